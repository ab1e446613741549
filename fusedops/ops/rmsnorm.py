"""fused_rmsnorm: autograd Function, public function and backend dispatch."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fusedops import _dispatch, _replay
from fusedops._validate import check_eps, check_rmsnorm_args, is_dtensor, normalize_shape
from fusedops.backends import reference
from fusedops.ops import _dtensor, _library, _native
from fusedops.ops._rows import as_rows, autocast_fp32, is_last_dim
from fusedops.ops._rows import flat_param as _flat

# F.rms_norm's eps=None: the machine epsilon of the type it computes in (float32 for 16-bit
# and float32 inputs, float64 for float64).
_EPS_FLOAT32 = torch.finfo(torch.float32).eps
_EPS_FLOAT64 = torch.finfo(torch.float64).eps


_RULES = _dispatch.SIZE_RULES["rmsnorm"]
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor
_native_now = _dispatch.native_now


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

    ``RMSNormFunction.apply(x, n, weight, eps, out_dtype)`` normalises over the trailing ``n``
    elements of ``x``; ``weight`` is None or a tensor with ``n`` elements. Saves x, weight and
    the float32 rstd (4 bytes per row).
    """

    @staticmethod
    def forward(ctx, x, n, weight, eps, out_dtype):
        x2 = as_rows(x, n)
        y2, rstd = _forward_rows(x2, _flat(weight), eps, out_dtype)
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
        need_dx, _, need_dw, _, _ = ctx.needs_input_grad
        need_dw = bool(need_dw and w is not None)
        dy2 = as_rows(dy, ctx.n)
        if torch.is_grad_enabled():
            # create_graph=True: rstd recomputed from x in differentiable torch ops, so second
            # derivatives see it as the function of x it is.
            xf = x2.float() if x2.dtype != torch.float64 else x2
            rstd = torch.rsqrt(xf.square().mean(dim=-1) + ctx.eps)
            dx2, dw = reference.rmsnorm_backward(dy2, x2, w, rstd, need_dx, need_dw)
        else:
            dx2, dw = _backward_rows(dy2, x2, w, rstd, need_dx, need_dw, (ctx.w_dtype,))
        dx = dx2.view(dy.shape) if dx2 is not None else None
        dweight = dw.to(ctx.w_dtype).view(ctx.w_shape) if dw is not None else None
        return dx, None, dweight, None, None


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
    if not grad and (eps is None or eps.__class__ is float) and x.__class__ is torch.Tensor \
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
        return RMSNormFunction.apply(x, n, weight, eps, out_dtype)
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
