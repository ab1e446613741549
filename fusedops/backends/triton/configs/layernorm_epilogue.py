"""Launch rules of the LayerNorm epilogues (residual add, dropout, activation):
:func:`forward_config` / :func:`backward_config` decide a call's launch (an
:class:`EpilogueConfig`) from the row caps of the single-block kernels (:func:`fwd_cap`,
:func:`bwd_cap`), their tile plans (:func:`fwd_plan`, :func:`bwd_plan`) and the looped kernels'
chunks. Host code: ``triton/layernorm_epilogue.py``; kernels: ``kernels/layernorm_epilogue*.py``.
"""

from __future__ import annotations

from typing import NamedTuple

from fusedops.backends.triton.configs import layernorm as ln_rules
from fusedops.backends.triton.configs.common import grid_programs, single_block_limit
from fusedops.backends.triton.runtime.device import cdiv, next_pow2
from fusedops.backends.triton.runtime.facts import DeviceFacts

# Padded rows up to these many columns are held whole in registers; longer rows take the
# looped kernels. Forward: FWD_MAX_BLOCK, with dropout FWD_MAX_BLOCK_DROPOUT.
# Backward: BWD_MAX_BLOCK, with dropout or an activation BWD_MAX_BLOCK_EPILOGUE. Chosen so that
# no variant spills registers (ptxas for sm_90, Triton 3.6 and 3.9), except the 16-warp plans of
# the epilogue backward (bwd_plan: GELU, or rows of 4K-8K), which are capped at 128 registers
# and keep 8-72 B of stack with Triton 3.6 (32-112 B with 3.9; ptxas for sm_90) yet run
# 1.3-1.8x faster than the plans without spills (H200: 8K-column rows 1.8x faster than the
# looped kernels, which they took before). All are also capped by the project's
# single-block limit (tests shrink it to exercise the looped kernels on short rows).
FWD_MAX_BLOCK = 16384
FWD_MAX_BLOCK_DROPOUT = 8192
BWD_MAX_BLOCK = 8192
BWD_MAX_BLOCK_EPILOGUE = 8192

# Elements per row tile of the single-block kernels (R rows of the padded row, up to MAX_ROWS).
FWD_TILE = 4096
BWD_TILE = 2048
MAX_ROWS = 128

# Elements of a tile per thread (forward, backward, looped kernels): with 16-byte vectors along
# the columns, 32 let a thread hold all four 256-column slices of its Philox counters (16-bit
# rows; float32 rows need 16). Fewer cost a shared-memory move of the packed keep bits (see the
# docstring of triton/layernorm_epilogue.py); more spill registers in the backward (its
# accumulators, weight and bias).
FWD_ELEMS_PER_THREAD = 32
BWD_ELEMS_PER_THREAD = 16
LOOPED_ELEMS_PER_THREAD = 16

# Backward single-block: programs per SM in the persistent grid (and so the number of float32
# partial rows to sum).
BWD_PER_SM = 2

# The looped kernels: 1024-column groups per chunk.
LOOPED_GROUPS = 4

# Long-row backward, column kernel: rows per iteration, programs per SM.
COLUMN_ROWS = 4
COLUMN_PER_SM = 2


def epi_warps(elements: int, per_thread: int) -> int:
    return max(1, min(16, elements // (32 * per_thread)))


def tile_2d(block: int, elt: int, dropout: bool, backward: bool = False) -> tuple[int, int]:
    """(rows per tile, warps) of the 2-D kernels: tiles of about 4K elements (2K with dropout's
    per-element Philox, whose registers add up), 4-16 warps, as the other norm kernels."""
    tile = BWD_TILE if dropout else FWD_TILE
    rows = max(1, min(MAX_ROWS, tile // block))
    warps = max(4, min(16, rows * block // 512))
    return rows, warps


def fwd_plan(block: int, elt_size: int, dropout: bool, has_res: bool
              ) -> tuple[int, int, int | None, int | None]:
    """(ROWS, warps, programs per SM or None, STAGES or None) of the single-block forward:
    the 4K-element tiles (2K with dropout) of ``tile_2d`` and ``grid_size``'s grid. With
    dropout the tile loop is software-pipelined where a residual is read too (its extra loads
    are what the pipelining hides; H200, bf16 inference, µs: add + LN + dropout + GELU 1K
    308 -> 265, 4K 318 -> 275; no spills with Triton 3.6 or 3.9; without a residual the plain
    loop was as fast or faster; 8K-column rows on 4 warps, pipelined, measured 222 -> 183
    but spill 184 B with Triton 3.6 and 568 B with 3.9, so not taken). Without dropout: a
    plain range, as measured before (0.75-0.95 of copy)."""
    rows, warps = tile_2d(block, elt_size, dropout)
    if dropout and has_res:
        return rows, warps, None, 2
    return rows, warps, None, None


def bwd_plan(block: int, elt_size: int, dropout: bool, act: int,
              strides: tuple[int, ...]) -> tuple[int, int, int, bool, bool, int]:
    """(ROWS, warps, programs per SM, ACC_1D, PAIRED, STAGES) of the single-block backward for
    padded rows of ``block`` elements. Without dropout or activation the kernel is LayerNorm's
    fused backward plus a read of ds, and takes its measured configuration
    (``layernorm.fused_bwd_config``, ``paired_sums``, ``fused_bwd_stages``). With them, the
    2K-element tiles of ``tile_2d`` (Philox and the activation's registers), one reduction per
    tile, about 32 resident warps per SM."""
    if dropout or act:
        # (ROWS, BLOCK) accumulators and paired row sums: Q slices folded into 1-D accumulators
        # every tile cost 2·Q cross-warp reductions per tile (H200, bf16 65536 x 768, p = 0.1,
        # ReLU: 524 us; 322 with these). 8K-element tiles, two
        # programs per SM. Up to 2K columns without GELU on 8 warps (247 us at 768 ReLU;
        # 210-255 registers, no spills on sm_90 with Triton 3.6), software-pipelined where ds
        # is read too or rows are 2K (H200: bf16 2048 ReLU with ds 464 -> 323 us; 1K without
        # ds it is 4-15% slower). GELU's registers, and rows of 4K-8K, take 16 warps,
        # pipelined (H200, µs, bf16 with ds: GELU 1K 761 -> 441, 2K 762 -> 433, 4K
        # 771 -> 428, ReLU 4K 651 -> 305; the 2K-element tiles on 4-8 warps before).
        rows = max(1, 8192 // block)
        if act != 2 and block <= 2048:
            stages = 2 if block >= 1024 and (len(strides) > 2 or block == 2048) else 1
            return rows, 8, 2, False, True, stages
        if block >= 1024:
            return rows, 16, 2, False, True, 2
        rows, warps = tile_2d(block, elt_size, dropout, backward=True)
        return rows, warps, max(BWD_PER_SM, 32 // warps), False, True, 1
    if block >= 8192:
        # One 8K row per tile on 16 warps, pipelined, paired sums (H200, with ds: fp32
        # 614 -> 510 us, bf16 393 -> 328 at 16384 x 8192; LayerNorm's plan below was level at
        # 4K).
        return 1, 16, 1, False, True, 2
    # ds's loads add registers: 16-bit rows of 4K+ columns take float32 rows' 8K-element tiles
    # (the 16K-element ones spill, ptxas sm_90 with Triton 3.6: 32 B at 4K, 104 B at 8K).
    rows, warps, per_sm, acc_1d = ln_rules.fused_bwd_config(block, False,
                                                         4 if block >= 4096 else elt_size)
    return (rows, warps, per_sm, acc_1d, ln_rules.paired_sums(elt_size, 0, block),
            ln_rules.fused_bwd_stages(block, elt_size, strides))


def slices(block: int, dropout: bool) -> int:
    """Q of the single-block kernels (``slice_cols``): with dropout, the Philox words a row
    block of ``block`` columns uses (4 from 1024 columns), so each call is made once."""
    return max(1, min(4, block // 256)) if dropout else 1


def fwd_cap(dropout: bool) -> int:
    return min(FWD_MAX_BLOCK_DROPOUT if dropout else FWD_MAX_BLOCK, single_block_limit())


def bwd_cap(dropout: bool, act: int) -> int:
    cap = BWD_MAX_BLOCK_EPILOGUE if dropout or act else BWD_MAX_BLOCK
    return min(cap, single_block_limit())


def looped_groups() -> int:
    return max(1, min(LOOPED_GROUPS, single_block_limit() // 1024))


# Replay plans (see runtime/recording.py), per call signature: everything the launch rules
# read (shapes, strides, dtypes, 16-byte alignment of every pointer, the scalar arguments but
# the seed, the gradients needed, the device). A call seen before allocates its outputs and
# scratch and relaunches the recorded kernels with its own tensors' addresses and seed words:
# the backend's checks and plans cost 80-120 µs of host time per call on the GPU hosts
# measured (H200 machines), more than the kernels take on a few thousand rows.
# The backward makes plans only for calls that give grad_dtypes (the eager autograd path), as
# LayerNorm's does. PLANS = False turns them off (tests compare both paths).
PLANS = True


class EpilogueConfig(NamedTuple):
    """A launch of the epilogue kernels: ``"single"`` (``ln_epi_fwd_2d`` / ``ln_epi_bwd_2d``:
    [ROWS, BLOCK] row tiles) or ``"looped"`` (``ln_epi_fwd_looped``; backward:
    ``ln_epi_bwd_row_sums``, then ``ln_epi_bwd_columns`` on a (col_blocks, splits) grid)."""

    variant: str
    grid: int  # programs (looped: one per row; backward: the row-sums kernel's)
    warps: int  # (looped backward: the column kernel's)
    block: int = 0  # BLOCK: the padded row (single)
    rows: int = 0  # rows per tile (single)
    tiles: int = 0  # row tiles (single)
    slices: int = 1  # Q column slices (single, see slices)
    stages: int | None = None  # STAGES of the tile loop (single)
    acc_1d: bool = False  # backward single: ACC_1D
    paired: bool = False  # backward single: PAIRED
    groups: int = 0  # looped: 1024-column groups per chunk
    sums_warps: int = 0  # looped backward: the row-sums kernel's warps
    col_blocks: int = 0  # looped backward: 1024-column blocks of the column kernel
    splits: int = 0  # looped backward: row splits (float32 partial rows)
    rows_per_split: int = 0
    column_rows: int = 0  # looped backward: rows per iteration of the column kernel


def forward_config(n: int, elt_size: int, m: int, dropout: bool, has_res: bool,
                   dev: DeviceFacts) -> EpilogueConfig:
    """The forward for ``m`` rows of ``n`` elements of ``elt_size`` bytes on ``dev``."""
    block = next_pow2(n)
    if block <= fwd_cap(dropout):
        rows, warps, per_sm, stages = fwd_plan(block, elt_size, dropout, has_res)
        tiles = cdiv(m, rows)
        progs = (grid_programs(tiles, warps, "ln_fwd", dev.num_sms, block) if per_sm is None
                 else max(1, min(tiles, dev.num_sms * per_sm)))
        return EpilogueConfig("single", progs, warps, block, rows, tiles, slices(block, dropout),
                              stages)
    groups = looped_groups()
    return EpilogueConfig("looped", m, epi_warps(groups * 1024, LOOPED_ELEMS_PER_THREAD),
                          groups=groups)


def backward_config(n: int, elt_size: int, m: int, dropout: bool, act: int,
                    strides: tuple[int, ...], dev: DeviceFacts) -> EpilogueConfig:
    """The backward for ``m`` rows of ``n`` elements (``strides``: the row strides of dout, s
    and ds where ds is read) on ``dev``."""
    block = next_pow2(n)
    if block <= bwd_cap(dropout, act):
        rows, warps, per_sm, acc_1d, paired, stages = bwd_plan(block, elt_size, dropout, act,
                                                              strides)
        tiles = cdiv(m, rows)
        progs = max(1, min(tiles, dev.num_sms * per_sm,
                           ln_rules.max_partial_rows(m, n, elt_size)))
        return EpilogueConfig("single", progs, warps, block, rows, tiles, slices(block, dropout),
                              stages, acc_1d, paired)
    groups = looped_groups()
    col_blocks = cdiv(n, 1024)
    splits = max(1, min(cdiv(m, COLUMN_ROWS), cdiv(COLUMN_PER_SM * dev.num_sms, col_blocks)))
    rows_per_split = cdiv(cdiv(m, splits), COLUMN_ROWS) * COLUMN_ROWS
    return EpilogueConfig("looped", m, epi_warps(COLUMN_ROWS * 1024, BWD_ELEMS_PER_THREAD),
                          groups=groups,
                          sums_warps=epi_warps(groups * 1024, LOOPED_ELEMS_PER_THREAD),
                          col_blocks=col_blocks, splits=cdiv(m, rows_per_split),
                          rows_per_split=rows_per_split, column_rows=COLUMN_ROWS)
