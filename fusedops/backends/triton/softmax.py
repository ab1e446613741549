"""Triton softmax kernels (forward and backward) and their launch wrappers.

Bytes moved (the floor): forward reads x once and writes y once (2·M·N·elt); backward reads y
and dy once and writes dx once (3·M·N·elt). Three kernel variants per direction:

* single-block: a program owns ``ROWS`` whole rows padded to ``BLOCK_N`` (a power of two up to
  the kind's cap), keeps them in registers, reduces once, writes once; one program per row tile.
  Rows that do not start 16-byte aligned are read as an aligned body plus edges (kernels/common.py).
* split-row (longer rows, CUDA): equal pieces of a row in cooperating programs that publish
  partial statistics, wait for their row's other pieces and write: one read, one write.
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

All math is float32; row offsets are 64-bit so tensors beyond 2^31 elements are fine.
"""

from __future__ import annotations

import torch

from fusedops import _replay
from fusedops.backends.triton.configs.common import (
    DEFAULT_SINGLE_BLOCK_LIMIT,
    body_len,
    grid_size,
    num_row_tiles,
    single_block_limit,
    unaligned_config,
    unaligned_vec,
    unrolled_config,
)
from fusedops.backends.triton.configs.softmax import (
    RELOAD_BWD,
    RELOAD_BWD_ABOVE,
    RELOAD_FWD,
    RELOAD_FWD_ABOVE,
    UNROLL_RELOAD_BWD,
    UNROLLED_BWD_ABOVE,
    UNROLLED_FWD,
    UNROLLED_FWD_ABOVE,
    UNROLLED_VEC_FWD,
    split_config,
    unrolled_bwd_config,
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
    softmax_fwd_unrolled,
    softmax_fwd_unrolled_vec,
)
from fusedops.backends.triton.runtime.device import next_pow2, rows_and_output
from fusedops.backends.triton.runtime.launcher import Launcher, current_stream, hooks_registered
from fusedops.backends.triton.runtime.plans import PlanCache
from fusedops.backends.triton.runtime.split import SplitLauncher, split_pieces, split_rows_enabled

_launch_fwd_single = Launcher(softmax_fwd_single)
_launch_fwd_looped = Launcher(softmax_fwd_looped)
_launch_fwd_reload = Launcher(softmax_fwd_reload)
_launch_fwd_unrolled = Launcher(softmax_fwd_unrolled)
_launch_fwd_unrolled_vec = Launcher(softmax_fwd_unrolled_vec)
_launch_bwd_single = Launcher(softmax_bwd_single)
_launch_bwd_looped = Launcher(softmax_bwd_looped)
_launch_bwd_unrolled = Launcher(softmax_bwd_unrolled)
_launch_fwd_split = SplitLauncher(softmax_fwd_split)
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


def _launch_split(launcher, M: int, N: int, tensors: tuple, strides: tuple, per_piece: int,
                  elt_size: int, kind: str, vec: int, device: torch.device) -> bool:
    """Run the split-row kernel ``launcher`` over (M, N) rows if it applies; False otherwise
    (the caller then runs the looped kernel)."""
    chunk, warps, prefetch = split_config(kind, elt_size, vec, N)
    if not split_rows_enabled(device, N, chunk):
        return False
    C, L = split_pieces(N, chunk, vec)
    stats = torch.empty((M * C * per_piece,), dtype=torch.float32, device=device)
    count = torch.zeros((M,), dtype=torch.int32, device=device)
    block = next_pow2(L)
    return bool(launcher(
        M * C, C, (*tensors, stats, count, N, L, *strides, M * C),
        (block, C, next_pow2(C), prefetch, vec, L == block), warps, device, vec=vec))


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
        go, grid, device, tail = plan
        go(grid, current_stream(device), (x.data_ptr(), y.data_ptr(), *tail))
        return y
    M, N, stride, y = rows_and_output(x, out_dtype)
    if M == 0 or N == 0:
        return y
    vec = unaligned_vec(N, (stride, N), x.element_size(), (x, y))
    unrolled = unrolled_config(UNROLLED_FWD, x.element_size(), N, UNROLLED_FWD_ABOVE, vec)
    if unrolled:
        chunk, warps = unrolled
        args = (x, y, M, stride, N, N, chunk)
        _launch_fwd_unrolled((M,), args, warps)
        if key is not None:
            _fwd_plans.add(key, _launch_fwd_unrolled, (M,), args, warps, 2)
        return y
    unrolled = (UNROLLED_VEC_FWD.get((x.element_size(), next_pow2(body_len(N, vec))))
                if vec and N > RELOAD_FWD_ABOVE
                and single_block_limit() == DEFAULT_SINGLE_BLOCK_LIMIT else None)
    if unrolled and (N // vec - 1) * vec >= unrolled[0]:
        chunk, warps = unrolled
        _launch_fwd_unrolled_vec((M,), (x, y, M, N, N, (N // vec - 1) * vec, chunk, vec), warps)
        return y
    if N > RELOAD_FWD_ABOVE and not vec and single_block_limit() == DEFAULT_SINGLE_BLOCK_LIMIT:
        whole = next_pow2(N)
        reload = RELOAD_FWD.get((x.element_size(), whole))
        if reload:
            chunk, warps = reload
            _launch_fwd_reload((M,), (x, y, N, stride, N, whole, chunk, N if N == whole else 0),
                               warps)
            return y
    single, block, rows, warps, vec = unaligned_config(N, "softmax_fwd", x.element_size(), vec)
    if single:
        tiles = num_row_tiles(M, rows, vec)
        progs = grid_size(tiles, warps, "softmax_fwd", x.device)
        args = (x, y, M, N, stride, N, tiles, progs, block, rows, vec)
        _launch_fwd_single((progs,), args, warps)
        if key is not None and not vec:
            _fwd_plans.add(key, _launch_fwd_single, (progs,), args, warps, 2)
    else:
        if _launch_split(_launch_fwd_split, M, N, (x, y), (stride, N), 2, x.element_size(),
                         "fwd", vec, x.device):
            return y
        _launch_fwd_looped((M,), (x, y, N, stride, N, block), warps)
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
    if N > UNROLLED_BWD_ABOVE:
        unrolled = unrolled_bwd_config(N, vec, y.element_size())
        if unrolled:
            chunk, warps = unrolled
            body = (N // vec - 1) * vec if vec else N
            _launch_bwd_unrolled((M,), (y, dy, dx, M, dy.stride(0), N, body, chunk, vec),
                                 warps)
            return dx
    reload = (RELOAD_BWD.get((y.element_size(), next_pow2(N)))
              if N > RELOAD_BWD_ABOVE and not vec
              and single_block_limit() == DEFAULT_SINGLE_BLOCK_LIMIT else None)
    if reload:
        chunk, warps, *first = reload  # (chunk, warps[, first-pass piece]): see RELOAD_BWD
        even = N if N == next_pow2(N) and UNROLL_RELOAD_BWD else 0
        _launch_bwd_looped((M,), (
            y, dy, dx, N, N, dy.stride(0), N, chunk, 0 if first else next_pow2(N),
            first[0] if first else chunk, even), warps)
        return dx
    single, block, rows, warps, vec = unaligned_config(N, "softmax_bwd", y.element_size(), vec)
    if single:
        tiles = num_row_tiles(M, rows, vec)
        progs = grid_size(tiles, warps, "softmax_bwd", y.device)
        _launch_bwd_single(
            (progs,), (y, dy, dx, M, N, dy.stride(0), tiles, progs, block, rows, vec), warps
        )
    else:
        if _launch_split(_launch_bwd_split, M, N, (y, dy, dx), (N, dy.stride(0)), 1,
                         y.element_size(), "bwd", vec, y.device):
            return dx
        _launch_bwd_looped(
            (M,), (y, dy, dx, N, y.stride(0), dy.stride(0), dx.stride(0), block, 0, block, 0),
            warps
        )
    return dx
