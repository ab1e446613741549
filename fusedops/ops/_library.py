"""``torch.library`` custom ops wrapping the backend contract, used only under ``torch.compile``.

In eager mode the autograd Functions call the backend directly (cheapest host path). While
Dynamo traces, they call these opaque ops instead, so the Triton/Metal launch code is never
traced, ``fullgraph=True`` sees no graph break, and CUDA-graph capture replays the real kernels.
Optional outputs are returned as empty tensors because custom ops cannot return None.
"""

from __future__ import annotations

import torch

from fusedops import _dispatch


@torch.library.custom_op("fusedops::softmax_forward", mutates_args=())
def softmax_forward(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return _dispatch.backend_for(x).softmax_forward(x, out_dtype)


@softmax_forward.register_fake
def _(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("fusedops::softmax_backward", mutates_args=())
def softmax_backward(y: torch.Tensor, dy: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return _dispatch.backend_for(y).softmax_backward(y, dy, out_dtype)


@softmax_backward.register_fake
def _(y: torch.Tensor, dy: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return y.new_empty(y.shape, dtype=out_dtype)


@torch.library.custom_op("fusedops::layernorm_forward", mutates_args=())
def layernorm_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, mean, rstd = _dispatch.backend_for(x).layernorm_forward(x, weight, bias, eps, out_dtype)
    return y, mean, rstd


@layernorm_forward.register_fake
def _(x, weight, bias, eps, out_dtype):
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    m = x.shape[0]
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty((m,), dtype=acc), x.new_empty(
        (m,), dtype=acc
    )


@torch.library.custom_op("fusedops::layernorm_backward", mutates_args=())
def layernorm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # No grad_dtypes: the Triton backend then makes no replay plans (see its docstring).
    dx, dw, db = _dispatch.backend_for(x).layernorm_backward(
        dy, x, weight, mean, rstd, need_dx, need_dw, need_db
    )
    # Missing outputs: fresh (never shared) empty tensors with the dtypes the fake reports
    # (a backend may return dweight/dbias in the weight's dtype: cast to what the fake says).
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (
        dx if dx is not None else x.new_empty((0,)),
        dw.to(acc) if dw is not None else x.new_empty((0,), dtype=acc),
        db.to(acc) if db is not None else x.new_empty((0,), dtype=acc),
    )


@layernorm_backward.register_fake
def _(dy, x, weight, mean, rstd, need_dx, need_dw, need_db):
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    n = x.shape[1]
    return (
        x.new_empty(x.shape if need_dx else (0,)),
        x.new_empty((n,) if need_dw else (0,), dtype=acc),
        x.new_empty((n,) if need_db else (0,), dtype=acc),
    )


@torch.library.custom_op("fusedops::rmsnorm_forward", mutates_args=())
def rmsnorm_forward(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    y, rstd = _dispatch.backend_for(x).rmsnorm_forward(x, weight, eps, out_dtype)
    return y, rstd


@rmsnorm_forward.register_fake
def _(x, weight, eps, out_dtype):
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty((x.shape[0],), dtype=acc)


@torch.library.custom_op("fusedops::rmsnorm_backward", mutates_args=())
def rmsnorm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = _dispatch.backend_for(x).rmsnorm_backward(dy, x, weight, rstd, need_dx, need_dw)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (
        dx if dx is not None else x.new_empty((0,)),
        dw.to(acc) if dw is not None else x.new_empty((0,), dtype=acc),
    )


@rmsnorm_backward.register_fake
def _(dy, x, weight, rstd, need_dx, need_dw):
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (
        x.new_empty(x.shape if need_dx else (0,)),
        x.new_empty((x.shape[1],) if need_dw else (0,), dtype=acc),
    )
