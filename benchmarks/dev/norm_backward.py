"""16-bit LayerNorm and RMSNorm backward: the current launch rules against candidate backward
configurations forced through ``configs.override``, in one run.

    PYTHONPATH=$PWD python benchmarks/dev/norm_backward.py           # writes norm_backward.json
    PYTHONPATH=$PWD python benchmarks/dev/norm_backward.py --ops layernorm --sizes 16384 65537
    PYTHONPATH=$PWD python benchmarks/dev/norm_backward.py --list    # the plan only, no timing
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/dev/norm_backward.py --smoke

Ops: the LayerNorm backward (x, weight and bias in x's dtype; dx, dweight, dbias) and the
RMSNorm backward (x and weight; dx, dweight), on bf16 rows (``--dtypes bf16 fp16``) of N = 512,
1K, 2K, 4K, 8K, 8193, 16K, 32K, 64K, 65537, 128K, 256K (``--sizes``) with M = 2^27 // N rows,
so every tensor is far larger than L2.

What is timed is the backward alone. The backend's forward (``fusedops.backends.triton.
layernorm_forward`` / ``rmsnorm_forward``) runs once per case for the saved statistics (mean
and rstd, rstd), then ``triton.testing.do_bench`` (median, L2 flushed between calls;
``--warmup`` / ``--rep``) times the backend's backward entry point with them::

    fusedops.backends.triton.layernorm_backward(dy, x, w, mean, rstd, True, True, True,
                                                grad_dtypes=(dtype, dtype))
    fusedops.backends.triton.rmsnorm_backward(dy, x, w, rstd, True, True, grad_dtypes=(dtype,))

the very call ``LayerNormFunction`` / ``RMSNormFunction.backward`` make (LayerNorm's replay
plans included), without the autograd engine. Per (op, dtype, N):

* ``copy``: ``dst.copy_(src)`` of 1.5·M·N elements of x's dtype, so it moves the bytes model's
  3·M·N·elt: the bandwidth reference of the same case;
* ``torch``: eager ``torch.autograd.grad(y, inputs, dy, retain_graph=True)`` through
  ``F.layer_norm`` / ``F.rms_norm`` (as the sweep, ``fusedops bench``, times backwards);
* ``compile`` (only with ``--compile``): the same through ``torch.compile(dynamic=False)`` of
  the eager op, one training graph per shape. Off by default: an Inductor forward+backward
  compile per case would take about a minute of the run, and the sweep
  (``benchmarks/results/<gpu>/sweep.json``) has the compiled backward at these points;
* ``current``: the entry point under the shipped rules, timed first and again last (a drift
  check), and ``current (autograd)``: ``torch.autograd.grad`` through ``fusedops.
  fused_layernorm`` / ``fused_rmsnorm``, the sweep's number for the same path;
* ``candidate``: the entry point under each candidate's override, named by the exact
  ``configs.override(...)`` calls it applies. Families (each where the current rules run the
  path it varies; ``--list`` prints them all):

  - fused kernel (LayerNorm rows up to 8K and 8193's aligned body, RMSNorm rows up to 16K):
    (ROWS, warps, programs per SM, ACC_1D) neighbours of the current configuration, pinned by
    :class:`PinFusedBwd` (LayerNorm's ``fused_bwd_config``) or a one-entry RMSNorm
    ``BWD_RULES_16BIT``; the pipelined tile loop switched (each op's
    ``PIPELINED_BWD_BLOCKS``; RMSNorm's 16-bit rows up to 8K), LayerNorm's paired row sums
    (``PAIRED_SUMS``) too; RMSNorm 8193 (``rms_bwd_vec``): warps
    and programs per SM pinned by :class:`PinVecBwd` (``vec_bwd_config``), and scalar
    accesses (``VEC_EDGES=False``);
  - split rows (aligned rows of 16K-256K, and forced at LayerNorm 8K / RMSNorm 16K): piece
    size (so the piece count C, the cluster size), warps, PREFETCH, register cap and
    thread-block clusters on or off, neighbours of the current choice. LayerNorm pins its
    ``split_config`` with :class:`PinSplitConfig`, RMSNorm gives ``CLUSTER_BWD`` /
    ``SPLIT_BWD`` one entry for the row length; unaligned rows on aligned-body pieces
    (``VEC_SPLIT_BWD``) and on scalar pieces;
  - the two-kernel paths: LayerNorm's dx row kernel plus the column kernel
    (``SPLIT_ROWS=False``), RMSNorm's looped dx kernel plus its column kernel
    (``SPLIT_ROWS_MIN=1 << 62``); LayerNorm's dx-pieces path for unaligned rows
    (``DX_PIECES_BWD`` piece and warps, forced at 8193 by ``FUSED_BWD_MAX_BLOCK=4096``) with
    the column kernel's tile and programs per SM (``COLUMN_TILE``, ``COLUMN_WARPS``,
    ``COLUMN_PER_SM``), and PyTorch's native kernel (``DX_PIECES_BWD=None``).

  A candidate whose rules give the current configuration is listed as ``same as current`` and
  not timed; ``--max-candidates`` (default 10) keeps the first ones of each case (the list is
  in order of interest) and lists the rest as left out. Before a candidate is timed, its first
  call runs with its launches recorded (``runtime.recording.record_launches``; the replay
  plans switched off for that call, LayerNorm's with ``BWD_PLANS=False``, RMSNorm's by
  :func:`rms_plans_off`, since the host records a plan's launches itself): the host's memo of the decision for that very call signature
  (``_bwd_config``, read back as a cache hit) must hold the candidate's path and parameters;
  the launches must include the path's kernels with the expected constexprs, warps and (where
  the rules fix it) grid, clusters and register cap as asked; no split-row or cluster switch
  may have been turned off by a failed launch; and the gradients must match the current
  rules' (``torch.testing.assert_close``, bf16 rtol 1.6e-2 / fp16 rtol 1e-3, atol 1e-5, for
  dx, dweight and dbias). LayerNorm's second call (plans on) must then give the same bits
  where it recorded a replay plan. A candidate that fails any of this, or raises, is recorded
  and reported as failed with the reason, and not timed. ``--budget-s`` (default 480; none
  with ``--smoke``) is the run's time budget, shared by the cases in order (case i of k starts
  no candidate once i/k of it has passed, so a case may use what earlier ones left);
  candidates past it are listed as left out, and every case's baselines still run.

TB/s = bytes / time with the sweep's bytes model: LayerNorm 3·M·N·elt + 3·N·elt + 8·M,
RMSNorm 3·M·N·elt + 2·N·elt + 4·M; each provider's fraction of the same case's copy TB/s.
Every record also holds the launches of its checked call (kernel, grid, warps, constexprs,
launcher kind, register cap, and on a GPU the compiled kernel's registers and spills).
``--out`` (default ``norm_backward.json``, rewritten after every case) gets every record, the
environment and a per-case summary; a table of the fraction of copy for current, torch,
compile and the best candidate (with its override) is printed last. The plan and a time
estimate are printed first; the defaults are sized for 6-8 minutes on an H100 or H200.

``--smoke`` runs on CPU tensors through the Triton interpreter (the environment must set
``TRITON_INTERPRET=1`` before Triton is imported) at small sizes (N = 512, 2048, 2049, 16384,
16385; M = 4 rows, 256 for LayerNorm rows whose aligned body takes the fused kernel: its grid
must be a multiple of VEC programs, at most M / 32 of them), each timing replaced by the one
checked call, without the drift check: it checks the script, the overrides and the forced
paths, not speed. Split-row candidates (their pieces wait for each other, which needs them
co-resident on a GPU: a cooperative grid or a thread-block cluster; the interpreter runs
programs one after another) and PyTorch's native kernel (CUDA only) are skipped there, each
with its reason printed, as is a candidate whose rules give its configuration on a GPU but
not on the interpreter's four "SMs" (a fused grid of one program per SM cannot be a multiple of
VEC there); they stay in the GPU plan. It takes about 5 minutes (LayerNorm 2049, 256 rows of
paired reductions, most of them). Needs a CUDA GPU otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from short_rows import (
    DTYPES,
    Candidate,
    Case,
    Records,
    bench_ms,
    candidate_fields,
    cap_candidates,
    dtype_name,
    environment,
    fmt,
    not_runnable,
    pick_device,
    short_error,
    summarize,
    sync,
)

import fusedops
from fusedops.backends import triton as backend
from fusedops.backends.triton import configs
from fusedops.backends.triton import layernorm_bwd as ln_host
from fusedops.backends.triton import rmsnorm_bwd as rms_host
from fusedops.backends.triton.configs import layernorm as ln_rules
from fusedops.backends.triton.configs import rmsnorm as rms_rules
from fusedops.backends.triton.configs.common import unaligned_vec
from fusedops.backends.triton.runtime.clusters import CLUSTER_SIZES, CLUSTER_STATE, ClusterLauncher
from fusedops.backends.triton.runtime.device import cdiv, interpreting, next_pow2
from fusedops.backends.triton.runtime.facts import DeviceFacts, device_facts
from fusedops.backends.triton.runtime.recording import record_launches
from fusedops.backends.triton.runtime.split import SPLIT_STATE, split_pieces

OPS = ("layernorm", "rmsnorm")
SIZES = (512, 1024, 2048, 4096, 8192, 8193, 16384, 32768, 65536, 65537, 131072, 262144)
SMOKE_SIZES = (512, 2048, 2049, 16384, 16385)
TOTAL_ELEMENTS = 1 << 27
SMOKE_ROWS = 4
EPS = 1e-5
# torch.testing's defaults for the dtype (dx in x's dtype; dweight/dbias rounded to it once)
TOLERANCES = {"bf16": {"rtol": 1.6e-2, "atol": 1e-5}, "fp16": {"rtol": 1e-3, "atol": 1e-5}}
MAX_THREADS_PER_SM = 2048
BUDGET_S = 480.0  # default --budget-s of a GPU run
# LayerNorm / RMSNorm bytes model (the sweep's): (N,)-sized parameters read or written, and
# float32 statistics per row read.
PARAMS = {"layernorm": 3, "rmsnorm": 2}
STATS_BYTES = {"layernorm": 8, "rmsnorm": 4}
# An H200 as the launch rules see it, for --list on a machine without a GPU.
ASSUMED_GPU = DeviceFacts(True, 132, "NVIDIA H200", True, True)
# Rough costs behind the printed estimate (seconds): one do_bench at the default warmup/rep on
# a 0.2-0.6 ms backward, a Triton compile of one backward kernel on a GPU host, the checked
# call's extra work (recording, the plan call, comparing 2^27-element gradients), a case's
# data and forward, an Inductor forward+backward compile of one static shape.
COST_TIMING, COST_TRITON_COMPILE, COST_CHECK = 0.2, 0.5, 0.15
COST_CASE, COST_TORCH_COMPILE, COST_SETUP = 0.6, 3.0, 20.0
# Distinct kernel specialisations a path's first call compiles (the shared reductions aside).
KERNELS_PER_PATH = {"fused": 2, "split": 3, "dx_pieces": 2, "rows": 2, "native": 0,
                    "looped": 2, "columns": 1}
SPLIT_REASON = ("GPU only: split-row pieces wait for each other, which needs them co-resident "
                "(a cooperative grid or a thread-block cluster); the interpreter runs programs "
                "one after another, so split rows are off there")
NATIVE_REASON = "GPU only: PyTorch's native CUDA backward (taken for CUDA tensors only)"


# ------------------------------------------------------------------------------ rule pins


class PinFusedBwd:
    """``configs.layernorm.fused_bwd_config`` with one padded block (aligned rows, or the
    aligned ``body`` of unaligned ones) of ``elt_size``-byte elements pinned to (ROWS, warps,
    programs per SM, ACC_1D); every other question goes to the rule in force when made."""

    def __init__(self, block: int, body: bool, elt_size: int, cfg: tuple[int, int, int, bool]):
        self.block, self.body, self.elt_size, self.cfg = block, body, elt_size, cfg
        self.rule = ln_rules.fused_bwd_config

    def __call__(self, block: int, body: bool = False,
                 elt_size: int = 2) -> tuple[int, int, int, bool]:
        if (block, body, elt_size) == (self.block, self.body, self.elt_size):
            return self.cfg
        return self.rule(block, body, elt_size)

    def __repr__(self) -> str:
        rows, warps, per_sm, acc_1d = self.cfg
        return (f"PinFusedBwd({self.block}, body={self.body}, elt_size={self.elt_size}, "
                f"rows={rows}, warps={warps}, per_sm={per_sm}, acc_1d={acc_1d})")


class PinSplitConfig:
    """``configs.layernorm.split_config`` with the backward of rows of ``n`` elements of
    ``elt_size`` bytes read with scalar or aligned accesses (not aligned-body pieces) pinned to
    ``cfg`` ((piece, warps, PREFETCH[, register cap[, clusters]])); every other question goes
    to the rule in force when made."""

    def __init__(self, n: int, elt_size: int, cfg: tuple) -> None:
        self.n, self.elt_size, self.cfg = n, elt_size, cfg
        self.rule = ln_rules.split_config

    def __call__(self, kind: str, n: int, elt_size: int, aligned: bool,
                 vec: int = 0) -> tuple | None:
        if kind == "bwd" and n == self.n and elt_size == self.elt_size and not vec:
            return self.cfg
        return self.rule(kind, n, elt_size, aligned, vec)

    def __repr__(self) -> str:
        return f"PinSplitConfig('bwd', {self.n}, elt_size={self.elt_size}, cfg={self.cfg!r})"


class PinVecBwd:
    """``configs.rmsnorm.vec_bwd_config`` with one padded body of ``elt_size``-byte elements
    pinned to (warps, programs per SM)."""

    def __init__(self, block: int, elt_size: int, cfg: tuple[int, int]) -> None:
        self.block, self.elt_size, self.cfg = block, elt_size, cfg
        self.rule = rms_rules.vec_bwd_config

    def __call__(self, block: int, elt_size: int) -> tuple[int, int]:
        if (block, elt_size) == (self.block, self.elt_size):
            return self.cfg
        return self.rule(block, elt_size)

    def __repr__(self) -> str:
        warps, per_sm = self.cfg
        return (f"PinVecBwd({self.block}, elt_size={self.elt_size}, warps={warps}, "
                f"per_sm={per_sm})")


@dataclass
class BwdCandidate(Candidate):
    """A :class:`short_rows.Candidate` with ``gpu_only``: why the interpreter cannot run it
    (None: it can)."""

    gpu_only: str | None = None
    kernels: int = 2  # kernel specialisations its first call compiles (for the estimate)


class Split(NamedTuple):
    """A split-row configuration: largest piece, warps, PREFETCH, register cap, clusters."""

    piece: int
    warps: int
    prefetch: int
    cap: int | None
    cluster: bool


# ------------------------------------------------------------------------------ the rules


def row_facts(op: str, n: int, elt: int) -> tuple[tuple[int, int, int], int, bool]:
    """(row strides of dy, x and dx, VEC, aligned) of contiguous (M, n) rows, as the hosts
    compute them for 16-byte aligned allocations."""
    strides = (n, n, n)
    vec = unaligned_vec(n, strides, elt)
    if op == "layernorm":
        return strides, vec, n % 8 == 0
    return strides, vec, all(s % (16 // elt) == 0 for s in strides)


def parked_mode() -> bool:
    return fusedops.get_layernorm_backward() == "low_memory"


def rules_config(op: str, n: int, elt: int, m: int, dev: DeviceFacts) -> Any:
    """What the rules in force decide for the backward of contiguous (m, n) rows with every
    gradient needed."""
    strides, vec, aligned = row_facts(op, n, elt)
    if op == "layernorm":
        return ln_rules.backward_config(m, n, elt, strides[:2], vec, True, True, True,
                                        parked_mode(), True, dev)
    return rms_rules.backward_config(n, elt, vec, aligned, dev)


def memo_config(op: str, n: int, elt: int, m: int, index: int) -> tuple[Any, bool]:
    """The host's memoized decision for the call signature just run, and whether it was read
    from the memo (a cache hit, so the very entry that call used)."""
    strides, vec, aligned = row_facts(op, n, elt)
    if op == "layernorm":
        fn, args = ln_host._bwd_config, (m, n, elt, strides[:2], vec, True, True, True,
                                         parked_mode(), True, index)
    else:
        fn, args = rms_host._bwd_config, (n, elt, vec, aligned, index)
    hits = fn.cache_info().hits
    cfg = fn(*args)
    return cfg, fn.cache_info().hits == hits + 1


def config_facts(op: str, cfg: Any, sms: int) -> dict[str, Any]:
    """A host config as flat facts: LayerNorm's nested decision as ``variant`` and dotted
    ``fused.*`` / ``split.*`` / ``pieces.*`` / ``rows.*`` keys (its fallback left out; the
    fused kernel's programs per SM on a GPU of ``sms`` SMs as ``fused.per_sm``), RMSNorm's
    ``BwdConfig`` fields with ``kernel`` as ``variant``."""
    if op == "rmsnorm":
        d = cfg._asdict()
        return {"variant": d.pop("kernel"), **d}
    f: dict[str, Any] = {"variant": cfg.variant}
    for part in ("fused", "split", "rows"):
        sub = getattr(cfg, part)
        if sub is not None:
            f.update({f"{part}.{k}": v for k, v in sub._asdict().items()})
    if cfg.fused is not None:
        f["fused.per_sm"] = cfg.fused.resident // max(1, sms)
    if cfg.pieces is not None:
        f.update(zip(("pieces.C", "pieces.L", "pieces.vec", "pieces.warps", "pieces.paired"),
                     cfg.pieces, strict=True))
    if cfg.columns is not None:
        f["columns"] = tuple(cfg.columns)
    return f


def label_of(op: str, f: dict[str, Any]) -> str:
    v = f["variant"]
    if op == "layernorm":
        if v == "fused":
            return (f"fused {f['fused.block']}{' body' if f['fused.vec'] else ''}: "
                    f"{f['fused.rows']}r x {f['fused.warps']}w, {f['fused.per_sm']}/SM, "
                    f"acc{'1d' if f['fused.acc_1d'] else '2d'}, st{f['fused.stages']}"
                    + (", paired" if f["fused.paired"] else ""))
        if v == "split":
            return (f"split {f['split.chunk']}x{f['split.warps']} C={f['split.pieces']} "
                    f"pf{f['split.prefetch']}"
                    + (f" cap{f['split.cap']}" if f["split.cap"] else "")
                    + (" cluster" if f["split.clusters"] else " coop")
                    + (" vec" if f["split.vec"] else ""))
        if v == "dx_pieces":
            return (f"dx_pieces {f['pieces.L']}x{f['pieces.warps']} C={f['pieces.C']} + "
                    f"columns {f['columns']}")
        if v == "rows":
            kind = "single" if f["rows.single"] else "looped"
            return (f"rows: dx {kind} {f['rows.block']}x{f['rows.warps']} + columns "
                    f"{f['columns']}")
        return v
    if v == "fused":
        if f["vec"]:
            return f"fused vec {f['block']}: {f['warps']}w, {f['per_sm']}/SM"
        return (f"fused {f['block']}: {f['rows']}r x {f['warps']}w, {f['per_sm']}/SM, "
                f"acc{'1d' if f['acc_1d'] else '2d'}, st{f['stages']}")
    if v == "split":
        return (f"split {f['chunk']}x{f['warps']} pf{f['prefetch']}"
                + (f" cap{f['maxnreg']}" if f["maxnreg"] else "")
                + (" cluster" if f["cluster"] else " coop") + (" vec" if f["vec"] else ""))
    return f"looped {f['block']}x{f['warps']} + columns"


def assumed_gpu() -> DeviceFacts:
    """ASSUMED_GPU with the split-row and cluster switches in force, as device_facts reads
    them."""
    split = SPLIT_STATE["enabled"]
    return ASSUMED_GPU._replace(split_rows=split, clusters=split and CLUSTER_STATE["enabled"])


# ------------------------------------------------------------------------------ candidates


def fused_neighbours(cur: tuple[int, int, int, bool],
                     one_row: bool) -> list[tuple[int, int, int, bool]]:
    """(ROWS, warps, programs per SM, ACC_1D) around the current fused configuration: more
    and fewer programs per SM, half and twice the elements per thread, a tile of twice and
    half the rows at the same elements per thread, the other accumulator layout (at most
    MAX_THREADS_PER_SM threads of programs per SM; ``one_row``: ROWS stays 1)."""
    rows, warps, per_sm, acc = cur
    out: list[tuple[int, int, int, bool]] = []

    def add(r: int, w: int, p: int, a: bool = acc) -> None:
        if r < 1 or not 1 <= w <= 32 or (one_row and r != 1):
            return
        p = min(p, MAX_THREADS_PER_SM // (32 * w))  # what one SM holds at once
        if p >= 1 and (r, w, p, a) != cur and (r, w, p, a) not in out:
            out.append((r, w, p, a))

    add(rows, warps, per_sm * 2)
    add(rows, warps * 2, per_sm)
    add(rows, warps, per_sm // 2)
    add(rows, max(1, warps // 2), per_sm * 2)
    add(rows * 2, warps * 2, per_sm)
    add(rows // 2, max(1, warps // 2), per_sm * 2)
    if rows > 1:
        add(rows, warps, per_sm, not acc)
    return out


def split_neighbours(n: int, cur: Split, sms: int, elt: int) -> list[Split]:
    """Split-row configurations around ``cur`` for aligned rows of ``n``, in order of
    interest: clusters toggled (the same pieces cooperatively; or, from a cooperative grid,
    the smallest piece whose count is a cluster size, on one and on half a 16-byte vector per
    thread), the other PREFETCH values (clusters: 0-2, 3 being 2 there), twice and half the
    piece at the same elements per thread, half the elements per thread, the register cap
    toggled (none <-> 128), twice the elements per thread."""
    vec_elems = 16 // elt
    out: list[Split] = []

    def pieces(p: int) -> int:
        return split_pieces(n, p, 0)[0]

    def add(s: Split) -> None:
        if (s.piece < 256 or not 1 <= s.warps <= 32 or pieces(s.piece) > sms
                or (s.cluster and pieces(s.piece) not in CLUSTER_SIZES)
                or s.piece < 32 * s.warps):
            return
        if s != cur and s not in out:
            out.append(s)

    if cur.cluster:
        add(cur._replace(cluster=False))
    else:
        p = cur.piece
        while p <= n and pieces(p) not in CLUSTER_SIZES:
            p *= 2
        if pieces(p) in CLUSTER_SIZES:
            for per_thread in (2 * vec_elems, vec_elems):
                add(Split(p, min(32, p // (32 * per_thread)), 1, cur.cap, True))
    for pf in ((0, 1, 2) if cur.cluster else (0, 1, 2, 3)):
        add(cur._replace(prefetch=pf))

    def cluster_if(p: int) -> bool:
        return cur.cluster and pieces(p) in CLUSTER_SIZES

    add(Split(cur.piece * 2, cur.warps * 2, cur.prefetch, cur.cap, cluster_if(cur.piece * 2)))
    add(Split(cur.piece // 2, cur.warps // 2, cur.prefetch, cur.cap,
              cluster_if(cur.piece // 2)))
    add(cur._replace(warps=cur.warps * 2))
    add(cur._replace(cap=None if cur.cap else 128))
    add(cur._replace(warps=cur.warps // 2))
    return out


def split_label(s: Split, n: int) -> str:
    c = split_pieces(n, s.piece, 0)[0]
    return (f"split {s.piece}x{s.warps} C={c} pf{s.prefetch}"
            + (f" cap{s.cap}" if s.cap else "") + (" cluster" if s.cluster else " coop"))


def ln_split_tuple(s: Split) -> tuple:
    """``split_config``'s form of ``s``: (piece, warps, PREFETCH[, cap[, True]])."""
    if s.cluster:
        return (s.piece, s.warps, s.prefetch, s.cap, True)
    if s.cap:
        return (s.piece, s.warps, s.prefetch, s.cap)
    return (s.piece, s.warps, s.prefetch)


def ln_split_candidate(n: int, elt: int, s: Split, extra: dict[str, Any] | None = None,
                       why: str = "") -> BwdCandidate:
    facts = {"variant": "split", "split.chunk": s.piece, "split.warps": s.warps,
             "split.prefetch": s.prefetch, "split.cap": s.cap, "split.clusters": s.cluster,
             "split.pieces": split_pieces(n, s.piece, 0)[0], "split.vec": 0}
    cfg = ln_split_tuple(s)
    return BwdCandidate(
        split_label(s, n) + why, facts,
        [("layernorm", {**(extra or {}), "split_config": PinSplitConfig(n, elt, cfg)})],
        f"configs/layernorm.py split_config('bwd'): {8 * elt}-bit rows of {n} -> {cfg}",
        gpu_only=SPLIT_REASON, kernels=KERNELS_PER_PATH["split"])


def stages_candidate(op: str, pipelined_now: frozenset[int], block: int, key: str,
                     kernels: int) -> BwdCandidate:
    """The fused backward of padded rows of ``block`` with its tile loop's pipelining switched
    (``block`` toggled in ``op``'s PIPELINED_BWD_BLOCKS); ``key``: the stages' fact name."""
    pipelined = set(pipelined_now) ^ {block}
    stages = 3 if block in pipelined else 1
    return BwdCandidate(
        f"fused {block}: stages {stages}", {"variant": "fused", key: stages},
        [(op, {"PIPELINED_BWD_BLOCKS": frozenset(sorted(pipelined))})],
        f"configs/{op}.py PIPELINED_BWD_BLOCKS {'with' if stages > 1 else 'without'} {block}",
        kernels=kernels)


def layernorm_candidates(n: int, elt: int, cur: dict[str, Any],
                         dev: DeviceFacts) -> list[BwdCandidate]:
    v = cur["variant"]
    out: list[BwdCandidate] = []
    if v == "fused":
        block, vec = cur["fused.block"], cur["fused.vec"]
        rule = ln_rules.fused_bwd_config(block, vec > 0, elt)
        for cfg in fused_neighbours(rule, vec > 0):
            rows, warps, per_sm, acc_1d = cfg
            facts = {"variant": "fused", "fused.block": block, "fused.vec": vec,
                     "fused.rows": rows, "fused.warps": warps, "fused.acc_1d": acc_1d,
                     "fused.per_sm": per_sm}
            out.append(BwdCandidate(
                f"fused {block}{' body' if vec else ''}: {rows}r x {warps}w, {per_sm}/SM, "
                f"acc{'1d' if acc_1d else '2d'}", facts,
                [("layernorm", {"fused_bwd_config": PinFusedBwd(block, vec > 0, elt, cfg)})],
                f"configs/layernorm.py fused_bwd_config({block}, body={vec > 0}): ROWS {rows}, "
                f"{warps} warps, {per_sm} per SM, ACC_1D {acc_1d}",
                kernels=KERNELS_PER_PATH["fused"]))
        if not vec and block <= 4096:
            out.append(stages_candidate("layernorm", ln_rules.PIPELINED_BWD_BLOCKS, block,
                                        "fused.stages", KERNELS_PER_PATH["fused"]))
        if cur["fused.paired"]:
            out.append(BwdCandidate(
                f"fused {block}{' body' if vec else ''}: separate sums",
                {"variant": "fused", "fused.paired": False},
                [("layernorm", {"PAIRED_SUMS": False})],
                f"configs/layernorm.py paired_sums: not for {8 * elt}-bit "
                f"{'bodies' if vec else 'blocks'} of {block}", kernels=KERNELS_PER_PATH["fused"]))
        if vec:  # unaligned rows: the other paths they may take
            out += ln_unaligned_candidates(n, elt, {"FUSED_BWD_MAX_BLOCK": block // 2},
                                           pieces=((4096, 8), (2048, 4)))
        elif block == ln_rules.FUSED_BWD_MAX_BLOCK:  # the longest fused rows on split rows
            for s in (Split(2048, 4, 1, 128, True), Split(4096, 8, 1, 128, False)):
                out.append(ln_split_candidate(
                    n, elt, s, {"FUSED_BWD_MAX_BLOCK": block // 2},
                    f" (FUSED_BWD_MAX_BLOCK={block // 2})"))
    elif v == "split" and not cur["split.vec"]:
        now = Split(cur["split.chunk"], cur["split.warps"], cur["split.prefetch"],
                    cur["split.cap"], cur["split.clusters"])
        for s in split_neighbours(n, now, dev.num_sms if dev.cuda else ASSUMED_GPU.num_sms,
                                  elt):
            out.append(ln_split_candidate(n, elt, s))
        out.append(ln_rows_candidate(n))
    elif v == "dx_pieces":
        out += ln_unaligned_candidates(n, elt, {}, pieces=(
            (8192, 16), (2048, 4), (4096, 4), (8192, 8)))
    elif v == "rows":
        out += ln_column_candidates(n)
    return out


def ln_rows_candidate(n: int) -> BwdCandidate:
    return BwdCandidate(
        "rows: dx row kernel + columns (SPLIT_ROWS=False)", {"variant": "rows"},
        [("layernorm", {"SPLIT_ROWS": False})],
        f"configs/layernorm.py split_config('bwd'): None for rows of {n} (the dx row kernel "
        "and the column kernel)", kernels=KERNELS_PER_PATH["rows"])


def ln_column_candidates(n: int) -> list[BwdCandidate]:
    out = []
    per_sm = ln_rules.COLUMN_PER_SM
    for rules, what in (({"COLUMN_PER_SM": per_sm * 2}, f"COLUMN_PER_SM = {per_sm * 2}"),
                        ({"COLUMN_TILE": (64, 64)}, "COLUMN_TILE = (64, 64)"),
                        ({"COLUMN_TILE": (256, 32), "COLUMN_WARPS": 8},
                         "COLUMN_TILE = (256, 32), COLUMN_WARPS = 8")):
        out.append(BwdCandidate(
            f"columns: {what}", {}, [("layernorm", rules)], f"configs/layernorm.py {what}",
            kernels=KERNELS_PER_PATH["columns"]))
    return out


def ln_unaligned_candidates(n: int, elt: int, base: dict[str, Any],
                            pieces: tuple[tuple[int, int], ...]) -> list[BwdCandidate]:
    """Unaligned 16-bit rows too long for the fused kernel (``base``: the override that makes
    them so): the dx-pieces path on each (piece, warps) of ``pieces`` not current, the column
    kernel's tiles, PyTorch's native kernel, the split kernel on aligned-body pieces
    (VEC_SPLIT_BWD) and on scalar pieces."""
    out: list[BwdCandidate] = []
    why = "".join(f" ({k}={v!r})" for k, v in base.items())
    body = (n // 8) * 8
    for piece, warps in pieces:
        if not base and (piece, warps) == ln_rules.DX_PIECES_BWD:
            continue
        c, length = split_pieces(n, piece, 8)
        rules = {**base, "DX_PIECES_BWD": (piece, warps)}
        out.append(BwdCandidate(
            f"dx_pieces {length}x{warps} C={c}{why}",
            {"variant": "dx_pieces", "pieces.C": c, "pieces.L": length, "pieces.warps": warps},
            [("layernorm", rules)], f"configs/layernorm.py DX_PIECES_BWD = ({piece}, {warps})"
            + (f" and {why.strip()}" if why else ""), kernels=KERNELS_PER_PATH["dx_pieces"]))
    if not base:
        out += ln_column_candidates(n)
    out.append(BwdCandidate(
        f"native (PyTorch's kernel){why}", {"variant": "native"},
        [("layernorm", {**base, "DX_PIECES_BWD": None})],
        "configs/layernorm.py DX_PIECES_BWD = None (NATIVE_UNALIGNED_16BIT_BWD takes these rows)"
        + (f" and {why.strip()}" if why else ""), gpu_only=NATIVE_REASON,
        kernels=KERNELS_PER_PATH["native"]))
    for cfg in ((2048, 8, 1), (4096, 8, 3)):
        c, length = split_pieces(n, cfg[0], 8)
        table = {elt: (cfg, min(16384, body))}
        out.append(BwdCandidate(
            f"split {cfg[0]}x{cfg[1]} C={c} pf{cfg[2]} vec (aligned-body pieces){why}",
            {"variant": "split", "split.vec": 8, "split.chunk": cfg[0], "split.warps": cfg[1],
             "split.prefetch": cfg[2], "split.pieces": c, "split.piece": length},
            [("layernorm", {**base, "DX_PIECES_BWD": None, "VEC_SPLIT_BWD": table})],
            f"configs/layernorm.py VEC_SPLIT_BWD[{elt}] = ({cfg}, {min(16384, body)}) and "
            f"DX_PIECES_BWD = None{why}", gpu_only=SPLIT_REASON,
            kernels=KERNELS_PER_PATH["split"]))
    out.append(BwdCandidate(
        f"split scalar pieces{why}", {"variant": "split", "split.vec": 0},
        [("layernorm", {**base, "DX_PIECES_BWD": None, "NATIVE_UNALIGNED_16BIT_BWD": False})],
        "configs/layernorm.py NATIVE_UNALIGNED_16BIT_BWD = False and DX_PIECES_BWD = None"
        + why, gpu_only=SPLIT_REASON, kernels=KERNELS_PER_PATH["split"]))
    return out


def rms_split_rules(n: int, elt: int, s: Split, vec: bool = False) -> dict[str, Any]:
    """The RMSNorm tables that make rows of ``n`` elements of ``elt`` bytes take ``s``:
    CLUSTER_BWD (clusters) or SPLIT_BWD (cooperative; CLUSTER_BWD emptied where it would take
    the rows first) holding one entry, for rows up to ``n``, or VEC_SPLIT_BWD for unaligned rows
    (``vec``). The tables hold that element size only (the run has no other)."""
    cfg = (s.piece, s.warps, s.prefetch, s.cap)
    if vec:
        return {"VEC_SPLIT_BWD": {elt: cfg}}
    if s.cluster:
        return {"CLUSTER_BWD": {elt: ((n, cfg),)}}
    rules: dict[str, Any] = {"SPLIT_BWD": {elt: ((n, cfg),)}}
    if rms_rules._first(rms_rules.CLUSTER_BWD.get(elt, ()), n) is not None:
        rules["CLUSTER_BWD"] = {elt: ()}
    return rules


def rms_split_candidate(n: int, elt: int, s: Split, base: dict[str, Any] | None = None,
                        why: str = "") -> BwdCandidate:
    cfg = (s.piece, s.warps, s.prefetch, s.cap)
    table = "CLUSTER_BWD" if s.cluster else "SPLIT_BWD"
    return BwdCandidate(
        split_label(s, n) + why,
        {"variant": "split", "chunk": s.piece, "warps": s.warps, "prefetch": s.prefetch,
         "maxnreg": s.cap, "cluster": s.cluster, "vec": 0},
        [("rmsnorm", {**(base or {}), **rms_split_rules(n, elt, s)})],
        f"configs/rmsnorm.py {table}[{elt}]: rows up to {n} -> {cfg}"
        + (f" and {why.strip()}" if why else ""), gpu_only=SPLIT_REASON,
        kernels=KERNELS_PER_PATH["split"])


def rmsnorm_candidates(n: int, elt: int, cur: dict[str, Any],
                       dev: DeviceFacts) -> list[BwdCandidate]:
    v = cur["variant"]
    out: list[BwdCandidate] = []
    sms = dev.num_sms if dev.cuda else ASSUMED_GPU.num_sms
    if v == "fused" and not cur["vec"]:
        block = cur["block"]
        aligned = n % (16 // elt) == 0
        rule = rms_rules.bwd_config(block, elt, aligned)
        if aligned and elt == 2 and block <= 8192:
            out.append(stages_candidate("rmsnorm", rms_rules.PIPELINED_BWD_BLOCKS, block,
                                        "stages", 1))
        if aligned and elt == 2:  # BWD_RULES_16BIT holds such rows
            for cfg in fused_neighbours(rule, False):
                rows, warps, per_sm, acc_1d = cfg
                out.append(BwdCandidate(
                    f"fused {block}: {rows}r x {warps}w, {per_sm}/SM, "
                    f"acc{'1d' if acc_1d else '2d'}",
                    {"variant": "fused", "block": block, "rows": rows, "warps": warps,
                     "per_sm": per_sm, "acc_1d": acc_1d, "vec": 0},
                    [("rmsnorm", {"BWD_RULES_16BIT": {block: cfg}})],
                    f"configs/rmsnorm.py BWD_RULES_16BIT[{block}] = {cfg}",
                    kernels=1))
        if block == rms_rules.FUSED_BWD_MAX_BLOCK:  # the longest fused rows on split rows
            base = {"FUSED_BWD_MAX_BLOCK": block // 2}
            why = f" (FUSED_BWD_MAX_BLOCK={block // 2})"
            for s in (Split(2048, 4, 1, 128, True), Split(4096, 8, 1, 128, True),
                      Split(4096, 8, 1, 128, False)):
                out.append(rms_split_candidate(n, elt, s, base, why))
    elif v == "fused":  # unaligned rows on their aligned body
        block = cur["block"]
        for warps, per_sm in ((32, 1), (16, 1), (8, 4), (16, 4), (32, 2), (8, 2)):
            if 32 * warps * per_sm > MAX_THREADS_PER_SM or block < 32 * warps:
                continue
            if (warps, per_sm) == (cur["warps"], cur["per_sm"]):
                continue
            out.append(BwdCandidate(
                f"fused vec {block}: {warps}w, {per_sm}/SM",
                {"variant": "fused", "vec": cur["vec"], "block": block, "warps": warps,
                 "per_sm": per_sm},
                [("rmsnorm", {"vec_bwd_config": PinVecBwd(block, elt, (warps, per_sm))})],
                f"configs/rmsnorm.py vec_bwd_config({block}): {warps} warps, {per_sm} per SM",
                kernels=1))
        if next_pow2(n) <= rms_rules.FUSED_BWD_MAX_BLOCK_UNALIGNED:
            out.append(BwdCandidate(
                "fused, scalar accesses (VEC_EDGES=False)", {"variant": "fused", "vec": 0},
                [("rmsnorm", {"VEC_EDGES": False})],
                "configs/rmsnorm.py VEC_EDGES = False (bwd_config for unaligned rows)",
                kernels=1))
        else:
            out.append(BwdCandidate(
                "split scalar pieces (VEC_EDGES=False)", {"variant": "split", "vec": 0},
                [("rmsnorm", {"VEC_EDGES": False})],
                "configs/rmsnorm.py VEC_EDGES = False (SCALAR_SPLIT_BWD_16BIT)",
                gpu_only=SPLIT_REASON, kernels=KERNELS_PER_PATH["split"]))
        s = Split(*rms_rules.VEC_SPLIT_BWD[elt], False)
        out.append(BwdCandidate(
            f"split {s.piece}x{s.warps} pf{s.prefetch} vec (FUSED_BWD_MAX_BLOCK={block // 2})",
            {"variant": "split", "vec": cur["vec"], "chunk": s.piece, "warps": s.warps},
            [("rmsnorm", {"FUSED_BWD_MAX_BLOCK": block // 2})],
            f"configs/rmsnorm.py FUSED_BWD_MAX_BLOCK below {block} (VEC_SPLIT_BWD[{elt}] then "
            "takes these rows)", gpu_only=SPLIT_REASON, kernels=KERNELS_PER_PATH["split"]))
    elif v == "split" and not cur["vec"]:
        now = Split(cur["chunk"], cur["warps"], cur["prefetch"], cur["maxnreg"], cur["cluster"])
        for s in split_neighbours(n, now, sms, elt):
            out.append(rms_split_candidate(n, elt, s))
        out.append(rms_looped_candidate(n))
    elif v == "split":  # unaligned rows on aligned-body pieces
        now = (cur["chunk"], cur["warps"], cur["prefetch"], cur["maxnreg"])
        for cfg in ((4096, 8, 1, None), (8192, 16, 1, None), (2048, 4, 1, None),
                    (2048, 8, 3, None), (4096, 8, 3, None), (2048, 8, 1, 128),
                    (4096, 16, 1, None)):
            if cfg == now:
                continue
            c = split_pieces(n, cfg[0], cur["vec"])[0]
            out.append(BwdCandidate(
                f"split {cfg[0]}x{cfg[1]} C={c} pf{cfg[2]}"
                + (f" cap{cfg[3]}" if cfg[3] else "") + " vec",
                {"variant": "split", "vec": cur["vec"], "chunk": cfg[0], "warps": cfg[1],
                 "prefetch": cfg[2], "maxnreg": cfg[3]},
                [("rmsnorm", rms_split_rules(n, elt, Split(*cfg, False), vec=True))],
                f"configs/rmsnorm.py VEC_SPLIT_BWD[{elt}] = {cfg}", gpu_only=SPLIT_REASON,
                kernels=KERNELS_PER_PATH["split"]))
        out.append(BwdCandidate(
            "split scalar pieces (VEC_EDGES=False)", {"variant": "split", "vec": 0},
            [("rmsnorm", {"VEC_EDGES": False})],
            "configs/rmsnorm.py VEC_EDGES = False (SCALAR_SPLIT_BWD_16BIT)",
            gpu_only=SPLIT_REASON, kernels=KERNELS_PER_PATH["split"]))
        out.append(rms_looped_candidate(n))
    return out


def rms_looped_candidate(n: int) -> BwdCandidate:
    return BwdCandidate(
        "looped dx + columns (SPLIT_ROWS_MIN=1 << 62)", {"variant": "looped"},
        [("rmsnorm", {"SPLIT_ROWS_MIN": 1 << 62})],
        f"configs/rmsnorm.py SPLIT_ROWS_MIN above {n}", kernels=KERNELS_PER_PATH["looped"])


BUILDERS = {"layernorm": layernorm_candidates, "rmsnorm": rmsnorm_candidates}


def plan_case(op: str, dtype: str, n: int, m: int, facts_now: Callable[[], DeviceFacts],
              max_candidates: int | None) -> Case:
    """The current configuration and the candidates of one case, each candidate's override
    checked against the rules (pure functions, nothing launched; ``facts_now``: the device as
    the rules see it under the switches in force): one whose rules give another configuration
    than it names is failed here, one that gives the current one is not timed, one the
    interpreter cannot run is skipped in smoke runs (a device that is not CUDA)."""
    elt = DTYPES[dtype].itemsize
    dev = facts_now()
    current = config_facts(op, rules_config(op, n, elt, m, dev), dev.num_sms)
    case = Case(op, dtype, n, m, current)
    for cand in BUILDERS[op](n, elt, current, dev):
        try:
            with cand.applied():
                now = facts_now()
                got = config_facts(op, rules_config(op, n, elt, m, now), now.num_sms)
                if op == "layernorm" and "columns" in got and not cand.facts:
                    cand.facts = {"variant": got["variant"], "columns": got["columns"]}
                gpu = assumed_gpu()
                on_gpu = config_facts(op, rules_config(op, n, elt, TOTAL_ELEMENTS // n, gpu),
                                      gpu.num_sms)
        except Exception as e:  # a rule the override cannot set: a failed candidate
            cand.status, cand.error = "failed", f"override refused: {type(e).__name__}: {e}"
            case.candidates.append(cand)
            continue
        wrong = {k: (got.get(k), v) for k, v in cand.facts.items() if got.get(k) != v}
        if cand.gpu_only and not dev.cuda:
            cand.status, cand.error = "skipped (GPU only)", cand.gpu_only
        elif wrong and not dev.cuda and all(on_gpu.get(k) == v for k, v in cand.facts.items()):
            cand.status = "skipped (GPU only)"
            cand.error = (f"GPU only: with this device's {dev.num_sms} SMs the rules under this "
                          f"override give {label_of(op, got)} ({wrong}); with {gpu.num_sms} "
                          f"SMs and M = {TOTAL_ELEMENTS // n} they give the named configuration")
        elif wrong:
            cand.status = "failed"
            cand.error = f"the rules under this override give {label_of(op, got)} ({wrong})"
        elif got == current:
            cand.status = "same as current"
        case.candidates.append(cand)
    return cap_candidates(case, max_candidates)


# ------------------------------------------------------------------------------ checks


class Expect(NamedTuple):
    """A launch a path must make: kernel, constexprs (and other scalars) by parameter name,
    warps, grid (None: sized at launch), thread-block clusters (None: not checked), register
    cap (``"any"``: not checked)."""

    kernel: str
    consts: dict[str, Any]
    warps: int
    grid: tuple[int, ...] | None = None
    cluster: bool | None = None
    cap: Any = "any"


def ln_columns_expect(columns: tuple[int, int, int]) -> Expect:
    block_c, block_r = ln_rules.COLUMN_TILE
    return Expect("ln_bwd_dwdb_columns", {"BLOCK_C": block_c, "BLOCK_R": block_r},
                  ln_rules.COLUMN_WARPS, tuple(columns[:2]))


def expected_launches(op: str, f: dict[str, Any], n: int, m: int,
                      dev: DeviceFacts) -> list[Expect] | None:
    """The launches of the path in host config facts ``f`` (read under the rules in force);
    an empty list: no Triton launch at all (PyTorch's kernel); None: no check for it."""
    v = f["variant"]
    if op == "layernorm":
        if v == "fused":
            return [Expect("ln_bwd_single", {
                "BLOCK_N": f["fused.block"], "ROWS": f["fused.rows"], "VEC": f["fused.vec"],
                "ACC_1D": f["fused.acc_1d"], "PAIRED": f["fused.paired"],
                "STAGES": f["fused.stages"], "NEED_DW": True, "NEED_DB": True,
                "PARKED": parked_mode()}, f["fused.warps"], (f["fused.programs"],))]
        if v == "split":
            clusters = f["split.clusters"]
            return [Expect("ln_bwd_split", {
                "BLOCK": next_pow2(f["split.piece"]), "C": f["split.pieces"],
                "PREFETCH": f["split.prefetch"], "VEC": f["split.vec"],
                "PAIRED": f["split.paired"], "CLUSTER": clusters}, f["split.warps"], None,
                clusters, f["split.cap"])]
        if v == "dx_pieces":
            return [ln_columns_expect(f["columns"]), Expect("ln_bwd_dx_pieces", {
                "BLOCK": next_pow2(f["pieces.L"]), "C": f["pieces.C"], "VEC": f["pieces.vec"],
                "PAIRED": f["pieces.paired"]}, f["pieces.warps"], (m,))]
        if v == "rows":
            if f["rows.single"]:
                dx = Expect("ln_bwd_single", {
                    "BLOCK_N": f["rows.block"], "ROWS": f["rows.rows"], "VEC": f["rows.vec"],
                    "NEED_DW": False, "NEED_DB": False}, f["rows.warps"],
                    (f["rows.programs"],))
            else:
                dx = Expect("ln_bwd_dx_looped", {"CHUNK": f["rows.block"]}, f["rows.warps"],
                            (m,))
            return [ln_columns_expect(f["columns"]), dx]
        if v == "native":
            return []
        return None
    if v == "fused":
        if f["vec"]:
            progs = min(m, dev.num_sms * f["per_sm"])
            if progs < m:
                progs = progs // f["vec"] * f["vec"]
            return [Expect("rms_bwd_vec", {"BLOCK_N": f["block"], "VEC": f["vec"]},
                           f["warps"], (progs,))]
        progs = min(cdiv(m, f["rows"]), dev.num_sms * f["per_sm"])
        return [Expect("rms_bwd_single", {"BLOCK_N": f["block"], "ROWS": f["rows"],
                                          "ACC_1D": f["acc_1d"], "STAGES": f["stages"]},
                       f["warps"], (progs,))]
    if v == "split":
        c, length = split_pieces(n, f["chunk"], f["vec"])
        clusters = bool(f["cluster"] and not f["vec"] and dev.clusters and c in CLUSTER_SIZES)
        return [Expect("rms_bwd_split", {"BLOCK": next_pow2(length), "C": c,
                                         "PREFETCH": f["prefetch"], "VEC": f["vec"],
                                         "CLUSTER": clusters}, f["warps"], None, clusters,
                       f["maxnreg"])]
    block_c, block_r = rms_rules.COLUMN_TILE
    return [Expect("rms_bwd_dx_looped", {"CHUNK": f["block"]}, f["warps"], (m,)),
            Expect("rms_bwd_dw_columns", {"BLOCK_C": block_c, "BLOCK_R": block_r},
                   rms_rules.COLUMN_WARPS)]


def kernel_fn(launcher: Any) -> Any:
    return getattr(launcher.kernel, "fn", launcher.kernel)


def launch_record(launcher: Any, grid: tuple, args: tuple, warps: int) -> dict[str, Any]:
    """One recorded launch as JSON: kernel, grid (clusters: in clusters, ``programs`` beside
    it), warps, launcher kind and register cap, the non-tensor arguments by name, and on a GPU
    the compiled kernel's registers and spills."""
    fn = kernel_fn(launcher)
    params = dict(zip(inspect.signature(fn).parameters, args, strict=False))
    options = dict(getattr(launcher, "options", {}) or {})
    clustered = isinstance(launcher, ClusterLauncher)
    kind = ("cluster" if clustered else "cooperative"
            if options.get("launch_cooperative_grid") else "plain")
    rec: dict[str, Any] = {
        "kernel": fn.__name__, "grid": list(grid), "num_warps": warps, "launcher": kind,
        "maxnreg": options.get("maxnreg"),
        "args": {k: v for k, v in params.items() if isinstance(v, (bool, int, float))}}
    if clustered:
        rec["programs"] = grid[0] * int(params.get("C", 1))
    if not interpreting():
        try:
            compiled = launcher.kernel.warmup(*args, grid=grid, num_warps=warps, **options)
            compiled._init_handles()
            rec["regs"], rec["spills"] = int(compiled.n_regs), int(compiled.n_spills)
        except Exception as e:  # noqa: BLE001 - an unknown Triton API: left out
            rec["regs_error"] = short_error(e, 1)
    return rec


def check_launches(record: list, expects: list[Expect] | None) -> list[str]:
    """Every way the recorded launches differ from ``expects``."""
    if expects is None:
        return []
    names = [kernel_fn(r[0]).__name__ for r in record]
    if not expects:
        return [f"{len(record)} Triton launches ({', '.join(names)}), expected none"
                ] if record else []
    problems = []
    for e in expects:
        hit = next((r for r in record if kernel_fn(r[0]).__name__ == e.kernel), None)
        if hit is None:
            problems.append(f"no {e.kernel} launch (launched: {', '.join(names) or '-'})")
            continue
        launcher, grid, args, warps = hit
        params = dict(zip(inspect.signature(kernel_fn(launcher)).parameters, args,
                          strict=False))
        bad = {k: (params.get(k), v) for k, v in e.consts.items() if params.get(k) != v}
        if bad:
            problems.append(f"{e.kernel} arguments (got, wanted): {bad}")
        if warps != e.warps:
            problems.append(f"{e.kernel} on {warps} warps, expected {e.warps}")
        if e.grid is not None and tuple(grid) != e.grid:
            problems.append(f"{e.kernel} grid {tuple(grid)}, expected {e.grid}")
        clustered = isinstance(launcher, ClusterLauncher)
        if e.cluster is not None and clustered != e.cluster:
            problems.append(f"{e.kernel} launched {'in' if clustered else 'without'} "
                            f"thread-block clusters, expected {'in' if e.cluster else 'without'}")
        cap = (getattr(launcher, "options", {}) or {}).get("maxnreg")
        if e.cap != "any" and not interpreting() and cap != e.cap:
            problems.append(f"{e.kernel} register cap {cap}, expected {e.cap}")
    return problems


@contextlib.contextmanager
def watched_switches(problems: list[str]) -> Iterator[None]:
    """Run a block with RuntimeWarnings recorded; where a failed launch turned the split-row
    kernels or clusters off, report it in ``problems`` and turn them back on (with every
    cached decision dropped) for what follows."""
    before = (SPLIT_STATE["enabled"], CLUSTER_STATE["enabled"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            problems.extend(f"warning: {w.message}" for w in caught
                            if issubclass(w.category, RuntimeWarning))
            after = (SPLIT_STATE["enabled"], CLUSTER_STATE["enabled"])
            if after != before:
                problems.append(f"split rows / clusters went from {before} to {after} during "
                                "the call (a launch failed); restored")
                SPLIT_STATE["enabled"], CLUSTER_STATE["enabled"] = before
                configs.clear_caches()


def ln_plans_on() -> bool:
    return bool(ln_host.BWD_PLANS)


def plan_state() -> str:
    """LayerNorm's replay plan for the call signature just run (the only one since the
    override's caches were dropped): ``replay``, ``not replayable`` or ``none``."""
    plans = list(ln_host._bwd_plans.values())
    if any(callable(p) for p in plans):
        return "replay"
    return "not replayable" if plans else "none"


@contextlib.contextmanager
def rms_plans_off() -> Iterator[None]:
    """RMSNorm's backward without its replay plans inside the block: a call that makes a
    plan records its launches itself, which hides them from the checked call's recording."""
    plans = rms_host._bwd_plans
    plans.get = lambda key: False  # (False: no plan for this signature, run the rules)
    try:
        yield
    finally:
        del plans.get


def run_checked(op: str, n: int, m: int, elt: int, index: int, want: dict[str, Any],
                fn: Callable[[], tuple]
                ) -> tuple[tuple, list[dict], dict[str, Any], list[str], str | None]:
    """Run ``fn`` once with its launches recorded (replay plans off for it): (the
    gradients, the launches, the host config facts, problems, the replay plan's state after
    a second call with plans on, LayerNorm on a GPU only). Problems: every way the host memo
    of this call's decision or its launches differ from ``want``, and, where the second call
    recorded a replay plan (which promises the same launches), its bits differing from the
    first call's."""
    problems: list[str] = []
    plans = op == "layernorm" and ln_plans_on()
    with watched_switches(problems):
        off = (configs.override("layernorm", BWD_PLANS=False) if plans
               else rms_plans_off() if op == "rmsnorm" else contextlib.nullcontext())
        with off:
            with record_launches() as record:
                grads = fn()
            sync(dev_of(grads))
            cfg, hit = memo_config(op, n, elt, m, index)
            now = device_facts(index)
            got = config_facts(op, cfg, now.num_sms)
            expects = expected_launches(op, got, n, m, now)
            launches = [launch_record(*r) for r in record]
            problems += check_launches(record, expects)
    if not hit:
        problems.append("the host memo held no decision for this call's signature")
    wrong = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
    if wrong:
        problems.append(f"host config {label_of(op, got)} differs "
                        f"(got, wanted): {wrong}")
    state = None
    if plans:
        with watched_switches(problems):
            again = fn()
            sync(dev_of(again))
        state = plan_state()
        if state == "replay" and not all(a is None and b is None or torch.equal(a, b)
                                         for a, b in zip(grads, again, strict=True)):
            problems.append("the second call (its replay plan recorded) gave other bits "
                            "than the first")
        del again
    return grads, launches, got, problems, state


def dev_of(grads: tuple) -> torch.device:
    return next(g.device for g in grads if g is not None)


def compare(grads: tuple, ref: tuple, tol: dict[str, float]) -> tuple[float, list[str]]:
    """(largest absolute difference, problems) of gradients against the reference's."""
    diff, problems = 0.0, []
    for name, g, r in zip(("dx", "dweight", "dbias"), grads, ref, strict=False):
        if g is None or r is None:
            if (g is None) != (r is None):
                problems.append(f"{name}: {'missing' if g is None else 'unexpected'}")
            continue
        d = (g.float() - r.float()).abs().max().item() if g.numel() else 0.0
        diff = max(diff, d)
        try:
            torch.testing.assert_close(g, r, **tol)
        except AssertionError as e:
            problems.append(f"{name} differs from the current rules' (max abs diff {d:.3g}): "
                            f"{short_error(e, 4)}")
    return diff, problems


# ------------------------------------------------------------------------------ running


def norm_fn(op: str, fused: bool) -> Callable[..., torch.Tensor]:
    """``f(x, w, b)``: the op over x's last dim, fusedops' (``fused``) or torch's."""
    if op == "layernorm":
        layer_norm = fusedops.fused_layernorm if fused else F.layer_norm
        return lambda x, w, b: layer_norm(x, (x.shape[-1],), w, b, EPS)
    rms_norm = fusedops.fused_rmsnorm if fused else F.rms_norm
    return lambda x, w, b: rms_norm(x, (x.shape[-1],), w, EPS)


def bytes_moved(op: str, m: int, n: int, elt: int) -> int:
    return 3 * m * n * elt + PARAMS[op] * n * elt + STATS_BYTES[op] * m


def run_case(case: Case, args: argparse.Namespace, device: torch.device, index: int,
             phases: dict[str, float], deadline: float) -> list[dict]:
    op, n, m = case.op, case.n, case.m
    dtype = DTYPES[case.dtype]
    elt = dtype.itemsize
    tol = TOLERANCES[case.dtype]
    g = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(m, n, device=device, dtype=dtype, generator=g)
    dy = torch.randn(m, n, device=device, dtype=dtype, generator=g)
    w = (1 + 0.1 * torch.randn(n, device=device, generator=g)).to(dtype)
    b = (0.1 * torch.randn(n, device=device, generator=g)).to(dtype) if op == "layernorm" \
        else None
    nbytes = bytes_moved(op, m, n, elt)
    if op == "layernorm":
        _, mean, rstd = backend.layernorm_forward(x, w, b, EPS, dtype)

        def entry() -> tuple:
            return backend.layernorm_backward(dy, x, w, mean, rstd, True, True, True,
                                              grad_dtypes=(dtype, dtype))
    else:
        _, rstd = backend.rmsnorm_forward(x, w, EPS, dtype)

        def entry() -> tuple:
            return backend.rmsnorm_backward(dy, x, w, rstd, True, True, grad_dtypes=(dtype,))
    records = Records({"op": op, "dtype": case.dtype, "N": n, "M": m}, 3 * m * n * elt, nbytes)
    record = records.add

    def timed(fn: Callable[[], object], checked_ms: float | None = None) -> float:
        if args.smoke and checked_ms is not None:  # the checked call was the one call
            return checked_ms
        return bench_ms(fn, args, phases)

    src = torch.empty(3 * m * n // 2, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    record("copy", "dst.copy_(src), 1.5·M·N elements each", ms=timed(lambda: dst.copy_(src)))
    del src, dst
    inputs = (x, w, b) if op == "layernorm" else (x, w)

    def autograd_timing(make: Callable[..., torch.Tensor]) -> tuple[float, tuple, float]:
        """(ms, gradients, first forward+backward s) of autograd.grad through ``make``."""
        leaves = tuple(t.detach().requires_grad_() for t in inputs)
        start = time.perf_counter()
        with torch.enable_grad():
            y = make(*leaves, *(() if op == "layernorm" else (None,)))
            grads = torch.autograd.grad(y, leaves, dy, retain_graph=True)
            sync(device)
            first = time.perf_counter() - start
            ms = timed(lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True))
        del y
        return ms, grads, first

    ms, eager_grads, _ = autograd_timing(norm_fn(op, False))
    record("torch", "eager autograd.grad", ms=ms)

    # The current rules: checked like a candidate (the memo, the launches); their gradients
    # are the reference of every candidate (kept where a check fails: status "unverified").
    configs.clear_caches()
    start = time.perf_counter()
    ref = None
    try:
        ref, launches, got, problems, state = run_checked(op, n, m, elt, index, case.current,
                                                          entry)
        checked_ms = (time.perf_counter() - start) * 1e3
        phases["first calls"] += time.perf_counter() - start
        diff, _ = compare(eager_grads, ref, tol)
        record("current", label_of(op, got),
               status="unverified" if problems else "ok", error="; ".join(problems) or None,
               ms=timed(entry, checked_ms), launches=launches, config=got, plan=state,
               max_abs_diff_eager=diff)
    except Exception as e:
        record("current", label_of(op, case.current), status="failed",
               error=short_error(e), config=case.current)
    del eager_grads
    try:
        ms, grads, first = autograd_timing(norm_fn(op, True))
        phases["first calls"] += first
        diff, problems = compare(grads, ref, tol) if ref is not None else (None, [])
        del grads
        record("current (autograd)", "fusedops autograd.grad", ms=ms,
               status="unverified" if problems else "ok", error="; ".join(problems) or None,
               max_abs_diff_current=diff)
    except Exception as e:
        record("current (autograd)", "fusedops autograd.grad", status="failed",
               error=short_error(e))

    if args.compile:
        torch._dynamo.reset()  # a fresh compile per shape: no shared cache, no dynamic shapes
        compiled = torch.compile(norm_fn(op, False), dynamic=False,
                                 backend="eager" if args.smoke else "inductor")
        try:
            ms, grads, first = autograd_timing(compiled)
            phases["torch.compile"] += first
            diff, _ = compare(grads, ref, tol) if ref is not None else (None, [])
            del grads
            record("compile", "torch.compile(dynamic=False) autograd.grad" + (
                ", backend='eager'" if args.smoke else ""), ms=ms, compile_s=first,
                max_abs_diff_current=diff)
        except Exception as e:
            record("compile", "torch.compile(dynamic=False)", status="failed",
                   error=short_error(e))
        del compiled

    for cand in case.candidates:
        base = candidate_fields(cand)
        if cand.status == "planned" and time.time() > deadline:
            cand.status = "left out (--budget-s)"
        if not_runnable(cand, ref, record, base):
            continue
        start = time.perf_counter()
        try:
            with cand.applied():
                grads, launches, got, problems, state = run_checked(
                    op, n, m, elt, index, cand.facts, entry)
                checked_ms = (time.perf_counter() - start) * 1e3
                phases["first calls"] += time.perf_counter() - start
                diff, bad = compare(grads, ref, tol)
                problems += bad
                del grads
                if problems:  # failed: recorded and reported, not timed
                    record("candidate", cand.label, status="failed",
                           error="; ".join(problems), launches=launches, config=got,
                           plan=state, max_abs_diff_current=diff, **base)
                    continue
                ms = timed(entry, checked_ms)
            record("candidate", cand.label, ms=ms, launches=launches, config=got, plan=state,
                   max_abs_diff_current=diff, **base)
        except Exception as e:  # raised (compile error, launch refused...): failed
            record("candidate", cand.label, status="failed", error=short_error(e), **base)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if ref is not None and not args.no_repeat and not args.smoke:
        records.append({**next(r for r in records if r["provider"] == "current"),
                        "provider": "current (again)", "ms": timed(entry)})
        r = records[-1]
        r["tbps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e12
    copy_tbps = records[0]["tbps"]
    for r in records:
        if r["tbps"]:
            r["frac_copy"] = r["tbps"] / copy_tbps
        if isinstance(r.get("config"), dict):
            r["config"] = {k: list(v) if isinstance(v, tuple) else v
                           for k, v in r["config"].items()}
    del x, dy, w, b, ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return records


def print_plan(cases: list[Case]) -> None:
    for case in cases:
        print(f"{case.op} {case.dtype} N={case.n} M={case.m}: current "
              f"{label_of(case.op, case.current)}")
        for c in case.candidates:
            state = "" if c.status == "planned" else f"   [{c.status}]"
            print(f"    {c.label:44} {c.override}{state}")
            if c.error and c.status != "skipped (GPU only)":
                print(f"        {c.error}")


def estimate(cases: list[Case], args: argparse.Namespace) -> tuple[int, int, float]:
    """(timed candidates, Triton kernels to compile, estimated seconds) of a GPU run."""
    live = [c for case in cases for c in case.candidates if c.status == "planned"]
    kernels = sum(c.kernels for c in live) + sum(
        KERNELS_PER_PATH.get(case.current["variant"], 2) for case in cases)
    per_case = 4 + (0 if args.no_repeat else 1) + (1 if args.compile else 0)
    secs = (COST_SETUP + (len(live) + per_case * len(cases)) * COST_TIMING
            * (args.warmup + args.rep) / 125 + len(live) * COST_CHECK
            + len(cases) * COST_CASE + kernels * COST_TRITON_COMPILE
            + (len(cases) * COST_TORCH_COMPILE if args.compile else 0))
    return len(live), kernels, secs


def write(path: str, meta: dict, summary: list[dict], records: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "summary": summary, "records": records}, f, indent=1,
                  default=repr)


def smoke_rows(op: str, n: int, elt: int, sms: int) -> int:
    """Rows of a smoke case: SMOKE_ROWS, or for LayerNorm rows whose aligned body takes the
    fused kernel the fewest (a power of two) that let its grid be a multiple of VEC programs
    (at most max_partial_rows of them: M / 32 for 16-bit rows), as at the GPU's M."""
    vec = unaligned_vec(n, (n, n, n), elt)
    if op == "layernorm" and vec:
        m = SMOKE_ROWS
        while m <= 4096:
            plan = ln_rules.fused_plan(m, n, elt, vec, sms)
            if plan is not None and plan[0]:
                return m
            m *= 2
    return SMOKE_ROWS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="norm_backward.json", help="JSON output (default %(default)s)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--dtypes", nargs="+", type=dtype_name, default=["bf16"],
                   help="bf16 / fp16 (default bf16)")
    p.add_argument("--sizes", nargs="+", type=int,
                   help=f"row lengths N (default {' '.join(map(str, SIZES))}; --smoke: "
                        f"{' '.join(map(str, SMOKE_SIZES))})")
    p.add_argument("--max-candidates", type=int, default=10,
                   help="timed candidates per case at most (default %(default)s; 0: no limit)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="time torch.compile's backward too (default: --no-compile)")
    p.add_argument("--no-repeat", action="store_true",
                   help="time the current rules once (not again after the candidates)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms (default 25)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms (default 100)")
    p.add_argument("--budget-s", type=float,
                   help="the run's time budget, shared by the cases in order: a case starts "
                        f"no candidate past its share (default {BUDGET_S:.0f}, --smoke: no "
                        "limit; 0: no limit)")
    p.add_argument("--list", action="store_true", help="print the plan and the estimate, exit")
    p.add_argument("--smoke", action="store_true",
                   help="CPU tensors under TRITON_INTERPRET=1, small sizes, one call per timing")
    args = p.parse_args()

    device, index, assumed = pick_device(args, "norm_backward.py")
    def facts_now() -> DeviceFacts:
        return assumed_gpu() if assumed else device_facts(index)

    dev = facts_now()
    sizes = args.sizes or list(SMOKE_SIZES if args.smoke else SIZES)
    limit = args.max_candidates or None

    cases = []
    for op in args.ops:
        for dt in args.dtypes:
            elt = DTYPES[dt].itemsize
            for n in sizes:
                m = smoke_rows(op, n, elt, dev.num_sms) if args.smoke else TOTAL_ELEMENTS // n
                cases.append(plan_case(op, dt, n, m, facts_now, limit))
    n_live, n_kernels, secs = estimate(cases, args)
    if args.list:
        if assumed:
            print(f"(no GPU here: the plan of a GPU the rules see as {ASSUMED_GPU})")
        print_plan(cases)
    skipped = [(case, c) for case in cases for c in case.candidates
               if c.status == "skipped (GPU only)"]
    if skipped and not args.list:
        print(f"{len(skipped)} candidates skipped here (they stay in the GPU plan):")
        for case, c in skipped:
            print(f"    {case.op} {case.n}: {c.label}: {c.error}")
    print(f"{len(cases)} cases, {n_live} candidates to time, about {n_kernels} Triton kernel "
          f"specialisations to compile; a GPU run takes about {secs:.0f} s (assumed: "
          f"{COST_TIMING} s per timing, {COST_TRITON_COMPILE} s per compile, {COST_CHECK} s per "
          f"check, {COST_CASE} s per case"
          + (f", {COST_TORCH_COMPILE} s per torch.compile" if args.compile else "") + ")",
          flush=True)
    if args.list:
        return

    budget = args.budget_s if args.budget_s is not None else 0 if args.smoke else BUDGET_S
    start = time.time()
    phases = {"timing": 0.0, "first calls": 0.0, "torch.compile": 0.0}
    records: list[dict] = []
    summary: list[dict] = []
    meta = environment(device, dev, args)
    meta.update(tolerance=TOLERANCES, layernorm_backward_mode=fusedops.get_layernorm_backward(),
                bytes_model={"layernorm": "3*M*N*elt + 3*N*welt + 8*M",
                             "rmsnorm": "3*M*N*elt + 2*N*welt + 4*M",
                             "copy": "3*M*N*elt (1.5*M*N elements read and written)"},
                timed_call={"layernorm": "fusedops.backends.triton.layernorm_backward(dy, x, w, "
                                         "mean, rstd, True, True, True, grad_dtypes=(dt, dt))",
                            "rmsnorm": "fusedops.backends.triton.rmsnorm_backward(dy, x, w, "
                                       "rstd, True, True, grad_dtypes=(dt,))"},
                max_candidates=limit, budget_s=budget, estimate_s=secs, complete=False)
    for i, case in enumerate(cases):
        # the budget shared by the cases in order: a case may use what earlier ones left
        deadline = start + budget * (i + 1) / len(cases) if budget else float("inf")
        rows = run_case(case, args, device, index, phases, deadline)
        records += rows
        s = summarize(rows)
        summary.append(s)
        print(f"[{time.time() - start:5.0f} s] {case.op} {case.dtype} {case.n}: current "
              f"{fmt(s['current_frac'])} ({s['current']}), torch {fmt(s['eager_frac'])}, best "
              f"{fmt(s['best_frac'])} ({s['best']}); "
              + ", ".join(f"{v} {k}" for k, v in sorted(s["candidates"].items())), flush=True)
        for r in rows:
            if r["status"] in ("failed", "unverified"):
                print(f"        {r['status'].upper()} {r['provider']} {r['label']}: "
                      + r["error"].replace("\n", "\n            "), flush=True)
        meta.update(elapsed_s=time.time() - start, phase_s=phases)
        write(args.out, meta, summary, records)
    elapsed = time.time() - start
    fusedops.set_backend(None)
    meta.update(elapsed_s=elapsed, phase_s=phases, complete=True)
    write(args.out, meta, summary, records)

    print(f"\n{meta['device']}, torch {meta['torch']}, Triton {meta['triton']}, fusedops "
          f"{meta['fusedops']} ({meta['git']}), LayerNorm backward mode "
          f"{meta['layernorm_backward_mode']}"
          + ("  [smoke: interpreter, times meaningless]" if args.smoke else ""))
    print("fraction of copy bandwidth (same case's copy of 3·M·N·elt bytes); current: first / "
          "again; autograd: current through torch.autograd.grad")
    print(f"{'op':9} {'dtype':5} {'N':>6} {'copy':>6} {'current':>13} {'autograd':>8} "
          f"{'torch':>5} {'compile':>7} {'best':>6} {'x cur':>5}  candidate / override  "
          "[current config]")
    for s in summary:
        ratio = (f"{s['best_frac'] / s['current_frac']:5.3f}"
                 if s["best_frac"] and s["current_frac"] else "  -  ")
        print(f"{s['op']:9} {s['dtype']:5} {s['N']:>6} {fmt(s['copy_tbps']):>6} "
              f"{fmt(s['current_frac'])}/{fmt(s['current_again_frac'])} "
              f"{fmt(s['autograd_frac']):>8} {fmt(s['eager_frac']):>5} "
              f"{fmt(s['compile_frac']):>7} {fmt(s['best_frac']):>6} {ratio}  "
              f"{s['best'] or '-'}: {s['best_override'] or '-'}  [{s['current'] or '-'}]")
    failed = [r for r in records if r["status"] == "failed"]
    left = sum(1 for r in records if r["status"].startswith("left out"))
    print(f"\n{len(failed)} failed ({', '.join(sorted({r['provider'] for r in failed})) or '-'}), "
          f"{left} left out; elapsed {elapsed:.0f} s (estimate {secs:.0f} s; timing "
          f"{phases['timing']:.0f} s, first calls and checks {phases['first calls']:.0f} s, "
          f"torch.compile {phases['torch.compile']:.0f} s); wrote {args.out}")


if __name__ == "__main__":
    main()
