"""``python -m fusedops demo``: the measure-first workflow on the built-in predictor, end to end.

train (or load) -> profile -> ``patch_model`` -> verify -> re-profile -> latency before/after ->
measured speed-up vs Amdahl's prediction -> ``torch.compile`` break-even.

Writes ``report.json``, ``ops_breakdown.png`` and ``latency.png`` under ``--out`` (the PNGs need
matplotlib, the ``tools`` extra; without it they are skipped with one line). On a machine
without a fused GPU kernel it still runs end to end (reference backend) and says so instead of
claiming a speed-up. Every number it prints is measured in this run.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import time
from dataclasses import dataclass

import torch

from fusedops.tools import _report
from fusedops.tools.amdahl import combined as amdahl_combined
from fusedops.tools.cli import bad_input, can_plot, positive_int, torch_threads
from fusedops.tools.demo_checks import compile_break_even, interleaved_latency, quantile, verify
from fusedops.tools.profile import call_model, format_profile, profile_model

__all__ = ["compile_break_even", "interleaved_latency", "main", "run_demo", "verify"]


def _say(text: str = "", quiet: bool = False) -> None:
    if not quiet:
        print(text, flush=True)


@dataclass
class _Setup:
    """Where and how the demo runs."""

    dev: torch.device
    preset: str
    batch: int
    out: str
    checkpoint: str
    inf_dtype: torch.dtype
    info: dict
    fused_available: bool
    quiet: bool

    def say(self, text: str = "") -> None:
        _say(text, self.quiet)


def _setup(preset, device, out, checkpoint, dtype, batch, quiet) -> _Setup:
    from fusedops.models import get_preset

    dev = _report.pick_device(device)
    preset = preset or ("gpu" if dev.type == "cuda" else "cpu")
    p = get_preset(preset)
    out = out or f"fusedops-demo-{preset}"
    os.makedirs(out, exist_ok=True)
    checkpoint = checkpoint or os.path.join(out, f"predictor-{preset}.pt")
    inf_dtype = _report.dtype_from_name(dtype or p.dtype)
    if dev.type == "cpu" and inf_dtype != torch.float32 and dtype is None:
        inf_dtype = torch.float32  # the preset's GPU dtype is slow and pointless on CPU
    info = _report.device_info(dev)
    fused_available = info["backends"].get(str(inf_dtype).replace("torch.", "")) != "reference"
    info["fused_kernels_available"] = fused_available
    info["inference_dtype"] = str(inf_dtype).replace("torch.", "")
    s = _Setup(dev, preset, batch or p.batch_size, out, checkpoint, inf_dtype, info,
               fused_available, quiet)
    s.say(_report.heading(f"fusedops demo: predictor, preset {preset}, on {dev.type}"))
    s.say(f"device: {info['name']} ({dev.type}); torch {info['torch']}; fusedops backend for "
          f"{info['inference_dtype']}: {info['backends'].get(info['inference_dtype'])}")
    if not fused_available:
        s.say("NOTE: the speed-up needs a GPU. No fused kernel runs on this device, so "
              "patch_model leaves the model as it is (its report says so) and both profiles "
              "run PyTorch's own ops: this run shows the workflow and claims no speed-up. On "
              "CUDA (Triton) or an Apple GPU (Metal) the same command measures the fused "
              "kernels.")
    return s


def _model_step(s: _Setup, train_steps: int | None, retrain: bool):
    """1. train or load: (model, task, train_info, train_mean, inputs)."""
    from fusedops.tools.train import format_metrics, train_or_load

    s.say(_report.heading("1. model"))
    if os.path.exists(s.checkpoint) and not retrain:
        from fusedops.models import load_checkpoint

        with bad_input(f"checkpoint {s.checkpoint} does not load"):
            load_checkpoint(s.checkpoint)
    model, task, train_info = train_or_load(s.preset, s.dev, s.checkpoint, steps=train_steps,
                                            retrain=retrain, quiet=s.quiet)
    train_mean = (train_info.get("train") or {}).get("train_mean") or \
        (train_info.get("saved_info") or {}).get("train_mean")
    model = model.to(device=s.dev, dtype=s.inf_dtype).eval()
    x, mask, _ = task.sample(s.batch, task.generator(3))
    inputs = (x.to(s.dev, s.inf_dtype), mask.to(s.dev))
    s.say(f"{train_info['source']} {s.checkpoint}: {model.num_parameters():,} parameters, "
          f"config {model.config.to_dict()}")
    s.say(f"held-out: {format_metrics(train_info['heldout'])}")
    s.say(f"workload: batch {s.batch} x seq {task.max_len} x features {task.n_features}, "
          f"{s.info['inference_dtype']}, inference (eval, no grad)")
    return model, task, train_info, train_mean, inputs


def _verify_step(s: _Setup, model, patched_model, task, inputs, train_mean) -> dict:
    """4. verification."""
    from fusedops.tools.train import format_metrics

    s.say(_report.heading("4. verification"))
    ver = verify(model, patched_model, task, inputs, s.inf_dtype, train_mean, s.quiet)
    s.say(f"held-out outputs: max abs diff {ver['max_abs_diff']:.3g}, max rel diff "
          f"{ver['max_rel_diff']:.3g} ({ver['outputs_compared']} outputs); the unpatched "
          f"model's own {ver['dtype']} rounding noise: {ver['dtype_noise_abs']:.3g} abs")
    s.say(f"gradients: max abs diff {ver['grad_max_abs_diff']:.3g}, max rel diff "
          f"{ver['grad_max_rel_diff']:.3g}")
    s.say(f"held-out before: {format_metrics(ver['heldout_before'])}")
    s.say(f"held-out after:  {format_metrics(ver['heldout_after'])}")
    s.say(f"fused-kernel calls per forward: {ver['fused_calls_per_forward'] or 'none'}"
          + ("" if s.fused_available else " (reference backend: nothing runs on a fused kernel)"))
    s.say(f"verification {'PASSED' if ver['passed'] else 'FAILED'} ({ver['criterion']})")
    return ver


def _latency_step(s: _Setup, model, patched_model, inputs, rounds: int, per_round: int):
    """6. end-to-end latency, baseline and patched interleaved: (samples, base, patched,
    per-round ratios)."""
    s.say(_report.heading("6. end-to-end latency"))
    with torch.no_grad():
        samples, rounds_med = interleaved_latency(
            {"baseline": lambda: call_model(model, inputs),
             "patched": lambda: call_model(patched_model, inputs)},
            s.dev, rounds, per_round, quiet=s.quiet, label="timing baseline vs patched")
    base_lat = _report.summarize(samples["baseline"])
    pat_lat = _report.summarize(samples["patched"])
    ratios = [r["baseline"] / r["patched"] for r in rounds_med]
    for name, lat in (("baseline (eager)", base_lat), ("patched (fused eager)", pat_lat)):
        s.say(f"{name:<22} median {_report.fmt_ms(lat['median_ms'])}  p10-p90 "
              f"{_report.fmt_ms(lat['p10_ms'])}-{_report.fmt_ms(lat['p90_ms'])}  "
              f"(n={lat['n']})")
    return samples, base_lat, pat_lat, ratios


def _amdahl(before: dict, after: dict, base_lat: dict) -> dict:
    """The profile's Amdahl prediction applied to the measured baseline, and the same law with
    the op speed-ups seen inside the model."""
    am = dict(before.get("amdahl") or {})
    if not am:
        return am
    am["baseline_ms"] = base_lat["median_ms"]
    am["predicted_ms"] = base_lat["median_ms"] / am["predicted_speedup"]
    am["bound_ms"] = (base_lat["median_ms"] / am["bound_speedup"]
                      if math.isfinite(am["bound_speedup"]) else 0.0)
    am["profile_forward_ms"] = before["forward_ms"]
    am["basis"] = ("fractions from the unpatched profile; op speed-ups measured fused vs "
                   "native on the model's captured shapes; applied to the median baseline "
                   "latency of step 6")
    # The same law with the op speed-ups observed inside the model (re-profile), and how
    # the time outside any op (GPU idle / host overhead) moved: the two usual reasons a
    # measurement departs from the microbenchmark-based prediction.
    in_model = {}
    for op in am["fractions"]:
        b_ms, a_ms = before["categories"][op]["ms"], after["categories"][op]["ms"]
        if b_ms > 0 and a_ms > 0:
            in_model[op] = b_ms / a_ms
    am["in_model_op_speedups"] = in_model
    am["in_model_predicted_speedup"] = amdahl_combined(
        {op: (f, in_model.get(op, 1.0)) for op, f in am["fractions"].items()})
    tax_b, tax_a = before["dispatch"], after["dispatch"]
    am["idle_ms_before"] = tax_b.get("gpu_idle_ms", tax_b.get("outside_ops_ms"))
    am["idle_ms_after"] = tax_a.get("gpu_idle_ms", tax_a.get("outside_ops_ms"))
    am["host_ms_before"] = tax_b["host_ms"]
    am["host_ms_after"] = tax_a["host_ms"]
    return am


def _measured(s: _Setup, am: dict, base_lat: dict, pat_lat: dict, ratios: list) -> dict:
    """The measured speed-up, its spread over rounds and what may be claimed from it."""
    speedup = base_lat["median_ms"] / pat_lat["median_ms"]
    predicted = am.get("predicted_speedup")
    ratio_to_pred = speedup / predicted if predicted else None
    if s.fused_available:
        if predicted and abs(ratio_to_pred - 1) > 0.10:
            claim = (f"measured {speedup:.3f}x vs predicted {predicted:.3f}x: off by "
                     f"{100 * (ratio_to_pred - 1):+.1f}% (more than 10%; see docs/workflow.md)")
        else:
            claim = f"measured {speedup:.3f}x vs predicted {predicted:.3f}x"
    else:
        claim = ("no fused GPU kernel was available: patch_model left the model as it is, so "
                 f"both runs are PyTorch's own ops and ratio {speedup:.3f}x is noise, not a "
                 "fusion speed-up (the speed-up needs a GPU)")
    return {
        "value": speedup,
        "baseline_median_ms": base_lat["median_ms"],
        "patched_median_ms": pat_lat["median_ms"],
        "round_ratio_median": quantile(ratios, 0.5),
        "round_ratio_p10": quantile(ratios, 0.1),
        "round_ratio_p90": quantile(ratios, 0.9),
        "rounds": len(ratios),
        "predicted": predicted,
        "bound": am.get("bound_speedup"),
        "measured_over_predicted": ratio_to_pred,
        "fused_kernels": s.fused_available,
        "claim": claim,
    }


def _say_amdahl(s: _Setup, am: dict, before: dict, after: dict, measured: dict) -> None:
    """7. measured speed-up vs Amdahl, printed."""
    if am:
        s.say(f"softmax + LayerNorm were {_report.fmt_pct(am['fused_fraction'])} of the forward; "
              f"measured op speed-ups: " + ", ".join(f"{op} {v:.2f}x" for op, v in
                                                     am["op_speedups"].items()))
        s.say(f"Amdahl: predicted {measured['predicted']:.3f}x "
              f"({_report.fmt_ms(am['predicted_ms'])}); bound {am['bound_speedup']:.3f}x")
        s.say("inside the model (re-profile): " + ", ".join(
            f"{op} {before['categories'][op]['ms'] * 1e3:.0f} -> "
            f"{after['categories'][op]['ms'] * 1e3:.0f} us ({v:.2f}x)"
            for op, v in am["in_model_op_speedups"].items())
            + f"; Amdahl with these: {am['in_model_predicted_speedup']:.3f}x")
        idle = "GPU idle" if before["dispatch"].get("device_busy_ms") is not None else \
            "time outside ATen ops"
        s.say(f"{idle} per forward {_report.fmt_ms(am['idle_ms_before'])} -> "
              f"{_report.fmt_ms(am['idle_ms_after'])}; host time per forward "
              f"{_report.fmt_ms(am['host_ms_before'])} -> {_report.fmt_ms(am['host_ms_after'])}")
    s.say(f"measured: {measured['value']:.3f}x "
          f"({_report.fmt_ms(measured['baseline_median_ms'])} -> "
          f"{_report.fmt_ms(measured['patched_median_ms'])}; per-round ratio p10-p90 "
          f"{measured['round_ratio_p10']:.3f}-{measured['round_ratio_p90']:.3f})")
    s.say(measured["claim"])


def _compile_step(s: _Setup, model, patched_model, inputs, pat_lat: dict, rounds: int,
                  per_round: int, skip: bool) -> dict:
    """8. torch.compile break-even."""
    s.say(_report.heading("8. torch.compile break-even"))
    if skip:
        s.say("skipped (--skip-compile)")
        return {"status": "skipped", "reason": "--skip-compile"}
    comp = compile_break_even(model, patched_model, inputs, s.dev, pat_lat["median_ms"],
                              max(4, rounds // 2), per_round, s.quiet)
    if comp["status"] == "ok":
        s.say(f"compile (first call) {comp['first_call_s']:.1f} s; compiled median "
              f"{_report.fmt_ms(comp['latency']['median_ms'])} vs fused eager "
              f"{_report.fmt_ms(comp['fused_eager_latency']['median_ms'])} vs eager baseline "
              f"{_report.fmt_ms(comp['baseline_latency']['median_ms'])} (timed together)")
        s.say(comp["verdict"])
    else:
        s.say(f"torch.compile failed: {comp['error']}")
    return comp


def _write(s: _Setup, report: dict, plots: bool, t_start: float) -> None:
    """report.json and (with matplotlib) the two figures; then the summary."""
    report_path = os.path.join(s.out, "report.json")
    files = [report_path]
    if plots and can_plot():
        from fusedops.tools import _plots

        files += _plots.write_all(report, s.out)
    report["files"] = files
    report["seconds"] = time.perf_counter() - t_start
    _report.write_json(report_path, report)
    base, pat = report["baseline"]["latency"], report["patched"]["latency"]
    comp = report["compile"]
    s.say(_report.heading("summary"))
    s.say(f"latency {_report.fmt_ms(base['median_ms'])} -> {_report.fmt_ms(pat['median_ms'])}; "
          f"{report['measured_speedup']['claim']}")
    if comp.get("status") == "ok":
        s.say(f"compile: {comp['verdict']}")
    s.say(f"wrote {', '.join(files)} ({report['seconds']:.0f} s total)")


def run_demo(
    preset: str | None = None,
    device: str | None = None,
    out: str | None = None,
    checkpoint: str | None = None,
    retrain: bool = False,
    train_steps: int | None = None,
    dtype: str | None = None,
    batch: int | None = None,
    rounds: int = 10,
    per_round: int = 10,
    iters: int = 10,
    skip_compile: bool = False,
    plots: bool = True,
    quiet: bool = False,
) -> dict:
    """Run the demo and return its report (also written to ``out/report.json``)."""
    from fusedops import patch_model

    t_start = time.perf_counter()
    s = _setup(preset, device, out, checkpoint, dtype, batch, quiet)
    model, task, train_info, train_mean, inputs = _model_step(s, train_steps, retrain)
    s.say(_report.heading("2. profile (unpatched)"))
    before = profile_model(model, inputs, iters=iters, label="predictor (unpatched)",
                           quiet=quiet)
    s.say(format_profile(before))
    s.say(_report.heading("3. patch_model"))
    patched_model = copy.deepcopy(model)
    patch_report = patch_model(patched_model, example_inputs=inputs)
    s.say(str(patch_report))
    ver = _verify_step(s, model, patched_model, task, inputs, train_mean)
    s.say(_report.heading("5. re-profile (patched)"))
    after = profile_model(patched_model, inputs, iters=iters, measure_speedups=False,
                          label="predictor (patched)", quiet=quiet)
    s.say(format_profile(after))
    samples, base_lat, pat_lat, ratios = _latency_step(s, model, patched_model, inputs, rounds,
                                                       per_round)
    s.say(_report.heading("7. measured speed-up vs Amdahl"))
    am = _amdahl(before, after, base_lat)
    measured = _measured(s, am, base_lat, pat_lat, ratios)
    _say_amdahl(s, am, before, after, measured)
    comp = _compile_step(s, model, patched_model, inputs, pat_lat, rounds, per_round,
                         skip_compile)
    report = {
        "fusedops_demo": 1,
        "preset": s.preset,
        "device": s.info,
        "model": {"config": model.config.to_dict(), "parameters": model.num_parameters(),
                  "batch": s.batch, "seq_len": task.max_len,
                  "dtype": s.info["inference_dtype"], "task": task.to_dict()},
        "training": {k: v for k, v in train_info.items() if k != "saved_info"},
        "profile": before,
        "patch": patch_report.to_dict(),
        "baseline": {"latency": base_lat, "samples_ms": [x * 1e3 for x in samples["baseline"]],
                     "heldout": ver["heldout_before"]},
        "patched": {"latency": pat_lat, "samples_ms": [x * 1e3 for x in samples["patched"]],
                    "heldout": ver["heldout_after"], "profile": after},
        "verification": ver,
        "amdahl": am,
        "measured_speedup": measured,
        "compile": comp,
    }
    _write(s, report, plots, t_start)
    return report


def build_parser() -> argparse.ArgumentParser:
    from fusedops.models import PRESETS

    parser = argparse.ArgumentParser(
        prog="python -m fusedops demo",
        description="Profile -> patch -> verify -> re-profile the built-in predictor, with "
                    "Amdahl's prediction and the torch.compile break-even.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="model size (default: gpu on CUDA, else cpu)")
    parser.add_argument("--device", help="cuda, mps or cpu (default: best present)")
    parser.add_argument("--out", help="output directory (default fusedops-demo-PRESET)")
    parser.add_argument("--checkpoint", help="checkpoint to load, or to train and save "
                        "(default OUT/predictor-PRESET.pt)")
    parser.add_argument("--retrain", action="store_true", help="train even if it exists")
    parser.add_argument("--train-steps", type=positive_int,
                        help="override the preset's training steps")
    parser.add_argument("--dtype", help="inference dtype (default: the preset's)")
    parser.add_argument("--batch", type=positive_int,
                        help="batch size for profiling and latency")
    parser.add_argument("--rounds", type=positive_int, default=10,
                        help="alternating timing rounds")
    parser.add_argument("--per-round", type=positive_int, default=10,
                        help="forwards timed per round")
    parser.add_argument("--iters", type=positive_int, default=10, help="profiled forwards")
    parser.add_argument("--skip-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--fast", action="store_true",
                        help="smoke-test sizes: few training steps and timing runs")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--threads", type=positive_int,
                        help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--quiet", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.fast:
        args.train_steps = args.train_steps or 40
        args.rounds, args.per_round, args.iters = 4, 5, 3
    with torch_threads(args.threads):
        run_demo(preset=args.preset, device=args.device, out=args.out,
                 checkpoint=args.checkpoint, retrain=args.retrain,
                 train_steps=args.train_steps, dtype=args.dtype, batch=args.batch,
                 rounds=args.rounds, per_round=args.per_round, iters=args.iters,
                 skip_compile=args.skip_compile, plots=not args.no_plots, quiet=args.quiet)
    return 0


if __name__ == "__main__":
    from fusedops.__main__ import run_command

    raise SystemExit(run_command("demo"))
