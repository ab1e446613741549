"""The softmax of attention, ``softmax(x * scale + mask)`` with an optional causal triangle, in
one kernel: the path :func:`fusedops.fused_softmax` takes when ``scale``, ``mask`` or ``causal``
is given."""

from __future__ import annotations

import math

import torch

from fusedops import _dispatch, _replay
from fusedops._validate import (
    broadcasts_to,
    check_float_dtype,
    check_float_tensor,
    check_same_kind,
    normalize_dim,
)
from fusedops.backends import reference
from fusedops.ops._rows import as_rows, softmax_input

_backend_fn = _dispatch.backend_fn


def check_mask_args(x: torch.Tensor, scale: object, mask: object, causal: object) -> None:
    """Raise (naming the argument) unless scale/mask/causal are valid for ``x``."""
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, int | float):
            raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if causal and x.dim() < 2:
        raise ValueError(
            f"causal=True needs x with at least 2 dimensions, got shape {list(x.shape)}")
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"mask must be bool (True = keep) or floating point (added to the scores), "
            f"got dtype {mask.dtype}")
    check_same_kind(mask, "mask", x)
    if mask.device != x.device:
        raise ValueError(f"mask is on {mask.device} but x is on {x.device}")
    if not broadcasts_to(mask.shape, x.shape):
        raise ValueError(
            f"mask of shape {list(mask.shape)} does not broadcast to x's shape {list(x.shape)}")


def compose(x: torch.Tensor, dim: int, scale: float, mask: torch.Tensor | None, causal: bool,
            out_dtype: torch.dtype) -> torch.Tensor:
    """The same result in differentiable torch ops, for any ``dim``: the fallback for what the
    kernels do not take, torch.compile's path (Inductor fuses it itself) and double backward."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    z = x.to(acc) * scale
    if mask is not None:
        z = z.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else z + mask.to(acc)
    if causal:
        q, n = z.shape[-2], z.shape[-1]
        z = z.masked_fill(torch.ones(q, n, dtype=torch.bool, device=z.device).triu(1),
                          -torch.inf)
    if z.shape[dim] == 0:
        return torch.softmax(z, dim=dim).to(out_dtype)  # nothing to reduce (amax would raise)
    empty = z.amax(dim=dim, keepdim=True) == -torch.inf
    return torch.softmax(z, dim=dim).masked_fill(empty, 0.0).to(out_dtype)


def native(x: torch.Tensor, dim: int, scale: float, mask: torch.Tensor | None,
           out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`compose` without causal, in the fewest torch calls (the path where no fused backend
    runs ``x``): scale and mask in one add, the softmax, and the rows with nothing kept set to
    zero."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xa = x if x.dtype == acc else x.to(acc)
    if mask is None:
        z = xa * scale if scale != 1.0 else xa
    elif mask.dtype == torch.bool:
        z = torch.where(mask, xa * scale if scale != 1.0 else xa, -torch.inf)
    else:  # (mask + scale * x in one op, computed in float32 and rounded once)
        z = torch.add(mask if mask.dtype == acc else mask.to(acc), xa, alpha=scale)
    if z.shape[dim] == 0:
        return compose(x, dim, scale, mask, False, out_dtype)
    y = torch.softmax(z, dim).masked_fill(z.amax(dim, keepdim=True) == -torch.inf, 0.0)
    return y if y.dtype == out_dtype else y.to(out_dtype)


def _as_4d(x: torch.Tensor, mask: torch.Tensor | None):
    """x as (B, H, Q, N) contiguous and the mask as a (B, H, Q, N) view of itself (strides 0
    where it was broadcast; a copy only when x has more than 4 dims and the mask's strides do
    not merge)."""
    shape = x.shape
    n = shape[-1]
    q = shape[-2] if x.dim() >= 2 else 1
    lead = tuple(shape[:-2])
    dims4 = (1,) * (2 - len(lead)) + lead if len(lead) <= 2 else (1, math.prod(lead))
    x4 = x.contiguous().view(*dims4, q, n)
    mask4 = None
    if mask is not None:
        if mask.dtype == torch.float64 and x.dtype != torch.float64:
            mask = mask.float()  # the kernels read float32/16-bit masks; an offset loses nothing
        mask4 = mask.expand(shape).reshape(*dims4, q, n)
    return x4, mask4


def _forward(x, mask, scale, causal, out_dtype):
    x4, mask4 = _as_4d(x, mask)
    backend, fn = _backend_fn(x4, "softmax_masked_forward")
    _dispatch.record("softmax_masked_forward", backend)
    y = fn(x4, mask4, scale, causal, out_dtype)
    if x.dim() == 4 and out_dtype is x.dtype:
        _register_replay(backend, x, mask, x4, mask4, scale, causal)
    return y if y.shape == x.shape else y.view(x.shape)


def _register_replay(backend, x, mask, x4, mask4, scale, causal) -> None:
    """Enter this call's signature in ``fusedops._replay.SOFTMAX_MASKED`` once: the backend's
    runner replaying the plan it made for the call, or False where it will have none."""
    key = replay_key(x, mask, scale, causal)
    if key in _replay.SOFTMAX_MASKED:
        return
    make = getattr(backend, "softmax_masked_ops_runner", None)
    runner = False if make is None else make(x, mask, x4, mask4, scale, causal)
    if runner is not None:  # (None: not decided yet, asked again next call)
        _replay.SOFTMAX_MASKED[key] = runner


class MaskedSoftmaxFunction(torch.autograd.Function):
    """Autograd Function of ``softmax(x * scale + mask)`` (optionally causal) over the last dim.

    ``MaskedSoftmaxFunction.apply(x, mask, scale, causal, out_dtype)``. Saves only y; backward is
    ``dx = scale * y * (dy - sum(dy * y))`` and, for a float mask that requires grad,
    ``dmask = y * (dy - sum(dy * y))`` summed over the dims it was broadcast along.
    """

    @staticmethod
    def forward(ctx, x, mask, scale, causal, out_dtype):
        y = _forward(x, mask, scale, causal, out_dtype)
        ctx.save_for_backward(y)
        ctx.scale = scale
        ctx.in_dtype = x.dtype
        ctx.mask_meta = None if mask is None else (mask.shape, mask.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        need_dx, need_dmask = ctx.needs_input_grad[:2]
        n = y.shape[-1]
        y2, dy2 = as_rows(y, n), as_rows(dy, n)
        dx = dmask = None
        if need_dmask:
            # The mask's gradient is the unscaled one; dx is it times scale.
            acc = torch.float64 if y.dtype == torch.float64 else torch.float32
            if torch.is_grad_enabled():
                dz = reference.softmax_masked_backward(y2, dy2, 1.0, acc)
            else:
                backend, fn = _backend_fn(y2, "softmax_masked_backward")
                _dispatch.record("softmax_masked_backward", backend)
                dz = fn(y2, dy2, 1.0, acc)
            dz = dz.view(y.shape)
            shape, dtype = ctx.mask_meta
            dmask = dz.sum_to_size(shape).to(dtype)
            if need_dx:
                dx = (dz * ctx.scale).to(ctx.in_dtype)
            return dx, dmask, None, None, None
        if torch.is_grad_enabled():
            # create_graph=True: torch ops on the saved output, so second derivatives see y.
            dx2 = reference.softmax_masked_backward(y2, dy2, ctx.scale, ctx.in_dtype)
        elif ctx.scale == 1.0:
            # No scale to apply: the plain softmax backward (its tuned kernels) is the same op.
            backend = _dispatch.backend_for(y2)
            _dispatch.record("softmax_backward", backend)
            dx2 = backend.softmax_backward(y2, dy2, ctx.in_dtype)
        else:
            backend, fn = _backend_fn(y2, "softmax_masked_backward")
            _dispatch.record("softmax_masked_backward", backend)
            dx2 = fn(y2, dy2, ctx.scale, ctx.in_dtype)
        return dx2.view(y.shape), None, None, None, None


class ReplayedMaskedSoftmax(MaskedSoftmaxFunction):
    """:class:`MaskedSoftmaxFunction` for a call whose signature ran before and whose mask
    needs no gradient: the forward replays that call's launch (``fusedops._replay``), the
    backward is the same. ``apply(x, mask, scale, causal, run)``."""

    @staticmethod
    def forward(ctx, x, mask, scale, causal, run):
        y = run(x, mask)
        if y is None:  # (the runner declined this call's tensors: the launch rules)
            y = _forward(x, mask, scale, causal, x.dtype)
        ctx.save_for_backward(y)
        ctx.scale = scale
        ctx.in_dtype = x.dtype
        ctx.mask_meta = None
        ctx.run = run
        return y

    @staticmethod
    def backward(ctx, dy):
        if ctx.run.native is None:
            # The runner's first training backward: it may make its C++ autograd path
            # (fusedops._host_ext) from this call, whose gradient it returns.
            dx = ctx.run.make_native(ctx.saved_tensors[0], dy)
            if dx is not None:
                return dx, None, None, None, None
        return MaskedSoftmaxFunction.backward(ctx, dy)


_grad_enabled = torch.is_grad_enabled
_functorch_active = torch._C._are_functorch_transforms_active


def replay_key(x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool) -> tuple:
    """A call's signature in ``fusedops._replay.SOFTMAX_MASKED`` (its docstring says what it
    fixes)."""
    return (x.shape, x.dtype, x.get_device(), scale, causal,
            None if mask is None else (mask.shape, mask.stride(), mask.dtype))


def replay_runner(x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool):
    """The ``fusedops._replay.SOFTMAX_MASKED`` runner of a call of this signature seen before
    (``run(x, mask) -> y or None``), or None/False. The caller has checked what the signature
    assumes: plain tensors, ``dim=-1``, no ``dtype``, a float ``scale``, a mask that needs no
    gradient, and :func:`fusedops._dispatch.plain_eager` (or the same facts otherwise).
    (:func:`replay_key` written out: one Python call fewer per attention layer.)"""
    return _replay.SOFTMAX_MASKED.get((
        x.shape, x.dtype, x.get_device(), scale, causal,
        None if mask is None else (mask.shape, mask.stride(), mask.dtype)))


def masked_softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None, scale: float | None,
                   mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """fused_softmax's path for scale/mask/causal (its arguments as the user gave them)."""
    if x.__class__ is torch.Tensor and dtype is None and dim.__class__ is int and dim == -1 \
            and (scale is None or scale.__class__ is float) and causal.__class__ is bool \
            and (mask is None or mask.__class__ is torch.Tensor and not mask.requires_grad) \
            and _dispatch.plain_eager():
        # A call seen before, replayed (fusedops._replay): no checks or launch rules; with
        # grad, through the lean Function above. (Exact classes: a bool scale or a non-bool
        # causal must still raise.)
        run = replay_runner(x, mask, 1.0 if scale is None else scale, causal)
        if run:
            if not (x.requires_grad and _grad_enabled()):
                y = run(x, mask)
                if y is not None:
                    return y
            elif not _functorch_active():
                node = run.native
                if node:  # forward and backward launched from C++ (fusedops._host_ext)
                    y = node(x, mask)
                    if y is not None:
                        return y
                return ReplayedMaskedSoftmax.apply(x, mask, 1.0 if scale is None else scale,
                                                   causal, run)
    check_float_tensor(x, "x")
    dim = normalize_dim(dim, x.dim())
    dtype = check_float_dtype(dtype)
    check_mask_args(x, scale, mask, causal)
    x, out_dtype = softmax_input(x, dtype)
    scale = 1.0 if scale is None else float(scale)
    grad = torch.is_grad_enabled() and (x.requires_grad or (mask is not None
                                                            and mask.requires_grad))
    backend = _dispatch.fused_backend(x, "softmax_masked", grad)
    if backend is None or x.numel() == 0 or torch.compiler.is_compiling():
        if backend is None and not causal and x.numel() and not _dispatch.native_now():
            return native(x, dim, scale, mask, out_dtype)
        return compose(x, dim, scale, mask, causal, out_dtype)
    if dim != x.dim() - 1:
        _dispatch.warn_once(
            "masked-softmax-dim",
            "fusedops: fused_softmax with scale/mask/causal runs fused over the last dim only; "
            f"dim={dim} of a {x.dim()}-d tensor uses PyTorch's ops (correct, not fused).")
        return compose(x, dim, scale, mask, causal, out_dtype)
    if grad:
        return MaskedSoftmaxFunction.apply(x, mask, scale, causal, out_dtype)
    return _forward(x, mask, scale, causal, out_dtype)
