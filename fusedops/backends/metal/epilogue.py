"""The LayerNorm epilogue (residual add, dropout, activation) on Metal."""

from __future__ import annotations

import torch

from fusedops.backends import reference
from fusedops.backends.metal.host import (
    Launcher,
    aligned,
    empty_arg,
    epilogue_flags,
    epilogue_kernel,
    kernel_names,
    param,
    rows2d,
    seed_arg,
)
from fusedops.backends.metal.rules import (
    FLAG_ADD,
    FLAG_BIAS,
    FLAG_DB,
    FLAG_DROPOUT,
    FLAG_DW,
    FLAG_DX,
    FLAG_GELU,
    FLAG_PHILOX,
    FLAG_RELU,
    FLAG_STATS,
    FLAG_VEC,
    FLAG_WEIGHT,
    TYPE_NAMES,
    layernorm_bwd_groups,
    reduce_threads,
    row_groups,
)


def layernorm_epilogue_forward_with(launch: Launcher, x: torch.Tensor, residual, weight, bias,
                                    eps: float, out_dtype: torch.dtype, dropout_p: float,
                                    seed: int, activation: str | None, need_stats: bool):
    """``(out, s, mean, rstd)`` of ``activation(dropout(layer_norm(x + residual)))``; see
    ``fusedops.backends.reference.layernorm_epilogue_forward``."""
    m, n = x.shape
    ep_flags, threshold, keep = epilogue_flags(dropout_p, activation)
    types = (TYPE_NAMES.get(x.dtype), TYPE_NAMES.get(out_dtype))
    names = kernel_names(launch, "layernorm_epilogue_fwd", types)
    if names is None or (residual is not None and residual.dtype != x.dtype):
        return reference.layernorm_epilogue_forward(x, residual, weight, bias, eps, out_dtype,
                                                    dropout_p, seed, activation, need_stats)
    dev = x.device
    out = torch.empty((m, n), dtype=out_dtype, device=dev)
    s = None if residual is None else torch.empty((m, n), dtype=x.dtype, device=dev)
    mean = rstd = None
    if need_stats:
        # The statistics of empty rows are NaN, as the reference's.
        mean = torch.full((m,), torch.nan, device=dev) if n == 0 else \
            torch.empty((m,), dtype=torch.float32, device=dev)
        rstd = torch.full_like(mean, torch.nan) if n == 0 else torch.empty_like(mean)
    if m == 0 or n == 0:
        return out, s, mean, rstd
    x = rows2d(x)
    residual = None if residual is None else rows2d(residual)
    w, b = param(weight), param(bias)
    flags = (ep_flags | (FLAG_WEIGHT if w is not None else 0) | (FLAG_BIAS if b is not None else 0)
             | (FLAG_ADD if residual is not None else 0) | (FLAG_STATS if need_stats else 0))
    name, threads, philox = epilogue_kernel(launch, names, n, bool(ep_flags & FLAG_DROPOUT))
    if philox:
        flags |= FLAG_PHILOX
    elif aligned(x, out, *[t for t in (residual, s, w, b) if t is not None]):
        flags |= FLAG_VEC
    none = empty_arg(x)
    args = [x, none if residual is None else residual, none if w is None else w,
            none if b is None else b, out, none if s is None else s,
            none if mean is None else mean, none if rstd is None else rstd, m, n, x.stride(0),
            0 if residual is None else residual.stride(0), float(eps), seed_arg(seed),
            threshold, keep, flags]
    launch(name, args, row_groups(m), threads)
    return out, s, mean, rstd


def layernorm_epilogue_backward_with(launch: Launcher, dout: torch.Tensor, ds, s: torch.Tensor,
                                     weight, bias, mean: torch.Tensor, rstd: torch.Tensor,
                                     dropout_p: float, seed: int, activation: str | None,
                                     need_dx: bool, need_dw: bool, need_db: bool):
    """``(dx, dw, db)`` of :func:`layernorm_epilogue_forward_with`; see
    ``fusedops.backends.reference.layernorm_epilogue_backward``."""
    m, n = s.shape
    need_dx, need_dw, need_db = bool(need_dx), bool(need_dw), bool(need_db)
    ep_flags, threshold, keep = epilogue_flags(dropout_p, activation)
    types = (TYPE_NAMES.get(s.dtype), TYPE_NAMES.get(dout.dtype))
    names = kernel_names(launch, "layernorm_epilogue_bwd", types)
    if names is None:
        return reference.layernorm_epilogue_backward(dout, ds, s, weight, bias, mean, rstd,
                                                     dropout_p, seed, activation, need_dx,
                                                     need_dw, need_db)
    dev = s.device
    dx = torch.empty((m, n), dtype=s.dtype, device=dev) if need_dx else None
    # Sums over zero rows are zeros; otherwise the reduction kernel writes every column.
    new = torch.zeros if m == 0 else torch.empty
    dw = new((n,), dtype=torch.float32, device=dev) if need_dw else None
    db = new((n,), dtype=torch.float32, device=dev) if need_db else None
    if m == 0 or n == 0 or not (need_dx or need_dw or need_db):
        return dx, dw, db
    s, dout = rows2d(s), rows2d(dout)
    if ds is not None and need_dx:
        ds = rows2d(ds if ds.dtype == s.dtype else ds.to(s.dtype))
    else:
        ds = None
    w = param(weight)
    # The bias only enters through the activation's input.
    b = param(bias) if ep_flags & (FLAG_RELU | FLAG_GELU) else None
    mean = mean.reshape(-1).to(torch.float32).contiguous()
    rstd = rstd.reshape(-1).to(torch.float32).contiguous()
    groups = layernorm_bwd_groups(m, n)
    dwp = torch.empty((groups, n), dtype=torch.float32, device=dev) if need_dw else None
    dbp = torch.empty((groups, n), dtype=torch.float32, device=dev) if need_db else None
    flags = (ep_flags | (FLAG_WEIGHT if w is not None else 0) | (FLAG_BIAS if b is not None else 0)
             | (FLAG_ADD if ds is not None else 0) | (FLAG_DX if need_dx else 0)
             | (FLAG_DW if need_dw else 0) | (FLAG_DB if need_db else 0))
    name, threads, philox = epilogue_kernel(launch, names, n, bool(ep_flags & FLAG_DROPOUT))
    if philox:
        flags |= FLAG_PHILOX
    elif aligned(s, dout, *[t for t in (ds, w, b, dx) if t is not None]):
        flags |= FLAG_VEC
    none = empty_arg(s)
    args = [dout, none if ds is None else ds, s, none if w is None else w,
            none if b is None else b, mean, rstd, none if dx is None else dx,
            none if dwp is None else dwp, none if dbp is None else dbp, m, n, dout.stride(0),
            0 if ds is None else ds.stride(0), s.stride(0), seed_arg(seed), threshold, keep,
            flags]
    launch(name, args, groups, threads)
    if need_dw or need_db:
        red = "fusedops_layernorm_dwdb_reduce"
        rt = reduce_threads(launch.max_threads(red))
        args = [none if dwp is None else dwp, none if dbp is None else dbp,
                none if dw is None else dw, none if db is None else db,
                groups, n, flags & (FLAG_DW | FLAG_DB)]
        launch(red, args, -(-n // rt), rt)
    return dx, dw, db
