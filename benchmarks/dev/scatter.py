"""Why do single 16-bit LayerNorm backward points drop by up to 40% in one run and not another?

Times the same points many times on fresh allocations (a random-sized pad in front, so the
tensors land at other addresses), and samples the SM clock, power and throttle reasons right
after each timing. Hypotheses: (a) placement (relative addresses of x, dy, dx), (b) the SM
clock (power capping slows kernels that issue many instructions per byte), (c) neither.

    OUT=dir python benchmarks/dev/scatter.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import triton

from fusedops.triton.layernorm import layernorm_backward

QUERY = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def gpu_state() -> dict:
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as exc:  # noqa: BLE001 - diagnostics only
        return {"error": str(exc)}
    return dict(zip(QUERY.split(","), [v.strip() for v in line.split(",")], strict=False))


def ln_bwd_point(dtype, n, total=1 << 27):
    m = total // n
    pad = torch.empty(int(torch.randint(1, 1 << 22, ()).item()) * 256, dtype=torch.uint8,
                      device="cuda")
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    w = torch.randn(n, device="cuda", dtype=dtype)
    mean = x.float().mean(1)
    rstd = (x.float().var(1, unbiased=False) + 1e-5).rsqrt()
    return pad, (dy, x, w, mean, rstd, True, True, True, (dtype, dtype))


def main() -> None:
    out = os.environ.get("OUT", ".")
    points = [(torch.bfloat16, 4096), (torch.bfloat16, 512), (torch.bfloat16, 8192),
              (torch.bfloat16, 65536), (torch.float32, 4096)]
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    copy_src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    records = []
    for t in range(trials):
        for dtype, n in points:
            pad, args = ln_bwd_point(dtype, n)
            x = args[1]
            ms = triton.testing.do_bench(lambda args=args: layernorm_backward(*args),
                                         warmup=5, rep=25)
            state = gpu_state()
            cms = triton.testing.do_bench(lambda: copy_dst.copy_(copy_src), warmup=5, rep=25)
            nbytes = 3 * x.numel() * x.element_size()
            rec = {"trial": t, "dtype": str(dtype), "N": n, "ms": ms,
                   "tbps": nbytes / ms / 1e9, "copy_tbps": 2 * copy_src.numel() / cms / 1e9,
                   "x_ptr_mod_2M": x.data_ptr() % (1 << 21),
                   "dy_minus_x_mod_2M": (args[0].data_ptr() - x.data_ptr()) % (1 << 21),
                   **state}
            records.append(rec)
            print(f"t{t} {str(dtype)[6:]:8s} {n:6d} {rec['tbps']:.3f} TB/s "
                  f"copy {rec['copy_tbps']:.3f} sm {state.get('clocks.sm')} "
                  f"mem {state.get('clocks.mem')} pw {state.get('power.draw')} "
                  f"T {state.get('temperature.gpu')} thr {state.get(QUERY.split(',')[-1])}",
                  flush=True)
            del pad, args, x
    with open(os.path.join(out, "scatter.json"), "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
