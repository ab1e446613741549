"""Philox4x32-10 in Triton (``@triton.jit`` only); see ``runtime/philox.py`` for the layout."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def philox4x32(c0, c1, c2, c3, k0, k1):
    """Philox4x32 with 10 rounds (Random123 constants) on uint32 tensors of broadcastable shapes
    (counter ``c0..c3``, key ``k0, k1``); returns the four uint32 output words."""
    for r in tl.static_range(10):
        if r > 0:
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        # The low halves as 64-bit products truncated: the compiler fuses each with its umulhi
        # into one 32x32->64 multiply (mul.wide.u32), and the interpreter skips its per-element
        # overflow check (made for integers narrower than 64 bits).
        hi0 = tl.umulhi(c0, 0xD2511F53)
        lo0 = (c0.to(tl.uint64) * 0xD2511F53).to(tl.uint32)
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo1 = (c2.to(tl.uint64) * 0xCD9E8D57).to(tl.uint32)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


@triton.jit
def uint32_key(k):
    """A 32-bit key word passed as a Python int (its int32 bit pattern, or its value in
    [0, 2^32) as an i64 or a specialised constant) as a uint32 scalar."""
    return (k + tl.zeros([], tl.int64)).to(tl.uint32)


@triton.jit
def element_bits(rows, g, q, i, key0, key1, Q: tl.constexpr):
    """The 32-bit random number of every element of a ``[Q, R, G, NI]`` tile: ``rows`` (any int
    type) broadcastable to ``[1, R, 1, 1]``, ``g`` to ``[1, 1, G, 1]``, ``i`` to ``[1, 1, 1, NI]``
    (the column's 1024-group and position in its 256-slice) and ``q`` to ``[Q, 1, 1, 1]`` (the
    slice, 0..Q-1, Q a power of two up to 4). One Philox call per (row, g, i)."""
    r64 = rows.to(tl.int64)
    c0 = (g * 256 + i).to(tl.uint32)
    c1 = r64.to(tl.uint32)
    c2 = (r64 >> 32).to(tl.uint32)
    w0, w1, w2, w3 = philox4x32(c0, c1, c2, tl.zeros_like(c1), key0, key1)
    if Q == 1:
        return w0 + tl.zeros_like(q).to(tl.uint32)
    elif Q == 2:
        return tl.where(q == 0, w0, w1)
    else:
        return tl.where(q < 2, tl.where(q == 0, w0, w1), tl.where(q == 2, w2, w3))


@triton.jit
def element_keep(rows, g, q, i, key0, key1, thr, Q: tl.constexpr):
    """The dropout keep mask of a ``[Q, R, G, NI]`` tile (arguments as :func:`element_bits`):
    True where the element's random number is >= ``thr`` (uint32). Each call's four keep bits
    are packed into one byte per counter before they are spread over the slices: where the
    compiler holds a counter's four slices in different threads (fewer than four 16-byte vectors
    per thread), it moves that byte between them rather than repeating the call."""
    r64 = rows.to(tl.int64)
    c0 = (g * 256 + i).to(tl.uint32)
    c1 = r64.to(tl.uint32)
    c2 = (r64 >> 32).to(tl.uint32)
    w0, w1, w2, w3 = philox4x32(c0, c1, c2, tl.zeros_like(c1), key0, key1)
    bits = (w0 >= thr).to(tl.int8)
    if Q > 1:
        bits = bits | ((w1 >= thr).to(tl.int8) << 1)
    if Q > 2:
        bits = bits | ((w2 >= thr).to(tl.int8) << 2) | ((w3 >= thr).to(tl.int8) << 3)
    return ((bits >> q.to(tl.int8)) & 1) != 0


@triton.jit
def random_bits_kernel(out_ptr, M, N, k0, k1, R: tl.constexpr, G: tl.constexpr,
                        Q: tl.constexpr, NI: tl.constexpr):
    # out: (M, N) int64, each element's random number; program (row tile, column block).
    q = tl.arange(0, Q)[:, None, None, None]
    g = tl.program_id(1) * G + tl.arange(0, G)[None, None, :, None]
    i = tl.arange(0, NI)[None, None, None, :]
    rows = tl.program_id(0) * R + tl.arange(0, R)[None, :, None, None]
    cols = g * 1024 + q * 256 + i
    bits = element_bits(rows, g, q, i, uint32_key(k0), uint32_key(k1), Q)
    tl.store(out_ptr + rows.to(tl.int64) * N + cols, bits.to(tl.int64),
             mask=(rows < M) & (cols < N))
