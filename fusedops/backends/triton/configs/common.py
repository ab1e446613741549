"""Launch rules shared by the row kernels: the single-block limit, per-kind tiles and warps
(:func:`row_config`), grids (:func:`grid_programs`), whether split rows fit
(:func:`split_fits`), and the body/edge split of unaligned rows."""

from __future__ import annotations

import os

import torch

from fusedops.backends.triton.runtime.caches import config_cache, config_caches
from fusedops.backends.triton.runtime.clusters import CLUSTER_SIZES
from fusedops.backends.triton.runtime.device import cdiv, next_pow2, num_sms
from fusedops.backends.triton.runtime.facts import DeviceFacts

# Rows whose padded length is at most this many elements (and at most the kernel kind's cap in
# KIND_CAPS) are held whole in registers by one program (read once, written once). Longer rows
# take the split-row or looped kernels. Tests shrink it (see ``set_single_block_limit``) so the
# looped path is exercised with small rows.
DEFAULT_SINGLE_BLOCK_LIMIT = 65536
_limits = {"single_block": DEFAULT_SINGLE_BLOCK_LIMIT}


def single_block_limit() -> int:
    """Largest padded row length (elements, a power of two) handled by the single-block kernels."""
    return _limits["single_block"]


def set_single_block_limit(n: int | None) -> None:
    """Change the single-block/looped switch (a power of two >= 16); ``None`` restores the default.

    Meant for tests and experiments; kernels' launch configs are re-derived on the next call.
    """
    if n is None:
        n = DEFAULT_SINGLE_BLOCK_LIMIT
    if n < 16 or n & (n - 1):
        raise ValueError(f"single-block limit must be a power of two >= 16, got {n}")
    _limits["single_block"] = n
    for cache in config_caches:
        cache.cache_clear()


# Launch configurations, measured on an H200 with each candidate timed next to torch eager in
# one process (docs/performance.md, method). Per kernel kind: the largest padded row kept
# in registers (above it the split-row or looped kernels win), the program tile (several short
# rows per program so every thread holds a few 16-byte vectors), the threads per program, and
# whether the grid is persistent (about one resident wave of programs looping over row tiles) or
# one program per tile.
KIND_CAPS = {"softmax_fwd": 32768, "softmax_bwd": 32768, "ln_fwd": 32768, "ln_bwd": 16384}

# (softmax forward rows of 64K run split: measured faster than one program per row, H100
# 16-bit 2.50 vs 1.84-2.28 TB/s, H200 float32 3.29 vs 2.89.)
_TILE_ELEMS = {"softmax_fwd": 2048, "softmax_bwd": 4096, "ln_fwd": 8192, "ln_bwd": 4096}

# Tiles of this many bytes, for kinds listed here (measured: softmax forward peaks at 4 KB per
# program with one program per tile, 0.96-0.99 of copy bandwidth at N <= 8K).
_TILE_BYTES = {"softmax_fwd": 4096}

# Measured on H200: one program per tile is 2-10% faster for softmax and LayerNorm forward
# (each program's loads do not wait for a previous tile's reduction); the LayerNorm backward
# row kernel stays persistent.
PERSISTENT = {"softmax_fwd": False, "softmax_bwd": False, "ln_fwd": False, "ln_bwd": True}


# Short 16-bit rows: (tile elements, warps) by padded row length (measured on H200). One or
# two warps per program, as Inductor does here, so a row's reductions stay within a warp or two
# (LayerNorm forward bf16 512: 3.91 vs 3.28 TB/s at 4 warps; 1K: 3.95 vs 3.67; softmax forward
# bf16 256/512: 4.10-4.11 vs 3.95-3.96). float32 rows measured no better (4.06-4.15 either way).
# 512: 4 rows a program, not 8 (fraction of copy, LayerNorm bf16 / fp16 0.99 vs 0.96, RMSNorm
# 0.98-0.99 vs 0.94-0.95: benchmarks/results/h200/short-rows-256-512.json).
_SHORT_16BIT = {
    "ln_fwd": {256: (2048, 1), 512: (2048, 2), 1024: (2048, 1)},
    "softmax_fwd": {256: (1024, 1), 512: (1024, 1)},
}


def _warps_for(tile: int, kind: str, elt_size: int, block: int) -> int:
    if kind == "softmax_bwd" and elt_size == 2 and block >= 2048:
        # 16-bit rows of 2K-32K (H200, bf16/fp16): 16 warps up to 8K-element tiles
        # (4.24-4.26 vs 4.20-4.23 TB/s at 8), 8 warps for 16K/32K rows (32K: 3.84-3.89 vs
        # 3.73-3.82 at 16).
        return 16 if tile <= 8192 else 8
    if kind == "ln_fwd":  # measured: LayerNorm forward prefers fewer, fuller threads
        return 4 if tile <= 8192 else min(32, tile // 1024)
    if kind == "softmax_fwd":  # 16K columns: 8 warps (fp32 4.08 vs 3.61 TB/s at 16)
        if tile > 16384:
            return 16
        return 8 if tile * elt_size > 8192 else 4
    return max(4, min(16, tile // 512))


def _tile_elems(kind: str, block: int, elt_size: int) -> int:
    if kind in _TILE_BYTES:
        return _TILE_BYTES[kind] // elt_size
    if kind == "ln_fwd" and block * elt_size <= 2048:
        # Short LayerNorm rows: 8 KB tiles (bf16 256: 3.79 vs 3.51 TB/s; fp32 256: 4.11 vs 3.60)
        return 8192 // elt_size
    return _TILE_ELEMS[kind]


def _cap(kind: str, elt_size: int) -> int:
    # float32 softmax backward rows of 32K spill in one program (y and dy: 128 values per
    # thread); the split-row kernel measured 3.68 vs 3.32 TB/s there.
    if kind == "softmax_bwd" and elt_size == 4:
        return 16384
    return KIND_CAPS[kind]


@config_cache
def row_config(n: int, kind: str, elt_size: int = 2) -> tuple[bool, int, int, int]:
    """(single_block, BLOCK, ROWS, num_warps) for rows of ``n`` elements and a kernel ``kind``
    (``softmax_fwd``, ``softmax_bwd``, ``ln_fwd``, ``ln_bwd``) on ``elt_size``-byte elements.

    Single-block: BLOCK is the padded row and ROWS rows share a program. Looped: BLOCK is the
    chunk streamed per iteration, one row per program.
    """
    block = next_pow2(n)
    if block <= min(single_block_limit(), _cap(kind, elt_size)):
        short = _SHORT_16BIT.get(kind) if elt_size == 2 else None
        if short and block <= 1024 and max(block, 256) in short:
            tile, warps = short[max(block, 256)]
            return True, block, max(1, tile // block), warps
        tile = _tile_elems(kind, block, elt_size)
        rows = max(1, min(64, tile // block))
        return True, block, rows, _warps_for(rows * block, kind, elt_size, block)
    chunk = min(single_block_limit(), 8192)
    # Looped kernels run one program per row: more threads keep more bytes in flight.
    return False, chunk, 1, max(1, min(16, chunk // 512))


# Kinds that switch back to a persistent grid for padded rows above this many elements
# (LayerNorm forward: 2.79 vs 2.57 TB/s at bf16 16K, and 0.19 of copy at N = 8193 without it).
PERSISTENT_ABOVE = {"ln_fwd": 8192}


def grid_size(num_tiles: int, num_warps: int, kind: str, device: torch.device,
              block: int = 0, vec: int = 0, persistent: bool = False) -> int:
    """:func:`grid_programs` on ``device`` (whose SMs are looked up only for persistent
    grids)."""
    if (not persistent and not PERSISTENT[kind]
            and block <= PERSISTENT_ABOVE.get(kind, 1 << 62)):
        return max(1, num_tiles)
    return grid_programs(num_tiles, num_warps, kind, num_sms(device), block, vec, True)


def grid_programs(num_tiles: int, num_warps: int, kind: str, sms: int, block: int = 0,
                  vec: int = 0, persistent: bool = False) -> int:
    """Programs for a single-block launch of ``kind`` over ``num_tiles`` row tiles of padded
    rows of ``block`` elements on a GPU of ``sms`` SMs (``persistent``: a persistent grid
    whatever the kind's rule). With unaligned rows (``vec`` > 0, see :func:`tile_rows`) a
    persistent grid is a multiple of ``vec``, so all tiles of a program share one misalignment
    (weights held in registers stay valid)."""
    if (not persistent and not PERSISTENT[kind]
            and block <= PERSISTENT_ABOVE.get(kind, 1 << 62)):
        return max(1, num_tiles)
    # One resident wave: 2048 threads per SM on Hopper/Ampere; the persistent loop does the rest.
    per_sm = max(1, 2048 // (32 * num_warps))
    progs = max(1, min(num_tiles, sms * per_sm))
    if vec and progs < num_tiles:
        progs = max(vec, progs // vec * vec)
    return progs


def for_gpu(table: dict, name: str) -> list:
    """The entries of a per-GPU rule table (GPU name part -> rules) whose key is part of the
    GPU name ``name`` ("": the CPU, none), in the table's order."""
    return [rules for part, rules in table.items() if part in name] if name else []


def cluster_rule(rules: tuple, n: int, dev: DeviceFacts) -> tuple | None:
    """The config of the first ``(shortest, longest, (piece, ...))`` rule whose range holds ``n``
    and whose pieces of a row make a cluster size that fits ``dev`` (a CLUSTER_FWD table's
    entries for one element size), or None; None on a device without clusters."""
    if not dev.clusters:
        return None
    for shortest, longest, cfg in rules:
        if shortest <= n <= longest and cdiv(n, cfg[0]) in CLUSTER_SIZES \
                and split_fits(dev, n, cfg[0]):
            return cfg
    return None


def pieces_rule(rules: tuple, n: int, dev: DeviceFacts) -> tuple | None:
    """:func:`cluster_rule` for a PIECES_FWD table (``(piece, CHUNK, warps, persistent)``
    configs): only where the row is whole pieces of whole chunks (the streamed-pieces kernels
    have no masks)."""
    rule = cluster_rule(rules, n, dev)
    return rule if rule is not None and n % rule[0] == 0 and rule[0] % rule[1] == 0 else None


def split_fits(dev: DeviceFacts, n: int, chunk: int) -> bool:
    """Whether the split-row kernels run rows of ``n`` on ``dev`` in equal pieces of at most
    ``chunk`` elements: they may run there, and all pieces of a row are resident at once."""
    return dev.split_rows and cdiv(n, chunk) <= dev.num_sms


# FUSEDOPS_ROW_BODY=0 turns the body/edge split off (scalar access for unaligned rows), for
# measurements against it.
ROW_BODY = {"enabled": os.environ.get("FUSEDOPS_ROW_BODY", "1") != "0"}


def unaligned_vec(n: int, strides: tuple[int, ...], elt_size: int,
                  tensors: tuple[torch.Tensor, ...] = ()) -> int:
    """VEC for :func:`row_body`: the elements per 16 bytes when the rows start unaligned and one
    body/edge split serves every tensor of the call (equal row strides, 16-byte aligned base
    pointers); 0 otherwise (aligned rows, or the scalar fallback).

    The split moves a column to another lane (so another place in the reduction tree) depending
    on where its row starts, so a row's last bits depend on its position in the batch. Under
    ``torch.use_deterministic_algorithms(True)`` unaligned rows take the scalar path instead,
    whose results depend on the row's values only (batch-split invariant)."""
    vec = 16 // elt_size
    for s in strides:  # on every call: the aligned case returns here, in a few bytecodes
        if s % vec:
            break
    else:
        return 0
    if (not ROW_BODY["enabled"] or n < 2 * vec or len(set(strides)) != 1
            or any(t.data_ptr() % 16 for t in tensors)
            or torch.are_deterministic_algorithms_enabled()):
        return 0
    return vec


def num_row_tiles(m: int, rows: int, vec: int) -> int:
    """Row tiles of :func:`tile_rows` covering ``m`` rows (with VEC > 0, up to VEC - 1 of them
    hold fewer rows)."""
    return vec * cdiv(cdiv(m, vec), rows) if vec else cdiv(m, rows)


def body_len(n: int, vec: int) -> int:
    """Longest aligned body of a row of ``n`` elements (the padded length to configure for)."""
    return (n // vec) * vec if vec else n


@config_cache
def unaligned_config(n: int, kind: str, elt_size: int, vec: int) -> tuple[int, int, int, int, int]:
    """(single_block, BLOCK, ROWS, num_warps, VEC) for rows of ``n`` with VEC from
    :func:`unaligned_vec`: :func:`row_config` for the aligned body, with the warps measured for
    the body/edge kernels on H200 (bf16/fp16/fp32 at N = 1025-8193). VEC comes
    back 0 where scalar access measured faster (short float32 rows in the backward kernels)."""
    single, block, rows, warps = row_config(body_len(n, vec), kind, elt_size)
    if not vec:
        return single, block, rows, warps, 0
    if not single:
        return single, block, rows, warps, vec
    if kind in ("softmax_bwd", "ln_bwd") and block <= 1024 and (elt_size == 4 or kind == "ln_bwd"):
        # float32 softmax backward 1025: 4.06 TB/s scalar vs 3.36; LayerNorm dx 3.39 vs 2.98
        # (16-bit: a tie at 1.81-1.93).
        return (*row_config(n, kind, elt_size), 0)
    if kind == "softmax_fwd" and block <= 8192:
        warps = 4  # bf16 8193: 4.01 vs 2.73 TB/s at 8 warps; 4097: 3.55 either way
    elif kind == "softmax_bwd":
        warps = 16 if block <= 1024 else 8  # bf16 1025: 2.55 vs 2.07; 4097: 4.17 vs 2.52
    elif kind == "ln_bwd":
        warps = 4  # bf16 4097: 2.68 vs 2.13 TB/s at 8 warps; float32 2049: 4.02 vs 3.85
    return single, block, rows, warps, vec


def unrolled_config(table: dict, elt_size: int, n: int, above: int,
                    vec: int) -> tuple[int, int] | None:
    """(chunk, warps) of an unrolled-kernel rule ``table`` ((element size, padded row) ->
    configs) for aligned rows of ``n`` elements: the first config whose chunk divides ``n``;
    None for rows of at most ``above`` elements, unaligned rows (``vec``), changed block limits,
    rows no chunk divides, and configs with 0 warps (rows left to the other kernels)."""
    if n <= above or vec or single_block_limit() != DEFAULT_SINGLE_BLOCK_LIMIT:
        return None
    for chunk, warps in table.get((elt_size, next_pow2(n)), ()):
        if n % chunk == 0:
            return (chunk, warps) if warps else None
    return None
