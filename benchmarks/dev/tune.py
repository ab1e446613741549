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
    if mod is tln and "UNROLLED_FWD" in values:  # a variant's rule, not a per-GPU replacement
        values.setdefault("UNROLLED_FWD_GPU", {})
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


@contextlib.contextmanager
def split_below(chunk, warps):
    """LayerNorm forward rows above 8K on the split-row kernel with (chunk, warps)."""
    with caps(ln_fwd=8192), knobs(tln, SPLIT_CONFIG=(chunk, warps)):
        yield


@contextlib.contextmanager
def caps_and(chunk, warps):
    with caps(ln_fwd=16384), knobs(tln, SPLIT_CONFIG=(chunk, warps)):
        yield


records = []
summary = []


def run_point(op, dt, N, variants, eager, nbytes, check):
    res = {}
    for name, ctx, fn in variants:
        split_before = _common._split_state["enabled"]
        try:
            with ctx():
                err = check(fn())
                ms = bench(fn)
            res[name] = (nbytes / ms / 1e9, err)
        except Exception as exc:  # noqa: BLE001
            res[name] = (0.0, f"fail {type(exc).__name__}: {str(exc)[:120]}")
        if split_before and not _common._split_state["enabled"]:
            # A refused cooperative launch turns split rows off for the process: flag this
            # variant and turn them back on, so later variants are not silently measured looped.
            res[name] = (res[name][0], "split rows were disabled during this variant")
            _common._split_state["enabled"] = True
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


def case(op, dt, N, parts=(True, True, True)):
    """(fusedops fn, eager fn, bytes moved, check) for one sweep point."""
    M = max(2, TOTAL // N)
    x = torch.randn(M, N, device=dev, dtype=dt)
    elt = x.element_size()
    if op == "sm_fwd":
        ref = torch.softmax(x.float(), -1)
        return (lambda: tsm.softmax_forward(x, dt), lambda: torch.softmax(x, -1),
                2 * M * N * elt, rel_err(ref))
    if op == "sm_bwd":
        y = torch.softmax(x, -1)
        dy = torch.randn_like(x)
        ref = torch._softmax_backward_data(dy.float(), y.float(), -1, torch.float32)
        return (lambda: tsm.softmax_backward(y, dy, dt),
                lambda: torch._softmax_backward_data(dy, y, -1, dt), 3 * M * N * elt,
                rel_err(ref))
    w = torch.randn(N, device=dev, dtype=dt)
    b = torch.randn(N, device=dev, dtype=dt)
    if op in ("ln_fwd", "ln_fwd_y"):  # ln_fwd_y: the inference call (no mean/rstd asked)
        ref = F.layer_norm(x.float(), (N,), w.float(), b.float())
        return ((lambda: tln.layernorm_forward(x, w, b, 1e-5, dt)[0]) if op == "ln_fwd" else
                (lambda: tln.layernorm_forward_y(x, w, b, 1e-5, dt)),
                lambda: F.layer_norm(x, (N,), w, b), 2 * M * N * elt, rel_err(ref))
    dy = torch.randn_like(x)
    _, mean, rstd = tln.layernorm_forward(x, w, b, 1e-5, dt)
    xr = x.detach().requires_grad_()
    wr = w.detach().requires_grad_()
    br = b.detach().requires_grad_()
    yr = F.layer_norm(xr, (N,), wr, br)
    ref = [r.float() for r in torch.autograd.grad(yr, (xr, wr, br), dy, retain_graph=True)]

    def check(out):
        return max(rel_err(r)(o) for o, r in zip(out, ref, strict=True) if o is not None)
    return (lambda: tln.layernorm_backward(dy, x, w, mean, rstd, *parts),
            lambda: torch.autograd.grad(yr, (xr, wr, br), dy, retain_graph=True),
            3 * M * N * elt, check)


def point(op, dt, N, variants, parts=(True, True, True)):
    fn, eager, nbytes, check = case(op, dt, N, parts)
    tag = op if parts == (True, True, True) else op + "".join("xwb"[i] for i in range(3)
                                                              if parts[i])
    run_point(tag, dt, N, [("cur", nullctx, fn)] + [(n, c, fn) for n, c in variants], eager,
              nbytes, check)
    torch.cuda.empty_cache() if not SMOKE else None


def compiled_tbps(op, dt, N):
    """TB/s of torch.compile(dynamic=False) of the eager op on fresh data of one sweep point
    (the sweep's "compile" provider, without autograd around the backward)."""
    if SMOKE:
        return 0.0
    _, eager, nbytes, _ = case(op, dt, N)
    torch._dynamo.reset()
    fn = torch.compile(eager, dynamic=False)
    fn()
    return nbytes / bench(fn) / 1e9


@contextlib.contextmanager
def item(mapping, key, value):
    """mapping[key] = value for the duration of the block."""
    old = mapping[key]
    mapping[key] = value
    _common.set_single_block_limit(_common.single_block_limit())  # config caches and plans
    try:
        yield
    finally:
        mapping[key] = old
        _common.set_single_block_limit(_common.single_block_limit())


def persistent(kind, value):
    return item(_common.PERSISTENT, kind, value)


@contextlib.contextmanager
def nosplit():
    _common._split_state["enabled"] = False
    try:
        yield
    finally:
        _common._split_state["enabled"] = True


@contextlib.contextmanager
def scalar_unaligned():
    """Unaligned rows without the aligned body/edge split (scalar accesses, as before it)."""
    _common._BODY["enabled"] = False
    _common.set_single_block_limit(_common.single_block_limit())
    try:
        yield
    finally:
        _common._BODY["enabled"] = True
        _common.set_single_block_limit(_common.single_block_limit())


@contextlib.contextmanager
def override(kind, **values):
    """Replace row_config's measured rules for ``kind`` (tile, warps, looped=(chunk, warps))."""
    old = _common.OVERRIDES.get(kind)
    _common.OVERRIDES[kind] = values
    _common.set_single_block_limit(_common.single_block_limit())
    try:
        yield
    finally:
        if old is None:
            _common.OVERRIDES.pop(kind, None)
        else:
            _common.OVERRIDES[kind] = old
        _common.set_single_block_limit(_common.single_block_limit())


@contextlib.contextmanager
def looped(kind, chunk, warps):
    """Every row on the looped kernel (no split rows) with (chunk, warps)."""
    with caps(**{kind: 1}), nosplit(), override(kind, looped=(chunk, warps)):
        yield


def tiles_warps(kind, pairs):
    return [(f"t{t}w{w}", lambda t=t, w=w: override(kind, tile=t, warps=w)) for t, w in pairs]


def loops(kind, pairs):
    return [(f"loop{c}w{w}", lambda c=c, w=w: looped(kind, c, w)) for c, w in pairs]


t0 = time.time()
which = sys.argv[1:] or ["ln_fwd_mid", "ln_bwd_mid"]
if "unaligned" in which:  # round 9: aligned body + element-wise edges for N = 2^k + 1
    def warps(kind, *ws):
        return [(f"w{w}", lambda w=w: override(kind, warps=w)) for w in ws]
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for N in (1025, 2049, 4097, 8193, 65537):
            point("sm_fwd", dt, N, [("scalar", scalar_unaligned)] + warps("softmax_fwd", 4, 8, 16))
            point("sm_bwd", dt, N, [("scalar", scalar_unaligned)] + warps("softmax_bwd", 8, 16))
            point("ln_fwd", dt, N, [("scalar", scalar_unaligned)] + warps("ln_fwd", 4, 8, 16))
            point("ln_bwd", dt, N, [("scalar", scalar_unaligned),
                                    ("nonative", lambda: knobs(tln, NATIVE_UNALIGNED_16BIT_BWD=False))])
            point("ln_bwd", dt, N, [("scalar", scalar_unaligned)] + warps("ln_bwd", 4, 8, 16),
                  parts=(True, False, False))
if "r8" in which:  # looped kernels with L2 eviction hints (Inductor's two-pass reductions)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for N in (256, 512, 1024):
            point("ln_fwd", dt, N, [])
    for dt in (torch.bfloat16, torch.float16):
        for N in (256, 512):
            point("sm_fwd", dt, N, [])
        for N in (4096, 16384, 32768):
            point("sm_bwd", dt, N, loops("softmax_bwd", ((2048, 16), (4096, 16), (min(N, 16384), 32))))
    for dt, N in ((torch.bfloat16, 16384), (torch.float16, 16384), (torch.float32, 16384),
                  (torch.float32, 32768), (torch.bfloat16, 32768)):
        point("ln_fwd", dt, N, loops("ln_fwd", ((2048, 16), (4096, 16), (2048, 8), (N, 32))))
fp16 = torch.float16
SHORT = ((1024, 1), (2048, 1), (2048, 2), (4096, 2), (4096, 4))
if "short_rows" in which:  # Inductor: one warp per row (tile of 32 elements per thread)
    for dt in (torch.bfloat16, fp16, torch.float32):
        for N in (256, 512, 1024):
            point("ln_fwd", dt, N, tiles_warps("ln_fwd", SHORT))
    for dt in (torch.bfloat16, fp16):
        for N in (256, 512, 1024):
            point("sm_fwd", dt, N, tiles_warps("softmax_fwd", SHORT))
if "sm_bwd_mid" in which:  # Inductor: 16 warps at 4K (looped 2048), 32 warps at 16K
    for dt in (torch.bfloat16, fp16):
        for N in (2048, 4096, 8192, 16384, 32768):
            point("sm_bwd", dt, N, [
                (f"w{w}", lambda w=w: override("softmax_bwd", warps=w)) for w in (8, 16, 32)]
                + [(f"t{t}w16", lambda t=t: override("softmax_bwd", tile=t, warps=16))
                   for t in (8192, 16384) if t >= N])
if "ln_fwd_loop" in which:  # Inductor: looped 2048 x 16 warps at 16K, 32 warps whole row at 32K
    # (round 10: the looped kernel with per-lane shifted sums instead of Welford updates)
    for dt, N in ((torch.bfloat16, 16384), (fp16, 16384), (torch.float32, 16384),
                  (torch.float32, 32768), (torch.bfloat16, 32768), (fp16, 32768),
                  (torch.bfloat16, 8192), (torch.bfloat16, 65536), (torch.float32, 65536)):
        point("ln_fwd", dt, N, [
            (f"loop{c}w{w}", lambda c=c, w=w: looped("ln_fwd", c, w))
            for c, w in ((2048, 16), (4096, 16), (2048, 8), (1024, 8))]
            + [("w16", lambda: override("ln_fwd", warps=16)),
               ("w32", lambda: override("ln_fwd", warps=32))])
bf, f32 = torch.bfloat16, torch.float32


@contextlib.contextmanager
def stack(*ctxs):
    with contextlib.ExitStack() as es:
        for c in ctxs:
            es.enter_context(c)
        yield


def sm_cfg(kind, cfg):
    return item(tsm.SPLIT_CONFIG, kind, cfg)


@contextlib.contextmanager
def entry(mapping, key, value):
    """mapping[key] = value for the duration of the block (key absent before)."""
    mapping[key] = value
    _common.set_single_block_limit(_common.single_block_limit())
    try:
        yield
    finally:
        mapping.pop(key, None)
        _common.set_single_block_limit(_common.single_block_limit())


if "split_bwd" in which:  # round 20 (tenth session, commit af36350; its REREAD variants (r) were
    # removed after round 22, so this section only runs there)
    sys.exit("section split_bwd ran on commit af36350 (REREAD, removed since)")
    # LayerNorm backward split rows. 16-bit
    # rows of 16K-256K sat at 0.55-0.63 of copy (float32 0.81-0.87): offline ptxas sm_90 gives
    # the shipped 16-bit configs 255 registers (8192 x 8: one 8-warp program per SM, 32 KB of
    # loads in flight, nothing in flight during the wait). REREAD (r): x, dy, w read again after
    # the wait, only the accumulators and a prefetched row live across it (8192 x 8 prefetch 1:
    # 178 registers; 4096 x 8: 124; 8192 x 16: 100). s{piece}w{warps}p{prefetch}[r]
    def sb(cfg):
        name = f"s{cfg[0] // 1024}w{cfg[1]}p{cfg[2]}{'r' if cfg[3:] and cfg[3] else ''}"
        return (name, lambda: knobs(tln, SPLIT_BWD_CONFIG=cfg))
    c16 = ((8192, 8, 1, 1), (8192, 8, 2, 1), (8192, 16, 1, 1), (4096, 8, 1, 1), (4096, 4, 1, 1),
           (2048, 4, 1, 1), (2048, 4, 0, 0), (4096, 8, 2, 0), (8192, 8, 2, 0))
    for dt in (bf, fp16):
        for N in (16384, 32768, 65536, 131072, 262144):
            point("ln_bwd", dt, N, [sb(c) for c in c16])
    c32 = ((2048, 4, 0, 1), (2048, 4, 1, 1), (4096, 8, 1, 1), (4096, 4, 1, 1), (8192, 16, 1, 1),
           (2048, 4, 2, 0))
    for N in (16384, 32768, 65536, 131072, 262144):
        point("ln_bwd", f32, N, [sb(c) for c in c32])
if "pf3" in which:  # round 21 (commit af36350, with REREAD variants: runs only there)
    sys.exit("section pf3 ran on commit af36350 (REREAD, removed since)")
    # PREFETCH 3, the next row's loads issued between the release
    # and the wait. The release is MEMBAR.GPU + RED in SASS, and a membar waits for the thread's
    # outstanding loads: PREFETCH 1's loads (issued before it) are waited for before the
    # release, so nothing is in flight during the wait; 3's are.
    def sbw(cfg):
        name = f"s{cfg[0] // 1024}w{cfg[1]}p{cfg[2]}{'r' if cfg[3:] and cfg[3] else ''}"
        return (name, lambda: knobs(tln, SPLIT_BWD_CONFIG=cfg))

    def sfw(cfg):
        return (f"s{cfg[0] // 1024}w{cfg[1]}p{cfg[2]}", lambda: knobs(tln, SPLIT_CONFIG=cfg))

    def smc(kind, cfg):
        return (f"s{cfg[0] // 1024}w{cfg[1]}p{cfg[2]}", lambda: sm_cfg(kind, cfg))
    for dt, cfgs in ((bf, ((8192, 8, 3, 0), (8192, 8, 3, 1), (4096, 8, 3, 1), (4096, 8, 3, 0),
                           (2048, 4, 3, 0), (8192, 16, 3, 1), (4096, 4, 3, 0))),
                     (f32, ((2048, 4, 3, 0), (2048, 4, 3, 1), (4096, 4, 3, 0), (8192, 8, 3, 0),
                            (4096, 8, 3, 1)))):
        for N in (16384, 32768, 65536, 131072, 262144):
            point("ln_bwd", dt, N, [sbw(c) for c in cfgs])
    for dt in (bf, f32):
        for N in (65536, 65537, 131072, 262144):
            point("sm_fwd", dt, N, [smc("fwd", c) for c in (
                (8192, 8, 3), (16384, 16, 3), (8192, 16, 3), (4096, 4, 3))])
            point("sm_bwd", dt, N, [smc("bwd", c) for c in (
                (8192, 8, 3), (8192, 16, 3), (16384, 16, 3))])
            point("ln_fwd", dt, N, [sfw(c) for c in (
                (8192, 8, 3), (8192, 4, 3), (16384, 16, 3), (4096, 4, 3))])
if "r22" in which:  # round 22: after round 21 and benchmarks/dev/split_anatomy.py (taking the
    # cross-program wait out barely changes the time: the split kernels are bound by their own
    # loads and arithmetic at their occupancy). Softmax forward split now takes one exponential
    # per element ("cur"); the 16-bit LayerNorm backward at 16 elements per thread capped at 128
    # registers (ptxas: 150 -> 128, 16 bytes of spill) for four 4-warp programs per SM (m128).
    @contextlib.contextmanager
    def maxnreg(launcher, regs):
        inner = launcher.launcher
        old = dict(inner.options)
        inner.options["maxnreg"] = regs
        inner.compiled.clear()
        launcher.blocks_per_sm.clear()
        try:
            yield
        finally:
            inner.options.clear()
            inner.options.update(old)
            inner.compiled.clear()
            launcher.blocks_per_sm.clear()

    def sbw(cfg, regs=None):
        name = f"s{cfg[0] // 1024}w{cfg[1]}p{cfg[2]}{'r' if cfg[3:] and cfg[3] else ''}"
        if regs:
            return (name + f"m{regs}", lambda: stack(knobs(tln, SPLIT_BWD_CONFIG=cfg),
                                                     maxnreg(tln._launch_bwd_split, regs)))
        return (name, lambda: knobs(tln, SPLIT_BWD_CONFIG=cfg))
    for N in (16384, 32768, 65536, 131072, 262144):
        point("ln_bwd", bf, N, [sbw((8192, 8, 3)), sbw((2048, 4, 3), 128), sbw((4096, 8, 3), 128),
                                sbw((2048, 4, 1), 128), sbw((4096, 8, 1), 128),
                                sbw((4096, 4, 3), 128)])

    def smc(cfg):
        return (f"s{cfg[0] // 1024}w{cfg[1]}p{cfg[2]}", lambda: sm_cfg("fwd", cfg))
    for dt in (bf, torch.float16, f32):
        for N in (65536, 65537, 131072, 262144):
            v = [smc(c) for c in ((8192, 8, 3), (4096, 4, 3), (8192, 8, 1), (8192, 8, 0))]
            if N == 65536:  # single-block as shipped; the split variants with a lower cap
                v = [(n, lambda c=c: stack(caps(softmax_fwd=32768), c())) for n, c in v]
            point("sm_fwd", dt, N, v)

    def sfw(cfg):
        return (f"s{cfg[0] // 1024}w{cfg[1]}p{cfg[2]}", lambda: knobs(tln, SPLIT_CONFIG=cfg))
    for dt in (bf, torch.float16, f32):
        point("ln_fwd", dt, 65537, [sfw(c) for c in (
            (8192, 4, 3), (8192, 4, 1), (4096, 4, 3), (8192, 8, 1), (16384, 16, 3))])
    # (the round ran these with the 64K looped rule, LOOPED_16BIT_FWD, emptied; "cur" was that
    # looped kernel at 64K; the rule is gone since)
    for N in (65536, 131072, 262144):
        point("ln_fwd", bf, N, [sfw(c) for c in (
            (8192, 8, 3), (8192, 4, 3), (8192, 4, 1), (4096, 4, 1))])
if "r23" in which:  # round 23: the round-22 rules as "cur" against what they replaced
    def smc(cfg):
        return (f"s{cfg[0] // 1024}w{cfg[1]}p{cfg[2]}", lambda: sm_cfg("fwd", cfg))
    single = ("single", lambda: caps(softmax_fwd=65536))  # rows of 64K in one program
    for dt in (bf, torch.float16):
        point("sm_fwd", dt, 65537, [single, smc((8192, 8, 1)), smc((4096, 4, 3))])
        point("sm_fwd", dt, 65536, [single, smc((8192, 8, 3))])
        for N in (16384, 32768, 65536):
            point("ln_bwd", dt, N, [("s8w8p3", lambda: knobs(tln, SPLIT_BWD_CONFIG=(8192, 8, 3))),
                                    ("s4w8p1", lambda: knobs(tln, SPLIT_BWD_CONFIG=(4096, 8, 1)))])
        point("ln_fwd", dt, 65536, [("s8w8p1", lambda: knobs(tln, SPLIT_CONFIG=(8192, 8, 1)))])
def with_compile(op, dt, N, variants):
    """point(), then torch.compile of the same op timed in the same run ("compile" records).
    Not for "ln_bwd": dynamo falls back to eager on its autograd.grad call (those records are
    eager; the sweep's compile provider compiles the forward and backward instead)."""
    point(op, dt, N, variants)
    records.append(dict(op=op, dtype=str(dt).split(".")[-1], N=N, variant="compile",
                        tbps=compiled_tbps(op, dt, N), frac_copy=None, eager_tbps=None,
                        err=None))
    print(f"        compile {records[-1]['tbps']:.2f}", flush=True)


def rb25(elt, cfg):
    """The softmax backward reload rule for rows of 32K: (second-pass chunk, warps[, first])."""
    name = f"rl{cfg[0] // 1024}Kw{cfg[1]}" + (f"f{cfg[2] // 1024}K" if cfg[2:] else "")
    return (name, lambda: item(tsm.RELOAD_BWD, (elt, 32768), cfg))


if "r24" in which:  # round 24 (eleventh session): the sweep's losses to a provider, with
    # torch.compile of the same op timed in the same run ("compile" in the JSON's records).
    def rb(elt, cfg):  # softmax backward reload kernel: (second-pass chunk, warps[, first])
        name = f"rl{cfg[0] // 1024}Kw{cfg[1]}" + (f"f{cfg[2] // 1024}K" if cfg[2:] else "")
        return (name, lambda: item(tsm.RELOAD_BWD, (elt, 32768), cfg))
    no_reload = ("single", lambda: knobs(tsm, RELOAD_BWD={}))
    split = ("split", lambda: stack(knobs(tsm, RELOAD_BWD={}), caps(softmax_bwd=16384)))
    for dt in (bf, fp16):
        with_compile("sm_bwd", dt, 32768, [rb(2, c) for c in (
            (16384, 32), (32768, 32), (4096, 32), (8192, 16), (8192, 32, 16384),
            (4096, 16, 4096), (8192, 16, 8192))] + [no_reload, split])
    with_compile("sm_bwd", f32, 32768, [rb(4, c) for c in (
        (16384, 32, 16384), (4096, 32, 16384), (8192, 16, 8192), (4096, 16, 4096),
        (8192, 32, 8192))] + [no_reload, split])

    def rf(elt, N, cfg):  # LayerNorm forward reload kernel: (chunk, warps[, third read])
        name = f"rl{cfg[0] // 1024 or 0.5}Kw{cfg[1]}" + ("t" if cfg[2:] and cfg[2] else "")
        return (name, lambda: item(tln.RELOAD_FWD, (elt, N), cfg))
    for dt in (bf, fp16):
        with_compile("ln_fwd", dt, 8192, [rf(2, 8192, c) for c in (
            (2048, 8), (1024, 16), (2048, 16), (512, 4), (1024, 4), (1024, 8, True))]
            + [("single", lambda: knobs(tln, RELOAD_FWD={}))])
        with_compile("ln_fwd", dt, 32768, [rf(2, 32768, c) for c in (
            (4096, 32, True), (16384, 32, True), (8192, 16, True), (8192, 32))]
            + [("single", lambda: knobs(tln, RELOAD_FWD={}))])
    point("ln_bwd", f32, 8192, [
        (f"f{t // 1024}K/{p}{'' if a else '2d'}", lambda t=t, p=p, a=a: knobs(
            tln, FUSED_BWD_OVERRIDE=(t, p, a)))
        for t, p, a in ((8192, 1, True), (8192, 2, True), (16384, 1, False), (32768, 1, True),
                        (16384, 2, True))])
if "r25" in which:  # round 25: power-of-two rows on the softmax backward reload kernel without
    # masks, both passes unrolled (EVEN, "cur") against the masked loops ("masked"), at every
    # reload rule; 32K with other chunks, unrolled; torch.compile in the same run.
    masked = ("masked", lambda: knobs(tsm, UNROLL_RELOAD_BWD=False))

    for dt in (bf, fp16):
        for N in (2048, 4096, 16384):
            point("sm_bwd", dt, N, [masked])
        with_compile("sm_bwd", dt, 32768, [masked] + [rb25(2, c) for c in (
            (16384, 32), (32768, 32), (8192, 32, 16384), (16384, 32, 16384), (4096, 16, 4096),
            (8192, 16, 8192), (16384, 32, 8192))])
    with_compile("sm_bwd", f32, 32768, [masked] + [rb25(4, c) for c in (
        (16384, 32, 16384), (8192, 16, 8192), (4096, 16, 4096), (16384, 32, 8192))])
if "r26" in which:  # round 26: float32 32K with the whole row in one load (ptxas sm_90, EVEN:
    # 52 registers at 32K second-pass chunks, 44 at 16K, no spills; Inductor's kernel: 52)
    with_compile("sm_bwd", f32, 32768, [rb25(4, c) for c in (
        (32768, 32), (16384, 32), (16384, 32, 16384), (8192, 32))])
    for dt in (bf, fp16):
        point("sm_bwd", dt, 32768, [rb25(2, c) for c in (
            (16384, 32), (16384, 32, 16384), (32768, 32))])
# Round 19a (tune-h100-2026-11-21/round19-shift-single.json) timed that SHIFT_W variant alone
# (noshift, s_all, s_w4/s_w16 warps, s_np without the persistent grid); the variant and its
# section were not kept.
if "rvec" in which:  # round 19 (ninth session): LayerNorm forward, unaligned rows (2^k + 1).
    # The weight/bias loads of the body were scalar (their columns start at the row's head):
    # "cur" = _ln_fwd_reload_vec (the row read whole, then again in chunks, weight/bias from
    # copies shifted per head, loaded as vectors); "single" = the single-block kernel. In the
    # round's JSON (tune-h100-2026-11-21/round19-rvec.json) "single" was the single-block
    # kernel reading the shifted copies (a SHIFT_W variant, dropped after this round) and
    # "noshift" the single-block kernel as it is now.
    def rv(elt, block, chunk, warps):
        cfg = (chunk, warps)
        return (f"rv{chunk // 1024 or 0.5}Kw{warps}",
                lambda: item(tln.RELOAD_VEC_FWD, (elt, block), cfg)
                if (elt, block) in tln.RELOAD_VEC_FWD
                else entry(tln.RELOAD_VEC_FWD, (elt, block), cfg))
    single = ("single", lambda: knobs(tln, RELOAD_VEC_FWD={}))
    cfgs = {4096: ((512, 4), (1024, 8), (2048, 8), (1024, 4)),
            8192: ((2048, 8), (1024, 4), (1024, 16), (2048, 16), (1024, 8)),
            16384: ((2048, 16), (4096, 32), (2048, 32), (8192, 32), (4096, 16))}
    for dt in (bf, fp16, f32):
        elt = torch.empty((), dtype=dt).element_size()
        for N in (4097, 8193, 16385):
            point("ln_fwd", dt, N, [single] + [rv(elt, N - 1, c, w) for c, w in cfgs[N - 1]])
if "rvec2" in which:  # round 19b: 16-bit 32769 on the reload kernel for unaligned rows, and
    # the wall time per call of few-row calls (the shifted copies cost one more launch)
    def rv2(chunk, warps):
        return (f"rv{chunk // 1024}Kw{warps}",
                lambda: item(tln.RELOAD_VEC_FWD, (2, 32768), (chunk, warps)))
    for dt in (bf, fp16):
        point("ln_fwd", dt, 32769, [("single", lambda: knobs(tln, RELOAD_VEC_FWD={}))]
              + [rv2(c, w) for c, w in ((4096, 32), (8192, 16), (16384, 32), (4096, 16))])
    import statistics
    for M in (() if SMOKE else (2, 16, 64, 256)):
        x = torch.randn(M, 8193, device=dev, dtype=bf)
        w = torch.randn(8193, device=dev, dtype=bf)
        res = {}
        for name, ctx in (("rvec", nullctx), ("single", lambda: knobs(tln, RELOAD_VEC_FWD={}))):
            with ctx():
                f = lambda: tln.layernorm_forward(x, w, w, 1e-5, bf)  # noqa: E731
                for _ in range(50):
                    f()
                runs = []
                for _ in range(5):
                    torch.cuda.synchronize()
                    t1 = time.perf_counter()
                    for _ in range(500):
                        f()
                    torch.cuda.synchronize()
                    runs.append((time.perf_counter() - t1) / 500 * 1e6)
                res[name] = statistics.median(runs)
        print(f"wall us/call bf16 {M}x8193: " + " ".join(f"{k}={v:.1f}" for k, v in res.items()),
              flush=True)
if "reload" in which:  # round 16: rows read whole (all bytes in flight), then again from L2
    # (Inductor's unrolled two-loop reductions; ours kept the row in registers or looped).
    # Offline ptxas sm_90: LN fwd bf16 16K 62 regs at 16 warps, 32 at 32; softmax bwd bf16 16K
    # 28 at 32 warps, 32 at 16.
    def rl(mod_dict, elt, block, chunk, warps):
        return (f"rl{chunk // 1024}Kw{warps}",
                lambda: entry(mod_dict, (elt, block), (chunk, warps)))
    for dt, N, cfgs in ((bf, 16384, ((2048, 16), (4096, 16), (2048, 32))),
                        (fp16, 16384, ((2048, 16), (4096, 16), (2048, 32))),
                        (bf, 8192, ((2048, 16), (1024, 8), (2048, 8))),
                        (fp16, 8192, ((2048, 16), (1024, 8))),
                        (bf, 32768, ((4096, 32), (2048, 32))),
                        (f32, 16384, ((2048, 16), (2048, 32))),
                        (f32, 32768, ((4096, 32), (2048, 32)))):
        elt = torch.empty((), dtype=dt).element_size()
        point("ln_fwd", dt, N, [rl(tln.RELOAD_FWD, elt, N, c, w) for c, w in cfgs])
    for dt, N, cfgs in ((bf, 16384, ((2048, 32), (4096, 32), (2048, 16))),
                        (fp16, 16384, ((2048, 32), (4096, 32), (2048, 16))),
                        (bf, 32768, ((4096, 32), (2048, 32))),
                        (fp16, 32768, ((4096, 32), (2048, 32))),
                        (f32, 16384, ((4096, 32), (2048, 16))),
                        (f32, 32768, ((4096, 32),)),
                        (bf, 4096, ((2048, 16), (1024, 8), (4096, 16))),
                        (fp16, 2048, ((2048, 8), (1024, 4), (2048, 16))),
                        (bf, 8192, ((2048, 16), (4096, 32)))):
        elt = torch.empty((), dtype=dt).element_size()
        point("sm_bwd", dt, N, [rl(tsm.RELOAD_BWD, elt, N, c, w) for c, w in cfgs])
if "reload2" in which:  # round 16b: more reload shapes, with the round-16 rules as "cur"
    def rl2(mod_dict, elt, block, chunk, warps):
        return (f"rl{chunk // 1024}Kw{warps}",
                lambda: item(mod_dict, (elt, block), (chunk, warps)) if (elt, block) in mod_dict
                else entry(mod_dict, (elt, block), (chunk, warps)))
    for dt, N, cfgs in ((bf, 16384, ((4096, 32), (8192, 32), (8192, 16))),
                        (fp16, 16384, ((4096, 32), (8192, 16))),
                        (f32, 32768, ((8192, 32), (2048, 16))),
                        (bf, 4096, ((1024, 4), (2048, 8), (1024, 8))),
                        (f32, 4096, ((1024, 4), (2048, 8), (1024, 8))),
                        (bf, 32768, ((8192, 32), (4096, 16)))):
        elt = torch.empty((), dtype=dt).element_size()
        point("ln_fwd", dt, N, [rl2(tln.RELOAD_FWD, elt, N, c, w) for c, w in cfgs])
    for dt, N, cfgs in ((bf, 32768, ((8192, 32), (4096, 16), (2048, 16))),
                        (fp16, 32768, ((8192, 32), (4096, 16))),
                        (bf, 16384, ((8192, 32), (4096, 16)))):
        elt = torch.empty((), dtype=dt).element_size()
        point("sm_bwd", dt, N, [rl2(tsm.RELOAD_BWD, elt, N, c, w) for c, w in cfgs])
if "third" in which:  # round 17: the reload forward reading x a third time (from L2) for the
    # variance instead of keeping it: ptxas sm_90 32 registers at bf16 16K on 16 warps (2048
    # chunks) instead of 63, i.e. four programs per SM instead of two (Inductor's 31)
    def tr(elt, block, chunk, warps, third=True):
        return (f"rl{chunk // 1024}Kw{warps}{'t' if third else ''}",
                lambda: item(tln.RELOAD_FWD, (elt, block), (chunk, warps, third))
                if (elt, block) in tln.RELOAD_FWD
                else entry(tln.RELOAD_FWD, (elt, block), (chunk, warps, third)))
    for dt, N, cfgs in ((bf, 16384, ((2048, 16), (4096, 16), (1024, 16))),
                        (fp16, 16384, ((2048, 16), (4096, 16))),
                        (bf, 8192, ((1024, 8), (2048, 16))),
                        (bf, 4096, ((1024, 4), (1024, 8))),
                        (f32, 16384, ((2048, 16), (4096, 16))),
                        (f32, 32768, ((8192, 32), (4096, 32))),
                        (bf, 32768, ((8192, 32), (4096, 32), (4096, 16)))):
        elt = torch.empty((), dtype=dt).element_size()
        point("ln_fwd", dt, N, [tr(elt, N, c, w) for c, w in cfgs])
if "r18" in which:  # round 18 (seventh session)
    def tr18(elt, block, cfg):
        return (f"rl{cfg[0] // 1024}Kw{cfg[1]}{'t' if cfg[2:] and cfg[2] else ''}",
                lambda: item(tln.RELOAD_FWD, (elt, block), cfg) if (elt, block) in tln.RELOAD_FWD
                else entry(tln.RELOAD_FWD, (elt, block), cfg))
    # LayerNorm forward 16-bit 32K: the reload kernel reading x a third time (round 17: bf16
    # 3.54 vs 3.19 at 8K chunks, 32 warps), fp16 not measured yet
    for dt in (bf, fp16):
        point("ln_fwd", dt, 32768, [tr18(2, 32768, c) for c in (
            (8192, 32, True), (4096, 32, True), (2048, 32, True), (4096, 16, True))])
    # softmax backward float32 32K: the reload kernel's whole-row load spills (64 registers at
    # 32 warps); first pass in pieces of FIRST, second in CHUNK (rl{chunk}w{warps}f{first})
    def sb(cfg):
        return (f"rl{cfg[0] // 1024}Kw{cfg[1]}f{cfg[2] // 1024}K",
                lambda: entry(tsm.RELOAD_BWD, (4, 32768), cfg))
    point("sm_bwd", f32, 32768, [sb(c) for c in (
        (4096, 32, 16384), (8192, 32, 16384), (4096, 16, 16384), (8192, 32, 8192),
        (4096, 16, 8192), (2048, 16, 8192))])
    # LayerNorm backward 16-bit 512 (0.92 of compile): fused tiles (tile, programs/SM, ACC_1D)
    for dt in (bf, fp16):
        point("ln_bwd", dt, 512, [
            (f"t{t // 1024}Kp{p}{'a' if a else ''}",
             lambda t=t, p=p, a=a: knobs(tln, FUSED_BWD_OVERRIDE=(t, p, a)))
            for t, p, a in ((2048, 2, False), (2048, 4, False), (4096, 1, False),
                            (4096, 3, False), (8192, 1, False), (4096, 2, True))])
    # LayerNorm backward scratch parked in dx (round 18 ran it as the default, commit a69ff6c:
    # "cur" parked, "sep" separate scratch); now the low_memory mode against the default
    from fusedops import layernorm_backward_mode
    for dt in (bf, f32):
        for N in (1024, 4096, 8192, 8193, 16384, 65536):
            point("ln_bwd", dt, N, [("lowmem", lambda: layernorm_backward_mode("low_memory"))])
if "fused_vec" in which:  # next: the fused backward's body variant without spills. Offline
    # (ptxas sm_90, Triton 3.9) the shipped tiles spill there (8K body, 2 rows x 16 warps: 208
    # bytes; 4K body, 4 rows x 16 warps: 656); one row per tile does not (8K on 16 warps: 122
    # registers, 4K on 8 warps: 141). (tile, programs per SM, ACC_1D) overrides, body variant on
    # for all lengths, against the shipped rules ("cur").
    def fused(tile, per_sm, body_from):
        return lambda: stack(knobs(tln, FUSED_BWD_OVERRIDE=(tile, per_sm, True),
                                   FUSED_BWD_UNALIGNED_MIN_BLOCK=body_from))
    for dt in (bf, torch.float16, f32):
        for N in (2049, 4097, 8193):
            body = 1 << (N - 1).bit_length() - 1
            point("ln_bwd", dt, N, [
                (f"t{t // 1024}Kp{p}", fused(t, p, 16)) for t, p in
                ((body, 1), (body, 2), (2 * body, 1), (min(16384, 4 * body), 1))])
if "sm_fwd_long" in which:  # round 14: softmax forward long rows, piece/warps/prefetch again
    for dt in (bf, f32):
        for N in (131072, 262144):
            point("sm_fwd", dt, N, [
                (f"s{c[0] // 1024}w{c[1]}p{c[2]}", lambda c=c: sm_cfg("fwd", c))
                for c in ((16384, 16, 0), (16384, 16, 1), (8192, 8, 0), (8192, 16, 1),
                          (8192, 16, 0), (16384, 8, 0), (8192, 8, 1))] + [("cur2", nullctx)])
if "full" in which:  # round 15: split softmax with FULL pieces (fewer registers)
    for dt in (bf, f32):
        for N in (131072, 262144):
            point("sm_fwd", dt, N, [
                (f"s{c[0] // 1024}w{c[1]}p{c[2]}", lambda c=c: sm_cfg("fwd", c))
                for c in ((16384, 16, 0), (16384, 16, 1), (8192, 16, 0), (8192, 16, 1),
                          (8192, 8, 0))])
        for N in (65536, 131072):
            point("sm_bwd", dt, N, [
                (f"s{c[0] // 1024}w{c[1]}p{c[2]}", lambda c=c: sm_cfg("bwd", c))
                for c in ((16384, 16, 0), (8192, 16, 0), (8192, 16, 1), (8192, 8, 0),
                          (8192, 8, 1))])
if "unaligned_fused" in which:  # round 13: LayerNorm backward fused with unaligned rows (VEC)
    # and LayerNorm forward 2^k + 1 rows on a persistent grid holding the weight
    def fwd_var(warps, persistent_above):
        return lambda: stack(override("ln_fwd", warps=warps),
                             knobs(_common, PERSISTENT_ABOVE={"ln_fwd": persistent_above}))
    for dt in (bf, torch.float16, f32):
        for N in (4097, 8193):
            point("ln_fwd", dt, N, [("w8p", fwd_var(8, 1024)), ("w16p", fwd_var(16, 1024)),
                                    ("w8", fwd_var(8, 1 << 20)), ("w4p", fwd_var(4, 1024))])
    for dt in (bf, f32):
        for N in (1025, 2049, 4097, 8193):
            point("ln_bwd", dt, N, [("scalar", scalar_unaligned)])
if "unaligned_split" in which:  # round 12: split rows cut into aligned-body pieces + edges
    for dt in (bf, torch.float16, f32):
        for N in (65537, 98309):
            v = [("looped", nosplit)]
            for cfg in ((8192, 8, 1), (8192, 8, 0), (8192, 8, 2), (4096, 4, 1), (16384, 16, 0)):
                v.append((f"s{cfg[0] // 1024}w{cfg[1]}p{cfg[2]}",
                          lambda cfg=cfg: sm_cfg("fwd", cfg)))
            point("sm_fwd", dt, N, v)
            v = [("looped", nosplit)]
            for cfg in ((8192, 8, 1), (8192, 8, 0), (8192, 8, 2), (16384, 16, 0)):
                v.append((f"s{cfg[0] // 1024}w{cfg[1]}p{cfg[2]}",
                          lambda cfg=cfg: sm_cfg("bwd", cfg)))
            point("sm_bwd", dt, N, v)
            v = [("looped", nosplit), ("scalar", scalar_unaligned)]
            for cfg in ((8192, 8, 1), (8192, 8, 0), (8192, 8, 2), (4096, 4, 1), (4096, 8, 1),
                        (16384, 16, 1)):
                v.append((f"s{cfg[0] // 1024}w{cfg[1]}p{cfg[2]}",
                          lambda cfg=cfg: knobs(tln, SPLIT_CONFIG=cfg)))
            point("ln_fwd", dt, N, v)
# Round 11 (next-row prefetch in the split-row kernels, a global switch then) ran the section
# `prefetch` of commit f8e65dc; its variants are now per-kind split configs (rounds 12 and 15).
if "ln_fwd_mid" in which:
    for dt in (bf, f32):
        for N in (16384, 32768):
            point("ln_fwd", dt, N, [
                (f"cap8K_s{c // 1024}Kw{w}", lambda c=c, w=w: split_below(c, w))
                for c, w in ((2048, 4), (4096, 4), (8192, 4), (8192, 8))])
if "ln_bwd_mid" in which:
    for dt in (bf, f32):
        for N in (1024, 2048, 4096):
            point("ln_bwd", dt, N, [
                (f"f{t // 1024}K/{p}{'' if a else '2d'}", lambda t=t, p=p, a=a: knobs(
                    tln, FUSED_BWD_OVERRIDE=(t, p, a)))
                for t, p, a in ((8192, 1, True), (16384, 1, True), (8192, 2, False),
                                (16384, 1, False))])
if "r27" in which:  # round 27 (twelfth session): the softmax forward reload kernel (row read
    # whole for max and sum, then again from L2 in chunks; ptxas sm_90, Triton 3.6: bf16 32K 59-64
    # registers on 32 warps, 128 on 16; 16K 55-64 on 16; 64K spills 48 bytes on 32 warps) against
    # the single-block kernel ("cur" up to 32K, split rows at 64K) and single-block warps;
    # LayerNorm forward 16-bit 16K reload chunks/warps not measured before; torch.compile.
    def rs(elt, whole, cfg):
        return (f"rl{cfg[0] // 1024}Kw{cfg[1]}",
                lambda: entry(tsm.RELOAD_FWD, (elt, whole), cfg))
    for dt in (bf, fp16):
        point("sm_fwd", dt, 16384, [rs(2, 16384, c) for c in (
            (16384, 16), (4096, 16), (8192, 16), (16384, 32))])
        with_compile("sm_fwd", dt, 32768, [rs(2, 32768, c) for c in (
            (32768, 32), (8192, 32), (16384, 32), (4096, 32), (16384, 16))]
            + [("w32", lambda: override("softmax_fwd", warps=32)),
               ("w8", lambda: override("softmax_fwd", warps=8))])
        point("sm_fwd", dt, 65536, [rs(2, 65536, c) for c in ((65536, 32), (16384, 32))])
    point("sm_fwd", f32, 32768, [rs(4, 32768, c) for c in ((32768, 32), (8192, 32))])
    point("sm_fwd", f32, 65536, [rs(4, 65536, c) for c in ((65536, 32), (16384, 32))])

    def rf27(N, cfg):
        return (f"rl{cfg[0] // 1024}Kw{cfg[1]}", lambda: item(tln.RELOAD_FWD, (2, N), cfg))
    for dt in (bf, fp16):
        with_compile("ln_fwd", dt, 16384, [rf27(16384, c) for c in (
            (16384, 16), (4096, 8), (2048, 8), (16384, 32), (8192, 16))])
if "r28" in which:  # round 28: LayerNorm backward, unaligned rows (65537) as aligned-body split
    # pieces plus edges ("cur", VEC_SPLIT_BWD: 2048 x 8) against the previous path ("scalar":
    # PyTorch's native kernel for 16-bit, scalar split pieces for float32) and other configs
    # (ptxas sm_90: 2048 x 8 112-117 registers, 4096 x 8 154-175, 8192 x 8 255 + spills).
    def sb(cfg):
        return (f"s{cfg[0] // 1024}Kw{cfg[1]}p{cfg[2]}" + (f"c{cfg[3]}" if cfg[3:] else ""),
                lambda: knobs(tln, SPLIT_BWD_CONFIG=cfg))
    prev = ("scalar", scalar_unaligned)
    for dt in (bf, fp16):
        with_compile("ln_bwd", dt, 65537, [prev] + [sb(c) for c in (
            (2048, 8, 3), (2048, 8, 0), (2048, 8, 2), (4096, 8, 1, 128), (4096, 4, 1),
            (8192, 8, 1), (8192, 4, 3))])
    with_compile("ln_bwd", f32, 65537, [prev] + [sb(c) for c in (
        (2048, 8, 0), (2048, 8, 1), (4096, 4, 2), (8192, 8, 2), (2048, 4, 2))])
    for dt in (bf, f32):  # other unaligned lengths on the default rule
        for N in (16385, 32769):
            point("ln_bwd", dt, N, [prev])
if "r29" in which:  # round 29: float32 unaligned rows of other lengths on aligned-body split
    # pieces (the round-28 rule, 8192 x 8 prefetching after the wait, and 4096 x 4) against
    # scalar pieces; "cur": VEC_SPLIT_BWD as shipped (bodies of 64K+).
    def vr(cfg):
        return (f"v{cfg[0] // 1024}Kw{cfg[1]}p{cfg[2]}",
                lambda: knobs(tln, VEC_SPLIT_BWD={4: (cfg, 0)}))
    for N in (16385, 32769, 65537, 131073, 262145):
        point("ln_bwd", f32, N, [("scalar", scalar_unaligned), vr((8192, 8, 2)),
                                 vr((4096, 4, 2))])
if "r30" in which:  # round 30: the twelfth session's sweep had LayerNorm backward bf16 256K at
    # 0.32 of copy (fp16, the same kernel, 0.46; ptxas sm_90: the same 255 registers and
    # instruction count as before the VEC change): repeats with torch.compile, same process.
    reps = [(f"rep{i}", nullctx) for i in (2, 3)]
    for dt in (bf, fp16):
        with_compile("ln_bwd", dt, 262144, reps)
        with_compile("ln_bwd", dt, 65537, reps)
if "r31" in which:  # round 31 (thirteenth session): LayerNorm forward on _ln_fwd_unrolled (N a
    # compile-time multiple of the chunk, both passes unrolled, per-lane shifted sums) as
    # u{chunk}w{warps}, against the shipped kernels ("cur") and torch.compile where it won.
    def un(elt, N, chunk, warps):
        return (f"u{chunk // 1024 or chunk / 1024:g}Kw{warps}",
                lambda: knobs(tln, UNROLLED_FWD={(elt, N): (chunk, warps)}))
    grid16 = {4096: ((1024, 4), (512, 4), (1024, 8), (2048, 8)),
              8192: ((1024, 8), (2048, 16), (1024, 4), (2048, 8)),
              16384: ((2048, 16), (1024, 8), (2048, 8), (4096, 16), (1024, 4), (4096, 32)),
              32768: ((2048, 16), (4096, 16), (4096, 32), (2048, 8)),
              65536: ((4096, 16), (2048, 16), (8192, 32))}
    for dt in (bf, fp16):
        for N, cfgs in grid16.items():
            run = with_compile if N in (8192, 16384) else point
            run("ln_fwd", dt, N, [un(2, N, c, w) for c, w in cfgs])
    grid32 = {1024: ((256, 1), (512, 2), (1024, 4), (512, 4)),
              2048: ((512, 2), (1024, 4), (2048, 8)),
              4096: ((1024, 4), (2048, 8), (512, 4), (1024, 8)),
              8192: ((1024, 8), (2048, 8), (2048, 16), (1024, 4)),
              16384: ((2048, 16), (4096, 16), (1024, 8)),
              32768: ((4096, 16), (2048, 16), (8192, 32)),
              65536: ((4096, 16), (8192, 32))}
    for N, cfgs in grid32.items():
        run = with_compile if N in (1024, 4096, 8192) else point
        run("ln_fwd", f32, N, [un(4, N, c, w) for c, w in cfgs])
if "r32" in which:  # round 32: round 31's winners and their neighbours, inference calls too
    # (ln_fwd_y: no statistics asked), and lengths that are multiples of the chunk but no power
    # of two (the rule of the padded length, N % chunk == 0).
    def un(elt, N, chunk, warps):
        return (f"u{chunk // 1024 or chunk / 1024:g}Kw{warps}",
                lambda: knobs(tln, UNROLLED_FWD={(elt, N): (chunk, warps)}))
    grid16 = {1024: ((1024, 4), (512, 2), (256, 1), (1024, 8)),
              2048: ((2048, 8), (1024, 4), (512, 2), (2048, 4)),
              4096: ((4096, 8), (2048, 4), (1024, 2), (512, 4), (4096, 16)),
              8192: ((2048, 8), (4096, 8), (4096, 16), (2048, 4), (8192, 16)),
              16384: ((4096, 16), (4096, 8), (8192, 16), (8192, 32), (2048, 4)),
              32768: ((8192, 32), (8192, 16), (16384, 32), (4096, 8), (4096, 32)),
              65536: ((8192, 32), (16384, 32), (8192, 16), (4096, 8))}
    for dt in (bf, fp16):
        for N, cfgs in grid16.items():
            run = with_compile if N in (8192, 16384) and dt == bf else point
            run("ln_fwd_y", dt, N, [un(2, N, c, w) for c, w in cfgs])
    grid32 = {1024: ((1024, 4), (512, 4), (1024, 2), (1024, 8)),
              2048: ((2048, 8), (2048, 4), (1024, 8), (2048, 16)),
              4096: ((2048, 16), (4096, 16), (4096, 8), (2048, 8), (1024, 16)),
              8192: ((2048, 16), (4096, 16), (4096, 32), (2048, 32)),
              16384: ((4096, 32), (8192, 32), (2048, 32), (4096, 16)),
              32768: ((8192, 32), (16384, 32), (8192, 16), (4096, 32)),
              65536: ((8192, 32), (16384, 32), (4096, 32))}
    for N, cfgs in grid32.items():
        run = with_compile if N == 4096 else point
        run("ln_fwd_y", f32, N, [un(4, N, c, w) for c, w in cfgs])
    for dt, N, rule, cfg in ((bf, 12288, 16384, (4096, 16)), (bf, 24576, 32768, (8192, 32)),
                             (bf, 6144, 8192, (2048, 8)), (f32, 6144, 8192, (2048, 16)),
                             (f32, 3072, 4096, (1024, 16)), (bf, 5120, 8192, (1024, 8))):
        point("ln_fwd_y", dt, N, [un(dt.itemsize, rule, *cfg)])


if "r33" in which:  # round 33: the round 31-32 rules ("cur") against the kernels before them
    # ("old": no unrolled rules), with and without statistics, at every power-of-two length
    # 1K-64K; neighbours where rounds 31-32 disagreed; lengths that are no power of two.
    old = ("old", lambda: knobs(tln, UNROLLED_FWD={}))

    def un(elt, N, *cfgs):
        return ("u" + "+".join(f"{c // 1024 or c / 1024:g}Kw{w}" for c, w in cfgs),
                lambda: knobs(tln, UNROLLED_FWD={(elt, N): cfgs}))
    extra = {(2, 4096): [un(2, 4096, (4096, 8))], (2, 65536): [un(2, 65536, (8192, 16))],
             (4, 16384): [un(4, 16384, (4096, 32))], (4, 65536): [un(4, 65536, (16384, 32))]}
    for dt in (bf, fp16, f32):
        for N in (1024, 2048, 4096, 8192, 16384, 32768, 65536):
            for op in ("ln_fwd", "ln_fwd_y"):
                point(op, dt, N, [old] + extra.get((dt.itemsize, N), []))
    for dt in (bf, f32):
        for N in (1536, 2560, 3072, 5120, 6144, 7168, 12288, 20480):
            p2 = 1 << (N - 1).bit_length()
            point("ln_fwd_y", dt, N, [old, un(dt.itemsize, p2, (512, 4)),
                                      un(dt.itemsize, p2, (1024, 8)),
                                      un(dt.itemsize, p2, (1024, 4))])


if "r34" in which:  # round 34: the sweep after rounds 31-33 had float32 4K on (4096, 16) at
    # 3.91 (rounds 32-33: 4.24, 4.20, 3.91): every candidate twice, with compile; LayerNorm
    # backward bf16 8K (an unchanged kernel at 2.43, 3.48 the sweep before) repeated; 16-bit
    # 65537 backward on the dx row kernel + column kernel (Inductor's split of that work) against
    # PyTorch's native kernel ("cur").
    def u4k(*cfgs):
        return ("u" + "+".join(f"{c // 1024}Kw{w}" for c, w in cfgs),
                lambda: knobs(tln, UNROLLED_FWD={(4, 4096): cfgs}))
    cands = [u4k((4096, 0)), u4k((2048, 16)), u4k((4096, 16)), u4k((1024, 16)), u4k((2048, 8))]
    for op in ("ln_fwd_y", "ln_fwd", "ln_fwd_y"):
        point(op, f32, 4096, cands)
    with_compile("ln_fwd", f32, 4096, [])
    with_compile("ln_bwd", bf, 8192, [("rep", nullctx)])
    cols = ("cols", lambda: stack(nosplit(), knobs(tln, NATIVE_UNALIGNED_16BIT_BWD=False)))
    for dt in (bf, fp16):
        with_compile("ln_bwd", dt, 65537, [cols])


if "r35" in which:  # round 35: softmax forward on _softmax_fwd_unrolled (three unrolled passes:
    # per-lane maxima, the sum of exponentials from L2, y from L2) as u{chunk}Kw{warps}, against
    # the shipped kernels ("cur": single-block to 32K, reload at 16-bit 64K / float32 32K, split
    # rows at float32 64K).
    def us(elt, N, chunk, warps):
        return (f"u{chunk // 1024}Kw{warps}",
                lambda: knobs(tsm, UNROLLED_FWD={(elt, N): ((chunk, warps),)}))
    g16 = {4096: ((2048, 8), (4096, 16), (1024, 4)),
           8192: ((2048, 8), (4096, 16), (1024, 4)),
           16384: ((4096, 16), (2048, 8), (4096, 8), (8192, 16)),
           32768: ((4096, 16), (8192, 16), (8192, 32), (4096, 8), (2048, 8)),
           65536: ((8192, 32), (8192, 16), (4096, 16), (16384, 32))}
    for dt in (bf, fp16):
        for N, cfgs in g16.items():
            point("sm_fwd", dt, N, [us(2, N, c, w) for c, w in cfgs])
    g32 = {16384: ((4096, 16), (2048, 16), (2048, 8)),
           32768: ((4096, 16), (8192, 32), (2048, 8)),
           65536: ((8192, 32), (4096, 16), (16384, 32))}
    for N, cfgs in g32.items():
        point("sm_fwd", f32, N, [us(4, N, c, w) for c, w in cfgs])

if "r36" in which:  # round 36 (runs on e3bb6a5 only: the variant was removed after it): the
    # fused LayerNorm backward's RELOAD variant (dweight/dbias
    # accumulated at the loads, dx's pass re-reading x and dy from L2; 1-row tiles at 8 bf16
    # elements per thread need 64 registers on sm_90 against the shipped tiles' 113-128) as
    # r{tile}p{programs per SM}w{warps}, against the shipped tiles ("cur"); compile.
    def rb(elt, N, tile, per_sm, warps):
        return (f"r{tile // 1024 or 0.5}Kp{per_sm}w{warps}",
                lambda: knobs(tln, RELOAD_BWD={(elt, N): (tile, per_sm, warps, True)}))
    g16 = {512: ((512, 16, 2), (1024, 8, 4), (2048, 4, 8), (512, 8, 2)),
           1024: ((1024, 8, 4), (1024, 4, 8), (2048, 4, 8), (2048, 2, 16)),
           2048: ((2048, 4, 8), (2048, 2, 16), (4096, 2, 16)),
           4096: ((4096, 2, 16), (4096, 1, 16), (4096, 2, 8), (8192, 1, 32)),
           8192: ((8192, 1, 32), (8192, 1, 16), (8192, 2, 16))}
    for dt in (bf, fp16):
        for N, cfgs in g16.items():
            point("ln_bwd", dt, N, [rb(2, N, *c) for c in cfgs])
    for N, cfgs in {4096: ((4096, 2, 16), (4096, 1, 16)),
                    8192: ((8192, 1, 32), (8192, 1, 16), (8192, 2, 16))}.items():
        point("ln_bwd", f32, N, [rb(4, N, *c) for c in cfgs])

if "r37" in which:  # round 37 (runs on 5c6baec only: LEAN_BWD became PAIRED_SUMS and the
    # unconditional no-select in 61ed9d7): the fused LayerNorm backward with fewer instructions
    # per element (ptxas sm_90, bf16 4K tiles: 976 -> 944 instructions without the mask on xhat, 10 -> 7
    # barriers with one paired reduction for both row sums; 8K: 976 -> 872), as lean{bits}:
    # 1 paired reduction, 2 no mask on xhat, 4 dx by FMA, against "cur" (LEAN_BWD = 0).
    def lean(bits):
        return (f"lean{bits}", lambda: knobs(tln, LEAN_BWD=bits))
    for dt in (bf, fp16):
        for N in (512, 1024, 2048, 4096, 8192, 768, 8193):
            point("ln_bwd", dt, N, [lean(b) for b in (1, 2, 3, 7)])
    for N in (1024, 4096, 8192):
        point("ln_bwd", f32, N, [lean(b) for b in (2, 3)])

if "r38" in which:  # round 38: the round-37 rules shipped ("cur": no mask on xhat everywhere,
    # paired row sums for aligned 16-bit rows) against the separate reductions ("sep"), the
    # fused kernel and the dx-only launch (weight and bias frozen: "ln_bwdx")
    sep = ("sep", lambda: knobs(tln, PAIRED_SUMS=False))
    for dt in (bf, fp16):
        for N in (512, 768, 1024, 2048, 4096, 8192, 8193, 5120):
            point("ln_bwd", dt, N, [sep])
    for N in (768, 1024, 4096):
        point("ln_bwd", bf, N, [sep], parts=(True, False, False))
    for N in (1024, 4096, 8192):
        point("ln_bwd", f32, N, [])

if "r39" in which:  # round 39: the split-row LayerNorm backward without the select on xhat (both
    # variants) and with its piece sums paired ("paired", SPLIT_PAIRED) or not ("cur"); sweep
    # s14 had the kernel with the select: 16-bit 32K 2.18, 64K 2.11, float32 16K-64K 3.02-3.10
    paired = ("paired", lambda: knobs(tln, SPLIT_PAIRED=True))  # (now the default: "sep"
    # would be knobs(tln, SPLIT_PAIRED=False))
    for dt in (bf, fp16):
        for N in (32768, 65536, 131072, 262144):
            point("ln_bwd", dt, N, [paired])
    for N in (8193, 16384, 32768, 65536, 65537, 131072):
        point("ln_bwd", f32, N, [paired])

if "r40" in which:  # round 40 (fifteenth session): long 16-bit rows as a dx row kernel plus the
    # column kernel. Unaligned rows (2^k + 1): dx on the aligned bodies (_ln_bwd_dx_pieces) and
    # the (128, 64) x 16-warp column tile ("cur", DX_PIECES_BWD) against PyTorch's native
    # backward ("native"), other dx pieces (p{piece}Kw{warps}) and column tiles
    # (c{cols}x{rows}w{warps}p{programs per SM}); compile. Aligned 16-bit 16K-64K: the split
    # kernel ("cur") against dx row kernel + column kernel ("cols", split rows off).
    # (Ran with the first rule, pieces of (4096, 4) below 131072 and (8192, 8) from there, as
    # "cur"; "compile" here is eager: dynamo falls back on autograd.grad; the sweep's compile
    # provider compiles forward and backward.)
    native = ("native", lambda: knobs(tln, DX_PIECES_BWD=None))

    def dxp(chunk, warps):
        return (f"p{chunk // 1024}Kw{warps}", lambda: knobs(tln, DX_PIECES_BWD=(chunk, warps)))

    def ct(tile, warps, per_sm, *ctx):
        return (f"c{tile[0]}x{tile[1]}w{warps}p{per_sm}", lambda: stack(*[c() for c in ctx], knobs(
            tln, COLUMN_TILE=tile, COLUMN_WARPS=warps, COLUMN_PER_SM=per_sm)))
    tiles = [ct((64, 64), 16, 2), ct((64, 128), 16, 2), ct((128, 64), 16, 4),
             ct((256, 32), 8, 8)]
    for dt in (bf, fp16):
        with_compile("ln_bwd", dt, 65537, [native, dxp(8192, 8), dxp(2048, 4)] + tiles)
    for N in (16385, 32769, 131073):
        with_compile("ln_bwd", bf, N, [native, dxp(8192, 8), dxp(4096, 8)])
    for dt in (bf, fp16):
        for N in (16384, 32768, 65536):
            point("ln_bwd", dt, N, [("cols", nosplit), ct((64, 64), 16, 2, nosplit),
                                    ct((64, 128), 16, 2, nosplit), ct((128, 64), 16, 4, nosplit)])

if "r41" in which:  # round 41: LayerNorm forward of unaligned long rows on _ln_fwd_unrolled_vec
    # (UNROLLED_VEC_FWD; "cur": (16384, 32) at 64K bodies) as u{chunk}Kw{warps}, against the
    # split-row kernel on aligned-body pieces ("split": no rule); aligned 16-bit 128K/256K rows
    # on _ln_fwd_unrolled against their split kernel ("cur").
    def uv(elt, body, chunk, warps):
        return (f"u{chunk // 1024}Kw{warps}",
                lambda: knobs(tln, UNROLLED_VEC_FWD={(elt, body): (chunk, warps)}))
    split = ("split", lambda: knobs(tln, UNROLLED_VEC_FWD={}))
    for dt, elt in ((bf, 2), (fp16, 2), (f32, 4)):
        point("ln_fwd", dt, 65537, [split] + [uv(elt, 65536, c, w) for c, w in (
            (8192, 32), (8192, 16), (4096, 16), (16384, 16), (2048, 8))])
    for N in (131073, 262145):
        point("ln_fwd", bf, N, [uv(2, N - 1, c, w) for c, w in ((16384, 32), (8192, 32),
                                                                 (8192, 16))])

    def ua(N, chunk, warps):
        return (f"u{chunk // 1024}Kw{warps}",
                lambda: knobs(tln, UNROLLED_FWD={**tln.UNROLLED_FWD, (2, N): ((chunk, warps),)}))
    for N in (131072, 262144):
        point("ln_fwd", bf, N, [ua(N, c, w) for c, w in ((16384, 32), (8192, 32), (8192, 16))])

if "r42" in which:  # round 42: softmax forward of unaligned long rows on
    # _softmax_fwd_unrolled_vec (UNROLLED_VEC_FWD; "cur": (8192, 16) at 64K bodies) as
    # u{chunk}Kw{warps}, against the split-row kernel on aligned-body pieces ("split");
    # aligned 128K/256K rows on _softmax_fwd_unrolled, and float32 LayerNorm forward rows of
    # 128K/256K on _ln_fwd_unrolled(_vec), against the shipped kernels ("cur").
    def sv(elt, body, chunk, warps):
        return (f"u{chunk // 1024}Kw{warps}",
                lambda: knobs(tsm, UNROLLED_VEC_FWD={(elt, body): (chunk, warps)}))
    split = ("split", lambda: knobs(tsm, UNROLLED_VEC_FWD={}))
    cfgs = ((8192, 32), (16384, 32), (4096, 16), (16384, 16))
    for dt, elt in ((bf, 2), (fp16, 2), (f32, 4)):
        point("sm_fwd", dt, 65537, [split] + [sv(elt, 65536, c, w) for c, w in cfgs])
    for N in (131073, 262145):
        point("sm_fwd", bf, N, [sv(2, N - 1, c, w) for c, w in ((8192, 16), (16384, 32),
                                                                 (8192, 32))])

    def sa(elt, N, chunk, warps):
        return (f"u{chunk // 1024}Kw{warps}", lambda: knobs(
            tsm, UNROLLED_FWD={**tsm.UNROLLED_FWD, (elt, N): ((chunk, warps),)}))
    for dt, elt in ((bf, 2), (f32, 4)):
        for N in (131072, 262144):
            point("sm_fwd", dt, N, [sa(elt, N, c, w) for c, w in ((8192, 16), (16384, 32),
                                                                   (8192, 32))])

    def la(N, chunk, warps):
        return (f"u{chunk // 1024}Kw{warps}", lambda: knobs(
            tln, UNROLLED_FWD={**tln.UNROLLED_FWD, (4, N): ((chunk, warps),)}))

    def lv(body, chunk, warps):
        return (f"u{chunk // 1024}Kw{warps}",
                lambda: knobs(tln, UNROLLED_VEC_FWD={(4, body): (chunk, warps)}))
    for N in (131072, 262144):
        point("ln_fwd", f32, N, [la(N, c, w) for c, w in ((16384, 32), (8192, 32))])
        point("ln_fwd", f32, N + 1, [lv(N, c, w) for c, w in ((16384, 32), (8192, 32))])


if "r43" in which:  # round 43: the softmax backward on _softmax_bwd_unrolled, unaligned rows
    # (UNROLLED_VEC_BWD, u{chunk}Kw{warps}) and aligned rows (UNROLLED_BWD), against the
    # shipped kernels ("cur": split rows above 32K).
    cfgs = ((8192, 16), (16384, 32), (8192, 32), (4096, 16), (16384, 16))

    def bv(elt, body, chunk, warps):
        return (f"u{chunk // 1024}Kw{warps}",
                lambda: knobs(tsm, UNROLLED_VEC_BWD={(elt, body): (chunk, warps)}))

    def ba(elt, N, chunk, warps):
        return (f"u{chunk // 1024}Kw{warps}",
                lambda: knobs(tsm, UNROLLED_BWD={(elt, N): ((chunk, warps),)}))
    for dt, elt in ((bf, 2), (fp16, 2), (f32, 4)):
        point("sm_bwd", dt, 65537, [bv(elt, 65536, c, w) for c, w in cfgs])
    for dt, elt in ((bf, 2), (f32, 4)):
        point("sm_bwd", dt, 65536, [ba(elt, 65536, c, w) for c, w in cfgs])
    for N in (131072, 262144):
        point("sm_bwd", bf, N, [ba(2, N, c, w) for c, w in cfgs[:3]])
        point("sm_bwd", bf, N + 1, [bv(2, N, c, w) for c, w in cfgs[:3]])

if "r44" in which:  # round 44: 16-bit softmax backward at 32K (Liger 2-3% ahead of the reload
    # kernel, "cur", in sweeps s15/s16): _softmax_bwd_unrolled configs, the single-block kernel
    # (no reload rule), and Liger's kernel itself when importable.
    def b32(chunk, warps):
        return (f"u{chunk // 1024}Kw{warps}",
                lambda: knobs(tsm, UNROLLED_BWD={(2, 32768): ((chunk, warps),)}))
    single = ("single", lambda: knobs(tsm, RELOAD_BWD={k: v for k, v in tsm.RELOAD_BWD.items()
                                                       if k != (2, 32768)}))
    def single_w(warps):  # the single-block kernel on `warps` warps (Liger: 32)
        return (f"single_w{warps}", lambda: stack(single[1](), override("softmax_bwd",
                                                                        warps=warps)))
    for dt in (bf, fp16):
        point("sm_bwd", dt, 32768, [single, single_w(16), single_w(32)] + [b32(c, w) for c, w in (
            (8192, 16), (16384, 32), (4096, 8), (32768, 32), (8192, 32))])
        try:
            from liger_kernel.ops.softmax import LigerSoftmaxFunction
            x = torch.randn(TOTAL // 32768, 32768, device=dev, dtype=dt, requires_grad=True)
            y = LigerSoftmaxFunction.apply(x)
            dy = torch.randn_like(y)
            ms = bench(lambda: torch.autograd.grad(y, x, dy, retain_graph=True))
            print(f"liger sm_bwd {dt} 32768: {3 * x.numel() * 2 / ms / 1e9:.2f} TB/s", flush=True)
            records.append(dict(op="sm_bwd", dtype=str(dt).split(".")[-1], N=32768,
                                variant="liger", tbps=3 * x.numel() * 2 / ms / 1e9))
        except Exception as exc:  # noqa: BLE001
            print(f"liger unavailable: {type(exc).__name__}: {exc}", flush=True)

if "r47" in which:  # round 47: the LayerNorm backward's row loops software-pipelined by
    # Triton (tl.range num_stages S: loads into shared memory S - 1 rows ahead; the split
    # kernel's publish and wait in inline PTX, see publish_sums), with and without RELOAD (x
    # and dy loaded again after the wait instead of kept in registers across it). Ran on
    # commit cbb0941; the split kernel's RELOAD/STAGES knobs were removed after it (slower),
    # so its variants here now run the shipped kernel.
    def sp(cfg):
        chunk, warps, pf, cap, reload, stages = cfg
        name = (f"s{chunk // 1024}w{warps}p{pf}{f'm{cap}' if cap else ''}"
                f"{'R' if reload else ''}S{stages}")
        return (name, lambda: knobs(tln, SPLIT_BWD_CONFIG=cfg))
    cfgs = ((4096, 8, 0, None, False, 3), (4096, 8, 0, None, True, 3),
            (4096, 8, 0, None, True, 2), (2048, 4, 0, None, True, 3),
            (2048, 4, 0, None, False, 3), (2048, 8, 0, None, True, 3),
            (8192, 16, 0, None, True, 3))
    for N in (16384, 32768, 65536, 131072, 262144):
        point("ln_bwd", bf, N, [sp(c) for c in cfgs])
    for N in (16384, 65536, 262144):
        point("ln_bwd", f32, N, [sp(c) for c in cfgs[:2] + cfgs[3:5]])
    for dt in (bf, f32):
        for N in (1024, 2048, 4096, 8192):
            point("ln_bwd", dt, N, [(f"S{k}", lambda k=k: knobs(tln, FUSED_BWD_STAGES=k))
                                    for k in (2, 3)])

if "r47b" in which:  # round 47b: the fused backward's S3 at 16-bit 1K/2K again, three times
    for _ in range(3):
        for N in (1024, 2048):
            point("ln_bwd", bf, N, [("S3", lambda: knobs(tln, FUSED_BWD_STAGES=3))])

if "r48" in which:  # round 48: the split backward's publish and wait in inline PTX without
    # pipelining (one block-wide barrier less per row: Nsight Compute on the shipped kernel,
    # bf16 32K, H100: 44% of the stall cycles at CTA barriers); the fused backward pipelined
    # (S3) over the 16-bit blocks up to 4K and float32 1K/2K. Ran on commit cbb0941 (the
    # "asm" knob, SYNC_ASM, was removed after it: no gain; its float32 64K variant was wrong:
    # PREFETCH 2 was not wired into the asm path).
    def asm(cfg):
        return ("asm", lambda: knobs(tln, SPLIT_BWD_CONFIG=(*cfg, False, 1, True)))
    for dt, N in ((bf, 16384), (bf, 32768), (bf, 65536), (bf, 131072), (bf, 262144),
                  (f32, 16384), (f32, 65536)):
        cfg = tln._split_config("bwd", N, torch.empty(0, dtype=dt).element_size(), True)
        cfg = (*cfg, None) if len(cfg) == 3 else cfg
        point("ln_bwd", dt, N, [asm(cfg)])
    for dt in (bf, fp16):
        for N in (256, 512, 768, 1024, 2048, 4096):
            point("ln_bwd", dt, N, [("S3", lambda: knobs(tln, FUSED_BWD_STAGES=3))])
    for N in (256, 1024, 2048):
        point("ln_bwd", f32, N, [("S3", lambda: knobs(tln, FUSED_BWD_STAGES=3))])

if "r49" in which:  # round 49 (nineteenth session): the split backward on one-warp programs
    # (a row piece reduced by warp shuffles alone: no CTA barrier, the 44% of stall cycles
    # Nsight Compute found in round 48's kernel) and two-warp ones; local ptxas sm_90 (Triton
    # 3.6, bf16): 512 x 1 125-135 registers, 15-16 programs per SM (8192 elements per SM in
    # flight, as 4096 x 8 at 128); 1024 x 1 232-244 (8 per SM); 1024 x 2 157-163 (6 per SM).
    def s1(cfg):
        chunk, warps, pf, *cap = cfg
        name = f"s{chunk}w{warps}p{pf}{f'm{cap[0]}' if cap else ''}"
        return (name, lambda: knobs(tln, SPLIT_BWD_CONFIG=cfg))
    small = ((512, 1, 0), (512, 1, 1), (512, 1, 1, 128), (1024, 1, 0, 128), (1024, 2, 1),
             (2048, 4, 1, 128))
    # (split_rows_enabled needs the C pieces of a row <= the SM count: 512 x 1 runs to 64K)
    for N in (16384, 32768, 65536):
        point("ln_bwd", bf, N, [s1(c) for c in small])
    for N in (16384, 32768, 65536):
        point("ln_bwd", f32, N, [s1(c) for c in ((512, 1, 0), (512, 1, 1), (1024, 2, 1),
                                                 (1024, 4, 1))])

if "r50" in which:  # round 50: the H100's LayerNorm forward at 16-bit 8K, 3% behind
    # torch.compile in the s17 and s18 sweeps (the rule (2048, 8) was tuned on the H200, where it
    # led compile by 8-12%): round 31's grid on the H100, compile in the same run; 4K too (Liger
    # 1-2% ahead in s18).
    def un(elt, N, chunk, warps):
        return (f"u{chunk // 1024 or chunk / 1024:g}Kw{warps}",
                lambda: knobs(tln, UNROLLED_FWD={**tln.UNROLLED_FWD, (elt, N): ((chunk, warps),)}))
    for _ in range(2):
        for dt in (bf, fp16):
            with_compile("ln_fwd_y", dt, 8192, [un(2, 8192, c, w) for c, w in (
                (1024, 8), (2048, 16), (1024, 4), (2048, 8), (4096, 16), (8192, 32), (512, 4),
                (4096, 8))])
        with_compile("ln_fwd_y", bf, 4096, [un(2, 4096, c, w) for c, w in (
            (4096, 0), (1024, 4), (512, 4), (2048, 8), (1024, 8), (2048, 4))])

if "r51" in which:  # round 51: float32 LayerNorm backward at 8K, 2% behind Liger in the H100
    # sweeps s17/s18 (2.72-2.73 vs 2.76-2.78 TB/s) while the unaligned 8193 ran 2.82-2.83 on
    # one-row 8K tiles (the body variant's rule): the aligned fused kernel's tile (tile, programs
    # per SM, ACC_1D) for float32 4K/8K.
    def fo(cfg):
        return (f"t{cfg[0] // 1024}Kp{cfg[1]}", lambda: knobs(tln, FUSED_BWD_OVERRIDE=cfg))
    for _ in range(2):
        for N in (8192, 4096):
            point("ln_bwd", f32, N, [fo(c) for c in ((8192, 1, True), (16384, 1, True),
                                                      (8192, 2, True), (4096, 2, True))])

# Round 52 (the LayerNorm forward's split rows in thread-block clusters against the shipped
# rules at float32 64K and 16-bit 128K/256K) ran on commit 308b1c8; every cluster variant was
# slower (benchmarks/results/tune-h200-2026-11-25/r52.*) and the variant was removed.

if "r53" in which:  # round 53 (ran on commit 053debf, whose VEC_CLUSTER_BWD the next commit
    # removed: every variant slower, results in benchmarks/results/tune-h200-2026-11-25/):
    # unaligned rows' aligned-body pieces in thread-block clusters
    # (VEC_CLUSTER_BWD) against the shipped paths ("cur": 16-bit dx pieces + column kernel,
    # float32 cooperative aligned-body pieces 4096 x 4) at the 2^k + 1 cliff and beside it.
    # Triton 3.6 sm_90 (local ptxas): the edges cost ~60 registers over the aligned kernel:
    # 16-bit 4096 x 16 127 registers, 4096 x 8 250 (128 capped: 184 B of spills), 8192 x 16
    # capped 184 B; float32 4096 x 8 232, 4096 x 16 128, 8192 x 8 / x 16 spill 304 / 232 B.
    def vc(elt, chunk, warps, pf, cap):
        return (f"c{chunk // 1024}Kw{warps}p{pf}" + (f"r{cap}" if cap else ""),
                lambda: knobs(tln, VEC_CLUSTER_BWD={elt: ((chunk, warps, pf, cap, True), 0)}))
    for dt in (bf, fp16):
        point("ln_bwd", dt, 65537, [vc(2, c, w, p, r) for c, w, p, r in (
            (4096, 16, 1, None), (4096, 16, 2, None), (4096, 16, 0, None), (4096, 8, 1, 128),
            (4096, 8, 1, None), (8192, 16, 1, 128))])
    point("ln_bwd", f32, 65537, [vc(4, c, w, p, r) for c, w, p, r in (
        (4096, 8, 1, None), (4096, 8, 2, None), (4096, 16, 1, None), (8192, 16, 1, None),
        (8192, 8, 1, None))])
    for N in (16385, 32769):
        point("ln_bwd", bf, N, [vc(2, c, w, p, r) for c, w, p, r in (
            (2048, 8, 1, None), (4096, 16, 1, None))])
        point("ln_bwd", f32, N, [vc(4, c, w, p, r) for c, w, p, r in (
            (2048, 8, 1, None), (4096, 16, 1, None), (4096, 8, 1, None))])

print(f"tune s {time.time() - t0:.0f}", flush=True)
out = os.environ.get("OUT")
if out:
    with open(os.path.join(out, "tune.json"), "w") as f:
        json.dump({"device": NAME, "torch": torch.__version__, "triton": triton.__version__,
                   "copy_tbps": COPY, "records": records}, f, indent=1)
print(f"\nbest per point (TB/s; copy {COPY:.2f})")
for op, dt, N, e, best, tb in summary:
    print(f"{op:7s} {dt:8s} {N:7d} eager {e:5.2f}  best {best:16s} {tb:5.2f} ({tb / COPY:.2f})")
