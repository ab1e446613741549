"""RMSNorm inference forward on aligned rows: the unrolled kernel's rule against today's kernels.

    PYTHONPATH=$PWD python benchmarks/dev/rmsnorm_unrolled.py --out rmsnorm_unrolled.json
    PYTHONPATH=$PWD python benchmarks/dev/rmsnorm_unrolled.py --dtypes bfloat16 --sizes 16384

For each dtype and row length N (16-bit: M·N = 2^27 elements, float32: 2^26) it times
``fusedops.fused_rmsnorm(x, (N,), w, 1e-6)`` under ``torch.no_grad`` (the weight in x's dtype)
with ``triton.testing.do_bench`` (median, L2 flushed between calls) under:

* ``current``: the rules without the unrolled kernel (``configs.override("rmsnorm",
  UNROLLED_FWD={})``: single-block, looped or split rows, as before rms_fwd_unrolled);
* ``new``: the shipped rules (``UNROLLED_FWD`` in ``configs/rmsnorm.py``);
* ``unrolled CxW``: rms_fwd_unrolled forced on chunk C and W warps (a one-entry table), up to
  ``--max-candidates`` configs per row whose chunk divides N, each thread holding one or two
  16-byte vectors per chunk, at most 16 chunks per row;
* ``compile``: ``torch.compile(lambda x, w: F.rms_norm(x, (N,), w, 1e-6))``, compiled once per
  dtype and N (static shapes);
* ``copy``: ``y.copy_(x)``, the bandwidth reference.

TB/s = (2·M·N·elt + N·w_elt) / time (copy: 2·M·N·elt / time), and each provider's fraction of
the copy's TB/s. The new rule's output is also compared with ``F.rms_norm`` in float32 math
(largest absolute difference, beside that of torch's own call in x's dtype). ``--out`` writes
every record as JSON. Needs a CUDA GPU; sized to finish in about 3 minutes on an H200 with
the defaults (``--max-candidates``, ``--no-compile`` and ``--rep`` shorten it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

import fusedops
from fusedops.backends.triton import configs
from fusedops.backends.triton.configs import rmsnorm as rms_rules
from fusedops.backends.triton.runtime.device import next_pow2
from fusedops.backends.triton.runtime.facts import device_facts

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SIZES_16BIT = (4096, 8192, 16384, 32768, 65536)
SIZES_FP32 = (8192, 16384)
CHUNKS = (1024, 2048, 4096, 8192, 16384)
WARPS = (4, 8, 16, 32)
EPS = 1e-6


def candidates(n: int, elt: int, limit: int, skip: tuple[int, int] | None) -> list[tuple[int, int]]:
    """(chunk, warps) configs of rms_fwd_unrolled for rows of ``n``: the chunk divides ``n``,
    each thread holds one or two 16-byte vectors of it, at most 16 chunks per row; nearest the
    shipped rule's chunk (``skip``, itself left out) first, at most ``limit``."""
    vec = 16 // elt
    found = [(c, w) for c in CHUNKS for w in WARPS
             if c <= n and n % c == 0 and n // c <= 16 and c // (32 * w) in (vec, 2 * vec)
             and (c, w) != skip]
    ref = skip[0] if skip else 4096
    found.sort(key=lambda cw: (abs(math.log2(cw[0] / ref)), cw[0], cw[1]))
    return found[:limit]


def describe(n: int, elt: int) -> str:
    """The kernel and launch parameters the rules in force give aligned rows of ``n``."""
    cfg = rms_rules.forward_config(n, elt, 0, True, device_facts(torch.cuda.current_device()),
                                   True)
    if cfg.kernel == "unrolled":
        return f"unrolled {cfg.chunk}x{cfg.warps}"
    if cfg.kernel == "single":
        return f"single {cfg.rows}x{cfg.warps}{' persistent' if cfg.persistent else ''}"
    if cfg.kernel == "split":
        return f"split {cfg.chunk}x{cfg.warps}"
    return f"{cfg.kernel} {cfg.block}x{cfg.warps}"


def bench(fn, warmup: int, rep: int) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


@torch.no_grad()
def run_case(dtype: torch.dtype, n: int, args: argparse.Namespace) -> tuple[list, dict]:
    """The records of every provider for rows of ``n`` in ``dtype``, and the new rule's check."""
    elt = torch.empty((), dtype=dtype).element_size()
    m = (1 << (27 if elt == 2 else 26)) // n
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(m, n, device="cuda", dtype=dtype, generator=g)
    w = (1 + 0.5 * torch.randn(n, device="cuda", generator=g)).to(dtype)
    nbytes = 2 * m * n * elt + n * w.element_size()
    key = (elt, next_pow2(n))

    def fused():
        return fusedops.fused_rmsnorm(x, (n,), w, EPS)

    rows = []

    def record(provider: str, config: str, ms: float, moved: int = nbytes) -> None:
        rows.append({"dtype": str(dtype).removeprefix("torch."), "N": n, "M": m,
                     "provider": provider, "config": config, "ms": ms,
                     "tbps": moved / (ms * 1e-3) / 1e12})

    y = torch.empty_like(x)
    record("copy", "y.copy_(x)", bench(lambda: y.copy_(x), args.warmup, args.rep),
           2 * m * n * elt)
    del y
    with configs.override("rmsnorm", UNROLLED_FWD={}):
        record("current", describe(n, elt), bench(fused, args.warmup, args.rep))
    new_cfg = describe(n, elt)
    record("new", new_cfg, bench(fused, args.warmup, args.rep))
    # The new rule's result against float32 math, beside torch's own call in x's dtype.
    ref = F.rms_norm(x.float(), (n,), w.float(), EPS)
    diff = (fused().float() - ref).abs().max().item()
    torch_diff = (F.rms_norm(x, (n,), w, EPS).float() - ref).abs().max().item()
    del ref
    check = {"dtype": str(dtype).removeprefix("torch."), "N": n, "config": new_cfg,
             "max_abs_diff": diff, "torch_max_abs_diff": torch_diff}
    rule = rms_rules.UNROLLED_FWD.get(key, ())
    shipped = next(((c, wp) for c, wp in rule if n % c == 0), None)
    for chunk, warps in candidates(n, elt, args.max_candidates, shipped):
        with configs.override("rmsnorm", UNROLLED_FWD={key: ((chunk, warps),)}):
            record("unrolled", f"unrolled {chunk}x{warps}", bench(fused, args.warmup, args.rep))
    if not args.no_compile:
        torch._dynamo.reset()  # a fresh compile per shape: no shared cache, no dynamic shapes
        compiled = torch.compile(lambda a, b: F.rms_norm(a, (n,), b, EPS), dynamic=False)
        compiled(x, w)
        record("compile", "torch.compile", bench(lambda: compiled(x, w), args.warmup, args.rep))
    copy_tbps = rows[0]["tbps"]
    for r in rows:
        r["frac_copy"] = r["tbps"] / copy_tbps
    return rows, check


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the records as JSON to this path")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--sizes", nargs="+", type=int,
                   help=f"row lengths (default: 16-bit {SIZES_16BIT}, float32 {SIZES_FP32})")
    p.add_argument("--max-candidates", type=int, default=6,
                   help="forced unrolled configs per dtype and N (default 6)")
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms (default 25)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms (default 100)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("rmsnorm_unrolled.py needs a CUDA GPU")
    start = time.time()
    records, checks = [], []
    for name in args.dtypes:
        dtype = DTYPES[name]
        sizes = args.sizes or (SIZES_FP32 if dtype == torch.float32 else SIZES_16BIT)
        for n in sizes:
            rows, check = run_case(dtype, n, args)
            records += rows
            checks.append(check)
            best = max((r for r in rows if r["provider"] != "copy"), key=lambda r: r["tbps"])
            print(f"[{time.time() - start:5.0f} s] {name} {n}: best {best['config']} "
                  f"{best['frac_copy']:.3f} of copy", flush=True)
            torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, Triton {__import__('triton').__version__}, "
          f"torch {torch.__version__}")
    print(f"{'dtype':9} {'N':>6} {'M':>6} {'provider':9} {'config':24} {'ms':>8} {'TB/s':>6} "
          f"{'copy':>6}")
    for r in records:
        print(f"{r['dtype']:9} {r['N']:>6} {r['M']:>6} {r['provider']:9} {r['config']:24} "
              f"{r['ms']:8.4f} {r['tbps']:6.3f} {r['frac_copy']:6.3f}")
    print("\nnew rule vs F.rms_norm in float32 math (max abs diff; torch's own call beside)")
    for c in checks:
        print(f"{c['dtype']:9} {c['N']:>6} {c['config']:24} {c['max_abs_diff']:.3e} "
              f"(torch {c['torch_max_abs_diff']:.3e})")
    print(f"\n{time.time() - start:.0f} s")
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "triton": __import__("triton").__version__,
                "torch": torch.__version__, "eps": EPS}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "records": records, "checks": checks}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
