"""The cProfile diff the host-profile scripts print: every function whose per-forward call count
differs from the baseline's, with its cumulative and own microseconds per forward."""

from __future__ import annotations

import pstats


def print_diff(st: pstats.Stats, base: pstats.Stats, forwards: int, label: str,
               base_label: str = "unpatched", top: int = 30, by_own: bool = False) -> None:
    """Print ``st`` against ``base`` (both over ``forwards`` forwards), by cumulative time, and
    by own time too when ``by_own``."""
    print(f"\n{label}: {st.total_calls / forwards:.0f} calls per forward ({base_label} "
          f"{base.total_calls / forwards:.0f}); profiled {st.total_tt / forwards * 1e6:.0f} us "
          f"per forward ({base_label} {base.total_tt / forwards * 1e6:.0f})")
    base_calls = {k: v[1] for k, v in base.stats.items()}
    rows = []
    for k, v in st.stats.items():
        n, was = v[1] / forwards, base_calls.get(k, 0) / forwards
        if n != was:
            rows.append((v[3] / forwards * 1e6, v[2] / forwards * 1e6, n, was,
                         f"{k[0].split('/')[-1]}:{k[1]}({k[2]})"))
    orders = [("by cumulative time", 0)] + ([("by own time", 1)] if by_own else [])
    for title, col in orders:
        print(f"{title}\n{'cum us':>8} {'own us':>8} {'calls':>6} {'was':>6}  function")
        for r in sorted(rows, key=lambda r: -r[col])[:top]:
            print(f"{r[0]:8.1f} {r[1]:8.1f} {r[2]:6.1f} {r[3]:6.1f}  {r[4]}")
