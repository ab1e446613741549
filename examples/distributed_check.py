"""Check fusedops inside PyTorch's distributed engines, on 2 ranks: DTensor inputs to every op,
FSDP2, tensor/sequence parallelism, torch.compile of an FSDP2 model and activation checkpointing.

    torchrun --nproc-per-node 2 examples/distributed_check.py --device cuda --out dist.json
    python examples/distributed_check.py --device cpu --backend gloo --out dist.json  # spawns 2

On CPU the Triton kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, set here
when unset). Checks (``--checks``, all by default):

* ``dtensor``: each public op (softmax with scale/mask/causal, LayerNorm with residual/
  activation/dropout, RMSNorm) on DTensors of many placements (1-D and 2-D meshes, uneven
  shards, Partial), forward and backward, against float64 torch on the whole tensors: values,
  output placements (as torch's own op gives them), gradient placements; arguments mixing
  DTensors and plain tensors raise naming the argument; dropout's masks (replicas alike,
  shards independent, the keep rate) and its recomputation under checkpointing; a patched
  nn.LayerNorm under SequenceParallel against the unpatched one.
* ``fsdp``: a small Llama-style model (nn.RMSNorm, softmax attention, gated MLP) under
  ``fully_shard`` per block and root (bf16 parameters, fp32 reduction on CUDA), patched and
  unpatched: same losses.
* ``tp``: the same model under ``parallelize_module`` (ColwiseParallel/RowwiseParallel
  linears, SequenceParallel norms: the norms see DTensor Shard(1) inputs), patched and
  unpatched: same losses.
* ``compile``: torch.compile of the FSDP2 patched model (and of the TP one): graph breaks no
  more than the unpatched model's and none from fusedops, fusedops' ops in the compiled graphs,
  losses as the eager unpatched run.
* ``ckpt``: a model whose blocks call the fused LayerNorm + dropout epilogue, under FSDP2 with
  ``checkpoint_wrapper`` on every block against without: the same losses and parameters
  (dropout's mask recomputed alike); ``dtensor`` checks ``torch.utils.checkpoint`` on the op.

Rank 0 writes every number (losses per step, max differences, step times, pass/fail) as JSON to
``--out`` and prints a table last; the exit code is 1 if any check failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
import traceback

if "--device" in sys.argv and "cpu" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import distributed_ops  # noqa: E402

CHECKS = ("dtensor", "fsdp", "tp", "compile", "ckpt")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                   help="torch.distributed backend (default: nccl on cuda, gloo on cpu)")
    p.add_argument("--out", default=None, help="where rank 0 writes the JSON results")
    p.add_argument("--checks", default=",".join(CHECKS),
                   help=f"comma-separated subset of {', '.join(CHECKS)}")
    p.add_argument("--steps", type=int, default=None, help="training steps (cuda 8, cpu 2)")
    p.add_argument("--fused-backend", choices=["triton", "auto"], default="triton",
                   help="triton: every call on the kernels (the size rule off); auto: the "
                        "size rule decides, as in production")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend (default: inductor on cuda, aot_eager on cpu)")
    p.add_argument("--param-dtype", choices=["bfloat16", "float32"], default=None,
                   help="FSDP2's MixedPrecisionPolicy param_dtype (reduce_dtype float32; "
                        "default bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--dim", type=int, default=None, help="model width (cuda 256, cpu 32)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (cuda 128, cpu 8)")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.backend = args.backend or ("nccl" if cuda else "gloo")
    if args.backend == "nccl" and not cuda:
        p.error("--backend nccl needs --device cuda")
    args.checks = [c for c in args.checks.split(",") if c]
    for c in args.checks:
        if c not in CHECKS:
            p.error(f"unknown check {c!r} (choose from {', '.join(CHECKS)})")
    args.steps = args.steps or (8 if cuda else 2)
    args.param_dtype = args.param_dtype or ("bfloat16" if cuda else "float32")
    args.compile_backend = args.compile_backend or ("inductor" if cuda else "aot_eager")
    args.dim = args.dim or (256 if cuda else 32)
    args.seq_len = args.seq_len or (128 if cuda else 8)
    return args


# --- the model: Llama-style, small ---------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        # -1 heads: under tensor parallelism each rank holds its own share of them.
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        causal = torch.full((s, s), float("-inf"), device=q.device).triu(1)
        scores = q @ k.transpose(-1, -2) * self.head_dim**-0.5 + causal
        attn = F.softmax(scores.float(), dim=-1).to(q.dtype)
        return self.wo((attn @ v).transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w3 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.feed_forward = MLP(dim)
        self.dropout = dropout
        if dropout:  # a block built on fusedops: LayerNorm + residual + dropout in one call
            self.out_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        out = self.feed_forward(self.ffn_norm(h))
        if not self.dropout:
            return h + out
        import fusedops

        y, _ = fusedops.fused_layernorm(out, out.shape[-1:], self.out_norm.weight,
                                        self.out_norm.bias, residual=h, dropout_p=self.dropout,
                                        training=self.training)
        return y


class Model(nn.Module):
    def __init__(self, dim: int, vocab: int = 64, layers: int = 2, dropout: float = 0.0):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, 4, dropout) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


# --- training runs -------------------------------------------------------------------------------


class Ctx:
    def __init__(self, args, rank: int, world: int, device: torch.device):
        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.cuda = device.type == "cuda"


def _tokens(ctx: Ctx, step: int, per_rank: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step + (ctx.rank * 7919 if per_rank else 0))
    return torch.randint(0, 64, (4, ctx.args.seq_len), generator=g).to(ctx.device)


def _build(ctx: Ctx, patched: bool, dropout: float = 0.0) -> Model:
    import fusedops

    torch.manual_seed(0)  # the same initial weights on every rank and in every run
    model = Model(ctx.args.dim, dropout=dropout).to(ctx.device)
    if patched:
        report = fusedops.patch_model(model, example_inputs=(_tokens(ctx, 0, False),),
                                      force=True)
        if not report.replaced:
            raise RuntimeError("patch_model replaced nothing")
    return model


def _fsdp(ctx: Ctx, model: Model, mesh, ckpt: bool = False) -> Model:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(param_dtype=getattr(torch, ctx.args.param_dtype),
                                     reduce_dtype=torch.float32)
    for i, layer in enumerate(model.layers):
        if ckpt:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )
            layer = model.layers[i] = checkpoint_wrapper(layer)
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def _tp(model: Model, mesh) -> Model:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for layer in model.layers:
        parallelize_module(layer, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                            desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    return model


def _train(ctx: Ctx, model: nn.Module, per_rank_data: bool, forward=None) -> dict:
    import fusedops

    forward = model if forward is None else forward
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses, times = [], []
    forced = "triton" if ctx.args.fused_backend == "triton" else None
    torch.manual_seed(1)  # dropout's masks: the same sequence in every run
    with fusedops.use_backend(forced), fusedops.count_fused_calls() as counts:
        for step in range(ctx.args.steps):
            tokens = _tokens(ctx, step, per_rank_data)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            logits = forward(tokens)
            if hasattr(logits, "full_tensor"):
                logits = logits.full_tensor()
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1),
                                   tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            if ctx.cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / ctx.world)
    params = []
    for p in model.parameters():
        p = p.detach()
        params.append((p.full_tensor() if hasattr(p, "full_tensor") else p).float().flatten())
    return {"losses": losses, "step_times_s": times, "fused_calls": dict(counts),
            "params": torch.cat(params).cpu()}


def _compare(plain: dict, fused: dict, atol: float, rtol: float) -> dict:
    diffs = [abs(a - b) for a, b in zip(plain["losses"], fused["losses"], strict=True)]
    ok = all(d <= atol + rtol * abs(a) for d, a in zip(diffs, plain["losses"], strict=True))
    ok = ok and all(map(torch.isfinite, map(torch.tensor, fused["losses"])))
    return {"passed": bool(ok), "losses_unpatched": plain["losses"],
            "losses_patched": fused["losses"], "max_loss_diff": max(diffs),
            "max_param_diff": (plain["params"] - fused["params"]).abs().max().item(),
            "step_times_unpatched_s": plain["step_times_s"],
            "step_times_patched_s": fused["step_times_s"], "fused_calls": fused["fused_calls"],
            "tolerance": [atol, rtol]}


def _loss_tol(ctx: Ctx) -> tuple[float, float]:
    # bf16 parameters (CUDA FSDP2) round every matmul input to 8 bits, at other points in the
    # fused and the torch norms: a few bf16 ulps over the steps; fp32 agrees to rounding.
    return (2e-2, 2e-2) if ctx.args.param_dtype == "bfloat16" else (1e-4, 1e-4)


def _need_kernels(ctx: Ctx, result: dict, *ops: str) -> None:
    calls = result["fused_calls"]
    missing = [op for op in ops if not calls.get(op)]
    if missing and ctx.args.fused_backend == "triton":
        result["passed"] = False
        result["problem"] = f"no fused kernel call of {missing}"


def check_fsdp(ctx: Ctx) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    plain = _train(ctx, _fsdp(ctx, _build(ctx, False), mesh), True)
    fused = _train(ctx, _fsdp(ctx, _build(ctx, True), mesh), True)
    result = _compare(plain, fused, *_loss_tol(ctx))
    _need_kernels(ctx, result, "rmsnorm_forward", "rmsnorm_backward")
    return result


def check_tp(ctx: Ctx) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    plain = _train(ctx, _tp(_build(ctx, False), mesh), False)
    fused = _train(ctx, _tp(_build(ctx, True), mesh), False)
    result = _compare(plain, fused, 1e-4, 1e-4)
    _need_kernels(ctx, result, "rmsnorm_forward", "rmsnorm_backward")
    return result


def _compiled(ctx: Ctx, wrap, per_rank: bool) -> dict:
    """Train the unpatched and the patched model, ``wrap``-ped (FSDP2 or TP), compiled: their
    runs, graph breaks and how many captured graphs call fusedops' ops."""
    from torch._dynamo.utils import counters

    out = {"runs": {}, "graph_breaks": {}, "graphs_calling_fusedops": {}}
    for name, patched in (("unpatched", False), ("patched", True)):
        torch._dynamo.reset()
        counters.clear()
        graphs = []

        def backend(gm, example_inputs, graphs=graphs):
            graphs.append("fusedops" in gm.print_readable(print_output=False))
            return torch._dynamo.lookup_backend(ctx.args.compile_backend)(gm, example_inputs)

        model = wrap(_build(ctx, patched))
        out["runs"][name] = _train(ctx, model, per_rank, forward=torch.compile(model,
                                                                               backend=backend))
        out["graph_breaks"][name] = {"count": sum(counters["graph_break"].values()),
                                     "reasons": [str(r) for r in counters["graph_break"]]}
        out["graphs_calling_fusedops"][name] = sum(graphs)
    return out


def _compile_problem(ctx: Ctx, c: dict) -> str | None:
    breaks = c["graph_breaks"]
    from_fusedops = [r for r in breaks["patched"]["reasons"] if "fusedops" in r]
    if breaks["patched"]["count"] > breaks["unpatched"]["count"] or from_fusedops:
        return f"graph breaks from fusedops: {from_fusedops or breaks}"
    if ctx.args.fused_backend == "triton" and not c["graphs_calling_fusedops"]["patched"]:
        return "no compiled graph calls fusedops' kernels"
    return None


def check_compile(ctx: Ctx) -> dict:
    """FSDP2 (the check's numbers) and TP (``tp``), compiled, against the eager unpatched run."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    fsdp = _compiled(ctx, lambda m: _fsdp(ctx, m, mesh), True)
    eager = _train(ctx, _fsdp(ctx, _build(ctx, False), mesh), True)
    result = _compare(eager, fsdp["runs"]["patched"], *_loss_tol(ctx))
    result["graph_breaks"] = fsdp["graph_breaks"]
    result["graphs_calling_fusedops"] = fsdp["graphs_calling_fusedops"]
    # Step times: compiled unpatched against compiled patched (the first step compiles).
    result["step_times_eager_unpatched_s"] = result["step_times_unpatched_s"]
    result["step_times_unpatched_s"] = fsdp["runs"]["unpatched"]["step_times_s"]
    problem = _compile_problem(ctx, fsdp)
    tp = _compiled(ctx, lambda m: _tp(m, mesh), False)
    tp_eager = _train(ctx, _tp(_build(ctx, False), mesh), False)
    result["tp"] = _compare(tp_eager, tp["runs"]["patched"], 1e-4, 1e-4)
    result["tp"].update(graph_breaks=tp["graph_breaks"],
                        graphs_calling_fusedops=tp["graphs_calling_fusedops"])
    problem = problem or _compile_problem(ctx, tp) or (
        None if result["tp"]["passed"] else "TP compiled losses differ")
    if problem:
        result["passed"] = False
        result["problem"] = problem
    return result


def check_ckpt(ctx: Ctx) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    plain = _train(ctx, _fsdp(ctx, _build(ctx, True, dropout=0.2), mesh), True)
    ckpt = _train(ctx, _fsdp(ctx, _build(ctx, True, dropout=0.2), mesh, ckpt=True), True)
    result = _compare(plain, ckpt, 0.0, 0.0)  # the same masks: the same numbers
    result["passed"] = result["passed"] and result["max_param_diff"] == 0.0
    result["note"] = "unpatched = without checkpoint_wrapper, patched = with it"
    if ctx.args.fused_backend == "triton":
        _need_kernels(ctx, result, "layernorm_epilogue_forward", "layernorm_epilogue_backward")
    return result


# --- the ranks -----------------------------------------------------------------------------------


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(1)  # the ranks share the machine
        device = torch.device("cpu")
    dist.init_process_group(args.backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    ctx = Ctx(args, rank, world, device)
    results = {}
    try:
        for name in args.checks:
            t0 = time.perf_counter()
            try:
                fn = distributed_ops.check_dtensor if name == "dtensor" else globals()[
                    f"check_{name}"]
                res = fn(ctx)
            except Exception as exc:  # recorded as a failure; every rank raised alike
                res = {"passed": False, "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()[-4000:]}
            res["wall_s"] = time.perf_counter() - t0
            results[name] = res
            dist.barrier()
        if rank == 0:
            meta = {"device": str(device), "backend": args.backend, "world_size": world,
                    "torch": torch.__version__, "fused_backend": args.fused_backend,
                    "steps": args.steps, "dim": args.dim, "seq_len": args.seq_len,
                    "fsdp_param_dtype": args.param_dtype,
                    "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}
            out = {"meta": meta, "checks": results,
                   "passed": all(r["passed"] for r in results.values())}
            path = args.out or os.path.join(os.getcwd(), "distributed_check.json")
            with open(path + ".tmp", "w") as f:
                json.dump(out, f, indent=1, default=str)
            os.replace(path + ".tmp", path)
            print_table(out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def print_table(out: dict) -> None:
    lines = [f"{'check':<9} {'result':<6} {'max loss diff':>13} {'max param diff':>14} "
             f"{'step s (unp/pat)':>17}  notes"]
    for name, r in out["checks"].items():
        tu, tp = r.get("step_times_unpatched_s"), r.get("step_times_patched_s")
        times = f"{_median(tu):.3f}/{_median(tp):.3f}" if tu and tp else "-"
        note = r.get("error") or r.get("problem") or ""
        if name == "dtensor":
            note = note or f"{r.get('cases_passed')}/{r.get('cases')} cases"
        if name == "compile" and "graph_breaks" in r:
            gb = r["graph_breaks"]
            note = note or (f"graph breaks unpatched {gb['unpatched']['count']}, "
                            f"patched {gb['patched']['count']}; graphs calling fusedops "
                            f"{r['graphs_calling_fusedops']['patched']}")
        lines.append(f"{name:<9} {'PASS' if r['passed'] else 'FAIL':<6} "
                     f"{_num(r.get('max_loss_diff')):>13} {_num(r.get('max_param_diff')):>14} "
                     f"{times:>17}  {note}")
    lines.append(f"{'PASS' if out['passed'] else 'FAIL'}: {out['meta']}")
    print("\n".join(lines), flush=True)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _num(v) -> str:
    return "-" if v is None else f"{v:.3g}"


def _spawned(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "localhost", str(port)
    worker(rank, 2, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out:
        args.out = os.path.abspath(args.out)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        if args.device == "cuda" and torch.cuda.device_count() < 2:
            print("FAIL: --device cuda needs 2 GPUs (or run under torchrun)")
            return 1
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, args=(port, args), nprocs=2, join=True)
    path = args.out or os.path.join(os.getcwd(), "distributed_check.json")
    with open(path) as f:
        return 0 if json.load(f)["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
