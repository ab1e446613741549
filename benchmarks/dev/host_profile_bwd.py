"""Developer probe (GPU): where the LayerNorm backward's host time goes (cProfile of
autograd.grad through fused_layernorm, the GPU kept busy so nothing waits on it).

    python benchmarks/dev/host_profile_bwd.py [dtype] [N]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

import fusedops

dt = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.float16
n = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
m = (1 << 27) // n
x = torch.randn(m, n, device="cuda", dtype=dt, requires_grad=True)
w = torch.randn(n, device="cuda", dtype=dt, requires_grad=True)
b = torch.randn(n, device="cuda", dtype=dt, requires_grad=True)
dy = torch.randn(m, n, device="cuda", dtype=dt)
y = fusedops.fused_layernorm(x, (n,), w, b, 1e-5)


def fn():
    return torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)


for _ in range(5):
    fn()
torch.cuda.synchronize()
torch.cuda._sleep(400_000_000)
for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(20):
        fn()
    print(f"{dt} {n}: host {(time.perf_counter() - t0) / 20 * 1e6:.1f} us per backward",
          flush=True)
with torch.no_grad():
    t0 = time.perf_counter()
    for _ in range(20):
        torch.empty_like(x)
    print(f"torch.empty_like(x): {(time.perf_counter() - t0) / 20 * 1e6:.1f} us", flush=True)
torch.cuda.synchronize()
torch.cuda._sleep(400_000_000)
prof = cProfile.Profile()
prof.enable()
for _ in range(20):
    fn()
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(14)
pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
