"""fused_rmsnorm: autograd Function, public function and backend dispatch."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fusedops import _dispatch, _replay
from fusedops._validate import check_eps, check_rmsnorm_args, is_dtensor, normalize_shape
from fusedops.backends import reference
from fusedops.ops import _dtensor, _library, _native, _nodes, _route
from fusedops.ops._rows import as_rows, autocast_fp32, is_last_dim
from fusedops.ops._rows import flat_param as _flat

# F.rms_norm's eps=None: the machine epsilon of the type it computes in (float32 for 16-bit
# and float32 inputs, float64 for float64).
_EPS_FLOAT32 = torch.finfo(torch.float32).eps
_EPS_FLOAT64 = torch.finfo(torch.float64).eps


_RULES = _dispatch.SIZE_RULES["rmsnorm"]
_NODES = _replay.RMSNORM_NODE
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor
_native_now = _dispatch.native_now
_route_rmsnorm = _route.rmsnorm
_dynamo_compiling = _route.dynamo_compiling


def _forward_rows(x2, w, eps, out_dtype):
    if torch.compiler.is_compiling():
        return _library.rmsnorm_forward(x2, w, eps, out_dtype)
    backend = _dispatch.backend_for(x2)
    _dispatch.record("rmsnorm_forward", backend)
    return backend.rmsnorm_forward(x2, w, eps, out_dtype)


def _backward_rows(dy2, x2, w, rstd, need_dx, need_dw, grad_dtypes):
    if torch.compiler.is_compiling():
        dx, dw = _library.rmsnorm_backward(dy2, x2, w, rstd, need_dx, need_dw)
        return (dx if need_dx else None, dw if need_dw else None)
    backend = _dispatch.backend_for(x2)
    _dispatch.record("rmsnorm_backward", backend)
    return backend.rmsnorm_backward(dy2, x2, w, rstd, need_dx, need_dw, grad_dtypes=grad_dtypes)


class RMSNormFunction(torch.autograd.Function):
    """Autograd Function behind :func:`fused_rmsnorm`.

    ``RMSNormFunction.apply(x, n, weight, eps, out_dtype, node_sig)`` normalises over the
    trailing ``n`` elements of ``x``; ``weight`` is None or a tensor with ``n`` elements. Saves
    x, weight and the float32 rstd (4 bytes per row). ``node_sig``: None, or the
    ``fusedops._replay.RMSNORM_NODE`` signature whose C++ node the backward makes.
    """

    @staticmethod
    def forward(ctx, x, n, weight, eps, out_dtype, node_sig=None):
        x2 = as_rows(x, n)
        y2, rstd = _forward_rows(x2, _flat(weight), eps, out_dtype)
        ctx.node = None if node_sig is None else (node_sig, out_dtype)
        # The inputs themselves are saved (not the row views) so that a double backward can
        # differentiate through them.
        ctx.save_for_backward(x, weight, rstd)
        ctx.n = n
        ctx.eps = eps
        ctx.w_dtype = None if weight is None else weight.dtype
        ctx.w_shape = None if weight is None else weight.shape
        return y2 if x2 is x else y2.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        x2, w = as_rows(x, ctx.n), _flat(weight)
        need_dx, _, need_dw = ctx.needs_input_grad[:3]
        need_dw = bool(need_dw and w is not None)
        dy2 = as_rows(dy, ctx.n)
        if torch.is_grad_enabled():
            dx2, dw = _differentiable_backward(dy2, x2, w, ctx.eps, need_dx, need_dw)
        else:
            if ctx.node is not None and (not dy2.is_contiguous() or dy2.data_ptr() & 15):
                dy2 = dy2.clone(memory_format=torch.contiguous_format)  # (the node's dy layout)
            dx2, dw = _backward_rows(dy2, x2, w, rstd, need_dx, need_dw, (ctx.w_dtype,))
            if ctx.node is not None:
                _make_node(ctx.node, x, weight, ctx.eps, dy2, rstd, ctx.w_dtype, ctx.w_shape)
                ctx.node = None
        dx, dweight = _shaped(dy, dx2, dw, ctx.w_dtype, ctx.w_shape)
        return dx, None, dweight, None, None, None


def _shaped(dy, dx2, dw, w_dtype, w_shape):
    """The gradients of x (``dy``'s shape) and weight (its dtype and shape)."""
    return (dx2.view(dy.shape) if dx2 is not None else None,
            dw.to(w_dtype).view(w_shape) if dw is not None else None)


def _differentiable_backward(dy2, x2, w, eps, need_dx, need_dw):
    """The row backward for create_graph=True: rstd recomputed from x in differentiable torch
    ops, so second derivatives see it as the function of x it is."""
    xf = x2.float() if x2.dtype != torch.float64 else x2
    rstd = torch.rsqrt(xf.square().mean(dim=-1) + eps)
    return reference.rmsnorm_backward(dy2, x2, w, rstd, need_dx, need_dw)


def _make_node(node, x, weight, eps, dy2, rstd, w_dtype, w_shape) -> None:
    """Register the C++ node of signature ``node[0]`` from the plans this call's forward and
    backward left (fusedops._replay.RMSNORM_NODE)."""
    sig, out_dtype = node
    n = x.shape[-1]

    def differentiable(dy, kept, needs):  # the node's backward under create_graph=True
        x, weight = kept[0], kept[1]
        grads = _differentiable_backward(as_rows(dy, n), as_rows(x, n), _flat(weight), eps,
                                         *needs)
        return _shaped(dy, *grads, w_dtype, w_shape)

    _nodes.make(_NODES, sig, "rmsnorm_node", x, weight, eps, out_dtype, dy2, rstd,
                differentiable)


def fused_rmsnorm(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int] | torch.Size,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """Root-mean-square normalisation over the trailing ``normalized_shape`` dims, same
    semantics as ``torch.nn.functional.rms_norm``: ``x / sqrt(mean(x²) + eps) * weight``.

    Args:
        x: float tensor ``(*, *normalized_shape)``; float32/float16/bfloat16 on the fused
            backends (float64 and other devices: the PyTorch reference).
        normalized_shape: int or sequence of ints matching the trailing dims of ``x``.
        weight: optional tensor of shape ``normalized_shape`` (may be float32 with a
            float16/bfloat16 ``x``).
        eps: added to the mean square; None (the default, as in torch) is the machine epsilon
            of the computation type: float32's for float32/float16/bfloat16, float64's for
            float64.

    ``x`` may be a ``torch.distributed.tensor.DTensor`` (its tensor arguments then DTensors on the
    same mesh): the op runs on each rank's shard and returns a DTensor (docs/reliability.md,
    "Distributed").

    Returns:
        Tensor like ``x`` in ``x``'s dtype (float32 under CUDA autocast). The mean square is
        accumulated in float32 and its reciprocal root saved in float32.
    """
    if not _dynamo_compiling():  # below the size rule, torch's op from C++ (fusedops.ops._route)
        y = _route_rmsnorm(x, normalized_shape, weight, eps)
        if y is not None:
            return y
    if x.__class__ is not _Tensor and is_dtensor(x):  # (fusedops.ops._dtensor)
        return _dtensor.rmsnorm(x, normalized_shape, weight, eps, fused_rmsnorm)
    try:  # (the size rule, inline: host cost per call)
        grad = _grad_enabled() and (x.requires_grad or weight is not None and weight.requires_grad)
        key = (True, x.dtype, grad) if x.is_cuda else (
            "cpu" if x.is_cpu else x.device.type, x.dtype, grad)
    except AttributeError:
        check_rmsnorm_args(x, normalize_shape(normalized_shape), weight, eps)
        raise
    below = _RULES.get(key)
    if below is None:
        below = _dispatch.size_rule("rmsnorm", key)
    if x.numel() < below or _native_now():
        if eps is not None and (eps.__class__ is not float or not eps >= 0.0):
            check_eps(eps)  # (torch takes any eps: a negative one would give NaN)
        if weight is None or weight.dtype is x.dtype:
            # One dtype: torch's op itself, in one call (a patched model's host cost).
            try:
                return torch.rms_norm(x, normalized_shape if isinstance(
                                          normalized_shape, _native.SHAPES)
                                      else (normalized_shape,), weight, eps)
            except _native.ERRORS:
                pass  # (the call below raises fusedops' error, naming the argument)
        return _native.rms_norm(x, normalized_shape, weight, eps)
    return _fused(x, normalized_shape, weight, eps, grad)


def _fused(x, normalized_shape, weight, eps, grad: bool):
    """:func:`fused_rmsnorm` above the size rule: a node or replay, or the checks and the
    kernels."""
    node_sig = None
    if grad:
        # Training calls: a C++ node where the backend made one for the signature (its size
        # rule is lower where it can), else the Python Function from its own size rule.
        y, node_sig = _nodes.take(_NODES, x, normalized_shape,
                                  _EPS_FLOAT32 if eps is None else eps, (weight,))
        if y is not None:
            return y
        if node_sig is None and x.numel() < _dispatch.python_rule("rmsnorm"):
            if eps is not None and (eps.__class__ is not float or not eps >= 0.0):
                check_eps(eps)
            return _native.rms_norm(x, normalized_shape, weight, eps)
    elif (eps is None or eps.__class__ is float) and x.__class__ is torch.Tensor \
            and _dispatch.plain_eager():
        # A call seen before, replayed (fusedops._replay): no checks, dispatch or launch rules.
        run = _replay.RMSNORM.get((x.shape, x.dtype, x.get_device(),
                                   _EPS_FLOAT32 if eps is None else eps))
        if run is not None and is_last_dim(normalized_shape, x.shape[-1]):
            y = run(x, weight)
            if y is not None:
                return y
    shape = normalize_shape(normalized_shape)
    check_rmsnorm_args(x, shape, weight, eps)
    if eps is None:
        eps = _EPS_FLOAT64 if x.dtype == torch.float64 else _EPS_FLOAT32
    eps = float(eps)
    out_dtype = torch.float32 if autocast_fp32(x) else x.dtype
    n = math.prod(shape)
    if x.numel() == 0 or n == 0:
        # Nothing to compute, but keep autograd's graph (and torch's result) intact.
        return torch.nn.functional.rms_norm(x, shape, weight, eps).to(out_dtype)
    if grad:
        return RMSNormFunction.apply(x, n, weight, eps, out_dtype, node_sig)
    return _forward_inference(x, len(shape), n, weight, eps, out_dtype)


def _forward_inference(x, dims: int, n: int, weight, eps: float, out_dtype):
    """Forward over the last ``dims`` dims (``n`` elements) with no autograd.Function, no saved
    tensors and no rstd buffer (host cost per call)."""
    w = _flat(weight)
    if torch.compiler.is_compiling():
        x2 = as_rows(x, n)
        y2 = _library.rmsnorm_forward(x2, w, eps, out_dtype)[0]
        return y2.view(x.shape)
    backend = _dispatch.backend_for(x)
    _dispatch.record("rmsnorm_forward", backend)
    if dims == 1 and x.is_contiguous() and getattr(backend, "ROWS_ND", False):
        return backend.rmsnorm_forward_y(x, w, eps, out_dtype)  # x as is: no views
    x2 = as_rows(x, n)
    y2 = backend.rmsnorm_forward_y(x2, w, eps, out_dtype)
    return y2 if x2 is x else y2.view(x.shape)
