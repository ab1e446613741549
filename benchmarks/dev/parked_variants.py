"""Developer probe (GPU): which change in the fused LayerNorm backward's PARKED variant (the
low_memory mode's first launch) costs speed on unaligned rows (N = 2^k + 1), against the default
variant doing the same work.

Variants are generated from the shipped kernel's source by text substitution (so they track
it): ``recompute_offsets`` (the PARKED variant of commit 73786d1: dx offsets and mask from
``row_body(..., M_dx, ...)``, 9-25% slower on unaligned rows), ``start_only`` (tiles from
first_tile, dx for every row), ``mask_only`` (the shipped dx mask, tiles from 0), ``barrier``
(the default loop; then every program waits at a grid-wide counter before storing its partial
rows, cooperative launch), ``branch`` (the dx stores under a per-tile branch). The shipped
PARKED variant is the mask on the default's offsets. do_bench medians, rounds interleaved;
prints TB/s per variant. Results (run as "mask_and" against 73786d1's source):
benchmarks/results/reliability-h100-2026-11-21/parked-variants.txt."""

import inspect
import json
import os
import sys
import tempfile

import torch
import triton
from triton.testing import do_bench

from fusedops.triton import layernorm as tln

OUT = os.environ.get("OUT", "/tmp/parked_variants")
SRC = inspect.getsource(tln._ln_bwd_single.fn)
START = "    if PARKED:\n        start = first_tile + pid"
MASK = "            if PARKED:  # (offsets"
EMASK = "                if PARKED:\n                    e_mask = e_mask"
STORE = "    out = part_ptr + pid.to(tl.int64) * N\n"
OFFSETS = SRC[SRC.index("            offs_dx, _ = row_body(rows, head, M, N, stride_dx"):
              SRC.index("            tl.store(dx_ptr + offs_dx")]
DXSTORE = SRC[SRC.index("            offs_dx, _ = row_body(rows, head, M, N, stride_dx"):
              SRC.index("        if ACC_1D:\n            if NEED_DW")]
RECOMPUTED = """            if PARKED:
                offs_dx, dx_mask = row_body(rows, head, M_dx, N, stride_dx, BLOCK_N, VEC)
            else:
                offs_dx, _ = row_body(rows, head, M, N, stride_dx, BLOCK_N, VEC)
                dx_mask = mask
"""
BRANCH = """            offs_dx, _ = row_body(rows, head, M, N, stride_dx, BLOCK_N, VEC)
            if tile < M_dx:  # M_dx: here the first tile whose dx is not written
                tl.store(dx_ptr + offs_dx, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                if VEC > 0:
                    dxe = (wdye - (xhe * c1[:, None] + c2[:, None])) * rstd[:, None]
                    tl.store(dx_ptr + e_offs, dxe.to(dx_ptr.dtype.element_ty), mask=e_mask)
"""
BARRIER = """    if PARKED:  # every program's dx is stored before any partial row is
        tl.debug_barrier()
        tl.atomic_add(count_ptr, 1, sem="release")
        seen = tl.atomic_add(count_ptr, 0, sem="acquire")
        while seen < num_progs:
            seen = tl.atomic_add(count_ptr, 0, sem="acquire")
"""
for s in (START, MASK, EMASK, STORE):
    assert s in SRC, s


def variant(name, *, start=True, mask=True, barrier=False, offsets=None, store=None):
    src = SRC.replace("def _ln_bwd_single(", f"def _v_{name}(")
    src = src.replace("first_tile, M_dx,", "first_tile, M_dx, count_ptr,")
    if not start:
        src = src.replace(START, START.replace("if PARKED", "if False"))
    if not mask:
        src = src.replace(MASK, MASK.replace("if PARKED", "if False"))
        src = src.replace(EMASK, EMASK.replace("if PARKED", "if False"))
    if barrier:
        src = src.replace(STORE, BARRIER + STORE)
    if offsets:
        src = src.replace(OFFSETS, offsets)
    if store:
        src = src.replace(DXSTORE, store)
    return src


VARIANTS = {"start_only": variant("start_only", mask=False),
            "mask_only": variant("mask_only", start=False),
            "recompute_offsets": variant("recompute_offsets", start=False, offsets=RECOMPUTED),
            "barrier": variant("barrier", start=False, mask=False, barrier=True),
            "branch": variant("branch", start=False, store=BRANCH)}
d = tempfile.mkdtemp()
with open(f"{d}/lnvariants.py", "w") as f:
    f.write("import triton\nimport triton.language as tl\n"
            "from fusedops.triton._common import row_body, row_edges, tile_rows\n"
            "from fusedops.triton.layernorm import _over_rows\n\n")
    for src in VARIANTS.values():
        f.write("\n@triton.jit\n" + src.split("\n", 1)[1] + "\n")
sys.path.insert(0, d)
import lnvariants  # noqa: E402


def main():
    os.makedirs(OUT, exist_ok=True)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    results = []
    for dtype, N in [(torch.float32, 8193), (torch.bfloat16, 8193), (torch.float32, 4097),
                     (torch.bfloat16, 4097), (torch.float16, 2049), (torch.bfloat16, 8192)]:
        M = (1 << 27) // N
        x = torch.randn(M, N, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        w = torch.randn(N, device="cuda", dtype=dtype)
        mean = x.float().mean(1)
        rstd = torch.rsqrt(x.float().var(1, unbiased=False) + 1e-5)
        dx = torch.empty_like(x)
        plan = tln._fused_plan(M, N, x, dy)
        vec, block, rows, warps, acc_1d, tiles, progs = plan
        part = torch.empty((2, progs, N), dtype=torch.float32, device="cuda")
        count = torch.zeros(1, dtype=torch.int32, device="cuda")
        m_dx = tln._park(dx, 8 * progs * N, rows * max(vec, 1))[0]
        head = (dy, x, w, mean, rstd, dx, part, M, N, dy.stride(0), x.stride(0), N, tiles,
                progs, 0, m_dx)
        consts = (block, rows, True, True, True, True, vec, True, acc_1d)
        paired = tln._paired_sums(x.element_size(), vec, block)
        fns = {}

        def shipped(parked):
            return lambda: tln._launch_bwd_single.kernel[(progs,)](
                *head, *consts, parked, paired, num_warps=warps)
        fns["default"] = shipped(False)
        fns["shipped_parked"] = shipped(True)
        coop = min(progs, torch.cuda.get_device_properties(0).multi_processor_count
                   * max(1, 65536 // (128 * 32 * warps)))  # 128 registers (ncu, all of these)
        coop_head = head[:13] + (coop,) + head[14:]
        fns["default_coop_grid"] = lambda: tln._launch_bwd_single.kernel[(coop,)](
            *coop_head, *consts, False, paired, num_warps=warps)
        for name in VARIANTS:
            k = getattr(lnvariants, f"_v_{name}")
            args = coop_head if name == "barrier" else head
            if name == "branch":
                args = head[:15] + (m_dx // rows,)

            def run(k=k, args=args, grid=coop if name == "barrier" else progs,
                    opts={"launch_cooperative_grid": True} if name == "barrier" else {}):
                count.zero_()
                k[(grid,)](*args, count, *consts, True, num_warps=warps, **opts)
            fns[name] = run
        fns["default+zero"] = lambda: (count.zero_(), fns["default"]())
        ref = None
        for name, fn in fns.items():  # same dx and partials for every variant
            dx.zero_()
            part.zero_()
            fn()
            rows_ok = (m_dx if name in ("mask_only", "shipped_parked", "recompute_offsets", "branch")
                       else M)
            got = (dx[:rows_ok].clone(), part.clone())
            if ref is None:
                ref = got
            same_grid = name not in ("barrier", "default_coop_grid") or coop == progs
            # another grid: other partial rows (dx only compared)
            ok = torch.equal(got[0], ref[0][:rows_ok]) and (
                torch.equal(got[1], ref[1]) if same_grid else True)
            print(f"  {name}: {'same' if ok else 'DIFFERENT'}", flush=True)
        nbytes = 3 * x.numel() * x.element_size()
        times = {k: [] for k in fns}
        for _ in range(3):
            for name, fn in fns.items():
                times[name].append(do_bench(fn, warmup=10, rep=60, return_mode="median"))
        tag = f"{str(dtype).split('.')[-1]}-{M}x{N}"
        row = dict(shape=tag, plan=list(plan),
                   tbps={k: nbytes / sorted(v)[1] / 1e9 for k, v in times.items()}, ms=times)
        results.append(row)
        print(tag, " ".join(f"{k} {v:.2f}" for k, v in row["tbps"].items()), flush=True)
        del x, dy, dx, part
        torch.cuda.empty_cache()
    with open(f"{OUT}/parked_variants.json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
