"""The DTensor op matrix of ``distributed_check.py``: every public fusedops op on DTensors of many
placements against float64 torch on the whole tensors, the errors of mixed arguments, dropout's
masks and checkpointing of the op. Run by every rank (the cases use collectives)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# fp32 against a float64 reference (the test suite's table): outputs 1e-5; gradients summed
# over rows (weight, bias, mask) get 10x, as the suite's row-sum checks.
TOL = {"y": 2e-5, "grad": 1e-4}


def _dtensor(t, mesh, placements, grad: bool):
    """``t`` (the same whole tensor on every rank) as a DTensor; Partial: each rank holds an
    equal share."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if any(p.is_partial() for p in placements):
        if not all(p.is_partial() or p.is_replicate() for p in placements):
            raise ValueError("Partial cases here mix only with Replicate")
        ranks = 1
        for i, p in enumerate(placements):
            ranks *= mesh.size(i) if p.is_partial() else 1
        d = DTensor.from_local(t / ranks, mesh, placements, run_check=False)
    else:
        d = distribute_tensor(t, mesh, placements)
    return d.detach().requires_grad_(grad)


def _expected(x_placements, reduced: set[int], ndim: int) -> tuple:
    """The output placements torch's own ops give: reduced dims and Partial replicated."""
    from torch.distributed.tensor import Replicate

    return tuple(Replicate() if p.is_partial() or p.is_shard() and p.dim % ndim in reduced
                 else p for p in x_placements)


def _grad_expected(compute) -> tuple:
    """A replicated parameter's gradient: Partial where x is sharded."""
    from torch.distributed.tensor import Partial, Replicate

    return tuple(Partial() if p.is_shard() else Replicate() for p in compute)


def run_case(name: str, mesh, fused, ref, inputs: list, reduced: set[int], params=(),
             grad_placements: dict | None = None) -> dict:
    """``inputs``: (whole tensor, placements or None for a plain tensor, requires grad). Runs
    ``fused`` on the DTensors and ``ref`` on float64 copies of the whole tensors; compares the
    outputs and every input's gradient, the output placements and the parameters'
    (``params``: input indices) gradient placements (Partial where x is sharded, or as
    ``grad_placements`` gives them per index)."""
    import fusedops

    dts = [t if pl is None else _dtensor(t, mesh, pl, g) for t, pl, g in inputs]
    with fusedops.count_fused_calls() as counts:
        out = fused(*dts)
        outs = out if isinstance(out, tuple) else (out,)
        g = torch.Generator().manual_seed(7)
        cots = [torch.randn(o.shape, generator=g).to(o.device) for o in outs]
        loss = sum((o.full_tensor() * c).sum() for o, c in zip(outs, cots, strict=True))
        loss.backward()
    refs = [(t.detach().double() if t.is_floating_point() else t).requires_grad_(gr)
            for t, _, gr in inputs]
    rout = ref(*refs)
    routs = rout if isinstance(rout, tuple) else (rout,)
    sum((o * c.double()).sum() for o, c in zip(routs, cots, strict=True)).backward()
    x = dts[0]
    expected = _expected(x.placements, reduced, x.dim())
    diff_y = max((o.full_tensor().double() - r).abs().max().item()
                 for o, r in zip(outs, routs, strict=True))
    diff_g, problems = 0.0, []
    for i, (d, r) in enumerate(zip(dts, refs, strict=True)):
        if r.grad is None:
            continue
        d_grad = d.grad.full_tensor().double()
        scale = (r.grad.abs().max().item() + 1.0)
        diff_g = max(diff_g, (d_grad - r.grad).abs().max().item() / scale)
        want = (grad_placements or {}).get(i) or _grad_expected(expected)
        if i in params and tuple(d.grad.placements) != tuple(want):
            problems.append(f"input {i} grad placements {d.grad.placements}")
    for o in outs:
        if tuple(o.placements) != expected:
            problems.append(f"output placements {o.placements}, expected {expected}")
    if diff_y > TOL["y"] or diff_g > TOL["grad"]:
        problems.append(f"values off: y {diff_y:.3g}, grads {diff_g:.3g}")
    return {"case": name, "passed": not problems, "max_diff_y": diff_y,
            "max_rel_diff_grad": diff_g, "fused_calls": dict(counts), "problems": problems}


def _cases(ctx) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard

    import fusedops

    dev = ctx.device
    mesh = init_device_mesh(dev.type, (ctx.world,))
    mesh2 = init_device_mesh(dev.type, (ctx.world, 1), mesh_dim_names=("a", "b"))
    g = torch.Generator().manual_seed(3)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dev)

    x3, w, b = rnd(4, 5, 32), rnd(32) + 1.0, rnd(32)
    r3 = rnd(4, 5, 32)
    s4 = rnd(2, 4, 6, 8)
    fmask = rnd(1, 1, 6, 8) * 0.5
    bmask = torch.rand(2, 1, 6, 8, generator=g).to(dev) > 0.3
    bmask[..., 0] = True  # no row without a kept element (torch gives NaN there, fusedops 0)
    R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)

    def ln(x, w_, b_):
        return fusedops.fused_layernorm(x, (32,), w_, b_)

    def ln_ref(x, w_, b_):
        return F.layer_norm(x, (32,), w_, b_)

    def rms(x, w_):
        return fusedops.fused_rmsnorm(x, 32, w_, 1e-6)

    def rms_ref(x, w_):
        return F.rms_norm(x, (32,), w_, 1e-6)

    def epi(x, r, w_, b_):
        return fusedops.fused_layernorm(x, 32, w_, b_, residual=r, activation="gelu")

    def epi_ref(x, r, w_, b_):
        s = x + r
        return F.gelu(F.layer_norm(s, (32,), w_, b_)), s

    def msm(x, m):
        return fusedops.fused_softmax(x, -1, scale=0.5, mask=m)

    def msm_ref(x, m):
        return torch.softmax(x * 0.5 + m, -1)

    def bsm(x, m):
        return fusedops.fused_softmax(x, -1, mask=m, causal=True)

    def bsm_ref(x, m):
        causal = torch.ones(6, 8, dtype=torch.bool, device=x.device).tril()
        return torch.softmax(x.masked_fill(~(m & causal), float("-inf")), -1)

    last = {2}
    out = []
    for pl in ([S0], [S1], [S2], [R], [Partial()]):  # batch, sequence, normalised, ...
        name = "/".join(map(str, pl))
        out.append(run_case(f"layernorm x={name}", mesh, ln, ln_ref,
                            [(x3, pl, True), (w, [R], True), (b, [R], True)], last, (1, 2)))
        out.append(run_case(f"rmsnorm x={name}", mesh, rms, rms_ref,
                            [(x3, pl, True), (w, [R], True)], last, (1,)))
    x1 = rnd(1, 5, 32)  # Shard(0) of one row: the second rank's shard is empty
    out.append(run_case("layernorm x=Shard(0), an empty shard", mesh, ln, ln_ref,
                        [(x1, [S0], True), (w, [R], True), (b, [R], True)], last, (1, 2)))
    for pl in ([S0, R], [R, S1], [S1, R]):
        out.append(run_case(f"rmsnorm 2-D mesh x={pl}", mesh2, rms, rms_ref,
                            [(x3, pl, True), (w, [R, R], True)], last, (1,)))
    out.append(run_case("layernorm weight Shard(0)", mesh, ln, ln_ref,
                        [(x3, [S1], True), (w, [S0], True), (b, [R], True)], last, (2,)))
    for pl in ([S1], [S2]):
        out.append(run_case(f"add+layernorm+gelu x={pl}", mesh, epi, epi_ref,
                            [(x3, pl, True), (r3, pl, True), (w, [R], True), (b, [R], True)],
                            last, (2, 3)))
    out.append(run_case("add+layernorm residual other placement", mesh, epi, epi_ref,
                        [(x3, [S1], True), (r3, [R], True), (w, [R], True), (b, [R], True)],
                        last, (2, 3)))
    for pl, dim in (([S0], -1), ([Shard(3)], -1), ([S1], 1), ([Partial()], -1)):
        out.append(run_case(f"softmax dim={dim} x={pl}", mesh,
                            lambda x, d=dim: fusedops.fused_softmax(x, d),
                            lambda x, d=dim: torch.softmax(x, d),
                            [(s4, pl, True)], {dim % 4}))
    for pl in ([S1], [S2]):  # heads; query rows (scale + float mask, no triangle: stays local)
        # The mask broadcasts over heads (its gradient: each rank's partial sum); along the
        # query rows it is sharded like x for the op, its gradient gathered back to Replicate.
        out.append(run_case(f"softmax scale+float mask x={pl}", mesh, msm, msm_ref,
                            [(s4, pl, True), (fmask, [R], True)], {3}, (1,),
                            {1: [R]} if pl == [S2] else None))
    for pl in ([S0], [S2]):  # batch; query rows (causal needs them whole)
        out.append(run_case(f"softmax causal+bool mask x={pl}", mesh, bsm, bsm_ref,
                            [(s4, pl, True), (bmask, [R], False)], {2, 3}))
    return out


def _raises(fn, name: str) -> bool:
    try:
        fn()
    except (TypeError, ValueError) as exc:
        return name in str(exc)
    return False


def _errors(ctx) -> dict:
    """Mixed DTensor / plain arguments raise, naming the argument, on every path."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import fusedops

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    x, w = torch.randn(4, 6, 16, device=ctx.device), torch.randn(16, device=ctx.device)
    m = torch.zeros(1, 1, 6, 16, device=ctx.device)
    dx, dw = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(w, mesh, [Replicate()])
    dm = distribute_tensor(m, mesh, [Replicate()])
    x4, dx4 = x.view(1, 4, 6, 16), dx.view(1, 4, 6, 16)
    cases = {
        "DTensor x, plain weight": lambda: fusedops.fused_layernorm(dx, 16, w),
        "plain x, DTensor weight": lambda: fusedops.fused_layernorm(x, 16, dw),
        "plain x, DTensor weight (rmsnorm)": lambda: fusedops.fused_rmsnorm(x, 16, dw),
        "DTensor x, plain weight (rmsnorm)": lambda: fusedops.fused_rmsnorm(dx, 16, w),
        "DTensor x, plain mask": lambda: fusedops.fused_softmax(dx4, mask=m),
        "plain x, DTensor mask": lambda: fusedops.fused_softmax(x4, mask=dm),
        "DTensor x, plain residual": lambda: fusedops.fused_layernorm(dx, 16, residual=x),
        "plain x, DTensor residual": lambda: fusedops.fused_layernorm(x, 16, residual=dx),
    }
    names = {k: k.split()[-1] if "(" not in k else k.split()[-2] for k in cases}
    results = {}
    for backend in ("triton", None):  # the kernels' path, then the size rule (native ops)
        with fusedops.use_backend(backend):
            with torch.no_grad():  # plain calls of these signatures first: replays exist
                for _ in range(2):
                    fusedops.fused_layernorm(x, 16, w)
                    fusedops.fused_rmsnorm(x, 16, w)
                    fusedops.fused_layernorm(x, 16, residual=x)
                    fusedops.fused_softmax(x4, mask=m)
            for label, fn in cases.items():
                ok = _raises(fn, names[label])
                with torch.no_grad():  # inference paths (a replayed call included)
                    ok = ok and _raises(fn, names[label]) and _raises(fn, names[label])
                results[f"{label} [{backend or 'auto'}]"] = ok
    return results


def _gather_equal(t: torch.Tensor) -> list[bool]:
    import torch.distributed as dist

    t = t.to(torch.uint8) if t.dtype == torch.bool else t.contiguous()  # (NCCL: no bool)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return [torch.equal(parts[0], p) for p in parts[1:]]


def _dropout(ctx) -> dict:
    """Dropout on DTensors: replicas draw one mask, shards their own; the keep rate is 1 - p."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import fusedops

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    half = torch.randn(8, 64, generator=torch.Generator().manual_seed(5)).to(ctx.device)
    x = torch.cat([half] * ctx.world)  # every shard of Shard(0) holds the same values
    torch.manual_seed(11)
    yr = fusedops.fused_layernorm(distribute_tensor(x, mesh, [Replicate()]), 64, dropout_p=0.5)
    ys = fusedops.fused_layernorm(distribute_tensor(x, mesh, [Shard(0)]), 64, dropout_p=0.5)
    kept = (yr.to_local() != 0).float().mean().item()
    shards_alike = _gather_equal(ys.to_local() != 0)
    return {"replicas_alike": all(_gather_equal(yr.to_local())),
            "shards_independent": not any(shards_alike), "keep_rate": kept,
            "passed": all(_gather_equal(yr.to_local())) and not any(shards_alike)
            and 0.4 < kept < 0.6}


def checkpoint_op(ctx) -> dict:
    """``torch.utils.checkpoint`` (non-reentrant) around the fused add + LayerNorm + dropout,
    plain and DTensor: the recomputed masks are the forward's, the gradients bitwise equal."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.utils.checkpoint import checkpoint

    import fusedops

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    g = torch.Generator().manual_seed(9)
    x, r = (torch.randn(6, 5, 32, generator=g).to(ctx.device) for _ in range(2))
    w = torch.randn(32, generator=g).to(ctx.device)

    def f(x_, r_, w_):
        y, s = fusedops.fused_layernorm(x_, 32, w_, residual=r_, dropout_p=0.3,
                                        activation="relu")
        return (y * y).sum() + s.sum()

    results = {}
    for kind in ("plain", "dtensor"):
        grads = []
        for ckpt in (False, True):
            if kind == "plain":
                ins = [t.clone().requires_grad_() for t in (x, r, w)]
            else:
                ins = [distribute_tensor(t, mesh, pl).requires_grad_()
                       for t, pl in ((x, [Shard(1)]), (r, [Shard(1)]), (w, [Replicate()]))]
            torch.manual_seed(4)
            with fusedops.use_backend("triton" if ctx.args.fused_backend == "triton" else None):
                loss = checkpoint(f, *ins, use_reentrant=False) if ckpt else f(*ins)
                if kind == "dtensor":
                    loss = loss.full_tensor()
                loss.backward()
            grads.append([t.grad.full_tensor() if kind == "dtensor" else t.grad for t in ins])
        results[kind] = all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    return {"passed": all(results.values()), **results}


def _sequence_parallel_layernorm(ctx) -> dict:
    """nn.LayerNorm (with bias) under ``SequenceParallel``, patched against unpatched: the
    output and its placements, the input's and the parameters' gradients (these Partial in
    both, reduced for the comparison)."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    import fusedops

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    g = torch.Generator().manual_seed(13)
    x_local = torch.randn(2, 3, 32, generator=g)[None].repeat(ctx.world, 1, 1, 1)
    x_local = x_local[ctx.rank].to(ctx.device) * (ctx.rank + 1)  # each rank's own rows
    runs = []
    for patched in (False, True):
        torch.manual_seed(0)
        ln = nn.LayerNorm(32).to(ctx.device)
        with torch.no_grad():
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.uniform_(-0.5, 0.5)
        if patched:
            fusedops.patch_model(ln, force=True)
        parallelize_module(ln, mesh, SequenceParallel())
        x = x_local.clone().requires_grad_()
        with fusedops.use_backend("triton" if ctx.args.fused_backend == "triton" else None), \
                fusedops.count_fused_calls() as counts:
            y = ln(x)
            (y.to_local() ** 2).sum().backward()
        runs.append((y.full_tensor(), x.grad, ln.weight.grad.full_tensor(),
                     ln.bias.grad.full_tensor(), tuple(y.placements), dict(counts)))
    (y0, dx0, dw0, db0, pl0, _), (y1, dx1, dw1, db1, pl1, calls) = runs
    diff = max((a - b).abs().max().item()
               for a, b in ((y0, y1), (dx0, dx1), (dw0, dw1), (db0, db1)))
    passed = diff < 1e-4 and pl0 == pl1 and (ctx.args.fused_backend != "triton"
                                             or calls.get("layernorm_backward", 0) > 0)
    return {"passed": passed, "max_diff": diff, "placements": str(pl1), "fused_calls": calls}


def check_dtensor(ctx) -> dict:
    import fusedops

    forced = "triton" if ctx.args.fused_backend == "triton" else None
    with fusedops.use_backend(forced):
        cases = _cases(ctx)
        dropout = _dropout(ctx)
    errors = _errors(ctx)
    ckpt = checkpoint_op(ctx)
    sp = _sequence_parallel_layernorm(ctx)
    if forced:  # every case ran the kernels (not PyTorch's ops)
        for c in cases:
            if not c["fused_calls"]:
                c["passed"] = False
                c["problems"].append("no fused kernel call")
    passed = all(c["passed"] for c in cases) and all(errors.values()) and dropout["passed"] \
        and ckpt["passed"] and sp["passed"]
    return {"passed": passed, "cases": len(cases), "cases_passed": sum(c["passed"] for c in cases),
            "case_results": cases, "mixed_argument_errors": errors, "dropout": dropout,
            "op_checkpoint": ckpt, "sequence_parallel_layernorm": sp,
            "max_diff_y": max(c["max_diff_y"] for c in cases),
            "max_rel_diff_grad": max(c["max_rel_diff_grad"] for c in cases)}
