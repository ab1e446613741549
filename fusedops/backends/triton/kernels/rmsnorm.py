"""RMSNorm kernels (``@triton.jit`` only); the rules that pick them: ``configs/rmsnorm.py``."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_fwd_single(
    x_ptr, w_ptr, y_ptr, rstd_ptr, M, N, stride_x, stride_y, eps, num_tiles, num_progs,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_W: tl.constexpr, HOLD_W: tl.constexpr,
    STATS: tl.constexpr,
):
    # HOLD_W: the weight stays in registers across a program's tiles (short rows); long rows
    # reload it per tile from L2 rather than spill (see hold_w).
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_W and HOLD_W:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    for tile in range(pid, num_tiles, num_progs):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        ms = tl.sum(x * x, axis=1) / N
        # An infinite mean square (an inf in the row, or squares beyond float32) gives rstd 0,
        # as torch's rms_norm and the reference: finite elements 0, the inf itself NaN.
        rstd = 1.0 / tl.sqrt(ms + eps)
        y = x * rstd[:, None]
        if HAS_W:
            if not HOLD_W:
                w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            y = y * w
        tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=mask)
        if STATS:
            tl.store(rstd_ptr + rows, rstd, mask=row_ok)


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
        acc += x * x
    ms = tl.sum(acc, axis=0) / N
    rstd = 1.0 / tl.sqrt(ms + eps)  # 0 for an infinite mean square, as torch
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
def rms_bwd_single(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, part_ptr, M, N, stride_dy, stride_x, stride_dx,
    num_tiles, num_progs,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_W: tl.constexpr, HOLD_W: tl.constexpr,
    NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, ACC_1D: tl.constexpr,
):
    # NEED_DW: part_ptr is (num_progs, N), float32 partials (or, with one program, dweight in
    # its own dtype). ACC_1D folds each tile's rows into a (BLOCK_N,) accumulator at once (fewer
    # registers, for long rows); otherwise a (ROWS, BLOCK_N) one is reduced over rows once at
    # the end (no cross-warp reduction per tile, for short rows).
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_W and NEED_DX and HOLD_W:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ACC_1D:
        dw_acc = tl.zeros([BLOCK_N], tl.float32)
    else:
        dw_acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for tile in range(pid, num_tiles, num_progs):
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
