"""Developer probe (GPU): launch-to-launch variation of the LayerNorm backward at long rows.

The sweep's quantiles showed fusedops' split backward at 16K/32K spreading (float32 32K: median
1.13 ms, 20-80% 0.93-1.81) while torch and torch.compile in the same rows did not. This times
single calls (CUDA events, L2 flushed before each, fresh data per shape as in the sweep) and,
with the profiler, each kernel of the call, so the slow calls can be pinned to a kernel.

    OUT=dir python benchmarks/dev/launch_spread.py [dtype:N ...]   # default bf16:32768 ...
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

from fusedops.triton import layernorm as tln

CALLS = 200


def shape_case(dt: torch.dtype, n: int):
    m = (1 << 27) // n
    x = torch.randn(m, n, device="cuda", dtype=dt)
    w = torch.randn(n, device="cuda", dtype=dt)
    b = torch.randn(n, device="cuda", dtype=dt)
    dy = torch.randn_like(x)
    _, mean, rstd = tln.layernorm_forward(x, w, b, 1e-5, dt)
    xr, wr, br = (t.detach().requires_grad_() for t in (x, w, b))
    yr = F.layer_norm(xr, (n,), wr, br)
    return {
        "fusedops": lambda: tln.layernorm_backward(dy, x, w, mean, rstd, True, True, True),
        "torch": lambda: torch.autograd.grad(yr, (xr, wr, br), dy, retain_graph=True),
    }


def spread(fn, flush: torch.Tensor, calls: int = CALLS, head_start: int = 0) -> list[float]:
    """CUDA-event times (ms) of ``calls`` single calls, each after an L2 flush; ``head_start``
    > 0: all of them enqueued behind a GPU sleep of that many cycles (the host runs ahead)."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(calls)]
    for _ in range(5):
        fn()
    if head_start:
        torch.cuda.synchronize()
        torch.cuda._sleep(head_start)
    for s, e in ev:
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in ev]


def kernel_times(fn, calls: int = 40) -> dict[str, list[float]]:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            out.setdefault(ev.name[:60], []).append(ev.device_time / 1e3)
    return out


def q(v: list[float], p: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(p * len(s)))]


def main() -> None:
    specs = sys.argv[1:] or ["bf16:32768", "float32:32768", "bf16:16384", "float16:16384"]
    names = {"bf16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    flush = torch.empty(1 << 26, dtype=torch.int32, device="cuda")  # 256 MiB > L2
    results = {}
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for spec in specs:
        dname, n = spec.split(":")
        fns = shape_case(names[dname], int(n))
        for prov, fn in fns.items():
            t = spread(fn, flush)
            k = kernel_times(fn) if prov == "fusedops" else {}
            results[f"{spec}:{prov}"] = {"calls_ms": t, "kernels_ms": k}
            slow = sum(v > 1.2 * q(t, 0.1) for v in t)
            print(f"{spec:14s} {prov:8s} p10 {q(t, .1):.3f} p50 {q(t, .5):.3f} "
                  f"p90 {q(t, .9):.3f} max {max(t):.3f} ms; {slow}/{len(t)} calls >1.2x p10",
                  flush=True)
            print("   first 40:", " ".join(f"{v:.2f}" for v in t[:40]), flush=True)
            for name, v in k.items():
                print(f"   {name:60s} n={len(v):3d} p10 {q(v, .1):.3f} p50 {q(v, .5):.3f} "
                      f"p90 {q(v, .9):.3f} max {max(v):.3f}", flush=True)
        del fns
        torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "launch_spread.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f)


if __name__ == "__main__":
    main()
