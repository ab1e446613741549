"""Philox4x32-10 in Triton: the dropout random numbers of ``fusedops._philox``, bit for bit.

``philox4x32`` is the generator itself (uint32 tensors in, the four uint32 output words out);
``element_bits`` maps a tile of elements onto it the way ``fusedops._philox`` defines:
element ``(row, col)`` with ``g, q, i = col // 1024, (col // 256) % 4, col % 256`` takes output
word ``q`` of the call with counter ``(g * 256 + i, row lo32, row hi32, 0)`` and key
``(seed lo32, seed hi32)``. Kernels lay their columns out as a ``[Q, R, G, NI]`` tile (``q``
outermost, ``col = g * 1024 + q * 256 + i``): the counters form a ``[1, R, G, NI]`` tensor, so
each call is made once and its four words feed the four column slices ``q``.

``element_keep`` gives the dropout keep mask of such a tile (the kernels' form).
``random_bits`` launches a small kernel built on ``element_bits`` (tests compare it with
``fusedops._philox.random_bits``).
"""

from __future__ import annotations

import torch

from fusedops.backends.triton.kernels.philox import random_bits_kernel
from fusedops.backends.triton.runtime.device import cdiv, next_pow2
from fusedops.backends.triton.runtime.launcher import Launcher


def column_tile(block: int) -> tuple[int, int, int]:
    """(G, Q, NI) of a row block of ``block`` columns (a power of two): 1024-column groups, 256-
    column slices per group, columns per slice, with ``col = g * 1024 + q * 256 + i``."""
    if block >= 1024:
        return block // 1024, 4, 256
    if block >= 256:
        return 1, block // 256, 256
    return 1, 1, block


_launch_bits = Launcher(random_bits_kernel)


def random_bits(seed: int, m: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``fusedops._philox.random_bits`` computed by the Triton generator: int64 ``(m, n)``."""
    out = torch.empty((m, n), dtype=torch.int64, device=device)
    if m == 0 or n == 0:
        return out
    G, Q, NI = column_tile(min(next_pow2(n), 2048))
    R = 4
    _launch_bits((cdiv(m, R), cdiv(n, G * Q * NI)),
                 (out, m, n, seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, R, G, Q, NI), 4)
    return out
