"""Developer probe (GPU): is the sweep's backward timing host-bound on some machines?

The sweeps' backward rows of Triton providers (fusedops, torch.compile, Liger) sometimes spread
(20-80% quantiles 10-60% apart) while torch's native backward in the same rows never does.
Hypothesis: their host path (autograd.grad through Python, several launches) sometimes takes
longer than the GPU work per repetition, so the GPU waits between launches and do_bench's
events count the wait. Per shape and provider this measures: the host time per backward call
(no synchronisation), do_bench as the sweep runs it (three times), and per-call CUDA-event times
with every call enqueued behind a 100 ms GPU sleep (the host then runs far ahead: GPU time
only, no starvation).

Providers: fusedops, fusedops with the LayerNorm backward's replay plans off ("noplan", the
path before the twentieth session), torch.

    OUT=dir python benchmarks/dev/host_bound.py
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import fusedops
from fusedops.triton import layernorm as tln

BWD_PLANS = tln.BWD_PLANS

sys.path.insert(0, os.path.dirname(__file__))
from launch_spread import spread  # noqa: E402


def providers():
    """name -> (forward, LayerNorm backward replay plans on): "fusedops-noplan" is the
    backward through the launch rules on every call (the code before the twentieth session)."""
    def fused(x, w, b):
        return fusedops.fused_layernorm(x, (x.shape[-1],), w, b, 1e-5)

    def native(x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)
    return {"fusedops": (fused, True), "fusedops-noplan": (fused, False),
            "torch": (native, True)}


def head_start_times(fn, flush, calls=60):
    # ~100 ms of GPU sleep at 1.98 GHz: the host enqueues every call meanwhile
    return sorted(spread(fn, flush, calls, head_start=200_000_000))


def main() -> None:
    flush = torch.empty(1 << 26, dtype=torch.int32, device="cuda")
    out, lines = [], []
    for dt, n in ((torch.bfloat16, 1024), (torch.bfloat16, 4096), (torch.bfloat16, 8192),
                  (torch.float16, 16384), (torch.bfloat16, 32768), (torch.bfloat16, 65536),
                  (torch.float32, 8192), (torch.float32, 65537)):
        m = (1 << 27) // n
        x = torch.randn(m, n, device="cuda", dtype=dt, requires_grad=True)
        w = torch.randn(n, device="cuda", dtype=dt, requires_grad=True)
        b = torch.randn(n, device="cuda", dtype=dt, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=dt)
        for name, (op, plans) in providers().items():
            y = op(x, w, b)
            tln.BWD_PLANS = plans and BWD_PLANS

            def fn(y=y):
                return torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            host_us = (time.perf_counter() - t0) / 20 * 1e6
            torch.cuda.synchronize()
            bench = [do_bench(fn, warmup=5, rep=25, quantiles=(0.5, 0.2, 0.8)) for _ in range(3)]
            hs = head_start_times(fn, flush)
            rec = dict(dtype=str(dt), N=n, provider=name, host_us=host_us,
                       do_bench=bench, head_start_p20_p50_p80=[hs[len(hs) // 5],
                                                               hs[len(hs) // 2],
                                                               hs[4 * len(hs) // 5]])
            out.append(rec)
            line = (f"{str(dt)[6:]:8s} {n:6d} {name:15s} host {host_us:6.1f} us | do_bench "
                    + " ".join(f"{a:.3f}({b_:.3f}-{c:.3f})" for a, b_, c in bench)
                    + " | head start {:.3f}({:.3f}-{:.3f})".format(
                        rec["head_start_p20_p50_p80"][1], rec["head_start_p20_p50_p80"][0],
                        rec["head_start_p20_p50_p80"][2]))
            print(line, flush=True)
            lines.append(line)
            del y
        del x, w, b, dy
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "host_bound.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "records": out}, f, indent=1)


if __name__ == "__main__":
    main()
