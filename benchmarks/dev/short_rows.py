"""16-bit forward kernels on short, non-power-of-two rows (and RMSNorm's long rows): the current
launch rules against candidate launch configurations forced through ``configs.override``, in
one run.

    PYTHONPATH=$PWD python benchmarks/dev/short_rows.py                  # writes short_rows.json
    PYTHONPATH=$PWD python benchmarks/dev/short_rows.py --ops layernorm --dtypes bf16 --sizes 768
    PYTHONPATH=$PWD python benchmarks/dev/short_rows.py --list           # the plan only, no timing
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/dev/short_rows.py --smoke

Ops: LayerNorm forward (weight and bias in x's dtype), RMSNorm forward (weight in x's dtype) and
softmax forward, all inference calls (``torch.no_grad``), on bf16 and fp16 rows of the hidden
sizes models use (default N = 768, 1536, 2560, 3072, 3584, 5120, 6144) with M = 2^27 // N
rows, so every tensor is far larger than L2. For each (op, dtype, N) it times, with
``triton.testing.do_bench`` (median, L2 flushed between calls; ``--warmup`` / ``--rep``):

* ``copy``: ``y.copy_(x)``, the bandwidth reference of the same run;
* ``torch``: eager ``F.layer_norm`` / ``F.rms_norm`` / ``torch.softmax``;
* ``compile``: the same under ``torch.compile(dynamic=False)``, compiled once per shape;
* ``current``: ``fusedops.fused_*`` with the shipped rules (timed first and again last, a
  drift check);
* ``candidate``: ``fusedops.fused_*`` under each candidate's override, named by the exact
  ``configs.override(...)`` calls it applies:

  - the unrolled kernel (``ln_fwd_unrolled`` / ``rms_fwd_unrolled`` / ``softmax_fwd_unrolled``,
    N and the chunk compile-time, no masked lanes): a one-entry ``UNROLLED_FWD`` table with the
    two largest power-of-two chunks dividing N (at most 16 chunks per row), the larger on the
    warps that give a thread one and half a 16-byte vector per chunk, the smaller on one vector
    (one warp at least: 128 x 1 at N = 768) (LayerNorm adds ``UNROLLED_FWD_GPU={}`` where the GPU's own table holds the key, softmax
    lowers ``UNROLLED_FWD_ABOVE`` below N where needed);
  - the reload kernel (LayerNorm / softmax, padded rows of at most 2048): ``RELOAD_FWD`` with the
    padded row read whole on one warp per 1024 elements, written back in quarter-row chunks
    (``RELOAD_FWD_ABOVE`` lowered, unrolled rules emptied where they would take the row);
  - RMSNorm's cluster split forward (``rms_fwd_split`` with CLUSTER, aligned rows of 16K and
    more on a GPU that runs clusters): a one-entry ``CLUSTER_FWD`` table per
    :func:`cluster_configs` (its launch checked for the kernel, C, PREFETCH and CLUSTER; its
    grid, the clusters the GPU holds at once, is not);
  - the single-block kernel, where it is what the current rules run: 1, 2 and 4 rows per
    program on the warps that give a thread 32 elements of the padded row (RMSNorm through its
    ``FWD_RULES`` table; LayerNorm and softmax through ``configs.common.row_config`` pinned for
    that kind and padded row by :class:`PinRowConfig`, whose table counterpart is
    ``_SHORT_16BIT`` for padded rows up to 1024, ``_tile_elems`` / ``_warps_for`` above);
  - softmax's single-block forward with the next row prefetched (aligned rows of 4K up to the
    single-block cap): a one-entry ``NEXT_FWD`` table per (warps, programs per SM) of
    ``NEXT_CONFIGS``, on a persistent grid; where the rules hold a ``NEXT_FWD`` entry for the
    row, the other candidates clear it.

  A candidate whose rules give the current configuration is listed as ``same as current`` and
  not timed. Before a candidate is timed, its first call runs with its launches recorded
  (``runtime.recording.record_launches``): the host's memo of the decision for that very call
  signature (``_fwd_config``, read back as a cache hit) must hold the candidate's variant and
  parameters, the one launch must be the variant's kernel with the expected constexprs
  (``N``/``CHUNK``, ``BLOCK_N``/``ROWS``, ``BLOCK_N``/``WHOLE`` and ``CHUNK``), warps and grid,
  and the output must match the current rules' output (``torch.testing.assert_close``, bf16
  tolerances: rtol 1.6e-2, atol 1e-5). A candidate that fails any of this, or raises, is
  recorded and reported as failed, with the reason, and not timed.

TB/s = bytes / time with bytes = read x + write y + the weights (LayerNorm 2·M·N·elt + 2·N·elt,
RMSNorm 2·M·N·elt + N·elt, softmax 2·M·N·elt; copy 2·M·N·elt), and each provider's fraction of
the same case's copy TB/s. ``--out`` (default ``short_rows.json``) gets every record (launch
facts, host config, override, times), the environment and a per-case summary; a table of the
fraction of copy for current, compile and the best candidate (with its override) is printed
last. The defaults are sized for about 3-4 minutes on an H100 or H200 (the plan and an
estimate are printed first, elapsed seconds per case as it goes; ``--ops``, ``--sizes``,
``--max-candidates`` and ``--no-compile`` shorten it).

``--smoke`` runs everything on CPU tensors through the Triton interpreter (the environment must
set ``TRITON_INTERPRET=1`` before Triton is imported) at M = 4 rows, each timing replaced by one
call, ``torch.compile`` on its ``eager`` backend: it checks the script, the overrides and the
forced variants, not speed. Needs a CUDA GPU otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import fusedops
from fusedops.backends.triton import configs
from fusedops.backends.triton import layernorm as ln_host
from fusedops.backends.triton import rmsnorm as rms_host
from fusedops.backends.triton import softmax as sm_host
from fusedops.backends.triton.configs import common as common_rules
from fusedops.backends.triton.configs import layernorm as ln_rules
from fusedops.backends.triton.configs import rmsnorm as rms_rules
from fusedops.backends.triton.configs import softmax as sm_rules
from fusedops.backends.triton.runtime.clusters import CLUSTER_SIZES
from fusedops.backends.triton.runtime.device import cdiv, interpreting, next_pow2
from fusedops.backends.triton.runtime.facts import DeviceFacts, device_facts
from fusedops.backends.triton.runtime.recording import record_launches

OPS = ("layernorm", "rmsnorm", "softmax")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
SIZES = (768, 1536, 2560, 3072, 3584, 5120, 6144)
TOTAL_ELEMENTS = 1 << 27
SMOKE_ROWS = 4
EPS = 1e-5
TOLERANCE = {"rtol": 1.6e-2, "atol": 1e-5}  # torch.testing's bf16 defaults, for both dtypes
CHUNKS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
MAX_CHUNKS_PER_ROW = 16
SINGLE_ELEMS_PER_THREAD = 32
RELOAD_MAX_BLOCK = 2048
WEIGHTS = {"layernorm": 2, "rmsnorm": 1, "softmax": 0}  # (N,) parameters read per call
KERNELS = {
    ("layernorm", "unrolled"): "ln_fwd_unrolled", ("layernorm", "reload"): "ln_fwd_reload",
    ("layernorm", "single"): "ln_fwd_single",
    ("rmsnorm", "unrolled"): "rms_fwd_unrolled", ("rmsnorm", "single"): "rms_fwd_single",
    ("rmsnorm", "split"): "rms_fwd_split",
    ("softmax", "unrolled"): "softmax_fwd_unrolled", ("softmax", "reload"): "softmax_fwd_reload",
    ("softmax", "single"): "softmax_fwd_single",
}
# Rough costs behind the printed estimate (seconds): one do_bench at the default warmup/rep on a
# ~0.13 ms kernel, a Triton compile on a GPU host, an Inductor compile of one static shape.
COST_TIMING, COST_TRITON_COMPILE, COST_TORCH_COMPILE, COST_SETUP = 0.15, 0.35, 1.5, 15.0


class PinRowConfig:
    """``configs.common.row_config`` with one (kernel kind, padded row) pinned to the
    single-block kernel on ``rows`` rows per program and ``warps`` warps; every other question
    is answered by the rule in force when this was made."""

    def __init__(self, kind: str, block: int, rows: int, warps: int) -> None:
        self.kind, self.block, self.rows, self.warps = kind, block, rows, warps
        self.rule = common_rules.row_config

    def __call__(self, n: int, kind: str, elt_size: int = 2) -> tuple[bool, int, int, int]:
        if kind == self.kind and next_pow2(n) == self.block:
            return True, self.block, self.rows, self.warps
        return self.rule(n, kind, elt_size)

    def __repr__(self) -> str:
        return (f"PinRowConfig({self.kind!r}, {self.block}, rows={self.rows}, "
                f"warps={self.warps})")


@dataclass
class Candidate:
    """A launch configuration forced through ``configs.override``: ``rules`` is the list of
    (op, rules) pairs given to it, ``facts`` the variant and parameters the host config must
    then hold, ``hint`` where the winner would go in the rules modules."""

    label: str
    facts: dict[str, Any]
    rules: list[tuple[str, dict[str, Any]]]
    hint: str
    status: str = "planned"  # planned | same as current | failed (at planning)
    error: str | None = None

    @property
    def override(self) -> str:
        return "; ".join(
            f"configs.override({op!r}, " + ", ".join(f"{k}={v!r}" for k, v in rules.items())
            + ")" for op, rules in self.rules)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for op, rules in self.rules:
                stack.enter_context(configs.override(op, **rules))
            yield


@dataclass
class Case:
    """One (op, dtype, N): the current rules' configuration and the candidates."""

    op: str
    dtype: str
    n: int
    m: int
    current: dict[str, Any]
    candidates: list[Candidate] = field(default_factory=list)


# ------------------------------------------------------------------------------ the rules


def config_facts(op: str, cfg: Any) -> dict[str, Any]:
    """The variant and launch parameters of a host config (any op's NamedTuple)."""
    facts = {"variant": cfg.kernel if op == "rmsnorm" else cfg.variant, "warps": cfg.warps,
             "block": cfg.block or getattr(cfg, "whole", 0), "rows": cfg.rows,
             "chunk": cfg.chunk}
    if op == "rmsnorm":  # (its split rows: PREFETCH and clusters)
        facts.update(prefetch=cfg.prefetch, cluster=cfg.cluster)
    if op == "softmax" and cfg.next:  # (the next tile prefetched, on a persistent grid)
        facts.update(next=cfg.next, programs=cfg.grid)
    return facts


def rules_config(op: str, n: int, elt: int, m: int, dev: DeviceFacts) -> Any:
    """What the rules in force decide for an inference call on aligned contiguous rows."""
    if op == "layernorm":
        return ln_rules.forward_config(n, elt, 0, m, False, True, dev)
    if op == "rmsnorm":
        return rms_rules.forward_config(n, elt, 0, True, dev,
                                        m * n >= rms_rules.SHIFTED_W_MIN_ELEMS)
    return sm_rules.forward_config(n, elt, 0, m, dev)


def memo_config(op: str, n: int, elt: int, m: int, index: int) -> tuple[Any, bool]:
    """The host's memoized decision for the call signature just run, and whether it was read
    from the memo (a cache hit, so the very entry that call used)."""
    if op == "layernorm":
        fn, args = ln_host._fwd_config, (n, elt, 0, m, False, True, index)
    elif op == "rmsnorm":
        fn, args = rms_host._fwd_config, (n, elt, 0, True, index,
                                          m * n >= rms_rules.SHIFTED_W_MIN_ELEMS)
    else:
        fn, args = sm_host._fwd_config, (n, elt, 0, m, index)
    hits = fn.cache_info().hits
    cfg = fn(*args)
    return cfg, fn.cache_info().hits == hits + 1


def label_of(facts: dict[str, Any]) -> str:
    v = facts["variant"]
    if v == "unrolled":
        return f"unrolled {facts['chunk']}x{facts['warps']}"
    if v == "single":
        rows, warps = facts["rows"], facts["warps"]
        nxt = f", next tile prefetched, {facts['programs']} programs" if facts.get("next") else ""
        return (f"single {facts['block']}: {rows} row{'s' * (rows > 1)} x {warps} "
                f"warp{'s' * (warps > 1)}{nxt}")
    if v == "reload":
        return f"reload {facts['block']}, {facts['chunk']}x{facts['warps']}"
    if v == "split":
        kind = "cluster split" if facts.get("cluster") else "split"
        return f"{kind} {facts['chunk']}x{facts['warps']} pf{facts.get('prefetch')}"
    return f"{v} block {facts['block']} chunk {facts['chunk']} x {facts['warps']}"


def unrolled_configs(n: int, elt: int) -> list[tuple[int, int]]:
    """(chunk, warps): the two largest power-of-two chunks dividing ``n`` (at most 16 per row),
    the larger on one and on half a 16-byte vector per thread, the smaller on one vector (one
    warp at least)."""
    vec = 16 // elt
    chunks = [c for c in reversed(CHUNKS) if n % c == 0 and n // c <= MAX_CHUNKS_PER_ROW][:2]
    out: list[tuple[int, int]] = []
    for i, c in enumerate(chunks):
        for per_thread in ((vec, vec // 2) if i == 0 else (vec,)):
            warps = max(1, c // (32 * per_thread))
            if warps <= 32 and (c, warps) not in out:
                out.append((c, warps))
    return out


def single_configs(block: int) -> list[tuple[int, int]]:
    """(rows, warps) of the single-block kernel: 1, 2, 4 rows per program, each thread holding
    32 elements of the padded rows, 1-16 warps."""
    out = []
    for rows in (1, 2, 4):
        warps = rows * block // (32 * SINGLE_ELEMS_PER_THREAD)
        if 1 <= warps <= 16:
            out.append((rows, warps))
    return out


def single_hint(kind: str, block: int, rows: int, warps: int) -> str:
    if block <= 1024:
        return (f"configs/common.py _SHORT_16BIT[{kind!r}][{max(block, 256)}] = "
                f"({rows * block}, {warps})")
    return (f"configs/common.py row_config({kind!r}) at padded {block}: ROWS {rows}, "
            f"{warps} warps (_tile_elems / _warps_for)")


def layernorm_candidates(n: int, elt: int, current: dict, dev: DeviceFacts) -> list[Candidate]:
    block = next_pow2(n)
    key = (elt, block)
    gpu_table = ln_rules.unrolled_fwd_table(dev.name, key) is not ln_rules.UNROLLED_FWD
    no_gpu_table = {"UNROLLED_FWD_GPU": {}} if gpu_table else {}
    out = []
    for chunk, warps in unrolled_configs(n, elt):
        out.append(Candidate(
            f"unrolled {chunk}x{warps}", {"variant": "unrolled", "chunk": chunk, "warps": warps},
            [("layernorm", {"UNROLLED_FWD": {key: ((chunk, warps),)}, **no_gpu_table})],
            f"layernorm UNROLLED_FWD[{key}]: ({chunk}, {warps}) the first config whose chunk "
            f"divides {n}" + (" (and in UNROLLED_FWD_GPU)" if gpu_table else "")))
    unset = {"UNROLLED_FWD": {}, **no_gpu_table} if current["variant"] == "unrolled" else {}
    out += reload_candidates("layernorm", n, elt, block, ln_rules.RELOAD_FWD_ABOVE, unset)
    out += single_candidates("ln_fwd", block, current)
    return out


def reload_candidates(op: str, n: int, elt: int, block: int, above: int,
                      unset: dict[str, Any]) -> list[Candidate]:
    """The reload kernel on a quarter-row chunk (rows up to RELOAD_MAX_BLOCK), with ``unset``
    (rules that would take the row first) cleared."""
    if block > RELOAD_MAX_BLOCK:
        return []
    key = (elt, block)
    chunk, warps = block // 4, max(1, block // 1024)
    rules: dict[str, Any] = {**unset, "RELOAD_FWD": {key: (chunk, warps)}}
    if n <= above:
        rules["RELOAD_FWD_ABOVE"] = block // 2
    return [Candidate(
        f"reload {block}, {chunk}x{warps}",
        {"variant": "reload", "block": block, "chunk": chunk, "warps": warps},
        [(op, rules)], f"{op} RELOAD_FWD[{key}] = ({chunk}, {warps}), RELOAD_FWD_ABOVE below {n}")]


def single_candidates(kind: str, block: int, current: dict) -> list[Candidate]:
    """The single-block kernel pinned to each rows/warps pair, where it is the current choice."""
    if current["variant"] != "single":
        return []
    out = []
    for rows, warps in single_configs(block):
        facts = {"variant": "single", "block": block, "rows": rows, "warps": warps}
        out.append(Candidate(
            label_of(facts), facts,
            [("common", {"row_config": PinRowConfig(kind, block, rows, warps)})],
            single_hint(kind, block, rows, warps)))
    return out


def cluster_configs(n: int) -> list[tuple[int, int, int]]:
    """(piece, warps, PREFETCH) of the cluster split forward for aligned rows of ``n``: pieces
    of 4K-32K making 2-16 per row, on 16 and 8 warps (32K: 16, 4K: also 4), the next row
    prefetched before (1) or after (3) the exchange."""
    out = []
    for piece in (32768, 16384, 8192, 4096):
        if n % piece or n // piece not in CLUSTER_SIZES:
            continue
        for warps in {32768: (16,), 4096: (16, 8, 4)}.get(piece, (16, 8)):
            for prefetch in (1, 3):
                out.append((piece, warps, prefetch))
    return out


def rmsnorm_candidates(n: int, elt: int, current: dict, dev: DeviceFacts) -> list[Candidate]:
    block = next_pow2(n)
    key = (elt, block)
    out = []
    if current.get("cluster"):  # the rules without clusters (the unrolled kernel, mostly)
        out.append(Candidate(
            "rules without clusters", {"cluster": False},
            [("rmsnorm", {"CLUSTER_FWD": {}})], "rmsnorm CLUSTER_FWD = {}"))
    if dev.clusters and n >= 16384 and n % 16 == 0:
        for piece, warps, prefetch in cluster_configs(n):
            facts = {"variant": "split", "chunk": piece, "warps": warps, "prefetch": prefetch,
                     "cluster": True}
            out.append(Candidate(
                label_of(facts), facts,
                [("rmsnorm", {"CLUSTER_FWD": {elt: ((n, n, (piece, warps, prefetch)),)}})],
                f"rmsnorm CLUSTER_FWD[{elt}] = (({n}, {n}, ({piece}, {warps}, {prefetch})),)"))
    for chunk, warps in unrolled_configs(n, elt):
        out.append(Candidate(
            f"unrolled {chunk}x{warps}", {"variant": "unrolled", "chunk": chunk, "warps": warps},
            [("rmsnorm", {"UNROLLED_FWD": {key: ((chunk, warps),)}})],
            f"rmsnorm UNROLLED_FWD[{key}]: ({chunk}, {warps}) the first config whose chunk "
            f"divides {n}"))
    if current["variant"] == "single":
        for rows, warps in single_configs(block):
            facts = {"variant": "single", "block": block, "rows": rows, "warps": warps}
            if n % 16 == 0:  # FWD_RULES holds for such rows only
                out.append(Candidate(
                    label_of(facts), facts,
                    [("rmsnorm", {"FWD_RULES": {key: (rows, warps, False)}})],
                    f"rmsnorm FWD_RULES[{key}] = ({rows}, {warps}, False)"))
            else:
                out.append(Candidate(
                    label_of(facts), facts,
                    [("common", {"row_config": PinRowConfig("ln_fwd", block, rows, warps)})],
                    single_hint("ln_fwd", block, rows, warps)))
    return out


def softmax_candidates(n: int, elt: int, current: dict, dev: DeviceFacts) -> list[Candidate]:
    block = next_pow2(n)
    key = (elt, block)
    out = []
    for chunk, warps in unrolled_configs(n, elt):
        rules: dict[str, Any] = {"UNROLLED_FWD": {key: ((chunk, warps),)}}
        if n <= sm_rules.UNROLLED_FWD_ABOVE:
            rules["UNROLLED_FWD_ABOVE"] = block // 2
        out.append(Candidate(
            f"unrolled {chunk}x{warps}", {"variant": "unrolled", "chunk": chunk, "warps": warps},
            [("softmax", rules)],
            f"softmax UNROLLED_FWD[{key}]: ({chunk}, {warps}) the first config whose chunk "
            f"divides {n}" + (", UNROLLED_FWD_ABOVE below it" if n <= sm_rules.UNROLLED_FWD_ABOVE
                              else "")))
    unset = {"UNROLLED_FWD": {}} if current["variant"] == "unrolled" else {}
    out += reload_candidates("softmax", n, elt, block, sm_rules.RELOAD_FWD_ABOVE, unset)
    out += single_candidates("softmax_fwd", block, current)
    if current.get("next"):  # (NEXT_FWD takes a row before the rules these candidates set)
        for cand in out:
            cand.rules.append(("softmax", {"NEXT_FWD": {}}))
    out += next_candidates(n, elt, dev)
    return out


# (warps, programs per SM) of the single-block forward with the next tile prefetched
# (NEXT_FWD), for aligned rows of 4K to the single-block cap; at most 64 elements a thread.
NEXT_CONFIGS = ((32, 1), (16, 1), (16, 2), (8, 2), (8, 4))


def next_candidates(n: int, elt: int, dev: DeviceFacts) -> list[Candidate]:
    block = next_pow2(n)
    if not 4096 <= n <= common_rules.KIND_CAPS["softmax_fwd"] or n % (16 // elt):
        return []
    out = []
    for warps, per_sm in NEXT_CONFIGS:
        if block // (32 * warps) > 64:
            continue
        out.append(Candidate(
            f"single+next {warps}x{per_sm}",
            {"variant": "single", "warps": warps, "rows": 1, "block": block, "next": 1},
            [("softmax", {"NEXT_FWD": {(elt, block): (warps, per_sm)}})],
            f"softmax NEXT_FWD[{(elt, block)}]: ({warps}, {per_sm}): one row per tile, "
            f"{per_sm} program(s) per SM looping over tiles, the next tile's loads issued "
            "before this tile's reductions"))
    return out


BUILDERS = {"layernorm": layernorm_candidates, "rmsnorm": rmsnorm_candidates,
            "softmax": softmax_candidates}


def plan_case(op: str, dtype: str, n: int, m: int, dev: DeviceFacts,
              max_candidates: int | None) -> Case:
    """The current configuration and the candidates of one case, each candidate's override
    checked against the rules (pure functions, nothing launched): one whose rules give another
    configuration than it names is failed here, one that gives the current one is not timed."""
    elt = DTYPES[dtype].itemsize
    current = config_facts(op, rules_config(op, n, elt, m, dev))
    case = Case(op, dtype, n, m, current)
    for cand in BUILDERS[op](n, elt, current, dev):
        try:
            with cand.applied():
                got = config_facts(op, rules_config(op, n, elt, m, dev))
        except Exception as e:  # a rule the override cannot set: a failed candidate
            cand.status, cand.error = "failed", f"override refused: {type(e).__name__}: {e}"
            case.candidates.append(cand)
            continue
        wrong = {k: (got[k], v) for k, v in cand.facts.items() if got[k] != v}
        if wrong:
            cand.status = "failed"
            cand.error = f"the rules under this override give {label_of(got)} ({wrong})"
        elif got == current:
            cand.status = "same as current"
        case.candidates.append(cand)
    return cap_candidates(case, max_candidates)


# ------------------------------------------------------------------------------ running


def eager_fn(op: str) -> Callable[..., torch.Tensor]:
    if op == "layernorm":
        def layer_norm(x: torch.Tensor, w: torch.Tensor | None,
                       b: torch.Tensor | None) -> torch.Tensor:
            return F.layer_norm(x, (x.shape[-1],), w, b, EPS)
        return layer_norm
    if op == "rmsnorm":
        def rms_norm(x: torch.Tensor, w: torch.Tensor | None,
                     b: torch.Tensor | None) -> torch.Tensor:
            return F.rms_norm(x, (x.shape[-1],), w, EPS)
        return rms_norm

    def softmax(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
        return torch.softmax(x, -1)
    return softmax


def fused_fn(op: str, x: torch.Tensor, w: torch.Tensor | None,
             b: torch.Tensor | None) -> Callable[[], torch.Tensor]:
    n = x.shape[-1]
    if op == "layernorm":
        return lambda: fusedops.fused_layernorm(x, (n,), w, b, EPS)
    if op == "rmsnorm":
        return lambda: fusedops.fused_rmsnorm(x, (n,), w, EPS)
    return lambda: fusedops.fused_softmax(x, -1)


def launch_expectation(op: str, n: int, m: int,
                       facts: dict) -> tuple[str, dict, int, tuple] | None:
    """(kernel name, constexprs, warps, grid) of the launch a variant with ``facts`` makes;
    None for variants this script does not force (split rows, looped, unaligned rows)."""
    v = facts["variant"]
    if (op, v) not in KERNELS or v == "split" and not facts.get("cluster"):
        return None
    if v == "split":  # (the grid: as many clusters as the GPU holds at once, not checked)
        c = cdiv(n, facts["chunk"])
        consts, grid = {"C": c, "PREFETCH": facts["prefetch"], "CLUSTER": True}, None
    elif v == "unrolled":
        consts, grid = {"N": n, "CHUNK": facts["chunk"]}, (m,)
    elif v == "single" and facts.get("next"):
        consts = {"BLOCK_N": facts["block"], "ROWS": 1, "NEXT": 1}
        grid = (facts["programs"],)
    elif v == "single":
        consts, grid = {"BLOCK_N": facts["block"], "ROWS": facts["rows"]}, (
            cdiv(m, facts["rows"]),)
    else:
        whole = "WHOLE" if op == "softmax" else "BLOCK_N"
        consts, grid = {whole: facts["block"], "CHUNK": facts["chunk"]}, (m,)
    return KERNELS[(op, v)], consts, facts["warps"], grid


def run_checked(op: str, n: int, m: int, index: int, facts: dict, check_grid: bool,
                fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, dict, dict, list[str]]:
    """Run ``fn`` once with its launches recorded: (output, launch facts, host config facts,
    problems), the problems being every way the host memo of this call's decision or the
    launch itself differ from ``facts`` (the variant and parameters named there)."""
    with torch.no_grad(), record_launches() as record:
        y = fn()
    if y.is_cuda:
        torch.cuda.synchronize()
    cfg, hit = memo_config(op, n, y.element_size(), m, index)
    got = config_facts(op, cfg)
    problems = []
    if not hit:
        problems.append("the host memo held no decision for this call's signature")
    wrong = {k: (got[k], v) for k, v in facts.items() if got[k] != v}
    if wrong:
        problems.append(f"host config {label_of(got)} differs (got, wanted): {wrong}")
    launch: dict[str, Any] = {"launches": len(record)}
    if len(record) != 1:
        problems.append(f"{len(record)} kernel launches recorded, expected 1")
        return y, launch, got, problems
    launcher, grid, args, warps = record[0]
    kernel = getattr(launcher.kernel, "fn", launcher.kernel)
    # (positional, in signature order; trailing parameters with defaults may be left out)
    params = dict(zip(inspect.signature(kernel).parameters, args, strict=False))
    launch.update(kernel=kernel.__name__, grid=list(grid), num_warps=warps,
                  args={k: v for k, v in params.items() if not isinstance(v, torch.Tensor)})
    expected = launch_expectation(op, n, m, {**got, **facts})
    if expected is None:
        problems.append(f"no launch check for variant {got['variant']!r}")
        return y, launch, got, problems
    name, consts, want_warps, want_grid = expected
    if kernel.__name__ != name:
        problems.append(f"launched {kernel.__name__}, expected {name}")
    bad = {k: (params.get(k), v) for k, v in consts.items() if params.get(k) != v}
    if bad:
        problems.append(f"launch constexprs (got, wanted): {bad}")
    if warps != want_warps:
        problems.append(f"launched on {warps} warps, expected {want_warps}")
    if check_grid and want_grid is not None and tuple(grid) != want_grid:
        problems.append(f"grid {tuple(grid)}, expected {want_grid}")
    return y, launch, got, problems


def short_error(e: BaseException, lines: int = 6) -> str:
    text = [ln for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
    return "\n".join(text[:lines])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()



def cap_candidates(case: Case, max_candidates: int | None) -> Case:
    """``case`` with its planned candidates past the first ``max_candidates`` left out."""
    if max_candidates is not None:
        live = [c for c in case.candidates if c.status == "planned"]
        for c in live[max_candidates:]:
            c.status = "left out (--max-candidates)"
    return case


def candidate_fields(cand: Candidate) -> dict[str, Any]:
    """What every record of a candidate carries: its override, rule hint and facts."""
    return {"override": cand.override, "rule_hint": cand.hint,
            "facts": {k: list(v) if isinstance(v, tuple) else v for k, v in cand.facts.items()}}


def not_runnable(cand: Candidate, ref: object, record: Callable[..., dict],
                 base: dict[str, Any]) -> bool:
    """Record a candidate that will not run (not planned, or no reference to check it
    against) and say so."""
    if cand.status != "planned":
        record("candidate", cand.label, status=cand.status, error=cand.error, **base)
        return True
    if ref is None:
        record("candidate", cand.label, status="failed",
               error="no reference: the current rules' call failed", **base)
        return True
    return False


def pick_device(args: argparse.Namespace, script: str) -> tuple[torch.device, int, bool]:
    """(device, its index, whether the GPU is only assumed): the CPU under the interpreter
    for ``--smoke`` (the Triton backend forced), the current CUDA GPU, or the CPU for a
    ``--list`` without one; exits otherwise."""
    if args.smoke:
        if not interpreting():
            sys.exit("--smoke needs TRITON_INTERPRET=1 in the environment (read when Triton is "
                     "imported)")
        fusedops.set_backend("triton")  # CPU tensors on the interpreted kernels, any size
        return torch.device("cpu"), -1, False
    if torch.cuda.is_available() and not interpreting():
        device = torch.device("cuda", torch.cuda.current_device())
        return device, device.index, False
    if args.list:
        return torch.device("cpu"), -1, True
    sys.exit(f"{script} needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1, or --list)")


def bench_ms(fn: Callable[[], object], args: argparse.Namespace, phases: dict[str, float]) -> float:
    """``do_bench``'s median of ``fn`` in ms (``args.smoke``: one call, the interpreter's time,
    nothing to read into it); the time spent goes to ``phases["timing"]``."""
    start = time.perf_counter()
    try:
        if args.smoke:
            fn()
            return (time.perf_counter() - start) * 1e3
        from triton.testing import do_bench

        return do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")
    finally:
        phases["timing"] += time.perf_counter() - start


class Records(list):
    """A case's measurement records: ``add(provider, label, ms=..., **extra)`` fills in the
    case's fields, the bytes (``copy_bytes`` for the copy, ``nbytes`` otherwise) and TB/s."""

    def __init__(self, fields: dict[str, Any], copy_bytes: int, nbytes: int) -> None:
        super().__init__()
        self.fields, self.copy_bytes, self.nbytes = fields, copy_bytes, nbytes

    def add(self, provider: str, label: str, **extra: Any) -> dict:
        r = {**self.fields, "provider": provider, "label": label, "status": "ok", "ms": None,
             "tbps": None, "frac_copy": None,
             "bytes": self.copy_bytes if provider == "copy" else self.nbytes, **extra}
        if r["ms"]:
            r["tbps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e12
        self.append(r)
        return r


def run_case(case: Case, args: argparse.Namespace, device: torch.device, index: int,
             phases: dict[str, float]) -> list[dict]:
    op, n, m = case.op, case.n, case.m
    dtype = DTYPES[case.dtype]
    elt = dtype.itemsize
    g = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(m, n, device=device, dtype=dtype, generator=g)
    w = b = None
    if op != "softmax":
        w = (1 + 0.1 * torch.randn(n, device=device, generator=g)).to(dtype)
    if op == "layernorm":
        b = (0.1 * torch.randn(n, device=device, generator=g)).to(dtype)
    nbytes = 2 * m * n * elt + WEIGHTS[op] * n * elt
    fused = fused_fn(op, x, w, b)
    records = Records({"op": op, "dtype": case.dtype, "N": n, "M": m}, 2 * m * n * elt, nbytes)
    record = records.add

    def timed(fn: Callable[[], object]) -> float:
        return bench_ms(fn, args, phases)

    y = torch.empty_like(x)
    record("copy", "y.copy_(x)", ms=timed(lambda: y.copy_(x)))
    del y
    with torch.no_grad():
        eager = eager_fn(op)
        y_eager = eager(x, w, b)
        record("torch", "eager", ms=timed(lambda: eager(x, w, b)))

    # The current rules: checked like a candidate (the memo, the launch); their output is the
    # reference of every candidate (kept even where a check fails: status "unverified").
    configs.clear_caches()
    start = time.perf_counter()
    ref = None
    try:
        ref, launch, got, problems = run_checked(op, n, m, index, case.current, False, fused)
        phases["first calls"] += time.perf_counter() - start
        with torch.no_grad():
            ms = timed(fused)
        record("current", label_of(got), status="unverified" if problems else "ok",
               error="; ".join(problems) or None, ms=ms, launch=launch, config=got,
               max_abs_diff_eager=(ref.float() - y_eager.float()).abs().max().item())
    except Exception as e:
        record("current", label_of(case.current), status="failed", error=short_error(e),
               config=case.current)
    del y_eager

    if not args.no_compile:
        torch._dynamo.reset()  # a fresh compile per shape: no shared cache, no dynamic shapes
        compiled = torch.compile(eager_fn(op), dynamic=False,
                                 backend="eager" if args.smoke else "inductor")
        start = time.perf_counter()
        try:
            with torch.no_grad():
                yc = compiled(x, w, b)
                sync(device)
                compile_s = time.perf_counter() - start
                phases["torch.compile"] += compile_s
                diff = (yc.float() - ref.float()).abs().max().item() if ref is not None else None
                del yc
                record("compile", "torch.compile(dynamic=False)" + (
                    ", backend='eager'" if args.smoke else ""),
                    ms=timed(lambda: compiled(x, w, b)), compile_s=compile_s,
                    max_abs_diff_current=diff)
        except Exception as e:
            record("compile", "torch.compile(dynamic=False)", status="failed",
                   error=short_error(e))
        del compiled

    for cand in case.candidates:
        base = candidate_fields(cand)
        if not_runnable(cand, ref, record, base):
            continue
        start = time.perf_counter()
        try:
            with cand.applied():
                y, launch, got, problems = run_checked(op, n, m, index, cand.facts, True, fused)
                phases["first calls"] += time.perf_counter() - start
                diff = (y.float() - ref.float()).abs().max().item()
                try:
                    torch.testing.assert_close(y, ref, **TOLERANCE)
                except AssertionError as e:
                    problems.append(f"output differs from the current rules' (max abs diff "
                                    f"{diff:.3g}): {short_error(e, 4)}")
                del y
                if problems:  # failed: recorded and reported, not timed
                    record("candidate", cand.label, status="failed", error="; ".join(problems),
                           launch=launch, config=got, max_abs_diff_current=diff, **base)
                    continue
                with torch.no_grad():
                    ms = timed(fused)
            record("candidate", cand.label, ms=ms, launch=launch, config=got,
                   max_abs_diff_current=diff, **base)
        except Exception as e:  # raised (compile error, launch refused...): failed
            record("candidate", cand.label, status="failed", error=short_error(e), **base)

    if ref is not None and not args.no_repeat:
        with torch.no_grad():
            records.append({**next(r for r in records if r["provider"] == "current"),
                            "provider": "current (again)", "ms": timed(fused)})
            r = records[-1]
            r["tbps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e12
    copy_tbps = records[0]["tbps"]
    for r in records:
        if r["tbps"]:
            r["frac_copy"] = r["tbps"] / copy_tbps
    del x, w, b, ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return records


def summarize(records: list[dict]) -> dict:
    """Per case: copy TB/s, fraction of copy for current (both timings, and through autograd
    where a script times that), eager, compile, the best timed candidate and its override,
    counts of candidates by status."""
    def frac(provider: str) -> float | None:
        r = next((r for r in records if r["provider"] == provider and r["frac_copy"]), None)
        return r["frac_copy"] if r else None

    first = records[0]
    timed = [r for r in records if r["provider"] == "candidate" and r["frac_copy"]]
    best = max(timed, key=lambda r: r["frac_copy"]) if timed else None
    current = next((r for r in records if r["provider"] == "current"), None)
    counts: dict[str, int] = {}
    for r in records:
        if r["provider"] == "candidate":
            counts[r["status"]] = counts.get(r["status"], 0) + 1
    return {
        "op": first["op"], "dtype": first["dtype"], "N": first["N"], "M": first["M"],
        "copy_tbps": first["tbps"], "current": current["label"] if current else None,
        "current_frac": frac("current"), "current_again_frac": frac("current (again)"),
        "autograd_frac": frac("current (autograd)"), "eager_frac": frac("torch"),
        "compile_frac": frac("compile"), "best": best["label"] if best else None, "best_frac": best["frac_copy"] if best else None,
        "best_override": best["override"] if best else None,
        "best_rule_hint": best["rule_hint"] if best else None, "candidates": counts,
    }


def fmt(v: float | None) -> str:
    return f"{v:.3f}" if v is not None else "  -  "


def print_plan(cases: list[Case]) -> None:
    for case in cases:
        print(f"{case.op} {case.dtype} N={case.n} M={case.m}: current {label_of(case.current)}")
        for c in case.candidates:
            state = "" if c.status == "planned" else f"   [{c.status}]"
            print(f"    {c.label:32} {c.override}{state}")
            if c.error:
                print(f"        {c.error}")


def estimate(cases: list[Case], args: argparse.Namespace) -> tuple[int, int, float]:
    """(timed candidates, distinct Triton kernels, estimated seconds) of a GPU run."""
    live = [(case, c) for case in cases for c in case.candidates if c.status == "planned"]
    kernels = {(case.op, case.dtype, case.n if c.facts["variant"] == "unrolled" else 0,
                tuple(sorted(c.facts.items()))) for case, c in live}
    kernels |= {(case.op, case.dtype, case.n if case.current["variant"] == "unrolled" else 0,
                 tuple(sorted(case.current.items()))) for case in cases}
    per_case = 3 + (0 if args.no_repeat else 1) + (0 if args.no_compile else 1)
    timings = len(live) + per_case * len(cases)
    secs = (COST_SETUP + timings * COST_TIMING * (args.warmup + args.rep) / 125
            + len(kernels) * COST_TRITON_COMPILE
            + (0 if args.no_compile else len(cases) * COST_TORCH_COMPILE))
    return len(live), len(kernels), secs


def environment(device: torch.device, dev: DeviceFacts, args: argparse.Namespace) -> dict:
    import triton

    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, cwd=os.path.dirname(os.path.abspath(__file__)))
        rev = git.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        rev = None
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "device_facts": dev._asdict(), "torch": torch.__version__, "triton": triton.__version__,
        "fusedops": fusedops.__version__, "git": rev, "python": platform.python_version(),
        "smoke": args.smoke, "interpreter": interpreting(), "total_elements": TOTAL_ELEMENTS,
        "eps": EPS, "warmup_ms": args.warmup, "rep_ms": args.rep, "tolerance": TOLERANCE,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def dtype_name(s: str) -> str:
    s = DTYPE_ALIASES.get(s.lower(), s.lower())
    if s not in DTYPES:
        raise argparse.ArgumentTypeError(f"dtype must be one of {sorted(DTYPES)}, got {s!r}")
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="short_rows.json", help="JSON output (default %(default)s)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--dtypes", nargs="+", type=dtype_name, default=list(DTYPES),
                   help="bf16 / fp16 (default both)")
    p.add_argument("--sizes", nargs="+", type=int, default=list(SIZES),
                   help=f"row lengths N (default {' '.join(map(str, SIZES))})")
    p.add_argument("--max-candidates", type=int,
                   help="timed candidates per case at most (default and 0: no limit)")
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    p.add_argument("--no-repeat", action="store_true",
                   help="time the current rules once (not again after the candidates)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms (default 25)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms (default 100)")
    p.add_argument("--list", action="store_true", help="print the plan and the estimate, exit")
    p.add_argument("--smoke", action="store_true",
                   help="CPU tensors under TRITON_INTERPRET=1, M=4, one call per timing")
    args = p.parse_args()

    device, index, _ = pick_device(args, "short_rows.py")
    dev = device_facts(index)

    cases = [plan_case(op, dt, n, SMOKE_ROWS if args.smoke else TOTAL_ELEMENTS // n, dev,
                       args.max_candidates or None)
             for op in args.ops for dt in args.dtypes for n in args.sizes]
    n_live, n_kernels, secs = estimate(cases, args)
    if args.list:
        print_plan(cases)
    print(f"{len(cases)} cases, {n_live} candidates to time, about {n_kernels} Triton kernels to "
          f"compile; a GPU run takes about {secs:.0f} s (assumed: {COST_TIMING} s per timing, "
          f"{COST_TRITON_COMPILE} s per Triton compile, {COST_TORCH_COMPILE} s per "
          f"torch.compile)", flush=True)
    if args.list:
        return

    start = time.time()
    phases = {"timing": 0.0, "first calls": 0.0, "torch.compile": 0.0}
    records: list[dict] = []
    summary: list[dict] = []
    for case in cases:
        rows = run_case(case, args, device, index, phases)
        records += rows
        s = summarize(rows)
        summary.append(s)
        failed = s["candidates"].get("failed", 0)
        print(f"[{time.time() - start:5.0f} s] {case.op} {case.dtype} {case.n}: current "
              f"{fmt(s['current_frac'])} ({s['current']}), compile {fmt(s['compile_frac'])}, "
              f"best {fmt(s['best_frac'])} ({s['best']}); "
              + ", ".join(f"{v} {k}" for k, v in sorted(s["candidates"].items())), flush=True)
        for r in rows:
            if r["status"] in ("failed", "unverified"):
                print(f"        {r['status'].upper()} {r['provider']} {r['label']}: "
                      + r["error"].replace("\n", "\n            "), flush=True)
    elapsed = time.time() - start
    fusedops.set_backend(None)

    meta = environment(device, dev, args)
    meta.update(elapsed_s=elapsed, phase_s=phases)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "summary": summary, "records": records}, f, indent=1)

    print(f"\n{meta['device']}, torch {meta['torch']}, Triton {meta['triton']}, fusedops "
          f"{meta['fusedops']} ({meta['git']})" + ("  [smoke: interpreter, times meaningless]"
                                                   if args.smoke else ""))
    print("fraction of copy bandwidth (same case's copy); current: first / again")
    print(f"{'op':9} {'dtype':5} {'N':>5} {'copy':>6} {'current':>13} {'config':30} "
          f"{'eager':>5} {'compile':>7} {'best':>6} {'x cur':>5}  candidate / override")
    for s in summary:
        ratio = (f"{s['best_frac'] / s['current_frac']:5.3f}"
                 if s["best_frac"] and s["current_frac"] else "  -  ")
        print(f"{s['op']:9} {s['dtype']:5} {s['N']:>5} {fmt(s['copy_tbps']):>6} "
              f"{fmt(s['current_frac'])}/{fmt(s['current_again_frac'])} "
              f"{(s['current'] or '-'):30} {fmt(s['eager_frac']):>5} {fmt(s['compile_frac']):>7} "
              f"{fmt(s['best_frac']):>6} {ratio}  {s['best'] or '-'}: {s['best_override'] or '-'}")
    failed = [r for r in records if r["status"] == "failed"]
    print(f"\n{len(failed)} failed ({', '.join(sorted({r['provider'] for r in failed})) or '-'}); "
          f"elapsed {elapsed:.0f} s (timing {phases['timing']:.0f} s, first calls and checks "
          f"{phases['first calls']:.0f} s, torch.compile {phases['torch.compile']:.0f} s); "
          f"wrote {args.out}")


if __name__ == "__main__":
    main()
