"""Pure-PyTorch implementations of the 2-D row contract (see ``fusedops._dispatch``).

These run wherever no fused backend applies (CPU tensors, float64, a device without kernels)
and compute in float32 (or float64 for float64 inputs) exactly like the kernels do, so the
fallback is correct, only not fused. The tests' oracle is separate: plain float64 PyTorch.
"""

from __future__ import annotations

import torch

NAME = "reference"


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def softmax_forward(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Row softmax. x: (M, N) float tensor; returns (M, N) contiguous of ``out_dtype``."""
    return torch.softmax(x.to(_acc_dtype(x.dtype)), dim=-1).to(out_dtype).contiguous()


def softmax_backward(
    y: torch.Tensor, dy: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """dx = y * (dy - sum(dy * y)). y, dy: (M, N); returns (M, N) of ``out_dtype``."""
    acc = _acc_dtype(y.dtype)
    yf, dyf = y.to(acc), dy.to(acc)
    dot = (yf * dyf).sum(dim=-1, keepdim=True)
    return (yf * (dyf - dot)).to(out_dtype)


def layernorm_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row LayerNorm. x: (M, N); weight, bias: (N,) or None.

    Returns y (M, N) of ``out_dtype``, mean (M,) and rstd (M,) in the accumulation dtype
    (float32, or float64 for float64 input).
    """
    acc = _acc_dtype(x.dtype)
    xf = x.to(acc)
    # var_mean is one Welford pass: exact for constant rows, no E[x^2] - E[x]^2 cancellation.
    var, mean = torch.var_mean(xf, dim=-1, correction=0)
    # A variance that overflows gives NaN (as torch does), never a silent row of zeros.
    rstd = torch.where(torch.isinf(var), torch.nan, torch.rsqrt(var + eps))
    y = (xf - mean[:, None]) * rstd[:, None]  # a new tensor: the in-place ops below are safe
    if weight is not None:
        y.mul_(weight.to(acc))
    if bias is not None:
        y.add_(bias.to(acc))
    return y.to(out_dtype), mean, rstd


def layernorm_forward_y(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`layernorm_forward` without the statistics (no backward will follow)."""
    return layernorm_forward(x, weight, bias, eps, out_dtype)[0]


def layernorm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
    grad_dtypes: tuple[torch.dtype, torch.dtype] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of row LayerNorm. dx has x's dtype; dw and db come back in the accumulation
    dtype (float32, float64 for float64 input), shape (N,). ``grad_dtypes`` (the parameters'
    dtypes, a hint some backends use to cast in place) is not needed here: the caller casts."""
    acc = _acc_dtype(x.dtype)
    dyf = dy.to(acc)
    xhat = (x.to(acc) - mean[:, None].to(acc)) * rstd[:, None].to(acc)
    dx = dw = db = None
    if need_dx:
        wdy = dyf * weight.to(acc) if weight is not None else dyf
        c1 = (xhat * wdy).mean(dim=-1, keepdim=True)
        c2 = wdy.mean(dim=-1, keepdim=True)
        dx = ((wdy - (xhat * c1 + c2)) * rstd[:, None].to(acc)).to(x.dtype)
    if need_dw:
        dw = (dyf * xhat).sum(dim=0)
    if need_db:
        db = dyf.sum(dim=0)
    return dx, dw, db


def rmsnorm_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row RMSNorm. x: (M, N); weight: (N,) or None.

    Returns y = x · rstd · weight, (M, N) of ``out_dtype``, and rstd = 1 / sqrt(mean(x²) + eps),
    (M,) in the accumulation dtype (float32, or float64 for float64 input).
    """
    acc = _acc_dtype(x.dtype)
    xf = x.to(acc)
    # As torch: an infinite mean square (an inf in the row) gives rstd 0, so the row's finite
    # elements come out 0 and the inf itself NaN.
    rstd = torch.rsqrt(xf.square().mean(dim=-1) + eps)
    y = xf * rstd[:, None]
    if weight is not None:
        y.mul_(weight.to(acc))
    return y.to(out_dtype), rstd


def rmsnorm_forward_y(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`rmsnorm_forward` without the statistics (no backward will follow)."""
    return rmsnorm_forward(x, weight, eps, out_dtype)[0]


def rmsnorm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
    grad_dtypes: tuple[torch.dtype, ...] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of row RMSNorm: with xhat = x · rstd and g = weight · dy,
    dx = rstd · (g − xhat · mean(xhat · g)) in x's dtype, dw = Σ_rows dy · xhat in the
    accumulation dtype, shape (N,)."""
    acc = _acc_dtype(x.dtype)
    dyf = dy.to(acc)
    r = rstd[:, None].to(acc)
    xhat = x.to(acc) * r
    dx = dw = None
    if need_dx:
        g = dyf * weight.to(acc) if weight is not None else dyf
        c = (xhat * g).mean(dim=-1, keepdim=True)
        dx = ((g - xhat * c) * r).to(x.dtype)
    if need_dw:
        dw = (dyf * xhat).sum(dim=0)
    return dx, dw


# --- epilogues: scaled/masked/causal softmax, add + LayerNorm + dropout + activation ---


def softmax_masked_forward(
    x: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Softmax over the last dim of ``z = x * scale``, masked.

    x: (B, H, Q, N) contiguous. mask: None or a (B, H, Q, N) view (any strides, 0 where it was
    broadcast) of dtype bool (True = keep) or float (added to z). causal: also drop column j of
    query row q (the index along dim 2) when j > q (top-left aligned). Returns (B, H, Q, N)
    contiguous of ``out_dtype``; a row with every element -inf after scale, mask and causal
    (nothing kept) comes out as zeros, not NaN.
    """
    acc = _acc_dtype(x.dtype)
    z = x.to(acc) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            z = z.masked_fill(~mask, -torch.inf)
        else:
            z = z + mask.to(acc)
    if causal:
        q, n = z.shape[-2], z.shape[-1]
        dropped = torch.ones(q, n, dtype=torch.bool, device=z.device).triu(1)
        z = z.masked_fill(dropped, -torch.inf)
    empty = z.amax(dim=-1, keepdim=True) == -torch.inf
    y = torch.softmax(z, dim=-1).masked_fill(empty, 0.0)
    return y.to(out_dtype).contiguous()


def softmax_masked_backward(
    y: torch.Tensor, dy: torch.Tensor, scale: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """dx = scale * y * (dy - sum(dy * y)). y, dy: (M, N); returns (M, N) of ``out_dtype``.
    Masked and empty-row positions have y == 0, so their gradient is 0."""
    return (softmax_backward(y, dy, _acc_dtype(y.dtype)) * scale).to(out_dtype)


ACTIVATIONS = (None, "relu", "gelu")


def _activate(v: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return v
    if activation == "relu":
        return torch.relu(v)
    return torch.nn.functional.gelu(v)  # exact (erf) GELU, torch's default


def _activation_grad(v: torch.Tensor, activation: str | None) -> torch.Tensor | None:
    """d activation / dv at v; None for no activation (the identity)."""
    if activation is None:
        return None
    if activation == "relu":
        return (v > 0).to(v.dtype)
    cdf = 0.5 * (1.0 + torch.erf(v * 0.7071067811865476))
    pdf = torch.exp(-0.5 * v * v) * 0.3989422804014327
    return cdf + v * pdf


def _keep_scale(shape: tuple[int, int], dropout_p: float, seed: int, device, acc):
    """The dropout factor per element: 0 where dropped, 1 / (1 - p) where kept (None: p == 0)."""
    if dropout_p == 0.0:
        return None
    from fusedops import _philox

    keep = _philox.keep_mask(seed, shape[0], shape[1], dropout_p, device)
    return keep.to(acc) * (1.0 / (1.0 - dropout_p))


def layernorm_epilogue_forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
    dropout_p: float,
    seed: int,
    activation: str | None,
    need_stats: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``out = activation(dropout(layer_norm(x + residual)))`` over rows.

    x, residual: (M, N) with unit column stride, same dtype (residual may be None). Returns
    ``(out, s, mean, rstd)``: out (M, N) of ``out_dtype``; s = x + residual rounded to x's dtype,
    (M, N) contiguous (None without residual), which is also the LayerNorm's input; mean/rstd
    (M,) in the accumulation dtype (None unless ``need_stats``). Dropout keeps element (row, col)
    when its Philox number (fusedops._philox) is >= the threshold of ``dropout_p`` and scales it
    by 1 / (1 - p); ``dropout_p == 0`` means no dropout.
    """
    s = None
    if residual is not None:
        s = (x + residual).contiguous()
    ln_in = x if s is None else s
    acc = _acc_dtype(x.dtype)
    y, mean, rstd = layernorm_forward(ln_in, weight, bias, eps, acc)
    factor = _keep_scale(tuple(y.shape), dropout_p, seed, y.device, acc)
    if factor is not None:
        y = y * factor
    out = _activate(y, activation).to(out_dtype)
    if not need_stats:
        mean = rstd = None
    return out, s, mean, rstd


def layernorm_epilogue_backward(
    dout: torch.Tensor,
    ds: torch.Tensor | None,
    s: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dropout_p: float,
    seed: int,
    activation: str | None,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
    grad_dtypes: tuple[torch.dtype, torch.dtype] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of :func:`layernorm_epilogue_forward`.

    dout: (M, N) gradient of ``out``; ds: (M, N) gradient flowing into the returned sum, or None;
    s: the LayerNorm's input (x + residual, or x). The dropout mask is regenerated from ``seed``
    and the activation's input recomputed from s, mean, rstd, weight and bias. Returns dx (the
    gradient of x, which is also residual's) in s's dtype, and float (N,) dw/db as
    :func:`layernorm_backward` (``grad_dtypes`` is a hint for backends that cast them; the caller
    casts these).
    """
    acc = _acc_dtype(s.dtype)
    g = dout.to(acc)
    factor = _keep_scale(tuple(s.shape), dropout_p, seed, s.device, acc)
    if activation is not None:
        v = (s.to(acc) - mean[:, None].to(acc)) * rstd[:, None].to(acc)
        if weight is not None:
            v = v * weight.to(acc)
        if bias is not None:
            v = v + bias.to(acc)
        if factor is not None:
            v = v * factor
        g = g * _activation_grad(v, activation)
    if factor is not None:
        g = g * factor
    # s in the accumulation dtype: dx comes back unrounded, so adding ds rounds once.
    dx, dw, db = layernorm_backward(g, s.to(acc), weight, mean, rstd, need_dx, need_dw, need_db)
    if need_dx:
        dx = (dx if ds is None else dx + ds.to(acc)).to(s.dtype)
    return dx, dw, db
