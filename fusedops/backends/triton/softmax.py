"""Triton softmax kernels (forward and backward) and their launch wrappers.

Bytes moved (the floor): forward reads x once and writes y once (2·M·N·elt); backward reads y
and dy once and writes dx once (3·M·N·elt). Three kernel variants per direction:

* single-block: a program owns ``ROWS`` whole rows padded to ``BLOCK_N`` (a power of two up to
  the kind's cap), keeps them in registers, reduces once, writes once; one program per row tile.
  Rows that do not start 16-byte aligned are read as an aligned body plus edges (kernels/common.py).
* split-row (longer rows, CUDA): equal pieces of a row in cooperating programs that publish
  partial statistics, wait for their row's other pieces and write: one read, one write. On a
  GPU that runs thread-block clusters, long aligned rows instead run ``softmax_fwd_staged``
  (``CLUSTER_FWD``): one cluster per row, each CTA's piece landed in shared memory by
  ``cp.async`` and the (max, sum) exchanged between the CTAs' shared memories.
* looped (longer rows elsewhere: the interpreter, a refused cooperative launch): one program
  per row streams it in ``CHUNK``-sized pieces; forward keeps a per-lane online (max, sum) so
  it reads x twice (stats pass + write pass), backward reads y and dy twice. The backward's
  reload variant (``WHOLE``, chosen 16-bit row lengths in ``RELOAD_BWD``) reads the row whole
  for the dot product and again from L2 for dx; the forward's reload kernel (``RELOAD_FWD``)
  reads the row whole for its max and sum and again from L2 to write y. The forward's unrolled
  kernel (``UNROLLED_FWD``: aligned rows a multiple of a rule's chunk, N compile-time) streams
  the row for per-lane maxima, then re-reads it from L2 for the sum and again to write y;
  ``softmax_fwd_unrolled_vec`` (``UNROLLED_VEC_FWD``) does the same for unaligned rows (N not a
  multiple of the vector width, e.g. 2^k + 1) on each row's aligned body, the few elements
  before and after it in an edge tile. The backward's unrolled kernel (``UNROLLED_BWD``,
  ``UNROLLED_VEC_BWD``: long 16-bit rows, aligned or not) streams y and dy for per-lane partial
  dot products, then re-reads both from L2 to write dx.

All math is float32; row offsets are 64-bit so tensors beyond 2^31 elements are fine. Which
kernel runs a call, with what parameters: ``configs.softmax.forward_config`` /
``backward_config``.
"""

from __future__ import annotations

import torch

from fusedops import _replay
from fusedops.backends.triton.configs.common import unaligned_vec
from fusedops.backends.triton.configs.softmax import (
    SoftmaxConfig,
    backward_config,
    forward_config,
)
from fusedops.backends.triton.kernels.softmax import (
    softmax_bwd_looped,
    softmax_bwd_single,
    softmax_bwd_split,
    softmax_bwd_unrolled,
    softmax_fwd_looped,
    softmax_fwd_reload,
    softmax_fwd_single,
    softmax_fwd_split,
    softmax_fwd_staged,
    softmax_fwd_unrolled,
    softmax_fwd_unrolled_vec,
)
from fusedops.backends.triton.runtime.caches import signature_cache
from fusedops.backends.triton.runtime.clusters import ClusterLauncher, stageable
from fusedops.backends.triton.runtime.device import next_pow2, rows_and_output
from fusedops.backends.triton.runtime.facts import device_facts
from fusedops.backends.triton.runtime.launcher import Launcher, current_stream, hooks_registered
from fusedops.backends.triton.runtime.plans import PlanCache
from fusedops.backends.triton.runtime.split import SplitLauncher

_launch_fwd_single = Launcher(softmax_fwd_single)
_launch_fwd_looped = Launcher(softmax_fwd_looped)
_launch_fwd_reload = Launcher(softmax_fwd_reload)
_launch_fwd_unrolled = Launcher(softmax_fwd_unrolled)
_launch_fwd_unrolled_vec = Launcher(softmax_fwd_unrolled_vec)
_launch_bwd_single = Launcher(softmax_bwd_single)
_launch_bwd_looped = Launcher(softmax_bwd_looped)
_launch_bwd_unrolled = Launcher(softmax_bwd_unrolled)
_launch_fwd_split = SplitLauncher(softmax_fwd_split)
_launch_fwd_staged = ClusterLauncher(softmax_fwd_staged)
_launch_bwd_split = SplitLauncher(softmax_bwd_split)


def _replay_runner(key: tuple, plan: tuple):
    """The ``fusedops._replay.SOFTMAX`` entry for a new forward plan (out dtype = x's dtype)."""
    shape, dtype, out_dtype, device = key
    if out_dtype is not dtype:
        return None
    (launch, function, coop, pdl, metadata), (g,), tail = plan[0].c_entry, plan[1], plan[3]

    def run(x: torch.Tensor) -> torch.Tensor | None:
        p = x.data_ptr()
        if p & 15 or not x.is_contiguous() or not x.is_cuda or hooks_registered():
            return None
        y = torch.empty_like(x)
        launch(g, 1, 1, current_stream(device), function, coop, pdl, None, None, metadata, None,
               None, None, p, y.data_ptr(), *tail)
        return y
    return (shape, dtype, device), run


# Single-block forward launches, per (shape, dtype, out dtype, device); those with out dtype =
# dtype are also replayed from the ops layer (fusedops._replay).
_fwd_plans = PlanCache(_replay.SOFTMAX, _replay_runner)


# The launch of each call signature (rows, element size, VEC, row count, device), decided once
# by the rules in configs/softmax.py.
@signature_cache
def _fwd_config(n: int, elt_size: int, vec: int, m: int, index: int) -> SoftmaxConfig:
    return forward_config(n, elt_size, vec, m, device_facts(index))


@signature_cache
def _bwd_config(n: int, elt_size: int, vec: int, m: int, index: int) -> SoftmaxConfig:
    return backward_config(n, elt_size, vec, m, device_facts(index))


def _launch_split(launcher, cfg: SoftmaxConfig, M: int, N: int, tensors: tuple,
                  strides: tuple, per_piece: int, device: torch.device, tail: tuple = ()) -> bool:
    """Run the split-row kernel ``launcher`` over (M, N) rows as ``cfg`` says (``tail``: its
    constexprs after FULL); False where the launch was refused (the caller then runs
    ``cfg.fallback``)."""
    C, L = cfg.pieces, cfg.piece
    stats = torch.empty((M * C * per_piece,), dtype=torch.float32, device=device)
    count = torch.zeros((M,), dtype=torch.int32, device=device)
    return bool(launcher(
        M * C, C, (*tensors, stats, count, N, L, *strides, M * C),
        (cfg.block, C, next_pow2(C), cfg.prefetch, cfg.vec, L == cfg.block, *tail), cfg.warps,
        device, vec=cfg.vec))


def _launch_staged(cfg: SoftmaxConfig, x: torch.Tensor, y: torch.Tensor, stride: int) -> bool:
    """softmax_fwd_staged, one thread-block cluster per row, as ``cfg`` says; False where the
    launch was refused (the config's DeviceFacts already said clusters run here)."""
    C, L = cfg.pieces, cfg.piece  # C a cluster size: a power of two, its own C_P2
    return bool(_launch_fwd_staged(
        cfg.grid, C, (x, y, stride, L * C), (L, C, C, 32 * cfg.warps), cfg.warps, x.device,
        progs=cfg.grid, staged=L * x.element_size()))


def softmax_forward(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Row softmax. x: (M, N) float32/float16/bfloat16, unit column stride, any row stride, or a
    contiguous tensor of any rank >= 1 (rows along the last dim).

    Returns a contiguous tensor of ``x``'s shape and ``out_dtype``.
    """
    # Contiguous inputs at 16-byte aligned addresses: the launch is fixed by shape, dtypes and
    # device, so a call seen before replays its plan (see PlanCache).
    key = ((x.shape, x.dtype, out_dtype, x.get_device())
           if x.is_contiguous() and not x.data_ptr() & 15 else None)
    plan = _fwd_plans.get(key)
    if plan is not None and not hooks_registered():
        y = torch.empty_like(x, dtype=out_dtype)
        go, grid, device, tail, _ = plan
        go(grid, current_stream(device), (x.data_ptr(), y.data_ptr(), *tail))
        return y
    M, N, stride, y = rows_and_output(x, out_dtype)
    if M == 0 or N == 0:
        return y
    # One row starts where x does, so it needs no aligned-body split (masks cover its tail), and
    # a float32 row then takes the exact arithmetic (EXACT in kernels/softmax.py).
    vec = unaligned_vec(N, (stride, N), x.element_size(), (x, y)) if M > 1 else 0
    cfg = _fwd_config(N, x.element_size(), vec, M, x.get_device())
    if cfg.cluster:
        # The staged kernel copies whole 16-byte vectors and writes x's dtype: a single row
        # (vec 0 wherever it starts) must start aligned too.
        if stageable(x, y) and _launch_staged(cfg, x, y, stride):
            return y
        # Refused (a profiler's launch hooks, clusters turned off): the rules without
        # clusters, kept out of the replay plans (the next call tries clusters again).
        cfg, key = cfg.fallback, None
    if cfg.variant == "single":
        args = (x, y, M, N, stride, N, cfg.tiles, cfg.grid, cfg.block, cfg.rows, cfg.vec,
                cfg.exact_rows, cfg.next)
        _launch_fwd_single((cfg.grid,), args, cfg.warps)
    elif cfg.variant == "unrolled":
        args = (x, y, M, stride, N, N, cfg.chunk)
        _launch_fwd_unrolled((M,), args, cfg.warps)
    elif cfg.variant == "unrolled_vec":
        _launch_fwd_unrolled_vec((M,), (x, y, M, N, N, cfg.body, cfg.chunk, cfg.vec), cfg.warps)
    elif cfg.variant == "reload":
        _launch_fwd_reload((M,), (x, y, N, stride, N, cfg.whole, cfg.chunk, cfg.even),
                           cfg.warps)
    else:
        if cfg.variant == "split":
            if _launch_split(_launch_fwd_split, cfg, M, N, (x, y), (stride, N), 2, x.device):
                return y
            cfg = cfg.fallback
        _launch_fwd_looped((M,), (x, y, N, stride, N, cfg.block), cfg.warps)
    if key is not None and cfg.plan:
        _fwd_plans.add(key, _launch_fwd_single if cfg.variant == "single"
                       else _launch_fwd_unrolled, (cfg.grid,), args, cfg.warps, 2)
    return y


def softmax_backward(y: torch.Tensor, dy: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """dx = y * (dy - sum(dy * y)) per row. y: (M, N) contiguous; dy: (M, N) unit column
    stride, any row stride (0 for expanded gradients). Returns contiguous (M, N) of ``out_dtype``.
    """
    M, N = y.shape
    dx = torch.empty((M, N), dtype=out_dtype, device=y.device)
    if M == 0 or N == 0:
        return dx
    vec = unaligned_vec(N, (N, dy.stride(0)), y.element_size(), (y, dy, dx))
    cfg = _bwd_config(N, y.element_size(), vec, M, y.get_device())
    if cfg.variant == "single":
        _launch_bwd_single((cfg.grid,), (y, dy, dx, M, N, dy.stride(0), cfg.tiles, cfg.grid,
                                         cfg.block, cfg.rows, cfg.vec), cfg.warps)
    elif cfg.variant == "unrolled":
        _launch_bwd_unrolled((M,), (y, dy, dx, M, dy.stride(0), N, cfg.body, cfg.chunk, cfg.vec),
                             cfg.warps)
    elif cfg.variant == "reload":
        _launch_bwd_looped((M,), (y, dy, dx, N, N, dy.stride(0), N, cfg.chunk, cfg.whole,
                                  cfg.first, cfg.even), cfg.warps)
    else:
        if cfg.variant == "split":
            if _launch_split(_launch_bwd_split, cfg, M, N, (y, dy, dx), (N, dy.stride(0)), 1,
                             y.device):
                return dx
            cfg = cfg.fallback
        _launch_bwd_looped((M,), (y, dy, dx, N, y.stride(0), dy.stride(0), dx.stride(0),
                                  cfg.block, 0, cfg.block, 0), cfg.warps)
    return dx
