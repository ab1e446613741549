"""Triton softmax kernels (forward and backward) and their launch wrappers.

Bytes moved (the floor): forward reads x once and writes y once (2·M·N·elt); backward reads y
and dy once and writes dx once (3·M·N·elt). Three kernel variants per direction:

* single-block: a program owns ``ROWS`` whole rows padded to ``BLOCK_N`` (a power of two up to
  the kind's cap), keeps them in registers, reduces once, writes once; one program per row tile.
  Rows that do not start 16-byte aligned are read as an aligned body plus edges (_common.py).
* split-row (longer rows, CUDA): equal pieces of a row in cooperating programs that publish
  partial statistics, wait for their row's other pieces and write: one read, one write.
* looped (longer rows elsewhere: the interpreter, a refused cooperative launch): one program
  per row streams it in ``CHUNK``-sized pieces; forward keeps a per-lane online (max, sum) so
  it reads x twice (stats pass + write pass), backward reads y and dy twice. The backward's
  reload variant (``WHOLE``, chosen 16-bit row lengths in ``RELOAD_BWD``) reads the row whole
  for the dot product and again from L2 for dx; the forward's reload kernel (``RELOAD_FWD``)
  reads the row whole for its max and sum and again from L2 to write y. The forward's unrolled
  kernel (``UNROLLED_FWD``: aligned rows a multiple of a rule's chunk, N compile-time) streams
  the row for per-lane maxima, then re-reads it from L2 for the sum and again to write y;
  ``_softmax_fwd_unrolled_vec`` (``UNROLLED_VEC_FWD``) does the same for unaligned rows (N not a
  multiple of the vector width, e.g. 2^k + 1) on each row's aligned body, the few elements
  before and after it in an edge tile. The backward's unrolled kernel (``UNROLLED_BWD``,
  ``UNROLLED_VEC_BWD``: long 16-bit rows, aligned or not) streams y and dy for per-lane partial
  dot products, then re-reads both from L2 to write dx.

All math is float32; row offsets are 64-bit so tensors beyond 2^31 elements are fine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedops import _replay
from fusedops.backends.triton.configs.common import (
    DEFAULT_SINGLE_BLOCK_LIMIT,
    body_len,
    grid_size,
    num_row_tiles,
    single_block_limit,
    unaligned_config,
    unaligned_vec,
    unrolled_config,
)
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
from fusedops.backends.triton.runtime.device import next_pow2, rows_and_output
from fusedops.backends.triton.runtime.launcher import Launcher, current_stream, hooks_registered
from fusedops.backends.triton.runtime.plans import PlanCache
from fusedops.backends.triton.runtime.split import SplitLauncher, split_pieces, split_rows_enabled

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _softmax_fwd_single(
    x_ptr, y_ptr, M, N, stride_x, stride_y, num_tiles, num_progs,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, VEC: tl.constexpr,
):
    # VEC > 0: unaligned rows as an aligned body plus edges (see row_body in _common.py); the
    # launcher then guarantees stride_x == stride_y, so one split serves x and y.
    pid = tl.program_id(0)
    for tile in range(pid, num_tiles, num_progs):
        rows, head = tile_rows(tile, stride_x, ROWS, VEC)
        offs, mask = row_body(rows, head, M, N, stride_x, BLOCK_N, VEC)
        offs_y, _ = row_body(rows, head, M, N, stride_y, BLOCK_N, VEC)
        x = tl.load(x_ptr + offs, mask=mask, other=-float("inf")).to(tl.float32)
        if VEC > 0:  # issued before any reduction, so both loads are in flight together
            e_offs, e_mask, _ = row_edges(rows, head, M, N, stride_x, VEC)
            xe = tl.load(x_ptr + e_offs, mask=e_mask, other=-float("inf")).to(tl.float32)
        row_max = tl.max(x, axis=1)
        if VEC > 0:
            row_max = tl.maximum(row_max, tl.max(xe, axis=1))
        e = tl.exp2((x - row_max[:, None]) * LOG2E)
        denom = tl.sum(e, axis=1)
        if VEC > 0:
            ee = tl.exp2((xe - row_max[:, None]) * LOG2E)
            denom += tl.sum(ee, axis=1)
        inv = (1.0 / denom)[:, None]
        tl.store(y_ptr + offs_y, (e * inv).to(y_ptr.dtype.element_ty), mask=mask)
        if VEC > 0:
            tl.store(y_ptr + e_offs, (ee * inv).to(y_ptr.dtype.element_ty), mask=e_mask)


@triton.jit
def _softmax_fwd_looped(x_ptr, y_ptr, N, stride_x, stride_y, CHUNK: tl.constexpr):
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
        scale = tl.where(m_new == -float("inf"), 0.0, tl.exp2((m - m_new) * LOG2E))
        s = s * scale + tl.where(m_new == -float("inf"), 0.0, tl.exp2((x - m_new) * LOG2E))
        m = m_new
    row_max = tl.max(m, axis=0)
    lane_scale = tl.where(m == -float("inf"), 0.0, tl.exp2((m - row_max) * LOG2E))
    denom = tl.sum(s * lane_scale, axis=0)
    inv = 1.0 / denom
    for start in range(0, N, CHUNK):
        cols = start + lanes
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=-float("inf"),
                    eviction_policy="evict_first").to(tl.float32)
        y = tl.exp2((x - row_max) * LOG2E) * inv
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_single(
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
def _softmax_fwd_reload(
    x_ptr, y_ptr, N, stride_x, stride_y, WHOLE: tl.constexpr, CHUNK: tl.constexpr,
    EVEN: tl.constexpr,
):
    # One row per program, read twice: whole, in one load (all its bytes in flight at once),
    # for the max and the sum; then again from L2 in CHUNK pieces to write y, the exponentials
    # computed again. Nothing is held across the passes, unlike the single-block kernel, which
    # keeps the row and its exponentials until it writes (one program per SM at 16-bit 32K).
    # EVEN > 0: N == EVEN (a power of two): no masks. Same arithmetic as _softmax_fwd_single.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    x = _piece(x_row, tl.arange(0, WHOLE), N, EVEN, "evict_last", -float("inf"))
    row_max = tl.max(x, axis=0).to(tl.float32)
    inv = 1.0 / tl.sum(tl.exp2((x.to(tl.float32) - row_max) * LOG2E), axis=0)
    lanes = tl.arange(0, CHUNK)
    for start in tl.static_range(0, WHOLE, CHUNK):
        cols = start + lanes
        xc = _piece(x_row, cols, N, EVEN, "evict_first", -float("inf")).to(tl.float32)
        y = (tl.exp2((xc - row_max) * LOG2E) * inv).to(y_ptr.dtype.element_ty)
        if EVEN > 0:
            tl.store(y_row + cols, y)
        else:
            tl.store(y_row + cols, y, mask=cols < N)


@triton.jit
def _softmax_fwd_unrolled(
    x_ptr, y_ptr, M, stride_x, stride_y, N: tl.constexpr, CHUNK: tl.constexpr,
):
    # Three unrolled passes over a row whose length is a compile-time multiple of CHUNK (M is
    # unused: it leads the scalars so launch plans replay this kernel like the single-block
    # one). Pass 1 keeps only per-lane maxima, so every chunk's loads are in flight at once;
    # passes 2 (the sum of exponentials) and 3 (y) re-read the row from L2. Two exponentials per
    # element, as in the reload kernel, but nothing of the row is held across a reduction, so
    # programs stay small (the reload kernel runs one 32-warp program per SM at 16-bit 32K).
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
        acc += tl.exp2((xc - row_max) * LOG2E)
    inv = 1.0 / tl.sum(acc, axis=0)
    for start in tl.static_range(0, N, CHUNK):
        cols = start + lanes
        xc = tl.load(x_row + cols, eviction_policy="evict_first").to(tl.float32)
        tl.store(y_row + cols, (tl.exp2((xc - row_max) * LOG2E) * inv).to(y_ptr.dtype.element_ty))


@triton.jit
def _softmax_fwd_unrolled_vec(
    x_ptr, y_ptr, M, stride, N: tl.constexpr, BODY: tl.constexpr, CHUNK: tl.constexpr,
    VEC: tl.constexpr,
):
    # _softmax_fwd_unrolled for rows that start unaligned (N not a multiple of VEC, e.g.
    # 2^k + 1; x and y share the row stride; M unused). Each row's first BODY = (N // VEC - 1)·
    # VEC elements from its first 16-byte boundary go through the three unrolled passes as
    # vectors (the same count for every misalignment, so only a last partial chunk is
    # masked); the head before the boundary (< VEC) and the tail after the body (< 2·VEC) are
    # one 4·VEC-lane edge tile, loaded once and kept.
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
        acc += tl.exp2((v.to(tl.float32) - row_max) * LOG2E)
    ee = tl.exp2((xe - row_max) * LOG2E)
    inv = 1.0 / (tl.sum(acc, axis=0) + tl.sum(tl.where(emask, ee, 0.0), axis=0))
    tl.store(y_ptr + start + ecol, (ee * inv).to(y_ptr.dtype.element_ty), mask=emask)
    for c0 in tl.static_range(0, BODY, CHUNK):
        c = c0 + lanes
        if c0 + CHUNK <= BODY:
            v = tl.load(x_body + c, eviction_policy="evict_first").to(tl.float32)
            tl.store(y_body + c, (tl.exp2((v - row_max) * LOG2E) * inv).to(
                y_ptr.dtype.element_ty))
        else:
            v = tl.load(x_body + c, mask=c < BODY, other=float("-inf"),
                        eviction_policy="evict_first").to(tl.float32)
            tl.store(y_body + c, (tl.exp2((v - row_max) * LOG2E) * inv).to(
                y_ptr.dtype.element_ty), mask=c < BODY)


@triton.jit
def _softmax_bwd_looped(
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
def _softmax_bwd_unrolled(
    y_ptr, dy_ptr, dx_ptr, M, stride_dy, N: tl.constexpr, BODY: tl.constexpr,
    CHUNK: tl.constexpr, VEC: tl.constexpr,
):
    # Two unrolled passes over a row (y and dx contiguous, row stride N; M unused): the dot
    # product keeps only per-lane partial sums, so every chunk's loads can be in flight at
    # once, then dx re-reads y and dy from L2. VEC = 0: aligned rows, BODY = N. VEC > 0: rows
    # that start unaligned (dy shares the stride N): each row's first BODY = (N // VEC - 1)·VEC
    # elements from its first 16-byte boundary as vectors (the same count for every
    # misalignment), the head (< VEC) and tail (< 2·VEC) in one 4·VEC-lane edge tile, loaded
    # once and kept (the layout of _softmax_fwd_unrolled_vec).
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
def _softmax_fwd_split(
    x_ptr, y_ptr, stats_ptr, count_ptr, N, L, stride, stride_y, num_items, num_progs,
    BLOCK: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, PREFETCH: tl.constexpr,
    VEC: tl.constexpr, FULL: tl.constexpr,
):
    # Work item = (row, piece), row-major; see fusedops/backends/triton/_common.py "split rows".
    # The grid
    # is a multiple of C, so a program always has the same piece of rows num_progs // C apart.
    # Pieces: split_piece (L elements of the row, or of its aligned body when VEC > 0; piece 0
    # then also has the edges; x and y then share the row stride). PREFETCH: see _common.py.
    # FULL: pieces fill their BLOCK lanes (L == BLOCK), which saves the per-lane piece mask
    # (bf16 at 8192 x 8: 64 registers instead of 79).
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
        e = tl.exp2((x - m_safe) * LOG2E)
        s = tl.sum(e, axis=0)
        if VEC > 0:
            ee = tl.exp2((xe - m_safe) * LOG2E)
            s += tl.sum(ee, axis=0)
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
        denom = tl.sum(tl.where(ms == -float("inf"), 0.0, ss * tl.exp2((ms - row_max) * LOG2E)),
                       axis=0)
        scale = tl.exp2((m - row_max) * LOG2E) / denom  # m <= row max: no overflow
        offs_y, mask_y, pos_y = split_piece(row, chunk, L, N, stride_y, BLOCK, VEC, FULL)
        tl.store(y_ptr + offs_y, (e * scale).to(y_ptr.dtype.element_ty), mask=mask)
        if VEC > 0:
            tl.store(y_ptr + e_offs, (ee * scale).to(y_ptr.dtype.element_ty), mask=e_mask)


@triton.jit
def _softmax_bwd_split(
    y_ptr, dy_ptr, dx_ptr, stats_ptr, count_ptr, N, L, stride, stride_dy, num_items, num_progs,
    BLOCK: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, PREFETCH: tl.constexpr,
    VEC: tl.constexpr, FULL: tl.constexpr,
):
    # See _softmax_fwd_split. y and dx have row stride ``stride``; with VEC > 0 dy has too.
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


_launch_fwd_single = Launcher(_softmax_fwd_single)
_launch_fwd_looped = Launcher(_softmax_fwd_looped)
_launch_fwd_reload = Launcher(_softmax_fwd_reload)
_launch_fwd_unrolled = Launcher(_softmax_fwd_unrolled)
_launch_fwd_unrolled_vec = Launcher(_softmax_fwd_unrolled_vec)
_launch_bwd_single = Launcher(_softmax_bwd_single)
_launch_bwd_looped = Launcher(_softmax_bwd_looped)
_launch_bwd_unrolled = Launcher(_softmax_bwd_unrolled)
_launch_fwd_split = SplitLauncher(_softmax_fwd_split)
_launch_bwd_split = SplitLauncher(_softmax_bwd_split)


def _replay_runner(key: tuple, plan: tuple):
    """The ``fusedops._replay.SOFTMAX`` entry for a new forward plan (out dtype = x's dtype)."""
    shape, dtype, out_dtype, device = key
    if out_dtype is not dtype:
        return None
    (launch, function, coop, pdl, metadata), (g,), tail = plan[0].c_entry, plan[1], plan[3]

    def run(x: torch.Tensor) -> torch.Tensor | None:
        p = x.data_ptr()
        if p & 15 or not x.is_contiguous() or not x.is_cuda or hooks_registered():
            return None
        y = torch.empty_like(x)
        launch(g, 1, 1, current_stream(device), function, coop, pdl, None, None, metadata, None,
               None, None, p, y.data_ptr(), *tail)
        return y
    return (shape, dtype, device), run


# Single-block forward launches, per (shape, dtype, out dtype, device); those with out dtype =
# dtype are also replayed from the ops layer (fusedops._replay).
_fwd_plans = PlanCache(_replay.SOFTMAX, _replay_runner)


# Split-row kernels: (piece elements, warps, PREFETCH) by direction, element size and whether
# rows are unaligned (VEC > 0: aligned-body pieces plus edges); a row of N is cut into equal
# pieces of at most that many elements (_common.split_pieces). Measured, TB/s, against the
# first split kernel (16384-element pieces on 16 warps, no prefetch) on H200 and H100:
# * forward: 16-bit aligned rows prefetching between publishing and waiting (PREFETCH 3; H100
#   bf16 128K / 256K: 2.47 / 2.38 vs 2.20 / 2.01 without prefetch), on 4096 x 4 up to 64K
#   (2.51 vs 2.42 at 8192 x 8); float32 aligned 8192 x 8 prefetching before publishing (H200
#   64K / 128K / 256K: 3.29 / 3.27 / 3.03 vs 2.91 (one program per row) / 3.31 / 3.25; H100
#   64K-256K level with PREFETCH 3); unaligned rows PREFETCH 3 (H100 float32 65537: 2.39 vs
#   1.69 prefetching before publishing, with one exponential per element; 16-bit on 4096 x 4:
#   bf16 1.95 vs 1.66 at 8192 x 8 and 1.75 in one program);
# * backward, 8192 x 8: 16-bit aligned prefetching (bf16 64K / 128K / 256K: 3.52 / 3.43 / 3.30
#   vs 2.96 / 2.86 / 2.78 old), unaligned 16-bit prefetching after the wait (65537: 2.48 vs
#   1.80 before it, 2.28 looped), float32 without prefetch (64K / 128K: 3.83 / 3.76 vs 3.67 /
#   3.65 old; 65537: 3.55 vs 2.39).
# None = these rules; a tuple overrides them (experiments).
SPLIT_CONFIG: dict[str, tuple[int, int, int] | None] = {"fwd": None, "bwd": None}


def split_config(kind: str, elt_size: int, vec: int = 0, n: int = 0) -> tuple[int, int, int]:
    forced = SPLIT_CONFIG[kind]
    if forced is not None:
        return forced
    if kind == "fwd":
        if vec:
            return (4096, 4, 3) if elt_size == 2 else (8192, 8, 3)
        if elt_size == 4:
            return 8192, 8, 1
        return (4096, 4, 3) if n <= 65536 else (8192, 8, 3)
    if elt_size == 4:
        return 8192, 8, 0
    return (8192, 8, 2) if vec else (8192, 8, 1)


def _launch_split(launcher, M: int, N: int, tensors: tuple, strides: tuple, per_piece: int,
                  elt_size: int, kind: str, vec: int, device: torch.device) -> bool:
    """Run the split-row kernel ``launcher`` over (M, N) rows if it applies; False otherwise
    (the caller then runs the looped kernel)."""
    chunk, warps, prefetch = split_config(kind, elt_size, vec, N)
    if not split_rows_enabled(device, N, chunk):
        return False
    C, L = split_pieces(N, chunk, vec)
    stats = torch.empty((M * C * per_piece,), dtype=torch.float32, device=device)
    count = torch.zeros((M,), dtype=torch.int32, device=device)
    block = next_pow2(L)
    return bool(launcher(
        M * C, C, (*tensors, stats, count, N, L, *strides, M * C),
        (block, C, next_pow2(C), prefetch, vec, L == block), warps, device, vec=vec))


# Aligned rows read whole for the dot product, then again from L2 for dx (the looped kernel
# with WHOLE = the padded row): (element size, padded row) -> (second-pass chunk, warps).
# H200, TB/s vs the single-block kernel: 16-bit 16K 4.29-4.30 vs 4.03-4.05,
# 4K 4.31 vs 4.26, 2K 4.33 vs 4.25; 8K level (4.27 vs 4.25); float32 16K slower (4.14 vs 4.31:
# the whole row is twice the registers). A third value is the first pass's piece (WHOLE = 0).
# 32K, every dtype (H200, with power-of-two rows unrolled, UNROLL_RELOAD_BWD): the whole row,
# second pass in one 32K piece, as Inductor does for this shape (ptxas sm_90: 52 registers
# float32, 38 16-bit, no spill): float32 4.21 vs 3.98-4.05 (two 16K halves then 8K chunks)
# and torch.compile 4.20; bf16 /
# fp16 4.09-4.13 / 4.14-4.15 vs 4.04-4.08 / 4.07-4.09 (8K chunks), compile 4.12 / 4.17.
RELOAD_BWD: dict[tuple[int, ...], tuple[int, ...]] = {
    (2, 2048): (2048, 8), (2, 4096): (4096, 16), (2, 16384): (4096, 32), (2, 32768): (32768, 32),
    (4, 32768): (32768, 32),
}
# Power-of-two rows on the reload kernel without masks, loops unrolled (EVEN): H200, TB/s vs
# masked loops: 32K 4.04-4.07 vs 4.00-4.05 (16-bit), 4.00 vs 3.95 (float32);
# 2K-16K level or +0.5%; the 32K first pass in 16K pieces 4.07-4.11 vs 3.26-3.34 masked.
UNROLL_RELOAD_BWD = True
RELOAD_BWD_ABOVE = 1024  # shorter rows skip the lookup (no rule below 2K; saves host time)
# The forward's reload kernel (_softmax_fwd_reload), aligned rows: (element size, padded row)
# -> (second-pass chunk, warps); power-of-two rows always unrolled without masks. H200, TB/s:
# 16-bit 64K 3.19 vs 3.02-3.06 on split rows (4096 x 4,
# PREFETCH 3; ptxas sm_90: 64 registers, 48 bytes spilled), float32 32K 4.19 vs 4.06 on the
# single-block kernel (48 registers). Slower elsewhere: it computes the exponentials twice and
# runs one 32-warp program per SM, so 16-bit 16K (3.71-3.90 vs 3.95-3.98) and 32K (2.90-3.16
# vs 3.22-3.24) stay single-block, float32 64K on split rows (3.07 vs 3.42).
RELOAD_FWD: dict[tuple[int, int], tuple[int, int]] = {
    (2, 65536): (16384, 32), (4, 32768): (8192, 32),
}
RELOAD_FWD_ABOVE = 16384  # shorter rows skip the lookup (no rule below 32K; saves host time)
# Aligned rows on _softmax_fwd_unrolled (N compile-time): (element size, padded row) ->
# (chunk, warps) configs, the first whose chunk divides N taken (warps 0: the other kernels).
# Checked before RELOAD_FWD. H200, TB/s bf16 / fp16 against
# the kernels these rows ran before: 4K 4.18 / 4.16 vs 4.00 / 4.00, 8K 4.14 / 4.16 vs 4.01 /
# 3.99, 16K 4.14 / 4.12 vs 3.88 / 3.91 (single-block), 64K on 8K x 16 3.45 / 3.45 vs 3.19 /
# 3.19 (reload); float32 16K 4.22 vs 4.07. Level or slower: 16-bit 32K (2.81-3.19 vs 3.20-3.24
# single-block), float32 32K (3.60-4.16 vs 4.17 reload) and 64K (2.92-3.09 vs 3.35 split rows).
UNROLLED_FWD: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {
    (2, 4096): ((2048, 8),), (2, 8192): ((2048, 8),), (2, 16384): ((2048, 8),),
    (2, 65536): ((8192, 16),), (4, 16384): ((4096, 16),),
}
UNROLLED_FWD_ABOVE = 1024  # shorter rows skip the lookup
# Unaligned rows (VEC > 0) on _softmax_fwd_unrolled_vec: (element size, padded body) ->
# (chunk, warps), rows longer than RELOAD_FWD_ABOVE whose body holds a chunk. H200, TB/s
# against the split-row kernel on aligned-body pieces: bf16 / fp16 65537 2.79 / 3.01
# vs 2.21 / 2.21 (16384 x 16: 2.90 / 2.95, 8192 x 32: 2.72 / 3.17). Slower: float32 65537
# (2.53-2.73 vs 2.90), and 128K+ rows (16-bit 131073 / 262145 0.58-1.00 vs 2.07 / 2.04; the
# aligned kernel alike at 128K / 256K: 0.42-1.10 vs 2.78-3.33).
UNROLLED_VEC_FWD: dict[tuple[int, int], tuple[int, int]] = {(2, 65536): (8192, 16)}


# The backward on _softmax_bwd_unrolled: aligned rows (element size, padded row) -> (chunk,
# warps) configs, the first whose chunk divides N; unaligned rows (VEC > 0) by (element size,
# padded body) -> (chunk, warps), rows longer than UNROLLED_BWD_ABOVE whose body holds a chunk.
# H200, TB/s against split rows: bf16 / fp16 65537
# 3.60 / 3.64 on 8192 x 32 vs 2.48 / 2.51 (16384 x 32: 3.43 / 3.56); bf16 131073 2.77 on
# 16384 x 32 vs 1.86; 262145 2.16 on 8192 x 16 vs 1.76; aligned bf16 64K 3.76 on 16384 x 32 vs
# 3.52. Slower: float32 (65536 / 65537 2.78-3.08 vs 3.84 / 3.58) and aligned 16-bit 128K / 256K
# (2.29-2.90 vs 3.42 / 3.30), which stay on split rows.
UNROLLED_BWD: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {(2, 65536): ((16384, 32),)}
UNROLLED_BWD_ABOVE = 32768  # shorter rows skip the lookup (no rule below 64K; saves host time)
UNROLLED_VEC_BWD: dict[tuple[int, int], tuple[int, int]] = {
    (2, 65536): (8192, 32), (2, 131072): (16384, 32), (2, 262144): (8192, 16),
}


def softmax_forward(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Row softmax. x: (M, N) float32/float16/bfloat16, unit column stride, any row stride, or a
    contiguous tensor of any rank >= 1 (rows along the last dim).

    Returns a contiguous tensor of ``x``'s shape and ``out_dtype``.
    """
    # Contiguous inputs at 16-byte aligned addresses: the launch is fixed by shape, dtypes and
    # device, so a call seen before replays its plan (see PlanCache).
    key = ((x.shape, x.dtype, out_dtype, x.get_device())
           if x.is_contiguous() and not x.data_ptr() & 15 else None)
    plan = _fwd_plans.get(key)
    if plan is not None and not hooks_registered():
        y = torch.empty_like(x, dtype=out_dtype)
        go, grid, device, tail = plan
        go(grid, current_stream(device), (x.data_ptr(), y.data_ptr(), *tail))
        return y
    M, N, stride, y = rows_and_output(x, out_dtype)
    if M == 0 or N == 0:
        return y
    vec = unaligned_vec(N, (stride, N), x.element_size(), (x, y))
    unrolled = unrolled_config(UNROLLED_FWD, x.element_size(), N, UNROLLED_FWD_ABOVE, vec)
    if unrolled:
        chunk, warps = unrolled
        args = (x, y, M, stride, N, N, chunk)
        _launch_fwd_unrolled((M,), args, warps)
        if key is not None:
            _fwd_plans.add(key, _launch_fwd_unrolled, (M,), args, warps, 2)
        return y
    unrolled = (UNROLLED_VEC_FWD.get((x.element_size(), next_pow2(body_len(N, vec))))
                if vec and N > RELOAD_FWD_ABOVE
                and single_block_limit() == DEFAULT_SINGLE_BLOCK_LIMIT else None)
    if unrolled and (N // vec - 1) * vec >= unrolled[0]:
        chunk, warps = unrolled
        _launch_fwd_unrolled_vec((M,), (x, y, M, N, N, (N // vec - 1) * vec, chunk, vec), warps)
        return y
    if N > RELOAD_FWD_ABOVE and not vec and single_block_limit() == DEFAULT_SINGLE_BLOCK_LIMIT:
        whole = next_pow2(N)
        reload = RELOAD_FWD.get((x.element_size(), whole))
        if reload:
            chunk, warps = reload
            _launch_fwd_reload((M,), (x, y, N, stride, N, whole, chunk, N if N == whole else 0),
                               warps)
            return y
    single, block, rows, warps, vec = unaligned_config(N, "softmax_fwd", x.element_size(), vec)
    if single:
        tiles = num_row_tiles(M, rows, vec)
        progs = grid_size(tiles, warps, "softmax_fwd", x.device)
        args = (x, y, M, N, stride, N, tiles, progs, block, rows, vec)
        _launch_fwd_single((progs,), args, warps)
        if key is not None and not vec:
            _fwd_plans.add(key, _launch_fwd_single, (progs,), args, warps, 2)
    else:
        if _launch_split(_launch_fwd_split, M, N, (x, y), (stride, N), 2, x.element_size(),
                         "fwd", vec, x.device):
            return y
        _launch_fwd_looped((M,), (x, y, N, stride, N, block), warps)
    return y


def _unrolled_bwd_config(N: int, vec: int, elt_size: int) -> tuple[int, int] | None:
    """(chunk, warps) of UNROLLED_BWD / UNROLLED_VEC_BWD for rows of N, or None."""
    if not vec:
        return unrolled_config(UNROLLED_BWD, elt_size, N, UNROLLED_BWD_ABOVE, 0)
    cfg = (UNROLLED_VEC_BWD.get((elt_size, next_pow2(body_len(N, vec))))
           if single_block_limit() == DEFAULT_SINGLE_BLOCK_LIMIT else None)
    return cfg if cfg and (N // vec - 1) * vec >= cfg[0] else None


def softmax_backward(y: torch.Tensor, dy: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """dx = y * (dy - sum(dy * y)) per row. y: (M, N) contiguous; dy: (M, N) unit column
    stride, any row stride (0 for expanded gradients). Returns contiguous (M, N) of ``out_dtype``.
    """
    M, N = y.shape
    dx = torch.empty((M, N), dtype=out_dtype, device=y.device)
    if M == 0 or N == 0:
        return dx
    vec = unaligned_vec(N, (N, dy.stride(0)), y.element_size(), (y, dy, dx))
    if N > UNROLLED_BWD_ABOVE:
        unrolled = _unrolled_bwd_config(N, vec, y.element_size())
        if unrolled:
            chunk, warps = unrolled
            body = (N // vec - 1) * vec if vec else N
            _launch_bwd_unrolled((M,), (y, dy, dx, M, dy.stride(0), N, body, chunk, vec),
                                 warps)
            return dx
    reload = (RELOAD_BWD.get((y.element_size(), next_pow2(N)))
              if N > RELOAD_BWD_ABOVE and not vec
              and single_block_limit() == DEFAULT_SINGLE_BLOCK_LIMIT else None)
    if reload:
        chunk, warps, *first = reload  # (chunk, warps[, first-pass piece]): see RELOAD_BWD
        even = N if N == next_pow2(N) and UNROLL_RELOAD_BWD else 0
        _launch_bwd_looped((M,), (
            y, dy, dx, N, N, dy.stride(0), N, chunk, 0 if first else next_pow2(N),
            first[0] if first else chunk, even), warps)
        return dx
    single, block, rows, warps, vec = unaligned_config(N, "softmax_bwd", y.element_size(), vec)
    if single:
        tiles = num_row_tiles(M, rows, vec)
        progs = grid_size(tiles, warps, "softmax_bwd", y.device)
        _launch_bwd_single(
            (progs,), (y, dy, dx, M, N, dy.stride(0), tiles, progs, block, rows, vec), warps
        )
    else:
        if _launch_split(_launch_bwd_split, M, N, (y, dy, dx), (N, dy.stride(0)), 1,
                         y.element_size(), "bwd", vec, y.device):
            return dx
        _launch_bwd_looped(
            (M,), (y, dy, dx, N, y.stride(0), dy.stride(0), dx.stride(0), block, 0, block, 0),
            warps
        )
    return dx
