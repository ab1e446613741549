"""Launch rules of the softmax of attention (scale + mask + causal): :func:`forward_config` /
:func:`backward_config` (the plain softmax's ``row_config`` rules with this op's caps: a
:class:`MaskedSoftmaxConfig`, single-block or looped) and the replay plan switch ``PLANS``.
Host code: ``triton/softmax_masked.py``; kernels: ``kernels/softmax_masked.py``.
"""

from __future__ import annotations

from typing import NamedTuple

from fusedops.backends.triton.configs.common import grid_programs, row_config, single_block_limit
from fusedops.backends.triton.runtime.device import cdiv
from fusedops.backends.triton.runtime.facts import DeviceFacts


class MaskedSoftmaxConfig(NamedTuple):
    """A launch of the masked softmax: ``"single"`` (``smm_*_single``: ROWS whole rows per
    program) or ``"looped"`` (``smm_*_looped``: one program per row, BLOCK-element chunks)."""

    variant: str
    grid: int  # programs
    warps: int
    block: int  # BLOCK: the padded row (single) or the chunk (looped)
    rows: int = 1  # rows per program tile (single)
    tiles: int = 0  # row tiles (single)
    vec: int = 0  # elements per 16-byte vector (the forward's causal loads stop at one)


# Largest padded row the forward keeps in registers (elements, by x's element size): a float
# mask tile is held next to the row until they are combined, so this stays below the plain
# softmax forward's 32K cap. Longer rows take the looped (online) kernel.
FWD_SINGLE_CAP = {2: 16384, 4: 16384}

# The looped forward: (chunk elements, warps) per iteration of its two passes.
FWD_LOOPED = (4096, 8)


def forward_config(n: int, elt_size: int, masked: bool, m: int,
                   dev: DeviceFacts) -> MaskedSoftmaxConfig:
    """The forward for ``m`` rows of ``n`` elements of ``elt_size`` bytes (``masked``: a mask
    or the causal triangle) on ``dev``. Single-block: the plain softmax forward's rules up to
    FWD_SINGLE_CAP; looped above."""
    single, block, rows, warps = row_config(n, "softmax_fwd", elt_size)
    if single and block <= FWD_SINGLE_CAP[elt_size]:
        if masked and block >= 16384:
            # The causal/mask predicates next to 64 values per thread on 8 warps: 150-190
            # registers (ptxas sm_90, one program per SM); 16 warps: 64-106.
            warps = max(warps, 16)
        tiles = cdiv(m, rows)
        return MaskedSoftmaxConfig("single", grid_programs(tiles, warps, "softmax_fwd",
                                                           dev.num_sms),
                                   warps, block, rows, tiles, 16 // elt_size)
    chunk, warps = FWD_LOOPED
    chunk = min(chunk, single_block_limit())
    return MaskedSoftmaxConfig("looped", m, max(1, min(warps, chunk // 256)), chunk,
                               vec=16 // elt_size)


def backward_config(n: int, elt_size: int, m: int, dev: DeviceFacts) -> MaskedSoftmaxConfig:
    """The backward for ``m`` rows of ``n`` elements: the plain softmax backward's
    single-block / looped rules."""
    single, block, rows, warps = row_config(n, "softmax_bwd", elt_size)
    if not single:
        return MaskedSoftmaxConfig("looped", m, warps, block)
    tiles = cdiv(m, rows)
    return MaskedSoftmaxConfig("single", grid_programs(tiles, warps, "softmax_bwd", dev.num_sms),
                               warps, block, rows, tiles)


# Replay plans (see runtime/recording.py), per call signature: the shapes, strides, dtypes
# and 16-byte alignment of every tensor, scale, causal, the output dtype and the device. A call
# seen before allocates its output and relaunches the recorded kernel with its own tensors'
# addresses (the launch rules and checks cost more host time than the kernel takes on a small
# batch's attention). PLANS = False turns them off.
PLANS = True
