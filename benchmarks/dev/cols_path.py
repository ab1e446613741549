"""Developer probe (GPU): the LayerNorm backward of long 16-bit rows as a dx row kernel plus a
dweight/dbias column kernel, kernel by kernel, against PyTorch's native backward (what fusedops
runs for unaligned 16-bit rows above 8K) and torch.compile of the same op.

Prints per shape: each column-kernel variant's time (dweight + dbias, partials summed), each dx
kernel variant's time (dx only), the native and compiled totals, then the best pair as TB/s of
the op's minimum bytes (3·M·N·elt). Writes every measurement to $OUT/cols_path.json.
On CPU (no GPU) it runs each kernel once on tiny shapes under the interpreter (a smoke test)."""

import json
import os
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from fusedops.triton import layernorm as tln
from fusedops.triton._common import split_pieces

SMOKE = not torch.cuda.is_available()
dev = "cpu" if SMOKE else "cuda"
TOTAL = 1 << 12 if SMOKE else 1 << 27
print(torch.__version__, triton.__version__, flush=True)


def bench(fn):
    if SMOKE:
        fn()
        return 1.0
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


@triton.jit
def _cols(dy_ptr, x_ptr, mean_ptr, rstd_ptr, part_ptr, M, N, stride, rows_per_split,
          BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, OFF64: tl.constexpr):
    # (BLOCK_R, BLOCK_C) tiles down a column block; 2-D accumulators reduced once at the end.
    col_block = tl.program_id(0)
    split = tl.program_id(1)
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < N
    dw = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    db = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    r_start = split * rows_per_split
    r_end = tl.minimum(r_start + rows_per_split, M)
    for r0 in range(r_start, r_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = rows < r_end
        mask = rmask[:, None] & cmask[None, :]
        if OFF64:
            offs = rows.to(tl.int64)[:, None] * stride + cols[None, :]
        else:
            offs = rows[:, None] * stride + cols[None, :]
        g = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        dw += g * ((x - mean[:, None]) * rstd[:, None])
        db += g
    out = part_ptr + split.to(tl.int64) * 2 * N + cols
    tl.store(out, tl.sum(dw, axis=0), mask=cmask)
    tl.store(out + N, tl.sum(db, axis=0), mask=cmask)


def cols_variant(dy, x, mean, rstd, bc, br, warps, splits, off64):
    M, N = x.shape
    rps = triton.cdiv(triton.cdiv(M, splits), br) * br
    splits = triton.cdiv(M, rps)
    part = torch.empty((splits, 2, N), dtype=torch.float32, device=x.device)

    def run():
        _cols[(triton.cdiv(N, bc), splits)](dy, x, mean, rstd, part, M, N, N, rps, bc, br,
                                            off64, num_warps=warps)
        return part.sum(0) if splits > 1 else part[0]
    return run


def dx_looped(dy, x, w, mean, rstd, dx, chunk, warps):
    M, N = x.shape

    def run():
        tln._ln_bwd_dx_looped[(M,)](dy, x, w, mean, rstd, dx, N, N, N, N, chunk, True,
                                    num_warps=warps)
        return dx
    return run


def dx_pieces(dy, x, w, mean, rstd, dx, chunk, warps):
    M, N = x.shape
    vec = 16 // x.element_size() if N % (16 // x.element_size()) else 0
    C, L = split_pieces(N, chunk, vec)

    def run():
        tln._ln_bwd_dx_pieces[(M,)](dy, x, w, mean, rstd, dx, N, L, N, N, N, 0,
                                    triton.next_power_of_2(L), C, triton.next_power_of_2(C),
                                    True, not SMOKE, vec, True, num_warps=warps)
        return dx
    return run


records = []
t0 = time.time()
src = torch.empty(TOTAL * 2, dtype=torch.float32, device=dev)
dst = torch.empty_like(src)
COPY = 2 * src.numel() * 4 / bench(lambda: dst.copy_(src)) / 1e9
del src, dst
print(f"copy {COPY:.3f} TB/s", flush=True)

COLS = [(256, 32, 8, None, True), (256, 32, 8, None, False), (64, 64, 16, 1, False),
        (64, 64, 16, 1, True), (128, 32, 8, None, False), (64, 32, 4, None, False),
        (128, 64, 16, 1, False), (64, 64, 8, 1, False), (32, 64, 4, 1, False),
        (64, 128, 16, 1, False)]
DX = [("loop", 1024, 8), ("loop", 2048, 8), ("loop", 4096, 16), ("loop", 2048, 4),
      ("pieces", 8192, 8), ("pieces", 4096, 4), ("pieces", 16384, 16), ("pieces", 8192, 16)]
SHAPES = ([(torch.bfloat16, 65537), (torch.float16, 65537), (torch.bfloat16, 16384),
           (torch.bfloat16, 131073), (torch.bfloat16, 16385)]
          if not SMOKE else [(torch.bfloat16, 67), (torch.float16, 64)])
for dt, N in SHAPES:
    M = max(2, TOTAL // N)
    x = torch.randn(M, N, device=dev, dtype=dt)
    dy = torch.randn_like(x)
    w = torch.randn(N, device=dev, dtype=dt)
    b = torch.randn(N, device=dev, dtype=dt)
    _, mean, rstd = tln.layernorm_forward(x, w, b, 1e-5, dt)
    xr, wr, br = (t.detach().requires_grad_() for t in (x, w, b))
    y = F.layer_norm(xr.float(), (N,), wr.float(), br.float())
    rdx, rdw, rdb = torch.autograd.grad(y, (xr, wr, br), dy.float())
    del y, xr, wr, br
    nbytes = 3 * M * N * x.element_size()
    tag = f"{str(dt)[6:]} {N}"
    res = {"cols": {}, "dx": {}}

    def err(a, r):
        return ((a.float() - r.float()).abs().max() / (1 + r.float().abs().max())).item()

    for bc, br_, warps, splits, off64 in COLS:
        name = f"c{bc}x{br_}w{warps}s{splits or 'a'}{'L' if off64 else 'i'}"
        s = splits or max(1, min(triton.cdiv(M, br_), 8 * 132 // triton.cdiv(N, bc) + 1))
        fn = cols_variant(dy, x, mean, rstd, bc, br_, warps, s, off64)
        out = fn()
        e = max(err(out[0], rdw), err(out[1], rdb))
        ms = bench(fn)
        res["cols"][name] = ms
        records.append(dict(shape=tag, part="cols", variant=name, us=ms * 1e3, err=e))
        print(f"{tag:12s} cols {name:18s} {ms * 1e3:8.1f} us  err {e:.1e}", flush=True)
    cur = lambda: tln._column_backward(dy, x, mean, rstd, None, True, True, None, scratch=True)  # noqa: E731
    out = cur()
    ms = bench(cur)
    res["cols"]["shipped"] = ms
    records.append(dict(shape=tag, part="cols", variant="shipped", us=ms * 1e3,
                        err=max(err(out[0], rdw), err(out[1], rdb))))
    print(f"{tag:12s} cols shipped            {ms * 1e3:8.1f} us", flush=True)
    dx = torch.empty_like(x)
    for kind, chunk, warps in DX:
        name = f"{kind}{chunk // 1024}Kw{warps}"
        fn = (dx_looped if kind == "loop" else dx_pieces)(dy, x, w, mean, rstd, dx, chunk,
                                                          warps)
        try:
            e = err(fn(), rdx)
            ms = bench(fn)
        except Exception as exc:  # noqa: BLE001
            print(f"{tag:12s} dx {name} fail {exc!s:.100}", flush=True)
            continue
        res["dx"][name] = ms
        records.append(dict(shape=tag, part="dx", variant=name, us=ms * 1e3, err=e))
        print(f"{tag:12s} dx   {name:18s} {ms * 1e3:8.1f} us  err {e:.1e}", flush=True)
    native = lambda: tln._native_backward(dy, x, w, mean, rstd, True, True, True)  # noqa: E731
    shipped = lambda: tln.layernorm_backward(dy, x, w, mean, rstd, True, True, True)  # noqa: E731
    tot = {}
    if not SMOKE:  # (PyTorch's CPU kernel rejects 16-bit x with float32 statistics)
        tot = {"native": bench(native), "shipped": bench(shipped)}
        torch._dynamo.reset()
        comp = torch.compile(native, dynamic=False)
        comp()
        tot["compile"] = bench(comp)
    bc = min(res["cols"], key=res["cols"].get)
    bd = min(res["dx"], key=res["dx"].get)
    tot[f"{bd}+{bc}"] = res["dx"][bd] + res["cols"][bc]
    for k, ms in tot.items():
        records.append(dict(shape=tag, part="total", variant=k, us=ms * 1e3,
                            tbps=nbytes / ms / 1e9))
    print(f"{tag:12s} TOTAL " + "  ".join(f"{k} {nbytes / ms / 1e9:.2f}" for k, ms in tot.items())
          + f" TB/s (copy {COPY:.2f})", flush=True)
    del x, dy, dx, rdx
    if not SMOKE:
        torch.cuda.empty_cache()

print(f"cols_path s {time.time() - t0:.0f}", flush=True)
out = os.environ.get("OUT")
if out:
    with open(os.path.join(out, "cols_path.json"), "w") as f:
        json.dump({"device": "cpu-smoke" if SMOKE else torch.cuda.get_device_name(),
                   "torch": torch.__version__, "triton": triton.__version__, "copy_tbps": COPY,
                   "records": records}, f, indent=1)
