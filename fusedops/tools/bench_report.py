"""Benchmark results: JSON/CSV files, merging runs, text tables and the targets summary."""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fusedops.tools.bench_harness import CPU_NOTE, format_size
from fusedops.tools.bench_host import TARGET_US
from fusedops.tools.bench_ops import COMPILE_BUDGET, NOISE, OPS, annotate_speedups
from fusedops.tools.bench_providers import PROVIDER_NAMES
from fusedops.tools.cli import can_plot

CSV_FIELDS = (
    "op", "dtype", "M", "N", "provider", "backend", "status", "ok", "max_err",
    "ms", "ms_p20", "ms_p80", "ms_gpu", "bytes", "flops", "tbps", "gflops", "copy_tbps",
    "frac_copy", "frac_peak", "compile_s", "first_call_s", "fwd_mode", "error",
)
# Targets of docs/performance.md (fraction of the same run's copy bandwidth).
TARGET_MID = (1024, 65536, 0.90)  # N range (inclusive) and fraction
TARGET_HIGH = 0.75  # above 64K


# --- files ----------------------------------------------------------------------------------------


def slug(text: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'."""
    t = text.lower().replace("nvidia", "").replace("geforce", "")
    t = re.sub(r"[^a-z0-9]+", "-", t).strip("-")
    return t or "device"


def default_stem(result: dict, tag: str | None = None) -> str:
    return tag or f"{slug(str(result.get('device', 'device')))}-{result.get('date', 'undated')}"


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else str(obj)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def write_json(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_jsonable(result), indent=1) + "\n")
    tmp.replace(path)
    return path


def load_result(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def write_csv(result: dict, path: str | Path) -> Path:
    """One row per record; speedups as ``speedup_vs_<provider>`` columns."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    providers = [p for p in PROVIDER_NAMES if any(r["provider"] == p for r in result["records"])]
    fields = list(CSV_FIELDS) + [f"speedup_vs_{p}" for p in providers]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in result["records"]:
            row = {k: r.get(k) for k in CSV_FIELDS}
            for p, s in (r.get("speedup") or {}).items():
                row[f"speedup_vs_{p}"] = s
            w.writerow({k: csv_value(v) for k, v in row.items()})
    return path


def csv_value(v: Any) -> Any:
    """A CSV cell: "" for None, 6 significant digits for floats."""
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def write_outputs(result: dict, out_dir: str | Path, stem: str | None = None,
                  plots: bool = True, plot_by: str = "auto") -> list[Path]:
    """``<stem>.json``, ``<stem>.csv``, ``<stem>.txt`` (the report) and the PNGs: one per op, or
    one per op family where per-op plots would be more than four files (``plot_by``, see
    :mod:`fusedops.tools.bench_plot`). Without matplotlib the PNGs are skipped, with one line on
    stderr."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = default_stem(result, stem)
    paths = [write_json(result, out / f"{stem}.json"), write_csv(result, out / f"{stem}.csv")]
    txt = out / f"{stem}.txt"
    txt.write_text(format_report(result) + "\n")
    paths.append(txt)
    if plots and result.get("records") and can_plot():
        from fusedops.tools.bench_plot import plot_results

        paths.extend(plot_results(result, out, stem, by=plot_by))
    return paths


def merge_results(results: Sequence[dict]) -> dict:
    """Combine runs (e.g. one per dtype): later records replace earlier ones at the same
    (op, dtype, N, provider); each record keeps its own run's copy_tbps and frac_copy;
    ``runs`` lists every run merged, those of merged inputs included."""
    if not results:
        raise ValueError("nothing to merge")
    if len(results) == 1:
        return results[0]
    merged = json.loads(json.dumps(results[0]))
    by_key: dict[tuple, dict] = {}
    for res in results:
        for r in res.get("records", []):
            by_key[(r["op"], r["dtype"], r["N"], r["provider"])] = r
    order = {o: i for i, o in enumerate(OPS)}
    merged["records"] = sorted(
        by_key.values(), key=lambda r: (order.get(r["op"], 99), r["dtype"], r["N"],
                                        PROVIDER_NAMES.index(r["provider"])
                                        if r["provider"] in PROVIDER_NAMES else 99))
    annotate_speedups(merged["records"])
    merged["host_latency"] = next((r["host_latency"] for r in reversed(results)
                                   if r.get("host_latency")), [])
    merged["host_costs"] = next((r["host_costs"] for r in reversed(results)
                                 if r.get("host_costs")), [])
    # A merged input brings the runs it lists (a sweep merged again keeps its history).
    merged["runs"] = [run for r in results for run in r.get("runs") or [
        {k: r.get(k) for k in ("timestamp", "copy_tbps", "git", "config")}]]
    merged["providers"] = {k: v for r in results for k, v in r.get("providers", {}).items()}
    # A point one run skipped and another measured is no longer missing.
    measured = {(r["dtype"], r["op"].split("_")[0], r["N"]) for r in merged["records"]
                if r.get("status") != "skipped"}
    merged["skipped"] = [s for r in results for s in r.get("skipped", [])
                         if (s["dtype"], s["family"], s["N"]) not in measured]
    merged["truncated"] = bool(merged["skipped"])
    return merged


# --- tables ---------------------------------------------------------------------------------------


def _providers_in(records: Sequence[dict]) -> list[str]:
    seen = {r["provider"] for r in records}
    return [p for p in PROVIDER_NAMES if p in seen] + sorted(seen - set(PROVIDER_NAMES))


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    status = r.get("status")
    if status == "skipped":
        return "skip"
    if r.get("tbps") is None:
        return "fail" if status == "error" else "-"
    text = _num(r["tbps"])
    return text + "!" if r.get("ok") is False else text


def _num(v: float) -> str:
    """3 decimals for GPU-sized numbers, 3 significant digits for tiny (CPU test) ones."""
    return f"{v:.3f}" if abs(v) >= 0.1 else f"{v:.3g}"


def _grid(records: Sequence[dict]) -> dict[tuple, dict[str, dict]]:
    grid: dict[tuple, dict[str, dict]] = {}
    for r in records:
        grid.setdefault((r["op"], r["dtype"], r["N"]), {})[r["provider"]] = r
    return grid


def _row_order(keys) -> list[tuple]:
    order = {o: i for i, o in enumerate(OPS)}
    dorder = {"bf16": 0, "fp16": 1, "fp32": 2}
    return sorted(keys, key=lambda k: (order.get(k[0], 99), dorder.get(k[1], 9), k[2]))


def _time(r: dict, gpu: bool) -> float | None:
    """A record's time: its do_bench median, or (``gpu``) its GPU-ahead time where recorded."""
    return (r.get("ms_gpu") or r.get("ms")) if gpu else r.get("ms")


def worst_speedup(row: dict[str, dict], provider: str = "fusedops",
                  gpu: bool = False) -> tuple[float | None, str]:
    """min over other providers of other_ms / provider_ms (< 1: ``provider`` is slower);
    ``gpu``: on GPU-ahead times where records have them."""
    me = row.get(provider)
    if not me or not _time(me, gpu):
        return None, ""
    best: tuple[float | None, str] = (None, "")
    for name, r in row.items():
        if name == provider or not _time(r, gpu):
            continue
        s = _time(r, gpu) / _time(me, gpu)
        if best[0] is None or s < best[0]:
            best = (s, name)
    return best


def _ms(v: float) -> str:
    """3 decimals for GPU-sized times (ms), 3 significant digits for tiny (CPU test) ones."""
    return f"{v:.3f}" if abs(v) >= 0.01 else f"{v:.3g}"


def _gpu_cell(r: dict | None) -> str:
    """``"ms (GPU-ahead ms)"`` of a record; just the ms where it has no GPU-ahead time."""
    if not r or r.get("ms") is None:
        return "-"
    text = _ms(r["ms"])
    return text if r.get("ms_gpu") is None else f"{text} ({_ms(r['ms_gpu'])})"


def format_table(result: dict) -> str:
    """One row per (op, dtype, N): TB/s per provider, fusedops' fraction of copy bandwidth and
    its speedup over each other provider (other ms / fusedops ms: ``x0.95`` = 5% slower); where
    the run has GPU-ahead times (CUDA), also fusedops' do_bench ms with its GPU-ahead ms."""
    records = result.get("records", [])
    if not records:
        return "(no sweep records)"
    provs = _providers_in(records)
    others = [p for p in provs if p != "fusedops"] if "fusedops" in provs else []
    gpu = "fusedops" in provs and any(r.get("ms_gpu") is not None for r in records)
    grid = _grid(records)
    head = (["op", "dtype", "N", "M"] + provs + ["frac_copy"]
            + (["fusedops ms (gpu)"] if gpu else []) + [f"vs {p}" for p in others])
    rows = []
    for key in _row_order(grid):
        row = grid[key]
        any_r = next(iter(row.values()))
        fo = row.get("fusedops")
        frac = _num(fo["frac_copy"]) if fo and fo.get("frac_copy") is not None else "-"
        speed = (fo or {}).get("speedup") or {}
        rows.append([key[0], key[1], format_size(key[2]), str(any_r["M"])]
                    + [_cell(row.get(p)) for p in provs] + [frac]
                    + ([_gpu_cell(fo)] if gpu else [])
                    + [f"x{speed[p]:.2f}" if p in speed else "-" for p in others])
    copy = result.get("copy_tbps")
    title = (f"TB/s by provider ({result.get('device')}, copy "
             f"{copy:.3f} TB/s)" if copy else f"TB/s by provider ({result.get('device')})")
    notes = ("! = output differs from torch beyond the loose check; fail = raised; "
             "skip = budget or unsupported; "
             + ("fusedops ms (gpu) = do_bench median (GPU-ahead time); " if gpu else "")
             + "vs p = p's time / fusedops' time (> 1: fusedops faster)")
    lines = [title, _render(head, rows), notes]
    unsupported = format_unsupported(result)
    if unsupported:
        lines.append(unsupported)
    if is_cpu(result):
        lines.insert(1, cpu_label(result))
    return "\n".join(lines)


def format_unsupported(result: dict) -> str:
    """One line per (provider, op, reason) of the records skipped because the provider does
    not support the op (every skip but the compile budget), with their count."""
    groups: dict[tuple[str, str, str], int] = {}
    for r in result.get("records", []):
        if r.get("status") == "skipped" and r.get("error") and r["error"] != COMPILE_BUDGET:
            key = (r["provider"], r["op"], r["error"])
            groups[key] = groups.get(key, 0) + 1
    return "\n".join(f"skipped: {p} {op} ({n} point{'s' if n != 1 else ''}): {why}"
                     for (p, op, why), n in groups.items())


def is_cpu(result: dict) -> bool:
    """True for a result timed on the CPU, where no fused kernel runs."""
    return result.get("device_type") == "cpu"


def cpu_label(result: dict) -> str:
    """The line every CPU table carries: what its numbers are (and are not)."""
    threads = (result.get("config") or {}).get("threads")
    return CPU_NOTE + (f" ({threads} thread{'s' if threads != 1 else ''})" if threads else "")


def _render(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows, strict=True)]
    right = [i >= 2 for i in range(len(head))]

    def fmt(cells):
        return "  ".join(str(c).rjust(w) if r else str(c).ljust(w)
                         for c, w, r in zip(cells, widths, right, strict=True)).rstrip()

    lines = [fmt(head), fmt(["-" * w for w in widths])]
    lines.extend(fmt(r) for r in rows)
    return "\n".join(lines)


def format_short_table(result: dict) -> str:
    """fusedops fraction of copy bandwidth per op/dtype (rows) and N (columns), with markers:
    ``*`` slower than some provider by more than the noise margin, ``!`` wrong output,
    ``x`` error, ``s`` skipped. Then the targets summary and host latency."""
    records = [r for r in result.get("records", []) if r["provider"] == "fusedops"]
    lines = []
    if records:
        grid = _grid(result["records"])
        sizes = sorted({r["N"] for r in records})
        rows_keys = sorted({(r["op"], r["dtype"]) for r in records},
                           key=lambda k: (OPS.index(k[0]) if k[0] in OPS else 99, k[1]))
        head = ["op", "dtype"] + [format_size(n) for n in sizes]
        rows = []
        for op, dt in rows_keys:
            cells = [op, dt]
            for n in sizes:
                row = grid.get((op, dt, n), {})
                fo = row.get("fusedops")
                if fo is None:
                    cells.append("-")
                elif fo.get("status") == "skipped":
                    cells.append("s")
                elif fo.get("frac_copy") is None:
                    cells.append("x")
                else:
                    mark = ""
                    s, _ = worst_speedup(row)
                    if s is not None and s < 1 - NOISE:
                        mark = "*"
                    if fo.get("ok") is False:
                        mark = "!"
                    cells.append(f"{fo['frac_copy']:.2f}{mark}")
            rows.append(cells)
        copy = result.get("copy_tbps")
        lines.append(f"fusedops fraction of copy bandwidth ({result.get('device')}, copy "
                     f"{copy:.3f} TB/s); * slower than a baseline by >{NOISE:.0%}, ! wrong, "
                     "x error, s skipped" if copy else "fusedops fraction of copy bandwidth")
        if is_cpu(result):
            lines.append(cpu_label(result))
        lines.append(_render(head, rows))
        lines.append(format_targets(result))
    hl = format_host_latency(result)
    if hl:
        lines.append(hl)
    return "\n".join(lines) if lines else "(no results)"


def targets_summary(result: dict, gpu: bool = False) -> dict[str, Any]:
    """Counts against the targets of docs/performance.md (fusedops only); ``gpu``: on
    GPU-ahead times where records have them (fractions of copy scaled to that time)."""
    grid = _grid(result.get("records", []))
    lo, hi, mid_frac = TARGET_MID
    out = {"mid_met": 0, "mid_total": 0, "high_met": 0, "high_total": 0, "beats_all": 0,
           "compared": 0, "wrong": 0, "errors": 0, "losses": []}
    for key in _row_order(grid):
        row = grid[key]
        fo = row.get("fusedops")
        if fo is None or fo.get("status") == "skipped":
            continue
        if fo.get("ok") is False:
            out["wrong"] += 1
        if fo.get("frac_copy") is None:
            out["errors"] += 1
            continue
        n = key[2]
        frac = fo["frac_copy"] * fo["ms"] / _time(fo, gpu) if gpu else fo["frac_copy"]
        if lo <= n <= hi:
            out["mid_total"] += 1
            out["mid_met"] += frac >= mid_frac
        elif n > hi:
            out["high_total"] += 1
            out["high_met"] += frac >= TARGET_HIGH
        s, who = worst_speedup(row, gpu=gpu)
        if s is not None:
            out["compared"] += 1
            if s >= 1 - NOISE:
                out["beats_all"] += 1
            else:
                out["losses"].append(f"{key[0]} {key[1]} N={format_size(n)}: x{s:.2f} vs {who}")
    return out


# A record whose do_bench median exceeds the GPU's own time (Timer.gpu_ahead) by more than this
# fraction was timed partly waiting for the host.
HOST_BOUND = 0.10


def host_bound(result: dict) -> list[str]:
    """The timed records (every provider) whose do_bench median is more than HOST_BOUND above
    their GPU-ahead time: ``"op dtype N provider: ms vs ms_gpu"``."""
    out = []
    for r in result.get("records", []):
        ms, gpu = r.get("ms"), r.get("ms_gpu")
        if ms and gpu and ms > (1 + HOST_BOUND) * gpu:
            out.append(f"{r['op']} {r['dtype']} N={format_size(r['N'])} {r['provider']}: "
                       f"{ms:.3f} vs {gpu:.3f} ms")
    return out


def _first_eight(items: list[str]) -> str:
    more = len(items) - 8
    return "; ".join(items[:8]) + (f"; +{more} more" if more > 0 else "")


def _targets_line(title: str, t: dict[str, Any]) -> str:
    return (f"{title}: frac_copy>={TARGET_MID[2]} for 1K<=N<=64K: {t['mid_met']}/"
            f"{t['mid_total']}; >={TARGET_HIGH} above 64K: {t['high_met']}/{t['high_total']}; "
            f">= every baseline (within {NOISE:.0%}): {t['beats_all']}/{t['compared']}; "
            f"wrong: {t['wrong']}; errors: {t['errors']}")


def format_targets(result: dict) -> str:
    if is_cpu(result):
        return ("targets: GPU targets (fraction of copy bandwidth, >= every baseline), not "
                "evaluated on CPU")
    t = targets_summary(result)
    lines = [_targets_line("targets", t)]
    if t["losses"]:
        lines.append("  losses: " + _first_eight(t["losses"]))
    bound = host_bound(result)
    if any(r.get("ms_gpu") for r in result.get("records", [])):
        # The kernels' own standing: do_bench medians of host-bound calls read the host.
        g = targets_summary(result, gpu=True)
        lines.append(_targets_line("targets on GPU-ahead time (where recorded)", g))
        if g["losses"]:
            lines.append("  losses: " + _first_eight(g["losses"]))
    if bound:
        lines.append(f"  host-bound (do_bench median > {1 + HOST_BOUND:.2f} x the GPU-ahead "
                     f"time): {len(bound)}: " + _first_eight(bound))
    if result.get("truncated"):
        lines.append(f"  truncated: {len(result.get('skipped', []))} points skipped (time budget)")
    return "\n".join(lines)


def _per_call_table(recs: list[dict], key_names: list[str], key_of, provs: list[str],
                    target: float | None = None) -> str:
    """Rows of µs per call, one per ``key_of(record)``, a column per provider, then fusedops'
    margin over torch (marked "(over)" beyond ``target``)."""
    grid: dict[tuple, dict[str, dict]] = {}
    for r in recs:
        grid.setdefault(key_of(r), {})[r["provider"]] = r
    head = key_names + [f"{p} us" for p in provs] + ["fusedops - torch"]
    rows = []
    for key, row in grid.items():
        cells = list(key)
        for p in provs:
            r = row.get(p)
            cells.append("-" if r is None else ("fail" if r.get("us_per_call") is None
                                                else f"{r['us_per_call']:.1f}"))
        d = (row.get("fusedops") or {}).get("delta_vs_torch_us")
        over = target is not None and d is not None and d > target
        cells.append("-" if d is None else f"{d:+.1f}" + (" (over)" if over else ""))
        rows.append(cells)
    return _render(head, rows)


def _shape(r: dict) -> str:
    return "x".join(map(str, r["shape"]))


def format_host_latency(result: dict) -> str:
    recs = result.get("host_latency") or []
    if not recs:
        return ""
    table = _per_call_table(recs, ["op", "shape", "dtype"],
                            lambda r: (r["op"], _shape(r), r["dtype"]), _providers_in(recs))
    title = ("wall time per call on CPU (µs; compute at these shapes, not host cost: the "
             "2 µs host target is a GPU target)" if is_cpu(result) else
             "host cost per call (wall time, µs; target: fusedops within 2 µs of torch)")
    return title + "\n" + table


def format_host_costs(records: list[dict]) -> str:
    """The table of :func:`fusedops.tools.bench_host.measure_host_costs` records: µs per call
    per provider, by case, shape and mode, and fusedops' margin over torch against the target."""
    if not records:
        return ""
    provs = [p for p in ("torch", "fusedops", "fusedops-kernel")
             if any(r["provider"] == p for r in records)]
    table = _per_call_table(records, ["case", "shape", "mode"],
                            lambda r: (r["case"], _shape(r), r["mode"]), provs, TARGET_US)
    return (f"host cost per call by mode (wall time, µs; target: fusedops within {TARGET_US:g} "
            "µs of torch)\n" + table)


def format_report(result: dict) -> str:
    """Everything a human wants at the end of a run: header, full table, targets, latency."""
    parts = [
        f"device: {result.get('device')}  torch {result.get('torch')}  triton "
        f"{result.get('triton')}  fusedops {result.get('fusedops')} (git {result.get('git')}, "
        f"source {result.get('source_sha')})  "
        f"date {result.get('date')}",
    ]
    if result.get("copy_tbps"):
        parts.append(f"copy bandwidth: {result['copy_tbps']:.3f} TB/s"
                     + (f"; peak {result['peak_tbps']:.3f} TB/s" if result.get("peak_tbps")
                        else ""))
    if result.get("providers_unavailable"):
        parts.append("unavailable: " + "; ".join(f"{k}: {v}" for k, v in
                                                  result["providers_unavailable"].items()))
    if result.get("records"):
        parts.append(format_table(result))
        parts.append(format_targets(result))
    hl = format_host_latency(result)
    if hl:
        parts.append(hl)
    hc = format_host_costs(result.get("host_costs") or [])
    if hc:
        parts.append(hc)
    models = result.get("bytes_model") or {}
    flop = result.get("flop_model") or {}
    if models:
        parts.append("bytes model: " + "; ".join(f"{k}: {v}" for k, v in models.items()))
    if flop:
        parts.append("flop model: " + "; ".join(f"{k}: {v}" for k, v in flop.items()))
    return "\n\n".join(parts)
