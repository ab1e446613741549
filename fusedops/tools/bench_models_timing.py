"""Timing of ``python -m fusedops bench-models``: wall and host time of interleaved rounds, the
GPU's own time behind a ``torch.cuda._sleep`` (CUDA), the GPU's busy time from the profiler's
kernel records (CUDA), the peak memory of one step (CUDA), and the median and 20%/80%
quantiles every time is reported with."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fusedops.tools import bench_harness
from fusedops.tools.bench_models_common import short_error

GPU_SAMPLES = 5
SLEEP_MIN_MS = 20.0
SLEEP_MAX_MS = 5000.0
KERNEL_STEPS = 3  # profiled steps per variant for the GPU's busy time (generate: 1)


def quantiles(values: Sequence[float]) -> dict[str, float | None]:
    """Median and 20%/80% quantiles (linear interpolation between closest ranks); None each
    when there are no values."""
    if not values:
        return {"median": None, "p20": None, "p80": None}
    median, p20, p80 = bench_harness.quantiles(list(values))
    return {"median": median, "p20": p20, "p80": p80}


def sync_fn(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def time_once(step: Callable[[], Any], sync: Callable[[], None],
              repeats: int = 1) -> tuple[float, float]:
    """(wall, host) seconds per step of ``repeats`` steps back to back: the device is idle at
    the start; host = until the last call returns, wall = until the device is done."""
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        step()
    t1 = time.perf_counter()
    sync()
    return (time.perf_counter() - t0) / repeats, (t1 - t0) / repeats


MAX_REPEATS = 64


def steps_per_round(steps: dict[str, Callable[[], Any]], sync: Callable[[], None],
                    min_round_s: float) -> int:
    """Steps each variant runs per round so that the fastest variant's round lasts about
    ``min_round_s`` (at most MAX_REPEATS; 1 for 0): one short step's time is the host's
    scheduling jitter as much as the step, which a round of several averages out."""
    times = []
    for step in steps.values() if min_round_s > 0 else ():
        try:
            times.append(time_once(step, sync)[0])
        except Exception:  # (it fails again in its round, which records the error)
            continue
    if not times:
        return 1
    return max(1, min(MAX_REPEATS, math.ceil(min_round_s / max(min(times), 1e-6))))


def time_rounds(steps: dict[str, Callable[[], Any]], sync: Callable[[], None], rounds: int,
                warmup: int, min_round_s: float = 0.0
                ) -> tuple[dict[str, list[tuple[float, float]]], dict[str, str], int]:
    """Warm every step up, then ``rounds`` rounds, each timing every step (the starting
    step rotates each round) over :func:`steps_per_round` steps. The same :func:`time_once`
    times every variant; the garbage collector runs between rounds, never inside one. A step
    that raises is dropped with its error. Returns ``({name: [(wall_s, host_s) per step, one
    per round]}, {name: error}, steps per round)``."""
    live = dict(steps)
    errors: dict[str, str] = {}
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in steps}
    for name, step in steps.items():
        try:
            for _ in range(warmup):
                step()
        except Exception as exc:
            errors[name] = short_error(exc)
            live.pop(name)
    repeats = steps_per_round(live, sync, min_round_s)
    # Objects alive now (torch, transformers, the models) are left out of the collections
    # between rounds, which then cost what the rounds allocated, not the whole process.
    gc.freeze()
    try:
        for r in range(rounds):
            names = list(live)
            if not names:
                break
            order = names[r % len(names):] + names[:r % len(names)]
            gc.collect()
            gc.disable()
            try:
                for name in order:
                    try:
                        samples[name].append(time_once(live[name], sync, repeats))
                    except Exception as exc:
                        errors[name] = short_error(exc)
                        live.pop(name)
            finally:
                gc.enable()
    finally:
        gc.unfreeze()
    return samples, errors, repeats


_CYCLES_PER_MS: list[float] = []


def _cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep`` (measured once per process)."""
    if not _CYCLES_PER_MS:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 20_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        _CYCLES_PER_MS.append(cycles / max(start.elapsed_time(end), 1e-3))
    return _CYCLES_PER_MS[0]


def gpu_once(step: Callable[[], Any], sleep_ms: float) -> tuple[float | None, float, float]:
    """One step enqueued behind a ``sleep_ms`` GPU sleep: ``(GPU ms between the events around
    the step, or None if the host was still issuing when the sleep ended; host ms from before
    the sleep was enqueued until the step returned; measured sleep ms)``."""
    torch.cuda.synchronize()
    e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    cycles = int(sleep_ms * _cycles_per_ms())
    t0 = time.perf_counter()
    e0.record()
    torch.cuda._sleep(cycles)
    e1.record()
    step()
    e2.record()
    issued_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    slept_ms = e0.elapsed_time(e1)
    return (e1.elapsed_time(e2) if issued_ms < slept_ms else None), issued_ms, slept_ms


def gpu_times(steps: dict[str, Callable[[], Any]], host_ms: dict[str, float],
              samples: int = GPU_SAMPLES) -> dict[str, dict]:
    """CUDA: the median GPU time of ``samples`` steps per variant (interleaved like the rounds),
    each behind a sleep of 3x the variant's median host time (at least 20 ms). An invalid
    sample is retried twice with a longer sleep; a variant whose host keeps catching up (a step
    that synchronizes inside) gets ``gpu_ms`` None and a ``gpu_note``."""
    sleep = {n: min(SLEEP_MAX_MS, max(SLEEP_MIN_MS, 3 * host_ms.get(n, 0.0) + 5)) for n in steps}
    got: dict[str, list[float]] = {n: [] for n in steps}
    notes: dict[str, str] = {}
    for _ in range(samples):
        for name, step in steps.items():
            if name in notes:
                continue
            for _attempt in range(3):
                ms, issued, slept = gpu_once(step, sleep[name])
                if ms is not None:
                    got[name].append(ms)
                    break
                sleep[name] = min(SLEEP_MAX_MS, max(4 * sleep[name], 2 * issued))
            else:
                notes[name] = (f"host still issuing after a {slept:.0f} ms GPU sleep "
                               f"({issued:.0f} ms): the step waits for the GPU")
    return {n: {"gpu_ms": None if n in notes else quantiles(got[n])["median"],
                "gpu_note": notes.get(n), "gpu_samples": len(got[n])} for n in steps}


def busy_ms(spans: Sequence[tuple[float, float]]) -> float:
    """Milliseconds covered by the union of ``(start, end)`` spans in µs (kernels that overlap,
    on two streams, count once)."""
    total, start, end = 0.0, None, None
    for s, e in sorted(spans):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    if end is not None:
        total += end - start
    return total / 1e3


def kernel_ms(step: Callable[[], Any], steps: int = KERNEL_STEPS) -> float:
    """CUDA: the GPU's busy time per step (ms), from the kernels, copies and memsets the
    profiler records over ``steps`` steps. Unlike :func:`gpu_once` it holds for steps that wait
    for the GPU inside (Hugging Face models do); it leaves out the gaps between kernels. The
    profiler slows the process's later host work (host-bound BERT-base 8x512 inference 5.4 ->
    15.4 ms: benchmarks/results/h200/models-profiled-inline.json), so bench-models calls this
    only after every timed round."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == cuda]
    if not spans:
        raise RuntimeError("the profiler recorded no GPU activity")
    return busy_ms(spans) / steps


def peak_memory(step: Callable[[], Any], device: torch.device) -> tuple[float | None, float | None]:
    """CUDA: (MiB allocated at the peak of one step above what was allocated at its start,
    absolute peak MiB). (None, None) elsewhere."""
    if device.type != "cuda":
        return None, None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return (peak - before) / 2**20, peak / 2**20
