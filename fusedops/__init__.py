"""fusedops: fused softmax, LayerNorm and RMSNorm for PyTorch, and the tools to prove they help.

Public API only; see docs/api.md.
"""

from fusedops._dispatch import count_fused_calls, get_backend, set_backend, use_backend
from fusedops._settings import (
    get_layernorm_backward,
    layernorm_backward_mode,
    set_layernorm_backward,
)
from fusedops.modules import FusedLayerNorm, FusedRMSNorm, FusedSoftmax
from fusedops.ops import (
    LayerNormEpilogueFunction,
    LayerNormFunction,
    MaskedSoftmaxFunction,
    RMSNormFunction,
    SoftmaxFunction,
    fused_layernorm,
    fused_rmsnorm,
    fused_softmax,
)
from fusedops.patching import PatchReport, is_patched, patch_model, patched, unpatch_model

__version__ = "0.1.0"

__all__ = [
    "FusedLayerNorm",
    "FusedRMSNorm",
    "FusedSoftmax",
    "LayerNormEpilogueFunction",
    "LayerNormFunction",
    "MaskedSoftmaxFunction",
    "PatchReport",
    "RMSNormFunction",
    "SoftmaxFunction",
    "count_fused_calls",
    "fused_layernorm",
    "fused_rmsnorm",
    "fused_softmax",
    "get_backend",
    "get_layernorm_backward",
    "is_patched",
    "layernorm_backward_mode",
    "patch_model",
    "patched",
    "set_backend",
    "set_layernorm_backward",
    "unpatch_model",
    "use_backend",
]
