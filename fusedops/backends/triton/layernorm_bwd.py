"""Triton LayerNorm backward: the host code that runs the path
``configs.layernorm.backward_config`` picks and launches its kernels; the paths are described
in ``layernorm.py``'s docstring, the kernels are in ``kernels/layernorm_bwd.py`` and
``kernels/layernorm_bwd_split.py``.
"""

from __future__ import annotations

import torch

from fusedops import _replay
from fusedops._settings import get_layernorm_backward
from fusedops.backends.triton.configs import layernorm as rules
from fusedops.backends.triton.configs.common import ROW_BODY, unaligned_vec
from fusedops.backends.triton.configs.layernorm import (
    COLUMN_TILE,
    COLUMN_WARPS,
    LayerNormBackward,
    RowsBackward,
    backward_config,
)
from fusedops.backends.triton.kernels.layernorm_bwd import (
    ln_bwd_dwdb_columns,
    ln_bwd_dx_looped,
    ln_bwd_dx_pieces,
    ln_bwd_dx_published,
    ln_bwd_single,
)
from fusedops.backends.triton.kernels.layernorm_bwd_split import ln_bwd_split
from fusedops.backends.triton.runtime.caches import signature_cache
from fusedops.backends.triton.runtime.clusters import ClusterLauncher
from fusedops.backends.triton.runtime.device import interpreting, next_pow2
from fusedops.backends.triton.runtime.facts import device_facts
from fusedops.backends.triton.runtime.launcher import Launcher, current_stream, hooks_registered
from fusedops.backends.triton.runtime.partials import reduce_partials
from fusedops.backends.triton.runtime.plans import SequencePlans, run_steps, sequence_steps
from fusedops.backends.triton.runtime.recording import mark_replayable, record_launches
from fusedops.backends.triton.runtime.split import SplitLauncher, zero_counters


def _native_backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db):
    M, N = x.shape
    # The native kernel only reads bias's shape and dtype (to allocate dbias): the weight serves.
    bias = weight if weight is not None else (
        torch.empty((N,), dtype=x.dtype, device=x.device) if need_db else None)
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        dy, x, [N], mean.view(M, 1), rstd.view(M, 1), weight, bias,
        [need_dx, need_dw and weight is not None, need_db])
    # dweight/dbias come back in the weight's dtype (accumulated in float32 by the kernel).
    return (dx if need_dx else None, dw if need_dw else None, db if need_db else None)


_launch_bwd_single = Launcher(ln_bwd_single)


_launch_bwd_split = SplitLauncher(ln_bwd_split)


_launch_dx_looped = Launcher(ln_bwd_dx_looped)


_launch_dx_pieces = Launcher(ln_bwd_dx_pieces)


_launch_dx_published = Launcher(ln_bwd_dx_published)


_launch_dwdb_columns = Launcher(ln_bwd_dwdb_columns)


# Backward replay plans (see layernorm_backward): only where launches can take the direct path
# (not under the interpreter; the plans themselves also need Triton 3.6's raw-pointer entries).
# FUSEDOPS_BWD_PLANS=0 turns them off (configs/layernorm.py).
BWD_PLANS = _launch_bwd_single.direct and rules.BWD_PLANS


_capped_bwd_split: dict[int, SplitLauncher] = {}  # by register cap (see split_config)


def _bwd_split_launcher(maxnreg: int | None) -> SplitLauncher:
    if not maxnreg:
        return _launch_bwd_split
    launcher = _capped_bwd_split.get(maxnreg)
    if launcher is None:
        launcher = _capped_bwd_split[maxnreg] = SplitLauncher(ln_bwd_split, maxnreg=maxnreg)
    return launcher


_bwd_cluster: dict[int | None, ClusterLauncher] = {}  # by register cap


def _bwd_cluster_launcher(maxnreg: int | None) -> ClusterLauncher:
    launcher = _bwd_cluster.get(maxnreg)
    if launcher is None:
        launcher = _bwd_cluster[maxnreg] = ClusterLauncher(ln_bwd_split, maxnreg=maxnreg)
    return launcher


# Backward replay plans (see runtime/recording.py), per call signature: everything the
# launch rules read (shapes, strides, dtypes, 16-byte alignment of every pointer, the gradients
# needed, the mode, the device, torch's deterministic-algorithms flag, the row-body switch).
# Paths whose results come from launches alone into dx, dweight and dbias (scratch parked in
# dx: the low_memory mode) replay: the outputs allocated, then the recorded launches.
_bwd_plans = SequencePlans(_replay.LAYERNORM_NODE)  # (nodes made from these plans go with them)


def layernorm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
    grad_dtypes: tuple[torch.dtype | None, torch.dtype | None] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of row LayerNorm.

    dy, x: (M, N) unit column stride, any row stride; weight: (N,) or None; mean/rstd: (M,)
    float32 from the forward. Returns dx (M, N) contiguous in x's dtype (or None), and (N,)
    dweight / dbias (or None): float32, reduced deterministically from per-program partials, or
    in the weight's dtype where PyTorch's native kernel runs (see NATIVE_UNALIGNED_16BIT_BWD).
    ``grad_dtypes``: (weight, bias) dtypes; the ``low_memory`` mode returns dweight/dbias in
    them (cast before dx overwrites the float32 sums kept in its storage).

    A call whose signature ran before through launches alone is replayed from them (the same
    launches, bitwise the same results, without the launch rules' host time). Only calls that
    give ``grad_dtypes`` (the eager autograd path) make and use plans: torch.compile's custom op
    (fusedops.ops._library) does not, because with a cold Triton cache, recording a plan inside
    the first warm-up of ``mode="reduce-overhead"`` made its CUDA graph trees report the
    forward's saved statistics as missing from their memory pool (H100, Triton 3.6, torch
    2.11; not understood; compiled graphs gain little from plans, CUDA graphs nothing).
    """
    if not BWD_PLANS or grad_dtypes is None:
        return _backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db, grad_dtypes)
    key = bwd_key(dy, x, weight, mean, rstd, need_dx, need_dw, need_db, grad_dtypes)
    plan = _bwd_plans.get(key)
    if plan and not hooks_registered():
        return plan(dy, x, weight, mean, rstd)
    if plan is False:
        return _backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db, grad_dtypes)
    with record_launches() as record:
        out = _backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db, grad_dtypes)
    _bwd_plans.put(key, _backward_runner(record, (dy, x, weight, mean, rstd), out) or False)
    return out


def bwd_key(dy, x, weight, mean, rstd, need_dx, need_dw, need_db, grad_dtypes) -> tuple:
    """The plan key of a backward call (``_bwd_plans``)."""
    return (*x.shape, x.stride(0), dy.stride(0), x.dtype, dy.dtype, x.data_ptr() & 15,
            dy.data_ptr() & 15, mean.data_ptr() & 15, rstd.data_ptr() & 15,
            None if weight is None else (weight.dtype, weight.data_ptr() & 15),
            need_dx, need_dw, need_db, grad_dtypes, get_layernorm_backward(), x.get_device(),
            torch.are_deterministic_algorithms_enabled(), ROW_BODY["enabled"])


def _backward_runner(record, inputs: tuple, out: tuple):
    """``run(dy, x, weight, mean, rstd) -> (dx, dweight, dbias)`` replaying ``record`` (the
    launches of the call that produced ``out``), or None where it cannot be replayed."""
    if any(t is not None and not t.is_contiguous() for t in out):
        return None
    steps = sequence_steps(record, (*inputs, *out), len(inputs))
    if steps is None:
        return None
    metas = tuple(None if t is None else (t.shape, t.dtype) for t in out)
    (dx_meta, dw_meta, db_meta), index = metas, inputs[1].get_device()

    def run(dy, x, weight, mean, rstd):
        dev = x.device
        dx = dw = db = None
        if dx_meta is not None:
            dx = torch.empty(dx_meta[0], dtype=dx_meta[1], device=dev)
        if dw_meta is not None:
            dw = torch.empty(dw_meta[0], dtype=dw_meta[1], device=dev)
        if db_meta is not None:
            db = torch.empty(db_meta[0], dtype=db_meta[1], device=dev)
        run_steps(steps, (
            dy.data_ptr(), x.data_ptr(), 0 if weight is None else weight.data_ptr(),
            mean.data_ptr(), rstd.data_ptr(), 0 if dx is None else dx.data_ptr(),
            0 if dw is None else dw.data_ptr(), 0 if db is None else db.data_ptr(),
        ), current_stream(index))
        return dx, dw, db

    # For host_ext.host_node: the steps (slots: dy, x, weight, mean, rstd, dx, dw, db; no
    # seeded arguments) and the outputs' (shape, dtype).
    run.steps = tuple((*step, None) for step in steps)
    run.metas = metas
    return run


# The backward of each call signature (shape, row strides, VEC, gradients needed, mode, whether
# PyTorch's kernel could take it, device), decided once by the rules in configs/layernorm.py.
@signature_cache
def _bwd_config(m: int, n: int, elt_size: int, strides: tuple[int, int], vec: int,
                need_dx: bool, need_dw: bool, need_db: bool, parked: bool, plain: bool,
                index: int) -> LayerNormBackward:
    return backward_config(m, n, elt_size, strides, vec, need_dx, need_dw, need_db, parked,
                           plain, device_facts(index))


def _backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db, grad_dtypes):
    """:func:`layernorm_backward` through the launch rules."""
    M, N = x.shape
    dev = x.device
    has_w = weight is not None
    w = weight if has_w else x
    parked = get_layernorm_backward() == "low_memory"
    strides = (dy.stride(0), x.stride(0))
    plain = (x.is_contiguous() and dy.is_contiguous() and dy.dtype == x.dtype
             and (weight is None or weight.dtype == x.dtype))
    cfg = _bwd_config(M, N, x.element_size(), strides,
                      unaligned_vec(N, (*strides, N), x.element_size(), (dy, x)),
                      need_dx, need_dw, need_db, parked, plain, x.get_device())
    if cfg.variant == "dx_pieces":  # long unaligned 16-bit rows: column kernel + dx on bodies
        return _columns_first_backward(dy, x, w, has_w, mean, rstd, torch.empty_like(x),
                                       need_dw, need_db, grad_dtypes, cfg)
    if cfg.variant == "native":
        return _native_backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db)
    dx = torch.empty((M, N), dtype=x.dtype, device=dev) if need_dx else None
    if cfg.variant == "empty":
        z = torch.zeros((N,), dtype=torch.float32, device=dev)
        return dx, (z if need_dw else None), (z.clone() if need_db else None)
    if cfg.variant == "columns":  # nothing to park in: the column kernel straight into
        # dweight/dbias (no scratch; slow for many rows)
        mark_replayable()
        return (None, *_column_backward(dy, x, mean, rstd, None, need_dw, need_db, grad_dtypes,
                                        cfg.columns))
    if cfg.variant == "fused":
        return _fused_backward(dy, x, w, has_w, mean, rstd, dx, need_dw, need_db, grad_dtypes,
                               cfg, parked)
    while cfg.variant == "split":
        done = _split_backward(dy, x, w, has_w, mean, rstd, dx, need_dw, need_db, grad_dtypes,
                               cfg, parked)
        if done is not None:
            return done
        cfg = cfg.fallback  # no grid of C·VEC programs fits (rows too long), or refused
        if cfg.variant == "native":
            return _native_backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db)
    if (need_dw or need_db) and dx is not None:
        # dx row kernel + column kernel: the column pass first, its partials parked in dx
        return _columns_first_backward(dy, x, w, has_w, mean, rstd, dx, need_dw, need_db,
                                       grad_dtypes, cfg)
    # dx as a pure row kernel (like softmax backward: x and dy read once, dx written once);
    # without dx, dweight/dbias from the column kernel into float32 scratch.
    if need_dx:
        _dx_rows(dy, x, w, has_w, mean, rstd, dx, cfg.rows)
    mark_replayable()  # (scratch of the column kernel, if any, is refused by sequence_steps)
    return (dx, *_column_backward(dy, x, mean, rstd, None, need_dw, need_db, grad_dtypes,
                                  cfg.columns))


# Scratch parked in dx (the low_memory mode, the default). The fused and split-row backward
# kernels accumulate dweight/dbias in per-program float32 partial rows, and the split kernel
# exchanges per-row statistics: scratch that would put the call's peak memory up to a few
# percent above PyTorch's (whose kernels read x and dy twice instead). It lives at the end of
# dx's own storage (dx is allocated, not yet written): the kernel writes dx for the rows before
# it (M_dx), the partials are summed into dweight/dbias, and a second launch writes the dx of the
# remaining rows with the same arithmetic (bitwise the rows the fast mode's single launch
# writes). Cost: those rows (at most ~1/8 of x, capped by max_partial_rows) are read again,
# plus a launch: 1-3% at most shapes, up to 7% at unaligned 16-bit rows (H100). The parked
# dx mask uses the default mode's row offsets (recomputing them cost 9-25% at unaligned rows).
def _park(dx: torch.Tensor, nbytes: int, group: int) -> tuple[int, int] | None:
    """(M_dx, byte offset) for ``nbytes`` of scratch at the end of dx's storage: the offset is
    16-byte aligned and M_dx, the first row it touches rounded down to a multiple of
    ``group``; None if dx cannot hold it."""
    M, N = dx.shape
    row_bytes = N * dx.element_size()
    start = (M * row_bytes - nbytes) // 16 * 16
    if start < 0:
        return None
    return start // row_bytes // group * group, start


def _parked(dx: torch.Tensor, offset: int, shape: tuple[int, ...],
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A ``shape`` tensor of ``dtype`` over dx's storage from byte ``offset``."""
    return torch.empty((0,), dtype=dtype, device=dx.device).set_(
        dx.untyped_storage(), offset // dtype.itemsize, shape)


def _fused_backward(dy, x, w, has_w, mean, rstd, dx, need_dw, need_db, grad_dtypes,
                    cfg: LayerNormBackward, parked: bool):
    """The fused kernel (rows up to 8K): dx, and dweight/dbias from per-program partials, in
    float32 scratch or (``parked``, the low_memory mode, with a dx) parked in dx (see _park)."""
    vec, block, rows, warps, acc_1d, tiles, progs, paired, stages, resident = cfg.fused
    M, N = x.shape
    need_dx = dx is not None
    strides = (dy.stride(0), x.stride(0), N)
    def dx_only(first: int, grid: int) -> None:  # the parked variant's dx of tiles first..
        _launch_bwd_single((grid,), (
            dy, x, w, mean, rstd, dx, x, M, N, *strides, tiles, grid, first, M,
            block, rows, has_w, True, False, False, vec, True, acc_1d, True, paired, stages,
        ), warps)

    m_dx = M
    if parked and need_dx:
        place = _park(dx, 8 * progs * N, rows * max(vec, 1))
        if place is None:  # 1-3 rows: no room in dx for the partials. dx from this kernel
            # all the same (its rows bitwise as in any other call), then the column kernel.
            dx_only(0, progs)
            return (dx, *_column_backward(dy, x, mean, rstd, None, need_dw, need_db,
                                          grad_dtypes, cfg.columns_direct))
        m_dx, offset = place
        part = _parked(dx, offset, (2, progs, N))
    else:
        part = torch.empty((2, progs, N), dtype=torch.float32, device=x.device)
    _launch_bwd_single((progs,), (
        dy, x, w, mean, rstd, dx if need_dx else x, part, M, N, *strides, tiles, progs, 0, m_dx,
        block, rows, has_w, need_dx, need_dw, need_db, vec, True, acc_1d, parked, paired,
        stages,
    ), warps)
    dw, db = reduce_partials(part, need_dw, need_db, dtypes=grad_dtypes)
    if m_dx < M:
        first = m_dx // rows  # a multiple of vec: m_dx is a multiple of rows * vec
        left = tiles - first
        tail = max(1, min(left, resident))
        if vec and tail < left:
            tail = max(vec, tail // vec * vec)
        dx_only(first, tail)
    mark_replayable()
    return dx, dw, db


def _split_backward(dy, x, w, has_w, mean, rstd, dx, need_dw, need_db, grad_dtypes,
                    cfg: LayerNormBackward, parked: bool):
    """The split-row kernel (long rows, ``cfg.split``): partials, per-row statistics and
    counters in scratch or (``parked``, with a dx) parked in dx (see _park). None if the
    cooperative launch was refused or no grid fits (the caller then runs ``cfg.fallback``).
    VEC > 0: unaligned rows as aligned-body pieces plus edges (dx is then contiguous like x
    and dy). Parked: partials, then statistics and counters, at the end of dx's storage (see
    _published_dx)."""
    M, N = x.shape
    dev = x.device
    need_dx = dx is not None
    need_part = need_dw or need_db
    split = cfg.split
    split_warps, vec, paired = split.warps, split.vec, split.paired
    C, L = split.pieces, split.piece
    # ``mean`` stands in for the buffers (same dtype/alignment) until they are sized.
    args = [dy, x, w, mean, rstd, dx if need_dx else x, mean, mean, mean, N, L,
            dy.stride(0), x.stride(0), N, M, M * C]
    head = (next_pow2(L), C, next_pow2(C), has_w, need_dx, need_dw, need_db, split.prefetch,
            parked, vec, paired)
    launcher, consts, progs = _split_grid(M * C, C, args, head, split_warps, dev, vec,
                                          split.cap, split.clusters)
    if not progs:
        return None
    progs = max(C, min(progs, split.max_rows * C))
    if vec and progs < M * C:  # a program's rows VEC apart share one misalignment (see kernel)
        progs = min(M * C, max(C * vec, progs // (C * vec) * (C * vec)))
    # One partial row per group of C programs (a program keeps one chunk of the row).
    part_rows = progs // C
    part_bytes = 8 * part_rows * N if need_part else 0
    stats_bytes = 8 * M * C if need_dx else 0
    def dx_pieces(row0: int) -> None:  # dx of rows row0.. with the split kernel's arithmetic
        _launch_dx_pieces((M - row0,), (
            dy, x, w, mean, rstd, dx, N, L, dy.stride(0), x.stride(0), N, row0,
            next_pow2(L), C, next_pow2(C), has_w, not interpreting(), vec, paired,
        ), split_warps)

    m_dx = M
    if parked and need_dx:
        place = _park(dx, part_bytes + stats_bytes + 4 * M, 1)
        if place is None:  # a few rows: no room in dx. dx row by row with the split kernel's
            # arithmetic (bitwise as in any other call), then the column kernel.
            dx_pieces(0)
            return (dx, *_column_backward(dy, x, mean, rstd, None, need_dw, need_db,
                                          grad_dtypes, cfg.columns_direct))
        m_dx, offset = place
        part = _parked(dx, offset, (2, part_rows, N)) if need_part else mean
        stats = _parked(dx, offset + part_bytes, (2 * M * C,))
        count = _parked(dx, offset + part_bytes + stats_bytes, (M,), torch.int32)
    else:  # scratch (without dx the kernel exchanges no statistics: placeholders)
        part = (torch.empty((2, part_rows, N), dtype=torch.float32, device=dev)
                if need_part else mean)
        stats = (torch.empty((M * C * 2,), dtype=torch.float32, device=dev) if need_dx
                 else mean)
        count = torch.empty((M,), dtype=torch.int32, device=dev) if need_dx else mean
    clustered = isinstance(launcher, ClusterLauncher)
    # The cluster variant never reads the row counters: no zeroing launch, and ``mean`` in
    # their place keeps its launch key the grid estimate's (one compiled kernel, not two).
    args[6:9] = part, stats, mean if clustered else _zeroed(count, need_dx, parked)
    args[14] = m_dx
    if not launcher(M * C, C, tuple(args), consts, split_warps, dev, progs):
        if not clustered:
            return None
        # The cluster launch failed (clusters are now off): the same pieces, cooperatively.
        args[8] = _zeroed(count, need_dx, parked)
        launcher = _bwd_split_launcher(split.cap)
        consts = (*consts[:-1], False)
        if launcher.programs(M * C, C, tuple(args), consts, split_warps, dev, vec) < progs or \
                not launcher(M * C, C, tuple(args), consts, split_warps, dev, progs):
            return None
    dw = db = None
    if need_part:
        dw, db = reduce_partials(part, need_dw, need_db, dtypes=grad_dtypes)
    if m_dx < M:
        _published_dx(dy, x, w, has_w, mean, rstd, dx, stats, count, m_dx,
                      offset + part_bytes + 8 * C * m_dx, C, L, vec, split_warps)
    mark_replayable()
    return dx, dw, db


def _split_grid(items, C, args, head, warps, dev, vec, cap, clusters: bool):
    """(launcher, constexprs, programs) of the split-row backward: a thread-block cluster
    where ``clusters`` and a grid of them fits, else a cooperative grid (programs 0: none
    fits)."""
    progs = 0
    if clusters:
        launcher, consts = _bwd_cluster_launcher(cap), (*head, True)
        progs = launcher.programs(items, C, tuple(args), consts, warps, dev, vec)
    if not progs:  # a cooperative grid
        launcher, consts = _bwd_split_launcher(cap), (*head, False)
        progs = launcher.programs(items, C, tuple(args), consts, warps, dev, vec)
    return launcher, consts, progs


def _published_dx(dy, x, w, has_w, mean, rstd, dx, stats, count, m_dx, first, C, L, vec, warps):
    """The dx of rows m_dx.. of a parked split-row call (scratch from byte ``first`` of dx).
    Once the partials are summed, the rows over them (from M_dx) get their dx from
    ln_bwd_dx_published, which reads the statistics the split launch left there: bitwise as
    that launch would have written those rows."""
    M, N = x.shape
    # The programs whose piece of dx covers the statistics of rows m_dx.. (or what follows
    # them) write last; the last counter, no longer needed, counts the readers.
    row_bytes = N * dx.element_size()
    late_from = (first // row_bytes - m_dx) * C
    if not vec:  # the piece too (with VEC > 0, piece 0 also writes the row's tail edge)
        late_from += first % row_bytes // (L * dx.element_size())
    n_progs = (M - m_dx) * C
    _launch_dx_published((n_progs,), (
        dy, x, w, mean, rstd, dx, stats, zero_counters(count[M - 1:]), N, L, dy.stride(0),
        x.stride(0), N, m_dx, n_progs, max(0, late_from),
        next_pow2(L), C, next_pow2(C), has_w, not interpreting(), vec,
    ), warps)


def _zeroed(count: torch.Tensor, need_dx: bool, parked: bool) -> torch.Tensor:
    """The cooperative split kernel's row counters, zeroed (parked in dx: with a launch, which
    a recorded call replays); without dx they are a placeholder, left as they are."""
    if not need_dx:
        return count
    return zero_counters(count) if parked else count.zero_()


def _dx_rows(dy, x, w, has_w, mean, rstd, dx, cfg: RowsBackward) -> None:
    """dx of (M, N) rows from the dx-only row kernel (single-block, or looped for long rows)."""
    M, N = x.shape
    if cfg.single:
        _launch_bwd_single((cfg.programs,), (
            dy, x, w, mean, rstd, dx, x, M, N, dy.stride(0), x.stride(0), N, cfg.tiles,
            cfg.programs, 0, M, cfg.block, cfg.rows, has_w, True, False, False, cfg.vec,
            cfg.hold_w, True, False, cfg.paired, 1,
        ), cfg.warps)
    else:
        _launch_dx_looped((M,), (
            dy, x, w, mean, rstd, dx, N, dy.stride(0), x.stride(0), dx.stride(0),
            cfg.block, has_w,
        ), cfg.warps)


def _columns_first_backward(dy, x, w, has_w, mean, rstd, dx, need_dw: bool, need_db: bool,
                            grad_dtypes, cfg: LayerNormBackward):
    """dx, dweight, dbias with no scratch beyond the outputs (the dx row kernel's path, both
    modes): dweight/dbias from :func:`_column_backward` first, then the dx row kernel writes dx
    (one stream: in order), or with ``cfg.pieces`` (see dx_pieces_plan) ln_bwd_dx_pieces on
    the rows' aligned bodies. 5 passes over memory."""
    dw, db = _column_backward(dy, x, mean, rstd, dx, need_dw, need_db, grad_dtypes, cfg.columns)
    if dx is not None and cfg.pieces is not None:
        M, N = x.shape
        C, L, vec, warps, paired = cfg.pieces
        _launch_dx_pieces((M,), (
            dy, x, w, mean, rstd, dx, N, L, dy.stride(0), x.stride(0), N, 0,
            next_pow2(L), C, next_pow2(C), has_w, False, vec, paired,
        ), warps)
    elif dx is not None:
        _dx_rows(dy, x, w, has_w, mean, rstd, dx, cfg.rows)
    mark_replayable()
    return dx, dw, db


def _column_backward(dy, x, mean, rstd, dx, need_dw: bool, need_db: bool, grad_dtypes,
                     columns: tuple[int, int, int]):
    """dweight/dbias (in ``grad_dtypes``, None: float32) from the column kernel on ``columns``
    (column blocks, row splits, rows per split): with several splits, their float32 partials
    parked in dx's storage (allocated, not yet written) and summed from there, or without a dx
    in a buffer of their own; with one split (x needs no gradient, or 1-3 rows), written
    directly into dweight/dbias."""
    if not (need_dw or need_db):
        return None, None
    M, N = x.shape
    dev = x.device
    col_blocks, splits, rows_per_split = columns
    dt_w, dt_b = grad_dtypes or (None, None)
    # separate tensors: outputs of a custom op must not alias each other
    dw = torch.empty((N,), dtype=dt_w or torch.float32, device=dev) if need_dw else None
    db = torch.empty((N,), dtype=dt_b or torch.float32, device=dev) if need_db else None
    part = None
    if splits > 1:
        part = (torch.empty((2, splits, N), dtype=torch.float32, device=dev) if dx is None
                else _parked(dx, 0, (2, splits, N)))
    outs = (part[0], part[1]) if part is not None else (dw if need_dw else db,
                                                        db if need_db else dw)
    _launch_dwdb_columns((col_blocks, splits), (
        dy, x, mean, rstd, *outs, M, N, dy.stride(0), x.stride(0),
        rows_per_split, *COLUMN_TILE, need_dw, need_db, dy.stride(0) == x.stride(0),
    ), COLUMN_WARPS)
    if part is not None:
        reduce_partials(part, need_dw, need_db, out=(dw, db))
    return dw, db
