"""bench-chains results: the CSV, the text table and the speed-up plot, written under ``--out``
next to the JSON (see :mod:`fusedops.tools.bench_chains`)."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from fusedops.tools.bench_harness import DTYPES
from fusedops.tools.bench_report import cpu_label, csv_value, is_cpu, slug, write_json
from fusedops.tools.chains_model import CHAINS, MODES
from fusedops.tools.cli import can_plot

CSV_FIELDS = (
    "chain", "mode", "dtype", "shape", "B", "H", "S", "M", "N", "provider", "backend", "status",
    "ok", "ms", "ms_p20", "ms_p80", "ms_gpu", "bytes_fused", "bytes_eager", "traffic_ratio",
    "bytes_own",
    "tbps", "own_tbps", "copy_tbps", "frac_copy", "speedup_vs_fusedops", "speedup_vs_eager",
    "speedup_vs_compile", "gpu_speedup_vs_fusedops", "gpu_speedup_vs_eager",
    "gpu_speedup_vs_compile", "max_abs_err", "max_rel_err", "check", "relu_ties", "relu_tie_worst",
    "drop_frac", "dropout_max_rel_err", "compile_s", "first_call_s", "error",
    "device", "torch", "triton", "fusedops", "date",
)


def default_stem(result: dict, tag: str | None = None) -> str:
    """``tag``, or ``chains-<device>-<date>``."""
    return tag or f"chains-{slug(str(result.get('device', 'device')))}-{result.get('date')}"


def write_csv(result: dict, path: str | Path) -> Path:
    """One row per record; every row also names the device, versions and date."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    run = {k: result.get(k) for k in ("device", "torch", "triton", "fusedops", "date")}
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in result["records"]:
            row = {k: r.get(k) for k in CSV_FIELDS}
            for p, s in (r.get("speedup") or {}).items():
                row[f"speedup_vs_{p}"] = s
            for p, s in (r.get("speedup_gpu") or {}).items():
                row[f"gpu_speedup_vs_{p}"] = s
            dc = r.get("dropout_check") or {}
            row["drop_frac"] = dc.get("drop_frac")
            row["dropout_max_rel_err"] = dc.get("max_rel_err")
            row.update(run)
            w.writerow({k: csv_value(v) for k, v in row.items()})
    return path


def _grid(records: Sequence[dict]) -> dict[tuple, dict[str, dict]]:
    rows: dict[tuple, dict[str, dict]] = {}
    for r in records:
        rows.setdefault((r["chain"], r["dtype"], r["shape"], r["mode"]), {})[r["provider"]] = r
    return rows


def _order(result: dict, keys) -> list[tuple]:
    chains = list(CHAINS)
    dtypes = list(DTYPES)
    return sorted(keys, key=lambda k: (chains.index(k[0]) if k[0] in chains else 99,
                                       dtypes.index(k[1]) if k[1] in dtypes else 9,
                                       [int(v) for v in k[2].split("x")],
                                       MODES.index(k[3]) if k[3] in MODES else 9))


def _err(r: dict | None, key: str) -> str:
    v = (r or {}).get(key)
    return "-" if v is None else f"{v:.1e}"


def format_table(result: dict) -> str:
    """The short table: per chain, dtype, shape and mode: the traffic ratio, each provider's
    median ms, fused speedups, fused TB/s and fraction of copy, the fused max abs / relative
    error against the eager chain."""
    grid = _grid(result.get("records", []))

    def ms(r):
        if r is None:
            return "-"
        if r.get("ms") is None:
            return r.get("status") or "-"
        return f"{r['ms']:.3f}" + ("!" if r.get("ok") is False else "")

    def sp(r, other, key="speedup"):
        v = (r or {}).get(key, {}).get(other)
        return f"{v:.2f}x" if v else "-"

    head = ["chain", "dtype", "shape", "mode", "bytes x", "fused ms", "eager ms", "compile ms",
            "vs eager", "vs compile", "gpu vs eager", "TB/s", "of copy", "abs err", "rel err"]
    rows = []
    for key in _order(result, grid):
        row = grid[key]
        f = row.get("fusedops")
        any_rec = next(iter(row.values()))
        rows.append([
            key[0], key[1], key[2], key[3], f"{any_rec['traffic_ratio']:.2f}", ms(f),
            ms(row.get("eager")), ms(row.get("compile")), sp(f, "eager"), sp(f, "compile"),
            sp(f, "eager", "speedup_gpu"), f"{f['tbps']:.2f}" if f and f.get("tbps") else "-",
            f"{f['frac_copy']:.2f}" if f and f.get("frac_copy") else "-",
            _err(f, "max_abs_err"), _err(f, "max_rel_err"),
        ])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    lines = [f"fused epilogue chains on {result.get('device')} ({result.get('date')}), copy "
             f"{result.get('copy_tbps') or 0:.3f} TB/s; TB/s = fused floor bytes / time; "
             "bytes x = eager / fused floor; ! = wrong output; gpu vs eager = the same speedup "
             "of GPU-ahead times (host far ahead, CUDA only)"]
    lines.append("  ".join(h.rjust(w) if i >= 4 else h.ljust(w)
                           for i, (h, w) in enumerate(zip(head, widths, strict=True))))
    for r in rows:
        lines.append("  ".join(v.rjust(w) if i >= 4 else v.ljust(w)
                               for i, (v, w) in enumerate(zip(r, widths, strict=True))))
    if result.get("truncated"):
        lines.append(f"truncated: {len(result.get('skipped', []))} points skipped (time budget)")
    if is_cpu(result):
        lines.append(cpu_label(result))
    return "\n".join(lines)


DTYPE_COLORS = {"bf16": ("#d62728", "#ff9896"), "fp16": ("#ff7f0e", "#ffbb78"),
                "fp32": ("#1f77b4", "#aec7e8")}


def plot_speedups(result: dict, path: str | Path) -> Path:
    """One PNG: a panel per (mode, chain), a group of bars per shape: fused speedup vs eager
    (solid) and vs compile (hatched) per dtype; a black tick over each 'vs eager' bar marks the
    traffic ratio (the speedup at equal bandwidth); the dashed line is 1x."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recs = [r for r in result.get("records", []) if r["provider"] == "fusedops"]
    chains = [c for c in CHAINS if any(r["chain"] == c for r in recs)] or ["(none)"]
    modes = [m for m in MODES if any(r["mode"] == m for r in recs)] or ["fwd"]
    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in recs)]
    fig = Figure(figsize=(4.2 * len(chains), 0.6 + 3.4 * len(modes)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(modes), len(chains), squeeze=False)
    for row, mode in zip(axes, modes, strict=True):
        for ax, chain in zip(row, chains, strict=True):
            sub = [r for r in recs if r["chain"] == chain and r["mode"] == mode]
            shapes = sorted({r["shape"] for r in sub},
                            key=lambda s: [int(v) for v in s.split("x")])
            nbars = max(1, 2 * len(dtypes))
            width = 0.8 / nbars
            for di, dt in enumerate(dtypes):
                solid, light = DTYPE_COLORS.get(dt, ("#7f7f7f", "#c7c7c7"))
                for bi, other in enumerate(("eager", "compile")):
                    xs, ys, ratios = [], [], []
                    for si, shape in enumerate(shapes):
                        r = next((r for r in sub if r["shape"] == shape and r["dtype"] == dt),
                                 None)
                        v = (r or {}).get("speedup", {}).get(other)
                        if v:
                            xs.append(si - 0.4 + width * (2 * di + bi + 0.5))
                            ys.append(v)
                            ratios.append(r["traffic_ratio"])
                    if not xs:
                        continue
                    ax.bar(xs, ys, width=width, color=solid if other == "eager" else light,
                           hatch=None if other == "eager" else "//", edgecolor=solid,
                           label=f"{dt} vs {other}")
                    if other == "eager":
                        ax.scatter(xs, ratios, marker="_", s=120, color="black", zorder=5,
                                   label="traffic ratio" if di == 0 else None)
            ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
            ax.set_xticks(range(len(shapes)))
            ax.set_xticklabels(shapes, fontsize=7, rotation=20)
            ax.set_title(f"{chain} {mode}", fontsize=9)
            ax.set_ylim(bottom=0)
            ax.grid(True, axis="y", alpha=0.3)
        row[0].set_ylabel("fused speedup (x)")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle(f"fused epilogue chains on {result.get('device')} ({result.get('date')})",
                 fontsize=10)
    fig.savefig(path, dpi=110)
    return path


def write_outputs(result: dict, out_dir: str | Path, stem: str | None = None,
                  plot: bool = True) -> list[Path]:
    """``<stem>.json``, ``<stem>.csv``, ``<stem>.txt`` (the table) and ``<stem>-speedup.png``
    (skipped, with one line on stderr, without matplotlib)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = default_stem(result, stem)
    paths = [write_json(result, out / f"{stem}.json"), write_csv(result, out / f"{stem}.csv")]
    txt = out / f"{stem}.txt"
    txt.write_text(format_table(result) + "\n")
    paths.append(txt)
    if plot and result.get("records") and can_plot():
        paths.append(plot_speedups(result, out / f"{stem}-speedup.png"))
    return paths
