"""fused_softmax: autograd Function, public function and backend dispatch."""

from __future__ import annotations

import torch

from fusedops import _dispatch, _replay
from fusedops._validate import check_float_dtype, check_float_tensor, is_dtensor, normalize_dim
from fusedops.backends import reference
from fusedops.ops import _dtensor, _library, _route
from fusedops.ops._rows import as_rows, softmax_input
from fusedops.ops.softmax_masked import masked_softmax

_RULES = _dispatch.SIZE_RULES["softmax"]
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor
_native_now = _dispatch.native_now
_route_softmax = _route.softmax
_dynamo_compiling = _route.dynamo_compiling


def _forward_rows(x2: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _library.softmax_forward(x2, out_dtype)
    backend = _dispatch.backend_for(x2)
    _dispatch.record("softmax_forward", backend)
    return backend.softmax_forward(x2, out_dtype)


def _backward_rows(y2: torch.Tensor, dy2: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _library.softmax_backward(y2, dy2, out_dtype)
    backend = _dispatch.backend_for(y2)
    _dispatch.record("softmax_backward", backend)
    return backend.softmax_backward(y2, dy2, out_dtype)


def _to_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    if t.dim() == 0:
        return t.reshape(1, 1)
    if dim != t.dim() - 1:
        t = t.movedim(dim, -1)
    return as_rows(t, t.shape[-1])


def _from_rows(rows: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    if like.dim() == 0:
        return rows.reshape(())
    if dim == like.dim() - 1:
        # 2-D inputs: rows already has like's shape (skip the view: host cost per call).
        return rows if like.dim() == 2 else rows.view(like.shape)
    moved = list(like.shape)
    moved.append(moved.pop(dim))
    # Keep torch's contract of a result laid out like a contiguous input.
    return rows.view(moved).movedim(-1, dim).contiguous()


class SoftmaxFunction(torch.autograd.Function):
    """Autograd Function behind :func:`fused_softmax`.

    ``SoftmaxFunction.apply(x, dim, out_dtype)`` with ``dim`` already normalised to
    ``[0, x.dim())`` (0 for a 0-d tensor) and ``x`` a float tensor that the kernel reads as is.
    Saves only the output ``y``; backward is ``dx = y * (dy - sum(dy * y))`` in float32, and is
    itself differentiable (create_graph=True) through a torch-ops path.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, out_dtype: torch.dtype) -> torch.Tensor:
        y = _from_rows(_forward_rows(_to_rows(x, dim), out_dtype), x, dim)
        ctx.dim = dim
        ctx.in_dtype = x.dtype
        # Save the output itself (not an internal buffer) so a double backward can see y's
        # dependence on x.
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (y,) = ctx.saved_tensors
        dim = ctx.dim
        y2 = _to_rows(y, dim)
        dy2 = _to_rows(dy, dim)
        if torch.is_grad_enabled():
            # create_graph=True (gradient penalties, Hessian-vector products): the same formula
            # in differentiable torch ops; y2 still links back to this Function's output.
            dx2 = reference.softmax_backward(y2, dy2, ctx.in_dtype)
        else:
            dx2 = _backward_rows(y2, dy2, ctx.in_dtype)
        return _from_rows(dx2, dy, dim), None, None


def fused_softmax(
    x: torch.Tensor,
    dim: int = -1,
    dtype: torch.dtype | None = None,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Softmax along ``dim``, same semantics as ``torch.softmax(x, dim, dtype=dtype)``; with
    ``scale``/``mask``/``causal``, the softmax of attention, ``softmax(x * scale + mask)``, in
    one kernel.

    Args:
        x: float tensor of any shape (0-d and empty included). float32/float16/bfloat16 on
            CUDA (or MPS) run the fused kernel; other dtypes and devices, and calls where
            PyTorch's own op is cheaper (``fusedops._dispatch.NATIVE_BELOW``), run
            ``torch.softmax`` itself.
        dim: the dimension to normalise over; any valid dim, negative allowed.
        dtype: if given, the input is cast to it first and the result has this dtype (as in
            torch); float16/bfloat16 -> float32 is done inside the kernel without a cast pass.
        scale: multiplies ``x`` before the mask (attention's ``1/sqrt(head_dim)``); None = 1.
        mask: broadcastable to ``x``; bool (True = keep, as in
            ``scaled_dot_product_attention``) or float (added to ``x * scale``, e.g. 0/-inf or
            Hugging Face's ``finfo.min`` masks). A float mask that requires grad gets one.
        causal: also drop element ``[..., i, j]`` when ``j > i`` (the upper triangle of the last
            two dims, top-left aligned); needs ``x.dim() >= 2``.

    With any of ``scale``/``mask``/``causal``, a row whose every element is ``-inf`` after them
    (nothing kept) comes out as zeros, not torch's NaN, and its gradient is zero. These are
    fused over the last dim; another ``dim`` runs PyTorch's ops with a one-time warning.

    ``x`` may be a ``torch.distributed.tensor.DTensor`` (its tensor arguments then DTensors on the
    same mesh): the op runs on each rank's shard and returns a DTensor (docs/reliability.md,
    "Distributed").

    Returns:
        Tensor of ``x``'s shape and dtype ``dtype or x.dtype`` (float32 under CUDA autocast);
        the mask's dtype does not promote it. Accumulation is float32 for every dtype.
    """
    if not _dynamo_compiling():  # below the size rule, torch's op from C++ (fusedops.ops._route)
        y = _route_softmax(x, dim, dtype, scale, mask, causal)
        if y is not None:
            return y
    if x.__class__ is not _Tensor and is_dtensor(x):  # (fusedops.ops._dtensor)
        return _dtensor.softmax(x, dim, dtype, scale, mask, causal, fused_softmax)
    if scale is not None or mask is not None or causal is not False:
        return masked_softmax(x, dim, dtype, scale, mask, causal)
    try:  # (the size rule, inline: host cost per call)
        grad = x.requires_grad and _grad_enabled()
        key = (True, x.dtype, grad) if x.is_cuda else (
            "cpu" if x.is_cpu else x.device.type, x.dtype, grad)
    except AttributeError:
        check_float_tensor(x, "x")
        raise
    below = _RULES.get(key)
    if below is None:
        below = _dispatch.size_rule("softmax", key)
    if x.numel() < below or _native_now():
        if dim.__class__ is not int:
            dim = normalize_dim(dim, x.dim())  # (torch takes a bool dim: ours is an error)
        try:
            return torch.softmax(x, dim, dtype)
        except (RuntimeError, IndexError, TypeError):  # the argument it was, named
            check_float_tensor(x, "x")
            normalize_dim(dim, x.dim())
            check_float_dtype(dtype)
            raise
    return _fused(x, dim, dtype, grad)


def _fused(x: torch.Tensor, dim: int, dtype: torch.dtype | None, grad: bool) -> torch.Tensor:
    """:func:`fused_softmax` above the size rule: a replay, or the checks and the kernels."""
    check_float_tensor(x, "x")
    if not grad and dtype is None and dim.__class__ is int and dim == -1 \
            and x.__class__ is torch.Tensor and _dispatch.plain_eager():
        # A call seen before, replayed (fusedops._replay): no checks, dispatch or launch rules.
        run = _replay.SOFTMAX.get((x.shape, x.dtype, x.get_device()))
        if run is not None:
            y = run(x)
            if y is not None:
                return y
    dim = normalize_dim(dim, x.dim())
    dtype = check_float_dtype(dtype)
    x, out_dtype = softmax_input(x, dtype)
    if x.numel() == 0:
        # Nothing to compute, but keep autograd's graph (and torch's result) intact.
        return torch.softmax(x, dim).to(out_dtype)
    if grad:
        return SoftmaxFunction.apply(x, dim, out_dtype)
    return _forward_inference(x, dim, out_dtype)


def _forward_inference(x: torch.Tensor, dim: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Forward without autograd bookkeeping or saving y (host cost per call)."""
    if dim == x.dim() - 1 and x.is_contiguous() and not torch.compiler.is_compiling():
        backend = _dispatch.backend_for(x)
        if getattr(backend, "ROWS_ND", False):  # takes x as is: no views around the call
            _dispatch.record("softmax_forward", backend)
            return backend.softmax_forward(x, out_dtype)
    return _from_rows(_forward_rows(_to_rows(x, dim), out_dtype), x, dim)
