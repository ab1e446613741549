"""LayerNorm or RMSNorm training calls: torch's op against fusedops' C++ node, host and kernel
time.

Every training call runs its node from the signature's second call (the op's node rule set to
0 for this run). Per shape and dtype: host µs per grad-enabled forward and per forward + backward
(200 back-to-back calls then a synchronisation, 11 rounds alternating torch and fusedops; the
median of each and of the paired differences) and kernel µs per forward + backward from the
profiler (10 iterations). Writes ``<op>-node.json`` to ``$OUT`` (or the current folder).

    python benchmarks/dev/norm_node_host.py [layernorm|rmsnorm]     # on a CUDA machine
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import fusedops
from fusedops import _dispatch

SHAPES = ((4, 128), (8, 128, 768), (8, 512, 768), (32, 512, 768), (16, 512, 2048),
          (8, 1024, 4096))


def host_pair(fa, fb, calls: int = 200, reps: int = 11) -> tuple[float, float, float]:
    for _ in range(30):
        fa()
        fb()
    torch.cuda.synchronize()
    ta: list[float] = []
    tb: list[float] = []
    for r in range(reps):
        for fn, ts in ((fa, ta), (fb, tb)) if r % 2 == 0 else ((fb, tb), (fa, ta)):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) / calls * 1e6)
    return (statistics.median(ta), statistics.median(tb),
            statistics.median([b - a for a, b in zip(ta, tb, strict=True)]))


def kernels(fn, it: int = 10) -> tuple[float, dict[str, float]]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(it):
            fn()
        torch.cuda.synchronize()
    total, names = 0.0, {}
    for e in prof.key_averages():
        if e.self_device_time_total > 0:
            total += e.self_device_time_total
            names[e.key[:40]] = round(e.self_device_time_total / it, 1)
    return total / it, names


def main(op: str) -> None:
    _dispatch.NATIVE_BELOW[op, "node"] = 0
    _dispatch.set_backend(None)  # (the size rules' tables refilled with it)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            n = shape[-1]
            x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
            w = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
            b = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
            dy = torch.randn(shape, device="cuda", dtype=dtype)
            ins = [x, w, b]

            if op == "rmsnorm":
                ins = [x, w]

            def tg(x=x, w=w, b=b, n=n):
                if op == "rmsnorm":
                    return F.rms_norm(x, (n,), w, 1e-5)
                return F.layer_norm(x, (n,), w, b, 1e-5)

            def fg(x=x, w=w, b=b, n=n):
                if op == "rmsnorm":
                    return fusedops.fused_rmsnorm(x, n, w, 1e-5)
                return fusedops.fused_layernorm(x, n, w, b, 1e-5)

            def tf(tg=tg, ins=ins, dy=dy):
                return torch.autograd.grad(tg(), ins, dy)

            def ff(fg=fg, ins=ins, dy=dy):
                return torch.autograd.grad(fg(), ins, dy)

            for _ in range(3):
                ff()
            r = {"dtype": str(dtype)[6:], "shape": shape, "node": fg().grad_fn.name(),
                 "grad_host": host_pair(tg, fg), "fb_host": host_pair(tf, ff),
                 "fb_kernels_torch": kernels(tf), "fb_kernels_fused": kernels(ff)}
            rows.append(r)
            print(f"{r['dtype']:8s} {str(shape):15s} grad host {r['grad_host'][0]:6.1f}/"
                  f"{r['grad_host'][1]:6.1f} | fwd+bwd host {r['fb_host'][0]:6.1f}/"
                  f"{r['fb_host'][1]:6.1f} | fwd+bwd kernels {r['fb_kernels_torch'][0]:7.1f}/"
                  f"{r['fb_kernels_fused'][0]:7.1f} us", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), f"{op}-node.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "layernorm")
