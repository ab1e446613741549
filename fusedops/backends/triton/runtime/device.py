"""Device facts (cached once per device) and host-side integer helpers."""

from __future__ import annotations

import functools

import torch


@functools.cache
def device_name(index: int) -> str:
    """The name of CUDA device ``index`` (per-GPU launch rules match parts of it)."""
    return torch.cuda.get_device_name(index)


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on ``device`` (a small constant for CPU/interpreter runs)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def rows_and_output(x: torch.Tensor, out_dtype: torch.dtype):
    """(M, N, row stride of x, y) for a row-wise op on ``x``: a 2-D tensor with unit column
    stride and any row stride, or a contiguous tensor of any rank >= 1 whose last dim is the row
    (forward entry points take those as is, which saves a view on each side of the call). ``y``
    is a new contiguous tensor of ``x``'s shape and ``out_dtype``."""
    if x.dim() == 2:
        M, N = x.shape
        stride = x.stride(0)
    else:
        N = x.shape[-1]
        M = x.numel() // N if N else 0
        stride = N
    if x.is_contiguous():
        y = torch.empty_like(x, dtype=out_dtype)  # about 1 µs cheaper than torch.empty(shape)
    else:
        y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    return M, N, stride, y


# Host-side integer helpers. triton.cdiv / triton.next_power_of_2 are constexpr functions whose
# Python call costs microseconds (argument unwrapping) on every launch; these are plain ints.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


@functools.cache
def interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
