"""Runs the Metal kernels on OS threads under ThreadSanitizer + UBSan (a subprocess of
tests/test_metal_sanitizers.py, started with LD_PRELOAD=libtsan.so).

    python -m metal_emu.sanitize_check [--remove-barrier FILE:LINE]

Without --mutant: every kernel template (softmax, LayerNorm, RMSNorm, masked softmax, LayerNorm
epilogue in both thread layouts; both variants, forward and backward, threadgroups owning several
rows, aligned and misaligned rows) runs once on the
shipped shaders and is checked against a float64 reference; prints "CLEAN-DONE" at the end.
Any TSan or UBSan report makes the process exit non-zero (halt_on_error).

With --remove-barrier FILE:LINE: the same with the threadgroup_barrier at that call site
removed (EmuLibrary.remove_barriers), expecting ThreadSanitizer to report a data race.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from conftest import assert_close_to_ref

from fusedops.backends.metal import epilogue as metal_epilogue
from fusedops.backends.metal import norms as metal_norms
from fusedops.backends.metal import rules as metal_rules
from fusedops.backends.metal import softmax as metal_softmax
from metal_emu import emu


def close(actual, expected, dtype, scale=1.0):
    """The shared tolerance table (tests/conftest.py), reference rounded to actual's dtype."""
    assert_close_to_ref(actual, expected, dtype, scale)


def run_cases(L) -> None:
    torch.manual_seed(0)
    for n, layout in ((150, "contiguous"), (500, "misaligned"), (700, "contiguous")):
        m = 5
        base = torch.randn(m, n + 3)
        x = base[:, 1:n + 1] if layout == "misaligned" else torch.randn(m, n)
        xh = x.half()
        y = metal_softmax.softmax_forward_with(L, xh, torch.float32)
        close(y, torch.softmax(xh.double(), -1), torch.float32)
        dy = torch.randn(m, n)
        dx = metal_softmax.softmax_backward_with(L, y, dy, torch.float16)
        y64 = y.double()
        close(dx, y64 * (dy.double() - (y64 * dy.double()).sum(-1, keepdim=True)),
              torch.float16)
        w, b = torch.randn(n), torch.randn(n)
        xb = x.bfloat16()
        yl, mean, rstd = metal_norms.layernorm_forward_with(L, xb, w, b, 1e-5, torch.bfloat16)
        close(yl, F.layer_norm(xb.double(), (n,), w.double(), b.double(), 1e-5),
              torch.bfloat16)
        dyb = torch.randn(m, n).bfloat16()
        dxl, dw, db = metal_norms.layernorm_backward_with(L, dyb, xb, w, mean, rstd, True, True,
                                                    True)
        x64 = xb.double().requires_grad_()
        w64 = w.double().requires_grad_()
        b64 = b.double().requires_grad_()
        F.layer_norm(x64, (n,), w64, b64, 1e-5).backward(dyb.double())
        close(dxl, x64.grad, torch.bfloat16, scale=2)
        close(dw, w64.grad, torch.float32, scale=10)
        close(db, b64.grad, torch.float32, scale=10)
        xh = x.half()
        yr, rstd = metal_norms.rmsnorm_forward_with(L, xh, w, 1e-5, torch.float32)
        x64 = xh.double().requires_grad_()
        w64 = w.double().requires_grad_()
        yr64 = F.rms_norm(x64, (n,), w64, 1e-5)
        close(yr, yr64.detach(), torch.float32, scale=10)
        dyh = torch.randn(m, n).half()
        dxr, dwr = metal_norms.rmsnorm_backward_with(L, dyh, xh, w, rstd, True, True)
        yr64.backward(dyh.double())
        close(dxr, x64.grad, torch.float16, scale=4)
        close(dwr, w64.grad, torch.float32, scale=10)
        run_epilogue_cases(L, x, m, n, w, b)


def run_epilogue_cases(L, x, m, n, w, b) -> None:
    """Masked softmax (broadcast bool mask, causal) and the LayerNorm epilogue (residual,
    dropout, GELU; its backward with ds) on the rows x."""
    from fusedops import _philox

    xh = x.half().reshape(1, 1, m, n)
    mask = (torch.rand(1, 1, 1, n) > 0.3).expand(1, 1, m, n)
    y = metal_softmax.softmax_masked_forward_with(L, xh, mask, 0.5, True, torch.float32)
    z = (xh.double() * 0.5).masked_fill(~mask, -torch.inf)
    z = z.masked_fill(torch.ones(m, n, dtype=torch.bool).triu(1), -torch.inf)
    y64 = torch.softmax(z, -1).nan_to_num(0.0)
    close(y, y64, torch.float32)
    dy = torch.randn(m, n)
    dx = metal_softmax.softmax_masked_backward_with(L, y.view(m, n), dy, 0.5, torch.float16)
    yv = y.view(m, n).double()
    close(dx, 0.5 * yv * (dy.double() - (yv * dy.double()).sum(-1, keepdim=True)),
          torch.float16)
    r = torch.randn(m, n)
    out, s, mean, rstd = metal_epilogue.layernorm_epilogue_forward_with(L, x, r, w, b, 1e-5,
                                                               torch.float32, 0.25, 11, "gelu",
                                                               True)
    keep = _philox.keep_mask(11, m, n, 0.25).double() / 0.75
    s64 = (x + r).double().requires_grad_()
    w64 = w.double().requires_grad_()
    out64 = F.gelu(F.layer_norm(s64, (n,), w64, b.double(), 1e-5) * keep)
    close(out, out64.detach(), torch.float32, scale=10)
    dout, ds = torch.randn(m, n), torch.randn(m, n)
    dxe, dwe, _ = metal_epilogue.layernorm_epilogue_backward_with(L, dout, ds, s, w, b, mean, rstd,
                                                                  0.25,
                                                         11, "gelu", True, True, True)
    out64.backward(dout.double())
    close(dxe, s64.grad + ds.double(), torch.float32, scale=10)
    close(dwe, w64.grad, torch.float32, scale=10)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--remove-barrier", metavar="FILE:LINE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Two threadgroups for 5 rows: each threadgroup reuses its threadgroup memory across rows.
    metal_rules.MAX_ROW_GROUPS = 2
    metal_rules.LN_BWD_MIN_GROUPS = 1
    metal_rules.LN_BWD_MAX_GROUPS = 2
    lib = emu.load(variant="tsan")
    if args.remove_barrier:
        fname, line = args.remove_barrier.rsplit(":", 1)
        lib.remove_barriers([(fname, int(line))])
    lib.set_mode("threads")
    lib.set_timeout(120)
    # 128 threads: 4 SIMD-groups, single-row up to 512 columns, looped above.
    run_cases(emu.EmuLauncher(lib, 128))
    # 256 threads: the LayerNorm epilogue's Philox layout (columns 256 apart) with dropout,
    # single-row (n <= 1024) and looped.
    torch.manual_seed(1)
    for n in (150, 1100):
        run_epilogue_cases(emu.EmuLauncher(lib, 256), torch.randn(3, n), 3, n, torch.randn(n),
                           torch.randn(n))
    print("CLEAN-DONE", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
