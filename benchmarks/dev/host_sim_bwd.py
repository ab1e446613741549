"""Developer probe (CPU, no GPU): the Python cost of the LayerNorm backward's launch rules, with
every launch stubbed out, through the normal path and through a replay plan.

Runs the Triton backend's ``layernorm_backward`` on CPU tensors with ``Launcher.__call__`` a
no-op (recording what it would launch), 132 SMs assumed and the split-row kernels allowed, so
only host work is timed: argument checks, launch rules, allocations, views. ``--plans`` gives
every launcher a stand-in raw-pointer entry, so the second call of a signature replays.

    python benchmarks/dev/host_sim_bwd.py [--plans]
"""

from __future__ import annotations

import sys
import time

import torch

import fusedops.triton._common as C
import fusedops.triton.layernorm as L


def _stub_launch(self, grid, args, num_warps):
    if C._recording:
        C._record(self, grid, args, num_warps)


def _entry(self, args, num_warps):
    def go(grid, stream, raw):
        return None
    go.raw_pointers = True
    return go


def per_call_us(n: int, m: int = 64, dtype=torch.bfloat16, calls: int = 3000) -> float:
    x = torch.randn(m, n, dtype=dtype)
    dy = torch.randn(m, n, dtype=dtype)
    w = torch.randn(n, dtype=dtype)
    mean, rstd = torch.zeros(m), torch.ones(m)

    def call():
        return L.layernorm_backward(dy, x, w, mean, rstd, True, True, True, (dtype, dtype))
    for _ in range(50):
        call()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    C.Launcher.__call__ = _stub_launch
    C.SplitLauncher._per_sm = lambda self, *a: 1
    L.num_sms = C.num_sms = lambda device: 132
    L.split_rows_enabled = lambda *a: True
    plans = "--plans" in sys.argv
    L.BWD_PLANS = plans
    if plans:
        C.Launcher.entry = _entry
        L.current_stream = lambda index: 0
    for n in (1024, 4096, 16384, 65536):
        print(f"N={n:6d} {'plans' if plans else 'rules'}: {per_call_us(n):6.1f} us per call")


if __name__ == "__main__":
    main()
