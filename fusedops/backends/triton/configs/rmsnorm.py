"""RMSNorm launch rules: ``FWD_RULES`` (else LayerNorm forward's ``row_config`` kind
"ln_fwd"), :func:`looped_config`, and the fused backward's :func:`bwd_config` up to
``FUSED_BWD_MAX_BLOCK``. Host code: ``triton/rmsnorm.py``; kernels: ``kernels/rmsnorm.py``.
"""

from __future__ import annotations

from fusedops.backends.triton.configs.common import single_block_limit

# The weight stays in registers across a program's row tiles while each thread holds at most
# this many row elements (LayerNorm's measured rule, FWD_HOLD_W_MAX_PER_THREAD).
HOLD_W_MAX_PER_THREAD = 32


def hold_w(block: int, warps: int) -> bool:
    return warps <= 16 and block // (32 * warps) <= HOLD_W_MAX_PER_THREAD


# The backward's tiles and warps are LayerNorm's measured ones (layernorm.fused_bwd_config),
# not re-tuned for RMSNorm; only the fused kernel's row limit was measured (below).
# Padded rows up to this many elements take the fused backward (the row, dy and the dweight
# accumulator in registers); longer rows the looped dx kernel plus the column kernel.
# H200, TB/s: 16K rows fused 2.46 vs 2.37 looped + columns (bf16), 3.47 vs 2.12 (float32);
# 32K rows spill in one program (0.21-0.52). Rows with N not a multiple of 16 (scalar
# accesses, up to half the padded row masked off) take it on 32 warps (8193: bf16 1.11 vs 0.78
# on 16 warps and 0.74 looped; float32 2.03 vs 1.24 and 1.44).
FUSED_BWD_MAX_BLOCK = 16384
FUSED_BWD_MAX_BLOCK_UNALIGNED = 16384

# Chunk of the looped kernels (elements per iteration; smaller while tests shrink the
# single-block limit, so short rows loop over several chunks).
LOOPED_CHUNK = 8192

# The dweight column kernel: (columns, rows) per iteration, warps, programs per SM.
COLUMN_TILE = (128, 64)
COLUMN_WARPS = 16
COLUMN_PER_SM = 2

# 16-bit rows (N a multiple of 16): (ROWS, num_warps, programs per SM, ACC_1D) by padded row,
# measured (H200, TB/s against LayerNorm's rule): 1K 3.46 vs 3.35, 2K 3.46
# vs 3.35, 8K 3.57 vs 3.48 (bf16; fp16 alike).
BWD_RULES_16BIT: dict[int, tuple[int, int, int, bool]] = {
    1024: (2, 4, 4, False), 2048: (1, 4, 4, True), 8192: (2, 32, 1, True),
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


# Forward launch rules measured for RMSNorm: (element size, padded row) -> (ROWS, num_warps,
# persistent grid); other rows take LayerNorm forward's rules (row_config, kind "ln_fwd").
# H200 (TB/s, copy 4.22-4.25; LayerNorm's rule in brackets): bf16 4K 4 rows x 8 warps 4.03
# [3.98], 8K 2 x 8 4.04 [3.96]; float32 8K 1 x 8 4.10 [4.03], 16K 2 x 16 4.10 [3.90], 32K
# 1 x 32 3.90 [3.85]. Rows with N not a multiple of 16 keep LayerNorm's rules (8193: 1.75
# [1.16-1.58 on these]). Not kept: 16-bit 16K on 1 x 32, faster for the forward with rstd
# (3.91 [3.22]) but not for the inference forward
# (benchmarks/results/h200/rmsnorm.json, which ran it: 0.65-0.68 of copy, behind compile).
FWD_RULES: dict[tuple[int, int], tuple[int, int, bool]] = {
    (2, 4096): (4, 8, False), (2, 8192): (2, 8, False),
    (4, 8192): (1, 8, False), (4, 16384): (2, 16, False), (4, 32768): (1, 32, False),
}


def looped_config() -> tuple[int, int]:
    """(CHUNK, num_warps) of the looped kernels: 16 warps for 8K chunks (untuned)."""
    chunk = min(single_block_limit(), LOOPED_CHUNK)
    return chunk, max(1, min(16, chunk // 512))
