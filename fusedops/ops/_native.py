"""PyTorch's own ops standing in for a fused call, where ``fusedops._dispatch.fused_backend``
says they are the better choice (no fused backend, small calls, torch.compile, torch.func).

They keep the fused ops' semantics: inputs and parameters of different dtypes are normalised in
float32 (float64 for float64 inputs) and rounded once to the input's dtype, as the kernels do
(torch's kernels take one dtype for all their tensors; CPU LayerNorm's mixed-dtype kernel has
no backward without a weight).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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


def layer_norm(x: torch.Tensor, shape: int | Sequence[int], weight: torch.Tensor | None,
               bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``F.layer_norm`` with fused_layernorm's dtype rules (result in x's dtype)."""
    if (_mixed(x, weight) or _mixed(x, bias)) \
            and not (x.is_cuda and torch.is_autocast_enabled("cuda")):  # (autocast casts them)
        acc = _acc(x)
        y = torch.layer_norm(x.to(acc), shape, _cast(weight, acc), _cast(bias, acc), eps)
        return y.to(x.dtype)
    return torch.layer_norm(x, shape, weight, bias, eps)


def rms_norm(x: torch.Tensor, shape: int | Sequence[int], weight: torch.Tensor | None,
             eps: float | None) -> torch.Tensor:
    """``F.rms_norm`` with fused_rmsnorm's dtype rules (result in x's dtype)."""
    if _mixed(x, weight) and not (x.is_cuda and torch.is_autocast_enabled("cuda")):
        # (torch's kernels take one dtype: it would warn and compose it from several ops)
        acc = _acc(x)
        return torch.rms_norm(x.to(acc), shape, weight.to(acc), eps).to(x.dtype)
    return torch.rms_norm(x, shape, weight, eps)
