"""Triton LayerNorm with fused epilogues: ``out = activation(dropout(layer_norm(x + residual)))``.

The row contract of ``fusedops.backends.reference.layernorm_epilogue_forward`` / ``_backward`` (same
arguments, same results). Bytes moved: the forward reads x (and residual) once and writes out
(and s = x + residual) once; the backward reads dout and s (and ds) once and writes dx once, plus
float32 per-program dweight/dbias partials summed in a fixed order (``reduce_partials``).
The dropout mask is never stored: the backward regenerates it from the seed.

Kernels (``dropout_p == 0``, no activation, no residual, no weight / bias, no statistics are
constexpr specialisations: the plain paths carry none of the dropout or activation code):

* Forward, single-block (padded rows up to 16K, see ``_fwd_cap``): ``ROWS`` whole rows per
  program as a [ROWS, BLOCK] tile in registers (about ``FWD_TILE`` elements, half that with
  dropout), one read and one write. With dropout the tile is held as Q column slices
  (``_slice_cols``: slice q holds the columns that take Philox word q), so each Philox call
  serves four elements; without it Q = 1, the plain tile.
* Forward, looped (longer rows): one program per row; pass 1 streams the row in chunks of
  ``LOOPED_GROUPS`` x 1024 columns (writing s), keeping per-lane shifted sums merged with Chan's
  formula; pass 2 reads s (or x) again, from L2, and writes out. Its columns are a
  ``[Q, R, G, NI]`` tile (``col = g * 1024 + q * 256 + i``,
  ``fusedops.backends.triton.runtime.philox``)
  so each
  Philox counter is computed once for its four 256-column slices.
* Backward, single-block (padded rows up to 4K-8K, ``_bwd_cap``): a persistent grid whose
  programs loop over [ROWS, BLOCK] row tiles (Q slices with dropout), write dx and accumulate
  dweight/dbias in float32 registers: one partial row each (with one program, the result
  itself). Plans from ``_bwd_plan``: LayerNorm's measured ones without dropout or activation.
* Backward, longer rows: a row kernel computes the two row sums of dx (one program per row,
  chunks of ``LOOPED_GROUPS`` x 1024 columns), then a column-blocked kernel (1024 columns by a
  split of the rows per program) reads the rows again, writes dx and keeps float32 dweight/dbias
  partials per row split. dout and s are read twice there (five passes of M·N elements in all,
  against three).

Host path: calls of a signature seen before replay their recorded launches (``PLANS``, with
the new call's seed words), and the forward also takes contiguous rows of any rank (the ops
layer's ``EPILOGUE_ROWS_ND``); see docs/design.md, "Epilogue and masked-softmax replay plans".

The single-block kernels first held rows as ``[Q, R, G, NI]`` column tiles too (one Philox call
per counter); those measured 0.07-0.4 of copy bandwidth on an H200 even without dropout (up
to 255 registers and spills with Triton 3.6) and were replaced by the 2-D tiles. The forward's
tiles follow the other norm kernels' rules; the backward's plans were measured on an H200 by
timing the backend functions alone under each plan (``BWD_PLAN_OVERRIDE``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedops import _philox, _replay
from fusedops.backends.triton.configs import layernorm as ln_rules
from fusedops.backends.triton.configs.common import grid_size, single_block_limit
from fusedops.backends.triton.kernels.layernorm_bwd import over_rows, row_sums
from fusedops.backends.triton.kernels.philox import element_keep, philox4x32, uint32_key
from fusedops.backends.triton.runtime.device import cdiv, next_pow2, num_sms
from fusedops.backends.triton.runtime.launcher import Launcher, hooks_registered
from fusedops.backends.triton.runtime.partials import reduce_partials
from fusedops.backends.triton.runtime.plans import (
    SequencePlans,
    param_ptr,
    replay_runner,
    tensor_key,
)
from fusedops.backends.triton.runtime.recording import mark_replayable, record_launches

ACTIVATIONS = {None: 0, "relu": 1, "gelu": 2}

# The dropout arguments (key words, threshold) change from call to call: they are passed as
# int32 bit patterns and never specialised on, so a new seed never compiles a new kernel.
_RANDOM_ARGS = ["k0", "k1", "thresh"]


@triton.jit
def _activate(y, ACT: tl.constexpr):
    # ACT: 0 none, 1 ReLU (NaN stays NaN, as torch.relu), 2 exact (erf) GELU.
    if ACT == 1:
        y = tl.where(y < 0.0, 0.0, y)
    elif ACT == 2:
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    return y


@triton.jit
def _activation_grad(v, ACT: tl.constexpr):
    # d activation / dv (ACT 1 or 2), as fusedops.backends.reference._activation_grad.
    if ACT == 1:
        d = tl.where(v > 0.0, 1.0, 0.0)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(v * 0.7071067811865476))
        d = cdf + v * (tl.exp(-0.5 * v * v) * 0.3989422804014327)
    return d


@triton.jit
def _row_sum(v):
    # [Q, R, G, NI] -> [R]: the slices first (held by one thread: plain adds), then the columns.
    return tl.sum(tl.sum(tl.sum(v, axis=0), axis=2), axis=1)


@triton.jit
def _tile_cols(Q: tl.constexpr, G: tl.constexpr, NI: tl.constexpr):
    q = tl.arange(0, Q)[:, None, None, None]
    g = tl.arange(0, G)[None, None, :, None]
    i = tl.arange(0, NI)[None, None, None, :]
    return q, g, i


@triton.jit
def _dropout(v, keep, scale):
    # v * scale where kept, v * 0 where dropped (NaN and inf stay NaN there, as torch's
    # x * mask * scale). A select on the mask rather than a product with a factor tensor: where
    # the mask is computed in another layout than v, the compiler converts the mask.
    return tl.where(keep, v * scale, v * 0.0)


@triton.jit
def _round_sum(x, r, dtype, RNE: tl.constexpr):
    # x + r in float32, rounded once to x's dtype as torch's add. RNE: round bfloat16 to nearest
    # even by hand, for Triton's interpreter, whose float32 -> bfloat16 conversion truncates
    # (compiled kernels convert correctly and skip this).
    v = x.to(tl.float32) + r.to(tl.float32)
    if RNE:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _load_sum(x_row, r_row, s_row, c, valid, HAS_RES: tl.constexpr, STORE: tl.constexpr,
              RNE: tl.constexpr = False):
    # One chunk of s = x (+ residual, rounded to x's dtype) in float32; STORE writes s.
    x = tl.load(x_row + c, mask=valid, other=0.0, eviction_policy="evict_last")
    if HAS_RES:
        r = tl.load(r_row + c, mask=valid, other=0.0, eviction_policy="evict_first")
        s_lp = _round_sum(x, r, x_row.dtype.element_ty, RNE)
        if STORE:
            tl.store(s_row + c, s_lp, mask=valid)
        s = s_lp.to(tl.float32)
    else:
        s = x.to(tl.float32)
    return s


@triton.jit(do_not_specialize=_RANDOM_ARGS)
def _ln_epi_fwd_looped(
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
    q, g, i = _tile_cols(4, G, 256)
    lanes = g * 1024 + q * 256 + i
    CHUNK: tl.constexpr = G * 1024
    # Pass 1: per-lane sums of s - k and (s - k)^2 about the lane's first element k (no
    # cancellation for rows far from zero), merged across lanes with Chan's formula.
    k = _load_sum(x_row, r_row, s_row, lanes, lanes < N, HAS_RES, False, RNE)
    s1 = tl.zeros([4, 1, G, 256], tl.float32)
    s2 = tl.zeros([4, 1, G, 256], tl.float32)
    for start in range(0, N, CHUNK):
        c = start + lanes
        valid = c < N
        d = tl.where(valid, _load_sum(x_row, r_row, s_row, c, valid, HAS_RES, True, RNE) - k, 0.0)
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
            y = _dropout(y, element_keep(row, start // 1024 + g, q, i, key0, key1, thr, 4), scale)
        y = _activate(y, ACT)
        tl.store(out_row + c, y.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _random_keys(k0, k1, thresh, DROPOUT: tl.constexpr):
    # The Philox key words and keep threshold as uint32 scalars (zeros without dropout).
    if DROPOUT:
        return uint32_key(k0), uint32_key(k1), uint32_key(thresh)
    else:
        return 0, 0, 0


@triton.jit
def _grad_at_norm(dout, xhat, w, b, rows, g, q, i, key0, key1, thr, scale,
                  Q: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                  DROPOUT: tl.constexpr, ACT: tl.constexpr):
    # The gradient reaching the LayerNorm's output y: dout * act'(dropout(y)) * keep / (1 - p),
    # with y = xhat * w + b recomputed (only an activation needs it).
    if DROPOUT:
        keep = element_keep(rows, g, q, i, key0, key1, thr, Q)
    gy = dout
    if ACT != 0:
        v = xhat
        if HAS_W:
            v = v * w
        if HAS_B:
            v = v + b
        if DROPOUT:
            v = _dropout(v, keep, scale)
        gy = gy * _activation_grad(v, ACT)
    if DROPOUT:
        gy = _dropout(gy, keep, scale)
    return gy


@triton.jit(do_not_specialize=_RANDOM_ARGS)
def _ln_epi_bwd_row_sums(
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
    q, g, i = _tile_cols(4, G, 256)
    lanes = g * 1024 + q * 256 + i
    CHUNK: tl.constexpr = G * 1024
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    key0, key1, thr = _random_keys(k0, k1, thresh, DROPOUT)
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
        gy = _grad_at_norm(dout, xhat, w, b, row, start // 1024 + g, q, i, key0, key1, thr,
                           scale, 4, HAS_W, HAS_B, DROPOUT, ACT)
        wg = gy * w if HAS_W else gy
        acc1 += xhat * wg
        acc2 += wg
    tl.store(sums_ptr + 2 * row, tl.sum(acc1) / N)
    tl.store(sums_ptr + 2 * row + 1, tl.sum(acc2) / N)


@triton.jit(do_not_specialize=_RANDOM_ARGS)
def _ln_epi_bwd_columns(
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
    q, g, i = _tile_cols(4, G, 256)
    g = block * G + g
    cols = g * 1024 + q * 256 + i
    col_ok = cols < N
    key0, key1, thr = _random_keys(k0, k1, thresh, DROPOUT)
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
        gy = _grad_at_norm(dout.to(tl.float32), xhat, w, b, rows4, g, q, i, key0, key1, thr,
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


# --- 2-D row tiles (the single-block paths) ----------------------------------------------------
# The [Q, R, G, NI] column tiles above compute each Philox counter once, but their multi-axis
# layouts measured 0.07-0.4 of copy bandwidth on an H200 (also without dropout). These kernels
# hold rows as plain [ROWS, BLOCK] tiles, as the other norm kernels do, and compute Philox per
# element (each counter four times): more integer work, full-speed loads and stores.


@triton.jit
def _slice_cols(j, q: tl.constexpr, Q: tl.constexpr):
    # Column of lane j in slice q of a row block cut into Q slices along fusedops._philox's
    # layout: slice q holds the columns that take Philox word q (col // 256 % 4 == q), so lane
    # j of every slice is served by the one call with counter j (with Q == 1, word 0 serves a
    # block of at most 256 columns, and without dropout the slice is the plain block).
    if Q == 1:
        return j
    else:
        return (j // 256) * 1024 + q * 256 + (j % 256)


@triton.jit
def _philox_words(rows, j, k0, k1):
    # The four words of the calls with counters (j, row lo, row hi, 0): [ROWS, L] each.
    r64 = rows.to(tl.int64)
    c0 = j.to(tl.uint32)[None, :]
    c1 = (r64 & 0xFFFFFFFF).to(tl.uint32)[:, None]
    c2 = (r64 >> 32).to(tl.uint32)[:, None]
    zero = tl.zeros_like(c0 + c1)
    return philox4x32(c0 + zero, c1 + zero, c2 + zero, zero, uint32_key(k0), uint32_key(k1))


@triton.jit
def _fwd_slice_in(x_ptr, r_ptr, s_ptr, rows64, cols, mask, N, stride_x, stride_r,
                  HAS_RES: tl.constexpr, RNE: tl.constexpr):
    # One slice of s = x (+ residual, rounded to x's dtype and stored) in float32.
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        sv = _round_sum(x, r, x_ptr.dtype.element_ty, RNE)
        tl.store(s_ptr + rows64[:, None] * N + cols[None, :], sv, mask=mask)
        return sv.to(tl.float32)
    else:
        return x.to(tl.float32)


@triton.jit
def _fwd_slice_out(d, rstd, w, b, word, thr, scale, out_ptr, rows64, cols, mask, N,
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
    y = _activate(y, ACT)
    tl.store(out_ptr + rows64[:, None] * N + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _param_slice(ptr, cols, N, HAS: tl.constexpr):
    if HAS:
        return tl.load(ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    else:
        return 0.0


@triton.jit(do_not_specialize=_RANDOM_ARGS)
def _ln_epi_fwd_2d(
    x_ptr, r_ptr, w_ptr, b_ptr, out_ptr, s_ptr, mean_ptr, rstd_ptr, M, N, stride_x, stride_r,
    eps, scale, k0, k1, thresh, num_tiles, num_progs,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, Q: tl.constexpr, HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, DROPOUT: tl.constexpr, ACT: tl.constexpr,
    STATS: tl.constexpr, RNE: tl.constexpr, STAGES: tl.constexpr,
):
    # Rows as Q slices of [ROWS, BLOCK // Q] (_slice_cols): with dropout Q = 4 (2 or 1 for
    # blocks of 512 or up to 256), so each Philox call is made once and its four words serve
    # the four slices; without it Q = 1, the plain [ROWS, BLOCK] tile. STAGES: Triton's
    # software pipelining of the tile loop (None: its default, as a plain range).
    pid = tl.program_id(0)
    j = tl.arange(0, BLOCK // Q)
    c0 = _slice_cols(j, 0, Q)
    w0 = _param_slice(w_ptr, c0, N, HAS_W)
    b0 = _param_slice(b_ptr, c0, N, HAS_B)
    if Q > 1:
        c1 = _slice_cols(j, 1, Q)
        w1 = _param_slice(w_ptr, c1, N, HAS_W)
        b1 = _param_slice(b_ptr, c1, N, HAS_B)
    if Q > 2:
        c2 = _slice_cols(j, 2, Q)
        c3 = _slice_cols(j, 3, Q)
        w2 = _param_slice(w_ptr, c2, N, HAS_W)
        b2 = _param_slice(b_ptr, c2, N, HAS_B)
        w3 = _param_slice(w_ptr, c3, N, HAS_W)
        b3 = _param_slice(b_ptr, c3, N, HAS_B)
    if DROPOUT:
        thr = uint32_key(thresh)
    else:
        thr = 0
    for tile in tl.range(pid, num_tiles, num_progs, num_stages=STAGES):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        rows64 = rows.to(tl.int64)
        m0 = row_ok[:, None] & (c0 < N)[None, :]
        x0 = _fwd_slice_in(x_ptr, r_ptr, s_ptr, rows64, c0, m0, N, stride_x, stride_r,
                           HAS_RES, RNE)
        tot = x0
        if Q > 1:
            m1 = row_ok[:, None] & (c1 < N)[None, :]
            x1 = _fwd_slice_in(x_ptr, r_ptr, s_ptr, rows64, c1, m1, N, stride_x, stride_r,
                               HAS_RES, RNE)
            tot += x1
        if Q > 2:
            m2 = row_ok[:, None] & (c2 < N)[None, :]
            m3 = row_ok[:, None] & (c3 < N)[None, :]
            x2 = _fwd_slice_in(x_ptr, r_ptr, s_ptr, rows64, c2, m2, N, stride_x, stride_r,
                               HAS_RES, RNE)
            x3 = _fwd_slice_in(x_ptr, r_ptr, s_ptr, rows64, c3, m3, N, stride_x, stride_r,
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
            r0, r1, r2, r3 = _philox_words(rows, j, k0, k1)
        else:
            r0, r1, r2, r3 = 0, 0, 0, 0
        _fwd_slice_out(d0, rstd, w0, b0, r0, thr, scale, out_ptr, rows64, c0, m0, N,
                       HAS_W, HAS_B, DROPOUT, ACT)
        if Q > 1:
            _fwd_slice_out(d1, rstd, w1, b1, r1, thr, scale, out_ptr, rows64, c1, m1, N,
                           HAS_W, HAS_B, DROPOUT, ACT)
        if Q > 2:
            _fwd_slice_out(d2, rstd, w2, b2, r2, thr, scale, out_ptr, rows64, c2, m2, N,
                           HAS_W, HAS_B, DROPOUT, ACT)
            _fwd_slice_out(d3, rstd, w3, b3, r3, thr, scale, out_ptr, rows64, c3, m3, N,
                           HAS_W, HAS_B, DROPOUT, ACT)
        if STATS:
            tl.store(mean_ptr + rows, mean, mask=row_ok)
            tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _bwd_slice_grad(dout_ptr, s_ptr, rows64, cols, mask, mean, rstd, w, b, word, thr, scale,
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
        g = g * _activation_grad(v, ACT)
    if DROPOUT:
        g = tl.where(word >= thr, g * scale, 0.0)
    if HAS_W:
        wg = g * w
    else:
        wg = g
    return xhat, g, wg


@triton.jit
def _bwd_slice_dx(xhat, wg, c1, c2, rstd, ds_ptr, dx_ptr, rows64, cols, mask, N, stride_ds,
                  HAS_DS: tl.constexpr):
    dx = (wg - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
    if HAS_DS:
        dx += tl.load(ds_ptr + rows64[:, None] * stride_ds + cols[None, :], mask=mask,
                      other=0.0).to(tl.float32)
    tl.store(dx_ptr + rows64[:, None] * N + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _accumulate(acc, v, ACC_1D: tl.constexpr):
    if ACC_1D:
        return acc + tl.sum(v, axis=0)
    else:
        return acc + v


@triton.jit
def _acc_zeros(ROWS: tl.constexpr, L: tl.constexpr, ACC_1D: tl.constexpr):
    if ACC_1D:
        return tl.zeros([L], tl.float32)
    else:
        return tl.zeros([ROWS, L], tl.float32)


@triton.jit
def _store_partial(ptr, acc, cols, N, ACC_1D: tl.constexpr):
    tl.store(ptr + cols, over_rows(acc, ACC_1D), mask=cols < N)


@triton.jit(do_not_specialize=_RANDOM_ARGS)
def _ln_epi_bwd_2d(
    dout_ptr, ds_ptr, s_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, M, N,
    stride_do, stride_ds, stride_s, scale, k0, k1, thresh, num_tiles, num_progs,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, Q: tl.constexpr, HAS_DS: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, DROPOUT: tl.constexpr, ACT: tl.constexpr,
    NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, ACC_1D: tl.constexpr,
    PAIRED: tl.constexpr, STAGES: tl.constexpr,
):
    # A persistent grid over [ROWS, BLOCK] row tiles, held as Q slices as in _ln_epi_fwd_2d
    # (one Philox call per counter with dropout). ACC_1D, PAIRED, STAGES as in LayerNorm's
    # ln_bwd_single: fold each tile's rows into the dweight/dbias accumulators at once, or keep
    # (ROWS, BLOCK) ones reduced once at the end (no cross-warp reduction per tile); the two
    # row sums of dx in one paired reduction; Triton's software pipelining of the tile loop.
    pid = tl.program_id(0)
    L: tl.constexpr = BLOCK // Q
    j = tl.arange(0, L)
    c0 = _slice_cols(j, 0, Q)
    w0 = _param_slice(w_ptr, c0, N, HAS_W)
    b0 = _param_slice(b_ptr, c0, N, HAS_B and ACT != 0)
    dw0 = _acc_zeros(ROWS, L, ACC_1D)
    db0 = _acc_zeros(ROWS, L, ACC_1D)
    if Q > 1:
        c1 = _slice_cols(j, 1, Q)
        w1 = _param_slice(w_ptr, c1, N, HAS_W)
        b1 = _param_slice(b_ptr, c1, N, HAS_B and ACT != 0)
        dw1 = _acc_zeros(ROWS, L, ACC_1D)
        db1 = _acc_zeros(ROWS, L, ACC_1D)
    if Q > 2:
        c2 = _slice_cols(j, 2, Q)
        c3 = _slice_cols(j, 3, Q)
        w2 = _param_slice(w_ptr, c2, N, HAS_W)
        b2 = _param_slice(b_ptr, c2, N, HAS_B and ACT != 0)
        w3 = _param_slice(w_ptr, c3, N, HAS_W)
        b3 = _param_slice(b_ptr, c3, N, HAS_B and ACT != 0)
        dw2 = _acc_zeros(ROWS, L, ACC_1D)
        db2 = _acc_zeros(ROWS, L, ACC_1D)
        dw3 = _acc_zeros(ROWS, L, ACC_1D)
        db3 = _acc_zeros(ROWS, L, ACC_1D)
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
            r0, r1, r2, r3 = _philox_words(rows, j, k0, k1)
        else:
            r0, r1, r2, r3 = 0, 0, 0, 0
        m0 = row_ok[:, None] & (c0 < N)[None, :]
        xh0, g0, wg0 = _bwd_slice_grad(dout_ptr, s_ptr, rows64, c0, m0, mean, rstd, w0, b0, r0,
                                       thr, scale, stride_do, stride_s, HAS_W, HAS_B, DROPOUT,
                                       ACT)
        t1 = xh0 * wg0
        t2 = wg0
        if Q > 1:
            m1 = row_ok[:, None] & (c1 < N)[None, :]
            xh1, g1, wg1 = _bwd_slice_grad(dout_ptr, s_ptr, rows64, c1, m1, mean, rstd, w1, b1,
                                           r1, thr, scale, stride_do, stride_s, HAS_W, HAS_B,
                                           DROPOUT, ACT)
            t1 += xh1 * wg1
            t2 += wg1
        if Q > 2:
            m2 = row_ok[:, None] & (c2 < N)[None, :]
            m3 = row_ok[:, None] & (c3 < N)[None, :]
            xh2, g2, wg2 = _bwd_slice_grad(dout_ptr, s_ptr, rows64, c2, m2, mean, rstd, w2, b2,
                                           r2, thr, scale, stride_do, stride_s, HAS_W, HAS_B,
                                           DROPOUT, ACT)
            xh3, g3, wg3 = _bwd_slice_grad(dout_ptr, s_ptr, rows64, c3, m3, mean, rstd, w3, b3,
                                           r3, thr, scale, stride_do, stride_s, HAS_W, HAS_B,
                                           DROPOUT, ACT)
            t1 += xh2 * wg2 + xh3 * wg3
            t2 += wg2 + wg3
        if NEED_DX:
            c1s, c2s = row_sums(t1, t2, 1, PAIRED)
            c1s = c1s / N
            c2s = c2s / N
            _bwd_slice_dx(xh0, wg0, c1s, c2s, rstd, ds_ptr, dx_ptr, rows64, c0, m0, N,
                          stride_ds, HAS_DS)
            if Q > 1:
                _bwd_slice_dx(xh1, wg1, c1s, c2s, rstd, ds_ptr, dx_ptr, rows64, c1, m1, N,
                              stride_ds, HAS_DS)
            if Q > 2:
                _bwd_slice_dx(xh2, wg2, c1s, c2s, rstd, ds_ptr, dx_ptr, rows64, c2, m2, N,
                              stride_ds, HAS_DS)
                _bwd_slice_dx(xh3, wg3, c1s, c2s, rstd, ds_ptr, dx_ptr, rows64, c3, m3, N,
                              stride_ds, HAS_DS)
        if NEED_DW:
            dw0 = _accumulate(dw0, g0 * xh0, ACC_1D)
            if Q > 1:
                dw1 = _accumulate(dw1, g1 * xh1, ACC_1D)
            if Q > 2:
                dw2 = _accumulate(dw2, g2 * xh2, ACC_1D)
                dw3 = _accumulate(dw3, g3 * xh3, ACC_1D)
        if NEED_DB:
            db0 = _accumulate(db0, g0, ACC_1D)
            if Q > 1:
                db1 = _accumulate(db1, g1, ACC_1D)
            if Q > 2:
                db2 = _accumulate(db2, g2, ACC_1D)
                db3 = _accumulate(db3, g3, ACC_1D)
    dw_row = dw_ptr + pid.to(tl.int64) * N
    db_row = db_ptr + pid.to(tl.int64) * N
    if NEED_DW:
        _store_partial(dw_row, dw0, c0, N, ACC_1D)
        if Q > 1:
            _store_partial(dw_row, dw1, c1, N, ACC_1D)
        if Q > 2:
            _store_partial(dw_row, dw2, c2, N, ACC_1D)
            _store_partial(dw_row, dw3, c3, N, ACC_1D)
    if NEED_DB:
        _store_partial(db_row, db0, c0, N, ACC_1D)
        if Q > 1:
            _store_partial(db_row, db1, c1, N, ACC_1D)
        if Q > 2:
            _store_partial(db_row, db2, c2, N, ACC_1D)
            _store_partial(db_row, db3, c3, N, ACC_1D)


# No multiply-add contraction: the training and inference specialisations (statistics stored or
# not) then round alike, so a forward gives the same bits whether or not a backward follows.
_launch_fwd_2d = Launcher(_ln_epi_fwd_2d, fp_fusion=False)
_launch_bwd_2d = Launcher(_ln_epi_bwd_2d, fp_fusion=False)
_launch_fwd_looped = Launcher(_ln_epi_fwd_looped)
_launch_bwd_row_sums = Launcher(_ln_epi_bwd_row_sums)
_launch_bwd_columns = Launcher(_ln_epi_bwd_columns)

# Padded rows up to these many columns are held whole in registers; longer rows take the
# looped kernels. Forward: FWD_MAX_BLOCK, with dropout FWD_MAX_BLOCK_DROPOUT.
# Backward: BWD_MAX_BLOCK, with dropout or an activation BWD_MAX_BLOCK_EPILOGUE. Chosen so that
# no variant spills registers (ptxas for sm_90, Triton 3.6 and 3.9), except the 16-warp plans of
# the epilogue backward (_bwd_plan: GELU, or rows of 4K-8K), which are capped at 128 registers
# and keep 8-72 B of stack with Triton 3.6 (32-112 B with 3.9; ptxas for sm_90) yet run
# 1.3-1.8x faster than the plans without spills (H200: 8K-column rows 1.8x faster than the
# looped kernels, which they took before). All are also capped by the project's
# single-block limit (tests shrink it to exercise the looped kernels on short rows).
FWD_MAX_BLOCK = 16384
FWD_MAX_BLOCK_DROPOUT = 8192
BWD_MAX_BLOCK = 8192
BWD_MAX_BLOCK_EPILOGUE = 8192
# Elements per row tile of the single-block kernels (R rows of the padded row, up to MAX_ROWS).
FWD_TILE = 4096
BWD_TILE = 2048
MAX_ROWS = 128
# Elements of a tile per thread (forward, backward, looped kernels): with 16-byte vectors along
# the columns, 32 let a thread hold all four 256-column slices of its Philox counters (16-bit
# rows; float32 rows need 16). Fewer cost a shared-memory move of the packed keep bits (see the
# module docstring); more spill registers in the backward (its accumulators, weight and bias).
FWD_ELEMS_PER_THREAD = 32
BWD_ELEMS_PER_THREAD = 16
LOOPED_ELEMS_PER_THREAD = 16
# Backward single-block: programs per SM in the persistent grid (and so the number of float32
# partial rows to sum).
BWD_PER_SM = 2
# The looped kernels: 1024-column groups per chunk.
LOOPED_GROUPS = 4
# Long-row backward, column kernel: rows per iteration, programs per SM.
COLUMN_ROWS = 4
COLUMN_PER_SM = 2


def _warps(elements: int, per_thread: int) -> int:
    return max(1, min(16, elements // (32 * per_thread)))


def _tile_2d(block: int, elt: int, dropout: bool, backward: bool = False) -> tuple[int, int]:
    """(rows per tile, warps) of the 2-D kernels: tiles of about 4K elements (2K with dropout's
    per-element Philox, whose registers add up), 4-16 warps, as the other norm kernels."""
    tile = BWD_TILE if dropout else FWD_TILE
    rows = max(1, min(MAX_ROWS, tile // block))
    warps = max(4, min(16, rows * block // 512))
    return rows, warps


# (ROWS, warps, programs per SM, ACC_1D, PAIRED, STAGES) forced on the single-block backward,
# for experiments (timing the backend under other plans); None: _bwd_plan's rule.
BWD_PLAN_OVERRIDE: tuple | None = None
# (ROWS, warps, programs per SM or None for grid_size's rule, STAGES or None) forced on the
# single-block forward, for experiments; None: _fwd_plan's.
FWD_PLAN_OVERRIDE: tuple | None = None


def _fwd_plan(block: int, elt_size: int, dropout: bool, has_res: bool
              ) -> tuple[int, int, int | None, int | None]:
    """(ROWS, warps, programs per SM or None, STAGES or None) of the single-block forward:
    the 4K-element tiles (2K with dropout) of ``_tile_2d`` and ``grid_size``'s grid. With
    dropout the tile loop is software-pipelined where a residual is read too (its extra loads
    are what the pipelining hides; H200, bf16 inference, µs: add + LN + dropout + GELU 1K
    308 -> 265, 4K 318 -> 275; no spills with Triton 3.6 or 3.9; without a residual the plain
    loop was as fast or faster; 8K-column rows on 4 warps, pipelined, measured 222 -> 183
    but spill 184 B with Triton 3.6 and 568 B with 3.9, so not taken). Without dropout: a
    plain range, as measured before (0.75-0.95 of copy)."""
    if FWD_PLAN_OVERRIDE is not None:
        return FWD_PLAN_OVERRIDE
    rows, warps = _tile_2d(block, elt_size, dropout)
    if dropout and has_res:
        return rows, warps, None, 2
    return rows, warps, None, None


def _bwd_plan(block: int, elt_size: int, dropout: bool, act: int,
              strides: tuple[int, ...]) -> tuple[int, int, int, bool, bool, int]:
    """(ROWS, warps, programs per SM, ACC_1D, PAIRED, STAGES) of the single-block backward for
    padded rows of ``block`` elements. Without dropout or activation the kernel is LayerNorm's
    fused backward plus a read of ds, and takes its measured configuration
    (``layernorm.fused_bwd_config``, ``paired_sums``, ``fused_bwd_stages``). With them, the
    2K-element tiles of ``_tile_2d`` (Philox and the activation's registers), one reduction per
    tile, about 32 resident warps per SM."""
    if BWD_PLAN_OVERRIDE is not None:
        return BWD_PLAN_OVERRIDE
    if dropout or act:
        # (ROWS, BLOCK) accumulators and paired row sums: Q slices folded into 1-D accumulators
        # every tile cost 2·Q cross-warp reductions per tile (H200, bf16 65536 x 768, p = 0.1,
        # ReLU: 524 us; 322 with these). 8K-element tiles, two
        # programs per SM. Up to 2K columns without GELU on 8 warps (247 us at 768 ReLU;
        # 210-255 registers, no spills on sm_90 with Triton 3.6), software-pipelined where ds
        # is read too or rows are 2K (H200: bf16 2048 ReLU with ds 464 -> 323 us; 1K without
        # ds it is 4-15% slower). GELU's registers, and rows of 4K-8K, take 16 warps,
        # pipelined (H200, µs, bf16 with ds: GELU 1K 761 -> 441, 2K 762 -> 433, 4K
        # 771 -> 428, ReLU 4K 651 -> 305; the 2K-element tiles on 4-8 warps before).
        rows = max(1, 8192 // block)
        if act != 2 and block <= 2048:
            stages = 2 if block >= 1024 and (len(strides) > 2 or block == 2048) else 1
            return rows, 8, 2, False, True, stages
        if block >= 1024:
            return rows, 16, 2, False, True, 2
        rows, warps = _tile_2d(block, elt_size, dropout, backward=True)
        return rows, warps, max(BWD_PER_SM, 32 // warps), False, True, 1
    if block >= 8192:
        # One 8K row per tile on 16 warps, pipelined, paired sums (H200, with ds: fp32
        # 614 -> 510 us, bf16 393 -> 328 at 16384 x 8192; LayerNorm's plan below was level at
        # 4K).
        return 1, 16, 1, False, True, 2
    # ds's loads add registers: 16-bit rows of 4K+ columns take float32 rows' 8K-element tiles
    # (the 16K-element ones spill, ptxas sm_90 with Triton 3.6: 32 B at 4K, 104 B at 8K).
    rows, warps, per_sm, acc_1d = ln_rules.fused_bwd_config(block, False,
                                                         4 if block >= 4096 else elt_size)
    return (rows, warps, per_sm, acc_1d, ln_rules.paired_sums(elt_size, 0, block),
            ln_rules.fused_bwd_stages(block, elt_size, strides))


def _slices(block: int, dropout: bool) -> int:
    """Q of the single-block kernels (``_slice_cols``): with dropout, the Philox words a row
    block of ``block`` columns uses (4 from 1024 columns), so each call is made once."""
    return max(1, min(4, block // 256)) if dropout else 1


def _rne(x: torch.Tensor) -> bool:
    """Whether the kernels must round bfloat16 sums by hand (Triton's interpreter, CPU tensors)."""
    return x.dtype == torch.bfloat16 and not x.is_cuda


def _fwd_cap(dropout: bool) -> int:
    return min(FWD_MAX_BLOCK_DROPOUT if dropout else FWD_MAX_BLOCK, single_block_limit())


def _bwd_cap(dropout: bool, act: int) -> int:
    cap = BWD_MAX_BLOCK_EPILOGUE if dropout or act else BWD_MAX_BLOCK
    return min(cap, single_block_limit())


def _looped_groups() -> int:
    return max(1, min(LOOPED_GROUPS, single_block_limit() // 1024))


def _random_args(dropout_p: float, seed: int) -> tuple[bool, float, int, int, int]:
    """(dropout on, scale, key word 0, key word 1, threshold): the key words and threshold as
    int32 bit patterns (one kernel argument type whatever the seed)."""
    if dropout_p == 0.0:
        return False, 1.0, 0, 0, 0
    thr = _philox.dropout_threshold(dropout_p)  # raises for p outside [0, 1)
    k0, k1 = _seed_words(seed)
    thr = thr - (1 << 32) if thr >= 1 << 31 else thr
    return True, 1.0 / (1.0 - float(dropout_p)), k0, k1, thr


def _act_code(activation: str | None) -> int:
    try:
        return ACTIVATIONS[activation]
    except (KeyError, TypeError):
        raise ValueError(f"activation must be one of None, 'relu', 'gelu', got {activation!r}") \
            from None


def _check_rows(name: str, t: torch.Tensor | None, shape, dtype) -> None:
    # The kernels index rows by their stride and columns as contiguous.
    if t is None:
        return
    if t.shape != shape or t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} of shape {tuple(shape)}, got {t.dtype} "
                         f"{tuple(t.shape)}")
    if t.stride(1) != 1 and shape[1] > 1:
        raise ValueError(f"{name} must have unit column stride, got strides {t.stride()}")


def _check_contiguous_rows(x: torch.Tensor, residual: torch.Tensor | None) -> None:
    # The forward's rows of any rank other than 2: contiguous, rows along the last dim.
    if x.dim() < 1 or not x.is_contiguous():
        raise ValueError(f"x of shape {tuple(x.shape)} must be contiguous with rows along its "
                         "last dim, or 2-D")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or not residual.is_contiguous()):
        raise ValueError(f"residual must be a contiguous {x.dtype} tensor of x's shape "
                         f"{tuple(x.shape)}, got {residual.dtype} {tuple(residual.shape)}")


def _vector(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.is_contiguous() else t.contiguous()


# Replay plans (see _common.record_launches), per call signature: everything the launch rules
# read (shapes, strides, dtypes, 16-byte alignment of every pointer, the scalar arguments but
# the seed, the gradients needed, the device). A call seen before allocates its outputs and
# scratch and relaunches the recorded kernels with its own tensors' addresses and seed words:
# the backend's checks and plans cost 80-120 µs of host time per call on the GPU hosts
# measured (H200 machines), more than the kernels take on a few thousand rows.
# The backward makes plans only for calls that give grad_dtypes (the eager autograd path), as
# LayerNorm's does. PLANS = False turns them off (tests compare both paths).
PLANS = True
# Inference add + LayerNorm plans are also replayed from the ops layer (fusedops._replay); the
# runners go with the plans.
_fwd_plans = SequencePlans(_replay.LAYERNORM_RESIDUAL)
_bwd_plans = SequencePlans()


def _seed_words(seed: int) -> tuple[int, int]:
    """The Philox key of ``seed`` as two int32 bit patterns (the kernels' k0, k1)."""
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be a non-negative 64-bit integer, got {seed}")
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    return k0 - (1 << 32) if k0 >= 1 << 31 else k0, k1 - (1 << 32) if k1 >= 1 << 31 else k1


def _seed_position(launcher: Launcher) -> int | None:
    """Index of k0 in ``launcher``'s kernel arguments (k1 follows it), or None if it takes none."""
    names = list(getattr(launcher.kernel, "arg_names", ()))
    if "k0" not in names:
        return None
    i = names.index("k0")
    return i if names[i + 1:i + 2] == ["k1"] else -1


def layernorm_epilogue_forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
    dropout_p: float,
    seed: int,
    activation: str | None,
    need_stats: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``out = activation(dropout(layer_norm(x + residual)))`` over rows (the contract of
    ``fusedops.backends.reference.layernorm_epilogue_forward``).

    x, residual: (M, N) float32/float16/bfloat16, unit column stride, any row strides, the same
    dtype (residual may be None), or contiguous tensors of any other rank >= 1 (rows along the
    last dim; out and s then have x's shape); weight, bias: (N,) in any float dtype, or None.
    Returns ``(out, s, mean, rstd)``: out (M, N) contiguous of ``out_dtype``; s = x + residual
    rounded to x's dtype, (M, N) contiguous (None without residual); mean/rstd (M,) float32
    (None unless ``need_stats``). A call whose signature ran before is replayed. Dropout with
    ``dropout_p`` in [0, 1) (0: none) keeps an element when its Philox number for ``seed``
    (``fusedops._philox``) is >= the threshold and scales it by 1 / (1 - p); activation None,
    "relu" or "gelu" (exact).
    """
    key = (x.shape, x.stride(), x.dtype, x.data_ptr() & 15, tensor_key(residual),
           tensor_key(weight), tensor_key(bias), eps, out_dtype, dropout_p, activation,
           need_stats, x.get_device(), FWD_PLAN_OVERRIDE) if PLANS else None
    plan = _fwd_plans.get(key)
    if plan and not hooks_registered():
        if plan.ops is not None and plan.ops[0] not in _replay.LAYERNORM_RESIDUAL:
            _replay.LAYERNORM_RESIDUAL[plan.ops[0]] = plan.ops[1]  # (tables cleared since)
        return plan(x, residual, weight, bias, words=_seed_words(seed) if dropout_p else None)
    if plan is False or key is None:
        return _forward(x, residual, weight, bias, eps, out_dtype, dropout_p, seed, activation,
                        need_stats)
    with record_launches() as record:
        out = _forward(x, residual, weight, bias, eps, out_dtype, dropout_p, seed, activation,
                       need_stats)
    run = replay_runner(record, (x, residual, weight, bias), out, (),
                        _seed_position if dropout_p else None)
    if run is not None:
        run.ops = _ops_runner(run, x, residual, weight, bias, eps, out_dtype, dropout_p,
                              activation, need_stats)
        if run.ops is not None:
            _replay.LAYERNORM_RESIDUAL[run.ops[0]] = run.ops[1]
    _fwd_plans.put(key, run or False)
    return out


def _ops_runner(run, x, residual, weight, bias, eps, out_dtype, dropout_p, activation,
                need_stats):
    """``(signature, replay)`` for ``fusedops._replay.LAYERNORM_RESIDUAL`` replaying the plan
    ``run`` just made, or None unless the call was an inference add + LayerNorm the ops layer
    can replay (residual, no dropout, activation or statistics, output in x's dtype, x and
    residual contiguous, every tensor 16-byte aligned, parameters (N,) vectors). ``replay``
    checks what the signature does not fix and returns None where the plan would not apply."""
    if (residual is None or dropout_p or activation is not None or need_stats
            or out_dtype is not x.dtype or not x.is_cuda or not x.is_contiguous()
            or not residual.is_contiguous() or (x.data_ptr() | residual.data_ptr()) & 15):
        return None
    shape, dtype, device, n = x.shape, x.dtype, x.get_device(), x.shape[-1]
    dtypes = []
    for t in (weight, bias):
        if t is not None and param_ptr(t, t.dtype, n, device) < 0:
            return None
        dtypes.append(None if t is None else t.dtype)
    w_dtype, b_dtype = dtypes

    def replay(x, residual, weight, bias):
        if (residual.__class__ is not torch.Tensor or residual.shape != shape
                or residual.dtype is not dtype or not residual.is_cuda
                or residual.get_device() != device or not x.is_contiguous()
                or not residual.is_contiguous() or (x.data_ptr() | residual.data_ptr()) & 15
                or param_ptr(weight, w_dtype, n, device) < 0
                or param_ptr(bias, b_dtype, n, device) < 0 or hooks_registered()):
            return None
        out, s, _, _ = run(x, residual, weight, bias)
        return out, s

    return (shape, dtype, device, eps), replay


def _forward(x, residual, weight, bias, eps, out_dtype, dropout_p, seed, activation,
             need_stats):
    """:func:`layernorm_epilogue_forward` through the launch rules."""
    dev = x.device
    has_res = residual is not None
    if x.dim() == 2:
        M, N = x.shape
        _check_rows("x", x, x.shape, x.dtype)
        _check_rows("residual", residual, x.shape, x.dtype)
        stride_x, stride_r = x.stride(0), residual.stride(0) if has_res else 0
    else:  # contiguous rows of another rank (ROWS_ND): no 2-D views to make
        _check_contiguous_rows(x, residual)
        N = x.shape[-1]
        M = x.numel() // N if N else 0
        stride_x = stride_r = N
    act = _act_code(activation)
    dropout, scale, k0, k1, thresh = _random_args(dropout_p, seed)
    out = torch.empty(x.shape, dtype=out_dtype, device=dev)
    s = torch.empty(x.shape, dtype=x.dtype, device=dev) if has_res else None
    mean = torch.empty((M,), dtype=torch.float32, device=dev) if need_stats else None
    rstd = torch.empty((M,), dtype=torch.float32, device=dev) if need_stats else None
    if M == 0 or N == 0:
        if need_stats:
            mean.fill_(float("nan"))  # statistics of no elements, as the reference has them
            rstd.fill_(float("nan"))
        return out, s, mean, rstd
    weight, bias = _vector(weight), _vector(bias)
    has_w, has_b = weight is not None, bias is not None
    # Placeholders for absent tensors are never read (the flags are constexpr).
    r = residual if has_res else x
    sp = s if has_res else out
    w = weight if has_w else out
    b = bias if has_b else out
    mp = mean if need_stats else out
    rp = rstd if need_stats else out
    block = next_pow2(N)
    if block <= _fwd_cap(dropout):
        rows2, warps2, per_sm, stages = _fwd_plan(block, x.element_size(), dropout, has_res)
        tiles2 = cdiv(M, rows2)
        progs2 = (grid_size(tiles2, warps2, "ln_fwd", dev, block) if per_sm is None
                  else max(1, min(tiles2, num_sms(dev) * per_sm)))
        _launch_fwd_2d((progs2,), (
            x, r, w, b, out, sp, mp, rp, M, N, stride_x, stride_r, eps, scale, k0, k1, thresh,
            tiles2, progs2, block, rows2, _slices(block, dropout), has_res, has_w, has_b, dropout,
            act, need_stats, _rne(x), stages,
        ), warps2)
        mark_replayable()
    else:
        groups = _looped_groups()
        _launch_fwd_looped((M,), (
            x, r, w, b, out, sp, mp, rp, N, stride_x, stride_r, eps, scale, k0, k1, thresh,
            groups, has_res, has_w, has_b, dropout, act, need_stats, _rne(x),
        ), _warps(groups * 1024, LOOPED_ELEMS_PER_THREAD))
        mark_replayable()
    return out, s, mean, rstd


def layernorm_epilogue_backward(
    dout: torch.Tensor,
    ds: torch.Tensor | None,
    s: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dropout_p: float,
    seed: int,
    activation: str | None,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
    grad_dtypes: tuple[torch.dtype, torch.dtype] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of :func:`layernorm_epilogue_forward` (the contract of
    ``fusedops.backends.reference.layernorm_epilogue_backward``).

    dout: (M, N) gradient of out; ds: (M, N) gradient reaching s, or None; s: the LayerNorm's
    input (x + residual, or x); all with unit column stride and any row strides. The dropout
    mask is regenerated from ``seed``, the activation's input recomputed from s, mean, rstd,
    weight and bias. With gy = dout * act'(v) * keep / (1 - p): dx = LayerNorm backward of gy
    plus ds, (M, N) contiguous in s's dtype (rounded once); dw = Σ_rows gy · xhat and
    db = Σ_rows gy, float32 (N,), or already in ``grad_dtypes`` (weight's, bias's) where the
    partials' sum writes them (it rounds once, as a cast of the float32 sum would). Each is None
    where not needed. Bitwise reproducible: the grid and the summation order depend on the
    shapes only.
    """
    if not PLANS or grad_dtypes is None:
        return _backward(dout, ds, s, weight, bias, mean, rstd, dropout_p, seed, activation,
                         need_dx, need_dw, need_db, grad_dtypes)[:3]
    key = (s.shape, s.stride(), s.dtype, s.data_ptr() & 15, tensor_key(dout), tensor_key(ds),
           tensor_key(weight), tensor_key(bias), tensor_key(mean), tensor_key(rstd),
           dropout_p, activation, need_dx, need_dw, need_db, grad_dtypes, s.get_device(),
           BWD_PLAN_OVERRIDE)
    plan = _bwd_plans.get(key)
    if plan and not hooks_registered():
        return plan(dout, ds, s, weight, bias, mean, rstd,
                    words=_seed_words(seed) if dropout_p else None)
    if plan is False:
        return _backward(dout, ds, s, weight, bias, mean, rstd, dropout_p, seed, activation,
                         need_dx, need_dw, need_db, grad_dtypes)[:3]
    with record_launches() as record:
        *out, scratch = _backward(dout, ds, s, weight, bias, mean, rstd, dropout_p, seed,
                                  activation, need_dx, need_dw, need_db, grad_dtypes)
    _bwd_plans.put(key, replay_runner(record, (dout, ds, s, weight, bias, mean, rstd),
                                      tuple(out), scratch,
                                      _seed_position if dropout_p else None) or False)
    return tuple(out)


def _backward(dout, ds, s, weight, bias, mean, rstd, dropout_p, seed, activation, need_dx,
              need_dw, need_db, grad_dtypes):
    """:func:`layernorm_epilogue_backward` through the launch rules: ``(dx, dw, db, scratch)``,
    scratch the tuple of temporaries its launches wrote (for ``replay_runner``)."""
    M, N = s.shape
    dev = s.device
    _check_rows("s", s, s.shape, s.dtype)
    _check_rows("dout", dout, s.shape, dout.dtype)
    _check_rows("ds", ds, s.shape, ds.dtype if ds is not None else None)
    act = _act_code(activation)
    dropout, scale, k0, k1, thresh = _random_args(dropout_p, seed)
    dx = torch.empty((M, N), dtype=s.dtype, device=dev) if need_dx else None
    if M == 0 or N == 0 or not (need_dx or need_dw or need_db):
        dw = torch.zeros((N,), dtype=torch.float32, device=dev) if need_dw else None
        db = torch.zeros((N,), dtype=torch.float32, device=dev) if need_db else None
        return dx, dw, db, ()
    weight, bias = _vector(weight), _vector(bias)
    mean, rstd = _vector(mean), _vector(rstd)
    has_w, has_b = weight is not None, bias is not None
    has_ds = ds is not None and need_dx
    w = weight if has_w else s  # placeholders, never read
    b = bias if has_b else s
    dsp = ds if has_ds else s
    stride_ds = ds.stride(0) if has_ds else 0
    dxp = dx if need_dx else s
    block = next_pow2(N)
    if block <= _bwd_cap(dropout, act):
        strides = (dout.stride(0), s.stride(0)) + ((stride_ds,) if has_ds else ())
        rows2, warps2, per_sm, acc_1d, paired, stages = _bwd_plan(
            block, s.element_size(), dropout, act, strides)
        tiles2 = cdiv(M, rows2)
        progs2 = max(1, min(tiles2, num_sms(dev) * per_sm, ln_rules.max_partial_rows(s)))
        dw, db, dwp, dbp, part = _partials(progs2, N, need_dw, need_db, dxp)
        scratch = ()
        _launch_bwd_2d((progs2,), (
            dout, dsp, s, w, b, mean, rstd, dxp, dwp, dbp, M, N, dout.stride(0), stride_ds,
            s.stride(0), scale, k0, k1, thresh, tiles2, progs2,
            block, rows2, _slices(block, dropout), has_ds, has_w, has_b, dropout, act, need_dx,
            need_dw, need_db, acc_1d, paired, stages,
        ), warps2)
    else:
        groups = _looped_groups()
        sums = dxp
        scratch = ()
        if need_dx:
            sums = torch.empty((M, 2), dtype=torch.float32, device=dev)
            scratch = (sums,)
            _launch_bwd_row_sums((M,), (
                dout, s, w, b, mean, rstd, sums, N, dout.stride(0), s.stride(0), scale, k0, k1,
                thresh, groups, has_w, has_b, dropout, act,
            ), _warps(groups * 1024, LOOPED_ELEMS_PER_THREAD))
        col_blocks = cdiv(N, 1024)
        splits = max(1, min(cdiv(M, COLUMN_ROWS),
                            cdiv(COLUMN_PER_SM * num_sms(dev), col_blocks)))
        rows_per_split = cdiv(cdiv(M, splits), COLUMN_ROWS) * COLUMN_ROWS
        splits = cdiv(M, rows_per_split)
        dw, db, dwp, dbp, part = _partials(splits, N, need_dw, need_db, dxp)
        _launch_bwd_columns((col_blocks, splits), (
            dout, dsp, s, w, b, mean, rstd, sums, dxp, dwp, dbp, M, N, dout.stride(0),
            stride_ds, s.stride(0), scale, k0, k1, thresh, rows_per_split,
            COLUMN_ROWS, 1, has_ds, has_w, has_b, dropout, act, need_dx, need_dw, need_db,
        ), _warps(COLUMN_ROWS * 1024, BWD_ELEMS_PER_THREAD))
    if part is not None:
        dw, db = reduce_partials(part, need_dw, need_db, dtypes=grad_dtypes)
        scratch = (*scratch, part)
    mark_replayable()
    return dx, dw, db, scratch


def _partials(progs: int, N: int, need_dw: bool, need_db: bool, placeholder: torch.Tensor):
    """(dw, db, dweight target, dbias target, partials to sum or None) for ``progs`` programs
    writing one float32 row each: with one program the results themselves (float32 dw, db
    allocated here), else the two halves of a (2, progs, N) float32 buffer (the layout
    ``reduce_partials`` sums; dw, db None until it makes them)."""
    if not (need_dw or need_db):
        return None, None, placeholder, placeholder, None
    dev = placeholder.device
    if progs == 1:
        dw = torch.empty((N,), dtype=torch.float32, device=dev) if need_dw else None
        db = torch.empty((N,), dtype=torch.float32, device=dev) if need_db else None
        return dw, db, (dw if need_dw else placeholder), (db if need_db else placeholder), None
    part = torch.empty((2, progs, N), dtype=torch.float32, device=dev)
    return None, None, part[0], part[1], part
