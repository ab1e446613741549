"""Developer tool (GPU): what the compiler and the hardware say about every point of a sweep
that misses the bandwidth targets (>= 0.90 of copy for 1K <= N <= 64K, >= 0.75 above).

    python benchmarks/dev/occupancy_report.py [SWEEP.json] [--all]

For each fusedops softmax or LayerNorm point of the sweep below its target (every such point with
--all) it runs the op once on fresh data of the sweep's shape (M·N = 2^27) under torch.profiler
and reads, for every CUDA kernel launched, what CUPTI recorded: grid, block, registers per
thread, shared memory, resident blocks and warps per SM and the estimated achieved occupancy,
with the kernel's time. Triton's compiled kernels add spilled bytes (matched by kernel name and
register count). The header states the bytes each SM must keep in flight by Little's law (copy
bandwidth x ~0.7 us loaded DRAM latency / SMs). Writes $OUT/occupancy.json when OUT is set and
prints one line per kernel. Other ops in the sweep (RMSNorm) are skipped. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import triton

from fusedops.backends.triton import layernorm as tln
from fusedops.backends.triton import layernorm_bwd as tlnb
from fusedops.backends.triton import softmax as tsm

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SWEEP = REPO / "benchmarks" / "results" / "h200" / "sweep.json"
OPS = ("softmax_fwd", "softmax_bwd", "layernorm_fwd", "layernorm_bwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOTAL = 1 << 27


def target(n: int) -> float | None:
    if n < 1024:
        return None
    return 0.90 if n <= 65536 else 0.75


def make_call(op: str, dt: torch.dtype, n: int):
    """The fusedops kernel call of one sweep point (what the sweep times for fusedops)."""
    m = TOTAL // n
    x = torch.randn(m, n, device="cuda", dtype=dt)
    if op == "softmax_fwd":
        return lambda: tsm.softmax_forward(x, dt)
    if op == "softmax_bwd":
        y = torch.softmax(x, -1)
        dy = torch.randn_like(x)
        return lambda: tsm.softmax_backward(y, dy, dt)
    w = torch.randn(n, device="cuda", dtype=dt)
    b = torch.randn(n, device="cuda", dtype=dt)
    if op == "layernorm_fwd":
        return lambda: tln.layernorm_forward(x, w, b, 1e-5, dt)
    dy = torch.randn_like(x)
    _, mean, rstd = tln.layernorm_forward(x, w, b, 1e-5, dt)
    return lambda: tlnb.layernorm_backward(dy, x, w, mean, rstd, True, True, True)


def profiled_kernels(fn) -> list[dict]:
    fn()  # compile and warm up outside the trace
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    out = []
    for e in events:
        if e.get("cat") != "kernel":
            continue
        a = e.get("args", {})
        out.append({
            "name": e["name"], "us": e.get("dur"), "grid": a.get("grid"), "block": a.get("block"),
            "regs": a.get("registers per thread"), "smem": a.get("shared memory"),
            "blocks_per_sm": a.get("blocks per SM"), "warps_per_sm": a.get("warps per SM"),
            "occupancy_pct": a.get("est. achieved occupancy %"),
        })
    return out


def triton_spills() -> dict[tuple[str, int], tuple[int, int]]:
    """(kernel name, registers) -> (spilled bytes, warps) over every compiled fusedops kernel."""
    found = {}
    for mod in (tsm, tln, sys.modules["fusedops.backends.triton._common"]):
        for obj in vars(mod).values():
            caches = getattr(obj, "device_caches", None)
            if not isinstance(caches, dict):
                continue
            for cache in caches.values():
                kernels = cache[0] if isinstance(cache, tuple) else cache
                for k in getattr(kernels, "values", lambda: [])():
                    try:
                        k._init_handles()
                        found[(k.metadata.name, k.n_regs)] = (k.n_spills, k.metadata.num_warps)
                    except Exception:  # noqa: BLE001 - a kernel that cannot load is skipped
                        continue
    return found


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", nargs="?", type=Path, default=DEFAULT_SWEEP,
                   help="a `python -m fusedops bench` JSON (default: %(default)s)")
    p.add_argument("--all", action="store_true", help="every point, not only those below target")
    return p.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    sweep_path = args.sweep
    sweep = json.loads(sweep_path.read_text())
    copy = sweep["copy_tbps"]
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    # Little's law with ~0.7 us of loaded DRAM latency (Hopper, measured in the literature
    # at 0.6-0.8 us under load): the bytes every SM must have requested and not yet received.
    need_per_sm = copy * 1e12 * 0.7e-6 / sms
    points = [r for r in sweep["records"] if r["provider"] == "fusedops" and r.get("ok")
              and r["op"] in OPS
              and (args.all or (target(r["N"]) and r["frac_copy"] < target(r["N"])))]
    print(f"{props.name}, {sms} SMs, torch {torch.__version__}, Triton {triton.__version__}; "
          f"sweep {sweep_path.name} (copy {copy:.3f} TB/s); {len(points)} points; Little's law "
          f"needs ~{need_per_sm / 1024:.0f} KiB in flight per SM", flush=True)
    rows = []
    for r in points:
        dt = DTYPES[r["dtype"]]
        kernels = profiled_kernels(make_call(r["op"], dt, r["N"]))
        rows.append({"op": r["op"], "dtype": r["dtype"], "N": r["N"], "M": TOTAL // r["N"],
                     "frac_copy": r["frac_copy"], "target": target(r["N"]), "kernels": kernels})
        torch.cuda.empty_cache()
    spills = triton_spills()
    for row in rows:
        for k in row["kernels"]:
            s = spills.get((k["name"], k["regs"]))
            k["spill_bytes"], k["triton_warps"] = s if s else (None, None)
    print(f"{'op':13s} {'dt':4s} {'N':>6s} {'frac':>5s}  {'kernel':28s} {'us':>7s} "
          f"{'grid':>8s} {'thr':>4s} {'regs':>4s} {'spill':>5s} {'smem':>6s} {'blk/SM':>6s} "
          f"{'occ%':>5s}")
    for row in rows:
        for k in row["kernels"]:
            grid = k["grid"][0] if k["grid"] else 0
            thr = k["block"][0] if k["block"] else 0
            print(f"{row['op']:13s} {row['dtype']:4s} {row['N']:6d} {row['frac_copy']:5.2f}  "
                  f"{k['name'][:28]:28s} {k['us'] or 0:7.1f} {grid:8d} {thr:4d} "
                  f"{k['regs'] or 0:4d} {str(k['spill_bytes']):>5s} {k['smem'] or 0:6d} "
                  f"{k['blocks_per_sm'] or 0:6.1f} {k['occupancy_pct'] or 0:5.1f}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "occupancy.json"), "w") as f:
            json.dump({"device": props.name, "sms": sms, "torch": torch.__version__,
                       "triton": triton.__version__, "sweep": sweep_path.name,
                       "copy_tbps": copy, "littles_law_bytes_per_sm": need_per_sm,
                       "points": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    ARGS = parse_args(sys.argv[1:])
    if not torch.cuda.is_available():
        print("occupancy_report.py needs a CUDA GPU")
        sys.exit(2)
    sys.exit(main(ARGS))
