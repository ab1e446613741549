"""The LayerNorm forward on aligned long rows in thread-block clusters whose pieces are
streamed, not held (``@triton.jit`` only; launched by ``runtime.clusters.ClusterLauncher``,
picked by ``PIECES_FWD`` in ``configs/layernorm.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from fusedops.backends.triton.kernels.clusters import (
    cluster_peer_sums,
    cluster_piece,
    cluster_publish,
)
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
