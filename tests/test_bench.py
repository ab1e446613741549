"""The benchmark harness (``python -m fusedops bench``): models, parsing, a tiny CPU sweep, the
files it writes, the correctness guard and the tables. Speed itself is never measured in CI."""

from __future__ import annotations

import csv
import json
import os
import shutil

import pytest
import torch

from fusedops.tools import bench, bench_plot, bench_report
from fusedops.tools.bench_providers import FAMILIES, Provider, all_providers

CPU_PROVIDERS = "fusedops,torch,naive"


# --- bytes / FLOP model ---------------------------------------------------------------------------


def test_bytes_model():
    M, N = 1024, 4096
    assert bench.bytes_moved("softmax_fwd", M, N, 2) == 2 * M * N * 2
    assert bench.bytes_moved("softmax_bwd", M, N, 4) == 3 * M * N * 4
    assert bench.bytes_moved("layernorm_fwd", M, N, 2) == 2 * M * N * 2 + 2 * N * 2
    assert bench.bytes_moved("layernorm_fwd", M, N, 2, welt=4) == 2 * M * N * 2 + 2 * N * 4
    assert bench.bytes_moved("layernorm_bwd", M, N, 2) == 3 * M * N * 2 + 3 * N * 2 + 8 * M
    assert bench.bytes_moved("rmsnorm_fwd", M, N, 2) == 2 * M * N * 2 + N * 2
    assert bench.bytes_moved("rmsnorm_fwd", M, N, 2, welt=4) == 2 * M * N * 2 + N * 4
    assert bench.bytes_moved("rmsnorm_bwd", M, N, 2) == 3 * M * N * 2 + 2 * N * 2 + 4 * M
    assert bench.bytes_moved("rmsnorm_bwd", M, N, 4, welt=2) == 3 * M * N * 4 + 2 * N * 2 + 4 * M
    with pytest.raises(ValueError, match="unknown op"):
        bench.bytes_moved("gelu_fwd", M, N, 2)


def test_flop_model():
    M, N = 3, 5
    assert bench.flops("softmax_fwd", M, N) == 5 * M * N
    assert bench.flops("softmax_bwd", M, N) == 4 * M * N
    assert bench.flops("layernorm_fwd", M, N) == 7 * M * N
    assert bench.flops("layernorm_bwd", M, N) == 13 * M * N
    assert bench.flops("rmsnorm_fwd", M, N) == 4 * M * N
    assert bench.flops("rmsnorm_bwd", M, N) == 9 * M * N
    # the stated models name the counts they use
    for op, n in bench.FLOPS_PER_ELEMENT.items():
        assert bench.FLOP_MODEL[op].startswith(f"{n} flops/element"), op
    assert set(bench.FLOP_MODEL) == set(bench.OPS) == set(bench.BYTES_MODEL)
    with pytest.raises(ValueError):
        bench.flops("nope", 1, 1)


def test_rows_keep_total_fixed():
    for n in bench.SIZES:
        m = bench.rows_for(n)
        assert m == 2**27 // n
        assert m * n <= 2**27 < (m + 1) * n
    assert bench.rows_for(2**28) == 1


# --- parsing --------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,value", [
    ("256", 256), ("1K", 1024), ("16k", 16384), ("64K+1", 65537), ("2^17", 131072),
    ("1M", 2**20), (" 8193 ", 8193),
])
def test_parse_size(text, value):
    assert bench.parse_size(text) == value


def test_format_size():
    assert [bench.format_size(n) for n in (256, 1024, 8193, 65537, 262144)] == [
        "256", "1K", "8193", "65537", "256K"]


def test_resolve_subsets():
    assert bench.resolve_ops(None) == bench.OPS
    assert bench.resolve_ops("softmax") == ("softmax_fwd", "softmax_bwd")
    assert bench.resolve_ops("bwd") == ("softmax_bwd", "layernorm_bwd", "rmsnorm_bwd")
    assert bench.resolve_ops("rmsnorm") == ("rmsnorm_fwd", "rmsnorm_bwd")
    assert bench.resolve_ops("rms_bwd,ln-fwd") == ("layernorm_fwd", "rmsnorm_bwd")
    assert bench.resolve_ops("RMS_FWD") == ("rmsnorm_fwd",)
    assert set(bench.resolve_ops("fwd")) == {f"{f}_fwd" for f in FAMILIES}
    assert bench.resolve_ops("layernorm_bwd,softmax_fwd") == ("softmax_fwd", "layernorm_bwd")
    assert bench.resolve_ops([]) == ()
    assert bench.resolve_dtypes("bfloat16,fp32") == ("bf16", "fp32")
    assert bench.resolve_sizes("1K,64K+1") == (1024, 65537)
    assert bench.resolve_sizes([256, "2K"]) == (256, 2048)
    assert bench.resolve_providers("naive,eager,fusedops") == ("fusedops", "torch", "naive")
    for fn, bad in ((bench.resolve_ops, "gelu"), (bench.resolve_ops, "rms"),
                    (bench.resolve_ops, "rmsnorm_fwdx"), (bench.resolve_dtypes, "fp8"),
                    (bench.resolve_providers, "cudnn"), (bench.resolve_sizes, "0")):
        with pytest.raises(ValueError):
            fn(bad)


def test_plan_counts():
    est = bench.plan(bench.OPS, tuple(bench.DTYPES), bench.SIZES, bench.resolve_providers(None),
                     5.0, 25.0)
    assert est["points"] == 6 * 3 * 14
    # six providers; QuACK's LayerNorm backward points are skipped, not timed
    assert est["measurements"] == 6 * 3 * 14 * 6 - 3 * 14
    assert est["compiled_shapes"] == 3 * 3 * 14  # fwd and bwd share one compile per shape
    assert est["cute_kernels"] == 5 * 3 * 14
    assert est["est_total_s"] > 0
    # the GPU-ahead measurement is part of every timed record's cost
    no_ahead = bench.plan(bench.OPS, ("bf16",), (1024,), ("torch",), 5.0, 25.0,
                          ahead_ms=(0.0, 0.0))
    ahead = bench.plan(bench.OPS, ("bf16",), (1024,), ("torch",), 5.0, 25.0,
                       ahead_ms=(20.0, 70.0))
    assert ahead["est_measure_s"] - no_ahead["est_measure_s"] == pytest.approx(
        (3 * 20.0 + 3 * 70.0) / 1e3)


def test_default_sizes():
    assert bench.SIZES == (256, 512, 768, 1024, 2048, 4096, 8192, 8193, 16384, 32768, 65536,
                           65537, 131072, 262144)
    assert bench.resolve_sizes(None) == bench.SIZES
    help_text = "".join(bench.build_parser().format_help().split())  # argparse wraps it
    assert "fullsweep:256,512,768,1K,2K,4K,8K,8193,16K,32K,64K,65537,128K,256K)" in help_text


# --- the tiny CPU sweep ---------------------------------------------------------------------------

RECORD_KEYS = {"op", "dtype", "M", "N", "provider", "backend", "status", "ok", "ms", "tbps",
               "gflops", "bytes", "flops", "copy_tbps", "frac_copy", "speedup", "error"}
TOP_KEYS = {"device", "device_type", "torch", "triton", "date", "copy_tbps", "records",
            "host_latency", "bytes_model", "flop_model", "config", "providers"}


@pytest.fixture(scope="module")
def tiny_result():
    return bench.run_sweep(
        ops="all", dtypes="fp32,bf16", sizes=[64, 257], providers=CPU_PROVIDERS, device="cpu",
        total=2**10, warmup_ms=0.2, rep_ms=0.5, host_latency=True, host_latency_calls=3,
        host_latency_shapes=[(4, 128), (2, 3, 64)], progress=False,
    )


def test_tiny_sweep_records(tiny_result):
    r = tiny_result
    assert TOP_KEYS <= set(r)
    assert r["device_type"] == "cpu"
    assert r["copy_tbps"] > 0
    recs = r["records"]
    assert {rec["op"] for rec in recs} == set(bench.OPS)
    assert len(recs) == 6 * 2 * 2 * 3  # ops x dtypes x sizes x providers
    for rec in recs:
        assert RECORD_KEYS <= set(rec), rec
        assert rec["status"] == "ok", rec
        assert rec["ok"] is True
        assert rec["M"] == 2**10 // rec["N"]
        assert rec["ms"] > 0 and rec["tbps"] > 0 and rec["gflops"] > 0
        elt = 4 if rec["dtype"] == "fp32" else 2
        assert rec["bytes"] == bench.bytes_moved(rec["op"], rec["M"], rec["N"], elt)
        assert rec["tbps"] == pytest.approx(rec["bytes"] / (rec["ms"] * 1e-3) / 1e12)
        assert rec["frac_copy"] == pytest.approx(rec["tbps"] / r["copy_tbps"])
        others = {"fusedops", "torch", "naive"} - {rec["provider"]}
        assert set(rec["speedup"]) == others
    fo = [x for x in recs if x["provider"] == "fusedops"]
    assert {x["backend"] for x in fo} == {"reference"}  # CPU tensors use the reference path
    # the GPU-ahead time is a CUDA measurement: every record has the field, None here
    assert all(x["ms_gpu"] is None for x in recs)


def test_tiny_sweep_speedups_consistent(tiny_result):
    grid = {}
    for rec in tiny_result["records"]:
        grid[(rec["op"], rec["dtype"], rec["N"], rec["provider"])] = rec
    for (op, dt, n, _p), rec in grid.items():
        for other, s in rec["speedup"].items():
            assert s == pytest.approx(grid[(op, dt, n, other)]["ms"] / rec["ms"])


def test_tiny_sweep_host_latency(tiny_result):
    hl = tiny_result["host_latency"]
    shapes = {tuple(h["shape"]) for h in hl}
    assert shapes == {(4, 128), (2, 3, 64)}
    assert bench.HOST_LATENCY_SHAPES == ((4, 128), (64, 768), (8, 128, 768))
    assert {h["op"] for h in hl} == {"softmax_fwd", "layernorm_fwd", "rmsnorm_fwd"}
    for h in hl:
        assert h["error"] is None, h
        assert h["us_per_call"] > 0
        assert h["delta_vs_torch_us"] is not None
    assert {h["provider"] for h in hl} == {"fusedops", "torch", "naive"}


def test_tiny_sweep_host_costs(tiny_result):
    from fusedops.tools import bench_host

    hc = tiny_result["host_costs"]
    keys = {(h["case"], tuple(h["shape"]), h["mode"]) for h in hc}
    assert keys == {(c, s, m) for c, s in bench_host.CASES for m in bench_host.MODES}
    # CPU has no fused backend: no forced-kernel row, fusedops against the native ops only
    assert {h["provider"] for h in hc} == {"torch", "fusedops"}
    for h in hc:
        assert h["error"] is None, h
        assert h["us_per_call"] > 0 and h["us_min"] <= h["us_per_call"]
        assert h["delta_vs_torch_us"] is not None
        if h["provider"] == "fusedops":
            assert h["within_target"] == (h["delta_vs_torch_us"] <= bench_host.TARGET_US)
    text = bench_report.format_report(tiny_result)
    assert "host cost per call by mode" in text and "scale+mask+softmax" in text


def test_host_cost_cases_compute_the_same():
    """Each case's fused call computes what its native ops compute (so the timing compares
    like with like), in every mode's inputs."""
    from fusedops.tools import bench_host

    for case, shape in bench_host.CASES:
        small = tuple(min(s, 8) for s in shape[:-1]) + (shape[-1],)
        x, extra = bench_host._inputs(case, small, "cpu", torch.float32, True)
        native, fused = bench_host._fns(case, x, extra)
        torch.testing.assert_close(fused(), native(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("order", ["rotating", "paired"])
def test_host_cost_run_orders(order):
    """Which provider each of torch and fusedops follows, over runs: ``paired`` makes it the
    same for both (the forced kernel, then each other, equally often); ``rotating`` does not
    with three providers."""
    from collections import Counter

    from fusedops.tools import bench_host

    runs = [({"provider": p},) for p in ("torch", "fusedops", "fusedops-kernel")]
    after: Counter = Counter()
    previous = None
    for r in range(12):
        for run in bench_host._run_order(runs, r, order):
            name = run[0]["provider"]
            if previous is not None:
                after[name, previous] += 1
            previous = name
        assert sorted(run[0]["provider"] for run in bench_host._run_order(runs, r, order)) == \
            sorted(run[0]["provider"] for run in runs)
    symmetric = (after["torch", "fusedops-kernel"] == after["fusedops", "fusedops-kernel"]
                 and after["torch", "fusedops"] == after["fusedops", "torch"])
    assert symmetric == (order == "paired"), after
    with pytest.raises(ValueError, match="order"):
        bench_host.measure_host_costs("cpu", order="random")


def test_write_outputs(tiny_result, tmp_path):
    paths = bench_report.write_outputs(tiny_result, tmp_path, stem="tiny")
    names = sorted(p.name for p in paths)
    # six ops: one PNG per family (fwd above bwd)
    assert names == sorted(["tiny.json", "tiny.csv", "tiny.txt"]
                           + [f"tiny-{fam}.png" for fam in FAMILIES])
    data = json.loads((tmp_path / "tiny.json").read_text())
    assert TOP_KEYS <= set(data)
    assert len(data["records"]) == len(tiny_result["records"])
    with (tmp_path / "tiny.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(tiny_result["records"])
    for col in ("op", "dtype", "M", "N", "provider", "ms", "ms_gpu", "tbps", "gflops",
                "copy_tbps", "frac_copy", "speedup_vs_torch", "speedup_vs_naive"):
        assert col in rows[0]
    assert {row["ms_gpu"] for row in rows} == {""}  # no GPU-ahead time on CPU
    assert all("ms_gpu" in rec and rec["ms_gpu"] is None for rec in data["records"])
    for fam in FAMILIES:
        assert (tmp_path / f"tiny-{fam}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (tmp_path / "tiny.txt").read_text()
    assert "TB/s by provider" in report and "wall time per call on CPU" in report
    # a CPU result says what it is and claims no targets
    assert "CPU run:" in report and "not evaluated on CPU" in report


def test_report_roundtrip_and_merge(tiny_result, tmp_path):
    a = bench_report.write_json(tiny_result, tmp_path / "a.json")
    other = json.loads(json.dumps(tiny_result))
    for rec in other["records"]:
        rec["N"] += 1000
    b = bench_report.write_json(other, tmp_path / "b.json")
    merged = bench_report.merge_results([bench_report.load_result(a),
                                         bench_report.load_result(b)])
    assert len(merged["records"]) == 2 * len(tiny_result["records"])
    assert len(merged["runs"]) == 2
    # merged again with a third run: the merged input's runs are kept, not collapsed to one
    third = dict(bench_report.load_result(a), timestamp="third")
    again = bench_report.merge_results([merged, third])
    assert [r["timestamp"] for r in again["runs"]] == [
        *(r["timestamp"] for r in merged["runs"]), "third"]
    # a point one run skipped (time budget) and the other measured is not reported missing
    rec = other["records"][0]
    gap = {"dtype": rec["dtype"], "family": rec["op"].split("_")[0], "N": rec["N"],
           "reason": "time budget"}
    first = dict(bench_report.load_result(a), skipped=[gap], truncated=True)
    merged = bench_report.merge_results([first, bench_report.load_result(b)])
    assert merged["skipped"] == [] and not merged["truncated"]
    merged = bench_report.merge_results([first, bench_report.load_result(a)])
    assert merged["skipped"] == [gap] and merged["truncated"]


def test_cli_cpu(tmp_path, capsys):
    rc = bench.main(["--device", "cpu", "--ops", "softmax_fwd,layernorm_bwd,rms_bwd",
                     "--dtypes", "fp32",
                     "--sizes", "128", "--providers", CPU_PROVIDERS, "--total", "512",
                     "--warmup", "0.2", "--rep", "0.5", "--no-host-latency", "--quiet",
                     "--out", str(tmp_path), "--tag", "cli", "--table", "short"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "fusedops fraction of copy bandwidth" in out
    assert "targets:" in out
    data = json.loads((tmp_path / "cli.json").read_text())
    assert {r["op"] for r in data["records"]} == {"softmax_fwd", "layernorm_bwd", "rmsnorm_bwd"}
    assert all(r["status"] == "ok" for r in data["records"])
    # three ops: one PNG per op
    for op in ("softmax_fwd", "layernorm_bwd", "rmsnorm_bwd"):
        assert (tmp_path / f"cli-{op}.png").exists()
    # --report re-renders from the JSON without benchmarking (here one PNG per family).
    rc = bench.main(["--report", str(tmp_path / "cli.json"), "--out", str(tmp_path / "re"),
                     "--tag", "re", "--plot-by", "family", "--table", "full"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "TB/s by provider" in out and "rmsnorm_bwd" in out
    assert (tmp_path / "re" / "re.csv").exists()
    assert sorted(p.name for p in (tmp_path / "re").glob("*.png")) == [
        "re-layernorm.png", "re-rmsnorm.png", "re-softmax.png"]


def test_cli_entry_point_and_errors(capsys):
    from fusedops.__main__ import main

    assert main(["bench", "--plan", "--device", "cpu", "--quick"]) == 0
    assert "points" in capsys.readouterr().out
    assert main(["bench", "--device", "cpu", "--ops", "gelu"]) == 2
    assert "unknown op" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--help"])


def test_plot_groups():
    ops = list(bench.OPS)
    assert bench_plot.plot_groups(ops, "op") == [(op, [op]) for op in bench.OPS]
    fams = [("softmax", ["softmax_fwd", "softmax_bwd"]),
            ("layernorm", ["layernorm_fwd", "layernorm_bwd"]),
            ("rmsnorm", ["rmsnorm_fwd", "rmsnorm_bwd"])]
    assert bench_plot.plot_groups(ops, "family") == fams
    assert bench_plot.plot_groups(ops, "auto") == fams  # 6 ops: per family
    # up to 4 ops (every two-family run) keeps one file per op
    assert bench_plot.plot_groups(["rmsnorm_bwd", "softmax_fwd", "rmsnorm_fwd"]) == [
        ("softmax_fwd", ["softmax_fwd"]), ("rmsnorm_fwd", ["rmsnorm_fwd"]),
        ("rmsnorm_bwd", ["rmsnorm_bwd"])]
    assert bench_plot.plot_groups(ops[:4]) == [(op, [op]) for op in ops[:4]]
    with pytest.raises(ValueError):
        bench_plot.plot_groups(ops, "dtype")


def test_time_budget_truncates():
    r = bench.run_sweep(ops="softmax_fwd", dtypes="fp32", sizes=[32, 64], providers="torch",
                        device="cpu", total=256, warmup_ms=0.1, rep_ms=0.2, host_latency=False,
                        time_budget_s=0.0, progress=False)
    assert r["truncated"] is True
    assert r["records"] == []
    assert len(r["skipped"]) == 2


def test_unavailable_provider_is_reported():
    r = bench.run_sweep(ops="softmax_fwd", dtypes="fp32", sizes=[32], providers="torch,liger",
                        device="cpu", total=64, warmup_ms=0.1, rep_ms=0.2, host_latency=False,
                        progress=False)
    assert "liger" in r["providers_unavailable"]
    assert {rec["provider"] for rec in r["records"]} == {"torch"}


def test_liger_availability_per_family(monkeypatch):
    import sys
    import types

    liger = all_providers()["liger"]
    assert "does not run on cpu" in liger.unavailable_reason("cpu", ["rmsnorm"])
    # A Liger build with softmax and LayerNorm but no RMSNorm: unavailable only where RMSNorm runs.
    for mod, cls in (("liger_kernel.ops.softmax", "LigerSoftmaxFunction"),
                     ("liger_kernel.ops.layer_norm", "LigerLayerNormFunction")):
        fake = types.ModuleType(mod)
        setattr(fake, cls, object)
        monkeypatch.setitem(sys.modules, mod, fake)
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.rms_norm", None)  # import fails
    assert liger.unavailable_reason("cuda", ["softmax", "layernorm"]) is None
    assert "not importable" in liger.unavailable_reason("cuda", ["rmsnorm"])
    assert "not importable" in liger.unavailable_reason("cuda")  # default: every family


def test_liger_rmsnorm_call(monkeypatch):
    # The exact LigerRMSNormFunction.apply arguments: plain RMSNorm (offset 0), Liger's default
    # "llama" casting, and not in place (dy is reused by every timed backward call).
    import sys
    import types

    from fusedops.tools import bench_providers

    calls = []

    class FakeRMSNorm:
        @staticmethod
        def apply(*args):
            calls.append(args)
            x, w, eps = args[:3]
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)

    fake = types.ModuleType("liger_kernel.ops.rms_norm")
    fake.LigerRMSNormFunction = FakeRMSNorm
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.rms_norm", fake)
    x, w = torch.randn(4, 16), torch.randn(16)
    y = all_providers()["liger"].make("rmsnorm")(x, w, None)
    assert calls == [(x, w, bench_providers.EPS, 0.0, "llama", False)]
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (16,), w, 1e-5))


# --- the correctness guard ------------------------------------------------------------------------


def _point(fam, ops, dtype=torch.float32, M=8, N=32):
    point = bench.Point(fam, ops, dtype, M, N, "cpu", seed=1)
    point.compute_refs(all_providers()["torch"])
    return point


def _timer():
    return bench.Timer("cpu", 0.1, 0.2)


def test_guard_flags_wrong_output():
    wrong = Provider("wrong", "returns its input", lambda x, w=None, b=None: x * 1.0,
                     lambda x, w, b: x * 1.0)
    point = _point("softmax", ["softmax_fwd", "softmax_bwd"])
    recs = bench.run_provider(point, wrong, ["softmax_fwd", "softmax_bwd"], "fp32", _timer(),
                               True, 1.0, None, True)
    assert [r["status"] for r in recs] == ["wrong", "wrong"]
    assert all(r["ok"] is False and r["max_err"] > 1e-3 and r["ms"] > 0 for r in recs)
    table = bench_report.format_table({"records": recs, "device": "cpu", "copy_tbps": 1.0})
    assert "!" in table


def test_guard_records_errors():
    def boom(*args):
        raise RuntimeError("kernel exploded\nsecond line")

    bad = Provider("bad", "raises", boom, boom)
    point = _point("layernorm", ["layernorm_fwd", "layernorm_bwd"])
    recs = bench.run_provider(point, bad, ["layernorm_fwd", "layernorm_bwd"], "fp32", _timer(),
                               True, 1.0, None, True)
    assert [r["status"] for r in recs] == ["error", "error"]
    assert recs[0]["error"] == "RuntimeError: kernel exploded"
    assert recs[0]["ms"] is None and recs[0]["tbps"] is None


def test_guard_checks_layernorm_grads():
    # A LayerNorm whose bias gradient is lost (bias detached) must fail the backward check only.
    def no_bias_grad(x, w, b):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b.detach(), 1e-5)

    prov = Provider("nobias", "drops db", no_bias_grad, no_bias_grad)
    point = _point("layernorm", ["layernorm_fwd", "layernorm_bwd"])
    with pytest.raises(RuntimeError):  # autograd.grad refuses an input that is not in the graph
        torch.autograd.grad(no_bias_grad(*point.args(point.grad_inputs())),
                            point.grad_inputs(), point.dy)
    recs = bench.run_provider(point, prov, ["layernorm_fwd", "layernorm_bwd"], "fp32",
                               _timer(), True, 1.0, None, True)
    assert recs[0]["status"] == "ok"
    assert recs[1]["status"] == "error"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_providers_match_torch(dtype):
    # Every provider that runs on CPU (not compile: a cold Inductor build), fwd and bwd
    # (dx and dweight), against F.rms_norm in float32 on the same data.
    point = _point("rmsnorm", ["rmsnorm_fwd", "rmsnorm_bwd"], dtype=dtype, M=6, N=48)
    assert point.b is None and point.w is not None
    assert len(point.grad_inputs()) == 2  # x and w
    x32, w32 = point.x.float(), point.w.float()
    ref_y = torch.nn.functional.rms_norm(x32, (48,), w32, 1e-5)
    xg, wg = x32.clone().requires_grad_(True), w32.clone().requires_grad_(True)
    ref_dx, ref_dw = torch.autograd.grad(torch.nn.functional.rms_norm(xg, (48,), wg, 1e-5),
                                         (xg, wg), point.dy.float())
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    for name in ("fusedops", "torch", "naive"):
        fn = all_providers()[name].make("rmsnorm")
        inputs = point.grad_inputs()
        y = fn(*point.args(inputs))
        assert y.dtype == dtype and y.shape == (6, 48), name
        dx, dw = torch.autograd.grad(y, inputs, point.dy)
        for out, ref in ((y, ref_y), (dx, ref_dx), (dw, ref_dw)):
            assert bench.rel_error(out, ref) < tol, name
        recs = bench.run_provider(point, all_providers()[name], ["rmsnorm_fwd", "rmsnorm_bwd"],
                                   "x", _timer(), True, 1.0, None, True)
        assert [r["status"] for r in recs] == ["ok", "ok"], (name, recs)
        elt = point.x.element_size()
        assert [r["bytes"] for r in recs] == [bench.bytes_moved(op, 6, 48, elt)
                                              for op in ("rmsnorm_fwd", "rmsnorm_bwd")]


def test_guard_checks_rmsnorm_grads():
    # An RMSNorm that scales the weight gradient is wrong in the backward only; one that drops
    # it (weight detached) errors there; a provider without an rmsnorm function errors on the
    # rmsnorm points alone.
    def half_dw(x, w, b=None):
        w2 = w * 0.5 + (w * 0.5).detach()  # same value, half the gradient
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), w2, 1e-5)

    def no_w_grad(x, w, b=None):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), w.detach(), 1e-5)

    ops = ["rmsnorm_fwd", "rmsnorm_bwd"]
    point = _point("rmsnorm", ops)
    for fn, want in ((half_dw, ["ok", "wrong"]), (no_w_grad, ["ok", "error"])):
        prov = Provider("p", "", fn, fn, fn)
        recs = bench.run_provider(point, prov, ops, "fp32", _timer(), True, 1.0, None, True)
        assert [r["status"] for r in recs] == want
    legacy = Provider("two", "softmax and layernorm only", all_providers()["torch"].softmax,
                      all_providers()["torch"].layernorm)
    recs = bench.run_provider(point, legacy, ops, "fp32", _timer(), True, 1.0, None, True)
    assert [r["status"] for r in recs] == ["error", "error"]
    assert "no rmsnorm function" in recs[0]["error"]
    with pytest.raises(ValueError, match="unknown op family"):
        legacy.make("gelu")


def test_check_outputs_tolerances():
    ref = torch.linspace(-1, 1, 100)
    ok, err = bench.check_outputs([ref + 1e-4], [ref], torch.float32)
    assert ok and err == pytest.approx(1e-4, rel=1e-3)
    ok, err = bench.check_outputs([ref + 1e-2], [ref], torch.float32)
    assert not ok
    ok, _ = bench.check_outputs([ref + 1e-2], [ref], torch.bfloat16)
    assert ok
    nan = ref.clone()
    nan[3] = float("nan")
    assert bench.check_outputs([nan], [ref], torch.bfloat16)[0] is False
    assert bench.check_outputs([None], [ref], torch.float32)[0] is False
    assert bench.check_outputs([ref[:5]], [ref], torch.float32)[0] is False


# --- tables ---------------------------------------------------------------------------------------


def _rec(op, n, provider, ms, ok=True, status="ok", dtype="bf16"):
    M = 2**27 // n
    rec = {"op": op, "dtype": dtype, "M": M, "N": n, "provider": provider, "status": status,
           "ok": ok, "ms": ms, "bytes": bench.bytes_moved(op, M, n, 2), "tbps": None,
           "frac_copy": None}
    if ms is not None:
        rec["tbps"] = rec["bytes"] / (ms * 1e-3) / 1e12
        rec["frac_copy"] = rec["tbps"] / 4.0
    return rec


def _synthetic():
    recs = [
        _rec("softmax_fwd", 1024, "fusedops", 0.140), _rec("softmax_fwd", 1024, "torch", 0.200),
        _rec("softmax_fwd", 1024, "liger", None, status="error"),
        _rec("softmax_fwd", 65537, "fusedops", 0.300), _rec("softmax_fwd", 65537, "torch", 0.250),
        _rec("softmax_fwd", 65537, "liger", None, status="skipped"),
        _rec("layernorm_bwd", 262144, "fusedops", 0.5, ok=False),
        _rec("layernorm_bwd", 262144, "torch", 0.6),
    ]
    bench.annotate_speedups(recs)
    return {"device": "Fake GPU", "date": "2026-01-01", "copy_tbps": 4.0, "records": recs,
            "host_latency": [
                {"op": "softmax_fwd", "shape": [4, 128], "dtype": "fp16", "provider": "torch",
                 "us_per_call": 5.0, "delta_vs_torch_us": 0.0},
                {"op": "softmax_fwd", "shape": [4, 128], "dtype": "fp16",
                 "provider": "fusedops", "us_per_call": 6.5, "delta_vs_torch_us": 1.5},
            ]}


def test_format_table():
    text = bench_report.format_table(_synthetic())
    lines = text.splitlines()
    assert "copy 4.000 TB/s" in lines[0]
    head = lines[1].split()
    assert head[:4] == ["op", "dtype", "N", "M"]
    assert head[4:7] == ["fusedops", "torch", "liger"]
    assert "frac_copy" in head
    assert lines[1].rstrip().endswith("vs torch  vs liger")
    body = "\n".join(lines[3:])
    assert "fail" in body and "skip" in body
    row = next(ln for ln in lines if ln.startswith("softmax_fwd") and " 1K " in ln)
    assert row.split()[-2:] == ["x1.43", "-"]  # vs torch 0.200 / 0.140; liger failed
    row = next(ln for ln in lines if "65537" in ln)
    assert row.split()[-2] == "x0.83"
    row = next(ln for ln in lines if ln.startswith("layernorm_bwd"))
    assert "!" in row
    # columns line up
    assert len({len(ln) for ln in lines[1:3]}) == 1
    # no GPU-ahead times (not CUDA): no column for them
    assert "(gpu)" not in text


def test_format_table_gpu_ahead_column():
    res = _synthetic()
    for r in res["records"]:
        if r["ms"] is not None:
            r["ms_gpu"] = r["ms"] * 0.5
    lines = bench_report.format_table(res).splitlines()
    assert "fusedops ms (gpu)" in lines[1]
    row = next(ln for ln in lines if ln.startswith("softmax_fwd") and " 1K " in ln)
    assert "0.140 (0.070)" in row  # fusedops' do_bench median (GPU-ahead time)
    assert row.split()[-2:] == ["x1.43", "-"]  # speed-ups still from the do_bench medians
    assert len({len(ln) for ln in lines[1:3]}) == 1


def test_format_short_table_and_targets():
    res = _synthetic()
    text = bench_report.format_short_table(res)
    row = next(ln for ln in text.splitlines() if ln.startswith("softmax_fwd"))
    cells = row.split()
    # 1K: fusedops 0.140 ms of 2*2^27*2 bytes -> 3.83 TB/s -> 0.96 of copy, not slower
    assert cells[2] == "0.96"
    assert cells[3].endswith("*")  # 65537: slower than torch
    assert "!" in next(ln for ln in text.splitlines() if ln.startswith("layernorm_bwd"))
    t = bench_report.targets_summary(res)
    assert (t["mid_met"], t["mid_total"]) == (1, 1)
    assert t["high_total"] == 2 and t["wrong"] == 1
    assert t["compared"] == 3 and t["beats_all"] == 2
    assert "65537" in t["losses"][0]
    assert "host cost per call" in text and "+1.5" in text


def test_host_bound_points_reported():
    res = _synthetic()
    assert bench_report.host_bound(res) == []  # no GPU-ahead times recorded
    bwd = next(r for r in res["records"] if r["op"] == "layernorm_bwd")
    bwd["ms_gpu"] = bwd["ms"] / 1.2  # do_bench 20% above the GPU's own time
    ok = next(r for r in res["records"] if r["op"] == "softmax_fwd")
    ok["ms_gpu"] = ok["ms"] / 1.05  # within HOST_BOUND: not reported
    bound = bench_report.host_bound(res)
    assert len(bound) == 1 and bound[0].startswith("layernorm_bwd")
    text = bench_report.format_targets(res)
    assert "host-bound" in text and "layernorm_bwd" in text.split("host-bound")[1]


def test_targets_on_gpu_ahead_time():
    """With GPU-ahead times recorded, a second targets line counts them: a host-bound
    fusedops median that loses on do_bench time wins on the GPU's own time."""
    res = _synthetic()
    assert "GPU-ahead" not in bench_report.format_targets(res)  # none recorded
    row = [r for r in res["records"] if r["op"] == "softmax_fwd" and r["N"] == 65537]
    fo = next(r for r in row if r["provider"] == "fusedops")
    for r in row:
        r["ms_gpu"] = r["ms"]
    fo["ms_gpu"] = min(r["ms"] for r in row if r["provider"] != "fusedops" and r["ms"]) / 2
    plain, gpu = bench_report.targets_summary(res), bench_report.targets_summary(res, gpu=True)
    assert gpu["beats_all"] == plain["beats_all"] + 1 and not any("65537" in x
                                                                    for x in gpu["losses"])
    assert gpu["compared"] == plain["compared"] and gpu["wrong"] == plain["wrong"]
    text = bench_report.format_targets(res)
    assert f">= every baseline (within 2%): {gpu['beats_all']}/{gpu['compared']}" in \
        text.split("targets on GPU-ahead time")[1]


def test_gpu_ahead_is_cuda_only():
    timer = bench.Timer("cpu", 1, 1)
    assert timer.gpu_ahead(lambda: None) is None


def test_gpu_ahead_failure_keeps_the_record(monkeypatch):
    def boom(self, fn, cycles=None):
        raise RuntimeError("CUDA out of memory")
    monkeypatch.setattr(bench.Timer, "gpu_ahead", boom)
    r = bench.run_sweep(ops="layernorm", dtypes="fp32", sizes=[64], providers="fusedops",
                        device="cpu", total=2**8, warmup_ms=0.1, rep_ms=0.2,
                        host_latency=False, progress=False)
    assert [rec["op"] for rec in r["records"]] == ["layernorm_fwd", "layernorm_bwd"]
    for rec in r["records"]:
        assert rec["status"] == "ok" and rec["ms"] > 0
        assert rec["ms_gpu"] is None and "out of memory" in rec["ms_gpu_error"]


def test_gpu_ahead_recorded_for_every_point(monkeypatch, tmp_path):
    # A stand-in for CUDA's GPU-ahead time: every record, forward and backward, of every
    # provider carries it, into the JSON, the CSV and the table; the forward sleeps shorter.
    seen = []

    def ahead(self, fn, cycles=None):
        fn()  # the timed call itself, as the real measurement makes it
        seen.append(cycles)
        return 0.5

    monkeypatch.setattr(bench.Timer, "gpu_ahead", ahead)
    r = bench.run_sweep(ops="softmax,rms_fwd", dtypes="fp32", sizes=[64],
                        providers="fusedops,torch", device="cpu", total=2**8, warmup_ms=0.1,
                        rep_ms=0.2, host_latency=False, progress=False)
    recs = r["records"]
    assert len(recs) == 3 * 2 and all(rec["ms_gpu"] == 0.5 for rec in recs)
    fwd = bench.Timer.AHEAD_CYCLES_FORWARD
    assert sorted(seen) == sorted([fwd, bench.Timer.AHEAD_CYCLES, fwd] * 2)
    assert fwd < bench.Timer.AHEAD_CYCLES
    bench_report.write_outputs(r, tmp_path, stem="g", plots=False)
    assert all(rec["ms_gpu"] == 0.5
               for rec in json.loads((tmp_path / "g.json").read_text())["records"])
    with (tmp_path / "g.csv").open() as f:
        assert {row["ms_gpu"] for row in csv.DictReader(f)} == {"0.5"}
    lines = bench_report.format_table(r).splitlines()
    head = next(ln for ln in lines if ln.startswith("op "))
    assert "fusedops ms (gpu)" in head
    assert "(0.500)" in next(ln for ln in lines if ln.startswith("softmax_fwd"))


def test_slug_and_stem():
    assert bench_report.slug("NVIDIA H200") == "h200"
    assert bench_report.slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert bench_report.slug("Apple M2 Pro") == "apple-m2-pro"
    assert bench_report.default_stem({"device": "NVIDIA H200", "date": "2026-11-21"}) == \
        "h200-2026-11-21"


def test_progress_bar_non_tty():
    import io

    buf = io.StringIO()
    bar = bench.Progress(4, stream=buf, interval=0.0)
    for i in range(4):
        bar.update(f"step {i}", advance=1)
    bar.close()
    lines = buf.getvalue().splitlines()
    assert lines[-1].startswith("[" + "#" * 24 + "] 4/4")


def test_apple_peak_lookup_is_optional(monkeypatch):
    import sys
    import types

    # Unknown chip (or the apple_chips module missing): no peak, no crash.
    assert bench.apple_peak_tbps("Not A Chip 9000") is None
    fake = types.ModuleType("fusedops.tools.apple_chips")
    fake.peak_bandwidth_gbps = lambda name: 400.0 if name == "Apple M1 Max" else None
    monkeypatch.setitem(sys.modules, "fusedops.tools.apple_chips", fake)
    assert bench.apple_peak_tbps("Apple M1 Max") == pytest.approx(0.4)
    assert bench.apple_peak_tbps("Apple M9") is None
    monkeypatch.setitem(sys.modules, "fusedops.tools.apple_chips", None)  # import fails
    assert bench.apple_peak_tbps("Apple M1 Max") is None


def test_frac_peak_recorded():
    rec = bench.base_record("softmax_fwd", "fp32", 4, 256, "torch", 4)
    bench.finish_record(rec, 1.0, 0.9, 1.1, copy_tbps=0.5, peak_tbps=0.4)
    assert rec["frac_peak"] == pytest.approx(rec["tbps"] / 0.4)
    assert rec["frac_copy"] == pytest.approx(rec["tbps"] / 0.5)


@pytest.mark.gpu
def test_tiny_sweep_cuda():
    # The real CUDA path (do_bench timing, Triton kernels, Liger if importable), kept small.
    r = bench.run_sweep(ops="all", dtypes="bf16", sizes=[1024, 4097], providers="all",
                        device="cuda", total=2**18, warmup_ms=1, rep_ms=3, host_latency=True,
                        host_latency_calls=20, progress=False)
    assert r["copy_tbps"] > 0.1
    recs = [x for x in r["records"] if x["provider"] in ("fusedops", "torch", "compile")]
    assert len(recs) == 6 * 2 * 3
    for rec in recs:
        assert rec["status"] == "ok", rec
        if rec["op"].endswith("_bwd"):
            assert rec["ms_gpu"] > 0
    assert {x["backend"] for x in recs if x["provider"] == "fusedops"} == {"triton"}


@pytest.mark.gpu
def test_liger_rmsnorm_cuda():
    # Liger's RMSNorm as the harness calls it, against F.rms_norm; dy must survive the backward
    # (in_place=False), since the harness reuses it for every call.
    pytest.importorskip("liger_kernel.ops.rms_norm")
    from fusedops.tools.bench_providers import _liger_rmsnorm

    torch.manual_seed(0)
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(1024, device="cuda")).to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn_like(x)
    dy0 = dy.clone()
    y = _liger_rmsnorm(x, w, None)
    grads = torch.autograd.grad(y, (x, w), dy)
    assert torch.equal(dy, dy0)
    y_ref = torch.nn.functional.rms_norm(x, (1024,), w, 1e-5)
    refs = torch.autograd.grad(y_ref, (x, w), dy)
    ok, err = bench.check_outputs([y, *grads], [y_ref, *refs], torch.bfloat16)
    assert ok, err


# --- torch.compile provider (slow on CPU: a cold Inductor compile is ~20 s) -----------------------


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FUSEDOPS_SLOW_TESTS") or shutil.which("g++") is None,
                    reason="set FUSEDOPS_SLOW_TESTS=1 (needs a C++ compiler for Inductor on CPU)")
def test_compile_provider_cpu():
    r = bench.run_sweep(ops="softmax", dtypes="fp32", sizes=[64], providers="torch,compile",
                        device="cpu", total=256, warmup_ms=0.2, rep_ms=0.5, host_latency=False,
                        progress=False)
    recs = {(x["op"], x["provider"]): x for x in r["records"]}
    fwd, bwd = recs[("softmax_fwd", "compile")], recs[("softmax_bwd", "compile")]
    assert fwd["status"] == bwd["status"] == "ok", (fwd, bwd)
    assert fwd["fwd_mode"] == "train"  # one training graph serves fwd and bwd
    assert fwd["compile_s"] > 0 and r["compile_s_total"] >= fwd["compile_s"]
