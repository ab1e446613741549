"""What ``python -m fusedops bench`` sweeps, and the models its numbers are made of.

* ops ``softmax_fwd``, ``softmax_bwd``, ``layernorm_fwd``, ``layernorm_bwd`` (dx + dweight +
  dbias), ``rmsnorm_fwd``, ``rmsnorm_bwd`` (dx + dweight) x dtypes bf16/fp32/fp16 x row length
  N, each at ``M = total // N`` rows (``total`` = 2^27 elements by default, far larger than any
  L2);
* the minimum bytes an ideal kernel moves (:func:`bytes_moved`) and the FLOP counts
  (:data:`FLOPS_PER_ELEMENT`) behind every TB/s and GFLOP/s;
* the names the command line accepts (:func:`resolve_ops`, ...), the speed-up of each provider
  against every other (:func:`annotate_speedups`) and a time estimate (:func:`plan`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fusedops.tools.bench_harness import parse_size, split_list
from fusedops.tools.bench_providers import FAMILIES, PROVIDER_NAMES, all_providers
from fusedops.tools.cli import UsageError

OPS = ("softmax_fwd", "softmax_bwd", "layernorm_fwd", "layernorm_bwd", "rmsnorm_fwd",
       "rmsnorm_bwd")
SIZES = (256, 512, 768, 1024, 2048, 4096, 8192, 8193, 16384, 32768, 65536, 65537, 131072,
         262144)
TOTAL_ELEMENTS = 2**27
QUICK = {
    "dtypes": ("bf16",),
    "sizes": (1024, 8193, 16384, 65536, 65537, 262144),
}
# Small shapes whose cost is host work (Python, dispatch, launch), not memory traffic.
HOST_LATENCY_SHAPES = ((4, 128), (64, 768), (8, 128, 768))
HOST_LATENCY_OPS = ("softmax_fwd", "layernorm_fwd", "rmsnorm_fwd")

# FLOPs per element of the (M, N) input, counting exp/rsqrt as one FLOP and a compare (max) as one.
FLOPS_PER_ELEMENT = {
    # max, subtract, exp, sum, scale by 1/sum
    "softmax_fwd": 5,
    # dy*y, sum, dy - dot, y * (.)
    "softmax_bwd": 4,
    # sum (mean), subtract, square, sum (var), * rstd, * weight, + bias
    "layernorm_fwd": 7,
    # xhat (sub, mul), w*dy, sum(w*dy*xhat) (mul, add), sum(w*dy) (add),
    # dx = (w*dy - (xhat*c1 + c2)) * rstd (4), dweight += dy*xhat (2), dbias += dy (1)
    "layernorm_bwd": 13,
    # square, sum, * rstd, * weight
    "rmsnorm_fwd": 4,
    # xhat = x*rstd (1), g = w*dy (1), c = row sum of xhat*g / N (2),
    # dx = (g - xhat*c) * rstd (3), dweight += dy*xhat (2)
    "rmsnorm_bwd": 9,
}
FLOP_MODEL = {
    "softmax_fwd": "5 flops/element: max, subtract, exp, sum, scale",
    "softmax_bwd": "4 flops/element: dy*y, row sum, subtract, multiply",
    "layernorm_fwd": "7 flops/element: mean sum, subtract, square, var sum, *rstd, *w, +b",
    "layernorm_bwd": "13 flops/element: xhat (2), w*dy (1), two row sums (3), dx (4), "
    "dweight (2), dbias (1)",
    "rmsnorm_fwd": "4 flops/element: square, sum, *rstd, *w",
    "rmsnorm_bwd": "9 flops/element: xhat (1), w*dy (1), row sum of xhat*w*dy (2), "
    "dx = (w*dy - xhat*c)*rstd (3), dweight (2)",
}
BYTES_MODEL = {
    "softmax_fwd": "2*M*N*elt (read x, write y)",
    "softmax_bwd": "3*M*N*elt (read y and dy, write dx)",
    "layernorm_fwd": "2*M*N*elt + 2*N*welt (read x, w, b; write y)",
    "layernorm_bwd": "3*M*N*elt + 3*N*welt + 8*M (read x, dy, w, mean, rstd; write dx, dw, db)",
    "rmsnorm_fwd": "2*M*N*elt + N*welt (read x, w; write y)",
    "rmsnorm_bwd": "3*M*N*elt + 2*N*welt + 4*M (read x, dy, w, rstd; write dx, dw)",
}
# A provider is "slower" than another only beyond this relative margin (run-to-run noise).
NOISE = 0.02
# The reason of a compile-provider record skipped because the compile budget was spent.
COMPILE_BUDGET = "compile budget spent"


def family(op: str) -> str:
    return op.split("_")[0]


def is_backward(op: str) -> bool:
    return op.endswith("_bwd")


def bytes_moved(op: str, M: int, N: int, elt: int, welt: int | None = None) -> int:
    """Minimum bytes an ideal kernel moves: each input read once, each output written once.

    ``elt`` is the element size of x/y/dy/dx, ``welt`` that of weight/bias and their grads
    (defaults to ``elt``). LayerNorm backward also reads the float32 mean and rstd (8 B per row),
    RMSNorm backward the float32 rstd (4 B per row).
    """
    welt = elt if welt is None else welt
    if op == "softmax_fwd":
        return 2 * M * N * elt
    if op == "softmax_bwd":
        return 3 * M * N * elt
    if op == "layernorm_fwd":
        return 2 * M * N * elt + 2 * N * welt
    if op == "layernorm_bwd":
        return 3 * M * N * elt + 3 * N * welt + 8 * M
    if op == "rmsnorm_fwd":
        return 2 * M * N * elt + N * welt
    if op == "rmsnorm_bwd":
        return 3 * M * N * elt + 2 * N * welt + 4 * M
    raise ValueError(f"unknown op {op!r}; expected one of {OPS}")


def flops(op: str, M: int, N: int) -> int:
    """FLOPs of one call, from :data:`FLOPS_PER_ELEMENT`."""
    if op not in FLOPS_PER_ELEMENT:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    return FLOPS_PER_ELEMENT[op] * M * N


def rows_for(N: int, total: int = TOTAL_ELEMENTS) -> int:
    """M = total // N (at least one row)."""
    return max(1, total // N)


# --- names on the command line -------------------------------------------------------------------


def resolve_ops(ops: str | Sequence[str] | None) -> tuple[str, ...]:
    """'all', op names, or shorthands: a family ('softmax', 'layernorm', 'rmsnorm'), 'fwd',
    'bwd', and the prefixes 'ln_' / 'rms_' for 'layernorm_' / 'rmsnorm_' ('rms_bwd')."""
    if ops is None:
        return OPS
    names = split_list(ops) or []
    if names == ["all"]:
        return OPS
    chosen: list[str] = []
    for name in names:
        name = name.lower().replace("-", "_")
        for short, full in (("ln_", "layernorm_"), ("rms_", "rmsnorm_")):
            if name.startswith(short):
                name = full + name[len(short):]
        if name in OPS:
            match = [name]
        elif name in FAMILIES:
            match = [o for o in OPS if family(o) == name]
        elif name in ("fwd", "bwd"):
            match = [o for o in OPS if o.endswith(name)]
        else:
            raise UsageError(
                f"unknown op {name!r}; choose from {OPS}, {', '.join(FAMILIES)}, fwd, bwd"
            )
        chosen.extend(o for o in match if o not in chosen)
    return tuple(o for o in OPS if o in chosen)


def resolve_sizes(sizes: str | Sequence[int | str] | None) -> tuple[int, ...]:
    if sizes is None:
        return SIZES
    if isinstance(sizes, str):
        sizes = split_list(sizes) or []
    out = []
    for s in sizes:
        try:
            n = s if isinstance(s, int) else parse_size(str(s))
        except ValueError:
            raise UsageError(f"bad size {s!r}: expected e.g. 1024, 1K, 64K+1 or 2^17") from None
        if n < 1:
            raise UsageError(f"sizes must be positive, got {s!r}")
        if n not in out:
            out.append(n)
    return tuple(out)


def resolve_providers(providers: str | Sequence[str] | None) -> tuple[str, ...]:
    names = split_list(providers)
    if not names or names == ["all"]:
        return PROVIDER_NAMES
    out = []
    for n in names:
        n = n.lower()
        n = {"eager": "torch", "inductor": "compile", "torch.compile": "compile",
             "liger-kernel": "liger", "quack-kernels": "quack", "unfused": "naive"}.get(n, n)
        if n not in PROVIDER_NAMES:
            raise UsageError(f"unknown provider {n!r}; choose from {PROVIDER_NAMES}")
        if n not in out:
            out.append(n)
    # Keep the canonical order so tables and plots are stable.
    return tuple(p for p in PROVIDER_NAMES if p in out)


# --- speed-ups and the plan ----------------------------------------------------------------------


def annotate_speedups(records: list[dict]) -> None:
    """Add ``speedup`` = {other provider: other_ms / this_ms} to every timed record."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["op"], r["dtype"], r["N"]), []).append(r)
    for group in groups.values():
        for r in group:
            r["speedup"] = {
                o["provider"]: (o["ms"] / r["ms"])
                for o in group
                if o is not r and r.get("ms") and o.get("ms")
            }


def plan(ops: Sequence[str], dtypes: Sequence[str], sizes: Sequence[int],
         providers: Sequence[str], warmup_ms: float, rep_ms: float,
         compile_s_per_shape: float = 1.5, jit_s_per_kernel: float = 0.3,
         ahead_ms: tuple[float, float] = (20.0, 70.0),
         cute_s_per_kernel: float = 2.0) -> dict[str, Any]:
    """Point counts and a rough time estimate (seconds) for a sweep on a GPU.

    Per timed measurement: warmup + rep + ~45 ms (first call, correctness check, do_bench's own
    estimate, data and cleanup), plus its GPU-ahead time (``ahead_ms``: forward, backward; the
    GPU sleep of :meth:`~fusedops.tools.bench_harness.Timer.gpu_ahead` and 31 calls); per
    compiled shape (one per op family, dtype and N): ``compile_s_per_shape``; per Triton kernel
    specialisation of fusedops/Liger (one per op, dtype and block size): ``jit_s_per_kernel``;
    per QuACK kernel (CuTe DSL compiles one per op, dtype and N; a guess until a sweep with
    QuACK is timed): ``cute_s_per_kernel``. For scale: the full four-op sweep in
    ``benchmarks/results/h200-2026-11-21.json`` (780 measurements, before GPU-ahead times)
    took 222 s, 98 s of it compiling; this estimate without ``ahead_ms`` gives 270 s for it.
    """
    n_points = len(ops) * len(dtypes) * len(sizes)
    fams = {family(o) for o in ops}
    per_op = len(dtypes) * len(sizes)
    table = all_providers()
    # (provider, op) pairs that are timed: an unsupported op is recorded as skipped.
    timed = [(p, o) for p in providers for o in ops if table[p].unsupported_reason(o) is None]
    measurements = len(timed) * per_op
    n_bwd = sum(is_backward(o) for _, o in timed) * per_op
    compiles = len(fams) * len(dtypes) * len(sizes) if "compile" in providers else 0
    blocks = len({1 << (n - 1).bit_length() for n in sizes})
    jit = sum(p in providers for p in ("fusedops", "liger")) * len(ops) * len(dtypes) * blocks
    cute = sum(p == "quack" for p, _ in timed) * per_op
    t_measure = (measurements * (warmup_ms + rep_ms + 45.0)
                 + (measurements - n_bwd) * ahead_ms[0] + n_bwd * ahead_ms[1]) / 1e3
    t_compile = compiles * compile_s_per_shape
    t_jit = jit * jit_s_per_kernel + cute * cute_s_per_kernel
    return {"points": n_points, "measurements": measurements, "compiled_shapes": compiles,
            "jit_kernels": jit, "cute_kernels": cute, "est_measure_s": t_measure,
            "est_compile_s": t_compile, "est_jit_s": t_jit,
            "est_total_s": t_measure + t_compile + t_jit + 15.0}

