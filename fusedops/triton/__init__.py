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
    from fusedops.triton.layernorm import layernorm_backward, layernorm_forward
    from fusedops.triton.softmax import softmax_backward, softmax_forward

__all__ = [
    "AVAILABLE",
    "NAME",
    "layernorm_backward",
    "layernorm_forward",
    "softmax_backward",
    "softmax_forward",
]
