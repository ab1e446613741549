"""One file per op: the autograd Function, the public function and the backend dispatch."""

from fusedops.ops.layernorm import LayerNormFunction, fused_layernorm
from fusedops.ops.rmsnorm import RMSNormFunction, fused_rmsnorm
from fusedops.ops.softmax import SoftmaxFunction, fused_softmax

__all__ = ["LayerNormFunction", "RMSNormFunction", "SoftmaxFunction", "fused_layernorm",
           "fused_rmsnorm", "fused_softmax"]
