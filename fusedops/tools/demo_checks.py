"""The demo's measurements beyond the profile: interleaved latency, the patched-vs-unpatched
verification and the ``torch.compile`` break-even (see :mod:`fusedops.tools.demo`)."""

from __future__ import annotations

import copy
import math
import time

import torch

from fusedops.tools import _report
from fusedops.tools.profile_target import call_model


def interleaved_latency(
    fns: dict, device: torch.device, rounds: int, per_round: int, warmup: int = 3,
    quiet: bool = False, label: str = "timing",
) -> tuple[dict, list[dict]]:
    """Time each callable in ``fns`` in alternating rounds (ABBA...) so drifting machine load
    hits all of them alike. Returns ``({name: [seconds per forward]}, [per-round medians])``."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    _report.sync(device)
    samples: dict[str, list[float]] = {n: [] for n in names}
    per_round_medians = []
    progress = _report.Progress(label, rounds, quiet=quiet)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        medians = {}
        for name in order:
            s = _report.time_calls(fns[name], device, reps=per_round, warmup=0)
            samples[name] += s
            medians[name] = sorted(s)[len(s) // 2]
        per_round_medians.append(medians)
        progress.update(r + 1)
    progress.close()
    return samples, per_round_medians


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values``, linearly interpolated."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def max_diffs(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a - b|, max |a - b| / max |b|) in float64."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    return diff, (diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))


def verify(model, patched_model, task, inputs, dtype, train_mean, quiet=False) -> dict:
    """Outputs on the held-out set, held-out metrics and gradients: unpatched vs patched."""
    from fusedops import count_fused_calls
    from fusedops.models import predict, regression_metrics

    x, mask, y = task.heldout(1024)
    # The yardstick: how far the unpatched model itself is from the same weights run in a wider
    # dtype (its own rounding noise). The fused ops must not add more than a few times that.
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    with _report.step("verification: held-out predictions, unpatched vs patched", quiet):
        ref = predict(model, x, mask, dtype=dtype)
        out = predict(patched_model, x, mask, dtype=dtype)
        hi = predict(copy.deepcopy(model).to(wide), x, mask, dtype=wide)
    max_abs, max_rel = max_diffs(out, ref)
    noise_abs, noise_rel = max_diffs(ref, hi)
    before = regression_metrics(ref, y, train_mean)
    after = regression_metrics(out, y, train_mean)

    # One forward + backward on the profiling batch: parameter gradients must match too.
    grads = []
    for m in (model, patched_model):
        m.zero_grad(set_to_none=True)
        m.train(False)
        with count_fused_calls() as counts:
            call_model(m, inputs).float().pow(2).mean().backward()
        grads.append(({n: p.grad.detach().clone() for n, p in m.named_parameters()
                       if p.grad is not None}, dict(counts)))
        m.zero_grad(set_to_none=True)
    (g_ref, _), (g_pat, fused_counts) = grads
    g_abs, worst, g_scale = 0.0, None, 0.0
    for name, g in g_ref.items():
        a, _ = max_diffs(g_pat[name], g)
        g_scale = max(g_scale, g.abs().max().item())
        if a >= g_abs:
            g_abs, worst = a, name
    g_rel = g_abs / g_scale if g_scale > 0 else 0.0
    with torch.no_grad(), count_fused_calls() as fwd_counts:
        call_model(patched_model, inputs)
    scale = ref.abs().max().item()
    allowed = 4 * noise_abs + 1e-6 * scale
    r2_ok = abs(after["r2"] - before["r2"]) <= 0.01
    passed = max_abs <= allowed and r2_ok and set(g_ref) == set(g_pat)
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "outputs_compared": int(out.numel()),
        "max_abs_diff": max_abs,
        "max_rel_diff": max_rel,
        "rel_definition": "max |patched - unpatched| / max |unpatched| over held-out outputs",
        "grad_max_abs_diff": g_abs,
        "grad_max_rel_diff": g_rel,
        "grad_worst_parameter": worst,
        "grad_definition": "max over all parameter gradients of |g_patched - g|, divided by "
                           "the largest |g|; loss = mean(output^2) on the profiling batch",
        "heldout_before": before,
        "heldout_after": after,
        "fused_calls_per_forward": fwd_counts and dict(fwd_counts),
        "fused_calls_forward_backward": fused_counts,
        "dtype_noise_abs": noise_abs,
        "dtype_noise_rel": noise_rel,
        "dtype_noise_definition": f"max |unpatched in {str(dtype).replace('torch.', '')} - "
                                  f"same weights in {str(wide).replace('torch.', '')}|",
        "allowed_abs": allowed,
        "criterion": "max_abs_diff <= 4 x dtype_noise_abs (+1e-6 x max|output|) and held-out "
                     "R^2 within 0.01",
        "passed": bool(passed),
    }


def compile_break_even(model, patched_model, inputs, device, fused_eager_ms, rounds, per_round,
                       quiet=False) -> dict:
    """Compile the unpatched model with torch.compile; time the first call (compilation) and the
    steady state, alternating with fused eager and unpatched eager; break-even against both."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model))
    try:
        with _report.step("torch.compile: first call (compiles)", quiet) as st, \
                torch.no_grad():
            t0 = time.perf_counter()
            call_model(compiled, inputs)
            _report.sync(device)
            first_s = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - report, do not crash the demo
        return {"status": "failed", "error": f"{type(e).__name__}: {e}"[:500]}
    del st
    with torch.no_grad():
        samples, rounds_med = interleaved_latency(
            {"compiled": lambda: call_model(compiled, inputs),
             "patched": lambda: call_model(patched_model, inputs),
             "baseline": lambda: call_model(model, inputs)},
            device, rounds, per_round, quiet=quiet,
            label="timing compiled vs fused eager vs eager")
    lat = _report.summarize(samples["compiled"])
    fused_now = _report.summarize(samples["patched"])
    base_now = _report.summarize(samples["baseline"])
    baseline_ms = base_now["median_ms"]
    compiled_ms = lat["median_ms"]
    # compile time = first call minus one steady compiled call
    compile_s = max(0.0, first_s - compiled_ms / 1e3)
    from fusedops.tools.amdahl import break_even

    be_fused = break_even(compile_s, fused_now["median_ms"], compiled_ms)
    be_base = break_even(compile_s, baseline_ms, compiled_ms)
    if be_fused is None:
        verdict = (f"fused eager wins outright: compiled {compiled_ms:.3g} ms is not faster than "
                   f"fused eager {fused_now['median_ms']:.3g} ms, so compiling never pays off")
    else:
        verdict = (f"against fused eager, compiling pays off after {math.ceil(be_fused):,} "
                   f"inferences ({compile_s:.1f} s of compiling / "
                   f"{fused_now['median_ms'] - compiled_ms:.3g} ms saved per inference)")
    if be_base is None:
        verdict += (f"; compiled is not faster than the unpatched eager baseline "
                    f"({baseline_ms:.3g} ms)")
    else:
        verdict += f"; against unpatched eager after {math.ceil(be_base):,} inferences"
    return {
        "status": "ok",
        "mode": "torch.compile(model) default (inductor), unpatched model",
        "first_call_s": first_s,
        "compile_s": compile_s,
        "latency": lat,
        "samples_ms": [s * 1e3 for s in samples["compiled"]],
        "fused_eager_latency": fused_now,
        "baseline_latency": base_now,
        "fused_eager_ms_step6": fused_eager_ms,
        "speedup_vs_baseline": baseline_ms / compiled_ms,
        "speedup_vs_fused_eager": fused_now["median_ms"] / compiled_ms,
        "break_even_inferences_vs_fused_eager": None if be_fused is None else math.ceil(be_fused),
        "break_even_inferences_vs_baseline": None if be_base is None else math.ceil(be_base),
        "fused_eager_wins_outright": be_fused is None,
        "verdict": verdict,
        "note": "compile time includes Dynamo tracing and Inductor codegen; Inductor's on-disk "
                "caches can make repeated runs compile faster",
    }
