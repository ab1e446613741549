"""Drop-in modules: same constructor, parameters, state_dict and repr as torch's, fused forward."""

from __future__ import annotations

import torch
from torch import nn

from fusedops.ops.layernorm import fused_layernorm
from fusedops.ops.rmsnorm import fused_rmsnorm
from fusedops.ops.softmax import fused_softmax


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
        return fused_layernorm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class FusedRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` whose forward runs :func:`fused_rmsnorm`.

    Same constructor (``normalized_shape, eps=None, elementwise_affine=True, device=None,
    dtype=None``), parameters, state_dict keys and repr as ``nn.RMSNorm``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_rmsnorm(x, self.normalized_shape, self.weight, self.eps)
