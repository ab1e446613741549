"""Memory measurements for the fused ops: bytes saved for backward and peak bytes of a step.

Used by ``tests/test_memory.py`` and ``benchmarks/dev/memory_report.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def saved_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(bytes of the unique storages autograd saves for backward while ``fn`` runs, fn's result).

    Storages are counted once each (a tensor and its views share one), via
    ``torch.autograd.graph.saved_tensors_hooks``.
    """
    storages: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[(t.device, s.data_ptr())] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


def peak_bytes(step: Callable[[], None]) -> int:
    """Peak CUDA bytes requested above the starting point while ``step`` runs, measured on a
    second call (the first warms up kernels and the caching allocator).

    Requested bytes are the tensors' own sizes. The allocator's counts (``memory_allocated``)
    add block rounding and unsplit cached blocks, which depend on what ran earlier in the
    process, so two steps with the same tensors could compare either way."""
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_stats()["requested_bytes.all.current"]
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["requested_bytes.all.peak"] - base
