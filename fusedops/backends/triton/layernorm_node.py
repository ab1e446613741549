"""LayerNorm training calls as C++ autograd nodes (``fusedops._host_ext``).

After a training call ran its forward and backward through the launch rules, both left
replay plans: the forward's single launch (``layernorm._fwd_plans``, with statistics) and the
backward's launch sequence (``layernorm_bwd._bwd_plans``). :func:`layernorm_node` hands both
to the extension as one node spec, so later calls of that signature launch from C++, forward
and backward, with no Python in the backward and no launch rules anywhere.
"""

from __future__ import annotations

import torch

from fusedops.backends.triton import layernorm as _forward
from fusedops.backends.triton import layernorm_bwd as _backward
from fusedops.backends.triton.runtime import host_ext

# Forward slots: the inputs (x, weight, bias), then the new tensors (y, mean, rstd).
_X, _W, _B, _Y, _MEAN, _RSTD = range(6)


def layernorm_node(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float, out_dtype: torch.dtype, dy: torch.Tensor, mean: torch.Tensor,
                   rstd: torch.Tensor, differentiable=None):
    """``node(x, weight, bias) -> y or None`` for calls like this one, or None.

    x: the call's input (contiguous, normalised over its last dim ``n``); weight, bias: (n,)
    or None, as the call passed them; dy: the gradient its backward just took (x's shape,
    ``out_dtype``, contiguous, 16-byte aligned); mean, rstd: (M,) float32 from its forward.
    The call's forward and backward must have run through the backend already (their plans
    are looked up, not made); None where either has no plan or a plan does not convert.
    ``differentiable``: the node's backward under ``create_graph=True``, ``(dy, (x, weight,
    mean, rstd), needs) -> [dx, dweight, dbias]`` (``host_ext.host_node``)."""
    if not host_ext.AVAILABLE or not x.is_contiguous():
        return None
    n = x.shape[-1]
    x2, dy2 = x.view(-1, n), dy.view(-1, n)
    fwd = _forward._fwd_plans.get(_forward.fwd_key(x2, weight, bias, eps, out_dtype, True))
    needs = (x.requires_grad, weight is not None and weight.requires_grad,
             bias is not None and bias.requires_grad)
    grad_dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)
    bwd = _backward._bwd_plans.get(_backward.bwd_key(dy2, x2, weight, mean, rstd, *needs,
                                                     grad_dtypes))
    if fwd is None or not bwd:
        return None
    go, grid, _, tail, rows = fwd
    # Absent parameters: y's address as the placeholder, as the backend passes it.
    slots = ((_X, 0), (_W if weight is not None else _Y, 0), (_B if bias is not None else _Y, 0),
             (_Y, 0), (_MEAN, 0), (_RSTD, 0))
    stats = ((rows,), torch.float32)
    inputs = (x, weight, bias)
    return host_ext.host_node(((go, grid, slots, tail, None),), bwd.steps, inputs,
                              ((x.shape, out_dtype), stats, stats), (_X, _W, _MEAN, _RSTD),
                              bwd.metas, host_ext.input_grads(bwd.metas, inputs),
                              differentiable)
