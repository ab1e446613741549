"""Launch-side helpers shared by the Triton kernels: device facts cached once per device."""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import triton
import triton.language as tl

# Rows whose padded length is at most this many elements (and at most the kernel kind's cap in
# KIND_CAPS) are held whole in registers by one program (read once, written once). Longer rows
# take the split-row or looped kernels. Tests shrink it (see ``set_single_block_limit``) so the
# looped path is exercised with small rows.
DEFAULT_SINGLE_BLOCK_LIMIT = 65536
_limits = {"single_block": DEFAULT_SINGLE_BLOCK_LIMIT}


def single_block_limit() -> int:
    """Largest padded row length (elements, a power of two) handled by the single-block kernels."""
    return _limits["single_block"]


def set_single_block_limit(n: int | None) -> None:
    """Change the single-block/looped switch (a power of two >= 16); ``None`` restores the default.

    Meant for tests and experiments; kernels' launch configs are re-derived on the next call.
    """
    if n is None:
        n = DEFAULT_SINGLE_BLOCK_LIMIT
    if n < 16 or n & (n - 1):
        raise ValueError(f"single-block limit must be a power of two >= 16, got {n}")
    _limits["single_block"] = n
    for cache in _config_caches:
        cache.cache_clear()


_config_caches: list = []


def config_cache(fn):
    """functools.cache that ``set_single_block_limit`` also clears."""
    cached = functools.cache(fn)
    _config_caches.append(cached)
    return cached


@functools.cache
def device_name(index: int) -> str:
    """The name of CUDA device ``index`` (per-GPU launch rules match parts of it)."""
    return torch.cuda.get_device_name(index)


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on ``device`` (a small constant for CPU/interpreter runs)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def rows_and_output(x: torch.Tensor, out_dtype: torch.dtype):
    """(M, N, row stride of x, y) for a row-wise op on ``x``: a 2-D tensor with unit column
    stride and any row stride, or a contiguous tensor of any rank >= 1 whose last dim is the row
    (forward entry points take those as is, which saves a view on each side of the call). ``y``
    is a new contiguous tensor of ``x``'s shape and ``out_dtype``."""
    if x.dim() == 2:
        M, N = x.shape
        stride = x.stride(0)
    else:
        N = x.shape[-1]
        M = x.numel() // N if N else 0
        stride = N
    if x.is_contiguous():
        y = torch.empty_like(x, dtype=out_dtype)  # about 1 µs cheaper than torch.empty(shape)
    else:
        y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    return M, N, stride, y


# Host-side integer helpers. triton.cdiv / triton.next_power_of_2 are constexpr functions whose
# Python call costs microseconds (argument unwrapping) on every launch; these are plain ints.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def _spec(a: object) -> object:
    """The properties of one argument that Triton specialises a compiled kernel on."""
    if isinstance(a, torch.Tensor):
        # Compiled kernels are per device; alignment decides vectorised access.
        return (a.dtype, a.get_device(), a.data_ptr() & 15 == 0)
    if isinstance(a, bool):
        return a
    if isinstance(a, int):
        return (a & 15 == 0, a == 1, -(2**31) <= a < 2**31)
    if isinstance(a, float):
        return float
    return a


def _launch_key(num_warps: int, args: tuple, n: int) -> tuple:
    """Everything a compiled kernel depends on, cheaply: per runtime argument Triton's
    specialisation (tensors: dtype and 16-byte alignment; ints: divisible by 16, equal to 1,
    64-bit), the constexprs by value and ``num_warps``. ``key[0]`` is the first tensor's device
    index (compiled kernels are loaded per device).

    Written as one flat loop because it runs on every launch (about 1 µs less than a generic
    per-argument function on 13 arguments).
    """
    key: list = [None, num_warps]
    add = key.append
    device = None
    for a in args[:n]:
        cls = a.__class__
        if cls is int:
            add((a & 15 == 0) + 2 * (a == 1) + 4 * (a >= 2147483648 or a < -2147483648))
        elif cls is float:
            add(0.5)
        elif cls is bool:
            add(a)
        else:  # a tensor (or Parameter)
            if device is None:
                device = a.get_device()
            add(a.dtype)
            add(a.data_ptr() & 15 == 0)
    key[0] = device
    key.extend(args[n:])
    return tuple(key)


# The raw handle of a device's current stream (what Triton itself launches on under torch).
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# Triton's launch hooks (Proton and other profilers register here); None on Triton without knobs.
_launch_hooks = getattr(getattr(triton, "knobs", None), "runtime", None)


class Launcher:
    """Launches a ``@triton.jit`` kernel with a lean host path.

    ``JITFunction.__call__`` re-derives the specialisation key, binds arguments, builds launch
    metadata for Triton's (usually empty) launch hooks and looks up the device and stream on
    every call, which costs more host time than the kernel itself for small tensors. The first
    launch for a given specialisation (see :func:`_launch_key`) goes through Triton; later ones
    call the compiled kernel's launcher directly with the tensor's device's current stream
    (on Triton 3.6, its C entry point itself: see :func:`_direct_entry`). The key is computed
    by a function generated for the kernel's argument kinds (:func:`_key_function`).
    Arguments must be passed positionally, constexprs included, in signature order.
    On CPU tensors (``TRITON_INTERPRET=1``) every call goes through Triton.

    Triton launch hooks (``triton.knobs.runtime.launch_enter_hook``, used by Proton) are
    honoured: while any is registered, launches take Triton's own path.
    """

    __slots__ = ("kernel", "compiled", "direct", "n_runtime", "options", "key")

    def __init__(self, kernel, cooperative: bool = False, fp_fusion: bool = True,
                 maxnreg: int | None = None) -> None:
        self.kernel = kernel
        self.compiled: dict = {}
        self.key = None
        self.direct = current_stream is not None and _launch_hooks is not None
        self.options = {"launch_cooperative_grid": True} if cooperative else {}
        if not fp_fusion:
            # No multiply-add contraction: every operation rounds on its own, so two kernels
            # written with the same arithmetic give the same bits however their code is split
            # into basic blocks (the contraction is decided per block).
            self.options["enable_fp_fusion"] = False
        if maxnreg and not _interpreting():
            # A register cap (ptxas .maxnreg): more programs per SM where the compiler would
            # otherwise take registers it does not need (the interpreter has no such option).
            self.options["maxnreg"] = maxnreg
        params = getattr(kernel, "params", None)
        if params is None:  # the interpreter's wrapper: no compiled kernels to cache
            self.direct, self.n_runtime = False, 0
            return
        # Constexprs come last in every kernel here; they enter the cache key by value.
        flags = [p.is_constexpr for p in params]
        self.n_runtime = flags.index(True) if True in flags else len(flags)
        if any(not f for f in flags[self.n_runtime:]):
            raise TypeError(f"{kernel.__name__}: constexpr parameters must come last")

    def __call__(self, grid: tuple[int, ...], args: tuple, num_warps: int):
        """Launch; returns Triton's compiled kernel object (or None on the direct path)."""
        if not self.direct:
            compiled = self.kernel[grid](*args, num_warps=num_warps, **self.options)
            if _recording:
                _record(self, grid, args, num_warps)
            return compiled
        try:
            key = self.key(num_warps, args)
        except Exception:  # first call, or other argument kinds than the generated key's
            key = _launch_key(num_warps, args, self.n_runtime)
            if self.key is None:
                self.key = _key_function(args, self.n_runtime)
        entry = self.compiled.get(key)
        if entry is not None and not hooks_registered():
            entry(grid, current_stream(key[0]), args)
            if _recording:
                _record(self, grid, args, num_warps)
            return None
        compiled = self.kernel[grid](*args, num_warps=num_warps, **self.options)
        if entry is None:
            self._remember(key, compiled)
        if _recording:
            _record(self, grid, args, num_warps)
        return compiled

    def entry(self, args: tuple, num_warps: int):
        """The direct launch callable compiled for these arguments' specialisation (see
        :func:`_direct_entry`), or None when there is none yet or this launcher has no direct
        path. For :class:`PlanCache` entries."""
        if not self.direct:
            return None
        try:
            key = self.key(num_warps, args)
        except Exception:
            key = _launch_key(num_warps, args, self.n_runtime)
        return self.compiled.get(key)

    def _remember(self, key: tuple, compiled) -> None:
        entry = _direct_entry(compiled)
        if entry is not None:
            self.compiled[key] = entry
        elif not _interpreting():
            # An unknown Triton runtime API: stay on Triton's own (slower) path for this kernel.
            self.direct = False


def _key_function(args: tuple, n: int):
    """A function ``(num_warps, args) -> key`` equal to :func:`_launch_key` for arguments of
    the same kinds (tensor, int, float, bool) at the same positions as ``args``, written out
    argument by argument (no loop, no per-argument type dispatch: about half the host time of
    the generic key for a dozen arguments). Arguments of other kinds make it raise, and the
    caller falls back to the generic key."""
    names = [f"a{i}" for i in range(n)]
    parts, first_tensor = [], None
    for name, a in zip(names, args[:n], strict=True):
        cls = a.__class__
        if cls is int:
            parts.append(f"(({name} & 15 == 0) + 2 * ({name} == 1)"
                         f" + 4 * ({name} >= 2147483648 or {name} < -2147483648))"
                         f" if {name}.__class__ is int else _other()")
        elif cls is float:
            parts.append(f"0.5 if {name}.__class__ is float else _other()")
        elif cls is bool:
            parts.append(f"{name} if {name}.__class__ is bool else _other()")
        else:
            first_tensor = first_tensor or name
            parts += [f"{name}.dtype", f"{name}.data_ptr() & 15 == 0"]
    device = f"{first_tensor}.get_device()" if first_tensor else "None"
    unpack = f"    {', '.join(names)}, *consts = args\n" if n else "    consts = args\n"
    src = (f"def key(num_warps, args):\n{unpack}"
           f"    return ({device}, num_warps, {''.join(p + ', ' for p in parts)}*consts)\n")
    scope = {"_other": _other_kinds}
    exec(src, scope)  # noqa: S102 - generated from the argument kinds above, no user text
    return scope["key"]


def _other_kinds():
    raise TypeError("argument kinds differ from the generated launch key's")


# Triton versions whose compiled-kernel launcher (``CompiledKernel.run``) is known to be a
# ``CudaLauncher`` whose ``launch`` attribute is its C entry point, taking (grid x, y, z,
# stream, function, cooperative, pdl, global scratch, profile scratch, packed metadata, launch
# metadata, enter hook, exit hook, *args): calling it directly skips the Python wrapper (which
# allocates the scratch buffers these kernels do not use): 0.8-1.5 µs per launch on an H100
# host. Other versions call ``run`` itself.
_C_ENTRY_VERSIONS = ("3.6.",)


def _direct_entry(compiled, metadata: tuple | None = None):
    """``go(grid, stream, args)`` launching ``compiled`` without Triton's Python layers, or
    None where its runtime API is not the one known here. ``metadata``: the launch's packed
    (num_warps, CTAs per cluster, shared memory bytes) instead of the compiled kernel's (see
    ``_clusters.py``; Triton 3.6 and 3.9 pack these three)."""
    try:
        run, function = compiled.run, compiled.function
        metadata = metadata or compiled.packed_metadata
    except AttributeError:
        return None
    if function is None or not callable(run):
        return None
    launch = getattr(run, "launch", None)
    if (type(run).__name__ == "CudaLauncher" and callable(launch)
            and triton.__version__.startswith(_C_ENTRY_VERSIONS)
            and not getattr(run, "global_scratch_size", 1)
            and not getattr(run, "profile_scratch_size", 1)):
        coop, pdl = run.launch_cooperative_grid, run.launch_pdl

        def go(grid, stream, args):
            if len(grid) == 1:
                launch(grid[0], 1, 1, stream, function, coop, pdl, None, None, metadata, None,
                       None, None, *args)
            else:
                g = (*grid, 1)
                launch(g[0], g[1], g[2], stream, function, coop, pdl, None, None, metadata,
                       None, None, None, *args)
        # This C entry takes a pointer argument as a Python int as it is, where a tensor costs
        # a data_ptr() call and a cuPointerGetAttribute check (PlanCache relies on it).
        go.raw_pointers = True
        # For replay runners, which call the entry themselves (one Python frame less).
        go.c_entry = (launch, function, coop, pdl, metadata)
        return go

    def go(grid, stream, args):
        g = (*grid, 1, 1)
        run(g[0], g[1], g[2], stream, function, metadata, None, None, None, *args)
    return go


class PlanCache(dict):
    """Launch plans of one op's small-call path, per call signature (shapes, dtypes, device,
    scalar arguments: whatever fixes every launch argument but the tensors' addresses).

    A plan is ``(go, grid, device index, tail)``: the compiled kernel's direct C entry
    (:func:`_direct_entry`, one taking raw pointers), its grid, and the launch arguments after
    the tensors. A call that finds its plan allocates its outputs and calls ``go`` with the
    tensors' addresses as ints: no launch rules, no launch key, no pointer checks (the
    dispatcher only sends CUDA tensors here, the ops layer checks devices). About 4 µs of host
    time per small call on an H100 host (docs/performance.md, "Small shapes").

    Plans are made only by the first call that took the normal path (and only for launches
    whose arguments the key fixes); like the launch-config caches they are cleared whenever
    :func:`set_single_block_limit` runs (tests and tuning change rules that way).
    """

    MAX_PLANS = 4096  # distinct call signatures kept; a workload cycling through more restarts

    def __init__(self, replay: dict | None = None, runner=None) -> None:
        """``runner(key, plan)``, if given, returns ``(signature, run)`` to register in the
        ``fusedops._replay`` table ``replay`` for a new plan, or None."""
        super().__init__()
        self.replay, self.runner = replay, runner
        _config_caches.append(self)

    def cache_clear(self) -> None:
        self.clear()

    def clear(self) -> None:
        super().clear()
        if self.replay is not None:
            self.replay.clear()  # runners replay plans: they go with them

    def add(self, key, launcher: Launcher, grid: tuple, args: tuple, num_warps: int,
            n_tensors: int) -> None:
        """Remember the launch ``launcher(grid, args, num_warps)`` just made, whose first
        ``n_tensors`` arguments are the call's tensors (in the order plan users pass them)."""
        go = launcher.entry(args, num_warps)
        if go is None or not getattr(go, "raw_pointers", False):
            return  # no direct C entry (other Triton versions, interpreter): no plans
        if len(self) >= self.MAX_PLANS:
            self.clear()
        plan = self[key] = (go, grid, args[0].get_device(), args[n_tensors:])
        made = self.runner(key, plan) if self.runner is not None and len(grid) == 1 else None
        if made is not None:
            self.replay[made[0]] = made[1]


# ------------------------------------------------------------------ recorded launch sequences
# A call whose results come from kernel launches alone (its outputs allocated, scratch parked
# inside them) can be replayed from its launches: the same grids and scalar arguments, the
# pointers moved to the new call's tensors. The LayerNorm backward does this (three to five
# launches and their planning cost 40-110 µs of Python per call on a fast CPU, several times
# that on slower GPU hosts: as much as the kernels' GPU time at 2^27 elements).

# The LaunchRecord being filled per thread (record_launches): the autograd engine runs CUDA
# backward functions on one worker thread per device, so two recordings can overlap, and each
# must see its own thread's launches only. Empty (the usual case): one falsy check per launch.
_recording: dict = {}


class LaunchRecord(list):
    """``(launcher, grid, args, num_warps)`` of each launch made while recording, in order.
    ``replayable`` is set (:func:`mark_replayable`) by a code path whose results come from these
    launches alone: anything else (torch operations, a fallback) leaves it False."""

    replayable = False


def _record(launcher, grid, args, num_warps) -> None:
    record = _recording.get(threading.get_ident())
    if record is not None:
        record.append((launcher, grid, args, num_warps))


@contextlib.contextmanager
def record_launches():
    """``with record_launches() as record:`` collects the :class:`Launcher` launches this thread
    makes in the block (after each launch returns: a launch that raised is not in it)."""
    me = threading.get_ident()
    outer = _recording.get(me)
    record = _recording[me] = LaunchRecord()
    try:
        yield record
    finally:
        if outer is None:
            del _recording[me]
        else:
            _recording[me] = outer


def mark_replayable() -> None:
    """Called by a code path whose results come from its launches alone (see LaunchRecord)."""
    record = _recording.get(threading.get_ident()) if _recording else None
    if record is not None:
        record.replayable = True


class SequencePlans(PlanCache):
    """Replay runners per call signature (cleared like :class:`PlanCache`, and when the
    split-row kernels are disabled). A value of False marks a signature whose calls cannot be
    replayed (not recorded again)."""

    def put(self, key, plan) -> None:
        if len(self) >= self.MAX_PLANS:
            self.clear()
        self[key] = plan


def sequence_steps(record: LaunchRecord, tensors: tuple, n_inputs: int) -> tuple | None:
    """Replay steps ``(go, grid, slots, tail)`` for ``record``, or None where it cannot be
    replayed. ``tensors``: the call's inputs (the first ``n_inputs``) then its outputs, None
    where absent. Every tensor argument of a launch must be one of the inputs or outputs itself
    or lie inside an output (scratch parked there; outputs must be contiguous); it becomes a
    slot ``(index, byte offset)``, so the replay passes ``pointer[index] + offset``. Tensor
    arguments must come before all others (true of every kernel here), and each launch needs a
    direct C entry that takes raw pointers (Triton 3.6, see :func:`_direct_entry`). Inputs
    sharing an address are refused: a later call of the same signature need not share it."""
    if not record.replayable:
        return None
    ptrs = [None if t is None else t.data_ptr() for t in tensors]
    given = [p for p in ptrs[:n_inputs] if p is not None]
    if len(set(given)) != len(given) or any(
            p in given for p in ptrs[n_inputs:] if p is not None):
        return None
    # Outputs are new contiguous tensors: their extent is their size. (No untyped_storage() on
    # the inputs: a storage object made for a tensor of a CUDA-graph pool confuses the liveness
    # accounting of torch.compile's CUDA graph trees.)
    ends = [None if t is None or i < n_inputs else p + t.numel() * t.element_size()
            for i, (t, p) in enumerate(zip(tensors, ptrs, strict=True))]
    steps = []
    for launcher, grid, args, num_warps in record:
        go = launcher.entry(args, num_warps)
        if go is None or not getattr(go, "raw_pointers", False):
            return None
        slots = []
        for a in args:
            if not isinstance(a, torch.Tensor):
                break
            slot = next((i for i, t in enumerate(tensors) if t is a), None)
            if slot is not None:
                slots.append((slot, 0))
                continue
            p = a.data_ptr()
            slot = next((i for i in range(n_inputs, len(tensors))
                         if ptrs[i] is not None and ptrs[i] <= p < ends[i]), None)
            if slot is None:
                return None
            slots.append((slot, p - ptrs[slot]))
        tail = args[len(slots):]
        if any(isinstance(a, torch.Tensor) for a in tail):
            return None
        steps.append((go, grid, tuple(slots), tuple(tail)))
    return tuple(steps)


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """What launch rules read of an optional tensor argument (shape, strides, dtype, 16-byte
    alignment), for replay plans' signatures."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.data_ptr() & 15


def replay_runner(record: LaunchRecord, inputs: tuple, out: tuple, scratch: tuple = (),
                  seed_at=None):
    """``run(*inputs, words=None) -> out``: allocates outputs and scratch like the call that
    produced ``out`` (and wrote the temporaries ``scratch``) and replays ``record`` with the
    new tensors' addresses; None where it cannot be replayed (see :func:`sequence_steps`).
    ``seed_at(launcher)``: for kernels that take two per-call words (a random seed), the index
    of the first among their arguments (the second follows), else None; ``run`` passes its
    ``words`` there, the recorded ones where ``words`` is None."""
    made = (*out, *scratch)
    if any(t is not None and not t.is_contiguous() for t in made):
        return None
    steps = sequence_steps(record, (*inputs, *made), len(inputs))
    if steps is None:
        return None
    split = []
    for (go, grid, slots, tail), (launcher, *_) in zip(steps, record, strict=True):
        at = None if seed_at is None else seed_at(launcher)
        if at is None:
            split.append((go, grid, slots, tail, None))
            continue
        if at < len(slots):
            return None
        at -= len(slots)
        split.append((go, grid, slots, tail[:at + 2], tail[at + 2:]))
    metas = tuple(None if t is None else (t.shape, t.dtype) for t in made)
    n_out, index = len(out), inputs[0].get_device()

    def run(*ins, words=None):
        dev = ins[0].device
        new = [None if m is None else torch.empty(m[0], dtype=m[1], device=dev) for m in metas]
        ptrs = [0 if t is None else t.data_ptr() for t in (*ins, *new)]
        stream = current_stream(index)
        for go, grid, slots, head, rest in split:
            p = [ptrs[i] + off for i, off in slots]
            if rest is None or words is None:
                go(grid, stream, (*p, *head) if rest is None else (*p, *head, *rest))
            else:
                go(grid, stream, (*p, *head[:-2], *words, *rest))
        return tuple(new[:n_out])

    return run


def run_steps(steps: tuple, ptrs: tuple, stream: int) -> None:
    """Launch replay ``steps`` (see :func:`sequence_steps`) with the call's tensor addresses."""
    for go, grid, slots, tail in steps:
        go(grid, stream, (*[ptrs[i] + off for i, off in slots], *tail))


def hooks_registered() -> bool:
    """Whether a Triton launch hook is registered (a profiler such as Proton)."""
    hook = _launch_hooks.launch_enter_hook
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)  # Triton >= 3.5: a HookChain, empty by default
    return calls is None or len(calls) > 0


@functools.cache
def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Launch configurations, measured on an H200 with each candidate timed next to torch eager in
# one process (docs/performance.md, method). Per kernel kind: the largest padded row kept
# in registers (above it the split-row or looped kernels win), the program tile (several short
# rows per program so every thread holds a few 16-byte vectors), the threads per program, and
# whether the grid is persistent (about one resident wave of programs looping over row tiles) or
# one program per tile.
KIND_CAPS = {"softmax_fwd": 32768, "softmax_bwd": 32768, "ln_fwd": 32768, "ln_bwd": 16384}
# (softmax forward rows of 64K run split: measured faster than one program per row, H100
# 16-bit 2.50 vs 1.84-2.28 TB/s, H200 float32 3.29 vs 2.89.)
_TILE_ELEMS = {"softmax_fwd": 2048, "softmax_bwd": 4096, "ln_fwd": 8192, "ln_bwd": 4096}
# Tiles of this many bytes, for kinds listed here (measured: softmax forward peaks at 4 KB per
# program with one program per tile, 0.96-0.99 of copy bandwidth at N <= 8K).
_TILE_BYTES = {"softmax_fwd": 4096}
# Measured on H200: one program per tile is 2-10% faster for softmax and LayerNorm forward
# (each program's loads do not wait for a previous tile's reduction); the LayerNorm backward
# row kernel stays persistent.
PERSISTENT = {"softmax_fwd": False, "softmax_bwd": False, "ln_fwd": False, "ln_bwd": True}


# Experiments only (a launch-rule sweep sets it, then restores it): per kind, "tile" (elements
# per program), "warps" and "looped" ((chunk, warps) of the looped kernels) replace the
# measured rules below.
OVERRIDES: dict[str, dict[str, object]] = {}


# Short 16-bit rows: (tile elements, warps) by padded row length (measured on H200). One or
# two warps per program, as Inductor does here, so a row's reductions stay within a warp or two
# (LayerNorm forward bf16 512: 3.91 vs 3.28 TB/s at 4 warps; 1K: 3.95 vs 3.67; softmax forward
# bf16 256/512: 4.10-4.11 vs 3.95-3.96). float32 rows measured no better (4.06-4.15 either way).
_SHORT_16BIT = {
    "ln_fwd": {256: (2048, 1), 512: (4096, 2), 1024: (2048, 1)},
    "softmax_fwd": {256: (1024, 1), 512: (1024, 1)},
}


def _warps_for(tile: int, kind: str, elt_size: int, block: int) -> int:
    forced = OVERRIDES.get(kind, {}).get("warps")
    if forced:
        return forced
    if kind == "softmax_bwd" and elt_size == 2 and block >= 2048:
        # 16-bit rows of 2K-32K (H200, bf16/fp16): 16 warps up to 8K-element tiles
        # (4.24-4.26 vs 4.20-4.23 TB/s at 8), 8 warps for 16K/32K rows (32K: 3.84-3.89 vs
        # 3.73-3.82 at 16).
        return 16 if tile <= 8192 else 8
    if kind == "ln_fwd":  # measured: LayerNorm forward prefers fewer, fuller threads
        return 4 if tile <= 8192 else min(32, tile // 1024)
    if kind == "softmax_fwd":  # 16K columns: 8 warps (fp32 4.08 vs 3.61 TB/s at 16)
        if tile > 16384:
            return 16
        return 8 if tile * elt_size > 8192 else 4
    return max(4, min(16, tile // 512))


def _tile_elems(kind: str, block: int, elt_size: int) -> int:
    forced = OVERRIDES.get(kind, {}).get("tile")
    if forced:
        return forced
    if kind in _TILE_BYTES:
        return _TILE_BYTES[kind] // elt_size
    if kind == "ln_fwd" and block * elt_size <= 2048:
        # Short LayerNorm rows: 8 KB tiles (bf16 256: 3.79 vs 3.51 TB/s; fp32 256: 4.11 vs 3.60)
        return 8192 // elt_size
    return _TILE_ELEMS[kind]


def _cap(kind: str, elt_size: int) -> int:
    # float32 softmax backward rows of 32K spill in one program (y and dy: 128 values per
    # thread); the split-row kernel measured 3.68 vs 3.32 TB/s there.
    if kind == "softmax_bwd" and elt_size == 4:
        return 16384
    return KIND_CAPS[kind]


@config_cache
def row_config(n: int, kind: str, elt_size: int = 2) -> tuple[bool, int, int, int]:
    """(single_block, BLOCK, ROWS, num_warps) for rows of ``n`` elements and a kernel ``kind``
    (``softmax_fwd``, ``softmax_bwd``, ``ln_fwd``, ``ln_bwd``) on ``elt_size``-byte elements.

    Single-block: BLOCK is the padded row and ROWS rows share a program. Looped: BLOCK is the
    chunk streamed per iteration, one row per program.
    """
    block = next_pow2(n)
    if block <= min(single_block_limit(), _cap(kind, elt_size)):
        short = _SHORT_16BIT.get(kind) if elt_size == 2 and not OVERRIDES.get(kind) else None
        if short and block <= 1024 and max(block, 256) in short:
            tile, warps = short[max(block, 256)]
            return True, block, max(1, tile // block), warps
        tile = _tile_elems(kind, block, elt_size)
        rows = max(1, min(64, tile // block))
        return True, block, rows, _warps_for(rows * block, kind, elt_size, block)
    forced = OVERRIDES.get(kind, {}).get("looped")
    if forced:
        return (False, *forced[:1], 1, *forced[1:])
    chunk = min(single_block_limit(), 8192)
    # Looped kernels run one program per row: more threads keep more bytes in flight.
    return False, chunk, 1, max(1, min(16, chunk // 512))


# Kinds that switch back to a persistent grid for padded rows above this many elements
# (LayerNorm forward: 2.79 vs 2.57 TB/s at bf16 16K, and 0.19 of copy at N = 8193 without it).
PERSISTENT_ABOVE = {"ln_fwd": 8192}


def grid_size(num_tiles: int, num_warps: int, kind: str, device: torch.device,
              block: int = 0, vec: int = 0, persistent: bool = False) -> int:
    """Programs for a single-block launch of ``kind`` over ``num_tiles`` row tiles of padded
    rows of ``block`` elements (``persistent``: a persistent grid whatever the kind's rule).
    With unaligned rows (``vec`` > 0, see :func:`tile_rows`) a persistent grid is a multiple of
    ``vec``, so all tiles of a program share one misalignment (weights held in registers stay
    valid)."""
    if (not persistent and not PERSISTENT[kind]
            and block <= PERSISTENT_ABOVE.get(kind, 1 << 62)):
        return max(1, num_tiles)
    # One resident wave: 2048 threads per SM on Hopper/Ampere; the persistent loop does the rest.
    per_sm = max(1, 2048 // (32 * num_warps))
    progs = max(1, min(num_tiles, num_sms(device) * per_sm))
    if vec and progs < num_tiles:
        progs = max(vec, progs // vec * vec)
    return progs


# --------------------------------------------------------------------------- split rows
# Rows too long for one program's registers are split over C programs ("chunks"). Each chunk
# program keeps its piece in registers, publishes a few float32 partial statistics, waits until
# all C chunks of its row have published (a per-row arrival counter), combines the partials and
# writes its piece: the row is read once and written once, as in the single-block kernels.
#
# Waiting on other programs is only safe when they are all resident at once, so these kernels
# run a persistent grid no larger than the GPU holds, launched as a cooperative grid (the driver
# refuses, rather than deadlocks, if it would not fit), with the work item order row-major so the
# chunks of a row run in the same round. The interpreter runs programs one after another, so it
# (and any launch failure) uses the looped kernels instead.

# PREFETCH (a constexpr of every split-row kernel): where a program issues the loads of its
# next row (it keeps the same piece of rows num_progs / C apart): 0 = not ahead (load, reduce,
# publish, wait, write: its loads idle while it waits for its row's other pieces), 1 = before
# publishing and waiting, 2 = right after the wait, overlapping the combine and the write, 3 =
# between publishing and waiting. The release that publishes is a fence (MEMBAR.GPU in SASS):
# it waits for the publishing thread's outstanding loads, so loads issued before it (1) are
# waited for before the release, while loads issued after it (3) are in flight during the wait.
# Each kernel kind's measured choice is in its split config (softmax.py, layernorm.py).
# FUSEDOPS_SPLIT_ROWS=0 turns them off (the looped kernels then handle long rows).
_split_state = {"enabled": __import__("os").environ.get("FUSEDOPS_SPLIT_ROWS", "1") != "0"}


def split_rows_enabled(device: torch.device, n: int, chunk: int) -> bool:
    """Whether the split-row (cooperative) kernels can run rows of ``n`` on ``device`` in equal
    pieces of at most ``chunk`` elements (see :func:`split_pieces`): CUDA, not disabled, and
    all pieces of a row resident at once."""
    if not (_split_state["enabled"] and device.type == "cuda" and not _interpreting()):
        return False
    return cdiv(n, chunk) <= num_sms(device)


def disable_split_rows(reason: str) -> None:
    """Fall back to the looped kernels for the rest of the process (after a launch failure)."""
    import warnings

    if _split_state["enabled"]:
        _split_state["enabled"] = False
        for cache in _config_caches:  # replay plans may hold split launches
            cache.cache_clear()
        warnings.warn(f"fusedops: split-row kernels disabled ({reason}); using looped kernels",
                      RuntimeWarning, stacklevel=3)


@triton.jit
def publish_row(count_ptr, row):
    """Publish this program's partials for ``row`` (its stores before this call)."""
    tl.debug_barrier()  # every thread's partial-statistics stores happen before the release
    tl.atomic_add(count_ptr + row, 1, sem="release")


@triton.jit
def await_row(count_ptr, row, C: tl.constexpr):
    """Wait until all C chunks of ``row`` have published."""
    seen = tl.atomic_add(count_ptr + row, 0, sem="acquire")
    while seen < C:
        seen = tl.atomic_add(count_ptr + row, 0, sem="acquire")


@triton.jit
def split_piece(row, chunk, L, N, stride, BLOCK: tl.constexpr, VEC: tl.constexpr,
                FULL: tl.constexpr = False):
    """``(offs, mask, pos)`` of piece ``chunk`` of row ``row`` in a split-row kernel: lanes
    ``[0, L)`` of BLOCK are positions ``chunk·L + lane`` of the row (VEC == 0) or of its
    aligned body (VEC > 0, row start unaligned: the body starts at the row's first 16-byte
    boundary, column ``head``, and has a multiple of VEC elements; :func:`split_edges` covers
    the rest). ``pos`` is the lane's position; its column is ``head + pos``. L is a multiple of
    16 with VEC > 0, so every access is a 16-byte vector."""
    lanes = tl.arange(0, BLOCK)
    start = row.to(tl.int64) * stride
    pos = chunk * L + lanes
    if FULL:  # L == BLOCK: a piece fills its lanes (fewer mask registers)
        pos = chunk * BLOCK + lanes
    if VEC > 0:
        first = ((start + (VEC - 1)) // VEC) * VEC
        head = (first - start).to(tl.int32)
        return first + pos, (lanes < L) & (pos < ((N - head) // VEC) * VEC), pos
    if FULL:
        return start + pos, pos < N, pos
    return start + pos, (lanes < L) & (pos < N), pos


@triton.jit
def split_head(row, N, stride, VEC: tl.constexpr):
    """``(head, body)`` of an unaligned row: its first aligned column and its body length."""
    start = row.to(tl.int64) * stride
    head = ((((start + (VEC - 1)) // VEC) * VEC) - start).to(tl.int32)
    return head, ((N - head) // VEC) * VEC


@triton.jit
def split_edges(row, chunk, N, stride, VEC: tl.constexpr):
    """``(offs, mask, col)`` of the columns of row ``row`` outside its aligned body (a
    ``2·VEC`` tile: lanes < VEC the head, the rest the tail); only piece 0 has them."""
    head, body = split_head(row, N, stride, VEC)
    j = tl.arange(0, 2 * VEC)
    col = tl.where(j < VEC, j, head + body + (j - VEC))
    mask = (chunk == 0) & tl.where(j < VEC, j < head, col < N)
    return row.to(tl.int64) * stride + col, mask, col


def split_pieces(n: int, chunk: int, vec: int) -> tuple[int, int]:
    """(C, L) for a split-row launch: C pieces of L elements covering rows of ``n`` (L a
    multiple of 16 with unaligned rows, ``vec`` > 0, so pieces of the body stay aligned; the
    last piece of a row whose body is shorter may then be empty, which the kernels allow)."""
    c = cdiv(n, chunk)
    length = cdiv(n, c)
    if vec:
        length = cdiv(length, 16) * 16
        c = cdiv(n, length)
    return c, length


class SplitLauncher:
    """Launches a split-row kernel on a cooperative persistent grid sized from its occupancy.

    The kernel's last runtime parameter must be ``num_progs`` (the grid size), followed only by
    constexprs.
    """

    __slots__ = ("launcher", "blocks_per_sm")

    def __init__(self, kernel, fp_fusion: bool = True, maxnreg: int | None = None) -> None:
        self.launcher = Launcher(kernel, cooperative=True, fp_fusion=fp_fusion, maxnreg=maxnreg)
        self.blocks_per_sm: dict = {}

    def programs(self, items: int, chunks: int, runtime: tuple, consts: tuple, num_warps: int,
                 device: torch.device, vec: int = 0) -> int:
        """The grid size a launch with these arguments uses: a multiple of the chunk count (so
        all chunks of a row run in the same round, and a program keeps one chunk). It depends
        only on the arguments' specialisation, never on earlier calls, so the same shapes always
        get the same grid (and kernels with per-program partials the same summation order).

        With unaligned rows (``vec`` > 0, see :func:`split_piece`) a grid smaller than
        ``items`` is a multiple of ``chunks * vec``: a program's rows are then a multiple of
        ``vec`` apart and share one misalignment (its weight columns stay fixed). Returns 0 if
        neither one item per program nor such a grid fits on the device at once."""
        per_sm = self._per_sm(chunks, runtime, consts, num_warps)
        resident = num_sms(device) * per_sm
        unit = chunks * max(vec, 1)
        fit = resident // unit * unit
        # One item per program whenever all of them fit (items is a multiple of chunks).
        if items <= resident or (not vec and items <= chunks):
            return items
        return fit if fit else (0 if vec else chunks)

    @staticmethod
    def _key(chunks: int, runtime: tuple, consts: tuple, num_warps: int) -> tuple:
        # Occupancy is per compiled kernel: dtypes and alignment change its register count.
        return (num_warps, chunks, consts, *map(_spec, runtime))

    def _per_sm(self, chunks: int, runtime: tuple, consts: tuple, num_warps: int) -> int:
        """Programs per SM that fit at once, from the compiled kernel's register count (compiled
        ahead of the first launch, without running it)."""
        key = self._key(chunks, runtime, consts, num_warps)
        per_sm = self.blocks_per_sm.get(key)
        if per_sm is None:
            per_sm = 1
            try:
                compiled = self.launcher.kernel.warmup(
                    *runtime, 1024, *consts, grid=(1,), num_warps=num_warps,
                    **self.launcher.options)
                compiled._init_handles()
                regs = int(compiled.n_regs or 0)
                # Registers are allocated per warp in units of 256.
                per_warp = -(-regs * 32 // 256) * 256
                if per_warp:
                    per_sm = max(1, min(65536 // (per_warp * num_warps),
                                        2048 // (32 * num_warps)))
                shared = int(getattr(compiled.metadata, "shared", 0) or 0)
                props = torch.cuda.get_device_properties(torch.cuda.current_device())
                smem = getattr(props, "shared_memory_per_multiprocessor", 0) or 0
                if shared and smem:  # the driver reserves 1 KiB per resident block
                    per_sm = max(1, min(per_sm, smem // (shared + 1024)))
            except Exception:  # noqa: BLE001 - an unknown Triton API: one program per SM
                per_sm = 1
            self.blocks_per_sm[key] = per_sm
        return per_sm

    def __call__(self, items: int, chunks: int, runtime: tuple, consts: tuple, num_warps: int,
                 device: torch.device, progs: int | None = None, vec: int = 0) -> int:
        """Launch on ``progs`` programs (default :meth:`programs`); returns the grid size, or 0
        if the launch was refused or no grid fits (the caller then uses another kernel)."""
        if progs is None:
            progs = self.programs(items, chunks, runtime, consts, num_warps, device, vec)
        if not progs:
            return 0
        try:
            self.launcher((progs,), (*runtime, progs, *consts), num_warps)
        except Exception as exc:  # cooperative launch refused, option unknown to this Triton...
            key = self._key(chunks, runtime, consts, num_warps)
            if self.blocks_per_sm.get(key, 1) > 1:
                self.blocks_per_sm[key] = 1  # the occupancy estimate was too high: retry lower
            else:
                disable_split_rows(f"{type(exc).__name__}: {exc}")
            return 0
        return progs


@triton.jit
def _zero_i32(ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=offs < n)


_launch_zero = Launcher(_zero_i32)


def zero_counters(t: torch.Tensor) -> torch.Tensor:
    """Zero a contiguous int32 tensor (the split kernels' row counters) with a launch rather
    than ``zero_()``, so that a recorded call (:func:`record_launches`) replays it."""
    n = t.numel()
    _launch_zero((cdiv(n, 1024),), (t, n, 1024), 4)
    return t


# --------------------------------------------------------------------------- unaligned rows
# In a contiguous tensor whose rows are not a multiple of 16 bytes (N = 2^k + 1, say), row r
# starts at r·N elements: Triton cannot prove any alignment and falls back to 2-byte scalar
# accesses, which halve the bandwidth (0.44-0.54 of copy at N = 8193). The single-block kernels
# instead split each row into its *body*, from the first 16-byte boundary inside the row to the
# last one, addressed from that aligned element with a mask whose bound is a multiple of the
# vector width (so every access is a 16-byte vector), and its two *edges*, at most VEC - 1
# elements on each side, read and written element by element in a small [ROWS, 2·VEC] tile. No
# access leaves the row. (An earlier design read an aligned window of the whole row with
# per-element masks; the second full-width edge store made it slower than scalar access.)


@triton.jit
def tile_rows(tile, stride, ROWS: tl.constexpr, VEC: tl.constexpr):
    """``(rows, head)`` of row tile ``tile``.

    VEC == 0: ROWS consecutive rows, head 0. VEC > 0 (unaligned rows): ROWS rows VEC apart
    (the rows congruent to ``tile`` modulo VEC), which all start at the same misalignment;
    ``head`` (0 <= head < VEC) is the distance from their start to the first 16-byte boundary,
    so lane j of the aligned body is column ``head + j`` in every row of the tile and per-column
    data (LayerNorm's weight) is fetched once per tile. See :func:`num_row_tiles`.
    """
    if VEC > 0:
        r0 = (tile // VEC) * (ROWS * VEC) + tile % VEC
        rows = r0 + tl.arange(0, ROWS) * VEC
        s0 = r0.to(tl.int64) * stride
        head = (((s0 + (VEC - 1)) // VEC) * VEC - s0).to(tl.int32)
    else:
        rows = tile * ROWS + tl.arange(0, ROWS)
        head = 0
    return rows, head


@triton.jit
def row_body(rows, head, M, N, stride, BLOCK_N: tl.constexpr, VEC: tl.constexpr):
    """``(offs, mask)`` of a [ROWS, BLOCK_N] tile of the rows ``rows`` (from :func:`tile_rows`).

    VEC == 0 (rows start 16-byte aligned, which Triton's specialisation of ``stride`` proves):
    lane j is column j. VEC > 0: lane j is column ``head + j``; the mask covers the row's aligned
    body only (:func:`row_edges` covers the rest). Needs N >= 2·VEC and
    BLOCK_N >= (N // VEC) * VEC.
    """
    lanes = tl.arange(0, BLOCK_N)[None, :]
    start = rows.to(tl.int64) * stride
    row_ok = (rows < M)[:, None]
    if VEC > 0:
        # Written as a multiple of VEC so that Triton's alignment analysis sees it as one.
        first = ((start + (VEC - 1)) // VEC) * VEC
        offs = first[:, None] + lanes
        mask = row_ok & (lanes < ((N - head) // VEC) * VEC)
    else:
        offs = start[:, None] + lanes
        mask = row_ok & (lanes < N)
    return offs, mask


@triton.jit
def unrolled_edges(start, N, BODY: tl.constexpr, VEC: tl.constexpr):
    """``(first, head, ecol, emask)`` of an unaligned row read as a fixed-length body plus an
    edge tile (the unrolled kernels for rows that start unaligned). ``start``: the row's first
    element offset (int64); ``first``: its first 16-byte boundary, where BODY = (N // VEC - 1)
    ·VEC body elements start (a multiple of VEC, visibly to the compiler); ``head = first -
    start`` (< VEC). The 4·VEC-lane edge tile holds the rest: lanes < VEC the head before
    ``first``, the others the tail after the body (< 2·VEC elements); ``ecol`` are its columns
    relative to ``start``, ``emask`` which lanes hold one."""
    first = ((start + (VEC - 1)) // VEC) * VEC
    head = (first - start).to(tl.int32)
    j = tl.arange(0, 4 * VEC)
    ecol = tl.where(j < VEC, j, head + BODY + (j - VEC))
    emask = tl.where(j < VEC, j < head, ecol < N)
    return first, head, ecol, emask


@triton.jit
def row_edges(rows, head, M, N, stride, VEC: tl.constexpr):
    """The elements of rows ``rows`` outside their aligned bodies (see :func:`row_body`):
    ``(offs, mask, col)``, offsets and mask of a [ROWS, 2·VEC] tile (lanes < VEC: the head,
    the rest: the tail) and the [1, 2·VEC] columns."""
    j = tl.arange(0, 2 * VEC)[None, :]
    tail = head + ((N - head) // VEC) * VEC  # first column after the body
    col = tl.where(j < VEC, j, tail + (j - VEC))
    mask = (rows < M)[:, None] & tl.where(j < VEC, j < head, col < N)
    offs = rows.to(tl.int64)[:, None] * stride + col
    return offs, mask, col


# FUSEDOPS_ROW_BODY=0 turns the body/edge split off (scalar access for unaligned rows), for
# measurements against it.
_BODY = {"enabled": __import__("os").environ.get("FUSEDOPS_ROW_BODY", "1") != "0"}


def unaligned_vec(n: int, strides: tuple[int, ...], elt_size: int,
                  tensors: tuple[torch.Tensor, ...] = ()) -> int:
    """VEC for :func:`row_body`: the elements per 16 bytes when the rows start unaligned and one
    body/edge split serves every tensor of the call (equal row strides, 16-byte aligned base
    pointers); 0 otherwise (aligned rows, or the scalar fallback).

    The split moves a column to another lane (so another place in the reduction tree) depending
    on where its row starts, so a row's last bits depend on its position in the batch. Under
    ``torch.use_deterministic_algorithms(True)`` unaligned rows take the scalar path instead,
    whose results depend on the row's values only (batch-split invariant)."""
    vec = 16 // elt_size
    for s in strides:  # on every call: the aligned case returns here, in a few bytecodes
        if s % vec:
            break
    else:
        return 0
    if (not _BODY["enabled"] or n < 2 * vec or len(set(strides)) != 1
            or any(t.data_ptr() % 16 for t in tensors)
            or torch.are_deterministic_algorithms_enabled()):
        return 0
    return vec


def num_row_tiles(m: int, rows: int, vec: int) -> int:
    """Row tiles of :func:`tile_rows` covering ``m`` rows (with VEC > 0, up to VEC - 1 of them
    hold fewer rows)."""
    return vec * cdiv(cdiv(m, vec), rows) if vec else cdiv(m, rows)


def body_len(n: int, vec: int) -> int:
    """Longest aligned body of a row of ``n`` elements (the padded length to configure for)."""
    return (n // vec) * vec if vec else n


@config_cache
def unaligned_config(n: int, kind: str, elt_size: int, vec: int) -> tuple[int, int, int, int, int]:
    """(single_block, BLOCK, ROWS, num_warps, VEC) for rows of ``n`` with VEC from
    :func:`unaligned_vec`: :func:`row_config` for the aligned body, with the warps measured for
    the body/edge kernels on H200 (bf16/fp16/fp32 at N = 1025-8193). VEC comes
    back 0 where scalar access measured faster (short float32 rows in the backward kernels)."""
    single, block, rows, warps = row_config(body_len(n, vec), kind, elt_size)
    if not vec:
        return single, block, rows, warps, 0
    if not single or OVERRIDES.get(kind, {}).get("warps"):
        return single, block, rows, warps, vec
    if kind in ("softmax_bwd", "ln_bwd") and block <= 1024 and (elt_size == 4 or kind == "ln_bwd"):
        # float32 softmax backward 1025: 4.06 TB/s scalar vs 3.36; LayerNorm dx 3.39 vs 2.98
        # (16-bit: a tie at 1.81-1.93).
        return (*row_config(n, kind, elt_size), 0)
    if kind == "softmax_fwd" and block <= 8192:
        warps = 4  # bf16 8193: 4.01 vs 2.73 TB/s at 8 warps; 4097: 3.55 either way
    elif kind == "softmax_bwd":
        warps = 16 if block <= 1024 else 8  # bf16 1025: 2.55 vs 2.07; 4097: 4.17 vs 2.52
    elif kind == "ln_bwd":
        warps = 4  # bf16 4097: 2.68 vs 2.13 TB/s at 8 warps; float32 2049: 4.02 vs 3.85
    return single, block, rows, warps, vec


def unrolled_config(table: dict, elt_size: int, n: int, above: int,
                    vec: int) -> tuple[int, int] | None:
    """(chunk, warps) of an unrolled-kernel rule ``table`` ((element size, padded row) ->
    configs) for aligned rows of ``n`` elements: the first config whose chunk divides ``n``;
    None for rows of at most ``above`` elements, unaligned rows (``vec``), changed block limits,
    rows no chunk divides, and configs with 0 warps (rows left to the other kernels)."""
    if n <= above or vec or single_block_limit() != DEFAULT_SINGLE_BLOCK_LIMIT:
        return None
    for chunk, warps in table.get((elt_size, next_pow2(n)), ()):
        if n % chunk == 0:
            return (chunk, warps) if warps else None
    return None
