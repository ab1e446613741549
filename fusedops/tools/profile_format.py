"""The terminal form of a profile report (:func:`fusedops.tools.profile.profile_model`)."""

from __future__ import annotations

from fusedops.tools import _report
from fusedops.tools.profile_ops import short_name


def _short(name: str, width: int = 56) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def format_profile(report: dict, top: int = 12) -> str:
    """Human-readable form of a :func:`profile_model` report."""
    out = []
    gpu = report["dispatch"].get("device_busy_ms") is not None
    out.append(f"profile of {report['label']} on {report['device']}  "
               f"({report['iters']} profiled forwards)")
    out.append(f"time basis: {report['time_basis']}")
    rows = [[_short(r.get("name") or short_name(r["op"])), r["category"], f"{r['calls']:.0f}",
             _report.fmt_ms(r["ms"]), _report.fmt_pct(r["share"])] for r in report["ops"][:top]]
    rest = report["ops"][top:]
    if rest:
        rows.append([f"({len(rest)} more ops)", "", f"{sum(r['calls'] for r in rest):.0f}",
                     _report.fmt_ms(sum(r["ms"] for r in rest)),
                     _report.fmt_pct(sum(r["share"] for r in rest))])
    label = "GPU idle (dispatch tax)" if gpu else "outside ATen ops (host)"
    d = report["dispatch"]
    rows.append([label, "", "", _report.fmt_ms(d.get("gpu_idle_ms", d.get("outside_ops_ms"))),
                 _report.fmt_pct(d["tax"])])
    out.append(_report.table(rows, ["kernel" if gpu else "op", "category", "calls/fwd",
                                    "time/fwd", "share"], "llrrr"))
    cats = [[c, f"{v['calls']:.0f}", _report.fmt_ms(v["ms"]), _report.fmt_pct(v["share"])]
            for c, v in report["categories"].items() if v["calls"]]
    out.append("")
    out.append(_report.table(cats, ["category", "calls/fwd", "time/fwd", "share"]))
    out.append("")
    lat = report["latency"]
    out.append(f"forward latency (no profiler): median {_report.fmt_ms(lat['median_ms'])}, "
               f"p10-p90 {_report.fmt_ms(lat['p10_ms'])}-{_report.fmt_ms(lat['p90_ms'])} "
               f"over {lat['n']} runs")
    out.append(f"{report['launch_kind']}: {report['launches_per_forward']:.0f}"
               + (f"  (all ATen ops dispatched: {report['aten_ops_per_forward']:.0f})"))
    if gpu:
        out.append(f"host issue time {_report.fmt_ms(d['host_ms'])} vs device busy "
                   f"{_report.fmt_ms(d['device_busy_ms'])} per forward of "
                   f"{_report.fmt_ms(d['wall_ms'])}: dispatch tax "
                   f"{_report.fmt_pct(d['tax'])} (GPU idle)")
    else:
        out.append(f"no separate device (device time = CPU time): ATen ops "
                   f"{_report.fmt_ms(d['aten_ms'])} of a {_report.fmt_ms(d['wall_ms'])} "
                   f"profiled forward; {_report.fmt_pct(d['tax'])} outside ops (Python, "
                   "dispatch)")
    f = report["fractions"]
    out.append(f"softmax share {_report.fmt_pct(f['softmax'])}, LayerNorm share "
               f"{_report.fmt_pct(f['layernorm'])}: together "
               f"{_report.fmt_pct(report['softmax_layernorm_share'])} of the forward")
    if "op_speedups" in report:
        out.append("")
        sp = report["op_speedups"]
        out.append(f"fused vs native on this model's own shapes (inference; "
                   f"{sp.get('basis', 'median')}):")
        srows = []
        for c in sp["calls"]:
            shape = "x".join(map(str, c["shape"]))
            row = [c["op"], f"{shape} {c['dtype']}", c["count"], f"{c['native_us']:.1f}",
                   f"{c['fused_us']:.1f}", f"{c['speedup']:.2f}x", c["backend"]]
            if gpu:
                row.insert(6, f"{c['native_wall_us']:.1f} / {c['fused_wall_us']:.1f}")
            srows.append(row)
        headers = ["op", "shape", "calls", "native us", "fused us", "speedup", "backend"]
        if gpu:
            headers.insert(6, "back-to-back wall us (nat / fused)")
        out.append(_report.table(srows, headers, "llrrrr" + ("rl" if gpu else "l")))
        a = report["amdahl"]
        not_fused = [op for op, fz in a["fused_kernels"].items() if not fz]
        out.append(
            f"Amdahl: fusing {_report.fmt_pct(a['fused_fraction'])} of the forward with the "
            f"measured op speed-ups predicts {a['predicted_speedup']:.3f}x end to end "
            f"({_report.fmt_ms(a['baseline_ms'])} -> {_report.fmt_ms(a['predicted_ms'])}); "
            f"bound with infinitely fast ops {a['bound_speedup']:.3f}x")
        if not_fused:
            out.append(f"note: no fused kernel ran for {', '.join(not_fused)} on this device; "
                       "the 'fused' column is PyTorch's own ops, so its ratio is noise, not a "
                       "fusion speed-up.")
    return "\n".join(out)
