"""LayerNorm epilogue forward kernels (``@triton.jit`` only); variants: the module docstring
of ``triton/layernorm_epilogue.py``; rules: ``configs/layernorm_epilogue.py``."""

from __future__ import annotations

import triton
import triton.language as tl

from fusedops.backends.triton.kernels.layernorm_epilogue import (
    RANDOM_ARGS,
    activate,
    dropout,
    load_sum,
    param_slice,
    philox_words,
    round_sum,
    slice_cols,
    tile_cols,
)
from fusedops.backends.triton.kernels.philox import element_keep, uint32_key


@triton.jit(do_not_specialize=RANDOM_ARGS)
def ln_epi_fwd_looped(
    x_ptr, r_ptr, w_ptr, b_ptr, out_ptr, s_ptr, mean_ptr, rstd_ptr,
    N, stride_x, stride_r, eps, scale, k0, k1, thresh,
    G: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    DROPOUT: tl.constexpr, ACT: tl.constexpr, STATS: tl.constexpr, RNE: tl.constexpr,
):
    # One program per row; chunks of G * 1024 columns as [4, 1, G, 256] tiles.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    s_row = s_ptr + row * N
    out_row = out_ptr + row * N
    q, g, i = tile_cols(4, G, 256)
    lanes = g * 1024 + q * 256 + i
    CHUNK: tl.constexpr = G * 1024
    # Pass 1: per-lane sums of s - k and (s - k)^2 about the lane's first element k (no
    # cancellation for rows far from zero), merged across lanes with Chan's formula.
    k = load_sum(x_row, r_row, s_row, lanes, lanes < N, HAS_RES, False, RNE)
    s1 = tl.zeros([4, 1, G, 256], tl.float32)
    s2 = tl.zeros([4, 1, G, 256], tl.float32)
    for start in range(0, N, CHUNK):
        c = start + lanes
        valid = c < N
        d = tl.where(valid, load_sum(x_row, r_row, s_row, c, valid, HAS_RES, True, RNE) - k, 0.0)
        s1 += d
        s2 += d * d
    cnt = ((N - lanes + CHUNK - 1) // CHUNK).to(tl.float32)  # elements per lane (0 past N)
    avg = k + s1 / tl.maximum(cnt, 1.0)
    m2 = tl.maximum(s2 - s1 * s1 / tl.maximum(cnt, 1.0), 0.0)
    # Combined about the row's first element (exact for constant rows).
    x0 = tl.sum(tl.where(lanes == 0, k, 0.0))
    mean = x0 + tl.sum(cnt * (avg - x0)) / N
    dev = tl.where(cnt > 0, avg - mean, 0.0)
    var = (tl.sum(m2) + tl.sum(cnt * dev * dev)) / N
    rstd = tl.where(var < float("inf"), 1.0 / tl.sqrt(var + eps), float("nan"))
    if STATS:
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)
    if HAS_RES:
        # Pass 2 reads s back: this program's stores must be visible to all its threads.
        tl.debug_barrier()
        src_row = s_row
    else:
        src_row = x_row
    if DROPOUT:
        key0 = uint32_key(k0)
        key1 = uint32_key(k1)
        thr = uint32_key(thresh)
    for start in range(0, N, CHUNK):
        c = start + lanes
        valid = c < N
        s = tl.load(src_row + c, mask=valid, other=0.0, eviction_policy="evict_first")
        y = (s.to(tl.float32) - mean) * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + c, mask=valid, other=0.0,
                            eviction_policy="evict_last").to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + c, mask=valid, other=0.0,
                            eviction_policy="evict_last").to(tl.float32)
        if DROPOUT:
            y = dropout(y, element_keep(row, start // 1024 + g, q, i, key0, key1, thr, 4), scale)
        y = activate(y, ACT)
        tl.store(out_row + c, y.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def fwd_slice_in(x_ptr, r_ptr, s_ptr, rows64, cols, mask, N, stride_x, stride_r,
                  HAS_RES: tl.constexpr, RNE: tl.constexpr):
    # One slice of s = x (+ residual, rounded to x's dtype and stored) in float32.
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        sv = round_sum(x, r, x_ptr.dtype.element_ty, RNE)
        tl.store(s_ptr + rows64[:, None] * N + cols[None, :], sv, mask=mask)
        return sv.to(tl.float32)
    else:
        return x.to(tl.float32)


@triton.jit
def fwd_slice_out(d, rstd, w, b, word, thr, scale, out_ptr, rows64, cols, mask, N,
                   HAS_W: tl.constexpr, HAS_B: tl.constexpr, DROPOUT: tl.constexpr,
                   ACT: tl.constexpr):
    # One slice of out = activation(dropout(d * rstd * w + b)), d = s - mean.
    y = d * rstd[:, None]
    if HAS_W:
        y = y * w
    if HAS_B:
        y = y + b
    if DROPOUT:
        y = tl.where(word >= thr, y * scale, 0.0)
    y = activate(y, ACT)
    tl.store(out_ptr + rows64[:, None] * N + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit(do_not_specialize=RANDOM_ARGS)
def ln_epi_fwd_2d(
    x_ptr, r_ptr, w_ptr, b_ptr, out_ptr, s_ptr, mean_ptr, rstd_ptr, M, N, stride_x, stride_r,
    eps, scale, k0, k1, thresh, num_tiles, num_progs,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, Q: tl.constexpr, HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, DROPOUT: tl.constexpr, ACT: tl.constexpr,
    STATS: tl.constexpr, RNE: tl.constexpr, STAGES: tl.constexpr,
):
    # Rows as Q slices of [ROWS, BLOCK // Q] (slice_cols): with dropout Q = 4 (2 or 1 for
    # blocks of 512 or up to 256), so each Philox call is made once and its four words serve
    # the four slices; without it Q = 1, the plain [ROWS, BLOCK] tile. STAGES: Triton's
    # software pipelining of the tile loop (None: its default, as a plain range).
    pid = tl.program_id(0)
    j = tl.arange(0, BLOCK // Q)
    c0 = slice_cols(j, 0, Q)
    w0 = param_slice(w_ptr, c0, N, HAS_W)
    b0 = param_slice(b_ptr, c0, N, HAS_B)
    if Q > 1:
        c1 = slice_cols(j, 1, Q)
        w1 = param_slice(w_ptr, c1, N, HAS_W)
        b1 = param_slice(b_ptr, c1, N, HAS_B)
    if Q > 2:
        c2 = slice_cols(j, 2, Q)
        c3 = slice_cols(j, 3, Q)
        w2 = param_slice(w_ptr, c2, N, HAS_W)
        b2 = param_slice(b_ptr, c2, N, HAS_B)
        w3 = param_slice(w_ptr, c3, N, HAS_W)
        b3 = param_slice(b_ptr, c3, N, HAS_B)
    if DROPOUT:
        thr = uint32_key(thresh)
    else:
        thr = 0
    for tile in tl.range(pid, num_tiles, num_progs, num_stages=STAGES):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        rows64 = rows.to(tl.int64)
        m0 = row_ok[:, None] & (c0 < N)[None, :]
        x0 = fwd_slice_in(x_ptr, r_ptr, s_ptr, rows64, c0, m0, N, stride_x, stride_r,
                           HAS_RES, RNE)
        tot = x0
        if Q > 1:
            m1 = row_ok[:, None] & (c1 < N)[None, :]
            x1 = fwd_slice_in(x_ptr, r_ptr, s_ptr, rows64, c1, m1, N, stride_x, stride_r,
                               HAS_RES, RNE)
            tot += x1
        if Q > 2:
            m2 = row_ok[:, None] & (c2 < N)[None, :]
            m3 = row_ok[:, None] & (c3 < N)[None, :]
            x2 = fwd_slice_in(x_ptr, r_ptr, s_ptr, rows64, c2, m2, N, stride_x, stride_r,
                               HAS_RES, RNE)
            x3 = fwd_slice_in(x_ptr, r_ptr, s_ptr, rows64, c3, m3, N, stride_x, stride_r,
                               HAS_RES, RNE)
            tot += x2 + x3
        mean = tl.sum(tot, axis=1) / N
        d0 = tl.where(m0, x0 - mean[:, None], 0.0)
        sq = d0 * d0
        if Q > 1:
            d1 = tl.where(m1, x1 - mean[:, None], 0.0)
            sq += d1 * d1
        if Q > 2:
            d2 = tl.where(m2, x2 - mean[:, None], 0.0)
            d3 = tl.where(m3, x3 - mean[:, None], 0.0)
            sq += d2 * d2 + d3 * d3
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / N + eps)
        if DROPOUT:
            r0, r1, r2, r3 = philox_words(rows, j, k0, k1)
        else:
            r0, r1, r2, r3 = 0, 0, 0, 0
        fwd_slice_out(d0, rstd, w0, b0, r0, thr, scale, out_ptr, rows64, c0, m0, N,
                       HAS_W, HAS_B, DROPOUT, ACT)
        if Q > 1:
            fwd_slice_out(d1, rstd, w1, b1, r1, thr, scale, out_ptr, rows64, c1, m1, N,
                           HAS_W, HAS_B, DROPOUT, ACT)
        if Q > 2:
            fwd_slice_out(d2, rstd, w2, b2, r2, thr, scale, out_ptr, rows64, c2, m2, N,
                           HAS_W, HAS_B, DROPOUT, ACT)
            fwd_slice_out(d3, rstd, w3, b3, r3, thr, scale, out_ptr, rows64, c3, m3, N,
                           HAS_W, HAS_B, DROPOUT, ACT)
        if STATS:
            tl.store(mean_ptr + rows, mean, mask=row_ok)
            tl.store(rstd_ptr + rows, rstd, mask=row_ok)
