"""The RMSNorm forward on aligned long rows whose pieces land in the shared memory of one
thread-block cluster (``@triton.jit`` only; launched by ``runtime.clusters.ClusterLauncher``
with the piece's bytes, picked by ``STAGED_FWD`` in ``configs/rmsnorm.py``; the helpers:
``kernels/staging.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from fusedops.backends.triton.kernels.clusters import cluster_peer_sums, cluster_publish
from fusedops.backends.triton.kernels.rmsnorm import rstd_of
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
def _square_word(acc, w, KIND: tl.constexpr):
    # acc + the squares of a word's elements
    lo = word_lo(w, KIND)
    acc = tl.fma(lo, lo, acc)
    if KIND != 2:
        hi = word_hi(w, KIND)
        acc = tl.fma(hi, hi, acc)
    return acc


@triton.jit
def _scaled(x, rstd, w, HAS_W: tl.constexpr):
    # (x·rstd)·w, rounded as the other RMSNorm kernels round it
    y = x * rstd
    if HAS_W:
        y = y * w
    return y


@triton.jit
def _y_word(word, rstd, w_lo, w_hi, KIND: tl.constexpr, HAS_W: tl.constexpr):
    # The word of y for a word of x and the weight at its elements
    lo = _scaled(word_lo(word, KIND), rstd, w_lo, HAS_W)
    if KIND == 2:
        hi = lo
    else:
        hi = _scaled(word_hi(word, KIND), rstd, w_hi, HAS_W)
    return pack_word(lo, hi, KIND)


@triton.jit
def rms_fwd_staged(
    x_ptr, w_ptr, y_ptr, rstd_ptr, stride_x, stride_y, eps, num_progs,
    L: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, VB: tl.constexpr,
    HAS_W: tl.constexpr, STATS: tl.constexpr,
):
    # One row per cluster of C CTAs (num_progs = rows x C; program pid is piece pid % C of row
    # pid // C): the piece's L elements land in shared memory, its sum of squares is read
    # there, the cluster exchanges the sums on chip, and y is written from a second read
    # there, so x is read from memory once. Rows: 16-byte aligned, N = C x L; y has x's dtype;
    # the weight x's dtype or (16-bit x) float32. VB: the CTA's threads (one 16-byte vector
    # each per step).
    KIND: tl.constexpr = (0 if x_ptr.dtype.element_ty == tl.bfloat16
                          else 1 if x_ptr.dtype.element_ty == tl.float16 else 2)
    WKIND: tl.constexpr = (0 if w_ptr.dtype.element_ty == tl.bfloat16
                           else 1 if w_ptr.dtype.element_ty == tl.float16 else 2)
    SB: tl.constexpr = L * (4 if KIND == 2 else 2)  # the piece's bytes
    STEPS: tl.constexpr = SB // 16 // VB
    pid = tl.program_id(0)
    rank = pid % C
    row = (pid // C).to(tl.int64)
    v, sb, parity = stage_row_piece(x_ptr + row * stride_x + rank * L, SB, C, VB)
    acc = tl.zeros((VB,), tl.float32)
    for j in tl.static_range(STEPS):
        w0, w1, w2, w3 = stage_read(sb + (j * VB + v) * 16)
        acc = _square_word(_square_word(_square_word(_square_word(acc, w0, KIND), w1, KIND),
                                        w2, KIND), w3, KIND)
    ss = tl.sum(acc, axis=0)
    if C > 1:
        token = cluster_publish(ss, ss, rank, parity, C)
        sums, _ = cluster_peer_sums(tl.arange(0, C_P2), parity, token, C)
        ss = tl.sum(sums, axis=0)
    rstd = rstd_of(ss, C * L, eps, KIND == 2)
    if STATS:
        tl.store(rstd_ptr + row, rstd, mask=rank == 0)
    out = y_ptr + row * stride_y + rank * L
    w_piece = w_ptr + rank * L
    for j in tl.static_range(STEPS):
        idx = j * VB + v
        w0, w1, w2, w3 = stage_read(sb + idx * 16)
        if HAS_W:
            f0, f1, f2, f3, f4, f5, f6, f7 = param_floats(w_piece, idx, KIND, WKIND)
        else:
            f0, f1, f2, f3, f4, f5, f6, f7 = rstd, rstd, rstd, rstd, rstd, rstd, rstd, rstd
        if KIND == 2:  # one element a word
            store_words(out, idx, _y_word(w0, rstd, f0, f0, KIND, HAS_W),
                        _y_word(w1, rstd, f1, f1, KIND, HAS_W),
                        _y_word(w2, rstd, f2, f2, KIND, HAS_W),
                        _y_word(w3, rstd, f3, f3, KIND, HAS_W))
        else:
            store_words(out, idx, _y_word(w0, rstd, f0, f1, KIND, HAS_W),
                        _y_word(w1, rstd, f2, f3, KIND, HAS_W),
                        _y_word(w2, rstd, f4, f5, KIND, HAS_W),
                        _y_word(w3, rstd, f6, f7, KIND, HAS_W))
