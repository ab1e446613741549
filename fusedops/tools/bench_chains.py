"""Benchmark of the fused epilogue chains: ``python -m fusedops bench-chains``.

Each chain is timed three ways on the same data in the same process:

* ``fusedops``: one fused call (``fused_softmax(..., scale=, mask=, causal=)`` or
  ``fused_layernorm(..., residual=, dropout_p=, activation=)``);
* ``eager``: the unfused chain of torch ops a user writes today (:func:`make_eager`);
* ``compile``: ``torch.compile(dynamic=False)`` of that same eager chain, compiled afresh for
  every point (``torch._dynamo.reset()``), its first-call time reported as ``compile_s``.

Chains (:data:`CHAINS`): ``attn_softmax`` (``softmax(x * scale + mask)``, additive float padding
mask ``(B, 1, 1, S)``), ``attn_softmax_causal`` (the same plus the causal triangle),
``add_layernorm`` (``s = x + r; y = layer_norm(s)``, returning ``(y, s)``),
``layernorm_dropout_relu`` and ``add_layernorm_dropout_gelu`` (dropout p = 0.1, training).

Modes: ``fwd`` (forward under ``torch.no_grad()``; dropout still on, ``training=True``) and
``fwd_bwd`` (forward with grad enabled plus ``torch.autograd.grad`` of every output with a fixed
upstream gradient, into x, the residual, the weight and the bias: what a training step pays for
the chain, including what each forward saves for its backward).

Bytes (:func:`bytes_terms`): the fused *floor* (each input read once, each output written once)
and the eager chain's sum of per-op floors (dropout's bool mask included). TB/s is always the
*fused floor* / time, for every provider, so the providers compare on one scale; ``own_tbps`` is
each provider's own floor / time where it is known (fusedops, eager).

Correctness: the fused chain and the eager chain are compared on the same data with dropout
p forced to 0 (their random masks differ otherwise): outputs in ``fwd``, outputs and gradients
in ``fwd_bwd``. ReLU's gradient jumps at 0, so where the pre-activation is within rounding of 0
two correct implementations can take opposite sides (a *tie*) and their gradients differ at that
element by the whole upstream gradient; the ReLU chain's gradients are therefore compared with an
eager reference that keeps exactly the elements the fused forward kept, and the elements where
that differs from eager's own ReLU are counted (``relu_ties``) and must all lie within rounding
of 0 (:func:`relu_tie_reference`). The dropout itself is checked separately on the fused
forward with p = 0.1: every element must be either 0 (dropped) or ``act(layer_norm(s) / (1 -
p))`` (kept), and the dropped fraction must be p within sampling noise.

Timing, device name, versions and the copy bandwidth come from
:mod:`fusedops.tools.bench_harness` (``triton.testing.do_bench`` medians with an L2 flush before
each call on CUDA, a synchronised ``time.perf_counter`` loop elsewhere; on CPU one thread unless
``--threads`` says otherwise, and the table says that fusedops runs its reference path there).
On CUDA every record also has ``ms_gpu``, the GPU's own
time with the host far ahead (:meth:`fusedops.tools.bench_harness.Timer.gpu_ahead`), and
``speedup_gpu`` from it: where a provider's host time per call exceeds its GPU time (a
fwd_bwd step through Python autograd at 16K rows of 768), ``ms`` is the host's and ``ms_gpu``
what the kernels take once the host keeps ahead (inside a larger model, or under CUDA graphs).

The pieces: :mod:`~fusedops.tools.chains_model` (the chains, their data, byte models and the
names the command line accepts), :mod:`~fusedops.tools.chains_check` (one step, comparisons,
ReLU ties, the dropout check), :mod:`~fusedops.tools.chains_run` (:func:`run_chains`) and
:mod:`~fusedops.tools.chains_report` (CSV, table, plot). This module is the command line and
re-exports their public names.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fusedops.tools.bench_harness import (
    CHECK_TOL,
    DTYPES,
    cpu_threads,
    positive_size,
    rel_error,
    require_device,
)
from fusedops.tools.bench_report import write_json
from fusedops.tools.chains_check import (
    RELU_TIE_TOL,
    Step,
    as_tuple,
    compare,
    dropout_check,
    grad_out,
    relu_tie_reference,
    run_mode,
)
from fusedops.tools.chains_model import (
    ATTN_SIZES,
    BYTES_MODEL,
    CHAIN_GROUPS,
    CHAIN_LIST,
    CHAINS,
    CPU_ATTN_SIZES,
    CPU_LN_SIZES,
    CPU_ROWS,
    DEFAULT_DTYPES,
    DROPOUT_P,
    EPS,
    HEAD_DIM,
    LN_SIZES,
    MODES,
    PROVIDERS,
    ROWS,
    SCALE,
    Chain,
    bytes_moved,
    bytes_terms,
    format_shape,
    make_eager,
    make_fused,
    make_inputs,
    parse_shape,
    resolve_chains,
    resolve_dtypes,
    resolve_modes,
    resolve_providers,
    resolve_sizes,
)
from fusedops.tools.chains_report import (
    CSV_FIELDS,
    default_stem,
    format_table,
    plot_speedups,
    write_csv,
    write_outputs,
)
from fusedops.tools.chains_run import annotate_speedups, run_chains
from fusedops.tools.cli import nonnegative_float, positive_int, torch_threads

__all__ = [
    "ATTN_SIZES", "BYTES_MODEL", "CHAINS", "CHAIN_GROUPS", "CHAIN_LIST", "CHECK_TOL",
    "CPU_ATTN_SIZES", "CPU_LN_SIZES", "CPU_ROWS", "CSV_FIELDS", "DEFAULT_DTYPES", "DROPOUT_P",
    "DTYPES", "EPS", "HEAD_DIM", "LN_SIZES", "MODES", "PROVIDERS", "RELU_TIE_TOL", "ROWS",
    "SCALE", "Chain", "Step", "annotate_speedups", "as_tuple", "build_parser", "bytes_moved",
    "bytes_terms", "compare", "default_stem", "dropout_check", "format_shape", "format_table",
    "grad_out", "main", "make_eager", "make_fused", "make_inputs", "parse_shape",
    "plot_speedups", "rel_error", "relu_tie_reference", "resolve_chains", "resolve_dtypes",
    "resolve_modes", "resolve_providers", "resolve_sizes", "run_chains", "run_mode",
    "write_csv", "write_outputs",
]

# The names these had when they lived in this module; the probes under benchmarks/dev still use
# them. New code: Step, run_mode, grad_out.
_Step, _run, _grad_out = Step, run_mode, grad_out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fusedops bench-chains",
        description="Benchmark the fused epilogue chains (scale + mask (+ causal) + softmax; "
        "residual + LayerNorm + dropout + activation) against the unfused eager chain and "
        "torch.compile of it: bytes moved, time, TB/s, fraction of copy bandwidth, speedups, "
        "correctness; JSON/CSV/TXT/PNG under --out.",
    )
    p.add_argument("--device", choices=("cuda", "mps", "cpu"), default=None,
                   help="default: cuda if available, else mps, else cpu (tiny sizes)")
    p.add_argument("--chains", default=None,
                   help=f"comma list of {', '.join(CHAINS)}, or attn / ln (default all)")
    p.add_argument("--dtypes", default=None,
                   help="comma list of bf16,fp16,fp32 or all (default bf16,fp32)")
    p.add_argument("--sizes", default=None,
                   help="comma list of shapes: N or MxN for the LayerNorm chains (N alone: M = "
                   "--rows), BxHxS for the attention chains; a kind with no entry keeps its "
                   "default (LN: 16384 x 768,1K,2K,4K,8K; attention: 8x12x512,4x16x1024,"
                   "2x16x2048)")
    p.add_argument("--rows", type=positive_size, default=None,
                   help="M for LayerNorm sizes given as N (default 16384; 64 on cpu)")
    p.add_argument("--modes", default=None, help="fwd, fwd_bwd or both (default both)")
    p.add_argument("--providers", default=None,
                   help=f"comma list of {', '.join(PROVIDERS)} (default all)")
    p.add_argument("--warmup", type=nonnegative_float, default=None,
                   help="warm-up ms per measurement")
    p.add_argument("--rep", type=nonnegative_float, default=None,
                   help="measurement ms per measurement")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads while timing (torch.set_num_threads); default 1 on cpu, "
                   "where several threads make single calls wait on the scheduler")
    p.add_argument("--budget", type=nonnegative_float, default=None,
                   help="seconds; start no new point after this (the rest is listed as skipped)")
    p.add_argument("--compile-budget", type=nonnegative_float, default=None,
                   help="seconds of compiling after which the compile provider is skipped")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend (default inductor; 'eager' for a dry run)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness comparison")
    p.add_argument("--out", default="out/bench-chains",
                   help="output folder (default out/bench-chains)")
    p.add_argument("--tag", default=None,
                   help="file name stem (default chains-<gpu>-<date>)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = require_device(args.device)
    chains = resolve_chains(args.chains)
    dtypes = resolve_dtypes(args.dtypes)
    modes = resolve_modes(args.modes)
    providers = resolve_providers(args.providers)
    sizes = resolve_sizes(args.sizes, args.rows, device)
    out_dir = Path(args.out)
    state: dict[str, Any] = {}

    def checkpoint(partial: dict) -> None:
        # Keep a JSON of what is done so far: a killed run still leaves its results.
        state["stem"] = state.get("stem") or default_stem(partial, args.tag)
        write_json(partial, out_dir / f"{state['stem']}.json")

    flat_sizes = list(sizes["ln"]) + list(sizes["attn"])
    with torch_threads(cpu_threads(device, args.threads)):
        result = run_chains(
            chains=chains, dtypes=dtypes, sizes=flat_sizes, modes=modes, providers=providers,
            device=device, rows=args.rows, warmup_ms=args.warmup, rep_ms=args.rep,
            check=not args.no_check, time_budget_s=args.budget,
            compile_budget_s=args.compile_budget, compile_backend=args.compile_backend,
            progress=not args.quiet, seed=args.seed, on_point=checkpoint,
        )
    paths = write_outputs(result, out_dir, stem=state.get("stem") or args.tag,
                          plot=not args.no_plot)
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr, flush=True)
    print(format_table(result))
    return 0


if __name__ == "__main__":
    from fusedops.__main__ import run_command

    sys.exit(run_command("bench-chains"))
