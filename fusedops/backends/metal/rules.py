"""The host/shader contract of the Metal kernels (``metal/common.metal``, mirrored by
``csrc/fusedops_metal.mm``): flags, supported type pairs and dispatch geometry."""

from __future__ import annotations

import torch

from fusedops import _philox
from fusedops.backends.metal import shader_source as _shader_source

SIMD_WIDTH = 32
READS = 4  # elements per thread per step; the single-row kernels hold READS per thread
MAX_THREADS = 1024  # Apple GPUs: at most 1024 threads per threadgroup
MAX_ROW_GROUPS = 65536  # row kernels: threadgroups stride over rows beyond this
LN_BWD_PARTIAL_BUDGET = 1 << 22  # LayerNorm/RMSNorm backward: groups * n_cols fp32 partials, max
LN_BWD_MIN_GROUPS = 32
LN_BWD_MAX_GROUPS = 1024
REDUCE_THREADS = 256  # dweight/dbias reduction kernel: threads per threadgroup (at most)
FLAG_VEC = 1
FLAG_WEIGHT = 2
FLAG_BIAS = 4
FLAG_DX = 8
FLAG_DW = 16
FLAG_DB = 32
FLAG_MASK = 64  # masked softmax: a mask is bound
FLAG_MASK_VEC = 128  # masked softmax: the mask's rows allow vector loads
FLAG_CAUSAL = 256
FLAG_ADD = 512  # LayerNorm epilogue: a residual (forward) / ds (backward) is bound
FLAG_DROPOUT = 1024
FLAG_RELU = 2048
FLAG_GELU = 4096
FLAG_STATS = 8192  # LayerNorm epilogue forward: write mean and rstd
FLAG_PHILOX = 16384  # LayerNorm epilogue: the Philox thread layout (columns PHILOX_W apart)
PHILOX_W = _philox.W  # columns between the four elements one Philox call serves
TYPE_NAMES = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat"}

# Instantiated (first, second) type pairs, see the end of each .metal file.
SOFTMAX_FWD_TYPES = {("float", "float"), ("half", "half"), ("bfloat", "bfloat"),
                     ("half", "float"), ("bfloat", "float")}


SOFTMAX_BWD_TYPES = {("float", "float"), ("half", "half"), ("bfloat", "bfloat"),
                     ("float", "half"), ("float", "bfloat")}


LAYERNORM_TYPES = SOFTMAX_FWD_TYPES  # forward: (x, y); backward: (x, dy)
RMSNORM_TYPES = LAYERNORM_TYPES  # forward: (x, y); backward: (x, dy)

# Masked softmax forward: (x, y, mask), mask "bool", x's type or "float" (other mask dtypes are
# converted to float32 by the host); backward: (y, dx), the softmax pairs plus half/bfloat y with
# float dx (the mask gradient's float32 dz).
SOFTMAX_MASKED_FWD_TYPES = {(a, b, m) for a, b in SOFTMAX_FWD_TYPES for m in ("bool", a, "float")}
SOFTMAX_MASKED_BWD_TYPES = SOFTMAX_BWD_TYPES | {("half", "float"), ("bfloat", "float")}
LAYERNORM_EPILOGUE_TYPES = LAYERNORM_TYPES  # forward: (x, out); backward: (s, dout)
SHADER_FILES = _shader_source.SHADER_FILES


def threadgroup_limit(max_threads: int) -> int:
    """Usable threadgroup size for a pipeline: its maxTotalThreadsPerThreadgroup, rounded down
    to a whole number of SIMD-groups and capped at MAX_THREADS."""
    return max(SIMD_WIDTH, min(MAX_THREADS, int(max_threads)) // SIMD_WIDTH * SIMD_WIDTH)


def single_row_limit(max_threads: int) -> int:
    """Largest row the register-resident ("single") kernels take on this pipeline."""
    return READS * threadgroup_limit(max_threads)


def row_threads(n_cols: int, max_threads: int) -> int:
    """Threadgroup size of a single-row kernel: enough SIMD-groups for READS columns each."""
    need = -(-n_cols // READS)
    return min(threadgroup_limit(max_threads), -(-need // SIMD_WIDTH) * SIMD_WIDTH)


def row_groups(n_rows: int) -> int:
    return min(n_rows, MAX_ROW_GROUPS)


def layernorm_bwd_groups(n_rows: int, n_cols: int) -> int:
    """Threadgroups of the LayerNorm and RMSNorm backward kernels (= rows of the dweight/dbias
    partials)."""
    budget = max(LN_BWD_MIN_GROUPS, min(LN_BWD_MAX_GROUPS, LN_BWD_PARTIAL_BUDGET // n_cols))
    return min(n_rows, budget)


def reduce_threads(max_threads: int) -> int:
    return min(REDUCE_THREADS, threadgroup_limit(max_threads))


def philox_threadgroup_limit(max_threads: int) -> int:
    """Largest threadgroup of the Philox layout (whole groups of PHILOX_W threads; 0 when the
    pipeline allows fewer than PHILOX_W)."""
    return threadgroup_limit(max_threads) // PHILOX_W * PHILOX_W


def philox_row_threads(n_cols: int, max_threads: int) -> int:
    """Threadgroup size of a single-row kernel in the Philox layout: PHILOX_W threads per
    READS * PHILOX_W columns."""
    return min(philox_threadgroup_limit(max_threads),
               -(-n_cols // (READS * PHILOX_W)) * PHILOX_W)
