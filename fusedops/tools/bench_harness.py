"""The timing harness shared by ``python -m fusedops bench`` and ``bench-chains``.

Devices, run metadata (device name, versions, source hash), the :class:`Timer`, the copy
bandwidth every result is compared with, the loose correctness measure, the progress bar and the
size syntax of the command lines.

Timing: ``triton.testing.do_bench`` medians (and 20/80% quantiles) on CUDA; on MPS and CPU a
``time.perf_counter`` loop that synchronises after every call. On CPU the median is the median
of :data:`CPU_REPEATS` separate runs' medians, and the commands default to one thread
(:func:`cpu_threads`): several OpenMP threads on a small or shared CPU make single calls wait for
the scheduler, and those waits, not the ops, then decide which provider looks faster.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from fusedops.tools.cli import UsageError, best_device_type, check_device

# Also the default sweep order: the target dtypes (bf16, fp32) first, so a run cut short by its
# time budget loses fp16 first.
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
}
# Loose correctness guard: max |out - torch| / max |torch| per output, per dtype.
CHECK_TOL = {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float32: 1e-3}
# Default warm-up / measurement windows (ms) per measurement, by device type.
WINDOWS_MS = {"cuda": (5.0, 25.0), "mps": (10.0, 50.0), "cpu": (1.0, 3.0)}
# CPU: the reported median is the median of this many separate runs' medians.
CPU_REPEATS = 5
# What a CPU result is (and is not): printed with every CPU table and stored in the JSON.
CPU_NOTE = ("CPU run: the fused kernels are GPU backends; on CPU fusedops runs its PyTorch "
            "reference path, so its speed-ups here time that fallback and claim no fusion win")

OOM_ERROR = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


# --- sizes and names on the command line ---------------------------------------------------------


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


def positive_size(text: str) -> int:
    """argparse type: :func:`parse_size` syntax, at least 1."""
    try:
        n = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: expected e.g. 1024, 1K, 64K+1 or 2^17") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return n


def format_size(n: int) -> str:
    """256 -> '256', 1024 -> '1K', 65537 -> '65537' (sizes that are not whole K stay exact)."""
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)


def split_list(values: str | Sequence[str] | None) -> list[str] | None:
    """'a,b' or ['a', 'b,c'] -> ['a', 'b', 'c'] (None stays None)."""
    if values is None:
        return None
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for v in values:
        out.extend(p.strip() for p in str(v).split(",") if p.strip())
    return out


def resolve_dtypes(dtypes: str | Sequence[str] | None) -> tuple[str, ...]:
    """Dtype names (bf16, fp16, fp32 and their torch spellings) -> keys of :data:`DTYPES`."""
    names = split_list(dtypes)
    if not names or names == ["all"]:
        return tuple(DTYPES)
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
               "float": "fp32"}
    out = []
    for n in names:
        n = aliases.get(n.lower(), n.lower())
        if n not in DTYPES:
            raise UsageError(f"unknown dtype {n!r}; choose from {tuple(DTYPES)}")
        if n not in out:
            out.append(n)
    return tuple(out)


# --- devices -------------------------------------------------------------------------------------


def default_device() -> str:
    """cuda if available, else mps, else cpu."""
    return best_device_type()


def require_device(device: str | None) -> str:
    """The device type to run on (None: :func:`default_device`); :class:`UsageError` when this
    machine does not have it."""
    return check_device(device).type


def windows_ms(device: str, warmup_ms: float | None, rep_ms: float | None
               ) -> tuple[float, float]:
    """The warm-up and measurement windows, the device's defaults where not given."""
    warmup, rep = WINDOWS_MS[device]
    return (warmup if warmup_ms is None else warmup_ms, rep if rep_ms is None else rep_ms)


def cpu_threads(device: str, threads: int | None) -> int | None:
    """The thread count a command runs with: ``threads`` if given, else 1 on CPU (None: leave
    torch's default alone)."""
    if threads:
        return threads
    return 1 if device == "cpu" else None


def timing_description(device: str, cuda: str) -> str:
    """How the records of a run on ``device`` were timed (``cuda``: the CUDA text)."""
    if device == "cuda":
        return cuda
    if device == "cpu":
        return (f"time.perf_counter, synchronised per call; median of {CPU_REPEATS} runs' "
                f"medians, {torch.get_num_threads()} thread(s)")
    return "time.perf_counter median, synchronised per call"


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


def versions() -> dict[str, str | None]:
    """torch, triton, fusedops, the git commit and :func:`source_sha` of this run."""
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
            "git": git, "source_sha": source_sha(), "python": platform.python_version()}


def source_sha() -> str | None:
    """Hash of the package's Python sources, to tie results to code where there is no git
    checkout (a copy of the working tree without .git)."""
    try:
        root = Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
        return h.hexdigest()[:12]
    except Exception:
        return None


def short_error(exc: BaseException) -> str:
    """``"Type: first line of the message"``, at most 200 characters."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text[:200]


# --- timing --------------------------------------------------------------------------------------


class Timer:
    """Median (and 20%/80% quantile) time of one call, in milliseconds.

    CUDA: ``triton.testing.do_bench`` (which flushes L2 between calls); when Triton is missing,
    CUDA events. MPS / CPU: a ``time.perf_counter`` loop, synchronising after every call; on CPU
    the measurement window is split into ``repeats`` runs (default :data:`CPU_REPEATS`) and the
    median reported is the median of the runs' medians (the quantiles are over every call).
    """

    def __init__(self, device: str, warmup_ms: float, rep_ms: float,
                 repeats: int | None = None):
        self.device = device
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms
        self.repeats = repeats if repeats is not None else (CPU_REPEATS if device == "cpu"
                                                            else 1)

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
    # The sweep's forward calls: one launch to a handful (naive, Dynamo's guards), under ~0.1 ms
    # of host time per call with its flush and events even on a slow host, so the 30 are
    # issued well inside this ~10 ms sleep; and a host slower than that still stays ahead, since
    # each call's 256 MiB flush plus a 2^27-element kernel takes the GPU longer than issuing
    # them takes the host. A fifth of the backward's sleep keeps this extra measurement to
    # ~20 ms per forward record.
    AHEAD_CYCLES_FORWARD = 20_000_000
    AHEAD_CALLS = 30

    def gpu_ahead(self, fn: Callable[[], Any], cycles: int | None = None) -> float | None:
        """CUDA only: the median time (ms) of single calls, each after an L2 flush, all
        enqueued behind a GPU sleep of ``cycles`` clock cycles (default :attr:`AHEAD_CYCLES`)
        so the host is far ahead and the GPU never waits for it: the GPU's own time.
        ``do_bench`` times calls the host issues as the GPU runs them; where a call's host time
        is close to its GPU time (a backward through autograd on a slow host) the GPU waits
        inside the timed window and its medians spread run to run. None elsewhere (or without
        ``torch.cuda._sleep``)."""
        sleep = getattr(torch.cuda, "_sleep", None)
        if self.device != "cuda" or sleep is None:
            return None
        if getattr(self, "_flush", None) is None:
            self._flush = torch.empty(1 << 26, dtype=torch.int32, device="cuda")  # 256 MiB
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.AHEAD_CALLS)]
        fn()
        torch.cuda.synchronize()
        sleep(self.AHEAD_CYCLES if cycles is None else cycles)
        for start, end in events:
            self._flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return quantiles([s.elapsed_time(e) for s, e in events])[0]

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
        return quantiles([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)])

    def _wall(self, fn) -> tuple[float, float, float]:
        def sync():
            synchronize(self.device)

        est = self._estimate(fn, sync)
        for _ in range(max(1, int(self.warmup_ms / est))):
            fn()
        sync()
        repeats = max(1, self.repeats)
        # The runs share the measurement window (and its 5..1000 calls).
        n = max(5, min(1000, int(self.rep_ms / est)))
        per_run = -(-n // repeats)  # ceil
        times: list[float] = []
        medians = []
        for _ in range(repeats):
            run = []
            for _ in range(per_run):
                t0 = time.perf_counter()
                fn()
                sync()
                run.append((time.perf_counter() - t0) * 1e3)
            medians.append(statistics.median(run))
            times.extend(run)
        _, lo, hi = quantiles(times)
        return statistics.median(medians), lo, hi


def quantiles(times: list[float]) -> tuple[float, float, float]:
    """(median, 20% quantile, 80% quantile), linearly interpolated."""
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


# --- correctness ---------------------------------------------------------------------------------


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
