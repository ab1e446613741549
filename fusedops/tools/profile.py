"""Profile a model's forward pass: where the time goes, and what fusing softmax/LayerNorm can buy.

``python -m fusedops profile MODULE:FACTORY`` (``FACTORY()`` returns ``(model, example_inputs)``;
``MODULE`` is a dotted module or a ``path/to/file.py``) or ``python -m fusedops profile`` for the
built-in predictor. The report has:

* a per-op table from ``torch.profiler`` (op, calls per forward, time per forward, share). On a
  GPU the rows are device kernels and the time is device time; on CPU there is no separate
  device, so the rows are the top-level ATen ops and the time is CPU time;
* kernel launches per forward (on CPU: ATen ops per forward, since CPU ops run inline);
* host time vs device time: how much of the forward the GPU sits idle waiting for the host
  (the *dispatch tax*); on CPU, the share of the forward spent outside ATen ops;
* the softmax and LayerNorm share of the forward;
* the fused-vs-native speed-up of each op *measured on the shapes this model actually uses*
  (captured during a forward), and Amdahl's prediction and bound for fusing them.

Every number is measured on this machine in this run.

The pieces: :mod:`~fusedops.tools.profile_target` (loading and calling the model),
:mod:`~fusedops.tools.profile_ops` (op categories, captured calls, profiler events) and
:mod:`~fusedops.tools.profile_speedups` (fused vs native on the captured shapes) and
:mod:`~fusedops.tools.profile_format` (the terminal report). This module runs the profiler, is
the command line and re-exports their public names.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fusedops.tools import _report, amdahl
from fusedops.tools.cli import (
    UsageError,
    bad_input,
    nonnegative_int,
    positive_int,
    torch_threads,
)
from fusedops.tools.profile_format import format_profile
from fusedops.tools.profile_ops import (
    CATEGORIES,
    FORWARD_RANGE,
    FUSED_OPS,
    capture_calls,
    categorize,
    is_device_event,
    is_device_work,
    short_name,
    union_us,
)
from fusedops.tools.profile_speedups import measure_op_speedups
from fusedops.tools.profile_target import call_model, load_target, model_device, move_inputs

__all__ = [
    "CATEGORIES", "FORWARD_RANGE", "FUSED_OPS", "annotate_fused_calls", "call_model",
    "capture_calls", "categorize", "format_profile", "load_target", "main",
    "measure_op_speedups", "model_device", "move_inputs", "profile_model", "short_name",
]


# ----------------------------------------------------------------------------------------------
# the profiler run


@contextlib.contextmanager
def annotate_fused_calls() -> Iterator[None]:
    """While active, each fusedops forward call shows in the profiler as one range named
    ``fusedops::<op>_forward`` (``softmax``, ``softmax_masked``, ``layer_norm``,
    ``layer_norm_epilogue``; so a reference-backend op is not mistaken for loose
    elementwise ops). Restores everything on exit."""
    from fusedops.ops import layernorm as ln_mod
    from fusedops.ops import softmax as sm_mod

    saved = []
    # The epilogue paths (fused_softmax with scale/mask/causal, fused_layernorm with residual/
    # dropout/activation) are entered through the names the op modules imported.
    for mod, label, attrs in (
            (sm_mod, "fusedops::softmax_forward", ("_forward_rows", "_forward_inference")),
            (sm_mod, "fusedops::softmax_masked_forward", ("masked_softmax",)),
            (ln_mod, "fusedops::layer_norm_forward", ("_forward_rows", "_forward_inference")),
            (ln_mod, "fusedops::layer_norm_epilogue_forward", ("layernorm_epilogue",))):
        # _forward_inference may call _forward_rows: only the outermost range is opened.
        active = [False]
        for attr in attrs:
            original = getattr(mod, attr, None)
            if original is None:
                continue

            def wrapped(*args, _original=original, _label=label, _active=active):
                if _active[0]:
                    return _original(*args)
                _active[0] = True
                try:
                    with torch.profiler.record_function(_label):
                        return _original(*args)
                finally:
                    _active[0] = False

            saved.append((mod, attr, original))
            setattr(mod, attr, wrapped)
    try:
        yield
    finally:
        for mod, attr, original in saved:
            setattr(mod, attr, original)


def _run_profiler(model, inputs, device, iters):
    """``iters`` forwards under ``torch.profiler`` (each in a :data:`FORWARD_RANGE` range):
    (the profiler, wall seconds)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with torch.no_grad(), annotate_fused_calls(), _report.filter_native_stderr(), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        _report.sync(device)
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(iters):
                with record_function(FORWARD_RANGE):
                    call_model(model, inputs)
            _report.sync(device)
            wall = time.perf_counter() - t0
    return prof, wall


def _time_forward(model: nn.Module, inputs: Any, device: torch.device, reps: int
                  ) -> tuple[dict, dict]:
    """Unprofiled wall time (synchronised) and host issue time per forward: (wall, host)
    summaries; host is wall where there is no separate device."""
    with torch.no_grad():
        wall_s = _report.time_calls(lambda: call_model(model, inputs), device, reps=reps,
                                    warmup=1)
        host_s = []
        if _report.is_gpu(device):
            for _ in range(reps):
                _report.sync(device)
                t0 = time.perf_counter()
                call_model(model, inputs)
                host_s.append(time.perf_counter() - t0)
            _report.sync(device)
    wall = _report.summarize(wall_s)
    return wall, (_report.summarize(host_s) if host_s else wall)


def _op_table(events: list, device: torch.device, wall_ms: float) -> dict:
    """Per-op rows, categories and busy time per forward from the profiler's events."""
    forwards = [e for e in events if e.name == FORWARD_RANGE and not is_device_event(e)]
    n_fwd = max(1, len(forwards))
    top_level = [c for f in forwards for c in f.cpu_children]
    cpu_ops = [e for e in events if not is_device_event(e) and e.name != FORWARD_RANGE
               and not e.is_user_annotation and e.name.startswith(("aten::", "fusedops::"))]
    device_events = [e for e in events if is_device_work(e)]
    gpu = bool(device_events) and _report.is_gpu(device)
    profiled_fwd_ms = sum(f.cpu_time_total for f in forwards) / 1e3 / n_fwd

    grouped: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    if gpu:
        for e in device_events:
            g = grouped[e.name]
            g[0] += 1
            g[1] += e.time_range.elapsed_us()
        busy_ms = union_us([(e.time_range.start, e.time_range.end)
                            for e in device_events]) / 1e3 / n_fwd
        forward_ms = wall_ms
        launches = len(device_events) / n_fwd
        basis = "device (GPU kernel) time; share = % of the forward's wall time"
        launch_kind = "device kernels + memcpy/memset per forward"
    else:
        for e in top_level:
            g = grouped[e.name]
            g[0] += 1
            g[1] += e.cpu_time_total
        busy_ms = sum(e.cpu_time_total for e in top_level) / 1e3 / n_fwd
        forward_ms = profiled_fwd_ms
        launches = len(top_level) / n_fwd
        basis = ("CPU time (no separate device: the CPU runs the ops inline); share = % of the "
                 "profiled forward's wall time")
        launch_kind = "top-level ATen ops per forward (CPU has no kernel launches)"

    rows = []
    for name, (count, us) in grouped.items():
        ms = us / 1e3 / n_fwd
        rows.append({"op": name, "name": short_name(name), "category": categorize(name),
                     "calls": count / n_fwd, "ms": ms,
                     "share": ms / forward_ms if forward_ms > 0 else 0.0})
    rows.sort(key=lambda r: -r["ms"])
    categories = {c: {"ms": 0.0, "share": 0.0, "calls": 0.0} for c in CATEGORIES}
    for r in rows:
        cat = categories[r["category"]]
        cat["ms"] += r["ms"]
        cat["share"] += r["share"]
        cat["calls"] += r["calls"]
    return {"gpu": gpu, "n_fwd": n_fwd, "rows": rows, "categories": categories,
            "busy_ms": busy_ms, "forward_ms": forward_ms, "launches": launches, "basis": basis,
            "launch_kind": launch_kind, "profiled_fwd_ms": profiled_fwd_ms,
            "aten_ops": len(cpu_ops) / n_fwd}


def _dispatch_tax(gpu: bool, host_ms: float, busy_ms: float, forward_ms: float) -> dict:
    """How much of the forward runs no op: GPU idle time, or (CPU) time outside ATen ops."""
    outside_ms = max(0.0, forward_ms - busy_ms)
    tax = outside_ms / forward_ms if forward_ms > 0 else 0.0
    if gpu:
        return {
            "host_ms": host_ms,
            "device_busy_ms": busy_ms,
            "wall_ms": forward_ms,
            "gpu_idle_ms": outside_ms,
            "tax": tax,
            "note": "tax = share of the forward's wall time the GPU is idle (not running any "
                    "kernel), i.e. waiting on Python/dispatch/launch overhead",
        }
    return {
        "host_ms": forward_ms,
        "device_busy_ms": None,
        "aten_ms": busy_ms,
        "wall_ms": forward_ms,
        "outside_ops_ms": outside_ms,
        "tax": tax,
        "note": "CPU: device time = CPU time, there is no separate device to sit idle; tax = "
                "share of the forward spent outside ATen ops (Python, module calls, "
                "dispatcher, profiler overhead)",
    }


def profile_model(
    model: nn.Module,
    example_inputs: Any,
    *,
    iters: int = 10,
    warmup: int = 3,
    timing_reps: int = 30,
    measure_speedups: bool = True,
    op_speedups: dict | None = None,
    speedup_reps: int = 15,
    label: str = "model",
    quiet: bool = False,
) -> dict:
    """Profile ``model``'s forward (eval mode, no grad) on ``example_inputs``.

    Args:
        iters: forwards recorded by ``torch.profiler`` (per-forward numbers are averages).
        warmup: forwards run first and not measured.
        timing_reps: forwards timed without the profiler for the wall / host times.
        measure_speedups: capture the softmax/layer_norm calls of one forward and time fused vs
            native on those shapes (needs the *unpatched* model); gives the Amdahl prediction.
        op_speedups: reuse a previous :func:`measure_op_speedups` result instead.

    Returns:
        A JSON-able dict; see ``docs/workflow.md`` ("Reading the profile") for every field.
    """
    device = model_device(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(warmup):
                call_model(model, example_inputs)
        _report.sync(device)

        calls = capture_calls(model, example_inputs) if measure_speedups else []
        if measure_speedups and op_speedups is None and calls:
            op_speedups = measure_op_speedups(calls, device, reps=speedup_reps, quiet=quiet)
        wall, host = _time_forward(model, example_inputs, device, timing_reps)
        prof, _ = _run_profiler(model, example_inputs, device, iters)
    finally:
        model.train(was_training)

    t = _op_table(list(prof.events()), device, wall["median_ms"])
    categories = t["categories"]
    fractions = {op: categories[op]["share"] for op in FUSED_OPS}
    report: dict = {
        "label": label,
        "device": device.type,
        "time_basis": t["basis"],
        "iters": t["n_fwd"],
        "forward_ms": t["forward_ms"],
        "latency": wall,
        "profiled_forward_ms": t["profiled_fwd_ms"],
        "busy_ms": t["busy_ms"],
        "launches_per_forward": t["launches"],
        "launch_kind": t["launch_kind"],
        "aten_ops_per_forward": t["aten_ops"],
        "dispatch": _dispatch_tax(t["gpu"], host["median_ms"], t["busy_ms"], t["forward_ms"]),
        "ops": t["rows"],
        "categories": categories,
        "softmax_layernorm_share": sum(fractions.values()),
        "fractions": fractions,
        "captured_calls": calls,
    }
    if op_speedups:
        report["op_speedups"] = op_speedups
        speedups = {op: v["speedup"] for op, v in op_speedups["ops"].items()}
        report["amdahl"] = amdahl.predict(t["forward_ms"], fractions, speedups)
        report["amdahl"]["fused_kernels"] = {op: v["fused"] for op, v in
                                             op_speedups["ops"].items()}
    return report


# ----------------------------------------------------------------------------------------------
# CLI


def _builtin(args) -> tuple[nn.Module, Any, str]:
    from fusedops.models import Predictor, get_preset, load_checkpoint, task_for

    preset = get_preset(args.preset)
    if args.checkpoint:
        model, meta = load_checkpoint(args.checkpoint)
        task = meta["task"] or task_for(model.config)
        label = f"Predictor from {args.checkpoint}"
    else:
        torch.manual_seed(0)
        model = Predictor(preset.config)
        task = task_for(model.config)
        label = f"Predictor (preset {preset.name}, untrained)"
    batch = args.batch or preset.batch_size
    x, mask, _ = task.sample(batch, task.generator(3), full_length=True)
    return model, (x, mask), label


def build_parser() -> argparse.ArgumentParser:
    from fusedops.models import PRESETS

    parser = argparse.ArgumentParser(
        prog="python -m fusedops profile",
        description="Per-op profile, dispatch tax, softmax/LayerNorm share and Amdahl bound.",
    )
    parser.add_argument("target", nargs="?", default=None,
                        help="MODULE:FACTORY returning (model, example_inputs); MODULE may be a "
                             "dotted module or a .py path. Default: the built-in predictor.")
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS),
                        help="built-in predictor preset (default: gpu on a GPU, else cpu)")
    parser.add_argument("--checkpoint", help="built-in predictor checkpoint to load")
    parser.add_argument("--batch", type=positive_int, help="built-in predictor batch size")
    parser.add_argument("--device", help="cuda, mps or cpu (default: best present)")
    parser.add_argument("--dtype", help="cast model and float inputs (float32/bfloat16/float16; "
                        "built-in predictor on a GPU: the preset's dtype)")
    parser.add_argument("--iters", type=positive_int, default=10, help="profiled forwards")
    parser.add_argument("--reps", type=positive_int, default=30,
                        help="timed forwards (no profiler)")
    parser.add_argument("--top", type=nonnegative_int, default=12, help="rows of the op table")
    parser.add_argument("--no-speedups", action="store_true",
                        help="skip timing fused vs native on the captured shapes")
    parser.add_argument("--patch", action="store_true",
                        help="then patch_model and profile again (before/after)")
    parser.add_argument("--json", help="write the report(s) as JSON here")
    parser.add_argument("--threads", type=positive_int,
                        help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def _load(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, Any, str]:
    """(model on ``device`` in ``--dtype``, inputs likewise, label); :class:`UsageError` for a
    target or checkpoint that does not load."""
    if args.preset is None:
        args.preset = "gpu" if _report.is_gpu(device) else "cpu"
    if args.target in (None, "predictor"):
        with bad_input(f"--checkpoint {args.checkpoint}"):
            model, inputs, label = _builtin(args)
        if args.dtype is None and _report.is_gpu(device):
            from fusedops.models import get_preset

            args.dtype = get_preset(args.preset).dtype  # what the demo runs it in
    else:
        if ":" not in args.target:
            raise UsageError(f"target {args.target!r}: expected MODULE:FACTORY (a dotted module "
                             "or a path/to/file.py, a colon, then the factory's name)")
        with bad_input(f"target {args.target!r} does not load"):
            model, inputs = load_target(args.target)
        label = args.target
    dtype = _report.dtype_from_name(args.dtype) if args.dtype else None
    model = model.to(device=device, dtype=dtype) if dtype else model.to(device)
    return model, move_inputs(inputs, device, dtype), label


def _patched(args: argparse.Namespace, model: nn.Module, inputs: Any, label: str,
             before: dict) -> dict:
    """patch_model, profile again, print both and the measured speed-up; unpatch after."""
    from fusedops import patch_model, unpatch_model

    report = patch_model(model, example_inputs=inputs)
    print(_report.heading("patch_model"))
    print(report)
    after = profile_model(model, inputs, iters=args.iters, timing_reps=args.reps,
                          measure_speedups=False, label=label + " (patched)", quiet=args.quiet)
    print(_report.heading("after patching"))
    print(format_profile(after, args.top))
    b_ms, a_ms = before["latency"]["median_ms"], after["latency"]["median_ms"]
    speedup = b_ms / a_ms
    print(f"\nmedian forward latency {_report.fmt_ms(b_ms)} -> {_report.fmt_ms(a_ms)}: "
          f"{speedup:.3f}x measured"
          + (f" vs {before['amdahl']['predicted_speedup']:.3f}x predicted"
             if "amdahl" in before else ""))
    unpatch_model(model)
    return {"patch": report.to_dict(), "patched": after, "measured_speedup": speedup}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = _report.pick_device(args.device)
    with torch_threads(args.threads):
        model, inputs, label = _load(args, device)
        info = _report.device_info(device)
        print(_report.heading(f"fusedops profile: {label}"))
        print(f"device: {info['name']} ({device.type}); backends: {info['backends']}")
        if not info["fused_kernels_available"]:
            print("no fused GPU kernel is available on this device: fusedops runs PyTorch's "
                  "own ops here, and patch_model leaves models as they are.")
        before = profile_model(model, inputs, iters=args.iters, timing_reps=args.reps,
                               measure_speedups=not args.no_speedups, label=label,
                               quiet=args.quiet)
        print(format_profile(before, args.top))
        result = {"device": info, "profile": before}
        if args.patch:
            result.update(_patched(args, model, inputs, label, before))
    if args.json:
        _report.write_json(args.json, result)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    from fusedops.__main__ import run_command

    raise SystemExit(run_command("profile"))
