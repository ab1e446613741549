"""LayerNorm forward kernels (``@triton.jit`` only). The variants and when each runs:
``triton/layernorm.py`` (module docstring); the rules that pick them: ``configs/layernorm.py``."""

from __future__ import annotations

import triton
import triton.language as tl

from fusedops.backends.triton.kernels.common import (
    await_row,
    publish_row,
    row_body,
    row_edges,
    split_edges,
    split_head,
    split_piece,
    tile_rows,
    unrolled_row,
)


@triton.jit
def rstd_of_var(var, eps, EXACT: tl.constexpr):
    # 1 / sqrt(var + eps); NaN where the variance overflows float32 (as torch), never a silent
    # row of zeros. EXACT (float32 y): GPUs' plain float32 sqrt and division are approximate
    # (rstd a few ulp off, on every element of the row), so one Newton step follows; rounded
    # ones compile to subroutine calls (ptxas sm_90: the split kernel at 32 registers and 4 KB
    # of spills). An inf or NaN start (var + eps = 0 or inf) is kept.
    r = 1.0 / tl.sqrt(var + eps)
    if EXACT:
        r1 = tl.fma(0.5 * tl.fma(-(var + eps), r * r, 1.0), r, r)
        r = tl.where(r1 == r1, r1, r)
    return tl.where(var < float("inf"), r, float("nan"))


@triton.jit
def _param(ptr, offs, mask, KEEP: tl.constexpr):
    # A weight or bias slice in float32 (mask None: whole chunks, no mask); KEEP: it stays in
    # L2 for the next row ("evict_last"), a flag rather than the policy string, which Triton
    # 3.6 cannot take as a nested function's constexpr.
    if mask is None:  # whole chunks
        if KEEP:
            v = tl.load(ptr + offs, eviction_policy="evict_last")
        else:
            v = tl.load(ptr + offs)
    elif KEEP:
        v = tl.load(ptr + offs, mask=mask, other=0.0, eviction_policy="evict_last")
    else:
        v = tl.load(ptr + offs, mask=mask, other=0.0)
    return v.to(tl.float32)


@triton.jit
def affine(y, w_ptr, b_ptr, offs, mask, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
           KEEP: tl.constexpr):
    # y·w[offs] + b[offs] (each where present): scale_shift of the loaded parameters.
    w = y  # (placeholders: unused without the parameter)
    b = y
    if HAS_W:
        w = _param(w_ptr, offs, mask, KEEP)
    if HAS_B:
        b = _param(b_ptr, offs, mask, KEEP)
    return scale_shift(y, w, b, HAS_W, HAS_B)


@triton.jit
def scale_shift(y, w, b, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    # y·w + b (each where present) as one FMA, which is what the compiler makes of it on GPUs;
    # written out so the interpreter rounds it the same way.
    if HAS_W and HAS_B:
        y = tl.fma(y, w, b)
    elif HAS_W:
        y = y * w
    elif HAS_B:
        y = y + b
    return y


@triton.jit
def ln_fwd_single(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, M, N, stride_x, stride_y, eps,
    num_tiles, num_progs,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    VEC: tl.constexpr, HOLD_W: tl.constexpr, STATS: tl.constexpr,
):
    # STATS: write mean/rstd (False for inference calls, which then allocate neither).
    # HOLD_W: load weight/bias once per program and keep them in registers across its row tiles
    # (short rows); long rows reload them per tile from L2 instead, which frees the registers
    # that would otherwise spill (a 32K-column row at 32 warps spills 240+ bytes per thread).
    # With VEC > 0 lane j is column head + j, the same in every row of a tile, and in every tile
    # of a program when num_progs is a multiple of VEC (the launcher sees to it for HOLD_W).
    EXACT: tl.constexpr = y_ptr.dtype.element_ty == tl.float32
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    if HOLD_W:
        first_rows, pid_head = tile_rows(pid, stride_x, ROWS, VEC)
        hold_mask = cols < ((N - pid_head) // VEC) * VEC if VEC > 0 else cols < N
        if HAS_W:
            w = tl.load(w_ptr + pid_head + cols, mask=hold_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            b = tl.load(b_ptr + pid_head + cols, mask=hold_mask, other=0.0).to(tl.float32)[None, :]
    for tile in range(pid, num_tiles, num_progs):
        rows, head = tile_rows(tile, stride_x, ROWS, VEC)
        row_mask = rows < M
        # VEC > 0: unaligned rows as an aligned body (lane j = column head + j) plus edges (see
        # row_body in kernels/common.py); the launcher then guarantees stride_x == stride_y.
        offs, mask = row_body(rows, head, M, N, stride_x, BLOCK_N, VEC)
        offs_y, _ = row_body(rows, head, M, N, stride_y, BLOCK_N, VEC)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # Mean about the row's first element: exact for constant rows (y is then exactly the
        # bias, as in torch) and no cancellation for rows far from zero (mean 1e4, small spread).
        x0 = tl.load(x_ptr + rows.to(tl.int64) * stride_x, mask=row_mask,
                     other=0.0).to(tl.float32)
        if VEC > 0:  # issued before any reduction, so all loads are in flight together
            e_offs, e_mask, e_col = row_edges(rows, head, M, N, stride_x, VEC)
            xe = tl.load(x_ptr + e_offs, mask=e_mask, other=0.0).to(tl.float32)
        total = tl.sum(tl.where(mask, x - x0[:, None], 0.0), axis=1)
        if VEC > 0:
            total += tl.sum(tl.where(e_mask, xe - x0[:, None], 0.0), axis=1)
        mean = x0 + total / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        sq = tl.sum(xc * xc, axis=1)
        if VEC > 0:
            xce = tl.where(e_mask, xe - mean[:, None], 0.0)
            sq += tl.sum(xce * xce, axis=1)
        var = sq / N
        rstd = rstd_of_var(var, eps, EXACT)
        y = xc * rstd[:, None]
        if not HOLD_W:  # long rows: weight and bias reloaded per tile (from L2)
            wcols = head + cols[None, :]
            wmask = (cols < ((N - head) // VEC) * VEC if VEC > 0 else cols < N)[None, :]
            if HAS_W:
                w = tl.load(w_ptr + wcols, mask=wmask, other=0.0).to(tl.float32)
            if HAS_B:
                b = tl.load(b_ptr + wcols, mask=wmask, other=0.0).to(tl.float32)
        if HAS_W and HAS_B:
            y = tl.fma(y, w, b)
        elif HAS_W:
            y = y * w
        elif HAS_B:
            y = y + b
        if VEC > 0:
            ye = affine(xce * rstd[:, None], w_ptr, b_ptr, e_col, e_col < N, HAS_W, HAS_B, False)
            tl.store(y_ptr + e_offs, ye.to(y_ptr.dtype.element_ty), mask=e_mask)
        tl.store(y_ptr + offs_y, y.to(y_ptr.dtype.element_ty), mask=mask)
        if STATS:
            tl.store(mean_ptr + rows, mean, mask=row_mask)
            tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _write_normalized(x_row, y_row, w_ptr, b_ptr, cols, N, mean, rstd, HAS_W: tl.constexpr,
                      HAS_B: tl.constexpr):
    # The write pass of the two-read kernels: one chunk of a row read again (from L2, then
    # evicted first), normalised, scaled and shifted, written in y's dtype.
    valid = cols < N
    x = tl.load(x_row + cols, mask=valid, other=0.0, eviction_policy="evict_first").to(tl.float32)
    y = affine((x - mean) * rstd, w_ptr, b_ptr, cols, valid, HAS_W, HAS_B, True)
    tl.store(y_row + cols, y.to(y_row.dtype.element_ty), mask=valid)


@triton.jit
def shift_weights(w_ptr, b_ptr, ws_ptr, bs_ptr, N, w_ld, HAS_W: tl.constexpr,
                   HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    # Row h of the (VEC, w_ld) outputs is the weight (bias) from column h on, zero-padded: the
    # copies ln_fwd_reload_vec reads with aligned vector loads for rows whose body starts at
    # column h.
    h = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    src = cols < N - h
    dst = cols < w_ld
    if HAS_W:
        tl.store(ws_ptr + h * w_ld + cols, tl.load(w_ptr + h + cols, mask=src, other=0.0),
                 mask=dst)
    if HAS_B:
        tl.store(bs_ptr + h * w_ld + cols, tl.load(b_ptr + h + cols, mask=src, other=0.0),
                 mask=dst)


@triton.jit
def ln_fwd_looped(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N, stride_x, stride_y, eps,
    CHUNK: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
):
    EXACT: tl.constexpr = y_ptr.dtype.element_ty == tl.float32
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    y_row = y_ptr + row.to(tl.int64) * stride_y
    lanes = tl.arange(0, CHUNK)
    # Per-lane sums of x - k and (x - k)^2 about a per-lane shift k (the lane's first element:
    # no cancellation for rows far from zero), merged across lanes with Chan's formula. Two
    # multiply-adds per element: a Welford update (one division per element) left this kernel
    # compute-bound (82% SM throughput at bf16 16K in Nsight Compute).
    k = tl.load(x_row + lanes, mask=lanes < N, other=0.0).to(tl.float32)
    s1 = tl.zeros([CHUNK], tl.float32)
    s2 = tl.zeros([CHUNK], tl.float32)
    for start in range(0, N, CHUNK):
        cols = start + lanes
        valid = cols < N
        # evict_last keeps the row in L2 for the second pass; evict_first lets it go after it.
        x = tl.load(x_row + cols, mask=valid, other=0.0,
                    eviction_policy="evict_last").to(tl.float32)
        d = tl.where(valid, x - k, 0.0)
        s1 += d
        s2 += d * d
    cnt = ((N - lanes + CHUNK - 1) // CHUNK).to(tl.float32)  # elements per lane (0 past N)
    avg = k + s1 / tl.maximum(cnt, 1.0)
    m2 = tl.maximum(s2 - s1 * s1 / tl.maximum(cnt, 1.0), 0.0)
    # Combined about the row's first element: exact for constant rows (see ln_fwd_single).
    x0 = tl.load(x_row).to(tl.float32)
    mean = x0 + tl.sum(cnt * (avg - x0), axis=0) / N
    dev = tl.where(cnt > 0, avg - mean, 0.0)
    var = (tl.sum(m2, axis=0) + tl.sum(cnt * dev * dev, axis=0)) / N
    rstd = rstd_of_var(var, eps, EXACT)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, N, CHUNK):
        _write_normalized(x_row, y_row, w_ptr, b_ptr, start + lanes, N, mean, rstd, HAS_W, HAS_B)


@triton.jit
def ln_fwd_reload(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N, stride_x, stride_y, eps,
    BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    STATS: tl.constexpr, THIRD_READ: tl.constexpr = False,
):
    # One row per program, read twice: first whole, in one load (every byte of the row in flight
    # at once), for exact two-pass statistics in registers; then again in CHUNK-sized pieces,
    # from L2, to write y. Nothing stays in registers across the two passes, so a program needs
    # far fewer registers than the single-block kernel (which holds the row and the weights until
    # it writes): more programs per SM, more bytes in flight. Inductor's reduction kernels do the
    # same at these lengths (its first loop fully unrolled).
    EXACT: tl.constexpr = y_ptr.dtype.element_ty == tl.float32
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    y_row = y_ptr + row.to(tl.int64) * stride_y
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_last")
    x0 = tl.load(x_row).to(tl.float32)  # the shift, as in ln_fwd_single
    mean = x0 + tl.sum(tl.where(mask, x.to(tl.float32) - x0, 0.0), axis=0) / N
    if THIRD_READ:  # read x again (L2) for the variance instead of keeping it: half the
        # registers at 16-bit 16K (ptxas: 32 vs 63 on 16 warps), a third read from L2. Measured
        # slower at 4K-16K (bf16 16K 3.36-3.63 vs 3.75 TB/s) but faster at 16-bit 32K on 32
        # warps (H200: bf16 3.51-3.54 vs 3.17-3.19 single-block, fp16 3.55 vs 3.20).
        x = tl.load(x_row + cols, mask=mask, other=0.0, cache_modifier=".cg")
    xc = tl.where(mask, x.to(tl.float32) - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / N
    rstd = rstd_of_var(var, eps, EXACT)
    if STATS:
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)
    lanes = tl.arange(0, CHUNK)
    for start in tl.static_range(0, BLOCK_N, CHUNK):
        _write_normalized(x_row, y_row, w_ptr, b_ptr, start + lanes, N, mean, rstd, HAS_W, HAS_B)


@triton.jit
def offset_stats(x_row, x_first, LEN: tl.constexpr, CHUNK: tl.constexpr):
    """(x0, offset, M2) of the LEN elements at ``x_row`` (a multiple of CHUNK, loaded in
    unrolled chunks kept in L2): x0 = the element at ``x_first``, their mean = x0 + offset,
    M2 = the sum of squared deviations from it."""
    # Per-lane sums about the lane's first element k (no cancellation for rows far from zero),
    # merged across lanes with Chan's formula; every lane holds LEN / CHUNK elements.
    lanes = tl.arange(0, CHUNK)
    k = tl.load(x_row + lanes, eviction_policy="evict_last").to(tl.float32)
    s1 = tl.zeros([CHUNK], tl.float32)
    s2 = tl.zeros([CHUNK], tl.float32)
    for start in tl.static_range(CHUNK, LEN, CHUNK):
        d = tl.load(x_row + start + lanes, eviction_policy="evict_last").to(tl.float32) - k
        s1 += d
        s2 += d * d
    per_lane: tl.constexpr = LEN // CHUNK
    m2 = tl.maximum(s2 - s1 * s1 / per_lane, 0.0)
    # Everything about x0: the lanes' means and the mean as offsets from it, and y from
    # (x - x0) - offset, so a row far from zero (1e4 + small spread) never rounds its mean to
    # x's magnitude before normalising (GPU, float32 rows at 1e4: y's error 0.054 with the
    # mean formed first, above torch's 0.048).
    x0 = tl.load(x_first).to(tl.float32)
    lane_off = (k - x0) + s1 / per_lane
    off = tl.sum(lane_off, axis=0) / CHUNK
    dev = lane_off - off
    return x0, off, tl.sum(m2, axis=0) + per_lane * tl.sum(dev * dev, axis=0)


@triton.jit
def ln_fwd_unrolled(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, M, stride_x, stride_y, eps,
    N: tl.constexpr, CHUNK: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    STATS: tl.constexpr,
):
    # (M is unused: the grid has one program per row; it leads the scalar arguments so launch
    # plans replay this kernel like the single-block one.)
    # The looped kernel with the row length a compile-time constant (N a multiple of CHUNK):
    # both passes unroll, so a thread has every chunk's loads in flight at once while holding
    # only its lanes' running sums, and no element needs a mask. This is the structure of
    # Inductor's static-shape reductions, which beat the reload kernel at 16-bit 16K on H200s.
    EXACT: tl.constexpr = y_ptr.dtype.element_ty == tl.float32
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    y_row = y_ptr + row.to(tl.int64) * stride_y
    lanes = tl.arange(0, CHUNK)
    x0, off, m2 = offset_stats(x_row, x_row, N, CHUNK)
    rstd = rstd_of_var(m2 / N, eps, EXACT)
    if STATS:
        tl.store(mean_ptr + row, x0 + off)
        tl.store(rstd_ptr + row, rstd)
    for start in tl.static_range(0, N, CHUNK):
        cols = start + lanes
        x = tl.load(x_row + cols, eviction_policy="evict_first").to(tl.float32)
        y = affine(((x - x0) - off) * rstd, w_ptr, b_ptr, cols, None, HAS_W, HAS_B, True)
        tl.store(y_row + cols, y.to(y_row.dtype.element_ty))


@triton.jit
def ln_fwd_unrolled_vec(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, M, stride, eps, w_ld,
    N: tl.constexpr, BODY: tl.constexpr, CHUNK: tl.constexpr, HAS_W: tl.constexpr,
    HAS_B: tl.constexpr, STATS: tl.constexpr, VEC: tl.constexpr,
):
    # ln_fwd_unrolled for rows that start unaligned (N not a multiple of VEC, e.g. 2^k + 1;
    # M unused, as there). Every row's first BODY = (N // VEC - 1)·VEC elements from its first
    # 16-byte boundary are read as vectors in unrolled chunks (the same count for every row,
    # whatever its misalignment, so only a last partial chunk needs a mask); the rest, the head
    # before the boundary (< VEC) and the tail after the body (< 2·VEC), in one 4·VEC-lane edge
    # tile. Weight and bias for the body from the shifted copies of shift_weights (row
    # ``head``), so those loads are vectors too.
    EXACT: tl.constexpr = y_ptr.dtype.element_ty == tl.float32
    row = tl.program_id(0)
    start, first, head, ecol, emask, xe = unrolled_row(x_ptr, stride, N, BODY, VEC)
    x_body = x_ptr + first
    y_body = y_ptr + first
    x0 = tl.load(x_ptr + start).to(tl.float32)
    lanes = tl.arange(0, CHUNK)
    # Per-lane sums about the lane's first element k, merged with Chan's formula (as in
    # ln_fwd_unrolled); each edge element joins as a lane of its own.
    k = tl.load(x_body + lanes, eviction_policy="evict_last").to(tl.float32)
    s1 = tl.zeros([CHUNK], tl.float32)
    s2 = tl.zeros([CHUNK], tl.float32)
    for c0 in tl.static_range(CHUNK, BODY, CHUNK):
        c = c0 + lanes
        if c0 + CHUNK <= BODY:
            d = tl.load(x_body + c, eviction_policy="evict_last").to(tl.float32) - k
        else:
            d = tl.load(x_body + c, mask=c < BODY, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
            d = tl.where(c < BODY, d - k, 0.0)
        s1 += d
        s2 += d * d
    cnt = ((BODY - lanes + CHUNK - 1) // CHUNK).to(tl.float32)  # >= 1: BODY >= CHUNK
    m2 = tl.maximum(s2 - s1 * s1 / cnt, 0.0)
    lane_off = (k - x0) + s1 / cnt
    de = tl.where(emask, xe - x0, 0.0)
    off = (tl.sum(cnt * lane_off, axis=0) + tl.sum(de, axis=0)) / N
    dev = lane_off - off
    dve = tl.where(emask, de - off, 0.0)
    var = (tl.sum(m2, axis=0) + tl.sum(cnt * dev * dev, axis=0) + tl.sum(dve * dve, axis=0)) / N
    rstd = rstd_of_var(var, eps, EXACT)
    if STATS:
        tl.store(mean_ptr + row, x0 + off)
        tl.store(rstd_ptr + row, rstd)
    # (row 0 of the shifted copies is the weight itself)
    ye = affine(dve * rstd, w_ptr, b_ptr, ecol, emask, HAS_W, HAS_B, False)
    tl.store(y_ptr + start + ecol, ye.to(y_ptr.dtype.element_ty), mask=emask)
    w_at = head * w_ld
    for c0 in tl.static_range(0, BODY, CHUNK):
        c = c0 + lanes
        m = c < BODY
        if c0 + CHUNK <= BODY:
            x = tl.load(x_body + c, eviction_policy="evict_first").to(tl.float32)
        else:
            x = tl.load(x_body + c, mask=m, other=0.0, eviction_policy="evict_first").to(
                tl.float32)
        y = affine(((x - x0) - off) * rstd, w_ptr, b_ptr, w_at + c, m, HAS_W, HAS_B, True)
        if c0 + CHUNK <= BODY:
            tl.store(y_body + c, y.to(y_ptr.dtype.element_ty))
        else:
            tl.store(y_body + c, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def ln_fwd_reload_vec(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N, stride, eps, w_ld,
    BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    STATS: tl.constexpr, VEC: tl.constexpr,
):
    # ln_fwd_reload for rows that start unaligned (N = 2^k + 1): the aligned body (16-byte
    # vectors from the first boundary of the row on) plus up to 2·VEC edge elements, as in
    # row_body/row_edges; x and y share the row stride. Weight and bias come from the shifted
    # copies of shift_weights (row ``head``), so the write pass loads them as vectors too.
    EXACT: tl.constexpr = y_ptr.dtype.element_ty == tl.float32
    row = tl.program_id(0)
    start = row.to(tl.int64) * stride
    first = ((start + (VEC - 1)) // VEC) * VEC  # a multiple of VEC, visibly to the compiler
    head = (first - start).to(tl.int32)
    body = ((N - head) // VEC) * VEC
    cols = tl.arange(0, BLOCK_N)
    bmask = cols < body
    x = tl.load(x_ptr + first + cols, mask=bmask, other=0.0, eviction_policy="evict_last")
    x0 = tl.load(x_ptr + start).to(tl.float32)  # the shift, as in ln_fwd_single
    j = tl.arange(0, 2 * VEC)
    ecol = tl.where(j < VEC, j, head + body + (j - VEC))
    emask = tl.where(j < VEC, j < head, ecol < N)
    xe = tl.load(x_ptr + start + ecol, mask=emask, other=0.0).to(tl.float32)
    total = (tl.sum(tl.where(bmask, x.to(tl.float32) - x0, 0.0), axis=0)
             + tl.sum(tl.where(emask, xe - x0, 0.0), axis=0))
    mean = x0 + total / N
    xc = tl.where(bmask, x.to(tl.float32) - mean, 0.0)
    xce = tl.where(emask, xe - mean, 0.0)
    var = (tl.sum(xc * xc, axis=0) + tl.sum(xce * xce, axis=0)) / N
    rstd = rstd_of_var(var, eps, EXACT)
    if STATS:
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)
    # (row 0 of the shifted copies is the weight itself)
    ye = affine(xce * rstd, w_ptr, b_ptr, ecol, emask, HAS_W, HAS_B, False)
    tl.store(y_ptr + start + ecol, ye.to(y_ptr.dtype.element_ty), mask=emask)
    lanes = tl.arange(0, CHUNK)
    w_at = head * w_ld
    for c0 in tl.static_range(0, BLOCK_N, CHUNK):
        c = c0 + lanes
        m = c < body
        xv = tl.load(x_ptr + first + c, mask=m, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        yv = affine((xv - mean) * rstd, w_ptr, b_ptr, w_at + c, m, HAS_W, HAS_B, True)
        tl.store(y_ptr + first + c, yv.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def ln_fwd_split(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, stats_ptr, count_ptr, N, L, stride_x,
    stride_y, eps, num_items, num_progs,
    BLOCK: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, HAS_W: tl.constexpr,
    HAS_B: tl.constexpr, PREFETCH: tl.constexpr, VEC: tl.constexpr,
):
    # Work item = (row, piece), row-major; see fusedops/backends/triton/runtime/split.py. Each piece
    # publishes its (mean, M2) about its own mean; the row's statistics are merged with Chan's
    # formula, so the row is read once and there is no E[x^2] - E[x]^2 cancellation. Pieces:
    # split_piece in kernels/common.py (VEC > 0: pieces of the aligned body, piece 0 also has the
    # edges, x and y share the row stride). The grid is a multiple of C: a program always has the
    # same piece, of rows num_progs // C apart; with VEC > 0 also a multiple of C·VEC (or one item
    # per program), so its rows share one misalignment and its weight columns are fixed: weight and
    # bias are loaded once. PREFETCH: see runtime/split.py.
    EXACT: tl.constexpr = y_ptr.dtype.element_ty == tl.float32
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    peers = tl.arange(0, C_P2)
    chunk = pid % C
    step = num_progs // C
    if VEC > 0:
        head, body = split_head(pid // C, N, stride_x, VEC)
        wcol = head + chunk * L + lanes
        wmask = (lanes < L) & (chunk * L + lanes < body)
        if HAS_W:
            w = tl.load(w_ptr + wcol, mask=wmask, other=0.0)
        if HAS_B:
            b = tl.load(b_ptr + wcol, mask=wmask, other=0.0)
        n_c = (tl.minimum(tl.maximum(body - chunk * L, 0), L)
               + tl.where(chunk == 0, N - body, 0)).to(tl.float32)
        counts = (tl.minimum(tl.maximum(body - peers * L, 0), L)
                  + tl.where(peers == 0, N - body, 0)).to(tl.float32)
    else:
        n_c = tl.minimum(N - chunk * L, L).to(tl.float32)
        counts = tl.minimum(tl.maximum(N - peers * L, 0), L).to(tl.float32)
    counts = tl.where(peers < C, counts, 0.0)
    if PREFETCH > 0:
        offs, mask, pos = split_piece(pid // C, chunk, L, N, stride_x, BLOCK, VEC)
        x_next = tl.load(x_ptr + offs, mask=mask, other=0.0)
    for item in range(pid, num_items, num_progs):
        row = item // C
        offs, mask, pos = split_piece(row, chunk, L, N, stride_x, BLOCK, VEC)
        if PREFETCH > 0:
            x = x_next.to(tl.float32)
            n_offs, n_mask, n_pos = split_piece(row + step, chunk, L, N, stride_x, BLOCK, VEC)
            n_mask = n_mask & (item + num_progs < num_items)
            if PREFETCH == 1:
                x_next = tl.load(x_ptr + n_offs, mask=n_mask, other=0.0)
        else:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # About the piece's first element, and merged about piece 0's mean: exact for constant
        # rows (see ln_fwd_single).
        x0 = tl.sum(tl.where(lanes == 0, x, 0.0), axis=0)
        total = tl.sum(tl.where(mask, x - x0, 0.0), axis=0)
        if VEC > 0:
            e_offs, e_mask, e_col = split_edges(row, chunk, N, stride_x, VEC)
            xe = tl.load(x_ptr + e_offs, mask=e_mask, other=0.0).to(tl.float32)
            total += tl.sum(tl.where(e_mask, xe - x0, 0.0), axis=0)
        mean_c = x0 + total / tl.maximum(n_c, 1.0)  # an empty piece (count 0) adds nothing
        xc = tl.where(mask, x - mean_c, 0.0)
        m2 = tl.sum(xc * xc, axis=0)
        if VEC > 0:
            xce = tl.where(e_mask, xe - mean_c, 0.0)
            m2 += tl.sum(xce * xce, axis=0)
        tl.store(stats_ptr + item * 2, mean_c)
        tl.store(stats_ptr + item * 2 + 1, m2)
        publish_row(count_ptr, row)
        if PREFETCH == 3:
            x_next = tl.load(x_ptr + n_offs, mask=n_mask, other=0.0)
        await_row(count_ptr, row, C)
        if PREFETCH == 2:
            x_next = tl.load(x_ptr + n_offs, mask=n_mask, other=0.0)
        base = (row * C + peers) * 2
        ok = peers < C
        means = tl.load(stats_ptr + base, mask=ok, other=0.0, cache_modifier=".cg")
        m2s = tl.load(stats_ptr + base + 1, mask=ok, other=0.0, cache_modifier=".cg")
        ref = tl.sum(tl.where(peers == 0, means, 0.0), axis=0)
        mean = ref + tl.sum(counts * (means - ref), axis=0) / N
        dev = means - mean
        var = (tl.sum(m2s, axis=0) + tl.sum(counts * dev * dev, axis=0)) / N
        rstd = rstd_of_var(var, eps, EXACT)
        y = (x - mean) * rstd
        if VEC > 0:
            if HAS_W and HAS_B:
                y = tl.fma(y, w.to(tl.float32), b.to(tl.float32))
            elif HAS_W:
                y = y * w.to(tl.float32)
            elif HAS_B:
                y = y + b.to(tl.float32)
        else:
            y = affine(y, w_ptr, b_ptr, pos, mask, HAS_W, HAS_B, False)
        offs_y, mask_y, pos_y = split_piece(row, chunk, L, N, stride_y, BLOCK, VEC)
        tl.store(y_ptr + offs_y, y.to(y_ptr.dtype.element_ty), mask=mask)
        if VEC > 0:
            ye = affine((xe - mean) * rstd, w_ptr, b_ptr, e_col, e_mask, HAS_W, HAS_B, False)
            tl.store(y_ptr + e_offs, ye.to(y_ptr.dtype.element_ty), mask=e_mask)
        if chunk == 0:
            tl.store(mean_ptr + row, mean)
            tl.store(rstd_ptr + row, rstd)
