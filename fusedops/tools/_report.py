"""Small helpers shared by the workflow tools: devices, timing, statistics, terminal output."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from fusedops.tools.cli import UsageError, check_device

# ----------------------------------------------------------------------------------------------
# devices


def pick_device(name: str | None = None) -> torch.device:
    """``name`` if given, else the best device present: CUDA, then MPS, then CPU.
    :class:`~fusedops.tools.cli.UsageError` for a device this machine does not have."""
    return check_device(name)


def sync(device: torch.device | str) -> None:
    """Wait for all queued work on ``device`` (no-op on CPU)."""
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


def is_gpu(device: torch.device | str) -> bool:
    return torch.device(device).type in ("cuda", "mps", "xpu")


def device_info(device: torch.device | str) -> dict:
    """What runs where: device name, library versions, and which backend each op would use."""
    from fusedops import _dispatch

    device = torch.device(device)
    info: dict = {
        "type": device.type,
        "name": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        info["name"] = props.name
        info["memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
        info["hip"] = getattr(torch.version, "hip", None)
    elif device.type == "mps":
        info["name"] = "Apple MPS"
    backends = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        probe = torch.empty(0, device=device, dtype=dtype)
        backend = _dispatch.backend_for(probe)
        backends[str(dtype).replace("torch.", "")] = backend.NAME
    info["backends"] = backends
    info["fused_kernels_available"] = any(name != "reference" for name in backends.values())
    return info


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
               "float": "float32"}
    value = getattr(torch, aliases.get(name, name), None)
    if not isinstance(value, torch.dtype):
        raise UsageError(f"unknown dtype {name!r}; use e.g. float32, bfloat16, float16")
    return value


# ----------------------------------------------------------------------------------------------
# timing


def time_calls(
    fn: Callable[[], object],
    device: torch.device | str,
    reps: int = 50,
    warmup: int = 5,
    inner: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> list[float]:
    """Run ``fn`` ``warmup`` times, then return ``reps`` samples of seconds per call.

    Each sample times ``inner`` back-to-back calls (synchronising the device before and after)
    and divides by ``inner``. On CUDA, CUDA events bracket the calls; elsewhere
    ``time.perf_counter``.
    """
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    cuda = device.type == "cuda"
    for i in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            sync(device)
            samples.append((time.perf_counter() - t0) / inner)
        if progress is not None:
            progress(i + 1, reps)
    return samples


def calibrate_inner(fn: Callable[[], object], device: torch.device | str,
                    target_s: float = 2e-3, cap: int = 1000) -> int:
    """How many back-to-back calls of ``fn`` take about ``target_s`` (at least 1)."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    once = max(time.perf_counter() - t0, 1e-7)
    return int(max(1, min(cap, target_s / once)))


def summarize(samples_s: Sequence[float]) -> dict:
    """Median and spread of timing samples (seconds in), in milliseconds."""
    ms = sorted(s * 1e3 for s in samples_s)
    if not ms:
        return {"n": 0}

    def q(p: float) -> float:
        # linear interpolation between closest ranks
        pos = p * (len(ms) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return ms[lo] + (ms[hi] - ms[lo]) * (pos - lo)

    return {
        "n": len(ms),
        "median_ms": q(0.5),
        "mean_ms": statistics.fmean(ms),
        "p10_ms": q(0.1),
        "p90_ms": q(0.9),
        "iqr_ms": q(0.75) - q(0.25),
        "min_ms": ms[0],
        "max_ms": ms[-1],
    }


# ----------------------------------------------------------------------------------------------
# terminal output


class Progress:
    """A one-line progress indicator on stderr (redrawn in place on a terminal, a few plain lines
    otherwise). ``quiet=True`` silences it."""

    def __init__(self, label: str, total: int | None = None, quiet: bool = False,
                 stream=None):
        self.label = label
        self.total = total
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1

    def update(self, done: int, total: int | None = None, note: str = "") -> None:
        if self.quiet:
            return
        total = total or self.total
        now = time.perf_counter()
        elapsed = now - self.start
        frac = done / total if total else 0.0
        if self.tty:
            if now - self._last_draw < 0.1 and done != total:
                return
            self._last_draw = now
            width = 24
            bar = "#" * int(width * frac) + "-" * (width - int(width * frac))
            eta = f" eta {elapsed / frac - elapsed:4.0f}s" if 0 < frac < 1 else ""
            line = f"  {self.label} [{bar}] {done}/{total} {elapsed:5.1f}s{eta} {note}"
            self.stream.write("\r" + line[:118].ljust(118))
            self.stream.flush()
        else:
            decile = int(frac * 4) if total else -1
            if decile > self._last_decile and done != total:
                self._last_decile = decile
                self.stream.write(f"  {self.label}: {done}/{total} ({elapsed:.1f}s) {note}\n")
                self.stream.flush()

    def close(self, note: str = "") -> float:
        elapsed = time.perf_counter() - self.start
        if not self.quiet:
            if self.tty:
                self.stream.write("\r" + " " * 118 + "\r")
            self.stream.write(f"  {self.label}: done in {elapsed:.1f}s {note}\n")
            self.stream.flush()
        return elapsed


@contextlib.contextmanager
def step(label: str, quiet: bool = False) -> Iterator[dict]:
    """Announce a long step on stderr and report its duration; yields a dict that receives
    ``seconds``."""
    out: dict = {}
    if not quiet:
        sys.stderr.write(f"  {label} ...\n")
        sys.stderr.flush()
    t0 = time.perf_counter()
    try:
        yield out
    finally:
        out["seconds"] = time.perf_counter() - t0
        if not quiet:
            sys.stderr.write(f"  {label}: {out['seconds']:.1f}s\n")
            sys.stderr.flush()


def table(rows: Sequence[Sequence[object]], headers: Sequence[str],
          align: str | None = None) -> str:
    """A plain-text table; ``align`` is one char per column, ``l`` or ``r`` (default: first
    column left, the rest right)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or "l" + "r" * (len(headers) - 1)
    lines = []
    for n, row in enumerate(cells):
        parts = [c.ljust(w) if a == "l" else c.rjust(w)
                 for c, w, a in zip(row, widths, align, strict=True)]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def heading(text: str) -> str:
    return f"\n== {text} " + "=" * max(0, 76 - len(text))


def fmt_ms(ms: float | None) -> str:
    if ms is None or (isinstance(ms, float) and math.isnan(ms)):
        return "-"
    if ms >= 100:
        return f"{ms:.0f} ms"
    if ms >= 1:
        return f"{ms:.2f} ms"
    return f"{ms * 1e3:.1f} us"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


@contextlib.contextmanager
def filter_native_stderr(prefixes: tuple[str, ...] = ("USDT:",)) -> Iterator[None]:
    """Drop lines starting with ``prefixes`` that native code (e.g. the profiler's tracing
    backend) writes straight to file descriptor 2; every other line is passed through."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        fd = None
    if fd != 2:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines(True):
                if not line.startswith(prefixes):
                    sys.stderr.write(line)
            sys.stderr.flush()


def write_json(path: str | os.PathLike, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(jsonable(data), f, indent=2)
        f.write("\n")


def jsonable(obj):
    """Convert tensors, dtypes, devices, tuples and NaN/inf to JSON-safe values."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (torch.dtype, torch.device, torch.Size)):
        return str(obj) if not isinstance(obj, torch.Size) else list(obj)
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    if hasattr(obj, "to_dict"):
        return jsonable(obj.to_dict())
    return str(obj)
