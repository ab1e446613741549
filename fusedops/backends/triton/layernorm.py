"""Triton LayerNorm kernels (forward; backward dx + dweight/dbias) and their launch wrappers.

Bytes moved (the floor): forward reads x once, writes y once (2·M·N·elt) plus the weights and
8·M bytes of float32 mean/rstd; backward reads x and dy once and writes dx once (3·M·N·elt) plus
the weights, mean/rstd and the float32 dweight/dbias partials.

* Forward, single-block: ``ROWS`` whole rows per program in registers; mean about the row's
  first element, variance from registers.
* Forward, split-row (long rows, CUDA): equal pieces in cooperating programs publish (mean, M2),
  merged with Chan's formula; one read, one write.
* Forward, looped: pass 1 streams the row keeping per-lane shifted sums, merged across lanes
  with Chan's formula; pass 2 normalises and writes.
* Forward, unrolled (aligned rows a multiple of a rule's chunk, ``UNROLLED_FWD``): the row
  length compile-time, pass 1 streams it in unrolled chunks keeping per-lane shifted sums,
  pass 2 re-reads it from L2 and writes y; statistics as offsets from the row's first element.
* Forward, reload (chosen row lengths, ``RELOAD_FWD``): the row read whole in one load for the
  statistics, then again from L2 in chunks to write y; nothing held across the two.
* Forward, reload for unaligned 16-bit rows (N = 2^k + 1, ``RELOAD_VEC_FWD``, large calls): the
  same on the row's aligned body plus its edges; weight and bias from copies shifted per row
  misalignment (``_shift_weights``), so every per-column load is a 16-byte vector. Longer
  bodies (64K+, ``UNROLLED_VEC_FWD``): the unrolled kernel's structure on the aligned body
  (``_ln_fwd_unrolled_vec``), with the same shifted copies.
* Backward, fused (rows up to 8K, and unaligned rows with a 2K-8K body): persistent programs write
  dx and accumulate dweight/dbias for their rows in float32 registers, one partial row pair
  each; ``_sum_partials`` adds them in a fixed order (deterministic: no atomics). The two row
  sums in one paired reduction where it measured faster (``_paired_sums``).
* Backward, split-row (long rows, CUDA): like the forward split, and each program keeps its
  chunk's dweight/dbias partials in registers across rows; unaligned float32 rows with a body
  of 16K+ as aligned-body pieces plus edges (``VEC_SPLIT_BWD``).
* Backward, dx row kernel (single-block or looped) + column-blocked dweight/dbias kernel: on
  the interpreter and after a refused split launch.
* Backward, 16-bit rows not a multiple of 8 and too long for the fused kernel: the column
  kernel, then dx from ``_ln_bwd_dx_pieces`` on the rows' aligned bodies plus edges (one program
  per row, the row read twice; see ``DX_PIECES_BWD``); where the rows' starts rule out vector
  accesses, PyTorch's native kernel (``NATIVE_UNALIGNED_16BIT_BWD``).
* Backward, ``low_memory`` mode (the default, ``fusedops.set_layernorm_backward``): the same
  kernels with their scratch parked at the end of dx's storage (see ``_park``), the dx of those
  rows written by a second launch; the column path computes dweight/dbias before dx: no
  scratch at all. ``fast`` mode: separate scratch, one launch, the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedops import _replay
from fusedops._settings import get_layernorm_backward
from fusedops.backends.triton.configs.common import (
    DEFAULT_SINGLE_BLOCK_LIMIT,
    ROW_BODY,
    body_len,
    grid_size,
    num_row_tiles,
    row_config,
    single_block_limit,
    unaligned_config,
    unaligned_vec,
    unrolled_config,
)
from fusedops.backends.triton.kernels.clusters import (
    cluster_peer_sums,
    cluster_publish,
    cluster_start,
)
from fusedops.backends.triton.kernels.common import (
    await_row,
    publish_row,
    row_body,
    row_edges,
    split_edges,
    split_head,
    split_piece,
    tile_rows,
    unrolled_edges,
)
from fusedops.backends.triton.runtime.clusters import ClusterLauncher, clusters_enabled
from fusedops.backends.triton.runtime.device import (
    cdiv,
    device_name,
    interpreting,
    next_pow2,
    num_sms,
    rows_and_output,
)
from fusedops.backends.triton.runtime.launcher import Launcher, current_stream, hooks_registered
from fusedops.backends.triton.runtime.plans import (
    PlanCache,
    SequencePlans,
    run_steps,
    sequence_steps,
)
from fusedops.backends.triton.runtime.recording import mark_replayable, record_launches
from fusedops.backends.triton.runtime.split import (
    SplitLauncher,
    split_pieces,
    split_rows_enabled,
    zero_counters,
)


@triton.jit
def _ln_fwd_single(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, M, N, stride_x, stride_y, eps,
    num_tiles, num_progs,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    VEC: tl.constexpr, HOLD_W: tl.constexpr, STATS: tl.constexpr,
):
    # STATS: write mean/rstd (False for inference calls, which then allocate neither).
    # HOLD_W: load weight/bias once per program and keep them in registers across its row tiles
    # (short rows); long rows reload them per tile from L2 instead, which frees the registers
    # that would otherwise spill (a 32K-column row at 32 warps spills 240+ bytes per thread).
    # With VEC > 0 lane j is column head + j, the same in every row of a tile, and in every tile
    # of a program when num_progs is a multiple of VEC (the launcher sees to it for HOLD_W).
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    if HOLD_W:
        first_rows, pid_head = tile_rows(pid, stride_x, ROWS, VEC)
        hold_mask = cols < ((N - pid_head) // VEC) * VEC if VEC > 0 else cols < N
        if HAS_W:
            w = tl.load(w_ptr + pid_head + cols, mask=hold_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            b = tl.load(b_ptr + pid_head + cols, mask=hold_mask, other=0.0).to(tl.float32)[None, :]
    for tile in range(pid, num_tiles, num_progs):
        rows, head = tile_rows(tile, stride_x, ROWS, VEC)
        row_mask = rows < M
        # VEC > 0: unaligned rows as an aligned body (lane j = column head + j) plus edges (see
        # row_body in _common.py); the launcher then guarantees stride_x == stride_y.
        offs, mask = row_body(rows, head, M, N, stride_x, BLOCK_N, VEC)
        offs_y, _ = row_body(rows, head, M, N, stride_y, BLOCK_N, VEC)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # Mean about the row's first element: exact for constant rows (y is then exactly the
        # bias, as in torch) and no cancellation for rows far from zero (mean 1e4, small spread).
        x0 = tl.load(x_ptr + rows.to(tl.int64) * stride_x, mask=row_mask,
                     other=0.0).to(tl.float32)
        if VEC > 0:  # issued before any reduction, so all loads are in flight together
            e_offs, e_mask, e_col = row_edges(rows, head, M, N, stride_x, VEC)
            xe = tl.load(x_ptr + e_offs, mask=e_mask, other=0.0).to(tl.float32)
        total = tl.sum(tl.where(mask, x - x0[:, None], 0.0), axis=1)
        if VEC > 0:
            total += tl.sum(tl.where(e_mask, xe - x0[:, None], 0.0), axis=1)
        mean = x0 + total / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        sq = tl.sum(xc * xc, axis=1)
        if VEC > 0:
            xce = tl.where(e_mask, xe - mean[:, None], 0.0)
            sq += tl.sum(xce * xce, axis=1)
        var = sq / N
        # A variance that overflows float32 gives NaN (as torch does), never a row of zeros.
        rstd = tl.where(var < float("inf"), 1.0 / tl.sqrt(var + eps), float("nan"))
        y = xc * rstd[:, None]
        if not HOLD_W:  # long rows: weight and bias reloaded per tile (from L2)
            wcols = head + cols[None, :]
            wmask = (cols < ((N - head) // VEC) * VEC if VEC > 0 else cols < N)[None, :]
            if HAS_W:
                w = tl.load(w_ptr + wcols, mask=wmask, other=0.0).to(tl.float32)
            if HAS_B:
                b = tl.load(b_ptr + wcols, mask=wmask, other=0.0).to(tl.float32)
        if HAS_W:
            y = y * w
        if HAS_B:
            y = y + b
        if VEC > 0:
            ye = xce * rstd[:, None]
            if HAS_W:
                ye = ye * tl.load(w_ptr + e_col, mask=e_col < N, other=0.0).to(tl.float32)
            if HAS_B:
                ye = ye + tl.load(b_ptr + e_col, mask=e_col < N, other=0.0).to(tl.float32)
            tl.store(y_ptr + e_offs, ye.to(y_ptr.dtype.element_ty), mask=e_mask)
        tl.store(y_ptr + offs_y, y.to(y_ptr.dtype.element_ty), mask=mask)
        if STATS:
            tl.store(mean_ptr + rows, mean, mask=row_mask)
            tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _write_normalized(x_row, y_row, w_ptr, b_ptr, cols, N, mean, rstd, HAS_W: tl.constexpr,
                      HAS_B: tl.constexpr):
    # The write pass of the two-read kernels: one chunk of a row read again (from L2, then
    # evicted first), normalised, scaled and shifted, written in y's dtype.
    valid = cols < N
    x = tl.load(x_row + cols, mask=valid, other=0.0, eviction_policy="evict_first").to(tl.float32)
    y = (x - mean) * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=valid, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=valid, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
    tl.store(y_row + cols, y.to(y_row.dtype.element_ty), mask=valid)


@triton.jit
def _shift_weights(w_ptr, b_ptr, ws_ptr, bs_ptr, N, w_ld, HAS_W: tl.constexpr,
                   HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    # Row h of the (VEC, w_ld) outputs is the weight (bias) from column h on, zero-padded: the
    # copies _ln_fwd_reload_vec reads with aligned vector loads for rows whose body starts at
    # column h.
    h = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    src = cols < N - h
    dst = cols < w_ld
    if HAS_W:
        tl.store(ws_ptr + h * w_ld + cols, tl.load(w_ptr + h + cols, mask=src, other=0.0),
                 mask=dst)
    if HAS_B:
        tl.store(bs_ptr + h * w_ld + cols, tl.load(b_ptr + h + cols, mask=src, other=0.0),
                 mask=dst)


@triton.jit
def _ln_fwd_looped(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N, stride_x, stride_y, eps,
    CHUNK: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    y_row = y_ptr + row.to(tl.int64) * stride_y
    lanes = tl.arange(0, CHUNK)
    # Per-lane sums of x - k and (x - k)^2 about a per-lane shift k (the lane's first element:
    # no cancellation for rows far from zero), merged across lanes with Chan's formula. Two
    # multiply-adds per element: a Welford update (one division per element) left this kernel
    # compute-bound (82% SM throughput at bf16 16K in Nsight Compute).
    k = tl.load(x_row + lanes, mask=lanes < N, other=0.0).to(tl.float32)
    s1 = tl.zeros([CHUNK], tl.float32)
    s2 = tl.zeros([CHUNK], tl.float32)
    for start in range(0, N, CHUNK):
        cols = start + lanes
        valid = cols < N
        # evict_last keeps the row in L2 for the second pass; evict_first lets it go after it.
        x = tl.load(x_row + cols, mask=valid, other=0.0,
                    eviction_policy="evict_last").to(tl.float32)
        d = tl.where(valid, x - k, 0.0)
        s1 += d
        s2 += d * d
    cnt = ((N - lanes + CHUNK - 1) // CHUNK).to(tl.float32)  # elements per lane (0 past N)
    avg = k + s1 / tl.maximum(cnt, 1.0)
    m2 = tl.maximum(s2 - s1 * s1 / tl.maximum(cnt, 1.0), 0.0)
    # Combined about the row's first element: exact for constant rows (see _ln_fwd_single).
    x0 = tl.load(x_row).to(tl.float32)
    mean = x0 + tl.sum(cnt * (avg - x0), axis=0) / N
    dev = tl.where(cnt > 0, avg - mean, 0.0)
    var = (tl.sum(m2, axis=0) + tl.sum(cnt * dev * dev, axis=0)) / N
    rstd = tl.where(var < float("inf"), 1.0 / tl.sqrt(var + eps), float("nan"))
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, N, CHUNK):
        _write_normalized(x_row, y_row, w_ptr, b_ptr, start + lanes, N, mean, rstd, HAS_W, HAS_B)


@triton.jit
def _ln_fwd_reload(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N, stride_x, stride_y, eps,
    BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    STATS: tl.constexpr, THIRD_READ: tl.constexpr = False,
):
    # One row per program, read twice: first whole, in one load (every byte of the row in flight
    # at once), for exact two-pass statistics in registers; then again in CHUNK-sized pieces,
    # from L2, to write y. Nothing stays in registers across the two passes, so a program needs
    # far fewer registers than the single-block kernel (which holds the row and the weights until
    # it writes): more programs per SM, more bytes in flight. Inductor's reduction kernels do the
    # same at these lengths (its first loop fully unrolled).
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    y_row = y_ptr + row.to(tl.int64) * stride_y
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_last")
    x0 = tl.load(x_row).to(tl.float32)  # the shift, as in _ln_fwd_single
    mean = x0 + tl.sum(tl.where(mask, x.to(tl.float32) - x0, 0.0), axis=0) / N
    if THIRD_READ:  # read x again (L2) for the variance instead of keeping it: half the
        # registers at 16-bit 16K (ptxas: 32 vs 63 on 16 warps), a third read from L2. Measured
        # slower at 4K-16K (bf16 16K 3.36-3.63 vs 3.75 TB/s) but faster at 16-bit 32K on 32
        # warps (H200: bf16 3.51-3.54 vs 3.17-3.19 single-block, fp16 3.55 vs 3.20).
        x = tl.load(x_row + cols, mask=mask, other=0.0, cache_modifier=".cg")
    xc = tl.where(mask, x.to(tl.float32) - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / N
    rstd = tl.where(var < float("inf"), 1.0 / tl.sqrt(var + eps), float("nan"))
    if STATS:
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)
    lanes = tl.arange(0, CHUNK)
    for start in tl.static_range(0, BLOCK_N, CHUNK):
        _write_normalized(x_row, y_row, w_ptr, b_ptr, start + lanes, N, mean, rstd, HAS_W, HAS_B)


@triton.jit
def _ln_fwd_unrolled(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, M, stride_x, stride_y, eps,
    N: tl.constexpr, CHUNK: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    STATS: tl.constexpr,
):
    # (M is unused: the grid has one program per row; it leads the scalar arguments so launch
    # plans replay this kernel like the single-block one.)
    # The looped kernel with the row length a compile-time constant (N a multiple of CHUNK):
    # both passes unroll, so a thread has every chunk's loads in flight at once while holding
    # only its lanes' running sums, and no element needs a mask. This is the structure of
    # Inductor's static-shape reductions, which beat the reload kernel at 16-bit 16K on H200s.
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    y_row = y_ptr + row.to(tl.int64) * stride_y
    lanes = tl.arange(0, CHUNK)
    # Per-lane sums about the lane's first element k (no cancellation for rows far from zero),
    # merged across lanes with Chan's formula; every lane holds N / CHUNK elements.
    k = tl.load(x_row + lanes, eviction_policy="evict_last").to(tl.float32)
    s1 = tl.zeros([CHUNK], tl.float32)
    s2 = tl.zeros([CHUNK], tl.float32)
    for start in tl.static_range(CHUNK, N, CHUNK):
        d = tl.load(x_row + start + lanes, eviction_policy="evict_last").to(tl.float32) - k
        s1 += d
        s2 += d * d
    per_lane: tl.constexpr = N // CHUNK
    m2 = tl.maximum(s2 - s1 * s1 / per_lane, 0.0)
    # Everything about the row's first element x0: the lanes' means and the row's mean as
    # offsets from it, and y from (x - x0) - offset, so a row far from zero (1e4 + small
    # spread) never rounds its mean to x's magnitude before normalising (GPU, float32 rows at
    # 1e4: y's error 0.054 with the mean formed first, above torch's 0.048).
    x0 = tl.load(x_row).to(tl.float32)
    lane_off = (k - x0) + s1 / per_lane
    off = tl.sum(lane_off, axis=0) / CHUNK
    dev = lane_off - off
    var = (tl.sum(m2, axis=0) + per_lane * tl.sum(dev * dev, axis=0)) / N
    rstd = tl.where(var < float("inf"), 1.0 / tl.sqrt(var + eps), float("nan"))
    if STATS:
        tl.store(mean_ptr + row, x0 + off)
        tl.store(rstd_ptr + row, rstd)
    for start in tl.static_range(0, N, CHUNK):
        cols = start + lanes
        x = tl.load(x_row + cols, eviction_policy="evict_first").to(tl.float32)
        y = ((x - x0) - off) * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + cols, eviction_policy="evict_last").to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + cols, eviction_policy="evict_last").to(tl.float32)
        tl.store(y_row + cols, y.to(y_row.dtype.element_ty))


@triton.jit
def _ln_fwd_unrolled_vec(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, M, stride, eps, w_ld,
    N: tl.constexpr, BODY: tl.constexpr, CHUNK: tl.constexpr, HAS_W: tl.constexpr,
    HAS_B: tl.constexpr, STATS: tl.constexpr, VEC: tl.constexpr,
):
    # _ln_fwd_unrolled for rows that start unaligned (N not a multiple of VEC, e.g. 2^k + 1;
    # M unused, as there). Every row's first BODY = (N // VEC - 1)·VEC elements from its first
    # 16-byte boundary are read as vectors in unrolled chunks (the same count for every row,
    # whatever its misalignment, so only a last partial chunk needs a mask); the rest, the head
    # before the boundary (< VEC) and the tail after the body (< 2·VEC), in one 4·VEC-lane edge
    # tile. Weight and bias for the body from the shifted copies of _shift_weights (row
    # ``head``), so those loads are vectors too.
    row = tl.program_id(0)
    start = row.to(tl.int64) * stride
    first, head, ecol, emask = unrolled_edges(start, N, BODY, VEC)
    x_body = x_ptr + first
    y_body = y_ptr + first
    xe = tl.load(x_ptr + start + ecol, mask=emask, other=0.0).to(tl.float32)
    x0 = tl.load(x_ptr + start).to(tl.float32)
    lanes = tl.arange(0, CHUNK)
    # Per-lane sums about the lane's first element k, merged with Chan's formula (as in
    # _ln_fwd_unrolled); each edge element joins as a lane of its own.
    k = tl.load(x_body + lanes, eviction_policy="evict_last").to(tl.float32)
    s1 = tl.zeros([CHUNK], tl.float32)
    s2 = tl.zeros([CHUNK], tl.float32)
    for c0 in tl.static_range(CHUNK, BODY, CHUNK):
        c = c0 + lanes
        if c0 + CHUNK <= BODY:
            d = tl.load(x_body + c, eviction_policy="evict_last").to(tl.float32) - k
        else:
            d = tl.load(x_body + c, mask=c < BODY, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
            d = tl.where(c < BODY, d - k, 0.0)
        s1 += d
        s2 += d * d
    cnt = ((BODY - lanes + CHUNK - 1) // CHUNK).to(tl.float32)  # >= 1: BODY >= CHUNK
    m2 = tl.maximum(s2 - s1 * s1 / cnt, 0.0)
    lane_off = (k - x0) + s1 / cnt
    de = tl.where(emask, xe - x0, 0.0)
    off = (tl.sum(cnt * lane_off, axis=0) + tl.sum(de, axis=0)) / N
    dev = lane_off - off
    dve = tl.where(emask, de - off, 0.0)
    var = (tl.sum(m2, axis=0) + tl.sum(cnt * dev * dev, axis=0) + tl.sum(dve * dve, axis=0)) / N
    rstd = tl.where(var < float("inf"), 1.0 / tl.sqrt(var + eps), float("nan"))
    if STATS:
        tl.store(mean_ptr + row, x0 + off)
        tl.store(rstd_ptr + row, rstd)
    ye = dve * rstd
    if HAS_W:  # row 0 of the shifted copies is the weight itself
        ye = ye * tl.load(w_ptr + ecol, mask=emask, other=0.0).to(tl.float32)
    if HAS_B:
        ye = ye + tl.load(b_ptr + ecol, mask=emask, other=0.0).to(tl.float32)
    tl.store(y_ptr + start + ecol, ye.to(y_ptr.dtype.element_ty), mask=emask)
    w_at = head * w_ld
    for c0 in tl.static_range(0, BODY, CHUNK):
        c = c0 + lanes
        m = c < BODY
        if c0 + CHUNK <= BODY:
            x = tl.load(x_body + c, eviction_policy="evict_first").to(tl.float32)
        else:
            x = tl.load(x_body + c, mask=m, other=0.0, eviction_policy="evict_first").to(
                tl.float32)
        y = ((x - x0) - off) * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + w_at + c, mask=m, other=0.0,
                            eviction_policy="evict_last").to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + w_at + c, mask=m, other=0.0,
                            eviction_policy="evict_last").to(tl.float32)
        if c0 + CHUNK <= BODY:
            tl.store(y_body + c, y.to(y_ptr.dtype.element_ty))
        else:
            tl.store(y_body + c, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _ln_fwd_reload_vec(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N, stride, eps, w_ld,
    BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    STATS: tl.constexpr, VEC: tl.constexpr,
):
    # _ln_fwd_reload for rows that start unaligned (N = 2^k + 1): the aligned body (16-byte
    # vectors from the first boundary of the row on) plus up to 2·VEC edge elements, as in
    # row_body/row_edges; x and y share the row stride. Weight and bias come from the shifted
    # copies of _shift_weights (row ``head``), so the write pass loads them as vectors too.
    row = tl.program_id(0)
    start = row.to(tl.int64) * stride
    first = ((start + (VEC - 1)) // VEC) * VEC  # a multiple of VEC, visibly to the compiler
    head = (first - start).to(tl.int32)
    body = ((N - head) // VEC) * VEC
    cols = tl.arange(0, BLOCK_N)
    bmask = cols < body
    x = tl.load(x_ptr + first + cols, mask=bmask, other=0.0, eviction_policy="evict_last")
    x0 = tl.load(x_ptr + start).to(tl.float32)  # the shift, as in _ln_fwd_single
    j = tl.arange(0, 2 * VEC)
    ecol = tl.where(j < VEC, j, head + body + (j - VEC))
    emask = tl.where(j < VEC, j < head, ecol < N)
    xe = tl.load(x_ptr + start + ecol, mask=emask, other=0.0).to(tl.float32)
    total = (tl.sum(tl.where(bmask, x.to(tl.float32) - x0, 0.0), axis=0)
             + tl.sum(tl.where(emask, xe - x0, 0.0), axis=0))
    mean = x0 + total / N
    xc = tl.where(bmask, x.to(tl.float32) - mean, 0.0)
    xce = tl.where(emask, xe - mean, 0.0)
    var = (tl.sum(xc * xc, axis=0) + tl.sum(xce * xce, axis=0)) / N
    rstd = tl.where(var < float("inf"), 1.0 / tl.sqrt(var + eps), float("nan"))
    if STATS:
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)
    ye = xce * rstd
    if HAS_W:  # row 0 of the shifted copies is the weight itself
        ye = ye * tl.load(w_ptr + ecol, mask=emask, other=0.0).to(tl.float32)
    if HAS_B:
        ye = ye + tl.load(b_ptr + ecol, mask=emask, other=0.0).to(tl.float32)
    tl.store(y_ptr + start + ecol, ye.to(y_ptr.dtype.element_ty), mask=emask)
    lanes = tl.arange(0, CHUNK)
    w_at = head * w_ld
    for c0 in tl.static_range(0, BLOCK_N, CHUNK):
        c = c0 + lanes
        m = c < body
        xv = tl.load(x_ptr + first + c, mask=m, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        yv = (xv - mean) * rstd
        if HAS_W:
            yv = yv * tl.load(w_ptr + w_at + c, mask=m, other=0.0,
                              eviction_policy="evict_last").to(tl.float32)
        if HAS_B:
            yv = yv + tl.load(b_ptr + w_at + c, mask=m, other=0.0,
                              eviction_policy="evict_last").to(tl.float32)
        tl.store(y_ptr + first + c, yv.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _ln_fwd_split(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, stats_ptr, count_ptr, N, L, stride_x,
    stride_y, eps, num_items, num_progs,
    BLOCK: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, HAS_W: tl.constexpr,
    HAS_B: tl.constexpr, PREFETCH: tl.constexpr, VEC: tl.constexpr,
):
    # Work item = (row, piece), row-major; see fusedops/backends/triton/_common.py "split rows".
    # Each
    # piece publishes its (mean, M2) about its own mean; the row's statistics are merged with
    # Chan's formula, so the row is read once and there is no E[x^2] - E[x]^2 cancellation.
    # Pieces: split_piece in _common.py (VEC > 0: pieces of the aligned body, piece 0 also has
    # the edges, x and y share the row stride). The grid is a multiple of C: a program always
    # has the same piece, of rows num_progs // C apart; with VEC > 0 also a multiple of C·VEC
    # (or one item per program), so its rows share one misalignment and its weight columns are
    # fixed: weight and bias are loaded once. PREFETCH: see _common.py.
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    peers = tl.arange(0, C_P2)
    chunk = pid % C
    step = num_progs // C
    if VEC > 0:
        head, body = split_head(pid // C, N, stride_x, VEC)
        wcol = head + chunk * L + lanes
        wmask = (lanes < L) & (chunk * L + lanes < body)
        if HAS_W:
            w = tl.load(w_ptr + wcol, mask=wmask, other=0.0)
        if HAS_B:
            b = tl.load(b_ptr + wcol, mask=wmask, other=0.0)
        n_c = (tl.minimum(tl.maximum(body - chunk * L, 0), L)
               + tl.where(chunk == 0, N - body, 0)).to(tl.float32)
        counts = (tl.minimum(tl.maximum(body - peers * L, 0), L)
                  + tl.where(peers == 0, N - body, 0)).to(tl.float32)
    else:
        n_c = tl.minimum(N - chunk * L, L).to(tl.float32)
        counts = tl.minimum(tl.maximum(N - peers * L, 0), L).to(tl.float32)
    counts = tl.where(peers < C, counts, 0.0)
    if PREFETCH > 0:
        offs, mask, pos = split_piece(pid // C, chunk, L, N, stride_x, BLOCK, VEC)
        x_next = tl.load(x_ptr + offs, mask=mask, other=0.0)
    for item in range(pid, num_items, num_progs):
        row = item // C
        offs, mask, pos = split_piece(row, chunk, L, N, stride_x, BLOCK, VEC)
        if PREFETCH > 0:
            x = x_next.to(tl.float32)
            n_offs, n_mask, n_pos = split_piece(row + step, chunk, L, N, stride_x, BLOCK, VEC)
            n_mask = n_mask & (item + num_progs < num_items)
            if PREFETCH == 1:
                x_next = tl.load(x_ptr + n_offs, mask=n_mask, other=0.0)
        else:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # About the piece's first element, and merged about piece 0's mean: exact for constant
        # rows (see _ln_fwd_single).
        x0 = tl.sum(tl.where(lanes == 0, x, 0.0), axis=0)
        total = tl.sum(tl.where(mask, x - x0, 0.0), axis=0)
        if VEC > 0:
            e_offs, e_mask, e_col = split_edges(row, chunk, N, stride_x, VEC)
            xe = tl.load(x_ptr + e_offs, mask=e_mask, other=0.0).to(tl.float32)
            total += tl.sum(tl.where(e_mask, xe - x0, 0.0), axis=0)
        mean_c = x0 + total / tl.maximum(n_c, 1.0)  # an empty piece (count 0) adds nothing
        xc = tl.where(mask, x - mean_c, 0.0)
        m2 = tl.sum(xc * xc, axis=0)
        if VEC > 0:
            xce = tl.where(e_mask, xe - mean_c, 0.0)
            m2 += tl.sum(xce * xce, axis=0)
        tl.store(stats_ptr + item * 2, mean_c)
        tl.store(stats_ptr + item * 2 + 1, m2)
        publish_row(count_ptr, row)
        if PREFETCH == 3:
            x_next = tl.load(x_ptr + n_offs, mask=n_mask, other=0.0)
        await_row(count_ptr, row, C)
        if PREFETCH == 2:
            x_next = tl.load(x_ptr + n_offs, mask=n_mask, other=0.0)
        base = (row * C + peers) * 2
        ok = peers < C
        means = tl.load(stats_ptr + base, mask=ok, other=0.0, cache_modifier=".cg")
        m2s = tl.load(stats_ptr + base + 1, mask=ok, other=0.0, cache_modifier=".cg")
        ref = tl.sum(tl.where(peers == 0, means, 0.0), axis=0)
        mean = ref + tl.sum(counts * (means - ref), axis=0) / N
        dev = means - mean
        var = (tl.sum(m2s, axis=0) + tl.sum(counts * dev * dev, axis=0)) / N
        rstd = tl.where(var < float("inf"), 1.0 / tl.sqrt(var + eps), float("nan"))
        y = (x - mean) * rstd
        if VEC > 0:
            if HAS_W:
                y = y * w.to(tl.float32)
            if HAS_B:
                y = y + b.to(tl.float32)
        else:
            if HAS_W:
                y = y * tl.load(w_ptr + pos, mask=mask, other=0.0).to(tl.float32)
            if HAS_B:
                y = y + tl.load(b_ptr + pos, mask=mask, other=0.0).to(tl.float32)
        offs_y, mask_y, pos_y = split_piece(row, chunk, L, N, stride_y, BLOCK, VEC)
        tl.store(y_ptr + offs_y, y.to(y_ptr.dtype.element_ty), mask=mask)
        if VEC > 0:
            ye = (xe - mean) * rstd
            if HAS_W:
                ye = ye * tl.load(w_ptr + e_col, mask=e_mask, other=0.0).to(tl.float32)
            if HAS_B:
                ye = ye + tl.load(b_ptr + e_col, mask=e_mask, other=0.0).to(tl.float32)
            tl.store(y_ptr + e_offs, ye.to(y_ptr.dtype.element_ty), mask=e_mask)
        if chunk == 0:
            tl.store(mean_ptr + row, mean)
            tl.store(rstd_ptr + row, rstd)


@triton.jit
def _over_rows(acc, ACC_1D: tl.constexpr):
    """A program's partial row from its accumulator: (ROWS, BLOCK) ones summed over rows."""
    if ACC_1D:
        row = acc
    else:
        row = tl.sum(acc, axis=0)
    return row


@triton.jit
def _add_pairs(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


@triton.jit
def _row_sums(a, b, axis: tl.constexpr, PAIRED: tl.constexpr):
    """(sum(a), sum(b)) over ``axis``: one paired reduction (one cross-warp exchange) or two."""
    if PAIRED:
        return tl.reduce((a, b), axis, _add_pairs)
    else:
        return tl.sum(a, axis=axis), tl.sum(b, axis=axis)


@triton.jit
def _ln_bwd_single(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr,
    M, N, stride_dy, stride_x, stride_dx, num_tiles, num_progs, first_tile, M_dx,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_W: tl.constexpr,
    NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, VEC: tl.constexpr,
    HOLD_W: tl.constexpr, ACC_1D: tl.constexpr, PARKED: tl.constexpr,
    PAIRED: tl.constexpr, STAGES: tl.constexpr,
):
    # NEED_DW/NEED_DB: per-program partials, part_ptr is (2, num_progs, N) float32. ACC_1D: fold
    # each tile's rows into (BLOCK_N,) accumulators at once (fewer registers); otherwise keep
    # (ROWS, BLOCK_N) accumulators and reduce over rows once at the end (no cross-warp reduction
    # per tile). VEC > 0 (unaligned rows, see row_body in _common.py): all tiles of a program
    # share one misalignment (the launcher makes num_progs a multiple of VEC, or gives each
    # program one tile), so accumulator lane j is column pid_head + j throughout, and the
    # columns outside the aligned body accumulate in (2·VEC,) edge accumulators.
    # PARKED (see _park): tiles first_tile.. are processed and dx is written for rows below
    # M_dx only (the rows from M_dx on hold the parked partials until a second launch writes
    # their dx); first_tile is a multiple of VEC, so a program's misalignment holds.
    pid = tl.program_id(0)
    if PARKED:
        start = first_tile + pid
    else:
        start = pid
    cols = tl.arange(0, BLOCK_N)
    if VEC > 0:
        first_rows, pid_head = tile_rows(start, stride_x, ROWS, VEC)
        pid_body = ((N - pid_head) // VEC) * VEC
    if HAS_W and HOLD_W:  # see _ln_fwd_single
        if VEC > 0:
            w = tl.load(w_ptr + pid_head + cols, mask=cols < pid_body,
                        other=0.0).to(tl.float32)[None, :]
        else:
            w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if ACC_1D:
        dw_acc = tl.zeros([BLOCK_N], tl.float32)
        db_acc = tl.zeros([BLOCK_N], tl.float32)
    else:
        dw_acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        db_acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    if VEC > 0:
        if ACC_1D or ROWS == 1:
            dwe_acc = tl.zeros([2 * VEC], tl.float32)
            dbe_acc = tl.zeros([2 * VEC], tl.float32)
        else:
            dwe_acc = tl.zeros([ROWS, 2 * VEC], tl.float32)
            dbe_acc = tl.zeros([ROWS, 2 * VEC], tl.float32)
    # STAGES > 1: Triton software-pipelines the tile loop (the next tiles' loads are copied
    # into shared memory asynchronously while this one is reduced; see _fused_bwd_stages).
    for tile in tl.range(start, num_tiles, num_progs, num_stages=STAGES):
        rows, head = tile_rows(tile, stride_x, ROWS, VEC)
        row_mask = rows < M
        offs_x, mask = row_body(rows, head, M, N, stride_x, BLOCK_N, VEC)
        offs_dy, _ = row_body(rows, head, M, N, stride_dy, BLOCK_N, VEC)
        x = tl.load(x_ptr + offs_x, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs_dy, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        if VEC > 0:  # unaligned rows: edges loaded with the body
            if ROWS == 1:
                # One row: a 1-D edge tile with its own statistics. As a [1, 2·VEC] slice of
                # the body's layout, Triton 3.6 gave every thread 8 of its elements (26 scalar
                # loads per thread per row in the SASS; docs/performance.md, "Known gaps").
                e_row = tile
                j = tl.arange(0, 2 * VEC)
                e_col = tl.where(j < VEC, j, head + ((N - head) // VEC) * VEC + (j - VEC))
                e_mask = row_mask & tl.where(j < VEC, j < head, e_col < N)
                e_offs = e_row.to(tl.int64) * stride_x + e_col
                e_mean = tl.sum(mean, axis=0)  # the one row's, as scalars
                e_rstd = tl.sum(rstd, axis=0)
            else:
                e_offs, e_mask, e_col = row_edges(rows, head, M, N, stride_x, VEC)
                e_mean = mean[:, None]
                e_rstd = rstd[:, None]
            xe = tl.load(x_ptr + e_offs, mask=e_mask, other=0.0).to(tl.float32)
            dye = tl.load(dy_ptr + e_offs, mask=e_mask, other=0.0).to(tl.float32)
            xhe = tl.where(e_mask, (xe - e_mean) * e_rstd, 0.0)
        # No tl.where on the masked lanes: there dy is 0 (and rows past M have mean = rstd = 0),
        # so they add nothing to any sum unless xhat is not finite, which it then also is on
        # the row's own lanes (a NaN row either way). One select per element less (H200, bf16
        # 768: 2.15 -> 2.58 TB/s).
        xhat = (x - mean[:, None]) * rstd[:, None]
        if NEED_DX:
            if HAS_W:
                if not HOLD_W:
                    wmask = cols < ((N - head) // VEC) * VEC if VEC > 0 else cols < N
                    w = tl.load(w_ptr + head + cols, mask=wmask,
                                other=0.0).to(tl.float32)[None, :]
                wdy = dy * w
            else:
                wdy = dy
            c1, c2 = _row_sums(xhat * wdy, wdy, 1, PAIRED)
            if VEC > 0:
                if HAS_W:
                    wdye = dye * tl.load(w_ptr + e_col, mask=e_col < N, other=0.0).to(tl.float32)
                else:
                    wdye = dye
                if ROWS == 1:
                    c1 += tl.sum(xhe * wdye, axis=0)
                    c2 += tl.sum(wdye, axis=0)
                else:
                    c1 += tl.sum(xhe * wdye, axis=1)
                    c2 += tl.sum(wdye, axis=1)
            c1 = c1 / N
            c2 = c2 / N
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            offs_dx, _ = row_body(rows, head, M, N, stride_dx, BLOCK_N, VEC)
            dx_mask = mask
            if PARKED:  # (offsets from row_body(..., M_dx, ...) cost 9-25% on unaligned rows)
                dx_mask = mask & (rows < M_dx)[:, None]
            tl.store(dx_ptr + offs_dx, dx.to(dx_ptr.dtype.element_ty), mask=dx_mask)
            if VEC > 0:
                if ROWS == 1:
                    dxe = (wdye - (xhe * tl.sum(c1, axis=0) + tl.sum(c2, axis=0))) * e_rstd
                    if PARKED:
                        e_mask = e_mask & (rows < M_dx)
                else:
                    dxe = (wdye - (xhe * c1[:, None] + c2[:, None])) * e_rstd
                    if PARKED:
                        e_mask = e_mask & (rows < M_dx)[:, None]
                tl.store(dx_ptr + e_offs, dxe.to(dx_ptr.dtype.element_ty), mask=e_mask)
        if ACC_1D:
            if NEED_DW:
                dw_acc += tl.sum(dy * xhat, axis=0)
            if NEED_DB:
                db_acc += tl.sum(dy, axis=0)
        else:
            if NEED_DW:
                dw_acc += dy * xhat
            if NEED_DB:
                db_acc += dy
        if VEC > 0:
            if ACC_1D and ROWS > 1:
                if NEED_DW:
                    dwe_acc += tl.sum(dye * xhe, axis=0)
                if NEED_DB:
                    dbe_acc += tl.sum(dye, axis=0)
            else:  # one row (a 1-D edge tile), or (ROWS, 2·VEC) accumulators
                if NEED_DW:
                    dwe_acc += dye * xhe
                if NEED_DB:
                    dbe_acc += dye
    out = part_ptr + pid.to(tl.int64) * N
    dw_row = _over_rows(dw_acc, ACC_1D)
    db_row = _over_rows(db_acc, ACC_1D)
    if VEC > 0:
        dwe_row = _over_rows(dwe_acc, ACC_1D or ROWS == 1)
        dbe_row = _over_rows(dbe_acc, ACC_1D or ROWS == 1)
        # Every column of the partial row is written once: the body from the lanes, the rest
        # (columns [0, head) and [head + body, N)) from the edge accumulators.
        body_cols = pid_head + cols
        body_ok = cols < pid_body
        j = tl.arange(0, 2 * VEC)
        e_cols = tl.where(j < VEC, j, pid_head + pid_body + (j - VEC))
        e_ok = tl.where(j < VEC, j < pid_head, e_cols < N)
    else:
        body_cols = cols
        body_ok = cols < N
    if NEED_DW:
        tl.store(out + body_cols, dw_row, mask=body_ok)
        if VEC > 0:
            tl.store(out + e_cols, dwe_row, mask=e_ok)
    if NEED_DB:
        # num_progs may arrive as the constant 1; (programs x N) fits int32 for these rows.
        tl.store(out + num_progs * N + body_cols, db_row, mask=body_ok)
        if VEC > 0:
            tl.store(out + num_progs * N + e_cols, dbe_row, mask=e_ok)


@triton.jit
def _body_at(row64, stride, VEC: tl.constexpr):
    """Offset of lane 0 of a row in the LayerNorm backward's split kernels: the row's start, or
    (VEC > 0, rows that start unaligned) its first 16-byte boundary, visibly a multiple of VEC
    to the compiler, so the body's accesses are 16-byte vectors."""
    start = row64 * stride
    if VEC > 0:
        start = ((start + (VEC - 1)) // VEC) * VEC
    return start


@triton.jit
def _piece_at(x_ptr, dy_ptr, row64, stride_x, stride_dy, pos, mask, VEC: tl.constexpr):
    """(x, dy) of a split-row program's piece of row ``row64``, in the inputs' dtype."""
    return (tl.load(x_ptr + _body_at(row64, stride_x, VEC) + pos, mask=mask, other=0.0),
            tl.load(dy_ptr + _body_at(row64, stride_dy, VEC) + pos, mask=mask, other=0.0))


@triton.jit
def _ln_bwd_split(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, stats_ptr, count_ptr,
    N, L, stride_dy, stride_x, stride_dx, M_dx, num_items, num_progs,
    BLOCK: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, HAS_W: tl.constexpr,
    NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
    PREFETCH: tl.constexpr, PARKED: tl.constexpr, VEC: tl.constexpr, PAIRED: tl.constexpr,
    CLUSTER: tl.constexpr,
):
    # Work item = (row, chunk), row-major, on a grid that is a multiple of C: a program always
    # gets the same chunk (pid % C), so it keeps that chunk's weight and its dweight/dbias
    # partials in registers across rows. Each chunk publishes its two partial row sums, waits for
    # its row's other chunks (see "split rows" in _common.py), then writes its piece of dx:
    # x and dy are read once, dx written once, partials are (2, num_progs / C, N) float32.
    # PREFETCH: see _common.py. PARKED: dx is written for rows below M_dx only (see
    # _ln_bwd_single); _ln_bwd_dx_published writes the others with the same arithmetic.
    # VEC > 0 (rows that start unaligned; x, dy and dx share the row stride): lane j is
    # position chunk·L + j of the row's aligned body, column head + chunk·L + j, and piece 0
    # also has the row's edges (split_edges). The grid is a multiple of C·VEC (or one item per
    # program), so all rows of a program share one head: its weight and accumulator columns,
    # edges included, are fixed.
    # CLUSTER (aligned rows, launched by runtime.clusters.ClusterLauncher): the C programs of a row
    # are one thread-block cluster, which exchanges the sums through shared memory and the
    # cluster barrier instead of the counters (the statistics are still stored for the parked
    # tail's second launch); VEC must be 0. w·dy is an explicitly rounded product (never
    # contracted into a multiply-add, see _rounded_mul), in the sums and in dx alike, as in
    # _ln_bwd_dx_pieces and _ln_bwd_dx_published: with or without a wait loop between the
    # product and the subtraction, every variant writes the same bits.
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    peers = tl.arange(0, C_P2)
    pos = (pid % C) * L + lanes
    step = num_progs // C
    parity = pid * 0
    if CLUSTER and NEED_DX:
        parity = cluster_start(parity)
    if VEC > 0:
        # weight and partial columns head + pos, from a scalar base (no tensor of columns live
        # across the row loop: pos is, for the addresses)
        head, body = split_head(pid // C, N, stride_x, VEC)
        w_at = w_ptr + head
        cmask = (lanes < L) & (pos < body)
        _, emask, ecols = split_edges(pid // C, pid % C, N, stride_x, VEC)
        if HAS_W:
            we = tl.load(w_ptr + ecols, mask=emask, other=0.0).to(tl.float32)
        dwe_acc = tl.zeros([2 * VEC], tl.float32)
        dbe_acc = tl.zeros([2 * VEC], tl.float32)
    else:
        head = 0
        w_at = w_ptr
        cmask = (lanes < L) & (pos < N)
    if HAS_W:
        w = tl.load(w_at + pos, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK], tl.float32)
    db_acc = tl.zeros([BLOCK], tl.float32)
    if PREFETCH > 0:
        x_next, dy_next = _piece_at(x_ptr, dy_ptr, (pid // C).to(tl.int64), stride_x,
                                    stride_dy, pos, cmask, VEC)
    for item in range(pid, num_items, num_progs):
        row = item // C
        row64 = row.to(tl.int64)
        if PREFETCH > 0:
            x = x_next.to(tl.float32)
            dy = dy_next.to(tl.float32)
            more = cmask & (item + num_progs < num_items)
            if PREFETCH == 1:
                x_next, dy_next = _piece_at(x_ptr, dy_ptr, row64 + step, stride_x, stride_dy,
                                            pos, more, VEC)
        else:
            x, dy = _piece_at(x_ptr, dy_ptr, row64, stride_x, stride_dy, pos, cmask, VEC)
            x = x.to(tl.float32)
            dy = dy.to(tl.float32)
        if VEC > 0:
            xe = tl.load(x_ptr + row64 * stride_x + ecols, mask=emask, other=0.0).to(tl.float32)
            dye = tl.load(dy_ptr + row64 * stride_dy + ecols, mask=emask,
                          other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        xhat = (x - mean) * rstd  # no select: masked lanes have dy = 0 (see _ln_bwd_single)
        if VEC > 0:
            xhe = tl.where(emask, (xe - mean) * rstd, 0.0)
        # Accumulate before waiting: only xhat and w·dy stay live across the wait.
        if NEED_DW:
            dw_acc += dy * xhat
            if VEC > 0:
                dwe_acc += dye * xhe
        if NEED_DB:
            db_acc += dy
            if VEC > 0:
                dbe_acc += dye
        if NEED_DX:
            if HAS_W:
                wdy = _rounded_mul(dy, w, True)
            else:
                wdy = dy
            s1, s2 = _row_sums(xhat * wdy, wdy, 0, PAIRED)
            if VEC > 0:
                if HAS_W:
                    wdye = _rounded_mul(dye, we, True)
                else:
                    wdye = dye
                s1 += tl.sum(xhe * wdye, axis=0)
                s2 += tl.sum(wdye, axis=0)
            tl.store(stats_ptr + item * 2, s1)
            tl.store(stats_ptr + item * 2 + 1, s2)
            if CLUSTER:
                token = cluster_publish(s1, s2, pid % C, parity, C)
                p1, p2 = cluster_peer_sums(peers, parity, token, C)
                parity = 1 - parity
                if PREFETCH >= 2:
                    x_next, dy_next = _piece_at(x_ptr, dy_ptr, row64 + step, stride_x,
                                                stride_dy, pos, more, VEC)
                c1 = tl.sum(p1, axis=0) / N
                c2 = tl.sum(p2, axis=0) / N
            else:
                publish_row(count_ptr, row)
                if PREFETCH == 3:
                    x_next, dy_next = _piece_at(x_ptr, dy_ptr, row64 + step, stride_x,
                                                stride_dy, pos, more, VEC)
                await_row(count_ptr, row, C)
                if PREFETCH == 2:
                    x_next, dy_next = _piece_at(x_ptr, dy_ptr, row64 + step, stride_x,
                                                stride_dy, pos, more, VEC)
                base = (row * C + peers) * 2
                ok = peers < C
                c1 = tl.sum(tl.load(stats_ptr + base, mask=ok, other=0.0, cache_modifier=".cg"),
                            axis=0) / N
                c2 = tl.sum(tl.load(stats_ptr + base + 1, mask=ok, other=0.0,
                                    cache_modifier=".cg"), axis=0) / N
            dx = ((wdy - (xhat * c1 + c2)) * rstd).to(dx_ptr.dtype.element_ty)
            dx_at = dx_ptr + _body_at(row64, stride_dx, VEC) + pos
            if PARKED:
                tl.store(dx_at, dx, mask=cmask & (row < M_dx))
            else:
                tl.store(dx_at, dx, mask=cmask)
            if VEC > 0:
                dxe = ((wdye - (xhe * c1 + c2)) * rstd).to(dx_ptr.dtype.element_ty)
                if PARKED:
                    tl.store(dx_ptr + row64 * stride_dx + ecols, dxe, mask=emask & (row < M_dx))
                else:
                    tl.store(dx_ptr + row64 * stride_dx + ecols, dxe, mask=emask)
        elif PREFETCH >= 2:
            x_next, dy_next = _piece_at(x_ptr, dy_ptr, row64 + step, stride_x, stride_dy, pos,
                                        more, VEC)
    out = part_ptr + (pid // C).to(tl.int64) * N
    db_out = out + (num_progs // C) * N  # < 2^31: partial rows x N
    if NEED_DW:
        tl.store(out + head + pos, dw_acc, mask=cmask)
        if VEC > 0:
            tl.store(out + ecols, dwe_acc, mask=emask)
    if NEED_DB:
        tl.store(db_out + head + pos, db_acc, mask=cmask)
        if VEC > 0:
            tl.store(db_out + ecols, dbe_acc, mask=emask)


@triton.jit
def _piece_sums(dy_row, x_row, w_ptr, cols, cmask, mean, rstd, HAS_W: tl.constexpr,
                PAIRED: tl.constexpr, PTX: tl.constexpr):
    # One piece of a row's statistics as _ln_bwd_split computes them: sum(xhat·w·dy), sum(w·dy)
    # (w·dy explicitly rounded there).
    x = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
    dy = tl.load(dy_row + cols, mask=cmask, other=0.0).to(tl.float32)
    xhat = (x - mean) * rstd
    if HAS_W:
        wdy = _rounded_mul(dy, tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32), PTX)
    else:
        wdy = dy
    return _row_sums(xhat * wdy, wdy, 0, PAIRED)


@triton.jit
def _rounded_mul(a, b, PTX: tl.constexpr):
    """a·b rounded to float32 before any use: an explicitly rounded PTX multiply is never
    contracted into a multiply-add (PTX: False, the interpreter, which never contracts)."""
    if PTX:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def _piece_dx(dy_row, x_row, w_ptr, dx_row, cols, cmask, mean, rstd, c1, c2,
              HAS_W: tl.constexpr, PTX: tl.constexpr):
    # dx of one piece from its row's combined statistics, as _ln_bwd_split writes it after its
    # exchange (w·dy an explicitly rounded product there too).
    x = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
    wdy = tl.load(dy_row + cols, mask=cmask, other=0.0).to(tl.float32)
    xhat = tl.where(cmask, (x - mean) * rstd, 0.0)
    if HAS_W:
        wdy = _rounded_mul(wdy, tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32),
                           PTX)
    dx = (wdy - (xhat * c1 + c2)) * rstd
    tl.store(dx_row + cols, dx.to(dx_row.dtype.element_ty), mask=cmask)


@triton.jit
def _ln_bwd_dx_pieces(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, N, L, stride_dy, stride_x, stride_dx,
    row0, BLOCK: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, HAS_W: tl.constexpr,
    PTX: tl.constexpr, VEC: tl.constexpr, PAIRED: tl.constexpr,
):
    # dx of row row0 + program id, bit for bit as _ln_bwd_split computes it (same pieces of L
    # columns, or of the aligned body plus the edges with VEC > 0, the same BLOCK and warps, so
    # the same per-piece reductions, combined over a (C_P2,) vector as that kernel combines its
    # peers' sums), but in one program that reads the row twice: no statistics buffer, no
    # cooperating programs (for the few rows whose dx cannot hold that kernel's scratch, see
    # _split_backward). w·dy is an explicitly rounded product here as there (PTX, see
    # _rounded_mul): never contracted into a multiply-add, however the code falls into basic
    # blocks (a wait loop separates the product from the subtraction in the cooperative split
    # kernel, nothing does in its cluster variant or here).
    row = row0 + tl.program_id(0)
    row64 = row.to(tl.int64)
    x_row = x_ptr + _body_at(row64, stride_x, VEC)
    dy_row = dy_ptr + _body_at(row64, stride_dy, VEC)
    dx_row = dx_ptr + _body_at(row64, stride_dx, VEC)
    lanes = tl.arange(0, BLOCK)
    peers = tl.arange(0, C_P2)
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    if VEC > 0:
        head, limit = split_head(row, N, stride_x, VEC)
        w_body = w_ptr + head
    else:
        limit = N
        w_body = w_ptr
    s1 = tl.zeros([C_P2], tl.float32)
    s2 = tl.zeros([C_P2], tl.float32)
    for piece in range(C):
        pos = piece * L + lanes
        a, b = _piece_sums(dy_row, x_row, w_body, pos, (lanes < L) & (pos < limit), mean, rstd,
                           HAS_W, PAIRED, PTX)
        if VEC > 0:  # the edges, with piece 0 (every piece adds a sum, as in the split kernel)
            _, emask, ecols = split_edges(row, piece, N, stride_x, VEC)
            ea, eb = _piece_sums(dy_ptr + row64 * stride_dy, x_ptr + row64 * stride_x, w_ptr,
                                 ecols, emask, mean, rstd, HAS_W, PAIRED, PTX)
            a += ea
            b += eb
        s1 = tl.where(peers == piece, a, s1)
        s2 = tl.where(peers == piece, b, s2)
    c1 = tl.sum(s1, axis=0) / N
    c2 = tl.sum(s2, axis=0) / N
    for piece in range(C):
        pos = piece * L + lanes
        _piece_dx(dy_row, x_row, w_body, dx_row, pos, (lanes < L) & (pos < limit), mean, rstd,
                  c1, c2, HAS_W, PTX)
    if VEC > 0:
        _, emask, ecols = split_edges(row, 0, N, stride_x, VEC)
        _piece_dx(dy_ptr + row64 * stride_dy, x_ptr + row64 * stride_x, w_ptr,
                  dx_ptr + row64 * stride_dx, ecols, emask, mean, rstd, c1, c2, HAS_W, PTX)


@triton.jit
def _ln_bwd_dx_published(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, stats_ptr, done_ptr, N, L, stride_dy,
    stride_x, stride_dx, row0, num_progs, late_from,
    BLOCK: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, HAS_W: tl.constexpr,
    PTX: tl.constexpr, VEC: tl.constexpr,
):
    # dx of piece pid % C of row row0 + pid // C from the per-piece statistics a parked
    # _ln_bwd_split launch left in dx's storage (see _split_backward), bit for bit as that
    # kernel computes it after its exchange: the same (C_P2,) sum of the peers' statistics, and
    # w·dy an explicitly rounded product (see _rounded_mul).
    # VEC > 0: pieces of the aligned body, piece 0 with the edges, as in the split kernel.
    # The statistics lie in the storage of the last pieces: programs from late_from on (whose
    # dx covers them) write only once every program has read what it needs (done_ptr: a
    # zeroed counter there too). The others never wait, so the grid needs no co-residency.
    pid = tl.program_id(0)
    row = row0 + pid // C
    row64 = row.to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    peers = tl.arange(0, C_P2)
    pos = (pid % C) * L + lanes
    base = (row * C + peers) * 2
    ok = peers < C
    c1 = tl.sum(tl.load(stats_ptr + base, mask=ok, other=0.0, cache_modifier=".cg"),
                axis=0) / N
    c2 = tl.sum(tl.load(stats_ptr + base + 1, mask=ok, other=0.0, cache_modifier=".cg"),
                axis=0) / N
    tl.debug_barrier()  # every thread's statistics loads happen before the release
    tl.atomic_add(done_ptr, 1, sem="release")
    if pid >= late_from:
        seen = tl.atomic_add(done_ptr, 0, sem="acquire")
        while seen < num_progs:
            seen = tl.atomic_add(done_ptr, 0, sem="acquire")
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    if VEC > 0:
        head, body = split_head(row, N, stride_x, VEC)
        _piece_dx(dy_ptr + _body_at(row64, stride_dy, VEC), x_ptr + _body_at(row64, stride_x, VEC),
                  w_ptr + head, dx_ptr + _body_at(row64, stride_dx, VEC), pos,
                  (lanes < L) & (pos < body), mean, rstd, c1, c2, HAS_W, PTX)
        _, emask, ecols = split_edges(row, 0, N, stride_x, VEC)
        emask = emask & (pid % C + ecols * 0 == 0)  # piece 0's (a vector test: the interpreter
        # rejects a scalar-and-vector mask)
        _piece_dx(dy_ptr + row64 * stride_dy, x_ptr + row64 * stride_x, w_ptr,
                  dx_ptr + row64 * stride_dx, ecols, emask, mean, rstd, c1, c2, HAS_W, PTX)
    else:
        _piece_dx(dy_ptr + row64 * stride_dy, x_ptr + row64 * stride_x, w_ptr,
                  dx_ptr + row64 * stride_dx, pos, (lanes < L) & (pos < N), mean, rstd, c1, c2,
                  HAS_W, PTX)


@triton.jit
def _ln_bwd_dx_looped(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, N, stride_dy, stride_x, stride_dx,
    CHUNK: tl.constexpr, HAS_W: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    dy_row = dy_ptr + row.to(tl.int64) * stride_dy
    dx_row = dx_ptr + row.to(tl.int64) * stride_dx
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    lanes = tl.arange(0, CHUNK)
    acc1 = tl.zeros([CHUNK], tl.float32)
    acc2 = tl.zeros([CHUNK], tl.float32)
    for start in range(0, N, CHUNK):
        cols = start + lanes
        valid = cols < N
        x = tl.load(x_row + cols, mask=valid, other=0.0).to(tl.float32)
        wdy = tl.load(dy_row + cols, mask=valid, other=0.0).to(tl.float32)
        if HAS_W:
            wdy = wdy * tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        xhat = tl.where(valid, (x - mean) * rstd, 0.0)
        acc1 += xhat * wdy
        acc2 += wdy
    c1 = tl.sum(acc1, axis=0) / N
    c2 = tl.sum(acc2, axis=0) / N
    for start in range(0, N, CHUNK):
        cols = start + lanes
        valid = cols < N
        x = tl.load(x_row + cols, mask=valid, other=0.0).to(tl.float32)
        wdy = tl.load(dy_row + cols, mask=valid, other=0.0).to(tl.float32)
        if HAS_W:
            wdy = wdy * tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        xhat = (x - mean) * rstd
        dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _ln_bwd_dwdb_columns(
    dy_ptr, x_ptr, mean_ptr, rstd_ptr, dw_part_ptr, db_part_ptr, M, N, stride_dy, stride_x,
    rows_per_split, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, ONE_STRIDE: tl.constexpr,
):
    col_block = tl.program_id(0)
    split = tl.program_id(1)
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < N
    # 2-D accumulators, reduced over rows once at the end (no cross-warp reduction per tile).
    dw_acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    db_acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    row_start = split * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, M)
    for r0 in range(row_start, row_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        # With unaligned rows every access is a scalar one with its own 64-bit address: one
        # offset for both tensors where their strides agree halves that arithmetic (H200, bf16
        # N = 65537: 2.1x faster together with the tile below).
        dy_offs = rows64[:, None] * stride_dy + cols[None, :]
        dy = tl.load(dy_ptr + dy_offs, mask=mask, other=0.0).to(tl.float32)
        if NEED_DW:
            x_offs = dy_offs if ONE_STRIDE else rows64[:, None] * stride_x + cols[None, :]
            x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            # no select on xhat: masked lanes have dy = 0, and a non-finite xhat there lies in
            # a column past N (never stored) or a row whose own columns are NaN already
            dw_acc += dy * ((x - mean[:, None]) * rstd[:, None])
        if NEED_DB:
            db_acc += dy
    # float32 partials, or (one split) dweight/dbias themselves in the parameters' dtypes
    if NEED_DW:
        tl.store(dw_part_ptr + split.to(tl.int64) * N + cols,
                 tl.sum(dw_acc, axis=0).to(dw_part_ptr.dtype.element_ty), mask=col_mask)
    if NEED_DB:
        tl.store(db_part_ptr + split.to(tl.int64) * N + cols,
                 tl.sum(db_acc, axis=0).to(db_part_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _sum_partials(part_ptr, dw_ptr, db_ptr, P, N, FIRST: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_C: tl.constexpr):
    # part: (2, P, N) float32 (dweight, dbias partials); program (column block, set - FIRST).
    # A fixed (BLOCK_P, BLOCK_C) tile order and reduction tree: bitwise reproducible run to run,
    # and wide enough that thousands of partial rows do not serialise into dependent loads.
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    which = tl.program_id(1) + FIRST
    cmask = cols < N
    base = part_ptr + which.to(tl.int64) * P * N
    acc = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        acc += tl.load(base + p.to(tl.int64)[:, None] * N + cols[None, :],
                       mask=(p < P)[:, None] & cmask[None, :], other=0.0)
    total = tl.sum(acc, axis=0)
    # dweight/dbias may be in the parameters' dtypes: rounded once, from the float32 sum.
    if which == 0:
        tl.store(dw_ptr + cols, total.to(dw_ptr.dtype.element_ty), mask=cmask)
    else:
        tl.store(db_ptr + cols, total.to(db_ptr.dtype.element_ty), mask=cmask)


# Forward: weight/bias stay in registers across a program's row tiles while each thread holds
# at most this many row elements (and the program has at most 16 warps, so 128+ registers per
# thread); otherwise they are reloaded per tile from L2. Measured on H200: holding them at 64
# elements per thread (8K columns, 4 warps) or at 32 warps (32K columns) spills and costs
# 10-30%.
FWD_HOLD_W_MAX_PER_THREAD = 32


def _hold_w(block: int, warps: int) -> bool:
    return warps <= 16 and block // (32 * warps) <= FWD_HOLD_W_MAX_PER_THREAD


# Split-row kernels: (largest piece in elements, warps, PREFETCH) per program. A row of N is cut
# into C = ceil(N / piece) equal pieces (no nearly empty last piece at N = 2^k + 1).
# None = the measured defaults below; a tuple overrides them (experiments).
SPLIT_CONFIG: tuple[int, int, int] | None = None
SPLIT_BWD_CONFIG: tuple | None = None
# The backward's split kernel on unaligned rows as aligned-body pieces plus the edges (VEC > 0):
# element size -> (config, shortest body it runs from); elsewhere scalar pieces, or PyTorch's
# native kernel for 16-bit rows (NATIVE_UNALIGNED_16BIT_BWD). H200, float32, TB/s on 4096 x 4
# prefetching after the wait against scalar pieces: 16385
# 2.81 vs 1.78, 32769 2.81 vs 2.02, 65537 2.51 vs 1.89 (8192 x 8: 2.53), 131073 2.51 vs 1.80,
# 262145 2.35 vs 1.64 (C·VEC = 260 programs: two per SM on 132 SMs). 16-bit rows gained
# nothing: 1.10 at best at 65537 (2048 x 8, 112-117 registers) against the native kernel's
# 1.11, 0.99 on 4096 x 8 capped at 128 registers (ptxas sm_90: 128 bytes of spills; the edge
# tile, its accumulators and the per-program head cost the aligned kernel's last registers),
# 16385 / 32769 slower (1.03 / 0.71 vs 1.21 / 1.16): the per-row work (two more block
# reductions for the edges, the wait) outweighs the vector accesses when a piece moves only 2
# bytes per element. A grid of C·VEC programs must fit at once (a program's rows share one
# misalignment) unless every item gets its own program; where none fits, scalar pieces.
VEC_SPLIT_BWD: dict[int, tuple[tuple, int]] = {4: ((4096, 4, 2), 16384)}


def _split_config(kind: str, n: int, elt_size: int, aligned: bool,
                  vec: int = 0) -> tuple | None:
    """(piece, warps, PREFETCH) of the split-row LayerNorm kernel for rows of ``n``, or None
    where the other kernels measured faster (H200 unless noted; PREFETCH: see _common.py).

    Forward: aligned float32 8192 on 4 warps with the next row prefetched (TB/s at 64K / 128K /
    256K: 2.96 / 2.85 / 2.72 vs 2.25 / 2.09 / 1.79 at 4096 x 4), 16-bit 8192 on 8 warps (bf16
    128K: 2.23 vs 2.08 on 4; H100, 64K: 2.11-2.14 vs 2.04 on 4, 1.94 looped); aligned
    16-bit rows of 256K+ stream faster looped (2.37 vs 2.00); unaligned rows (aligned-body
    pieces) 8192 on 4 warps prefetching between publishing and waiting (H100, N =
    65537: bf16 1.56 vs 1.38 at 16384 x 16 prefetching before publishing, fp16 1.59 vs 1.40,
    float32 1.86 vs 1.76).
    Backward (a fourth value: a register cap, see Launcher): 16-bit rows up to 64K on 4096 x 8
    prefetching before publishing, capped at 128 registers (H100, bf16 16K / 32K /
    64K: 2.00 / 2.00 / 1.95 vs 1.65 dx + column kernels / 1.67 at 8192 x 8 / 1.88 at 8192 x
    16), 128K 8192 x 16 (1.86), longer 8192 x 8 prefetching between publishing and waiting
    (256K: 1.75 vs 1.62); float32 from 2048 x 4 to 8192 x 8 as rows grow (H200: 8193: 1.86 vs
    1.51 at 4096 x 4; 16K: 3.14; 64K: 3.12 vs 2.71; 256K: 2.83 vs 1.47).
    A fifth value True: the pieces of a row run as one thread-block cluster exchanging on chip
    (``runtime/clusters.py``; aligned rows on Hopper, else the same pieces on a cooperative grid).
    H100, a probe of the cluster kernel against the cooperative rules above in the same run
    (TB/s of 3·M·N·size bytes, copy 3.01): 16-bit 16K and 32K 2048 x 4 capped at 128 (bf16
    2.34 / 2.27 vs 2.08 / 2.04; 4096 x 8: 2.28 / 2.18), 64K 4096 x 8 (2.10 vs 1.98; 128K on
    8192 x 16 measured level, 1.81 vs 1.85, and stays cooperative); float32 16K-64K 8192 x 8
    (2.85 / 2.80 / 2.77 vs 2.60 / 2.59 / 2.63)."""
    override = SPLIT_CONFIG if kind == "fwd" else SPLIT_BWD_CONFIG
    if override is not None:
        return override
    if kind == "fwd":
        if not aligned:
            return 8192, 4, 3
        if elt_size == 2 and n >= 262144:
            return None
        return (8192, 4, 1) if elt_size == 4 else (8192, 8, 1)
    if vec:  # unaligned rows as aligned-body pieces plus edges (see VEC_SPLIT_BWD)
        rule = VEC_SPLIT_BWD.get(elt_size)
        return rule[0] if rule and body_len(n, vec) >= rule[1] else None
    if elt_size == 2:
        if not aligned:  # scalar accesses (rarely run: see NATIVE_UNALIGNED_16BIT_BWD)
            return (8192, 8, 2) if n <= 32768 else (8192, 16, 1)
        if CLUSTER_BWD and 16384 <= n <= 32768:
            return 2048, 4, 1, 128, True
        if CLUSTER_BWD and 32768 < n <= 65536:
            return 4096, 8, 1, 128, True
        if n <= 65536:
            return 4096, 8, 1, 128
        return (8192, 16, 1) if n <= 131072 else (8192, 8, 3)
    if CLUSTER_BWD and aligned and 16384 <= n <= 65536:
        return 8192, 8, 1, None, True
    if n < 16384:
        return (2048, 4, 2)
    if n <= 32768:
        return (2048, 4, 0)
    return (4096, 4, 2) if n <= 65536 else (8192, 8, 2)


# The backward's cluster rules in _split_config (tests turn them off to compare).
CLUSTER_BWD = True

# 16-bit rows whose starts are not 16-byte aligned (N not a multiple of 8, e.g. 2^k + 1), too
# long for the fused single kernel, that cannot take DX_PIECES_BWD (below: strides differing
# between x and dy, unaligned base pointers, deterministic mode): every Triton kernel here then
# reads and writes with scalar 2-byte accesses, and the best of them (the split backward)
# measured 1.01 TB/s against PyTorch's native backward's 1.23 at N = 8193 (bf16, H200). Those
# calls run PyTorch's native CUDA kernel instead (same math: fp32 statistics from our forward,
# fp32 accumulation).
NATIVE_UNALIGNED_16BIT_BWD = True

# 16-bit rows not a multiple of 8 and too long for the fused kernel, whose starts allow vector
# accesses (see unaligned_vec): dx from _ln_bwd_dx_pieces, one program per row reading its
# aligned body plus edges twice (the second time from L2) in pieces of (piece, warps), then the
# column kernel for dweight/dbias (x and dy read again: 5 passes, but every dx access a 16-byte
# vector). H200, TB/s of the op's 3·M·N·2 bytes against PyTorch's native backward (and
# torch.compile: benchmarks/results/h200/sweep.json, bf16 65537: 1.46 vs torch 1.10, compile
# 1.21): bf16 16385 1.63 vs 1.21, 65537 1.46 vs 1.11, 131073 1.41 vs 0.84; pieces (4096, 8) /
# (4096, 4) / (8192, 8):
# 16385 1.59 / 1.56 / 1.38, 32769 1.49 / 1.48 / 1.46, 131073 1.40 / - / 1.38, 65537 (2048, 4)
# 1.45, (4096, 4) 1.43, (8192, 8) 1.42. None: off (the paths below).
DX_PIECES_BWD: tuple[int, int] | None = (4096, 8)


def _dx_pieces_plan(N: int, x: torch.Tensor, dy: torch.Tensor) -> tuple | None:
    """(C, L, VEC, warps) of the dx-pieces backward (DX_PIECES_BWD) for rows of ``N``, or None
    where it does not run."""
    if DX_PIECES_BWD is None or x.element_size() != 2 or next_pow2(N) <= FUSED_BWD_MAX_BLOCK:
        return None
    vec = unaligned_vec(N, (dy.stride(0), x.stride(0), N), 2, (dy, x))
    if not vec:
        return None
    piece, warps = DX_PIECES_BWD
    return (*split_pieces(N, piece, vec), vec, warps)


def _native_unaligned(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor | None) -> bool:
    n = x.shape[1]
    return (NATIVE_UNALIGNED_16BIT_BWD and x.is_cuda and x.element_size() == 2 and n % 8 != 0
            and next_pow2(n) > FUSED_BWD_MAX_BLOCK and x.is_contiguous() and dy.is_contiguous()
            and dy.dtype == x.dtype and (weight is None or weight.dtype == x.dtype))


def _native_backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db):
    M, N = x.shape
    # The native kernel only reads bias's shape and dtype (to allocate dbias): the weight serves.
    bias = weight if weight is not None else (
        torch.empty((N,), dtype=x.dtype, device=x.device) if need_db else None)
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        dy, x, [N], mean.view(M, 1), rstd.view(M, 1), weight, bias,
        [need_dx, need_dw and weight is not None, need_db])
    # dweight/dbias come back in the weight's dtype (accumulated in float32 by the kernel).
    return (dx if need_dx else None, dw if need_dw else None, db if need_db else None)


# Backward strategy (module docstring). Padded rows up to FUSED_BWD_MAX_BLOCK run one persistent
# kernel that writes dx and accumulates dweight/dbias partials per program (3 passes of memory
# plus (2, programs, N) float32 partials; above 8K the row and the accumulators no longer fit
# one program's registers without spilling). Longer rows run the split-row kernel where
# _split_config says so, else the dx row kernel plus the column dweight/dbias kernel (x and dy
# read twice: 5 passes).
FUSED_BWD_MAX_BLOCK = 8192
# Override for experiments (a launch-rule sweep): (tile elements, programs per SM, ACC_1D).
FUSED_BWD_OVERRIDE: tuple[int, int, bool] | None = None


def _max_partial_rows(x: torch.Tensor) -> int:
    """Most (2, N) float32 partial rows a backward call may allocate: 1/8 of x's bytes, so
    small batches do not pay scratch comparable to their activations (peak memory stays
    within a few percent of torch's); large ones are not limited by it."""
    return max(1, x.numel() * x.element_size() // 8 // (8 * x.shape[1]))


def _fused_bwd_config(block: int, body: bool = False,
                      elt_size: int = 2) -> tuple[int, int, int, bool]:
    """(ROWS, num_warps, programs per SM, ACC_1D) of the fused backward for padded rows of
    ``block`` (``body``: the aligned body of unaligned rows, on ``elt_size``-byte elements).
    Measured on H200: 4096-element tiles at two
    programs per SM up to 2K columns, with (ROWS, BLOCK) accumulators while a tile holds 4+ rows
    (folding rows every tile costs a cross-warp reduction); above, one 16-warp program per SM
    on 16K-element tiles (4 rows of 4K, 2 of 8K). More programs per SM write more partial rows
    (2·programs·N·4 bytes).

    The body variant keeps edge accumulators and addresses besides the body's, and spills on
    multi-row tiles (ptxas sm_90: 208 bytes at an 8K body on 2 rows, 656 at 4K on 4 rows): one
    row per tile, two programs per SM, except float32 bodies of 4K+ on 8K-element tiles (H100,
    TB/s vs the earlier multi-row tiles: 8193 bf16 1.75 vs 1.08, float32 2.81
    vs 1.86; 4097 float32 2.81 vs 2.51, 16-bit 1.42 vs 0.83-1.44; 2049 within 3%).
    Aligned float32 rows of 4K-8K take the same 8K-element tiles (H100, two runs: 8K
    2.85-2.86 vs 2.72-2.73 on 16K-element tiles, where Liger was faster; 4K 2.87 vs 2.83-2.84;
    benchmarks/results/h100/sweep.json: float32 8K at 0.96 of copy, ahead of every provider)."""
    if FUSED_BWD_OVERRIDE is not None:
        tile, per_sm, acc_1d = FUSED_BWD_OVERRIDE
    elif elt_size == 4 and block >= 4096:
        tile, per_sm, acc_1d = 8192, 1, True
    elif body:
        tile, per_sm, acc_1d = block, 2, True
    elif block == 512 and elt_size == 2:  # H200: bf16 3.15 vs 2.96, fp16 3.20 vs 3.02
        tile, per_sm, acc_1d = 2048, 4, False
    elif block <= 2048:
        tile, per_sm, acc_1d = 4096, 2, block > 1024
    else:  # 16K-element 16-warp tiles: bf16 8K 3.55 vs 2.27 TB/s, bf16 4K 3.52 vs 2.69
        tile, per_sm, acc_1d = 16384, 1, True
    tile = max(tile, block)
    return tile // block, max(4, min(16, tile // 512)), per_sm, acc_1d


# Unaligned rows take the fused kernel's aligned-body variant only from bodies of this many
# elements. With multi-row tiles it measured slower than the padded scalar variant below 8K
# (H200: 4097 bf16 0.56 vs 1.49); on one-row tiles (H100) it is level at 2049 and ahead from
# 4097.
FUSED_BWD_UNALIGNED_MIN_BLOCK = 2048


def _paired_sums(elt_size: int, vec: int, block: int) -> bool:
    """Whether the fused backward forms its two row sums in one paired reduction (PAIRED):
    aligned 16-bit rows of blocks up to 4K. H200, TB/s, separate ->
    paired): bf16 4K 3.42 -> 3.65, 2K 3.06 -> 3.19, 1K 3.06 -> 3.16, 768 2.59 -> 2.70 (fp16
    alike); where both operands live at once cost registers it is slower: 5120 (8K blocks)
    2.74 -> 2.45, float32 8K 3.83 -> 3.44, 16-bit 8193 bodies 1.83 -> 1.69 (8192: 3.51 -> 3.58,
    within noise, left separate with its padded neighbours). Unaligned 16-bit bodies (one-row
    tiles) pair since their edge tile is 1-D (H100, same process, three
    alternations, fraction of copy separate -> paired: 8193 0.72 -> 0.73, 4097 0.57 -> 0.59,
    2049 0.63 -> 0.65; half the barriers per row, the same instruction count, no spills)."""
    return PAIRED_SUMS and elt_size == 2 and (vec > 0 or block <= 4096)


PAIRED_SUMS = True  # off: the separate reductions (for experiments)

# The fused backward's tile loop pipelined by Triton (num_stages) for these padded blocks of
# 16-bit rows whose starts are 16-byte aligned. H100, TB/s (not pipelined -> three stages, the
# same process): bf16 768 2.34 -> 2.73, 1K 2.58-2.59 -> 2.65-2.69 (five
# runs), 2K 2.58-2.60 -> 2.69-2.72, fp16 alike; slower at 256/512 (2.69 -> 2.61) and 4K (2.78
# -> 2.72), level on float32 (whose 4K+ tiles also do not fit shared memory three deep).
PIPELINED_BWD_BLOCKS: frozenset[int] = frozenset({1024, 2048})
FUSED_BWD_STAGES: int | None = None  # override for experiments


def _fused_bwd_stages(block: int, elt_size: int, strides: tuple[int, ...]) -> int:
    """num_stages of the fused backward's tile loop (1: not pipelined) for padded rows of
    ``block`` elements of ``elt_size`` bytes with these row strides (PIPELINED_BWD_BLOCKS)."""
    if FUSED_BWD_STAGES is not None:
        return FUSED_BWD_STAGES
    aligned = all(s % 8 == 0 for s in strides)
    return 3 if elt_size == 2 and aligned and block in PIPELINED_BWD_BLOCKS else 1


# The split-row backward's two piece sums in one paired reduction. H200, TB/s, separate ->
# paired: float32 16K 3.16 -> 3.23, 64K 3.11 -> 3.15, bf16 32K 2.24 -> 2.30; the
# rest within 1% either way.
SPLIT_PAIRED = True


def _fused_plan(M: int, N: int, x: torch.Tensor, dy: torch.Tensor):
    """(VEC, BLOCK, ROWS, warps, ACC_1D, tiles, programs) of the fused backward for (M, N) rows,
    or None where rows are too long for it. Unaligned rows (VEC > 0, see ``unaligned_vec``) are
    configured for their aligned body (N = 8193: 8192, not 16384) on a grid that is a multiple
    of VEC or has one tile per program (a program's accumulators then stay on fixed columns);
    where the partial-row budget allows no such grid, or the body is shorter than
    FUSED_BWD_UNALIGNED_MIN_BLOCK, they are read with scalar accesses."""
    vec = unaligned_vec(N, (dy.stride(0), x.stride(0), N), x.element_size(), (dy, x))
    if vec and next_pow2(body_len(N, vec)) < FUSED_BWD_UNALIGNED_MIN_BLOCK:
        vec = 0
    for v in (vec, 0) if vec else (0,):
        block = next_pow2(body_len(N, v))
        if block > min(FUSED_BWD_MAX_BLOCK, single_block_limit()):
            continue
        rows, warps, per_sm, acc_1d = _fused_bwd_config(block, v > 0, x.element_size())
        tiles = num_row_tiles(M, rows, v)
        progs = max(1, min(tiles, num_sms(x.device) * per_sm, _max_partial_rows(x)))
        if v and progs < tiles:
            progs = progs // v * v
            if not progs:
                continue
        return v, block, rows, warps, acc_1d, tiles, progs
    return None


# The dweight/dbias column kernel: (columns, rows) per iteration, warps, programs per SM.
# H200 (bf16, µs for dweight + dbias, the column kernel timed alone): N = 65537
# 187 on (128, 64) x 16 warps, one program per column block, vs 622 on the earlier (256, 32) x 8
# at eight programs per SM; N = 16384 140 on (64, 64) x 16 at two per SM vs 167.
COLUMN_TILE = (128, 64)
COLUMN_WARPS = 16
COLUMN_PER_SM = 2

_launch_fwd_single = Launcher(_ln_fwd_single)


def _param_ptr(t, dtype, n: int, device: int) -> int:
    """The address of parameter ``t`` (weight or bias) if a replayed plan, made for a parameter
    of ``dtype`` (None: no parameter) on ``device``, can read it as it read the registering
    call's: a plain tensor or Parameter of that dtype and shape (n,), contiguous, 16-byte
    aligned, on that CUDA device; -1 otherwise (0 for no parameter)."""
    if t is None:
        return 0 if dtype is None else -1
    cls = t.__class__
    if ((cls is not torch.Tensor and cls is not torch.nn.Parameter) or t.dtype is not dtype
            or not t.is_cuda or t.get_device() != device
            or t.shape != (n,) or not t.is_contiguous()):
        return -1
    p = t.data_ptr()
    return -1 if p & 15 else p


def _replay_runner(key: tuple, plan: tuple):
    """The ``fusedops._replay.LAYERNORM`` entry for a new inference forward plan (out dtype =
    x's dtype, no statistics)."""
    shape, dtype, out_dtype, device, eps, with_stats, w_dtype, b_dtype = key
    if out_dtype is not dtype or with_stats:
        return None
    (launch, function, coop, pdl, metadata), (g,), tail = plan[0].c_entry, plan[1], plan[3]
    n = shape[-1]

    def run(x: torch.Tensor, weight, bias) -> torch.Tensor | None:
        p = x.data_ptr()
        if p & 15 or not x.is_contiguous() or not x.is_cuda or hooks_registered():
            return None
        wp = _param_ptr(weight, w_dtype, n, device)
        bp = _param_ptr(bias, b_dtype, n, device)
        if wp < 0 or bp < 0:
            return None
        y = torch.empty_like(x)
        yp = y.data_ptr()
        # Absent parameters: y's address as the placeholder, as in _forward (never read).
        launch(g, 1, 1, current_stream(device), function, coop, pdl, None, None, metadata, None,
               None, None, p, wp or yp, bp or yp, yp, yp, yp, *tail)
        return y
    return (shape, dtype, device, eps), run


# Single-block forward launches, per (shape, dtypes, device, eps, with_stats): see _forward.
# Inference plans (out dtype = x's dtype, no statistics) are also replayed from the ops layer
# (fusedops._replay).
_fwd_plans = PlanCache(_replay.LAYERNORM, _replay_runner)
_launch_shift_weights = Launcher(_shift_weights)
_launch_fwd_looped = Launcher(_ln_fwd_looped)
_launch_fwd_reload = Launcher(_ln_fwd_reload)
_launch_fwd_unrolled = Launcher(_ln_fwd_unrolled)
_launch_fwd_reload_vec = Launcher(_ln_fwd_reload_vec)
_launch_fwd_unrolled_vec = Launcher(_ln_fwd_unrolled_vec)
_launch_fwd_split = SplitLauncher(_ln_fwd_split)
_launch_bwd_single = Launcher(_ln_bwd_single)
_launch_bwd_split = SplitLauncher(_ln_bwd_split)
_launch_dx_looped = Launcher(_ln_bwd_dx_looped)
_launch_dx_pieces = Launcher(_ln_bwd_dx_pieces)
_launch_dx_published = Launcher(_ln_bwd_dx_published)
_launch_dwdb_columns = Launcher(_ln_bwd_dwdb_columns)
_launch_sum = Launcher(_sum_partials)
# Backward replay plans (see layernorm_backward): only where launches can take the direct path
# (not under the interpreter; the plans themselves also need Triton 3.6's raw-pointer entries).
# FUSEDOPS_BWD_PLANS=0 turns them off.
BWD_PLANS = _launch_sum.direct and __import__("os").environ.get("FUSEDOPS_BWD_PLANS", "1") != "0"
_capped_bwd_split: dict[int, SplitLauncher] = {}  # by register cap (see _split_config)


def _bwd_split_launcher(maxnreg: int | None) -> SplitLauncher:
    if not maxnreg:
        return _launch_bwd_split
    launcher = _capped_bwd_split.get(maxnreg)
    if launcher is None:
        launcher = _capped_bwd_split[maxnreg] = SplitLauncher(_ln_bwd_split, maxnreg=maxnreg)
    return launcher


_bwd_cluster: dict[int | None, ClusterLauncher] = {}  # by register cap


def _bwd_cluster_launcher(maxnreg: int | None) -> ClusterLauncher:
    launcher = _bwd_cluster.get(maxnreg)
    if launcher is None:
        launcher = _bwd_cluster[maxnreg] = ClusterLauncher(_ln_bwd_split, maxnreg=maxnreg)
    return launcher


def _reduce_partials(part: torch.Tensor, need_dw: bool, need_db: bool, out=None,
                     dtypes=None):
    """Sum (2, P, N) float32 partials over P in a fixed order: (dweight, dbias), each a separate
    (N,) tensor (outputs of a custom op must not alias each other) or None, in ``dtypes``
    (weight's, bias's; None: float32); ``out``: two (N,) tensors to write instead."""
    _, P, N = part.shape
    if out is not None:
        dw = out[0] if need_dw else None
        db = out[1] if need_db else None
    else:
        dt_w, dt_b = dtypes or (None, None)
        dw = (torch.empty((N,), dtype=dt_w or torch.float32, device=part.device)
              if need_dw else None)
        db = (torch.empty((N,), dtype=dt_b or torch.float32, device=part.device)
              if need_db else None)
    block_p, block_c = 32, 64
    _launch_sum((cdiv(N, block_c), int(need_dw) + int(need_db)), (
        part, dw if need_dw else db, db if need_db else dw, P, N, 0 if need_dw else 1,
        block_p, block_c), 4)
    return dw, db


SHIFT_W_BLOCK = 1024  # columns per program of _shift_weights


def _shifted_weights(w: torch.Tensor | None, b: torch.Tensor | None, vec: int, n: int):
    """(weight copies, bias copies, row stride): (vec, ld) tensors whose row h holds columns
    h.. of ``w`` (``b``), zero-padded to ``ld`` (a multiple of 16 elements); None for an absent
    tensor."""
    ld = cdiv(n, 16) * 16
    if w is not None and b is not None and w.dtype == b.dtype:
        both = torch.empty((2, vec, ld), dtype=w.dtype, device=w.device)
        ws, bs = both[0], both[1]
    else:
        ws = torch.empty((vec, ld), dtype=w.dtype, device=w.device) if w is not None else None
        bs = torch.empty((vec, ld), dtype=b.dtype, device=b.device) if b is not None else None
    some = ws if ws is not None else bs
    _launch_shift_weights((vec, cdiv(ld, SHIFT_W_BLOCK)), (
        w if w is not None else some, b if b is not None else some,
        ws if ws is not None else some, bs if bs is not None else some, n, ld,
        w is not None, b is not None, SHIFT_W_BLOCK), 4)
    return ws, bs, ld


def layernorm_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row LayerNorm. x: (M, N) float32/float16/bfloat16, unit column stride, any row stride;
    weight/bias: contiguous (N,) of any float dtype, or None.

    Returns y (M, N) contiguous of ``out_dtype``, mean and rstd (M,) float32.
    """
    return _forward(x, weight, bias, eps, out_dtype, True)


# Inference calls use the kernel variant that writes no mean/rstd (and allocate neither), except
# 16-bit rows of 8K+ columns above this many elements. Measured on H200 at M·N = 2^27 (the same
# kernel, STATS on vs off): bf16 2K 3.63 vs 3.99 TB/s (two sweeps), 4K 3.69 vs 3.62, 8K 3.62 vs
# 2.98, 16K 2.78 vs 2.71; fp16 within 2%; float32 8K 4.02 vs 4.04, 16K 3.52 vs 3.80. Calls this
# small are bound by host time, where two allocations count.
STATS_FREE_16BIT_MAX = 1 << 22


def layernorm_forward_y(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`layernorm_forward` for calls that need no backward: returns only y. Rows held in
    registers skip the mean/rstd buffers altogether (two allocations less per call). ``x`` may
    also be a contiguous tensor of any rank >= 1 normalised over its last dim; y has its shape."""
    return _forward(x, weight, bias, eps, out_dtype, False)[0]


# Aligned rows read whole, then again from L2 (_ln_fwd_reload): (element size, padded row) ->
# (second-pass chunk, warps[, THIRD_READ]). H200, TB/s vs the kernels these rows ran
# before: 16-bit 4K 4.04 vs 3.70 (single-block); 8K 3.83-3.96
# vs 3.62; 16K 3.74-3.83 vs 3.10-3.31 (looped; 32 warps: 3.17-3.50); float32 16K 4.01 vs 3.51,
# 32K 3.73 vs 3.24 (single-block); 16-bit 32K with THIRD_READ (bf16 3.51 vs 3.17,
# fp16 3.55 vs 3.20; without it 2.96-3.07). Float32 4K (4.12 vs 3.86-4.10) stays.
RELOAD_FWD: dict[tuple[int, int], tuple] = {
    (2, 4096): (1024, 4), (2, 8192): (1024, 8), (2, 16384): (4096, 16),
    (2, 32768): (8192, 32, True), (4, 16384): (2048, 16), (4, 32768): (8192, 32),
}
RELOAD_FWD_ABOVE = 2048  # shorter rows skip the lookup (no rule below 4K; saves host time)

# Aligned rows on _ln_fwd_unrolled (N compile-time): (element size, padded row) -> (chunk,
# warps) configs, the first whose chunk divides N taken; warps 0 sends those rows to the other
# kernels (RELOAD_FWD and below), as do rows no chunk divides. H200 (TB/s;
# "was": the kernels these rows ran before, same run; compile: torch.compile, same run):
#   16-bit  1K 4.08-4.17 was 3.91-4.03 | 2K 3.85-4.17 was 3.66-4.06 | 8K 3.91-4.07 was
#   3.81-3.98 (compile 3.62) | 16K 4.04-4.10 was 3.76-3.88 (compile 3.95-3.99) | 32K 3.76-3.90
#   was 3.51-3.57 | 64K 3.10-3.20 was 2.30-2.34. 4K: level (4096 x 8 slower with statistics).
#   bf16, other lengths: 1536 on 512 x 4 3.81 was 3.52, 2560 4.10 was 2.94, 3072 on 1K x 4 4.11
#   was 3.40, 5120 on 1K x 8 4.10-4.13 was 2.77, 6144 4.08 was 3.24, 7168 4.01 was 3.60, 12288
#   3.91-3.93 was 3.07, 20480 on 1K x 8 3.03 was 2.77, 24576 3.84 was 3.18.
#   float32 1K 4.22-4.25 was 4.05-4.07 (compile 4.18) | 2K 4.11-4.24 was 4.08-4.09 | 4K on 2K x
#   16 4.16-4.21 was 4.06-4.16 (compile 4.23-4.25; the whole row in one 4096 x 16 chunk: 4.18
#   with statistics, 3.86-3.91 without) | 8K 4.19-4.21 was 4.04-4.05 (compile 4.22) |
#   64K on 16K x 32 3.07-3.13 was 2.94-2.99 (8K x 32: 2.71-3.08) | 2560 on 512 x 4 3.88 was
#   3.50, 3072 on 1K x 8 4.14 was 3.88, 5120 4.06 was 3.26, 6144 4.20 was 3.68, 7168 3.81 was
#   3.93 (the one length measured slower). 16K-32K: level or slower, no rule.
#   Long rows: bf16 128K on 16K x 32 2.98 was 2.23 (split rows; 8K x 32 2.56), 256K 2.66 was
#   2.36 (8K x 16 2.48).
UNROLLED_FWD: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {
    (2, 1024): ((512, 2),), (2, 2048): ((2048, 4), (512, 4)),
    (2, 4096): ((4096, 0), (1024, 4), (512, 4)), (2, 8192): ((2048, 8), (1024, 8)),
    (2, 16384): ((4096, 16),), (2, 32768): ((8192, 32), (1024, 8)),
    (2, 65536): ((16384, 32),), (2, 131072): ((16384, 32),), (2, 262144): ((16384, 32),),
    (4, 1024): ((1024, 4),), (4, 2048): ((2048, 8),),
    (4, 4096): ((2048, 16), (1024, 8), (512, 4)), (4, 8192): ((2048, 16), (1024, 8)),
    (4, 65536): ((16384, 32),),
}
UNROLLED_FWD_ABOVE = 512  # shorter rows skip the lookup

# Entries of UNROLLED_FWD replaced on GPUs whose name contains the key. H100 (inference calls,
# TB/s, torch.compile in the same run), where the H200's rules left the 16-bit forward 2-3%
# behind compile at 8K and Liger at 4K: 16-bit 8K on
# 2048 x 16 2.93-2.96 vs 2.85-2.88 on 2048 x 8 (compile 2.95-2.96), 4K on 2048 x 8 2.94 vs
# 2.88-2.89 on the reload kernel. (The H200 measured the other way: 8K 2048 x 16 3.72-3.84 vs
# 2048 x 8 4.06-4.07, 4K 2048 x 8 3.86 vs 4.02-4.04.) benchmarks/results/h100/sweep.json:
# 16-bit 4K and 8K at 0.99 of copy, level with or ahead of compile and Liger.
UNROLLED_FWD_GPU: dict[str, dict[tuple[int, int], tuple[tuple[int, int], ...]]] = {
    "H100": {(2, 4096): ((2048, 8), (1024, 4), (512, 4)), (2, 8192): ((2048, 16), (1024, 8))},
}


def _unrolled_fwd_table(device_index: int, key: tuple[int, int]) -> dict:
    """The rule table to read ``key`` ((element size, padded row)) from on CUDA device
    ``device_index`` (-1: the CPU): a matching GPU's UNROLLED_FWD_GPU rules where they hold
    ``key``, else UNROLLED_FWD. No table is built per call; both are read per call, so tests
    and tuning can change either."""
    if device_index >= 0 and UNROLLED_FWD_GPU:
        name = device_name(device_index)
        for part, rules in UNROLLED_FWD_GPU.items():
            if key in rules and part in name:
                return rules
    return UNROLLED_FWD


def _stats_buffers(M: int, device: torch.device, with_stats: bool, placeholder: torch.Tensor):
    """(mean, rstd) float32 (M,) buffers, or the placeholder twice (never written without
    STATS) for the reload kernels' inference calls."""
    if not with_stats:
        return placeholder, placeholder
    return (torch.empty((M,), dtype=torch.float32, device=device),
            torch.empty((M,), dtype=torch.float32, device=device))


def _forward_reload(x, w, b, y, M, N, stride, eps, has_w, has_b, with_stats, chunk, warps,
                    third_read=False, key=None):
    """``key``: the call's plan key where its launch may be replayed (the statistics written
    exactly as the call asked)."""
    mean, rstd = _stats_buffers(M, x.device, with_stats, y)
    if M > 0:
        args = (x, w, b, y, mean, rstd, N, stride, N, eps, next_pow2(N), chunk, has_w, has_b,
                with_stats, third_read)
        _launch_fwd_reload((M,), args, warps)
        if key is not None:
            _fwd_plans.add(key, _launch_fwd_reload, (M,), args, warps, 6)
    return (y, mean, rstd) if with_stats else (y, None, None)


def _forward_unrolled(x, w, b, y, M, N, stride, eps, has_w, has_b, with_stats, chunk, warps,
                      key):
    mean, rstd = _stats_buffers(M, x.device, with_stats, y)
    if M > 0:
        args = (x, w, b, y, mean, rstd, M, stride, N, eps, N, chunk, has_w, has_b, with_stats)
        _launch_fwd_unrolled((M,), args, warps)
        if key is not None:
            _fwd_plans.add(key, _launch_fwd_unrolled, (M,), args, warps, 6)
    return (y, mean, rstd) if with_stats else (y, None, None)


# Unaligned rows (VEC > 0) on _ln_fwd_reload_vec: (element size, padded body) -> (chunk, warps).
# The single-block kernel's body loads of weight/bias start at the row's head column, which
# only scalar loads can do (ptxas sm_90, 16-bit 8193 on 4 warps: 153 scalar loads, 255
# registers, two 4-warp programs per SM; too few bytes in flight). H100, TB/s against the
# single-block kernel: bf16 / fp16 4097 2.87 / 2.88 vs 2.27 / 1.96, 8193 2.72 /
# 2.74 vs 1.71 / 1.97, 16385 2.65 / 2.68 vs 1.83 / 1.87, 32769 2.49 / 2.52 vs 0.52 / 0.56 (the
# chunk/warps neighbours within 3%). Float32 rows stay: 8193 2.82 vs 2.92 (4-byte scalar
# loads are half as many per byte of x).
RELOAD_VEC_FWD: dict[tuple[int, int], tuple[int, int]] = {
    (2, 4096): (1024, 4), (2, 8192): (1024, 8), (2, 16384): (4096, 16), (2, 32768): (8192, 32),
}
# ... for calls of at least this many elements: the shifted copies cost a launch and an
# allocation (14.5 µs of host time per call on an H100 host), which small calls do not win
# back. Wall time per call on an H100 host, bf16 rows of 8193: 512 rows 36.4 vs 22.2 µs
# single-block, 2048 rows 40.6 vs 48.2, 8192 rows 101 vs 156.
RELOAD_VEC_MIN_ELEMS = 1 << 24


def _forward_reload_vec(x, weight, bias, y, M, N, eps, with_stats, vec, chunk, warps,
                        unrolled: bool = False):
    """Unaligned rows (VEC > 0) on _ln_fwd_reload_vec or (``unrolled``) _ln_fwd_unrolled_vec,
    with weight and bias from per-misalignment shifted copies."""
    has_w, has_b = weight is not None, bias is not None
    w = b = y  # placeholders, never read (HAS_W/HAS_B are constexpr)
    w_ld = N
    if has_w or has_b:
        ws, bs, w_ld = _shifted_weights(weight, bias, vec, N)
        w, b = (ws if has_w else y), (bs if has_b else y)
    mean, rstd = _stats_buffers(M, x.device, with_stats, y)
    if M > 0 and unrolled:
        _launch_fwd_unrolled_vec((M,), (x, w, b, y, mean, rstd, M, N, eps, w_ld, N,
                                        (N // vec - 1) * vec, chunk, has_w, has_b, with_stats,
                                        vec), warps)
    elif M > 0:
        _launch_fwd_reload_vec((M,), (x, w, b, y, mean, rstd, N, N, eps, w_ld,
                                      next_pow2(body_len(N, vec)), chunk, has_w, has_b,
                                      with_stats, vec), warps)
    return (y, mean, rstd) if with_stats else (y, None, None)


# Unaligned rows (VEC > 0) with longer bodies on _ln_fwd_unrolled_vec (N compile-time, like
# UNROLLED_FWD): (element size, padded body) -> (chunk, warps), for calls of at least
# RELOAD_VEC_MIN_ELEMS elements whose body holds a chunk. H200, TB/s against
# the split-row kernel on aligned-body pieces: bf16 / fp16 65537 2.89 / 2.97 vs 1.64 / 1.66
# (8192 x 16: 2.54 / 2.73, 16384 x 32: 2.79 / 2.82), float32 65537 2.99 vs 2.05 (8192 x 32:
# 2.69), bf16 131073 2.63 vs 1.14 (8192 x 32: 2.24), 262145 2.17 vs 1.81 (16384 x 32: 2.15);
# float32 131073 2.36 vs 1.83 (16384 x 32: 2.35), 262145 2.30 vs 2.08 (2.24).
# (Aligned float32 128K / 256K stay on split rows: 2.84 / 2.72 vs 2.50-2.68 unrolled.)
UNROLLED_VEC_FWD: dict[tuple[int, int], tuple[int, int]] = {
    (2, 65536): (8192, 32), (4, 65536): (16384, 32), (2, 131072): (16384, 32),
    (2, 262144): (8192, 32), (4, 131072): (8192, 32), (4, 262144): (8192, 32),
}


def _forward(x, weight, bias, eps, out_dtype, with_stats: bool):
    # Contiguous x and parameters at 16-byte aligned addresses: the launch is fixed by shapes,
    # dtypes, device, eps and with_stats, so a call seen before replays its plan (PlanCache).
    key = ((x.shape, x.dtype, out_dtype, x.get_device(), eps, with_stats,
            None if weight is None else weight.dtype, None if bias is None else bias.dtype)
           if x.is_contiguous() and not x.data_ptr() & 15
           and (weight is None or not weight.data_ptr() & 15)
           and (bias is None or not bias.data_ptr() & 15) else None)
    plan = _fwd_plans.get(key)
    if plan is not None and not hooks_registered():
        return _replay_forward(plan, x, weight, bias, out_dtype, with_stats)
    requested_stats = with_stats
    M, N, stride, y = rows_and_output(x, out_dtype)
    has_w, has_b = weight is not None, bias is not None
    w = weight if has_w else y  # placeholders are never read (HAS_W/HAS_B are constexpr)
    b = bias if has_b else y
    vec = unaligned_vec(N, (stride, N), x.element_size(), (x, y))
    elt = x.element_size()
    unrolled = unrolled_config(_unrolled_fwd_table(x.get_device(), (elt, next_pow2(N))), elt,
                               N, UNROLLED_FWD_ABOVE, vec)
    if unrolled:
        return _forward_unrolled(x, w, b, y, M, N, stride, eps, has_w, has_b, with_stats,
                                 *unrolled, key)
    reload = (RELOAD_FWD.get((x.element_size(), next_pow2(N)))
              if N > RELOAD_FWD_ABOVE and not vec
              and single_block_limit() == DEFAULT_SINGLE_BLOCK_LIMIT else None)
    if reload:
        # Measured with the statistics written (see STATS_FREE_16BIT_MAX below).
        stats = with_stats or (x.element_size() == 2 and M * N > STATS_FREE_16BIT_MAX)
        return _forward_reload(x, w, b, y, M, N, stride, eps, has_w, has_b, stats, *reload,
                               key=key if stats == with_stats else None)
    reload = (RELOAD_VEC_FWD.get((x.element_size(), next_pow2(body_len(N, vec))))
              if vec and M * N >= RELOAD_VEC_MIN_ELEMS
              and single_block_limit() == DEFAULT_SINGLE_BLOCK_LIMIT else None)
    if reload:
        return _forward_reload_vec(x, weight, bias, y, M, N, eps, with_stats, vec, *reload)
    unrolled = (UNROLLED_VEC_FWD.get((x.element_size(), next_pow2(body_len(N, vec))))
                if vec and M * N >= RELOAD_VEC_MIN_ELEMS
                and single_block_limit() == DEFAULT_SINGLE_BLOCK_LIMIT else None)
    if unrolled and (N // vec - 1) * vec >= unrolled[0]:
        return _forward_reload_vec(x, weight, bias, y, M, N, eps, with_stats, vec, *unrolled,
                                   unrolled=True)
    single, block, rows, warps, vec = unaligned_config(N, "ln_fwd", x.element_size(), vec)
    if (not with_stats and x.element_size() == 2 and block >= 8192
            and M * N > STATS_FREE_16BIT_MAX):
        # The variant without statistics compiles slower for large 16-bit inputs with rows of
        # 8K+ (bf16 8K: 2.98 vs 3.62 TB/s); the two small buffers cost nothing next to the kernel.
        with_stats = True
    if single and not with_stats:
        mean = rstd = None
    else:
        mean = torch.empty((M,), dtype=torch.float32, device=x.device)
        rstd = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M == 0 or N == 0:
        return y, mean, rstd
    if single:
        tiles = num_row_tiles(M, rows, vec)
        # Unaligned 16-bit rows of 4K+: a persistent grid (H200, TB/s: bf16 4097 2.51
        # vs 2.29 one program per row, 8193 1.93 vs 1.77; float32 within 2%).
        persist = vec and x.element_size() == 2 and block >= 4096
        progs = grid_size(tiles, warps, "ln_fwd", x.device, block, vec, persist)
        args = (x, w, b, y, mean if with_stats else y, rstd if with_stats else y, M, N,
                stride, N, eps, tiles, progs,
                block, rows, has_w, has_b, vec, _hold_w(block, warps), with_stats)
        _launch_fwd_single((progs,), args, warps)
        if key is not None and not vec and with_stats == requested_stats:
            _fwd_plans.add(key, _launch_fwd_single, (progs,), args, warps, 6)
    else:
        cfg = _split_config("fwd", N, x.element_size(), stride % 8 == 0 and N % 8 == 0)
        chunk, split_warps, prefetch = cfg or (0, 0, 0)
        if cfg and split_rows_enabled(x.device, N, chunk):
            C, L = split_pieces(N, chunk, vec)
            stats = torch.empty((M * C * 2,), dtype=torch.float32, device=x.device)
            count = torch.zeros((M,), dtype=torch.int32, device=x.device)
            if _launch_fwd_split(
                M * C, C,
                (x, w, b, y, mean, rstd, stats, count, N, L, stride, N, eps, M * C),
                (next_pow2(L), C, next_pow2(C), has_w, has_b, prefetch, vec), split_warps,
                x.device, vec=vec,
            ):
                return y, mean, rstd
        _launch_fwd_looped((M,), (
            x, w, b, y, mean, rstd, N, stride, N, eps, block, has_w, has_b,
        ), warps)
    return y, mean, rstd


def _replay_forward(plan, x, weight, bias, out_dtype, with_stats: bool):
    """:func:`_forward` from a plan: the single-block or unrolled launch with this call's
    tensors (both take (x, w, b, y, mean, rstd, M, ...))."""
    go, grid, device, tail = plan
    y = torch.empty_like(x, dtype=out_dtype)
    yp = y.data_ptr()
    wp = yp if weight is None else weight.data_ptr()  # placeholders, as in _forward
    bp = yp if bias is None else bias.data_ptr()
    if not with_stats:
        go(grid, current_stream(device), (x.data_ptr(), wp, bp, yp, yp, yp, *tail))
        return y, None, None
    mean = torch.empty((tail[0],), dtype=torch.float32, device=x.device)
    rstd = torch.empty((tail[0],), dtype=torch.float32, device=x.device)
    go(grid, current_stream(device),
       (x.data_ptr(), wp, bp, yp, mean.data_ptr(), rstd.data_ptr(), *tail))
    return y, mean, rstd


# Backward replay plans (see _common.record_launches), per call signature: everything the
# launch rules read (shapes, strides, dtypes, 16-byte alignment of every pointer, the gradients
# needed, the mode, the device, torch's deterministic-algorithms flag, the row-body switch).
# Paths whose results come from launches alone into dx, dweight and dbias (scratch parked in
# dx: the low_memory mode) replay: the outputs allocated, then the recorded launches.
_bwd_plans = SequencePlans()


def layernorm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
    grad_dtypes: tuple[torch.dtype | None, torch.dtype | None] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of row LayerNorm.

    dy, x: (M, N) unit column stride, any row stride; weight: (N,) or None; mean/rstd: (M,)
    float32 from the forward. Returns dx (M, N) contiguous in x's dtype (or None), and (N,)
    dweight / dbias (or None): float32, reduced deterministically from per-program partials, or
    in the weight's dtype where PyTorch's native kernel runs (see NATIVE_UNALIGNED_16BIT_BWD).
    ``grad_dtypes``: (weight, bias) dtypes; the ``low_memory`` mode returns dweight/dbias in
    them (cast before dx overwrites the float32 sums kept in its storage).

    A call whose signature ran before through launches alone is replayed from them (the same
    launches, bitwise the same results, without the launch rules' host time). Only calls that
    give ``grad_dtypes`` (the eager autograd path) make and use plans: torch.compile's custom op
    (fusedops.ops._library) does not, because with a cold Triton cache, recording a plan inside
    the first warm-up of ``mode="reduce-overhead"`` made its CUDA graph trees report the
    forward's saved statistics as missing from their memory pool (H100, Triton 3.6, torch
    2.11; not understood; compiled graphs gain little from plans, CUDA graphs nothing).
    """
    if not BWD_PLANS or grad_dtypes is None:
        return _backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db, grad_dtypes)
    key = (*x.shape, x.stride(0), dy.stride(0), x.dtype, dy.dtype, x.data_ptr() & 15,
           dy.data_ptr() & 15, mean.data_ptr() & 15, rstd.data_ptr() & 15,
           None if weight is None else (weight.dtype, weight.data_ptr() & 15),
           need_dx, need_dw, need_db, grad_dtypes, get_layernorm_backward(), x.get_device(),
           torch.are_deterministic_algorithms_enabled(), ROW_BODY["enabled"])
    plan = _bwd_plans.get(key)
    if plan and not hooks_registered():
        return plan(dy, x, weight, mean, rstd)
    if plan is False:
        return _backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db, grad_dtypes)
    with record_launches() as record:
        out = _backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db, grad_dtypes)
    _bwd_plans.put(key, _backward_runner(record, (dy, x, weight, mean, rstd), out) or False)
    return out


def _backward_runner(record, inputs: tuple, out: tuple):
    """``run(dy, x, weight, mean, rstd) -> (dx, dweight, dbias)`` replaying ``record`` (the
    launches of the call that produced ``out``), or None where it cannot be replayed."""
    if any(t is not None and not t.is_contiguous() for t in out):
        return None
    steps = sequence_steps(record, (*inputs, *out), len(inputs))
    if steps is None:
        return None
    metas = tuple(None if t is None else (t.shape, t.dtype) for t in out)
    (dx_meta, dw_meta, db_meta), index = metas, inputs[1].get_device()

    def run(dy, x, weight, mean, rstd):
        dev = x.device
        dx = dw = db = None
        if dx_meta is not None:
            dx = torch.empty(dx_meta[0], dtype=dx_meta[1], device=dev)
        if dw_meta is not None:
            dw = torch.empty(dw_meta[0], dtype=dw_meta[1], device=dev)
        if db_meta is not None:
            db = torch.empty(db_meta[0], dtype=db_meta[1], device=dev)
        run_steps(steps, (
            dy.data_ptr(), x.data_ptr(), 0 if weight is None else weight.data_ptr(),
            mean.data_ptr(), rstd.data_ptr(), 0 if dx is None else dx.data_ptr(),
            0 if dw is None else dw.data_ptr(), 0 if db is None else db.data_ptr(),
        ), current_stream(index))
        return dx, dw, db

    return run


def _backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db, grad_dtypes):
    """:func:`layernorm_backward` through the launch rules."""
    M, N = x.shape
    dev = x.device
    has_w = weight is not None
    w = weight if has_w else x
    need_part = need_dw or need_db
    parked = get_layernorm_backward() == "low_memory"
    fused = _fused_plan(M, N, x, dy) if need_part and M > 0 and N > 0 else None
    pieces = _dx_pieces_plan(N, x, dy) if fused is None and need_dx and M > 0 else None
    if pieces is not None:  # long unaligned 16-bit rows: dx on aligned bodies + column kernel
        return _columns_first_backward(dy, x, w, has_w, mean, rstd, torch.empty_like(x),
                                       need_dw, need_db, grad_dtypes, pieces)
    split = (_split_plan(N, x, dy) if fused is None and M > 0 and N > 0
             and (need_dx or (need_part and not parked)) else None)
    if (fused is None and M > 0 and N > 0 and not (split and split[1])
            and _native_unaligned(x, dy, weight)):
        return _native_backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db)
    dx = torch.empty((M, N), dtype=x.dtype, device=dev) if need_dx else None
    if M == 0 or N == 0:
        z = torch.zeros((N,), dtype=torch.float32, device=dev)
        return dx, (z if need_dw else None), (z.clone() if need_db else None)
    if parked and dx is None and need_part:  # nothing to park in: the column kernel straight
        # into dweight/dbias (no scratch; slow for many rows)
        mark_replayable()
        return (None, *_column_backward(dy, x, mean, rstd, None, need_dw, need_db, grad_dtypes))
    if fused is not None:
        return _fused_backward(dy, x, w, has_w, mean, rstd, dx, need_dw, need_db, grad_dtypes,
                               fused, parked)
    if split:
        done = _split_backward(dy, x, w, has_w, mean, rstd, dx, need_dw, need_db, grad_dtypes,
                               *split, parked)
        if done is None and split[1]:  # no grid of C·VEC programs fits (rows too long)
            if _native_unaligned(x, dy, weight):
                return _native_backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db)
            split = _split_plan(N, x, dy, vec=False)  # the scalar pieces, any grid
            done = split and _split_backward(dy, x, w, has_w, mean, rstd, dx, need_dw, need_db,
                                             grad_dtypes, *split, parked)
        if done is not None:
            return done
    if need_part and dx is not None:
        # dx row kernel + column kernel: the column pass first, its partials parked in dx
        return _columns_first_backward(dy, x, w, has_w, mean, rstd, dx, need_dw, need_db,
                                    grad_dtypes)
    # dx as a pure row kernel (like softmax backward: x and dy read once, dx written once);
    # without dx, dweight/dbias from the column kernel into float32 scratch.
    if need_dx:
        _dx_rows(dy, x, w, has_w, mean, rstd, dx)
    mark_replayable()  # (scratch of the column kernel, if any, is refused by sequence_steps)
    return (dx, *_column_backward(dy, x, mean, rstd, None, need_dw, need_db, grad_dtypes,
                                  scratch=True))


# Scratch parked in dx (the low_memory mode, the default). The fused and split-row backward
# kernels accumulate dweight/dbias in per-program float32 partial rows, and the split kernel
# exchanges per-row statistics: scratch that would put the call's peak memory up to a few
# percent above PyTorch's (whose kernels read x and dy twice instead). It lives at the end of
# dx's own storage (dx is allocated, not yet written): the kernel writes dx for the rows before
# it (M_dx), the partials are summed into dweight/dbias, and a second launch writes the dx of the
# remaining rows with the same arithmetic (bitwise the rows the fast mode's single launch
# writes). Cost: those rows (at most ~1/8 of x, capped by _max_partial_rows) are read again,
# plus a launch: 1-3% at most shapes, up to 7% at unaligned 16-bit rows (H100). The parked
# dx mask uses the default mode's row offsets (recomputing them cost 9-25% at unaligned rows).
def _park(dx: torch.Tensor, nbytes: int, group: int) -> tuple[int, int] | None:
    """(M_dx, byte offset) for ``nbytes`` of scratch at the end of dx's storage: the offset is
    16-byte aligned and M_dx, the first row it touches rounded down to a multiple of
    ``group``; None if dx cannot hold it."""
    M, N = dx.shape
    row_bytes = N * dx.element_size()
    start = (M * row_bytes - nbytes) // 16 * 16
    if start < 0:
        return None
    return start // row_bytes // group * group, start


def _parked(dx: torch.Tensor, offset: int, shape: tuple[int, ...],
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A ``shape`` tensor of ``dtype`` over dx's storage from byte ``offset``."""
    return torch.empty((0,), dtype=dtype, device=dx.device).set_(
        dx.untyped_storage(), offset // dtype.itemsize, shape)


def _fused_backward(dy, x, w, has_w, mean, rstd, dx, need_dw, need_db, grad_dtypes, plan,
                    parked: bool):
    """The fused kernel (rows up to 8K): dx, and dweight/dbias from per-program partials, in
    float32 scratch or (``parked``, the low_memory mode, with a dx) parked in dx (see _park)."""
    vec, block, rows, warps, acc_1d, tiles, progs = plan
    M, N = x.shape
    need_dx = dx is not None
    paired = _paired_sums(x.element_size(), vec, block)
    strides = (dy.stride(0), x.stride(0), N)
    stages = _fused_bwd_stages(block, x.element_size(), strides)
    def dx_only(first: int, grid: int) -> None:  # the parked variant's dx of tiles first..
        _launch_bwd_single((grid,), (
            dy, x, w, mean, rstd, dx, x, M, N, *strides, tiles, grid, first, M,
            block, rows, has_w, True, False, False, vec, True, acc_1d, True, paired, stages,
        ), warps)

    m_dx = M
    if parked and need_dx:
        place = _park(dx, 8 * progs * N, rows * max(vec, 1))
        if place is None:  # 1-3 rows: no room in dx for the partials. dx from this kernel
            # all the same (its rows bitwise as in any other call), then the column kernel.
            dx_only(0, progs)
            return (dx, *_column_backward(dy, x, mean, rstd, None, need_dw, need_db,
                                          grad_dtypes))
        m_dx, offset = place
        part = _parked(dx, offset, (2, progs, N))
    else:
        part = torch.empty((2, progs, N), dtype=torch.float32, device=x.device)
    _launch_bwd_single((progs,), (
        dy, x, w, mean, rstd, dx if need_dx else x, part, M, N, *strides, tiles, progs, 0, m_dx,
        block, rows, has_w, need_dx, need_dw, need_db, vec, True, acc_1d, parked, paired,
        stages,
    ), warps)
    dw, db = _reduce_partials(part, need_dw, need_db, dtypes=grad_dtypes)
    if m_dx < M:
        first = m_dx // rows  # a multiple of vec: m_dx is a multiple of rows * vec
        left = tiles - first
        per_sm = _fused_bwd_config(block, vec > 0, x.element_size())[2]
        tail = max(1, min(left, num_sms(x.device) * per_sm))
        if vec and tail < left:
            tail = max(vec, tail // vec * vec)
        dx_only(first, tail)
    mark_replayable()
    return dx, dw, db


def _split_plan(N: int, x: torch.Tensor, dy: torch.Tensor,
                vec: bool = True) -> tuple[tuple, int] | None:
    """(config, VEC) of the split-row backward for rows of ``N``, or None where it does not
    run. VEC > 0: rows that start unaligned (x and dy contiguous, N not a multiple of 16
    bytes), read as an aligned body cut into pieces plus edges (see unaligned_vec); ``vec``
    False: scalar accesses instead."""
    if next_pow2(N) <= FUSED_BWD_MAX_BLOCK:
        return None
    vec = vec and unaligned_vec(N, (dy.stride(0), x.stride(0), N), x.element_size(), (dy, x))
    aligned = x.stride(0) % 8 == 0 and dy.stride(0) % 8 == 0
    cfg = _split_config("bwd", N, x.element_size(), aligned, vec) if vec else None
    if cfg is None:  # no rule for aligned-body pieces here: scalar pieces
        vec, cfg = 0, _split_config("bwd", N, x.element_size(), aligned)
    return (cfg, vec) if cfg and split_rows_enabled(x.device, N, cfg[0]) else None


def _split_backward(dy, x, w, has_w, mean, rstd, dx, need_dw, need_db, grad_dtypes, cfg,
                    vec: int, parked: bool):
    """The split-row kernel (long rows): partials, per-row statistics and counters in scratch
    or (``parked``, with a dx) parked in dx (see _park). None if the cooperative launch was
    refused or no grid fits (the caller then uses the other kernels). ``vec`` > 0: unaligned
    rows as aligned-body pieces plus edges (dx is then contiguous like x and dy).

    Parked: partials, then statistics and counters, at the end of dx's storage. Once the
    partials are summed, the rows over them (from M_dx) get their dx from
    _ln_bwd_dx_published, which reads the statistics the split launch left there: bitwise as
    that launch would have written those rows."""
    M, N = x.shape
    dev = x.device
    need_dx = dx is not None
    need_part = need_dw or need_db
    chunk, split_warps, prefetch, *extra = cfg
    cap = extra[0] if extra else None
    C, L = split_pieces(N, chunk, vec)
    paired = SPLIT_PAIRED
    # ``mean`` stands in for the buffers (same dtype/alignment) until they are sized.
    args = [dy, x, w, mean, rstd, dx if need_dx else x, mean, mean, mean, N, L,
            dy.stride(0), x.stride(0), N, M, M * C]
    progs = 0
    if len(extra) > 1 and extra[1] and need_dx and not vec and clusters_enabled(dev, N, chunk, C):
        launcher = _bwd_cluster_launcher(cap)
        consts = (next_pow2(L), C, next_pow2(C), has_w, need_dx, need_dw, need_db, prefetch,
                  parked, vec, paired, True)
        progs = launcher.programs(M * C, C, tuple(args), consts, split_warps, dev, vec)
    if not progs:  # a cooperative grid
        launcher = _bwd_split_launcher(cap)
        consts = (next_pow2(L), C, next_pow2(C), has_w, need_dx, need_dw, need_db, prefetch,
                  parked, vec, paired, False)
        progs = launcher.programs(M * C, C, tuple(args), consts, split_warps, dev, vec)
    if not progs:
        return None
    progs = max(C, min(progs, _max_partial_rows(x) * C))
    if vec and progs < M * C:  # a program's rows VEC apart share one misalignment (see kernel)
        progs = min(M * C, max(C * vec, progs // (C * vec) * (C * vec)))
    # One partial row per group of C programs (a program keeps one chunk of the row).
    part_rows = progs // C
    part_bytes = 8 * part_rows * N if need_part else 0
    stats_bytes = 8 * M * C if need_dx else 0
    def dx_pieces(row0: int) -> None:  # dx of rows row0.. with the split kernel's arithmetic
        _launch_dx_pieces((M - row0,), (
            dy, x, w, mean, rstd, dx, N, L, dy.stride(0), x.stride(0), N, row0,
            next_pow2(L), C, next_pow2(C), has_w, not interpreting(), vec, paired,
        ), split_warps)

    m_dx = M
    if parked and need_dx:
        place = _park(dx, part_bytes + stats_bytes + 4 * M, 1)
        if place is None:  # a few rows: no room in dx. dx row by row with the split kernel's
            # arithmetic (bitwise as in any other call), then the column kernel.
            dx_pieces(0)
            return (dx, *_column_backward(dy, x, mean, rstd, None, need_dw, need_db,
                                          grad_dtypes))
        m_dx, offset = place
        part = _parked(dx, offset, (2, part_rows, N)) if need_part else mean
        stats = _parked(dx, offset + part_bytes, (2 * M * C,))
        count = _parked(dx, offset + part_bytes + stats_bytes, (M,), torch.int32)
    else:  # scratch (without dx the kernel exchanges no statistics: placeholders)
        part = (torch.empty((2, part_rows, N), dtype=torch.float32, device=dev)
                if need_part else mean)
        stats = (torch.empty((M * C * 2,), dtype=torch.float32, device=dev) if need_dx
                 else mean)
        count = torch.empty((M,), dtype=torch.int32, device=dev) if need_dx else mean
    clustered = isinstance(launcher, ClusterLauncher)
    # The cluster variant never reads the row counters: no zeroing launch, and ``mean`` in
    # their place keeps its launch key the grid estimate's (one compiled kernel, not two).
    args[6:9] = part, stats, mean if clustered else _zeroed(count, need_dx, parked)
    args[14] = m_dx
    if not launcher(M * C, C, tuple(args), consts, split_warps, dev, progs):
        if not clustered:
            return None
        # The cluster launch failed (clusters are now off): the same pieces, cooperatively.
        args[8] = _zeroed(count, need_dx, parked)
        launcher = _bwd_split_launcher(cap)
        consts = (*consts[:-1], False)
        if launcher.programs(M * C, C, tuple(args), consts, split_warps, dev, vec) < progs or \
                not launcher(M * C, C, tuple(args), consts, split_warps, dev, progs):
            return None
    dw = db = None
    if need_part:
        dw, db = _reduce_partials(part, need_dw, need_db, dtypes=grad_dtypes)
    if m_dx < M:
        # The programs whose piece of dx covers the statistics of rows m_dx.. (or what
        # follows them) write last; the last counter, no longer needed, counts the readers.
        row_bytes, first = N * dx.element_size(), offset + part_bytes + 8 * C * m_dx
        late_from = (first // row_bytes - m_dx) * C
        if not vec:  # the piece too (with VEC > 0, piece 0 also writes the row's tail edge)
            late_from += first % row_bytes // (L * dx.element_size())
        n_progs = (M - m_dx) * C
        _launch_dx_published((n_progs,), (
            dy, x, w, mean, rstd, dx, stats, zero_counters(count[M - 1:]), N, L, dy.stride(0),
            x.stride(0), N, m_dx, n_progs, max(0, late_from),
            next_pow2(L), C, next_pow2(C), has_w, not interpreting(), vec,
        ), split_warps)
    mark_replayable()
    return dx, dw, db


def _zeroed(count: torch.Tensor, need_dx: bool, parked: bool) -> torch.Tensor:
    """The cooperative split kernel's row counters, zeroed (parked in dx: with a launch, which
    a recorded call replays); without dx they are a placeholder, left as they are."""
    if not need_dx:
        return count
    return zero_counters(count) if parked else count.zero_()


def _dx_rows(dy, x, w, has_w, mean, rstd, dx) -> None:
    """dx of (M, N) rows from the dx-only row kernel (single-block, or looped for long rows)."""
    M, N = x.shape
    single, block, rows, warps = row_config(N, "ln_bwd", x.element_size())
    vec = 0
    if single:
        vec = unaligned_vec(N, (dy.stride(0), x.stride(0), N), x.element_size(), (dy, x, dx))
        if vec:
            single, block, rows, warps, vec = unaligned_config(N, "ln_bwd", x.element_size(),
                                                               vec)
    if single:
        tiles = num_row_tiles(M, rows, vec)
        progs = grid_size(tiles, warps, "ln_bwd", x.device, vec=vec)
        _launch_bwd_single((progs,), (
            dy, x, w, mean, rstd, dx, x, M, N, dy.stride(0), x.stride(0), N, tiles, progs, 0, M,
            block, rows, has_w, True, False, False, vec, _hold_w(block, warps), True, False,
            _paired_sums(x.element_size(), vec, block), 1,
        ), warps)
    else:
        _launch_dx_looped((M,), (
            dy, x, w, mean, rstd, dx, N, dy.stride(0), x.stride(0), dx.stride(0),
            block, has_w,
        ), warps)


def _column_splits(M: int, N: int, dev: torch.device,
                   max_splits: int | None = None) -> tuple[int, int, int]:
    """(column blocks, row splits, rows per split) of the dweight/dbias column kernel: the
    fewest row splits giving COLUMN_PER_SM programs per SM, each owning a (row-split,
    column-block) tile (one split: no partials to sum); at most ``max_splits`` splits."""
    block_c, block_r = COLUMN_TILE
    col_blocks = cdiv(N, block_c)
    splits = max(1, min(cdiv(M, block_r), cdiv(COLUMN_PER_SM * num_sms(dev), col_blocks)))
    if max_splits is not None:
        splits = max(1, min(splits, max_splits))
    rows_per_split = cdiv(cdiv(M, splits), block_r) * block_r
    return col_blocks, cdiv(M, rows_per_split), rows_per_split


def _columns_first_backward(dy, x, w, has_w, mean, rstd, dx, need_dw: bool, need_db: bool,
                            grad_dtypes=None, pieces: tuple | None = None):
    """dx, dweight, dbias with no scratch beyond the outputs (the dx row kernel's path, both
    modes): dweight/dbias from :func:`_column_backward` first, then the dx row kernel writes dx
    (one stream: in order), or with ``pieces`` (see _dx_pieces_plan) _ln_bwd_dx_pieces on the
    rows' aligned bodies. 5 passes over memory."""
    dw, db = _column_backward(dy, x, mean, rstd, dx, need_dw, need_db, grad_dtypes)
    if dx is not None and pieces is not None:
        M, N = x.shape
        C, L, vec, warps = pieces
        _launch_dx_pieces((M,), (
            dy, x, w, mean, rstd, dx, N, L, dy.stride(0), x.stride(0), N, 0,
            next_pow2(L), C, next_pow2(C), has_w, False, vec, SPLIT_PAIRED,
        ), warps)
    elif dx is not None:
        _dx_rows(dy, x, w, has_w, mean, rstd, dx)
    mark_replayable()
    return dx, dw, db


def _column_backward(dy, x, mean, rstd, dx, need_dw: bool, need_db: bool, grad_dtypes=None,
                     scratch: bool = False):
    """dweight/dbias (in ``grad_dtypes``, None: float32) from the column kernel: its float32
    partials parked in dx's storage (allocated, not yet written) and summed from there, or
    (``scratch``) in a buffer of their own; with neither (x needs no gradient, or 1-3 rows),
    one row split writes dweight/dbias directly (one program per 256 columns)."""
    if not (need_dw or need_db):
        return None, None
    M, N = x.shape
    dev = x.device
    room = M * N * x.element_size() // (8 * N) if dx is not None else 0  # (2, N) float32 pairs
    col_blocks, splits, rows_per_split = _column_splits(M, N, dev,
                                                        None if scratch else max(1, room))
    dt_w, dt_b = grad_dtypes or (None, None)
    # separate tensors: outputs of a custom op must not alias each other
    dw = torch.empty((N,), dtype=dt_w or torch.float32, device=dev) if need_dw else None
    db = torch.empty((N,), dtype=dt_b or torch.float32, device=dev) if need_db else None
    part = None
    if splits > 1:
        part = (torch.empty((2, splits, N), dtype=torch.float32, device=dev) if scratch
                else _parked(dx, 0, (2, splits, N)))
    outs = (part[0], part[1]) if part is not None else (dw if need_dw else db,
                                                        db if need_db else dw)
    _launch_dwdb_columns((col_blocks, splits), (
        dy, x, mean, rstd, *outs, M, N, dy.stride(0), x.stride(0),
        rows_per_split, *COLUMN_TILE, need_dw, need_db, dy.stride(0) == x.stride(0),
    ), COLUMN_WARPS)
    if part is not None:
        _reduce_partials(part, need_dw, need_db, out=(dw, db))
    return dw, db
