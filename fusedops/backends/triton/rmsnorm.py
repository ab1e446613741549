"""Triton RMSNorm: the forward's host code and the backend's RMSNorm entry points (the
backward's host code is ``rmsnorm_bwd.py``). Rules: ``configs/rmsnorm.py`` (``forward_config``,
``backward_config``); kernels: ``kernels/rmsnorm.py``, ``kernels/rmsnorm_split.py``.

RMSNorm is LayerNorm without the mean and the bias: rstd = 1 / sqrt(mean(x²) + eps) (float32),
y = x · rstd · weight. Bytes moved (the floor): forward reads x once and writes y once
(2·M·N·elt, plus the weight and 4·M bytes of rstd); backward reads x and dy once and writes dx
once (3·M·N·elt, plus the weight, rstd and the float32 dweight partials).

Unaligned rows (a row start not 16-byte aligned: N not a multiple of 16 bytes, e.g. 2^k + 1,
in a contiguous tensor) are read as an aligned body of 16-byte vectors plus scalar edges of
fewer than VEC elements each side (``configs.common.unaligned_vec``: one row stride for every
tensor of the call, aligned base pointers, not under deterministic algorithms; otherwise
scalar accesses), the kernels configured for the body (8192 at N = 8193).

* Forward, single-block (padded rows or bodies up to the ``ln_fwd`` single-block limit, 32K):
  ``ROWS`` whole rows per program in registers, one read and one write. Launch rules:
  ``FWD_RULES`` (measured for RMSNorm), else LayerNorm forward's (``row_config`` /
  ``unaligned_config`` / ``grid_size`` of kind ``ln_fwd``). ``STATS`` (constexpr) drops the
  rstd store for inference calls. With VEC a tile's rows share one misalignment, and calls of
  ``SHIFTED_W_MIN_ELEMS`` elements and more read the weight from copies shifted per
  misalignment (``shifted_weight``) so its loads are vectors too.
* Forward, unrolled (aligned rows a multiple of a rule's chunk, ``UNROLLED_FWD``, measured
  for RMSNorm: 16-bit 4K-256K, float32 8K and 16K): one program per row, the row length
  compile-time;
  pass 1 sums squares per lane over unrolled chunks (every chunk's loads in flight at once,
  the row kept in L2), pass 2 reads it again from L2 to write y.
* Forward, reload (unaligned 16-bit bodies of 4K-32K in large calls, ``RELOAD_VEC_FWD``): one
  row per program, the body read whole for the sum of squares, then again from L2 in chunks
  to write y, the weight from the shifted copies.
* Forward, unrolled over the aligned body (unaligned rows of large calls, ``UNROLLED_VEC_FWD``:
  bodies of 64K-256K): rms_fwd_unrolled's two passes over the body in vector chunks (the body
  length compile-time), the edges in one small tile kept in registers, the weight from the
  shifted copies.
* Forward, streamed pieces in clusters (aligned rows of 128K and 256K on Hopper,
  ``PIECES_FWD``): C = N / L programs of one thread-block cluster per row, each running the
  unrolled kernel's two passes on its piece of L elements, the sums of squares exchanged on
  chip between them (``runtime/clusters.py``); the pieces stay in L2 between the passes.
* Forward, staged pieces in clusters (aligned rows on Hopper, ``STAGED_FWD``): C = N / L CTAs
  of one thread-block cluster per row, each landing its piece of L elements in shared memory
  by ``cp.async`` (``kernels/staging.py``) and reading it there twice, for its sum of squares
  and for y, around the on-chip exchange: x is read from memory once. Calls it cannot take (x
  or the weight off a 16-byte boundary, y or the weight in another dtype) run the rules
  without it.
* Forward, split rows (rows no program holds, CUDA, ``SPLIT_FWD``: float32 and unaligned rows):
  C equal pieces in cooperating programs (``runtime/split.py``) each publish their sum of
  squares and wait for their row's: one read, one write; unaligned rows in pieces of their
  aligned body, piece 0 with the edges.
* Forward, looped (other long rows, and where split rows do not run): one program per row;
  pass 1 sums squares chunk by chunk (keeping the row in L2), pass 2 reads it again.
* Backward, fused (padded rows up to ``FUSED_BWD_MAX_BLOCK``): a persistent grid whose
  programs loop over row tiles, write dx and accumulate dweight in float32 registers, one
  partial row per program; LayerNorm's ``sum_partials`` adds them in a fixed order
  (deterministic: no atomics). With one program the partial row is dweight itself. Unaligned
  rows with bodies of 2K+ run ``rms_bwd_vec``: one row per iteration on a grid that is a
  multiple of VEC, so a program's weight and accumulator columns stay fixed.
* Backward, streamed pieces in clusters (calls with dx on Hopper, ``PIECES_BWD``: aligned
  16-bit rows of 32K-256K, float32 16K): C = N / L programs of one thread-block cluster per
  row on a persistent grid; each streams its piece of x and dy for its share of Σ x̂·w·dy, the
  shares are exchanged on chip, and a second pass over the piece (from L2) writes dx and adds
  to the piece's dweight accumulators, the only registers kept across rows.
* Backward, split rows (longer rows, CUDA): pieces exchange Σ x̂·w·dy (through global memory,
  or on Hopper, for aligned rows of 16K-64K, within a thread-block cluster), write their piece
  of dx and keep their columns' dweight partials in registers across rows; unaligned rows in
  aligned-body pieces.
* Backward, looped (where split rows do not run: the interpreter, a refused launch,
  ``SPLIT_ROWS_MIN``): dx from a looped row kernel and dweight from a column-blocked kernel
  (x and dy read twice in all).

dweight comes back in ``grad_dtypes[0]`` where given (not None): the float32 sum rounded once
in the kernel that finishes it; float32 otherwise.

Small inference calls of aligned contiguous rows replay their launch plan (``PlanCache``,
registered in ``fusedops._replay.RMSNORM``), as LayerNorm's do.
"""

from __future__ import annotations

import torch

from fusedops import _replay
from fusedops.backends.triton.configs.common import grid_size, num_row_tiles, unaligned_vec
from fusedops.backends.triton.configs.rmsnorm import (
    SHIFT_W_BLOCK,
    SHIFTED_W_MIN_ELEMS,
    FwdConfig,
    forward_config,
    hold_w,
    looped_config,
)
from fusedops.backends.triton.kernels.rmsnorm import (
    rms_fwd_looped,
    rms_fwd_reload_vec,
    rms_fwd_single,
    rms_fwd_unrolled,
    rms_fwd_unrolled_vec,
    shift_weight,
)
from fusedops.backends.triton.kernels.rmsnorm_split import rms_fwd_pieces, rms_fwd_split
from fusedops.backends.triton.kernels.rmsnorm_staged import rms_fwd_staged
from fusedops.backends.triton.rmsnorm_bwd import rmsnorm_backward
from fusedops.backends.triton.runtime.caches import signature_cache
from fusedops.backends.triton.runtime.clusters import ClusterLauncher, stageable
from fusedops.backends.triton.runtime.device import cdiv, next_pow2, rows_and_output
from fusedops.backends.triton.runtime.facts import device_facts
from fusedops.backends.triton.runtime.launcher import Launcher, current_stream, hooks_registered
from fusedops.backends.triton.runtime.plans import PlanCache, param_ptr
from fusedops.backends.triton.runtime.split import SplitLauncher, split_pieces

__all__ = ["rmsnorm_backward", "rmsnorm_forward", "rmsnorm_forward_y"]

_launch_fwd_single = Launcher(rms_fwd_single)
_launch_fwd_unrolled = Launcher(rms_fwd_unrolled)
_launch_fwd_unrolled_vec = Launcher(rms_fwd_unrolled_vec)
_launch_fwd_reload_vec = Launcher(rms_fwd_reload_vec)
_launch_fwd_looped = Launcher(rms_fwd_looped)
_launch_fwd_split = SplitLauncher(rms_fwd_split)
_launch_fwd_cluster = ClusterLauncher(rms_fwd_split)
_launch_fwd_pieces = ClusterLauncher(rms_fwd_pieces)
_launch_fwd_staged = ClusterLauncher(rms_fwd_staged)
_launch_shift_weight = Launcher(shift_weight)


# The launch of each call signature (row, element size, VEC, row alignment, device, whether
# the call is large), decided once by configs.rmsnorm.forward_config.
@signature_cache
def _fwd_config(n: int, elt_size: int, vec: int, aligned: bool, index: int,
                large: bool) -> FwdConfig:
    return forward_config(n, elt_size, vec, aligned, device_facts(index), large)


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


# Single-block and unrolled forward launches of aligned rows, per (shape, dtypes, device, eps,
# with_stats): see _forward. Inference plans are also replayed from the ops layer
# (fusedops._replay).
_fwd_plans = PlanCache(_replay.RMSNORM, _replay_runner)


def _replay_forward(plan, x, weight, out_dtype, with_stats: bool):
    """:func:`_forward` from a plan: the recorded launch (single-block or unrolled: both take
    (x, w, y, rstd, ...)) with this call's tensors; rstd has the rows the plan recorded."""
    go, grid, device, tail, rows = plan
    y = torch.empty_like(x, dtype=out_dtype)
    yp = y.data_ptr()
    wp = yp if weight is None else weight.data_ptr()
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device) if with_stats else None
    go(grid, current_stream(device), (x.data_ptr(), wp, yp, yp if rstd is None else
                                      rstd.data_ptr(), *tail))
    return y, rstd


def shifted_weight(weight: torch.Tensor, vec: int, n: int) -> tuple[torch.Tensor, int]:
    """(copies, row stride): a (vec, ld) tensor in the weight's dtype whose row h holds the
    (n,) ``weight`` from column h on, zero-padded to ``ld`` (a multiple of 16 elements)."""
    ld = cdiv(n, 16) * 16
    copies = torch.empty((vec, ld), dtype=weight.dtype, device=weight.device)
    _launch_shift_weight((vec, cdiv(ld, SHIFT_W_BLOCK)), (weight, copies, n, ld, SHIFT_W_BLOCK), 4)
    return copies, ld


def fwd_key(x, weight, eps, out_dtype, with_stats: bool) -> tuple | None:
    """The plan key of a forward call (``_fwd_plans``), None where it may not have a plan."""
    # Contiguous x and weight at 16-byte aligned addresses: the launch is fixed by shapes,
    # dtypes, device, eps and with_stats, so a call seen before replays its plan (PlanCache).
    return ((x.shape, x.dtype, out_dtype, x.get_device(), eps, with_stats,
             None if weight is None else weight.dtype)
            if x.is_contiguous() and not x.data_ptr() & 15
            and (weight is None or not weight.data_ptr() & 15) else None)


def _forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             out_dtype: torch.dtype, with_stats: bool):
    key = fwd_key(x, weight, eps, out_dtype, with_stats)
    plan = _fwd_plans.get(key)
    if plan is not None and not hooks_registered():
        return _replay_forward(plan, x, weight, out_dtype, with_stats)
    M, N, stride, y = rows_and_output(x, out_dtype)
    rstd = torch.empty((M,), dtype=torch.float32, device=x.device) if with_stats else None
    if M == 0 or N == 0:
        if rstd is not None:
            rstd.fill_(float("nan"))  # the mean of no squares, as the reference has it
        return y, rstd
    elt = x.element_size()
    vec = unaligned_vec(N, (stride, N), elt, (x, y))
    cfg = _fwd_config(N, elt, vec, (stride | N) % (16 // elt) == 0, x.get_device(),
                      M * N >= SHIFTED_W_MIN_ELEMS)
    has_w = weight is not None
    w, w_ld = (weight, 1) if has_w else (y, 1)  # placeholders are never read (HAS_W / STATS)
    if has_w and cfg.shifted_w:
        w, w_ld = shifted_weight(weight, cfg.vec, N)
    r = rstd if with_stats else y
    if cfg.cluster and cfg.kernel == "staged":
        if stageable(x, y, weight) and _forward_staged(x, w, y, r, M, N, stride, eps, has_w,
                                                       with_stats, cfg):
            return y, rstd
        cfg = cfg.fallback  # (another dtype or alignment, or refused as below)
    if cfg.cluster:
        run = _forward_pieces if cfg.kernel == "pieces" else _forward_split
        if run(x, w, y, r, M, N, stride, eps, has_w, with_stats, cfg):
            return y, rstd
        cfg = cfg.fallback  # (refused: a profiler's launch hooks, or clusters turned off)
    if cfg.kernel == "single":
        tiles = num_row_tiles(M, cfg.rows, cfg.vec)
        progs = (grid_size(tiles, cfg.warps, "ln_fwd", x.device, cfg.block, cfg.vec, True)
                 if cfg.persistent else tiles)
        args = (x, w, y, r, M, N, stride, N, eps, tiles, progs, w_ld,
                cfg.block, cfg.rows, has_w, hold_w(cfg.block, cfg.warps), with_stats, cfg.vec)
        _launch_fwd_single((progs,), args, cfg.warps)
        if key is not None and not cfg.vec:
            _fwd_plans.add(key, _launch_fwd_single, (progs,), args, cfg.warps, 4, M)
    elif cfg.kernel == "unrolled":
        args = (x, w, y, r, M, stride, N, eps, N, cfg.chunk, has_w, with_stats)
        _launch_fwd_unrolled((M,), args, cfg.warps)
        if key is not None:
            _fwd_plans.add(key, _launch_fwd_unrolled, (M,), args, cfg.warps, 4, M)
    elif cfg.kernel == "unrolled_vec":
        _launch_fwd_unrolled_vec((M,), (x, w, y, r, M, stride, eps, w_ld, N, cfg.block,
                                        cfg.chunk, has_w, with_stats, cfg.vec), cfg.warps)
    elif cfg.kernel == "reload_vec":
        _launch_fwd_reload_vec((M,), (x, w, y, r, N, stride, eps, w_ld, cfg.block, cfg.chunk,
                                      has_w, with_stats, cfg.vec), cfg.warps)
    else:
        _forward_long(x, w, y, r, M, N, stride, eps, has_w, with_stats, cfg)
    return y, rstd


def _forward_long(x, w, y, r, M, N, stride, eps, has_w, with_stats, cfg: FwdConfig) -> None:
    """Rows no program holds: the split-row kernel where it runs (aligned-body pieces for
    unaligned rows, else scalar pieces where no grid of C·VEC programs fits), else looped."""
    if cfg.kernel == "split":
        if _forward_split(x, w, y, r, M, N, stride, eps, has_w, with_stats, cfg):
            return
        if cfg.vec:
            elt = x.element_size()
            cfg = _fwd_config(N, elt, 0, (stride | N) % (16 // elt) == 0, x.get_device(), False)
            if cfg.kernel == "split" and _forward_split(x, w, y, r, M, N, stride, eps, has_w,
                                                        with_stats, cfg):
                return
    chunk, warps = looped_config()
    _launch_fwd_looped((M,), (x, w, y, r, N, stride, N, eps, chunk, has_w, with_stats), warps)


def _forward_split(x, w, y, r, M, N, stride, eps, has_w, with_stats, cfg: FwdConfig) -> bool:
    """rms_fwd_split on C pieces of the rows; False where no grid fits or the launch was
    refused (nothing written then)."""
    C, L = split_pieces(N, cfg.chunk, cfg.vec)
    consts = (next_pow2(L), C, next_pow2(C), has_w, with_stats, cfg.prefetch, cfg.vec)
    if cfg.cluster:  # (no counters or statistics: the exchange stays on chip)
        return bool(_launch_fwd_cluster(M * C, C, (x, w, y, r, r, r, N, L, stride, N, eps, M * C),
                                        (*consts, True), cfg.warps, x.device))
    stats = torch.empty((M * C,), dtype=torch.float32, device=x.device)
    count = torch.zeros((M,), dtype=torch.int32, device=x.device)
    return bool(_launch_fwd_split(
        M * C, C, (x, w, y, r, stats, count, N, L, stride, N, eps, M * C), (*consts, False),
        cfg.warps, x.device, vec=cfg.vec))


def _forward_pieces(x, w, y, r, M, N, stride, eps, has_w, with_stats, cfg: FwdConfig) -> bool:
    """rms_fwd_pieces in clusters of C = N / L programs; False where the launch was refused
    (nothing written then). The config's DeviceFacts already said clusters run here."""
    C = N // cfg.block
    return bool(_launch_fwd_pieces(
        M * C, C, (x, w, y, r, M, stride, N, eps),
        (N, cfg.block, cfg.chunk, C, C, has_w, with_stats), cfg.warps, x.device,
        progs=None if cfg.persistent else M * C))


def _forward_staged(x, w, y, r, M, N, stride, eps, has_w, with_stats, cfg: FwdConfig) -> bool:
    """rms_fwd_staged, one cluster of C = N / L CTAs per row; False where the launch was
    refused (nothing written then). The config's DeviceFacts already said clusters run here."""
    L = cfg.block
    C = N // L  # a cluster size: a power of two, its own C_P2
    return bool(_launch_fwd_staged(
        M * C, C, (x, w, y, r, stride, N, eps), (L, C, C, 32 * cfg.warps, has_w, with_stats),
        cfg.warps, x.device, progs=M * C, staged=L * x.element_size()))


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
