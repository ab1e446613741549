"""Host helpers shared by the Metal ops: the launcher protocol, kernel names per type pair,
the row kernel and threadgroup size, argument bindings."""

from __future__ import annotations

from typing import Protocol

import torch

from fusedops import _philox
from fusedops.backends import reference
from fusedops.backends.metal.rules import (
    FLAG_DROPOUT,
    FLAG_GELU,
    FLAG_RELU,
    LAYERNORM_EPILOGUE_TYPES,
    LAYERNORM_TYPES,
    READS,
    RMSNORM_TYPES,
    SOFTMAX_BWD_TYPES,
    SOFTMAX_FWD_TYPES,
    SOFTMAX_MASKED_BWD_TYPES,
    SOFTMAX_MASKED_FWD_TYPES,
    TYPE_NAMES,
    philox_row_threads,
    philox_threadgroup_limit,
    row_threads,
    single_row_limit,
    threadgroup_limit,
)


class Launcher(Protocol):
    def has(self, name: str) -> bool: ...

    def max_threads(self, name: str) -> int: ...

    def __call__(self, name: str, args: list, groups: int, threads: int) -> None: ...


def aligned(*tensors: torch.Tensor) -> bool:
    """True when every row start of every (row-major) tensor is READS-element aligned."""
    for t in tensors:
        if t.storage_offset() % READS:
            return False
        if t.dim() == 2 and t.shape[0] > 1 and t.stride(0) % READS:
            return False
    return True


def empty_arg(like: torch.Tensor) -> torch.Tensor:
    """Binding for an argument the kernel does not touch (its flag is off)."""
    return torch.empty(0, dtype=torch.float32, device=like.device)


_SUPPORTED = {"softmax_fwd": SOFTMAX_FWD_TYPES, "softmax_bwd": SOFTMAX_BWD_TYPES,
              "layernorm_fwd": LAYERNORM_TYPES, "layernorm_bwd": LAYERNORM_TYPES,
              "rmsnorm_fwd": RMSNORM_TYPES, "rmsnorm_bwd": RMSNORM_TYPES,
              "softmax_masked_fwd": SOFTMAX_MASKED_FWD_TYPES,
              "softmax_masked_bwd": SOFTMAX_MASKED_BWD_TYPES,
              "layernorm_epilogue_fwd": LAYERNORM_EPILOGUE_TYPES,
              "layernorm_epilogue_bwd": LAYERNORM_EPILOGUE_TYPES}


_names: dict[tuple, tuple[str, str] | None] = {}


def kernel_names(launch: Launcher, op: str, types: tuple) -> tuple[str, str] | None:
    """(single, looped) kernel names of ``op`` for a type pair, or None when not available
    (an unsupported pair, or bfloat on a Metal without ``__HAVE_BFLOAT__``). Cached."""
    key = (launch, op, types)
    try:
        return _names[key]
    except KeyError:
        pass
    names = None
    if types in _SUPPORTED[op]:
        suffix = "_".join(types)
        single = f"fusedops_{op}_single_{suffix}"
        looped = f"fusedops_{op}_looped_{suffix}"
        if launch.has(single) and launch.has(looped):
            names = (single, looped)
    _names[key] = names
    return names


def row_kernel(launch: Launcher, names: tuple[str, str], n: int) -> tuple[str, int]:
    """The kernel for rows of n columns and its threadgroup size."""
    single, looped = names
    limit = launch.max_threads(single)
    if n <= single_row_limit(limit):
        return single, row_threads(n, limit)
    return looped, threadgroup_limit(launch.max_threads(looped))


def param(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.reshape(-1).to(torch.float32).contiguous()


def rows2d(t: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor with unit column stride (a copy only when it has none)."""
    return t if t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


def mask_kind(mask: torch.Tensor | None, x_type: str | None) -> str:
    """The kernel's mask type: "bool", x's type, or "float" (any other dtype, converted)."""
    if mask is None or mask.dtype == torch.bool:
        return "bool"  # without a mask: the bool kernel, FLAG_MASK off
    name = TYPE_NAMES.get(mask.dtype)
    return name if name == x_type else "float"


def compact_to(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` converted to ``dtype`` without materialising its broadcast (stride-0) dims."""
    idx = tuple(slice(0, 1) if st == 0 and sz > 1 else slice(None)
                for sz, st in zip(mask.shape, mask.stride(), strict=True))
    return mask[idx].to(dtype).expand(mask.shape)


MASK_DTYPES = {"bool": torch.bool, "float": torch.float32, "half": torch.float16,
                "bfloat": torch.bfloat16}


def epilogue_flags(dropout_p: float, activation: str | None) -> tuple[int, int, float]:
    """(flags, keep threshold, keep scale) of the dropout and activation arguments."""
    if activation not in reference.ACTIVATIONS:
        raise ValueError(f"activation must be one of {reference.ACTIVATIONS}, got {activation!r}")
    flags = FLAG_RELU if activation == "relu" else FLAG_GELU if activation == "gelu" else 0
    p = float(dropout_p)
    if p == 0.0:
        return flags, 0, 1.0
    return flags | FLAG_DROPOUT, _philox.dropout_threshold(p), 1.0 / (1.0 - p)


def seed_arg(seed: int) -> int:
    """The 64-bit seed as the kernels' signed 64-bit integer (same bits)."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return s - (1 << 64) if s >= 1 << 63 else s


def epilogue_kernel(launch: Launcher, names: tuple[str, str], n: int,
                     dropout: bool) -> tuple[str, int, bool]:
    """(kernel, threadgroup size, Philox layout) for rows of n columns. With dropout, the Philox
    layout wherever the pipelines allow whole groups of PHILOX_W threads."""
    single, looped = names
    if dropout:
        ls = philox_threadgroup_limit(launch.max_threads(single))
        ll = philox_threadgroup_limit(launch.max_threads(looped))
        if ls and ll:
            if n <= READS * ls:
                return single, philox_row_threads(n, launch.max_threads(single)), True
            return looped, ll, True
    name, threads = row_kernel(launch, names, n)
    return name, threads, False
