"""Drop-in modules: same constructor, parameters, state_dict and repr as torch's, fused forward."""

from __future__ import annotations

import torch
from torch import nn

from fusedops import _dispatch
from fusedops.ops._native import ERRORS
from fusedops.ops.layernorm import fused_layernorm
from fusedops.ops.rmsnorm import fused_rmsnorm
from fusedops.ops.softmax import fused_softmax

# The norms' short path: a call below its op's size rule without autograd (no rule with
# autograd is lower, fusedops._dispatch) is torch's op whatever the grad mode. The rule is
# read inline (one lookup, one size test): a patched model makes these calls per layer.
_LN_RULES = _dispatch.SIZE_RULES["layernorm"]
_RMS_RULES = _dispatch.SIZE_RULES["rmsnorm"]



class FusedSoftmax(nn.Softmax):
    """``nn.Softmax`` whose forward runs :func:`fused_softmax`.

    Constructor, attributes and repr are ``nn.Softmax``'s. ``dim=None`` keeps torch's legacy
    implicit-dim rule (0 for 0-, 1- and 3-d inputs, else 1) without the deprecation warning.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        dim = self.dim
        if dim is None:
            dim = 0 if input.dim() in (0, 1, 3) else 1
        return fused_softmax(input, dim)


class FusedLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose forward runs :func:`fused_layernorm`.

    Same constructor (``normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
    device=None, dtype=None``), parameters, state_dict keys and repr as ``nn.LayerNorm``.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, bias, eps = self.weight, self.bias, self.eps
        if input.__class__ is torch.Tensor and eps.__class__ is float and eps >= 0.0:
            key = (True, input.dtype, False) if input.is_cuda else (
                "cpu" if input.is_cpu else input.device.type, input.dtype, False)
            below = _LN_RULES.get(key)
            if below is None:  # (first sight, also where only autograd calls come)
                below = _dispatch.size_rule("layernorm", key)
            if input.numel() < below and (weight is None or weight.dtype is input.dtype) \
                    and (bias is None or bias.dtype is input.dtype):
                # torch's op, reached in fewer calls than nn.LayerNorm's own forward makes (a
                # patched model's host cost). Where torch raises, the call below raises
                # fusedops' error, naming the argument.
                try:
                    return torch.layer_norm(input, self.normalized_shape, weight, bias, eps)
                except ERRORS:
                    pass
        return fused_layernorm(input, self.normalized_shape, weight, bias, eps)


class FusedRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` whose forward runs :func:`fused_rmsnorm`.

    Same constructor (``normalized_shape, eps=None, elementwise_affine=True, device=None,
    dtype=None``), parameters, state_dict keys and repr as ``nn.RMSNorm``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, eps = self.weight, self.eps
        if x.__class__ is torch.Tensor and (eps is None or eps.__class__ is float and eps >= 0.0):
            key = (True, x.dtype, False) if x.is_cuda else (
                "cpu" if x.is_cpu else x.device.type, x.dtype, False)
            below = _RMS_RULES.get(key)
            if below is None:
                below = _dispatch.size_rule("rmsnorm", key)
            if x.numel() < below and (weight is None or weight.dtype is x.dtype):
                try:  # (as above)
                    return torch.rms_norm(x, self.normalized_shape, weight, eps)
                except ERRORS:
                    pass
        return fused_rmsnorm(x, self.normalized_shape, weight, eps)
