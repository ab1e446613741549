"""``@triton.jit`` helpers that land a row piece in shared memory by ``cp.async`` (inline PTX).

Triton's ``tl`` holds loaded data in registers: a split-row kernel that keeps a long row's
piece across the exchange with its peers needs those registers for the whole wait, which
leaves one or two programs per SM whose loads stop meanwhile. Here each thread instead copies
16-byte vectors of its piece straight into the dynamic shared memory beyond Triton's own
(``cp.async.cg``, no registers held while the copy is in flight), waits for its copies, meets
the CTA at a barrier, and reads the piece from shared memory as often as the kernel needs.
Pieces of 16-64 KB then let 3-7 CTAs share an SM, each one row's piece in flight.

A vector is 4 int32 *words* (8 16-bit elements or 4 float32, little-endian: word k holds
elements 2k and 2k+1); the kernels index vectors with a ``(VB,)`` tensor ``v`` (VB = threads of
the CTA, one vector per thread per step) and compute on the words' unpacked float32 values.
The launch: ``runtime/clusters.py`` (``ClusterLauncher`` with ``shared``). GPU only: no
inline PTX runs under the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusedops.backends.triton.kernels.clusters import END_PTX, cluster_arrive, cluster_wait

# $0 = the shared address of the last $1 bytes of the dynamic shared memory.
BASE_PTX = tl.constexpr(
    "{\n.reg .u32 fo_base, fo_size;\n" + END_PTX + "sub.u32 $0, fo_base, $1;\n}")
COPY_PTX = tl.constexpr("cp.async.cg.shared.global [$2], [$1], 16;\nmov.u32 $0, 0;")
COMMIT_PTX = tl.constexpr("cp.async.commit_group;\nmov.u32 $0, $1;")
# This thread's copies have landed; the barrier makes every thread's visible to the CTA.
WAIT_PTX = tl.constexpr("cp.async.wait_group 0;\nbar.sync 0;\nmov.u32 $0, $1;")
READ_PTX = tl.constexpr("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];")
STORE_PTX = tl.constexpr("st.global.v4.b32 [$1], {$2, $3, $4, $5};\nmov.u32 $0, 0;")
LOAD_PTX = tl.constexpr("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];")


@triton.jit
def stage_base(nbytes):
    """Shared address (int32) of the last ``nbytes`` bytes of the launch's dynamic shared
    memory (the launch adds them to Triton's own)."""
    return tl.inline_asm_elementwise(BASE_PTX, "=r,r", [nbytes], dtype=tl.int32, is_pure=False,
                                     pack=1)


@triton.jit
def stage_piece(ptr, sbase, v, NV: tl.constexpr, VB: tl.constexpr):
    """Start copying NV 16-byte vectors from ``ptr`` (16-byte aligned) to shared address
    ``sbase``, one commit group; returns a token for :func:`stage_wait`."""
    g0 = ptr.to(tl.int64, bitcast=True)
    for j in tl.static_range(NV // VB):
        tl.inline_asm_elementwise(COPY_PTX, "=r,l,r", [g0 + (j * VB + v) * 16,
                                                       sbase + (j * VB + v) * 16],
                                  dtype=tl.int32, is_pure=False, pack=1)
    return tl.inline_asm_elementwise(COMMIT_PTX, "=r,r", [sbase], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def stage_wait(token):
    """Wait for this thread's copies, then for the CTA's (a barrier); returns int32 0."""
    return tl.inline_asm_elementwise(WAIT_PTX, "=r,r", [token], dtype=tl.int32, is_pure=False,
                                     pack=1) * 0


@triton.jit
def stage_row_piece(ptr, SB: tl.constexpr, C: tl.constexpr, VB: tl.constexpr):
    """Land the SB bytes at ``ptr`` (16-byte aligned) in this CTA's shared memory, with the
    exchange's slots of a cluster of C after them; returns (v, the piece's shared address,
    the first row's parity). The cluster's start barrier is split around the copies (C > 1),
    which then overlap the wait for the cluster's other CTAs."""
    tl.static_assert(SB % (16 * VB) == 0, "a piece is whole 16-byte vectors of every thread")
    v = tl.arange(0, VB)
    sbase = stage_base(tl.program_id(0) * 0 + (SB + 16 * C))
    token = stage_piece(ptr, sbase, v, SB // 16, VB)
    if C > 1:
        token = cluster_arrive(token)
    token = stage_wait(token)
    parity = token
    if C > 1:
        parity = cluster_wait(token)
    return v, sbase + token, parity


@triton.jit
def stage_read(saddr):
    """The 4 words of the shared vector at each address of ``saddr`` (int32 tensors)."""
    return tl.inline_asm_elementwise(READ_PTX, "=r,=r,=r,=r,r", [saddr],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                     is_pure=False, pack=1)


@triton.jit
def store_words(ptr, v, w0, w1, w2, w3):
    """Store 16-byte vectors ``v`` (indices from ``ptr``, 16-byte aligned) of words w0..w3."""
    g0 = ptr.to(tl.int64, bitcast=True)
    tl.inline_asm_elementwise(STORE_PTX, "=r,l,r,r,r,r", [g0 + v * 16, w0, w1, w2, w3],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def load_words(ptr, v):
    """The 4 words of the 16-byte global vectors ``v`` (indices from ``ptr``, 16-byte aligned;
    read-only data, such as a norm's weight)."""
    g0 = ptr.to(tl.int64, bitcast=True)
    return tl.inline_asm_elementwise(LOAD_PTX, "=r,=r,=r,=r,l", [g0 + v * 16],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                     is_pure=True, pack=1)


@triton.jit
def param_floats(ptr, v, KIND: tl.constexpr, PKIND: tl.constexpr):
    """A parameter's float32 values at the elements of x's 16-byte vectors ``v`` (indices
    from ``ptr``, the parameter's column of the vectors' first element): 8 for 16-bit x
    (KIND 0, 1) with the parameter in x's dtype (PKIND = KIND) or float32 (PKIND 2, two
    vectors), 4 and 4 zeros for float32 x and parameter (KIND = PKIND = 2)."""
    if PKIND == KIND:
        p0, p1, p2, p3 = load_words(ptr, v)
        if KIND == 2:
            f0, f1, f2, f3 = (p0.to(tl.float32, bitcast=True), p1.to(tl.float32, bitcast=True),
                              p2.to(tl.float32, bitcast=True), p3.to(tl.float32, bitcast=True))
            f4 = f0 * 0.0
            f5 = f4
            f6 = f4
            f7 = f4
        else:
            f0, f1, f2, f3 = word_lo(p0, KIND), word_hi(p0, KIND), word_lo(p1, KIND), word_hi(
                p1, KIND)
            f4, f5, f6, f7 = word_lo(p2, KIND), word_hi(p2, KIND), word_lo(p3, KIND), word_hi(
                p3, KIND)
    else:
        a0, a1, a2, a3 = load_words(ptr, 2 * v)
        b0, b1, b2, b3 = load_words(ptr, 2 * v + 1)
        f0, f1, f2, f3 = (a0.to(tl.float32, bitcast=True), a1.to(tl.float32, bitcast=True),
                          a2.to(tl.float32, bitcast=True), a3.to(tl.float32, bitcast=True))
        f4, f5, f6, f7 = (b0.to(tl.float32, bitcast=True), b1.to(tl.float32, bitcast=True),
                          b2.to(tl.float32, bitcast=True), b3.to(tl.float32, bitcast=True))
    return f0, f1, f2, f3, f4, f5, f6, f7


@triton.jit
def word_lo(w, KIND: tl.constexpr):
    """The first element of each word as float32 (KIND: 0 bfloat16, 1 float16, 2 float32)."""
    if KIND == 0:
        r = (w << 16).to(tl.float32, bitcast=True)
    elif KIND == 1:
        r = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        r = w.to(tl.float32, bitcast=True)
    return r


@triton.jit
def word_hi(w, KIND: tl.constexpr):
    """The second element of each word of 16-bit elements as float32."""
    if KIND == 0:
        r = (w & -65536).to(tl.float32, bitcast=True)
    else:
        r = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return r


@triton.jit
def pack_word(lo, hi, KIND: tl.constexpr):
    """A word of two float32 values rounded to 16 bits (KIND 0 or 1), or ``lo`` (KIND 2)."""
    if KIND == 0:
        a = lo.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 65535
        w = a | (hi.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) << 16)
    elif KIND == 1:
        a = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 65535
        w = a | (hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)
    else:
        w = lo.to(tl.int32, bitcast=True)
    return w

