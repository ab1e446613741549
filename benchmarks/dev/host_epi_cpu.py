"""Host time of one fused add + LayerNorm training step without a GPU: the Triton backend's
host code on CPU tensors with every kernel launch stubbed out (only Python and torch-dispatch
time is real); replay plans are made as with Triton 3.6's C entries unless ``--no-plans``. Prints microseconds per step for eager, an identity autograd.Function and the
fused op, then a cProfile of the fused steps.

    PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/dev/host_epi_cpu.py [--profile 40]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import fusedops
from fusedops import _dispatch
from fusedops.triton import _common


def per_step_us(step, batches=30, n=40):
    """Microseconds per step: the fastest of ``batches`` batches of ``n`` steps (the shared
    machine's noise only ever adds time)."""
    for _ in range(30):
        step()
    best = float("inf")
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", type=int, default=40)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--activation", default=None)
    ap.add_argument("--no-residual", action="store_true")
    ap.add_argument("--no-plans", action="store_true", help="no replay plans")
    a = ap.parse_args()
    torch.set_num_threads(1)
    # No kernels; launches are still recorded for replay plans, as the real launcher does.
    _common.Launcher.__call__ = (lambda self, grid, args, num_warps:
                                 _common._record(self, grid, args, num_warps))
    if not a.no_plans:  # replay plans as with Triton 3.6's C entries, launching nothing
        from fusedops.triton import layernorm_epilogue as tle

        def entry(self, args, num_warps):
            def go(grid, stream, raw):
                return None
            go.raw_pointers = True
            return go
        _common.Launcher.entry = entry
        _common.current_stream = lambda index: 0
    else:
        from fusedops.triton import layernorm_epilogue as tle

        tle.PLANS = False
    _dispatch.set_backend("triton")
    M, N = 64, 768
    dt = torch.bfloat16
    x = torch.randn(M, N, dtype=dt, requires_grad=True)
    r = None if a.no_residual else torch.randn(M, N, dtype=dt, requires_grad=True)
    w = torch.randn(N, dtype=dt, requires_grad=True)
    b = torch.randn(N, dtype=dt, requires_grad=True)
    g = torch.randn(M, N, dtype=dt)
    ins = tuple(t for t in (x, r, w, b) if t is not None)

    def fused_step():
        res = fusedops.fused_layernorm(x, (N,), w, b, residual=r, dropout_p=a.dropout,
                                       activation=a.activation)
        outs = res if r is not None else (res,)
        return torch.autograd.grad(outs, ins, (g,) * len(outs))

    def eager_step():
        s = x if r is None else x + r
        o = torch.nn.functional.layer_norm(s, (N,), w, b)
        outs = (o, s) if r is not None else (o,)
        return torch.autograd.grad(outs, ins, (g,) * len(outs))

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, p, q):
            return p.view(p.shape), q.view(q.shape)

        @staticmethod
        def backward(ctx, gp, gq):
            return gp, gq

    def identity_step():
        o, s = Identity.apply(x, w)
        return torch.autograd.grad((o, s), (x, w), (g, w))

    def empty():
        return torch.empty(M, N, dtype=dt)

    for name, fn in (("torch.empty", empty), ("eager", eager_step),
                     ("identity Function", identity_step), ("fused", fused_step)):
        print(f"{name:20s} {per_step_us(fn):8.1f} us/step")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(200):
        fused_step()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(a.profile)


if __name__ == "__main__":
    main()
