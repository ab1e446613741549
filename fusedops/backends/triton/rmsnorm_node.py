"""RMSNorm training calls as C++ autograd nodes (``fusedops._host_ext``), as LayerNorm's
(``layernorm_node.py``): the forward's single launch with statistics (``rmsnorm._fwd_plans``)
and the backward's recorded launches (``rmsnorm_bwd._bwd_plans``: the row kernel, its dweight
partials as scratch, their sum) handed to the extension as one node spec.
"""

from __future__ import annotations

import torch

from fusedops.backends.triton import rmsnorm as _forward
from fusedops.backends.triton import rmsnorm_bwd as _backward
from fusedops.backends.triton.runtime import host_ext

# Forward slots: the inputs (x, weight), then the new tensors (y, rstd).
_X, _W, _Y, _RSTD = range(4)


def rmsnorm_node(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 out_dtype: torch.dtype, dy: torch.Tensor, rstd: torch.Tensor,
                 differentiable=None):
    """``node(x, weight) -> y or None`` for calls like this one, or None.

    x: the call's input (contiguous, normalised over its last dim ``n``); weight: (n,) or None;
    dy: the gradient its backward just took (x's shape, ``out_dtype``, contiguous, 16-byte
    aligned); rstd: (M,) float32 from its forward. Both passes must have run through the
    backend already (their plans are looked up); None where either has no plan or a plan does
    not convert. ``differentiable``: the node's backward under ``create_graph=True``,
    ``(dy, (x, weight, rstd), needs) -> [dx, dweight]`` (``host_ext.host_node``)."""
    if not host_ext.AVAILABLE or not x.is_contiguous():
        return None
    n = x.shape[-1]
    x2, dy2 = x.view(-1, n), dy.view(-1, n)
    fwd = _forward._fwd_plans.get(_forward.fwd_key(x2, weight, eps, out_dtype, True))
    needs = (x.requires_grad, weight is not None and weight.requires_grad)
    bwd = _backward._bwd_plans.get(_backward.bwd_key(
        dy2, x2, weight, rstd, *needs, (None if weight is None else weight.dtype,)))
    if fwd is None or not bwd:
        return None
    go, grid, _, tail, rows = fwd
    # An absent weight: y's address as the placeholder, as the backend passes it.
    slots = ((_X, 0), (_W if weight is not None else _Y, 0), (_Y, 0), (_RSTD, 0))
    inputs = (x, weight)
    return host_ext.host_node(((go, grid, slots, tail, None),), bwd.steps, inputs,
                              ((x.shape, out_dtype), ((rows,), torch.float32)),
                              (_X, _W, _RSTD), bwd.metas,
                              host_ext.input_grads(bwd.metas, inputs), differentiable)
