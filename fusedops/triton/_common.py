"""Launch-side helpers shared by the Triton kernels: device facts cached once per device."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Rows whose padded length is at most this many elements are held whole in registers by one
# program (read once, written once). Longer rows take the chunked (looped) kernels. Tests shrink
# it (see ``set_single_block_limit``) so the looped path is exercised with small rows.
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
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on ``device`` (a small constant for CPU/interpreter runs)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


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


class Launcher:
    """Launches a ``@triton.jit`` kernel with a lean host path.

    ``JITFunction.__call__`` re-derives the specialisation key and binds arguments on every call,
    which costs more host time than the kernel itself for small tensors. The first launch for a
    given specialisation (dtypes, 16-byte alignment of pointers, divisibility/size of integers,
    constexprs, num_warps) goes through Triton; later ones call the cached compiled kernel
    directly. Arguments must be passed positionally, constexprs included, in signature order.
    On CPU tensors (``TRITON_INTERPRET=1``) every call goes through Triton.
    """

    __slots__ = ("kernel", "compiled", "direct", "n_runtime")

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.compiled: dict = {}
        self.direct = True
        params = getattr(kernel, "params", None)
        if params is None:  # the interpreter's wrapper: no compiled kernels to cache
            self.direct, self.n_runtime = False, 0
            return
        # Constexprs come last in every kernel here; they enter the cache key by value.
        flags = [p.is_constexpr for p in params]
        self.n_runtime = flags.index(True) if True in flags else len(flags)
        if any(not f for f in flags[self.n_runtime:]):
            raise TypeError(f"{kernel.__name__}: constexpr parameters must come last")

    def __call__(self, grid: tuple[int, ...], args: tuple, num_warps: int) -> None:
        if not self.direct:
            self.kernel[grid](*args, num_warps=num_warps)
            return
        n = self.n_runtime
        key = (num_warps, *map(_spec, args[:n]), *args[n:])
        compiled = self.compiled.get(key)
        if compiled is not None:
            # The compiled runner indexes all three grid dimensions.
            compiled[(grid + (1, 1))[:3]](*args)
            return
        compiled = self.kernel[grid](*args, num_warps=num_warps)
        if callable(getattr(compiled, "__getitem__", None)) and hasattr(compiled, "run"):
            self.compiled[key] = compiled
        elif not _interpreting():
            # An unknown Triton runtime API: stay on the safe (slower) path for this kernel.
            self.direct = False


@functools.cache
def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Launch configurations, from the H200 measurements in benchmarks/dev/probe.py (see
# docs/performance.md). Per kernel kind: the largest padded row kept in registers (above it the
# looped kernels win), the program tile in *bytes* of input (several short rows per program so
# every thread holds a few 16-byte vectors), and the threads per program.
KIND_CAPS = {"softmax_fwd": 65536, "softmax_bwd": 32768, "ln_fwd": 32768, "ln_bwd": 32768}
_TILE_ELEMS = {"softmax_fwd": 2048, "softmax_bwd": 4096, "ln_fwd": 8192, "ln_bwd": 4096}


def _warps_for(tile: int, kind: str) -> int:
    if kind == "ln_fwd":  # measured: LayerNorm forward prefers fewer, fuller threads
        return 4 if tile <= 8192 else min(32, tile // 1024)
    if kind == "softmax_fwd":
        return 8 if tile <= 8192 else 16
    return max(4, min(16, tile // 512))


@config_cache
def row_config(n: int, kind: str, elt_size: int = 2) -> tuple[bool, int, int, int]:
    """(single_block, BLOCK, ROWS, num_warps) for rows of ``n`` elements and a kernel ``kind``
    (``softmax_fwd``, ``softmax_bwd``, ``ln_fwd``, ``ln_bwd``). ``elt_size`` is accepted for
    dtype-specific tuning (the measured optimum is currently the same for 2- and 4-byte types).

    Single-block: BLOCK is the padded row and ROWS rows share a program. Looped: BLOCK is the
    chunk streamed per iteration, one row per program.
    """
    block = next_pow2(n)
    if block <= min(single_block_limit(), KIND_CAPS[kind]):
        rows = max(1, min(64, _TILE_ELEMS[kind] // block))
        return True, block, rows, _warps_for(rows * block, kind)
    chunk = min(single_block_limit(), 8192)
    return False, chunk, 1, _warps_for(chunk, kind)
