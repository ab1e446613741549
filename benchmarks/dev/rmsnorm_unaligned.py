"""RMSNorm forward on long unaligned rows (N = 2^k + 1): the launch rules against candidates
forced through ``configs.override``, in one run.

    PYTHONPATH=$PWD python benchmarks/dev/rmsnorm_unaligned.py --out rmsnorm_unaligned.json
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/dev/rmsnorm_unaligned.py --smoke

For each dtype (bf16, fp16, float32) and row length (65537, 131073, 262145; M = 2^27 // N rows,
2^26 // N for float32, so every tensor is far larger than L2), inference calls of
``fused_rmsnorm`` with a weight in x's dtype: ``rules`` (the shipped rules), ``split`` (the
split-row kernel on aligned-body pieces: ``UNROLLED_VEC_FWD`` emptied) and
``unrolled_vec CxW`` (``rms_fwd_unrolled_vec`` on chunks of C elements and W warps: a one-entry
``UNROLLED_VEC_FWD``). Each variant's first call runs with its launches recorded: it must
launch the kernel it names (with that CHUNK) and match the rules' output (bf16 tolerances);
one that does not is reported and not timed. ``torch`` (``F.rms_norm``) and ``copy``
(``y.copy_(x)``) are timed beside them. Times: ``triton.testing.do_bench`` medians (L2
flushed), every variant timed twice in alternating order (the lower median kept); TB/s of
2·M·N·elt + N·elt bytes, and each as a fraction of the same case's copy.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

import fusedops
from fusedops.backends.triton import configs
from fusedops.backends.triton.configs.common import body_len
from fusedops.backends.triton.runtime.device import next_pow2
from fusedops.backends.triton.runtime.recording import record_launches
from fusedops.tools.bench_harness import source_sha

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SIZES = (65537, 131073, 262145)
CANDIDATES = ((8192, 16), (8192, 32), (16384, 32))
SMOKE_CANDIDATES = ((64, 2), (128, 4))  # (interpreter rows of a few hundred columns)
EPS = 1e-6


def variants(n: int, elt: int, smoke: bool) -> dict[str, tuple[dict, str, int]]:
    """name -> (rmsnorm overrides, the kernel it must launch, its CHUNK or 0); split rows run
    on CUDA only."""
    key = (elt, next_pow2(body_len(n, 16 // elt)))
    out = {"rules": ({}, "", 0),
           "split": ({"UNROLLED_VEC_FWD": {}}, "" if smoke else "rms_fwd_split", 0)}
    for chunk, warps in SMOKE_CANDIDATES if smoke else CANDIDATES:
        out[f"unrolled_vec {chunk}x{warps}"] = (
            {"UNROLLED_VEC_FWD": {key: (chunk, warps)}}, "rms_fwd_unrolled_vec", chunk)
    return out


def first_call(fn: Callable[[], torch.Tensor], kernel: str, chunk: int) -> tuple[torch.Tensor,
                                                                                  list[str]]:
    """Run ``fn`` once with its launches recorded: (output, problems)."""
    with record_launches() as record:
        y = fn()
    names = [launcher.kernel.__name__ for launcher, *_ in record]
    problems = []
    if kernel and kernel not in names:
        problems.append(f"launched {names}, not {kernel}")
    if chunk:
        for launcher, _grid, args, _warps in record:
            if launcher.kernel.__name__ == kernel and args[10] != chunk:
                problems.append(f"CHUNK {args[10]}, not {chunk}")
    return y, problems


def time_alternating(fns: dict[str, tuple[Callable[[], object], dict]], op: str,
                     smoke: bool) -> dict[str, float]:
    """The lower of two ``do_bench`` medians (ms) per variant, timed in alternating order
    (listed, then reversed), each under its overrides of ``op``'s rules; ``smoke``: one call
    each, 0.0."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for order in (list(fns), list(reversed(fns))):
        for name in order:
            fn, rules = fns[name]
            with configs.override(op, **rules):
                if smoke:
                    fn()
                    times[name].append(0.0)
                else:
                    times[name].append(triton.testing.do_bench(fn, warmup=25, rep=100))
    return {name: min(t) for name, t in times.items()}


def run_case(dtype: str, n: int, smoke: bool, device: torch.device) -> list[dict]:
    dt = DTYPES[dtype]
    elt = torch.empty((), dtype=dt).element_size()
    m = 3 if smoke else (1 << (27 if elt == 2 else 26)) // n
    g = torch.Generator().manual_seed(n)
    x = torch.randn(m, n, generator=g).to(device, dt)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(device, dt)
    nbytes = 2 * m * n * elt + n * elt
    y = torch.empty_like(x)
    fns: dict[str, tuple[Callable[[], torch.Tensor], dict]] = {
        "copy": (lambda: y.copy_(x), {}), "torch": (lambda: F.rms_norm(x, (n,), w, EPS), {})}
    records: dict[str, dict] = {}
    ref = None
    with torch.no_grad(), fusedops.use_backend("triton"):
        for name, (rules, kernel, chunk) in variants(n, elt, smoke).items():
            with configs.override("rmsnorm", **rules):
                out, problems = first_call(lambda: fusedops.fused_rmsnorm(x, (n,), w, eps=EPS),
                                           kernel, chunk)
            if ref is None:
                ref = out
            elif not problems:
                try:
                    torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1e-5)
                except AssertionError as e:
                    problems.append(f"differs from the rules' output: {str(e)[:200]}")
            records[name] = {"problems": problems}
            if not problems:
                fns[name] = (lambda: fusedops.fused_rmsnorm(x, (n,), w, eps=EPS), rules)
        times = time_alternating(fns, "rmsnorm", smoke)
    copy_ms = times["copy"]
    out = []
    for name in [*fns, *(k for k in records if k not in fns)]:
        ms = times.get(name)
        tbps = nbytes / ms / 1e9 if ms else None
        out.append({"dtype": dtype, "N": n, "M": m, "variant": name, "ms": ms, "tbps": tbps,
                    "frac_copy": copy_ms / ms if ms else None,
                    "problems": records.get(name, {}).get("problems", [])})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="rmsnorm_unaligned.json")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    p.add_argument("--smoke", action="store_true", help="tiny rows, no timing (interpreter)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = [259, 275] if args.smoke else args.sizes
    rules = {"SHIFTED_W_MIN_ELEMS": 0} if args.smoke else {}
    records = []
    with configs.override("rmsnorm", **rules):
        for dtype in args.dtypes:
            for n in sizes:
                records += run_case(dtype, n, args.smoke, device)
    meta = {"torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "source_sha": source_sha(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)
    print_records(records)


def print_records(records: list[dict], width: int = 22) -> None:
    """The records as a table: (op,) dtype, N, variant, ms, fraction of copy, problems."""
    op = "op" in records[0] if records else False
    print(("op        " if op else "") + f"{'dtype':5} {'N':>7}  {'variant':{width}} {'ms':>7} "
          f"{'of copy':>7}  problems")
    for r in records:
        ms = f"{r['ms']:.3f}" if r["ms"] is not None else "-"
        frac = f"{r['frac_copy']:.3f}" if r["frac_copy"] else "-"
        print((f"{r['op']:9} " if op else "") + f"{r['dtype']:5} {r['N']:>7}  "
              f"{r['variant']:{width}} {ms:>7} {frac:>7}  {'; '.join(r['problems'])}")


if __name__ == "__main__":
    main()
