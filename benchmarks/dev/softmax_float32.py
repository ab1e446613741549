"""float32 softmax forward and backward: accuracy against torch's own and speed, on the kernels
as shipped.

Accuracy: for each row length, data kind and batch (one 1-D row, 64 rows), the largest absolute
error against a float64 result, beside torch's own float32 error and the kernel that ran;
``ok`` is the test suite's bound (tests/test_accuracy_long_rows.py): error <= 2 x torch's +
half an ulp of the largest output. Forward: ``fused_softmax`` against the float64 softmax of
the same float32 inputs. Backward (``backward_*``): the Triton backend's softmax backward alone,
dx = y·(dy - Σ dy·y), on torch's float32 y of those inputs and a random dy, against the same
formula in float64 on that y (torch: ``torch._softmax_backward_data``). Speed:
``triton.testing.do_bench`` medians (L2 flushed) on M = 2^26 / N rows, with the same run's copy
bandwidth (``y.copy_(x)``) and torch beside it; bytes 2·M·N·4 forward, 3·M·N·4 backward.
Writes every record to ``--out``.

    PYTHONPATH=$PWD python benchmarks/dev/softmax_float32.py --out softmax_float32.json
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/dev/softmax_float32.py --smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import triton

import fusedops
from fusedops.backends.triton.runtime.recording import record_launches
from fusedops.backends.triton.softmax import softmax_backward
from fusedops.tools.bench_harness import source_sha

LENGTHS = (1024, 8193, 16384, 17866, 32768, 65536, 65537, 131072, 262144)
SMOKE_LENGTHS = (1024, 8193)
DATA = {"randn": (1.0, 0.0), "x10": (10.0, 0.0), "x100": (100.0, 0.0), "shifted": (1.0, 100.0)}
FLOOR_ULPS = 0.5
ELEMENTS = 1 << 26


def _ulp(v: float) -> float:
    t = torch.tensor(v, dtype=torch.float32)
    return (torch.nextafter(t, torch.tensor(float("inf"))) - t).item()


def _inputs(n: int, data: str, rows: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(n * 10 + rows)
    scale, shift = DATA[data]
    shape = (rows, n) if rows > 1 else (n,)
    x = torch.randn(shape, generator=g) * scale + shift
    return x.to(device), torch.randn(shape, generator=g).to(device)


def accuracy(n: int, data: str, rows: int, device: torch.device, backward: bool) -> dict:
    """One accuracy record: the fused kernel's and torch's error against float64."""
    x, dy = _inputs(n, data, rows, device)
    if backward:
        y = torch.softmax(x, -1).reshape(-1, n)
        dy = dy.reshape(-1, n)
        with record_launches() as record:
            got = softmax_backward(y, dy, torch.float32)
        y64, dy64 = y.double().cpu(), dy.double().cpu()
        ref = y64 * (dy64 - (dy64 * y64).sum(-1, keepdim=True))
        native = torch._softmax_backward_data(dy, y, -1, torch.float32)
    else:
        with record_launches() as record:
            got = fusedops.fused_softmax(x, -1)
        ref = torch.softmax(x.double(), -1).cpu()
        native = torch.softmax(x, -1)
    err = (got.double().cpu() - ref).abs().max().item()
    torch_err = (native.double().cpu() - ref).abs().max().item()
    floor = FLOOR_ULPS * _ulp(ref.abs().max().item())
    kernels = [getattr(launcher.kernel, "fn", launcher.kernel).__name__
               for launcher, *_ in record]
    return {"n": n, "data": data, "rows": rows, "kernels": kernels, "err": err,
            "torch_err": torch_err, "ratio": err / torch_err if torch_err else None,
            "ok": err <= 2 * torch_err + floor}


def speed(n: int, device: torch.device, smoke: bool, backward: bool) -> dict:
    """One speed record: fused and torch ms, copy ms, TB/s of 2·M·N·4 bytes (forward) or
    3·M·N·4 (backward)."""
    m = 4 if smoke else ELEMENTS // n
    x = torch.randn(m, n, device=device)
    y = torch.empty_like(x)
    if backward:
        sm, dy = torch.softmax(x, -1), torch.randn_like(x)
        fns = {"copy": lambda: y.copy_(x),
               "torch": lambda: torch._softmax_backward_data(dy, sm, -1, torch.float32),
               "fusedops": lambda: softmax_backward(sm, dy, torch.float32)}
    else:
        fns = {"copy": lambda: y.copy_(x), "torch": lambda: torch.softmax(x, -1),
               "fusedops": lambda: fusedops.fused_softmax(x, -1)}
    out: dict = {"n": n, "m": m}
    for name, fn in fns.items():
        if smoke:
            fn()
            ms = float("nan")
        else:
            from triton.testing import do_bench

            ms = do_bench(fn, return_mode="median")
        nbytes = (2 if name == "copy" or not backward else 3) * m * n * 4
        out[f"{name}_ms"] = ms
        out[f"{name}_tbps"] = nbytes / (ms * 1e-3) / 1e12 if ms == ms else None
    out["frac_copy"] = (out["fusedops_tbps"] / out["copy_tbps"]) if not smoke else None
    return out


def _report(what: str, records: list[dict], speeds: list[dict]) -> None:
    bad = [r for r in records if not r["ok"]]
    worst = max((r["ratio"] or 0.0) for r in records)
    print(f"{what} accuracy: {len(records) - len(bad)}/{len(records)} within the bound, worst "
          f"ratio {worst:.2f}")
    for r in bad:
        print(f"  over: N {r['n']} {r['data']} x{r['rows']} ratio {r['ratio']:.2f} "
              f"({', '.join(r['kernels'])})")
    for s in speeds:
        if s["frac_copy"] is not None:
            print(f"  N {s['n']:>6}: fusedops {s['fusedops_ms']:.3f} ms ({s['frac_copy']:.3f} "
                  f"of copy), torch {s['torch_ms']:.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="softmax_float32.json")
    p.add_argument("--smoke", action="store_true",
                   help="CPU tensors under TRITON_INTERPRET=1, two lengths, no timing")
    p.add_argument("--no-speed", action="store_true")
    args = p.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    lengths = SMOKE_LENGTHS if args.smoke else LENGTHS
    out: dict = {}
    with fusedops.use_backend("triton"):
        for backward, prefix in ((False, ""), (True, "backward_")):
            out[prefix + "accuracy"] = [accuracy(n, data, rows, device, backward)
                                        for n in lengths for data in DATA
                                        for rows in (1, 64 if not args.smoke else 2)]
            out[prefix + "speed"] = ([] if args.no_speed else
                                     [speed(n, device, args.smoke, backward) for n in lengths])
    meta = {"torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "source_sha": source_sha(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "floor_ulps": FLOOR_ULPS}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, **out}, f, indent=1)
    _report("forward", out["accuracy"], out["speed"])
    _report("backward", out["backward_accuracy"], out["backward_speed"])


if __name__ == "__main__":
    main()
