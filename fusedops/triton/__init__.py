"""Triton backend: the 2-D row contract (see fusedops._dispatch) implemented with Triton kernels.

Runs on CUDA (and ROCm) tensors, and on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

NAME = "triton"

try:
    import triton  # noqa: F401

    AVAILABLE = True
except ImportError:  # e.g. macOS, where triton is not installed
    AVAILABLE = False

if AVAILABLE:
    import functools

    import torch

    from fusedops.triton import layernorm as _layernorm
    from fusedops.triton import softmax as _softmax

    def _on_tensor_device(fn):
        """Run ``fn`` with its first tensor's GPU as the current device: Triton launches on the
        current device and its current stream, so a tensor on cuda:1 while cuda:0 is current
        would otherwise be launched on the wrong GPU."""

        @functools.wraps(fn)
        def run(first, *args):
            dev = first.device
            if dev.type == "cuda" and dev.index != torch.cuda.current_device():
                with torch.cuda.device(dev):
                    return fn(first, *args)
            return fn(first, *args)

        return run

    layernorm_forward = _on_tensor_device(_layernorm.layernorm_forward)
    layernorm_forward_y = _on_tensor_device(_layernorm.layernorm_forward_y)
    layernorm_backward = _on_tensor_device(_layernorm.layernorm_backward)
    softmax_forward = _on_tensor_device(_softmax.softmax_forward)
    softmax_backward = _on_tensor_device(_softmax.softmax_backward)

__all__ = [
    "AVAILABLE",
    "NAME",
    "layernorm_backward",
    "layernorm_forward",
    "layernorm_forward_y",
    "softmax_backward",
    "softmax_forward",
]
