"""Developer probe (GPU): launch-strategy variants at the shapes where fusedops lost to a
baseline in the committed sweep. Every point times fusedops variants next to torch eager in the
same run (do_bench medians, M·N = 2^27, fresh random data). Prints one line per point with the
best variant; writes every measurement to $OUT/tune.json.

Knobs are module globals / functions in fusedops.triton.{softmax,layernorm,_common}; each
variant sets them, runs, and restores them."""

import contextlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from fusedops.triton import _common
from fusedops.triton import layernorm as tln
from fusedops.triton import softmax as tsm

SMOKE = not torch.cuda.is_available()  # CPU smoke run of the script itself (interpreter)
dev = "cpu" if SMOKE else "cuda"
TOTAL = 1 << 13 if SMOKE else 1 << 27
torch.manual_seed(0)
NAME = "cpu-smoke" if SMOKE else torch.cuda.get_device_properties(0).name
print(NAME, torch.__version__, triton.__version__, flush=True)


def bench(fn):
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


src = torch.empty(TOTAL * 2, dtype=torch.float32, device=dev)
dst = torch.empty_like(src)
COPY = 2 * src.numel() * 4 / bench(lambda: dst.copy_(src)) / 1e9
print(f"copy {COPY:.3f} TB/s", flush=True)
del src, dst


@contextlib.contextmanager
def knobs(mod, **values):
    old = {k: getattr(mod, k) for k in values}
    for k, v in values.items():
        setattr(mod, k, v)
    _common.set_single_block_limit(_common.single_block_limit())  # clears config caches
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(mod, k, v)
        _common.set_single_block_limit(_common.single_block_limit())


@contextlib.contextmanager
def caps(**values):
    old = dict(_common.KIND_CAPS)
    _common.KIND_CAPS.update(values)
    _common.set_single_block_limit(_common.single_block_limit())
    try:
        yield
    finally:
        _common.KIND_CAPS.clear()
        _common.KIND_CAPS.update(old)
        _common.set_single_block_limit(_common.single_block_limit())


records = []
summary = []


def run_point(op, dt, N, variants, eager, nbytes, check):
    res = {}
    for name, ctx, fn in variants:
        try:
            with ctx():
                err = check(fn())
                ms = bench(fn)
            res[name] = (nbytes / ms / 1e9, err)
        except Exception as exc:  # noqa: BLE001
            res[name] = (0.0, f"fail {type(exc).__name__}: {str(exc)[:120]}")
    e = nbytes / bench(eager) / 1e9
    for name, (tb, err) in res.items():
        records.append(dict(op=op, dtype=str(dt).split(".")[-1], N=N, variant=name, tbps=tb,
                            frac_copy=tb / COPY, eager_tbps=e, err=err))
    best = max(res, key=lambda k: res[k][0])
    line = (f"{op:7s} {str(dt)[6:]:8s} N={N:6d} eager {e:5.2f} | "
            + " ".join(f"{k}={v[0]:.2f}" for k, v in res.items()) + f" | best {best}")
    bad = [f"{k}:{v[1]}" for k, v in res.items() if isinstance(v[1], str) or v[1] > 0.05]
    if bad:
        line += "  ERR " + " ".join(bad)
    print(line, flush=True)
    summary.append((op, str(dt)[6:], N, e, best, res[best][0]))


def rel_err(ref):
    def f(out):
        return ((out.float() - ref).abs().max() / (1 + ref.abs().max())).item()
    return f


def nullctx():
    return contextlib.nullcontext()


def sm_grid(kind):
    def g(num_tiles, num_warps, device):
        if kind == "full":
            return num_tiles
        per_sm = kind if isinstance(kind, int) else max(1, 2048 // (32 * num_warps))
        return max(1, min(num_tiles, _common.num_sms(device) * per_sm))
    return g


def softmax_fwd_point(dt, N):
    M = max(2, TOTAL // N)
    x = torch.randn(M, N, device=dev, dtype=dt)
    ref = torch.softmax(x.float(), -1)
    block = triton.next_power_of_2(N)
    variants = [("cur", nullctx, lambda: tsm.softmax_forward(x, dt))]
    for tile in (1024, 2048, 4096):
        rows = max(1, tile // block)
        for warps in (4, 8):
            if rows * block // (32 * warps) < 4:
                continue
            for grid in ("occ", "full"):
                cfg = (True, block, rows, warps)
                variants.append((f"t{tile}w{warps}{grid}",
                                 lambda cfg=cfg, grid=grid: knobs(
                                     tsm, row_config=lambda n, k, *_: cfg,
                                     _grid_size=sm_grid(grid)),
                                 lambda: tsm.softmax_forward(x, dt)))
    run_point("sm_fwd", dt, N, variants, lambda: torch.softmax(x, -1),
              2 * M * N * x.element_size(), rel_err(ref))


def ln_fwd_point(dt, N):
    M = max(2, TOTAL // N)
    x = torch.randn(M, N, device=dev, dtype=dt)
    w = torch.randn(N, device=dev, dtype=dt)
    b = torch.randn(N, device=dev, dtype=dt)
    ref = F.layer_norm(x.float(), (N,), w.float(), b.float())

    def fn():
        return tln.layernorm_forward(x, w, b, 1e-5, dt)[0]
    variants = [("cur", nullctx, fn),
                ("nohold", lambda: knobs(tln, FWD_HOLD_W_MAX_BLOCK=1024), fn)]
    if N >= 16384:
        variants.append(("cap16K", lambda: caps(ln_fwd=16384), fn))

        @contextlib.contextmanager
        def nosplit():
            with caps(ln_fwd=16384):
                _common._split_state["enabled"] = False
                try:
                    yield
                finally:
                    _common._split_state["enabled"] = True
        variants.append(("looped", nosplit, fn))
        for warps in (16, 32):
            blk = triton.next_power_of_2(N)
            if blk <= 32768:
                cfg = (True, blk, 1, warps)
                variants.append((f"w{warps}nohold", lambda cfg=cfg: knobs(
                    tln, row_config=lambda n, k, *_: cfg, FWD_HOLD_W_MAX_BLOCK=1024), fn))
    run_point("ln_fwd", dt, N, variants, lambda: F.layer_norm(x, (N,), w, b),
              2 * M * N * x.element_size(), rel_err(ref))


def ln_bwd_point(dt, N):
    M = max(2, TOTAL // N)
    x = torch.randn(M, N, device=dev, dtype=dt)
    w = torch.randn(N, device=dev, dtype=dt)
    b = torch.randn(N, device=dev, dtype=dt)
    dy = torch.randn_like(x)
    _, mean, rstd = tln.layernorm_forward(x, w, b, 1e-5, dt)
    xr = x.detach().requires_grad_()
    wr = w.detach().requires_grad_()
    br = b.detach().requires_grad_()
    yr = F.layer_norm(xr, (N,), wr, br)
    ref = torch.autograd.grad(yr, (xr, wr, br), dy, retain_graph=True)
    ref_dx = ref[0].float()
    ref_dw = ref[1].float()

    def check(out):
        dx, dw, _ = out
        return max(rel_err(ref_dx)(dx), rel_err(ref_dw)(dw))

    def fn():
        return tln.layernorm_backward(dy, x, w, mean, rstd, True, True, True)
    variants = [("cur", nullctx, fn),
                ("columns", lambda: knobs(tln, FUSED_BWD_MAX_BLOCK=0), fn)]
    for tile in (4096, 8192) if triton.next_power_of_2(N) <= 8192 else ():
        for per_sm in (1, 2, 4) if N <= 1024 else (1, 2):
            for acc in ((True, False) if N <= 1024 else (True,)):
                if tile < triton.next_power_of_2(N):
                    continue
                variants.append((f"f{tile // 1024}K/{per_sm}{'' if acc else '2d'}",
                                 lambda tile=tile, per_sm=per_sm, acc=acc: knobs(
                                     tln, FUSED_BWD_MAX_BLOCK=8192, FUSED_BWD_TILE=tile,
                                     FUSED_BWD_PROGS_PER_SM=per_sm, FUSED_BWD_ACC_1D=acc), fn))
    run_point("ln_bwd", dt, N, variants,
              lambda: torch.autograd.grad(yr, (xr, wr, br), dy, retain_graph=True),
              3 * M * N * x.element_size(), check)


t0 = time.time()
which = sys.argv[1:] or ["ln_bwd", "ln_fwd", "sm_fwd"]
bf, f32 = torch.bfloat16, torch.float32
if "ln_bwd" in which:
    for dt in (bf, f32):
        for N in (256, 512, 1024, 2048, 4096, 8192, 8193):
            ln_bwd_point(dt, N)
if "ln_fwd" in which:
    for dt in (bf, f32):
        for N in (8192, 16384, 32768, 65536, 65537, 131072, 262144):
            ln_fwd_point(dt, N)
if "sm_fwd" in which:
    for dt in (f32, bf):
        for N in ((256, 512, 1024) if dt == f32 else (256, 1024, 4096, 8192)):
            softmax_fwd_point(dt, N)
print(f"tune s {time.time() - t0:.0f}", flush=True)
out = os.environ.get("OUT")
if out:
    with open(os.path.join(out, "tune.json"), "w") as f:
        json.dump({"device": NAME, "torch": torch.__version__, "triton": triton.__version__,
                   "copy_tbps": COPY, "records": records}, f, indent=1)
print(f"\nbest per point (TB/s; copy {COPY:.2f})")
for op, dt, N, e, best, tb in summary:
    print(f"{op:7s} {dt:8s} {N:7d} eager {e:5.2f}  best {best:16s} {tb:5.2f} ({tb / COPY:.2f})")
