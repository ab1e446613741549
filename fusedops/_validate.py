"""Argument checks shared by the ops. Each raises before any kernel runs and names the argument."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing
    torch.distributed when nothing has: no DTensor can exist then)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def check_same_kind(t: torch.Tensor, name: str, x: torch.Tensor) -> None:
    """Raise (naming the argument) when one of ``x`` and ``t`` is a DTensor and the other a
    plain tensor: no conversion between them is known to be right."""
    if t.__class__ is x.__class__ or is_dtensor(t) == is_dtensor(x):
        return
    if is_dtensor(t):
        raise TypeError(
            f"{name} is a DTensor but x is a plain torch.Tensor: pass x as a DTensor on "
            f"{name}'s device mesh, or a plain {name} ({name}.full_tensor())")
    raise TypeError(
        f"{name} is a plain torch.Tensor but x is a DTensor: pass {name} as a DTensor on "
        f"x's device mesh (e.g. distribute_tensor({name}, mesh, [Replicate()]))")


def check_float_tensor(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    return t


def normalize_dim(dim: object, ndim: int, name: str = "dim") -> int:
    if dim.__class__ is int and -ndim <= dim < ndim:  # the common case, checked cheaply
        return dim % ndim
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name} must be an int, got {type(dim).__name__}")
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise ValueError(
            f"{name}={dim} is out of range for a tensor with {ndim} dimension(s) "
            f"(expected [{-rank}, {rank - 1}])"
        )
    return dim % rank


def check_float_dtype(dtype: object, name: str = "dtype") -> torch.dtype | None:
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point torch.dtype or None, got {dtype!r}")
    return dtype


def normalize_shape(normalized_shape: object) -> tuple[int, ...]:
    cls = normalized_shape.__class__
    if cls is int:
        return (normalized_shape,)
    if (cls is tuple or cls is torch.Size or cls is list) and len(normalized_shape) == 1:
        n = normalized_shape[0]
        if n.__class__ is int and n >= 0:  # the common case: one trailing dim
            return (n,)
    if isinstance(normalized_shape, int) and not isinstance(normalized_shape, bool):
        return (normalized_shape,)
    if isinstance(normalized_shape, torch.Size | Sequence) and all(
        isinstance(s, int) and not isinstance(s, bool) for s in normalized_shape
    ):
        shape = tuple(int(s) for s in normalized_shape)
        if len(shape) == 0:
            raise ValueError("normalized_shape must have at least one dimension")
        if any(s < 0 for s in shape):
            raise ValueError(f"normalized_shape must be non-negative, got {shape}")
        return shape
    raise TypeError(
        f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}"
    )


def check_layernorm_args(
    x: object,
    shape: tuple[int, ...],
    weight: object,
    bias: object,
    eps: object,
) -> None:
    x = check_float_tensor(x, "x")
    if len(shape) == 1 and x.dim() >= 1 and x.shape[-1] == shape[0]:
        pass  # the common case, without building a tuple of x's trailing dims
    elif tuple(x.shape[x.dim() - len(shape):]) != shape or x.dim() < len(shape):
        raise ValueError(
            f"normalized_shape={list(shape)} does not match the trailing dimensions of x "
            f"with shape {list(x.shape)}"
        )
    # Written out per parameter, not as a loop over (name, tensor) pairs: this runs on every
    # call (host cost, docs/performance.md "Small shapes").
    if weight is not None:
        _check_param(weight, "weight", shape, x)
    if bias is not None:
        _check_param(bias, "bias", shape, x)
    if eps.__class__ is not float or not eps >= 0:
        check_eps(eps)


def check_eps(eps: object) -> None:
    """Raise unless ``eps`` is a non-negative real number (bool excluded)."""
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")


def _check_param(p: object, name: str, shape: tuple[int, ...], x: torch.Tensor) -> None:
    cls = p.__class__
    if (cls is torch.Tensor or cls is torch.nn.Parameter) and p.is_floating_point() \
            and p.shape == shape and (p.is_cuda and x.is_cuda and p.get_device() == x.get_device()
                                      or p.is_cpu and x.is_cpu):
        return  # the common case, without building device objects (host cost per call)
    check_float_tensor(p, name)
    check_same_kind(p, name, x)
    if p.shape != shape:
        raise ValueError(
            f"{name} must have shape {list(shape)} (normalized_shape), got {list(p.shape)}"
        )
    if p.device != x.device:
        raise ValueError(f"{name} is on {p.device} but x is on {x.device}")


def check_rmsnorm_args(x: object, shape: tuple[int, ...], weight: object, eps: object) -> None:
    """:func:`check_layernorm_args` for RMSNorm: no bias, and ``eps`` may be None."""
    check_layernorm_args(x, shape, weight, None, 0.0 if eps is None else eps)


def broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to exactly ``target`` (torch's rules, trailing
    dims aligned). Plain Python: ``torch.broadcast_shapes`` costs tens of microseconds per call
    on the host (it runs the symbolic-shape machinery), and this runs on every masked call."""
    if len(shape) > len(target):
        return False
    offset = len(target) - len(shape)
    return all(s == 1 or s == target[offset + i] for i, s in enumerate(shape))
