"""Triton backend: the 2-D row contract (see fusedops._dispatch) implemented with Triton kernels.

Runs on CUDA (and ROCm) tensors, and on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

NAME = "triton"
# softmax_forward / layernorm_forward_y also take contiguous tensors of any rank >= 1 (rows along
# the last dim) and return results of that shape: inference calls skip two views.
ROWS_ND = True
# layernorm_epilogue_forward also takes contiguous x / residual of any rank (rows along the last
# dim) and returns out / s of that shape.
EPILOGUE_ROWS_ND = True

try:
    import triton  # noqa: F401

    AVAILABLE = True
except ImportError:  # e.g. macOS, where triton is not installed
    AVAILABLE = False

if AVAILABLE:
    import functools

    import torch

    from fusedops.backends.triton import layernorm as _layernorm
    from fusedops.backends.triton import layernorm_bwd as _layernorm_backward
    from fusedops.backends.triton import layernorm_epilogue as _layernorm_epilogue
    from fusedops.backends.triton import layernorm_node as _layernorm_node
    from fusedops.backends.triton import rmsnorm as _rmsnorm
    from fusedops.backends.triton import rmsnorm_node as _rmsnorm_node
    from fusedops.backends.triton import softmax as _softmax
    from fusedops.backends.triton import softmax_masked as _softmax_masked

    def _on_tensor_device(fn):
        """Run ``fn`` with its first tensor's GPU as the current device: Triton launches on the
        current device and its current stream, so a tensor on cuda:1 while cuda:0 is current
        would otherwise be launched on the wrong GPU."""

        get_device = torch._C._cuda_getDevice if hasattr(torch._C, "_cuda_getDevice") else None

        @functools.wraps(fn)
        def run(first, *args, **kwargs):
            index = first.get_device()  # -1 for CPU tensors (the interpreter)
            if index >= 0 and first.is_cuda and index != get_device():
                with torch.cuda.device(index):
                    return fn(first, *args, **kwargs)
            return fn(first, *args, **kwargs)

        return run

    layernorm_forward = _on_tensor_device(_layernorm.layernorm_forward)
    layernorm_forward_y = _on_tensor_device(_layernorm.layernorm_forward_y)
    layernorm_backward = _on_tensor_device(_layernorm_backward.layernorm_backward)
    layernorm_epilogue_forward = _on_tensor_device(_layernorm_epilogue.layernorm_epilogue_forward)
    layernorm_epilogue_backward = _on_tensor_device(
        _layernorm_epilogue.layernorm_epilogue_backward)
    rmsnorm_forward = _on_tensor_device(_rmsnorm.rmsnorm_forward)
    rmsnorm_forward_y = _on_tensor_device(_rmsnorm.rmsnorm_forward_y)
    rmsnorm_backward = _on_tensor_device(_rmsnorm.rmsnorm_backward)
    softmax_forward = _on_tensor_device(_softmax.softmax_forward)
    softmax_backward = _on_tensor_device(_softmax.softmax_backward)
    softmax_masked_forward = _on_tensor_device(_softmax_masked.softmax_masked_forward)
    softmax_masked_backward = _on_tensor_device(_softmax_masked.softmax_masked_backward)
    # (Makes the ops layer's fusedops._replay.SOFTMAX_MASKED runners; launches nothing.)
    softmax_masked_ops_runner = _softmax_masked.softmax_masked_ops_runner
    # Replayed attention softmax, LayerNorm and RMSNorm training calls run from C++ autograd
    # nodes (host_ext.py); the ops layer asks for a norm's node once a call's plans exist.
    NATIVE_AUTOGRAD = _softmax_masked.host_ext.AVAILABLE
    layernorm_node = _layernorm_node.layernorm_node
    rmsnorm_node = _rmsnorm_node.rmsnorm_node

__all__ = [
    "AVAILABLE",
    "NAME",
    "NATIVE_AUTOGRAD",
    "layernorm_backward",
    "layernorm_epilogue_backward",
    "layernorm_epilogue_forward",
    "layernorm_forward",
    "layernorm_forward_y",
    "layernorm_node",
    "rmsnorm_backward",
    "rmsnorm_forward",
    "rmsnorm_forward_y",
    "rmsnorm_node",
    "softmax_backward",
    "softmax_forward",
    "softmax_masked_backward",
    "softmax_masked_forward",
    "softmax_masked_ops_runner",
]
