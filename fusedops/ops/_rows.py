"""Reshaping user tensors to the backends' (M, N) row form and back, copying only when needed."""

from __future__ import annotations

import torch


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """View ``t`` (trailing size ``n``) as (M, n) with unit column stride.

    A view whenever the leading dims collapse into one stride (any row stride, including the 0
    of an expanded gradient); otherwise one copy.
    """
    if t.dim() == 2 and t.shape[1] == n and t.is_contiguous():
        return t  # already rows: skip the view (host cost per call)
    rows = t.reshape(-1, n) if n > 0 else t.reshape(-1, 0)
    if rows.stride(1) != 1 and n > 1:
        rows = rows.contiguous()
    return rows


def flat_param(p: torch.Tensor | None) -> torch.Tensor | None:
    """A weight/bias as the (N,) contiguous vector the backends take (a view when possible)."""
    if p is None or (p.dim() == 1 and p.is_contiguous()):  # the common case: no view to make
        return p
    return p.reshape(-1).contiguous()


def autocast_fp32(x: torch.Tensor) -> bool:
    """True when PyTorch's autocast would run softmax/layer_norm/rms_norm on ``x`` in float32.

    The three ops are on autocast's float32 list for CUDA; there the fused kernels read the
    low-precision input as is and write float32, which matches torch without an extra cast pass.
    """
    return x.is_cuda and torch.is_autocast_enabled("cuda")


# Casting these to float32 loses nothing, so the kernels read them directly and write float32.
_EXACT_UPCAST = (torch.float16, torch.bfloat16)


def softmax_input(x: torch.Tensor, dtype: torch.dtype | None
                  ) -> tuple[torch.Tensor, torch.dtype]:
    """(the tensor the softmax kernels read, the result dtype) for ``torch.softmax``'s
    ``dtype=`` argument (already checked): x is cast first, as in torch, unless the kernel can
    read it as is (16-bit -> float32); under CUDA autocast the result is float32."""
    if dtype is not None and dtype != x.dtype:
        if not (dtype == torch.float32 and x.dtype in _EXACT_UPCAST):
            x = x.to(dtype)
        return x, dtype
    if dtype is None and autocast_fp32(x):
        return x, torch.float32
    return x, x.dtype


def is_last_dim(normalized_shape: object, last: int) -> bool:
    """Whether ``normalized_shape`` is an int or a 1-tuple (or Size) of an int equal to
    ``last``, x's last dim: the replay tables' LayerNorm (over the last dim)."""
    cls = normalized_shape.__class__
    if cls is int:
        n = normalized_shape
    elif (cls is tuple or cls is torch.Size) and len(normalized_shape) == 1:
        n = normalized_shape[0]
    else:
        return False
    return n.__class__ is int and n == last
