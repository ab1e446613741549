"""``@triton.jit`` helpers shared by the op kernels: split-row exchange and unaligned rows.

Unaligned rows: in a contiguous tensor whose rows are not a multiple of 16 bytes (N = 2^k + 1,
say), row r starts at r·N elements: Triton cannot prove any alignment and falls back to 2-byte
scalar accesses, which halve the bandwidth (0.44-0.54 of copy at N = 8193). The single-block
kernels instead split each row into its *body*, from the first 16-byte boundary inside the row
to the last one, addressed from that aligned element with a mask whose bound is a multiple of
the vector width (so every access is a 16-byte vector), and its two *edges*, at most VEC - 1
elements on each side, read and written element by element in a small [ROWS, 2·VEC] tile. No
access leaves the row. (An earlier design read an aligned window of the whole row with
per-element masks; the second full-width edge store made it slower than scalar access.)
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def publish_row(count_ptr, row):
    """Publish this program's partials for ``row`` (its stores before this call)."""
    tl.debug_barrier()  # every thread's partial-statistics stores happen before the release
    tl.atomic_add(count_ptr + row, 1, sem="release")


@triton.jit
def await_row(count_ptr, row, C: tl.constexpr):
    """Wait until all C chunks of ``row`` have published."""
    seen = tl.atomic_add(count_ptr + row, 0, sem="acquire")
    while seen < C:
        seen = tl.atomic_add(count_ptr + row, 0, sem="acquire")


@triton.jit
def split_piece(row, chunk, L, N, stride, BLOCK: tl.constexpr, VEC: tl.constexpr,
                FULL: tl.constexpr = False):
    """``(offs, mask, pos)`` of piece ``chunk`` of row ``row`` in a split-row kernel: lanes
    ``[0, L)`` of BLOCK are positions ``chunk·L + lane`` of the row (VEC == 0) or of its
    aligned body (VEC > 0, row start unaligned: the body starts at the row's first 16-byte
    boundary, column ``head``, and has a multiple of VEC elements; :func:`split_edges` covers
    the rest). ``pos`` is the lane's position; its column is ``head + pos``. L is a multiple of
    16 with VEC > 0, so every access is a 16-byte vector."""
    lanes = tl.arange(0, BLOCK)
    start = row.to(tl.int64) * stride
    pos = chunk * L + lanes
    if FULL:  # L == BLOCK: a piece fills its lanes (fewer mask registers)
        pos = chunk * BLOCK + lanes
    if VEC > 0:
        first = ((start + (VEC - 1)) // VEC) * VEC
        head = (first - start).to(tl.int32)
        return first + pos, (lanes < L) & (pos < ((N - head) // VEC) * VEC), pos
    if FULL:
        return start + pos, pos < N, pos
    return start + pos, (lanes < L) & (pos < N), pos


@triton.jit
def split_head(row, N, stride, VEC: tl.constexpr):
    """``(head, body)`` of an unaligned row: its first aligned column and its body length."""
    start = row.to(tl.int64) * stride
    head = ((((start + (VEC - 1)) // VEC) * VEC) - start).to(tl.int32)
    return head, ((N - head) // VEC) * VEC


@triton.jit
def split_edges(row, chunk, N, stride, VEC: tl.constexpr):
    """``(offs, mask, col)`` of the columns of row ``row`` outside its aligned body (a
    ``2·VEC`` tile: lanes < VEC the head, the rest the tail); only piece 0 has them."""
    head, body = split_head(row, N, stride, VEC)
    j = tl.arange(0, 2 * VEC)
    col = tl.where(j < VEC, j, head + body + (j - VEC))
    mask = (chunk == 0) & tl.where(j < VEC, j < head, col < N)
    return row.to(tl.int64) * stride + col, mask, col


@triton.jit
def zero_i32(ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=offs < n)


@triton.jit
def tile_rows(tile, stride, ROWS: tl.constexpr, VEC: tl.constexpr):
    """``(rows, head)`` of row tile ``tile``.

    VEC == 0: ROWS consecutive rows, head 0. VEC > 0 (unaligned rows): ROWS rows VEC apart
    (the rows congruent to ``tile`` modulo VEC), which all start at the same misalignment;
    ``head`` (0 <= head < VEC) is the distance from their start to the first 16-byte boundary,
    so lane j of the aligned body is column ``head + j`` in every row of the tile and per-column
    data (LayerNorm's weight) is fetched once per tile. See :func:`num_row_tiles`.
    """
    if VEC > 0:
        r0 = (tile // VEC) * (ROWS * VEC) + tile % VEC
        rows = r0 + tl.arange(0, ROWS) * VEC
        s0 = r0.to(tl.int64) * stride
        head = (((s0 + (VEC - 1)) // VEC) * VEC - s0).to(tl.int32)
    else:
        rows = tile * ROWS + tl.arange(0, ROWS)
        head = 0
    return rows, head


@triton.jit
def row_body(rows, head, M, N, stride, BLOCK_N: tl.constexpr, VEC: tl.constexpr):
    """``(offs, mask)`` of a [ROWS, BLOCK_N] tile of the rows ``rows`` (from :func:`tile_rows`).

    VEC == 0 (rows start 16-byte aligned, which Triton's specialisation of ``stride`` proves):
    lane j is column j. VEC > 0: lane j is column ``head + j``; the mask covers the row's aligned
    body only (:func:`row_edges` covers the rest). Needs N >= 2·VEC and
    BLOCK_N >= (N // VEC) * VEC.
    """
    lanes = tl.arange(0, BLOCK_N)[None, :]
    start = rows.to(tl.int64) * stride
    row_ok = (rows < M)[:, None]
    if VEC > 0:
        # Written as a multiple of VEC so that Triton's alignment analysis sees it as one.
        first = ((start + (VEC - 1)) // VEC) * VEC
        offs = first[:, None] + lanes
        mask = row_ok & (lanes < ((N - head) // VEC) * VEC)
    else:
        offs = start[:, None] + lanes
        mask = row_ok & (lanes < N)
    return offs, mask


@triton.jit
def unrolled_edges(start, N, BODY: tl.constexpr, VEC: tl.constexpr):
    """``(first, head, ecol, emask)`` of an unaligned row read as a fixed-length body plus an
    edge tile (the unrolled kernels for rows that start unaligned). ``start``: the row's first
    element offset (int64); ``first``: its first 16-byte boundary, where BODY = (N // VEC - 1)
    ·VEC body elements start (a multiple of VEC, visibly to the compiler); ``head = first -
    start`` (< VEC). The 4·VEC-lane edge tile holds the rest: lanes < VEC the head before
    ``first``, the others the tail after the body (< 2·VEC elements); ``ecol`` are its columns
    relative to ``start``, ``emask`` which lanes hold one."""
    first = ((start + (VEC - 1)) // VEC) * VEC
    head = (first - start).to(tl.int32)
    j = tl.arange(0, 4 * VEC)
    ecol = tl.where(j < VEC, j, head + BODY + (j - VEC))
    emask = tl.where(j < VEC, j < head, ecol < N)
    return first, head, ecol, emask


@triton.jit
def unrolled_row(x_ptr, stride, N, BODY: tl.constexpr, VEC: tl.constexpr):
    """The unaligned row of this program (row stride ``stride``) for the unrolled kernels:
    ``(start, first, head, ecol, emask, xe)``, :func:`unrolled_edges`' values and ``xe`` the
    row's edge tile of x as float32 (0 off the edges)."""
    start = tl.program_id(0).to(tl.int64) * stride
    first, head, ecol, emask = unrolled_edges(start, N, BODY, VEC)
    xe = tl.load(x_ptr + start + ecol, mask=emask, other=0.0).to(tl.float32)
    return start, first, head, ecol, emask, xe


@triton.jit
def row_edges(rows, head, M, N, stride, VEC: tl.constexpr):
    """The elements of rows ``rows`` outside their aligned bodies (see :func:`row_body`):
    ``(offs, mask, col)``, offsets and mask of a [ROWS, 2·VEC] tile (lanes < VEC: the head,
    the rest: the tail) and the [1, 2·VEC] columns."""
    j = tl.arange(0, 2 * VEC)[None, :]
    tail = head + ((N - head) // VEC) * VEC  # first column after the body
    col = tl.where(j < VEC, j, tail + (j - VEC))
    mask = (rows < M)[:, None] & tl.where(j < VEC, j < head, col < N)
    offs = rows.to(tl.int64)[:, None] * stride + col
    return offs, mask, col
