"""The LayerNorm forward and backward on aligned long rows in thread-block clusters whose
pieces are streamed, not held (``@triton.jit`` only; launched by
``runtime.clusters.ClusterLauncher``, picked by ``PIECES_FWD`` / ``PIECES_BWD`` in
``configs/layernorm.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from fusedops.backends.triton.kernels.clusters import (
    cluster_peer_sums,
    cluster_piece,
    cluster_publish,
)
from fusedops.backends.triton.kernels.layernorm_bwd import row_sums
from fusedops.backends.triton.kernels.layernorm_fwd import affine, offset_stats, rstd_of_var


@triton.jit
def ln_fwd_pieces(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, M, stride_x, stride_y, eps, num_progs,
    L: tl.constexpr, CHUNK: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, STATS: tl.constexpr,
):
    # Rows of C·L elements, program pid the piece pid % C of rows num_progs // C apart. As
    # ln_fwd_unrolled on the piece (pass 1 streams it in unrolled chunks, kept in L2; pass 2
    # reads it again from L2 to write y), with the piece's (mean offset, M2) exchanged on chip
    # between the passes. Offsets are from the row's first element x0 in every piece (see
    # ln_fwd_unrolled), merged with Chan's formula over the C equal pieces.
    EXACT: tl.constexpr = y_ptr.dtype.element_ty == tl.float32
    N: tl.constexpr = C * L
    pid, piece, parity = cluster_piece(C)
    lanes = tl.arange(0, CHUNK)
    peers = tl.arange(0, C_P2)
    for row in range(pid // C, M, num_progs // C):
        x_row = x_ptr + row.to(tl.int64) * stride_x
        x_piece = x_row + piece * L
        x0, off, m2 = offset_stats(x_piece, x_row, L, CHUNK)
        token = cluster_publish(off, m2, piece, parity, C)
        offs, m2s = cluster_peer_sums(peers, parity, token, C)
        parity = 1 - parity
        row_off = tl.sum(offs, axis=0) / C
        spread = tl.where(peers < C, offs - row_off, 0.0)
        var = (tl.sum(m2s, axis=0) + L * tl.sum(spread * spread, axis=0)) / N
        rstd = rstd_of_var(var, eps, EXACT)
        if STATS:
            tl.store(mean_ptr + row, x0 + row_off, mask=piece == 0)
            tl.store(rstd_ptr + row, rstd, mask=piece == 0)
        y_piece = y_ptr + row.to(tl.int64) * stride_y + piece * L
        for start in tl.static_range(0, L, CHUNK):
            x = tl.load(x_piece + start + lanes, eviction_policy="evict_first").to(tl.float32)
            y = affine(((x - x0) - row_off) * rstd, w_ptr, b_ptr, piece * L + start + lanes,
                       None, HAS_W, HAS_B, True)
            tl.store(y_piece + start + lanes, y.to(y_ptr.dtype.element_ty))


@triton.jit
def piece_sums(x_piece, dy_piece, w_piece, mean, rstd, lanes, L: tl.constexpr,
               CHUNK: tl.constexpr, HAS_W: tl.constexpr):
    """(Σ x̂·g, Σ g) over one streamed piece, g = w·dy (its chunks kept in L2 for pass 2)."""
    s1 = tl.zeros([CHUNK], tl.float32)
    s2 = tl.zeros([CHUNK], tl.float32)
    for start in tl.static_range(0, L, CHUNK):
        x = tl.load(x_piece + start + lanes, eviction_policy="evict_last").to(tl.float32)
        g = tl.load(dy_piece + start + lanes, eviction_policy="evict_last").to(tl.float32)
        if HAS_W:
            g = g * tl.load(w_piece + start + lanes, eviction_policy="evict_last").to(tl.float32)
        s1 = tl.fma((x - mean) * rstd, g, s1)
        s2 += g
    return row_sums(s1, s2, 0, True)  # (one paired reduction: half the block barriers)


@triton.jit
def dx_chunk(x_piece, dy_piece, w_piece, dx_piece, start, lanes, mean, rstd, c1, c2, keep,
             dw_acc, db_acc, HAS_W: tl.constexpr):
    """Write one chunk's dx = rstd·(g − (x̂·c1 + c2)) where ``keep`` (x and dy read again,
    from L2) and return the dweight / dbias accumulators plus its dy·x̂ and dy."""
    xhat = (tl.load(x_piece + start + lanes, eviction_policy="evict_first").to(tl.float32)
            - mean) * rstd
    dy = tl.load(dy_piece + start + lanes, eviction_policy="evict_first").to(tl.float32)
    g = dy
    if HAS_W:
        g = dy * tl.load(w_piece + start + lanes, eviction_policy="evict_last").to(tl.float32)
    dx = ((g - (xhat * c1 + c2)) * rstd).to(dx_piece.dtype.element_ty)
    tl.store(dx_piece + start + lanes, dx, mask=keep)
    return tl.fma(dy, xhat, dw_acc), db_acc + dy


@triton.jit
def ln_bwd_pieces(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, row0, M, M_dx, stride_dy,
    stride_x, stride_dx, num_progs,
    N: tl.constexpr, L: tl.constexpr, CHUNK: tl.constexpr, C: tl.constexpr,
    C_P2: tl.constexpr, HAS_W: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
):
    # The backward of aligned rows N = C·L in clusters of C programs, as ln_fwd_pieces: rows
    # row0.. of M; pass 1 streams the piece's x and dy (kept in L2) for (Σ x̂·g, Σ g), the
    # cluster exchanges the pair, pass 2 reads them again from L2, writes dx for rows below
    # M_dx (the rest of dx may hold the parked partials: a second launch from row0 = M_dx
    # without partials writes them) and adds dy·x̂ and dy to the piece's dweight / dbias
    # accumulators (one pair per chunk, L / CHUNK <= 4, unrolled by hand: the only registers
    # kept across rows). The grid is persistent; partials are (2, num_progs // C, N) float32.
    tl.static_assert(L // CHUNK <= 4)
    pid, piece, parity = cluster_piece(C)
    lanes = tl.arange(0, CHUNK)
    peers = tl.arange(0, C_P2)
    w_piece = w_ptr + piece * L
    dw0 = tl.zeros([CHUNK], tl.float32)
    db0, dw1, db1, dw2, db2, dw3, db3 = dw0, dw0, dw0, dw0, dw0, dw0, dw0
    for row in range(row0 + pid // C, M, num_progs // C):
        row64 = row.to(tl.int64)
        x_piece = x_ptr + row64 * stride_x + piece * L
        dy_piece = dy_ptr + row64 * stride_dy + piece * L
        dx_piece = dx_ptr + row64 * stride_dx + piece * L
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        s1, s2 = piece_sums(x_piece, dy_piece, w_piece, mean, rstd, lanes, L, CHUNK, HAS_W)
        token = cluster_publish(s1, s2, piece, parity, C)
        p1, p2 = cluster_peer_sums(peers, parity, token, C)
        parity = 1 - parity
        c1, c2 = row_sums(p1, p2, 0, True)
        c1 = c1 / N
        c2 = c2 / N
        keep = lanes * 0 + row < M_dx  # (a vector: the interpreter rejects a scalar mask)
        dw0, db0 = dx_chunk(x_piece, dy_piece, w_piece, dx_piece, 0, lanes, mean, rstd, c1, c2,
                            keep, dw0, db0, HAS_W)
        if L > CHUNK:
            dw1, db1 = dx_chunk(x_piece, dy_piece, w_piece, dx_piece, CHUNK, lanes, mean, rstd,
                                c1, c2, keep, dw1, db1, HAS_W)
        if L > 2 * CHUNK:
            dw2, db2 = dx_chunk(x_piece, dy_piece, w_piece, dx_piece, 2 * CHUNK, lanes, mean,
                                rstd, c1, c2, keep, dw2, db2, HAS_W)
        if L > 3 * CHUNK:
            dw3, db3 = dx_chunk(x_piece, dy_piece, w_piece, dx_piece, 3 * CHUNK, lanes, mean,
                                rstd, c1, c2, keep, dw3, db3, HAS_W)
    out = part_ptr + (pid // C).to(tl.int64) * N + piece * L + lanes
    if NEED_DW:
        store_chunks(out, dw0, dw1, dw2, dw3, L, CHUNK)
    if NEED_DB:
        store_chunks(out + (num_progs // C) * N, db0, db1, db2, db3, L, CHUNK)


@triton.jit
def store_chunks(out, a0, a1, a2, a3, L: tl.constexpr, CHUNK: tl.constexpr):
    """Store a piece's per-chunk accumulators (the first L / CHUNK of them) from ``out``."""
    tl.store(out, a0)
    if L > CHUNK:
        tl.store(out + CHUNK, a1)
    if L > 2 * CHUNK:
        tl.store(out + 2 * CHUNK, a2)
    if L > 3 * CHUNK:
        tl.store(out + 3 * CHUNK, a3)
