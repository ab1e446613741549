"""PNG figures of the demo report (matplotlib, Agg backend). Every value plotted comes from the
report dict, i.e. from measurements."""

from __future__ import annotations

import os
import sys

from fusedops.tools.profile_ops import short_name

CATEGORY_COLORS = {
    "softmax": "#d62728",
    "layernorm": "#ff7f0e",
    "matmul": "#1f77b4",
    "elementwise": "#2ca02c",
    "reduction": "#9467bd",
    "memory": "#8c564b",
    "view": "#c7c7c7",
    "other": "#7f7f7f",
    "idle": "#f2f2f2",
}


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _idle_ms(profile: dict) -> float:
    d = profile["dispatch"]
    return d.get("gpu_idle_ms", d.get("outside_ops_ms")) or 0.0


def ops_breakdown(report: dict, path: str, top: int = 10) -> str:
    """Per-op time per forward, before vs after patching: a stacked bar per run by category and
    the top ops of each run."""
    plt = _plt()
    before, after = report["profile"], report["patched"]["profile"]
    gpu = before["dispatch"].get("device_busy_ms") is not None
    idle_label = "GPU idle (dispatch tax)" if gpu else "outside ATen ops (host)"
    unit = "device time" if gpu else "CPU time"
    fig = plt.figure(figsize=(16.5, 5.8))
    grid = fig.add_gridspec(1, 3, width_ratios=[1.0, 1.3, 1.3], wspace=1.05)

    ax = fig.add_subplot(grid[0])
    runs = [("baseline", before), ("patched", after)]
    for i, (_, prof) in enumerate(runs):
        left = 0.0
        for cat, color in CATEGORY_COLORS.items():
            ms = _idle_ms(prof) if cat == "idle" else prof["categories"].get(cat, {}).get("ms", 0)
            if ms <= 0:
                continue
            label = idle_label if cat == "idle" else cat
            ax.barh(i, ms, left=left, color=color, edgecolor="black", linewidth=0.4,
                    label=label if i == 0 or cat in ("softmax", "layernorm") else None)
            left += ms
    ax.set_yticks([0, 1], [name for name, _ in runs])
    ax.invert_yaxis()
    ax.set_xlabel(f"ms per forward ({unit})")
    ax.set_title("by category")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles, strict=True))
    ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)

    for j, (name, prof) in enumerate(runs):
        ax = fig.add_subplot(grid[j + 1])
        rows = prof["ops"][:top][::-1]
        names = [r.get("name") or short_name(r["op"]) for r in rows]
        labels = [n if len(n) <= 40 else n[:37] + "..." for n in names]
        ax.barh(range(len(rows)), [r["ms"] for r in rows],
                color=[CATEGORY_COLORS.get(r["category"], "#7f7f7f") for r in rows],
                edgecolor="black", linewidth=0.4)
        ax.set_yticks(range(len(rows)), labels, fontsize=7)
        ax.set_xlabel(f"ms per forward ({unit})")
        ax.set_title(f"top {len(rows)} {'kernels' if gpu else 'ops'}: {name}")
        for k, r in enumerate(rows):
            ax.text(r["ms"], k, f" {100 * r['share']:.1f}%", va="center", fontsize=6)
        if rows:
            ax.set_xlim(0, max(r["ms"] for r in rows) * 1.22)

    dev = report["device"]
    note = "" if dev.get("fused_kernels_available") else \
        " - no fused GPU kernel here: 'patched' runs the PyTorch reference path"
    fig.suptitle(f"Per-op time per forward before/after patch_model - {dev.get('name')} "
                 f"({dev.get('type')}){note}", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def latency(report: dict, path: str) -> str:
    """End-to-end latency before/after (every timed run), Amdahl's prediction and bound, and
    torch.compile when measured."""
    plt = _plt()
    base = report["baseline"]["latency"]
    pat = report["patched"]["latency"]
    series = [("baseline\n(eager)", report["baseline"]["samples_ms"], "#1f77b4"),
              ("patched\n(fused eager)", report["patched"]["samples_ms"], "#d62728")]
    comp = report.get("compile") or {}
    if comp.get("status") == "ok":
        series.append(("torch.compile\n(unpatched)", comp["samples_ms"], "#2ca02c"))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 5), gridspec_kw={"width_ratios": [1.6, 1]})
    ax.boxplot([s for _, s, _ in series], showfliers=False, widths=0.5)
    for i, (_, samples, color) in enumerate(series, start=1):
        jitter = [i + 0.18 * ((k * 0.6180339) % 1 - 0.5) for k in range(len(samples))]
        ax.scatter(jitter, samples, s=6, alpha=0.5, color=color)
    ax.set_xticks(range(1, len(series) + 1), [name for name, _, _ in series])
    am = report["amdahl"]
    if am.get("predicted_ms"):
        ax.axhline(am["predicted_ms"], color="#d62728", linestyle="--", linewidth=1,
                   label=f"Amdahl prediction for patched ({am['predicted_speedup']:.3f}x)")
    if am.get("bound_ms"):
        ax.axhline(am["bound_ms"], color="black", linestyle=":", linewidth=1,
                   label=f"Amdahl bound, infinitely fast ops ({am['bound_speedup']:.3f}x)")
    ax.axhline(base["median_ms"], color="#1f77b4", linewidth=0.6, alpha=0.6)
    ax.set_ylabel("ms per forward (each dot one timed run)")
    ax.set_title("end-to-end latency")
    ax.legend(fontsize=7, loc="upper right")
    lo = min(min(s) for _, s, _ in series)
    hi = max(max(s) for _, s, _ in series)
    ax.set_ylim(max(0.0, min(lo, am.get("bound_ms") or lo) * 0.9), hi * 1.05)

    ms = report["measured_speedup"]
    names = ["measured", "Amdahl\nprediction", "Amdahl\nbound"]
    values = [ms["value"], am.get("predicted_speedup"), am.get("bound_speedup")]
    colors = ["#d62728", "#ff9896", "#bbbbbb"]
    if comp.get("status") == "ok":
        names.append("torch.compile\nvs baseline")
        values.append(comp["speedup_vs_baseline"])
        colors.append("#2ca02c")
    keep = [(n, v, c) for n, v, c in zip(names, values, colors, strict=True) if v is not None]
    ax2.bar(range(len(keep)), [v for _, v, _ in keep], color=[c for _, _, c in keep],
            edgecolor="black", linewidth=0.5)
    if ms.get("round_ratio_p10") is not None:
        ax2.errorbar([0], [ms["value"]],
                     yerr=[[max(0.0, ms["value"] - ms["round_ratio_p10"])],
                           [max(0.0, ms["round_ratio_p90"] - ms["value"])]],
                     color="black", capsize=4)
    for k, (_, v, _) in enumerate(keep):
        ax2.text(k, v, f"{v:.3f}x", ha="center", va="bottom", fontsize=8)
    ax2.axhline(1.0, color="black", linewidth=0.8)
    ax2.set_xticks(range(len(keep)), [n for n, _, _ in keep], fontsize=8)
    ax2.set_ylabel("speed-up over the unpatched eager model")
    ax2.set_title("speed-up (error bar: p10-p90 over rounds)")
    dev = report["device"]
    note = "" if dev.get("fused_kernels_available") else \
        "\nno fused GPU kernel on this device: the patched model runs the PyTorch reference " \
        "path, no speed-up is expected or claimed"
    fig.suptitle(f"Latency before/after vs Amdahl - {dev.get('name')} ({dev.get('type')}), "
                 f"median {base['median_ms']:.3g} -> {pat['median_ms']:.3g} ms{note}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def write_all(report: dict, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    return [ops_breakdown(report, os.path.join(out_dir, "ops_breakdown.png")),
            latency(report, os.path.join(out_dir, "latency.png"))]


def main(argv: list[str] | None = None) -> int:
    """Re-draw the figures of a demo ``report.json``: ``python -m fusedops.tools._plots
    REPORT.json [OUT_DIR]`` (default: the report's folder)."""
    import json

    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m fusedops.tools._plots REPORT.json [OUT_DIR]", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        report = json.load(f)
    out = argv[1] if len(argv) > 1 else os.path.dirname(os.path.abspath(argv[0]))
    for path in write_all(report, out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
