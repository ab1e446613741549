"""Kernel benchmark sweep: ``python -m fusedops bench`` and :func:`run_sweep`.

What it measures (see ``benchmarks/README.md`` and ``docs/performance.md``):

* ops ``softmax_fwd``, ``softmax_bwd``, ``layernorm_fwd``, ``layernorm_bwd`` (dx + dweight +
  dbias), ``rmsnorm_fwd``, ``rmsnorm_bwd`` (dx + dweight) x dtypes bf16/fp16/fp32 x row length
  N, each at ``M = total // N`` rows (``total`` = 2^27 elements by default, far larger than any
  L2), fresh random data per point;
* providers in the same run: fusedops, torch eager, torch.compile (dynamic=False, recompiled per
  shape, compile time reported), Liger-Kernel and QuACK when importable (CUDA; QuACK has no
  LayerNorm backward, so those points are recorded as skipped), the unfused eager composition;
* the device-to-device copy bandwidth first, so every result is also a fraction of it;
* bandwidth = minimum bytes moved (:func:`bytes_moved`) / median time, GFLOP/s from the stated
  FLOP counts (:data:`FLOPS_PER_ELEMENT`), speedup of each provider against every other; on
  CUDA also each record's GPU-ahead time (``ms_gpu``: the GPU's own time, the host far ahead);
* small-shape host latency: wall time per call of fusedops vs the native torch op;
* a correctness guard: every provider's output is checked against torch eager on the same data
  before it is timed, and mismatches are marked in the results.

The pieces: :mod:`~fusedops.tools.bench_ops` (the sweep space, byte and FLOP models, names),
:mod:`~fusedops.tools.bench_harness` (devices, the :class:`Timer`, copy bandwidth, progress),
:mod:`~fusedops.tools.bench_providers`, :mod:`~fusedops.tools.bench_sweep` (the run),
:mod:`~fusedops.tools.bench_latency`, :mod:`~fusedops.tools.bench_report` (files and tables) and
:mod:`~fusedops.tools.bench_plot`. This module is the command line and re-exports their public
names.

On CPU the command runs one thread unless ``--threads`` says otherwise, and its tables say that
fusedops runs its PyTorch reference path there (the fused kernels are GPU backends).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fusedops.tools import bench_report
from fusedops.tools.bench_harness import (
    CHECK_TOL,
    DTYPES,
    Progress,
    Timer,
    apple_peak_tbps,
    check_outputs,
    cpu_threads,
    default_device,
    device_name,
    empty_cache,
    format_size,
    measure_copy_bandwidth,
    parse_size,
    positive_size,
    rel_error,
    require_device,
    resolve_dtypes,
    synchronize,
)
from fusedops.tools.bench_latency import measure_host_latency
from fusedops.tools.bench_ops import (
    BYTES_MODEL,
    FLOP_MODEL,
    FLOPS_PER_ELEMENT,
    HOST_LATENCY_OPS,
    HOST_LATENCY_SHAPES,
    NOISE,
    OPS,
    QUICK,
    SIZES,
    TOTAL_ELEMENTS,
    annotate_speedups,
    bytes_moved,
    family,
    flops,
    is_backward,
    plan,
    resolve_ops,
    resolve_providers,
    resolve_sizes,
    rows_for,
)
from fusedops.tools.bench_providers import FAMILIES, PROVIDER_NAMES
from fusedops.tools.bench_sweep import Point, base_record, finish_record, run_provider, run_sweep
from fusedops.tools.cli import (
    UsageError,
    bad_input,
    nonnegative_float,
    positive_int,
    torch_threads,
)

__all__ = [
    "BYTES_MODEL", "CHECK_TOL", "DTYPES", "FLOPS_PER_ELEMENT", "FLOP_MODEL", "HOST_LATENCY_OPS",
    "HOST_LATENCY_SHAPES", "NOISE", "OPS", "QUICK", "SIZES", "TOTAL_ELEMENTS", "Point",
    "Progress", "Timer", "annotate_speedups", "apple_peak_tbps", "base_record", "build_parser",
    "bytes_moved", "check_outputs", "default_device", "device_name", "empty_cache", "family",
    "finish_record", "flops", "format_size", "is_backward", "main", "measure_copy_bandwidth",
    "measure_host_latency", "parse_size", "plan", "rel_error", "resolve_dtypes", "resolve_ops",
    "resolve_providers", "resolve_sizes", "rows_for", "run_provider", "run_sweep",
    "synchronize",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fusedops bench",
        description="Benchmark fused softmax / LayerNorm / RMSNorm against torch eager, "
        "torch.compile, Liger-Kernel, QuACK and the unfused composition: TB/s, GFLOP/s, "
        "fraction of the measured copy bandwidth, speedups, the GPU-ahead time beside do_bench "
        "on CUDA; JSON/CSV/PNG under --out.",
    )
    p.add_argument("--device", choices=("cuda", "mps", "cpu"), default=None,
                   help="default: cuda if available, else mps, else cpu (tiny sizes)")
    p.add_argument("--ops", default=None,
                   help=f"comma list of {', '.join(OPS)} or {'/'.join(FAMILIES)}/fwd/bwd, "
                   "ln_*/rms_* for layernorm_*/rmsnorm_* (default all)")
    p.add_argument("--dtypes", default=None, help="comma list of bf16,fp16,fp32 (default all)")
    p.add_argument("--sizes", default=None,
                   help="comma list of N, e.g. 1K,8193,64K+1 (default the full sweep: "
                   + ",".join(format_size(s) for s in SIZES) + ")")
    p.add_argument("--providers", default=None,
                   help=f"comma list of {', '.join(PROVIDER_NAMES)} (default all)")
    p.add_argument("--quick", action="store_true",
                   help="bf16 only at N in " + ",".join(format_size(s) for s in QUICK["sizes"])
                   + " (explicit --dtypes/--sizes still win)")
    p.add_argument("--total", type=positive_size, default=None,
                   help="elements per point, M = total // N (default 2^27; 2^14 on cpu)")
    p.add_argument("--warmup", type=nonnegative_float, default=None,
                   help="warm-up ms per point (default 5)")
    p.add_argument("--rep", type=nonnegative_float, default=None,
                   help="measurement ms per point (default 25)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads while timing (torch.set_num_threads); default 1 on cpu, "
                   "where several threads make single calls wait on the scheduler")
    p.add_argument("--no-check", action="store_true", help="skip the correctness guard")
    p.add_argument("--no-host-latency", action="store_true", help="skip the small-shape cases")
    p.add_argument("--host-latency-only", action="store_true",
                   help="only the copy bandwidth and the small-shape cases")
    p.add_argument("--separate-compile", action="store_true",
                   help="compile an inference graph for fwd and a training graph for bwd "
                   "(default: one training graph per shape serves both)")
    p.add_argument("--time-budget", type=nonnegative_float, default=None,
                   help="seconds; start no new point after this (the rest is marked skipped)")
    p.add_argument("--compile-budget", type=nonnegative_float, default=None,
                   help="seconds of torch.compile time after which the compile provider is skipped")
    p.add_argument("--out", default="out/bench", help="output folder (default out/bench)")
    p.add_argument("--tag", default=None,
                   help="file name stem (default <gpu>-<date>, e.g. h200-2026-11-21)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--plot-by", choices=("auto", "op", "family"), default="auto",
                   help="one PNG per op, or per op family (fwd and bwd in one figure); auto "
                   "(default): per op up to 4 ops, else per family, so a full sweep writes "
                   "3 PNGs (benchmarks/run_gpu.sh keeps its output to 8 files)")
    p.add_argument("--table", choices=("full", "short", "none"), default="full",
                   help="table printed at the end (default full)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--plan", action="store_true",
                   help="print the number of points and a time estimate, then exit")
    p.add_argument("--report", nargs="+", metavar="JSON", default=None,
                   help="no benchmarking: load result JSON file(s) (merged in order), "
                   "print the table and rewrite CSV/plots under --out")
    p.add_argument("--seed", type=int, default=0)
    return p


def _load_reports(paths: list[str]) -> dict:
    """The merged results of ``--report`` files; :class:`UsageError` for a file that is not a
    bench result (a missing one raises ``FileNotFoundError``)."""
    results = []
    for path in paths:
        with bad_input(f"--report {path}: not a bench result JSON", ValueError):
            result = bench_report.load_result(path)
        if not isinstance(result, dict) or not isinstance(result.get("records"), list):
            raise UsageError(f"--report {path}: not a bench result JSON (no 'records' list)")
        results.append(result)
    return bench_report.merge_results(results)


def _selection(args: argparse.Namespace, device: str) -> tuple[tuple, tuple, tuple, tuple]:
    """(ops, dtypes, sizes, providers) of the command line."""
    dtypes, sizes = args.dtypes, args.sizes
    if args.quick:
        dtypes = dtypes or ",".join(QUICK["dtypes"])
        sizes = sizes or ",".join(str(s) for s in QUICK["sizes"])
    if sizes is None and device == "cpu":
        sizes = "256,1K"  # tiny mode: the CPU path exists for tests and smoke runs
    ops_t, dtypes_t = resolve_ops(args.ops), resolve_dtypes(dtypes)
    sizes_t, prov_t = resolve_sizes(sizes), resolve_providers(args.providers)
    return (() if args.host_latency_only else ops_t), dtypes_t, sizes_t, prov_t


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        result = _load_reports(args.report)
        paths = bench_report.write_outputs(result, args.out, stem=args.tag,
                                           plots=not args.no_plots, plot_by=args.plot_by)
        print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr, flush=True)
        _print_tables(result, args.table)
        return 0
    device = args.device or default_device()
    ops_t, dtypes_t, sizes_t, prov_t = _selection(args, device)
    if args.plan:  # an estimate for a GPU run: the device need not be this machine's
        warmup = args.warmup if args.warmup is not None else 5.0
        rep = args.rep if args.rep is not None else 25.0
        est = plan(ops_t, dtypes_t, sizes_t, prov_t, warmup, rep)
        for k, v in est.items():
            print(f"{k:>16}: {v:.0f}" if isinstance(v, float) else f"{k:>16}: {v}")
        return 0
    device = require_device(device)
    out_dir = Path(args.out)
    state: dict[str, Any] = {}

    def checkpoint(partial: dict) -> None:
        # Keep a JSON of what is done so far: a killed run still leaves its results.
        state["stem"] = state.get("stem") or bench_report.default_stem(partial, args.tag)
        bench_report.write_json(partial, out_dir / f"{state['stem']}.json")

    with torch_threads(cpu_threads(device, args.threads)):
        result = run_sweep(
            ops=ops_t, dtypes=dtypes_t, sizes=sizes_t, providers=prov_t, device=device,
            total=args.total, warmup_ms=args.warmup, rep_ms=args.rep, check=not args.no_check,
            host_latency=not args.no_host_latency, share_compile=not args.separate_compile,
            time_budget_s=args.time_budget, compile_budget_s=args.compile_budget,
            progress=not args.quiet, seed=args.seed, on_point=checkpoint,
        )
    paths = bench_report.write_outputs(result, out_dir, stem=args.tag, plots=not args.no_plots,
                                       plot_by=args.plot_by)
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr, flush=True)
    _print_tables(result, args.table)
    return 0


def _print_tables(result: dict, which: str) -> None:
    if which == "none":
        return
    text = (bench_report.format_short_table(result) if which == "short"
            else bench_report.format_report(result))
    print(text)
