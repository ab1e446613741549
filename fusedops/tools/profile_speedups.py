"""Fused vs native on the shapes a model actually uses: :func:`measure_op_speedups`, the op
speed-ups behind the profile's Amdahl prediction."""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fusedops import _dispatch
from fusedops.tools import _report
from fusedops.tools.profile_ops import is_device_event, is_device_work


def _op_pair(call: dict, device: torch.device) -> tuple[Callable, Callable, torch.Tensor]:
    from fusedops import fused_layernorm, fused_softmax

    dtype = _report.dtype_from_name(call["dtype"])
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(call["shape"], generator=gen).to(device=device, dtype=dtype)
    if call["op"] == "softmax":
        dim = call["dim"]
        out_dtype = None if call["out_dtype"] is None else _report.dtype_from_name(
            call["out_dtype"])
        return (lambda: torch.softmax(x, dim, dtype=out_dtype),
                lambda: fused_softmax(x, dim, out_dtype), x)
    nshape = tuple(call["normalized_shape"])
    w = b = None
    if call["weight_dtype"]:
        w = torch.randn(nshape, generator=gen).to(device,
                                                  _report.dtype_from_name(call["weight_dtype"]))
    if call["bias_dtype"]:
        b = torch.randn(nshape, generator=gen).to(device,
                                                  _report.dtype_from_name(call["bias_dtype"]))
    eps = call["eps"]
    return (lambda: F.layer_norm(x, nshape, w, b, eps),
            lambda: fused_layernorm(x, nshape, w, b, eps), x)


def _device_us_per_call(fns: dict, device: torch.device, calls: int, rounds: int) -> dict:
    """GPU kernel time per call of each callable, from ``torch.profiler`` device events.

    One profiler run; each (callable, round) is a phase ended by a synchronize and marked
    by a ``record_function`` range, and a kernel belongs to the phase whose range contains its
    start. Returns ``{name: [us per call, one per round]}``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    for fn in fns.values():
        fn()
    _report.sync(device)
    labels = []
    with _report.filter_native_stderr(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for r in range(rounds):
                for name, fn in fns.items():
                    label = f"fusedops.phase.{name}.{r}"
                    labels.append((label, name))
                    with record_function(label):
                        for _ in range(calls):
                            fn()
                        _report.sync(device)
    events = list(p.events())
    windows = {e.name: (e.time_range.start, e.time_range.end) for e in events
               if e.name.startswith("fusedops.phase.") and not is_device_event(e)}
    kernels = [e for e in events if is_device_work(e) and not e.name.startswith("fusedops.")]
    out: dict[str, list[float]] = {name: [] for name in fns}
    for label, name in labels:
        lo, hi = windows[label]
        us = sum(k.time_range.elapsed_us() for k in kernels if lo <= k.time_range.start <= hi)
        out[name].append(us / calls)
    return out


def measure_op_speedups(
    calls: list[dict], device: torch.device | str, reps: int = 15, quiet: bool = True
) -> dict:
    """Time native vs fused for every captured call signature (inference, no grad).

    The time compared is the one the profile's shares are made of: on a GPU, *device* (kernel)
    time per call from the profiler (the host's launch cost is reported separately as
    ``*_wall_us``: back-to-back calls timed with events, which a host-bound small op is limited
    by); on CPU, wall time per call. Native and fused runs alternate so drifting load hits both
    alike. Returns ``{"calls": [...per signature: native_us, fused_us, speedup, native_wall_us,
    fused_wall_us, backend, fused...], "ops": {op: {"native_us_per_forward",
    "fused_us_per_forward", "speedup", "backend", "fused"}}, "basis": ...}`` where per-forward
    times weight each signature by its call count.
    """
    device = torch.device(device)
    gpu = device.type == "cuda"
    rows = []
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    backends: dict[str, set] = defaultdict(set)
    progress = _report.Progress("timing fused vs native on the model's shapes", len(calls),
                                quiet=quiet)
    device_rows = 0
    for i, call in enumerate(calls):
        native, fused, x = _op_pair(call, device)
        backend = _dispatch.backend_for(x).NAME
        with torch.no_grad():
            inner = max(_report.calibrate_inner(native, device), 1)
            nat, fus = [], []
            for _ in range(reps):
                nat += _report.time_calls(native, device, reps=1, warmup=1, inner=inner)
                fus += _report.time_calls(fused, device, reps=1, warmup=1, inner=inner)
            n_wall = _report.summarize(nat)["median_ms"] * 1e3
            f_wall = _report.summarize(fus)["median_ms"] * 1e3
            n_us, f_us = n_wall, f_wall
            if gpu:
                try:
                    dev = _device_us_per_call({"native": native, "fused": fused}, device,
                                              calls=min(inner, 50), rounds=3)
                except Exception as e:  # noqa: BLE001 - fall back to wall time, say so
                    warnings.warn(f"fusedops.profile: no device times ({e}); using wall time",
                                  stacklevel=2)
                    dev = None
                if dev and min(dev["native"]) > 0 and min(dev["fused"]) > 0:
                    n_us = sorted(dev["native"])[len(dev["native"]) // 2]
                    f_us = sorted(dev["fused"])[len(dev["fused"]) // 2]
                    device_rows += 1
        rows.append({**call, "native_us": n_us, "fused_us": f_us,
                     "speedup": n_us / f_us if f_us > 0 else float("nan"),
                     "native_wall_us": n_wall, "fused_wall_us": f_wall,
                     "backend": backend, "fused": backend != "reference"})
        totals[call["op"]][0] += n_us * call["count"]
        totals[call["op"]][1] += f_us * call["count"]
        backends[call["op"]].add(backend)
        progress.update(i + 1)
    progress.close()
    ops = {}
    for op, (n_us, f_us) in totals.items():
        names = sorted(backends[op])
        ops[op] = {
            "native_us_per_forward": n_us,
            "fused_us_per_forward": f_us,
            "speedup": n_us / f_us if f_us > 0 else float("nan"),
            "backend": "+".join(names),
            "fused": any(n != "reference" for n in names),
        }
    if gpu and device_rows == len(rows):
        basis = "GPU kernel time per call (torch.profiler), median of 3 rounds"
    elif gpu:
        basis = "GPU kernel time per call where the profiler gave it, else wall time"
    else:
        basis = "wall time per call (CPU: no separate device), median"
    return {"calls": rows, "ops": ops, "basis": basis}
