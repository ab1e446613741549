"""Developer probe: the split-row LayerNorm backward without block-wide barriers in its row loop.

Nsight Compute on the shipped split kernel (eighteenth session, H100, bf16 32K) found 44% of the
stall cycles at CTA barriers: the cross-warp reductions of the piece's two partial sums, the
publish barrier and the broadcast of the spin-wait's result. Here each warp of a program owns a
contiguous part of the row piece, laid out as [W, SUB] tiles (warps along dim 0, a warp's 32
lanes x 16 bytes along dim 1), so ``tl.sum(axis=1)`` reduces within a warp; each warp publishes
its own two sums (inline PTX: lane 0 stores them and counts its arrival with a release), and
every warp waits for its row's C·W arrivals and sums the C·W published pairs itself (inline
PTX: acquire spin, lanes load strided slots, butterfly shuffles). Nothing in the row loop needs
the other warps of the program.

    PYTHONPATH=/tmp/t36:$PWD python benchmarks/dev/warp_rows.py ptx      # local: barriers, regs
    OUT=dir python benchmarks/dev/warp_rows.py bench                    # GPU: check and time
"""

from __future__ import annotations

import json
import os
import re
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _publish_warp(slot_at, s1, s2, count_at):
    """Lane 0 of each warp stores its warp's (s1, s2) at slot_at[2·warp:2·warp + 2] and counts
    the arrival at count_at (release: orders that lane's own stores; no barrier needed)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        .reg .b32 t;
        .reg .b64 a;
        mov.u32 t, %laneid;
        setp.eq.u32 p, t, 0;
        mov.u32 t, %tid.x;
        shr.u32 t, t, 5;
        mul.wide.u32 a, t, 8;
        add.u64 a, a, $1;
        @p st.global.v2.f32 [a], {$2, $3};
        @p red.release.gpu.global.add.u32 [$4], 1;
        mov.u32 $0, 0;
        }""", "=r,l,f,f,l",
        [slot_at.to(tl.int64), s1, s2, count_at.to(tl.int64)], dtype=tl.int32,
        is_pure=False, pack=1)


# Butterfly sum of ($0, $1) over a warp's 32 lanes (offsets 16, 8, 4, 2, 1).
_BUTTERFLY = "".join(f"""
        shfl.sync.bfly.b32 u, $0, {k}, 31, -1;
        shfl.sync.bfly.b32 v, $1, {k}, 31, -1;
        add.f32 $0, $0, u;
        add.f32 $1, $1, v;""" for k in (16, 8, 4, 2, 1))


# The wait and peer sums of _await_sums, in PTX.
_AWAIT_ASM = tl.constexpr("""{
            .reg .pred p;
            .reg .b32 t, k;
            .reg .b64 a;
            .reg .f32 u, v;
            WAIT:
            ld.acquire.gpu.global.u32 t, [$2];
            setp.lt.u32 p, t, $3;
            @p bra WAIT;
            mov.f32 $0, 0f00000000;
            mov.f32 $1, 0f00000000;
            mov.u32 k, %laneid;
            LOOP:
            setp.ge.u32 p, k, $3;
            @p bra DONE;
            mul.wide.u32 a, k, 8;
            add.u64 a, a, $4;
            ld.global.cg.v2.f32 {u, v}, [a];
            add.f32 $0, $0, u;
            add.f32 $1, $1, v;
            add.u32 k, k, 32;
            bra LOOP;
            DONE:
            """ + _BUTTERFLY + """
            }""")


@triton.jit
def _await_sums(count_at, target, slots_at, dep):
    """Wait (acquire) until count_at reaches ``target``, then the sums of the ``target``
    published (s1, s2) pairs at slots_at: lane k adds pairs k, k + 32, ..., then butterfly
    shuffles (the same order in every warp and program: all pieces of a row agree bitwise)."""
    return tl.inline_asm_elementwise(
        _AWAIT_ASM, "=f,=f,l,r,l,f",
        [count_at.to(tl.int64), target, slots_at.to(tl.int64), dep],
        dtype=(tl.float32, tl.float32), is_pure=False, pack=1)


@triton.jit
def _ln_bwd_warp_rows(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, stats_ptr, count_ptr,
    N, stride, num_items, num_progs,
    W: tl.constexpr, SUB: tl.constexpr, C: tl.constexpr,
):
    # Work item = (row, chunk) as in _ln_bwd_split; piece = W warps x 2 tiles x SUB columns,
    # warp w owning columns [w·2·SUB, (w + 1)·2·SUB) of the piece.
    pid = tl.program_id(0)
    chunk = pid % C
    wi = tl.arange(0, W)[:, None]
    j = tl.arange(0, SUB)[None, :]
    pos0 = chunk * (W * 2 * SUB) + wi * (2 * SUB) + j
    pos1 = pos0 + SUB
    m0 = pos0 < N
    m1 = pos1 < N
    w0 = tl.load(w_ptr + pos0, mask=m0, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + pos1, mask=m1, other=0.0).to(tl.float32)
    dw0 = tl.zeros([W, SUB], tl.float32)
    dw1 = tl.zeros([W, SUB], tl.float32)
    db0 = tl.zeros([W, SUB], tl.float32)
    db1 = tl.zeros([W, SUB], tl.float32)
    step = num_progs // C
    r0 = (pid // C).to(tl.int64) * stride
    xn0 = tl.load(x_ptr + r0 + pos0, mask=m0, other=0.0)
    xn1 = tl.load(x_ptr + r0 + pos1, mask=m1, other=0.0)
    gn0 = tl.load(dy_ptr + r0 + pos0, mask=m0, other=0.0)
    gn1 = tl.load(dy_ptr + r0 + pos1, mask=m1, other=0.0)
    for item in range(pid, num_items, num_progs):
        row = item // C
        at = row.to(tl.int64) * stride
        nxt = at + step * stride
        more = item + num_progs < num_items
        x0 = xn0.to(tl.float32)
        x1 = xn1.to(tl.float32)
        dy0 = gn0.to(tl.float32)
        dy1 = gn1.to(tl.float32)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        xh0 = (x0 - mean) * rstd
        xh1 = (x1 - mean) * rstd
        dw0 += dy0 * xh0
        dw1 += dy1 * xh1
        db0 += dy0
        db1 += dy1
        g0 = dy0 * w0
        g1 = dy1 * w1
        s1 = tl.sum(xh0 * g0, axis=1) + tl.sum(xh1 * g1, axis=1)
        s2 = tl.sum(g0, axis=1) + tl.sum(g1, axis=1)
        slots = stats_ptr + row.to(tl.int64) * (C * W * 2)
        _publish_warp(slots + chunk * (W * 2), s1, s2, count_ptr + row)
        xn0 = tl.load(x_ptr + nxt + pos0, mask=m0 & more, other=0.0)
        xn1 = tl.load(x_ptr + nxt + pos1, mask=m1 & more, other=0.0)
        gn0 = tl.load(dy_ptr + nxt + pos0, mask=m0 & more, other=0.0)
        gn1 = tl.load(dy_ptr + nxt + pos1, mask=m1 & more, other=0.0)
        c1, c2 = _await_sums(count_ptr + row, C * W, slots, s1)
        c1 = (c1 / N)[:, None]
        c2 = (c2 / N)[:, None]
        tl.store(dx_ptr + at + pos0, ((g0 - (xh0 * c1 + c2)) * rstd).to(dx_ptr.dtype.element_ty),
                 mask=m0)
        tl.store(dx_ptr + at + pos1, ((g1 - (xh1 * c1 + c2)) * rstd).to(dx_ptr.dtype.element_ty),
                 mask=m1)
    out = part_ptr + (pid // C).to(tl.int64) * N
    db_out = out + step * N
    tl.store(out + pos0, dw0, mask=m0)
    tl.store(out + pos1, dw1, mask=m1)
    tl.store(db_out + pos0, db0, mask=m0)
    tl.store(db_out + pos1, db1, mask=m1)


def sub_for(elt: int) -> int:
    return 32 * (16 // elt)


def ptx_report() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sys.path.insert(0, os.path.dirname(__file__))
    from regs_split import resources

    for dt, elt, W in (("bf16", 2, 8), ("bf16", 2, 4), ("fp32", 4, 8), ("fp32", 4, 4)):
        fn = _ln_bwd_warp_rows
        names = fn.arg_names
        ptrs = {"mean_ptr": "*fp32", "rstd_ptr": "*fp32", "part_ptr": "*fp32",
                "stats_ptr": "*fp32", "count_ptr": "*i32"}
        consts = {"W": W, "SUB": sub_for(elt), "C": 4}
        sig = {a: ptrs.get(a, f"*{dt}" if a.endswith("_ptr") else
                           ("constexpr" if a in consts else "i32")) for a in names}
        aligned = [a for a in names if a.endswith("_ptr")] + ["N", "stride"]
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
        src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                        constexprs={(names.index(k),): v for k, v in consts.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": W})
        ptx = k.asm["ptx"]
        regs, stack = resources(k)
        print(f"{dt} W={W} SUB={sub_for(elt)}: bar.sync {len(re.findall(r'bar.sync', ptx))}, "
              f"shared {k.metadata.shared} B, {regs} registers, {stack} B stack")


def per_sm(kernel_regs: int, warps: int) -> int:
    per_warp = -(-kernel_regs * 32 // 256) * 256
    return max(1, min(65536 // (per_warp * warps), 64 // warps, 32))


def warp_rows_backward(dy, x, w, mean, rstd, W: int, progs_per_sm: int | None = None):
    from fusedops.triton import layernorm as tln
    M, N = x.shape
    sub = sub_for(x.element_size())
    piece = W * 2 * sub
    C = triton.cdiv(N, piece)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    key = (x.dtype, N, W)
    if key not in _REGS:
        k = _ln_bwd_warp_rows.warmup(dy, x, w, mean, rstd, dy, mean, mean, mean.int(), N, N,
                                     M * C, C, W=W, SUB=sub, C=C, grid=(1,), num_warps=W)
        k._init_handles()
        _REGS[key] = k.n_regs
    ps = progs_per_sm or per_sm(_REGS[key], W)
    progs = min(M * C, sms * ps // C * C)
    part = torch.empty((2, progs // C, N), dtype=torch.float32, device=x.device)
    stats = torch.empty((M * C * W * 2,), dtype=torch.float32, device=x.device)
    count = torch.zeros((M,), dtype=torch.int32, device=x.device)
    dx = torch.empty_like(x)
    _ln_bwd_warp_rows[(progs,)](dy, x, w, mean, rstd, dx, part, stats, count, N, N, M * C,
                                progs, W=W, SUB=sub, C=C, num_warps=W,
                                launch_cooperative_grid=True)
    dw, db = tln._reduce_partials(part, True, True, dtypes=(w.dtype, w.dtype))
    return dx, dw, db


_REGS: dict = {}


def bench() -> None:
    from triton.testing import do_bench

    from fusedops.triton import layernorm as tln
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * src.numel() * 4 / do_bench(lambda: dst.copy_(src), rep=50) / 1e9
    del src, dst
    print(torch.cuda.get_device_name(), triton.__version__, f"copy {copy:.3f} TB/s", flush=True)
    recs = []
    specs = [(torch.bfloat16, n) for n in (16384, 32768, 65536)] + \
            [(torch.float32, n) for n in (16384, 65536)] + [(torch.bfloat16, 131072)]
    for dt, N in specs:
        M = (1 << 27) // N
        x = torch.randn(M, N, device="cuda", dtype=dt)
        w = torch.randn(N, device="cuda", dtype=dt)
        b = torch.randn(N, device="cuda", dtype=dt)
        dy = torch.randn_like(x)
        _, mean, rstd = tln.layernorm_forward(x, w, b, 1e-5, dt)
        ref = tln.layernorm_backward(dy, x, w, mean, rstd, True, True, True)
        nbytes = 3 * M * N * x.element_size()
        line = f"{str(dt)[6:]:9s} N={N:6d}"
        t = do_bench(lambda: tln.layernorm_backward(dy, x, w, mean, rstd, True, True, True),
                     rep=50)
        recs.append(dict(dtype=str(dt), N=N, variant="shipped", tbps=nbytes / t / 1e9))
        line += f" shipped {nbytes / t / 1e9:.2f}"
        for W, ps in ((8, None), (4, None), (16, None)):
            if 2 * sub_for(x.element_size()) * W > N:
                continue
            name = f"w{W}" + (f"p{ps}" if ps else "")
            try:
                out = warp_rows_backward(dy, x, w, mean, rstd, W, ps)
                err = max(((o.float() - r.float()).abs().max() / (1 + r.float().abs().max())).item()
                          for o, r in zip(out, ref, strict=True))
                t = do_bench(lambda W=W, ps=ps: warp_rows_backward(dy, x, w, mean, rstd, W, ps),
                             rep=50)
                tb = nbytes / t / 1e9
            except Exception as exc:  # noqa: BLE001
                tb, err = 0.0, f"{type(exc).__name__}: {str(exc)[:100]}"
            regs = _REGS.get((x.dtype, N, W))
            recs.append(dict(dtype=str(dt), N=N, variant=name, tbps=tb, err=err, regs=regs))
            line += f" | {name} {tb:.2f} (r{regs}, err {err if isinstance(err, str) else f'{err:.1e}'})"
        print(line + f"  [copy frac of shipped {recs[-1]['tbps'] / copy:.2f}]", flush=True)
        del x, dy, w, b, mean, rstd, ref
        torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "warp_rows.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                       "copy_tbps": copy, "records": recs}, f, indent=1)


if __name__ == "__main__":
    (ptx_report if sys.argv[1:] == ["ptx"] else bench)()
