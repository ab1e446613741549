"""The single-block LayerNorm-epilogue forward under several launch plans (CUDA only): (ROWS,
warps, programs per SM, STAGES) forced through FWD_PLAN_OVERRIDE, inference calls (no
statistics) timed with do_bench medians on fresh rows larger than L2. Prints microseconds per
plan and the fraction of copy bandwidth of the best one (bytes: read x (+ residual), write out
(+ the sum)).

    python benchmarks/dev/epi_fwd_plans.py [--cases bf16:16384x4096:relu:0.1:res,...]
                                           [--plans "4096,8,0;2048,4,2"]
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from fusedops.triton import layernorm_epilogue as E

DT = {"bf16": torch.bfloat16, "fp32": torch.float32}
CASES = ("bf16:65536x1024:relu:0.1:-,bf16:32768x2048:relu:0.1:-,bf16:16384x4096:relu:0.1:-,"
         "bf16:8192x8192:relu:0.1:-,bf16:65536x1024:gelu:0.1:res,bf16:16384x4096:gelu:0.1:res,"
         "fp32:16384x4096:relu:0.1:-")
# (tile elements, warps, STAGES); None: the shipped rule.
PLANS = (None, (4096, 8, None), (4096, 8, 2), (8192, 16, None), (8192, 16, 2), (2048, 4, 2),
         (2048, 8, None), (4096, 16, None))


def copy_tbps() -> float:
    a = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), return_mode="median")
    return 2 * a.numel() / (ms * 1e-3) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--plans", default=None,
                    help="tile elements,warps,stages (0: None);... (the shipped rule first)")
    a = ap.parse_args()
    plans = PLANS if a.plans is None else (None, *(
        tuple(None if (i == 2 and v == "0") else int(v) for i, v in enumerate(p.split(",")))
        for p in a.plans.split(";")))
    copy = copy_tbps()
    print(f"copy {copy:.3f} TB/s")
    for case in a.cases.split(","):
        dt, shape, act, p, res = case.split(":")
        M, N = (int(v) for v in shape.split("x"))
        dtype, p, act = DT[dt], float(p), None if act == "none" else act
        x = torch.randn(M, N, device="cuda", dtype=dtype)
        r = torch.randn_like(x) if res == "res" else None
        w = torch.randn(N, device="cuda", dtype=dtype)
        b = torch.randn(N, device="cuda", dtype=dtype)
        block = E.next_pow2(N)
        nbytes = x.numel() * x.element_size() * (4 if r is not None else 2)
        row, best = [], None
        for plan in plans:
            E.FWD_PLAN_OVERRIDE = None if plan is None else (
                max(1, plan[0] // block), plan[1], None, plan[2])
            us = 1e3 * do_bench(lambda: E.layernorm_epilogue_forward(
                x, r, w, b, 1e-5, dtype, p, 123, act, False), return_mode="median")
            E.FWD_PLAN_OVERRIDE = None
            row.append(f"{plan or 'shipped'}: {us:.1f}")
            best = us if best is None else min(best, us)
        frac = nbytes / (best * 1e-6) / 1e12 / copy
        print(f"{case}: " + "; ".join(row) + f" | best {frac:.2f} of copy", flush=True)


if __name__ == "__main__":
    main()
