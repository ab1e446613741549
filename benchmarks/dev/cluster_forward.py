"""Softmax, RMSNorm and LayerNorm forwards on long aligned rows in thread-block clusters: the
launch rules against cluster candidates forced through ``configs.override``, in one run
(Hopper or newer).

    PYTHONPATH=$PWD python benchmarks/dev/cluster_forward.py --out cluster_forward.json
    PYTHONPATH=$PWD python benchmarks/dev/cluster_forward.py --ops rmsnorm --kinds pieces
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/dev/cluster_forward.py --smoke

For each op (``--ops``), dtype (bf16, fp16, float32) and row length (65536, 131072, 262144 by
default; M = 2^27 // N rows, 2^26 // N for float32, so every tensor is far larger than L2),
inference calls of ``fused_softmax`` / ``fused_rmsnorm`` / ``fused_layernorm`` (weight and
bias in x's dtype): ``rules`` (the shipped rules), ``no clusters`` (``CLUSTER_FWD``,
``PIECES_FWD`` and ``STAGED_FWD`` emptied), ``no staged`` (the norms' ``STAGED_FWD``
emptied), ``no pieces`` (with ``pieces`` candidates: ``PIECES_FWD`` and ``STAGED_FWD``
emptied) and the candidates of ``--kinds``:

* ``held`` (RMSNorm): ``cluster PxW held pfK``, the op's split-row kernel holding pieces of
  P elements in registers on W warps, as a one-entry ``CLUSTER_FWD`` (as many clusters as the
  GPU holds at once, looping over rows with PREFETCH K); pieces of 4K-32K whose count C = N / P
  is a cluster size (2-16), on 32 and on 16 elements per thread.
* ``staged``: ``staged PxW``, ``softmax_fwd_staged`` / ``rms_fwd_staged`` /
  ``ln_fwd_staged`` (one cluster per row, each CTA's piece of P elements landed in shared
  memory) on W warps, as a one-entry ``CLUSTER_FWD`` (softmax) or ``STAGED_FWD``; pieces of
  4K-32K (16-64 KB) whose count is a cluster size, on 4, 8 and 16 warps (``--warps``).
* ``pieces`` (RMSNorm, LayerNorm): ``pieces PxKxW held|rows``, the streamed-pieces kernel
  (``rms_fwd_pieces``, ``ln_fwd_pieces``) on pieces of P elements in chunks of K on W warps,
  as a one-entry ``PIECES_FWD``: a persistent grid (``held``) or one cluster per row
  (``rows``); pieces of 8K-32K (float32 4K-16K, or ``--pieces``).

Each variant's first call runs with its launches recorded: a candidate must launch its kernel
with those parameters, and match the rules' output (bf16 rtol 1.6e-2, fp16 1e-3, float32
1e-5); one that does not is reported and not timed. The op in torch and ``copy``
(``y.copy_(x)``) are timed beside them. Times: ``triton.testing.do_bench`` medians (L2
flushed), every variant timed twice in alternating order (the lower median kept); TB/s of the
op's bytes (2·M·N·elt plus the weight and bias), and each as a fraction of the same case's
copy. ``--smoke`` (the interpreter, which has no clusters) runs the rules once on tiny rows:
it checks the script, not speed.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable

import torch
import triton
from rmsnorm_unaligned import print_records, time_alternating

import fusedops
from fusedops.backends.triton import configs
from fusedops.backends.triton.runtime.clusters import CLUSTER_SIZES
from fusedops.backends.triton.runtime.recording import record_launches
from fusedops.tools.bench_harness import source_sha

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SIZES = (65536, 131072, 262144)
# piece -> warps (32 and 16 elements per thread; 32K pieces on 16 and 32 warps)
PIECES = {4096: (4, 8), 8192: (8, 16), 16384: (16, 32), 32768: (16, 32)}
# streamed pieces: (CHUNK, warps) per chunk of the two passes
STREAM_CHUNKS = ((2048, 8), (4096, 16))
RTOL = {"bf16": 1.6e-2, "fp16": 1e-3, "fp32": 1e-5}
EPS = 1e-6
# op -> the split-row kernel and the positions of BLOCK, C and CLUSTER in its launch arguments
KERNELS = {"rmsnorm": ("rms_fwd_split", 13, 14, 20)}
# op -> the staged kernel, its rules table and the positions of L and C in its launch
# arguments; the pieces' bytes
STAGED = {"softmax": ("softmax_fwd_staged", "CLUSTER_FWD", 5, 6),
          "rmsnorm": ("rms_fwd_staged", "STAGED_FWD", 8, 9),
          "layernorm": ("ln_fwd_staged", "STAGED_FWD", 10, 11)}
STAGED_BYTES = (16384, 32768, 65536)
STAGED_WARPS = (4, 8, 16)
# op -> the streamed-pieces kernel and the positions of L, CHUNK and C in its launch arguments
STREAMED = {"rmsnorm": ("rms_fwd_pieces", 10, 11, 12),
            "layernorm": ("ln_fwd_pieces", 11, 12, 13)}
OPS = ("softmax", "rmsnorm", "layernorm")


def variants(op: str, n: int, elt: int, kinds: list[str], smoke: bool,
             streamed_pieces: list[int] | None = None,
             staged_warps: tuple[int, ...] = STAGED_WARPS) -> dict[str, tuple[dict, tuple | None]]:
    """name -> (the op's overrides, the launch a candidate must make: (kernel, {argument
    position: value}, warps), or None)."""
    streamed = STREAMED.get(op)
    norm = op != "softmax"  # (the norms' staged rules are a table of their own)
    off = ({"CLUSTER_FWD": {}} if op != "layernorm" else {}) | (
        {"PIECES_FWD": {}, "STAGED_FWD": {}} if norm else {})
    out: dict[str, tuple[dict, tuple | None]] = {"rules": ({}, None), "no clusters": (off, None)}
    if norm:  # the rules before the staged pieces
        out["no staged"] = ({"STAGED_FWD": {}}, None)
    if norm and "pieces" in kinds:  # the rules before the streamed pieces
        out["no pieces"] = ({"PIECES_FWD": {}, "STAGED_FWD": {}}, None)
    if smoke:
        return out
    kernel, table, i_l, i_c = STAGED[op]
    for nbytes in STAGED_BYTES if "staged" in kinds else ():
        piece = nbytes // elt
        if n // piece not in CLUSTER_SIZES or n % piece:
            continue
        for warps in staged_warps:
            out[f"staged {piece}x{warps}"] = (
                {table: {elt: ((n, n, (piece, warps)),)}}, (kernel, {i_l: piece, i_c: n // piece},
                                                            warps))
    kernel, i_block, i_c, i_cluster = KERNELS.get(op, ("", 0, 0, 0))
    for piece, warp_counts in PIECES.items() if "held" in kinds and kernel else ():
        c = n // piece
        if c not in CLUSTER_SIZES:
            continue
        for warps in warp_counts:
            # (16 elements per thread: without prefetch only)
            for prefetch in (0,) if warps == piece // 512 else (0, 1):
                table = {el: ((n, n, (piece, warps, prefetch)),) for el in (2, 4)}
                out[f"cluster {piece}x{warps} held pf{prefetch}"] = (
                    {"CLUSTER_FWD": table, "PIECES_FWD": {}, "STAGED_FWD": {}} if streamed else
                    {"CLUSTER_FWD": table},
                    (kernel, {i_block: piece, i_c: c, i_cluster: True}, warps))
    if not streamed or "pieces" not in kinds:
        return out
    kernel, i_piece, i_chunk, i_c = streamed
    for piece in streamed_pieces or ((8192, 16384, 32768) if elt == 2 else (4096, 8192, 16384)):
        c = n // piece
        for chunk, warps in STREAM_CHUNKS if c in CLUSTER_SIZES else ():
            for persistent in (True, False):
                if chunk > piece:
                    continue
                table = {el: ((n, n, (piece, chunk, warps, persistent)),) for el in (2, 4)}
                out[f"pieces {piece}x{chunk}x{warps} {'held' if persistent else 'rows'}"] = (
                    off | {"PIECES_FWD": table},
                    (kernel, {i_piece: piece, i_chunk: chunk, i_c: c}, warps))
    return out


def first_call(fn: Callable[[], torch.Tensor], expect: tuple | None
               ) -> tuple[torch.Tensor, list[str]]:
    """Run ``fn`` once with its launches recorded: (output, problems)."""
    with record_launches() as record:
        y = fn()
    if expect is None:
        return y, []
    kernel, values, warps = expect
    for launcher, _grid, args, num_warps in record:
        if getattr(launcher.kernel, "__name__", "") != kernel:
            continue
        got = {i: args[i] for i in values}
        if got != values or num_warps != warps:
            return y, [f"launched {got} on {num_warps} warps"]
        return y, []
    names = [getattr(launcher.kernel, "__name__", "?") for launcher, *_ in record]
    return y, [f"launched {names}, not {kernel}"]


def run_case(op: str, dtype: str, n: int, kinds: list[str], smoke: bool,
             device: torch.device, streamed_pieces: list[int] | None = None,
             staged_warps: tuple[int, ...] = STAGED_WARPS) -> list[dict]:
    dt = DTYPES[dtype]
    elt = torch.empty((), dtype=dt).element_size()
    m = 3 if smoke else (1 << (27 if elt == 2 else 26)) // n
    g = torch.Generator().manual_seed(n)
    x = (2 * torch.randn(m, n, generator=g)).to(device, dt)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(device, dt)
    nbytes = 2 * m * n * elt + {"softmax": 0, "rmsnorm": n * elt, "layernorm": 2 * n * elt}[op]
    y = torch.empty_like(x)
    if op == "softmax":
        def call() -> torch.Tensor:
            return fusedops.fused_softmax(x, -1)
        peer = lambda: torch.softmax(x, -1)  # noqa: E731
    elif op == "layernorm":
        b = (0.1 * torch.randn(n, generator=g)).to(device, dt)

        def call() -> torch.Tensor:
            return fusedops.fused_layernorm(x, (n,), w, b, eps=EPS)
        peer = lambda: torch.nn.functional.layer_norm(x, (n,), w, b, EPS)  # noqa: E731
    else:
        def call() -> torch.Tensor:
            return fusedops.fused_rmsnorm(x, (n,), w, eps=EPS)
        peer = lambda: torch.nn.functional.rms_norm(x, (n,), w, EPS)  # noqa: E731
    fns: dict[str, tuple[Callable[[], object], dict]] = {
        "copy": (lambda: y.copy_(x), {}), "torch": (peer, {})}

    def differs(out: torch.Tensor, ref: torch.Tensor) -> list[str]:
        try:
            torch.testing.assert_close(out.float(), ref.float(), rtol=RTOL[dtype], atol=1e-5)
        except AssertionError as e:
            return [f"differs from the rules' output: {str(e)[:200]}"]
        return []

    with torch.no_grad(), fusedops.use_backend("triton"):
        items = variants(op, n, elt, kinds, smoke, streamed_pieces, staged_warps)
        records = checked_variants(items, op, call, call, differs, fns)
        times = time_alternating(fns, op, smoke)
    return timed_records(times, fns, records, {"op": op, "dtype": dtype, "N": n, "M": m},
                         nbytes)


def checked_variants(items: dict[str, tuple[dict, tuple | None]], op: str,
                     first: Callable[[], object], timed: Callable[[], object],
                     differs: Callable[[object, object], list[str]],
                     fns: dict[str, tuple[Callable[[], object], dict]]) -> dict[str, dict]:
    """Run ``first`` once under each variant's overrides of ``op``'s rules with its launches
    recorded (:func:`first_call`), compare its output with the first variant's (``differs``:
    the problems, [] if none), and add every variant without problems to ``fns`` (``timed``
    under its overrides); returns name -> {problems, overrides}."""
    records: dict[str, dict] = {}
    ref = None
    for name, (rules, expect) in items.items():
        try:
            with configs.override(op, **rules):
                out, problems = first_call(first, expect)
        except Exception as e:  # noqa: BLE001 - reported, not timed
            out, problems = None, [f"{type(e).__name__}: {str(e)[:200]}"]
        if ref is None:
            ref = out
        elif not problems:
            problems = differs(out, ref)
        records[name] = {"problems": problems, "overrides": repr(rules)}
        if not problems:
            fns[name] = (timed, rules)
    return records


def timed_records(times: dict[str, float], fns: dict, records: dict[str, dict], case: dict,
                  nbytes: int) -> list[dict]:
    """One record per variant (timed ones first): ``case``'s fields, ms, TB/s of ``nbytes``,
    the fraction of the case's ``copy`` time, and its problems."""
    copy_ms = times["copy"]
    out = []
    for name in [*fns, *(k for k in records if k not in fns)]:
        ms = times.get(name)
        out.append({**case, "variant": name, "ms": ms, "tbps": nbytes / ms / 1e9 if ms else None,
                    "frac_copy": copy_ms / ms if ms else None,
                    **records.get(name, {"problems": []})})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="cluster_forward.json")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    p.add_argument("--kinds", nargs="+", default=["held", "pieces", "staged"],
                   choices=["held", "pieces", "staged"],
                   help="candidates: pieces held in registers, streamed, landed in shared memory")
    p.add_argument("--pieces", nargs="+", type=int, default=None,
                   help="streamed piece lengths (default 8K-32K, float32 4K-16K)")
    p.add_argument("--warps", nargs="+", type=int, default=list(STAGED_WARPS),
                   help="warp counts of the staged candidates")
    p.add_argument("--smoke", action="store_true", help="tiny rows, no timing (interpreter)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records = []
    for op in args.ops:
        for dtype in args.dtypes:
            for n in [256] if args.smoke else args.sizes:
                records += run_case(op, dtype, n, args.kinds, args.smoke, device, args.pieces,
                                    tuple(args.warps))
            with open(args.out, "w") as f:  # (rewritten after every case)
                json.dump({"meta": meta(device), "records": records}, f, indent=1)
    print_records(records, 28)


def meta(device: torch.device) -> dict:
    return {"torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "source_sha": source_sha(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}


if __name__ == "__main__":
    main()
