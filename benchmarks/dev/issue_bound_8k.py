"""Developer probe (GPU): is the fused LayerNorm backward at 16-bit N = 8193 bound by instruction
issue or by its one-row tiles?

SASS of the tile loop (local Triton 3.6, sm_90, 16 warps, 16 elements per thread): aligned
8192 on one-row tiles 340 instructions (21.3 per element, as on its shipped two-row tiles),
the 8193 body variant 432 (27.0: the unaligned body's addressing and the 1-D edge tile's loads
and reductions). If issue bounds the kernel, aligned 8192 on one-row tiles runs at the two-row
tiles' speed and 8193 at about 21.3 / 27.0 of it; if one-row tiles were the cause, 8192 on
them drops toward 8193.

    python benchmarks/dev/issue_bound_8k.py

Prints the fraction of copy bandwidth per variant over three alternations (do_bench, same
process) and the largest output difference between the two tilings. 8193's "two-row tiles"
(16384-element tiles: two rows of the body) run the kernel's [2, 2·VEC] edge tile on the
current code; the twenty-first session measured them with a 1-D edge tile per row instead (a
kernel change not kept: level or 1% slower than one-row tiles, ptxas 80 bytes of spills;
results in benchmarks/results/tune-h100-2026-11-25/issue_bound_8k.txt).
"""

from __future__ import annotations

import os
import sys

import torch
from triton.testing import do_bench

from fusedops.triton import layernorm as tln

sys.path.insert(0, os.path.dirname(__file__))
from lnbwd_case import case, copy_tbps  # noqa: E402


def main() -> None:
    copy = copy_tbps()
    print(torch.cuda.get_device_name(), f"copy {copy:.3f} TB/s", flush=True)
    for dt in (torch.bfloat16, torch.float16):
        for n, variants in ((8192, {"two-row tiles": None, "one-row tiles": (8192, 1, True)}),
                            (8193, {"shipped": None, "two-row tiles": (16384, 1, True)})):
            x, dy, w, mean, rstd, nbytes = case(dt, n)

            def call(x=x, dy=dy, w=w, mean=mean, rstd=rstd):
                return tln.layernorm_backward(dy, x, w, mean, rstd, True, True, True)
            outs, line = {}, []
            for _ in range(3):
                for name, override in variants.items():
                    tln.FUSED_BWD_OVERRIDE = override
                    outs[name] = call()
                    frac = nbytes / do_bench(call, warmup=5, rep=40) / 1e9 / copy
                    line.append(f"{name} {frac:.3f}")
            tln.FUSED_BWD_OVERRIDE = None
            diff = ""
            if len(outs) == 2:  # (8193's two-row tiles: the per-row 1-D edge tiles)
                a, b = outs.values()
                diff = " max|diff| {:.2e}".format(max(
                    (p.float() - q.float()).abs().max().item() for p, q in zip(a, b, strict=True)))
            print(str(dt)[6:], n, " | ".join(line) + diff, flush=True)


if __name__ == "__main__":
    main()
