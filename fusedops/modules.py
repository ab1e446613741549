"""Drop-in modules: same constructor, parameters, state_dict and repr as torch's, fused forward."""

from __future__ import annotations

import torch
from torch import nn

from fusedops.ops import _route
from fusedops.ops.layernorm import fused_layernorm
from fusedops.ops.rmsnorm import fused_rmsnorm
from fusedops.ops.softmax import fused_softmax

# The norms' short path: a call below its op's size rule is torch's op, reached from C++
# (fusedops.ops._route) in fewer calls than nn.LayerNorm's own forward makes (a patched
# model's host cost); anything else goes through the public op.
_route_layernorm, _route_rmsnorm = _route.layernorm, _route.rmsnorm
_dynamo_compiling = _route.dynamo_compiling
# Parameters are read from ``_parameters`` where they are there: ``self.weight`` goes through
# nn.Module.__getattr__, a Python call (0.4 µs on a CPU). Anywhere else (a parametrization's
# property) the attribute is read.
MISSING = object()


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
        if not _dynamo_compiling():
            params = self._parameters
            weight, bias = params.get("weight", MISSING), params.get("bias", MISSING)
            if weight is not MISSING and bias is not MISSING:
                y = _route_layernorm(input, self.normalized_shape, weight, bias, self.eps,
                                     None, 0.0, None, True)
                if y is not None:
                    return y
        return fused_layernorm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class FusedRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` whose forward runs :func:`fused_rmsnorm`.

    Same constructor (``normalized_shape, eps=None, elementwise_affine=True, device=None,
    dtype=None``), parameters, state_dict keys and repr as ``nn.RMSNorm``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _dynamo_compiling():
            weight = self._parameters.get("weight", MISSING)
            if weight is not MISSING:
                y = _route_rmsnorm(x, self.normalized_shape, weight, self.eps)
                if y is not None:
                    return y
        return fused_rmsnorm(x, self.normalized_shape, self.weight, self.eps)
