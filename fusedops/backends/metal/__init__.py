"""Metal backend for Apple GPUs: the 2-D row contract (see ``fusedops._dispatch``) on MPS tensors.

Fallback chain, decided once per process by :func:`is_available`:

1. the compiled Objective-C++ extension ``fusedops._metal_ext`` (built by ``setup.py`` on macOS),
   which encodes the kernels on PyTorch's current MPS stream;
2. ``torch.mps.compile_shader`` over the same shader sources (when this PyTorch has it), driven
   by the host code in this file;
3. neither: :func:`is_available` is False and the dispatcher uses the PyTorch reference with a
   one-time warning.

The shader sources are ``fusedops/_shaders/*.metal`` in an installed package (``setup.py``
copies ``metal/`` there) or ``<repo>/metal/*.metal`` in a source checkout.

The host logic (kernel choice, dispatch geometry, argument order, flags) is written once here
against a small *launcher* protocol: ``launcher(name, args, groups, threads)``,
``launcher.max_threads(name)`` and ``launcher.has(name)``. The compile_shader path implements it
with ``torch.mps.compile_shader``; the test-suite implements it with the CPU emulation of the
shaders (``tests/metal_emu``), so this exact code is what the Linux tests run. The extension in
``csrc/fusedops_metal.mm`` mirrors the same constants and geometry in C++ (a test compares them).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Protocol

import torch

from fusedops import _philox
from fusedops.backends import reference
from fusedops.backends.metal import shader_source as _shader_source

NAME = "metal"

# --- Host/shader contract (metal/common.metal, csrc/fusedops_metal.mm) ------------------------
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


# --- Dispatch geometry --------------------------------------------------------------------------
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


# --- Launchers -------------------------------------------------------------------------------
class Launcher(Protocol):
    def has(self, name: str) -> bool: ...

    def max_threads(self, name: str) -> int: ...

    def __call__(self, name: str, args: list, groups: int, threads: int) -> None: ...


def _aligned(*tensors: torch.Tensor) -> bool:
    """True when every row start of every (row-major) tensor is READS-element aligned."""
    for t in tensors:
        if t.storage_offset() % READS:
            return False
        if t.dim() == 2 and t.shape[0] > 1 and t.stride(0) % READS:
            return False
    return True


def _empty(like: torch.Tensor) -> torch.Tensor:
    """Binding for an argument the kernel does not touch (its flag is off)."""
    return torch.empty(0, dtype=torch.float32, device=like.device)


_SUPPORTED = {"softmax_fwd": SOFTMAX_FWD_TYPES, "softmax_bwd": SOFTMAX_BWD_TYPES,
              "layernorm_fwd": LAYERNORM_TYPES, "layernorm_bwd": LAYERNORM_TYPES,
              "rmsnorm_fwd": RMSNORM_TYPES, "rmsnorm_bwd": RMSNORM_TYPES,
              "softmax_masked_fwd": SOFTMAX_MASKED_FWD_TYPES,
              "softmax_masked_bwd": SOFTMAX_MASKED_BWD_TYPES,
              "layernorm_epilogue_fwd": LAYERNORM_EPILOGUE_TYPES,
              "layernorm_epilogue_bwd": LAYERNORM_EPILOGUE_TYPES}
_names: dict[tuple, tuple[str, str] | None] = {}


def _kernels(launch: Launcher, op: str, types: tuple) -> tuple[str, str] | None:
    """(single, looped) kernel names of ``op`` for a type pair, or None when not available
    (an unsupported pair, or bfloat on a Metal without ``__HAVE_BFLOAT__``). Cached."""
    key = (launch, op, types)
    try:
        return _names[key]
    except KeyError:
        pass
    names = None
    if types in _SUPPORTED[op]:
        suffix = "_".join(types)
        single = f"fusedops_{op}_single_{suffix}"
        looped = f"fusedops_{op}_looped_{suffix}"
        if launch.has(single) and launch.has(looped):
            names = (single, looped)
    _names[key] = names
    return names


def _row_kernel(launch: Launcher, names: tuple[str, str], n: int) -> tuple[str, int]:
    """The kernel for rows of n columns and its threadgroup size."""
    single, looped = names
    limit = launch.max_threads(single)
    if n <= single_row_limit(limit):
        return single, row_threads(n, limit)
    return looped, threadgroup_limit(launch.max_threads(looped))


def softmax_forward_with(launch: Launcher, x: torch.Tensor, out_dtype: torch.dtype):
    m, n = x.shape
    types = (TYPE_NAMES.get(x.dtype), TYPE_NAMES.get(out_dtype))
    names = _kernels(launch, "softmax_fwd", types)
    if names is None:
        return reference.softmax_forward(x, out_dtype)
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    name, threads = _row_kernel(launch, names, n)
    flags = FLAG_VEC if _aligned(x, y) else 0
    launch(name, [x, y, m, n, x.stride(0), flags], row_groups(m), threads)
    return y


def softmax_backward_with(launch: Launcher, y: torch.Tensor, dy: torch.Tensor,
                          out_dtype: torch.dtype):
    m, n = y.shape
    if dy.dtype != y.dtype:
        dy = dy.to(y.dtype)
    types = (TYPE_NAMES.get(y.dtype), TYPE_NAMES.get(out_dtype))
    names = _kernels(launch, "softmax_bwd", types)
    if names is None:
        return reference.softmax_backward(y, dy, out_dtype)
    dx = torch.empty((m, n), dtype=out_dtype, device=y.device)
    if m == 0 or n == 0:
        return dx
    name, threads = _row_kernel(launch, names, n)
    flags = FLAG_VEC if _aligned(y, dy, dx) else 0
    launch(name, [y, dy, dx, m, n, y.stride(0), dy.stride(0), flags], row_groups(m), threads)
    return dx


def _param(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.reshape(-1).to(torch.float32).contiguous()


def layernorm_forward_with(launch: Launcher, x: torch.Tensor, weight, bias, eps: float,
                           out_dtype: torch.dtype):
    m, n = x.shape
    types = (TYPE_NAMES.get(x.dtype), TYPE_NAMES.get(out_dtype))
    names = _kernels(launch, "layernorm_fwd", types)
    if names is None:
        return reference.layernorm_forward(x, weight, bias, eps, out_dtype)
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    mean = torch.empty((m,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y, mean, rstd
    w, b = _param(weight), _param(bias)
    flags = (FLAG_WEIGHT if w is not None else 0) | (FLAG_BIAS if b is not None else 0)
    params = [t for t in (w, b) if t is not None]
    if _aligned(x, y, *params):
        flags |= FLAG_VEC
    name, threads = _row_kernel(launch, names, n)
    args = [x, w if w is not None else _empty(x), b if b is not None else _empty(x), y, mean,
            rstd, m, n, x.stride(0), float(eps), flags]
    launch(name, args, row_groups(m), threads)
    return y, mean, rstd


def layernorm_backward_with(launch: Launcher, dy: torch.Tensor, x: torch.Tensor, weight,
                            mean: torch.Tensor, rstd: torch.Tensor, need_dx: bool,
                            need_dw: bool, need_db: bool):
    m, n = x.shape
    need_dx, need_dw, need_db = bool(need_dx), bool(need_dw), bool(need_db)
    types = (TYPE_NAMES.get(x.dtype), TYPE_NAMES.get(dy.dtype))
    names = _kernels(launch, "layernorm_bwd", types)
    if names is None:
        return reference.layernorm_backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db)
    dev = x.device
    dx = torch.empty((m, n), dtype=x.dtype, device=dev) if need_dx else None
    # Sums over zero rows are zeros; otherwise the reduction kernel writes every column.
    new = torch.zeros if m == 0 else torch.empty
    dw = new((n,), dtype=torch.float32, device=dev) if need_dw else None
    db = new((n,), dtype=torch.float32, device=dev) if need_db else None
    if m == 0 or n == 0 or not (need_dx or need_dw or need_db):
        return dx, dw, db
    w = _param(weight)
    mean = mean.reshape(-1).to(torch.float32).contiguous()
    rstd = rstd.reshape(-1).to(torch.float32).contiguous()
    groups = layernorm_bwd_groups(m, n)
    dwp = torch.empty((groups, n), dtype=torch.float32, device=dev) if need_dw else None
    dbp = torch.empty((groups, n), dtype=torch.float32, device=dev) if need_db else None
    flags = ((FLAG_WEIGHT if w is not None else 0) | (FLAG_DX if need_dx else 0)
             | (FLAG_DW if need_dw else 0) | (FLAG_DB if need_db else 0))
    if _aligned(x, dy, *[t for t in (w, dx) if t is not None]):
        flags |= FLAG_VEC
    name, threads = _row_kernel(launch, names, n)
    none = _empty(x)
    args = [dy, x, w if w is not None else none, mean, rstd, dx if dx is not None else none,
            dwp if dwp is not None else none, dbp if dbp is not None else none,
            m, n, dy.stride(0), x.stride(0), flags]
    launch(name, args, groups, threads)
    if need_dw or need_db:
        red = "fusedops_layernorm_dwdb_reduce"
        rt = reduce_threads(launch.max_threads(red))
        args = [dwp if dwp is not None else none, dbp if dbp is not None else none,
                dw if dw is not None else none, db if db is not None else none,
                groups, n, flags & (FLAG_DW | FLAG_DB)]
        launch(red, args, -(-n // rt), rt)
    return dx, dw, db


def rmsnorm_forward_with(launch: Launcher, x: torch.Tensor, weight, eps: float,
                         out_dtype: torch.dtype):
    m, n = x.shape
    types = (TYPE_NAMES.get(x.dtype), TYPE_NAMES.get(out_dtype))
    names = _kernels(launch, "rmsnorm_fwd", types)
    if names is None:
        return reference.rmsnorm_forward(x, weight, eps, out_dtype)
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y, rstd
    w = _param(weight)
    flags = FLAG_WEIGHT if w is not None else 0
    if _aligned(x, y, *([w] if w is not None else [])):
        flags |= FLAG_VEC
    name, threads = _row_kernel(launch, names, n)
    args = [x, w if w is not None else _empty(x), y, rstd, m, n, x.stride(0), float(eps), flags]
    launch(name, args, row_groups(m), threads)
    return y, rstd


def rmsnorm_forward_y_with(launch: Launcher, x: torch.Tensor, weight, eps: float,
                           out_dtype: torch.dtype) -> torch.Tensor:
    return rmsnorm_forward_with(launch, x, weight, eps, out_dtype)[0]


def rmsnorm_backward_with(launch: Launcher, dy: torch.Tensor, x: torch.Tensor, weight,
                          rstd: torch.Tensor, need_dx: bool, need_dw: bool):
    m, n = x.shape
    need_dx, need_dw = bool(need_dx), bool(need_dw)
    types = (TYPE_NAMES.get(x.dtype), TYPE_NAMES.get(dy.dtype))
    names = _kernels(launch, "rmsnorm_bwd", types)
    if names is None:
        return reference.rmsnorm_backward(dy, x, weight, rstd, need_dx, need_dw)
    dev = x.device
    dx = torch.empty((m, n), dtype=x.dtype, device=dev) if need_dx else None
    # A sum over zero rows is zeros; otherwise the reduction kernel writes every column.
    dw = ((torch.zeros if m == 0 else torch.empty)((n,), dtype=torch.float32, device=dev)
          if need_dw else None)
    if m == 0 or n == 0 or not (need_dx or need_dw):
        return dx, dw
    w = _param(weight)
    rstd = rstd.reshape(-1).to(torch.float32).contiguous()
    groups = layernorm_bwd_groups(m, n)
    dwp = torch.empty((groups, n), dtype=torch.float32, device=dev) if need_dw else None
    flags = ((FLAG_WEIGHT if w is not None else 0) | (FLAG_DX if need_dx else 0)
             | (FLAG_DW if need_dw else 0))
    if _aligned(x, dy, *[t for t in (w, dx) if t is not None]):
        flags |= FLAG_VEC
    name, threads = _row_kernel(launch, names, n)
    none = _empty(x)
    args = [dy, x, w if w is not None else none, rstd, dx if dx is not None else none,
            dwp if dwp is not None else none, m, n, dy.stride(0), x.stride(0), flags]
    launch(name, args, groups, threads)
    if need_dw:
        # Stage 2: the LayerNorm reduction kernel, dweight only.
        red = "fusedops_layernorm_dwdb_reduce"
        rt = reduce_threads(launch.max_threads(red))
        launch(red, [dwp, none, dw, none, groups, n, FLAG_DW], -(-n // rt), rt)
    return dx, dw



# --- Masked softmax (metal/softmax_masked.metal) ---------------------------------------------

def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor with unit column stride (a copy only when it has none)."""
    return t if t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


def _mask_kind(mask: torch.Tensor | None, x_type: str | None) -> str:
    """The kernel's mask type: "bool", x's type, or "float" (any other dtype, converted)."""
    if mask is None or mask.dtype == torch.bool:
        return "bool"  # without a mask: the bool kernel, FLAG_MASK off
    name = TYPE_NAMES.get(mask.dtype)
    return name if name == x_type else "float"


def _compact_to(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` converted to ``dtype`` without materialising its broadcast (stride-0) dims."""
    idx = tuple(slice(0, 1) if st == 0 and sz > 1 else slice(None)
                for sz, st in zip(mask.shape, mask.stride(), strict=True))
    return mask[idx].to(dtype).expand(mask.shape)


_MASK_DTYPES = {"bool": torch.bool, "float": torch.float32, "half": torch.float16,
                "bfloat": torch.bfloat16}


def softmax_masked_forward_with(launch: Launcher, x: torch.Tensor, mask, scale: float,
                                causal: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """Softmax of ``x * scale`` (B, H, Q, N), masked (bool: keep; float: added) and causal, over
    N; see ``fusedops.backends.reference.softmax_masked_forward``."""
    if x.dim() != 4:
        raise ValueError(f"fusedops metal: x must be (B, H, Q, N), got shape {list(x.shape)}")
    bsz, heads, queries, n = x.shape
    x_type = TYPE_NAMES.get(x.dtype)
    kind = _mask_kind(mask, x_type)
    names = _kernels(launch, "softmax_masked_fwd", (x_type, TYPE_NAMES.get(out_dtype), kind))
    if names is None:
        return reference.softmax_masked_forward(x, mask, scale, causal, out_dtype)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    m = bsz * heads * queries
    if m == 0 or n == 0:
        return y
    x2, y2 = _rows(x.reshape(m, n)), y.view(m, n)
    flags = (FLAG_VEC if _aligned(x2, y2) else 0) | (FLAG_CAUSAL if causal else 0)
    strides = [0, 0, 0, 0]
    mk = _empty(x)
    if mask is not None:
        mk = mask.expand(x.shape)
        if mk.dtype != _MASK_DTYPES[kind]:
            mk = _compact_to(mk, _MASK_DTYPES[kind])
        # A size-1 dim is only ever indexed at 0: its stride does not matter.
        strides = [0 if sz == 1 else st for sz, st in zip(mk.shape, mk.stride(), strict=True)]
        flags |= FLAG_MASK
        if strides[3] == 1 and mk.storage_offset() % READS == 0 \
                and all(st % READS == 0 for st in strides[:3]):
            flags |= FLAG_MASK_VEC
    name, threads = _row_kernel(launch, names, n)
    launch(name, [x2, mk, y2, m, n, x2.stride(0), heads, queries, *strides, float(scale), flags],
           row_groups(m), threads)
    return y


def softmax_masked_backward_with(launch: Launcher, y: torch.Tensor, dy: torch.Tensor,
                                 scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    """dx = scale * y * (dy - sum(dy * y)) over rows (M, N)."""
    m, n = y.shape
    if dy.dtype != y.dtype:
        dy = dy.to(y.dtype)
    types = (TYPE_NAMES.get(y.dtype), TYPE_NAMES.get(out_dtype))
    names = _kernels(launch, "softmax_masked_bwd", types)
    if names is None:
        return reference.softmax_masked_backward(y, dy, scale, out_dtype)
    dx = torch.empty((m, n), dtype=out_dtype, device=y.device)
    if m == 0 or n == 0:
        return dx
    y, dy = _rows(y), _rows(dy)
    name, threads = _row_kernel(launch, names, n)
    flags = FLAG_VEC if _aligned(y, dy, dx) else 0
    launch(name, [y, dy, dx, m, n, y.stride(0), dy.stride(0), float(scale), flags],
           row_groups(m), threads)
    return dx


# --- LayerNorm epilogue (metal/layernorm_epilogue.metal) --------------------------------------

def _epilogue_flags(dropout_p: float, activation: str | None) -> tuple[int, int, float]:
    """(flags, keep threshold, keep scale) of the dropout and activation arguments."""
    if activation not in reference.ACTIVATIONS:
        raise ValueError(f"activation must be one of {reference.ACTIVATIONS}, got {activation!r}")
    flags = FLAG_RELU if activation == "relu" else FLAG_GELU if activation == "gelu" else 0
    p = float(dropout_p)
    if p == 0.0:
        return flags, 0, 1.0
    return flags | FLAG_DROPOUT, _philox.dropout_threshold(p), 1.0 / (1.0 - p)


def _seed_arg(seed: int) -> int:
    """The 64-bit seed as the kernels' signed 64-bit integer (same bits)."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return s - (1 << 64) if s >= 1 << 63 else s


def _epilogue_kernel(launch: Launcher, names: tuple[str, str], n: int,
                     dropout: bool) -> tuple[str, int, bool]:
    """(kernel, threadgroup size, Philox layout) for rows of n columns. With dropout, the Philox
    layout wherever the pipelines allow whole groups of PHILOX_W threads."""
    single, looped = names
    if dropout:
        ls = philox_threadgroup_limit(launch.max_threads(single))
        ll = philox_threadgroup_limit(launch.max_threads(looped))
        if ls and ll:
            if n <= READS * ls:
                return single, philox_row_threads(n, launch.max_threads(single)), True
            return looped, ll, True
    name, threads = _row_kernel(launch, names, n)
    return name, threads, False


def layernorm_epilogue_forward_with(launch: Launcher, x: torch.Tensor, residual, weight, bias,
                                    eps: float, out_dtype: torch.dtype, dropout_p: float,
                                    seed: int, activation: str | None, need_stats: bool):
    """``(out, s, mean, rstd)`` of ``activation(dropout(layer_norm(x + residual)))``; see
    ``fusedops.backends.reference.layernorm_epilogue_forward``."""
    m, n = x.shape
    ep_flags, threshold, keep = _epilogue_flags(dropout_p, activation)
    types = (TYPE_NAMES.get(x.dtype), TYPE_NAMES.get(out_dtype))
    names = _kernels(launch, "layernorm_epilogue_fwd", types)
    if names is None or (residual is not None and residual.dtype != x.dtype):
        return reference.layernorm_epilogue_forward(x, residual, weight, bias, eps, out_dtype,
                                                    dropout_p, seed, activation, need_stats)
    dev = x.device
    out = torch.empty((m, n), dtype=out_dtype, device=dev)
    s = None if residual is None else torch.empty((m, n), dtype=x.dtype, device=dev)
    mean = rstd = None
    if need_stats:
        # The statistics of empty rows are NaN, as the reference's.
        mean = torch.full((m,), torch.nan, device=dev) if n == 0 else \
            torch.empty((m,), dtype=torch.float32, device=dev)
        rstd = torch.full_like(mean, torch.nan) if n == 0 else torch.empty_like(mean)
    if m == 0 or n == 0:
        return out, s, mean, rstd
    x = _rows(x)
    residual = None if residual is None else _rows(residual)
    w, b = _param(weight), _param(bias)
    flags = (ep_flags | (FLAG_WEIGHT if w is not None else 0) | (FLAG_BIAS if b is not None else 0)
             | (FLAG_ADD if residual is not None else 0) | (FLAG_STATS if need_stats else 0))
    name, threads, philox = _epilogue_kernel(launch, names, n, bool(ep_flags & FLAG_DROPOUT))
    if philox:
        flags |= FLAG_PHILOX
    elif _aligned(x, out, *[t for t in (residual, s, w, b) if t is not None]):
        flags |= FLAG_VEC
    none = _empty(x)
    args = [x, none if residual is None else residual, none if w is None else w,
            none if b is None else b, out, none if s is None else s,
            none if mean is None else mean, none if rstd is None else rstd, m, n, x.stride(0),
            0 if residual is None else residual.stride(0), float(eps), _seed_arg(seed),
            threshold, keep, flags]
    launch(name, args, row_groups(m), threads)
    return out, s, mean, rstd


def layernorm_epilogue_backward_with(launch: Launcher, dout: torch.Tensor, ds, s: torch.Tensor,
                                     weight, bias, mean: torch.Tensor, rstd: torch.Tensor,
                                     dropout_p: float, seed: int, activation: str | None,
                                     need_dx: bool, need_dw: bool, need_db: bool):
    """``(dx, dw, db)`` of :func:`layernorm_epilogue_forward_with`; see
    ``fusedops.backends.reference.layernorm_epilogue_backward``."""
    m, n = s.shape
    need_dx, need_dw, need_db = bool(need_dx), bool(need_dw), bool(need_db)
    ep_flags, threshold, keep = _epilogue_flags(dropout_p, activation)
    types = (TYPE_NAMES.get(s.dtype), TYPE_NAMES.get(dout.dtype))
    names = _kernels(launch, "layernorm_epilogue_bwd", types)
    if names is None:
        return reference.layernorm_epilogue_backward(dout, ds, s, weight, bias, mean, rstd,
                                                     dropout_p, seed, activation, need_dx,
                                                     need_dw, need_db)
    dev = s.device
    dx = torch.empty((m, n), dtype=s.dtype, device=dev) if need_dx else None
    # Sums over zero rows are zeros; otherwise the reduction kernel writes every column.
    new = torch.zeros if m == 0 else torch.empty
    dw = new((n,), dtype=torch.float32, device=dev) if need_dw else None
    db = new((n,), dtype=torch.float32, device=dev) if need_db else None
    if m == 0 or n == 0 or not (need_dx or need_dw or need_db):
        return dx, dw, db
    s, dout = _rows(s), _rows(dout)
    if ds is not None and need_dx:
        ds = _rows(ds if ds.dtype == s.dtype else ds.to(s.dtype))
    else:
        ds = None
    w = _param(weight)
    # The bias only enters through the activation's input.
    b = _param(bias) if ep_flags & (FLAG_RELU | FLAG_GELU) else None
    mean = mean.reshape(-1).to(torch.float32).contiguous()
    rstd = rstd.reshape(-1).to(torch.float32).contiguous()
    groups = layernorm_bwd_groups(m, n)
    dwp = torch.empty((groups, n), dtype=torch.float32, device=dev) if need_dw else None
    dbp = torch.empty((groups, n), dtype=torch.float32, device=dev) if need_db else None
    flags = (ep_flags | (FLAG_WEIGHT if w is not None else 0) | (FLAG_BIAS if b is not None else 0)
             | (FLAG_ADD if ds is not None else 0) | (FLAG_DX if need_dx else 0)
             | (FLAG_DW if need_dw else 0) | (FLAG_DB if need_db else 0))
    name, threads, philox = _epilogue_kernel(launch, names, n, bool(ep_flags & FLAG_DROPOUT))
    if philox:
        flags |= FLAG_PHILOX
    elif _aligned(s, dout, *[t for t in (ds, w, b, dx) if t is not None]):
        flags |= FLAG_VEC
    none = _empty(s)
    args = [dout, none if ds is None else ds, s, none if w is None else w,
            none if b is None else b, mean, rstd, none if dx is None else dx,
            none if dwp is None else dwp, none if dbp is None else dbp, m, n, dout.stride(0),
            0 if ds is None else ds.stride(0), s.stride(0), _seed_arg(seed), threshold, keep,
            flags]
    launch(name, args, groups, threads)
    if need_dw or need_db:
        red = "fusedops_layernorm_dwdb_reduce"
        rt = reduce_threads(launch.max_threads(red))
        args = [none if dwp is None else dwp, none if dbp is None else dbp,
                none if dw is None else dw, none if db is None else db,
                groups, n, flags & (FLAG_DW | FLAG_DB)]
        launch(red, args, -(-n // rt), rt)
    return dx, dw, db

# --- Shader sources --------------------------------------------------------------------------


def shader_dir() -> Path | None:
    """Where the .metal sources are: the installed package, else the source checkout."""
    package = Path(__file__).resolve().parents[2]  # fusedops/
    for d in (package / "_shaders", package.parent / "metal"):
        if all((d / f).is_file() for f in SHADER_FILES):
            return d
    return None


def library_source(directory: Path | None = None) -> str:
    """One Metal source holding every kernel: the shader files with their includes inlined."""
    directory = shader_dir() if directory is None else directory
    if directory is None:
        raise FileNotFoundError("fusedops: Metal shader sources not found")
    return _shader_source.library_source(directory)


class ShaderLauncher:
    """The launcher protocol on ``torch.mps.compile_shader`` (the extension-less path)."""

    def __init__(self, source: str):
        self._lib = torch.mps.compile_shader(source)
        try:
            self._names = set(dir(self._lib))
        except Exception:  # pragma: no cover - older torch without __dir__
            self._names = None
        self._kernels: dict[str, object] = {}
        self._max: dict[str, int] = {}

    def _kernel(self, name: str):
        k = self._kernels.get(name)
        if k is None:
            k = self._kernels[name] = getattr(self._lib, name)
            self._max[name] = int(getattr(k, "max_threads_per_threadgroup", 256))
        return k

    def has(self, name: str) -> bool:
        if self._names is not None:
            return name in self._names
        try:  # pragma: no cover
            self._kernel(name)
        except Exception:  # pragma: no cover
            return False
        return True  # pragma: no cover

    def max_threads(self, name: str) -> int:
        self._kernel(name)
        return self._max[name]

    def __call__(self, name: str, args: list, groups: int, threads: int) -> None:
        self._kernel(name)(*args, threads=groups * threads, group_size=threads)


# --- Backend selection -----------------------------------------------------------------------
class _Extension:
    """The compiled extension, with the dtype pairs its library has kernels for."""

    def __init__(self, ext):
        ext.initialize()  # compiles the embedded shaders once; raises if Metal rejects them
        self.ext = ext
        names = set(ext.kernel_names())
        dtypes = {v: k for k, v in TYPE_NAMES.items()}

        def pairs(op: str, supported: set) -> set:
            return {(dtypes[a], dtypes[b]) for a, b in supported
                    if f"fusedops_{op}_single_{a}_{b}" in names
                    and f"fusedops_{op}_looped_{a}_{b}" in names}

        self.softmax_fwd = pairs("softmax_fwd", SOFTMAX_FWD_TYPES)
        self.softmax_bwd = pairs("softmax_bwd", SOFTMAX_BWD_TYPES)
        self.layernorm_fwd = pairs("layernorm_fwd", LAYERNORM_TYPES)
        self.layernorm_bwd = pairs("layernorm_bwd", LAYERNORM_TYPES)
        self.rmsnorm_fwd = pairs("rmsnorm_fwd", RMSNORM_TYPES)
        self.rmsnorm_bwd = pairs("rmsnorm_bwd", RMSNORM_TYPES)
        # Masked softmax forward: the (x, y) pairs with kernels for every mask kind.
        fwd = {(a, b) for a, b, _ in SOFTMAX_MASKED_FWD_TYPES}
        self.softmax_masked_fwd = {
            (dtypes[a], dtypes[b]) for a, b in fwd
            if all(f"fusedops_softmax_masked_fwd_{v}_{a}_{b}_{k}" in names
                   for v in ("single", "looped") for k in ("bool", a, "float"))}
        self.softmax_masked_bwd = pairs("softmax_masked_bwd", SOFTMAX_MASKED_BWD_TYPES)
        self.layernorm_epilogue_fwd = pairs("layernorm_epilogue_fwd", LAYERNORM_EPILOGUE_TYPES)
        self.layernorm_epilogue_bwd = pairs("layernorm_epilogue_bwd", LAYERNORM_EPILOGUE_TYPES)


_impl: object = None  # an _Extension, a ShaderLauncher, or False (nothing works)


def _warn(msg: str) -> None:
    warnings.warn(f"fusedops: {msg}", UserWarning, stacklevel=3)


def _load_impl() -> object:
    if sys.platform != "darwin":
        return False
    try:
        if not torch.backends.mps.is_available():
            return False
    except Exception:
        return False
    try:
        from fusedops import _metal_ext  # type: ignore[attr-defined]
    except ImportError:
        _metal_ext = None
    if _metal_ext is not None:
        try:
            return _Extension(_metal_ext)
        except Exception as e:  # pragma: no cover - needs a Mac
            _warn(f"the Metal extension failed to initialise ({e}); trying compile_shader")
    if hasattr(torch.mps, "compile_shader"):
        try:
            return ShaderLauncher(library_source())
        except Exception as e:  # pragma: no cover - needs a Mac
            _warn(f"torch.mps.compile_shader could not build the fusedops shaders ({e})")
    return False


def _get_impl() -> object:
    global _impl
    if _impl is None:
        _impl = _load_impl()
    if _impl is False:
        raise RuntimeError("fusedops: the Metal backend is not available in this process "
                           "(needs macOS with an MPS device); see "
                           "fusedops.backends.metal.is_available()")
    return _impl


def is_available() -> bool:
    """True when a Metal kernel path can run in this process (cached; False off macOS)."""
    global _impl
    if _impl is None:
        _impl = _load_impl()
    return _impl is not False


def implementation() -> str:
    """Which Metal path runs: ``"extension"``, ``"compile_shader"`` or ``"none"``."""
    if not is_available():
        return "none"
    return "compile_shader" if isinstance(_impl, ShaderLauncher) else "extension"


def softmax_forward(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    impl = _get_impl()
    if isinstance(impl, _Extension):
        if (x.dtype, out_dtype) in impl.softmax_fwd:
            return impl.ext.softmax_forward(x, out_dtype)
        return reference.softmax_forward(x, out_dtype)
    return softmax_forward_with(impl, x, out_dtype)


def softmax_backward(y: torch.Tensor, dy: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    impl = _get_impl()
    if isinstance(impl, _Extension):
        if (y.dtype, out_dtype) in impl.softmax_bwd:
            return impl.ext.softmax_backward(y, dy, out_dtype)
        return reference.softmax_backward(y, dy, out_dtype)
    return softmax_backward_with(impl, y, dy, out_dtype)


def layernorm_forward(x, weight, bias, eps, out_dtype):
    impl = _get_impl()
    if isinstance(impl, _Extension):
        if (x.dtype, out_dtype) in impl.layernorm_fwd:
            return tuple(impl.ext.layernorm_forward(x, weight, bias, float(eps), out_dtype))
        return reference.layernorm_forward(x, weight, bias, eps, out_dtype)
    return layernorm_forward_with(impl, x, weight, bias, eps, out_dtype)


def layernorm_forward_y(x, weight, bias, eps, out_dtype):
    return layernorm_forward(x, weight, bias, eps, out_dtype)[0]


def layernorm_backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db, grad_dtypes=None):
    # grad_dtypes: a hint for backends that cast dweight/dbias themselves; the caller casts here.
    impl = _get_impl()
    if isinstance(impl, _Extension):
        if (x.dtype, dy.dtype) in impl.layernorm_bwd:
            return tuple(impl.ext.layernorm_backward(dy, x, weight, mean, rstd, bool(need_dx),
                                                     bool(need_dw), bool(need_db)))
        return reference.layernorm_backward(dy, x, weight, mean, rstd, need_dx, need_dw,
                                            need_db)
    return layernorm_backward_with(impl, dy, x, weight, mean, rstd, need_dx, need_dw,
                                   need_db)


def rmsnorm_forward(x, weight, eps, out_dtype):
    impl = _get_impl()
    if isinstance(impl, _Extension):
        if (x.dtype, out_dtype) in impl.rmsnorm_fwd:
            return tuple(impl.ext.rmsnorm_forward(x, weight, float(eps), out_dtype))
        return reference.rmsnorm_forward(x, weight, eps, out_dtype)
    return rmsnorm_forward_with(impl, x, weight, eps, out_dtype)


def rmsnorm_forward_y(x, weight, eps, out_dtype):
    return rmsnorm_forward(x, weight, eps, out_dtype)[0]


def rmsnorm_backward(dy, x, weight, rstd, need_dx, need_dw, grad_dtypes=None):
    # grad_dtypes: a hint for backends that cast dweight themselves; the caller casts here.
    impl = _get_impl()
    if isinstance(impl, _Extension):
        if (x.dtype, dy.dtype) in impl.rmsnorm_bwd:
            return tuple(impl.ext.rmsnorm_backward(dy, x, weight, rstd, bool(need_dx),
                                                   bool(need_dw)))
        return reference.rmsnorm_backward(dy, x, weight, rstd, need_dx, need_dw)
    return rmsnorm_backward_with(impl, dy, x, weight, rstd, need_dx, need_dw)


def softmax_masked_forward(x, mask, scale, causal, out_dtype):
    impl = _get_impl()
    if isinstance(impl, _Extension):
        if (x.dtype, out_dtype) in impl.softmax_masked_fwd:
            return impl.ext.softmax_masked_forward(x, mask, float(scale), bool(causal), out_dtype)
        return reference.softmax_masked_forward(x, mask, scale, causal, out_dtype)
    return softmax_masked_forward_with(impl, x, mask, scale, causal, out_dtype)


def softmax_masked_backward(y, dy, scale, out_dtype):
    impl = _get_impl()
    if isinstance(impl, _Extension):
        if (y.dtype, out_dtype) in impl.softmax_masked_bwd:
            return impl.ext.softmax_masked_backward(y, dy, float(scale), out_dtype)
        return reference.softmax_masked_backward(y, dy, scale, out_dtype)
    return softmax_masked_backward_with(impl, y, dy, scale, out_dtype)


def layernorm_epilogue_forward(x, residual, weight, bias, eps, out_dtype, dropout_p, seed,
                               activation, need_stats):
    impl = _get_impl()
    if isinstance(impl, _Extension):
        if (x.dtype, out_dtype) in impl.layernorm_epilogue_fwd and (
                residual is None or residual.dtype == x.dtype):
            return tuple(impl.ext.layernorm_epilogue_forward(
                x, residual, weight, bias, float(eps), out_dtype, float(dropout_p),
                _seed_arg(seed), activation, bool(need_stats)))
        return reference.layernorm_epilogue_forward(x, residual, weight, bias, eps, out_dtype,
                                                    dropout_p, seed, activation, need_stats)
    return layernorm_epilogue_forward_with(impl, x, residual, weight, bias, eps, out_dtype,
                                           dropout_p, seed, activation, need_stats)


def layernorm_epilogue_backward(dout, ds, s, weight, bias, mean, rstd, dropout_p, seed,
                                activation, need_dx, need_dw, need_db, grad_dtypes=None):
    # grad_dtypes: a hint for backends that cast dweight/dbias themselves; the caller casts here.
    impl = _get_impl()
    if isinstance(impl, _Extension):
        if (s.dtype, dout.dtype) in impl.layernorm_epilogue_bwd:
            return tuple(impl.ext.layernorm_epilogue_backward(
                dout, ds, s, weight, bias, mean, rstd, float(dropout_p), _seed_arg(seed),
                activation, bool(need_dx), bool(need_dw), bool(need_db)))
        return reference.layernorm_epilogue_backward(dout, ds, s, weight, bias, mean, rstd,
                                                     dropout_p, seed, activation, need_dx,
                                                     need_dw, need_db)
    return layernorm_epilogue_backward_with(impl, dout, ds, s, weight, bias, mean, rstd,
                                            dropout_p, seed, activation, need_dx, need_dw,
                                            need_db)
