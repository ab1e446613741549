"""Check that a model patched with fusedops trains under DistributedDataParallel exactly like the
unpatched model: same per-step losses (within a tolerance), parameters in sync across ranks.

    python examples/ddp_check.py --backend gloo --device cpu --steps 5      # CPU, reference ops
    python examples/ddp_check.py --backend gloo --device cpu --fused-backend triton  # interpreter
    python examples/ddp_check.py --backend nccl --device cuda --steps 20    # 2 GPUs, Triton

Spawns 2 processes (``torch.multiprocessing.spawn``, ``MASTER_ADDR=localhost`` and a free port).
Each rank builds the same small predictor (``fusedops.models.Predictor``: nn.LayerNorm modules,
nn.Softmax attention and a functional F.softmax pooling), trains it for ``--steps`` steps on its
own synthetic batches with SGD, once unpatched and once after ``fusedops.patch_model``, from the
same initial weights and data. Rank 0 reports the globally averaged loss of every step for both
runs and a PASS/FAIL line; the exit code is 1 on FAIL.

FAIL when: a loss differs by more than ``atol + rtol * |loss|``; any loss is not finite; the
parameters differ between ranks after training (a broken DDP all-reduce); the patched run made no
call to fusedops (the patch did not take); or, on a fused backend, no call ran on fused kernels.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import sys
import tempfile
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD_SIZE = 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Default loss tolerances (absolute, relative) per training dtype.
# bfloat16: both runs round every activation to 8 significant bits, not always at the same
# points, and training compounds the differences (measured on CPU: about 0.1% over 10 steps);
# 2% is about two bfloat16 ulps.
DEFAULT_TOL = {"float32": (1e-5, 1e-4), "bfloat16": (2e-3, 2e-2)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["nccl", "gloo"], default="gloo",
                   help="torch.distributed backend (nccl needs --device cuda)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cpu",
                   help="cuda: rank r uses cuda:r (needs 2 GPUs)")
    p.add_argument("--steps", type=int, default=10, help="training steps per run")
    p.add_argument("--batch-size", type=int, default=8, help="per-rank batch size")
    p.add_argument("--seq-len", type=int, default=16, help="sequence length")
    p.add_argument("--d-model", type=int, default=64, help="model width")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="model and activation dtype")
    p.add_argument("--fused-backend", choices=["auto", "triton", "reference"], default="auto",
                   help="fusedops backend for the patched run (auto: Triton on CUDA, the "
                        "PyTorch reference on CPU; triton on CPU runs Triton's interpreter)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--atol", type=float, default=None, help="absolute loss tolerance")
    p.add_argument("--rtol", type=float, default=None, help="relative loss tolerance")
    args = p.parse_args(argv)
    if args.backend == "nccl" and args.device != "cuda":
        p.error("--backend nccl needs --device cuda")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    atol, rtol = DEFAULT_TOL[args.dtype]
    args.atol = atol if args.atol is None else args.atol
    args.rtol = rtol if args.rtol is None else args.rtol
    return args


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from fusedops.models import Predictor, PredictorConfig

    torch.manual_seed(args.seed)  # identical initial weights on every rank and in both runs
    cfg = PredictorConfig(n_features=6, max_len=args.seq_len, d_model=args.d_model, n_heads=4,
                          n_layers=2, d_ff=2 * args.d_model)
    return Predictor(cfg)


def batches(args: argparse.Namespace, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's own synthetic regression batches (same in both runs)."""
    g = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
    out = []
    for _ in range(args.steps):
        x = torch.randn(args.batch_size, args.seq_len, 6, generator=g)
        target = (x[:, :, 0].mean(1, keepdim=True) * 4
                  + (x[:, :, 1] * x[:, :, 2]).mean(1, keepdim=True) * 2)
        out.append((x, target))
    return out


def train(args: argparse.Namespace, rank: int, device: torch.device, patched: bool) -> dict:
    import fusedops

    dtype = DTYPES[args.dtype]
    model = build_model(args).to(device=device, dtype=dtype)
    data = batches(args, rank)
    routed = patterns = None
    if patched:
        # force: on CPU the patched calls run PyTorch's ops, which is what this check compares.
        # patterns=True: the blocks' LayerNorm(x + attn) too, so DDP sees every fused kind.
        report = fusedops.patch_model(model, example_inputs=(data[0][0].to(device, dtype),),
                                      force=True, patterns=True)
        v = report.verification
        routed = {op: v["module_calls"][op] + v["routed_calls"][op] for op in v["routed_calls"]}
        patterns = dict(report.verification["pattern_calls"])
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    losses = []
    forced = args.fused_backend if patched and args.fused_backend != "auto" else None
    with fusedops.use_backend(forced), fusedops.count_fused_calls() as counts:
        for x, target in data:
            x, target = x.to(device, dtype), target.to(device)
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(ddp(x).float(), target)
            loss.backward()
            opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / WORLD_SIZE)
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(WORLD_SIZE)]
    dist.all_gather(gathered, flat)
    # Free DDP's reducer (it holds the process group and gloo's threads) now, not at interpreter
    # exit, where an unjoined thread aborts the process.
    del ddp, opt
    gc.collect()
    return {
        "losses": losses,
        "in_sync": all(torch.equal(gathered[0], t) for t in gathered[1:]),
        "params": flat.cpu(),
        "fused_calls": dict(Counter(counts)),
        "routed_calls": routed,
        "pattern_calls": patterns,
    }


def worker(rank: int, args: argparse.Namespace, port: int, out_path: str) -> None:
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # two processes share the machine
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, rank=rank, world_size=WORLD_SIZE)
    try:
        plain = train(args, rank, device, patched=False)
        fused = train(args, rank, device, patched=True)
        if rank == 0:
            diff = (plain["params"] - fused["params"]).abs().max().item()
            result = {
                "plain": {k: v for k, v in plain.items() if k != "params"},
                "fused": {k: v for k, v in fused.items() if k != "params"},
                "max_param_diff": diff,
                "fused_backend": _backend_name(args, device),
            }
            with open(out_path + ".tmp", "w") as f:
                json.dump(result, f)
            os.replace(out_path + ".tmp", out_path)  # complete or absent, never half-written
        dist.barrier()  # neither rank tears gloo down while the other still talks to it
    finally:
        dist.destroy_process_group()


def _backend_name(args: argparse.Namespace, device: torch.device) -> str:
    from fusedops import _dispatch

    if args.fused_backend != "auto":
        return args.fused_backend
    probe = torch.empty(0, device=device, dtype=DTYPES[args.dtype])
    return _dispatch.backend_for(probe).NAME


def evaluate(result: dict, args: argparse.Namespace) -> tuple[bool, list[str]]:
    """(passed, report lines) for rank 0's result."""
    plain, fused = result["plain"], result["fused"]
    lines = [f"{'step':>4}  {'unpatched loss':>16}  {'patched loss':>16}  {'|diff|':>10}"]
    problems = []
    for i, (a, b) in enumerate(zip(plain["losses"], fused["losses"], strict=True)):
        diff = abs(a - b)
        lines.append(f"{i:>4}  {a:>16.8g}  {b:>16.8g}  {diff:>10.3g}")
        if not (math.isfinite(a) and math.isfinite(b)):
            problems.append(f"step {i}: non-finite loss")
        elif diff > args.atol + args.rtol * abs(a):
            problems.append(f"step {i}: |diff| {diff:.3g} > atol + rtol * |loss| "
                            f"({args.atol:g} + {args.rtol:g} * {abs(a):.3g})")
    lines.append(f"fusedops backend of the patched run: {result['fused_backend']}")
    lines.append(f"calls routed to fusedops (verification pass): {fused['routed_calls']}")
    lines.append(f"epilogue pattern calls (verification pass): {fused.get('pattern_calls')}")
    lines.append(f"calls on fused kernels during patched training: {fused['fused_calls']}")
    lines.append(f"max |param difference| after training, patched vs unpatched: "
                 f"{result['max_param_diff']:.3g}")
    lines.append(f"parameters identical across ranks: unpatched {plain['in_sync']}, "
                 f"patched {fused['in_sync']}")
    for name, run in (("unpatched", plain), ("patched", fused)):
        if not run["in_sync"]:
            problems.append(f"{name}: parameters differ between ranks")
    if not any((fused["routed_calls"] or {}).values()) and \
            not any((fused.get("pattern_calls") or {}).values()):
        problems.append("the patched model made no call to fusedops")
    if result["fused_backend"] != "reference" and not any(fused["fused_calls"].values()):
        problems.append("no call ran on fused kernels")
    lines.extend(f"  problem: {p}" for p in problems)
    return not problems, lines


def run_workers(args: argparse.Namespace, out_path: str) -> str | None:
    """Spawn the ranks; None when rank 0's result is in ``out_path``, else what went wrong.

    A worker killed by a signal *after* rank 0 wrote its result is reported and tolerated:
    rank 0 writes only after the last collective (the parameter all-gather), which every rank
    must have joined, so all training and every check had completed; what died was
    torch.distributed's teardown (gloo's threads have aborted a rank at exit, rarely, in CI).
    """
    try:
        mp.spawn(worker, args=(args, free_port(), out_path), nprocs=WORLD_SIZE, join=True)
    except mp.ProcessExitedException as exc:
        if exc.signal_name and os.path.exists(out_path):
            print(f"note: {exc} during teardown, after every rank finished training "
                  "(rank 0's result is complete); the check goes on", flush=True)
            return None
        return f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # a worker raised: report it as a failure
        return f"{type(exc).__name__}: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < WORLD_SIZE:
        print(f"FAIL: --device cuda needs {WORLD_SIZE} GPUs, found {torch.cuda.device_count()}")
        return 1
    if args.device == "cpu" and args.fused_backend == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # inherited by the spawned workers
    print(f"DDP check: world size {WORLD_SIZE}, backend {args.backend}, device {args.device}, "
          f"dtype {args.dtype}, {args.steps} steps, fused backend {args.fused_backend}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.json")
        failure = run_workers(args, out_path)
        if failure:
            print(f"FAIL: a worker failed: {failure}")
            return 1
        with open(out_path) as f:
            result = json.load(f)
    passed, lines = evaluate(result, args)
    print("\n".join(lines))
    tol = f"atol={args.atol:g}, rtol={args.rtol:g}"
    if passed:
        print(f"PASS: patched and unpatched DDP training agree over {args.steps} steps ({tol})")
        return 0
    print(f"FAIL: patched and unpatched DDP training disagree ({tol})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
