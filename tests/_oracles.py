"""float64 references of every fused op, shared by the suites that compare a backend with them
(the Metal emulation tests on CPU and the Metal tests on an Apple GPU among them).

Each takes the inputs as the kernel sees them (already rounded to their dtypes) and returns
float64 results on the CPU; with a cotangent, the float64 gradients through autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _leaf(t: torch.Tensor | None, grad: bool) -> torch.Tensor | None:
    return None if t is None else t.detach().cpu().double().requires_grad_(grad)


def _grads(out: torch.Tensor, leaves: list, dout: torch.Tensor) -> list:
    """Gradients of ``out`` for each leaf (None for absent leaves)."""
    present = [t for t in leaves if t is not None]
    got = iter(torch.autograd.grad(out, present, dout.detach().cpu().double()))
    return [None if t is None else next(got) for t in leaves]


def softmax(x: torch.Tensor, dy: torch.Tensor | None = None, dim: int = -1):
    """y, or (y, dx) with ``dy``."""
    x64 = _leaf(x, dy is not None)
    y = torch.softmax(x64, dim)
    if dy is None:
        return y.detach()
    return y.detach(), _grads(y, [x64], dy)[0]


def softmax_backward(y: torch.Tensor, dy: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """dx from the saved output y (as the backward kernels compute it): scale·y·(dy - Σ y·dy)."""
    y64, dy64 = y.detach().cpu().double(), dy.detach().cpu().double()
    return scale * y64 * (dy64 - (y64 * dy64).sum(-1, keepdim=True))


def layernorm(x, weight, bias, eps: float, dy=None):
    """(y, mean, rstd) over the last dim, or with ``dy`` (dx, dweight, dbias)."""
    grad = dy is not None
    x64, w64, b64 = (_leaf(t, grad) for t in (x, weight, bias))
    y = F.layer_norm(x64, (x.shape[-1],), w64, b64, eps)
    if not grad:
        var, mean = torch.var_mean(x64, -1, correction=0)
        return y, mean, torch.rsqrt(var + eps)
    return tuple(_grads(y, [x64, w64, b64], dy))


def rmsnorm(x, weight, eps: float, dy=None):
    """(y, rstd) over the last dim, or with ``dy`` (dx, dweight)."""
    grad = dy is not None
    x64, w64 = _leaf(x, grad), _leaf(weight, grad)
    y = F.rms_norm(x64, (x.shape[-1],), w64, eps)
    if not grad:
        return y.detach(), torch.rsqrt(x64.square().mean(-1) + eps)
    return tuple(_grads(y, [x64, w64], dy))


def softmax_masked(x, mask, scale: float, causal: bool, dy=None):
    """softmax(x·scale + mask) over the last dim with a bool (False: dropped) or additive
    mask broadcast to x, causal (column > query index dropped, over the last two dims); rows
    with nothing kept are zeros. y, or (y, dx) with ``dy``."""
    x64 = _leaf(x, dy is not None)
    z = x64 * scale
    if mask is not None:
        m = mask.detach().cpu()
        z = z.masked_fill(~m, -torch.inf) if m.dtype == torch.bool else z + m.double()
    if causal:
        q, n = z.shape[-2:]
        z = z.masked_fill(torch.ones(q, n, dtype=torch.bool).triu(1), -torch.inf)
    empty = z.amax(-1, keepdim=True) == -torch.inf
    y = torch.softmax(z.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    if dy is None:
        return y.detach()
    return y.detach(), _grads(y, [x64], dy)[0]


def activate(v: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation == "relu":
        return torch.relu(v)
    if activation == "gelu":
        return F.gelu(v)  # the exact (erf) GELU
    return v


def layernorm_epilogue(x, residual, weight, bias, eps: float, keep=None, activation=None,
                       dout=None, ds=None):
    """activation(dropout(layer_norm(x + residual))) over the last dim, the sum rounded to x's
    dtype first (as the kernels and ``x + residual`` do); ``keep``: the float64 dropout factor
    (kept / (1 - p), 0 where dropped) or None. (out, mean, rstd), or with ``dout`` the
    gradients (dx, dweight, dbias), dx including ``ds`` (the sum's own cotangent) if given."""
    s = x if residual is None else x + residual
    grad = dout is not None
    s64, w64, b64 = (_leaf(t, grad) for t in (s, weight, bias))
    y = F.layer_norm(s64, (s.shape[-1],), w64, b64, eps)
    if keep is not None:
        y = y * keep
    out = activate(y, activation)
    if not grad:
        var, mean = torch.var_mean(s64.detach(), -1, correction=0)
        return out.detach(), mean, torch.rsqrt(var + eps)
    dx, dw, db = _grads(out, [s64, w64, b64], dout)
    if ds is not None:
        dx = dx + ds.detach().cpu().double()
    return dx, dw, db
