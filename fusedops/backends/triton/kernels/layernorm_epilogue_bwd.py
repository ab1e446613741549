"""LayerNorm epilogue backward kernels (``@triton.jit`` only); variants: the module docstring
of ``triton/layernorm_epilogue.py``; rules: ``configs/layernorm_epilogue.py``."""

from __future__ import annotations

import triton
import triton.language as tl

from fusedops.backends.triton.kernels.layernorm_bwd import row_sums
from fusedops.backends.triton.kernels.layernorm_epilogue import (
    RANDOM_ARGS,
    acc_zeros,
    accumulate,
    activation_grad,
    grad_at_norm,
    param_slice,
    philox_words,
    random_keys,
    slice_cols,
    store_partial,
    tile_cols,
)
from fusedops.backends.triton.kernels.philox import uint32_key


@triton.jit(do_not_specialize=RANDOM_ARGS)
def ln_epi_bwd_row_sums(
    dout_ptr, s_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, sums_ptr,
    N, stride_dout, stride_s, scale, k0, k1, thresh,
    G: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, DROPOUT: tl.constexpr,
    ACT: tl.constexpr,
):
    # Long rows, pass 1: sums_ptr[2 * row + (0, 1)] = mean(xhat * w * gy), mean(w * gy) (the two
    # row sums of dx), one program per row, chunks of G * 1024 columns.
    row = tl.program_id(0).to(tl.int64)
    dout_row = dout_ptr + row * stride_dout
    s_row = s_ptr + row * stride_s
    q, g, i = tile_cols(4, G, 256)
    lanes = g * 1024 + q * 256 + i
    CHUNK: tl.constexpr = G * 1024
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    key0, key1, thr = random_keys(k0, k1, thresh, DROPOUT)
    acc1 = tl.zeros([4, 1, G, 256], tl.float32)
    acc2 = tl.zeros([4, 1, G, 256], tl.float32)
    for start in range(0, N, CHUNK):
        c = start + lanes
        valid = c < N
        dout = tl.load(dout_row + c, mask=valid, other=0.0).to(tl.float32)
        xhat = (tl.load(s_row + c, mask=valid, other=0.0).to(tl.float32) - mean) * rstd
        if HAS_W:
            w = tl.load(w_ptr + c, mask=valid, other=0.0, eviction_policy="evict_last")
            w = w.to(tl.float32)
        else:
            w = 0.0
        if HAS_B and ACT != 0:
            b = tl.load(b_ptr + c, mask=valid, other=0.0, eviction_policy="evict_last")
            b = b.to(tl.float32)
        else:
            b = 0.0
        gy = grad_at_norm(dout, xhat, w, b, row, start // 1024 + g, q, i, key0, key1, thr,
                           scale, 4, HAS_W, HAS_B, DROPOUT, ACT)
        wg = gy * w if HAS_W else gy
        acc1 += xhat * wg
        acc2 += wg
    tl.store(sums_ptr + 2 * row, tl.sum(acc1) / N)
    tl.store(sums_ptr + 2 * row + 1, tl.sum(acc2) / N)


@triton.jit(do_not_specialize=RANDOM_ARGS)
def ln_epi_bwd_columns(
    dout_ptr, ds_ptr, s_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, sums_ptr, dx_ptr, dw_ptr, db_ptr,
    M, N, stride_dout, stride_ds, stride_s, scale, k0, k1, thresh, rows_per_split,
    R: tl.constexpr, G: tl.constexpr,
    HAS_DS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, DROPOUT: tl.constexpr,
    ACT: tl.constexpr, NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
):
    # Long rows, pass 2: program (column block of G * 1024 columns, row split) writes dx of its
    # rows there (from the row sums of pass 1) and dw_ptr / db_ptr[split, cols], the float32
    # dweight / dbias partials of the split (with one split, the results themselves).
    block = tl.program_id(0)
    split = tl.program_id(1)
    q, g, i = tile_cols(4, G, 256)
    g = block * G + g
    cols = g * 1024 + q * 256 + i
    col_ok = cols < N
    key0, key1, thr = random_keys(k0, k1, thresh, DROPOUT)
    w = 0.0
    b = 0.0
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_B and ACT != 0:
        b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([4, R, G, 256], tl.float32)
    db_acc = tl.zeros([4, R, G, 256], tl.float32)
    row_start = split * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, M)
    for r0 in range(row_start, row_end, R):
        rows = r0 + tl.arange(0, R)
        row_ok = rows < row_end
        rows4 = rows.to(tl.int64)[None, :, None, None]
        mask = row_ok[None, :, None, None] & col_ok
        dout = tl.load(dout_ptr + rows4 * stride_dout + cols, mask=mask, other=0.0)
        s = tl.load(s_ptr + rows4 * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)[None, :, None, None]
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[None, :, None, None]
        xhat = (s - mean) * rstd
        gy = grad_at_norm(dout.to(tl.float32), xhat, w, b, rows4, g, q, i, key0, key1, thr,
                           scale, 4, HAS_W, HAS_B, DROPOUT, ACT)
        if NEED_DX:
            c1 = tl.load(sums_ptr + 2 * rows, mask=row_ok, other=0.0)[None, :, None, None]
            c2 = tl.load(sums_ptr + 2 * rows + 1, mask=row_ok, other=0.0)[None, :, None, None]
            wg = gy * w if HAS_W else gy
            dx = (wg - (xhat * c1 + c2)) * rstd
            if HAS_DS:
                ds = tl.load(ds_ptr + rows4 * stride_ds + cols, mask=mask, other=0.0)
                dx = dx + ds.to(tl.float32)
            tl.store(dx_ptr + rows4 * N + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if NEED_DW:
            dw_acc += gy * xhat
        if NEED_DB:
            db_acc += gy
    part = split.to(tl.int64) * N + cols
    if NEED_DW:
        tl.store(dw_ptr + part, tl.sum(dw_acc, axis=1, keep_dims=True), mask=col_ok)
    if NEED_DB:
        tl.store(db_ptr + part, tl.sum(db_acc, axis=1, keep_dims=True), mask=col_ok)


@triton.jit
def bwd_slice_grad(dout_ptr, s_ptr, rows64, cols, mask, mean, rstd, w, b, word, thr, scale,
                    stride_do, stride_s, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                    DROPOUT: tl.constexpr, ACT: tl.constexpr):
    # One slice: (xhat, gy, w * gy), gy = dout * act'(v) * keep / (1 - p) the gradient at the
    # LayerNorm's output, v = dropout(xhat * w + b) recomputed (only an activation needs it).
    sx = tl.load(s_ptr + rows64[:, None] * stride_s + cols[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    g = tl.load(dout_ptr + rows64[:, None] * stride_do + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    xhat = tl.where(mask, (sx - mean[:, None]) * rstd[:, None], 0.0)
    if ACT != 0:
        v = xhat
        if HAS_W:
            v = v * w
        if HAS_B:
            v = v + b
        if DROPOUT:
            v = tl.where(word >= thr, v * scale, 0.0)
        g = g * activation_grad(v, ACT)
    if DROPOUT:
        g = tl.where(word >= thr, g * scale, 0.0)
    if HAS_W:
        wg = g * w
    else:
        wg = g
    return xhat, g, wg


@triton.jit
def bwd_slice_dx(xhat, wg, c1, c2, rstd, ds_ptr, dx_ptr, rows64, cols, mask, N, stride_ds,
                  HAS_DS: tl.constexpr):
    dx = (wg - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
    if HAS_DS:
        dx += tl.load(ds_ptr + rows64[:, None] * stride_ds + cols[None, :], mask=mask,
                      other=0.0).to(tl.float32)
    tl.store(dx_ptr + rows64[:, None] * N + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=mask)


@triton.jit(do_not_specialize=RANDOM_ARGS)
def ln_epi_bwd_2d(
    dout_ptr, ds_ptr, s_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, M, N,
    stride_do, stride_ds, stride_s, scale, k0, k1, thresh, num_tiles, num_progs,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, Q: tl.constexpr, HAS_DS: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, DROPOUT: tl.constexpr, ACT: tl.constexpr,
    NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, ACC_1D: tl.constexpr,
    PAIRED: tl.constexpr, STAGES: tl.constexpr,
):
    # A persistent grid over [ROWS, BLOCK] row tiles, held as Q slices as in ln_epi_fwd_2d
    # (one Philox call per counter with dropout). ACC_1D, PAIRED, STAGES as in LayerNorm's
    # ln_bwd_single: fold each tile's rows into the dweight/dbias accumulators at once, or keep
    # (ROWS, BLOCK) ones reduced once at the end (no cross-warp reduction per tile); the two
    # row sums of dx in one paired reduction; Triton's software pipelining of the tile loop.
    pid = tl.program_id(0)
    L: tl.constexpr = BLOCK // Q
    j = tl.arange(0, L)
    c0 = slice_cols(j, 0, Q)
    w0 = param_slice(w_ptr, c0, N, HAS_W)
    b0 = param_slice(b_ptr, c0, N, HAS_B and ACT != 0)
    dw0 = acc_zeros(ROWS, L, ACC_1D)
    db0 = acc_zeros(ROWS, L, ACC_1D)
    if Q > 1:
        c1 = slice_cols(j, 1, Q)
        w1 = param_slice(w_ptr, c1, N, HAS_W)
        b1 = param_slice(b_ptr, c1, N, HAS_B and ACT != 0)
        dw1 = acc_zeros(ROWS, L, ACC_1D)
        db1 = acc_zeros(ROWS, L, ACC_1D)
    if Q > 2:
        c2 = slice_cols(j, 2, Q)
        c3 = slice_cols(j, 3, Q)
        w2 = param_slice(w_ptr, c2, N, HAS_W)
        b2 = param_slice(b_ptr, c2, N, HAS_B and ACT != 0)
        w3 = param_slice(w_ptr, c3, N, HAS_W)
        b3 = param_slice(b_ptr, c3, N, HAS_B and ACT != 0)
        dw2 = acc_zeros(ROWS, L, ACC_1D)
        db2 = acc_zeros(ROWS, L, ACC_1D)
        dw3 = acc_zeros(ROWS, L, ACC_1D)
        db3 = acc_zeros(ROWS, L, ACC_1D)
    if DROPOUT:
        thr = uint32_key(thresh)
    else:
        thr = 0
    for tile in tl.range(pid, num_tiles, num_progs, num_stages=STAGES):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        rows64 = rows.to(tl.int64)
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        if DROPOUT:
            r0, r1, r2, r3 = philox_words(rows, j, k0, k1)
        else:
            r0, r1, r2, r3 = 0, 0, 0, 0
        m0 = row_ok[:, None] & (c0 < N)[None, :]
        xh0, g0, wg0 = bwd_slice_grad(dout_ptr, s_ptr, rows64, c0, m0, mean, rstd, w0, b0, r0,
                                       thr, scale, stride_do, stride_s, HAS_W, HAS_B, DROPOUT,
                                       ACT)
        t1 = xh0 * wg0
        t2 = wg0
        if Q > 1:
            m1 = row_ok[:, None] & (c1 < N)[None, :]
            xh1, g1, wg1 = bwd_slice_grad(dout_ptr, s_ptr, rows64, c1, m1, mean, rstd, w1, b1,
                                           r1, thr, scale, stride_do, stride_s, HAS_W, HAS_B,
                                           DROPOUT, ACT)
            t1 += xh1 * wg1
            t2 += wg1
        if Q > 2:
            m2 = row_ok[:, None] & (c2 < N)[None, :]
            m3 = row_ok[:, None] & (c3 < N)[None, :]
            xh2, g2, wg2 = bwd_slice_grad(dout_ptr, s_ptr, rows64, c2, m2, mean, rstd, w2, b2,
                                           r2, thr, scale, stride_do, stride_s, HAS_W, HAS_B,
                                           DROPOUT, ACT)
            xh3, g3, wg3 = bwd_slice_grad(dout_ptr, s_ptr, rows64, c3, m3, mean, rstd, w3, b3,
                                           r3, thr, scale, stride_do, stride_s, HAS_W, HAS_B,
                                           DROPOUT, ACT)
            t1 += xh2 * wg2 + xh3 * wg3
            t2 += wg2 + wg3
        if NEED_DX:
            c1s, c2s = row_sums(t1, t2, 1, PAIRED)
            c1s = c1s / N
            c2s = c2s / N
            bwd_slice_dx(xh0, wg0, c1s, c2s, rstd, ds_ptr, dx_ptr, rows64, c0, m0, N,
                          stride_ds, HAS_DS)
            if Q > 1:
                bwd_slice_dx(xh1, wg1, c1s, c2s, rstd, ds_ptr, dx_ptr, rows64, c1, m1, N,
                              stride_ds, HAS_DS)
            if Q > 2:
                bwd_slice_dx(xh2, wg2, c1s, c2s, rstd, ds_ptr, dx_ptr, rows64, c2, m2, N,
                              stride_ds, HAS_DS)
                bwd_slice_dx(xh3, wg3, c1s, c2s, rstd, ds_ptr, dx_ptr, rows64, c3, m3, N,
                              stride_ds, HAS_DS)
        if NEED_DW:
            dw0 = accumulate(dw0, g0 * xh0, ACC_1D)
            if Q > 1:
                dw1 = accumulate(dw1, g1 * xh1, ACC_1D)
            if Q > 2:
                dw2 = accumulate(dw2, g2 * xh2, ACC_1D)
                dw3 = accumulate(dw3, g3 * xh3, ACC_1D)
        if NEED_DB:
            db0 = accumulate(db0, g0, ACC_1D)
            if Q > 1:
                db1 = accumulate(db1, g1, ACC_1D)
            if Q > 2:
                db2 = accumulate(db2, g2, ACC_1D)
                db3 = accumulate(db3, g3, ACC_1D)
    dw_row = dw_ptr + pid.to(tl.int64) * N
    db_row = db_ptr + pid.to(tl.int64) * N
    if NEED_DW:
        store_partial(dw_row, dw0, c0, N, ACC_1D)
        if Q > 1:
            store_partial(dw_row, dw1, c1, N, ACC_1D)
        if Q > 2:
            store_partial(dw_row, dw2, c2, N, ACC_1D)
            store_partial(dw_row, dw3, c3, N, ACC_1D)
    if NEED_DB:
        store_partial(db_row, db0, c0, N, ACC_1D)
        if Q > 1:
            store_partial(db_row, db1, c1, N, ACC_1D)
        if Q > 2:
            store_partial(db_row, db2, c2, N, ACC_1D)
            store_partial(db_row, db3, c3, N, ACC_1D)
