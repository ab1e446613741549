"""The lean launch path of a ``@triton.jit`` kernel (:class:`Launcher`)."""

from __future__ import annotations

import torch
import triton

from fusedops.backends.triton.runtime.device import interpreting
from fusedops.backends.triton.runtime.recording import record_launch, recording


def launch_spec(a: object) -> object:
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


def launch_key(num_warps: int, args: tuple, n: int) -> tuple:
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
launch_hooks = getattr(getattr(triton, "knobs", None), "runtime", None)


class Launcher:
    """Launches a ``@triton.jit`` kernel with a lean host path.

    ``JITFunction.__call__`` re-derives the specialisation key, binds arguments, builds launch
    metadata for Triton's (usually empty) launch hooks and looks up the device and stream on
    every call, which costs more host time than the kernel itself for small tensors. The first
    launch for a given specialisation (see :func:`launch_key`) goes through Triton; later ones
    call the compiled kernel's launcher directly with the tensor's device's current stream
    (on Triton 3.6, its C entry point itself: see :func:`direct_entry`). The key is computed
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
        self.direct = current_stream is not None and launch_hooks is not None
        self.options = {"launch_cooperative_grid": True} if cooperative else {}
        if not fp_fusion:
            # No multiply-add contraction: every operation rounds on its own, so two kernels
            # written with the same arithmetic give the same bits however their code is split
            # into basic blocks (the contraction is decided per block).
            self.options["enable_fp_fusion"] = False
        if maxnreg and not interpreting():
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
            if recording:
                record_launch(self, grid, args, num_warps)
            return compiled
        try:
            key = self.key(num_warps, args)
        except Exception:  # first call, or other argument kinds than the generated key's
            key = launch_key(num_warps, args, self.n_runtime)
            if self.key is None:
                self.key = _key_function(args, self.n_runtime)
        entry = self.compiled.get(key)
        if entry is not None and not hooks_registered():
            entry(grid, current_stream(key[0]), args)
            if recording:
                record_launch(self, grid, args, num_warps)
            return None
        compiled = self.kernel[grid](*args, num_warps=num_warps, **self.options)
        if entry is None:
            self._remember(key, compiled)
        if recording:
            record_launch(self, grid, args, num_warps)
        return compiled

    def entry(self, args: tuple, num_warps: int):
        """The direct launch callable compiled for these arguments' specialisation (see
        :func:`direct_entry`), or None when there is none yet or this launcher has no direct
        path. For :class:`PlanCache` entries."""
        if not self.direct:
            return None
        try:
            key = self.key(num_warps, args)
        except Exception:
            key = launch_key(num_warps, args, self.n_runtime)
        return self.compiled.get(key)

    def _remember(self, key: tuple, compiled) -> None:
        entry = direct_entry(compiled)
        if entry is not None:
            self.compiled[key] = entry
        elif not interpreting():
            # An unknown Triton runtime API: stay on Triton's own (slower) path for this kernel.
            self.direct = False


def _key_function(args: tuple, n: int):
    """A function ``(num_warps, args) -> key`` equal to :func:`launch_key` for arguments of
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


def direct_entry(compiled, metadata: tuple | None = None):
    """``go(grid, stream, args)`` launching ``compiled`` without Triton's Python layers, or
    None where its runtime API is not the one known here. ``metadata``: the launch's packed
    (num_warps, CTAs per cluster, shared memory bytes) instead of the compiled kernel's (see
    ``runtime/clusters.py``; Triton 3.6 and 3.9 pack these three)."""
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
        go.compiled = compiled  # its signature and PTX, for the C++ host plans (host_ext.py)
        return go

    def go(grid, stream, args):
        g = (*grid, 1, 1)
        run(g[0], g[1], g[2], stream, function, metadata, None, None, None, *args)
    return go


def hooks_registered() -> bool:
    """Whether a Triton launch hook is registered (a profiler such as Proton)."""
    hook = launch_hooks.launch_enter_hook
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)  # Triton >= 3.5: a HookChain, empty by default
    return calls is None or len(calls) > 0
