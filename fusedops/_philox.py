"""The dropout mask's random numbers: Philox4x32-10, and which output feeds which element.

Every backend (Triton, Metal, this PyTorch reference) draws the same bits for the same seed, so a
mask can be regenerated in backward instead of stored, and the tests can compare backends mask
for mask. The definition (docs/design.md, "Dropout's random numbers"):

* Generator: Philox4x32 with 10 rounds (Salmon et al., SC'11; the Random123 constants), a
  4-word counter and a 2-word key, one call giving four 32-bit outputs.
* Key: the 64-bit seed, ``(k0, k1) = (seed & 0xffffffff, seed >> 32)``. fusedops draws a fresh
  seed from torch's default CPU generator per forward call (:func:`draw_seed`), so
  ``torch.manual_seed`` fixes the masks.
* Counter and output for element ``(row, col)`` of the ``(M, N)`` row view, with ``W = 256``:
  ``g, q, i = col // (4W), (col // W) % 4, col % W``; counter
  ``(g * W + i, row & 0xffffffff, row >> 32, 0)``; the element takes output ``q``. So one call
  serves four elements ``W`` columns apart, and a kernel holding ``4W`` consecutive columns of a
  row computes each counter once.
* Keep test: ``r >= threshold`` with ``threshold = dropout_threshold(p)`` (``p`` scaled to 2^32),
  kept values scaled by ``1 / (1 - p)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

W = 256  # columns between the four elements that share one Philox call
MUL0, MUL1 = 0xD2511F53, 0xCD9E8D57
BUMP0, BUMP1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
_MASK32 = 0xFFFFFFFF


_salt = 0  # mixed into every seed drawn inside seed_salt (a DTensor shard's own masks)
_SEED_MASK = 2**62 - 1


def draw_seed() -> int:
    """A fresh 62-bit seed from torch's default (CPU) generator: honours ``torch.manual_seed``,
    costs no GPU work and no synchronisation."""
    # device="cpu" also under torch.set_default_device("cuda"): no GPU generator, no sync.
    seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64, device="cpu").item())
    return seed if not _salt else (seed ^ _salt) & _SEED_MASK


@contextlib.contextmanager
def seed_salt(index: int) -> Iterator[None]:
    """Inside the block, every drawn seed is mixed with shard ``index`` (0: unchanged): each
    shard of a DTensor draws a mask of its own from the one seed all ranks draw alike, while
    torch's generator advances exactly as for one unsharded call."""
    global _salt
    previous = _salt
    # An odd 62-bit multiplier spreads neighbouring indices over the whole key.
    _salt = (index * 0x2545F4914F6CDD1D) & _SEED_MASK
    try:
        yield
    finally:
        _salt = previous


def dropout_threshold(p: float) -> int:
    """The keep threshold for drop probability ``p`` in [0, 1): an element is kept when its
    32-bit random number is >= this, which happens with probability 1 - p (to 2^-32)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1) here, got {p!r}")
    return min(int(p * 2.0**32), _MASK32)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # a * b for a 32-bit constant a and int64 tensor b in [0, 2^32), without overflowing int64:
    # split b into 16-bit halves (each partial product < 2^48).
    lo_part = a * (b & 0xFFFF)
    hi_part = a * (b >> 16)
    hi = (hi_part + (lo_part >> 16)) >> 16
    lo = (((hi_part & 0xFFFF) << 16) + lo_part) & _MASK32
    return hi, lo


def philox4x32(c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor,
               k0: int, k1: int) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 on int64 tensors holding uint32 values (broadcastable); returns the four
    output words, int64 in [0, 2^32)."""
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + BUMP0) & _MASK32, (k1 + BUMP1) & _MASK32
        hi0, lo0 = _mulhilo(MUL0, c0)
        hi1, lo1 = _mulhilo(MUL1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def random_bits(seed: int, m: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 32-bit random number of every element of an ``(m, n)`` row view, int64 ``(m, n)``."""
    rows = torch.arange(m, dtype=torch.int64, device=device)[:, None]
    cols = torch.arange(n, dtype=torch.int64, device=device)[None, :]
    g, q, i = cols // (4 * W), (cols // W) % 4, cols % W
    c0 = (g * W + i).expand(m, n)
    c1 = (rows & _MASK32).expand(m, n)
    c2 = (rows >> 32).expand(m, n)
    words = philox4x32(c0, c1, c2, torch.zeros_like(c0), seed & _MASK32, (seed >> 32) & _MASK32)
    out = torch.where(q == 0, words[0], words[1])
    out = torch.where(q == 2, words[2], out)
    return torch.where(q == 3, words[3], out)


def keep_mask(seed: int, m: int, n: int, p: float,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean ``(m, n)``: True where dropout with probability ``p`` keeps the element."""
    return random_bits(seed, m, n, device) >= dropout_threshold(p)
