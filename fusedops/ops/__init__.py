"""One file per op: the autograd Function, the public function and the backend dispatch."""

from fusedops.ops.layernorm import LayerNormFunction, fused_layernorm
from fusedops.ops.layernorm_epilogue import LayerNormEpilogueFunction
from fusedops.ops.rmsnorm import RMSNormFunction, fused_rmsnorm
from fusedops.ops.softmax import SoftmaxFunction, fused_softmax
from fusedops.ops.softmax_masked import MaskedSoftmaxFunction

__all__ = ["LayerNormEpilogueFunction", "LayerNormFunction", "MaskedSoftmaxFunction",
           "RMSNormFunction", "SoftmaxFunction", "fused_layernorm", "fused_rmsnorm",
           "fused_softmax"]
