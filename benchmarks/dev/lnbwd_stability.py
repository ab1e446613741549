"""Developer probe (GPU): is the 16-bit LayerNorm backward's run-to-run drop at short rows a
property of the allocation, of the clocks, or of the kernel?

    python benchmarks/dev/lnbwd_stability.py [REPEATS]

For bf16 rows of 256, 1K and 4K (M·N = 2^27) it times, REPEATS times each with fresh tensors
(new allocations, new data): fusedops' LayerNorm backward, torch.compile's backward (compiled
once per shape) and a 1 GiB copy, interleaved so a slow phase of the device shows in every
provider. Each line gives TB/s and the low address bits (mod 2 MiB) of x, dy and the dx the
call returned, and the SM clock nvidia-smi reports. Writes $OUT/lnbwd_stability.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import triton
from triton.testing import do_bench

from fusedops.triton import layernorm as tln

TOTAL = 1 << 27
MIB2 = 2 << 20


def sm_clock() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - the clock is informative only
        return "?"


def bench(fn) -> float:
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def main(repeats: int) -> int:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    records = []
    src = torch.empty(TOTAL * 2, device="cuda")
    dst = torch.empty_like(src)
    copy_bytes = 2 * src.numel() * 4
    for n in (256, 1024, 4096):
        m = TOTAL // n
        nbytes = 3 * m * n * 2 + 8 * m

        def eager(x, w, b, dy, mean, rstd):
            return torch.ops.aten.native_layer_norm_backward(
                dy, x, (n,), mean, rstd, w, b, (True, True, True))
        compiled = torch.compile(eager, dynamic=False)
        for rep in range(repeats):
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn_like(x)
            w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            b = torch.randn_like(w)
            _, mean, rstd = tln.layernorm_forward(x, w, b, 1e-5, torch.bfloat16)
            grads = tln.layernorm_backward(dy, x, w, mean, rstd, True, True, True)
            fo = nbytes / bench(lambda: tln.layernorm_backward(dy, x, w, mean, rstd, True, True,
                                                               True)) / 1e9
            co = nbytes / bench(lambda: compiled(x, w, b, dy, mean.view(m, 1),
                                                 rstd.view(m, 1))) / 1e9
            cp = copy_bytes / bench(lambda: dst.copy_(src)) / 1e9
            rec = {"N": n, "rep": rep, "fusedops_tbps": fo, "compile_tbps": co, "copy_tbps": cp,
                   "x_mod_2MiB": x.data_ptr() % MIB2, "dy_mod_2MiB": dy.data_ptr() % MIB2,
                   "dx_mod_2MiB": grads[0].data_ptr() % MIB2, "clock": sm_clock()}
            records.append(rec)
            print(f"N={n:5d} rep {rep}: fusedops {fo:5.2f}  compile {co:5.2f}  copy {cp:5.2f}  "
                  f"x%2M {rec['x_mod_2MiB']:8d} dy%2M {rec['dy_mod_2MiB']:8d} "
                  f"dx%2M {rec['dx_mod_2MiB']:8d}  [{rec['clock']}]", flush=True)
            del x, dy, grads
            torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "lnbwd_stability.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5))
