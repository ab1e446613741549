"""The measure-first workflow tools: Amdahl math, op classification, the profiler report, the
profile / train / verify CLIs, the demo end to end, and the compile break-even."""

from __future__ import annotations

import copy
import json
import math
import os
import sys

import pytest
import torch
from conftest import EXHAUSTIVE

import fusedops
from fusedops.models import Predictor, PredictorConfig, task_for
from fusedops.tools import _report, amdahl
from fusedops.tools import profile as prof

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = PredictorConfig(n_features=5, max_len=12, d_model=16, n_heads=2, n_layers=1, d_ff=32)


@pytest.fixture
def one_thread():
    """One intra-op thread: on a small shared CPU, far steadier than several spinning threads."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_model_and_inputs(batch=4):
    torch.manual_seed(0)
    model = Predictor(TINY).eval()
    task = task_for(TINY)
    x, mask, _ = task.sample(batch, task.generator(0))
    return model, (x, mask)


# ---------------------------------------------------------------------------------------------
# Amdahl


def test_amdahl_math():
    assert amdahl.speedup(0.5, 2.0) == pytest.approx(1 / (0.5 + 0.25))
    assert amdahl.speedup(0.0, 10.0) == 1.0
    assert amdahl.speedup(1.0, 4.0) == pytest.approx(4.0)
    assert amdahl.speedup(0.3, 0.5) == pytest.approx(1 / (0.7 + 0.6))  # slower part
    assert amdahl.bound(0.5) == pytest.approx(2.0)
    assert amdahl.bound(0.0) == 1.0
    assert math.isinf(amdahl.bound(1.0))
    both = amdahl.combined({"softmax": (0.2, 2.0), "layernorm": (0.1, 4.0)})
    assert both == pytest.approx(1 / (0.7 + 0.1 + 0.025))
    # the prediction never beats the bound, and equals it for infinitely fast parts
    assert both < amdahl.bound(0.3)
    assert amdahl.combined({"a": (0.3, 1e12)}) == pytest.approx(amdahl.bound(0.3))
    for bad in ((-0.1, 2.0), (1.5, 2.0), (0.5, 0.0), (0.5, -1.0)):
        with pytest.raises(ValueError):
            amdahl.speedup(*bad)
    with pytest.raises(ValueError, match="sum"):
        amdahl.combined({"a": (0.7, 2.0), "b": (0.6, 2.0)})


def test_amdahl_predict_and_break_even():
    p = amdahl.predict(10.0, {"softmax": 0.2, "layernorm": 0.1}, {"softmax": 2.0})
    assert p["op_speedups"] == {"softmax": 2.0, "layernorm": 1.0}  # missing: unchanged
    assert p["fused_fraction"] == pytest.approx(0.3)
    assert p["predicted_speedup"] == pytest.approx(1 / 0.9)
    assert p["predicted_ms"] == pytest.approx(9.0)
    assert p["bound_speedup"] == pytest.approx(1 / 0.7)
    assert p["bound_ms"] == pytest.approx(7.0)
    assert p["saved_ms"]["softmax"] == pytest.approx(1.0)
    assert p["saved_ms"]["layernorm"] == pytest.approx(0.0)
    # 10 s of compiling, 2 ms saved per call -> 5000 calls
    assert amdahl.break_even(10.0, 5.0, 3.0) == pytest.approx(5000)
    assert amdahl.break_even(10.0, 3.0, 3.0) is None
    assert amdahl.break_even(10.0, 3.0, 4.0) is None


def test_amdahl_cli(capsys):
    assert amdahl.main(["softmax=0.5:2"]) == 0
    out = capsys.readouterr().out
    assert "1.333x" in out and "2.000x" in out
    with pytest.raises(SystemExit):
        amdahl.main(["nonsense"])


# ---------------------------------------------------------------------------------------------
# profiler report


@pytest.mark.parametrize(
    "name, category",
    [
        ("aten::softmax", "softmax"),
        ("aten::_softmax", "softmax"),
        ("aten::log_softmax", "other"),
        ("void (anonymous namespace)::softmax_warp_forward<c10::BFloat16>", "softmax"),
        ("softmax_fwd_single", "softmax"),
        ("fusedops::softmax_forward", "softmax"),
        ("aten::layer_norm", "layernorm"),
        ("aten::native_layer_norm", "layernorm"),
        ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float>",
         "layernorm"),
        ("ln_fwd_single", "layernorm"),
        ("smm_fwd_single", "softmax"),  # the masked softmax (attention's)
        ("smm_bwd_looped", "softmax"),
        ("ln_epi_fwd_2d", "layernorm"),  # add + LayerNorm, LayerNorm + dropout + activation
        ("ln_epi_bwd_columns", "layernorm"),
        ("fusedops::layer_norm_forward", "layernorm"),
        ("aten::linear", "matmul"),
        ("aten::addmm", "matmul"),
        ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NNN", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "matmul"),
        ("aten::add", "elementwise"),
        ("aten::masked_fill", "elementwise"),
        ("void at::native::vectorized_elementwise_kernel<8, ...>", "elementwise"),
        ("aten::view", "view"),
        ("aten::copy_", "memory"),
        ("Memset (Device)", "memory"),
        ("aten::sum", "reduction"),
        ("aten::embedding", "other"),
    ],
)
def test_categorize(name, category):
    assert prof.categorize(name) == category


def test_capture_calls_sees_module_and_functional_forms():
    model, inputs = tiny_model_and_inputs()
    calls = prof.capture_calls(model, inputs)
    by_shape = {(c["op"], tuple(c["shape"])): c for c in calls}
    att = by_shape[("softmax", (4, 2, 12, 12))]
    assert att["count"] == TINY.n_layers and att["dim"] == -1 and att["dtype"] == "float32"
    assert by_shape[("softmax", (4, 12))]["count"] == 1
    ln = by_shape[("layernorm", (4, 12, 16))]
    assert ln["count"] == 2 * TINY.n_layers + 1
    assert ln["normalized_shape"] == [16] and ln["weight_dtype"] == "float32"


def test_measure_op_speedups():
    calls = [
        {"op": "softmax", "shape": [2, 3, 8], "dtype": "float32", "dim": -1, "out_dtype": None,
         "count": 2},
        {"op": "layernorm", "shape": [4, 8], "dtype": "float32", "normalized_shape": [8],
         "weight_dtype": None, "bias_dtype": None, "eps": 1e-5, "count": 1},
    ]
    res = prof.measure_op_speedups(calls, "cpu", reps=2)
    assert len(res["calls"]) == 2
    for c in res["calls"]:
        assert c["native_us"] > 0 and c["fused_us"] > 0
        assert c["speedup"] == pytest.approx(c["native_us"] / c["fused_us"])
    sm = res["ops"]["softmax"]
    assert sm["native_us_per_forward"] == pytest.approx(2 * res["calls"][0]["native_us"])
    expect_fused = fusedops._dispatch.backend_for(torch.empty(0)).NAME != "reference"
    assert sm["fused"] is expect_fused


def _check_profile(report, model_label):
    assert report["label"] == model_label
    assert report["device"] == "cpu"
    assert report["iters"] == 3
    assert report["forward_ms"] > 0 and report["latency"]["median_ms"] > 0
    assert report["launches_per_forward"] > 0
    assert report["aten_ops_per_forward"] >= report["launches_per_forward"]
    assert 0 <= report["dispatch"]["tax"] < 1
    names = {r["op"] for r in report["ops"]}
    assert {"aten::softmax", "aten::layer_norm", "aten::linear"} <= names
    sm = next(r for r in report["ops"] if r["op"] == "aten::softmax")
    assert sm["calls"] == TINY.n_layers + 1 and sm["category"] == "softmax"
    ln = next(r for r in report["ops"] if r["op"] == "aten::layer_norm")
    assert ln["calls"] == 2 * TINY.n_layers + 1
    total_share = sum(r["share"] for r in report["ops"])
    assert total_share + report["dispatch"]["tax"] == pytest.approx(1.0, abs=1e-6)
    f = report["fractions"]
    assert 0 < f["softmax"] < 1 and 0 < f["layernorm"] < 1
    assert report["softmax_layernorm_share"] == pytest.approx(f["softmax"] + f["layernorm"])
    a = report["amdahl"]
    assert a["fused_fraction"] == pytest.approx(report["softmax_layernorm_share"])
    assert a["predicted_speedup"] <= a["bound_speedup"]
    assert a["bound_speedup"] == pytest.approx(1 / (1 - a["fused_fraction"]))
    json.dumps(_report.jsonable(report))  # JSON-able


def test_profile_report_on_tiny_model(one_thread):
    model, inputs = tiny_model_and_inputs()
    report = prof.profile_model(model, inputs, iters=3, timing_reps=5, speedup_reps=2,
                                label="tiny", quiet=True)
    _check_profile(report, "tiny")
    text = prof.format_profile(report)
    for needle in ("aten::softmax", "softmax share", "Amdahl", "no separate device"):
        assert needle in text
    assert model.training is False


def test_profile_patched_model_attributes_fused_calls(one_thread):
    model, inputs = tiny_model_and_inputs()
    # fusedops' own paths on CPU tensors (automatically they would run PyTorch's ops).
    with fusedops.use_backend("reference"):
        fusedops.patch_model(model, force=True, patterns=True)
        report = prof.profile_model(model, inputs, iters=2, timing_reps=3,
                                    measure_speedups=False, quiet=True)
    names = {r["op"]: r for r in report["ops"]}
    # The attention softmax and ln2(x + attn) run as fused epilogue patterns; the pooling
    # softmax, ln1 and ln_f as plain fused ops.
    assert names["fusedops::softmax_masked_forward"]["calls"] == TINY.n_layers
    assert names["fusedops::softmax_forward"]["calls"] == 1
    assert names["fusedops::layer_norm_epilogue_forward"]["calls"] == TINY.n_layers
    assert names["fusedops::layer_norm_forward"]["calls"] == TINY.n_layers + 1
    assert "aten::softmax" not in names and "aten::layer_norm" not in names
    assert report["fractions"]["softmax"] > 0 and "amdahl" not in report
    # the profiling annotations are gone afterwards
    from fusedops.ops import layernorm, softmax

    assert softmax._forward_rows.__module__ == "fusedops.ops.softmax"
    assert layernorm._forward_rows.__module__ == "fusedops.ops.layernorm"


def test_profile_cli_module_factory(tmp_path, capsys, one_thread):
    out = tmp_path / "p.json"
    target = os.path.join(ROOT, "examples", "custom_model.py") + ":make_model"
    rc = prof.main([target, "--iters", "2", "--reps", "3", "--patch", "--json", str(out),
                    "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "per forward" in text and "patch_model" in text and "measured" in text
    data = json.loads(out.read_text())
    assert {"device", "profile", "patch", "patched", "measured_speedup"} <= set(data)
    calls = data["profile"]["captured_calls"]
    # the example model uses F.layer_norm, nn.LayerNorm and Tensor.softmax
    assert {c["op"] for c in calls} == {"softmax", "layernorm"}
    if torch.cuda.is_available():
        assert len(data["patch"]["replaced"]) == 1  # the one nn.LayerNorm module
    else:  # no fused backend: the model is left as it is, and the report says so
        assert data["patch"]["applied"] is False and data["patch"]["replaced"] == []
        assert "no fused backend" in data["patch"]["reason"]


def test_load_target_errors(tmp_path):
    with pytest.raises(ValueError, match="MODULE:FACTORY"):
        prof.load_target("no_colon")
    with pytest.raises(FileNotFoundError):
        prof.load_target(str(tmp_path / "missing.py") + ":f")
    path = tmp_path / "m.py"
    path.write_text("def bad():\n    return 3\n")
    with pytest.raises(AttributeError):
        prof.load_target(f"{path}:nope")
    with pytest.raises(TypeError, match="model, example_inputs"):
        prof.load_target(f"{path}:bad")


def test_move_inputs_and_call_model():
    model, (x, mask) = tiny_model_and_inputs()
    moved = prof.move_inputs({"x": x, "mask": mask, "n": 3}, "cpu", torch.float64)
    assert moved["x"].dtype == torch.float64 and moved["mask"].dtype == torch.bool
    assert moved["n"] == 3
    out = prof.call_model(model.double(), {"x": moved["x"], "mask": moved["mask"]})
    assert out.shape == (4, 1)


# ---------------------------------------------------------------------------------------------
# summaries and small helpers


def test_summarize_and_table():
    s = _report.summarize([0.001, 0.002, 0.003, 0.004, 0.010])
    assert s["n"] == 5 and s["median_ms"] == pytest.approx(3.0)
    assert s["min_ms"] == pytest.approx(1.0) and s["max_ms"] == pytest.approx(10.0)
    assert s["p10_ms"] == pytest.approx(1.4) and s["p90_ms"] == pytest.approx(7.6)
    t = _report.table([["a", 1], ["bbb", 22]], ["name", "n"])
    assert t.splitlines()[0].startswith("name") and "bbb" in t
    assert _report.jsonable({"x": float("inf"), "d": torch.float16, "t": (1, 2)}) == \
        {"x": None, "d": "torch.float16", "t": [1, 2]}
    assert _report.dtype_from_name("bf16") is torch.bfloat16


# ---------------------------------------------------------------------------------------------
# CLIs: train, verify


def test_train_cli(tmp_path, capsys, one_thread):
    from fusedops.models import load_checkpoint
    from fusedops.tools import train

    ckpt = tmp_path / "p.pt"
    assert train.main(["--steps", "5", "--out", str(ckpt), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "held-out after" in text and "predicting the mean" in text
    model, meta = load_checkpoint(ckpt)
    assert meta["info"]["steps"] == 5 and meta["task"] is not None


def test_verify_cli(capsys):
    from fusedops.tools import verify

    assert verify.main(["--quick", "--dtypes", "float32,bfloat16"]) == 0
    text = capsys.readouterr().out
    assert "cases passed" in text and "FAIL" not in text


def test_cli_dispatch_lists_commands(capsys):
    from fusedops.__main__ import main

    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# demo end to end, compile break-even


@EXHAUSTIVE  # (30 training steps and the plots; test_demo_cli_fast runs the demo by default)
def test_demo_end_to_end_cpu(tmp_path, capsys, one_thread):
    from fusedops.tools.demo import run_demo

    out = tmp_path / "demo"
    report = run_demo(preset="cpu", device="cpu", out=str(out), train_steps=30, rounds=2,
                      per_round=3, iters=2, skip_compile=True, quiet=False)
    text = capsys.readouterr().out
    assert report["files"][0].endswith("report.json")
    for section in ("1. model", "2. profile", "3. patch_model", "4. verification",
                    "5. re-profile", "6. end-to-end latency", "7. measured speed-up",
                    "8. torch.compile"):
        assert section in text
    data = json.loads((out / "report.json").read_text())
    required = {"device", "profile", "baseline", "patched", "verification", "amdahl",
                "measured_speedup", "compile"}
    assert required <= set(data)
    for png in ("ops_breakdown.png", "latency.png"):
        blob = (out / png).read_bytes()
        assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 10_000
    ver = data["verification"]
    assert ver["passed"] and ver["max_abs_diff"] <= ver["allowed_abs"]
    assert ver["heldout_before"]["r2"] == pytest.approx(ver["heldout_after"]["r2"], abs=1e-3)
    assert data["baseline"]["latency"]["n"] == 6 and len(data["patched"]["samples_ms"]) == 6
    ms = data["measured_speedup"]
    assert ms["value"] == pytest.approx(ms["baseline_median_ms"] / ms["patched_median_ms"])
    assert data["amdahl"]["predicted_speedup"] == ms["predicted"]
    assert data["compile"]["status"] == "skipped"
    if not data["device"]["fused_kernels_available"]:
        assert ms["fused_kernels"] is False
        assert "no fused GPU kernel" in ms["claim"]
        assert "no fused GPU kernel" in text
    assert (out / "predictor-cpu.pt").exists()
    # a second run loads the checkpoint instead of training
    again = run_demo(preset="cpu", device="cpu", out=str(out), rounds=1, per_round=2, iters=1,
                     skip_compile=True, plots=False, quiet=True)
    assert again["training"]["source"] == "loaded"


def test_demo_cli_fast(tmp_path, one_thread):
    from fusedops.tools import demo

    out = tmp_path / "d"
    assert demo.main(["--fast", "--skip-compile", "--no-plots", "--quiet", "--out", str(out),
                      "--device", "cpu", "--train-steps", "5"]) == 0
    assert (out / "report.json").exists() and not (out / "latency.png").exists()


@EXHAUSTIVE  # (an Inductor build and timed rounds: seconds)
@pytest.mark.skipif(sys.platform == "win32", reason="Inductor needs a C++ compiler")
def test_compile_break_even(one_thread):
    from fusedops.tools.demo import compile_break_even

    model, inputs = tiny_model_and_inputs(2)
    patched = copy.deepcopy(model)
    fusedops.patch_model(patched)
    res = compile_break_even(model, patched, inputs, torch.device("cpu"), 1.0, 2, 2,
                             quiet=True)
    assert res["status"] == "ok", res
    assert res["compile_s"] > 0 and res["latency"]["n"] == 4
    fused, comp = res["fused_eager_latency"]["median_ms"], res["latency"]["median_ms"]
    if comp < fused:
        want = math.ceil(res["compile_s"] / ((fused - comp) / 1e3))
        assert res["break_even_inferences_vs_fused_eager"] == want
        assert not res["fused_eager_wins_outright"]
    else:
        assert res["break_even_inferences_vs_fused_eager"] is None
        assert res["fused_eager_wins_outright"]
        assert "wins outright" in res["verdict"]
