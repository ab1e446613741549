"""Repeated correctness check of fused LayerNorm + ReLU training steps against eager (CUDA only):
out, dx, dweight, dbias of ``fused_layernorm(x, w, b, activation="relu")`` with the same upstream
gradient, several times per configuration, with and without the epilogue replay plans. Prints
the worst relative error (abs error / max |eager|) per output and configuration.

    python benchmarks/dev/epi_check_repeat.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fusedops
from fusedops.triton import layernorm_epilogue as tle


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def main() -> None:
    torch.manual_seed(0)
    for dtype, N in ((torch.float32, 768), (torch.float32, 1024), (torch.bfloat16, 768)):
        x = torch.randn(16384, N, device="cuda", dtype=dtype)
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype)
        b = (0.1 * torch.randn(N, device="cuda")).to(dtype)
        g = torch.randn(16384, N, device="cuda", dtype=dtype)
        leaves = [t.detach().requires_grad_() for t in (x, w, b)]
        ref_out = torch.relu(F.layer_norm(leaves[0], (N,), leaves[1], leaves[2]))
        ref = (ref_out, *torch.autograd.grad(ref_out, leaves, g))
        for plans in (False, True):
            tle.PLANS = plans
            worst = [0.0] * 4
            for _ in range(8):
                out = fusedops.fused_layernorm(leaves[0], N, leaves[1], leaves[2],
                                               activation="relu")
                got = (out, *torch.autograd.grad(out, leaves, g))
                worst = [max(v, rel(a, r)) for v, a, r in zip(worst, got, ref, strict=True)]
            print(f"{str(dtype):15s} N={N:5d} plans={plans!s:5s} worst rel err out/dx/dw/db: "
                  + " ".join(f"{v:.2e}" for v in worst))
    tle.PLANS = True


if __name__ == "__main__":
    main()
