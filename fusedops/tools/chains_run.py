"""The bench-chains run: :func:`run_chains` times every chain, dtype, shape, mode and provider,
on one set of data per point (see :mod:`fusedops.tools.bench_chains` for what is measured)."""

from __future__ import annotations

import contextlib
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
    device_name,
    empty_cache,
    measure_copy_bandwidth,
    require_device,
    short_error,
    synchronize,
    timing_description,
    versions,
    windows_ms,
)
from fusedops.tools.bench_ops import TOTAL_ELEMENTS
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
    BYTES_MODEL,
    CHAINS,
    DROPOUT_P,
    EPS,
    SCALE,
    bytes_moved,
    format_shape,
    make_eager,
    make_fused,
    make_inputs,
    resolve_chains,
    resolve_dtypes,
    resolve_modes,
    resolve_providers,
    resolve_sizes,
)

# --- the run -------------------------------------------------------------------------------------


def _base_record(chain: str, mode: str, dtype_name: str, shape: tuple[int, ...], provider: str,
                 elt: int) -> dict[str, Any]:
    c = CHAINS[chain]
    fused, eager = bytes_moved(chain, mode, shape, elt)
    dims = (dict(zip(("B", "H", "S"), shape, strict=True)) if c.kind == "attn"
            else dict(zip(("M", "N"), shape, strict=True)))
    own = {"fusedops": fused, "eager": eager}.get(provider)
    return {
        "chain": chain, "mode": mode, "dtype": dtype_name, "shape": format_shape(shape),
        **dims, "provider": provider, "backend": None, "status": "error", "ok": None,
        "ms": None, "ms_p20": None, "ms_p80": None, "ms_gpu": None, "speedup_gpu": {},
        "bytes_fused": fused, "bytes_eager": eager, "traffic_ratio": eager / fused,
        "bytes_own": own, "tbps": None, "own_tbps": None, "copy_tbps": None, "frac_copy": None,
        "speedup": {}, "max_abs_err": None, "max_rel_err": None, "check": None,
        "dropout_check": None, "relu_ties": None, "relu_tie_worst": None, "compile_s": None,
        "first_call_s": None, "error": None,
    }


def _backend_name(provider: str, x: torch.Tensor, compile_backend: str) -> str:
    if provider == "eager":
        return "eager"
    if provider == "compile":
        return f"torch.compile({compile_backend})"
    try:
        from fusedops import _dispatch

        return _dispatch.backend_for(x).NAME
    except Exception:
        return "fusedops"


def annotate_speedups(records: list[dict]) -> None:
    """``speedup`` = {other provider: other ms / this ms} within each (chain, mode, dtype,
    shape); ``speedup_gpu`` the same of the GPU-ahead times (``ms_gpu``, CUDA only)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["chain"], r["mode"], r["dtype"], r["shape"]), []).append(r)
    for group in groups.values():
        for r in group:
            for key, out in (("ms", "speedup"), ("ms_gpu", "speedup_gpu")):
                r[out] = {o["provider"]: o[key] / r[key] for o in group
                          if o is not r and r.get(key) and o.get(key)}


@dataclass
class _Run:
    """What every point of one bench-chains run shares."""

    device: str
    modes: tuple[str, ...]
    providers: tuple[str, ...]
    timer: Timer
    check: bool
    copy_tbps: float
    compile_backend: str
    compile_budget_s: float | None
    compile_spent: float = 0.0


def _new_result(device: str, name: str, chains_t, dtypes_t, modes_t, prov_t, sizes_d,
                warmup_ms: float, rep_ms: float, check: bool, compile_backend: str) -> dict:
    now = _dt.datetime.now(_dt.timezone.utc)
    result: dict[str, Any] = {
        "benchmark": "chains",
        "device": name,
        "device_type": device,
        **versions(),
        "date": now.strftime("%Y-%m-%d"),
        "timestamp": now.isoformat(timespec="seconds"),
        "copy_tbps": None,
        "copy": None,
        "config": {
            "chains": list(chains_t), "dtypes": list(dtypes_t), "modes": list(modes_t),
            "providers": list(prov_t),
            "sizes": {c: [format_shape(s) for s in sizes_d[CHAINS[c].kind]] for c in chains_t},
            "scale": SCALE, "dropout_p": DROPOUT_P, "eps": EPS,
            "warmup_ms": warmup_ms, "rep_ms": rep_ms, "check": check,
            "compile_backend": compile_backend,
            "timing": timing_description(
                device, "triton.testing.do_bench median (L2 flushed before each call)"),
            "threads": torch.get_num_threads(),
            "fwd": "forward under torch.no_grad() (dropout on, training=True)",
            "fwd_bwd": "forward with grad + torch.autograd.grad of every output with a fixed "
                       "upstream gradient, into every input but the mask",
            "tbps": "fused floor bytes / median time, for every provider",
            "check_desc": "max error of the provider vs the eager chain on the same data, "
                          "dropout p forced to 0 for both (fwd: outputs; fwd_bwd: outputs and "
                          "gradients); fused dropout checked separately at p (dropout_check)",
            "check_tolerance": {k: CHECK_TOL[v] for k, v in DTYPES.items()},
        },
        "chains": {c: {"eager": CHAINS[c].eager, "fused": CHAINS[c].fused} for c in chains_t},
        "bytes_model": {c: BYTES_MODEL[c] for c in chains_t},
        "records": [],
        "skipped": [],
        "truncated": False,
    }
    if device == "cpu":
        result["note"] = CPU_NOTE
    return result


def _run_points(run: _Run, result: dict, points: list, progress: bool, t_start: float,
                time_budget_s: float | None, seed: int,
                on_point: Callable[[dict], None] | None) -> None:
    """Run the (dtype, chain, shape) points in order into ``result``, until the time budget is
    spent."""
    bar = Progress(len(points), enabled=progress)
    records = result["records"]
    for idx, (dt_name, chain, shape) in enumerate(points):
        label = f"{chain} {dt_name} {format_shape(shape)}"
        if time_budget_s is not None and time.perf_counter() - t_start > time_budget_s:
            result["truncated"] = True
            result["skipped"].extend({"chain": c2, "dtype": d2, "shape": format_shape(s2),
                                      "reason": "time budget"} for d2, c2, s2 in points[idx:])
            break
        bar.update(label)
        skip_compile = (run.compile_budget_s is not None
                        and run.compile_spent > run.compile_budget_s)
        recs = _run_point(run, chain, shape, dt_name, DTYPES[dt_name], skip_compile, seed + idx)
        run.compile_spent += sum(r["compile_s"] or 0.0 for r in recs)
        records.extend(recs)
        annotate_speedups(records)
        empty_cache(run.device)
        result["elapsed_s"] = time.perf_counter() - t_start
        bar.update(label, advance=1)
        if on_point:
            on_point(result)
    bar.close()
    annotate_speedups(records)


def run_chains(
    chains: str | Sequence[str] | None = None,
    dtypes: str | Sequence[str] | None = None,
    sizes: str | Sequence | None = None,
    modes: str | Sequence[str] | None = None,
    providers: str | Sequence[str] | None = None,
    device: str | None = None,
    rows: int | None = None,
    warmup_ms: float | None = None,
    rep_ms: float | None = None,
    check: bool = True,
    time_budget_s: float | None = None,
    compile_budget_s: float | None = None,
    compile_backend: str = "inductor",
    copy_elements: int | None = None,
    progress: bool = True,
    seed: int = 0,
    on_point: Callable[[dict], None] | None = None,
) -> dict[str, Any]:
    """Run the chain benchmark and return the result dict (what ``--out`` writes as JSON).

    Args:
        chains, dtypes, modes, providers: subsets (names, comma strings or lists); defaults:
            every chain, bf16 + fp32, fwd + fwd_bwd, fusedops + eager + compile.
        sizes: shapes (:func:`resolve_sizes`); default the grid of :data:`LN_SIZES` and
            :data:`ATTN_SIZES` (tiny shapes on CPU).
        device: "cuda", "mps" or "cpu" (default: the best available; a device this machine
            lacks raises :class:`fusedops.tools.cli.UsageError`).
        rows: M for sizes given as N alone (default 16384; 64 on CPU).
        warmup_ms, rep_ms: timing windows per measurement (default 5 / 25 ms on CUDA, 1 / 3
            on CPU).
        check: compare fused (and compiled, where it has no dropout) with eager on the same data.
        time_budget_s: start no new point after this many seconds (the rest is skipped).
        compile_budget_s: stop running the compile provider once compiling took this long.
        compile_backend: torch.compile backend (default inductor; "eager" for a quick dry run).
        on_point: called with the partial result after every point (e.g. to save progress).
    """
    device = require_device(device)
    chains_t, dtypes_t = resolve_chains(chains), resolve_dtypes(dtypes)
    modes_t, prov_t = resolve_modes(modes), resolve_providers(providers)
    sizes_d = resolve_sizes(sizes, rows, device)
    warmup_ms, rep_ms = windows_ms(device, warmup_ms, rep_ms)
    if copy_elements is None:
        copy_elements = 2**14 if device == "cpu" else TOTAL_ELEMENTS
    timer = Timer(device, warmup_ms, rep_ms)
    t_start = time.perf_counter()
    name = device_name(device)
    result = _new_result(device, name, chains_t, dtypes_t, modes_t, prov_t, sizes_d, warmup_ms,
                         rep_ms, check, compile_backend)
    copy = measure_copy_bandwidth(device, timer, copy_elements)
    result["copy"] = copy
    result["copy_tbps"] = copy["tbps"]
    if progress:
        print(f"fusedops bench-chains: {name}, copy {copy['tbps']:.3f} TB/s", file=sys.stderr)
    run = _Run(device, modes_t, prov_t, timer, check, copy["tbps"], compile_backend,
               compile_budget_s)
    points = [(dt, c, s) for dt in dtypes_t for c in chains_t for s in sizes_d[CHAINS[c].kind]]
    _run_points(run, result, points, progress, t_start, time_budget_s, seed, on_point)
    result["compile_s_total"] = run.compile_spent
    result["elapsed_s"] = time.perf_counter() - t_start
    return result


def _make(prov: str, chain: str, compile_backend: str) -> Callable:
    """The function ``prov`` runs for ``chain`` (compile: a fresh graph)."""
    if prov == "fusedops":
        return make_fused(chain)
    if prov == "eager":
        return make_eager(chain)
    torch._dynamo.reset()
    return torch.compile(make_eager(chain), dynamic=False, backend=compile_backend)


def _references(chain: str, inputs: dict, modes: Sequence[str], device: str,
                dtype: torch.dtype) -> tuple[dict[str, tuple], str | None]:
    """The eager chain with dropout off, the reference of every mode: ({mode: outputs +
    gradients}, None), or ({}, why not)."""
    refs: dict[str, tuple] = {}
    try:
        eager0 = make_eager(chain, p=0.0)
        for m in modes:
            outs, grads = run_mode(eager0, inputs, m, device, dtype)
            refs[m] = outs + grads
    except Exception as exc:
        return {}, "reference: " + short_error(exc)
    return refs, None


def _run_point(run: _Run, chain: str, shape: tuple[int, ...], dt_name: str, dtype: torch.dtype,
               skip_compile: bool, seed: int) -> list[dict]:
    """Every provider and mode at one (chain, dtype, shape) point, on one set of data."""
    device, modes, providers = run.device, run.modes, run.providers
    elt = torch.empty((), dtype=dtype).element_size()
    records: list[dict] = []
    try:
        inputs = make_inputs(chain, shape, dtype, device, seed)
        if any(m == "fwd_bwd" for m in modes):
            grad_out(inputs, device, dtype)
    except Exception as exc:
        for p in providers:
            for m in modes:
                rec = _base_record(chain, m, dt_name, shape, p, elt)
                rec["error"] = "setup: " + short_error(exc)
                records.append(rec)
        return records
    x = inputs["args"][0]
    refs, check_error = (_references(chain, inputs, modes, device, dtype) if run.check
                         else ({}, None))
    for prov in providers:
        fn: Callable | None = None
        try:
            fn = _make(prov, chain, run.compile_backend)
            make_error = None
        except Exception as exc:
            make_error = short_error(exc)
        for m in modes:
            rec = _base_record(chain, m, dt_name, shape, prov, elt)
            records.append(rec)
            rec["backend"] = _backend_name(prov, x, run.compile_backend)
            if prov == "compile" and skip_compile:
                rec["status"] = "skipped"
                rec["error"] = "compile budget spent"
                continue
            if make_error is not None:
                rec["error"] = make_error
                continue
            try:
                _measure(run, rec, chain, fn, inputs, m, dtype, refs, check_error)
            except Exception as exc:
                rec["status"] = "error"
                rec["error"] = short_error(exc)
                if isinstance(exc, OOM_ERROR):
                    empty_cache(device)
        fn = None
        if prov == "compile":
            torch._dynamo.reset()
    del inputs, refs
    return records


def _first_call(fn: Callable, inputs: dict, mode: str, device: str, dtype: torch.dtype
                ) -> tuple[Callable, tuple, float]:
    """(the call to time, the first call's outputs + gradients, its seconds)."""
    if mode == "fwd":
        args = inputs["args"]

        def call(fn=fn, args=args):
            return fn(*args)

        with torch.no_grad():
            t0 = time.perf_counter()
            got = as_tuple(call())
            synchronize(device)
            return call, got, time.perf_counter() - t0
    step = Step(fn, inputs, device, dtype)
    with torch.enable_grad():
        t0 = time.perf_counter()
        outs, grads = step()
        synchronize(device)
        first = time.perf_counter() - t0
        got = tuple(o.detach() for o in outs) + tuple(grads)
        del outs, grads

    def call_step(step=step):
        with torch.enable_grad():
            return step()

    return call_step, got, first


def _check(rec: dict, chain: str, fn: Callable, inputs: dict, mode: str, device: str,
           dtype: torch.dtype, got: tuple, refs: dict, check_error: str | None) -> None:
    """Compare a provider's first-call ``got`` with the eager reference, into ``rec``."""
    c = CHAINS[chain]
    prov = rec["provider"]
    if check_error is not None:
        rec["check"] = check_error
        return
    if prov == "eager":
        rec["check"] = "reference"
        return
    if prov == "compile" and c.dropout_p:
        rec["check"] = "not compared (its dropout masks differ from eager's)"
        return
    ref = refs[mode]
    tie_ok = True
    if prov == "fusedops" and c.dropout_p:
        # Same chain with dropout off, on the same data.
        got = run_mode(make_fused(chain, p=0.0), inputs, mode, device, dtype)
        got = got[0] + got[1]
        rec["check"] = "vs eager, dropout p = 0 for both"
        if c.activation == "relu" and mode == "fwd_bwd":
            ref, ties, worst = relu_tie_reference(chain, inputs, got[0], device, dtype)
            rec["relu_ties"], rec["relu_tie_worst"] = ties, worst
            rec["check"] += ", ReLU ties kept as the fused forward broke them"
            tie_ok = worst <= RELU_TIE_TOL.get(dtype, 1e-5)
    else:
        rec["check"] = "vs eager"
    rec["max_abs_err"], rec["max_rel_err"] = compare(got, ref)
    rec["ok"] = rec["max_rel_err"] <= CHECK_TOL.get(dtype, 1e-3) and tie_ok
    if prov == "fusedops" and c.dropout_p and mode == "fwd":
        with torch.no_grad():
            out_p = as_tuple(fn(*inputs["args"]))[0]
        rec["dropout_check"] = dropout_check(chain, inputs, out_p, c.dropout_p)
        del out_p
        rec["ok"] = bool(rec["ok"] and rec["dropout_check"]["ok"])


def _grad_mode(mode: str):
    """No grad for the forward mode (the step of fwd_bwd enables grad itself)."""
    return torch.no_grad() if mode == "fwd" else contextlib.nullcontext()


def _time(run: _Run, rec: dict, call: Callable, mode: str) -> None:
    """Time ``call`` (and its GPU-ahead time on CUDA) into ``rec``."""
    timer = run.timer
    with _grad_mode(mode):
        ms, lo, hi = timer(call)
    rec["ms"], rec["ms_p20"], rec["ms_p80"] = ms, lo, hi
    gpu_ahead = getattr(timer, "gpu_ahead", None)
    if gpu_ahead is not None:
        try:  # an extra measurement: its failure must not cost the record
            with _grad_mode(mode):
                rec["ms_gpu"] = gpu_ahead(call)
        except Exception as exc:
            rec["ms_gpu_error"] = short_error(exc)
    rec["tbps"] = rec["bytes_fused"] / (ms * 1e-3) / 1e12
    if rec["bytes_own"] is not None:
        rec["own_tbps"] = rec["bytes_own"] / (ms * 1e-3) / 1e12
    rec["copy_tbps"] = run.copy_tbps
    rec["frac_copy"] = rec["tbps"] / run.copy_tbps if run.copy_tbps else None


def _measure(run: _Run, rec: dict, chain: str, fn: Callable, inputs: dict, mode: str,
             dtype: torch.dtype, refs: dict, check_error: str | None) -> None:
    """First call, correctness check and timing of one provider in one mode."""
    call, got, first = _first_call(fn, inputs, mode, run.device, dtype)
    rec["first_call_s"] = first
    if rec["provider"] == "compile":
        rec["compile_s"] = first
    if run.check:
        _check(rec, chain, fn, inputs, mode, run.device, dtype, got, refs, check_error)
    del got
    _time(run, rec, call, mode)
    rec["status"] = "ok" if rec["ok"] in (True, None) else "wrong"
