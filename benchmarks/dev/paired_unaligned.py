"""Developer probe (GPU): the fused LayerNorm backward's row sums for unaligned 16-bit bodies,
separate (two block reductions) vs paired (one), same process, three alternations, do_bench.

    python benchmarks/dev/paired_unaligned.py

Prints, per dtype and N (M = 2^27 // N), the fraction of copy bandwidth of each variant per
alternation and the largest difference between their outputs. Written for the twentieth
session's decision (before it, ``_paired_sums`` paired aligned rows only); it patches
``_paired_sums`` so it measures whichever rule is current against the forced variants.
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
    rule = tln._paired_sums
    copy = copy_tbps()
    print(torch.cuda.get_device_name(), f"copy {copy:.3f} TB/s")
    variants = {"sep": lambda e, v, b: False, "paired": lambda e, v, b: e == 2}
    for dt in (torch.bfloat16, torch.float16):
        for n in (8193, 4097, 2049):
            x, dy, w, mean, rstd, nbytes = case(dt, n)

            def call(x=x, dy=dy, w=w, mean=mean, rstd=rstd):
                return tln.layernorm_backward(dy, x, w, mean, rstd, True, True, True)
            outs, line = {}, []
            for _ in range(3):
                for name, paired in variants.items():
                    tln._paired_sums = paired
                    outs[name] = call()
                    line.append(f"{name} {nbytes / do_bench(call, warmup=5, rep=40) / 1e9 / copy:.3f}")
            tln._paired_sums = rule
            err = max((a.float() - b.float()).abs().max().item()
                      for a, b in zip(outs["sep"], outs["paired"], strict=True))
            print(str(dt)[6:], n, " ".join(line), f"max|diff| {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
