"""Where the host time of one fused add + LayerNorm training step goes (CUDA only).

Wraps LayerNormEpilogueFunction's forward and backward and the Triton backend functions with
perf_counter timers, runs back-to-back steps (forward with grad + torch.autograd.grad), and
prints the mean microseconds per step in each layer: the API before apply, the Function's
forward around its backend call, the backend call itself, the same for backward, and the rest
(autograd's engine). Also times an identity autograd.Function step and torch's eager chain.

    python benchmarks/dev/epi_host_split.py [dropout_p]
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch

import fusedops
import fusedops.triton as T
from fusedops.ops import layernorm_epilogue as ops_epi

ACC: dict[str, float] = defaultdict(float)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            ACC[name] += time.perf_counter() - t0
    return wrapper


def per_step_us(step, n=300):
    for _ in range(30):
        step()
    torch.cuda.synchronize()
    ACC.clear()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    total = time.perf_counter() - t0
    torch.cuda.synchronize()
    return total / n * 1e6, {k: v / n * 1e6 for k, v in ACC.items()}


def main() -> None:
    M, N = 64, 768
    dt = torch.bfloat16
    p = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
    x = torch.randn(M, N, device="cuda", dtype=dt, requires_grad=True)
    r = torch.randn(M, N, device="cuda", dtype=dt, requires_grad=True)
    w = torch.randn(N, device="cuda", dtype=dt, requires_grad=True)
    b = torch.randn(N, device="cuda", dtype=dt, requires_grad=True)
    g = torch.randn(M, N, device="cuda", dtype=dt)

    def fused_step():
        o, s = fusedops.fused_layernorm(x, (N,), w, b, residual=r, dropout_p=p)
        return torch.autograd.grad((o, s), (x, r, w, b), (g, g))

    def eager_step():
        s = x + r
        o = torch.nn.functional.layer_norm(s, (N,), w, b)
        o = torch.nn.functional.dropout(o, p) if p else o
        return torch.autograd.grad((o, s), (x, r, w, b), (g, g))

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, c):
            return a.view(a.shape), c.view(c.shape)

        @staticmethod
        def backward(ctx, ga, gc):
            return ga, gc

    def identity_step():
        o, s = Identity.apply(x, r)
        return torch.autograd.grad((o, s), (x, r), (g, g))

    from fusedops.triton import layernorm_epilogue as tle

    def no_plans_step():
        tle.PLANS = False
        try:
            return fused_step()
        finally:
            tle.PLANS = True

    base = {name: per_step_us(fn)[0] for name, fn in
            (("eager", eager_step), ("identity Function", identity_step),
             ("fused, no replay plans", no_plans_step), ("fused (unwrapped)", fused_step))}
    F = ops_epi.LayerNormEpilogueFunction
    fwd, bwd = F.forward, F.backward
    tf, tb = T.layernorm_epilogue_forward, T.layernorm_epilogue_backward
    F.forward = staticmethod(timed("Function.forward", fwd))
    F.backward = staticmethod(timed("Function.backward", bwd))
    T.layernorm_epilogue_forward = timed("backend forward", tf)
    T.layernorm_epilogue_backward = timed("backend backward", tb)
    ops_epi.layernorm_epilogue = timed("layernorm_epilogue (api below checks)",
                                       ops_epi.layernorm_epilogue)
    import fusedops.ops.layernorm as ops_ln
    ops_ln.layernorm_epilogue = ops_epi.layernorm_epilogue
    api = fusedops.fused_layernorm
    fusedops.fused_layernorm = timed("fused_layernorm (the API call)", api)
    grad = torch.autograd.grad
    torch.autograd.grad = timed("torch.autograd.grad", grad)
    total, parts = per_step_us(fused_step)
    F.forward, F.backward = staticmethod(fwd), staticmethod(bwd)
    fusedops.fused_layernorm, torch.autograd.grad = api, grad
    for k, v in base.items():
        print(f"{k:40s} {v:8.1f} us/step")
    print(f"{'fused (timers on)':40s} {total:8.1f} us/step")
    for k, v in parts.items():
        print(f"  {k:38s} {v:8.1f} us/step")


if __name__ == "__main__":
    main()
