"""Developer probe (GPU): why the LayerNorm backward kernels' PARKED variant (the low_memory
mode) is slower than the default one at the same work.

For each shape it launches the fused (or split-row) backward kernel directly, same inputs and
grid, as: the default variant (PARKED=False); the parked variant doing the same work (first tile
0, dx for every row, scratch kept separate); the parked variant skipping the last rows' dx (as
the low_memory mode's first launch). Then the public backward in both modes. do_bench medians,
rounds interleaved. Writes each variant's cubin and PTX to $OUT/<shape>/ for cuobjdump -sass.

``--once``: each direct variant launched once (for ncu: --kernel-name regex:_ln_bwd)."""

import json
import os
import sys

import torch
import triton
from triton.testing import do_bench

import fusedops
from fusedops.triton import _common
from fusedops.triton import layernorm as tln

OUT = os.environ.get("OUT", "/tmp/parked_ab")
ONCE = "--once" in sys.argv
SHAPES = [(torch.float32, 8193), (torch.float32, 8192), (torch.bfloat16, 8193),
          (torch.float32, 4096), (torch.float32, 16384), (torch.float32, 65536)]
TOTAL = 1 << 27


def inputs(dtype, N):
    M = TOTAL // N
    x = torch.randn(M, N, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    w = torch.randn(N, device="cuda", dtype=dtype)
    mean = x.float().mean(1)
    rstd = torch.rsqrt(x.float().var(1, unbiased=False) + 1e-5)
    return x, dy, w, mean, rstd


def fused_variants(x, dy, w, mean, rstd, dx):
    M, N = x.shape
    plan = tln._fused_plan(M, N, x, dy)
    vec, block, rows, warps, acc_1d, tiles, progs = plan
    part = torch.empty((2, progs, N), dtype=torch.float32, device="cuda")
    m_dx = tln._park(dx, 8 * progs * N, rows * max(vec, 1))[0]

    def launch(parked, first, mdx):
        args = (dy, x, w, mean, rstd, dx, part, M, N, dy.stride(0), x.stride(0), N, tiles,
                progs, first, mdx, block, rows, True, True, True, True, vec, True, acc_1d,
                parked, tln._paired_sums(x.element_size(), vec, block))
        return tln._launch_bwd_single.kernel[(progs,)](*args, num_warps=warps)

    info = dict(plan=list(plan), m_dx=m_dx)
    return {"default": lambda: launch(False, 0, M), "parked_same_work": lambda: launch(True, 0, M),
            "parked_skip_tail": lambda: launch(True, 0, m_dx)}, info


def split_variants(x, dy, w, mean, rstd, dx):
    M, N = x.shape
    chunk, warps, prefetch = tln._split_config("bwd", N, x.element_size(), True)
    C, L = _common.split_pieces(N, chunk, 0)
    stats = torch.empty((M * C * 2,), dtype=torch.float32, device="cuda")
    count = torch.zeros((M,), dtype=torch.int32, device="cuda")
    out = {}
    info = dict(chunk=chunk, warps=warps, prefetch=prefetch, C=C)
    launcher = tln._launch_bwd_split
    for name, parked in (("default", False), ("parked_same_work", True)):
        consts = (triton.next_power_of_2(L), C, triton.next_power_of_2(C), True, True, True,
                  True, prefetch, parked)
        args = [dy, x, w, mean, rstd, dx, mean, stats, count, N, L, dy.stride(0), x.stride(0),
                N, M, M * C]
        progs = launcher.programs(M * C, C, tuple(args), consts, warps, x.device)
        progs = max(C, min(progs, tln._max_partial_rows(x) * C))
        part = torch.empty((2, progs // C, N), dtype=torch.float32, device="cuda")
        args[6] = part
        info[name + "_progs"] = progs

        def run(args=tuple(args), consts=consts, progs=progs):
            count.zero_()
            launcher(M * C, C, args, consts, warps, x.device, progs)
        out[name] = run
    return out, info


def main():
    os.makedirs(OUT, exist_ok=True)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    results = []
    for dtype, N in SHAPES:
        x, dy, w, mean, rstd = inputs(dtype, N)
        M = x.shape[0]
        dx = torch.empty_like(x)
        fused = tln._fused_plan(M, N, x, dy) is not None
        variants, info = (fused_variants if fused else split_variants)(x, dy, w, mean, rstd, dx)
        tag = f"{str(dtype).split('.')[-1]}-{M}x{N}"
        if ONCE:
            for fn in variants.values():
                fn()
            torch.cuda.synchronize()
            continue
        if fused:  # the compiled variants' code, for a SASS diff
            os.makedirs(f"{OUT}/{tag}", exist_ok=True)
            for name, fn in variants.items():
                k = fn()
                with open(f"{OUT}/{tag}/{name}.cubin", "wb") as f:
                    f.write(k.asm["cubin"])
                with open(f"{OUT}/{tag}/{name}.ptx", "w") as f:
                    f.write(k.asm["ptx"])
                info[name + "_regs"] = k.n_regs
        def public(mode):
            def run():
                with fusedops.layernorm_backward_mode(mode):
                    tln.layernorm_backward(dy, x.detach(), w.detach(), mean, rstd, True, True,
                                           True, (dtype, dtype))
            return run
        variants = dict(variants, public_fast=public("fast"),
                        public_low_memory=public("low_memory"))
        nbytes = 3 * x.numel() * x.element_size()
        times = {k: [] for k in variants}
        for _ in range(3):
            for name, fn in variants.items():
                times[name].append(do_bench(fn, warmup=10, rep=60, return_mode="median"))
        row = dict(shape=tag, **info)
        for name, ts in times.items():
            ms = sorted(ts)[1]
            row[name] = dict(ms=ms, tbps=nbytes / ms / 1e9, all=ts)
        results.append(row)
        print(tag, "  ".join(f"{k} {v['tbps']:.2f}" for k, v in row.items()
                             if isinstance(v, dict)), flush=True)
        del x, dy, dx
        torch.cuda.empty_cache()
    if not ONCE:
        with open(f"{OUT}/parked_ab.json", "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
