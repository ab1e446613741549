"""The LayerNorm forward on aligned long rows in thread-block clusters (``@triton.jit`` only;
launched by ``runtime.clusters.ClusterLauncher``): pieces streamed, not held
(``ln_fwd_pieces``, picked by ``PIECES_FWD`` in ``configs/layernorm.py``), or landed in shared
memory (``ln_fwd_staged``, ``STAGED_FWD``; the helpers: ``kernels/staging.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from fusedops.backends.triton.kernels.clusters import (
    cluster_peer_sums,
    cluster_piece,
    cluster_publish,
)
from fusedops.backends.triton.kernels.layernorm_fwd import (
    affine,
    offset_stats,
    rstd_of_var,
    scale_shift,
)
from fusedops.backends.triton.kernels.staging import (
    pack_word,
    param_floats,
    stage_read,
    stage_row_piece,
    store_words,
    word_hi,
    word_lo,
)


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
def _shifted_word(s1, s2, w, k, KIND: tl.constexpr):
    # (s1, s2) + the sums of (e - k) and (e - k)² over a word's elements e
    d = word_lo(w, KIND) - k
    s1 += d
    s2 = tl.fma(d, d, s2)
    if KIND != 2:
        d = word_hi(w, KIND) - k
        s1 += d
        s2 = tl.fma(d, d, s2)
    return s1, s2


@triton.jit
def _y(x, x0, off, rstd, w, b, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    # affine(((x - x0) - off)·rstd), rounded as the other LayerNorm kernels round it
    return scale_shift(((x - x0) - off) * rstd, w, b, HAS_W, HAS_B)


@triton.jit
def _y_word(word, x0, off, rstd, w_lo, w_hi, b_lo, b_hi, KIND: tl.constexpr,
            HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    # The word of y for a word of x and the parameters at its elements
    lo = _y(word_lo(word, KIND), x0, off, rstd, w_lo, b_lo, HAS_W, HAS_B)
    if KIND == 2:
        hi = lo
    else:
        hi = _y(word_hi(word, KIND), x0, off, rstd, w_hi, b_hi, HAS_W, HAS_B)
    return pack_word(lo, hi, KIND)


@triton.jit
def ln_fwd_staged(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, stride_x, stride_y, eps, num_progs,
    L: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, VB: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, STATS: tl.constexpr,
):
    # One row per cluster of C CTAs (num_progs = rows x C; program pid is piece pid % C of row
    # pid // C), as rms_fwd_staged (kernels/rmsnorm_staged.py): the piece lands in shared
    # memory; one read there gives each thread its sums about its first element k (as
    # offset_stats: no cancellation for rows far from zero), merged into the piece's (offset
    # from the row's first element x0, M2) and across the cluster with Chan's formula; a
    # second read writes y. Rows: 16-byte aligned, N = C x L; y has x's dtype; weight and
    # bias one dtype, x's or (16-bit x) float32.
    KIND: tl.constexpr = (0 if x_ptr.dtype.element_ty == tl.bfloat16
                          else 1 if x_ptr.dtype.element_ty == tl.float16 else 2)
    PKIND: tl.constexpr = (0 if w_ptr.dtype.element_ty == tl.bfloat16
                           else 1 if w_ptr.dtype.element_ty == tl.float16 else 2)
    SB: tl.constexpr = L * (4 if KIND == 2 else 2)  # the piece's bytes
    STEPS: tl.constexpr = SB // 16 // VB
    PER: tl.constexpr = L // VB  # elements a thread sums
    pid = tl.program_id(0)
    rank = pid % C
    row = (pid // C).to(tl.int64)
    x_row = x_ptr + row * stride_x
    v, sb, parity = stage_row_piece(x_row + rank * L, SB, C, VB)
    x0 = tl.load(x_row).to(tl.float32)
    k = word_lo(stage_read(sb + v * 16)[0], KIND)
    s1 = tl.zeros((VB,), tl.float32)
    s2 = tl.zeros((VB,), tl.float32)
    for j in tl.static_range(STEPS):
        w0, w1, w2, w3 = stage_read(sb + (j * VB + v) * 16)
        s1, s2 = _shifted_word(s1, s2, w0, k, KIND)
        s1, s2 = _shifted_word(s1, s2, w1, k, KIND)
        s1, s2 = _shifted_word(s1, s2, w2, k, KIND)
        s1, s2 = _shifted_word(s1, s2, w3, k, KIND)
    lane_off = (k - x0) + s1 / PER
    off = tl.sum(lane_off, axis=0) / VB
    spread = lane_off - off
    m2 = tl.sum(tl.maximum(s2 - s1 * s1 / PER, 0.0), axis=0) + PER * tl.sum(spread * spread,
                                                                             axis=0)
    if C > 1:
        peers = tl.arange(0, C_P2)
        token = cluster_publish(off, m2, rank, parity, C)
        offs, m2s = cluster_peer_sums(peers, parity, token, C)
        off = tl.sum(offs, axis=0) / C
        spread_c = tl.where(peers < C, offs - off, 0.0)
        m2 = tl.sum(m2s, axis=0) + L * tl.sum(spread_c * spread_c, axis=0)
    rstd = rstd_of_var(m2 / (C * L), eps, KIND == 2)
    if STATS:
        tl.store(mean_ptr + row, x0 + off, mask=rank == 0)
        tl.store(rstd_ptr + row, rstd, mask=rank == 0)
    out = y_ptr + row * stride_y + rank * L
    for j in tl.static_range(STEPS):
        idx = j * VB + v
        w0, w1, w2, w3 = stage_read(sb + idx * 16)
        if HAS_W:
            p0, p1, p2, p3, p4, p5, p6, p7 = param_floats(w_ptr + rank * L, idx, KIND, PKIND)
        else:
            p0, p1, p2, p3, p4, p5, p6, p7 = rstd, rstd, rstd, rstd, rstd, rstd, rstd, rstd
        if HAS_B:
            q0, q1, q2, q3, q4, q5, q6, q7 = param_floats(b_ptr + rank * L, idx, KIND, PKIND)
        else:
            q0, q1, q2, q3, q4, q5, q6, q7 = rstd, rstd, rstd, rstd, rstd, rstd, rstd, rstd
        if KIND == 2:  # one element a word
            store_words(out, idx, _y_word(w0, x0, off, rstd, p0, p0, q0, q0, KIND, HAS_W, HAS_B),
                        _y_word(w1, x0, off, rstd, p1, p1, q1, q1, KIND, HAS_W, HAS_B),
                        _y_word(w2, x0, off, rstd, p2, p2, q2, q2, KIND, HAS_W, HAS_B),
                        _y_word(w3, x0, off, rstd, p3, p3, q3, q3, KIND, HAS_W, HAS_B))
        else:
            store_words(out, idx, _y_word(w0, x0, off, rstd, p0, p1, q0, q1, KIND, HAS_W, HAS_B),
                        _y_word(w1, x0, off, rstd, p2, p3, q2, q3, KIND, HAS_W, HAS_B),
                        _y_word(w2, x0, off, rstd, p4, p5, q4, q5, KIND, HAS_W, HAS_B),
                        _y_word(w3, x0, off, rstd, p6, p7, q6, q7, KIND, HAS_W, HAS_B))
