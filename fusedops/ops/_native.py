"""PyTorch's own ops standing in for a fused call, where ``fusedops._dispatch.fused_backend``
says they are the better choice (no fused backend, small calls, torch.compile, torch.func).

They keep the fused ops' semantics: 16-bit inputs with float32 parameters are normalised in
float32 and rounded once to the input's dtype, as the kernels do (CUDA's native LayerNorm and
both devices' RMSNorm take one dtype for all their tensors; CPU's LayerNorm mixes them itself).
"""

from __future__ import annotations

import torch


def _mixed(x: torch.Tensor, p: torch.Tensor | None) -> bool:
    return p is not None and p.dtype != x.dtype


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _cast(p: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if p is None else p.to(dtype)


def layer_norm(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None,
               bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``F.layer_norm`` with fused_layernorm's dtype rules (result in x's dtype)."""
    if x.is_cuda and (_mixed(x, weight) or _mixed(x, bias)) \
            and not torch.is_autocast_enabled("cuda"):  # (autocast casts all three itself)
        acc = _acc(x)
        y = torch.layer_norm(x.to(acc), shape, _cast(weight, acc), _cast(bias, acc), eps)
        return y.to(x.dtype)
    return torch.layer_norm(x, shape, weight, bias, eps)


def rms_norm(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None,
             eps: float | None) -> torch.Tensor:
    """``F.rms_norm`` with fused_rmsnorm's dtype rules (result in x's dtype)."""
    if _mixed(x, weight) and not (x.is_cuda and torch.is_autocast_enabled("cuda")):
        # (torch's kernels take one dtype: it would warn and compose it from several ops)
        acc = _acc(x)
        return torch.rms_norm(x.to(acc), shape, weight.to(acc), eps).to(x.dtype)
    return torch.rms_norm(x, shape, weight, eps)
