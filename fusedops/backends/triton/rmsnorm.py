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

from fusedops import _replay
from fusedops.backends.triton.configs.common import grid_size, row_config, single_block_limit
from fusedops.backends.triton.configs.rmsnorm import (
    COLUMN_PER_SM,
    COLUMN_TILE,
    COLUMN_WARPS,
    FUSED_BWD_MAX_BLOCK,
    FUSED_BWD_MAX_BLOCK_UNALIGNED,
    FWD_RULES,
    bwd_config,
    hold_w,
    looped_config,
)
from fusedops.backends.triton.kernels.rmsnorm import (
    rms_bwd_dw_columns,
    rms_bwd_dx_looped,
    rms_bwd_single,
    rms_fwd_looped,
    rms_fwd_single,
)
from fusedops.backends.triton.runtime.device import cdiv, next_pow2, num_sms, rows_and_output
from fusedops.backends.triton.runtime.launcher import Launcher, current_stream, hooks_registered
from fusedops.backends.triton.runtime.partials import reduce_partials
from fusedops.backends.triton.runtime.plans import PlanCache, param_ptr

_launch_fwd_single = Launcher(rms_fwd_single)
_launch_fwd_looped = Launcher(rms_fwd_looped)
_launch_bwd_single = Launcher(rms_bwd_single)
_launch_dx_looped = Launcher(rms_bwd_dx_looped)
_launch_dw_columns = Launcher(rms_bwd_dw_columns)


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
        chunk, warps = looped_config()
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
        rows, warps, per_sm, acc_1d = bwd_config(block, x.element_size(), N % 16 == 0)
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
        chunk, warps = looped_config()
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
