"""Memory report: bytes saved for backward and peak bytes of forward + backward, fused vs torch.

    python benchmarks/dev/memory_report.py                  # CUDA if present, else CPU
    python benchmarks/dev/memory_report.py --device cuda --markdown

Saved bytes: the unique storages packed by ``torch.autograd.graph.saved_tensors_hooks`` while the
forward runs (what autograd keeps alive until backward). Peak bytes (CUDA only): the rise of
``torch.cuda.max_memory_allocated`` above the starting point during one forward + backward
(input/parameter clones, output, saved tensors, gradients and any kernel scratch), measured after
a warm-up call. The same measurements back the assertions in tests/test_memory.py.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import fusedops
from fusedops import fused_layernorm, fused_softmax
from fusedops.tools.memory import peak_bytes, saved_bytes

SHAPES = [(4096, 1024), (1024, 4096), (64, 70000), (8, 2 * 16384), (16384, 64)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_fns(op: str, fused: bool, x, w, b, dy):
    n = x.shape[-1]

    def forward(leaves):
        if op == "softmax":
            return (fused_softmax if fused else torch.softmax)(leaves[0], -1)
        return (fused_layernorm if fused else F.layer_norm)(leaves[0], (n,), *leaves[1:])

    def leaves():
        return [t.clone().requires_grad_(True) for t in (x, w, b)]

    def saved_only():
        forward(leaves())

    def step():
        y = forward(leaves())
        y.backward(dy)

    return saved_only, step


def fmt_mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.add_argument("--layernorm-backward", choices=["fast", "low_memory"],
                   default=fusedops.get_layernorm_backward(),
                   help="fusedops.set_layernorm_backward mode for the fused runs (default: the "
                        "current one)")
    args = p.parse_args()
    fusedops.set_layernorm_backward(args.layernorm_backward)
    print(f"LayerNorm backward mode: {args.layernorm_backward}")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    header = ["op", "shape", "dtype", "saved fused MiB", "saved torch MiB", "saved ratio",
              "peak fused MiB", "peak torch MiB", "peak ratio"]
    rows = []
    for op in ("softmax", "layernorm"):
        for m, n in SHAPES:
            for name in args.dtypes:
                dtype = DTYPES[name]
                g = torch.Generator().manual_seed(0)
                x = torch.randn(m, n, generator=g).to(dtype).to(device)
                dy = torch.randn(m, n, generator=g).to(dtype).to(device)
                w = torch.randn(n, generator=g).to(dtype).to(device)
                b = torch.randn(n, generator=g).to(dtype).to(device)
                result = {}
                for fused in (True, False):
                    saved_only, step = make_fns(op, fused, x, w, b, dy)
                    saved = saved_bytes(saved_only)[0]
                    peak = peak_bytes(step) if cuda else None
                    result[fused] = (saved, peak)
                (sf, pf), (st, pt) = result[True], result[False]
                rows.append([
                    op, f"{m}x{n}", name, fmt_mib(sf), fmt_mib(st), f"{sf / st:.3f}",
                    fmt_mib(pf), fmt_mib(pt), "-" if pf is None else f"{pf / pt:.3f}",
                ])
                del x, dy, w, b
                if cuda:
                    torch.cuda.empty_cache()
    print(f"device: {torch.cuda.get_device_name(device) if cuda else 'cpu'}; "
          f"torch {torch.__version__}")
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
