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
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import math
import os
import re
import sys
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from fusedops import _dispatch
from fusedops.tools import _report, amdahl

FORWARD_RANGE = "fusedops.profile.forward"
FUSED_OPS = ("softmax", "layernorm")
CATEGORIES = ("softmax", "layernorm", "matmul", "elementwise", "reduction", "memory", "view",
              "other")

# ----------------------------------------------------------------------------------------------
# loading models and calling them


def load_target(spec: str) -> tuple[nn.Module, Any]:
    """Import ``MODULE:FACTORY`` and call the factory; returns ``(model, example_inputs)``.

    ``MODULE`` is a dotted module name or a path to a ``.py`` file.
    """
    if ":" not in spec:
        raise ValueError(f"expected MODULE:FACTORY, got {spec!r}")
    module_name, _, attr = spec.rpartition(":")
    if module_name.endswith(".py") or os.path.sep in module_name:
        path = os.path.abspath(module_name)
        if not os.path.exists(path):
            raise FileNotFoundError(path)
        name = "_fusedops_user_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        spec_obj = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec_obj)
        sys.modules[name] = module
        spec_obj.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(module_name)
    factory = getattr(module, attr, None)
    if factory is None:
        raise AttributeError(f"{module_name} has no attribute {attr!r}")
    result = factory() if callable(factory) else factory
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise TypeError(f"{spec} must return (model, example_inputs)")
    return result


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for a dict, ``model(*inputs)`` for a tuple/list, else ``model(x)``."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def move_inputs(inputs: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> Any:
    """Move every tensor in a nested tuple/list/dict to ``device``; floating tensors also to
    ``dtype`` when given."""
    if isinstance(inputs, torch.Tensor):
        if dtype is not None and inputs.is_floating_point():
            return inputs.to(device=device, dtype=dtype)
        return inputs.to(device)
    if isinstance(inputs, Mapping):
        return {k: move_inputs(v, device, dtype) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(move_inputs(v, device, dtype) for v in inputs)
    return inputs


def model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# op classification


_PATTERNS = [
    ("other", re.compile(r"log_?softmax")),
    # (fusedops' kernels: _softmax_*, _smm_* the masked softmax; _ln_*, _ln_epi_* the
    # LayerNorm epilogues.)
    ("softmax", re.compile(r"softmax|(^|_)smm_(fwd|bwd)")),
    ("layernorm", re.compile(r"layer_?norm|(^|_)ln_(epi_)?(fwd|bwd)")),
    ("matmul", re.compile(
        r"gemm|matmul|cutlass|xmma|cublas|nvjet|sm\d\d_|aten::(mm|addmm|bmm|baddbmm|linear|"
        r"_addmm_activation|scaled_dot_product)")),
    ("memory", re.compile(
        r"memcpy|memset|copy|contiguous|clone|aten::(cat|to|_to_copy|empty|empty_like|zeros|"
        r"zeros_like|ones|full|new_empty|new_zeros|resize_)$")),
    ("view", re.compile(
        r"aten::(view|_unsafe_view|reshape|permute|transpose|t|unsqueeze|squeeze|select|slice|"
        r"expand|as_strided|detach|alias|unbind|split|chunk|lift_fresh|unflatten|flatten|"
        r"movedim|narrow)$")),
    ("reduction", re.compile(r"reduce|aten::(sum|mean|amax|amin|max|min|norm|var|std|prod)$")),
    ("elementwise", re.compile(
        r"elementwise|aten::(add|add_|sub|rsub|mul|mul_|div|div_|gelu|relu|silu|tanh|sigmoid|exp|"
        r"rsqrt|sqrt|neg|pow|square|masked_fill|masked_fill_|where|fill_|dropout|clamp|abs|"
        r"bitwise_not|logical_not|lt|gt|le|ge|eq|ne|arange|scalar_tensor)$")),
]


_WRAPPERS = {"AUnaryFunctor", "BUnaryFunctor", "BinaryFunctor", "gpu_kernel_impl_nocast",
             "gpu_kernel_impl", "func_wrapper_t", "ReduceOp", "launch_kernel"}
_DETAIL = re.compile(
    r"[A-Za-z_]\w*(?:Functor\w*|functor|_kernel_cuda|KernelImpl|_kernel)\b|cutlass_\w+")


def short_name(name: str) -> str:
    """A readable name for a long C++ kernel signature: the kernel's own name plus the functor or
    kernel it instantiates, e.g. ``elementwise_kernel[CUDAFunctor_add]``."""
    if len(name) <= 40 or ("<" not in name and "(" not in name):
        return name
    text = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    head = re.split(r"[<(]", text, maxsplit=1)[0]
    base = head.split("::")[-1] or head
    rest = text[len(head):]
    details = [m.group(0) for m in _DETAIL.finditer(rest)
               if m.group(0) not in _WRAPPERS and m.group(0) != base]
    return f"{base}[{details[0]}]" if details else base


def categorize(name: str) -> str:
    """Coarse category of an ATen op or a device kernel name (see ``CATEGORIES``)."""
    n = name.lower()
    for category, pattern in _PATTERNS:
        if pattern.search(n):
            return category
    return "other"


# ----------------------------------------------------------------------------------------------
# capturing the shapes the model feeds to softmax / layer_norm


class _CallRecorder(TorchFunctionMode):
    """Counts the softmax / layer_norm calls of a forward by signature (shape, dtype, args)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            sig = _signature(func, args, kwargs)
        except Exception:  # noqa: BLE001 - recording must never break the model
            sig = None
        if sig is not None:
            self.calls[sig] += 1
        return func(*args, **kwargs)


def _get(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _dt(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def _signature(func, args, kwargs) -> tuple | None:
    if func in (F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax):
        x = _get(args, kwargs, 0, "input")
        if not isinstance(x, torch.Tensor):
            return None
        dim = _get(args, kwargs, 1, "dim")
        if func is F.softmax:
            dtype = _get(args, kwargs, 3, "dtype")
            if dim is None:
                dim = 0 if x.dim() in (0, 1, 3) else 1
        else:
            dtype = _get(args, kwargs, 2, "dtype")
        if not isinstance(dim, int):
            return None
        return ("softmax", tuple(x.shape), _dt(x.dtype), dim, _dt(dtype))
    if func in (F.layer_norm, torch.layer_norm):
        x = _get(args, kwargs, 0, "input")
        shape = _get(args, kwargs, 1, "normalized_shape")
        if not isinstance(x, torch.Tensor):
            return None
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        w = _get(args, kwargs, 2, "weight")
        b = _get(args, kwargs, 3, "bias")
        eps = float(_get(args, kwargs, 4, "eps", 1e-5))
        return ("layernorm", tuple(x.shape), _dt(x.dtype), shape,
                None if w is None else _dt(w.dtype), None if b is None else _dt(b.dtype), eps)
    return None


def capture_calls(model: nn.Module, inputs: Any) -> list[dict]:
    """Run one forward (eval, no grad) and return the softmax / layer_norm calls it made, one dict
    per distinct signature with ``count``.

    Both module and functional forms are seen (``nn.Softmax``/``nn.LayerNorm`` call the
    functional ops). Run this on the *unpatched* model: a patched model's calls go to fusedops.
    """
    recorder = _CallRecorder()
    with torch.no_grad(), recorder:
        call_model(model, inputs)
    out = []
    for sig, count in recorder.calls.items():
        if sig[0] == "softmax":
            _, shape, dtype, dim, out_dtype = sig
            out.append({"op": "softmax", "shape": list(shape), "dtype": dtype, "dim": dim,
                        "out_dtype": out_dtype, "count": count})
        else:
            _, shape, dtype, nshape, w, b, eps = sig
            out.append({"op": "layernorm", "shape": list(shape), "dtype": dtype,
                        "normalized_shape": list(nshape), "weight_dtype": w, "bias_dtype": b,
                        "eps": eps, "count": count})
    return out


# ----------------------------------------------------------------------------------------------
# measuring fused vs native on those shapes


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

    One profiler session; each (callable, round) is a phase ended by a synchronize and marked
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
               if e.name.startswith("fusedops.phase.") and not _is_device_event(e)}
    kernels = [e for e in events if _is_device_work(e) and not e.name.startswith("fusedops.")]
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


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def _run_profiler(model, inputs, device, iters):
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


def _is_device_event(evt) -> bool:
    return evt.device_type != torch.autograd.DeviceType.CPU


def _is_device_work(evt) -> bool:
    """A kernel / memcpy / memset on the device (not a mirrored user-annotation range)."""
    return (_is_device_event(evt) and not evt.is_user_annotation
            and getattr(evt, "activity_type", None) != "gpu_user_annotation"
            and evt.name != FORWARD_RANGE and not evt.name.startswith("fusedops::"))


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

        # Unprofiled wall (synchronised) and host issue time per forward.
        with torch.no_grad():
            wall_s = _report.time_calls(lambda: call_model(model, example_inputs), device,
                                        reps=timing_reps, warmup=1)
            host_s = []
            if _report.is_gpu(device):
                for _ in range(timing_reps):
                    _report.sync(device)
                    t0 = time.perf_counter()
                    call_model(model, example_inputs)
                    host_s.append(time.perf_counter() - t0)
                _report.sync(device)
        wall = _report.summarize(wall_s)
        host = _report.summarize(host_s) if host_s else wall

        prof, prof_wall = _run_profiler(model, example_inputs, device, iters)
    finally:
        model.train(was_training)

    events = list(prof.events())
    forwards = [e for e in events if e.name == FORWARD_RANGE and not _is_device_event(e)]
    n_fwd = max(1, len(forwards))
    top_level = [c for f in forwards for c in f.cpu_children]
    cpu_ops = [e for e in events if not _is_device_event(e) and e.name != FORWARD_RANGE
               and not e.is_user_annotation and e.name.startswith(("aten::", "fusedops::"))]
    device_events = [e for e in events if _is_device_work(e)]
    gpu = bool(device_events) and _report.is_gpu(device)
    profiled_fwd_ms = sum(f.cpu_time_total for f in forwards) / 1e3 / n_fwd

    grouped: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    if gpu:
        for e in device_events:
            g = grouped[e.name]
            g[0] += 1
            g[1] += e.time_range.elapsed_us()
        busy_ms = _union_us([(e.time_range.start, e.time_range.end)
                             for e in device_events]) / 1e3 / n_fwd
        forward_ms = wall["median_ms"]
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
    outside_ms = max(0.0, forward_ms - busy_ms)

    if gpu:
        dispatch = {
            "host_ms": host["median_ms"],
            "device_busy_ms": busy_ms,
            "wall_ms": forward_ms,
            "gpu_idle_ms": outside_ms,
            "tax": outside_ms / forward_ms if forward_ms > 0 else 0.0,
            "note": "tax = share of the forward's wall time the GPU is idle (not running any "
                    "kernel), i.e. waiting on Python/dispatch/launch overhead",
        }
    else:
        dispatch = {
            "host_ms": forward_ms,
            "device_busy_ms": None,
            "aten_ms": busy_ms,
            "wall_ms": forward_ms,
            "outside_ops_ms": outside_ms,
            "tax": outside_ms / forward_ms if forward_ms > 0 else 0.0,
            "note": "CPU: device time = CPU time, there is no separate device to sit idle; tax = "
                    "share of the forward spent outside ATen ops (Python, module calls, "
                    "dispatcher, profiler overhead)",
        }

    fractions = {op: categories[op]["share"] for op in FUSED_OPS}
    report: dict = {
        "label": label,
        "device": device.type,
        "time_basis": basis,
        "iters": n_fwd,
        "forward_ms": forward_ms,
        "latency": wall,
        "profiled_forward_ms": profiled_fwd_ms,
        "busy_ms": busy_ms,
        "launches_per_forward": launches,
        "launch_kind": launch_kind,
        "aten_ops_per_forward": len(cpu_ops) / n_fwd,
        "dispatch": dispatch,
        "ops": rows,
        "categories": categories,
        "softmax_layernorm_share": sum(fractions.values()),
        "fractions": fractions,
        "captured_calls": calls,
    }
    if op_speedups:
        report["op_speedups"] = op_speedups
        speedups = {op: v["speedup"] for op, v in op_speedups["ops"].items()}
        report["amdahl"] = amdahl.predict(forward_ms, fractions, speedups)
        report["amdahl"]["fused_kernels"] = {op: v["fused"] for op, v in
                                             op_speedups["ops"].items()}
    return report


# ----------------------------------------------------------------------------------------------
# terminal rendering


def _short(name: str, width: int = 56) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def format_profile(report: dict, top: int = 12) -> str:
    """Human-readable form of a :func:`profile_model` report."""
    out = []
    gpu = report["dispatch"].get("device_busy_ms") is not None
    out.append(f"profile of {report['label']} on {report['device']}  "
               f"({report['iters']} profiled forwards)")
    out.append(f"time basis: {report['time_basis']}")
    rows = [[_short(r.get("name") or short_name(r["op"])), r["category"], f"{r['calls']:.0f}",
             _report.fmt_ms(r["ms"]), _report.fmt_pct(r["share"])] for r in report["ops"][:top]]
    rest = report["ops"][top:]
    if rest:
        rows.append([f"({len(rest)} more ops)", "", f"{sum(r['calls'] for r in rest):.0f}",
                     _report.fmt_ms(sum(r["ms"] for r in rest)),
                     _report.fmt_pct(sum(r["share"] for r in rest))])
    label = "GPU idle (dispatch tax)" if gpu else "outside ATen ops (host)"
    d = report["dispatch"]
    rows.append([label, "", "", _report.fmt_ms(d.get("gpu_idle_ms", d.get("outside_ops_ms"))),
                 _report.fmt_pct(d["tax"])])
    out.append(_report.table(rows, ["kernel" if gpu else "op", "category", "calls/fwd",
                                    "time/fwd", "share"], "llrrr"))
    cats = [[c, f"{v['calls']:.0f}", _report.fmt_ms(v["ms"]), _report.fmt_pct(v["share"])]
            for c, v in report["categories"].items() if v["calls"]]
    out.append("")
    out.append(_report.table(cats, ["category", "calls/fwd", "time/fwd", "share"]))
    out.append("")
    lat = report["latency"]
    out.append(f"forward latency (no profiler): median {_report.fmt_ms(lat['median_ms'])}, "
               f"p10-p90 {_report.fmt_ms(lat['p10_ms'])}-{_report.fmt_ms(lat['p90_ms'])} "
               f"over {lat['n']} runs")
    out.append(f"{report['launch_kind']}: {report['launches_per_forward']:.0f}"
               + (f"  (all ATen ops dispatched: {report['aten_ops_per_forward']:.0f})"))
    if gpu:
        out.append(f"host issue time {_report.fmt_ms(d['host_ms'])} vs device busy "
                   f"{_report.fmt_ms(d['device_busy_ms'])} per forward of "
                   f"{_report.fmt_ms(d['wall_ms'])}: dispatch tax "
                   f"{_report.fmt_pct(d['tax'])} (GPU idle)")
    else:
        out.append(f"no separate device (device time = CPU time): ATen ops "
                   f"{_report.fmt_ms(d['aten_ms'])} of a {_report.fmt_ms(d['wall_ms'])} "
                   f"profiled forward; {_report.fmt_pct(d['tax'])} outside ops (Python, "
                   "dispatch)")
    f = report["fractions"]
    out.append(f"softmax share {_report.fmt_pct(f['softmax'])}, LayerNorm share "
               f"{_report.fmt_pct(f['layernorm'])}: together "
               f"{_report.fmt_pct(report['softmax_layernorm_share'])} of the forward")
    if "op_speedups" in report:
        out.append("")
        sp = report["op_speedups"]
        out.append(f"fused vs native on this model's own shapes (inference; "
                   f"{sp.get('basis', 'median')}):")
        srows = []
        for c in sp["calls"]:
            shape = "x".join(map(str, c["shape"]))
            row = [c["op"], f"{shape} {c['dtype']}", c["count"], f"{c['native_us']:.1f}",
                   f"{c['fused_us']:.1f}", f"{c['speedup']:.2f}x", c["backend"]]
            if gpu:
                row.insert(6, f"{c['native_wall_us']:.1f} / {c['fused_wall_us']:.1f}")
            srows.append(row)
        headers = ["op", "shape", "calls", "native us", "fused us", "speedup", "backend"]
        if gpu:
            headers.insert(6, "back-to-back wall us (nat / fused)")
        out.append(_report.table(srows, headers, "llrrrr" + ("rl" if gpu else "l")))
        a = report["amdahl"]
        not_fused = [op for op, fz in a["fused_kernels"].items() if not fz]
        out.append(
            f"Amdahl: fusing {_report.fmt_pct(a['fused_fraction'])} of the forward with the "
            f"measured op speed-ups predicts {a['predicted_speedup']:.3f}x end to end "
            f"({_report.fmt_ms(a['baseline_ms'])} -> {_report.fmt_ms(a['predicted_ms'])}); "
            f"bound with infinitely fast ops {a['bound_speedup']:.3f}x")
        if not_fused:
            out.append(f"note: no fused kernel ran for {', '.join(not_fused)} on this device "
                       "(reference backend); the 'fused' column is the PyTorch reference path, "
                       "so its ratio is the fallback's cost, not a fusion speed-up.")
    return "\n".join(out)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fusedops profile",
        description="Per-op profile, dispatch tax, softmax/LayerNorm share and Amdahl bound.",
    )
    parser.add_argument("target", nargs="?", default=None,
                        help="MODULE:FACTORY returning (model, example_inputs); MODULE may be a "
                             "dotted module or a .py path. Default: the built-in predictor.")
    parser.add_argument("--preset", default=None, help="built-in predictor preset: cpu or gpu "
                        "(default: gpu on a GPU, else cpu)")
    parser.add_argument("--checkpoint", help="built-in predictor checkpoint to load")
    parser.add_argument("--batch", type=int, help="built-in predictor batch size")
    parser.add_argument("--device", help="cuda, mps or cpu (default: best present)")
    parser.add_argument("--dtype", help="cast model and float inputs (float32/bfloat16/float16; "
                        "built-in predictor on a GPU: the preset's dtype)")
    parser.add_argument("--iters", type=int, default=10, help="profiled forwards")
    parser.add_argument("--reps", type=int, default=30, help="timed forwards (no profiler)")
    parser.add_argument("--top", type=int, default=12, help="rows of the op table")
    parser.add_argument("--no-speedups", action="store_true",
                        help="skip timing fused vs native on the captured shapes")
    parser.add_argument("--patch", action="store_true",
                        help="then patch_model and profile again (before/after)")
    parser.add_argument("--json", help="write the report(s) as JSON here")
    parser.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    _report.set_threads(args.threads)

    device = _report.pick_device(args.device)
    if args.preset is None:
        args.preset = "gpu" if _report.is_gpu(device) else "cpu"
    if args.target in (None, "predictor"):
        model, inputs, label = _builtin(args)
        if args.dtype is None and _report.is_gpu(device):
            from fusedops.models import get_preset

            args.dtype = get_preset(args.preset).dtype  # what the demo runs it in
    else:
        model, inputs = load_target(args.target)
        label = args.target
    dtype = _report.dtype_from_name(args.dtype) if args.dtype else None
    model = model.to(device=device, dtype=dtype) if dtype else model.to(device)
    inputs = move_inputs(inputs, device, dtype)

    info = _report.device_info(device)
    print(_report.heading(f"fusedops profile: {label}"))
    print(f"device: {info['name']} ({device.type}); backends: {info['backends']}")
    if not info["fused_kernels_available"]:
        print("no fused GPU kernel is available on this device: fusedops runs its PyTorch "
              "reference implementation here (correct, not faster).")
    before = profile_model(model, inputs, iters=args.iters, timing_reps=args.reps,
                           measure_speedups=not args.no_speedups, label=label, quiet=args.quiet)
    print(format_profile(before, args.top))
    result = {"device": info, "profile": before}
    if args.patch:
        from fusedops import patch_model, unpatch_model

        report = patch_model(model, example_inputs=inputs)
        print(_report.heading("patch_model"))
        print(report)
        after = profile_model(model, inputs, iters=args.iters, timing_reps=args.reps,
                              measure_speedups=False, label=label + " (patched)",
                              quiet=args.quiet)
        print(_report.heading("after patching"))
        print(format_profile(after, args.top))
        b_ms, a_ms = before["latency"]["median_ms"], after["latency"]["median_ms"]
        speedup = b_ms / a_ms
        print(f"\nmedian forward latency {_report.fmt_ms(b_ms)} -> {_report.fmt_ms(a_ms)}: "
              f"{speedup:.3f}x measured"
              + (f" vs {before['amdahl']['predicted_speedup']:.3f}x predicted"
                 if "amdahl" in before else ""))
        result.update(patch=report.to_dict(), patched=after, measured_speedup=speedup)
        unpatch_model(model)
    if args.json:
        _report.write_json(args.json, result)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
