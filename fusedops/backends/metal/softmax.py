"""Softmax and masked softmax on Metal: kernel choice, geometry and arguments per call."""

from __future__ import annotations

import torch

from fusedops.backends import reference
from fusedops.backends.metal.host import (
    MASK_DTYPES,
    Launcher,
    aligned,
    compact_to,
    empty_arg,
    kernel_names,
    mask_kind,
    row_kernel,
    rows2d,
)
from fusedops.backends.metal.rules import (
    FLAG_CAUSAL,
    FLAG_MASK,
    FLAG_MASK_VEC,
    FLAG_VEC,
    READS,
    TYPE_NAMES,
    row_groups,
)


def softmax_forward_with(launch: Launcher, x: torch.Tensor, out_dtype: torch.dtype):
    m, n = x.shape
    types = (TYPE_NAMES.get(x.dtype), TYPE_NAMES.get(out_dtype))
    names = kernel_names(launch, "softmax_fwd", types)
    if names is None:
        return reference.softmax_forward(x, out_dtype)
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    name, threads = row_kernel(launch, names, n)
    flags = FLAG_VEC if aligned(x, y) else 0
    launch(name, [x, y, m, n, x.stride(0), flags], row_groups(m), threads)
    return y


def softmax_backward_with(launch: Launcher, y: torch.Tensor, dy: torch.Tensor,
                          out_dtype: torch.dtype):
    m, n = y.shape
    if dy.dtype != y.dtype:
        dy = dy.to(y.dtype)
    types = (TYPE_NAMES.get(y.dtype), TYPE_NAMES.get(out_dtype))
    names = kernel_names(launch, "softmax_bwd", types)
    if names is None:
        return reference.softmax_backward(y, dy, out_dtype)
    dx = torch.empty((m, n), dtype=out_dtype, device=y.device)
    if m == 0 or n == 0:
        return dx
    name, threads = row_kernel(launch, names, n)
    flags = FLAG_VEC if aligned(y, dy, dx) else 0
    launch(name, [y, dy, dx, m, n, y.stride(0), dy.stride(0), flags], row_groups(m), threads)
    return dx


def softmax_masked_forward_with(launch: Launcher, x: torch.Tensor, mask, scale: float,
                                causal: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """Softmax of ``x * scale`` (B, H, Q, N), masked (bool: keep; float: added) and causal, over
    N; see ``fusedops.backends.reference.softmax_masked_forward``."""
    if x.dim() != 4:
        raise ValueError(f"fusedops metal: x must be (B, H, Q, N), got shape {list(x.shape)}")
    bsz, heads, queries, n = x.shape
    x_type = TYPE_NAMES.get(x.dtype)
    kind = mask_kind(mask, x_type)
    names = kernel_names(launch, "softmax_masked_fwd", (x_type, TYPE_NAMES.get(out_dtype), kind))
    if names is None:
        return reference.softmax_masked_forward(x, mask, scale, causal, out_dtype)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    m = bsz * heads * queries
    if m == 0 or n == 0:
        return y
    x2, y2 = rows2d(x.reshape(m, n)), y.view(m, n)
    flags = (FLAG_VEC if aligned(x2, y2) else 0) | (FLAG_CAUSAL if causal else 0)
    strides = [0, 0, 0, 0]
    mk = empty_arg(x)
    if mask is not None:
        mk = mask.expand(x.shape)
        if mk.dtype != MASK_DTYPES[kind]:
            mk = compact_to(mk, MASK_DTYPES[kind])
        # A size-1 dim is only ever indexed at 0: its stride does not matter.
        strides = [0 if sz == 1 else st for sz, st in zip(mk.shape, mk.stride(), strict=True)]
        flags |= FLAG_MASK
        if strides[3] == 1 and mk.storage_offset() % READS == 0 \
                and all(st % READS == 0 for st in strides[:3]):
            flags |= FLAG_MASK_VEC
    name, threads = row_kernel(launch, names, n)
    launch(name, [x2, mk, y2, m, n, x2.stride(0), heads, queries, *strides, float(scale), flags],
           row_groups(m), threads)
    return y


def softmax_masked_backward_with(launch: Launcher, y: torch.Tensor, dy: torch.Tensor,
                                 scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    """dx = scale * y * (dy - sum(dy * y)) over rows (M, N)."""
    m, n = y.shape
    if dy.dtype != y.dtype:
        dy = dy.to(y.dtype)
    types = (TYPE_NAMES.get(y.dtype), TYPE_NAMES.get(out_dtype))
    names = kernel_names(launch, "softmax_masked_bwd", types)
    if names is None:
        return reference.softmax_masked_backward(y, dy, scale, out_dtype)
    dx = torch.empty((m, n), dtype=out_dtype, device=y.device)
    if m == 0 or n == 0:
        return dx
    y, dy = rows2d(y), rows2d(dy)
    name, threads = row_kernel(launch, names, n)
    flags = FLAG_VEC if aligned(y, dy, dx) else 0
    launch(name, [y, dy, dx, m, n, y.stride(0), dy.stride(0), float(scale), flags],
           row_groups(m), threads)
    return dx
