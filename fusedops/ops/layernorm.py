"""fused_layernorm: autograd Function, public function and backend dispatch."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fusedops import _dispatch, _replay
from fusedops._validate import check_eps, check_layernorm_args, is_dtensor, normalize_shape
from fusedops.backends import reference
from fusedops.ops import _dtensor, _library, _native, _nodes, _route
from fusedops.ops._rows import as_rows, autocast_fp32, is_last_dim
from fusedops.ops._rows import flat_param as _flat
from fusedops.ops.layernorm_epilogue import check_epilogue_args, layernorm_epilogue

_RULES = _dispatch.SIZE_RULES["layernorm"]
_NODES = _replay.LAYERNORM_NODE
_EPILOGUE_RULES = _dispatch.SIZE_RULES["layernorm_epilogue"]
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor
_native_now = _dispatch.native_now
_route_layernorm = _route.layernorm
_dynamo_compiling = _route.dynamo_compiling


def _forward_rows(x2, w, b, eps, out_dtype):
    if torch.compiler.is_compiling():
        return _library.layernorm_forward(x2, w, b, eps, out_dtype)
    backend = _dispatch.backend_for(x2)
    _dispatch.record("layernorm_forward", backend)
    return backend.layernorm_forward(x2, w, b, eps, out_dtype)


def _backward_rows(dy2, x2, w, mean, rstd, need_dx, need_dw, need_db, grad_dtypes):
    if torch.compiler.is_compiling():
        dx, dw, db = _library.layernorm_backward(
            dy2, x2, w, mean, rstd, need_dx, need_dw, need_db
        )
        return (dx if need_dx else None, dw if need_dw else None, db if need_db else None)
    backend = _dispatch.backend_for(x2)
    _dispatch.record("layernorm_backward", backend)
    return backend.layernorm_backward(dy2, x2, w, mean, rstd, need_dx, need_dw, need_db,
                                      grad_dtypes=grad_dtypes)


class LayerNormFunction(torch.autograd.Function):
    """Autograd Function behind :func:`fused_layernorm`.

    ``LayerNormFunction.apply(x, n, weight, bias, eps, out_dtype, node_sig)`` normalises over
    the trailing ``n`` elements of ``x`` (the product of ``normalized_shape``); ``weight``/``bias``
    are None or tensors with ``n`` elements. Saves x, weight, and float32 mean/rstd (8 bytes per
    row). ``node_sig``: None, or the ``fusedops._replay.LAYERNORM_NODE`` signature whose C++ node
    the backward makes once the call's plans exist.
    """

    @staticmethod
    def forward(ctx, x, n, weight, bias, eps, out_dtype, node_sig=None):
        x2 = as_rows(x, n)
        w, b = _flat(weight), _flat(bias)
        y2, mean, rstd = _forward_rows(x2, w, b, eps, out_dtype)
        ctx.node = None if node_sig is None else (node_sig, bias, out_dtype)
        # The inputs themselves are saved (not the row views made here) so that a double
        # backward can differentiate through them.
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.n = n
        ctx.eps = eps
        ctx.has_bias = bias is not None
        ctx.param_dtypes = (
            None if weight is None else weight.dtype,
            None if bias is None else bias.dtype,
        )
        ctx.param_shapes = (
            None if weight is None else weight.shape,
            None if bias is None else bias.shape,
        )
        return y2 if x2 is x else y2.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        x2, w = as_rows(x, ctx.n), _flat(weight)
        need_dx, _, need_dw, need_db = ctx.needs_input_grad[:4]
        need_dw = bool(need_dw and w is not None)
        need_db = bool(need_db and ctx.has_bias)
        dy2 = as_rows(dy, ctx.n)
        if torch.is_grad_enabled():
            dx2, dw, db = _differentiable_backward(dy2, x2, w, ctx.eps, need_dx, need_dw, need_db)
        else:
            if ctx.node is not None and (not dy2.is_contiguous() or dy2.data_ptr() & 15):
                dy2 = dy2.clone(memory_format=torch.contiguous_format)  # (the node's dy layout)
            dx2, dw, db = _backward_rows(dy2, x2, w, mean, rstd, need_dx, need_dw, need_db,
                                         ctx.param_dtypes)
            if ctx.node is not None:
                _make_node(ctx.node, x, weight, ctx.eps, dy2, mean, rstd, ctx.param_dtypes,
                           ctx.param_shapes)
                ctx.node = None
        dx, dweight, dbias = _shaped(dy, dx2, dw, db, ctx.param_dtypes, ctx.param_shapes)
        return dx, None, dweight, dbias, None, None, None


def _shaped(dy, dx2, dw, db, dtypes, shapes):
    """The gradients of x (``dy``'s shape), weight and bias (their dtypes and shapes)."""
    dx = dx2.view(dy.shape) if dx2 is not None else None
    dweight = dw.to(dtypes[0]).view(shapes[0]) if dw is not None else None
    dbias = db.to(dtypes[1]).view(shapes[1]) if db is not None else None
    return dx, dweight, dbias


def _differentiable_backward(dy2, x2, w, eps, need_dx, need_dw, need_db):
    """The row backward for create_graph=True: the statistics recomputed from x in
    differentiable torch ops, so second derivatives see mean and rstd as the functions of x
    they are."""
    xf = x2.float() if x2.dtype != torch.float64 else x2
    mean = xf.mean(dim=-1)
    rstd = torch.rsqrt((xf - mean[:, None]).square().mean(dim=-1) + eps)
    return reference.layernorm_backward(dy2, x2, w, mean, rstd, need_dx, need_dw, need_db)


def _make_node(node, x, weight, eps, dy2, mean, rstd, dtypes, shapes) -> None:
    """Register the C++ node of signature ``node[0]`` from the plans this call's forward and
    backward left (fusedops._replay.LAYERNORM_NODE)."""
    sig, bias, out_dtype = node
    n = x.shape[-1]

    def differentiable(dy, kept, needs):  # the node's backward under create_graph=True
        x, weight = kept[0], kept[1]
        grads = _differentiable_backward(as_rows(dy, n), as_rows(x, n), _flat(weight), eps,
                                         *needs)
        return _shaped(dy, *grads, dtypes, shapes)

    _nodes.make(_NODES, sig, "layernorm_node", x, weight, bias, eps, out_dtype, dy2, mean, rstd,
                differentiable)


def fused_layernorm(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int] | torch.Size,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    residual: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    activation: str | None = None,
    training: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Layer normalisation over the trailing ``normalized_shape`` dims, same semantics as
    ``torch.nn.functional.layer_norm``; with ``residual``/``dropout_p``/``activation``,
    ``activation(dropout(layer_norm(x + residual)))`` in one kernel.

    Args:
        x: float tensor ``(*, *normalized_shape)``; float32/float16/bfloat16 on the fused backends.
        normalized_shape: int or sequence of ints matching the trailing dims of ``x``.
        weight, bias: optional tensors of shape ``normalized_shape`` (may be float32 with a
            float16/bfloat16 ``x``).
        eps: added to the variance.
        residual: optional tensor of ``x``'s shape and dtype added to ``x`` first; the sum
            (rounded to ``x``'s dtype, as ``x + residual`` is) is what gets normalised.
        dropout_p: probability of zeroing an element of the normalised output (kept ones are
            scaled by ``1 / (1 - p)``), applied only when ``training``. The mask comes from a
            counter-based generator (Philox) seeded from torch's default generator, so
            ``torch.manual_seed`` reproduces it; backward regenerates it instead of storing it.
        activation: None, ``"relu"`` or ``"gelu"`` (exact, erf-based), applied last.
        training: as ``F.dropout``'s: False turns dropout off.

    ``x`` may be a ``torch.distributed.tensor.DTensor`` (its tensor arguments then DTensors on the
    same mesh): the op runs on each rank's shard and returns a DTensor (docs/reliability.md,
    "Distributed").

    Returns:
        Tensor like ``x`` in ``x``'s dtype (float32 under CUDA autocast); with ``residual``, the
        pair ``(out, x + residual)`` so the sum can feed the next residual connection. Mean and
        rstd are computed and saved in float32.
    """
    if not _dynamo_compiling():  # below the size rule, torch's op from C++ (fusedops.ops._route)
        y = _route_layernorm(x, normalized_shape, weight, bias, eps, residual, dropout_p,
                             activation, training)
        if y is not None:
            return y
    if x.__class__ is not _Tensor and is_dtensor(x):  # (fusedops.ops._dtensor)
        return _dtensor.layernorm(x, normalized_shape, weight, bias, eps, residual,
                                  dropout_p, activation, training, fused_layernorm)
    if residual is not None or activation is not None or dropout_p != 0.0 \
            or dropout_p.__class__ is bool or training is not True:
        return _epilogue(x, normalized_shape, weight, bias, eps, residual, dropout_p,
                         activation, training)
    try:  # (the size rule, inline: host cost per call)
        grad = _grad_enabled() and (x.requires_grad or weight is not None and weight.requires_grad
                                    or bias is not None and bias.requires_grad)
        key = (True, x.dtype, grad) if x.is_cuda else (
            "cpu" if x.is_cpu else x.device.type, x.dtype, grad)
    except AttributeError:
        check_layernorm_args(x, normalize_shape(normalized_shape), weight, bias, eps)
        raise
    below = _RULES.get(key)
    if below is None:
        below = _dispatch.size_rule("layernorm", key)
    if x.numel() < below or _native_now():
        if eps.__class__ is not float or not eps >= 0.0:
            check_eps(eps)  # (torch takes any eps: a negative one would give NaN)
        if (weight is None or weight.dtype is x.dtype) and (bias is None or bias.dtype is x.dtype):
            # One dtype: torch's op itself, in one call (a patched model's host cost).
            try:
                return torch.layer_norm(x, normalized_shape if isinstance(
                                            normalized_shape, _native.SHAPES)
                                        else (normalized_shape,),
                                        weight, bias, eps)
            except _native.ERRORS:
                pass  # (the call below raises fusedops' error, naming the argument)
        return _native.layer_norm(x, normalized_shape, weight, bias, eps)
    return _fused(x, normalized_shape, weight, bias, eps, grad)


def _fused(x, normalized_shape, weight, bias, eps, grad: bool):
    """:func:`fused_layernorm` above the size rule: a replay, or the checks and the kernels."""
    node_sig = None
    if grad:
        # Training calls: a C++ node where the backend made one for the signature (its size
        # rule is lower where it can), else the Python Function from its own size rule.
        y, node_sig = _nodes.take(_NODES, x, normalized_shape, eps, (weight, bias))
        if y is not None:
            return y
        if node_sig is None and x.numel() < _dispatch.python_rule("layernorm"):
            if eps.__class__ is not float or not eps >= 0.0:
                check_eps(eps)
            return _native.layer_norm(x, normalized_shape, weight, bias, eps)
    elif eps.__class__ is float and x.__class__ is torch.Tensor and _dispatch.plain_eager():
        # A call seen before, replayed (fusedops._replay): no checks, dispatch or launch rules.
        run = _replay.LAYERNORM.get((x.shape, x.dtype, x.get_device(), eps))
        if run is not None and is_last_dim(normalized_shape, x.shape[-1]):
            y = run(x, weight, bias)
            if y is not None:
                return y
    shape = normalize_shape(normalized_shape)
    check_layernorm_args(x, shape, weight, bias, eps)
    out_dtype = torch.float32 if autocast_fp32(x) else x.dtype
    n = math.prod(shape)
    if x.numel() == 0 or n == 0:
        # Nothing to compute, but keep autograd's graph (and torch's result) intact.
        return torch.nn.functional.layer_norm(x, shape, weight, bias, eps).to(out_dtype)
    eps = float(eps)
    if grad:
        return LayerNormFunction.apply(x, n, weight, bias, eps, out_dtype, node_sig)
    return _forward_inference(x, len(shape), n, weight, bias, eps, out_dtype)


def _epilogue(x, normalized_shape, weight, bias, eps, residual, dropout_p, activation,
              training):
    """fused_layernorm with residual/dropout/activation (arguments as the user gave them)."""
    if residual is not None and activation is None and dropout_p == 0.0 \
            and x.__class__ is torch.Tensor and eps.__class__ is float \
            and training.__class__ is bool:
        # A plain add + LayerNorm: the size rule first, inline (host cost per call), then a
        # replay.
        try:
            grad = (x.requires_grad or residual.requires_grad
                    or weight is not None and weight.requires_grad
                    or bias is not None and bias.requires_grad) and _grad_enabled()
        except AttributeError:  # (a bad argument: the checks below name it)
            grad = _grad_enabled() and _needs_grad(x, weight, bias, residual)
        key = (True, x.dtype, grad) if x.is_cuda else (
            "cpu" if x.is_cpu else x.device.type, x.dtype, grad)
        below = _EPILOGUE_RULES.get(key)
        if below is None:
            below = _dispatch.size_rule("layernorm_epilogue", key)
        if x.numel() < below or _native_now():
            if residual.__class__ is torch.Tensor and residual.dtype is x.dtype and eps >= 0.0 \
                    and residual.shape == x.shape and (weight is None or weight.dtype is x.dtype) \
                    and (bias is None or bias.dtype is x.dtype):
                # torch's two ops, inline (host cost per call); any error is raised below by
                # the checked path, naming the argument.
                try:
                    s = x + residual
                    return torch.layer_norm(s, normalized_shape if isinstance(
                        normalized_shape, _native.SHAPES) else (normalized_shape,),
                        weight, bias, eps), s
                except _native.ERRORS:
                    pass
            return _native_add_layernorm(x, normalized_shape, weight, bias, eps, residual)
        if not grad and _dispatch.plain_eager():
            # An inference add + LayerNorm seen before, replayed (fusedops._replay).
            run = _replay.LAYERNORM_RESIDUAL.get((x.shape, x.dtype, x.get_device(), eps))
            if run is not None and is_last_dim(normalized_shape, x.shape[-1]):
                pair = run(x, residual, weight, bias)
                if pair is not None:
                    return pair
    shape = normalize_shape(normalized_shape)
    check_layernorm_args(x, shape, weight, bias, eps)
    check_epilogue_args(x, residual, dropout_p, activation, training)
    out_dtype = torch.float32 if autocast_fp32(x) else x.dtype
    p = dropout_p if training else 0.0
    if residual is None and activation is None and p == 0.0:
        return fused_layernorm(x, shape, weight, bias, eps)
    return layernorm_epilogue(x, shape, math.prod(shape), weight, bias, eps, residual, p,
                              activation, out_dtype)


def _native_add_layernorm(x, normalized_shape, weight, bias, eps, residual):
    """``(layer_norm(x + residual), x + residual)`` in PyTorch's ops, arguments checked: what
    :func:`_epilogue`'s inline native path does not take (parameters of another dtype) or
    where torch raised (fusedops' error then names the argument)."""
    if residual.__class__ is not torch.Tensor or residual.shape != x.shape \
            or residual.dtype != x.dtype or not eps >= 0.0:
        check_layernorm_args(x, normalize_shape(normalized_shape), weight, bias, eps)
        check_epilogue_args(x, residual, 0.0, None, True)
    try:
        s = x + residual
    except RuntimeError:  # (a residual on another device): the argument it was, named
        check_epilogue_args(x, residual, 0.0, None, True)
        raise
    return _native.layer_norm(s, normalize_shape(normalized_shape), weight, bias, eps), s


def _needs_grad(*tensors: object) -> bool:
    # getattr: the arguments are not checked yet (bad ones raise later, naming themselves).
    for t in tensors:
        if t is not None and getattr(t, "requires_grad", False):
            return True
    return False


def _forward_inference(x, dims: int, n: int, weight, bias, eps: float, out_dtype):
    """Forward over the last ``dims`` dims (``n`` elements) with no autograd.Function, no saved
    tensors and no mean/rstd buffers (host cost per call)."""
    w, b = _flat(weight), _flat(bias)
    if torch.compiler.is_compiling():
        x2 = as_rows(x, n)
        y2 = _library.layernorm_forward(x2, w, b, eps, out_dtype)[0]
        return y2.view(x.shape)
    backend = _dispatch.backend_for(x)
    _dispatch.record("layernorm_forward", backend)
    if dims == 1 and x.is_contiguous() and getattr(backend, "ROWS_ND", False):
        return backend.layernorm_forward_y(x, w, b, eps, out_dtype)  # x as is: no views
    x2 = as_rows(x, n)
    y2 = backend.layernorm_forward_y(x2, w, b, eps, out_dtype)
    return y2 if x2 is x else y2.view(x.shape)
