"""Developer probe (no GPU needed): registers and spills of the single-block LayerNorm-epilogue
backward (``_ln_epi_bwd_2d``) compiled for sm_90 by the local Triton under the launch plans
``_bwd_plan`` gives (dropout p > 0, with ds, weight and bias), per dtype, activation and padded
row length, and the programs of that size an SM holds by registers (65536 per SM).

    python benchmarks/dev/regs_epi_bwd.py                          # this machine's Triton
    PYTHONPATH=/tmp/t36py:$PWD python benchmarks/dev/regs_epi_bwd.py   # another Triton
"""

from __future__ import annotations

import sys

import triton

sys.path.insert(0, "benchmarks/dev")
from regs_split import compile_sm90, resources  # noqa: E402

from fusedops.triton import layernorm_epilogue as tle  # noqa: E402


def main() -> None:
    print(f"Triton {triton.__version__}, sm_90, p > 0, with ds, weight and bias")
    for dt, elt in (("bf16", 2), ("fp32", 4)):
        t = "*" + dt
        pointers = {"dout_ptr": t, "ds_ptr": t, "s_ptr": t, "w_ptr": t, "b_ptr": t,
                    "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "dx_ptr": t, "dw_ptr": "*fp32",
                    "db_ptr": "*fp32"}
        aligned = list(pointers) + ["N", "stride_do", "stride_ds", "stride_s"]
        for act in (1, 2):
            for block in (1024, 2048, 4096, 8192):
                strides = (block, block, block)
                rows, warps, per_sm, acc_1d, paired, stages = tle._bwd_plan(
                    block, elt, True, act, strides)
                consts = dict(BLOCK=block, ROWS=rows, Q=tle._slices(block, True), HAS_DS=True,
                              HAS_W=True, HAS_B=True, DROPOUT=True, ACT=act, NEED_DX=True,
                              NEED_DW=True, NEED_DB=True, ACC_1D=acc_1d, PAIRED=paired,
                              STAGES=stages)
                k = compile_sm90(tle._ln_epi_bwd_2d, consts, pointers, aligned, warps, None)
                regs, stack = resources(k)
                per_warp = -(-regs * 32 // 256) * 256
                fit = min(65536 // (per_warp * warps), 64 // warps)
                print(f"{dt} act={act} block {block:5d}: plan {(rows, warps, per_sm, stages)} "
                      f"{regs:3d} registers, {stack:3d} B stack, {fit} programs/SM fit",
                      flush=True)


if __name__ == "__main__":
    main()
