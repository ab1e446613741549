"""The output of ``python -m fusedops bench-models``: the notes above the tables, the details and
summary tables, the CSV, the ratio plot and the files one run writes."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

from fusedops.tools import _report
from fusedops.tools.bench_models_common import MIN_VERDICT_ROUNDS, NOISE, RATIOS
from fusedops.tools.cli import can_plot


def fmt_num(x: float | None) -> str:
    """``x`` with three significant digits or so; ``-`` for None or a non-finite value."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def _check_text(check: dict | None) -> str:
    if not check:
        return "ref"
    mark = "" if check.get("ok") else " !"
    if "token_match" in check:
        return f"tokens {100 * check['token_match']:.0f}%{mark}"
    return f"{check['max_rel']:.1e}{mark}"


def format_details(result: dict) -> str:
    """One row per (model, shape, mode, variant): wall (median, p20-p80), host, GPU, peak."""
    rows = []
    for r in result["records"]:
        head = [r["model"], r["shape"], r["mode"], r["variant"]]
        if r["status"] != "ok" and not r.get("wall_ms", {}).get("median"):
            rows.append(head + ["error"] + [""] * 8 + [str(r["error"])[:60]])
            continue
        w = r["wall_ms"]
        rows.append(head + [
            fmt_num(w["median"]), f"{fmt_num(w['p20'])}-{fmt_num(w['p80'])}",
            fmt_num(r["host_ms"]["median"]), fmt_num(r.get("gpu_ms")),
            fmt_num(r.get("gpu_busy_ms")), fmt_num(r.get("peak_mb")),
            fmt_num(r.get("first_call_s")), fmt_num(r.get("tokens_per_s")),
            _check_text(r.get("check")) if r["status"] == "ok" else "error: " + r["error"][:50]])
    headers = ["model", "shape", "mode", "variant", "wall ms", "p20-p80", "host ms", "GPU ms",
               "busy ms", "peak MB", "1st call s", "tok/s", "diff"]
    return _report.table(rows, headers, align="llll" + "r" * 9)


def _ratio_text(ratio: dict | None) -> str:
    if not ratio:
        return "-"
    return f"{ratio['ratio']:.3f} {ratio['verdict'] or '?'}"


def format_summary(result: dict) -> str:
    """One row per (model, shape, mode): median wall ms per variant, the ratios
    patched/eager and compiled+patched/compiled, and the worst correctness difference."""
    variants = result["meta"]["options"]["variants"]
    headers = ["model", "shape", "mode"]
    for v in variants:
        headers.append(f"{v} ms")
        for a, b in RATIOS:
            if v == a and b in variants:
                headers.append(f"{a}/{b}")
    headers.append("max diff")
    rows = []
    for row in result["summary"]:
        cells = [row["model"], row["shape"], row["mode"]]
        for v in variants:
            cells.append(fmt_num(row["wall_ms"].get(v)) if v in row["wall_ms"] else "error")
            for a, b in RATIOS:
                if v == a and b in variants:
                    cells.append(_ratio_text(row["ratios"].get(f"{a}/{b}")))
        if row["token_match"] is not None:
            diff = f"tokens {100 * row['token_match']:.0f}%"
        else:
            diff = "-" if row["max_rel_diff"] is None else f"{row['max_rel_diff']:.1e}"
        cells.append(diff + ("" if row["check_ok"] in (True, None) else " !"))
        rows.append(cells)
    return _report.table(rows, headers, align="lll" + "r" * (len(headers) - 3))


def _round_steps(result: dict) -> str:
    """', N-M steps per round' from the summary rows (runs before --min-round-ms: '')."""
    steps = [r["steps_per_round"] for r in result.get("summary", []) if "steps_per_round" in r]
    if not steps:
        return ""
    lo, hi = min(steps), max(steps)
    return f", {lo}{'' if lo == hi else f'-{hi}'} steps per round"


def format_notes(result: dict) -> str:
    """The lines printed above the tables: device, what patching did, anything flagged."""
    meta = result["meta"]
    dev = meta["device"]
    opts = meta["options"]
    lines = [f"device: {dev['name']} ({dev['type']}), torch {meta['versions']['torch']}, "
             f"transformers {meta['versions']['transformers']}, dtype {opts['dtype']}, "
             f"preset {opts['preset']}, {opts['rounds']} rounds ({opts['gen_rounds']} for "
             "generate)" + _round_steps(result)]
    if not dev.get("fused_kernels_available"):
        lines.append("no fused kernel on this device: 'patched' runs the PyTorch reference "
                     "path, so no speed-up is expected or claimed")
    if opts["force_patch"] and not meta["patch_model_accepts_force"]:
        lines.append("--force-patch ignored: this patch_model has no 'force' parameter")
    for name, entry in result["models"].items():
        for mode, info in entry["modes"].items():
            for variant, ok in info.get("unpatched_ok", {}).items():
                if not ok:
                    lines.append(f"WARNING {name} {mode} {variant}: unpatch_model left changes")
            for variant, p in info["patch"].items():
                if p["applied"] is False:
                    lines.append(f"{name} {mode} {variant}: patch_model applied nothing here")
    lines += _compile_notes(result)
    for name, err in meta.get("busy_errors", {}).items():
        lines.append(f"{name}: GPU busy time not measured ({err})")
    if dev["type"] == "cuda":
        lines.append(
            "GPU ms: the step's GPU time with the host kept ahead behind a GPU sleep ('-' where "
            "the step waits for the GPU inside); busy ms: the GPU's busy time per step, from "
            "the profiler's kernel records (gaps between kernels left out)")
    lines.append(
        "ratios: median wall time of the first over the second (< 1: faster); 'slower' / "
        f"'faster' beyond {NOISE:.0%} with the paired per-round ratios' p20/p80 agreeing, "
        f"else 'same' ('?': under {MIN_VERDICT_ROUNDS} rounds). diff: the relative output "
        "difference against the reference variant ('ref': eager when measured), max diff the "
        "worst of a row ('!' beyond the dtype's tolerance)")
    return "\n".join(lines)


def _compile_notes(result: dict) -> list[str]:
    lines = []
    for row in result["summary"]:
        if row.get("weights_identical") is False:
            lines.append(f"WARNING {row['model']} {row['shape']} {row['mode']}: the variants' "
                         "weights differ")
        if row.get("graphs_compiled_while_timing"):
            lines.append(f"WARNING {row['model']} {row['shape']} {row['mode']}: dynamo compiled "
                         f"{row['graphs_compiled_while_timing']} graphs while timing")
    for r in result["records"]:
        comp = r.get("compile")
        if comp and comp["graph_breaks"]:
            top = next(iter(comp["graph_break_reasons"]), "?")
            lines.append(f"{r['model']} {r['shape']} {r['mode']} {r['variant']}: "
                         f"{comp['graphs']} graphs, {comp['graph_breaks']} graph breaks "
                         f"(most: {top[:70]})")
    return lines


def format_patch_line(name: str, mode: str, patch: dict) -> str:
    """The progress line of what ``patch_model`` did to each patched variant of a mode."""
    parts = []
    for variant, p in patch.items():
        kinds = ", ".join(f"{n} {k}" for k, n in {**p["fused_types"], **p["patterns"]}.items())
        applied = "" if p["applied"] is None else f", applied={p['applied']}"
        parts.append(f"{variant}: {p['replaced']} modules swapped, {p['fused_patterns']} "
                     f"patterns fused ({kinds or 'nothing'}){applied}, {p['seconds']:.2f}s")
    return f"  patch_model {name} {mode}: " + "; ".join(parts)


CSV_FIELDS = ("model", "mode", "batch", "tokens", "new_tokens", "variant", "status",
              "wall_ms", "wall_p20_ms", "wall_p80_ms", "host_ms", "host_p20_ms", "host_p80_ms",
              "gpu_ms", "gpu_busy_ms", "peak_mb", "peak_total_mb", "first_call_s", "check_s",
              "tokens_per_s",
              "ratio", "ratio_vs", "check_max_rel", "check_token_match", "check_ok", "error")


def _csv_row(r: dict, ratios: dict[tuple, dict]) -> dict:
    w, h = r.get("wall_ms") or {}, r.get("host_ms") or {}
    check = r.get("check") or {}
    pair = next((f"{a}/{b}" for a, b in RATIOS if a == r["variant"]), None)
    ratio = ratios.get((r["model"], r["mode"], r["shape"]), {}).get(pair) if pair else None
    return {**{k: r.get(k) for k in CSV_FIELDS},
            "wall_ms": w.get("median"), "wall_p20_ms": w.get("p20"), "wall_p80_ms": w.get("p80"),
            "host_ms": h.get("median"), "host_p20_ms": h.get("p20"), "host_p80_ms": h.get("p80"),
            "ratio": ratio["ratio"] if ratio else None, "ratio_vs": pair if ratio else None,
            "check_max_rel": check.get("max_rel"), "check_token_match": check.get("token_match"),
            "check_ok": check.get("ok")}


def write_csv(result: dict, path: str | os.PathLike) -> Path:
    """One CSV row per record (the ratio column: patched/eager or compiled+patched/compiled)."""
    ratios = {(s["model"], s["mode"], s["shape"]): s["ratios"] for s in result["summary"]}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in result["records"]:
            writer.writerow(_csv_row(r, ratios))
    return path


def plot_ratios(result: dict, path: str | os.PathLike) -> Path | None:
    """Horizontal bars: each ratio per (model, shape, mode), whiskers at the paired per-round
    p20/p80. None (and one line on stderr) when matplotlib is missing."""
    if not can_plot():
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows = result["summary"]
    colors = {"patched/eager": "#d62728", "compiled+patched/compiled": "#2ca02c"}
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) * len(colors) + 1.5))
    height = 0.8 / len(colors)
    for k, (key, color) in enumerate(colors.items()):
        ys, xs, lo, hi = [], [], [], []
        for i, row in enumerate(rows):
            r = row["ratios"].get(key)
            if r:
                ys.append(i + (k - (len(colors) - 1) / 2) * height)
                xs.append(r["ratio"])
                lo.append(max(0.0, r["ratio"] - r["p20"]))
                hi.append(max(0.0, r["p80"] - r["ratio"]))
        if xs:
            ax.barh(ys, xs, height=height, color=color, label=key, xerr=[lo, hi], capsize=2)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [f"{r['model']} {r['shape']} {r['mode']}" for r in rows],
                  fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("wall-time ratio (< 1: the patched variant is faster)")
    meta = result["meta"]
    ax.set_title(f"bench-models on {meta['device']['name']} ({meta['options']['dtype']}, "
                 f"{meta['options']['preset']})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(result: dict, out_dir: str | os.PathLike, plot: bool = True) -> list[Path]:
    """``bench_models.json`` (every measurement and the metadata), ``.csv``, ``.txt`` (the
    printed report) and ``.png`` (unless ``plot`` is False or matplotlib is missing)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _report.write_json(out / "bench_models.json", result)
    paths = [out / "bench_models.json", write_csv(result, out / "bench_models.csv")]
    (out / "bench_models.txt").write_text(format_report(result) + "\n")
    paths.append(out / "bench_models.txt")
    if plot and result["summary"]:
        png = plot_ratios(result, out / "bench_models.png")
        if png is not None:
            paths.append(png)
    return paths


def format_report(result: dict) -> str:
    """Notes, the per-variant details table, then the summary table (last)."""
    return "\n\n".join([format_notes(result), format_details(result), format_summary(result)])
