"""What torch.compile generates where it beats fusedops: the Triton source and the launch config
Inductor picked (block sizes, warps, registers, spills) per (op, dtype, N) at M·N = 2^27.

    python benchmarks/dev/inductor_configs.py --out out/inductor ln_fwd:bf16:1024 sm_bwd:bf16:4096

Writes ``<op>_<dtype>_<N>.txt`` (the generated code) and ``configs.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def ln_fwd(x, w, b, dy):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def sm_fwd(x, w, b, dy):
    return torch.softmax(x, -1)


def sm_bwd(y, w, b, dy):
    return torch._softmax_backward_data(dy, y, -1, y.dtype)


def ln_bwd(x, w, b, dy):
    mean = x.float().mean(-1, keepdim=True)
    rstd = torch.rsqrt(x.float().var(-1, unbiased=False, keepdim=True) + 1e-5)
    return torch.ops.aten.native_layer_norm_backward(
        dy, x, (x.shape[-1],), mean, rstd, w, b, (True, True, True))


FNS = {"ln_fwd": ln_fwd, "sm_fwd": sm_fwd, "sm_bwd": sm_bwd, "ln_bwd": ln_bwd}


def launch_configs() -> list[dict]:
    """The launchers Inductor kept after autotuning, for every kernel module loaded so far."""
    from torch._inductor.codecache import PyCodeCache

    mods = getattr(PyCodeCache, "modules", None) or list(getattr(PyCodeCache, "cache", {}).values())
    found = []
    for mod in mods:
        for name in dir(mod):
            obj = getattr(mod, name, None)
            launchers = getattr(obj, "launchers", None)
            if not launchers:
                continue
            for launcher in launchers:
                cfg = getattr(launcher, "config", None)
                found.append({
                    "kernel": name,
                    "kwargs": dict(getattr(cfg, "kwargs", {}) or {}),
                    "num_warps": getattr(cfg, "num_warps", None),
                    "num_stages": getattr(cfg, "num_stages", None),
                    "n_regs": getattr(launcher, "n_regs", None),
                    "n_spills": getattr(launcher, "n_spills", None),
                    "shared": getattr(launcher, "shared", None),
                })
    return found


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("cases", nargs="+", help="op:dtype:N with op in " + ",".join(FNS))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from torch._inductor.utils import run_and_get_code

    results = []
    for case in args.cases:
        op, dt, n = case.split(":")
        n = int(n)
        m = (1 << 27) // n
        x = torch.randn(m, n, device="cuda", dtype=DT[dt])
        w = torch.randn(n, device="cuda", dtype=DT[dt])
        b = torch.randn(n, device="cuda", dtype=DT[dt])
        dy = torch.randn_like(x)
        if op == "sm_bwd":
            x = torch.softmax(x.float(), -1).to(DT[dt])
        torch._dynamo.reset()
        fn = torch.compile(FNS[op], dynamic=False)
        before = len(launch_configs())
        _, code = run_and_get_code(fn, x, w, b, dy)
        configs = launch_configs()[before:]
        with open(os.path.join(args.out, f"{op}_{dt}_{n}.txt"), "w") as f:
            f.write("\n\n# ----\n\n".join(code))
        results.append({"case": case, "configs": configs})
        print(case, json.dumps(configs))
    with open(os.path.join(args.out, "configs.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
