"""Softmax launch rules: which kernel runs a call and with what tile, warps and grid.

:func:`forward_config` / :func:`backward_config` are the whole decision: a call's row length,
element size, alignment (VEC), row count and :class:`DeviceFacts` in, a :class:`SoftmaxConfig`
(the kernel variant and every launch parameter) out. They ask, in order: forward
``CLUSTER_FWD`` (aligned rows on a GPU that runs thread-block clusters), ``NEXT_FWD``,
``UNROLLED_FWD`` (aligned rows, ``configs.common.unrolled_config``), ``UNROLLED_VEC_FWD``
(unaligned), ``RELOAD_FWD``, then ``configs.common.unaligned_config`` (single-block, else split
rows by :func:`split_config` where they fit, else looped); backward ``UNROLLED_BWD`` /
``UNROLLED_VEC_BWD`` (:func:`unrolled_bwd_config`), ``RELOAD_BWD``, then the same shared rules.
The host code that applies them: ``triton/softmax.py``; kernels: ``kernels/softmax.py``.
"""

from __future__ import annotations

from typing import NamedTuple

from fusedops.backends.triton.configs.common import (
    DEFAULT_SINGLE_BLOCK_LIMIT,
    body_len,
    cluster_rule,
    grid_programs,
    num_row_tiles,
    single_block_limit,
    split_fits,
    unaligned_config,
    unrolled_config,
)
from fusedops.backends.triton.runtime.device import next_pow2
from fusedops.backends.triton.runtime.facts import DeviceFacts
from fusedops.backends.triton.runtime.split import split_pieces


# Split-row kernels: (piece elements, warps, PREFETCH) by direction, element size and whether
# rows are unaligned (VEC > 0: aligned-body pieces plus edges); a row of N is cut into equal
# pieces of at most that many elements (split_pieces, runtime/split.py). Measured, TB/s,
# against the first split kernel (16384-element pieces on 16 warps, no prefetch) on H200 and H100:
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
def split_config(kind: str, elt_size: int, vec: int = 0, n: int = 0) -> tuple[int, int, int]:
    """(piece, warps, PREFETCH) of the split-row softmax kernels (``kind``: "fwd" or "bwd")."""
    if kind == "fwd":
        if vec:
            return (4096, 4, 3) if elt_size == 2 else (8192, 8, 3)
        if elt_size == 4:
            return 8192, 8, 1
        return (4096, 4, 3) if n <= 65536 else (8192, 8, 3)
    if elt_size == 4:
        return 8192, 8, 0
    return (8192, 8, 2) if vec else (8192, 8, 1)


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

# The forward's reload kernel (softmax_fwd_reload), aligned rows: (element size, padded row)
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

# Aligned rows on softmax_fwd_unrolled (N compile-time): (element size, padded row) ->
# (chunk, warps) configs, the first whose chunk divides N taken (warps 0: the other kernels).
# Checked before RELOAD_FWD. H200, TB/s bf16 / fp16 against
# the kernels these rows ran before: 4K 4.18 / 4.16 vs 4.00 / 4.00, 8K 4.14 / 4.16 vs 4.01 /
# 3.99, 16K 4.14 / 4.12 vs 3.88 / 3.91 (single-block), 64K on 8K x 16 3.45 / 3.45 vs 3.19 /
# 3.19 (reload); float32 16K 4.22 vs 4.07. Level or slower: 16-bit 32K (2.81-3.19 vs 3.20-3.24
# single-block), float32 32K (3.60-4.16 vs 4.17 reload) and 64K (2.92-3.09 vs 3.35 split rows).
# Rows between powers of two (benchmarks/results/h200/short-rows.json, bf16, fraction of copy,
# against single-block on the padded row): 768 1.03 on 256 x 2 (1.00), 2560 1.01 (0.99), 3072
# 1.01 on 1024 x 4 (0.98), 3584 1.03 (1.01), 5120 1.01 on 1024 x 8 (0.85); 1536 level.
UNROLLED_FWD: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {
    (2, 1024): ((1024, 0), (256, 2)), (2, 4096): ((2048, 8), (1024, 4), (512, 4)),
    (2, 8192): ((2048, 8), (1024, 8)), (2, 16384): ((2048, 8),),
    (2, 65536): ((8192, 16),), (4, 16384): ((4096, 16),),
}
UNROLLED_FWD_ABOVE = 512  # shorter rows skip the lookup

# Aligned rows on the single-block forward with the next tile prefetched (NEXT): (element size,
# padded row) -> (warps, programs per SM) of a persistent grid, for rows whose one program per
# SM otherwise waits on its own loads. H200, fraction of copy (h200/softmax-next.json): 16-bit
# 32K 0.90 / 0.91 (bf16 / fp16) vs 0.77 / 0.78 single-block; 8K and 16K slower (0.76-0.91 vs
# 1.00 unrolled).
NEXT_FWD: dict[tuple[int, int], tuple[int, int]] = {(2, 32768): (16, 1)}

# The single-block forward's exact float32 arithmetic (EXACT in kernels/softmax.py) from rows
# of this many elements: shorter rows, many to a program, keep the plain sum and reciprocal
# multiply, which cost them 8% (H200 256-768: 0.92 of copy in h200/sweep.json, 1.02 in the
# sweep before it), and their short sums were within the accuracy bound without it.
EXACT_MIN_N = 1024

# Unaligned rows (VEC > 0) on softmax_fwd_unrolled_vec: (element size, padded body) ->
# (chunk, warps), rows longer than RELOAD_FWD_ABOVE whose body holds a chunk. H200, TB/s
# against the split-row kernel on aligned-body pieces: bf16 / fp16 65537 2.79 / 3.01
# vs 2.21 / 2.21 (16384 x 16: 2.90 / 2.95, 8192 x 32: 2.72 / 3.17). Slower: float32 65537
# (2.53-2.73 vs 2.90), and 128K+ rows (16-bit 131073 / 262145 0.58-1.00 vs 2.07 / 2.04; the
# aligned kernel alike at 128K / 256K: 0.42-1.10 vs 2.78-3.33).
UNROLLED_VEC_FWD: dict[tuple[int, int], tuple[int, int]] = {(2, 65536): (8192, 16)}

# The backward on softmax_bwd_unrolled: aligned rows (element size, padded row) -> (chunk,
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


# The forward of long aligned rows in thread-block clusters (softmax_fwd_staged, kernels/
# softmax.py): one cluster of C CTAs per row, each CTA's piece of L elements landed in
# shared memory by cp.async and read there three times around the cluster's exchange of (max,
# sum), so x is read from memory once. Element size -> ((shortest row, longest row, (L,
# warps)), ...), rows that are C whole pieces with C a cluster size (CLUSTER_SIZES); checked
# first. Fraction of copy against the rules without clusters, one run each: H200 bf16 32K /
# 64K / 256K 0.91 / 0.88 / 0.85 vs 0.90 / 0.85 / 0.67 (256K on 32K pieces: 0.81), float32 64K /
# 256K 0.92 / 0.81 vs 0.77 / 0.71 (benchmarks/results/h200/softmax-staged.json); H100 16-bit
# 0.92-0.98 vs 0.81-0.94 (64K on 16K pieces: 0.95-0.97), float32 0.94-0.99 vs 0.84-0.89
# (h100/softmax-staged.json). Slower: 8K 16-bit pieces, 16 warps, 4 warps for 16-bit rows.
CLUSTER_FWD: dict[int, tuple[tuple[int, int, tuple[int, int]], ...]] = {
    2: ((32768, 32768, (16384, 8)), (65536, 131072, (32768, 8)), (262144, 262144, (16384, 8))),
    4: ((65536, 131072, (8192, 4)), (262144, 262144, (16384, 4))),
}


def unrolled_bwd_config(N: int, vec: int, elt_size: int) -> tuple[int, int] | None:
    """(chunk, warps) of UNROLLED_BWD / UNROLLED_VEC_BWD for rows of N, or None."""
    if not vec:
        return unrolled_config(UNROLLED_BWD, elt_size, N, UNROLLED_BWD_ABOVE, 0)
    cfg = (UNROLLED_VEC_BWD.get((elt_size, next_pow2(body_len(N, vec))))
           if single_block_limit() == DEFAULT_SINGLE_BLOCK_LIMIT else None)
    return cfg if cfg and (N // vec - 1) * vec >= cfg[0] else None


class SoftmaxConfig(NamedTuple):
    """A softmax launch: the kernel variant and its parameters (0 where the variant has none).

    Variants (``kernels/softmax.py``): ``"unrolled"`` (``softmax_fwd_unrolled`` /
    ``softmax_bwd_unrolled``), ``"unrolled_vec"`` (``softmax_fwd_unrolled_vec``), ``"reload"``
    (``softmax_fwd_reload``; backward: ``softmax_bwd_looped`` reading whole rows),
    ``"single"``, ``"split"`` (cooperative pieces; ``fallback``: the looped launch where the
    split launch is refused at run time), ``"looped"`` and ``"staged"`` (``softmax_fwd_staged``
    in ``kernels/softmax.py``, a cluster of ``pieces`` CTAs per row; ``fallback``: the
    rules without clusters)."""

    variant: str
    grid: int = 0  # programs (split: sized from the compiled kernel's occupancy at launch;
    # staged: rows x pieces)
    warps: int = 0
    block: int = 0  # BLOCK: single: the padded row (or body); looped: the chunk; split: the piece
    rows: int = 0  # rows per program tile (single)
    tiles: int = 0  # row tiles (single)
    chunk: int = 0  # elements per iteration (unrolled, reload) or largest piece (split)
    vec: int = 0  # elements per 16 bytes where rows start unaligned (body + edges), else 0
    body: int = 0  # unrolled over the aligned body: its last vector's start
    whole: int = 0  # reload: the padded row read whole (backward: 0 when read in pieces)
    first: int = 0  # backward reload: the first pass's piece
    even: int = 0  # reload: N where power-of-two rows run unmasked, else 0
    prefetch: int = 0  # split: PREFETCH (runtime/split.py)
    pieces: int = 0  # split, staged: C pieces per row
    piece: int = 0  # split, staged: L elements per piece
    plan: bool = False  # the launch is fixed by the call's signature (replay plans may keep it)
    next: int = 0  # single: NEXT (the next tile prefetched; a persistent grid)
    exact_rows: bool = False  # single forward: EXACT_ROWS (rows of EXACT_MIN_N+)
    fallback: SoftmaxConfig | None = None
    cluster: bool = False  # staged: a row's pieces as one thread-block cluster (CLUSTER_FWD)


def _rows_config(kind: str, direction: str, n: int, elt_size: int, vec: int, m: int,
                 dev: DeviceFacts, plan: bool = False) -> SoftmaxConfig:
    """Single-block, else split rows where they fit, else looped (shared by both directions)."""
    single, block, rows, warps, vec = unaligned_config(n, kind, elt_size, vec)
    if single:
        tiles = num_row_tiles(m, rows, vec)
        progs = grid_programs(tiles, warps, kind, dev.num_sms)
        return SoftmaxConfig("single", progs, warps, block, rows, tiles, vec=vec,
                             plan=plan and not vec)
    looped = SoftmaxConfig("looped", m, warps, block)
    chunk, split_warps, prefetch = split_config(direction, elt_size, vec, n)
    if not split_fits(dev, n, chunk):
        return looped
    pieces, piece = split_pieces(n, chunk, vec)
    return SoftmaxConfig("split", 0, split_warps, next_pow2(piece), chunk=chunk, vec=vec,
                         prefetch=prefetch, pieces=pieces, piece=piece, fallback=looped)


def forward_config(n: int, elt_size: int, vec: int, m: int, dev: DeviceFacts) -> SoftmaxConfig:
    """The forward launch for ``m`` rows of ``n`` elements of ``elt_size`` bytes (``vec``: see
    ``configs.common.unaligned_vec``) on ``dev``."""
    cluster = cluster_rule(CLUSTER_FWD.get(elt_size, ()), n, dev) if not vec else None
    if cluster and n % cluster[0] == 0:
        piece, warps = cluster
        return SoftmaxConfig("staged", m * (n // piece), warps, chunk=piece, pieces=n // piece,
                             piece=piece, cluster=True,
                             fallback=forward_config(n, elt_size, vec, m,
                                                     dev._replace(clusters=False)))
    nxt = NEXT_FWD.get((elt_size, next_pow2(n))) if NEXT_FWD and not vec else None
    if nxt and n <= single_block_limit():
        warps, per_sm = nxt
        block = next_pow2(n)
        tiles = num_row_tiles(m, 1, 0)
        return SoftmaxConfig("single", max(1, min(tiles, dev.num_sms * per_sm)), warps, block,
                             1, tiles, plan=True, next=1, exact_rows=n >= EXACT_MIN_N)
    unrolled = unrolled_config(UNROLLED_FWD, elt_size, n, UNROLLED_FWD_ABOVE, vec)
    if unrolled:
        return SoftmaxConfig("unrolled", m, unrolled[1], chunk=unrolled[0], plan=True)
    default_limit = single_block_limit() == DEFAULT_SINGLE_BLOCK_LIMIT
    unrolled = (UNROLLED_VEC_FWD.get((elt_size, next_pow2(body_len(n, vec))))
                if vec and n > RELOAD_FWD_ABOVE and default_limit else None)
    if unrolled and (n // vec - 1) * vec >= unrolled[0]:
        return SoftmaxConfig("unrolled_vec", m, unrolled[1], chunk=unrolled[0], vec=vec,
                             body=(n // vec - 1) * vec)
    if n > RELOAD_FWD_ABOVE and not vec and default_limit:
        whole = next_pow2(n)
        reload = RELOAD_FWD.get((elt_size, whole))
        if reload:
            return SoftmaxConfig("reload", m, reload[1], chunk=reload[0], whole=whole,
                                 even=n if n == whole else 0)
    cfg = _rows_config("softmax_fwd", "fwd", n, elt_size, vec, m, dev, plan=True)
    return cfg._replace(exact_rows=n >= EXACT_MIN_N) if cfg.variant == "single" else cfg


def backward_config(n: int, elt_size: int, vec: int, m: int, dev: DeviceFacts) -> SoftmaxConfig:
    """The backward launch for ``m`` rows of ``n`` elements (as :func:`forward_config`)."""
    if n > UNROLLED_BWD_ABOVE:
        unrolled = unrolled_bwd_config(n, vec, elt_size)
        if unrolled:
            return SoftmaxConfig("unrolled", m, unrolled[1], chunk=unrolled[0], vec=vec,
                                 body=(n // vec - 1) * vec if vec else n)
    reload = (RELOAD_BWD.get((elt_size, next_pow2(n)))
              if n > RELOAD_BWD_ABOVE and not vec
              and single_block_limit() == DEFAULT_SINGLE_BLOCK_LIMIT else None)
    if reload:
        chunk, warps, *first = reload  # (chunk, warps[, first-pass piece]): see RELOAD_BWD
        return SoftmaxConfig("reload", m, warps, chunk=chunk,
                             whole=0 if first else next_pow2(n),
                             first=first[0] if first else chunk,
                             even=n if n == next_pow2(n) and UNROLL_RELOAD_BWD else 0)
    return _rows_config("softmax_bwd", "bwd", n, elt_size, vec, m, dev)
