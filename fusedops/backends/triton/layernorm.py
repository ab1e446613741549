"""Triton LayerNorm kernels (forward; backward dx + dweight/dbias) and their launch wrappers.

Bytes moved (the floor): forward reads x once, writes y once (2·M·N·elt) plus the weights and
8·M bytes of float32 mean/rstd; backward reads x and dy once and writes dx once (3·M·N·elt) plus
the weights, mean/rstd and the float32 dweight/dbias partials.

* Forward, single-block: ``ROWS`` whole rows per program in registers; mean about the row's
  first element, variance from registers.
* Forward, split-row (long rows, CUDA): equal pieces in cooperating programs publish (mean, M2),
  merged with Chan's formula; one read, one write.
* Forward, looped: pass 1 streams the row keeping per-lane shifted sums, merged across lanes
  with Chan's formula; pass 2 normalises and writes.
* Forward, unrolled (aligned rows a multiple of a rule's chunk, ``UNROLLED_FWD``): the row
  length compile-time, pass 1 streams it in unrolled chunks keeping per-lane shifted sums,
  pass 2 re-reads it from L2 and writes y; statistics as offsets from the row's first element.
* Forward, streamed pieces in clusters (aligned long rows on Hopper, ``PIECES_FWD``): the C
  programs of one thread-block cluster share a row, each running the unrolled kernel's two
  passes on its piece with (mean offset, M2) exchanged on chip between them.
* Forward, staged pieces in clusters (aligned long rows on Hopper, ``STAGED_FWD``): one
  cluster of C CTAs per row, each landing its piece in shared memory by ``cp.async``
  (``kernels/staging.py``) and reading it there twice, for (mean offset, M2) and for y, around
  the on-chip exchange: x is read from memory once. Calls it cannot take (x or a parameter off
  a 16-byte boundary, y or the parameters in another dtype) run the rules without it.
* Forward, reload (chosen row lengths, ``RELOAD_FWD``): the row read whole in one load for the
  statistics, then again from L2 in chunks to write y; nothing held across the two.
* Forward, reload for unaligned 16-bit rows (N = 2^k + 1, ``RELOAD_VEC_FWD``, large calls): the
  same on the row's aligned body plus its edges; weight and bias from copies shifted per row
  misalignment (``shift_weights``), so every per-column load is a 16-byte vector. Longer
  bodies (64K+, ``UNROLLED_VEC_FWD``): the unrolled kernel's structure on the aligned body
  (``ln_fwd_unrolled_vec``), with the same shifted copies.
* Backward, fused (rows up to 8K, and unaligned rows with a 2K-8K body): persistent programs write
  dx and accumulate dweight/dbias for their rows in float32 registers, one partial row pair
  each; ``sum_partials`` adds them in a fixed order (deterministic: no atomics). The two row
  sums in one paired reduction where it measured faster (``paired_sums``).
* Backward, split-row (long rows, CUDA): like the forward split, and each program keeps its
  chunk's dweight/dbias partials in registers across rows; unaligned float32 rows with a body
  of 16K+ as aligned-body pieces plus edges (``VEC_SPLIT_BWD``).
* Backward, dx row kernel (single-block or looped) + column-blocked dweight/dbias kernel: on
  the interpreter and after a refused split launch.
* Backward, 16-bit rows not a multiple of 8 and too long for the fused kernel: the column
  kernel, then dx from ``ln_bwd_dx_pieces`` on the rows' aligned bodies plus edges (one program
  per row, the row read twice; see ``DX_PIECES_BWD``); where the rows' starts rule out vector
  accesses, PyTorch's native kernel (``NATIVE_UNALIGNED_16BIT_BWD``).
* Backward, ``low_memory`` mode (the default, ``fusedops.set_layernorm_backward``): the same
  kernels with their scratch parked at the end of dx's storage (see ``_park``), the dx of those
  rows written by a second launch; the column path computes dweight/dbias before dx: no
  scratch at all. ``fast`` mode: separate scratch, one launch, the same bits.

Which kernel runs a call, with what parameters: ``configs.layernorm.forward_config`` /
``backward_config``.
"""

from __future__ import annotations

import torch

from fusedops import _replay
from fusedops.backends.triton.configs.common import unaligned_vec
from fusedops.backends.triton.configs.layernorm import (
    SHIFT_W_BLOCK,
    LayerNormForward,
    forward_config,
)
from fusedops.backends.triton.kernels.layernorm_fwd import (
    ln_fwd_looped,
    ln_fwd_reload,
    ln_fwd_reload_vec,
    ln_fwd_single,
    ln_fwd_split,
    ln_fwd_unrolled,
    ln_fwd_unrolled_vec,
    shift_weights,
)
from fusedops.backends.triton.kernels.layernorm_pieces import ln_fwd_pieces, ln_fwd_staged
from fusedops.backends.triton.runtime.caches import signature_cache
from fusedops.backends.triton.runtime.clusters import ClusterLauncher, stageable
from fusedops.backends.triton.runtime.device import (
    cdiv,
    next_pow2,
    rows_and_output,
)
from fusedops.backends.triton.runtime.facts import device_facts
from fusedops.backends.triton.runtime.launcher import Launcher, current_stream, hooks_registered
from fusedops.backends.triton.runtime.plans import (
    PlanCache,
    param_ptr,
)
from fusedops.backends.triton.runtime.split import SplitLauncher

_launch_fwd_single = Launcher(ln_fwd_single)
_launch_fwd_pieces = ClusterLauncher(ln_fwd_pieces)
_launch_fwd_staged = ClusterLauncher(ln_fwd_staged)


def _replay_runner(key: tuple, plan: tuple):
    """The ``fusedops._replay.LAYERNORM`` entry for a new inference forward plan (out dtype =
    x's dtype, no statistics)."""
    shape, dtype, out_dtype, device, eps, with_stats, w_dtype, b_dtype = key
    if out_dtype is not dtype or with_stats:
        return None
    (launch, function, coop, pdl, metadata), (g,), tail = plan[0].c_entry, plan[1], plan[3]
    n = shape[-1]

    def run(x: torch.Tensor, weight, bias) -> torch.Tensor | None:
        p = x.data_ptr()
        if p & 15 or not x.is_contiguous() or not x.is_cuda or hooks_registered():
            return None
        wp = param_ptr(weight, w_dtype, n, device)
        bp = param_ptr(bias, b_dtype, n, device)
        if wp < 0 or bp < 0:
            return None
        y = torch.empty_like(x)
        yp = y.data_ptr()
        # Absent parameters: y's address as the placeholder, as in _forward (never read).
        launch(g, 1, 1, current_stream(device), function, coop, pdl, None, None, metadata, None,
               None, None, p, wp or yp, bp or yp, yp, yp, yp, *tail)
        return y
    return (shape, dtype, device, eps), run


# Single-block forward launches, per (shape, dtypes, device, eps, with_stats): see _forward.
# Inference plans (out dtype = x's dtype, no statistics) are also replayed from the ops layer
# (fusedops._replay).
_fwd_plans = PlanCache(_replay.LAYERNORM, _replay_runner)
_launch_shift_weights = Launcher(shift_weights)
_launch_fwd_looped = Launcher(ln_fwd_looped)
_launch_fwd_reload = Launcher(ln_fwd_reload)
_launch_fwd_unrolled = Launcher(ln_fwd_unrolled)
_launch_fwd_reload_vec = Launcher(ln_fwd_reload_vec)
_launch_fwd_unrolled_vec = Launcher(ln_fwd_unrolled_vec)
_launch_fwd_split = SplitLauncher(ln_fwd_split)


def _shifted_weights(w: torch.Tensor | None, b: torch.Tensor | None, vec: int, n: int):
    """(weight copies, bias copies, row stride): (vec, ld) tensors whose row h holds columns
    h.. of ``w`` (``b``), zero-padded to ``ld`` (a multiple of 16 elements); None for an absent
    tensor."""
    ld = cdiv(n, 16) * 16
    if w is not None and b is not None and w.dtype == b.dtype:
        both = torch.empty((2, vec, ld), dtype=w.dtype, device=w.device)
        ws, bs = both[0], both[1]
    else:
        ws = torch.empty((vec, ld), dtype=w.dtype, device=w.device) if w is not None else None
        bs = torch.empty((vec, ld), dtype=b.dtype, device=b.device) if b is not None else None
    some = ws if ws is not None else bs
    _launch_shift_weights((vec, cdiv(ld, SHIFT_W_BLOCK)), (
        w if w is not None else some, b if b is not None else some,
        ws if ws is not None else some, bs if bs is not None else some, n, ld,
        w is not None, b is not None, SHIFT_W_BLOCK), 4)
    return ws, bs, ld


def layernorm_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row LayerNorm. x: (M, N) float32/float16/bfloat16, unit column stride, any row stride;
    weight/bias: contiguous (N,) of any float dtype, or None.

    Returns y (M, N) contiguous of ``out_dtype``, mean and rstd (M,) float32.
    """
    return _forward(x, weight, bias, eps, out_dtype, True)


def layernorm_forward_y(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`layernorm_forward` for calls that need no backward: returns only y. Rows held in
    registers skip the mean/rstd buffers altogether (two allocations less per call). ``x`` may
    also be a contiguous tensor of any rank >= 1 normalised over its last dim; y has its shape."""
    return _forward(x, weight, bias, eps, out_dtype, False)[0]


def _stats_buffers(M: int, device: torch.device, with_stats: bool, placeholder: torch.Tensor):
    """(mean, rstd) float32 (M,) buffers, or the placeholder twice (never written without
    STATS) for the reload kernels' inference calls."""
    if not with_stats:
        return placeholder, placeholder
    return (torch.empty((M,), dtype=torch.float32, device=device),
            torch.empty((M,), dtype=torch.float32, device=device))


# The launch of each call signature (row length, element size, VEC, rows, statistics, row
# stride a multiple of 8, device), decided once by the rules in configs/layernorm.py.
@signature_cache
def _fwd_config(n: int, elt_size: int, vec: int, m: int, with_stats: bool, aligned: bool,
                index: int) -> LayerNormForward:
    return forward_config(n, elt_size, vec, m, with_stats, aligned, device_facts(index))


def _forward_rows(x, w, b, y, M, N, stride, eps, has_w, has_b, cfg: LayerNormForward,
                  key=None):
    """The unrolled or reload kernel (one program per row). ``key``: the call's plan key where
    its launch may be replayed (the statistics written exactly as the call asked)."""
    with_stats = cfg.stats
    mean, rstd = _stats_buffers(M, x.device, with_stats, y)
    if M > 0:
        if cfg.variant == "unrolled":
            launcher = _launch_fwd_unrolled
            args = (x, w, b, y, mean, rstd, M, stride, N, eps, N, cfg.chunk, has_w, has_b,
                    with_stats)
        else:
            launcher = _launch_fwd_reload
            args = (x, w, b, y, mean, rstd, N, stride, N, eps, cfg.block, cfg.chunk, has_w,
                    has_b, with_stats, cfg.third_read)
        launcher((M,), args, cfg.warps)
        if key is not None and cfg.plan:
            _fwd_plans.add(key, launcher, (M,), args, cfg.warps, 6, M)
    return (y, mean, rstd) if with_stats else (y, None, None)


def _forward_reload_vec(x, weight, bias, y, M, N, eps, cfg: LayerNormForward):
    """Unaligned rows (VEC > 0) on ln_fwd_reload_vec or ln_fwd_unrolled_vec, with weight and
    bias from per-misalignment shifted copies."""
    has_w, has_b = weight is not None, bias is not None
    with_stats, vec = cfg.stats, cfg.vec
    w = b = y  # placeholders, never read (HAS_W/HAS_B are constexpr)
    w_ld = N
    if has_w or has_b:
        ws, bs, w_ld = _shifted_weights(weight, bias, vec, N)
        w, b = (ws if has_w else y), (bs if has_b else y)
    mean, rstd = _stats_buffers(M, x.device, with_stats, y)
    if M > 0 and cfg.variant == "unrolled_vec":
        _launch_fwd_unrolled_vec((M,), (x, w, b, y, mean, rstd, M, N, eps, w_ld, N, cfg.body,
                                        cfg.chunk, has_w, has_b, with_stats, vec), cfg.warps)
    elif M > 0:
        _launch_fwd_reload_vec((M,), (x, w, b, y, mean, rstd, N, N, eps, w_ld, cfg.block,
                                      cfg.chunk, has_w, has_b, with_stats, vec), cfg.warps)
    return (y, mean, rstd) if with_stats else (y, None, None)


def fwd_key(x, weight, bias, eps, out_dtype, with_stats: bool) -> tuple | None:
    """The plan key of a forward call (``_fwd_plans``), None where it may not have a plan."""
    # Contiguous x and parameters at 16-byte aligned addresses: the launch is fixed by shapes,
    # dtypes, device, eps and with_stats, so a call seen before replays its plan (PlanCache).
    return ((x.shape, x.dtype, out_dtype, x.get_device(), eps, with_stats,
             None if weight is None else weight.dtype, None if bias is None else bias.dtype)
            if x.is_contiguous() and not x.data_ptr() & 15
            and (weight is None or not weight.data_ptr() & 15)
            and (bias is None or not bias.data_ptr() & 15) else None)


def _forward(x, weight, bias, eps, out_dtype, with_stats: bool):
    key = fwd_key(x, weight, bias, eps, out_dtype, with_stats)
    plan = _fwd_plans.get(key)
    if plan is not None and not hooks_registered():
        return _replay_forward(plan, x, weight, bias, out_dtype, with_stats)
    M, N, stride, y = rows_and_output(x, out_dtype)
    has_w, has_b = weight is not None, bias is not None
    w = weight if has_w else y  # placeholders are never read (HAS_W/HAS_B are constexpr)
    b = bias if has_b else y
    elt = x.element_size()
    vec = unaligned_vec(N, (stride, N), elt, (x, y))
    cfg = _fwd_config(N, elt, vec, M, with_stats, stride % 8 == 0, x.get_device())
    if cfg.variant == "staged":
        done = (_forward_staged(x, w if has_w else b, b, y, M, N, stride, eps, has_w, has_b,
                                cfg) if stageable(x, y, weight, bias) else None)
        if done is not None:
            return done
        cfg = cfg.fallback  # (another dtype or alignment, or refused as below)
    if cfg.variant == "pieces":
        done = _forward_pieces(x, w, b, y, M, N, stride, eps, has_w, has_b, cfg)
        if done is not None:
            return done
        cfg = cfg.fallback  # (clusters refused: a profiler's launch hooks, or turned off)
    if cfg.variant in ("unrolled", "reload"):
        return _forward_rows(x, w, b, y, M, N, stride, eps, has_w, has_b, cfg, key)
    if cfg.variant in ("reload_vec", "unrolled_vec"):
        return _forward_reload_vec(x, weight, bias, y, M, N, eps, cfg)
    single = cfg.variant == "single"
    if single and not cfg.stats:
        mean = rstd = None
    else:
        mean = torch.empty((M,), dtype=torch.float32, device=x.device)
        rstd = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M == 0 or N == 0:
        return y, mean, rstd
    if single:
        args = (x, w, b, y, mean if cfg.stats else y, rstd if cfg.stats else y, M, N,
                stride, N, eps, cfg.tiles, cfg.grid,
                cfg.block, cfg.rows, has_w, has_b, cfg.vec, cfg.hold_w, cfg.stats)
        _launch_fwd_single((cfg.grid,), args, cfg.warps)
        if key is not None and cfg.plan:
            _fwd_plans.add(key, _launch_fwd_single, (cfg.grid,), args, cfg.warps, 6, M)
    else:
        _forward_long(x, w, b, y, mean, rstd, M, N, stride, eps, has_w, has_b, cfg)
    return y, mean, rstd


def _forward_staged(x, w, b, y, M, N, stride, eps, has_w, has_b, cfg: LayerNormForward):
    """ln_fwd_staged, one cluster of C CTAs per row: (y, mean, rstd), or None where the launch
    was refused (nothing written then; the config's DeviceFacts said clusters run). ``w``:
    the bias where there is no weight (the kernel takes the parameters' dtype from it)."""
    C, L = cfg.pieces, cfg.piece  # C a cluster size: a power of two, its own C_P2
    mean, rstd = _stats_buffers(M, x.device, cfg.stats, y)
    if not _launch_fwd_staged(cfg.grid, C, (x, w, b, y, mean, rstd, stride, N, eps),
                              (L, C, C, 32 * cfg.warps, has_w, has_b, cfg.stats), cfg.warps,
                              x.device, progs=cfg.grid, staged=L * x.element_size()):
        return None
    return (y, mean, rstd) if cfg.stats else (y, None, None)


def _forward_pieces(x, w, b, y, M, N, stride, eps, has_w, has_b, cfg: LayerNormForward):
    """ln_fwd_pieces in clusters of C programs per row: (y, mean, rstd), or None where the
    launch was refused (nothing written then; the config's DeviceFacts said clusters run)."""
    C, L = cfg.pieces, cfg.piece
    mean = rstd = None
    if cfg.stats:
        mean = torch.empty((M,), dtype=torch.float32, device=x.device)
        rstd = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M == 0:
        return y, mean, rstd
    s = mean if cfg.stats else y
    if not _launch_fwd_pieces(M * C, C, (x, w, b, y, s, rstd if cfg.stats else y, M, stride, N,
                                         eps), (L, cfg.chunk, C, C, has_w, has_b, cfg.stats),
                              cfg.warps, x.device, progs=cfg.grid or None):
        return None
    return y, mean, rstd


def _forward_long(x, w, b, y, mean, rstd, M, N, stride, eps, has_w, has_b,
                  cfg: LayerNormForward):
    """Rows too long for one program: the split-row kernel where it runs, else looped."""
    if cfg.variant == "split":
        C, L = cfg.pieces, cfg.piece
        stats = torch.empty((M * C * 2,), dtype=torch.float32, device=x.device)
        count = torch.zeros((M,), dtype=torch.int32, device=x.device)
        if _launch_fwd_split(
            M * C, C,
            (x, w, b, y, mean, rstd, stats, count, N, L, stride, N, eps, M * C),
            (cfg.block, C, next_pow2(C), has_w, has_b, cfg.prefetch, cfg.vec), cfg.warps,
            x.device, vec=cfg.vec,
        ):
            return
        cfg = cfg.fallback
    _launch_fwd_looped((M,), (
        x, w, b, y, mean, rstd, N, stride, N, eps, cfg.block, has_w, has_b,
    ), cfg.warps)


def _replay_forward(plan, x, weight, bias, out_dtype, with_stats: bool):
    """:func:`_forward` from a plan: the recorded launch (single-block, unrolled or reload: all
    take (x, w, b, y, mean, rstd, ...)) with this call's tensors; mean and rstd have the rows the
    plan recorded (the key fixes x's shape)."""
    go, grid, device, tail, rows = plan
    y = torch.empty_like(x, dtype=out_dtype)
    yp = y.data_ptr()
    wp = yp if weight is None else weight.data_ptr()  # placeholders, as in _forward
    bp = yp if bias is None else bias.data_ptr()
    if not with_stats:
        go(grid, current_stream(device), (x.data_ptr(), wp, bp, yp, yp, yp, *tail))
        return y, None, None
    mean = torch.empty((rows,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    go(grid, current_stream(device),
       (x.data_ptr(), wp, bp, yp, mean.data_ptr(), rstd.data_ptr(), *tail))
    return y, mean, rstd


