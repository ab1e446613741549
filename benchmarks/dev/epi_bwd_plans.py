"""The single-block epilogue backward with dropout under several launch plans (CUDA only):
(ROWS, warps, programs per SM, ACC_1D, PAIRED, STAGES) forced through BWD_PLAN_OVERRIDE, timed
with do_bench medians on fresh rows larger than L2. Prints microseconds per plan.

    python benchmarks/dev/epi_bwd_plans.py
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
    for dt, M, N in CASES:
        dtype = DT[dt]
        s = torch.randn(M, N, device="cuda", dtype=dtype)
        dout = torch.randn_like(s)
        w = torch.randn(N, device="cuda", dtype=dtype)
        b = torch.randn(N, device="cuda", dtype=dtype)
        _, _, mean, rstd = E.layernorm_epilogue_forward(s, None, w, b, 1e-5, dtype, 0.0, 0, None,
                                                        True)
        block = E.next_pow2(N)
        for act in ("relu", None):
            row = []
            for plan in PLANS_1K if block <= 2048 else PLANS_BIG:
                if plan is not None and block * plan[0] > 8192:
                    continue
                E.BWD_PLAN_OVERRIDE = plan
                us = 1e3 * do_bench(lambda: E.layernorm_epilogue_backward(
                    dout, None, s, w, b, mean, rstd, 0.1, 123, act, True, True, True,
                    grad_dtypes=(dtype, dtype)), return_mode="median")
                E.BWD_PLAN_OVERRIDE = None
                row.append(f"{plan or 'shipped'}: {us:.1f}")
            print(f"{dt} {M}x{N} p=0.1 act={act}: " + "; ".join(row), flush=True)


if __name__ == "__main__":
    main()
