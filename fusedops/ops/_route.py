"""The public ops' first step: a call below its size rule runs torch's op from C++.

``softmax(x, dim, dtype, scale, mask, causal)``, ``layernorm(x, normalized_shape, weight, bias,
eps, residual, dropout_p, activation, training)`` and ``rmsnorm(x, normalized_shape, weight,
eps)`` take the public ops' arguments and return torch's result (for a residual, the pair
``(layer_norm(x + residual), x + residual)``) where the call is plain and below the rule that
``fusedops._dispatch.SIZE_RULES`` holds for it; otherwise None, and the op's Python path goes
on. They are ``fusedops._host_ext``'s (``csrc/host/route.cpp``), which skip torch's Python
argument parser and fusedops' Python checks; without the extension, or with
``FUSEDOPS_HOST_EXT=0``, they always return None.

Dynamo cannot trace into them: callers skip them where ``dynamo_compiling()`` (which Dynamo
reads as True, eager Python as a constant False).
"""

from __future__ import annotations

import os

import torch

from fusedops import _dispatch

dynamo_compiling = torch.compiler.is_dynamo_compiling


def _none(*args: object) -> None:
    return None


softmax = layernorm = rmsnorm = _none

try:
    from fusedops import _host_ext as _ext
except ImportError:  # not built: the Python paths
    _ext = None

ENABLED = (_ext is not None and hasattr(_ext, "route_softmax")
           and os.environ.get("FUSEDOPS_HOST_EXT") != "0")
if ENABLED:
    _rules = _dispatch.SIZE_RULES
    _ext.route_tables(_rules["softmax"], _rules["layernorm"], _rules["rmsnorm"],
                      _rules["layernorm_epilogue"], torch.nn.Parameter)
    softmax, layernorm, rmsnorm = _ext.route_softmax, _ext.route_layer_norm, _ext.route_rms_norm
