"""Where the time of the fused LayerNorm-epilogue and masked-softmax chains goes (CUDA only).

For each point: the chain's fwd_bwd step (bench-chains' ``_Step``) under torch.profiler (CUDA
kernels: name, calls per step, mean us), the step's host time per call (back-to-back loop,
synchronised at the end), and the Triton backward / forward functions timed alone with
``do_bench`` on the same shapes. Prints a table; ``--json`` writes the numbers.

    python benchmarks/dev/epi_probe.py --json out/epi_probe.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from triton.testing import do_bench

from fusedops.tools import bench_chains as bc
from fusedops.triton import layernorm_epilogue as E

POINTS = [("add_layernorm", "bf16", (16384, 768)), ("add_layernorm", "bf16", (65536, 768)),
          ("layernorm_dropout_relu", "bf16", (65536, 768))]
DT = {"bf16": torch.bfloat16, "fp32": torch.float32}


def host_us(fn, calls=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def kernels(fn, steps=5):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.count:
            rows.append((e.key[:60], e.count / steps, e.device_time_total / e.count))
    return sorted(rows, key=lambda r: -r[1] * r[2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    res = []
    for chain, dt, shape in POINTS:
        for prov in ("fusedops", "eager"):
            inputs = bc.make_inputs(chain, shape, DT[dt], "cuda")
            fn = bc.make_fused(chain) if prov == "fusedops" else bc.make_eager(chain)
            step = bc._Step(fn, inputs, "cuda", DT[dt])

            def call(step=step):
                with torch.enable_grad():
                    return step()
            rec = {"chain": chain, "dtype": dt, "shape": shape, "provider": prov,
                   "bench_ms": do_bench(call, warmup=25, rep=100, return_mode="median"),
                   "host_us": host_us(call), "kernels": kernels(call)}
            res.append(rec)
            print(f"{chain} {dt} {shape} {prov}: do_bench {rec['bench_ms']:.3f} ms, "
                  f"loop {rec['host_us']:.1f} us/step")
            for k in rec["kernels"][:8]:
                print(f"    {k[1]:4.1f} x {k[2]:8.1f} us  {k[0]}")
    # The Triton functions alone: the epilogue backward (shipped plan, and the previous plan
    # through BWD_PLAN_OVERRIDE) against LayerNorm's own fused backward on the same rows.
    from fusedops.triton import layernorm as tln
    for dt in ("bf16", "fp32"):
        for M, N in ((16384, 768), (65536, 768), (32768, 1024), (16384, 2048), (16384, 4096),
                     (8192, 8192)):
            dtype = DT[dt]
            s = torch.randn(M, N, device="cuda", dtype=dtype)
            dout, ds = torch.randn_like(s), torch.randn_like(s)
            w = torch.randn(N, device="cuda", dtype=dtype)
            b = torch.randn(N, device="cuda", dtype=dtype)
            _, _, mean, rstd = E.layernorm_epilogue_forward(s, None, w, b, 1e-5, dtype, 0.0, 0,
                                                            None, True)
            block = E.next_pow2(N)
            rows, warps = E._tile_2d(block, s.element_size(), False, True)
            old_plan = (rows, warps, max(2, 32 // warps), True, False, 1)
            rec = {"fn": True, "dtype": dt, "M": M, "N": N}
            rec["plain_ln_bwd_us"] = 1e3 * do_bench(lambda: tln.layernorm_backward(
                dout, s, w, mean, rstd, True, True, True), return_mode="median")
            for p, act in ((0.0, None), (0.1, "relu")):
                for name, plan in (("new", None), ("old", old_plan)):
                    if p and name == "old":
                        continue
                    E.BWD_PLAN_OVERRIDE = plan
                    rec[f"bwd_{name}_p{p}_us"] = 1e3 * do_bench(
                        lambda: E.layernorm_epilogue_backward(
                            dout, ds, s, w, b, mean, rstd, p, 123, act, True, True, True,
                            grad_dtypes=(dtype, dtype)), return_mode="median")
                    E.BWD_PLAN_OVERRIDE = None
                rec[f"fwd_p{p}_us"] = 1e3 * do_bench(lambda: E.layernorm_epilogue_forward(
                    s, ds, w, b, 1e-5, dtype, p, 123, act, True), return_mode="median")
            # Dropout tiles of 4K elements instead of 2K (_tile_2d's BWD_TILE).
            shipped = E.BWD_TILE
            E.BWD_TILE = 4096
            rec["fwd_p0.1_tile4k_us"] = 1e3 * do_bench(lambda: E.layernorm_epilogue_forward(
                s, ds, w, b, 1e-5, dtype, 0.1, 123, "relu", True), return_mode="median")
            rec["bwd_new_p0.1_tile4k_us"] = 1e3 * do_bench(lambda: E.layernorm_epilogue_backward(
                dout, ds, s, w, b, mean, rstd, 0.1, 123, "relu", True, True, True,
                grad_dtypes=(dtype, dtype)), return_mode="median")
            E.BWD_TILE = shipped
            ideal = M * N * s.element_size() / 4.1e12 * 1e6
            rec["pass_us_at_4.1TBs"] = ideal
            print(f"fn {dt} {M}x{N} (one pass {ideal:.1f} us): " + ", ".join(
                f"{k} {v:.1f}" for k, v in rec.items() if k.endswith("_us")))
            res.append(rec)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
