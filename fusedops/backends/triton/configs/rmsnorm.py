"""RMSNorm launch rules: :func:`forward_config` and :func:`backward_config` pick the kernel of a
call and its launch parameters from the row length, the element size, the rows' alignment
(VEC from ``configs.common.unaligned_vec``) and device facts; the tables and switches below are
what they read. Host code: ``triton/rmsnorm.py`` (forward) and ``triton/rmsnorm_bwd.py``;
kernels: ``kernels/rmsnorm.py`` and ``kernels/rmsnorm_split.py``.

Rules marked "LayerNorm's" were measured for the LayerNorm kernels of the same structure and
row lengths, not yet for RMSNorm's (which move the same bytes with less arithmetic). The new
paths can be switched off for measurements against the kernels they replaced:
``configs.override("rmsnorm", VEC_EDGES=False)`` (unaligned rows on scalar accesses) and
``configs.override("rmsnorm", SPLIT_ROWS_MIN=1 << 62)`` (long rows on the looped kernels),
``configs.override("rmsnorm", UNROLLED_FWD={})`` (aligned rows on the kernels they took before
rms_fwd_unrolled).
"""

from __future__ import annotations

from typing import NamedTuple

from fusedops.backends.triton.configs.common import (
    DEFAULT_SINGLE_BLOCK_LIMIT,
    PERSISTENT,
    PERSISTENT_ABOVE,
    body_len,
    cluster_rule,
    for_gpu,
    pieces_rule,
    row_config,
    single_block_limit,
    split_fits,
    unaligned_config,
    unrolled_config,
)
from fusedops.backends.triton.runtime.device import next_pow2
from fusedops.backends.triton.runtime.facts import DeviceFacts

# The weight stays in registers across a program's row tiles while each thread holds at most
# this many row elements (LayerNorm's measured rule, FWD_HOLD_W_MAX_PER_THREAD).
HOLD_W_MAX_PER_THREAD = 32


def hold_w(block: int, warps: int) -> bool:
    """Whether a program of ``warps`` warps over padded rows of ``block`` elements keeps the
    weight in registers across its row tiles (HOLD_W)."""
    return warps <= 16 and block // (32 * warps) <= HOLD_W_MAX_PER_THREAD


# Unaligned rows (N not a multiple of 16 bytes, e.g. 2^k + 1) as an aligned body read with
# 16-byte vectors plus scalar edges (kernels/common.py, row_body); off: scalar accesses for the
# whole row (the kernels' earlier behaviour, for measurements against it).
VEC_EDGES = True

# Rows of at least this many elements that no one-program kernel holds take the split-row
# kernels (CUDA); a larger value leaves them to the looped kernels (1 << 62: off).
SPLIT_ROWS_MIN = 0

# The backward's tiles and warps are LayerNorm's measured ones (layernorm.fused_bwd_config),
# not re-tuned for RMSNorm; only the fused kernel's row limit was measured (below).
# Padded rows up to this many elements take the fused backward (the row, dy and the dweight
# accumulator in registers); longer rows split rows, else the looped dx kernel plus the
# column kernel. H200, TB/s: 16K rows fused 2.46 vs 2.37 looped + columns (bf16), 3.47 vs
# 2.12 (float32); 32K rows spill in one program (0.21-0.52). Rows with N not a multiple of 16
# on scalar accesses take it on 32 warps (8193: bf16 1.11 vs 0.78 on 16 warps and 0.74
# looped; float32 2.03 vs 1.24 and 1.44).
FUSED_BWD_MAX_BLOCK = 16384
FUSED_BWD_MAX_BLOCK_UNALIGNED = 16384

# Unaligned rows take the fused backward on their aligned body (rms_bwd_vec) from bodies of
# this many elements; shorter ones stay scalar (LayerNorm's FUSED_BWD_UNALIGNED_MIN_BLOCK:
# level at 2049 on one-row tiles, ahead from 4097).
FUSED_BWD_VEC_MIN_BLOCK = 2048

# Chunk of the looped kernels (elements per iteration; smaller while tests shrink the
# single-block limit, so short rows loop over several chunks).
LOOPED_CHUNK = 8192

# The dweight column kernel: (columns, rows) per iteration, warps, programs per SM.
COLUMN_TILE = (128, 64)
COLUMN_WARPS = 16
COLUMN_PER_SM = 2

# 16-bit rows (N a multiple of 16): (ROWS, num_warps, programs per SM, ACC_1D) by padded row,
# measured (H200, TB/s against LayerNorm's rule): 1K 3.46 vs 3.35, 2K 3.46
# vs 3.35, 8K 3.57 vs 3.48 (bf16; fp16 alike); fraction of copy, bf16
# (benchmarks/results/h200/norm-backward.json, norm-backward-after.json): 512 0.83 vs 0.79,
# 16K on 8 warps 0.78-0.79 vs 0.62 on 16 (one program per SM 0.785 vs two 0.760).
BWD_RULES_16BIT: dict[int, tuple[int, int, int, bool]] = {
    512: (4, 4, 4, False), 1024: (2, 4, 4, False), 2048: (1, 4, 4, True),
    8192: (2, 32, 1, True), 16384: (1, 8, 1, True),
}


def bwd_config(block: int, elt_size: int, aligned: bool = True) -> tuple[int, int, int, bool]:
    """(ROWS, num_warps, programs per SM, ACC_1D) of the fused backward for padded rows of
    ``block`` elements of ``elt_size`` bytes: 4K-element tiles at two programs per SM up to 2K
    columns (a (ROWS, BLOCK) accumulator up to 1K), 16K-element tiles (float32 rows of 4K+:
    8K) at one 16-warp program per SM above (LayerNorm's measured rule); measured for RMSNorm:
    16-bit rows in BWD_RULES_16BIT, rows of 8K-16K that are not ``aligned`` (N not a multiple
    of 16) on 32 warps (see above)."""
    if not aligned and block == 16384:
        return 1, 32, 1, True
    if aligned and elt_size == 2 and block in BWD_RULES_16BIT:
        return BWD_RULES_16BIT[block]
    if elt_size == 4 and block >= 4096:
        tile, per_sm, acc_1d = 8192, 1, True
    elif block <= 2048:
        tile, per_sm, acc_1d = 4096, 2, block > 1024
    else:
        tile, per_sm, acc_1d = 16384, 1, True
    tile = max(tile, block)
    return tile // block, max(4, min(16, tile // 512)), per_sm, acc_1d


# The fused backward's tile loop pipelined by Triton (STAGES = 3) for these padded blocks of
# 16-bit rows whose row strides and length are multiples of 16 bytes. H200, fraction of copy,
# pipelined vs not (benchmarks/results/h200/rmsnorm-backward-stages.json; bf16, fp16 alike):
# 768 0.94 vs 0.75 and fp16 2K 0.91 vs 0.83 in the same run; 512 / 1K / 2K 0.91 / 0.92 /
# 0.92 against 0.83 / 0.82 / 0.84 unpipelined in norm-backward-after.json. Slower: 4K (0.85
# vs 0.89) and 8K (0.65 vs 0.85) in the same run.
PIPELINED_BWD_BLOCKS: frozenset[int] = frozenset({512, 1024, 2048})


def fused_bwd_stages(block: int, elt_size: int, rows_aligned: bool) -> int:
    """STAGES of rms_bwd_single for padded rows of ``block`` (PIPELINED_BWD_BLOCKS)."""
    return 3 if elt_size == 2 and rows_aligned and block in PIPELINED_BWD_BLOCKS else 1


def vec_bwd_config(block: int, elt_size: int) -> tuple[int, int]:
    """(num_warps, programs per SM) of rms_bwd_vec for aligned bodies padded to ``block``:
    LayerNorm's body-variant rule (fused_bwd_config(body=True): one row per tile, two programs
    per SM; float32 bodies of 4K+ one per SM on 8K-element tiles, i.e. 16 warps)."""
    tile, per_sm = (8192, 1) if elt_size == 4 and block >= 4096 else (block, 2)
    return max(4, min(16, max(tile, block) // 512)), per_sm


# Forward launch rules measured for RMSNorm: (element size, padded row) -> (ROWS, num_warps,
# persistent grid); other rows take LayerNorm forward's rules (row_config, kind "ln_fwd").
# H200 (TB/s, copy 4.22-4.25; LayerNorm's rule in brackets): bf16 4K 4 rows x 8 warps 4.03
# [3.98], 8K 2 x 8 4.04 [3.96]; float32 8K 1 x 8 4.10 [4.03], 16K 2 x 16 4.10 [3.90], 32K
# 1 x 32 3.90 [3.85]. Rows with N not a multiple of 16 keep LayerNorm's rules (scalar
# accesses at 8193: 1.75 [1.16-1.58 on these]). Not kept: 16-bit 16K on 1 x 32, faster for the
# forward with rstd (3.91 [3.22]) but not for the inference forward (0.65-0.68 of copy, behind
# compile, in the RMSNorm sweep committed at 308b1c8 as benchmarks/results/h200/rmsnorm.json).
# 16-bit 256: 4 rows x 1 warp, 0.99 of copy vs 0.97-0.98 on LayerNorm's 8, where LayerNorm
# measured slower on 4 (benchmarks/results/h200/short-rows-256-512.json).
FWD_RULES: dict[tuple[int, int], tuple[int, int, bool]] = {
    (2, 256): (4, 1, False), (2, 4096): (4, 8, False), (2, 8192): (2, 8, False),
    (4, 8192): (1, 8, False), (4, 16384): (2, 16, False), (4, 32768): (1, 32, False),
}

# Aligned rows on rms_fwd_unrolled (N compile-time, one program per row): (element size,
# padded row) -> ((chunk, warps), ...), the first config whose chunk divides N taken (warps 0:
# the rows keep the other kernels); rows must start 16-byte aligned (row stride and N). The
# single-block kernel held a 16-bit 16K row on 16 warps at 88 registers, one program per SM
# whose loads idle while it reduces (ptxas sm_90: rms_fwd_unrolled 32 registers on 4096 x 16).
# H200, inference forward, fraction of copy bandwidth, bf16 / fp16 (the kernels these rows
# took before; compile: torch.compile, same run; benchmarks/results/h200/rmsnorm-unrolled.json):
# 16-bit 4K 0.99 / 1.00 on 2048 x 8 (single 0.97 / 0.98; compile 0.88-0.91), 8K 1.01 on 4096 x
# 16 (single 0.97-0.98; compile 1.01), 16K 1.00 on 8192 x 16 (single 0.77; compile 0.96), 32K
# 0.99 on 8192 x 32 (single 0.90; compile 0.97-0.99), 64K 0.90 on 8192 x 32 (looped 0.65;
# compile 0.66); float32 8K 0.995 on 4096 x 32 (single 0.97), 16K 0.996 (single 0.96;
# compile 0.99). Second configs (padded neighbours such as 12288, 6144) are LayerNorm's.
# Longer rows (rmsnorm-unrolled-long.json): bf16 128K 0.76 on 16384 x 32 (looped 0.63, compile
# 0.63), 256K 0.67 (looped 0.63); float32 64K-256K stay (single-block / split 0.69-0.89, the
# unrolled candidates 0.67-0.83).
# Rows between powers of two (short-rows.json, bf16; single-block pads them to the next power
# of two): 768 1.04 on 256 x 1 (single 0.91, compile 1.02), 1536 1.03 (0.99), 2560 1.00
# (0.85), 3072 1.00 on 1024 x 8 (0.93), 3584 level, 5120 0.99 on 1024 x 8 (0.85, compile 0.89).
# float32 rows of one chunk (rmsnorm-unrolled-float32.json): 2K 1.00 on 2048 x 8 (single 0.97),
# 4K 1.01 on 4096 x 16 (0.97), 32K 0.98 on 32768 x 32 (single 0.90; 8192 x 32 0.84).
UNROLLED_FWD: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {
    (2, 1024): ((1024, 0), (256, 1)), (2, 2048): ((2048, 0), (512, 4)),
    (2, 4096): ((2048, 8), (1024, 8), (512, 4)), (2, 8192): ((4096, 16), (2048, 8), (1024, 8)),
    (2, 16384): ((8192, 16), (4096, 16)), (2, 32768): ((8192, 32),), (2, 65536): ((8192, 32),),
    (2, 131072): ((16384, 32),), (2, 262144): ((16384, 32),),
    (4, 2048): ((2048, 8),), (4, 4096): ((4096, 16),), (4, 8192): ((4096, 32), (2048, 16)),
    (4, 16384): ((4096, 32),), (4, 32768): ((32768, 32),),
}

# Unaligned rows in the single-block kernel: LayerNorm's unaligned_config (kind "ln_fwd"), and
# for 16-bit bodies of this many elements and more a persistent grid (LayerNorm's, H200: bf16
# 4097 2.51 vs 2.29 TB/s one program per row, 8193 1.93 vs 1.77; float32 within 2%).
VEC_FWD_PERSISTENT_16BIT_FROM = 4096

# Large calls (this many elements and more) of unaligned rows read the weight from copies
# shifted per row misalignment (shift_weights: lane j of a body starting at column h reads
# row h of the copies, so weight loads are 16-byte vectors too), and 16-bit bodies of 4K-32K
# take rms_fwd_reload_vec. LayerNorm's RELOAD_VEC_MIN_ELEMS: the copies cost a launch and an
# allocation (14.5 µs of host time per call on an H100 host), which small calls do not win back.
SHIFTED_W_MIN_ELEMS = 1 << 24
SHIFT_W_BLOCK = 1024  # columns per program of the shift_weight launch

# Unaligned 16-bit rows of large calls on rms_fwd_reload_vec: (element size, padded body) ->
# (write-pass chunk, warps). LayerNorm's RELOAD_VEC_FWD (H100, TB/s against its single-block
# kernel with scalar weight loads: bf16 4097 2.87 vs 2.27, 8193 2.72 vs 1.71, 16385 2.65 vs
# 1.83, 32769 2.49 vs 0.52); float32 rows stay single-block (LayerNorm: 8193 2.82 vs 2.92).
RELOAD_VEC_FWD: dict[tuple[int, int], tuple[int, int]] = {
    (2, 4096): (1024, 4), (2, 8192): (1024, 8), (2, 16384): (4096, 16), (2, 32768): (8192, 32),
}

# Unaligned rows of large calls with longer bodies on rms_fwd_unrolled_vec (N compile-time, the
# body in unrolled vector chunks, the weight from the shifted copies): (element size, padded
# body) -> (chunk, warps), rows whose body holds a chunk; checked ahead of the split rows.
# H200, fraction of copy against split rows on aligned-body pieces (h200/rmsnorm-unaligned.json,
# bf16 / fp16): 65537 0.75 / 0.77 vs 0.53 / 0.53, 131073 0.71 / 0.71 vs 0.39 / 0.39, 262145
# 0.61 / 0.61 vs 0.58 / 0.58; float32 65537 0.74 vs 0.71. Slower: float32 131073 / 262145
# (0.57-0.63 vs 0.68 / 0.72), which stay on split rows.
UNROLLED_VEC_FWD: dict[tuple[int, int], tuple[int, int]] = {
    (2, 65536): (8192, 32), (2, 131072): (16384, 32), (2, 262144): (16384, 32),
    (4, 65536): (16384, 32),
}


# Split-row forward: (element size, rows start aligned) -> (largest piece, warps, PREFETCH);
# rows without a rule stream looped. LayerNorm's split_config("fwd") configurations: aligned
# float32 8192 on 4 warps prefetching before publishing, unaligned rows (aligned-body pieces)
# 8192 on 4 warps prefetching between publishing and waiting. H200, TB/s against the looped
# kernel: float32 64K 3.18 vs 2.62, 128K 3.07 vs 2.41, 256K 2.87 vs 2.59, 65537 2.80 vs 2.29;
# bf16 65537 2.13 vs 1.63. Aligned 16-bit rows stay looped (the two-pass RMSNorm loop reads
# the row back from L2): bf16 64K 2.70 vs 2.43 split on 8192 x 8, 128K 2.61 vs 2.30.
SPLIT_FWD: dict[tuple[int, bool], tuple[int, int, int]] = {
    (4, True): (8192, 4, 1), (2, False): (8192, 4, 3), (4, False): (8192, 4, 3),
}


# Split-row backward, aligned rows: element size -> ((longest row, (piece, warps, PREFETCH,
# register cap)), ...), the first that holds. LayerNorm's split_config("bwd"): 16-bit up to
# 64K 4096 x 8 prefetching before publishing, capped at 128 registers (H100, bf16 32K / 64K:
# 2.00 / 1.95 vs 1.67 dx + column kernels), 128K 8192 x 16 (1.86), longer 8192 x 8
# prefetching between publishing and waiting (256K: 1.75 vs 1.62); float32 up to 32K 2048 x 4,
# 64K 4096 x 4, longer 8192 x 8 (H200: 64K 3.12 vs 2.71; 256K 2.83 vs 1.47).
SPLIT_BWD: dict[int, tuple[tuple[int, tuple[int, int, int, int | None]], ...]] = {
    2: ((65536, (4096, 8, 1, 128)), (131072, (8192, 16, 1, None)), (1 << 62, (8192, 8, 3, None))),
    4: ((32768, (2048, 4, 0, None)), (65536, (4096, 4, 2, None)), (1 << 62, (8192, 8, 2, None))),
}
# ... in thread-block clusters (aligned rows, calls with dx, Hopper; elsewhere the same
# pieces on a cooperative grid): LayerNorm's (H100, against the cooperative rules above:
# bf16 16K / 32K 2.34 / 2.27 vs 2.08 / 2.04 on 2048 x 4 capped at 128, 64K 2.10 vs 1.98 on
# 4096 x 8; float32 16K-64K 8192 x 8, 2.85 / 2.80 / 2.77 vs 2.60 / 2.59 / 2.63). {}: none.
CLUSTER_BWD: dict[int, tuple[tuple[int, tuple[int, int, int, int | None]], ...]] = {
    2: ((32768, (2048, 4, 1, 128)), (65536, (4096, 8, 1, 128))),
    4: ((65536, (8192, 8, 1, None)),),
}
# ... replaced on GPUs whose name contains the key. H200, bf16, fraction of copy against the
# rules above (norm-backward.json): 32K on 4096 x 8 0.67 vs 0.63; 128K in clusters 0.54 vs
# 0.53 cooperative (LayerNorm 0.51 vs 0.48), where the H100 measured both the other way.
CLUSTER_BWD_GPU: dict[str, dict[int, tuple[tuple[int, tuple[int, int, int, int | None]], ...]]] = {
    "H200": {2: ((65536, (4096, 8, 1, 128)), (131072, (8192, 16, 1, None)))},
}


def cluster_bwd_table(name: str, elt_size: int) -> tuple:
    """CLUSTER_BWD's rules for ``elt_size`` on the GPU called ``name`` ("": the CPU): a
    matching GPU's CLUSTER_BWD_GPU entry where it has one (read per call: tests change them)."""
    return next((rules[elt_size] for rules in for_gpu(CLUSTER_BWD_GPU, name)
                 if elt_size in rules), CLUSTER_BWD.get(elt_size, ()))
# ... unaligned rows as aligned-body pieces plus edges (VEC > 0): element size -> config.
# float32: LayerNorm's VEC_SPLIT_BWD (H200, vs scalar pieces: 65537 2.51 vs 1.89, 131073
# 2.51 vs 1.80); 16-bit: the best LayerNorm measured on such pieces (bf16 65537, 2048 x 8:
# 1.10 TB/s, level with PyTorch's kernel, which RMSNorm lacks; scalar pieces slower), capped
# at 128 registers (H200, bf16 65537: 0.33 of copy vs 0.27 uncapped, norm-backward.json).
VEC_SPLIT_BWD: dict[int, tuple[int, int, int, int | None]] = {
    4: (4096, 4, 2, None), 2: (2048, 8, 1, 128),
}
# ... unaligned rows on scalar accesses (strides that rule out the body/edge split):
# LayerNorm's, 16-bit (8192 x 8 up to 32K, 8192 x 16 above); float32 as aligned rows.
SCALAR_SPLIT_BWD_16BIT: tuple[tuple[int, tuple[int, int, int, int | None]], ...] = (
    (32768, (8192, 8, 2, None)), (1 << 62, (8192, 16, 1, None)),
)


class FwdConfig(NamedTuple):
    """The forward's kernel and launch parameters (:func:`forward_config`)."""

    kernel: str  # "single" | "unrolled" | "unrolled_vec" | "reload_vec" | "split" | "pieces"
    # | "staged" | "looped"
    block: int  # BLOCK_N: padded row or body (single, reload_vec), chunk (looped); unrolled_vec:
    # BODY, the body elements every row streams; pieces, staged: L; 0 (split, unrolled: N
    # constexpr)
    rows: int  # rows per tile (single)
    warps: int
    persistent: bool  # single, pieces: a persistent grid rather than one program (cluster) per
    # tile (row)
    vec: int  # VEC: > 0 for unaligned rows as an aligned body plus edges
    chunk: int  # unrolled(_vec), pieces: CHUNK; reload_vec: write-pass chunk; split: largest
    # piece
    prefetch: int  # split: PREFETCH
    shifted_w: bool  # the weight from per-misalignment shifted copies
    cluster: bool = False  # split, pieces, staged: a row's pieces as one thread-block cluster
    fallback: FwdConfig | None = None  # cluster: the rules without clusters (staged: the rules
    # without STAGED_FWD, for calls it cannot take)


class BwdConfig(NamedTuple):
    """The backward's kernel and launch parameters (:func:`backward_config`)."""

    kernel: str  # "fused" (rms_bwd_single, or rms_bwd_vec with VEC > 0) | "split" | "pieces"
    # | "looped"
    block: int  # BLOCK_N (fused), chunk (looped), 0 (split), L (pieces)
    rows: int  # rows per tile (fused)
    warps: int
    per_sm: int  # fused: programs per SM
    acc_1d: bool  # fused: ACC_1D
    vec: int
    chunk: int  # split: largest piece; pieces: CHUNK
    prefetch: int  # split: PREFETCH
    maxnreg: int | None  # split: register cap
    cluster: bool  # split: pieces as thread-block clusters where the device allows; pieces
    stages: int = 1  # fused (rms_bwd_single): STAGES (PIPELINED_BWD_BLOCKS)
    fallback: BwdConfig | None = None  # pieces: the rules without clusters (calls without dx,
    # refused launches)


def looped_config() -> tuple[int, int]:
    """(CHUNK, num_warps) of the looped kernels: 16 warps for 8K chunks (untuned)."""
    chunk = min(single_block_limit(), LOOPED_CHUNK)
    return chunk, max(1, min(16, chunk // 512))


def _looped_fwd() -> FwdConfig:
    chunk, warps = looped_config()
    return FwdConfig("looped", chunk, 1, warps, False, 0, chunk, 0, False)


def forward_config(n: int, elt_size: int, vec: int, rows_aligned: bool, dev: DeviceFacts,
                   large: bool, staged: bool = True) -> FwdConfig:
    """The forward of rows of ``n`` elements of ``elt_size`` bytes on ``dev``. ``vec``:
    ``unaligned_vec``'s VEC for the call (0: rows start 16-byte aligned, or scalar accesses);
    ``rows_aligned``: x's row stride and ``n`` are multiples of 16 bytes; ``large``: the call
    has at least SHIFTED_W_MIN_ELEMS elements. In order: aligned rows with a STAGED_FWD rule
    (where ``staged``) in clusters of pieces landed in shared memory, with a PIECES_FWD rule in
    clusters of streamed pieces, with a CLUSTER_FWD rule split in thread-block clusters;
    aligned rows with an UNROLLED_FWD config rms_fwd_unrolled; unaligned rows of large calls
    with an UNROLLED_VEC_FWD config rms_fwd_unrolled_vec; rows no program holds (padded body
    above the single-block limit) split rows where they run, else looped; unaligned 16-bit
    rows of large calls rms_fwd_reload_vec (RELOAD_VEC_FWD); the single-block kernel
    (FWD_RULES, else LayerNorm's rules, kind "ln_fwd")."""
    vec = vec if VEC_EDGES else 0
    # (every row length is looked up: the host memoizes this decision per call signature)
    if staged and rows_aligned and not vec:
        rule = cluster_rule(STAGED_FWD.get(elt_size, ()), n, dev)
        if rule and n % rule[0] == 0:
            return FwdConfig("staged", rule[0], 1, rule[1], False, 0, 0, 0, False, True,
                             forward_config(n, elt_size, vec, rows_aligned, dev, large, False))
    cluster = ((pieces_fwd_config(n, elt_size, dev) or cluster_fwd_config(n, elt_size, dev))
               if rows_aligned and not vec else None)
    if cluster:  # (fallback: where the cluster launch is refused at run time)
        return cluster._replace(fallback=forward_config(
            n, elt_size, vec, rows_aligned, dev._replace(clusters=False), large))
    unrolled = unrolled_config(UNROLLED_FWD, elt_size, n, 0, vec) if rows_aligned else None
    if unrolled:
        return FwdConfig("unrolled", 0, 1, unrolled[1], False, 0, unrolled[0], 0, False)
    unrolled = (UNROLLED_VEC_FWD.get((elt_size, next_pow2(body_len(n, vec))))
                if vec and large and single_block_limit() == DEFAULT_SINGLE_BLOCK_LIMIT else None)
    body = (n // vec - 1) * vec if unrolled else 0
    if unrolled and body >= unrolled[0]:
        return FwdConfig("unrolled_vec", body, 1, unrolled[1], False, vec, unrolled[0], 0, True)
    single, block, rows, warps = row_config(body_len(n, vec), "ln_fwd", elt_size)
    if not single:
        return split_fwd_config(n, elt_size, vec, rows_aligned, dev) or _looped_fwd()
    shifted = bool(vec) and large
    reload = (RELOAD_VEC_FWD.get((elt_size, block)) if shifted
              and single_block_limit() == DEFAULT_SINGLE_BLOCK_LIMIT else None)
    if reload:
        return FwdConfig("reload_vec", block, 1, reload[1], False, vec, reload[0], 0, True)
    if vec:
        _, block, rows, warps, vec = unaligned_config(n, "ln_fwd", elt_size, vec)
        persistent = (elt_size == 2 and block >= VEC_FWD_PERSISTENT_16BIT_FROM) or (
            PERSISTENT["ln_fwd"] or block > PERSISTENT_ABOVE.get("ln_fwd", 1 << 62))
        return FwdConfig("single", block, rows, warps, persistent, vec, 0, 0, shifted)
    rule = FWD_RULES.get((elt_size, block)) if n % 16 == 0 else None
    if rule is not None:
        rows, warps, persistent = rule
    else:
        persistent = PERSISTENT["ln_fwd"] or block > PERSISTENT_ABOVE.get("ln_fwd", 1 << 62)
    return FwdConfig("single", block, rows, warps, persistent, 0, 0, 0, False)


# Split-row forward in thread-block clusters (aligned rows on a GPU that runs clusters): a row's
# C pieces, held in registers, exchange their sums on chip, so x is read once from memory and y
# written once. Element size -> ((shortest row, longest row, (piece, warps, PREFETCH)), ...);
# C must be a cluster size (CLUSTER_SIZES). H200 (benchmarks/results/h200/cluster-forward.json):
# float32 64K on 16384 x 16 prefetching 0.81 of copy vs 0.78 without clusters. 16-bit rows
# measured slower than the unrolled kernel up to 128K (rmsnorm-cluster-forward.json: 128K 0.72
# vs 0.76, 64K 0.76 vs 0.91: a row's pieces wait for each other once per row, holding one
# program per SM); 128K-256K (both dtypes) run PIECES_FWD, faster than held pieces there.
CLUSTER_FWD: dict[int, tuple[tuple[int, int, tuple[int, int, int]], ...]] = {
    4: ((65536, 65536, (16384, 16, 1)),),
}


# Forward in thread-block clusters of streamed pieces (rms_fwd_pieces; aligned rows that C =
# N / piece pieces of whole chunks fill, C a cluster size): each program runs the unrolled
# kernel's two passes on its piece, the second from L2, with the sum of squares exchanged on
# chip between them, so L2 keeps pieces between the passes where whole rows outgrow it, and
# nothing of a row is held across the exchange (several programs per SM).
# Element size -> ((shortest row, longest row, (piece, CHUNK, warps, persistent)), ...). H200,
# fraction of copy (benchmarks/results/h200/rmsnorm-pieces.json, against the rules before it,
# "no pieces", in the same run): 128K one cluster per row bf16 / fp16 / float32 0.85 / 0.85 /
# 0.79 vs 0.76 / 0.77 / 0.75; 256K persistent 0.79 / 0.78 / 0.74 vs 0.67 / 0.67 / 0.69 (held
# pieces in clusters: 0.70-0.71, h200/cluster-forward.json). 64K slower (16-bit 0.85-0.86 vs
# 0.90 unrolled) or level (float32 0.81), and 8K or 32K pieces slower everywhere.
PIECES_FWD: dict[int, tuple[tuple[int, int, tuple[int, int, int, bool]], ...]] = {
    2: ((131072, 131072, (16384, 4096, 16, False)), (262144, 262144, (16384, 4096, 16, True))),
    4: ((131072, 131072, (16384, 4096, 16, False)), (262144, 262144, (16384, 4096, 16, True))),
}


# Forward in thread-block clusters whose pieces land in shared memory (rms_fwd_staged,
# kernels/rmsnorm_staged.py: one cluster of C CTAs per row, each CTA's piece of L elements
# copied there by cp.async and read twice, for the sum of squares and for y, around the
# cluster's exchange; x read from memory once). Element size -> ((shortest row, longest row,
# (L, warps)), ...), rows that are C whole pieces with C a cluster size; asked first.
# Empty: no GPU run has measured the kernel against the rules below yet (its candidates:
# benchmarks/dev/cluster_forward.py --kinds staged), so no call takes it.
STAGED_FWD: dict[int, tuple[tuple[int, int, tuple[int, int]], ...]] = {}


def pieces_fwd_config(n: int, elt_size: int, dev: DeviceFacts) -> FwdConfig | None:
    """The forward in clusters of streamed pieces for aligned rows of ``n`` on ``dev``
    (PIECES_FWD), or None."""
    rule = pieces_rule(PIECES_FWD.get(elt_size, ()), n, dev) if n >= SPLIT_ROWS_MIN else None
    if rule is None:
        return None
    piece, chunk, warps, persistent = rule
    return FwdConfig("pieces", piece, 1, warps, persistent, 0, chunk, 0, False, True)


def cluster_fwd_config(n: int, elt_size: int, dev: DeviceFacts) -> FwdConfig | None:
    """The cluster split-row forward of aligned rows of ``n`` on ``dev`` (CLUSTER_FWD), or
    None."""
    rule = cluster_rule(CLUSTER_FWD.get(elt_size, ()), n, dev) if n >= SPLIT_ROWS_MIN else None
    if rule is None:
        return None
    piece, warps, prefetch = rule
    return FwdConfig("split", 0, 1, warps, False, 0, piece, prefetch, False, True)


def split_fwd_config(n: int, elt_size: int, vec: int, rows_aligned: bool,
                     dev: DeviceFacts) -> FwdConfig | None:
    """The split-row forward for rows of ``n`` (aligned-body pieces with ``vec`` > 0), or None
    where it does not run (SPLIT_FWD, SPLIT_ROWS_MIN, not CUDA, switched off)."""
    if n < SPLIT_ROWS_MIN:
        return None
    rule = SPLIT_FWD.get((elt_size, rows_aligned))
    if rule is None or not split_fits(dev, n, rule[0]):
        return None
    return FwdConfig("split", 0, 1, rule[1], False, vec, rule[0], rule[2], False)


# The backward in thread-block clusters of streamed pieces (rms_bwd_pieces; calls with dx,
# aligned rows that C = N / piece pieces of whole chunks fill, C a cluster size): as
# PIECES_FWD, pass 1 streams a piece's x and dy for its share of Σ x̂·w·dy, the cluster exchanges
# it on chip, pass 2 reads the piece again from L2 for dx and the dweight partials; only the
# piece's dweight accumulators stay in registers across rows (several programs per SM, where
# held pieces leave one). Element size -> ((shortest row, longest row, (piece, CHUNK, warps)),
# ...); the grid is persistent (one partial dweight row per cluster). H200, fraction of copy of
# the backend's backward (benchmarks/results/h200/rmsnorm-pieces-backward.json: "no pieces",
# the rules before it, in the same run), 16384 x 8192 x 32: bf16 32K / 64K / 128K / 256K 0.72 /
# 0.66 / 0.63 / 0.56 vs 0.67 / 0.61 / 0.53 / 0.51, fp16 alike; float32 16K on 8192 x 4096 x 8
# 0.85 vs 0.78. 4096-element chunks: level in bf16 but fp16 0.46-0.57 (50 registers a thread
# against 64: ptxas schedules fewer loads ahead). Slower or level: 16-bit 16K (0.69 vs 0.79
# fused), float32 32K-256K; two rows per exchange (more registers) slower in an earlier run.
PIECES_BWD: dict[int, tuple[tuple[int, int, tuple[int, int, int]], ...]] = {
    2: ((32768, 262144, (16384, 8192, 32)),),
    4: ((16384, 16384, (8192, 4096, 8)),),
}


def pieces_bwd_config(n: int, elt_size: int, dev: DeviceFacts) -> BwdConfig | None:
    """The backward in clusters of streamed pieces for aligned rows of ``n`` on ``dev``
    (PIECES_BWD), or None."""
    rule = pieces_rule(PIECES_BWD.get(elt_size, ()), n, dev) if n >= SPLIT_ROWS_MIN else None
    if rule is None:
        return None
    piece, chunk, warps = rule
    return BwdConfig("pieces", piece, 1, warps, 0, True, 0, chunk, 0, None, True)


def _first(table, n: int):
    return next((cfg for longest, cfg in table if n <= longest), None)


def backward_config(n: int, elt_size: int, vec: int, rows_aligned: bool,
                    dev: DeviceFacts) -> BwdConfig:
    """The backward of rows of ``n`` elements of ``elt_size`` bytes on ``dev``. ``vec``:
    ``unaligned_vec``'s VEC (x, dy and dx one row stride); ``rows_aligned``: the row strides
    of x and dy and ``n`` are multiples of 16 bytes. Padded rows (bodies, with ``vec``) up to
    the fused limit: the fused kernel (unaligned bodies of FUSED_BWD_VEC_MIN_BLOCK+ on
    rms_bwd_vec, shorter ones scalar); longer rows split rows where they run (SPLIT_BWD,
    CLUSTER_BWD, VEC_SPLIT_BWD, scalar pieces), else the looped dx kernel and the column
    kernel. Aligned rows with a PIECES_BWD rule run in clusters of streamed pieces first.
    """
    vec = vec if VEC_EDGES else 0
    pieces = pieces_bwd_config(n, elt_size, dev) if rows_aligned and not vec else None
    if pieces:
        return pieces._replace(fallback=backward_config(
            n, elt_size, vec, rows_aligned, dev._replace(clusters=False)))
    limit = min(FUSED_BWD_MAX_BLOCK, single_block_limit())
    if vec and next_pow2(body_len(n, vec)) <= limit:
        block = next_pow2(body_len(n, vec))
        if block >= FUSED_BWD_VEC_MIN_BLOCK:
            warps, per_sm = vec_bwd_config(block, elt_size)
            return BwdConfig("fused", block, 1, warps, per_sm, True, vec, 0, 0, None, False)
        vec = 0
    aligned = n % 16 == 0
    if not aligned:
        limit = min(FUSED_BWD_MAX_BLOCK_UNALIGNED, single_block_limit())
    if not vec and next_pow2(n) <= limit:
        block = next_pow2(n)
        rows, warps, per_sm, acc_1d = bwd_config(block, elt_size, aligned)
        return BwdConfig("fused", block, rows, warps, per_sm, acc_1d, 0, 0, 0, None, False,
                         fused_bwd_stages(block, elt_size, rows_aligned))
    cfg, cluster = None, False
    if n >= SPLIT_ROWS_MIN:
        if vec:
            cfg = VEC_SPLIT_BWD.get(elt_size)
        elif elt_size == 2 and not rows_aligned:
            cfg = _first(SCALAR_SPLIT_BWD_16BIT, n)
        else:
            cfg = _first(cluster_bwd_table(dev.name, elt_size), n) if rows_aligned else None
            cluster = cfg is not None
            cfg = cfg or _first(SPLIT_BWD.get(elt_size, ()), n)
    if cfg is not None and split_fits(dev, n, cfg[0]):
        chunk, warps, prefetch, cap = cfg
        return BwdConfig("split", 0, 1, warps, 0, True, vec, chunk, prefetch, cap, cluster)
    chunk, warps = looped_config()
    return BwdConfig("looped", chunk, 1, warps, 0, True, 0, 0, 0, None, False)
