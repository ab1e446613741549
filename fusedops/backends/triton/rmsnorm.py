"""Triton RMSNorm kernels (forward; backward dx + dweight) and their launch wrappers.

RMSNorm is LayerNorm without the mean and the bias: rstd = 1 / sqrt(mean(x²) + eps) (float32),
y = x · rstd · weight. Bytes moved (the floor): forward reads x once and writes y once
(2·M·N·elt, plus the weight and 4·M bytes of rstd); backward reads x and dy once and writes dx
once (3·M·N·elt, plus the weight, rstd and the float32 dweight partials).

* Forward, single-block (padded rows up to the ``ln_fwd`` single-block limit, 32K): ``ROWS``
  whole rows per program in registers, float32 sum of squares, one read and one write. Launch
  rules: LayerNorm forward's (``row_config`` / ``grid_size`` of kind ``ln_fwd``: one program
  per row tile up to 8K columns, a persistent grid above), measured for LayerNorm, not yet for
  RMSNorm. ``STATS`` (constexpr) drops the rstd store for inference calls.
* Forward, looped (longer rows): one program per row; pass 1 sums squares chunk by chunk
  (keeping the row in L2), pass 2 reads it again and writes y.
* Backward, fused (padded rows up to ``FUSED_BWD_MAX_BLOCK``): a persistent grid whose
  programs loop over row tiles, write dx and accumulate dweight in float32 registers, one
  partial row per program; LayerNorm's ``sum_partials`` adds them in a fixed order
  (deterministic: no atomics). With one program the partial row is dweight itself.
* Backward, longer rows: dx from a looped row kernel (two passes over the row: the sum, then
  dx) and dweight from a column-blocked kernel (x and dy read twice in all).

dweight comes back in ``grad_dtypes[0]`` where given (not None): the float32 sum rounded once
in the kernel that finishes it; float32 otherwise.

Small inference calls replay their launch plan (``PlanCache``, registered in
``fusedops._replay.RMSNORM``), as LayerNorm's do. Not done (LayerNorm has them): the body/edge
split for rows not starting 16-byte aligned (those run with scalar accesses) and split-row
cooperative kernels for long rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedops import _replay
from fusedops.backends.triton.configs.common import grid_size, row_config, single_block_limit
from fusedops.backends.triton.runtime.device import cdiv, next_pow2, num_sms, rows_and_output
from fusedops.backends.triton.runtime.launcher import Launcher, current_stream, hooks_registered
from fusedops.backends.triton.runtime.partials import reduce_partials
from fusedops.backends.triton.runtime.plans import PlanCache, param_ptr


@triton.jit
def _rms_fwd_single(
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
def _rms_fwd_looped(
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
def _rms_bwd_single(
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
def _rms_bwd_dx_looped(
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
def _rms_bwd_dw_columns(
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


_launch_fwd_single = Launcher(_rms_fwd_single)
_launch_fwd_looped = Launcher(_rms_fwd_looped)
_launch_bwd_single = Launcher(_rms_bwd_single)
_launch_dx_looped = Launcher(_rms_bwd_dx_looped)
_launch_dw_columns = Launcher(_rms_bwd_dw_columns)

# The weight stays in registers across a program's row tiles while each thread holds at most
# this many row elements (LayerNorm's measured rule, FWD_HOLD_W_MAX_PER_THREAD).
HOLD_W_MAX_PER_THREAD = 32


def hold_w(block: int, warps: int) -> bool:
    return warps <= 16 and block // (32 * warps) <= HOLD_W_MAX_PER_THREAD


# The backward's tiles and warps are LayerNorm's measured ones (layernorm.fused_bwd_config),
# not re-tuned for RMSNorm; only the fused kernel's row limit was measured (below).
# Padded rows up to this many elements take the fused backward (the row, dy and the dweight
# accumulator in registers); longer rows the looped dx kernel plus the column kernel.
# H200, TB/s: 16K rows fused 2.46 vs 2.37 looped + columns (bf16), 3.47 vs 2.12 (float32);
# 32K rows spill in one program (0.21-0.52). Rows with N not a multiple of 16 (scalar
# accesses, up to half the padded row masked off) take it on 32 warps (8193: bf16 1.11 vs 0.78
# on 16 warps and 0.74 looped; float32 2.03 vs 1.24 and 1.44).
FUSED_BWD_MAX_BLOCK = 16384
FUSED_BWD_MAX_BLOCK_UNALIGNED = 16384
# Chunk of the looped kernels (elements per iteration; smaller while tests shrink the
# single-block limit, so short rows loop over several chunks).
LOOPED_CHUNK = 8192
# The dweight column kernel: (columns, rows) per iteration, warps, programs per SM.
COLUMN_TILE = (128, 64)
COLUMN_WARPS = 16
COLUMN_PER_SM = 2


# 16-bit rows (N a multiple of 16): (ROWS, num_warps, programs per SM, ACC_1D) by padded row,
# measured (H200, TB/s against LayerNorm's rule): 1K 3.46 vs 3.35, 2K 3.46
# vs 3.35, 8K 3.57 vs 3.48 (bf16; fp16 alike).
BWD_RULES_16BIT: dict[int, tuple[int, int, int, bool]] = {
    1024: (2, 4, 4, False), 2048: (1, 4, 4, True), 8192: (2, 32, 1, True),
}


def _bwd_config(block: int, elt_size: int, aligned: bool = True) -> tuple[int, int, int, bool]:
    """(ROWS, num_warps, programs per SM, ACC_1D) of the fused backward for padded rows of
    ``block`` elements of ``elt_size`` bytes: 4K-element tiles at two programs per SM up to 2K
    columns (a (ROWS, BLOCK) accumulator up to 1K), 16K-element tiles (float32 rows of 4K+:
    8K) at one 16-warp program per SM above (LayerNorm's measured rule); measured for RMSNorm:
    16-bit rows in BWD_RULES_16BIT, rows of 8K-16K that are not ``aligned`` (N not a multiple
    of 16) on 32 warps (see above)."""
    if not aligned and block == 16384:
        return 1, 32, 1, True
    if aligned and elt_size == 2 and block in BWD_RULES_16BIT:
        return BWD_RULES_16BIT[block]
    if elt_size == 4 and block >= 4096:
        tile, per_sm, acc_1d = 8192, 1, True
    elif block <= 2048:
        tile, per_sm, acc_1d = 4096, 2, block > 1024
    else:
        tile, per_sm, acc_1d = 16384, 1, True
    tile = max(tile, block)
    return tile // block, max(4, min(16, tile // 512)), per_sm, acc_1d


# Forward launch rules measured for RMSNorm: (element size, padded row) -> (ROWS, num_warps,
# persistent grid); other rows take LayerNorm forward's rules (row_config, kind "ln_fwd").
# H200 (TB/s, copy 4.22-4.25; LayerNorm's rule in brackets): bf16 4K 4 rows x 8 warps 4.03
# [3.98], 8K 2 x 8 4.04 [3.96]; float32 8K 1 x 8 4.10 [4.03], 16K 2 x 16 4.10 [3.90], 32K
# 1 x 32 3.90 [3.85]. Rows with N not a multiple of 16 keep LayerNorm's rules (8193: 1.75
# [1.16-1.58 on these]). Not kept: 16-bit 16K on 1 x 32, faster for the forward with rstd
# (3.91 [3.22]) but not for the inference forward
# (benchmarks/results/h200/rmsnorm.json, which ran it: 0.65-0.68 of copy, behind compile).
FWD_RULES: dict[tuple[int, int], tuple[int, int, bool]] = {
    (2, 4096): (4, 8, False), (2, 8192): (2, 8, False),
    (4, 8192): (1, 8, False), (4, 16384): (2, 16, False), (4, 32768): (1, 32, False),
}


def _looped_config() -> tuple[int, int]:
    """(CHUNK, num_warps) of the looped kernels: 16 warps for 8K chunks (untuned)."""
    chunk = min(single_block_limit(), LOOPED_CHUNK)
    return chunk, max(1, min(16, chunk // 512))


def _replay_runner(key: tuple, plan: tuple):
    """The ``fusedops._replay.RMSNORM`` entry for a new inference forward plan (out dtype = x's
    dtype, no rstd)."""
    shape, dtype, out_dtype, device, eps, with_stats, w_dtype = key
    if out_dtype is not dtype or with_stats:
        return None
    (launch, function, coop, pdl, metadata), (g,), tail = plan[0].c_entry, plan[1], plan[3]
    n = shape[-1]

    def run(x: torch.Tensor, weight) -> torch.Tensor | None:
        p = x.data_ptr()
        if p & 15 or not x.is_contiguous() or not x.is_cuda or hooks_registered():
            return None
        wp = param_ptr(weight, w_dtype, n, device)
        if wp < 0:
            return None
        y = torch.empty_like(x)
        yp = y.data_ptr()
        # An absent weight and the absent rstd: y's address as the placeholder (never read).
        launch(g, 1, 1, current_stream(device), function, coop, pdl, None, None, metadata, None,
               None, None, p, wp or yp, yp, yp, *tail)
        return y
    return (shape, dtype, device, eps), run


# Single-block forward launches, per (shape, dtypes, device, eps, with_stats): see _forward.
# Inference plans are also replayed from the ops layer (fusedops._replay).
_fwd_plans = PlanCache(_replay.RMSNORM, _replay_runner)


def _replay_forward(plan, x, weight, out_dtype, with_stats: bool):
    """:func:`_forward` from a plan: the single-block launch with this call's tensors."""
    go, grid, device, tail = plan
    y = torch.empty_like(x, dtype=out_dtype)
    yp = y.data_ptr()
    wp = yp if weight is None else weight.data_ptr()
    rstd = torch.empty((tail[0],), dtype=torch.float32, device=x.device) if with_stats else None
    go(grid, current_stream(device), (x.data_ptr(), wp, yp, yp if rstd is None else
                                      rstd.data_ptr(), *tail))
    return y, rstd


def _forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             out_dtype: torch.dtype, with_stats: bool):
    # Contiguous x and weight at 16-byte aligned addresses: the launch is fixed by shapes,
    # dtypes, device, eps and with_stats, so a call seen before replays its plan (PlanCache).
    key = ((x.shape, x.dtype, out_dtype, x.get_device(), eps, with_stats,
            None if weight is None else weight.dtype)
           if x.is_contiguous() and not x.data_ptr() & 15
           and (weight is None or not weight.data_ptr() & 15) else None)
    plan = _fwd_plans.get(key)
    if plan is not None and not hooks_registered():
        return _replay_forward(plan, x, weight, out_dtype, with_stats)
    M, N, stride, y = rows_and_output(x, out_dtype)
    rstd = torch.empty((M,), dtype=torch.float32, device=x.device) if with_stats else None
    if M == 0 or N == 0:
        if rstd is not None:
            rstd.fill_(float("nan"))  # the mean of no squares, as the reference has it
        return y, rstd
    has_w = weight is not None
    w = weight if has_w else y  # placeholders are never read (HAS_W / STATS are constexpr)
    r = rstd if with_stats else y
    single, block, rows, warps = row_config(N, "ln_fwd", x.element_size())
    if single:
        tiles = cdiv(M, rows)
        # (measured on rows of whole 16-element groups; 2^k + 1 rows keep LayerNorm's rules)
        rule = FWD_RULES.get((x.element_size(), block)) if N % 16 == 0 else None
        if rule is None:
            progs = grid_size(tiles, warps, "ln_fwd", x.device, block)
        else:
            rows, warps, persistent = rule
            tiles = cdiv(M, rows)
            progs = (grid_size(tiles, warps, "ln_fwd", x.device, block, persistent=True)
                     if persistent else tiles)
        args = (x, w, y, r, M, N, stride, N, eps, tiles, progs,
                block, rows, has_w, hold_w(block, warps), with_stats)
        _launch_fwd_single((progs,), args, warps)
        if key is not None:
            _fwd_plans.add(key, _launch_fwd_single, (progs,), args, warps, 4)
    else:
        chunk, warps = _looped_config()
        _launch_fwd_looped((M,), (x, w, y, r, N, stride, N, eps, chunk, has_w, with_stats),
                           warps)
    return y, rstd


def rmsnorm_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row RMSNorm. x: (M, N) float32/float16/bfloat16, unit column stride, any row stride;
    weight: contiguous (N,) in x's dtype or float32, or None.

    Returns y = x · rstd · weight, (M, N) contiguous of ``out_dtype`` (computed in float32,
    rounded once), and rstd = 1 / sqrt(mean(x²) + eps), (M,) float32.
    """
    return _forward(x, weight, eps, out_dtype, True)


def rmsnorm_forward_y(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`rmsnorm_forward` for calls that need no backward: returns only y (no rstd buffer
    is allocated or written)."""
    return _forward(x, weight, eps, out_dtype, False)[0]


def rmsnorm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
    grad_dtypes: tuple[torch.dtype | None, ...] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of row RMSNorm. dy, x: (M, N) float32/float16/bfloat16, unit column stride,
    any row strides; weight: contiguous (N,) or None; rstd: (M,) float32 from the forward.

    With xhat = x · rstd and g = weight · dy: dx = rstd · (g − xhat · mean(xhat · g)), (M, N)
    contiguous in x's dtype; dw = Σ_rows dy · xhat, (N,) in ``grad_dtypes[0]`` where given
    (not None), else float32. Each is None where not needed. Bitwise reproducible: the grid
    and the summation order depend on the shapes only.
    """
    M, N = x.shape
    dev = x.device
    dw_dtype = grad_dtypes[0] if grad_dtypes and grad_dtypes[0] is not None else torch.float32
    dx = torch.empty((M, N), dtype=x.dtype, device=dev) if need_dx else None
    dw = torch.empty((N,), dtype=dw_dtype, device=dev) if need_dw else None
    if M == 0 or N == 0 or not (need_dx or need_dw):
        if dw is not None:
            dw.zero_()
        return dx, dw
    has_w = weight is not None
    w = weight if has_w else x  # a placeholder, never read
    if not rstd.is_contiguous():
        rstd = rstd.contiguous()
    block = next_pow2(N)
    limit = FUSED_BWD_MAX_BLOCK if N % 16 == 0 else FUSED_BWD_MAX_BLOCK_UNALIGNED
    if block <= min(limit, single_block_limit()):
        rows, warps, per_sm, acc_1d = _bwd_config(block, x.element_size(), N % 16 == 0)
        tiles = cdiv(M, rows)
        progs = min(tiles, num_sms(dev) * per_sm)
        if not need_dw:
            part = x  # placeholder
        elif progs == 1:
            part = dw  # one program: its partial row is dweight
        else:
            part = torch.empty((progs, N), dtype=torch.float32, device=dev)
        _launch_bwd_single((progs,), (
            dy, x, w, rstd, dx if need_dx else x, part, M, N, dy.stride(0), x.stride(0), N,
            tiles, progs,
            block, rows, has_w, hold_w(block, warps), need_dx, need_dw, acc_1d,
        ), warps)
        if need_dw and progs > 1:
            reduce_partials(part.view(1, progs, N), True, False, out=(dw, None))
        return dx, dw
    if need_dx:
        chunk, warps = _looped_config()
        _launch_dx_looped((M,), (
            dy, x, w, rstd, dx, N, dy.stride(0), x.stride(0), N, chunk, has_w,
        ), warps)
    if need_dw:
        _dw_columns(dy, x, rstd, dw)
    return dx, dw


def _dw_columns(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, dw: torch.Tensor) -> None:
    """dweight from the column kernel: the fewest row splits giving COLUMN_PER_SM programs per
    SM, each a (row split, column block) tile; more than one split writes float32 partials,
    summed in a fixed order."""
    M, N = x.shape
    block_c, block_r = COLUMN_TILE
    col_blocks = cdiv(N, block_c)
    splits = max(1, min(cdiv(M, block_r), cdiv(COLUMN_PER_SM * num_sms(x.device), col_blocks)))
    rows_per_split = cdiv(cdiv(M, splits), block_r) * block_r
    splits = cdiv(M, rows_per_split)
    out = dw if splits == 1 else torch.empty((splits, N), dtype=torch.float32, device=x.device)
    _launch_dw_columns((col_blocks, splits), (
        dy, x, rstd, out, M, N, dy.stride(0), x.stride(0), rows_per_split, block_c, block_r,
    ), COLUMN_WARPS)
    if splits > 1:
        reduce_partials(out.view(1, splits, N), True, False, out=(dw, None))
