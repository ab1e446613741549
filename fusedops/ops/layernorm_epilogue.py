"""LayerNorm with fused epilogues, ``activation(dropout(layer_norm(x + residual)))``, in one
kernel: the path :func:`fusedops.fused_layernorm` takes when ``residual``, ``dropout_p`` (while
training) or ``activation`` is given."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedops import _dispatch, _philox
from fusedops._validate import check_same_kind
from fusedops.backends import reference
from fusedops.ops import _native
from fusedops.ops._rows import as_rows
from fusedops.ops._rows import flat_param as _flat

_backend_fn = _dispatch.backend_fn
_activate = reference._activate

ACTIVATIONS = reference.ACTIVATIONS


def check_epilogue_args(x: torch.Tensor, residual: object, dropout_p: object, activation: object,
                        training: object) -> None:
    """Raise (naming the argument) unless the epilogue arguments are valid for ``x``."""
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(
                f"residual must be a torch.Tensor or None, got {type(residual).__name__}")
        check_same_kind(residual, "residual", x)
        if residual.shape != x.shape:
            raise ValueError(
                f"residual must have x's shape {list(x.shape)}, got {list(residual.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device} but x is on {x.device}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, int | float) \
            or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be a probability in [0, 1], got {dropout_p!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not isinstance(training, bool):
        raise TypeError(f"training must be a bool, got {type(training).__name__}")


def compose(x, shape, weight, bias, eps, residual, p, activation, keep):
    """The chain in differentiable torch ops (double backward, p == 1, the reference of last
    resort). ``keep``: the boolean keep-mask of x's shape, or None for no dropout."""
    s = x if residual is None else x + residual
    # In float32 for 16-bit inputs (rounded once by the caller), as the kernels compute.
    acc = s if s.dtype in (torch.float32, torch.float64) else s.float()
    y = _native.layer_norm(acc, shape, weight, bias, eps)
    if keep is not None:
        y = y * keep * (1.0 / (1.0 - p)) if p < 1.0 else y * 0.0
    y = _activate(y, activation)
    return y if residual is None else (y, s)


class LayerNormEpilogueFunction(torch.autograd.Function):
    """Autograd Function of ``activation(dropout(layer_norm(x + residual)))``.

    ``apply(x, residual, weight, bias, n, eps, p, seed, activation, out_dtype)`` normalises over
    the trailing ``n`` elements and returns ``(out, x + residual)``, or ``out`` alone when
    ``residual`` is None. Saves the LayerNorm's input and the float32 mean/rstd (8 bytes per
    row), not the dropout mask: backward regenerates it from ``seed`` and recomputes the
    activation's input.
    """

    @staticmethod
    def forward(ctx, x, residual, weight, bias, n, eps, p, seed, activation, out_dtype):
        backend, fn = _backend_fn(x, "layernorm_epilogue_forward")
        _dispatch.record("layernorm_epilogue_forward", backend)
        x2, r2 = _rows(x, residual, n, backend)
        out2, s2, mean, rstd = fn(x2, r2, _flat(weight), _flat(bias), eps, out_dtype, p, seed,
                                  activation, True)
        out = out2 if x2 is x else out2.view(x.shape)
        s = x if s2 is None else s2 if x2 is x else s2.view(x.shape)
        ctx.save_for_backward(s, weight, bias, mean, rstd)
        ctx.meta = (n, eps, p, seed, activation)
        ctx.out_dtype = out_dtype
        ctx.param_meta = tuple(None if t is None else (t.shape, t.dtype) for t in (weight, bias))
        # An unused output's gradient arrives as None, not as zeros autograd would fill and the
        # backward would read (x + residual is often used only for its value, or not at all).
        ctx.set_materialize_grads(False)
        return out if residual is None else (out, s)

    @staticmethod
    def backward(ctx, dout, ds=None):
        s, weight, bias, mean, rstd = ctx.saved_tensors
        n, eps, p, seed, activation = ctx.meta
        need_x, need_r, need_w, need_b = ctx.needs_input_grad[:4]
        need_dx = bool(need_x or need_r)
        need_dw = bool(need_w and weight is not None)
        need_db = bool(need_b and bias is not None)
        if dout is None:  # only the sum was used
            dout = torch.zeros(s.shape, dtype=ctx.out_dtype, device=s.device)
        s2, dout2 = as_rows(s, n), as_rows(dout, n)
        ds2 = None if ds is None else as_rows(ds, n)
        w, b = _flat(weight), _flat(bias)
        w_meta, b_meta = ctx.param_meta
        if torch.is_grad_enabled():
            # create_graph=True: torch ops throughout, the statistics recomputed from s, so
            # second derivatives see mean and rstd as the functions of s they are.
            sf = s2 if s2.dtype == torch.float64 else s2.float()
            mean = sf.mean(dim=-1)
            rstd = torch.rsqrt((sf - mean[:, None]).square().mean(dim=-1) + eps)
            dx2, dw, db = reference.layernorm_epilogue_backward(
                dout2, ds2, s2, w, b, mean, rstd, p, seed, activation, need_dx, need_dw, need_db)
        else:
            backend, fn = _backend_fn(s2, "layernorm_epilogue_backward")
            _dispatch.record("layernorm_epilogue_backward", backend)
            dx2, dw, db = fn(dout2, ds2, s2, w, b, mean, rstd, p, seed, activation,
                             need_dx, need_dw, need_db,
                             grad_dtypes=(w_meta and w_meta[1], b_meta and b_meta[1]))
        dx = dx2 if dx2 is None or dx2.shape == s.shape else dx2.view(s.shape)
        dweight = None if dw is None else _as_param_grad(dw, w_meta)
        dbias = None if db is None else _as_param_grad(db, b_meta)
        return (dx if need_x else None, dx if need_r else None, dweight, dbias,
                None, None, None, None, None, None)


def _as_param_grad(g: torch.Tensor, meta: tuple) -> torch.Tensor:
    """A parameter's gradient ``g`` (N,) in the parameter's (shape, dtype) ``meta``; the
    backends usually return it so already (each .to / .view is a dispatch of host time)."""
    shape, dtype = meta
    if g.dtype != dtype:
        g = g.to(dtype)
    return g if g.shape == shape else g.view(shape)


def layernorm_epilogue(x, shape, n, weight, bias, eps, residual, p, activation, out_dtype):
    """fused_layernorm's path for residual/dropout/activation; arguments already checked,
    ``p`` already 0 outside training."""
    eps, p = float(eps), float(p)
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, residual, weight, bias))
    # With dropout, PyTorch's ops stand in only where no fused kernel can run: the mask's
    # generator (Philox, fusedops._philox) is part of the op.
    backend = _dispatch.fused_backend(x, "layernorm_epilogue" if p == 0.0 else "dropout", grad)
    if torch.compiler.is_compiling():
        # Inductor fuses the chain itself (also with a forced backend: the epilogue has no
        # custom op); dropout there draws from torch's generator.
        s = x if residual is None else x + residual
        y = _native.layer_norm(s, shape, weight, bias, eps)
        y = _activate(F.dropout(y, p) if p else y, activation).to(out_dtype)
        return y if residual is None else (y, s)
    if backend is None or x.numel() == 0 or n == 0 or p == 1.0:
        # PyTorch's ops (nothing to compute or nothing kept: they keep autograd's graph).
        keep = None
        if p == 1.0 or x.numel() == 0:
            keep = None if p == 0.0 else torch.zeros(x.shape, dtype=torch.bool, device=x.device)
        elif p > 0.0:
            keep = _philox.keep_mask(_philox.draw_seed(), x.numel() // n, n, p,
                                     x.device).view(x.shape)
        result = compose(x, shape, weight, bias, eps, residual, p, activation, keep)
        if residual is None:
            return result.to(out_dtype)
        return result[0].to(out_dtype), result[1]
    seed = _philox.draw_seed() if p > 0.0 else 0
    if grad:
        return LayerNormEpilogueFunction.apply(x, residual, weight, bias, n, eps, p, seed,
                                               activation, out_dtype)
    # No backward will follow: no statistics written, nothing saved.
    backend, fn = _backend_fn(x, "layernorm_epilogue_forward")
    _dispatch.record("layernorm_epilogue_forward", backend)
    x2, r2 = _rows(x, residual, n, backend)
    out2, s2, _, _ = fn(x2, r2, _flat(weight), _flat(bias), eps, out_dtype, p, seed, activation,
                        False)
    out = out2 if x2 is x else out2.view(x.shape)
    if residual is None:
        return out
    return out, s2 if x2 is x else s2.view(x.shape)


def _rows(x: torch.Tensor, residual: torch.Tensor | None, n: int, backend):
    """(x, residual) as ``backend``'s rows: as they are where it takes contiguous rows of any
    rank (``EPILOGUE_ROWS_ND``: no views to make and undo), else (M, n) views."""
    if (x.dim() not in (0, 2) and x.shape[-1] == n and x.is_contiguous()
            and (residual is None or residual.is_contiguous())
            and getattr(backend, "EPILOGUE_ROWS_ND", False)):
        return x, residual
    return as_rows(x, n), None if residual is None else as_rows(residual, n)

