"""Does a kernel's L2 eviction policy survive do_bench's cache flush?

Inductor's two-pass reductions load with ``eviction_policy="evict_last"``. If those lines outlive
the 256 MB flush that ``triton.testing.do_bench`` writes between repetitions, a benchmark that
reuses one input tensor finds part of it in L2 and reports more than DRAM bandwidth allows.
This times each provider twice per point: the same input every repetition, and a rotation over
``--rotate`` distinct inputs (each larger than L2), and prints both.

    python benchmarks/dev/l2_persist.py --json out/l2_persist.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import fusedops

CASES = (("ln_fwd", torch.bfloat16, 16384), ("ln_fwd", torch.float32, 32768),
         ("ln_fwd", torch.float32, 16384), ("sm_bwd", torch.bfloat16, 16384),
         ("ln_fwd", torch.bfloat16, 1024), ("sm_fwd", torch.bfloat16, 4096))


def make(op, n):
    if op == "ln_fwd":
        def fn(x, w, b, dy):
            return F.layer_norm(x, (n,), w, b)

        def fused(x, w, b, dy):
            return fusedops.fused_layernorm(x, (n,), w, b)
        return fn, fused, 2
    if op == "sm_fwd":
        return (lambda x, w, b, dy: torch.softmax(x, -1),
                lambda x, w, b, dy: fusedops.fused_softmax(x), 2)

    def bwd(x, w, b, dy):
        return torch._softmax_backward_data(dy, x, -1, x.dtype)

    def fbwd(x, w, b, dy):
        from fusedops.triton import softmax as tsm
        return tsm.softmax_backward(x, dy, x.dtype)
    return bwd, fbwd, 3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rotate", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = []
    for op, dt, n in CASES:
        m = (1 << 27) // n
        eager, fused, passes = make(op, n)
        compiled = torch.compile(eager, dynamic=False)
        sets = []
        for _ in range(args.rotate):
            x = torch.randn(m, n, device="cuda", dtype=dt)
            if op == "sm_bwd":
                x = torch.softmax(x, -1)
            sets.append((x, torch.randn(n, device="cuda", dtype=dt),
                         torch.randn(n, device="cuda", dtype=dt),
                         torch.randn_like(x) if op == "sm_bwd" else None))
        nbytes = passes * m * n * x.element_size()
        for name, fn in (("fusedops", fused), ("eager", eager), ("compile", compiled)):
            with torch.no_grad():
                fn(*sets[0])
                same = do_bench(lambda: fn(*sets[0]), warmup=25, rep=100, return_mode="median")
                cyc = itertools.cycle(sets)
                rot = do_bench(lambda: fn(*next(cyc)), warmup=25, rep=100, return_mode="median")
            rec = {"op": op, "dtype": str(dt)[6:], "N": n, "provider": name,
                   "same_tbps": nbytes / same / 1e9, "rotate_tbps": nbytes / rot / 1e9}
            out.append(rec)
            print(f"{op} {rec['dtype']:8s} {n:6d} {name:9s} same {rec['same_tbps']:.2f}  "
                  f"rotate {rec['rotate_tbps']:.2f} TB/s", flush=True)
        del sets
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
