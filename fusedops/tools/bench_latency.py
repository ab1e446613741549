"""Host latency of small ops: the wall time per call of each provider at shapes too small to
be limited by memory traffic (Python, dispatch and launch costs), part of every
``python -m fusedops bench`` run."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from fusedops.tools.bench_harness import DTYPES, short_error, synchronize
from fusedops.tools.bench_ops import HOST_LATENCY_OPS, HOST_LATENCY_SHAPES, family
from fusedops.tools.bench_providers import PROVIDER_NAMES, all_providers


def _latency_case(device, table, names, fam, op, dtype, shape, x, w, b, warmup, out):
    """The providers' callables of one host-latency case, warmed up: [(record, fn, runs)]."""
    case: list[tuple[dict, Callable, list[float]]] = []
    for name in names:
        prov = table[name]
        rec = {"op": op, "dtype": dtype, "shape": list(shape), "provider": name,
               "backend": None, "us_per_call": None, "us_min": None,
               "delta_vs_torch_us": None, "error": None}
        if prov.unavailable_reason(device, (fam,)) is not None:
            continue
        out.append(rec)
        try:
            fn = prov.make(fam)
            rec["backend"] = prov.backend(x)
            with torch.no_grad():
                for _ in range(warmup):
                    fn(x, w, b)
            synchronize(device)
            case.append((rec, fn, []))
        except Exception as exc:
            rec["error"] = short_error(exc)
    return case


def measure_host_latency(device: str, providers: Sequence[str] | None = None,
                         shapes: Iterable[Sequence[int]] = HOST_LATENCY_SHAPES,
                         ops: Sequence[str] = HOST_LATENCY_OPS, dtype: str = "fp16",
                         calls: int = 2000, repeats: int = 7, warmup: int = 200) -> list[dict]:
    """Wall time per call (µs) of small ops: ``calls`` back-to-back calls after a warm-up,
    synchronising once at the end; the median over ``repeats`` runs is reported with the best.
    The providers of one case take turns run by run, so a host that drifts during the
    measurement moves every provider's runs alike (the same unpatched BERT-base forward took 7.7
    and 11.3 ms in two runs: benchmarks/results/h200/models-generate.json, models.json). The
    compile provider is left out (its guards are a separate story)."""
    table = all_providers()
    names = [p for p in (providers or PROVIDER_NAMES) if p != "compile"]
    if "torch" not in names:
        names.insert(0, "torch")
    tdtype = DTYPES[dtype]
    out: list[dict] = []
    for shape in shapes:
        shape = tuple(int(s) for s in shape)
        n = shape[-1]
        x = torch.randn(shape, device=device, dtype=tdtype)
        w = torch.ones(n, device=device, dtype=tdtype)
        b = torch.zeros(n, device=device, dtype=tdtype)
        for op in ops:
            case = _latency_case(device, table, names, family(op), op, dtype, shape, x, w, b,
                                 warmup, out)
            for _ in range(repeats):
                for rec, fn, runs in case:
                    if rec["error"] is not None:
                        continue
                    try:
                        with torch.no_grad():
                            t0 = time.perf_counter()
                            for _ in range(calls):
                                fn(x, w, b)
                            synchronize(device)
                        runs.append((time.perf_counter() - t0) / calls * 1e6)
                    except Exception as exc:
                        rec["error"] = short_error(exc)
            for rec, _, runs in case:
                if rec["error"] is None and runs:
                    rec["us_per_call"] = statistics.median(runs)
                    rec["us_min"] = min(runs)
            base = next((r["us_per_call"] for r, _, _ in case if r["provider"] == "torch"), None)
            for r, _, _ in case:
                if base is not None and r["us_per_call"] is not None:
                    r["delta_vs_torch_us"] = r["us_per_call"] - base
        del x, w, b
    return out


def host_latency_for_sweep(device: str, providers: Sequence[str], calls: int | None,
                          shapes: Sequence[Sequence[int]]) -> list[dict]:
    """:func:`measure_host_latency` as the sweep runs it: fp16 (fp32 on CPU), 20 calls a run on
    CPU unless ``calls`` says otherwise."""
    if calls is None and device == "cpu":
        calls = 20  # CPU "latency" is compute time; keep test runs short
    kw = {} if calls is None else {"calls": calls, "warmup": max(1, calls // 10), "repeats": 3}
    return measure_host_latency(device, list(providers), shapes=shapes,
                                dtype="fp32" if device == "cpu" else "fp16", **kw)
