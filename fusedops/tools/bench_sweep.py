"""The benchmark sweep behind ``python -m fusedops bench``: :func:`run_sweep`.

Every (dtype, op family, N) point gets fresh random data (:class:`Point`), shared by the
providers and by the family's forward and backward; each provider's output is checked against
torch eager on that data before it is timed, and mismatches are marked in the record. The
device-to-device copy bandwidth is measured first, so every result is also a fraction of it;
small shapes get a separate host-latency measurement (:func:`measure_host_latency`). Every
record also has ``ms_gpu``, on CUDA the GPU's own time with the host far ahead
(:meth:`fusedops.tools.bench_harness.Timer.gpu_ahead`), None elsewhere. An op a provider does
not support (:meth:`~fusedops.tools.bench_providers.Provider.unsupported_reason`) is recorded
as ``status: "skipped"`` with the reason in ``error``, as points past the compile budget are.
"""

from __future__ import annotations

import datetime as _dt
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fusedops.tools.bench_harness import (
    CHECK_TOL,
    CPU_NOTE,
    DTYPES,
    OOM_ERROR,
    Progress,
    Timer,
    apple_peak_tbps,
    check_outputs,
    device_name,
    empty_cache,
    format_size,
    measure_copy_bandwidth,
    require_device,
    resolve_dtypes,
    short_error,
    synchronize,
    timing_description,
    versions,
    windows_ms,
)
from fusedops.tools.bench_host import host_costs_for_sweep
from fusedops.tools.bench_latency import host_latency_for_sweep
from fusedops.tools.bench_ops import (
    BYTES_MODEL,
    COMPILE_BUDGET,
    FLOP_MODEL,
    HOST_LATENCY_SHAPES,
    NOISE,
    TOTAL_ELEMENTS,
    annotate_speedups,
    bytes_moved,
    family,
    flops,
    is_backward,
    resolve_ops,
    resolve_providers,
    resolve_sizes,
    rows_for,
)
from fusedops.tools.bench_providers import FAMILIES, Provider, all_providers

# --- one sweep point -----------------------------------------------------------------------------


class Point:
    """The data of one (family, dtype, N) point, shared by every provider and op there."""

    def __init__(self, fam: str, ops: Sequence[str], dtype: torch.dtype, M: int, N: int,
                 device: str, seed: int):
        self.family, self.dtype, self.M, self.N, self.device = fam, dtype, M, N, device
        # Fresh random data per point, created on the device (seeded per point for repeatability).
        torch.manual_seed(seed)
        self.x = torch.randn(M, N, device=device, dtype=dtype)
        self.w = self.b = None
        if fam in ("layernorm", "rmsnorm"):
            self.w = (1.0 + 0.1 * torch.randn(N, device=device)).to(dtype)
        if fam == "layernorm":
            self.b = (0.1 * torch.randn(N, device=device)).to(dtype)
        self.need_fwd = any(not is_backward(o) for o in ops)
        self.need_bwd = any(is_backward(o) for o in ops)
        self.dy = torch.randn(M, N, device=device, dtype=dtype) if self.need_bwd else None
        self.ref_y = None
        self.ref_grads: tuple = ()

    def grad_inputs(self) -> tuple[torch.Tensor, ...]:
        """The leaves the backward differentiates: x, then the weight and bias the family has
        (softmax: x; layernorm: x, w, b; rmsnorm: x, w)."""
        return tuple(t.detach().requires_grad_(True) for t in (self.x, self.w, self.b)
                     if t is not None)

    def args(self, inputs: tuple[torch.Tensor, ...] | None = None):
        """The (x, w, b) row-function arguments, from ``inputs`` (:meth:`grad_inputs`) if given;
        what the family has not is None."""
        if inputs is None:
            return (self.x, self.w, self.b)
        padded = tuple(inputs) + (None,) * (3 - len(inputs))
        return padded[:3]

    def compute_refs(self, torch_provider: Provider) -> None:
        fn = torch_provider.make(self.family)
        if self.need_fwd:
            with torch.no_grad():
                self.ref_y = fn(*self.args())
        if self.need_bwd:
            inputs = self.grad_inputs()
            with torch.enable_grad():
                y = fn(*self.args(inputs))
                self.ref_grads = tuple(torch.autograd.grad(y, inputs, self.dy))
            del y

    def release(self) -> None:
        self.x = self.w = self.b = self.dy = self.ref_y = None
        self.ref_grads = ()


def base_record(op: str, dtype_name: str, M: int, N: int, provider: str, elt: int) -> dict:
    """A record with every field, nothing measured yet (status "error" until timed)."""
    return {
        "op": op, "dtype": dtype_name, "M": M, "N": N, "provider": provider,
        "backend": None, "status": "error", "ok": None, "max_err": None,
        "ms": None, "ms_p20": None, "ms_p80": None, "ms_gpu": None,
        "bytes": bytes_moved(op, M, N, elt), "flops": flops(op, M, N),
        "tbps": None, "gflops": None, "copy_tbps": None, "frac_copy": None,
        "compile_s": None, "first_call_s": None, "error": None,
    }


def finish_record(rec: dict, ms: float, lo: float, hi: float, copy_tbps: float | None,
                  peak_tbps: float | None) -> None:
    """Fill in the times and everything derived from them."""
    rec["ms"], rec["ms_p20"], rec["ms_p80"] = ms, lo, hi
    rec["tbps"] = rec["bytes"] / (ms * 1e-3) / 1e12
    rec["gflops"] = rec["flops"] / (ms * 1e-3) / 1e9
    rec["copy_tbps"] = copy_tbps
    rec["frac_copy"] = rec["tbps"] / copy_tbps if copy_tbps else None
    if peak_tbps:
        rec["peak_tbps"] = peak_tbps
        rec["frac_peak"] = rec["tbps"] / peak_tbps


def _gpu_ahead(rec: dict, timer: Timer, call: Callable[[], Any], cycles: int) -> None:
    """``rec["ms_gpu"]``: :meth:`Timer.gpu_ahead` of ``call`` behind a ``cycles`` GPU sleep
    (None off CUDA). An extra measurement: its failure notes ``ms_gpu_error`` and leaves the
    record's do_bench time standing."""
    try:
        rec["ms_gpu"] = timer.gpu_ahead(call, cycles=cycles)
    except Exception as exc:
        rec["ms_gpu"] = None
        rec["ms_gpu_error"] = short_error(exc)


def _time_forward(point: Point, fn: Callable, rec: dict, timer: Timer, check: bool,
                  grad_inputs: tuple | None) -> tuple[float, float, float, float]:
    """(ms, p20, p80, first-call seconds) of the forward; in grad mode on ``grad_inputs`` when
    given (one compiled training graph then serves fwd and bwd), else inference. Also
    ``ms_gpu`` in ``rec``."""
    train = grad_inputs is not None
    args = point.args(grad_inputs) if train else point.args()
    rec["fwd_mode"] = "train" if train else "inference"
    with torch.set_grad_enabled(train):
        t0 = time.perf_counter()
        y = fn(*args)
        synchronize(point.device)
        first = time.perf_counter() - t0
        if check:
            rec["ok"], rec["max_err"] = check_outputs((y,), (point.ref_y,), point.dtype)
        del y

        def run_fwd(fn=fn, args=args):
            return fn(*args)

        ms, lo, hi = timer(run_fwd)
        _gpu_ahead(rec, timer, run_fwd, Timer.AHEAD_CYCLES_FORWARD)
    return ms, lo, hi, first


def _time_backward(point: Point, fn: Callable, rec: dict, timer: Timer, check: bool,
                   grad_inputs: tuple) -> tuple[float, float, float, float, float]:
    """(ms, p20, p80, first forward s, first backward s) of ``torch.autograd.grad`` through
    ``fn``'s graph; also ``ms_gpu`` (CUDA) in ``rec``."""
    args = point.args(grad_inputs)
    with torch.enable_grad():
        t0 = time.perf_counter()
        y = fn(*args)
        synchronize(point.device)
        first_fwd = time.perf_counter() - t0
        dy = point.dy
        t1 = time.perf_counter()
        grads = torch.autograd.grad(y, grad_inputs, dy, retain_graph=True)
        synchronize(point.device)
        first_bwd = time.perf_counter() - t1
        if check:
            rec["ok"], rec["max_err"] = check_outputs(grads, point.ref_grads, point.dtype)
        del grads

        def run_bwd(y=y, inputs=grad_inputs, dy=dy):
            return torch.autograd.grad(y, inputs, dy, retain_graph=True)

        ms, lo, hi = timer(run_bwd)
        _gpu_ahead(rec, timer, run_bwd, Timer.AHEAD_CYCLES)
        del y, run_bwd
    return ms, lo, hi, first_fwd, first_bwd


def run_provider(point: Point, provider: Provider, ops: Sequence[str], dtype_name: str,
                 timer: Timer, check: bool, copy_tbps: float | None, peak_tbps: float | None,
                 share_compile: bool) -> list[dict]:
    """Time ``provider`` on every op of ``point`` (forward then backward, one compile shared)."""
    elt = point.x.element_size()
    try:
        fn = provider.make(point.family)
    except Exception as exc:
        records = [base_record(op, dtype_name, point.M, point.N, provider.name, elt)
                   for op in ops]
        for rec in records:
            rec["error"] = short_error(exc)
        return records
    # The compile provider times its forward in grad mode when the backward is also measured,
    # so one compiled (training) graph serves both and each shape is compiled once.
    compile_grad_fwd = provider.compiles and share_compile and point.need_bwd
    train_compiled = False
    grad_inputs = None
    records = []
    for op in ops:
        rec = base_record(op, dtype_name, point.M, point.N, provider.name, elt)
        records.append(rec)
        unsupported = provider.unsupported_reason(op)
        if unsupported is not None:
            rec["status"], rec["error"] = "skipped", unsupported
            continue
        try:
            rec["backend"] = provider.backend(point.x)
            if compile_grad_fwd or is_backward(op):
                grad_inputs = grad_inputs or point.grad_inputs()
            if not is_backward(op):
                ms, lo, hi, first = _time_forward(point, fn, rec, timer, check,
                                                  grad_inputs if compile_grad_fwd else None)
                train_compiled = compile_grad_fwd
            else:
                ms, lo, hi, first_fwd, first = _time_backward(point, fn, rec, timer, check,
                                                              grad_inputs)
                if provider.compiles and not train_compiled:
                    first += first_fwd
                train_compiled = True
            rec["first_call_s"] = first
            if provider.compiles:
                # First-call time of a freshly compiled graph (the backward graph is compiled
                # lazily at its first call), so the compile_s of a point's records add up to
                # what compiling that shape cost.
                rec["compile_s"] = first
            finish_record(rec, ms, lo, hi, copy_tbps, peak_tbps)
            rec["status"] = "ok" if rec["ok"] in (True, None) else "wrong"
        except Exception as exc:
            rec["status"] = "error"
            rec["error"] = short_error(exc)
            if isinstance(exc, OOM_ERROR):
                empty_cache(point.device)
    fn = grad_inputs = None
    if provider.compiles:
        torch._dynamo.reset()
    return records


# --- the sweep -----------------------------------------------------------------------------------


@dataclass
class _Sweep:
    """What every point of one sweep shares."""

    device: str
    timer: Timer
    active: list[Provider]
    reference: Provider
    fam_ops: dict[str, list[str]]
    check: bool
    share_compile: bool
    copy_tbps: float
    peak_tbps: float | None
    total: int
    seed: int
    compile_budget_s: float | None
    compile_spent: float = 0.0


def _new_result(device: str, name: str, ops_t, dtypes_t, sizes_t, active, unavailable,
                total: int, warmup_ms: float, rep_ms: float, check: bool,
                share_compile: bool) -> dict[str, Any]:
    now = _dt.datetime.now(_dt.timezone.utc)
    result: dict[str, Any] = {
        "device": name,
        "device_type": device,
        **versions(),
        "date": now.strftime("%Y-%m-%d"),
        "timestamp": now.isoformat(timespec="seconds"),
        "copy_tbps": None,
        "copy": None,
        "peak_tbps": apple_peak_tbps(name) if device == "mps" else None,
        "config": {
            "ops": list(ops_t), "dtypes": list(dtypes_t), "sizes": list(sizes_t),
            "providers": [p.name for p in active], "total_elements": total,
            "warmup_ms": warmup_ms, "rep_ms": rep_ms, "check": check,
            "share_compile": share_compile,
            "timing": timing_description(device, "triton.testing.do_bench median"),
            "threads": torch.get_num_threads(),
            "check_tolerance": {k: CHECK_TOL[v] for k, v in DTYPES.items()},
            "noise": NOISE,
        },
        "providers": {p.name: p.description for p in active},
        "providers_unavailable": unavailable,
        "bytes_model": BYTES_MODEL,
        "flop_model": FLOP_MODEL,
        "records": [],
        "host_latency": [],
        "host_costs": [],
        "skipped": [],
        "truncated": False,
    }
    if device == "cpu":
        result["note"] = CPU_NOTE
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        result["device_properties"] = {"sm_count": props.multi_processor_count,
                                       "memory_gib": round(props.total_memory / 2**30, 1)}
    return result


def _run_point(sw: _Sweep, idx: int, dt_name: str, fam: str, n: int, bar: Progress,
               label: str) -> list[dict]:
    """Every active provider on one (dtype, family, N) point."""
    m = rows_for(n, sw.total)
    dtype = DTYPES[dt_name]
    ops = sw.fam_ops[fam]
    point = None
    records: list[dict] = []
    try:
        point = Point(fam, ops, dtype, m, n, sw.device, sw.seed + idx)
        if sw.check:
            point.compute_refs(sw.reference)
    except Exception as exc:
        for p in sw.active:
            for op in ops:
                rec = base_record(op, dt_name, m, n, p.name, dtype.itemsize)
                rec["error"] = "setup: " + short_error(exc)
                records.append(rec)
        bar.update(label, advance=len(sw.active))
        if point is not None:
            point.release()
        empty_cache(sw.device)
        return records
    for p in sw.active:
        bar.update(f"{label} {p.name}")
        if p.compiles and sw.compile_budget_s is not None and \
                sw.compile_spent > sw.compile_budget_s:
            for op in ops:
                rec = base_record(op, dt_name, m, n, p.name, dtype.itemsize)
                rec["status"] = "skipped"
                rec["error"] = COMPILE_BUDGET
                records.append(rec)
        else:
            recs = run_provider(point, p, ops, dt_name, sw.timer, sw.check, sw.copy_tbps,
                                sw.peak_tbps, sw.share_compile)
            sw.compile_spent += sum(r["compile_s"] or 0.0 for r in recs)
            records.extend(recs)
        bar.update(f"{label} {p.name}", advance=1)
    point.release()
    del point
    empty_cache(sw.device)
    return records


def _available(names: Sequence[str], device: str, ops: Sequence[str]
               ) -> tuple[list[Provider], dict[str, str]]:
    """(the providers that run here, {provider: why not} for the others)."""
    table = all_providers()
    sweep_families = [f for f in FAMILIES if any(family(o) == f for o in ops)]
    active, unavailable = [], {}
    for name in names:
        reason = table[name].unavailable_reason(device, sweep_families)
        if reason is None:
            active.append(table[name])
        else:
            unavailable[name] = reason
    return active, unavailable


def _sweep_points(sw: _Sweep, result: dict, points: list[tuple[str, str, int]],
                  progress: bool, t_start: float, time_budget_s: float | None,
                  on_point: Callable[[dict], None] | None) -> None:
    """Run the points in order into ``result``, until the time budget is spent."""
    bar = Progress(len(points) * len(sw.active), enabled=progress)
    for idx, (dt_name, fam, n) in enumerate(points):
        if time_budget_s is not None and time.perf_counter() - t_start > time_budget_s:
            result["truncated"] = True
            result["skipped"] += [{"dtype": d, "family": f, "N": s, "reason": "time budget"}
                                  for d, f, s in points[idx:]]
            break
        label = f"{fam} {dt_name} N={format_size(n)}"
        result["records"].extend(_run_point(sw, idx, dt_name, fam, n, bar, label))
        annotate_speedups(result["records"])
        result["elapsed_s"] = time.perf_counter() - t_start
        if on_point:
            on_point(result)
    bar.close()
    annotate_speedups(result["records"])


def run_sweep(
    ops: str | Sequence[str] | None = None,
    dtypes: str | Sequence[str] | None = None,
    sizes: str | Sequence[int | str] | None = None,
    providers: str | Sequence[str] | None = None,
    device: str | None = None,
    total: int | None = None,
    warmup_ms: float | None = None,
    rep_ms: float | None = None,
    check: bool = True,
    host_latency: bool = True,
    host_latency_calls: int | None = None,
    host_latency_shapes: Sequence[Sequence[int]] = HOST_LATENCY_SHAPES,
    copy_elements: int | None = None,
    share_compile: bool = True,
    time_budget_s: float | None = None,
    compile_budget_s: float | None = None,
    progress: bool = True,
    seed: int = 0,
    on_point: Callable[[dict], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark sweep and return the result dict (what ``--out`` writes as JSON).

    Args:
        ops, dtypes, sizes, providers: subsets (names, comma strings or lists); default: all.
        device: "cuda", "mps" or "cpu" (default: the best available; a device this machine
            lacks raises :class:`fusedops.tools.cli.UsageError`).
        total: elements per point, M = total // N (default 2^27; 2^14 on CPU).
        warmup_ms, rep_ms: do_bench warm-up / measurement windows per point (default 5 / 25 ms
            on CUDA, 10 / 50 on MPS, 1 / 3 on CPU).
        check: verify each provider's output against torch eager before timing it.
        host_latency: also measure small-shape wall time per call (``host_latency_shapes``,
            ``host_latency_calls`` calls per run).
        share_compile: compile each (family, dtype, N) once in training mode and time the
            compiled forward in grad mode too (otherwise forward-only sweeps compile an
            inference graph; a family with fwd and bwd then needs only one compile).
        time_budget_s: stop starting new points after this many seconds (rest marked skipped).
        compile_budget_s: stop running the compile provider once compiling took this long.
        on_point: called with the partial result after every point (e.g. to save progress).

    Returns:
        dict with device, versions, date, copy_tbps, models, records, host_latency, ...
    """
    device = require_device(device)
    ops_t, dtypes_t = resolve_ops(ops), resolve_dtypes(dtypes)
    sizes_t, prov_t = resolve_sizes(sizes), resolve_providers(providers)
    if total is None:
        total = 2**14 if device == "cpu" else TOTAL_ELEMENTS
    warmup_ms, rep_ms = windows_ms(device, warmup_ms, rep_ms)
    if copy_elements is None:
        copy_elements = total if device == "cpu" else max(total, TOTAL_ELEMENTS)
    active, unavailable = _available(prov_t, device, ops_t)
    name = device_name(device)
    timer = Timer(device, warmup_ms, rep_ms)
    t_start = time.perf_counter()
    result = _new_result(device, name, ops_t, dtypes_t, sizes_t, active, unavailable, total,
                         warmup_ms, rep_ms, check, share_compile)
    # Copy bandwidth first: every result is also reported as a fraction of it.
    copy = measure_copy_bandwidth(device, timer, copy_elements)
    result["copy"], result["copy_tbps"] = copy, copy["tbps"]
    if progress:
        print(f"fusedops bench: {name}, copy {copy['tbps']:.3f} TB/s "
              f"({copy['bytes'] / 2**20:.0f} MiB moved in {copy['ms']:.3f} ms)",
              file=sys.stderr)
    if host_latency:
        result["host_latency"] = host_latency_for_sweep(device, [p.name for p in active],
                                                        host_latency_calls, host_latency_shapes)
        result["host_costs"] = host_costs_for_sweep(device, host_latency_calls)
        if on_point:
            on_point(result)
    # Points: dtype-major (bf16 first), then op family, then N; fwd and bwd of a family share
    # the data and the compiled graph.
    fam_ops = {f: [o for o in ops_t if family(o) == f] for f in FAMILIES}
    sw = _Sweep(device, timer, active, all_providers()["torch"], fam_ops, check, share_compile,
                copy["tbps"], result["peak_tbps"], total, seed, compile_budget_s)
    points = [(dt, f, n) for dt in dtypes_t for f in FAMILIES if fam_ops[f] for n in sizes_t]
    _sweep_points(sw, result, points, progress, t_start, time_budget_s, on_point)
    result["compile_s_total"] = sw.compile_spent
    result["elapsed_s"] = time.perf_counter() - t_start
    return result
