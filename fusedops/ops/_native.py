"""PyTorch's own ops standing in for a fused call, where ``fusedops._dispatch.fused_backend``
says they are the better choice (no fused backend, small calls, torch.compile, torch.func).

They keep the fused ops' semantics: inputs and parameters of different dtypes are normalised in
float32 (float64 for float64 inputs) and rounded once to the input's dtype, as the kernels do
(torch's kernels take one dtype for all their tensors; CPU LayerNorm's mixed-dtype kernel has
no backward without a weight).
"""

from __future__ import annotations

import torch

from fusedops._validate import check_layernorm_args, check_rmsnorm_args, normalize_shape


def _mixed(x: torch.Tensor, p: torch.Tensor | None) -> bool:
    if p is None or p.dtype == x.dtype:
        return False
    if not p.is_floating_point():  # (a cast would hide it: the op names the argument)
        raise TypeError("parameter is not a floating-point tensor")
    return True


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _cast(p: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if p is None else p.to(dtype)


# What torch reads as a shape as given, and the errors its norms raise for bad arguments (the
# ops' one-call paths read them too).
SHAPES = (tuple, list, torch.Size)
ERRORS = (RuntimeError, TypeError, IndexError, ValueError)


def _as_shape(normalized_shape: object) -> object:
    """What torch reads as a shape: a tuple, a list or a Size as given, an int (or a SymInt
    under dynamic compile) in a tuple."""
    return normalized_shape if isinstance(normalized_shape, SHAPES) else (normalized_shape,)


def layer_norm(x: torch.Tensor, normalized_shape: object, weight: torch.Tensor | None,
               bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``F.layer_norm`` with fused_layernorm's dtype rules (result in x's dtype). Arguments
    are torch's to check; where torch raises, fusedops' checks name the argument."""
    shape = _as_shape(normalized_shape)
    try:
        if (_mixed(x, weight) or _mixed(x, bias)) \
                and not (x.is_cuda and torch.is_autocast_enabled("cuda")):  # (autocast casts)
            acc = _acc(x)
            y = torch.layer_norm(x.to(acc), shape, _cast(weight, acc), _cast(bias, acc), eps)
            return y.to(x.dtype)
        return torch.layer_norm(x, shape, weight, bias, eps)
    except ERRORS:
        check_layernorm_args(x, normalize_shape(normalized_shape), weight, bias, eps)
        raise


def rms_norm(x: torch.Tensor, normalized_shape: object, weight: torch.Tensor | None,
             eps: float | None) -> torch.Tensor:
    """``F.rms_norm`` with fused_rmsnorm's dtype rules (result in x's dtype); errors as in
    :func:`layer_norm`."""
    shape = _as_shape(normalized_shape)
    try:
        if _mixed(x, weight) and not (x.is_cuda and torch.is_autocast_enabled("cuda")):
            # (torch's kernels take one dtype: it would warn and compose it from several ops)
            acc = _acc(x)
            return torch.rms_norm(x.to(acc), shape, weight.to(acc), eps).to(x.dtype)
        return torch.rms_norm(x, shape, weight, eps)
    except ERRORS:
        check_rmsnorm_args(x, normalize_shape(normalized_shape), weight, eps)
        raise
