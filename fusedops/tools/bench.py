"""Kernel benchmark sweep: ``python -m fusedops bench`` and :func:`run_sweep`.

What it measures (see ``benchmarks/README.md`` and ``docs/performance.md``):

* ops ``softmax_fwd``, ``softmax_bwd``, ``layernorm_fwd``, ``layernorm_bwd`` (dx + dweight +
  dbias), ``rmsnorm_fwd``, ``rmsnorm_bwd`` (dx + dweight) x dtypes bf16/fp16/fp32 x row length
  N, each at ``M = total // N`` rows (``total`` = 2^27 elements by default, far larger than any
  L2), fresh random data per point;
* providers in the same run: fusedops, torch eager, torch.compile (dynamic=False, recompiled per
  shape, compile time reported), Liger-Kernel when importable, the unfused eager composition;
* the device-to-device copy bandwidth first, so every result is also a fraction of it;
* bandwidth = minimum bytes moved (:func:`bytes_moved`) / median time, GFLOP/s from the stated
  FLOP counts (:data:`FLOPS_PER_ELEMENT`), speedup of each provider against every other;
* small-shape host latency: wall time per call of fusedops vs the native torch op;
* a correctness guard: every provider's output is checked against torch eager on the same data
  before it is timed, and mismatches are marked in the results.

Timing: ``triton.testing.do_bench`` medians (and 20/80% quantiles) on CUDA; on MPS and CPU a
``time.perf_counter`` loop that synchronises after every call. CUDA backward records also carry
``ms_gpu``, the GPU's own time with the host far ahead (:meth:`Timer.gpu_ahead`); the report
lists records whose ``do_bench`` median was partly spent waiting for the host.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from fusedops.tools.bench_providers import FAMILIES, PROVIDER_NAMES, Provider, all_providers

# --- the sweep space -----------------------------------------------------------------------------

OPS = ("softmax_fwd", "softmax_bwd", "layernorm_fwd", "layernorm_bwd", "rmsnorm_fwd",
       "rmsnorm_bwd")
# Also the default sweep order: the target dtypes (bf16, fp32) first, so a run cut short by its
# time budget loses fp16 first.
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
}
SIZES = (256, 512, 1024, 2048, 4096, 8192, 8193, 16384, 32768, 65536, 65537, 131072, 262144)
TOTAL_ELEMENTS = 2**27
QUICK = {
    "dtypes": ("bf16",),
    "sizes": (1024, 8193, 16384, 65536, 65537, 262144),
}
# Small shapes whose cost is host work (Python, dispatch, launch), not memory traffic.
HOST_LATENCY_SHAPES = ((4, 128), (64, 768), (8, 128, 768))
HOST_LATENCY_OPS = ("softmax_fwd", "layernorm_fwd", "rmsnorm_fwd")

# FLOPs per element of the (M, N) input, counting exp/rsqrt as one FLOP and a compare (max) as one.
FLOPS_PER_ELEMENT = {
    # max, subtract, exp, sum, scale by 1/sum
    "softmax_fwd": 5,
    # dy*y, sum, dy - dot, y * (.)
    "softmax_bwd": 4,
    # sum (mean), subtract, square, sum (var), * rstd, * weight, + bias
    "layernorm_fwd": 7,
    # xhat (sub, mul), w*dy, sum(w*dy*xhat) (mul, add), sum(w*dy) (add),
    # dx = (w*dy - (xhat*c1 + c2)) * rstd (4), dweight += dy*xhat (2), dbias += dy (1)
    "layernorm_bwd": 13,
    # square, sum, * rstd, * weight
    "rmsnorm_fwd": 4,
    # xhat = x*rstd (1), g = w*dy (1), c = row sum of xhat*g / N (2),
    # dx = (g - xhat*c) * rstd (3), dweight += dy*xhat (2)
    "rmsnorm_bwd": 9,
}
FLOP_MODEL = {
    "softmax_fwd": "5 flops/element: max, subtract, exp, sum, scale",
    "softmax_bwd": "4 flops/element: dy*y, row sum, subtract, multiply",
    "layernorm_fwd": "7 flops/element: mean sum, subtract, square, var sum, *rstd, *w, +b",
    "layernorm_bwd": "13 flops/element: xhat (2), w*dy (1), two row sums (3), dx (4), "
    "dweight (2), dbias (1)",
    "rmsnorm_fwd": "4 flops/element: square, sum, *rstd, *w",
    "rmsnorm_bwd": "9 flops/element: xhat (1), w*dy (1), row sum of xhat*w*dy (2), "
    "dx = (w*dy - xhat*c)*rstd (3), dweight (2)",
}
BYTES_MODEL = {
    "softmax_fwd": "2*M*N*elt (read x, write y)",
    "softmax_bwd": "3*M*N*elt (read y and dy, write dx)",
    "layernorm_fwd": "2*M*N*elt + 2*N*welt (read x, w, b; write y)",
    "layernorm_bwd": "3*M*N*elt + 3*N*welt + 8*M (read x, dy, w, mean, rstd; write dx, dw, db)",
    "rmsnorm_fwd": "2*M*N*elt + N*welt (read x, w; write y)",
    "rmsnorm_bwd": "3*M*N*elt + 2*N*welt + 4*M (read x, dy, w, rstd; write dx, dw)",
}
# Loose correctness guard: max |out - torch| / max |torch| per output, per dtype.
CHECK_TOL = {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float32: 1e-3}
# A provider is "slower" than another only beyond this relative margin (run-to-run noise).
NOISE = 0.02


def family(op: str) -> str:
    return op.split("_")[0]


def is_backward(op: str) -> bool:
    return op.endswith("_bwd")


def bytes_moved(op: str, M: int, N: int, elt: int, welt: int | None = None) -> int:
    """Minimum bytes an ideal kernel moves: each input read once, each output written once.

    ``elt`` is the element size of x/y/dy/dx, ``welt`` that of weight/bias and their grads
    (defaults to ``elt``). LayerNorm backward also reads the float32 mean and rstd (8 B per row),
    RMSNorm backward the float32 rstd (4 B per row).
    """
    welt = elt if welt is None else welt
    if op == "softmax_fwd":
        return 2 * M * N * elt
    if op == "softmax_bwd":
        return 3 * M * N * elt
    if op == "layernorm_fwd":
        return 2 * M * N * elt + 2 * N * welt
    if op == "layernorm_bwd":
        return 3 * M * N * elt + 3 * N * welt + 8 * M
    if op == "rmsnorm_fwd":
        return 2 * M * N * elt + N * welt
    if op == "rmsnorm_bwd":
        return 3 * M * N * elt + 2 * N * welt + 4 * M
    raise ValueError(f"unknown op {op!r}; expected one of {OPS}")


def flops(op: str, M: int, N: int) -> int:
    """FLOPs of one call, from :data:`FLOPS_PER_ELEMENT`."""
    if op not in FLOPS_PER_ELEMENT:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    return FLOPS_PER_ELEMENT[op] * M * N


def rows_for(N: int, total: int = TOTAL_ELEMENTS) -> int:
    """M = total // N (at least one row)."""
    return max(1, total // N)


# --- parsing -------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """'256', '1K', '16k', '64K+1', '2^17', '1M' -> int."""
    t = text.strip().upper().replace(" ", "")
    if not t:
        raise ValueError("empty size")
    if "+" in t:
        head, tail = t.split("+", 1)
        return parse_size(head) + parse_size(tail)
    if "^" in t:
        base, exp = t.split("^", 1)
        return int(base) ** int(exp)
    mult = {"K": 1024, "M": 1024**2}.get(t[-1])
    if mult:
        return int(t[:-1]) * mult
    return int(t)


def format_size(n: int) -> str:
    """256 -> '256', 1024 -> '1K', 65537 -> '65537' (sizes that are not whole K stay exact)."""
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)


def _split(values: str | Sequence[str] | None) -> list[str] | None:
    if values is None:
        return None
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for v in values:
        out.extend(p.strip() for p in str(v).split(",") if p.strip())
    return out


def resolve_ops(ops: str | Sequence[str] | None) -> tuple[str, ...]:
    """'all', op names, or shorthands: a family ('softmax', 'layernorm', 'rmsnorm'), 'fwd',
    'bwd', and the prefixes 'ln_' / 'rms_' for 'layernorm_' / 'rmsnorm_' ('rms_bwd')."""
    if ops is None:
        return OPS
    names = _split(ops) or []
    if names == ["all"]:
        return OPS
    chosen: list[str] = []
    for name in names:
        name = name.lower().replace("-", "_")
        for short, full in (("ln_", "layernorm_"), ("rms_", "rmsnorm_")):
            if name.startswith(short):
                name = full + name[len(short):]
        if name in OPS:
            match = [name]
        elif name in FAMILIES:
            match = [o for o in OPS if family(o) == name]
        elif name in ("fwd", "bwd"):
            match = [o for o in OPS if o.endswith(name)]
        else:
            raise ValueError(
                f"unknown op {name!r}; choose from {OPS}, {', '.join(FAMILIES)}, fwd, bwd"
            )
        chosen.extend(o for o in match if o not in chosen)
    return tuple(o for o in OPS if o in chosen)


def resolve_dtypes(dtypes: str | Sequence[str] | None) -> tuple[str, ...]:
    names = _split(dtypes)
    if not names or names == ["all"]:
        return tuple(DTYPES)
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
               "float": "fp32"}
    out = []
    for n in names:
        n = aliases.get(n.lower(), n.lower())
        if n not in DTYPES:
            raise ValueError(f"unknown dtype {n!r}; choose from {tuple(DTYPES)}")
        if n not in out:
            out.append(n)
    return tuple(out)


def resolve_sizes(sizes: str | Sequence[int | str] | None) -> tuple[int, ...]:
    if sizes is None:
        return SIZES
    if isinstance(sizes, str):
        sizes = _split(sizes) or []
    out = []
    for s in sizes:
        n = s if isinstance(s, int) else parse_size(str(s))
        if n < 1:
            raise ValueError(f"sizes must be positive, got {s!r}")
        if n not in out:
            out.append(n)
    return tuple(out)


def resolve_providers(providers: str | Sequence[str] | None) -> tuple[str, ...]:
    names = _split(providers)
    if not names or names == ["all"]:
        return PROVIDER_NAMES
    out = []
    for n in names:
        n = n.lower()
        n = {"eager": "torch", "inductor": "compile", "torch.compile": "compile",
             "liger-kernel": "liger", "unfused": "naive"}.get(n, n)
        if n not in PROVIDER_NAMES:
            raise ValueError(f"unknown provider {n!r}; choose from {PROVIDER_NAMES}")
        if n not in out:
            out.append(n)
    # Keep the canonical order so tables and plots are stable.
    return tuple(p for p in PROVIDER_NAMES if p in out)


# --- device helpers ------------------------------------------------------------------------------


def default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


def empty_cache(device: str) -> None:
    if device == "cpu":
        return
    gc.collect()  # drop reference cycles that still hold device tensors
    if device == "cuda":
        torch.cuda.empty_cache()
    elif device == "mps":
        torch.mps.empty_cache()


def _apple_chip_name() -> str | None:
    try:
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                             text=True, timeout=5)
    except Exception:
        return None
    name = out.stdout.strip()
    return name or None


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    if device == "mps":
        return _apple_chip_name() or "Apple GPU (mps)"
    return platform.processor() or platform.machine() or "cpu"


def apple_peak_tbps(name: str) -> float | None:
    """Peak memory bandwidth (TB/s) of a known Apple chip, from ``fusedops.tools.apple_chips``."""
    try:
        from fusedops.tools.apple_chips import peak_bandwidth_gbps
    except ImportError:
        return None
    try:
        gbps = peak_bandwidth_gbps(name)
    except Exception:
        return None
    return None if gbps is None else gbps / 1000.0


def _versions() -> dict[str, str | None]:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    try:
        import fusedops

        fusedops_version = fusedops.__version__
    except Exception:
        fusedops_version = None
    git = None
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            git = out.stdout.strip() or None
    except Exception:
        pass
    return {"torch": torch.__version__, "triton": triton_version, "fusedops": fusedops_version,
            "git": git, "source_sha": _source_sha(), "python": platform.python_version()}


def _source_sha() -> str | None:
    """Hash of the package's Python sources, to tie results to code where there is no git
    checkout (the lent GPU gets a copy of the working tree without .git)."""
    try:
        import hashlib

        root = Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
        return h.hexdigest()[:12]
    except Exception:
        return None


# --- timing --------------------------------------------------------------------------------------


class Timer:
    """Median (and 20%/80% quantile) time of one call, in milliseconds.

    CUDA: ``triton.testing.do_bench`` (which flushes L2 between calls); when Triton is missing,
    CUDA events. MPS / CPU: a ``time.perf_counter`` loop, synchronising after every call.
    """

    def __init__(self, device: str, warmup_ms: float, rep_ms: float):
        self.device = device
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, float, float]:
        if self.device == "cuda":
            try:
                from triton.testing import do_bench
            except ImportError:
                return self._events(fn)
            p50, p20, p80 = do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms,
                                     quantiles=[0.5, 0.2, 0.8])
            return float(p50), float(p20), float(p80)
        return self._wall(fn)

    # A GPU sleep long enough for the host to enqueue every call of ``gpu_ahead`` behind it
    # (about 50 ms at 2 GHz; a slow host needs up to ~0.5 ms per backward call).
    AHEAD_CYCLES = 100_000_000
    AHEAD_CALLS = 30

    def gpu_ahead(self, fn: Callable[[], Any]) -> float | None:
        """CUDA only: the median time (ms) of single calls, each after an L2 flush, all
        enqueued behind a GPU sleep so the host is far ahead and the GPU never waits for it:
        the GPU's own time. ``do_bench`` times calls the host issues as the GPU runs them; where
        a call's host time is close to its GPU time (a backward through autograd on a slow
        host) the GPU waits inside the timed window and its medians spread run to run. None
        elsewhere (or without ``torch.cuda._sleep``)."""
        sleep = getattr(torch.cuda, "_sleep", None)
        if self.device != "cuda" or sleep is None:
            return None
        if getattr(self, "_flush", None) is None:
            self._flush = torch.empty(1 << 26, dtype=torch.int32, device="cuda")  # 256 MiB
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.AHEAD_CALLS)]
        fn()
        torch.cuda.synchronize()
        sleep(self.AHEAD_CYCLES)
        for start, end in events:
            self._flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return _quantiles([s.elapsed_time(e) for s, e in events])[0]

    def _estimate(self, fn, sync) -> float:
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        sync()
        return max((time.perf_counter() - t0) / 3 * 1e3, 1e-4)

    def _events(self, fn) -> tuple[float, float, float]:
        sync = torch.cuda.synchronize
        est = self._estimate(fn, sync)
        for _ in range(max(1, int(self.warmup_ms / est))):
            fn()
        n = max(5, min(1000, int(self.rep_ms / est)))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for s, e in zip(starts, ends, strict=True):
            s.record()
            fn()
            e.record()
        sync()
        return _quantiles([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)])

    def _wall(self, fn) -> tuple[float, float, float]:
        def sync():
            synchronize(self.device)

        est = self._estimate(fn, sync)
        for _ in range(max(1, int(self.warmup_ms / est))):
            fn()
        sync()
        n = max(5, min(1000, int(self.rep_ms / est)))
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return _quantiles(times)


def _quantiles(times: list[float]) -> tuple[float, float, float]:
    times = sorted(times)

    def q(p: float) -> float:
        if len(times) == 1:
            return times[0]
        pos = p * (len(times) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(times) - 1)
        return times[lo] + (times[hi] - times[lo]) * (pos - lo)

    return q(0.5), q(0.2), q(0.8)


def measure_copy_bandwidth(device: str, timer: Timer, elements: int) -> dict[str, Any]:
    """Device-to-device copy of a float32 buffer (``dst.copy_(src)``): bytes = read + write."""
    src = torch.ones(elements, dtype=torch.float32, device=device)
    bufs = [src, torch.empty_like(src)]
    nbytes = 2 * src.numel() * src.element_size()
    del src
    ms, lo, hi = timer(lambda: bufs[1].copy_(bufs[0]))
    bufs.clear()
    empty_cache(device)
    return {"bytes": nbytes, "ms": ms, "tbps": nbytes / (ms * 1e-3) / 1e12}


# --- correctness guard ---------------------------------------------------------------------------


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (nan when out has non-finite values that ref does not)."""
    if out.shape != ref.shape:
        return float("inf")
    a = out.detach().float()
    b = ref.detach().float()
    denom = b.abs().max().item() if b.numel() else 0.0
    diff = (a - b).abs().max().item() if b.numel() else 0.0
    return diff / max(denom, 1e-12)


def check_outputs(outs: Sequence[torch.Tensor | None], refs: Sequence[torch.Tensor | None],
                  dtype: torch.dtype) -> tuple[bool, float]:
    """Loose comparison of each output with torch's; returns (ok, worst relative error)."""
    worst = 0.0
    for out, ref in zip(outs, refs, strict=True):
        if ref is None:
            continue
        if out is None:
            return False, float("inf")
        err = rel_error(out, ref)
        if not err <= worst:  # also catches nan
            worst = err
    ok = worst <= CHECK_TOL.get(dtype, 1e-3)
    return ok, worst


# --- progress ------------------------------------------------------------------------------------


class Progress:
    """A plain-text progress bar on stderr: redrawn in place on a terminal, else one line at most
    every ``interval`` seconds (so logs stay short)."""

    def __init__(self, total: int, enabled: bool = True, stream=None, interval: float = 20.0):
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval
        self.t0 = time.perf_counter()
        self._last = -math.inf

    def line(self, label: str) -> str:
        frac = self.done / self.total
        width = 24
        filled = int(round(frac * width))
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        eta_s = "?" if math.isnan(eta) else _fmt_duration(eta)
        return (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"{_fmt_duration(elapsed)} elapsed, eta {eta_s}  {label}")

    def update(self, label: str, advance: int = 0) -> None:
        self.done = min(self.total, self.done + advance)
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            self.stream.write("\r\033[K" + self.line(label)[:160])
            self.stream.flush()
        elif now - self._last >= self.interval or self.done == self.total:
            self._last = now
            self.stream.write(self.line(label) + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _fmt_duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


# --- one sweep point -----------------------------------------------------------------------------


_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def _short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text[:200]


class _Point:
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


def _base_record(op: str, dtype_name: str, M: int, N: int, provider: str, elt: int) -> dict:
    return {
        "op": op, "dtype": dtype_name, "M": M, "N": N, "provider": provider,
        "backend": None, "status": "error", "ok": None, "max_err": None,
        "ms": None, "ms_p20": None, "ms_p80": None,
        "bytes": bytes_moved(op, M, N, elt), "flops": flops(op, M, N),
        "tbps": None, "gflops": None, "copy_tbps": None, "frac_copy": None,
        "compile_s": None, "first_call_s": None, "error": None,
    }


def _finish_record(rec: dict, ms: float, lo: float, hi: float, copy_tbps: float | None,
                   peak_tbps: float | None) -> None:
    rec["ms"], rec["ms_p20"], rec["ms_p80"] = ms, lo, hi
    rec["tbps"] = rec["bytes"] / (ms * 1e-3) / 1e12
    rec["gflops"] = rec["flops"] / (ms * 1e-3) / 1e9
    rec["copy_tbps"] = copy_tbps
    rec["frac_copy"] = rec["tbps"] / copy_tbps if copy_tbps else None
    if peak_tbps:
        rec["peak_tbps"] = peak_tbps
        rec["frac_peak"] = rec["tbps"] / peak_tbps


def _run_provider(point: _Point, provider: Provider, ops: Sequence[str], dtype_name: str,
                  timer: Timer, check: bool, copy_tbps: float | None, peak_tbps: float | None,
                  share_compile: bool) -> list[dict]:
    """Time ``provider`` on every op of ``point`` (forward then backward, one compile shared)."""
    device = point.device
    elt = point.x.element_size()
    records = []
    try:
        fn = provider.make(point.family)
    except Exception as exc:
        for op in ops:
            rec = _base_record(op, dtype_name, point.M, point.N, provider.name, elt)
            rec["error"] = _short_error(exc)
            records.append(rec)
        return records
    # The compile provider times its forward in grad mode when the backward is also measured,
    # so one compiled (training) graph serves both and each shape is compiled once.
    compile_grad_fwd = provider.compiles and share_compile and point.need_bwd
    train_compiled = False
    grad_inputs = None
    for op in ops:
        rec = _base_record(op, dtype_name, point.M, point.N, provider.name, elt)
        records.append(rec)
        try:
            rec["backend"] = provider.backend(point.x)
            if not is_backward(op):
                if compile_grad_fwd:
                    grad_inputs = grad_inputs or point.grad_inputs()
                    args = point.args(grad_inputs)
                    rec["fwd_mode"] = "train"
                else:
                    args = point.args()
                    rec["fwd_mode"] = "inference"
                with torch.set_grad_enabled(compile_grad_fwd):
                    t0 = time.perf_counter()
                    y = fn(*args)
                    synchronize(device)
                    first = time.perf_counter() - t0
                    outs, refs = (y,), (point.ref_y,)
                    if check:
                        rec["ok"], rec["max_err"] = check_outputs(outs, refs, point.dtype)
                    del y, outs
                    ms, lo, hi = timer(lambda fn=fn, args=args: fn(*args))
                train_compiled = compile_grad_fwd
            else:
                grad_inputs = grad_inputs or point.grad_inputs()
                args = point.args(grad_inputs)
                with torch.enable_grad():
                    t0 = time.perf_counter()
                    y = fn(*args)
                    synchronize(device)
                    first = time.perf_counter() - t0
                    dy = point.dy
                    t1 = time.perf_counter()
                    grads = torch.autograd.grad(y, grad_inputs, dy, retain_graph=True)
                    synchronize(device)
                    first_bwd = time.perf_counter() - t1
                    if check:
                        rec["ok"], rec["max_err"] = check_outputs(grads, point.ref_grads,
                                                                  point.dtype)
                    del grads

                    def run_bwd(y=y, inputs=grad_inputs, dy=dy):
                        return torch.autograd.grad(y, inputs, dy, retain_graph=True)

                    ms, lo, hi = timer(run_bwd)
                    try:  # an extra measurement: its failure must not cost the record
                        rec["ms_gpu"] = timer.gpu_ahead(run_bwd)
                    except Exception as exc:
                        rec["ms_gpu"] = None
                        rec["ms_gpu_error"] = _short_error(exc)
                    del y, run_bwd
                first = first_bwd + (first if provider.compiles and not train_compiled else 0.0)
                train_compiled = True
            rec["first_call_s"] = first
            if provider.compiles:
                # First-call time of a freshly compiled graph (the backward graph is compiled
                # lazily at its first call), so the compile_s of a point's records add up to
                # what compiling that shape cost.
                rec["compile_s"] = first
            _finish_record(rec, ms, lo, hi, copy_tbps, peak_tbps)
            rec["status"] = "ok" if rec["ok"] in (True, None) else "wrong"
        except Exception as exc:
            rec["status"] = "error"
            rec["error"] = _short_error(exc)
            if isinstance(exc, _OOM):
                empty_cache(device)
    fn = grad_inputs = None
    if provider.compiles:
        torch._dynamo.reset()
    return records


def annotate_speedups(records: list[dict]) -> None:
    """Add ``speedup`` = {other provider: other_ms / this_ms} to every timed record."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["op"], r["dtype"], r["N"]), []).append(r)
    for group in groups.values():
        for r in group:
            r["speedup"] = {
                o["provider"]: (o["ms"] / r["ms"])
                for o in group
                if o is not r and r.get("ms") and o.get("ms")
            }


# --- host latency --------------------------------------------------------------------------------


def measure_host_latency(device: str, providers: Sequence[str] | None = None,
                         shapes: Iterable[Sequence[int]] = HOST_LATENCY_SHAPES,
                         ops: Sequence[str] = HOST_LATENCY_OPS, dtype: str = "fp16",
                         calls: int = 2000, repeats: int = 7, warmup: int = 200) -> list[dict]:
    """Wall time per call (µs) of small ops: ``calls`` back-to-back calls after a warm-up,
    synchronising once at the end; the median over ``repeats`` runs is reported with the best.
    The providers of one case take turns run by run, so a host that drifts during the
    measurement (seen on the lent machines: torch's own call 7-10 µs from one minute to the
    next) moves every provider's runs alike. The compile provider is left out (its guards are
    a separate story)."""
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
            fam = family(op)
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
                    rec["error"] = _short_error(exc)
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
                        rec["error"] = _short_error(exc)
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


# --- the sweep -----------------------------------------------------------------------------------


def plan(ops: Sequence[str], dtypes: Sequence[str], sizes: Sequence[int],
         providers: Sequence[str], warmup_ms: float, rep_ms: float,
         compile_s_per_shape: float = 1.5, jit_s_per_kernel: float = 0.3) -> dict[str, Any]:
    """Point counts and a rough time estimate (seconds) for a sweep on a GPU.

    Per timed measurement: warmup + rep + ~45 ms (first call, correctness check, do_bench's own
    estimate, data and cleanup; measured on an H200: 24 points x 5 providers in 31 s, of which
    13 s compiling); per compiled shape (one per op family, dtype and N):
    ``compile_s_per_shape``; per Triton
    kernel specialisation of fusedops/Liger (one per op, dtype and block size):
    ``jit_s_per_kernel``.
    """
    n_points = len(ops) * len(dtypes) * len(sizes)
    fams = {family(o) for o in ops}
    measurements = n_points * len(providers)
    compiles = len(fams) * len(dtypes) * len(sizes) if "compile" in providers else 0
    blocks = len({1 << (n - 1).bit_length() for n in sizes})
    jit = sum(p in providers for p in ("fusedops", "liger")) * len(ops) * len(dtypes) * blocks
    t_measure = measurements * (warmup_ms + rep_ms + 45.0) / 1e3
    t_compile = compiles * compile_s_per_shape
    t_jit = jit * jit_s_per_kernel
    return {"points": n_points, "measurements": measurements, "compiled_shapes": compiles,
            "jit_kernels": jit, "est_measure_s": t_measure, "est_compile_s": t_compile,
            "est_jit_s": t_jit, "est_total_s": t_measure + t_compile + t_jit + 15.0}


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
        device: "cuda", "mps" or "cpu" (default: the best available).
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
    device = device or default_device()
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but CUDA is not available")
    if device == "mps" and not (getattr(torch.backends, "mps", None)
                                and torch.backends.mps.is_available()):
        raise RuntimeError("--device mps requested but MPS is not available")
    ops_t = resolve_ops(ops)
    dtypes_t = resolve_dtypes(dtypes)
    sizes_t = resolve_sizes(sizes)
    prov_t = resolve_providers(providers)
    if total is None:
        total = 2**14 if device == "cpu" else TOTAL_ELEMENTS
    defaults = {"cuda": (5.0, 25.0), "mps": (10.0, 50.0), "cpu": (1.0, 3.0)}[device]
    warmup_ms = defaults[0] if warmup_ms is None else warmup_ms
    rep_ms = defaults[1] if rep_ms is None else rep_ms
    if copy_elements is None:
        copy_elements = total if device == "cpu" else max(total, TOTAL_ELEMENTS)

    table = all_providers()
    unavailable = {}
    active: list[Provider] = []
    sweep_families = [f for f in FAMILIES if any(family(o) == f for o in ops_t)]
    for name in prov_t:
        reason = table[name].unavailable_reason(device, sweep_families)
        if reason is None:
            active.append(table[name])
        else:
            unavailable[name] = reason

    name = device_name(device)
    peak_tbps = apple_peak_tbps(name) if device == "mps" else None
    timer = Timer(device, warmup_ms, rep_ms)
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "device": name,
        "device_type": device,
        **_versions(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "copy_tbps": None,
        "copy": None,
        "peak_tbps": peak_tbps,
        "config": {
            "ops": list(ops_t), "dtypes": list(dtypes_t), "sizes": list(sizes_t),
            "providers": [p.name for p in active], "total_elements": total,
            "warmup_ms": warmup_ms, "rep_ms": rep_ms, "check": check,
            "share_compile": share_compile, "timing": "triton.testing.do_bench median"
            if device == "cuda" else "time.perf_counter median, synchronised per call",
            "check_tolerance": {k: CHECK_TOL[v] for k, v in DTYPES.items()},
            "noise": NOISE,
        },
        "providers": {p.name: p.description for p in active},
        "providers_unavailable": unavailable,
        "bytes_model": BYTES_MODEL,
        "flop_model": FLOP_MODEL,
        "records": [],
        "host_latency": [],
        "skipped": [],
        "truncated": False,
    }
    if device == "cuda":
        result["device_properties"] = {
            "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
            "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        }
    # Copy bandwidth first: every result is also reported as a fraction of it.
    copy = measure_copy_bandwidth(device, timer, copy_elements)
    result["copy"] = copy
    result["copy_tbps"] = copy["tbps"]
    if progress:
        print(f"fusedops bench: {name}, copy {copy['tbps']:.3f} TB/s "
              f"({copy['bytes'] / 2**20:.0f} MiB moved in {copy['ms']:.3f} ms)", file=sys.stderr)

    if host_latency:
        if host_latency_calls is None and device == "cpu":
            host_latency_calls = 20  # CPU "latency" is compute time; keep test runs short
        kw = {} if host_latency_calls is None else {"calls": host_latency_calls,
                                                    "warmup": max(1, host_latency_calls // 10),
                                                    "repeats": 3}
        host_dtype = "fp32" if device == "cpu" else "fp16"
        result["host_latency"] = measure_host_latency(device, [p.name for p in active],
                                                      shapes=host_latency_shapes,
                                                      dtype=host_dtype, **kw)
        if on_point:
            on_point(result)

    # Points: dtype-major (bf16 first), then op family, then N; fwd and bwd of a family share
    # the data and the compiled graph.
    fam_ops = {f: [o for o in ops_t if family(o) == f] for f in FAMILIES}
    points = [(dt, f, n) for dt in dtypes_t for f in FAMILIES if fam_ops[f] for n in sizes_t]
    bar = Progress(len(points) * len(active), enabled=progress)
    compile_spent = 0.0
    records = result["records"]
    torch_ref = table["torch"]
    for idx, (dt_name, fam, n) in enumerate(points):
        m = rows_for(n, total)
        label = f"{fam} {dt_name} N={format_size(n)}"
        if time_budget_s is not None and time.perf_counter() - t_start > time_budget_s:
            result["truncated"] = True
            for dt2, f2, n2 in points[idx:]:
                result["skipped"].append({"dtype": dt2, "family": f2, "N": n2,
                                          "reason": "time budget"})
            break
        dtype = DTYPES[dt_name]
        point = None
        try:
            point = _Point(fam, fam_ops[fam], dtype, m, n, device, seed + idx)
            if check:
                point.compute_refs(torch_ref)
        except Exception as exc:
            for p in active:
                for op in fam_ops[fam]:
                    rec = _base_record(op, dt_name, m, n, p.name, dtype.itemsize)
                    rec["error"] = "setup: " + _short_error(exc)
                    records.append(rec)
            bar.update(label, advance=len(active))
            if point is not None:
                point.release()
            empty_cache(device)
            continue
        for p in active:
            bar.update(f"{label} {p.name}")
            if p.compiles and compile_budget_s is not None and compile_spent > compile_budget_s:
                for op in fam_ops[fam]:
                    rec = _base_record(op, dt_name, m, n, p.name, dtype.itemsize)
                    rec["status"] = "skipped"
                    rec["error"] = "compile budget spent"
                    records.append(rec)
            else:
                recs = _run_provider(point, p, fam_ops[fam], dt_name, timer, check,
                                     copy["tbps"], peak_tbps, share_compile)
                compile_spent += sum(r["compile_s"] or 0.0 for r in recs)
                records.extend(recs)
            bar.update(f"{label} {p.name}", advance=1)
        point.release()
        del point
        empty_cache(device)
        annotate_speedups(records)
        result["elapsed_s"] = time.perf_counter() - t_start
        if on_point:
            on_point(result)
    bar.close()
    annotate_speedups(records)
    result["compile_s_total"] = compile_spent
    result["elapsed_s"] = time.perf_counter() - t_start
    return result


# --- CLI -----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fusedops bench",
        description="Benchmark fused softmax / LayerNorm / RMSNorm against torch eager, "
        "torch.compile, "
        "Liger-Kernel and the unfused composition: TB/s, GFLOP/s, fraction of the measured "
        "copy bandwidth, speedups; JSON/CSV/PNG under --out.",
    )
    p.add_argument("--device", choices=("cuda", "mps", "cpu"), default=None,
                   help="default: cuda if available, else mps, else cpu (tiny sizes)")
    p.add_argument("--ops", default=None,
                   help=f"comma list of {', '.join(OPS)} or {'/'.join(FAMILIES)}/fwd/bwd, "
                   "ln_*/rms_* for layernorm_*/rmsnorm_* (default all)")
    p.add_argument("--dtypes", default=None, help="comma list of bf16,fp16,fp32 (default all)")
    p.add_argument("--sizes", default=None,
                   help="comma list of N, e.g. 1K,8193,64K+1 (default the full sweep: "
                   + ",".join(format_size(s) for s in SIZES) + ")")
    p.add_argument("--providers", default=None,
                   help=f"comma list of {', '.join(PROVIDER_NAMES)} (default all)")
    p.add_argument("--quick", action="store_true",
                   help="bf16 only at N in " + ",".join(format_size(s) for s in QUICK["sizes"])
                   + " (explicit --dtypes/--sizes still win)")
    p.add_argument("--total", type=parse_size, default=None,
                   help="elements per point, M = total // N (default 2^27; 2^14 on cpu)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up ms per point (default 5)")
    p.add_argument("--rep", type=float, default=None, help="measurement ms per point (default 25)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness guard")
    p.add_argument("--no-host-latency", action="store_true", help="skip the small-shape cases")
    p.add_argument("--host-latency-only", action="store_true",
                   help="only the copy bandwidth and the small-shape cases")
    p.add_argument("--separate-compile", action="store_true",
                   help="compile an inference graph for fwd and a training graph for bwd "
                   "(default: one training graph per shape serves both)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds; start no new point after this (the rest is marked skipped)")
    p.add_argument("--compile-budget", type=float, default=None,
                   help="seconds of torch.compile time after which the compile provider is skipped")
    p.add_argument("--out", default="out/bench", help="output folder (default out/bench)")
    p.add_argument("--tag", default=None,
                   help="file name stem (default <gpu>-<date>, e.g. h200-2026-11-21)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--plot-by", choices=("auto", "op", "family"), default="auto",
                   help="one PNG per op, or per op family (fwd and bwd in one figure); auto "
                   "(default): per op up to 4 ops, else per family, so a full sweep's files "
                   "fit the 8 a lent-GPU run brings back")
    p.add_argument("--table", choices=("full", "short", "none"), default="full",
                   help="table printed at the end (default full)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--plan", action="store_true",
                   help="print the number of points and a time estimate, then exit")
    p.add_argument("--report", nargs="+", metavar="JSON", default=None,
                   help="no benchmarking: load result JSON file(s) (merged in order), "
                   "print the table and rewrite CSV/plots under --out")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    from fusedops.tools import bench_report

    args = build_parser().parse_args(argv)
    if args.report:
        result = bench_report.merge_results([bench_report.load_result(f) for f in args.report])
        paths = bench_report.write_outputs(result, args.out, stem=args.tag,
                                           plots=not args.no_plots, plot_by=args.plot_by)
        print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr, flush=True)
        _print_tables(result, args.table)
        return 0
    dtypes, sizes = args.dtypes, args.sizes
    if args.quick:
        dtypes = dtypes or ",".join(QUICK["dtypes"])
        sizes = sizes or ",".join(str(s) for s in QUICK["sizes"])
    device = args.device or default_device()
    if sizes is None and device == "cpu":
        sizes = "256,1K"  # tiny mode: the CPU path exists for tests and smoke runs
    try:
        ops_t, dtypes_t = resolve_ops(args.ops), resolve_dtypes(dtypes)
        sizes_t, prov_t = resolve_sizes(sizes), resolve_providers(args.providers)
    except ValueError as exc:
        print(f"fusedops bench: {exc}", file=sys.stderr)
        return 2
    if args.host_latency_only:
        ops_t = ()
    warmup = args.warmup if args.warmup is not None else 5.0
    rep = args.rep if args.rep is not None else 25.0
    if args.plan:
        est = plan(ops_t, dtypes_t, sizes_t, prov_t, warmup, rep)
        for k, v in est.items():
            print(f"{k:>16}: {v:.0f}" if isinstance(v, float) else f"{k:>16}: {v}")
        return 0

    out_dir = Path(args.out)
    state: dict[str, Any] = {}

    def checkpoint(partial: dict) -> None:
        # Keep a JSON of what is done so far: a killed run still leaves its results.
        state["stem"] = state.get("stem") or bench_report.default_stem(partial, args.tag)
        bench_report.write_json(partial, out_dir / f"{state['stem']}.json")

    try:
        result = run_sweep(
            ops=ops_t, dtypes=dtypes_t, sizes=sizes_t, providers=prov_t, device=device,
            total=args.total, warmup_ms=args.warmup, rep_ms=args.rep, check=not args.no_check,
            host_latency=not args.no_host_latency, share_compile=not args.separate_compile,
            time_budget_s=args.time_budget, compile_budget_s=args.compile_budget,
            progress=not args.quiet, seed=args.seed, on_point=checkpoint,
        )
    except RuntimeError as exc:
        print(f"fusedops bench: {exc}", file=sys.stderr)
        return 2
    paths = bench_report.write_outputs(result, out_dir, stem=args.tag, plots=not args.no_plots,
                                       plot_by=args.plot_by)
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr, flush=True)
    _print_tables(result, args.table)
    return 0


def _print_tables(result: dict, which: str) -> None:
    from fusedops.tools import bench_report

    if which == "none":
        return
    text = (bench_report.format_short_table(result) if which == "short"
            else bench_report.format_report(result))
    print(text)

