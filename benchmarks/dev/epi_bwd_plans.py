"""The single-block epilogue backward with dropout under several launch plans (CUDA only):
(ROWS, warps, programs per SM, ACC_1D, PAIRED, STAGES) forced through BWD_PLAN_OVERRIDE, timed
with do_bench medians on fresh rows larger than L2. Prints microseconds per plan.

    python benchmarks/dev/epi_bwd_plans.py [--cases bf16:16384x4096,...] [--acts gelu,relu]
                                           [--ds] [--plans "1,8,4,0,1,1;2,16,2,0,1,1"]
"""

from __future__ import annotations

import torch
from triton.testing import do_bench

from fusedops.triton import layernorm_epilogue as E

CASES = [("bf16", 65536, 768), ("bf16", 32768, 1024), ("bf16", 16384, 4096), ("fp32", 65536, 768),
         ("fp32", 16384, 2048)]
PLANS_1K = [None, (2, 4, 8, False, True, 1), (4, 8, 2, False, True, 1), (2, 8, 4, False, True, 1),
            (2, 8, 4, True, True, 1), (4, 8, 4, False, True, 1), (8, 8, 2, False, True, 1)]
PLANS_BIG = [None, (1, 8, 4, False, True, 1), (1, 8, 2, False, True, 1), (1, 4, 8, False, True, 1),
             (2, 16, 1, True, True, 1), (1, 16, 2, False, True, 1)]
DT = {"bf16": torch.bfloat16, "fp32": torch.float32}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=None, help="dtype:MxN, comma separated")
    ap.add_argument("--acts", default="relu,none")
    ap.add_argument("--ds", action="store_true", help="with a gradient reaching s (residual)")
    ap.add_argument("--plans", default=None, help="ROWS,warps,per_sm,acc_1d,paired,stages;...")
    ap.add_argument("--p", type=float, default=0.1, help="dropout probability (0: none)")
    ap.add_argument("--cap", type=int, default=None,
                    help="BWD_MAX_BLOCK_EPILOGUE for the run (longer rows in one block)")
    a = ap.parse_args()
    cases = CASES if a.cases is None else [
        (c.split(":")[0], *(int(v) for v in c.split(":")[1].split("x"))) for c in a.cases.split(",")]
    acts = [None if v == "none" else v for v in a.acts.split(",")]
    forced = None if a.plans is None else [None] + [
        tuple(int(v) if i < 3 or i == 5 else bool(int(v)) for i, v in enumerate(p.split(",")))
        for p in a.plans.split(";")]
    if a.cap is not None:
        E.BWD_MAX_BLOCK_EPILOGUE = a.cap
    for dt, M, N in cases:
        dtype = DT[dt]
        s = torch.randn(M, N, device="cuda", dtype=dtype)
        dout = torch.randn_like(s)
        w = torch.randn(N, device="cuda", dtype=dtype)
        b = torch.randn(N, device="cuda", dtype=dtype)
        _, _, mean, rstd = E.layernorm_epilogue_forward(s, None, w, b, 1e-5, dtype, 0.0, 0, None,
                                                        True)
        block = E.next_pow2(N)
        ds = torch.randn_like(s) if a.ds else None
        for act in acts:
            row = []
            for plan in forced or (PLANS_1K if block <= 2048 else PLANS_BIG):
                if plan is not None and block * plan[0] > 8192:
                    continue
                E.BWD_PLAN_OVERRIDE = plan
                us = 1e3 * do_bench(lambda: E.layernorm_epilogue_backward(
                    dout, ds, s, w, b, mean, rstd, a.p, 123, act, True, True, True,
                    grad_dtypes=(dtype, dtype)), return_mode="median")
                E.BWD_PLAN_OVERRIDE = None
                row.append(f"{plan or 'shipped'}: {us:.1f}")
            print(f"{dt} {M}x{N} p={a.p} act={act} ds={a.ds}: " + "; ".join(row), flush=True)


if __name__ == "__main__":
    main()
