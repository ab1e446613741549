"""RMSNorm kernels (``@triton.jit`` only); the rules that pick them: ``configs/rmsnorm.py``.
The split-row kernels are in ``rmsnorm_split.py``."""

from __future__ import annotations

import triton
import triton.language as tl

from fusedops.backends.triton.kernels.common import (
    row_body,
    row_edges,
    split_head,
    tile_rows,
    unrolled_row,
)


@triton.jit
def body_weight(w_ptr, head, w_ld, cols, N, VEC: tl.constexpr):
    """float32 weight of the lanes ``cols`` of rows whose lane j is column head + j (VEC > 0,
    see row_body) or j (VEC == 0). ``w_ld`` > 1: ``w_ptr`` holds shift_weights copies (row h:
    the weight from column h on, rows ``w_ld`` apart, a multiple of 16), read with 16-byte
    vectors; ``w_ld`` == 1: the weight itself, read from column ``head`` on."""
    if VEC > 0:
        w = tl.load(w_ptr + head * w_ld + cols, mask=cols < ((N - head) // VEC) * VEC, other=0.0)
    else:
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
    return w.to(tl.float32)


@triton.jit
def sum_sq(x, axis):
    return tl.sum(x * x, axis=axis)


@triton.jit
def rstd_of(ss, N, eps, EXACT: tl.constexpr):
    """1 / sqrt(ss / N + eps); 0 for an infinite mean square, as torch's rms_norm."""
    ms = ss / N
    v = ms + eps
    r = 1.0 / tl.sqrt(v)
    if EXACT:
        # float32 y: one Newton step after GPUs' approximate sqrt and division (a few ulp on
        # every element), its residual 1 - v·r² carrying the roundings of r², ss / N and + eps.
        h = r * r
        n = N + 0.0
        v_lo = tl.fma(-ms, n, ss) / n + tl.where(ms >= eps, (ms - v) + eps, (eps - v) + ms)
        e = tl.fma(-v, h, 1.0) - v * tl.fma(r, r, -h) - v_lo * h
        # (an inf, NaN or overflowing start, v = 0, inf or tiny, is kept)
        r = tl.where(tl.abs(e) < 0.5, tl.fma(0.5 * e, r, r), r)
    return r


@triton.jit
def finish_edges(ss, xe, w_ptr, y_ptr, rstd_ptr, row, start, ecol, emask, N, eps,
                 HAS_W: tl.constexpr, STATS: tl.constexpr, EXACT: tl.constexpr):
    """rstd of an unaligned row from its sum of squares ``ss`` (stored with STATS), and y of its
    edge tile ``xe`` (columns ``ecol`` from ``start``, lanes ``emask``) written; returns rstd."""
    rstd = rstd_of(ss, N, eps, EXACT)
    if STATS:
        tl.store(rstd_ptr + row, rstd)
    ye = xe * rstd
    if HAS_W:
        ye = ye * tl.load(w_ptr + ecol, mask=emask, other=0.0).to(tl.float32)
    tl.store(y_ptr + start + ecol, ye.to(y_ptr.dtype.element_ty), mask=emask)
    return rstd


@triton.jit
def shift_weight(w_ptr, ws_ptr, N, w_ld, BLOCK: tl.constexpr):
    # Row h of the (VEC, w_ld) output is the weight from column h on, zero-padded: what
    # body_weight reads with aligned vector loads for rows whose body starts at column h.
    h = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ws_ptr + h * w_ld + cols, tl.load(w_ptr + h + cols, mask=cols < N - h, other=0.0),
             mask=cols < w_ld)


@triton.jit
def rms_fwd_single(
    x_ptr, w_ptr, y_ptr, rstd_ptr, M, N, stride_x, stride_y, eps, num_tiles, num_progs, w_ld,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_W: tl.constexpr, HOLD_W: tl.constexpr,
    STATS: tl.constexpr, VEC: tl.constexpr,
):
    # HOLD_W: the weight stays in registers across a program's tiles (short rows); long rows
    # reload it per tile from L2 rather than spill (see hold_w).
    # VEC > 0: unaligned rows as an aligned body plus edges (row_body / row_edges in
    # kernels/common.py, stride_x == stride_y); a tile's rows share one misalignment, and so
    # do all tiles of a program on a grid that is a multiple of VEC (grid_size).
    EXACT: tl.constexpr = y_ptr.dtype.element_ty == tl.float32
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    if HAS_W and HOLD_W:
        pid_rows, pid_head = tile_rows(pid, stride_x, ROWS, VEC)
        w = body_weight(w_ptr, pid_head, w_ld, cols, N, VEC)[None, :]
    for tile in range(pid, num_tiles, num_progs):
        rows, head = tile_rows(tile, stride_x, ROWS, VEC)
        row_ok = rows < M
        offs, mask = row_body(rows, head, M, N, stride_x, BLOCK_N, VEC)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if VEC > 0:  # issued before any reduction, so all loads are in flight together
            e_offs, e_mask, e_col = row_edges(rows, head, M, N, stride_x, VEC)
            xe = tl.load(x_ptr + e_offs, mask=e_mask, other=0.0).to(tl.float32)
        ss = sum_sq(x, 1)
        if VEC > 0:
            ss += sum_sq(xe, 1)
        # An infinite mean square (an inf in the row, or squares beyond float32) gives rstd 0,
        # as torch's rms_norm and the reference: finite elements 0, the inf itself NaN.
        rstd = rstd_of(ss, N, eps, EXACT)
        y = x * rstd[:, None]
        if HAS_W:
            if not HOLD_W:
                w = body_weight(w_ptr, head, w_ld, cols, N, VEC)[None, :]
            y = y * w
        offs_y, mask_y = row_body(rows, head, M, N, stride_y, BLOCK_N, VEC)
        tl.store(y_ptr + offs_y, y.to(y_ptr.dtype.element_ty), mask=mask_y)
        if VEC > 0:
            ye = xe * rstd[:, None]
            if HAS_W:  # (row 0 of shifted copies is the weight itself)
                ye = ye * tl.load(w_ptr + e_col, mask=e_col < N, other=0.0).to(tl.float32)
            tl.store(y_ptr + e_offs, ye.to(y_ptr.dtype.element_ty), mask=e_mask)
        if STATS:
            tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def rms_fwd_reload_vec(
    x_ptr, w_ptr, y_ptr, rstd_ptr, N, stride, eps, w_ld,
    BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, HAS_W: tl.constexpr, STATS: tl.constexpr,
    VEC: tl.constexpr,
):
    # One unaligned row per program (LayerNorm's ln_fwd_reload_vec): its aligned body read
    # whole in one load for the sum of squares (nothing of it held past the reduction), then
    # again in CHUNK pieces from L2 to write y; the edges (< 2·VEC elements) in one small tile.
    # x and y share the row stride; the weight from the shifted copies (w_ld > 1) or itself.
    EXACT: tl.constexpr = y_ptr.dtype.element_ty == tl.float32
    row = tl.program_id(0)
    start = row.to(tl.int64) * stride
    first = ((start + (VEC - 1)) // VEC) * VEC  # a multiple of VEC, visibly to the compiler
    head = (first - start).to(tl.int32)
    body = ((N - head) // VEC) * VEC
    cols = tl.arange(0, BLOCK_N)
    x = tl.load(x_ptr + first + cols, mask=cols < body, other=0.0,
                eviction_policy="evict_last").to(tl.float32)
    j = tl.arange(0, 2 * VEC)
    ecol = tl.where(j < VEC, j, head + body + (j - VEC))
    emask = tl.where(j < VEC, j < head, ecol < N)
    xe = tl.load(x_ptr + start + ecol, mask=emask, other=0.0).to(tl.float32)
    rstd = finish_edges(sum_sq(x, 0) + sum_sq(xe, 0), xe, w_ptr, y_ptr, rstd_ptr, row, start,
                        ecol, emask, N, eps, HAS_W, STATS, EXACT)
    lanes = tl.arange(0, CHUNK)
    w_at = head * w_ld
    for c0 in tl.static_range(0, BLOCK_N, CHUNK):
        c = c0 + lanes
        m = c < body
        yv = tl.load(x_ptr + first + c, mask=m, other=0.0,
                     eviction_policy="evict_first").to(tl.float32) * rstd
        if HAS_W:
            yv = yv * tl.load(w_ptr + w_at + c, mask=m, other=0.0,
                              eviction_policy="evict_last").to(tl.float32)
        tl.store(y_ptr + first + c, yv.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def rms_fwd_looped(
    x_ptr, w_ptr, y_ptr, rstd_ptr, N, stride_x, stride_y, eps,
    CHUNK: tl.constexpr, HAS_W: tl.constexpr, STATS: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    y_row = y_ptr + row.to(tl.int64) * stride_y
    lanes = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], tl.float32)
    for start in range(0, N, CHUNK):
        cols = start + lanes
        # evict_last keeps the row in L2 for the second pass; evict_first lets it go after it.
        x = tl.load(x_row + cols, mask=cols < N, other=0.0,
                    eviction_policy="evict_last").to(tl.float32)
        acc = tl.fma(x, x, acc)  # (what GPUs contract it to; the interpreter rounds the same)
    rstd = rstd_of(tl.sum(acc, axis=0), N, eps, y_ptr.dtype.element_ty == tl.float32)
    if STATS:
        tl.store(rstd_ptr + row, rstd)
    for start in range(0, N, CHUNK):
        cols = start + lanes
        valid = cols < N
        x = tl.load(x_row + cols, mask=valid, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        y = x * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=valid, other=0.0,
                            eviction_policy="evict_last").to(tl.float32)
        tl.store(y_row + cols, y.to(y_row.dtype.element_ty), mask=valid)


@triton.jit
def rms_fwd_unrolled(
    x_ptr, w_ptr, y_ptr, rstd_ptr, M, stride_x, stride_y, eps,
    N: tl.constexpr, CHUNK: tl.constexpr, HAS_W: tl.constexpr, STATS: tl.constexpr,
):
    # (M is unused: the grid has one program per row; it leads the scalar arguments as in
    # LayerNorm's ln_fwd_unrolled and the single-block kernel.)
    # rms_fwd_looped with the row length a compile-time constant (N a multiple of CHUNK, as
    # LayerNorm's ln_fwd_unrolled): both passes unroll, so a thread has every chunk's loads in
    # flight at once while holding only its lanes' running sums, and no element needs a mask.
    EXACT: tl.constexpr = y_ptr.dtype.element_ty == tl.float32
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    y_row = y_ptr + row.to(tl.int64) * stride_y
    lanes = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], tl.float32)
    for start in tl.static_range(0, N, CHUNK):
        # evict_last keeps the row in L2 for the second pass; evict_first lets it go after it.
        x = tl.load(x_row + start + lanes, eviction_policy="evict_last").to(tl.float32)
        acc = tl.fma(x, x, acc)  # (as in rms_fwd_looped)
    rstd = rstd_of(tl.sum(acc, axis=0), N, eps, EXACT)
    if STATS:
        tl.store(rstd_ptr + row, rstd)
    for start in tl.static_range(0, N, CHUNK):
        cols = start + lanes
        y = tl.load(x_row + cols, eviction_policy="evict_first").to(tl.float32) * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + cols, eviction_policy="evict_last").to(tl.float32)
        tl.store(y_row + cols, y.to(y_row.dtype.element_ty))


@triton.jit
def rms_fwd_unrolled_vec(
    x_ptr, w_ptr, y_ptr, rstd_ptr, M, stride, eps, w_ld,
    N: tl.constexpr, BODY: tl.constexpr, CHUNK: tl.constexpr, HAS_W: tl.constexpr,
    STATS: tl.constexpr, VEC: tl.constexpr,
):
    # rms_fwd_unrolled for rows that start unaligned (LayerNorm's ln_fwd_unrolled_vec; M
    # unused): every row's first BODY = (N // VEC - 1)·VEC elements from its first 16-byte
    # boundary in unrolled vector chunks (the same count whatever the misalignment, so only a
    # last partial chunk is masked), the head and tail in one 4·VEC-lane edge tile, loaded
    # once and kept. x and y share the row stride; the weight from the shifted copies (w_ld >
    # 1, whose row 0 is the weight itself) or the weight (w_ld == 1).
    EXACT: tl.constexpr = y_ptr.dtype.element_ty == tl.float32
    row = tl.program_id(0)
    start, first, head, ecol, emask, xe = unrolled_row(x_ptr, stride, N, BODY, VEC)
    x_body = x_ptr + first
    y_body = y_ptr + first
    lanes = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], tl.float32)
    for c0 in tl.static_range(0, BODY, CHUNK):
        c = c0 + lanes
        if c0 + CHUNK <= BODY:
            x = tl.load(x_body + c, eviction_policy="evict_last").to(tl.float32)
        else:
            x = tl.load(x_body + c, mask=c < BODY, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
        acc = tl.fma(x, x, acc)  # (as in rms_fwd_unrolled)
    rstd = finish_edges(tl.sum(acc, axis=0) + sum_sq(xe, 0), xe, w_ptr, y_ptr, rstd_ptr, row,
                        start, ecol, emask, N, eps, HAS_W, STATS, EXACT)
    w_at = head * w_ld
    for c0 in tl.static_range(0, BODY, CHUNK):
        c = c0 + lanes
        m = c < BODY
        if c0 + CHUNK <= BODY:
            y = tl.load(x_body + c, eviction_policy="evict_first").to(tl.float32) * rstd
            if HAS_W:
                y = y * tl.load(w_ptr + w_at + c, eviction_policy="evict_last").to(tl.float32)
            tl.store(y_body + c, y.to(y_ptr.dtype.element_ty))
        else:
            y = tl.load(x_body + c, mask=m, other=0.0,
                        eviction_policy="evict_first").to(tl.float32) * rstd
            if HAS_W:
                y = y * tl.load(w_ptr + w_at + c, mask=m, other=0.0,
                                eviction_policy="evict_last").to(tl.float32)
            tl.store(y_body + c, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def rms_bwd_single(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, part_ptr, M, N, stride_dy, stride_x, stride_dx,
    num_tiles, num_progs,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_W: tl.constexpr, HOLD_W: tl.constexpr,
    NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, ACC_1D: tl.constexpr,
    STAGES: tl.constexpr,
):
    # NEED_DW: part_ptr is (num_progs, N), float32 partials (or, with one program, dweight in
    # its own dtype). ACC_1D folds each tile's rows into a (BLOCK_N,) accumulator at once (fewer
    # registers, for long rows); otherwise a (ROWS, BLOCK_N) one is reduced over rows once at
    # the end (no cross-warp reduction per tile, for short rows). STAGES > 1: Triton
    # software-pipelines the tile loop (the next tiles' loads copied into shared memory
    # asynchronously while this one is reduced; configs/rmsnorm.py PIPELINED_BWD_BLOCKS).
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_W and NEED_DX and HOLD_W:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ACC_1D:
        dw_acc = tl.zeros([BLOCK_N], tl.float32)
    else:
        dw_acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for tile in tl.range(pid, num_tiles, num_progs, num_stages=STAGES):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        # Masked lanes hold x = dy = 0 (and rows past M rstd = 0): they add nothing to any sum,
        # so no select is needed.
        xhat = x * rstd[:, None]
        if NEED_DX:
            if HAS_W:
                if not HOLD_W:
                    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
                g = dy * w
            else:
                g = dy
            c = tl.sum(xhat * g, axis=1) / N
            dx = (g - xhat * c[:, None]) * rstd[:, None]
            tl.store(dx_ptr + rows64[:, None] * stride_dx + cols[None, :],
                     dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if NEED_DW:
            if ACC_1D:
                dw_acc += tl.sum(dy * xhat, axis=0)
            else:
                dw_acc += dy * xhat
    if NEED_DW:
        if ACC_1D:
            dw_row = dw_acc
        else:
            dw_row = tl.sum(dw_acc, axis=0)
        tl.store(part_ptr + pid.to(tl.int64) * N + cols, dw_row.to(part_ptr.dtype.element_ty),
                 mask=col_ok)


@triton.jit
def rms_bwd_vec(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, part_ptr, M, N, stride, num_progs,
    BLOCK_N: tl.constexpr, HAS_W: tl.constexpr, HOLD_W: tl.constexpr, NEED_DX: tl.constexpr,
    NEED_DW: tl.constexpr, VEC: tl.constexpr,
):
    # rms_bwd_single for unaligned rows (dy, x and dx share the row stride): one row per
    # iteration, its aligned body read with 16-byte vectors (lane j: column head + j) and its
    # edges (< 2·VEC columns) in a 1-D tile. A program's rows are num_progs apart, a multiple
    # of VEC unless it has one row, so they share one misalignment: the weight and the dweight
    # accumulators stay on fixed columns, and each program writes one whole partial row.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    head, body = split_head(pid, N, stride, VEC)
    bmask = cols < body
    j = tl.arange(0, 2 * VEC)
    ecol = tl.where(j < VEC, j, head + body + (j - VEC))
    emask = tl.where(j < VEC, j < head, ecol < N)
    if HAS_W and NEED_DX:
        we = tl.load(w_ptr + ecol, mask=emask, other=0.0).to(tl.float32)
        if HOLD_W:
            w = tl.load(w_ptr + head + cols, mask=bmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], tl.float32)
    dwe_acc = tl.zeros([2 * VEC], tl.float32)
    for row in range(pid, M, num_progs):
        start = (pid * 0 + row).to(tl.int64) * stride  # (the interpreter's loop gives ints)
        first = ((start + (VEC - 1)) // VEC) * VEC  # a multiple of VEC, visibly
        x = tl.load(x_ptr + first + cols, mask=bmask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + first + cols, mask=bmask, other=0.0).to(tl.float32)
        xe = tl.load(x_ptr + start + ecol, mask=emask, other=0.0).to(tl.float32)
        dye = tl.load(dy_ptr + start + ecol, mask=emask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd  # masked lanes: x = dy = 0, nothing added to any sum
        xhe = xe * rstd
        if NEED_DX:
            if HAS_W:
                if not HOLD_W:
                    w = tl.load(w_ptr + head + cols, mask=bmask, other=0.0).to(tl.float32)
                g = dy * w
                ge = dye * we
            else:
                g = dy
                ge = dye
            c = (tl.sum(xhat * g, axis=0) + tl.sum(xhe * ge, axis=0)) / N
            tl.store(dx_ptr + first + cols, ((g - xhat * c) * rstd).to(dx_ptr.dtype.element_ty),
                     mask=bmask)
            tl.store(dx_ptr + start + ecol, ((ge - xhe * c) * rstd).to(dx_ptr.dtype.element_ty),
                     mask=emask)
        if NEED_DW:
            dw_acc += dy * xhat
            dwe_acc += dye * xhe
    if NEED_DW:
        out = part_ptr + pid.to(tl.int64) * N
        tl.store(out + head + cols, dw_acc.to(part_ptr.dtype.element_ty), mask=bmask)
        tl.store(out + ecol, dwe_acc.to(part_ptr.dtype.element_ty), mask=emask)


@triton.jit
def rms_bwd_dx_looped(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, N, stride_dy, stride_x, stride_dx,
    CHUNK: tl.constexpr, HAS_W: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    dy_row = dy_ptr + row.to(tl.int64) * stride_dy
    dx_row = dx_ptr + row.to(tl.int64) * stride_dx
    rstd = tl.load(rstd_ptr + row)
    lanes = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], tl.float32)
    for start in range(0, N, CHUNK):
        cols = start + lanes
        valid = cols < N
        x = tl.load(x_row + cols, mask=valid, other=0.0,
                    eviction_policy="evict_last").to(tl.float32)
        g = tl.load(dy_row + cols, mask=valid, other=0.0,
                    eviction_policy="evict_last").to(tl.float32)
        if HAS_W:
            g = g * tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        acc += (x * rstd) * g
    c = tl.sum(acc, axis=0) / N
    for start in range(0, N, CHUNK):
        cols = start + lanes
        valid = cols < N
        x = tl.load(x_row + cols, mask=valid, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        g = tl.load(dy_row + cols, mask=valid, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        if HAS_W:
            g = g * tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        dx = (g - (x * rstd) * c) * rstd
        tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=valid)


@triton.jit
def rms_bwd_dw_columns(
    dy_ptr, x_ptr, rstd_ptr, out_ptr, M, N, stride_dy, stride_x, rows_per_split,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # Program (column block, row split): out[split, cols] = Σ over the split's rows of dy·xhat,
    # float32 partials or (one split) dweight itself in its dtype.
    col_block = tl.program_id(0)
    split = tl.program_id(1)
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < N
    # 2-D accumulator reduced over rows once at the end (no cross-warp reduction per tile).
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    row_start = split * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, M)
    for r0 in range(row_start, row_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < row_end
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        dy = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        acc += dy * (x * rstd[:, None])
    tl.store(out_ptr + split.to(tl.int64) * N + cols,
             tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=col_ok)
