"""Shared set-up of the LayerNorm backward probes (split_rows.py, issue_bound_8k.py,
paired_unaligned.py): the device's copy bandwidth, and one sweep-sized problem."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Case(NamedTuple):
    """A LayerNorm backward problem: x, dy (M, N) and w (N,) in ``dtype``, the forward's
    float32 mean and rstd (M,), and the op's minimum bytes (read x and dy, write dx)."""

    x: torch.Tensor
    dy: torch.Tensor
    w: torch.Tensor
    mean: torch.Tensor
    rstd: torch.Tensor
    nbytes: int


def copy_tbps(device: str = "cuda") -> float:
    """Device-to-device copy bandwidth (TB/s, bytes read + written) of a 1 GiB ``copy_``."""
    from triton.testing import do_bench

    src = torch.empty(1 << 28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=50)
    return 2 * src.numel() * 4 / ms / 1e9


def case(dtype: torch.dtype, n: int, total: int = 1 << 27, device: str = "cuda") -> Case:
    """Rows of ``n`` at M·N = ``total`` elements (M = total // n), fresh random data."""
    m = total // n
    x = torch.randn(m, n, device=device, dtype=dtype)
    dy = torch.randn_like(x)
    w = torch.randn(n, device=device, dtype=dtype)
    xf = x.float()
    mean = xf.mean(1)
    rstd = torch.rsqrt(xf.var(1, unbiased=False) + 1e-5)
    return Case(x, dy, w, mean, rstd, 3 * m * n * x.element_size())
