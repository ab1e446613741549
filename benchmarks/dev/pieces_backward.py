"""RMSNorm backward on long aligned rows in thread-block clusters of streamed pieces
(``rms_bwd_pieces``): the launch rules against candidate ``PIECES_BWD`` rules forced through
``configs.override``, in one run (Hopper or newer).

    PYTHONPATH=$PWD python benchmarks/dev/pieces_backward.py --out pieces_backward.json
    PYTHONPATH=$PWD python benchmarks/dev/pieces_backward.py --dtypes bf16 --sizes 65536
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/dev/pieces_backward.py --smoke

For each dtype (bf16, fp16, float32) and row length (16K-256K by default; M = 2^27 // N rows,
2^26 // N for float32, so every tensor is far larger than L2), the backend's backward entry
point with the forward's saved rstd, as ``RMSNormFunction.backward`` calls it::

    fusedops.backends.triton.rmsnorm_backward(dy, x, w, rstd, True, True, grad_dtypes=(dt,))

under ``rules`` (the shipped rules), ``no pieces`` (``PIECES_BWD`` emptied: the rules before
it) and each candidate ``pieces PxKxW``: pieces of P elements in chunks of K on W warps, as a
one-entry ``PIECES_BWD`` (C = N / P programs per cluster, as many clusters as the GPU holds at
once; ``--candidates`` replaces the default list). Each variant's first call (without
``grad_dtypes``: such a call records its own launches for a replay plan; dweight in float32)
runs with its launches recorded: a candidate must launch ``rms_bwd_pieces`` with those
parameters and match the rules' dx and dweight (bf16 rtol 1.6e-2, fp16 1e-3, float32 1e-4);
one that does not is reported and not timed. ``copy`` (1.5·M·N elements, the 3·M·N·elt bytes
of x, dy and dx) is timed beside them. Times: ``do_bench``
medians (L2 flushed), every variant timed twice in alternating order (the lower kept); TB/s of
3·M·N·elt plus the weight and dweight, and each as a fraction of the same case's copy.
``--smoke`` (the interpreter, which has no clusters) runs the rules once on tiny rows.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from cluster_forward import DTYPES, checked_variants, meta, timed_records
from rmsnorm_unaligned import print_records, time_alternating

from fusedops.backends.triton import rmsnorm_backward, rmsnorm_forward
from fusedops.backends.triton.runtime.clusters import CLUSTER_SIZES

SIZES = (16384, 32768, 65536, 131072, 262144)
# (piece, CHUNK, warps): at most four chunks a piece (the kernel's dweight accumulators)
CANDIDATES = ((4096, 4096, 8), (8192, 4096, 8), (8192, 2048, 8), (8192, 2048, 16),
              (16384, 4096, 32), (16384, 8192, 32))
RTOL = {"bf16": 1.6e-2, "fp16": 1e-3, "fp32": 1e-4}
EPS = 1e-6
# positions of L, CHUNK and C in rms_bwd_pieces' launch arguments
I_PIECE, I_CHUNK, I_C = 12, 13, 14


def variants(n: int, smoke: bool, candidates: tuple = CANDIDATES
             ) -> dict[str, tuple[dict, tuple | None]]:
    """name -> (RMSNorm overrides, the launch a candidate must make, or None)."""
    out: dict[str, tuple[dict, tuple | None]] = {"rules": ({}, None),
                                                 "no pieces": ({"PIECES_BWD": {}}, None)}
    for piece, chunk, warps in () if smoke else candidates:
        c = n // piece
        if c not in CLUSTER_SIZES or n % piece:
            continue
        table = {el: ((n, n, (piece, chunk, warps)),) for el in (2, 4)}
        out[f"pieces {piece}x{chunk}x{warps}"] = (
            {"PIECES_BWD": table},
            ("rms_bwd_pieces", {I_PIECE: piece, I_CHUNK: chunk, I_C: c}, warps))
    return out


def run_case(dtype: str, n: int, smoke: bool, device: torch.device,
             candidates: tuple = CANDIDATES) -> list[dict]:
    dt = DTYPES[dtype]
    elt = torch.empty((), dtype=dt).element_size()
    m = 3 if smoke else (1 << (27 if elt == 2 else 26)) // n
    g = torch.Generator().manual_seed(n)
    x = (2 * torch.randn(m, n, generator=g)).to(device, dt)
    dy = torch.randn(m, n, generator=g).to(device, dt)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(device, dt)
    with torch.no_grad():
        _, rstd = rmsnorm_forward(x, w, EPS, dt)
    nbytes = 3 * m * n * elt + 2 * n * elt
    src = torch.empty(m * n * 3 // 2, dtype=dt, device=device)
    dst = torch.empty_like(src)

    def call() -> tuple:
        return rmsnorm_backward(dy, x, w, rstd, True, True, grad_dtypes=(dt,))

    def recorded() -> tuple:  # (a call with grad_dtypes records its own launches, for a plan)
        return rmsnorm_backward(dy, x, w, rstd, True, True)

    fns: dict[str, tuple[Callable[[], object], dict]] = {"copy": (lambda: dst.copy_(src), {})}

    def differs(out: tuple, ref: tuple) -> list[str]:
        problems = []
        for got, want, what in zip(out, ref, ("dx", "dweight"), strict=True):
            try:
                torch.testing.assert_close(got.float(), want.float(), rtol=RTOL[dtype],
                                           atol=1e-4)
            except AssertionError as e:
                problems.append(f"{what} differs from the rules': {str(e)[:200]}")
        return problems

    records = checked_variants(variants(n, smoke, candidates), "rmsnorm", recorded, call,
                               differs, fns)
    times = time_alternating(fns, "rmsnorm", smoke)
    return timed_records(times, fns, records,
                         {"op": "rmsnorm_bwd", "dtype": dtype, "N": n, "M": m}, nbytes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="pieces_backward.json")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    p.add_argument("--candidates", nargs="+", default=None, metavar="PxKxW",
                   help="candidate (piece, CHUNK, warps) triples (default: CANDIDATES)")
    p.add_argument("--smoke", action="store_true", help="tiny rows, no timing (interpreter)")
    args = p.parse_args()
    candidates = (tuple(tuple(int(v) for v in c.split("x")) for c in args.candidates)
                  if args.candidates else CANDIDATES)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records = []
    for dtype in args.dtypes:
        for n in [256] if args.smoke else args.sizes:
            records += run_case(dtype, n, args.smoke, device, candidates)
            with open(args.out, "w") as f:  # (rewritten after every case)
                json.dump({"meta": meta(device), "records": records}, f, indent=1)
    print_records(records, 24)


if __name__ == "__main__":
    main()
