"""One file per op: the autograd Function, the public function and the backend dispatch."""

from fusedops.ops.layernorm import LayerNormFunction, fused_layernorm
from fusedops.ops.softmax import SoftmaxFunction, fused_softmax

__all__ = ["LayerNormFunction", "SoftmaxFunction", "fused_layernorm", "fused_softmax"]
