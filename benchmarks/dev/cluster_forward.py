"""Softmax and RMSNorm forwards on long aligned rows in thread-block clusters: the launch rules
against ``CLUSTER_FWD`` candidates forced through ``configs.override``, in one run (Hopper or
newer).

    PYTHONPATH=$PWD python benchmarks/dev/cluster_forward.py --out cluster_forward.json
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/dev/cluster_forward.py --smoke

For each op (``--ops``: softmax, rmsnorm), dtype (bf16, fp16, float32) and row length (65536,
131072, 262144 by default; M = 2^27 // N rows, 2^26 // N for float32, so every tensor is far
larger than L2), inference calls of ``fused_softmax`` / ``fused_rmsnorm`` (a weight in x's
dtype): ``rules`` (the shipped rules), ``no clusters`` (``CLUSTER_FWD`` emptied) and
``cluster PxW held pfK`` (the op's split-row kernel on pieces of P elements, W warps, as a
one-entry ``CLUSTER_FWD``: as many clusters as the GPU holds at once, looping over rows with
PREFETCH K). Pieces of 4K-32K elements whose count C = N / P is a cluster size (2-16),
on 32 and on 16 elements per thread (32K: 64 and 32). Each variant's first call runs with its launches recorded: a
candidate must launch the split-row kernel with CLUSTER, that BLOCK and C, and match the
rules' output (bf16 rtol 1.6e-2, fp16 1e-3, float32 1e-5); one that does not is reported and
not timed. ``torch`` (``torch.softmax`` / ``F.rms_norm``) and ``copy`` (``y.copy_(x)``) are
timed beside them. Times:
``triton.testing.do_bench`` medians (L2 flushed), every variant timed twice in alternating
order (the lower median kept); TB/s of 2·M·N·elt bytes (RMSNorm: plus the weight), and each
as a fraction of the same case's copy. ``--smoke`` (the interpreter, which has no clusters) runs the rules once on tiny
rows: it checks the script, not speed.
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
RTOL = {"bf16": 1.6e-2, "fp16": 1e-3, "fp32": 1e-5}
EPS = 1e-6
# op -> (split-row kernel, positions of BLOCK, C and CLUSTER in its launch arguments)
KERNELS = {"softmax": ("softmax_fwd_split", 10, 11, 16), "rmsnorm": ("rms_fwd_split", 13, 14, 20)}


def variants(op: str, n: int, smoke: bool) -> dict[str, tuple[dict, tuple | None]]:
    """name -> (the op's overrides, the (BLOCK, C, warps) a candidate must launch, or None)."""
    out: dict[str, tuple[dict, tuple | None]] = {"rules": ({}, None),
                                                 "no clusters": ({"CLUSTER_FWD": {}}, None)}
    if smoke:
        return out
    for piece, warp_counts in PIECES.items():
        c = n // piece
        if c not in CLUSTER_SIZES:
            continue
        for warps in warp_counts:
            # (16 elements per thread: without prefetch only)
            for prefetch in (0,) if warps == piece // 512 else (0, 1):
                table = {el: ((n, n, (piece, warps, prefetch)),) for el in (2, 4)}
                out[f"cluster {piece}x{warps} held pf{prefetch}"] = (
                    {"CLUSTER_FWD": table}, (piece, c, warps))
    return out


def first_call(op: str, fn: Callable[[], torch.Tensor], expect: tuple | None
               ) -> tuple[torch.Tensor, list[str]]:
    """Run ``fn`` once with its launches recorded: (output, problems)."""
    with record_launches() as record:
        y = fn()
    if expect is None:
        return y, []
    kernel, i_block, i_c, i_cluster = KERNELS[op]
    block, c, warps = expect
    for launcher, _grid, args, num_warps in record:
        if getattr(launcher.kernel, "__name__", "") != kernel:
            continue
        got = (args[i_block], args[i_c], num_warps, args[i_cluster])
        if got != (block, c, warps, True):
            return y, [f"launched BLOCK, C, warps, CLUSTER = {got}"]
        return y, []
    names = [getattr(launcher.kernel, "__name__", "?") for launcher, *_ in record]
    return y, [f"launched {names}, not {kernel} in clusters"]


def run_case(op: str, dtype: str, n: int, smoke: bool, device: torch.device) -> list[dict]:
    dt = DTYPES[dtype]
    elt = torch.empty((), dtype=dt).element_size()
    m = 3 if smoke else (1 << (27 if elt == 2 else 26)) // n
    g = torch.Generator().manual_seed(n)
    x = (2 * torch.randn(m, n, generator=g)).to(device, dt)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(device, dt)
    nbytes = 2 * m * n * elt + (n * elt if op == "rmsnorm" else 0)
    y = torch.empty_like(x)
    if op == "softmax":
        def call() -> torch.Tensor:
            return fusedops.fused_softmax(x, -1)
        peer = lambda: torch.softmax(x, -1)  # noqa: E731
    else:
        def call() -> torch.Tensor:
            return fusedops.fused_rmsnorm(x, (n,), w, eps=EPS)
        peer = lambda: torch.nn.functional.rms_norm(x, (n,), w, EPS)  # noqa: E731
    fns: dict[str, tuple[Callable[[], torch.Tensor], dict]] = {
        "copy": (lambda: y.copy_(x), {}), "torch": (peer, {})}
    records: dict[str, dict] = {}
    ref = None
    with torch.no_grad(), fusedops.use_backend("triton"):
        for name, (rules, expect) in variants(op, n, smoke).items():
            try:
                with configs.override(op, **rules):
                    out, problems = first_call(op, call, expect)
            except Exception as e:  # noqa: BLE001 - reported, not timed
                out, problems = None, [f"{type(e).__name__}: {str(e)[:200]}"]
            if ref is None:
                ref = out
            elif not problems:
                try:
                    torch.testing.assert_close(out.float(), ref.float(), rtol=RTOL[dtype],
                                               atol=1e-5)
                except AssertionError as e:
                    problems.append(f"differs from the rules' output: {str(e)[:200]}")
            records[name] = {"problems": problems, "overrides": repr(rules)}
            if not problems:
                fns[name] = (call, rules)
        times = time_alternating(fns, op, smoke)
    copy_ms = times["copy"]
    out = []
    for name in [*fns, *(k for k in records if k not in fns)]:
        ms = times.get(name)
        out.append({"op": op, "dtype": dtype, "N": n, "M": m, "variant": name, "ms": ms,
                    "tbps": nbytes / ms / 1e9 if ms else None,
                    "frac_copy": copy_ms / ms if ms else None,
                    **records.get(name, {"problems": []})})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="cluster_forward.json")
    p.add_argument("--ops", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    p.add_argument("--smoke", action="store_true", help="tiny rows, no timing (interpreter)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records = []
    for op in args.ops:
        for dtype in args.dtypes:
            for n in [256] if args.smoke else args.sizes:
                records += run_case(op, dtype, n, args.smoke, device)
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
