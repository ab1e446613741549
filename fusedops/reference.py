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
