"""Developer probe (GPU): launch rules of the RMSNorm Triton kernels (fusedops/triton/rmsnorm.py)
against torch eager and torch.compile(dynamic=False) in the same process (do_bench medians,
M·N = 2^27, fresh random data, weight in x's dtype). Forward variants set FWD_RULES
((ROWS, warps, persistent) per padded row) or force the looped kernel; backward variants move
FUSED_BWD_MAX_BLOCK. Prints one line per point; writes every measurement to $OUT/rms_tune.json.

    PYTHONPATH=$PWD python benchmarks/dev/rms_tune.py [r1] [r2] [r3] [r4] [r5]   # rounds (default r1)
"""

import contextlib
import json
import os

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from fusedops.triton import _common
from fusedops.triton import rmsnorm as trms

NAME = torch.cuda.get_device_properties(0).name
TOTAL = 1 << 27
print(NAME, torch.__version__, triton.__version__, flush=True)


def bench(fn):
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


src = torch.empty(TOTAL * 2, dtype=torch.float32, device="cuda")
dst = torch.empty_like(src)
COPY = 2 * src.numel() * 4 / bench(lambda: dst.copy_(src)) / 1e9
del src, dst
print(f"copy {COPY:.3f} TB/s", flush=True)


@contextlib.contextmanager
def setting(**values):
    old = {k: getattr(trms, k) for k in values}
    for k, v in values.items():
        setattr(trms, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(trms, k, v)


@contextlib.contextmanager
def limit(n):
    _common.set_single_block_limit(n)
    try:
        yield
    finally:
        _common.set_single_block_limit(None)


records = []


def point(op, dt, N, variants):
    M = TOTAL // N
    x = torch.randn(M, N, device="cuda", dtype=dt)
    w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dt)
    elt = x.element_size()
    if op == "fwd":
        nbytes = 2 * M * N * elt

        def ours():
            return trms.rmsnorm_forward(x, w, 1e-6, dt)[0]

        def eager():
            return F.rms_norm(x, (N,), w, 1e-6)
    else:
        nbytes = 3 * M * N * elt
        dy = torch.randn_like(x)
        _, rstd = trms.rmsnorm_forward(x, w, 1e-6, dt)

        def ours():
            return trms.rmsnorm_backward(dy, x, w, rstd, True, True)

        xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()

        def eager():
            return torch.autograd.grad(F.rms_norm(xr, (N,), wr, 1e-6), (xr, wr), dy)
    torch._dynamo.reset()
    if op == "fwd":
        comp = torch.compile(lambda: F.rms_norm(x, (N,), w, 1e-6), dynamic=False)
    else:
        fn = torch.compile(lambda a, b: F.rms_norm(a, (N,), b, 1e-6), dynamic=False)

        def comp():
            return torch.autograd.grad(fn(xr, wr), (xr, wr), dy)
    comp()
    base = {"eager": nbytes / bench(eager) / 1e9, "compile": nbytes / bench(comp) / 1e9}
    ref = eager()
    res = {}
    for name, ctx in [("cur", contextlib.nullcontext)] + variants:
        try:
            with ctx():
                out = ours()
                a = out if op == "fwd" else out[0]
                b = ref if op == "fwd" else ref[0]
                err = ((a.float() - b.float()).abs().max() / (1 + b.float().abs().max())).item()
                res[name] = (nbytes / bench(ours) / 1e9, err)
        except Exception as exc:  # noqa: BLE001
            res[name] = (0.0, f"{type(exc).__name__}: {str(exc)[:100]}")
    for k, (tb, err) in res.items():
        records.append(dict(op=op, dtype=str(dt)[6:], N=N, variant=k, tbps=tb,
                            frac_copy=tb / COPY, err=err, **{f"{p}_tbps": v
                                                              for p, v in base.items()}))
    best = max(res, key=lambda k: res[k][0])
    bad = [k for k, v in res.items() if isinstance(v[1], str) or v[1] > 0.05]
    print(f"{op} {str(dt)[6:]:8s} N={N:6d} eager {base['eager']:.2f} compile "
          f"{base['compile']:.2f} | " + " ".join(f"{k}={v[0]:.2f}" for k, v in res.items())
          + f" | best {best} ({res[best][0] / COPY:.2f})" + (f" ERR {bad}" if bad else ""),
          flush=True)


def fwd_rule(elt, block, rows, warps, persistent):
    return (f"r{rows}w{warps}{'p' if persistent else ''}",
            lambda: setting(FWD_RULES={(elt, block): (rows, warps, persistent)}))


def looped(chunk, warps):
    return (f"loop{chunk // 1024}Kw{warps}", lambda: _looped(chunk, warps))


@contextlib.contextmanager
def _looped(chunk, warps):
    with setting(_looped_config=lambda: (chunk, warps)), limit(chunk):
        yield


import sys  # noqa: E402

ROUNDS = sys.argv[1:] or ["r1"]

for dt in (torch.bfloat16, torch.float32):
    if "r2" not in ROUNDS:  # round 2: the sweep's misses at 8193 / 16K / 65537
        break
    e = 2 if dt == torch.bfloat16 else 4
    point("fwd", dt, 16384, [fwd_rule(e, 16384, r, w, p) for r, w, p in (
        (1, 8, False), (1, 16, False), (1, 32, False), (1, 16, True), (2, 16, False))])
    point("fwd", dt, 8193, [fwd_rule(e, 16384, r, w, p) for r, w, p in (
        (1, 8, False), (1, 16, False), (1, 32, False))])
    for N in (8193, 65537):
        point("bwd", dt, N, [("fusedmax8K", lambda: setting(FUSED_BWD_MAX_BLOCK=8192))])

for dt in (torch.bfloat16, torch.float32):
    if "r3" not in ROUNDS:  # round 3: the unaligned backward at 8193 (behind torch eager)
        break
    variants = [(f"fused16Kw{w}", lambda w=w: setting(
        FUSED_BWD_MAX_BLOCK_UNALIGNED=16384, _bwd_config=lambda b, e, a=True, w=w: (1, w, 1, True)))
        for w in (8, 16, 32)]
    variants += [(f"loop{c // 1024}Kw{w}", lambda c=c, w=w: setting(
        _looped_config=lambda c=c, w=w: (c, w))) for c, w in ((4096, 8), (2048, 4), (8192, 8))]
    variants += [(f"col{t[0]}x{t[1]}s{k}", lambda t=t, k=k: setting(COLUMN_TILE=t,
                                                                     COLUMN_PER_SM=k))
                 for t, k in (((64, 64), 2), ((128, 64), 4), ((256, 32), 2))]
    point("bwd", dt, 8193, variants)

for dt in (torch.bfloat16, torch.float32):
    if "r4" not in ROUNDS:  # round 4: 32 warps for the fused backward's 16K rows
        break
    for N in (16384, 8193):
        point("bwd", dt, N, [(f"fused16Kw{w}", lambda w=w: setting(
            FUSED_BWD_MAX_BLOCK_UNALIGNED=16384, _bwd_config=lambda b, e, a=True, w=w: (1, w, 1, True)))
            for w in (16, 32)])

def bwd_cfg(cfg):
    rows, warps, per_sm, acc_1d = cfg
    return (f"r{rows}w{warps}s{per_sm}{'a' if acc_1d else ''}",
            lambda: setting(_bwd_config=lambda b, e, a=True: cfg))


for dt in (torch.bfloat16, torch.float16):
    if "r5" not in ROUNDS:  # round 5: the 16-bit fused backward's tiles at 1K-8K
        break
    point("bwd", dt, 1024, [bwd_cfg(c) for c in (
        (2, 4, 4, False), (4, 4, 4, False), (8, 8, 2, False), (4, 8, 2, True), (2, 8, 2, True),
        (8, 16, 1, False))])
    point("bwd", dt, 2048, [bwd_cfg(c) for c in (
        (1, 4, 4, True), (2, 4, 4, True), (4, 16, 1, True), (1, 8, 2, True), (4, 8, 2, True))])
    point("bwd", dt, 8192, [bwd_cfg(c) for c in (
        (1, 8, 2, True), (1, 16, 1, True), (2, 16, 2, True), (1, 4, 4, True), (2, 32, 1, True))])

for dt in (torch.bfloat16, torch.float32):
    if "r1" not in ROUNDS:
        break
    e = 2 if dt == torch.bfloat16 else 4
    point("fwd", dt, 1024, [fwd_rule(e, 1024, r, w, p) for r, w, p in (
        (4, 4, False), (8, 4, False), (8, 8, False), (16, 8, False), (4, 2, False),
        (8, 4, True), (16, 16, True))])
    point("fwd", dt, 4096, [fwd_rule(e, 4096, r, w, p) for r, w, p in (
        (1, 4, False), (2, 4, False), (2, 8, False), (4, 8, False), (1, 8, False),
        (2, 8, True), (4, 16, True))])
    point("fwd", dt, 8192, [fwd_rule(e, 8192, r, w, p) for r, w, p in (
        (1, 4, False), (1, 8, False), (1, 16, False), (2, 8, False), (2, 16, False),
        (1, 8, True), (2, 16, True))])
    point("fwd", dt, 32768, [fwd_rule(e, 32768, r, w, p) for r, w, p in (
        (1, 8, False), (1, 16, False), (1, 32, False), (1, 16, True), (1, 32, True))]
        + [looped(c, w) for c, w in ((8192, 16), (4096, 8), (16384, 16))])
    for N in (16384, 32768):
        point("bwd", dt, N, [(f"fusedmax{m // 1024}K", lambda m=m: setting(
            FUSED_BWD_MAX_BLOCK=m)) for m in (16384, 32768) if m >= N])

out = os.environ.get("OUT")
if out:
    with open(os.path.join(out, "rms_tune.json"), "w") as f:
        json.dump({"device": NAME, "torch": torch.__version__, "triton": triton.__version__,
                   "copy_tbps": COPY, "records": records}, f, indent=1)
