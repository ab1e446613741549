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
