"""``python -m fusedops verify``: check the fused ops against PyTorch on this machine's device.

For a handful of shapes that hit the kernel variants (tiny rows, odd sizes, rows just past a
power of two, a non-contiguous input, multi-dim ``normalized_shape``, no affine) and each dtype,
it runs forward and backward through fusedops and through torch in the same dtype, compares
both with a float64 reference, and prints the max errors. A case passes when the fused error
is within ``max(4 x torch's own error, the dtype's floor)``. Exit status 1 if any case fails.

``--backend triton`` on a CPU-only machine runs the Triton kernels in the interpreter
(``TRITON_INTERPRET=1``, slow, small shapes only).
"""

from __future__ import annotations

import argparse
import os
import sys

# error floors (relative to max(1, |reference|)) per dtype
FLOOR = {"float32": 2e-6, "float16": 2e-3, "bfloat16": 1.6e-2}


def _cases(quick: bool) -> list[dict]:
    sm = [
        {"op": "softmax", "shape": (4, 1), "dim": -1},
        {"op": "softmax", "shape": (8, 33), "dim": -1},
        {"op": "softmax", "shape": (16, 1000), "dim": -1},
        {"op": "softmax", "shape": (4, 1025), "dim": -1},
        {"op": "softmax", "shape": (2, 3, 5, 7), "dim": 1},
        {"op": "softmax", "shape": (64, 48), "dim": -1, "transpose": True},
        {"op": "softmax", "shape": (8, 333), "dim": -1, "out_dtype": "float32"},
    ]
    ln = [
        {"op": "layernorm", "shape": (8, 33), "nshape": (33,)},
        {"op": "layernorm", "shape": (16, 1000), "nshape": (1000,)},
        {"op": "layernorm", "shape": (4, 1025), "nshape": (1025,)},
        {"op": "layernorm", "shape": (3, 4, 6), "nshape": (4, 6)},
        {"op": "layernorm", "shape": (8, 64), "nshape": (64,), "affine": False},
    ]
    if not quick:
        sm.append({"op": "softmax", "shape": (4, 8192), "dim": -1})
        sm.append({"op": "softmax", "shape": (2, 70000), "dim": -1})
        ln.append({"op": "layernorm", "shape": (4, 8192), "nshape": (8192,)})
        ln.append({"op": "layernorm", "shape": (2, 70000), "nshape": (70000,)})
    return sm + ln


def _err(a, ref) -> float:
    if a is None or ref is None:
        return 0.0
    a, ref = a.double(), ref.double()
    if ref.numel() == 0:
        return 0.0
    return ((a - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item()


def run_case(case: dict, dtype, device):
    """Return ``{"fused": {out: err}, "torch": {out: err}, "backend": name}`` for one case."""
    import torch
    import torch.nn.functional as F

    from fusedops import _dispatch, fused_layernorm, fused_softmax

    gen = torch.Generator().manual_seed(0)
    shape = case["shape"]
    x64 = torch.randn(shape, generator=gen, dtype=torch.float64) * 3
    if case.get("transpose"):
        x64 = x64.t()
    dy64 = torch.randn(x64.shape, generator=gen, dtype=torch.float64)
    params64 = []
    if case["op"] == "layernorm" and case.get("affine", True):
        n = case["nshape"]
        params64 = [torch.randn(n, generator=gen, dtype=torch.float64),
                    torch.randn(n, generator=gen, dtype=torch.float64)]

    def run(impl, work_dtype, param_dtype):
        x = x64.detach().to(device=device, dtype=work_dtype, copy=True)
        if case.get("transpose"):
            x = x64.t().contiguous().to(device=device, dtype=work_dtype).t()
        x.requires_grad_(True)
        params = [p.detach().to(device=device, dtype=param_dtype, copy=True).requires_grad_(True)
                  for p in params64]
        if case["op"] == "softmax":
            out_dtype = case.get("out_dtype")
            od = getattr(torch, out_dtype) if out_dtype else None
            fn = fused_softmax if impl == "fused" else torch.softmax
            y = fn(x, case["dim"], dtype=od)
        else:
            w, b = params if params else (None, None)
            fn = fused_layernorm if impl == "fused" else F.layer_norm
            y = fn(x, case["nshape"], w, b, 1e-5)
        y.backward(dy64.to(device=device, dtype=y.dtype))
        grads = {"y": y, "dx": x.grad}
        if params:
            grads["dw"], grads["db"] = params[0].grad, params[1].grad
        return {k: v.detach().cpu() for k, v in grads.items()}

    ref = run_cpu_reference(case, x64, dy64, params64)  # float64 on CPU
    # half inputs use float32 weights (the mixed case fusedops supports); torch's own yardstick
    # falls back to weights in the input dtype where its kernel rejects the mix
    param_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    try:
        fused = run("fused", dtype, param_dtype)
    except Exception as e:
        raise RuntimeError(f"fusedops: {type(e).__name__}: {e}") from e
    try:
        native = run("torch", dtype, param_dtype)
    except RuntimeError:
        try:
            native = run("torch", dtype, dtype)
        except Exception as e:
            raise RuntimeError(f"torch: {type(e).__name__}: {e}") from e
    backend = _dispatch.backend_for(torch.empty(0, device=device, dtype=dtype)).NAME
    return {
        "fused": {k: _err(v, ref[k]) for k, v in fused.items()},
        "torch": {k: _err(v, ref[k]) for k, v in native.items()},
        "backend": backend,
    }


def run_cpu_reference(case, x64, dy64, params64):
    import torch
    import torch.nn.functional as F

    x = x64.clone().requires_grad_(True)
    params = [p.clone().requires_grad_(True) for p in params64]
    if case["op"] == "softmax":
        y = torch.softmax(x, case["dim"])
    else:
        w, b = params if params else (None, None)
        y = F.layer_norm(x, case["nshape"], w, b, 1e-5)
    y.backward(dy64)
    out = {"y": y.detach(), "dx": x.grad}
    if params:
        out["dw"], out["db"] = params[0].grad, params[1].grad
    return out


def _label(case: dict) -> str:
    """A case's row label: op, shape and what is special about it."""
    label = case["op"] + " " + "x".join(map(str, case["shape"]))
    if case.get("transpose"):
        label += " (transposed)"
    if case.get("dim", -1) != -1:
        label += f" dim={case['dim']}"
    if case.get("out_dtype"):
        label += f" dtype={case['out_dtype']}"
    if case["op"] == "layernorm" and len(case["nshape"]) > 1:
        label += f" ns={tuple(case['nshape'])}"
    if case["op"] == "layernorm" and not case.get("affine", True):
        label += " no-affine"
    return label


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fusedops verify",
        description="Check fused softmax / LayerNorm against PyTorch on this machine's device.",
    )
    parser.add_argument("--device", help="cuda, mps or cpu (default: best present)")
    parser.add_argument("--backend", choices=["triton", "metal", "reference"],
                        help="force a backend (triton on CPU runs the interpreter)")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--quick", action="store_true", help="skip the long-row cases")
    args = parser.parse_args(argv)

    if args.backend == "triton" and "triton" not in sys.modules:
        import torch as _torch

        if not _torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
            args.quick = True

    import fusedops
    from fusedops.tools import _report
    from fusedops.tools.cli import UsageError

    device = _report.pick_device(args.device)
    if args.backend == "triton" and device.type == "cpu":
        args.quick = True
    dtypes = [_report.dtype_from_name(d.strip()) for d in args.dtypes.split(",") if d.strip()]
    if not dtypes:
        raise UsageError("--dtypes: no dtype given")
    for dtype in dtypes:
        if str(dtype).replace("torch.", "") not in FLOOR:
            raise UsageError(f"--dtypes: {dtype} is not checked; use {', '.join(FLOOR)}")
    info = _report.device_info(device)
    print(_report.heading(f"fusedops verify on {info['name']} ({device.type})"))
    print(f"torch {info['torch']}, triton {info['triton']}; automatic backends: "
          f"{info['backends']}" + (f"; forced: {args.backend}" if args.backend else ""))
    rows, failures, backends, errors = [], 0, set(), []
    with fusedops.use_backend(args.backend):
        for dtype in dtypes:
            dname = str(dtype).replace("torch.", "")
            for case in _cases(args.quick):
                label = _label(case)
                try:
                    res = run_case(case, dtype, device)
                except Exception as e:  # noqa: BLE001 - report every failing case
                    failures += 1
                    rows.append([label, dname, "-", "ERROR (see below)", "", "FAIL"])
                    errors.append(f"{label} {dname}: {str(e).splitlines()[0][:300]}")
                    continue
                backends.add(res["backend"])
                worst_ok = True
                parts_f, parts_t = [], []
                for k, fe in res["fused"].items():
                    te = res["torch"][k]
                    ok = fe <= max(4 * te, FLOOR[dname])
                    worst_ok &= ok
                    parts_f.append(f"{k} {fe:.1e}")
                    parts_t.append(f"{te:.1e}")
                failures += not worst_ok
                rows.append([label, dname, res["backend"], ", ".join(parts_f),
                             ", ".join(parts_t), "ok" if worst_ok else "FAIL"])
    print(_report.table(rows, ["case", "dtype", "backend", "fused max err (per output)",
                               "torch max err", "result"], "llllll"))
    print("errors: max |out - float64 reference| / max(1, max |reference|); outputs y, dx and "
          "for LayerNorm dw, db; pass: fused <= max(4 x torch's error, dtype floor)")
    if backends == {"reference"}:
        print("note: every case ran the PyTorch reference backend (no fused kernel on this "
              "device); use --backend triton to exercise the Triton kernels in the interpreter.")
    for line in errors:
        print("ERROR", line)
    print(f"{len(rows) - failures}/{len(rows)} cases passed")
    return 1 if failures else 0


if __name__ == "__main__":
    from fusedops.__main__ import run_command

    raise SystemExit(run_command("verify"))
