"""Run every Triton kernel variant once on small shapes and check it against float64 torch.

Meant to run under NVIDIA's compute-sanitizer (see docs/reliability.md):

    compute-sanitizer --tool memcheck  python benchmarks/dev/sanitize_kernels.py
    compute-sanitizer --tool racecheck python benchmarks/dev/sanitize_kernels.py

Shapes are small (a few rows) so the sanitizer's slowdown stays bearable; each case is still
checked against a float64 reference with the tests' tolerance table (tests/conftest.py), so a
kernel that skips work without an error fails here too. Every launcher of fusedops/backends/triton/softmax.py
and layernorm.py (the module attributes named ``_launch_*``) is wrapped to count its launches;
the run fails if any of them never launched, so a new variant of those kernels without a case
here is noticed. The RMSNorm, masked-softmax, LayerNorm-epilogue and cluster kernels have no
cases here yet.

Variants: softmax forward/backward single-block (aligned rows and, as an aligned body
plus element-wise edges, unaligned ones), looped (single-block limit shrunk to 256), the
backward's reload variant (16-bit N = 4000), the unrolled forwards and backward (16-bit N =
4096, 65536, 65537), split-row (N = 2 x 16384 and 6 x 16384 + 5, M = 3);
LayerNorm forward single/looped/reload (N = 12000)/split-row, the fused backward with
per-program dweight/dbias partials, the dx row kernel (single/looped) with the column
dweight/dbias kernel (FUSED_BWD_MAX_BLOCK = 0 forces it at short rows), the partial-sum kernel,
each with no affine, weight only, bias only and both, with and without dx; float32 and
bfloat16, half activations with float32 parameters, strided inputs and zero-stride gradients.

Exit status: 0 when every case matched and every kernel ran, 1 on a mismatch, 3 when some
kernel never ran (e.g. the cooperative split-row launch was refused). ``--device cpu`` runs the
same cases through Triton's interpreter as a smoke test (no split-row kernels there).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: Triton's interpreter (smoke test of this script)")
    return p.parse_args()


ARGS = parse_args()
os.environ["TRITON_INTERPRET"] = "1" if ARGS.device == "cpu" else "0"  # before Triton loads

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from conftest import TOLERANCES  # noqa: E402  (the tests' one tolerance table)

import fusedops  # noqa: E402
from fusedops.backends.triton import configs  # noqa: E402
from fusedops.backends.triton import layernorm as tln  # noqa: E402
from fusedops.backends.triton import layernorm_bwd as tlnb  # noqa: E402
from fusedops.backends.triton import softmax as tsm  # noqa: E402
from fusedops.backends.triton.runtime import launcher as rt_launcher  # noqa: E402
from fusedops.backends.triton.runtime import split as rt_split  # noqa: E402

DEV = torch.device(ARGS.device)
DTYPES = [torch.float32, torch.bfloat16]
LAUNCHES: Counter = Counter()
FAILURES: list[str] = []


class CountingLauncher:
    """Wraps a module-level launcher; counts launches that happened (split launchers return
    False when the cooperative launch was refused)."""

    def __init__(self, name: str, inner) -> None:
        self.name, self.inner = name, inner

    def __call__(self, *args, **kwargs):
        result = self.inner(*args, **kwargs)
        # Split launchers return the grid size, or 0/False when the launch was refused.
        if result is not False and not (isinstance(result, int) and result == 0):
            LAUNCHES[self.name] += 1
        return result

    def __getattr__(self, name: str):
        # Everything else (e.g. SplitLauncher.programs) is the wrapped launcher's.
        return getattr(self.inner, name)


def wrap_launchers() -> list[str]:
    names = []
    for module in (tsm, tln, tlnb):
        short = module.__name__.rsplit(".", 1)[-1]
        for attr in sorted(vars(module)):
            value = getattr(module, attr)
            if attr.startswith("_launch_") and isinstance(value, (rt_launcher.Launcher,
                                                                  rt_split.SplitLauncher)):
                name = f"{short}.{attr}"
                setattr(module, attr, CountingLauncher(name, getattr(module, attr)))
                names.append(name)
    return names


def close(name: str, got: torch.Tensor | None, want: torch.Tensor | None, dtype: torch.dtype,
          scale: float = 4.0) -> None:
    if want is None:
        if got is not None:
            FAILURES.append(f"{name}: expected no gradient")
        return
    atol, rtol = TOLERANCES[dtype]
    expected = want.to(got.dtype).to(torch.float64)
    try:
        torch.testing.assert_close(got.detach().to(torch.float64), expected, atol=atol * scale,
                                   rtol=rtol * scale)
    except AssertionError as exc:
        FAILURES.append(f"{name}: {str(exc).splitlines()[0]}")


def leaf(t: torch.Tensor | None, grad: bool = True) -> torch.Tensor | None:
    return None if t is None else t.detach().clone().requires_grad_(grad)


def softmax_case(name: str, x: torch.Tensor, dy: torch.Tensor) -> None:
    xl = leaf(x)
    y = fusedops.fused_softmax(xl, -1)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_(True)
    y64 = torch.softmax(x64, -1)
    y64.backward(dy.double())
    close(f"{name} y", y, y64, x.dtype, 1.0)
    close(f"{name} dx", xl.grad, x64.grad, x.dtype)


def layernorm_case(name: str, x, w, b, dy, need_x: bool = True) -> None:
    n = x.shape[-1]
    rows = x.numel() // n
    xl, wl, bl = leaf(x, need_x), leaf(w), leaf(b)
    y = fusedops.fused_layernorm(xl, n, wl, bl)
    y.backward(dy)
    x64, w64, b64 = (None if t is None else t.detach().double().requires_grad_(True)
                     for t in (x, w, b))
    y64 = F.layer_norm(x64, (n,), w64, b64)
    y64.backward(dy.double())
    close(f"{name} y", y, y64, x.dtype)
    close(f"{name} dx", xl.grad, x64.grad if need_x else None, x.dtype)
    for label, got, ref, p in (("dweight", wl, w64, w), ("dbias", bl, b64, b)):
        if p is not None:
            key = max((x.dtype, p.dtype), key=lambda d: TOLERANCES[d][1])
            close(f"{name} {label}", got.grad, ref.grad, key, 4.0 * rows**0.5)


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


def softmax_cases(dtype: torch.dtype) -> None:
    t = str(dtype).replace("torch.", "")
    softmax_case(f"softmax single {t}", randn(5, 1000, dtype=dtype), randn(5, 1000, dtype=dtype))
    wide = randn(5, 1100, dtype=dtype, seed=1)
    softmax_case(f"softmax single strided {t}", wide[:, 50:1050],
                 randn(1, 1000, dtype=dtype, seed=2).expand(5, 1000))
    # Unaligned rows: aligned body plus element-wise edges (the default).
    softmax_case(f"softmax unaligned {t}", randn(5, 1025, dtype=dtype, seed=3),
                 randn(5, 1025, dtype=dtype, seed=4))
    # rows of 1000: looped, 4 chunks (split rows off: they take any long row on CUDA)
    with configs.override(SINGLE_BLOCK_LIMIT=256, SPLIT_ROWS=False):
        softmax_case(f"softmax looped {t}", randn(3, 1000, dtype=dtype, seed=5),
                     randn(3, 1000, dtype=dtype, seed=6))
    # 16-bit rows of 4K: the backward's reload variant (row read whole, then again in chunks)
    softmax_case(f"softmax reload N=4000 {t}", randn(3, 4000, dtype=dtype, seed=9),
                 randn(3, 4000, dtype=dtype, seed=10))
    # Unrolled kernels (16-bit rules): aligned 4K rows forward; 65537 (unaligned, a 64K body)
    # forward and backward; 64K aligned backward. float32 rows of these take other kernels.
    for n in (4096, 65536, 65537):
        softmax_case(f"softmax unrolled N={n} {t}", randn(2, n, dtype=dtype, seed=11),
                     randn(2, n, dtype=dtype, seed=12))
    for n in (2 * 16384, 6 * 16384 + 5):
        softmax_case(f"softmax split N={n} {t}", randn(3, n, dtype=dtype, seed=7),
                     randn(3, n, dtype=dtype, seed=8))


def layernorm_cases(dtype: torch.dtype) -> None:
    t = str(dtype).replace("torch.", "")
    for affine in ("none", "weight", "bias", "both"):
        def params(n: int, pdtype: torch.dtype = dtype, affine: str = affine):
            w = randn(n, dtype=pdtype, seed=10) if affine in ("weight", "both") else None
            b = randn(n, dtype=pdtype, seed=11) if affine in ("bias", "both") else None
            return w, b

        tag = f"{affine} {t}"
        layernorm_case(f"layernorm single {tag}", randn(5, 1000, dtype=dtype),
                       *params(1000), randn(5, 1000, dtype=dtype, seed=1))
        wide = randn(6, 1100, dtype=dtype, seed=2)
        layernorm_case(f"layernorm single strided {tag}", wide[:, 7:1007], *params(1000),
                       randn(1, 1000, dtype=dtype, seed=3).expand(6, 1000))
        layernorm_case(f"layernorm unaligned {tag}", randn(5, 1025, dtype=dtype, seed=4),
                       *params(1025), randn(5, 1025, dtype=dtype, seed=5))
        # Split rows off too: LayerNorm's even-chunk split kernels take any long row on CUDA.
        with configs.override(SINGLE_BLOCK_LIMIT=256, SPLIT_ROWS=False):
            layernorm_case(f"layernorm looped {tag}", randn(3, 1000, dtype=dtype, seed=6),
                           *params(1000), randn(3, 1000, dtype=dtype, seed=7))
        # dx row kernel + column dweight/dbias kernel at short rows
        with configs.override("layernorm", FUSED_BWD_MAX_BLOCK=0):
            layernorm_case(f"layernorm column-kernel {tag}", randn(70, 1000, dtype=dtype, seed=8),
                           *params(1000), randn(70, 1000, dtype=dtype, seed=9))
            if affine != "none":  # dweight/dbias only (x needs no gradient)
                layernorm_case(f"layernorm column-kernel params-only {tag}",
                               randn(9, 300, dtype=dtype, seed=12), *params(300),
                               randn(9, 300, dtype=dtype, seed=13), need_x=False)
        if affine != "none":  # the fused backward with partials only
            layernorm_case(f"layernorm params-only {tag}", randn(40, 300, dtype=dtype, seed=14),
                           *params(300), randn(40, 300, dtype=dtype, seed=15), need_x=False)
        # rows padded to 16K: the forward's reload kernel (row read whole, then in chunks)
        layernorm_case(f"layernorm reload N=12000 {tag}", randn(3, 12000, dtype=dtype, seed=24),
                       *params(12000), randn(3, 12000, dtype=dtype, seed=25))
        # 16-bit rows of 2^k + 1: the reload kernel for unaligned rows (+ shifted weights)
        layernorm_case(f"layernorm reload unaligned N=4097 {tag}",
                       randn(9, 4097, dtype=dtype, seed=30), *params(4097),
                       randn(9, 4097, dtype=dtype, seed=31))
        # (16-bit 32K / 96K+5 and 128K rows have unrolled forward rules; float32 128K does not)
        for n in (2 * 16384, 6 * 16384 + 5, 8 * 16384):
            layernorm_case(f"layernorm split N={n} {tag}", randn(3, n, dtype=dtype, seed=20),
                           *params(n), randn(3, n, dtype=dtype, seed=21))
        if affine == "both":  # both LayerNorm backward modes (low_memory: scratch in dx)
            for mode in ("fast", "low_memory"):
                with fusedops.layernorm_backward_mode(mode):
                    for m, n in ((40, 32768), (3, 32768), (70, 1000), (2, 1000), (256, 8193)):
                        # 40 rows: the split kernel writes dx before its parked scratch and
                        # ln_bwd_dx_published the rest; 3 rows: no room, all rows from
                        # ln_bwd_dx_pieces; 70 / 2 rows: the fused kernel's parked variant and
                        # its second launch / no room; 8193: the aligned-body variant
                        layernorm_case(f"layernorm {mode} {m} x {n} {tag}",
                                       randn(m, n, dtype=dtype, seed=26), *params(n),
                                       randn(m, n, dtype=dtype, seed=27))
                    layernorm_case(f"layernorm {mode} params-only {tag}",
                                   randn(40, 300, dtype=dtype, seed=28), *params(300),
                                   randn(40, 300, dtype=dtype, seed=29), need_x=False)
        if affine != "none":  # unaligned 8K bodies: the fused backward's body + edge variant
            layernorm_case(f"layernorm unaligned fused N=8193 {tag}",
                           randn(256, 8193, dtype=dtype, seed=22), *params(8193),
                           randn(256, 8193, dtype=dtype, seed=23))
    if dtype != torch.float32:  # half activations, float32 parameters
        w, b = randn(1000, seed=16), randn(1000, seed=17)
        layernorm_case(f"layernorm mixed-params {t}", randn(5, 1000, dtype=dtype, seed=18), w, b,
                       randn(5, 1000, dtype=dtype, seed=19))
        w, b = randn(4097, seed=16), randn(4097, seed=17)
        layernorm_case(f"layernorm mixed-params unaligned {t}",
                       randn(5, 4097, dtype=dtype, seed=18), w, b,
                       randn(5, 4097, dtype=dtype, seed=19))


def main() -> int:
    if DEV.type == "cuda" and not torch.cuda.is_available():
        print("sanitize_kernels: no CUDA device (use --device cpu for the interpreter)")
        return 2
    names = wrap_launchers()
    # Small inputs reach the forward's reload kernel for unaligned rows (normally only calls of
    # 2^24+ elements, where its extra launch pays off).
    with fusedops.use_backend("triton"), configs.override("layernorm", RELOAD_VEC_MIN_ELEMS=0):
        for dtype in DTYPES:
            for cases in (softmax_cases, layernorm_cases):
                try:
                    cases(dtype)
                except Exception:  # a launch error (or a sanitizer-reported abort) is a failure
                    FAILURES.append(f"{cases.__name__}({dtype}) raised:\n"
                                    + traceback.format_exc())
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    # The interpreter runs split rows on the looped kernels (and so never needs the dx of the
    # rows behind the split kernel's parked scratch).
    expected_missing = ({n for n in names if "split" in n
                         or n.endswith(("_dx_pieces", "_dx_published"))}
                        if DEV.type == "cpu" else set())
    missing = [n for n in names if LAUNCHES[n] == 0 and n not in expected_missing]
    print("kernel launches:")
    for n in names:
        print(f"  {n:32s} {LAUNCHES[n]:4d}")
    for f in FAILURES:
        print(f"MISMATCH: {f}")
    for n in missing:
        print(f"NOT EXERCISED: {n}")
    if FAILURES:
        print(f"FAIL: {len(FAILURES)} mismatches")
        return 1
    if missing:
        print(f"FAIL: {len(missing)} kernels never launched")
        return 3
    print("OK: every kernel variant ran and matched the float64 reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
