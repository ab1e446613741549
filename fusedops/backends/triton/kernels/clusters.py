"""``@triton.jit`` helpers of the thread-block cluster exchange (inline PTX); the launcher and
the design notes are in ``runtime/clusters.py``."""

from __future__ import annotations

import triton
import triton.language as tl

# fo_base = the shared address just past the dynamic shared memory, whose end holds the bytes
# a launch adds to Triton's own (the exchange's slots last; kernels/staging.py's pieces before).
END_PTX = (
    "mov.u32 fo_base, global_smem;\n"
    "mov.u32 fo_size, %dynamic_smem_size;\n"
    "add.u32 fo_base, fo_base, fo_size;\n"
)

# Slots: the last 16·C bytes of the dynamic shared memory (the launch adds them to Triton's).
SLOTS_PTX = END_PTX + (
    "shl.b32 fo_size, {C}, 4;\n"
    "sub.u32 fo_base, fo_base, fo_size;\n"
    "shl.b32 fo_size, {C}, 3;\n"
    "mad.lo.u32 fo_base, {parity}, fo_size, fo_base;\n"
)


# $0 = $3 (a token ordering later reads after this); $1, $2 the CTA's sums; $3 its rank; $4 the
# row's parity; $5 C. Every thread runs it once: threads 0..C-1 each store the pair into one
# peer's slot, then every thread arrives and waits.
PUBLISH_PTX = tl.constexpr(
    "{\n"
    ".reg .u32 fo_base, fo_size, fo_t, fo_remote;\n"
    ".reg .pred fo_p;\n"
    + SLOTS_PTX.format(C="$5", parity="$4")
    + "mad.lo.u32 fo_base, $3, 8, fo_base;\n"
    "mov.u32 fo_t, %tid.x;\n"
    "setp.lt.u32 fo_p, fo_t, $5;\n"
    "@fo_p mapa.shared::cluster.u32 fo_remote, fo_base, fo_t;\n"
    "@fo_p st.shared::cluster.v2.f32 [fo_remote], {$1, $2};\n"
    "barrier.cluster.arrive.release;\n"
    "barrier.cluster.wait.acquire;\n"
    "mov.u32 $0, $3;\n"
    "}"
)


# ($0, $1) = slot [$3][$2] of this CTA, or 0 where $2 >= $4 (C); $5: the publish's token.
PEER_PTX = tl.constexpr(
    "{\n"
    ".reg .u32 fo_base, fo_size;\n"
    ".reg .pred fo_p;\n"
    + SLOTS_PTX.format(C="$4", parity="$3")
    + "mad.lo.u32 fo_base, $2, 8, fo_base;\n"
    "setp.lt.u32 fo_p, $2, $4;\n"
    "mov.f32 $0, 0f00000000;\n"
    "mov.f32 $1, 0f00000000;\n"
    "@fo_p ld.shared.v2.f32 {$0, $1}, [fo_base];\n"
    "}"
)


# Every CTA of the cluster has started before any stores into another's shared memory.
SYNC_PTX = tl.constexpr(
    "barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\nmov.u32 $0, 0;"
)


# The start barrier in two halves, for a kernel that starts its loads in between.
ARRIVE_PTX = tl.constexpr("barrier.cluster.arrive.relaxed;\nmov.u32 $0, $1;")
WAIT_PTX = tl.constexpr("barrier.cluster.wait.acquire;\nmov.u32 $0, $1;")


@triton.jit
def cluster_arrive(token):
    """Arrive at the cluster's start barrier (returns ``token``, int32); every CTA of the
    cluster has started once :func:`cluster_wait` returns."""
    return tl.inline_asm_elementwise(ARRIVE_PTX, "=r,r", [token], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def cluster_wait(token):
    """Wait at the barrier :func:`cluster_arrive` arrived at; returns int32 0 (the first
    row's parity)."""
    return tl.inline_asm_elementwise(WAIT_PTX, "=r,r", [token], dtype=tl.int32, is_pure=False,
                                     pack=1) * 0


@triton.jit
def cluster_start(like):
    """Cluster barrier at a cluster kernel's start; returns int32 0 (the first row's parity).
    ``like``: any int32 scalar (an operand the barrier's PTX ignores)."""
    return tl.inline_asm_elementwise(SYNC_PTX, "=r,r", [like], dtype=tl.int32, is_pure=False,
                                     pack=1)


@triton.jit
def cluster_piece(C: tl.constexpr):
    """(program id, its piece: its rank in its cluster of C, the first row's parity) of a
    kernel launched in clusters, after the barrier at the kernel's start."""
    pid = tl.program_id(0)
    return pid, pid % C, cluster_start(pid * 0)


@triton.jit
def cluster_publish(s1, s2, rank, parity, C: tl.constexpr):
    """Store this CTA's float32 sums (s1, s2) into slot [parity][rank] of every CTA of its
    cluster and meet the others at the cluster barrier; returns a token for
    :func:`cluster_peer_sums`."""
    return tl.inline_asm_elementwise(PUBLISH_PTX, "=r,f,f,r,r,r", [s1, s2, rank, parity, C],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def cluster_peer_sums(peers, parity, token, C: tl.constexpr):
    """(s1, s2) of the cluster's CTAs (a (C_P2,) float32 pair, 0 beyond C) after
    :func:`cluster_publish` for this parity; ``peers``: ``tl.arange(0, C_P2)``."""
    return tl.inline_asm_elementwise(PEER_PTX, "=f,=f,r,r,r,r", [peers, parity, C, token],
                                     dtype=(tl.float32, tl.float32), is_pure=False, pack=1)
