"""Triton RMSNorm backward: the host code that picks a kernel (``configs/rmsnorm.py``,
:func:`backward_config`) and launches it; the paths are described in ``rmsnorm.py``'s
docstring, the kernels are in ``kernels/rmsnorm.py`` and ``kernels/rmsnorm_split.py``.
"""

from __future__ import annotations

import torch

from fusedops import _replay
from fusedops.backends.triton.configs import rmsnorm as rules
from fusedops.backends.triton.configs.common import unaligned_vec
from fusedops.backends.triton.kernels.rmsnorm import (
    rms_bwd_dw_columns,
    rms_bwd_dx_looped,
    rms_bwd_single,
    rms_bwd_vec,
)
from fusedops.backends.triton.kernels.rmsnorm_split import rms_bwd_pieces, rms_bwd_split
from fusedops.backends.triton.runtime.caches import signature_cache
from fusedops.backends.triton.runtime.clusters import ClusterLauncher, clusters_enabled
from fusedops.backends.triton.runtime.device import cdiv, next_pow2, num_sms
from fusedops.backends.triton.runtime.facts import device_facts
from fusedops.backends.triton.runtime.launcher import Launcher, hooks_registered
from fusedops.backends.triton.runtime.partials import reduce_partials
from fusedops.backends.triton.runtime.plans import SequencePlans, replay_runner
from fusedops.backends.triton.runtime.recording import mark_replayable, record_launches
from fusedops.backends.triton.runtime.split import SplitLauncher, split_pieces

_launch_bwd_single = Launcher(rms_bwd_single)
_launch_bwd_vec = Launcher(rms_bwd_vec)
_launch_dx_looped = Launcher(rms_bwd_dx_looped)
_launch_dw_columns = Launcher(rms_bwd_dw_columns)
_launch_bwd_pieces = ClusterLauncher(rms_bwd_pieces)
# Split-row launchers by register cap (see SPLIT_BWD): cooperative grids and clusters.
_split_launchers: dict[int | None, SplitLauncher] = {}
_cluster_launchers: dict[int | None, ClusterLauncher] = {}


# The launch of each call signature (row, element size, VEC, row alignment, device), decided
# once by configs.rmsnorm.backward_config.
@signature_cache
def _bwd_config(n: int, elt_size: int, vec: int, aligned: bool, index: int) -> rules.BwdConfig:
    return rules.backward_config(n, elt_size, vec, aligned, device_facts(index))


def split_launcher(maxnreg: int | None) -> SplitLauncher:
    """The cooperative-grid launcher of rms_bwd_split with this register cap."""
    launcher = _split_launchers.get(maxnreg)
    if launcher is None:
        launcher = _split_launchers[maxnreg] = SplitLauncher(rms_bwd_split, maxnreg=maxnreg)
    return launcher


def cluster_launcher(maxnreg: int | None) -> ClusterLauncher:
    """The thread-block cluster launcher of rms_bwd_split with this register cap."""
    launcher = _cluster_launchers.get(maxnreg)
    if launcher is None:
        launcher = _cluster_launchers[maxnreg] = ClusterLauncher(rms_bwd_split, maxnreg=maxnreg)
    return launcher


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
    and the summation order depend on the shapes (and, for rows that do not start 16-byte
    aligned, on their alignment) only.

    A call whose signature ran before through launches alone (the persistent row kernels and
    the column kernel, with their partials' sum) is replayed from them, as LayerNorm's
    backward is; only calls that give ``grad_dtypes`` (the eager autograd path) make and use
    plans.
    """
    if grad_dtypes is None:
        return _backward(dy, x, weight, rstd, need_dx, need_dw, grad_dtypes)[:2]
    key = bwd_key(dy, x, weight, rstd, need_dx, need_dw, grad_dtypes)
    plan = _bwd_plans.get(key)
    if plan and not hooks_registered():
        return plan(dy, x, weight, rstd)
    if plan is False:
        return _backward(dy, x, weight, rstd, need_dx, need_dw, grad_dtypes)[:2]
    with record_launches() as record:
        dx, dw, scratch = _backward(dy, x, weight, rstd, need_dx, need_dw, grad_dtypes)
    _bwd_plans.put(key, replay_runner(record, (dy, x, weight, rstd), (dx, dw), scratch)
                   or False)
    return dx, dw


# Backward replay plans (see runtime/recording.py) per call signature: what the launch rules
# read (shapes, row strides, dtypes, 16-byte alignment of every pointer, the gradients needed,
# the device).
_bwd_plans = SequencePlans(_replay.RMSNORM_NODE)  # (nodes made from these plans go with them)


def bwd_key(dy, x, weight, rstd, need_dx, need_dw, grad_dtypes) -> tuple:
    """The plan key of a backward call (``_bwd_plans``)."""
    return (*x.shape, x.stride(0), dy.stride(0), x.dtype, dy.dtype, x.data_ptr() & 15,
            dy.data_ptr() & 15, rstd.data_ptr() & 15, rstd.is_contiguous(),
            None if weight is None else (weight.dtype, weight.data_ptr() & 15),
            need_dx, need_dw, grad_dtypes, x.get_device())


def _backward(dy, x, weight, rstd, need_dx, need_dw, grad_dtypes):
    """:func:`rmsnorm_backward` through the launch rules: ``(dx, dw, scratch)``, scratch the
    temporaries its launches wrote (for ``replay_runner``)."""
    M, N = x.shape
    dev = x.device
    dw_dtype = grad_dtypes[0] if grad_dtypes and grad_dtypes[0] is not None else torch.float32
    dx = torch.empty((M, N), dtype=x.dtype, device=dev) if need_dx else None
    dw = torch.empty((N,), dtype=dw_dtype, device=dev) if need_dw else None
    if M == 0 or N == 0 or not (need_dx or need_dw):
        if dw is not None:
            dw.zero_()
        return dx, dw, ()
    w = weight if weight is not None else x  # a placeholder, never read
    if not rstd.is_contiguous():
        rstd = rstd.contiguous()
    elt = x.element_size()
    strides = (dy.stride(0), x.stride(0), N)
    vec = unaligned_vec(N, strides, elt, (dy, x))
    aligned = all(s % (16 // elt) == 0 for s in strides)
    cfg = _bwd_config(N, elt, vec, aligned, x.get_device())
    call = (dy, x, w, weight is not None, rstd, dx, dw)
    if cfg.kernel == "pieces":
        if need_dx and _pieces(*call, cfg):
            return dx, dw, ()  # (a cluster launch: no plan)
        cfg = cfg.fallback  # (dweight alone, or refused: a profiler's launch hooks)
    if cfg.kernel == "fused" and cfg.vec:
        scratch = _fused_vec(*call, cfg)
        if scratch is not None:
            mark_replayable()
            return dx, dw, scratch
    if cfg.kernel == "split" and _split(*call, cfg):
        return dx, dw, ()  # (cooperative or clustered, counters zeroed by torch: no plan)
    if cfg.vec:  # no grid of a multiple of VEC programs fits: scalar accesses
        cfg = _bwd_config(N, elt, 0, aligned, x.get_device())
        if cfg.kernel == "split" and _split(*call, cfg):
            return dx, dw, ()
    if cfg.kernel == "fused":
        scratch = _fused(*call, cfg)
        mark_replayable()
        return dx, dw, scratch
    if need_dx:
        chunk, warps = rules.looped_config()
        _launch_dx_looped((M,), (
            dy, x, w, rstd, dx, N, dy.stride(0), x.stride(0), N, chunk, weight is not None,
        ), warps)
    scratch = _dw_columns(dy, x, rstd, dw) if need_dw else ()
    mark_replayable()
    return dx, dw, scratch


def _partials(progs: int, dw: torch.Tensor | None, x: torch.Tensor) -> tuple:
    """``(where, scratch)``: where a kernel with ``progs`` programs writes its dweight
    partial rows (float32 scratch, dweight itself for one program, ``x`` as a placeholder
    without dweight), and the scratch made for it (a tuple, empty or of that tensor)."""
    if dw is None or progs == 1:
        return (x if dw is None else dw), ()
    part = torch.empty((progs, x.shape[1]), dtype=torch.float32, device=x.device)
    return part, (part,)


def _fused(dy, x, w, has_w, rstd, dx, dw, cfg: rules.BwdConfig) -> tuple:
    """rms_bwd_single: a persistent grid over row tiles, one partial dweight row per program
    (summed in a fixed order: deterministic, no atomics). Returns its scratch (see
    :func:`_partials`)."""
    M, N = x.shape
    tiles = cdiv(M, cfg.rows)
    progs = min(tiles, num_sms(x.device) * cfg.per_sm)
    part, scratch = _partials(progs, dw, x)
    _launch_bwd_single((progs,), (
        dy, x, w, rstd, x if dx is None else dx, part, M, N, dy.stride(0), x.stride(0), N,
        tiles, progs,
        cfg.block, cfg.rows, has_w, rules.hold_w(cfg.block, cfg.warps), dx is not None,
        dw is not None, cfg.acc_1d, cfg.stages,
    ), cfg.warps)
    if dw is not None and progs > 1:
        reduce_partials(part.view(1, progs, N), True, False, out=(dw, None))
    return scratch


def _fused_vec(dy, x, w, has_w, rstd, dx, dw, cfg: rules.BwdConfig) -> tuple | None:
    """rms_bwd_vec (unaligned rows, one per iteration) on a grid that is a multiple of VEC or
    has one row per program: its scratch (see :func:`_partials`); None where neither fits
    (nothing launched)."""
    M, N = x.shape
    progs = min(M, num_sms(x.device) * cfg.per_sm)
    if progs < M:
        progs = progs // cfg.vec * cfg.vec
        if not progs:
            return None
    part, scratch = _partials(progs, dw, x)
    _launch_bwd_vec((progs,), (
        dy, x, w, rstd, x if dx is None else dx, part, M, N, x.stride(0), progs,
        cfg.block, has_w, rules.hold_w(cfg.block, cfg.warps), dx is not None, dw is not None,
        cfg.vec,
    ), cfg.warps)
    if dw is not None and progs > 1:
        reduce_partials(part.view(1, progs, N), True, False, out=(dw, None))
    return scratch


def _split(dy, x, w, has_w, rstd, dx, dw, cfg: rules.BwdConfig) -> bool:
    """rms_bwd_split on C pieces per row: in thread-block clusters where the config asks for
    them and the device allows (calls with dx, aligned rows), else on a cooperative grid; a
    failed cluster launch (clusters are then off) retries the same pieces cooperatively.
    False where no grid fits or the launch was refused (nothing written then)."""
    M, N = x.shape
    dev = x.device
    need_dx = dx is not None
    C, L = split_pieces(N, cfg.chunk, cfg.vec)
    clustered = (cfg.cluster and need_dx and not cfg.vec
                 and clusters_enabled(dev, N, cfg.chunk, C))
    if clustered:  # (no counters or statistics: the exchange stays on chip)
        launcher, stats, count = cluster_launcher(cfg.maxnreg), rstd, rstd
    else:
        launcher = split_launcher(cfg.maxnreg)
        stats = torch.empty((M * C,), dtype=torch.float32, device=dev) if need_dx else rstd
        count = torch.zeros((M,), dtype=torch.int32, device=dev) if need_dx else rstd
    # rstd stands in for the partials (same dtype and alignment) until their rows are known.
    args = [dy, x, w, rstd, dx if need_dx else x, rstd, stats, count, N, L, dy.stride(0),
            x.stride(0), N, M * C]
    consts = (next_pow2(L), C, next_pow2(C), has_w, need_dx, dw is not None, cfg.prefetch,
              cfg.vec, clustered)
    progs = launcher.programs(M * C, C, tuple(args), consts, cfg.warps, dev, cfg.vec)
    if not progs:
        return False if not clustered else _split(dy, x, w, has_w, rstd, dx, dw,
                                                  cfg._replace(cluster=False))
    part = (torch.empty((progs // C, N), dtype=torch.float32, device=dev) if dw is not None
            else rstd)
    args[5] = part
    if not launcher(M * C, C, tuple(args), consts, cfg.warps, dev, progs, cfg.vec):
        return False if not clustered else _split(dy, x, w, has_w, rstd, dx, dw,
                                                  cfg._replace(cluster=False))
    if dw is not None:
        reduce_partials(part.view(1, progs // C, N), True, False, out=(dw, None))
    return True


def _pieces(dy, x, w, has_w, rstd, dx, dw, cfg: rules.BwdConfig) -> bool:
    """rms_bwd_pieces in clusters of C = N / L programs on a persistent grid, one partial
    dweight row per cluster; False where the launch was refused (nothing written then)."""
    M, N = x.shape
    C = N // cfg.block
    runtime = (dy, x, w, rstd, dx, rstd, M, dy.stride(0), x.stride(0), N)
    consts = (N, cfg.block, cfg.chunk, C, C, has_w, dw is not None)
    progs = 0 if hooks_registered() else _launch_bwd_pieces.programs(
        M * C, C, runtime, consts, cfg.warps, x.device)
    if not progs:
        return False
    part = (torch.empty((progs // C, N), dtype=torch.float32, device=x.device)
            if dw is not None else rstd)
    if not _launch_bwd_pieces(M * C, C, (*runtime[:5], part, *runtime[6:]), consts, cfg.warps,
                              x.device, progs):
        return False
    if dw is not None:
        reduce_partials(part.view(1, progs // C, N), True, False, out=(dw, None))
    return True


def _dw_columns(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, dw: torch.Tensor
                ) -> tuple:
    """dweight from the column kernel: the fewest row splits giving COLUMN_PER_SM programs per
    SM, each a (row split, column block) tile; more than one split writes float32 partials,
    summed in a fixed order (returned as the scratch, for ``replay_runner``)."""
    M, N = x.shape
    block_c, block_r = rules.COLUMN_TILE
    col_blocks = cdiv(N, block_c)
    splits = max(1, min(cdiv(M, block_r),
                        cdiv(rules.COLUMN_PER_SM * num_sms(x.device), col_blocks)))
    rows_per_split = cdiv(cdiv(M, splits), block_r) * block_r
    splits = cdiv(M, rows_per_split)
    out = dw if splits == 1 else torch.empty((splits, N), dtype=torch.float32, device=x.device)
    _launch_dw_columns((col_blocks, splits), (
        dy, x, rstd, out, M, N, dy.stride(0), x.stride(0), rows_per_split, block_c, block_r,
    ), rules.COLUMN_WARPS)
    if splits > 1:
        reduce_partials(out.view(1, splits, N), True, False, out=(dw, None))
        return (out,)
    return ()
