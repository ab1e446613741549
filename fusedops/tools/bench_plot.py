"""Plots of a benchmark result: TB/s vs N (log2 axis), one panel per op and dtype, one curve per
provider and the run's copy bandwidth as a horizontal line.

Files: ``<stem>-<op>.png`` (one per op, a row of dtype panels) or ``<stem>-<family>.png`` (one
per op family, a row per op: fwd above bwd). ``by="auto"`` (the default) writes one per op while
that makes at most :data:`MAX_OP_PLOTS` files -- every result of one or two families, so such
runs keep their op-named files -- and one per family beyond (a full sweep of three families:
3 PNGs, not 6), so that ``benchmarks/run_gpu.sh``, which keeps its output to 8 files (JSON,
CSV, TXT, pytest.log and the plots), has room for every plot of a full sweep.

Uses matplotlib's object API with the Agg canvas, so it never touches the global pyplot backend;
matplotlib (the ``tools`` extra) is imported only when a plot is drawn.
"""

from __future__ import annotations

from pathlib import Path

from fusedops.tools.bench_harness import format_size
from fusedops.tools.bench_ops import OPS, family
from fusedops.tools.bench_providers import PROVIDER_NAMES

STYLE = {
    "fusedops": {"color": "#d62728", "marker": "o", "linewidth": 2.2, "zorder": 5},
    "torch": {"color": "#1f77b4", "marker": "s"},
    "compile": {"color": "#2ca02c", "marker": "^"},
    "liger": {"color": "#9467bd", "marker": "D"},
    "quack": {"color": "#8c564b", "marker": "P"},
    "naive": {"color": "#7f7f7f", "marker": "v", "linestyle": "--"},
}
DTYPE_ORDER = ("bf16", "fp16", "fp32")
PLOT_BY = ("auto", "op", "family")
# by="auto": one PNG per op up to this many ops in the result, else one per family.
MAX_OP_PLOTS = 4


def _ticks(sizes: list[int]) -> list[int]:
    """Tick labels for the sizes, dropping any within 1% of a previous one (8192 and 8193 sit
    on the same spot of a log axis; a 2^k + 1 cliff shows as a vertical drop there)."""
    ticks: list[int] = []
    for n in sorted(sizes, key=lambda n: (n & (n - 1) != 0, n)):
        if all(abs(n - t) > 0.01 * t for t in ticks):
            ticks.append(n)
    return sorted(ticks)


def plot_groups(ops: list[str], by: str = "auto") -> list[tuple[str, list[str]]]:
    """(file suffix, ops drawn in it) for the ops of a result, in :data:`OPS` order."""
    if by not in PLOT_BY:
        raise ValueError(f"unknown plot grouping {by!r}; choose from {PLOT_BY}")
    ops = [o for o in OPS if o in ops] + sorted(o for o in set(ops) if o not in OPS)
    if by == "op" or (by == "auto" and len(ops) <= MAX_OP_PLOTS):
        return [(op, [op]) for op in ops]
    groups: dict[str, list[str]] = {}
    for op in ops:
        groups.setdefault(family(op), []).append(op)
    return list(groups.items())


def _panel(ax, recs: list[dict], title: str, copy: float | None, peak: float | None) -> None:
    sizes = sorted({r["N"] for r in recs})
    for prov in [p for p in PROVIDER_NAMES if any(r["provider"] == p for r in recs)]:
        pts = sorted((r["N"], r["tbps"], r.get("ok")) for r in recs if r["provider"] == prov)
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        ax.plot(xs, ys, label=prov, markersize=4, **STYLE.get(prov, {}))
        bad = [(x, y) for x, y, ok in pts if ok is False]
        if bad:
            ax.scatter([b[0] for b in bad], [b[1] for b in bad], marker="x", s=60,
                       color="black", zorder=10)
    if copy:
        ax.axhline(copy, color="black", linestyle=":", linewidth=1.2,
                   label=f"copy {copy:.2f} TB/s")
    if peak:
        ax.axhline(peak, color="#ff7f0e", linestyle="-.", linewidth=1.0,
                   label=f"peak {peak:.2f} TB/s")
    ax.set_xscale("log", base=2)
    ticks = _ticks(sizes)
    if ticks:
        ax.set_xticks(ticks)
        ax.set_xticklabels([format_size(n) for n in ticks], fontsize=7)
        ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)


def plot_results(result: dict, out_dir: str | Path, stem: str, by: str = "auto") -> list[Path]:
    """Write ``<stem>-<op>.png`` per op or ``<stem>-<family>.png`` per family (``by``: "op",
    "family" or "auto", see the module docstring) for the ops in the result; returns the
    paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = [r for r in result.get("records", []) if r.get("tbps") is not None]
    copy = result.get("copy_tbps")
    peak = result.get("peak_tbps")
    paths = []
    for suffix, ops in plot_groups(list({r["op"] for r in records}), by):
        grp = [r for r in records if r["op"] in ops]
        dtypes = [d for d in DTYPE_ORDER if any(r["dtype"] == d for r in grp)]
        fig = Figure(figsize=(5.2 * len(dtypes), 0.4 + 3.8 * len(ops)), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(ops), len(dtypes), squeeze=False, sharey=True)
        for row, op in zip(axes, ops, strict=True):
            for ax, dt in zip(row, dtypes, strict=True):
                _panel(ax, [r for r in grp if r["op"] == op and r["dtype"] == dt],
                       f"{op} {dt}", copy, peak)
            row[0].set_ylabel("TB/s (minimum bytes / median time)")
        for ax in axes[-1]:
            ax.set_xlabel("N (row length), M = total / N")
        axes[0][-1].legend(fontsize=7, loc="best")
        fig.suptitle(f"{suffix} on {result.get('device')} ({result.get('date')})", fontsize=10)
        path = out / f"{stem}-{suffix}.png"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths
