"""The epilogue-chain benchmark (``python -m fusedops bench-chains``): byte models checked by
hand, parsing and its errors, a tiny CPU run through the CLI and the files it writes, the
correctness and dropout checks. Speed itself is never measured in CI."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import re

import pytest
import torch

from fusedops.tools import bench_chains as bc
from fusedops.tools import chains_run

# --- bytes model ----------------------------------------------------------------------------------


def test_bytes_attention_by_hand():
    # B, H, S = 2, 3, 4 in fp32: x has P = 96 elements = 384 B; the (2, 1, 1, 4) mask 32 B; the
    # bool causal triangle 16 B.
    shape = (2, 3, 4)
    # fused: read x + mask, write y | eager: x*scale 768, + mask 800, softmax 768
    assert bc.bytes_moved("attn_softmax", "fwd", shape, 4) == (800, 2336)
    # + backward: fused reads y, dy and writes dx (1152) | eager softmax bwd 1152, mul bwd 768
    assert bc.bytes_moved("attn_softmax", "fwd_bwd", shape, 4) == (1952, 4256)
    # causal: the fused kernel computes the triangle; eager's masked_fill reads it (768 + 16)
    assert bc.bytes_moved("attn_softmax_causal", "fwd", shape, 4) == (800, 3120)
    assert bc.bytes_moved("attn_softmax_causal", "fwd_bwd", shape, 4) == (1952, 5824)
    # bf16 halves everything but the bool triangle: eager 8 * 96 * 2 + 16 (mask) + 16
    assert bc.bytes_moved("attn_softmax_causal", "fwd", shape, 2) == (400, 1568)


def test_bytes_layernorm_by_hand():
    # M, N = 4, 8 in bf16: a (4, 8) tensor is 64 B, weight + bias 32 B, dropout's bool mask 32 B,
    # float32 mean + rstd 32 B (written by a training forward, read by the backward).
    shape = (4, 8)
    # fused: read x, r (128) + w, b (32), write y, s (128) | eager: add 192, layer_norm 160
    assert bc.bytes_moved("add_layernorm", "fwd", shape, 2) == (288, 352)
    # fwd_bwd fused: 288 + 32 stats; bwd reads s, dy, ds (192), w (16), stats (32), writes dx
    # (64), dw, db (32) = 336 -> 656. eager: 352 + 32; layer_norm bwd 192 + 48 + 32 = 272;
    # accumulating ds into the grad of s 192 -> 848
    assert bc.bytes_moved("add_layernorm", "fwd_bwd", shape, 2) == (656, 848)
    # fused: read x, w, b; write out = 160 | eager: layer_norm 160, dropout 128 + 32 mask,
    # relu 128 = 448
    assert bc.bytes_moved("layernorm_dropout_relu", "fwd", shape, 2) == (160, 448)
    # fused: 160 + 32; bwd reads x, dout (128), w, b (32), stats (32), writes dx (64), dw, db
    # (32) = 288 -> 480. eager: 448 + 32; relu bwd 192, dropout bwd 128 + 32,
    # layer_norm bwd 272 -> 1104
    assert bc.bytes_moved("layernorm_dropout_relu", "fwd_bwd", shape, 2) == (480, 1104)
    # fused as add_layernorm | eager: add 192, layer_norm 160, dropout 160, gelu 128 = 640
    assert bc.bytes_moved("add_layernorm_dropout_gelu", "fwd", shape, 2) == (288, 640)
    # fused: 320 + bwd (192 reads + 64 dx + 64 w, b, dw, db + 32 stats = 352) = 672.
    # eager: 672 (fwd + stats) + gelu bwd 192 + dropout bwd 160 + layer_norm bwd 272 + ds 192
    assert bc.bytes_moved("add_layernorm_dropout_gelu", "fwd_bwd", shape, 2) == (672, 1488)


def test_bytes_terms_sum_and_claim():
    t = bc.bytes_terms("layernorm_dropout_relu", "fwd", (4, 8), 2)
    assert [name.split(" ")[0] for name, _ in t["eager"]] == ["layer_norm", "dropout", "relu"]
    assert len(t["fused"]) == 1
    # the seeds' claim: about 3x less memory traffic for LayerNorm + dropout + ReLU
    fused, eager = bc.bytes_moved("layernorm_dropout_relu", "fwd", (16384, 4096), 2)
    assert eager / fused == pytest.approx(3.25, abs=0.01)
    fused, eager = bc.bytes_moved("layernorm_dropout_relu", "fwd", (16384, 4096), 4)
    assert eager / fused == pytest.approx(3.125, abs=0.01)


def _eval_formula(text: str, **sym: int) -> int:
    """'11Pe + BSe + 2S^2 (...)' -> its value for the given symbols."""
    expr = text.split(" (")[0].replace("^", "**")
    expr = re.sub(r"(?<=[0-9A-Za-z])(?=[A-Za-z])", "*", expr)
    return eval(expr, {}, sym)  # the formulas are ours, a few symbols and + * **


@pytest.mark.parametrize("chain", list(bc.CHAINS))
@pytest.mark.parametrize("mode", bc.MODES)
def test_bytes_model_text_matches_function(chain, mode):
    """The formulas written into every result (and the README) give the function's numbers."""
    if bc.CHAINS[chain].kind == "attn":
        shape, sym = (3, 5, 7), {"B": 3, "H": 5, "S": 7, "P": 3 * 5 * 7 * 7}
    else:
        shape, sym = (6, 10), {"M": 6, "N": 10, "E": 60}
    for elt in (2, 4):
        fused, eager = bc.bytes_moved(chain, mode, shape, elt)
        model = bc.BYTES_MODEL[chain][mode]
        assert _eval_formula(model["fused"], e=elt, **sym) == fused
        assert _eval_formula(model["eager"], e=elt, **sym) == eager


def test_bytes_errors():
    with pytest.raises(ValueError, match="unknown chain 'softmax_gelu'"):
        bc.bytes_moved("softmax_gelu", "fwd", (4, 8), 2)
    with pytest.raises(ValueError, match="unknown mode"):
        bc.bytes_moved("add_layernorm", "bwd", (4, 8), 2)
    with pytest.raises(ValueError, match=r"\(B, H, S\)"):
        bc.bytes_moved("attn_softmax", "fwd", (4, 8), 2)


# --- parsing --------------------------------------------------------------------------------------


def test_resolve_names():
    assert bc.resolve_chains(None) == tuple(bc.CHAINS)
    assert bc.resolve_chains("attn") == ("attn_softmax", "attn_softmax_causal")
    assert bc.resolve_chains("layernorm-dropout-relu,attn_softmax") == (
        "attn_softmax", "layernorm_dropout_relu")
    assert bc.resolve_chains("ln") == ("add_layernorm", "layernorm_dropout_relu",
                                       "add_layernorm_dropout_gelu")
    assert bc.resolve_modes("fwd+bwd") == ("fwd_bwd",)
    assert bc.resolve_modes(None) == ("fwd", "fwd_bwd")
    assert bc.resolve_providers("torch,fused") == ("fusedops", "eager")
    assert bc.resolve_dtypes(None) == ("bf16", "fp32")
    assert bc.resolve_dtypes("all") == ("bf16", "fp32", "fp16")
    with pytest.raises(ValueError, match="unknown chain 'layernorm_gelu'.*add_layernorm"):
        bc.resolve_chains("attn,layernorm_gelu")
    for fn, bad in ((bc.resolve_modes, "bwd"), (bc.resolve_providers, "liger"),
                    (bc.resolve_dtypes, "fp8")):
        with pytest.raises(ValueError, match="unknown"):
            fn(bad)


def test_resolve_sizes():
    s = bc.resolve_sizes("1K,32768x4096,8x12x512")
    assert s == {"ln": ((16384, 1024), (32768, 4096)), "attn": ((8, 12, 512),)}
    # a kind with no entry keeps its default grid; --rows sets M for bare N
    s = bc.resolve_sizes("2x16x2K", rows=4096)
    assert s["attn"] == ((2, 16, 2048),)
    assert s["ln"] == tuple((4096, n) for n in (768, 1024, 2048, 4096, 8192))
    assert bc.resolve_sizes(None) == {"ln": bc.LN_SIZES, "attn": bc.ATTN_SIZES}
    assert bc.resolve_sizes(None, device="cpu") == {"ln": bc.CPU_LN_SIZES,
                                                    "attn": bc.CPU_ATTN_SIZES}
    for bad in ("1x2x3x4", "16384x", "0", "axb"):
        with pytest.raises(ValueError):
            bc.resolve_sizes(bad)


# --- the tiny CPU run through the CLI -------------------------------------------------------------

TOP_KEYS = {"device", "device_type", "torch", "triton", "date", "timestamp", "copy_tbps",
            "copy", "config", "chains", "bytes_model", "records", "skipped", "truncated"}
RECORD_KEYS = {"chain", "mode", "dtype", "shape", "provider", "backend", "status", "ok", "ms",
               "ms_p20", "ms_p80", "bytes_fused", "bytes_eager", "traffic_ratio", "bytes_own",
               "tbps", "own_tbps", "copy_tbps", "frac_copy", "speedup", "max_abs_err",
               "max_rel_err", "check", "dropout_check", "compile_s", "first_call_s", "error"}
# The compile provider is covered by test_compile_provider (one point: Dynamo costs ~0.5 s a graph
# on CPU even with the eager backend).
TINY = ["--device", "cpu", "--dtypes", "fp32,bf16", "--sizes", "32x64,2x2x16",
        "--providers", "fusedops,eager", "--warmup", "0.1", "--rep", "0.3", "--quiet",
        "--tag", "tiny"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from fusedops.__main__ import main

    out = tmp_path_factory.mktemp("chains")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["bench-chains", *TINY, "--out", str(out)])
    return {"rc": rc, "out": out, "stdout": stdout.getvalue(), "stderr": stderr.getvalue(),
            "data": json.loads((out / "tiny.json").read_text())}


def test_cli_writes_files(tiny_run):
    assert tiny_run["rc"] == 0, tiny_run["stderr"]
    out = tiny_run["out"]
    assert sorted(p.name for p in out.iterdir()) == [
        "tiny-speedup.png", "tiny.csv", "tiny.json", "tiny.txt"]
    assert (out / "tiny-speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in tiny_run["stderr"]
    # the table comes last on stdout, one line per chain/dtype/shape/mode
    lines = tiny_run["stdout"].strip().splitlines()
    assert lines[0].startswith("fused epilogue chains on")
    assert "bytes x" in lines[1] and "vs eager" in lines[1] and "of copy" in lines[1]
    assert len(lines) == 2 + 5 * 2 * 2 + 1
    assert lines[-1].startswith("CPU run:") and "1 thread" in lines[-1]  # the default on CPU
    assert (out / "tiny.txt").read_text().strip() == tiny_run["stdout"].strip()


def test_cli_json(tiny_run):
    d = tiny_run["data"]
    assert TOP_KEYS <= set(d)
    assert d["device_type"] == "cpu" and d["torch"] == torch.__version__
    assert d["copy_tbps"] > 0 and not d["truncated"]
    assert set(d["chains"]) == set(bc.CHAINS) == set(d["bytes_model"])
    recs = d["records"]
    assert len(recs) == 5 * 2 * 2 * 2  # chains x dtypes x modes x providers
    for r in recs:
        assert RECORD_KEYS <= set(r), r
        assert r["status"] == "ok", r
        elt = 4 if r["dtype"] == "fp32" else 2
        shape = tuple(int(v) for v in r["shape"].split("x"))
        assert shape == ((2, 2, 16) if r["chain"].startswith("attn") else (32, 64))
        fused, eager = bc.bytes_moved(r["chain"], r["mode"], shape, elt)
        assert (r["bytes_fused"], r["bytes_eager"]) == (fused, eager)
        assert r["traffic_ratio"] == pytest.approx(eager / fused)
        assert r["ms"] > 0
        # effective TB/s: the fused floor over each provider's own time
        assert r["tbps"] == pytest.approx(fused / (r["ms"] * 1e-3) / 1e12)
        assert r["frac_copy"] == pytest.approx(r["tbps"] / d["copy_tbps"])
        assert r["bytes_own"] == {"fusedops": fused, "eager": eager}.get(r["provider"])
        assert set(r["speedup"]) == {"fusedops", "eager"} - {r["provider"]}
    grid = {(r["chain"], r["mode"], r["dtype"], r["provider"]): r for r in recs}
    for (chain, mode, dt, _), r in grid.items():
        for other, s in r["speedup"].items():
            assert s == pytest.approx(grid[(chain, mode, dt, other)]["ms"] / r["ms"])
    fused = [r for r in recs if r["provider"] == "fusedops"]
    assert {r["backend"] for r in fused} == {"reference"}  # CPU tensors


def test_cli_correctness_small(tiny_run):
    for r in tiny_run["data"]["records"]:
        if r["provider"] == "eager":
            assert r["check"] == "reference"
            continue
        if r["provider"] == "compile" and bc.CHAINS[r["chain"]].dropout_p:
            assert r["max_abs_err"] is None and "not compared" in r["check"]
            continue
        assert r["ok"] is True, r
        tol = {"fp32": 1e-5, "bf16": 2e-2}[r["dtype"]]
        assert r["max_rel_err"] <= tol, r
        # gradients of w and b are sums over the rows: absolute error scales with them
        assert r["max_abs_err"] <= (1e-4 if r["dtype"] == "fp32" else 0.5), r
        if r["provider"] == "fusedops" and bc.CHAINS[r["chain"]].dropout_p:
            assert r["check"].startswith("vs eager, dropout p = 0 for both")
            relu_bwd = r["chain"] == "layernorm_dropout_relu" and r["mode"] == "fwd_bwd"
            assert (r["relu_ties"] == 0) if relu_bwd else r["relu_ties"] is None, r
            if r["mode"] == "fwd":
                dc = r["dropout_check"]
                assert dc["ok"] is True, dc
                assert dc["drop_frac"] == pytest.approx(0.1, abs=0.05)
                assert dc["max_rel_err"] <= tol


def test_cli_csv(tiny_run):
    with (tiny_run["out"] / "tiny.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(tiny_run["data"]["records"])
    for col in ("chain", "mode", "dtype", "shape", "M", "N", "B", "H", "S", "provider", "ms",
                "bytes_fused", "bytes_eager", "traffic_ratio", "tbps", "copy_tbps", "frac_copy",
                "speedup_vs_eager", "speedup_vs_compile", "max_abs_err", "max_rel_err",
                "drop_frac", "device", "torch", "triton", "date"):
        assert col in rows[0], col
    for row in rows:
        assert row["device"] and row["torch"] == torch.__version__ and row["date"]
        if row["provider"] == "fusedops":
            assert float(row["speedup_vs_eager"]) > 0 and row["speedup_vs_compile"] == ""
        if row["chain"].startswith("attn"):
            assert row["B"] == "2" and row["M"] == ""
        else:
            assert row["M"] == "32" and row["N"] == "64" and row["S"] == ""
        assert row["ms_gpu"] == "" and row["gpu_speedup_vs_eager"] == ""  # (CUDA only)


def test_gpu_ahead_speedups_and_table():
    """speedup_gpu compares the GPU-ahead times as speedup compares the do_bench medians; the
    table shows fused vs eager of both."""
    def rec(provider, ms, ms_gpu):
        return {"chain": "add_layernorm", "mode": "fwd_bwd", "dtype": "bf16",
                "shape": "16384x768", "provider": provider, "ms": ms, "ms_gpu": ms_gpu,
                "traffic_ratio": 1.37, "tbps": 1.0, "frac_copy": 0.25, "status": "ok",
                "ok": True, "max_abs_err": 0.0, "max_rel_err": 0.0}

    records = [rec("fusedops", 0.5, 0.08), rec("eager", 0.25, 0.12), rec("compile", 0.4, None)]
    bc.annotate_speedups(records)
    fused, eager, compiled = records
    assert fused["speedup"] == {"eager": 0.5, "compile": 0.8}
    assert fused["speedup_gpu"] == {"eager": pytest.approx(1.5)}  # compile has no ms_gpu
    assert compiled["speedup_gpu"] == {} and eager["speedup_gpu"] == {
        "fusedops": pytest.approx(0.08 / 0.12)}
    table = bc.format_table({"records": records, "device": "X", "date": "d", "copy_tbps": 4.0})
    head, row = table.splitlines()[1:3]
    assert "gpu vs eager" in head
    assert "0.50x" in row and "1.50x" in row


def test_compile_provider():
    """torch.compile of the eager chain (the eager backend here: Inductor would take seconds a
    graph on CPU): a fresh graph per mode, its first-call time reported, compared with eager where
    the chain has no dropout, not compared where it has; the compile budget drops it."""
    r = bc.run_chains(chains="add_layernorm", dtypes="fp32", sizes="16x32", device="cpu",
                      compile_backend="eager", warmup_ms=0.1, rep_ms=0.2, progress=False)
    recs = [x for x in r["records"] if x["provider"] == "compile"]
    assert [x["mode"] for x in recs] == ["fwd", "fwd_bwd"]
    assert r["config"]["compile_backend"] == "eager"
    for x in recs:
        assert x["status"] == "ok" and x["backend"] == "torch.compile(eager)", x
        assert x["compile_s"] > 0 and x["compile_s"] == x["first_call_s"]
        assert x["bytes_own"] is None and x["own_tbps"] is None
        assert x["ok"] is True and x["max_rel_err"] <= 1e-5  # outputs (and grads in fwd_bwd)
    fused = [x for x in r["records"] if x["provider"] == "fusedops"]
    assert all(set(x["speedup"]) == {"eager", "compile"} for x in fused)
    assert r["compile_s_total"] == pytest.approx(sum(x["compile_s"] for x in recs))
    # with dropout: timed, not compared; a spent compile budget skips the next points
    r = bc.run_chains(chains="layernorm_dropout_relu", dtypes="fp32", sizes="16x32,16x64",
                      device="cpu", providers="compile", modes="fwd", compile_backend="eager",
                      compile_budget_s=0.0, warmup_ms=0.1, rep_ms=0.2, progress=False)
    first, second = r["records"]
    assert first["status"] == "ok" and first["ok"] is None and "not compared" in first["check"]
    assert second["status"] == "skipped" and second["error"] == "compile budget spent"


def test_cli_bad_names(capsys):
    from fusedops.__main__ import main

    assert main(["bench-chains", "--device", "cpu", "--chains", "attn,softmax_gelu"]) == 2
    err = capsys.readouterr().err
    assert "unknown chain 'softmax_gelu'" in err and "layernorm_dropout_relu" in err
    assert main(["bench-chains", "--device", "cpu", "--sizes", "1x2x3x4"]) == 2
    assert "bad size" in capsys.readouterr().err
    assert main(["bench-chains", "--device", "cpu", "--modes", "bwd"]) == 2
    assert "unknown mode" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench-chains", "--help"])
    assert "bench-chains" in capsys.readouterr().out


# --- pieces ---------------------------------------------------------------------------------------


def test_time_budget_truncates():
    r = bc.run_chains(chains="add_layernorm", dtypes="fp32", sizes="8x16,8x32", device="cpu",
                      providers="eager", warmup_ms=0.1, rep_ms=0.2, time_budget_s=0.0,
                      progress=False)
    assert r["truncated"] is True and r["records"] == []
    assert [s["shape"] for s in r["skipped"]] == ["8x16", "8x32"]


def test_inputs_mask_and_causal():
    inp = bc.make_inputs("attn_softmax_causal", (4, 2, 8), torch.float16, "cpu", seed=3)
    x, mask, tri = inp["args"]
    assert x.shape == (4, 2, 8, 8) and mask.shape == (4, 1, 1, 8) and mask.dtype == x.dtype
    assert torch.isinf(mask[0]).any()  # batch 0 always pads with -inf
    assert (mask[:, ..., 0] == 0).all()  # the first key is never masked: no empty rows
    assert tri.dtype == torch.bool and torch.equal(tri, torch.ones(8, 8, dtype=torch.bool).triu(1))
    y = bc.make_eager("attn_softmax_causal")(x.float(), mask.float(), tri)
    assert torch.isfinite(y).all()
    assert y[..., 0, 1:].abs().max() == 0  # the causal first row keeps only key 0


def test_dropout_check_catches_a_missing_dropout():
    inp = bc.make_inputs("layernorm_dropout_relu", (64, 128), torch.float32, "cpu")
    x, w, b = inp["args"]
    y = torch.nn.functional.layer_norm(x, (128,), w, b)
    good = torch.relu(torch.nn.functional.dropout(y, 0.1, training=True))
    assert bc.dropout_check("layernorm_dropout_relu", inp, good, 0.1)["ok"] is True
    no_drop = torch.relu(y) / 0.9  # scaled but never dropped
    chk = bc.dropout_check("layernorm_dropout_relu", inp, no_drop, 0.1)
    assert chk["ok"] is False and chk["drop_frac"] == 0.0 and chk["max_rel_err"] < 1e-6
    unscaled = torch.relu(y)  # dropped nothing and kept values not scaled by 1 / (1 - p)
    assert bc.dropout_check("layernorm_dropout_relu", inp, unscaled, 0.1)["max_rel_err"] > 0.05


def test_compare_reports_nan():
    a, b = torch.ones(3), torch.ones(3)
    assert bc.compare([a], [b]) == (0.0, 0.0)
    bad = torch.tensor([1.0, math.nan, 1.0])
    abs_err, rel_err = bc.compare([bad, a], [b, b])
    assert math.isnan(abs_err) and math.isnan(rel_err)
    assert bc.compare([a], [torch.ones(4)]) == (math.inf, math.inf)


def test_a_failing_provider_is_recorded(monkeypatch):
    def broken(chain, p=None):
        def fn(*args):
            raise TypeError("fused_layernorm() got an unexpected keyword argument 'residual'")
        return fn

    monkeypatch.setattr(chains_run, "make_fused", broken)
    r = bc.run_chains(chains="add_layernorm", dtypes="fp32", sizes="8x16", device="cpu",
                      providers="fusedops,eager", warmup_ms=0.1, rep_ms=0.2, progress=False)
    fused = [x for x in r["records"] if x["provider"] == "fusedops"]
    assert [x["status"] for x in fused] == ["error", "error"]
    assert "unexpected keyword argument" in fused[0]["error"]
    assert all(x["status"] == "ok" for x in r["records"] if x["provider"] == "eager")
    assert "error" in bc.format_table(r)  # the table still renders


def _tie_inputs():
    """LayerNorm + ReLU inputs (32 x 64, fp32) whose pre-activation at (3, 5) is 1e-7 of its
    max |y|: within rounding of 0, where two correct kernels may take opposite sides."""
    import torch.nn.functional as F

    inp = bc.make_inputs("layernorm_dropout_relu", (32, 64), torch.float32, "cpu", seed=1)
    x, w, b = inp["args"]
    y = F.layer_norm(x, (64,), w, b, bc.EPS)
    b[5] = b[5] - y[3, 5] + 1e-7 * y.abs().max()
    bc.grad_out(inp, "cpu", torch.float32)
    return inp, F.layer_norm(x, (64,), w, b, bc.EPS)


def test_relu_tie_reference_keeps_the_fused_pattern():
    inp, y = _tie_inputs()
    assert 0 < y[3, 5] < 1e-6 * y.abs().max()
    tied = torch.relu(y)
    tied[3, 5] = 0.0  # a fused forward whose pre-activation rounded just below 0 there
    ref, ties, worst = bc.relu_tie_reference("layernorm_dropout_relu", inp, tied, "cpu",
                                             torch.float32)
    assert ties == 1 and 0 < worst <= bc.RELU_TIE_TOL[torch.float32]
    eager = bc.run_mode(bc.make_eager("layernorm_dropout_relu", p=0.0), inp, "fwd_bwd", "cpu",
                    torch.float32)
    eager = eager[0] + eager[1]
    # Against eager, dx at the tied element differs by the whole upstream gradient (what the
    # check flagged as wrong before it knew ties); against the tie-aware reference the same
    # gradients agree.
    dx_gap = (ref[1] - eager[1]).abs()
    assert dx_gap[3, 5] > 0.1 * eager[1].abs().max()
    assert bc.compare(ref, eager)[1] > bc.CHECK_TOL[torch.float32]
    keep = (tied > 0).float()
    x = inp["args"][0].detach().requires_grad_(True)
    w = inp["args"][1].detach().requires_grad_(True)
    b = inp["args"][2].detach().requires_grad_(True)
    out = torch.nn.functional.layer_norm(x, (64,), w, b, bc.EPS) * keep
    grads = torch.autograd.grad(out, (x, w, b), inp["grad_out"][0])
    assert bc.compare((out.detach(), *grads), ref)[1] < 1e-6


def test_relu_tie_reference_flags_a_wrong_mask():
    inp, y = _tie_inputs()
    wrong = torch.relu(y)
    big = y.argmax()
    wrong.view(-1)[big] = 0.0  # dropped an element far from 0: a real bug, not a tie
    _, ties, worst = bc.relu_tie_reference("layernorm_dropout_relu", inp, wrong, "cpu",
                                           torch.float32)
    assert ties == 1 and worst > 0.5  # y.max() over max |y|
    with pytest.raises(ValueError, match="not a LayerNorm \\+ ReLU chain"):
        bc.relu_tie_reference("add_layernorm", inp, wrong, "cpu", torch.float32)


@pytest.mark.parametrize("flip", ["tie", "far"])
def test_relu_ties_in_a_run(monkeypatch, flip):
    """run_chains's fwd_bwd check of the ReLU chain passes a fused forward that broke a tie the
    other way and fails one that dropped an element far from 0."""
    inp, y = _tie_inputs()
    monkeypatch.setattr(chains_run, "make_inputs", lambda *a, **k: inp)
    where = (3, 5) if flip == "tie" else divmod(int(y.argmax()), 64)
    mask = torch.ones_like(y)
    mask[where] = 0.0

    def flipped(chain, p=None):
        eager = bc.make_eager(chain, p=p)
        return lambda *args: eager(*args) * mask

    monkeypatch.setattr(chains_run, "make_fused", flipped)
    r = bc.run_chains(chains="layernorm_dropout_relu", dtypes="fp32", sizes="32x64",
                      device="cpu", providers="fusedops", modes="fwd_bwd", warmup_ms=0.1,
                      rep_ms=0.2, progress=False)
    (rec,) = r["records"]
    assert rec["relu_ties"] == 1 and "ReLU ties" in rec["check"]
    assert rec["ok"] is (flip == "tie"), rec
