"""Softmax kernels (``@triton.jit`` only). The variants and when each runs: ``triton/softmax.py``
(module docstring); the rules that pick them: ``configs/softmax.py``."""

from __future__ import annotations

import triton
import triton.language as tl

from fusedops.backends.triton.kernels.clusters import cluster_peer_sums, cluster_publish
from fusedops.backends.triton.kernels.common import (
    await_row,
    publish_row,
    row_body,
    row_edges,
    split_edges,
    split_piece,
    tile_rows,
    unrolled_edges,
)
from fusedops.backends.triton.kernels.staging import (
    pack_word,
    stage_read,
    stage_row_piece,
    store_words,
    word_hi,
    word_lo,
)

LOG2E = tl.constexpr(1.4426950408889634)

# EXACT (a constexpr of the helpers below; float32 outputs of aligned rows): compensated row
# sums, and y = e / sum rounded as a division would (a correctly rounded reciprocal and one
# Newton step), where a plain tree sum and an approximate reciprocal put long rows dominated by
# a few elements at up to 4.8x torch's error. H200, one run (h200/softmax-float32.json against
# softmax-float32-before.json): 72 of 72 cases within twice torch's error plus half an ulp, not
# 69; forwards 0-4% slower. Unaligned rows keep the cheap arithmetic: their kernels run one
# program per SM and lost up to 43% with it (65537, h200/softmax-float32-variants.json); a
# single row is never unaligned (triton/softmax.py). 16-bit outputs round far coarser.
# softmax_fwd_single takes it only for rows of EXACT_MIN_N+ (its EXACT_ROWS; configs/softmax.py).


@triton.jit
def _exp(t):
    # exp(t) as 2^(t·log2 e): exp2 of a rounded product, off by about |t|·2^-24 relative, which
    # is far below an ulp of the largest outputs (those with t near 0).
    return tl.exp2(t * LOG2E)


@triton.jit
def _two_sum(a, ca, b, cb):
    # (a + b, the rounding error of that add plus both carried errors): Knuth's TwoSum.
    s = a + b
    bp = s - a
    return s, ca + cb + ((a - (s - bp)) + (b - bp))


@triton.jit
def _sum(v, axis: tl.constexpr, EXACT: tl.constexpr):
    # tl.sum(v, axis). EXACT: a compensated tree sum, each add's rounding error carried along.
    if EXACT:
        s, c = tl.reduce((v, tl.zeros_like(v)), axis, _two_sum)
        out = s + c
    else:
        out = tl.sum(v, axis=axis)
    return out


@triton.jit
def _inverse(s, EXACT: tl.constexpr):
    # 1 / s for a positive float32 row sum ``s``; EXACT: correctly rounded (once per row; the
    # GPU's plain float32 reciprocal is approximate).
    if EXACT:
        inv = tl.math.div_rn(tl.zeros_like(s) + 1.0, s)
    else:
        inv = 1.0 / s
    return inv


@triton.jit
def _times(e, inv, s, EXACT: tl.constexpr):
    # e / s given inv = _inverse(s): a multiply; EXACT, refined by one Newton step on the
    # residual e - y·s (two FMAs), as good as a correctly rounded division but for rare ties.
    y = e * inv
    if EXACT:
        y = tl.fma(tl.fma(-y, s, e), inv, y)
    return y


@triton.jit
def softmax_fwd_single(
    x_ptr, y_ptr, M, N, stride_x, stride_y, num_tiles, num_progs,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, VEC: tl.constexpr, EXACT_ROWS: tl.constexpr,
    NEXT: tl.constexpr = 0,
):
    # VEC > 0: unaligned rows as an aligned body plus edges (see row_body in kernels/common.py); the
    # launcher then guarantees stride_x == stride_y, so one split serves x and y.
    # NEXT (aligned rows, a persistent grid): the program's next tile is loaded, in x's dtype,
    # before this tile's reductions, so its loads are in flight while this tile computes.
    # EXACT_ROWS: rows long enough for the exact arithmetic (shorter ones keep the cheap one).
    EXACT: tl.constexpr = (y_ptr.dtype.element_ty == tl.float32) and VEC == 0 and EXACT_ROWS
    pid = tl.program_id(0)
    if NEXT:
        rows, head = tile_rows(pid, stride_x, ROWS, VEC)
        offs, mask = row_body(rows, head, M, N, stride_x, BLOCK_N, VEC)
        x_next = tl.load(x_ptr + offs, mask=mask, other=-float("inf"))
    for tile in range(pid, num_tiles, num_progs):
        rows, head = tile_rows(tile, stride_x, ROWS, VEC)
        offs, mask = row_body(rows, head, M, N, stride_x, BLOCK_N, VEC)
        offs_y, _ = row_body(rows, head, M, N, stride_y, BLOCK_N, VEC)
        if NEXT:
            x = x_next.to(tl.float32)
            rows_n, head_n = tile_rows(tile + num_progs, stride_x, ROWS, VEC)
            offs_n, mask_n = row_body(rows_n, head_n, M, N, stride_x, BLOCK_N, VEC)
            x_next = tl.load(x_ptr + offs_n, mask=mask_n, other=-float("inf"))
        else:
            x = tl.load(x_ptr + offs, mask=mask, other=-float("inf")).to(tl.float32)
        if VEC > 0:  # issued before any reduction, so both loads are in flight together
            e_offs, e_mask, _ = row_edges(rows, head, M, N, stride_x, VEC)
            xe = tl.load(x_ptr + e_offs, mask=e_mask, other=-float("inf")).to(tl.float32)
        row_max = tl.max(x, axis=1)
        if VEC > 0:
            row_max = tl.maximum(row_max, tl.max(xe, axis=1))
        e = _exp(x - row_max[:, None])
        denom = _sum(e, 1, EXACT)
        if VEC > 0:
            ee = _exp(xe - row_max[:, None])
            denom += _sum(ee, 1, EXACT)
        inv = _inverse(denom, EXACT)[:, None]
        denom = denom[:, None]
        tl.store(y_ptr + offs_y, _times(e, inv, denom, EXACT).to(y_ptr.dtype.element_ty),
                 mask=mask)
        if VEC > 0:
            tl.store(y_ptr + e_offs, _times(ee, inv, denom, EXACT).to(y_ptr.dtype.element_ty),
                     mask=e_mask)


@triton.jit
def softmax_fwd_looped(x_ptr, y_ptr, N, stride_x, stride_y, CHUNK: tl.constexpr):
    EXACT: tl.constexpr = y_ptr.dtype.element_ty == tl.float32
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    lanes = tl.arange(0, CHUNK)
    # Per-lane online softmax statistics: running max and sum of exp relative to it.
    m = tl.full([CHUNK], -float("inf"), tl.float32)
    s = tl.zeros([CHUNK], tl.float32)
    for start in range(0, N, CHUNK):
        cols = start + lanes
        # evict_last keeps the row in L2 for the second pass; evict_first lets it go after it.
        x = tl.load(x_row + cols, mask=cols < N, other=-float("inf"),
                    eviction_policy="evict_last").to(tl.float32)
        # tl.maximum drops NaN; keep a lane's NaN sticky so the row comes out NaN, as in torch.
        m_new = tl.where((x != x) | (m != m), float("nan"), tl.maximum(m, x))
        # A lane that has only seen -inf keeps s = 0 (avoids -inf - -inf = NaN).
        scale = tl.where(m_new == -float("inf"), 0.0, _exp(m - m_new))
        e = tl.where(m_new == -float("inf"), 0.0, _exp(x - m_new))
        s = s * scale + e
        m = m_new
    row_max = tl.max(m, axis=0)
    lane_scale = tl.where(m == -float("inf"), 0.0, _exp(m - row_max))
    denom = _sum(s * lane_scale, 0, EXACT)
    inv = _inverse(denom, EXACT)
    for start in range(0, N, CHUNK):
        cols = start + lanes
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=-float("inf"),
                    eviction_policy="evict_first").to(tl.float32)
        y = _times(_exp(x - row_max), inv, denom, EXACT)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_bwd_single(
    y_ptr, dy_ptr, dx_ptr, M, N, stride_dy, num_tiles, num_progs,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, VEC: tl.constexpr,
):
    # y and dx are contiguous (row stride N); with VEC > 0 the launcher guarantees dy is too.
    pid = tl.program_id(0)
    for tile in range(pid, num_tiles, num_progs):
        rows, head = tile_rows(tile, N, ROWS, VEC)
        offs, mask = row_body(rows, head, M, N, N, BLOCK_N, VEC)
        offs_dy, _ = row_body(rows, head, M, N, stride_dy, BLOCK_N, VEC)
        y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs_dy, mask=mask, other=0.0).to(tl.float32)
        if VEC > 0:  # issued before any reduction, so all loads are in flight together
            e_offs, e_mask, _ = row_edges(rows, head, M, N, N, VEC)
            ye = tl.load(y_ptr + e_offs, mask=e_mask, other=0.0).to(tl.float32)
            dye = tl.load(dy_ptr + e_offs, mask=e_mask, other=0.0).to(tl.float32)
        dot = tl.sum(y * dy, axis=1)
        if VEC > 0:
            dot += tl.sum(ye * dye, axis=1)
        dx = y * (dy - dot[:, None])
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if VEC > 0:
            dxe = ye * (dye - dot[:, None])
            tl.store(dx_ptr + e_offs, dxe.to(dx_ptr.dtype.element_ty), mask=e_mask)


@triton.jit
def _piece(ptr, cols, N, EVEN: tl.constexpr, POLICY: tl.constexpr, OTHER: tl.constexpr = 0.0):
    if EVEN > 0:
        v = tl.load(ptr + cols, eviction_policy=POLICY)
    else:
        v = tl.load(ptr + cols, mask=cols < N, other=OTHER, eviction_policy=POLICY)
    return v


@triton.jit
def softmax_fwd_reload(
    x_ptr, y_ptr, N, stride_x, stride_y, WHOLE: tl.constexpr, CHUNK: tl.constexpr,
    EVEN: tl.constexpr,
):
    # One row per program, read twice: whole, in one load (all its bytes in flight at once),
    # for the max and the sum; then again from L2 in CHUNK pieces to write y, the exponentials
    # computed again. Nothing is held across the passes, unlike the single-block kernel, which
    # keeps the row and its exponentials until it writes (one program per SM at 16-bit 32K).
    # EVEN > 0: N == EVEN (a power of two): no masks. Same arithmetic as softmax_fwd_single.
    EXACT: tl.constexpr = y_ptr.dtype.element_ty == tl.float32
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    x = _piece(x_row, tl.arange(0, WHOLE), N, EVEN, "evict_last", -float("inf"))
    row_max = tl.max(x, axis=0).to(tl.float32)
    denom = _sum(_exp(x.to(tl.float32) - row_max), 0, EXACT)
    inv = _inverse(denom, EXACT)
    lanes = tl.arange(0, CHUNK)
    for start in tl.static_range(0, WHOLE, CHUNK):
        cols = start + lanes
        xc = _piece(x_row, cols, N, EVEN, "evict_first", -float("inf")).to(tl.float32)
        y = _times(_exp(xc - row_max), inv, denom, EXACT).to(y_ptr.dtype.element_ty)
        if EVEN > 0:
            tl.store(y_row + cols, y)
        else:
            tl.store(y_row + cols, y, mask=cols < N)


@triton.jit
def softmax_fwd_unrolled(
    x_ptr, y_ptr, M, stride_x, stride_y, N: tl.constexpr, CHUNK: tl.constexpr,
):
    # Three unrolled passes over a row whose length is a compile-time multiple of CHUNK (M is
    # unused: it leads the scalars so launch plans replay this kernel like the single-block
    # one). Pass 1 keeps only per-lane maxima, so every chunk's loads are in flight at once;
    # passes 2 (the sum of exponentials) and 3 (y) re-read the row from L2. Two exponentials per
    # element, as in the reload kernel, but nothing of the row is held across a reduction, so
    # programs stay small (the reload kernel runs one 32-warp program per SM at 16-bit 32K).
    EXACT: tl.constexpr = y_ptr.dtype.element_ty == tl.float32
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    lanes = tl.arange(0, CHUNK)
    m = tl.load(x_row + lanes, eviction_policy="evict_last").to(tl.float32)
    for start in tl.static_range(CHUNK, N, CHUNK):
        m = tl.maximum(m, tl.load(x_row + start + lanes,
                                  eviction_policy="evict_last").to(tl.float32))
    row_max = tl.max(m, axis=0)
    acc = tl.zeros([CHUNK], tl.float32)
    for start in tl.static_range(0, N, CHUNK):
        xc = tl.load(x_row + start + lanes, eviction_policy="evict_last").to(tl.float32)
        acc += _exp(xc - row_max)
    denom = _sum(acc, 0, EXACT)
    inv = _inverse(denom, EXACT)
    for start in tl.static_range(0, N, CHUNK):
        cols = start + lanes
        xc = tl.load(x_row + cols, eviction_policy="evict_first").to(tl.float32)
        y = _times(_exp(xc - row_max), inv, denom, EXACT)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty))


@triton.jit
def softmax_fwd_unrolled_vec(
    x_ptr, y_ptr, M, stride, N: tl.constexpr, BODY: tl.constexpr, CHUNK: tl.constexpr,
    VEC: tl.constexpr,
):
    # softmax_fwd_unrolled for rows that start unaligned (N not a multiple of VEC, e.g.
    # 2^k + 1; x and y share the row stride; M unused). Each row's first BODY = (N // VEC - 1)·
    # VEC elements from its first 16-byte boundary go through the three unrolled passes as
    # vectors (the same count for every misalignment, so only a last partial chunk is
    # masked); the head before the boundary (< VEC) and the tail after the body (< 2·VEC) are
    # one 4·VEC-lane edge tile, loaded once and kept.
    EXACT: tl.constexpr = False  # unaligned rows (see EXACT above)
    row = tl.program_id(0)
    start = row.to(tl.int64) * stride
    first, head, ecol, emask = unrolled_edges(start, N, BODY, VEC)
    x_body = x_ptr + first
    y_body = y_ptr + first
    xe = tl.load(x_ptr + start + ecol, mask=emask, other=float("-inf")).to(tl.float32)
    lanes = tl.arange(0, CHUNK)
    m = tl.load(x_body + lanes, eviction_policy="evict_last").to(tl.float32)
    for c0 in tl.static_range(CHUNK, BODY, CHUNK):
        c = c0 + lanes
        if c0 + CHUNK <= BODY:
            v = tl.load(x_body + c, eviction_policy="evict_last")
        else:
            v = tl.load(x_body + c, mask=c < BODY, other=float("-inf"),
                        eviction_policy="evict_last")
        m = tl.maximum(m, v.to(tl.float32))
    row_max = tl.maximum(tl.max(m, axis=0), tl.max(xe, axis=0))
    acc = tl.zeros([CHUNK], tl.float32)
    for c0 in tl.static_range(0, BODY, CHUNK):
        c = c0 + lanes
        if c0 + CHUNK <= BODY:
            v = tl.load(x_body + c, eviction_policy="evict_last")
        else:
            v = tl.load(x_body + c, mask=c < BODY, other=float("-inf"),
                        eviction_policy="evict_last")
        acc += _exp(v.to(tl.float32) - row_max)
    ee = _exp(xe - row_max)
    denom = _sum(acc, 0, EXACT) + _sum(tl.where(emask, ee, 0.0), 0, EXACT)
    inv = _inverse(denom, EXACT)
    tl.store(y_ptr + start + ecol, _times(ee, inv, denom, EXACT).to(y_ptr.dtype.element_ty),
             mask=emask)
    for c0 in tl.static_range(0, BODY, CHUNK):
        c = c0 + lanes
        if c0 + CHUNK <= BODY:
            v = tl.load(x_body + c, eviction_policy="evict_first").to(tl.float32)
            tl.store(y_body + c, _times(_exp(v - row_max), inv, denom, EXACT).to(
                y_ptr.dtype.element_ty))
        else:
            v = tl.load(x_body + c, mask=c < BODY, other=float("-inf"),
                        eviction_policy="evict_first").to(tl.float32)
            tl.store(y_body + c, _times(_exp(v - row_max), inv, denom, EXACT).to(
                y_ptr.dtype.element_ty), mask=c < BODY)


@triton.jit
def softmax_bwd_looped(
    y_ptr, dy_ptr, dx_ptr, N, stride_y, stride_dy, stride_dx, CHUNK: tl.constexpr,
    WHOLE: tl.constexpr, FIRST: tl.constexpr, EVEN: tl.constexpr,
):
    # WHOLE > 0 (the padded row): the first pass (the dot product) reads the row in one load,
    # all of it in flight at once, and holds nothing across the passes (fewer registers than the
    # single-block kernel, so more programs per SM); the second pass reads it again from L2.
    # WHOLE = 0: both passes stream pieces, of FIRST elements in the first pass and CHUNK in
    # the second (FIRST > CHUNK: a row too big to load whole without spilling, in halves).
    # EVEN > 0: N == EVEN (a power of two): no masks, and both passes unrolled (constant trip
    # counts), so the next piece's loads are issued before the current one is used.
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * stride_y
    dy_row = dy_ptr + row * stride_dy
    dx_row = dx_ptr + row * stride_dx
    lanes = tl.arange(0, CHUNK)
    if WHOLE > 0:
        whole = tl.arange(0, WHOLE)
        y1 = _piece(y_row, whole, N, EVEN, "evict_last")
        dy1 = _piece(dy_row, whole, N, EVEN, "evict_last")
        dot = tl.sum(y1.to(tl.float32) * dy1.to(tl.float32), axis=0)
    else:
        acc = tl.zeros([FIRST], tl.float32)
        if EVEN > 0:
            for start in tl.static_range(0, EVEN, FIRST):
                cols = start + tl.arange(0, FIRST)
                y = _piece(y_row, cols, N, EVEN, "evict_last")
                dy = _piece(dy_row, cols, N, EVEN, "evict_last")
                acc += y.to(tl.float32) * dy.to(tl.float32)
        else:
            for start in range(0, N, FIRST):
                cols = start + tl.arange(0, FIRST)
                y = _piece(y_row, cols, N, EVEN, "evict_last")
                dy = _piece(dy_row, cols, N, EVEN, "evict_last")
                acc += y.to(tl.float32) * dy.to(tl.float32)
        dot = tl.sum(acc, axis=0)
    if EVEN > 0:
        for start in tl.static_range(0, EVEN, CHUNK):
            cols = start + lanes
            y = _piece(y_row, cols, N, EVEN, "evict_first").to(tl.float32)
            dy = _piece(dy_row, cols, N, EVEN, "evict_first").to(tl.float32)
            tl.store(dx_row + cols, (y * (dy - dot)).to(dx_ptr.dtype.element_ty))
    else:
        for start in range(0, N, CHUNK):
            cols = start + lanes
            mask = cols < N
            y = _piece(y_row, cols, N, EVEN, "evict_first").to(tl.float32)
            dy = _piece(dy_row, cols, N, EVEN, "evict_first").to(tl.float32)
            tl.store(dx_row + cols, (y * (dy - dot)).to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_bwd_unrolled(
    y_ptr, dy_ptr, dx_ptr, M, stride_dy, N: tl.constexpr, BODY: tl.constexpr,
    CHUNK: tl.constexpr, VEC: tl.constexpr,
):
    # Two unrolled passes over a row (y and dx contiguous, row stride N; M unused): the dot
    # product keeps only per-lane partial sums, so every chunk's loads can be in flight at
    # once, then dx re-reads y and dy from L2. VEC = 0: aligned rows, BODY = N. VEC > 0: rows
    # that start unaligned (dy shares the stride N): each row's first BODY = (N // VEC - 1)·VEC
    # elements from its first 16-byte boundary as vectors (the same count for every
    # misalignment), the head (< VEC) and tail (< 2·VEC) in one 4·VEC-lane edge tile, loaded
    # once and kept (the layout of softmax_fwd_unrolled_vec).
    row = tl.program_id(0).to(tl.int64)
    start = row * N
    if VEC > 0:
        first, head, ecol, emask = unrolled_edges(start, N, BODY, VEC)
        ye = tl.load(y_ptr + start + ecol, mask=emask, other=0.0).to(tl.float32)
        dye = tl.load(dy_ptr + start + ecol, mask=emask, other=0.0).to(tl.float32)
        y_body = y_ptr + first
        dy_body = dy_ptr + first
        dx_body = dx_ptr + first
    else:
        y_body = y_ptr + start
        dy_body = dy_ptr + row * stride_dy
        dx_body = dx_ptr + start
    lanes = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], tl.float32)
    for c0 in tl.static_range(0, BODY, CHUNK):
        c = c0 + lanes
        if c0 + CHUNK <= BODY:
            y = tl.load(y_body + c, eviction_policy="evict_last")
            dy = tl.load(dy_body + c, eviction_policy="evict_last")
        else:
            y = tl.load(y_body + c, mask=c < BODY, other=0.0, eviction_policy="evict_last")
            dy = tl.load(dy_body + c, mask=c < BODY, other=0.0, eviction_policy="evict_last")
        acc += y.to(tl.float32) * dy.to(tl.float32)
    dot = tl.sum(acc, axis=0)
    if VEC > 0:
        dot += tl.sum(ye * dye, axis=0)
        tl.store(dx_ptr + start + ecol, (ye * (dye - dot)).to(dx_ptr.dtype.element_ty),
                 mask=emask)
    for c0 in tl.static_range(0, BODY, CHUNK):
        c = c0 + lanes
        if c0 + CHUNK <= BODY:
            y = tl.load(y_body + c, eviction_policy="evict_first").to(tl.float32)
            dy = tl.load(dy_body + c, eviction_policy="evict_first").to(tl.float32)
            tl.store(dx_body + c, (y * (dy - dot)).to(dx_ptr.dtype.element_ty))
        else:
            y = tl.load(y_body + c, mask=c < BODY, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            dy = tl.load(dy_body + c, mask=c < BODY, other=0.0,
                         eviction_policy="evict_first").to(tl.float32)
            tl.store(dx_body + c, (y * (dy - dot)).to(dx_ptr.dtype.element_ty), mask=c < BODY)


@triton.jit
def softmax_fwd_split(
    x_ptr, y_ptr, stats_ptr, count_ptr, N, L, stride, stride_y, num_items, num_progs,
    BLOCK: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, PREFETCH: tl.constexpr,
    VEC: tl.constexpr, FULL: tl.constexpr,
):
    # Work item = (row, piece), row-major; see fusedops/backends/triton/runtime/split.py.
    # The grid
    # is a multiple of C, so a program always has the same piece of rows num_progs // C apart.
    # Pieces: split_piece (L elements of the row, or of its aligned body when VEC > 0; piece 0
    # then also has the edges; x and y then share the row stride). PREFETCH: see runtime/split.py.
    # FULL: pieces fill their BLOCK lanes (L == BLOCK), which saves the per-lane piece mask
    # (bf16 at 8192 x 8: 64 registers instead of 79).
    EXACT: tl.constexpr = (y_ptr.dtype.element_ty == tl.float32) and VEC == 0
    pid = tl.program_id(0)
    peers = tl.arange(0, C_P2)
    chunk = pid % C
    step = num_progs // C
    if PREFETCH > 0:
        offs, mask, pos = split_piece(pid // C, chunk, L, N, stride, BLOCK, VEC, FULL)
        x_next = tl.load(x_ptr + offs, mask=mask, other=-float("inf"))
    for item in range(pid, num_items, num_progs):
        row = item // C
        offs, mask, pos = split_piece(row, chunk, L, N, stride, BLOCK, VEC, FULL)
        if PREFETCH > 0:
            x = x_next.to(tl.float32)
            n_offs, n_mask, n_pos = split_piece(row + step, chunk, L, N, stride, BLOCK, VEC,
                                                FULL)
            n_mask = n_mask & (item + num_progs < num_items)
            if PREFETCH == 1:
                x_next = tl.load(x_ptr + n_offs, mask=n_mask, other=-float("inf"))
        else:
            x = tl.load(x_ptr + offs, mask=mask, other=-float("inf")).to(tl.float32)
        if VEC > 0:
            e_offs, e_mask, e_col = split_edges(row, chunk, N, stride, VEC)
            xe = tl.load(x_ptr + e_offs, mask=e_mask, other=-float("inf")).to(tl.float32)
            m = tl.maximum(tl.max(x, axis=0), tl.max(xe, axis=0))
            nan = tl.sum((x != x).to(tl.int32), axis=0) + tl.sum((xe != xe).to(tl.int32), axis=0)
        else:
            m = tl.max(x, axis=0)
            nan = tl.sum((x != x).to(tl.int32), axis=0)
        # tl.max drops NaN: a piece holding one publishes a NaN max, so the whole row is NaN.
        m = tl.where(nan > 0, float("nan"), m)
        # e = exp(x - m) once: y = e · exp(m - row max) / sum after the wait (one exponential per
        # element, not two). An all -inf piece takes its exponentials about 0 (-inf - -inf would
        # be NaN): e = 0, and its scale is exp(-inf) = 0 (NaN if the whole row is -inf, as torch).
        m_safe = tl.where(m == -float("inf"), 0.0, m)
        e = _exp(x - m_safe)
        s = _sum(e, 0, EXACT)
        if VEC > 0:
            ee = _exp(xe - m_safe)
            s += _sum(ee, 0, EXACT)
        tl.store(stats_ptr + item * 2, m)
        tl.store(stats_ptr + item * 2 + 1, s)
        publish_row(count_ptr, row)
        if PREFETCH == 3:
            x_next = tl.load(x_ptr + n_offs, mask=n_mask, other=-float("inf"))
        await_row(count_ptr, row, C)
        if PREFETCH == 2:
            x_next = tl.load(x_ptr + n_offs, mask=n_mask, other=-float("inf"))
        base = (row * C + peers) * 2
        ms = tl.load(stats_ptr + base, mask=peers < C, other=-float("inf"), cache_modifier=".cg")
        ss = tl.load(stats_ptr + base + 1, mask=peers < C, other=0.0, cache_modifier=".cg")
        row_max = tl.max(ms, axis=0)
        denom = _sum(tl.where(ms == -float("inf"), 0.0, ss * _exp(ms - row_max)), 0, EXACT)
        # m <= row max: no overflow (and 1 exactly in the piece that holds it).
        scale = _times(_exp(m - row_max), _inverse(denom, EXACT), denom, EXACT)
        offs_y, mask_y, pos_y = split_piece(row, chunk, L, N, stride_y, BLOCK, VEC, FULL)
        tl.store(y_ptr + offs_y, (e * scale).to(y_ptr.dtype.element_ty), mask=mask)
        if VEC > 0:
            tl.store(y_ptr + e_offs, (ee * scale).to(y_ptr.dtype.element_ty), mask=e_mask)


@triton.jit
def softmax_bwd_split(
    y_ptr, dy_ptr, dx_ptr, stats_ptr, count_ptr, N, L, stride, stride_dy, num_items, num_progs,
    BLOCK: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, PREFETCH: tl.constexpr,
    VEC: tl.constexpr, FULL: tl.constexpr,
):
    # See softmax_fwd_split. y and dx have row stride ``stride``; with VEC > 0 dy has too.
    pid = tl.program_id(0)
    peers = tl.arange(0, C_P2)
    chunk = pid % C
    step = num_progs // C
    if PREFETCH > 0:
        offs, mask, pos = split_piece(pid // C, chunk, L, N, stride, BLOCK, VEC, FULL)
        offs_dy, mask_dy, pos_dy = split_piece(pid // C, chunk, L, N, stride_dy, BLOCK, VEC, FULL)
        y_next = tl.load(y_ptr + offs, mask=mask, other=0.0)
        dy_next = tl.load(dy_ptr + offs_dy, mask=mask, other=0.0)
    for item in range(pid, num_items, num_progs):
        row = item // C
        offs, mask, pos = split_piece(row, chunk, L, N, stride, BLOCK, VEC, FULL)
        if PREFETCH > 0:
            y = y_next.to(tl.float32)
            dy = dy_next.to(tl.float32)
            n_offs, n_mask, n_pos = split_piece(row + step, chunk, L, N, stride, BLOCK, VEC,
                                                FULL)
            n_offs_dy, n_mask_dy, n_pos_dy = split_piece(row + step, chunk, L, N, stride_dy,
                                                         BLOCK, VEC, FULL)
            n_mask = n_mask & (item + num_progs < num_items)
            if PREFETCH == 1:
                y_next = tl.load(y_ptr + n_offs, mask=n_mask, other=0.0)
                dy_next = tl.load(dy_ptr + n_offs_dy, mask=n_mask, other=0.0)
        else:
            offs_dy, mask_dy, pos_dy = split_piece(row, chunk, L, N, stride_dy, BLOCK, VEC, FULL)
            y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offs_dy, mask=mask, other=0.0).to(tl.float32)
        part = tl.sum(y * dy, axis=0)
        if VEC > 0:
            e_offs, e_mask, e_col = split_edges(row, chunk, N, stride, VEC)
            ye = tl.load(y_ptr + e_offs, mask=e_mask, other=0.0).to(tl.float32)
            dye = tl.load(dy_ptr + e_offs, mask=e_mask, other=0.0).to(tl.float32)
            part += tl.sum(ye * dye, axis=0)
        tl.store(stats_ptr + item, part)
        publish_row(count_ptr, row)
        if PREFETCH == 3:
            y_next = tl.load(y_ptr + n_offs, mask=n_mask, other=0.0)
            dy_next = tl.load(dy_ptr + n_offs_dy, mask=n_mask, other=0.0)
        await_row(count_ptr, row, C)
        if PREFETCH == 2:
            y_next = tl.load(y_ptr + n_offs, mask=n_mask, other=0.0)
            dy_next = tl.load(dy_ptr + n_offs_dy, mask=n_mask, other=0.0)
        dot = tl.sum(tl.load(stats_ptr + row * C + peers, mask=peers < C, other=0.0,
                             cache_modifier=".cg"), axis=0)
        tl.store(dx_ptr + offs, (y * (dy - dot)).to(dx_ptr.dtype.element_ty), mask=mask)
        if VEC > 0:
            tl.store(dx_ptr + e_offs, (ye * (dye - dot)).to(dx_ptr.dtype.element_ty),
                     mask=e_mask)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _word_max(m, w, KIND: tl.constexpr):
    m = _max_nan(m, word_lo(w, KIND))
    if KIND != 2:
        m = _max_nan(m, word_hi(w, KIND))
    return m


@triton.jit
def _word_sum(s, c, w, m, KIND: tl.constexpr, EXACT: tl.constexpr):
    # (s, c) plus exp(element - m) of each element of w; EXACT: c carries the rounding errors
    e = _exp(word_lo(w, KIND) - m)
    if EXACT:
        s, c = _two_sum(s, c, e, 0.0)
    else:
        s += e
    if KIND != 2:
        s += _exp(word_hi(w, KIND) - m)
    return s, c


@triton.jit
def _word_out(w, m, scale, KIND: tl.constexpr):
    lo = _exp(word_lo(w, KIND) - m) * scale
    hi = lo
    if KIND != 2:
        hi = _exp(word_hi(w, KIND) - m) * scale
    return pack_word(lo, hi, KIND)


@triton.jit
def softmax_fwd_staged(
    x_ptr, y_ptr, stride, stride_y, num_progs,
    L: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, VB: tl.constexpr,
):
    # One row per cluster of C CTAs (num_progs = rows x C; program pid is piece pid % C of row
    # pid // C): the piece's L elements land in shared memory, then three passes over it there
    # (maximum, sum of exponentials, y) around the cluster's exchange of (max, sum), so x is
    # read from memory once. The start barrier's arrive and wait bracket the copies, which
    # then overlap the wait for the cluster's other CTAs. Rows: 16-byte aligned, N = C x L;
    # y has x's dtype. VB: the CTA's threads (one 16-byte vector each per step).
    KIND: tl.constexpr = (0 if x_ptr.dtype.element_ty == tl.bfloat16
                          else 1 if x_ptr.dtype.element_ty == tl.float16 else 2)
    EXACT: tl.constexpr = KIND == 2  # see EXACT in kernels/softmax.py
    SB: tl.constexpr = L * (4 if KIND == 2 else 2)  # the piece's bytes
    NV: tl.constexpr = SB // 16
    pid = tl.program_id(0)
    rank = pid % C
    row = (pid // C).to(tl.int64)
    v, sb, parity = stage_row_piece(x_ptr + row * stride + rank * L, SB, C, VB)
    m_vec = tl.full((VB,), -float("inf"), tl.float32)
    for j in tl.static_range(NV // VB):
        w0, w1, w2, w3 = stage_read(sb + (j * VB + v) * 16)
        m_vec = _word_max(_word_max(_word_max(_word_max(m_vec, w0, KIND), w1, KIND), w2, KIND),
                          w3, KIND)
    # tl.max drops NaN: the piece's maximum is NaN if it holds one, and so is the whole row.
    m = tl.max(m_vec, axis=0)
    m = tl.where(tl.max((m_vec != m_vec).to(tl.int32), axis=0) > 0, float("nan"), m)
    m_safe = tl.where(m == -float("inf"), 0.0, m)  # an all -inf piece: e = 0 (see the split)
    s_vec = tl.zeros((VB,), tl.float32)
    c_vec = tl.zeros((VB,), tl.float32)
    for j in tl.static_range(NV // VB):
        w0, w1, w2, w3 = stage_read(sb + (j * VB + v) * 16)
        s_vec, c_vec = _word_sum(s_vec, c_vec, w0, m_safe, KIND, EXACT)
        s_vec, c_vec = _word_sum(s_vec, c_vec, w1, m_safe, KIND, EXACT)
        s_vec, c_vec = _word_sum(s_vec, c_vec, w2, m_safe, KIND, EXACT)
        s_vec, c_vec = _word_sum(s_vec, c_vec, w3, m_safe, KIND, EXACT)
    if EXACT:
        s, c = tl.reduce((s_vec, c_vec), 0, _two_sum)
        s = s + c
    else:
        s = tl.sum(s_vec, axis=0)
    row_max = m
    denom = s
    if C > 1:
        peers = tl.arange(0, C_P2)
        token = cluster_publish(m, s, rank, parity, C)
        ms, ss = cluster_peer_sums(peers, parity, token, C)
        ms = tl.where(peers < C, ms, -float("inf"))
        row_max = tl.max(ms, axis=0)
        denom = _sum(tl.where(ms == -float("inf"), 0.0, ss * _exp(ms - row_max)), 0, EXACT)
    # m <= row max: no overflow (and 1 exactly in the piece that holds it).
    scale = _times(_exp(m - row_max), _inverse(denom, EXACT), denom, EXACT)
    out = y_ptr + row * stride_y + rank * L
    for j in tl.static_range(NV // VB):
        w0, w1, w2, w3 = stage_read(sb + (j * VB + v) * 16)
        store_words(out, j * VB + v, _word_out(w0, m_safe, scale, KIND),
                    _word_out(w1, m_safe, scale, KIND), _word_out(w2, m_safe, scale, KIND),
                    _word_out(w3, m_safe, scale, KIND))
