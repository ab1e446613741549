"""LayerNorm launch rules: which kernel runs a call and with what tile, warps, stages and grid.

:func:`forward_config` / :func:`backward_config` (at the end) are the whole decision: the
call's facts and :class:`DeviceFacts` in, a :class:`LayerNormForward` / :class:`LayerNormBackward`
(the kernel variant or path and every launch parameter) out. Forward, in order:
``unrolled_fwd_table`` + ``UNROLLED_FWD``, ``RELOAD_FWD``, ``RELOAD_VEC_FWD``,
``UNROLLED_VEC_FWD``, then ``configs.common.unaligned_config`` (single-block), else
``split_config("fwd", ...)`` where split rows fit, else looped; backward: ``fused_plan``,
``dx_pieces_plan``, ``split_plan``, ``native_unaligned``, then the dx row kernel
(``configs.common.row_config``) and ``column_splits``. Rule tables and thresholds are data
(UPPER_CASE); every function here reads only them and its arguments (no tensors, no device,
nothing allocated or launched). Experiments change them through
:func:`fusedops.backends.triton.configs.override`. The host code that applies the decisions:
``triton/layernorm.py`` (forward) and ``triton/layernorm_bwd.py``.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from fusedops.backends.triton.configs.common import (
    DEFAULT_SINGLE_BLOCK_LIMIT,
    body_len,
    cluster_rule,
    for_gpu,
    grid_programs,
    num_row_tiles,
    pieces_rule,
    row_config,
    single_block_limit,
    split_fits,
    unaligned_config,
    unrolled_config,
)
from fusedops.backends.triton.runtime.clusters import CLUSTER_SIZES
from fusedops.backends.triton.runtime.device import cdiv, next_pow2
from fusedops.backends.triton.runtime.facts import DeviceFacts
from fusedops.backends.triton.runtime.split import split_pieces

# Backward replay plans (see triton/layernorm_bwd.py); FUSEDOPS_BWD_PLANS=0 turns them off.
BWD_PLANS = os.environ.get("FUSEDOPS_BWD_PLANS", "1") != "0"

# Forward: weight/bias stay in registers across a program's row tiles while each thread holds
# at most this many row elements (and the program has at most 16 warps, so 128+ registers per
# thread); otherwise they are reloaded per tile from L2. Measured on H200: holding them at 64
# elements per thread (8K columns, 4 warps) or at 32 warps (32K columns) spills and costs
# 10-30%.
FWD_HOLD_W_MAX_PER_THREAD = 32


def hold_w(block: int, warps: int) -> bool:
    return warps <= 16 and block // (32 * warps) <= FWD_HOLD_W_MAX_PER_THREAD


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


def split_config(kind: str, n: int, elt_size: int, aligned: bool,
                  vec: int = 0) -> tuple | None:
    """Split-row kernels: (largest piece in elements, warps, PREFETCH) per program; a row of N
    is cut into C = ceil(N / piece) equal pieces (no nearly empty last piece at N = 2^k + 1).
    (piece, warps, PREFETCH) of the split-row LayerNorm kernel for rows of ``n``, or None
    where the other kernels measured faster (H200 unless noted; PREFETCH: see runtime/split.py).

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


# The backward's cluster rules in split_config (tests turn them off to compare).
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
# accesses (see unaligned_vec): dx from ln_bwd_dx_pieces, one program per row reading its
# aligned body plus edges twice (the second time from L2) in pieces of (piece, warps), then the
# column kernel for dweight/dbias (x and dy read again: 5 passes, but every dx access a 16-byte
# vector). H200, TB/s of the op's 3·M·N·2 bytes against PyTorch's native backward (and
# torch.compile: benchmarks/results/h200/sweep.json, bf16 65537: 1.46 vs torch 1.10, compile
# 1.21): bf16 16385 1.63 vs 1.21, 65537 1.46 vs 1.11, 131073 1.41 vs 0.84; pieces (4096, 8) /
# (4096, 4) / (8192, 8):
# 16385 1.59 / 1.56 / 1.38, 32769 1.49 / 1.48 / 1.46, 131073 1.40 / - / 1.38, 65537 (2048, 4)
# 1.45, (4096, 4) 1.43, (8192, 8) 1.42. None: off (the paths below).
DX_PIECES_BWD: tuple[int, int] | None = (4096, 8)


def dx_pieces_plan(n: int, elt_size: int, vec: int) -> tuple | None:
    """(C, L, VEC, warps) of the dx-pieces backward (DX_PIECES_BWD) for rows of ``n`` elements
    of ``elt_size`` bytes (``vec``: see ``configs.common.unaligned_vec``, for x and dy), or None
    where it does not run."""
    if DX_PIECES_BWD is None or elt_size != 2 or next_pow2(n) <= FUSED_BWD_MAX_BLOCK:
        return None
    if not vec:
        return None
    piece, warps = DX_PIECES_BWD
    return (*split_pieces(n, piece, vec), vec, warps)


def native_unaligned(n: int, elt_size: int, plain: bool, dev: DeviceFacts) -> bool:
    """Whether PyTorch's native backward runs rows of ``n`` (NATIVE_UNALIGNED_16BIT_BWD);
    ``plain``: x and dy contiguous, dy and the weight (if any) in x's dtype (what the native
    kernel takes as it is)."""
    return (NATIVE_UNALIGNED_16BIT_BWD and dev.cuda and elt_size == 2 and n % 8 != 0
            and next_pow2(n) > FUSED_BWD_MAX_BLOCK and plain)


# Backward strategy (triton/layernorm.py docstring). Padded rows up to FUSED_BWD_MAX_BLOCK run one
# persistent kernel that writes dx and accumulates dweight/dbias partials per program (3 passes of
# memory plus (2, programs, N) float32 partials; above 8K the row and the accumulators no longer fit
# one program's registers without spilling). Longer rows run the split-row kernel where split_config
# says so, else the dx row kernel plus the column dweight/dbias kernel (x and dy read twice: 5
# passes).
FUSED_BWD_MAX_BLOCK = 8192


def max_partial_rows(m: int, n: int, elt_size: int) -> int:
    """Most (2, N) float32 partial rows a backward call on (m, n) rows of ``elt_size``-byte
    elements may allocate: 1/8 of x's bytes, so small batches do not pay scratch comparable to
    their activations (peak memory stays within a few percent of torch's); large ones are not
    limited by it."""
    return max(1, m * n * elt_size // 8 // (8 * n))


def fused_bwd_config(block: int, body: bool = False,
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
    if elt_size == 4 and block >= 4096:
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


def paired_sums(elt_size: int, vec: int, block: int) -> bool:
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
# ... and these as well on GPUs whose name contains the key. H200, bf16, fraction of copy
# (benchmarks/results/h200/norm-backward.json): 512 0.89 vs 0.78, 4K 0.90 vs 0.87.
PIPELINED_BWD_BLOCKS_GPU: dict[str, frozenset[int]] = {"H200": frozenset({512, 4096})}


def fused_bwd_stages(block: int, elt_size: int, strides: tuple[int, ...], name: str = "") -> int:
    """num_stages of the fused backward's tile loop (1: not pipelined) for padded rows of
    ``block`` elements of ``elt_size`` bytes with these row strides on the GPU called ``name``
    (PIPELINED_BWD_BLOCKS, PIPELINED_BWD_BLOCKS_GPU)."""
    if elt_size != 2 or not all(s % 8 == 0 for s in strides):
        return 1
    if block in PIPELINED_BWD_BLOCKS:
        return 3
    return 3 if any(block in blocks for blocks in for_gpu(PIPELINED_BWD_BLOCKS_GPU, name)) else 1


# The split-row backward's two piece sums in one paired reduction. H200, TB/s, separate ->
# paired: float32 16K 3.16 -> 3.23, 64K 3.11 -> 3.15, bf16 32K 2.24 -> 2.30; the
# rest within 1% either way.
SPLIT_PAIRED = True


def fused_plan(m: int, n: int, elt_size: int, vec: int, sms: int) -> tuple | None:
    """(VEC, BLOCK, ROWS, warps, ACC_1D, tiles, programs) of the fused backward for (m, n) rows
    of ``elt_size``-byte elements (``vec``: see ``configs.common.unaligned_vec``, for x and dy)
    on a GPU of ``sms`` SMs, or None where rows are too long for it. Unaligned rows (VEC > 0)
    are configured for their aligned body (N = 8193: 8192, not 16384) on a grid that is a
    multiple of VEC or has one tile per program (a program's accumulators then stay on fixed
    columns); where the partial-row budget allows no such grid, or the body is shorter than
    FUSED_BWD_UNALIGNED_MIN_BLOCK, they are read with scalar accesses."""
    if vec and next_pow2(body_len(n, vec)) < FUSED_BWD_UNALIGNED_MIN_BLOCK:
        vec = 0
    for v in (vec, 0) if vec else (0,):
        block = next_pow2(body_len(n, v))
        if block > min(FUSED_BWD_MAX_BLOCK, single_block_limit()):
            continue
        rows, warps, per_sm, acc_1d = fused_bwd_config(block, v > 0, elt_size)
        tiles = num_row_tiles(m, rows, v)
        progs = max(1, min(tiles, sms * per_sm, max_partial_rows(m, n, elt_size)))
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
SHIFT_W_BLOCK = 1024  # columns per program of shift_weights

# Inference calls use the kernel variant that writes no mean/rstd (and allocate neither), except
# 16-bit rows of 8K+ columns above this many elements. Measured on H200 at M·N = 2^27 (the same
# kernel, STATS on vs off): bf16 2K 3.63 vs 3.99 TB/s (two sweeps), 4K 3.69 vs 3.62, 8K 3.62 vs
# 2.98, 16K 2.78 vs 2.71; fp16 within 2%; float32 8K 4.02 vs 4.04, 16K 3.52 vs 3.80. Calls this
# small are bound by host time, where two allocations count.
STATS_FREE_16BIT_MAX = 1 << 22

# Aligned rows read whole, then again from L2 (ln_fwd_reload): (element size, padded row) ->
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

# Aligned rows on ln_fwd_unrolled (N compile-time): (element size, padded row) -> (chunk,
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
#   Short rows (benchmarks/results/h200/short-rows.json, bf16, fraction of copy): 768 on 256 x 1
#   1.02 (single-block, 1024 lanes for 768, 164 registers: 0.85; compile 1.02), 1536 on 512 x 2
#   1.02 (512 x 4: 0.95).
UNROLLED_FWD: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {
    (2, 1024): ((512, 2), (256, 1)), (2, 2048): ((2048, 4), (512, 2)),
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


def unrolled_fwd_table(name: str, key: tuple[int, int]) -> dict:
    """The rule table to read ``key`` ((element size, padded row)) from on the GPU called
    ``name`` ("": the CPU): a matching GPU's UNROLLED_FWD_GPU rules where they hold ``key``,
    else UNROLLED_FWD. No table is built per call; both are read per call, so tests and tuning
    can change either."""
    return next((rules for rules in for_gpu(UNROLLED_FWD_GPU, name) if key in rules),
                UNROLLED_FWD)


# Unaligned rows (VEC > 0) on ln_fwd_reload_vec: (element size, padded body) -> (chunk, warps).
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

# Unaligned rows (VEC > 0) with longer bodies on ln_fwd_unrolled_vec (N compile-time, like
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


def split_plan(n: int, elt_size: int, vec: int, aligned: bool,
               dev: DeviceFacts) -> tuple[tuple, int] | None:
    """(config, VEC) of the split-row backward for rows of ``n``, or None where it does not
    run on ``dev``. VEC > 0 (``vec`` from ``configs.common.unaligned_vec``; 0: scalar accesses
    asked for): rows that start unaligned, read as an aligned body cut into pieces plus edges
    where VEC_SPLIT_BWD has a rule, else as scalar pieces. ``aligned``: x's and dy's row
    strides are multiples of 8 elements."""
    if next_pow2(n) <= FUSED_BWD_MAX_BLOCK:
        return None
    cfg = split_config("bwd", n, elt_size, aligned, vec) if vec else None
    if cfg is None:  # no rule for aligned-body pieces here: scalar pieces
        vec, cfg = 0, (aligned and CLUSTER_BWD and gpu_split_bwd(dev.name, n, elt_size)
                       or split_config("bwd", n, elt_size, aligned))
    return (cfg, vec) if cfg and split_fits(dev, n, cfg[0]) else None


# split_config's backward for aligned rows, replaced on GPUs whose name contains the key:
# element size -> ((shortest row, longest row, config), ...). H200, bf16, fraction of copy
# (benchmarks/results/h200/norm-backward.json, norm-backward-after.json): 128K in clusters
# 0.51 / 0.51 vs 0.48 / 0.48 cooperative, where the H100 measured level (see split_config).
SPLIT_BWD_GPU: dict[str, dict[int, tuple[tuple[int, int, tuple], ...]]] = {
    "H200": {2: ((65537, 131072, (8192, 16, 1, None, True)),)},
}


def gpu_split_bwd(name: str, n: int, elt_size: int) -> tuple | None:
    """SPLIT_BWD_GPU's config for aligned rows of ``n`` on the GPU called ``name``, or None."""
    return next((cfg for tables in for_gpu(SPLIT_BWD_GPU, name)
                 for shortest, longest, cfg in tables.get(elt_size, ())
                 if shortest <= n <= longest), None)


def column_splits(m: int, n: int, sms: int,
                  max_splits: int | None = None) -> tuple[int, int, int]:
    """(column blocks, row splits, rows per split) of the dweight/dbias column kernel on a GPU
    of ``sms`` SMs: the fewest row splits giving COLUMN_PER_SM programs per SM, each owning a
    (row-split, column-block) tile (one split: no partials to sum); at most ``max_splits``
    splits."""
    block_c, block_r = COLUMN_TILE
    col_blocks = cdiv(n, block_c)
    splits = max(1, min(cdiv(m, block_r), cdiv(COLUMN_PER_SM * sms, col_blocks)))
    if max_splits is not None:
        splits = max(1, min(splits, max_splits))
    rows_per_split = cdiv(cdiv(m, splits), block_r) * block_r
    return col_blocks, cdiv(m, rows_per_split), rows_per_split


# ---------------------------------------------------------------------------- the decisions


class LayerNormForward(NamedTuple):
    """A LayerNorm forward launch: the kernel variant and its parameters (0 where it has none).

    Variants (``kernels/layernorm_fwd.py``): ``"unrolled"`` (``ln_fwd_unrolled``), ``"reload"``
    (``ln_fwd_reload``), ``"reload_vec"`` / ``"unrolled_vec"`` (``ln_fwd_reload_vec`` /
    ``ln_fwd_unrolled_vec``, weights from shifted copies), ``"single"`` (``ln_fwd_single``),
    ``"split"`` (``ln_fwd_split``; ``fallback``: the looped launch where the split launch is
    refused at run time), ``"pieces"`` (``ln_fwd_pieces`` in thread-block clusters;
    ``fallback``: the rules without clusters), ``"staged"`` (``ln_fwd_staged``, one cluster
    per row; ``fallback``: the rules without STAGED_FWD, for calls it cannot take) and
    ``"looped"`` (``ln_fwd_looped``)."""

    variant: str
    grid: int = 0  # programs (split, persistent pieces: sized from the compiled kernel's
    # occupancy at launch)
    warps: int = 0
    block: int = 0  # BLOCK: the padded row or body (single, reload), the chunk (looped) or piece
    rows: int = 0  # rows per tile (single)
    tiles: int = 0  # row tiles (single)
    chunk: int = 0  # elements per iteration (unrolled, reload) or largest piece (split)
    vec: int = 0  # elements per 16 bytes where rows start unaligned (body + edges), else 0
    body: int = 0  # unrolled_vec: the start of the aligned body's last vector
    stats: bool = True  # mean/rstd written (STATS; may be on where the call needs none)
    third_read: bool = False  # reload: THIRD_READ
    hold_w: bool = False  # single: weight and bias held in registers across tiles
    prefetch: int = 0  # split: PREFETCH (runtime/split.py)
    pieces: int = 0  # split, pieces, staged: C pieces per row
    piece: int = 0  # split, pieces, staged: L elements per piece
    plan: bool = False  # the launch is fixed by the call's signature (replay plans may keep it)
    fallback: LayerNormForward | None = None


# Aligned rows in thread-block clusters of streamed pieces (ln_fwd_pieces; rows that C =
# N / piece pieces of whole chunks fill, C a cluster size): each program runs the unrolled
# kernel's two passes on its piece, the second from L2, exchanging (mean offset, M2) on chip
# between them. Element size -> ((shortest row, longest row, (piece, CHUNK, warps,
# persistent)), ...). H200, fraction of copy against the rules without it, one run
# (benchmarks/results/h200/layernorm-pieces.json, pieces of 4K-32K): float32 128K on 16384 x
# 4096 x 16 persistent 0.70 vs 0.67. Elsewhere (bf16 and float32, 64K-256K) level or slower:
# the pieces' second pass reads x, weight and bias, where RMSNorm's reads x and weight.
PIECES_FWD: dict[int, tuple[tuple[int, int, tuple[int, int, int, bool]], ...]] = {
    4: ((131072, 131072, (16384, 4096, 16, True)),),
}


# Aligned rows in thread-block clusters whose pieces land in shared memory (ln_fwd_staged,
# kernels/layernorm_pieces.py: one cluster of C CTAs per row, each CTA's piece of L elements
# copied there by cp.async and read twice, for (offset, M2) and for y, around the cluster's
# exchange; x read from memory once). Element size -> ((shortest row, longest row, (L,
# warps)), ...), rows that are C whole pieces with C a cluster size; asked first.
# Empty: no GPU run has measured the kernel against the rules below yet (its candidates:
# benchmarks/dev/cluster_forward.py --kinds staged), so no call takes it.
STAGED_FWD: dict[int, tuple[tuple[int, int, tuple[int, int]], ...]] = {}


def forward_config(n: int, elt_size: int, vec: int, m: int, with_stats: bool, aligned: bool,
                   dev: DeviceFacts, staged: bool = True) -> LayerNormForward:
    """The forward launch for ``m`` rows of ``n`` elements of ``elt_size`` bytes on ``dev``
    (``vec``: see ``configs.common.unaligned_vec``; ``with_stats``: the call returns mean and
    rstd; ``aligned``: x's row stride is a multiple of 8 elements). Rules in the order asked:
    STAGED_FWD (where ``staged``) and PIECES_FWD (thread-block clusters), UNROLLED_FWD (per
    GPU: unrolled_fwd_table),
    RELOAD_FWD, RELOAD_VEC_FWD, UNROLLED_VEC_FWD, then the single-block kernel
    (``configs.common.unaligned_config``), split rows (split_config) where they fit, the
    looped kernel."""
    rule = (cluster_rule(STAGED_FWD.get(elt_size, ()), n, dev) if staged and aligned and not vec
            else None)
    if rule and n % rule[0] == 0:
        return LayerNormForward("staged", m * (n // rule[0]), rule[1], stats=with_stats,
                                pieces=n // rule[0], piece=rule[0],
                                fallback=forward_config(n, elt_size, vec, m, with_stats, aligned,
                                                        dev, False))
    pieces = pieces_rule(PIECES_FWD.get(elt_size, ()), n, dev) if aligned and not vec else None
    if pieces:
        piece, chunk, warps, persistent = pieces
        return LayerNormForward("pieces", 0 if persistent else m * (n // piece), warps,
                                chunk=chunk, stats=with_stats, pieces=n // piece, piece=piece,
                                fallback=forward_config(n, elt_size, vec, m, with_stats, aligned,
                                                        dev._replace(clusters=False)))
    whole = next_pow2(n)
    unrolled = unrolled_config(unrolled_fwd_table(dev.name, (elt_size, whole)), elt_size, n,
                               UNROLLED_FWD_ABOVE, vec)
    if unrolled:
        return LayerNormForward("unrolled", m, unrolled[1], chunk=unrolled[0], stats=with_stats,
                                plan=True)
    default_limit = single_block_limit() == DEFAULT_SINGLE_BLOCK_LIMIT
    reload = (RELOAD_FWD.get((elt_size, whole))
              if n > RELOAD_FWD_ABOVE and not vec and default_limit else None)
    if reload:
        # Measured with the statistics written (see STATS_FREE_16BIT_MAX).
        stats = with_stats or (elt_size == 2 and m * n > STATS_FREE_16BIT_MAX)
        return LayerNormForward("reload", m, reload[1], whole, chunk=reload[0], stats=stats,
                                third_read=len(reload) > 2 and reload[2],
                                plan=stats == with_stats)
    big_unaligned = vec and m * n >= RELOAD_VEC_MIN_ELEMS and default_limit
    body = next_pow2(body_len(n, vec))
    reload = RELOAD_VEC_FWD.get((elt_size, body)) if big_unaligned else None
    if reload:
        return LayerNormForward("reload_vec", m, reload[1], body, chunk=reload[0], vec=vec,
                                stats=with_stats)
    unrolled = UNROLLED_VEC_FWD.get((elt_size, body)) if big_unaligned else None
    if unrolled and (n // vec - 1) * vec >= unrolled[0]:
        return LayerNormForward("unrolled_vec", m, unrolled[1], chunk=unrolled[0], vec=vec,
                                body=(n // vec - 1) * vec, stats=with_stats)
    single, block, rows, warps, vec = unaligned_config(n, "ln_fwd", elt_size, vec)
    # The variant without statistics compiles slower for large 16-bit inputs with rows of 8K+
    # (bf16 8K: 2.98 vs 3.62 TB/s); the two small buffers cost nothing next to the kernel.
    stats = with_stats or (elt_size == 2 and block >= 8192 and m * n > STATS_FREE_16BIT_MAX)
    if single:
        tiles = num_row_tiles(m, rows, vec)
        # Unaligned 16-bit rows of 4K+: a persistent grid (H200, TB/s: bf16 4097 2.51
        # vs 2.29 one program per row, 8193 1.93 vs 1.77; float32 within 2%).
        persist = bool(vec) and elt_size == 2 and block >= 4096
        progs = grid_programs(tiles, warps, "ln_fwd", dev.num_sms, block, vec, persist)
        return LayerNormForward("single", progs, warps, block, rows, tiles, vec=vec,
                                stats=stats, hold_w=hold_w(block, warps),
                                plan=not vec and stats == with_stats)
    looped = LayerNormForward("looped", m, warps, block)
    cfg = split_config("fwd", n, elt_size, aligned and n % 8 == 0)
    if not (cfg and split_fits(dev, n, cfg[0])):
        return looped
    chunk, split_warps, prefetch = cfg
    pieces, piece = split_pieces(n, chunk, vec)
    return LayerNormForward("split", 0, split_warps, next_pow2(piece), chunk=chunk, vec=vec,
                            prefetch=prefetch, pieces=pieces, piece=piece, fallback=looped)


class FusedBackward(NamedTuple):
    """``ln_bwd_single`` writing dx and accumulating dweight/dbias (see :func:`fused_plan`)."""

    vec: int
    block: int
    rows: int
    warps: int
    acc_1d: bool
    tiles: int
    programs: int
    paired: bool  # PAIRED (paired_sums)
    stages: int  # STAGES (fused_bwd_stages)
    resident: int  # programs resident at once (caps the parked rows' second launch)


class SplitBackward(NamedTuple):
    """``ln_bwd_split`` (see :func:`split_config`); its grid comes from the compiled kernel's
    occupancy at launch."""

    chunk: int
    warps: int
    prefetch: int
    cap: int | None  # register cap (maxnreg)
    clusters: bool  # launched as thread-block clusters (else, or where refused, cooperative)
    vec: int
    pieces: int  # C
    piece: int  # L
    paired: bool  # PAIRED (SPLIT_PAIRED)
    max_rows: int  # partial rows the call may allocate (max_partial_rows)


class RowsBackward(NamedTuple):
    """The dx row kernel: ``ln_bwd_single`` writing dx only (``single``), else
    ``ln_bwd_dx_looped`` (BLOCK: the chunk; one program per row)."""

    single: bool
    block: int
    rows: int
    warps: int
    vec: int = 0
    tiles: int = 0
    programs: int = 0
    hold_w: bool = False
    paired: bool = False


class LayerNormBackward(NamedTuple):
    """A LayerNorm backward: the path (its launches, in ``triton/layernorm_bwd.py``) and the
    parameters of each kernel it runs. Column launches (``ln_bwd_dwdb_columns``) are (column
    blocks, row splits, rows per split); ``columns_direct``: one split straight into
    dweight/dbias, for parked paths that find no room in dx.

    ``"empty"`` (no rows or columns), ``"native"`` (PyTorch's kernel), ``"columns"`` (no dx:
    the column kernel alone), ``"fused"``, ``"dx_pieces"`` (columns, then dx on aligned-body
    pieces), ``"split"`` (``fallback``: what runs where no split grid fits or the launch is
    refused), ``"rows"`` (the columns, then the dx row kernel ``rows``)."""

    variant: str
    fused: FusedBackward | None = None
    split: SplitBackward | None = None
    # (C, L, VEC, warps, PAIRED) of ln_bwd_dx_pieces (dx_pieces_plan, SPLIT_PAIRED)
    pieces: tuple[int, int, int, int, bool] | None = None
    rows: RowsBackward | None = None
    columns: tuple[int, int, int] | None = None
    columns_direct: tuple[int, int, int] | None = None
    fallback: LayerNormBackward | None = None


def backward_config(m: int, n: int, elt_size: int, strides: tuple[int, int], vec: int,
                    need_dx: bool, need_dw: bool, need_db: bool, parked: bool, plain: bool,
                    dev: DeviceFacts) -> LayerNormBackward:
    """The backward of (m, n) rows of ``elt_size``-byte elements on ``dev``: ``strides`` (dy's,
    x's row strides), ``vec`` (``configs.common.unaligned_vec`` of dy and x), the gradients
    needed, ``parked`` (the ``low_memory`` mode: scratch parked in dx) and ``plain`` (see
    :func:`native_unaligned`). Asked in order: fused_plan, dx_pieces_plan, split_plan,
    native_unaligned, then the dx row kernel (row_config) and the column kernel."""
    need_part = need_dw or need_db
    some = m > 0 and n > 0
    fused = fused_plan(m, n, elt_size, vec, dev.num_sms) if need_part and some else None
    pieces = dx_pieces_plan(n, elt_size, vec) if fused is None and need_dx and m > 0 else None
    room = max(1, m * n * elt_size // (8 * n)) if some else 1  # (2, N) float32 rows in dx
    if pieces is not None:
        return LayerNormBackward("dx_pieces", pieces=(*pieces, SPLIT_PAIRED),
                                 columns=column_splits(m, n, dev.num_sms, room))
    aligned = strides[0] % 8 == 0 and strides[1] % 8 == 0
    split = (split_plan(n, elt_size, vec, aligned, dev)
             if fused is None and some and (need_dx or (need_part and not parked)) else None)
    native = fused is None and some and native_unaligned(n, elt_size, plain, dev)
    if native and not (split and split[1]):
        return LayerNormBackward("native")
    if not some:
        return LayerNormBackward("empty")
    direct = column_splits(m, n, dev.num_sms, 1)
    if parked and not need_dx and need_part:
        return LayerNormBackward("columns", columns=direct)
    if fused is not None:
        v, block, rows, warps, acc_1d, tiles, progs = fused
        per_sm = fused_bwd_config(block, v > 0, elt_size)[2]
        return LayerNormBackward("fused", FusedBackward(
            v, block, rows, warps, acc_1d, tiles, progs, paired_sums(elt_size, v, block),
            fused_bwd_stages(block, elt_size, (*strides, n), dev.name), dev.num_sms * per_sm),
            columns_direct=direct)
    rows = LayerNormBackward("rows", rows=_dx_rows_config(m, n, elt_size, vec, dev),
                             columns=column_splits(m, n, dev.num_sms,
                                                   room if need_dx else None))
    if not split:
        return rows
    fallback = rows
    if split[1]:  # aligned-body pieces, where no grid of C·VEC programs fits: PyTorch's
        # kernel, else the scalar pieces (any grid)
        scalar = None if native else split_plan(n, elt_size, 0, aligned, dev)
        if native:
            fallback = LayerNormBackward("native")
        elif scalar:
            fallback = _split_path(scalar, m, n, elt_size, need_dx, dev, direct, rows)
    return _split_path(split, m, n, elt_size, need_dx, dev, direct, fallback)


def _split_path(plan: tuple[tuple, int], m: int, n: int, elt_size: int, need_dx: bool,
                dev: DeviceFacts, direct: tuple[int, int, int],
                fallback: LayerNormBackward) -> LayerNormBackward:
    """The split path of ``plan`` (split_plan's (config, VEC)), ``fallback`` where it fails."""
    (chunk, warps, prefetch, *extra), vec = plan
    pieces, piece = split_pieces(n, chunk, vec)
    clusters = bool(len(extra) > 1 and extra[1] and need_dx and not vec and dev.clusters
                    and pieces in CLUSTER_SIZES)
    return LayerNormBackward("split", split=SplitBackward(
        chunk, warps, prefetch, extra[0] if extra else None, clusters, vec, pieces, piece,
        SPLIT_PAIRED, max_partial_rows(m, n, elt_size)), columns_direct=direct,
        fallback=fallback)


def _dx_rows_config(m: int, n: int, elt_size: int, vec: int, dev: DeviceFacts) -> RowsBackward:
    single, block, rows, warps = row_config(n, "ln_bwd", elt_size)
    if single and vec:
        single, block, rows, warps, vec = unaligned_config(n, "ln_bwd", elt_size, vec)
    if not single:
        return RowsBackward(False, block, rows, warps)
    tiles = num_row_tiles(m, rows, vec)
    return RowsBackward(True, block, rows, warps, vec, tiles,
                        grid_programs(tiles, warps, "ln_bwd", dev.num_sms, vec=vec),
                        hold_w(block, warps), paired_sums(elt_size, vec, block))
