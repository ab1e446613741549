"""Kernels of the softmax of attention (``@triton.jit`` only); variants: the module docstring
of ``triton/softmax_masked.py``; rules: ``configs/softmax_masked.py``."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _scores(x_row, m_row, cols, q, row_ok, N, sn, scale, VEC: tl.constexpr,
            MASK_KIND: tl.constexpr, MASK_COLS: tl.constexpr, CAUSAL: tl.constexpr,
            POLICY: tl.constexpr):
    """The scores z of columns ``cols``: x · scale (``scale`` holds log2(e)) without a mask or
    with a bool one, x · scale + mask with a float mask (natural units, see _exp); -inf where
    dropped (bool mask False, causal, past N). ``x_row`` / ``m_row`` point at the rows' first
    elements, ``q`` is their query index, ``row_ok`` whether they exist (nothing is loaded
    otherwise); shapes broadcast (a [ROWS, BLOCK] tile or one row's [CHUNK] piece). The mask's
    column stride ``sn``: MASK_COLS 1 a unit stride, 2 any other (64-bit column offsets)."""
    if CAUSAL:
        # Loads stop at the diagonal rounded up to a multiple of VEC (a bound whose divisibility
        # the compiler sees, so the masked loads stay 16-byte vectors); one compare per element
        # then drops everything past the diagonal and past N.
        ld = row_ok & (cols < N) & (cols < (q // VEC + 1) * VEC)
        keep = cols < tl.minimum(q + 1, N)
    else:
        ld = row_ok & (cols < N)
        keep = cols < N
    x = tl.load(x_row + cols, mask=ld, other=0.0, eviction_policy=POLICY).to(tl.float32)
    z = x * scale
    # The mask without an eviction hint: a broadcast one is re-read by many rows, a full one
    # streams like x (POLICY is the looped kernel's hint for x: kept for, then dropped after,
    # its second pass).
    if MASK_COLS == 1:
        m_ptrs = m_row + cols
    else:
        m_ptrs = m_row + cols.to(tl.int64) * sn
    if MASK_KIND == 1:
        mv = tl.load(m_ptrs, mask=ld, other=0)
        keep = keep & (mv != 0)
    elif MASK_KIND == 2:
        mv = tl.load(m_ptrs, mask=ld, other=0.0)
        z = z + mv.to(tl.float32)  # natural units (see _exp)
    return tl.where(keep, z, -float("inf"))


@triton.jit
def _exp(d, MASK_KIND: tl.constexpr):
    """exp of score differences ``d`` (<= 0) as _scores makes them: in log2 units (log2(e)
    folded into the scale) without a float mask; in natural units with one, converted after the
    subtraction. A float mask can hold finfo.min (Hugging Face's "drop"): times log2(e) it
    would overflow to -inf and turn a row of finite scores into an empty one, where torch gives
    the uniform distribution."""
    if MASK_KIND == 2:
        return tl.exp2(d * LOG2E)
    return tl.exp2(d)


@triton.jit
def _mask_row_offset(rows, Q, H, sb, sh, sq):
    """Offset (int64) of the mask row of flattened rows ``rows`` (row r: q = r % Q,
    h = (r // Q) % H, b = r // (Q·H))."""
    q = rows % Q
    t = rows // Q
    return (t // H).to(tl.int64) * sb + (t % H).to(tl.int64) * sh + q.to(tl.int64) * sq


@triton.jit
def smm_fwd_single(
    x_ptr, m_ptr, y_ptr, M, N, Q, H, sb, sh, sq, sn, scale, num_tiles, num_progs,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, VEC: tl.constexpr, MASK_KIND: tl.constexpr,
    MASK_COLS: tl.constexpr, CAUSAL: tl.constexpr,
):
    # x and y contiguous: row stride N.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    for tile in range(pid, num_tiles, num_progs):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_ok = (rows < M)[:, None]
        start = rows.to(tl.int64)[:, None] * N
        q = (rows % Q)[:, None]
        if MASK_KIND > 0:
            m_row = m_ptr + _mask_row_offset(rows, Q, H, sb, sh, sq)[:, None]
        else:
            m_row = m_ptr
        z = _scores(x_ptr + start, m_row, cols, q, row_ok, N, sn, scale, VEC, MASK_KIND,
                    MASK_COLS, CAUSAL, "")
        row_max = tl.max(z, axis=1)
        # A row with nothing kept (max -inf): e = exp2(-inf - 0) = 0 everywhere, then y = 0.
        row_max = tl.where(row_max == -float("inf"), 0.0, row_max)
        e = _exp(z - row_max[:, None], MASK_KIND)
        denom = tl.sum(e, axis=1)
        # (denominator 0: nothing kept, e == 0, so any finite inverse gives the zeros)
        inv = 1.0 / tl.where(denom == 0.0, 1.0, denom)
        tl.store(y_ptr + start + cols, (e * inv[:, None]).to(y_ptr.dtype.element_ty),
                 mask=row_ok & (cols < N))


@triton.jit
def smm_fwd_looped(
    x_ptr, m_ptr, y_ptr, N, Q, H, sb, sh, sq, sn, scale,
    CHUNK: tl.constexpr, VEC: tl.constexpr, MASK_KIND: tl.constexpr, MASK_COLS: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    row = tl.program_id(0)
    start = row.to(tl.int64) * N
    x_row = x_ptr + start
    y_row = y_ptr + start
    q = row % Q
    if MASK_KIND > 0:
        m_row = m_ptr + _mask_row_offset(row, Q, H, sb, sh, sq)
    else:
        m_row = m_ptr
    if CAUSAL:
        end = tl.minimum(N, q + 1)  # nothing past the diagonal enters the statistics
    else:
        end = N
    lanes = tl.arange(0, CHUNK)
    # Per-lane online softmax statistics: running max and sum of exp relative to it.
    m = tl.full([CHUNK], -float("inf"), tl.float32)
    s = tl.zeros([CHUNK], tl.float32)
    for c0 in range(0, end, CHUNK):
        cols = c0 + lanes
        # evict_last keeps the row in L2 for the second pass; evict_first lets it go after it.
        z = _scores(x_row, m_row, cols, q, True, N, sn, scale, VEC, MASK_KIND, MASK_COLS,
                    CAUSAL, "evict_last")
        # A lane that has only seen -inf keeps s = 0 (exp2(-inf - 0)). NaN needs no special
        # case: tl.maximum may drop it, but exp(NaN - m) makes the lane's s NaN for good.
        m_new = tl.maximum(m, z)
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * _exp(m - m_safe, MASK_KIND) + _exp(z - m_safe, MASK_KIND)
        m = m_new
    row_max = tl.max(m, axis=0)
    row_max = tl.where(row_max == -float("inf"), 0.0, row_max)
    denom = tl.sum(s * _exp(m - row_max, MASK_KIND), axis=0)
    inv = 1.0 / tl.where(denom == 0.0, 1.0, denom)  # nothing kept: z == -inf, y == 0
    for c0 in range(0, N, CHUNK):
        cols = c0 + lanes
        z = _scores(x_row, m_row, cols, q, True, N, sn, scale, VEC, MASK_KIND, MASK_COLS,
                    CAUSAL, "evict_first")
        y = _exp(z - row_max, MASK_KIND) * inv
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def smm_bwd_single(
    y_ptr, dy_ptr, dx_ptr, M, N, stride_dy, scale, num_tiles, num_progs,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):
    # y and dx contiguous (row stride N); dy any row stride.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    for tile in range(pid, num_tiles, num_progs):
        rows = tile * ROWS + tl.arange(0, ROWS)
        mask = (rows < M)[:, None] & (cols < N)
        rows64 = rows.to(tl.int64)[:, None]
        offs = rows64 * N + cols
        y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        dot = tl.sum(y * dy, axis=1)
        dx = (y * scale) * (dy - dot[:, None])
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def smm_bwd_looped(
    y_ptr, dy_ptr, dx_ptr, N, stride_dy, scale, CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * N
    dy_row = dy_ptr + row * stride_dy
    dx_row = dx_ptr + row * N
    lanes = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], tl.float32)
    for c0 in range(0, N, CHUNK):
        cols = c0 + lanes
        mask = cols < N
        y = tl.load(y_row + cols, mask=mask, other=0.0, eviction_policy="evict_last")
        dy = tl.load(dy_row + cols, mask=mask, other=0.0, eviction_policy="evict_last")
        acc += y.to(tl.float32) * dy.to(tl.float32)
    dot = tl.sum(acc, axis=0)
    for c0 in range(0, N, CHUNK):
        cols = c0 + lanes
        mask = cols < N
        y = tl.load(y_row + cols, mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        dy = tl.load(dy_row + cols, mask=mask, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        tl.store(dx_row + cols, ((y * scale) * (dy - dot)).to(dx_ptr.dtype.element_ty),
                 mask=mask)
