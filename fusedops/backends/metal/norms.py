"""LayerNorm and RMSNorm on Metal: kernel choice, geometry and arguments per call."""

from __future__ import annotations

import torch

from fusedops.backends import reference
from fusedops.backends.metal.host import (
    Launcher,
    aligned,
    empty_arg,
    kernel_names,
    param,
    row_kernel,
)
from fusedops.backends.metal.rules import (
    FLAG_BIAS,
    FLAG_DB,
    FLAG_DW,
    FLAG_DX,
    FLAG_VEC,
    FLAG_WEIGHT,
    TYPE_NAMES,
    layernorm_bwd_groups,
    reduce_threads,
    row_groups,
)


def layernorm_forward_with(launch: Launcher, x: torch.Tensor, weight, bias, eps: float,
                           out_dtype: torch.dtype):
    m, n = x.shape
    types = (TYPE_NAMES.get(x.dtype), TYPE_NAMES.get(out_dtype))
    names = kernel_names(launch, "layernorm_fwd", types)
    if names is None:
        return reference.layernorm_forward(x, weight, bias, eps, out_dtype)
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    mean = torch.empty((m,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y, mean, rstd
    w, b = param(weight), param(bias)
    flags = (FLAG_WEIGHT if w is not None else 0) | (FLAG_BIAS if b is not None else 0)
    params = [t for t in (w, b) if t is not None]
    if aligned(x, y, *params):
        flags |= FLAG_VEC
    name, threads = row_kernel(launch, names, n)
    args = [x, w if w is not None else empty_arg(x), b if b is not None else empty_arg(x), y, mean,
            rstd, m, n, x.stride(0), float(eps), flags]
    launch(name, args, row_groups(m), threads)
    return y, mean, rstd


def layernorm_backward_with(launch: Launcher, dy: torch.Tensor, x: torch.Tensor, weight,
                            mean: torch.Tensor, rstd: torch.Tensor, need_dx: bool,
                            need_dw: bool, need_db: bool):
    m, n = x.shape
    need_dx, need_dw, need_db = bool(need_dx), bool(need_dw), bool(need_db)
    types = (TYPE_NAMES.get(x.dtype), TYPE_NAMES.get(dy.dtype))
    names = kernel_names(launch, "layernorm_bwd", types)
    if names is None:
        return reference.layernorm_backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db)
    dev = x.device
    dx = torch.empty((m, n), dtype=x.dtype, device=dev) if need_dx else None
    # Sums over zero rows are zeros; otherwise the reduction kernel writes every column.
    new = torch.zeros if m == 0 else torch.empty
    dw = new((n,), dtype=torch.float32, device=dev) if need_dw else None
    db = new((n,), dtype=torch.float32, device=dev) if need_db else None
    if m == 0 or n == 0 or not (need_dx or need_dw or need_db):
        return dx, dw, db
    w = param(weight)
    mean = mean.reshape(-1).to(torch.float32).contiguous()
    rstd = rstd.reshape(-1).to(torch.float32).contiguous()
    groups = layernorm_bwd_groups(m, n)
    dwp = torch.empty((groups, n), dtype=torch.float32, device=dev) if need_dw else None
    dbp = torch.empty((groups, n), dtype=torch.float32, device=dev) if need_db else None
    flags = ((FLAG_WEIGHT if w is not None else 0) | (FLAG_DX if need_dx else 0)
             | (FLAG_DW if need_dw else 0) | (FLAG_DB if need_db else 0))
    if aligned(x, dy, *[t for t in (w, dx) if t is not None]):
        flags |= FLAG_VEC
    name, threads = row_kernel(launch, names, n)
    none = empty_arg(x)
    args = [dy, x, w if w is not None else none, mean, rstd, dx if dx is not None else none,
            dwp if dwp is not None else none, dbp if dbp is not None else none,
            m, n, dy.stride(0), x.stride(0), flags]
    launch(name, args, groups, threads)
    if need_dw or need_db:
        red = "fusedops_layernorm_dwdb_reduce"
        rt = reduce_threads(launch.max_threads(red))
        args = [dwp if dwp is not None else none, dbp if dbp is not None else none,
                dw if dw is not None else none, db if db is not None else none,
                groups, n, flags & (FLAG_DW | FLAG_DB)]
        launch(red, args, -(-n // rt), rt)
    return dx, dw, db


def rmsnorm_forward_with(launch: Launcher, x: torch.Tensor, weight, eps: float,
                         out_dtype: torch.dtype):
    m, n = x.shape
    types = (TYPE_NAMES.get(x.dtype), TYPE_NAMES.get(out_dtype))
    names = kernel_names(launch, "rmsnorm_fwd", types)
    if names is None:
        return reference.rmsnorm_forward(x, weight, eps, out_dtype)
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y, rstd
    w = param(weight)
    flags = FLAG_WEIGHT if w is not None else 0
    if aligned(x, y, *([w] if w is not None else [])):
        flags |= FLAG_VEC
    name, threads = row_kernel(launch, names, n)
    args = [x, w if w is not None else empty_arg(x), y, rstd, m, n, x.stride(0), float(eps), flags]
    launch(name, args, row_groups(m), threads)
    return y, rstd


def rmsnorm_forward_y_with(launch: Launcher, x: torch.Tensor, weight, eps: float,
                           out_dtype: torch.dtype) -> torch.Tensor:
    return rmsnorm_forward_with(launch, x, weight, eps, out_dtype)[0]


def rmsnorm_backward_with(launch: Launcher, dy: torch.Tensor, x: torch.Tensor, weight,
                          rstd: torch.Tensor, need_dx: bool, need_dw: bool):
    m, n = x.shape
    need_dx, need_dw = bool(need_dx), bool(need_dw)
    types = (TYPE_NAMES.get(x.dtype), TYPE_NAMES.get(dy.dtype))
    names = kernel_names(launch, "rmsnorm_bwd", types)
    if names is None:
        return reference.rmsnorm_backward(dy, x, weight, rstd, need_dx, need_dw)
    dev = x.device
    dx = torch.empty((m, n), dtype=x.dtype, device=dev) if need_dx else None
    # A sum over zero rows is zeros; otherwise the reduction kernel writes every column.
    dw = ((torch.zeros if m == 0 else torch.empty)((n,), dtype=torch.float32, device=dev)
          if need_dw else None)
    if m == 0 or n == 0 or not (need_dx or need_dw):
        return dx, dw
    w = param(weight)
    rstd = rstd.reshape(-1).to(torch.float32).contiguous()
    groups = layernorm_bwd_groups(m, n)
    dwp = torch.empty((groups, n), dtype=torch.float32, device=dev) if need_dw else None
    flags = ((FLAG_WEIGHT if w is not None else 0) | (FLAG_DX if need_dx else 0)
             | (FLAG_DW if need_dw else 0))
    if aligned(x, dy, *[t for t in (w, dx) if t is not None]):
        flags |= FLAG_VEC
    name, threads = row_kernel(launch, names, n)
    none = empty_arg(x)
    args = [dy, x, w if w is not None else none, rstd, dx if dx is not None else none,
            dwp if dwp is not None else none, m, n, dy.stride(0), x.stride(0), flags]
    launch(name, args, groups, threads)
    if need_dw:
        # Stage 2: the LayerNorm reduction kernel, dweight only.
        red = "fusedops_layernorm_dwdb_reduce"
        rt = reduce_threads(launch.max_threads(red))
        launch(red, [dwp, none, dw, none, groups, n, FLAG_DW], -(-n // rt), rt)
    return dx, dw
