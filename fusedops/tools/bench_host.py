"""Host cost per call by autograd mode: what a fused call costs the host (Python, checks,
dispatch, launch) against the native op or ops it replaces, part of every
``python -m fusedops bench`` run with host latency.

Each case times one call shape in three modes: ``nograd`` (inference), ``grad`` (the forward
with inputs that require grad, as in training) and ``fwd+bwd`` (that forward and its backward,
``torch.autograd.grad`` of every input). Providers: ``torch`` (the native op; for an epilogue,
the native ops it replaces), ``fusedops`` (the public call as users make it: below the size rule
of ``fusedops._dispatch`` that is the native op) and ``fusedops-kernel`` (the fused kernel
forced, on a device with a fused backend). The target: ``fusedops`` at most 1 µs above
``torch`` in every mode.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import fusedops
from fusedops import _dispatch
from fusedops.tools.bench_harness import DTYPES, short_error, synchronize

MODES = ("nograd", "grad", "fwd+bwd")
ORDERS = ("rotating", "paired")  # how providers take turns run by run (_run_order)
TARGET_US = 1.0  # fusedops' host cost may exceed the native op's by this much per call
# A forward + backward call costs ~100 µs whose run medians scatter by 20 (H200 host), so it
# takes three times the runs to read a 1 µs difference (benchmarks/results/h200/host-orders.json).
MODE_REPEATS = {"fwd+bwd": 3}

# (case, shape): norms and softmax over rows of a small model's width; the attention softmax
# (scale + mask + softmax) at one BERT-base head block of 128 tokens.
CASES: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("softmax", (4, 128)), ("softmax", (8, 128, 768)),
    ("layernorm", (4, 128)), ("layernorm", (8, 128, 768)),
    ("rmsnorm", (4, 128)), ("rmsnorm", (8, 128, 768)),
    ("add+layernorm", (8, 128, 768)),
    ("scale+mask+softmax", (1, 12, 128, 128)),
)


def _fns(case: str, x: torch.Tensor, extra: dict[str, torch.Tensor]
         ) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """(native, fused) callables of one case on ``x`` and its extra tensors."""
    n = x.shape[-1]
    w, b, r, m = extra.get("w"), extra.get("b"), extra.get("r"), extra.get("m")
    if case == "softmax":
        return (lambda: torch.softmax(x, -1)), (lambda: fusedops.fused_softmax(x, -1))
    if case == "layernorm":
        return ((lambda: F.layer_norm(x, (n,), w, b, 1e-5)),
                (lambda: fusedops.fused_layernorm(x, n, w, b, 1e-5)))
    if case == "rmsnorm":
        return ((lambda: F.rms_norm(x, (n,), w, 1e-6)),
                (lambda: fusedops.fused_rmsnorm(x, n, w, 1e-6)))
    if case == "add+layernorm":
        return ((lambda: F.layer_norm(x + r, (n,), w, b, 1e-5)),
                (lambda: fusedops.fused_layernorm(x, n, w, b, 1e-5, residual=r)[0]))
    if case == "scale+mask+softmax":
        return ((lambda: torch.softmax(x * 0.125 + m, -1)),
                (lambda: fusedops.fused_softmax(x, -1, scale=0.125, mask=m)))
    raise ValueError(f"unknown host-cost case {case!r}")


def _inputs(case: str, shape: tuple[int, ...], device: str, dtype: torch.dtype, grad: bool
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    n = shape[-1]
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=grad)
    extra: dict[str, torch.Tensor] = {}
    if case in ("layernorm", "rmsnorm", "add+layernorm"):
        extra["w"] = torch.ones(n, device=device, dtype=dtype, requires_grad=grad)
    if case in ("layernorm", "add+layernorm"):
        extra["b"] = torch.zeros(n, device=device, dtype=dtype, requires_grad=grad)
    if case == "add+layernorm":
        extra["r"] = torch.randn(shape, device=device, dtype=dtype, requires_grad=grad)
    if case == "scale+mask+softmax":
        extra["m"] = torch.zeros((shape[0], 1, 1, n), device=device, dtype=dtype)
    return x, extra


def _step(fn: Callable[[], torch.Tensor], mode: str, inputs: list[torch.Tensor],
          dy: torch.Tensor) -> Callable[[], Any]:
    """One timed call of ``fn`` in ``mode``."""
    if mode == "nograd":
        def run() -> Any:
            with torch.no_grad():
                return fn()
        return run
    if mode == "grad":
        return fn
    return lambda: torch.autograd.grad(fn(), inputs, dy)


def _kernel_backend(device: str) -> str | None:
    """The fused backend a device has, to force for ``fusedops-kernel`` (None: no such row)."""
    return {"cuda": "triton", "mps": "metal"}.get(device)


def measure_host_costs(device: str, dtype: str = "fp16", calls: int = 500, repeats: int = 15,
                       warmup: int = 100, cases: Sequence[tuple[str, Sequence[int]]] = CASES,
                       modes: Sequence[str] = MODES, order: str = "paired") -> list[dict]:
    """Wall time per call (µs) of each case, mode and provider: ``calls`` back-to-back calls
    after a warm-up, one synchronisation at the end, the median of ``repeats`` runs (times
    :data:`MODE_REPEATS` of the mode; providers
    take turns run by run in ``order``; ``delta_vs_torch_us`` is the median of the runs'
    paired differences, see :func:`_time_runs`). Returns one record per
    (case, shape, mode, provider) with ``us_per_call``, ``us_min``, ``delta_vs_torch_us`` and
    ``within_target`` (fusedops only)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    tdtype = DTYPES[dtype]
    kernel = _kernel_backend(device)
    out: list[dict] = []
    for case, shape in cases:
        shape = tuple(int(s) for s in shape)
        for mode in modes:
            grad = mode != "nograd"
            x, extra = _inputs(case, shape, device, tdtype, grad)
            native, fused = _fns(case, x, extra)
            inputs = [t for t in (x, *extra.values()) if t.requires_grad]
            dy = torch.randn(shape, device=device, dtype=tdtype)
            runs: list[tuple[dict, Callable[[], Any], str | None, list[float]]] = []
            for provider, fn, forced in (("torch", native, None), ("fusedops", fused, None),
                                         ("fusedops-kernel", fused, kernel)):
                if provider == "fusedops-kernel" and kernel is None:
                    continue
                rec = {"case": case, "shape": list(shape), "mode": mode, "dtype": dtype,
                       "provider": provider, "us_per_call": None, "us_min": None,
                       "delta_vs_torch_us": None, "error": None}
                out.append(rec)
                step = _step(fn, mode, inputs, dy)
                try:
                    with _dispatch.use_backend(forced) if forced else contextlib.nullcontext():
                        for _ in range(warmup):
                            step()
                    synchronize(device)
                    runs.append((rec, step, forced, []))
                except Exception as exc:
                    rec["error"] = short_error(exc)
            _time_runs(runs, repeats * MODE_REPEATS.get(mode, 1), calls, device, order)
    return out


def _run_order(runs: list, r: int, order: str) -> list:
    """The providers' order in run ``r``. ``rotating``: each starts in turn (with three
    providers, torch follows the forced kernel in two runs of three, fusedops in one).
    ``paired``: the other providers first, then torch and fusedops back to back, which of the
    two goes first alternating, so each follows the same providers equally often."""
    if order == "rotating":
        return runs[r % len(runs):] + runs[:r % len(runs)]
    pair = [run for run in runs if run[0]["provider"] in ("torch", "fusedops")]
    rest = [run for run in runs if run[0]["provider"] not in ("torch", "fusedops")]
    return rest + (pair if r % 2 == 0 else pair[::-1])


def _time_runs(runs: list, repeats: int, calls: int, device: str, order: str = "paired"
               ) -> None:
    """Time each provider's ``calls`` back-to-back calls ``repeats`` times, in the order
    :func:`_run_order` gives run by run; the delta against torch is the median of the runs'
    paired differences (a host whose speed drifts between runs moves both sides of a pair
    alike)."""
    for r in range(repeats):
        for _rec, step, forced, times in _run_order(runs, r, order):
            with _dispatch.use_backend(forced) if forced else contextlib.nullcontext():
                t0 = time.perf_counter()
                for _ in range(calls):
                    step()
                synchronize(device)
            times.append((time.perf_counter() - t0) / calls * 1e6)
    for rec, _, _, times in runs:
        rec["us_per_call"], rec["us_min"] = statistics.median(times), min(times)
    base = next((t for r, _, _, t in runs if r["provider"] == "torch"), None)
    for rec, _, _, times in runs:
        if base is not None:
            pairs = zip(times, base, strict=True)
            rec["delta_vs_torch_us"] = statistics.median([a - b for a, b in pairs])
        if rec["provider"] == "fusedops" and rec["delta_vs_torch_us"] is not None:
            rec["within_target"] = rec["delta_vs_torch_us"] <= TARGET_US


def host_costs_for_sweep(device: str, calls: int | None) -> list[dict]:
    """:func:`measure_host_costs` as the sweep runs it: fp16 (fp32 on CPU, where a few calls
    keep test runs short: CPU "host cost" is compute time at these shapes)."""
    if calls is None and device == "cpu":
        calls = 3
    kw = {} if calls is None else {"calls": calls, "warmup": max(1, calls // 10), "repeats": 3}
    return measure_host_costs(device, "fp32" if device == "cpu" else "fp16", **kw)
