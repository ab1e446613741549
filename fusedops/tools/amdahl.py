"""Amdahl's law for fusing a few ops of a model.

If parts of a program taking fractions ``f_i`` of its time get faster by factors ``s_i``, the
whole program speeds up by::

    S = 1 / ((1 - sum f_i) + sum f_i / s_i)

and no speed-up of those parts can do better than the bound ``1 / (1 - sum f_i)``.

CLI: ``python -m fusedops.tools.amdahl softmax=0.30:1.4 layernorm=0.05:1.8`` (fraction:speedup).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping


def _check(fraction: float, speedup: float | None = None) -> None:
    if not 0.0 <= fraction <= 1.0 or math.isnan(fraction):
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    if speedup is not None and not speedup > 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")


def speedup(fraction: float, part_speedup: float) -> float:
    """End-to-end speed-up when a part taking ``fraction`` of the time gets ``part_speedup``x
    faster (``part_speedup < 1`` means it got slower)."""
    return combined({"part": (fraction, part_speedup)})


def bound(fraction: float) -> float:
    """The most any speed-up of a part taking ``fraction`` of the time can give:
    ``1 / (1 - fraction)`` (infinite when ``fraction == 1``)."""
    _check(fraction)
    return math.inf if fraction >= 1.0 else 1.0 / (1.0 - fraction)


def combined(parts: Mapping[str, tuple[float, float]]) -> float:
    """End-to-end speed-up for several parts ``{name: (fraction, speedup)}`` at once."""
    total_f = 0.0
    new_time = 0.0
    for fraction, s in parts.values():
        _check(fraction, s)
        total_f += fraction
        new_time += fraction / s
    if total_f > 1.0 + 1e-9:
        raise ValueError(f"fractions sum to {total_f:.4f} > 1")
    new_time += max(0.0, 1.0 - total_f)
    return math.inf if new_time == 0 else 1.0 / new_time


def predict(
    baseline_ms: float,
    fractions: Mapping[str, float],
    op_speedups: Mapping[str, float],
) -> dict:
    """Amdahl prediction for a model.

    Args:
        baseline_ms: the measured time the fractions refer to (one forward).
        fractions: share of ``baseline_ms`` spent in each op (e.g. ``{"softmax": 0.3}``).
        op_speedups: measured native-time / fused-time for each op on the model's own shapes
            (ops missing here are assumed unchanged, speed-up 1).

    Returns:
        A dict with ``fractions``, ``op_speedups``, ``fused_fraction`` (their sum),
        ``predicted_speedup``, ``predicted_ms``, ``bound_speedup`` (infinitely fast ops) and
        ``bound_ms``, plus ``saved_ms`` per op.
    """
    parts = {op: (f, float(op_speedups.get(op, 1.0))) for op, f in fractions.items()}
    total = sum(f for f, _ in parts.values())
    predicted = combined(parts)
    limit = bound(min(total, 1.0))
    return {
        "baseline_ms": baseline_ms,
        "fractions": dict(fractions),
        "op_speedups": {op: s for op, (_, s) in parts.items()},
        "fused_fraction": total,
        "predicted_speedup": predicted,
        "predicted_ms": baseline_ms / predicted,
        "bound_speedup": limit,
        "bound_ms": baseline_ms / limit if math.isfinite(limit) else 0.0,
        "saved_ms": {op: baseline_ms * f * (1.0 - 1.0 / s) for op, (f, s) in parts.items()},
    }


def break_even(compile_s: float, eager_ms: float, compiled_ms: float) -> float | None:
    """Inferences after which compiling pays off: the ``n`` solving
    ``compile_s + n * compiled_ms = n * eager_ms``. None when compiled is not faster (eager wins
    outright)."""
    gain_s = (eager_ms - compiled_ms) / 1e3
    if gain_s <= 0:
        return None
    return compile_s / gain_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fusedops amdahl",
        description="Amdahl's law: end-to-end speed-up from per-part fractions and speed-ups.",
    )
    parser.add_argument("parts", nargs="+", metavar="NAME=FRACTION:SPEEDUP",
                        help="e.g. softmax=0.30:1.4 (fraction of total time, part speed-up)")
    args = parser.parse_args(argv)
    parts = {}
    for item in args.parts:
        try:
            name, rest = item.split("=", 1)
            f, s = rest.split(":", 1)
            parts[name] = (float(f), float(s))
        except ValueError:
            parser.error(f"cannot parse {item!r}; expected NAME=FRACTION:SPEEDUP")
    total = sum(f for f, _ in parts.values())
    try:
        s = combined(parts)
        limit = bound(min(total, 1.0))
    except ValueError as e:
        parser.error(str(e))
    for name, (f, ps) in parts.items():
        print(f"{name:<12} fraction {f:6.1%}  part speed-up {ps:.3g}x")
    print(f"end-to-end speed-up: {s:.3f}x  (bound with infinitely fast parts: {limit:.3f}x)")
    return 0


if __name__ == "__main__":
    from fusedops.__main__ import run_command

    raise SystemExit(run_command("amdahl"))
