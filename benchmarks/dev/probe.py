"""Developer probe (GPU): correctness spot-check, copy bandwidth, fusedops vs eager TB/s, and a
small config sweep of the single-block kernels. Prints a table; writes JSON to $OUT if set."""

import itertools
import json
import os
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

import fusedops
from fusedops.triton import layernorm as tln
from fusedops.triton import softmax as tsm

dev = "cuda"
props = torch.cuda.get_device_properties(0)
print(props.name, torch.__version__, triton.__version__, flush=True)
TOTAL = 1 << 27


def bench(fn):
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


src = torch.empty(TOTAL * 2, dtype=torch.float32, device=dev)
dst = torch.empty_like(src)
ms = bench(lambda: dst.copy_(src))
copy = 2 * src.numel() * 4 / ms / 1e9
print(f"copy {copy:.2f} TB/s", flush=True)
del src, dst

# correctness spot check on odd shapes (compiled kernels)
errs = []
for N in [1, 33, 1000, 1025, 4097, 65536, 65537, 200000]:
    for dt in [torch.float32, torch.bfloat16]:
        x = torch.randn(6, N, device=dev, dtype=dt, requires_grad=True)
        w = torch.randn(N, device=dev, requires_grad=True)
        b = torch.randn(N, device=dev, requires_grad=True)
        g = torch.randn(6, N, device=dev, dtype=dt)
        y = fusedops.fused_softmax(x)
        r = torch.softmax(x.double(), -1)
        e1 = (y.double() - r).abs().max().item()
        dx, = torch.autograd.grad(y, x, g)
        dr, = torch.autograd.grad(r, x, g.double())
        e2 = (dx.double() - dr).abs().max().item()
        y = fusedops.fused_layernorm(x, N, w, b)
        r = F.layer_norm(x.double(), (N,), w.double(), b.double())
        e3 = (y.double() - r).abs().max().item()
        gs = torch.autograd.grad(y, (x, w, b), g)
        rs = torch.autograd.grad(r, (x, w, b), g.double())
        e4 = max((a.double() - c).abs().max().item() / (1 + c.abs().max().item()) for a, c in zip(gs, rs, strict=True))
        errs.append((N, str(dt), e1, e2, e3, e4))
        print("err", N, dt, f"{e1:.1e} {e2:.1e} {e3:.1e} {e4:.1e}", flush=True)

rows_out = []


def point(op, dt, N, variant=None):
    M = TOTAL // N
    elt = torch.tensor([], dtype=dt).element_size()
    x = torch.randn(M, N, device=dev, dtype=dt)
    res = {}
    if op == "sm_fwd":
        res["fused"] = bench(lambda: tsm.softmax_forward(x, dt))
        res["eager"] = bench(lambda: torch.softmax(x, -1))
        nbytes = 2 * M * N * elt
    elif op == "sm_bwd":
        y = torch.softmax(x, -1)
        dy = torch.randn_like(x)
        res["fused"] = bench(lambda: tsm.softmax_backward(y, dy, dt))
        res["eager"] = bench(lambda: torch._softmax_backward_data(dy, y, -1, dt))
        nbytes = 3 * M * N * elt
    elif op == "ln_fwd":
        w = torch.randn(N, device=dev, dtype=dt)
        b = torch.randn(N, device=dev, dtype=dt)
        res["fused"] = bench(lambda: tln.layernorm_forward(x, w, b, 1e-5, dt))
        res["eager"] = bench(lambda: F.layer_norm(x, (N,), w, b))
        nbytes = 2 * M * N * elt
    elif op == "ln_bwd":
        w = torch.randn(N, device=dev, dtype=dt)
        b = torch.randn(N, device=dev, dtype=dt)
        dy = torch.randn_like(x)
        _, mean, rstd = tln.layernorm_forward(x, w, b, 1e-5, dt)
        res["fused"] = bench(lambda: tln.layernorm_backward(dy, x, w, mean, rstd, True, True, True))
        xr = x.detach().requires_grad_()
        wr = w.detach().requires_grad_()
        br = b.detach().requires_grad_()
        yr = F.layer_norm(xr, (N,), wr, br)
        res["eager"] = bench(lambda: torch.autograd.grad(yr, (xr, wr, br), dy, retain_graph=True))
        nbytes = 3 * M * N * elt
    out = {k: nbytes / v / 1e9 for k, v in res.items()}
    rec = dict(op=op, dtype=str(dt).split(".")[-1], N=N, M=M, variant=variant, copy=copy,
               **{k + "_tbps": v for k, v in out.items()})
    rows_out.append(rec)
    print(f"{op:7s} {rec['dtype']:9s} N={N:7d} {str(variant):22s} fused {out['fused']:.2f} "
          f"({out['fused'] / copy:.2f}) eager {out['eager']:.2f}", flush=True)
    del x
    torch.cuda.empty_cache()


t0 = time.time()
for op, dt, N in itertools.product(["sm_fwd", "sm_bwd", "ln_fwd", "ln_bwd"],
                                   [torch.bfloat16, torch.float32],
                                   [256, 1024, 4096, 16384, 65536, 65537, 262144]):
    point(op, dt, N)
print("sweep s", time.time() - t0, flush=True)

# config exploration: (op, N, cfg) with cfg = (single, block, rows, warps)
orig_sm, orig_ln = tsm.row_config, tln.row_config
explore = []
for N in [256, 1024, 4096, 16384]:
    for tile in [1024, 2048, 4096, 8192]:
        block = triton.next_power_of_2(N)
        rows = max(1, min(64, tile // block))
        for warps in [4, 8, 16]:
            if rows * block // (32 * warps) < 4 or rows * block // (32 * warps) > 64:
                continue
            explore.append(("ln_fwd", N, (True, block, rows, warps)))
            explore.append(("ln_bwd", N, (True, block, rows, warps)))
for N in [32768, 65536]:
    for cfg in [(True, N, 1, 16), (True, N, 1, 32), (False, 8192, 1, 8), (False, 4096, 1, 8),
                (False, 16384, 1, 16)]:
        for op in ["sm_fwd", "sm_bwd", "ln_fwd", "ln_bwd"]:
            explore.append((op, N, cfg))
for op, N, cfg in explore:
    tsm.row_config = lambda n, k, *_, cfg=cfg: cfg
    tln.row_config = lambda n, k, *_, cfg=cfg: cfg
    try:
        point(op, torch.bfloat16, N, variant=str(cfg))
    except Exception as exc:  # noqa
        print("fail", op, N, cfg, str(exc)[:200])
tsm.row_config, tln.row_config = orig_sm, orig_ln

# host latency small shapes


def host_us(fn, calls=2000):
    """Wall time per call of ``fn`` issued back to back (after a warm-up), in microseconds."""
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


for shape in [(4, 128), (64, 768), (8, 128, 768)]:
    x = torch.randn(*shape, device=dev, dtype=torch.float16)
    w = torch.randn(shape[-1], device=dev, dtype=torch.float16)
    x2 = x.reshape(-1, shape[-1])
    y2 = torch.empty_like(x2)
    cases = {
        "torch.softmax": lambda: torch.softmax(x, -1),
        "fused_softmax": lambda: fusedops.fused_softmax(x),
        "F.layer_norm": lambda: F.layer_norm(x, (shape[-1],), w, w),
        "fused_layernorm": lambda: fusedops.fused_layernorm(x, shape[-1], w, w),
        # where the fused host time goes
        "torch.empty": lambda: torch.empty(x2.shape, dtype=x2.dtype, device=x2.device),
        "tsm.softmax_forward": lambda: tsm.softmax_forward(x2, x2.dtype),
        "raw triton launch": lambda: tsm._softmax_fwd_single[(1,)](
            x2, y2, x2.shape[0], x2.shape[1], x2.stride(0), y2.stride(0), 1, 1,
            BLOCK_N=triton.next_power_of_2(x2.shape[1]), ROWS=1, VEC=0, num_warps=4),
        "tln.layernorm_forward": lambda: tln.layernorm_forward(x2, w, w, 1e-5, x2.dtype),
    }
    for name, fn in cases.items():
        print(f"host {shape} {name:22s} {host_us(fn):.1f} us", flush=True)

out = os.environ.get("OUT")
if out:
    json.dump({"device": props.name, "copy": copy, "rows": rows_out, "errs": errs},
              open(os.path.join(out, "probe.json"), "w"), indent=1)
