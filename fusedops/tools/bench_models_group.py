"""One group of ``python -m fusedops bench-models``: a model, a mode and a shape with every variant:
first calls and the correctness check, the interleaved timed rounds, the CUDA extras (GPU time,
peak memory), the group's summary row (ratios and their verdicts), and the GPU busy time the
run measures after all of them."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusedops.tools import _model_zoo as zoo
from fusedops.tools import bench_models_timing as timing
from fusedops.tools.bench_models_check import compare
from fusedops.tools.bench_models_common import (
    DTYPES,
    MIN_VERDICT_ROUNDS,
    NOISE,
    RATIOS,
    Options,
    free_memory,
    short_error,
)
from fusedops.tools.bench_models_variants import Variant, reset_weights


@dataclass
class Group:
    """One (model, mode, shape): ``new_tokens`` is set for ``generate`` only."""

    name: str
    mode: str
    batch: int
    tokens: int
    new_tokens: int | None

    @property
    def shape(self) -> str:
        text = f"{self.batch}x{self.tokens}"
        return text + (f"+{self.new_tokens}" if self.new_tokens else "")

    def record(self, variant: str) -> dict:
        """A fresh record of ``variant`` in this group, before anything is measured."""
        return {"model": self.name, "mode": self.mode, "batch": self.batch,
                "tokens": self.tokens, "new_tokens": self.new_tokens, "shape": self.shape,
                "variant": variant, "status": "ok", "error": None}


def _steps_for(v: Variant, group: Group, inputs: dict, opts: Options,
               device: torch.device) -> tuple[Callable[[], Any], Callable[[], list] | None]:
    """The timed step of ``v`` and, for ``train``, its separate correctness pass."""
    if group.mode == "infer":
        return zoo.infer_step(v.model, inputs), None
    if group.mode == "generate":
        return zoo.generate_step(v.model, inputs, opts.new_tokens), None
    amp = None if opts.dtype == "fp32" else DTYPES[opts.dtype]
    autocast = zoo.autocast_for(device, amp)
    assert v.optimizer is not None
    return (zoo.train_step(v.model, inputs, v.optimizer, autocast),
            lambda: zoo.train_check(v.model, inputs, autocast))


def dynamo_counts() -> tuple[int, dict[str, int]]:
    """(graphs dynamo has compiled so far in this process, graph breaks by first line of their
    reason); (0, {}) when dynamo was never imported."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0, {}
    counters = utils.counters
    breaks: dict[str, int] = {}
    for reason, n in counters["graph_break"].items():
        key = str(reason).strip().splitlines()[0][:120] if str(reason).strip() else "?"
        breaks[key] = breaks.get(key, 0) + n
    return int(counters["stats"]["unique_graphs"]), breaks


def _compile_stats(before: tuple[int, dict[str, int]]) -> dict:
    graphs, breaks = dynamo_counts()
    new = {k: n - before[1].get(k, 0) for k, n in breaks.items() if n > before[1].get(k, 0)}
    return {"graphs": graphs - before[0], "graph_breaks": sum(new.values()),
            "graph_break_reasons": dict(sorted(new.items(), key=lambda kv: -kv[1])[:5])}


def first_call(v: Variant, group: Group, inputs: dict, opts: Options, device: torch.device,
               rec: dict) -> tuple[Callable[[], Any], list[torch.Tensor]]:
    """Run ``v``'s correctness pass (``train`` only, timed as ``check_s``) and its first step
    (timed as ``first_call_s``: compilation included for compiled variants); returns the step
    and the outputs to compare. Compiled variants also get ``compile``: the graphs and graph
    breaks dynamo produced meanwhile."""
    sync = timing.sync_fn(device)
    step, check = _steps_for(v, group, inputs, opts, device)
    counts = dynamo_counts() if v.name.startswith("compiled") else None
    outputs = None
    if check is not None:
        t0 = time.perf_counter()
        outputs = check()
        sync()
        rec["check_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = step()
    sync()
    rec["first_call_s"] = time.perf_counter() - t0
    if counts is not None:
        rec["compile"] = _compile_stats(counts)
    return step, outputs if outputs is not None else [out]


def _start_group(variants: Sequence[Variant], group: Group, opts: Options, device: torch.device,
                 proto: nn.Module | None) -> tuple[bool | None, dict]:
    """Every variant back to ``proto``'s weights (whether they came out identical; None without
    ``proto``), fresh compiled graphs, and the group's inputs."""
    same = reset_weights(variants, proto) if proto is not None else None
    if any(v.name.startswith("compiled") for v in variants):
        torch._dynamo.reset()  # fresh, shape-specialised graphs for this group
    vocab = zoo.vocab_size(variants[0].model)
    inputs = zoo.make_inputs(group.name, vocab, group.batch, group.tokens, device,
                             seed=opts.seed, labels=group.mode == "train")
    return same, inputs


def run_group(variants: Sequence[Variant], group: Group, opts: Options, device: torch.device,
              proto: nn.Module | None = None) -> tuple[list[dict], dict]:
    """Correctness check, first calls, interleaved timing, GPU time and peak memory of every
    variant at one (model, mode, shape), all starting from ``proto``'s weights when given.
    Returns (one record per variant, the summary row)."""
    same, inputs = _start_group(variants, group, opts, device, proto)
    records = {v.name: group.record(v.name) for v in variants}
    steps: dict[str, Callable[[], Any]] = {}
    ref: tuple[str, list[torch.Tensor]] | None = None
    for v in variants:
        rec = records[v.name]
        try:
            if v.error:
                raise RuntimeError(v.error)
            step, outputs = first_call(v, group, inputs, opts, device, rec)
        except Exception as exc:
            rec.update(status="error", error=v.error or short_error(exc))
            free_memory(device)
            continue
        if ref is None:
            ref = (v.name, outputs)
        else:
            rec["check"] = compare(outputs, ref[1], ref[0], group.mode, opts.dtype,
                                   opts.new_tokens)
        steps[v.name] = step
        del outputs
    del ref
    free_memory(device)
    generate = group.mode == "generate"
    rounds = opts.gen_rounds if generate else opts.rounds
    warmup = min(opts.warmup, 1) if generate else opts.warmup
    graphs_before = dynamo_counts()[0]
    samples, errors, repeats = timing.time_rounds(steps, timing.sync_fn(device), rounds,
                                                  warmup, opts.min_round_ms / 1e3)
    recompiled = dynamo_counts()[0] - graphs_before
    _fill_timings(records, samples, errors, group)
    live = {n: s for n, s in steps.items() if n not in errors}
    if device.type == "cuda":
        device_extras(live, records, generate, device)
    row = summarize_group(group, records, samples)
    row["weights_identical"] = same
    row["steps_per_round"] = repeats
    row["graphs_compiled_while_timing"] = recompiled
    return list(records.values()), row


def busy_times(variants: Sequence[Variant], group: Group, opts: Options, device: torch.device,
               proto: nn.Module | None = None) -> dict[str, dict]:
    """CUDA: each variant's GPU busy time per step at one (model, mode, shape)
    (:func:`~fusedops.tools.bench_models_timing.kernel_ms`), after its first step and warm-up,
    from ``proto``'s weights when given: ``{variant: {"gpu_busy_ms", "gpu_busy_note"}}``, the
    time None and the note saying why where it failed. Called once every timed round of the
    run is over (the profiler slows later host work)."""
    _, inputs = _start_group(variants, group, opts, device, proto)
    generate = group.mode == "generate"
    warmup = min(opts.warmup, 1) if generate else opts.warmup
    out: dict[str, dict] = {}
    for v in variants:
        try:
            if v.error:
                raise RuntimeError(v.error)
            step, _ = _steps_for(v, group, inputs, opts, device)
            for _ in range(1 + warmup):
                step()
            ms = timing.kernel_ms(step, 1 if generate else timing.KERNEL_STEPS)
            out[v.name] = {"gpu_busy_ms": ms, "gpu_busy_note": None}
        except Exception as exc:
            out[v.name] = {"gpu_busy_ms": None, "gpu_busy_note": f"failed: {short_error(exc)}"}
            free_memory(device)
    return out


def device_extras(steps: dict[str, Callable[[], Any]], records: dict[str, dict],
                  generate: bool, device: torch.device) -> None:
    """CUDA: GPU time (not for ``generate``, whose stopping check waits for the GPU after
    every token) and peak memory of every variant, after its timed rounds."""
    note = None
    if generate:
        note = "generate waits for the GPU after every token: no GPU-only time"
    elif not hasattr(torch.cuda, "_sleep"):
        note = "torch.cuda._sleep is missing: no GPU-only time"
    else:
        host = {n: records[n]["host_ms"]["median"] for n in steps}
        try:
            for name, g in timing.gpu_times(steps, host).items():
                records[name].update(g)
        except Exception as exc:
            note = f"GPU time failed: {short_error(exc)}"
    for name, step in steps.items():
        if note:
            records[name]["gpu_note"] = note
        try:
            peak, total = timing.peak_memory(step, device)
            records[name]["peak_mb"], records[name]["peak_total_mb"] = peak, total
        except Exception as exc:
            records[name]["peak_note"] = f"failed: {short_error(exc)}"
            free_memory(device)


def _fill_timings(records: dict[str, dict], samples: dict[str, list[tuple[float, float]]],
                  errors: dict[str, str], group: Group) -> None:
    for name, got in samples.items():
        rec = records[name]
        if name in errors:
            rec.update(status="error", error=errors[name])
        wall = [w * 1e3 for w, _ in got]
        host = [h * 1e3 for _, h in got]
        rec["wall_ms"] = timing.quantiles(wall)
        rec["host_ms"] = timing.quantiles(host)
        rec["samples_wall_ms"] = wall
        rec["samples_host_ms"] = host
        rec.setdefault("gpu_ms", None)
        median = rec["wall_ms"]["median"]
        if group.new_tokens and median:
            rec["tokens_per_s"] = group.batch * group.new_tokens / (median / 1e3)


def verdict(ratio: float | None, p20: float | None, p80: float | None,
            rounds: int = MIN_VERDICT_ROUNDS) -> str | None:
    """``slower`` / ``faster`` when the ratio of medians is beyond ``1 +- NOISE`` and the
    paired per-round ratios agree (p20 above 1 / p80 below 1), else ``same``; None with fewer
    than :data:`MIN_VERDICT_ROUNDS` paired rounds."""
    if ratio is None or p20 is None or p80 is None or rounds < MIN_VERDICT_ROUNDS:
        return None
    if ratio > 1 + NOISE and p20 > 1:
        return "slower"
    if ratio < 1 - NOISE and p80 < 1:
        return "faster"
    return "same"


def summarize_group(group: Group, records: dict[str, dict],
                    samples: dict[str, list[tuple[float, float]]]) -> dict:
    """The summary row: median wall per variant, each ratio of :data:`RATIOS` (ratio of the
    medians, p20/p80 of the paired per-round ratios, verdict) and the worst check result."""
    ok = {n: r for n, r in records.items()
          if r["status"] == "ok" and (r.get("wall_ms") or {}).get("median")}
    row: dict[str, Any] = {k: v for k, v in group.record("").items()
                           if k not in ("variant", "status", "error")}
    row["wall_ms"] = {n: r["wall_ms"]["median"] for n, r in ok.items()}
    row["errors"] = {n: r["error"] for n, r in records.items() if r["status"] != "ok"}
    row["ratios"] = {}
    for a, b in RATIOS:
        if a in ok and b in ok:
            pairs = zip(samples[a], samples[b], strict=True)  # both ran every round
            paired = [wa / wb for (wa, _), (wb, _) in pairs]
            q = timing.quantiles(paired)
            ratio = ok[a]["wall_ms"]["median"] / ok[b]["wall_ms"]["median"]
            row["ratios"][f"{a}/{b}"] = {
                "ratio": ratio, "p20": q["p20"], "p80": q["p80"], "rounds": len(paired),
                "verdict": verdict(ratio, q["p20"], q["p80"], len(paired))}
    checks = [r["check"] for r in records.values() if r.get("check")]
    rels = [c["max_rel"] for c in checks if "max_rel" in c]
    row["max_rel_diff"] = (math.nan if any(math.isnan(x) for x in rels) else max(rels)) \
        if rels else None
    matches = [c["token_match"] for c in checks if "token_match" in c]
    row["token_match"] = min(matches) if matches else None
    row["check_ok"] = all(c["ok"] for c in checks) if checks else None
    return row
