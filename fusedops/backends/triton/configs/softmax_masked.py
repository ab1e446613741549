"""Launch rules of the softmax of attention (scale + mask + causal): :func:`fwd_config` /
:func:`bwd_config` (the plain softmax's ``row_config`` rules with this op's caps) and the replay
plan switch ``PLANS``. Host code: ``triton/softmax_masked.py``; kernels:
``kernels/softmax_masked.py``.
"""

from __future__ import annotations

from fusedops.backends.triton.configs.common import row_config, single_block_limit
from fusedops.backends.triton.runtime.caches import config_cache

# Largest padded row the forward keeps in registers (elements, by x's element size): a float
# mask tile is held next to the row until they are combined, so this stays below the plain
# softmax forward's 32K cap. Longer rows take the looped (online) kernel.
FWD_SINGLE_CAP = {2: 16384, 4: 16384}

# The looped forward: (chunk elements, warps) per iteration of its two passes.
FWD_LOOPED = (4096, 8)


@config_cache
def fwd_config(n: int, elt_size: int, masked: bool = False) -> tuple[bool, int, int, int]:
    """(single_block, BLOCK, ROWS, num_warps) of the forward for rows of ``n`` elements of
    ``elt_size`` bytes (``masked``: a mask or the causal triangle). Single-block: BLOCK is the
    padded row, ROWS rows per program (the plain softmax forward's rules). Looped: BLOCK is the
    chunk, one row per program."""
    single, block, rows, warps = row_config(n, "softmax_fwd", elt_size)
    if single and block <= FWD_SINGLE_CAP[elt_size]:
        if masked and block >= 16384:
            # The causal/mask predicates next to 64 values per thread on 8 warps: 150-190
            # registers (ptxas sm_90, one program per SM); 16 warps: 64-106.
            warps = max(warps, 16)
        return True, block, rows, warps
    chunk, warps = FWD_LOOPED
    chunk = min(chunk, single_block_limit())
    return False, chunk, 1, max(1, min(warps, chunk // 256))


@config_cache
def bwd_config(n: int, elt_size: int) -> tuple[bool, int, int, int]:
    """(single_block, BLOCK, ROWS, num_warps) of the backward (the plain softmax backward's
    single-block / looped rules)."""
    return row_config(n, "softmax_bwd", elt_size)


# Replay plans (see runtime/recording.py), per call signature: the shapes, strides, dtypes
# and 16-byte alignment of every tensor, scale, causal, the output dtype and the device. A call
# seen before allocates its output and relaunches the recorded kernel with its own tensors'
# addresses (the launch rules and checks cost more host time than the kernel takes on a small
# batch's attention). PLANS = False turns them off.
PLANS = True
