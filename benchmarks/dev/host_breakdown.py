"""Where the host time of one small fused call goes (CUDA only).

Times, per call, back-to-back loops of: torch's own op, the allocation alone, the full
fusedops call (with replay runners, with launch plans only, with neither), the backend function, our Launcher alone (buffers preallocated), Triton's compiled
runner (``compiled[grid](*args)``) and Triton's JIT launch (``kernel[grid](*args)``), so the
difference between neighbouring rows is the cost of one layer. Prints a table; ``--json`` writes
the numbers.

    python benchmarks/dev/host_breakdown.py --json out/host_breakdown.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

import fusedops
from fusedops import _dispatch, _replay
from fusedops.triton import _common
from fusedops.triton import layernorm as tln
from fusedops.triton import softmax as tsm


def per_call_us(fn, calls: int = 2000, repeats: int = 7) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


class _NoPlans(dict):
    """A plan cache that never keeps a plan (the host path before PlanCache)."""

    def add(self, *args) -> None:
        pass


@contextlib.contextmanager
def no_plans():
    saved = tsm._fwd_plans, tln._fwd_plans
    tsm._fwd_plans, tln._fwd_plans = _NoPlans(), _NoPlans()
    try:
        yield
    finally:
        tsm._fwd_plans, tln._fwd_plans = saved


@contextlib.contextmanager
def no_replay():
    """Plans kept, replay runners off (the host path before fusedops._replay)."""
    saved = tsm._fwd_plans.runner, tln._fwd_plans.runner
    tsm._fwd_plans.runner = tln._fwd_plans.runner = None
    _replay.clear()
    try:
        yield
    finally:
        tsm._fwd_plans.runner, tln._fwd_plans.runner = saved
        _common.set_single_block_limit(None)  # plans made meanwhile have no runner: drop them


def with_and_without_plans(name: str, fn) -> dict[str, float]:
    """``fn`` timed with replay runners and launch plans, with plans only, without either, and
    with both again (the host drifts)."""
    a = per_call_us(fn)
    with no_replay():
        r = per_call_us(fn)
        with no_plans():
            b = per_call_us(fn)
    c = per_call_us(fn)
    return {name: min(a, c), name + " (no replay)": r, name + " (no replay, no plans)": b}


def softmax_rows(x: torch.Tensor) -> dict[str, float]:
    x2 = x.reshape(-1, x.shape[-1])
    M, N = x2.shape
    y = torch.empty_like(x2)
    single, block, rows, warps = _common.row_config(N, "softmax_fwd", x.element_size())
    tiles = _common.cdiv(M, rows)
    args = (x2, y, M, N, N, N, tiles, tiles, block, rows, 0)
    compiled = tsm._softmax_fwd_single[(tiles,)](*args, num_warps=warps)
    launcher = tsm._launch_fwd_single
    backend = _dispatch.backend_for(x2)
    grid = (tiles, 1, 1)
    return {
        "torch.softmax": per_call_us(lambda: torch.softmax(x, -1)),
        "torch.empty_like": per_call_us(lambda: torch.empty_like(x)),
        **with_and_without_plans("fused_softmax", lambda: fusedops.fused_softmax(x)),
        "backend.softmax_forward": per_call_us(lambda: backend.softmax_forward(x2, x.dtype)),
        "Launcher (buffers ready)": per_call_us(lambda: launcher((tiles,), args, warps)),
        "launch key only": per_call_us(lambda: _common._launch_key(warps, args, 8)),
        "compiled[grid](*args)": per_call_us(lambda: compiled[grid](*args)),
        "kernel[grid](*args) (JIT)": per_call_us(
            lambda: tsm._softmax_fwd_single[(tiles,)](*args, num_warps=warps)),
        "current raw stream": per_call_us(lambda: _common.current_stream(0)),
        "empty_like + direct entry, int pointers (the plan floor)": plan_floor(x),
    }


def plan_floor(x: torch.Tensor) -> float:
    """What a replayed plan costs without the ops layer: allocation plus the C entry."""
    tsm.softmax_forward(x, x.dtype)
    key = (x.shape, x.dtype, x.dtype, x.get_device())
    if key not in tsm._fwd_plans:
        return float("nan")
    go, grid, device, tail = tsm._fwd_plans[key]

    def call():
        y = torch.empty_like(x)
        go(grid, _common.current_stream(device), (x.data_ptr(), y.data_ptr(), *tail))
    return per_call_us(call)


def layernorm_rows(x: torch.Tensor) -> dict[str, float]:
    n = x.shape[-1]
    w = torch.ones(n, device=x.device, dtype=x.dtype)
    b = torch.zeros(n, device=x.device, dtype=x.dtype)
    x2 = x.reshape(-1, n)
    backend = _dispatch.backend_for(x2)
    return {
        "F.layer_norm": per_call_us(lambda: torch.nn.functional.layer_norm(x, (n,), w, b)),
        **with_and_without_plans("fused_layernorm",
                                 lambda: fusedops.fused_layernorm(x, (n,), w, b)),
        "backend.layernorm_forward_y": per_call_us(
            lambda: backend.layernorm_forward_y(x2, w, b, 1e-5, x.dtype)),
        "backend.layernorm_forward (+stats)": per_call_us(
            lambda: backend.layernorm_forward(x2, w, b, 1e-5, x.dtype)),
        "tln._forward (no device switch)": per_call_us(
            lambda: tln._forward(x2, w, b, 1e-5, x.dtype, False)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "cases": []}
    with torch.no_grad():
        for shape in ((4, 128), (64, 768), (8, 128, 768)):
            x = torch.randn(shape, device="cuda", dtype=torch.float16)
            for op, fn in (("softmax", softmax_rows), ("layernorm", layernorm_rows)):
                res = fn(x)
                out["cases"].append({"op": op, "shape": list(shape), "us": res})
                print(f"{op} {tuple(shape)}")
                for k, v in res.items():
                    print(f"  {v:7.2f} us  {k}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
