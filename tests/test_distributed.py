"""fusedops inside PyTorch's distributed engines, on 2 CPU processes with gloo through the Triton
interpreter: DTensor inputs to every op, FSDP2, tensor/sequence parallelism, activation
checkpointing and torch.compile of an FSDP2 model.

The ranks are spawned once per test by ``examples/distributed_check.py`` (the script the GPU run
uses too; see its docstring), which runs every check inside one spawn and writes its numbers as
JSON; the tests assert those numbers. The plain-tensor hot path never looks for DTensors
(checked in process, below).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import EXHAUSTIVE, INTERPRETING, triton_kernels_ready

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "distributed_check.py"

needs_interpreter = pytest.mark.skipif(
    not (INTERPRETING and triton_kernels_ready()),
    reason="the CPU ranks run the Triton kernels through the interpreter (a GPU machine runs "
           "the script itself under torchrun)")


def run_checks(tmp_path: Path, checks: str, *extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["TRITON_INTERPRET"] = "1"
    out = tmp_path / "dist.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--backend", "gloo",
                           "--checks", checks, "--out", str(out), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    failed = {k: {f: v.get(f) for f in ("error", "problem", "traceback")}
              for k, v in result["checks"].items() if not v["passed"]}
    assert not failed and proc.returncode == 0, json.dumps(failed, indent=1)[-6000:]
    assert "PASS:" in proc.stdout.splitlines()[-1]
    return result["checks"]


def _losses_agree(r: dict, steps: int, tol: float) -> None:
    a, b = r["losses_unpatched"], r["losses_patched"]
    assert len(a) == len(b) == steps
    assert all(0.5 < x < 10 for x in a)  # cross entropy over 64 tokens from random weights
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tol, (a, b)


@EXHAUSTIVE  # (two interpreted ranks through every check: about a minute)
@needs_interpreter
def test_distributed_checks(tmp_path):
    checks = run_checks(tmp_path, "dtensor,fsdp,tp,ckpt")

    d = checks["dtensor"]
    assert d["cases"] == d["cases_passed"] >= 26
    for case in d["case_results"]:
        assert case["fused_calls"], case  # the kernels ran, not PyTorch's ops
        assert case["max_diff_y"] < 2e-5 and case["max_rel_diff_grad"] < 1e-4, case
    names = " ".join(c["case"] for c in d["case_results"])
    for part in ("Shard(dim=1)", "Shard(dim=2)", "Partial", "2-D mesh", "causal", "gelu", "empty"):
        assert part in names
    assert len(d["mixed_argument_errors"]) == 16 and all(d["mixed_argument_errors"].values())
    drop = d["dropout"]
    assert drop["replicas_alike"] and drop["shards_independent"]
    assert 0.4 < drop["keep_rate"] < 0.6
    assert d["op_checkpoint"] == {"passed": True, "plain": True, "dtensor": True}
    sp = d["sequence_parallel_layernorm"]  # nn.LayerNorm under SequenceParallel, patched
    assert sp["passed"] and sp["max_diff"] < 1e-4 and sp["placements"] == "(Shard(dim=1),)"
    assert sp["fused_calls"] == {"layernorm_forward": 1, "layernorm_backward": 1}

    # FSDP2 per block and root; TP with SequenceParallel norms (DTensor Shard(1) inputs).
    for name in ("fsdp", "tp"):
        _losses_agree(checks[name], 2, 1e-4)
        calls = checks[name]["fused_calls"]
        assert calls["rmsnorm_forward"] == calls["rmsnorm_backward"] == 10  # 5 norms x 2 steps
        assert calls["softmax_forward"] == 4
        assert checks[name]["max_param_diff"] < 1e-3

    # checkpoint_wrapper on FSDP2 blocks with the fused dropout: bitwise the same training.
    ck = checks["ckpt"]
    assert ck["losses_unpatched"] == ck["losses_patched"] and ck["max_param_diff"] == 0.0
    # Recomputation runs the epilogue's forward again: 2 blocks x 2 steps, twice.
    assert ck["fused_calls"]["layernorm_epilogue_forward"] == 8
    assert ck["fused_calls"]["layernorm_epilogue_backward"] == 4


@EXHAUSTIVE
@needs_interpreter
def test_distributed_compile_and_bf16_fsdp(tmp_path):
    """torch.compile of the FSDP2 and of the TP patched model: no graph break, fusedops'
    kernels in the compiled graphs, the eager unpatched losses. FSDP2 with bf16 parameters and
    fp32 reduction (the GPU run's policy): the unpatched losses to bf16's rounding."""
    checks = run_checks(tmp_path, "compile,fsdp", "--param-dtype", "bfloat16")
    r = checks["compile"]
    for run, tol in ((r, 2e-2), (r["tp"], 1e-4)):  # FSDP2 (bf16), TP (fp32, DTensor norms)
        assert run["graph_breaks"]["patched"]["count"] == 0
        assert run["graphs_calling_fusedops"]["patched"] >= 1
        assert run["graphs_calling_fusedops"]["unpatched"] == 0
        _losses_agree(run, 2, tol)
    _losses_agree(checks["fsdp"], 2, 2e-2)
    assert checks["fsdp"]["fused_calls"]["rmsnorm_forward"] == 10


def _load_script():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("distributed_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_check_comparison_fails_on_divergence():
    """The script's comparison: a diverging or non-finite loss is a failure."""
    check = _load_script()
    run = {"losses": [4.0, 3.0], "step_times_s": [0.1, 0.1], "fused_calls": {},
           "params": torch.zeros(3)}
    assert check._compare(run, dict(run), 1e-4, 1e-4)["passed"]
    assert not check._compare(run, dict(run, losses=[4.0, 3.1]), 1e-4, 1e-4)["passed"]
    assert not check._compare(run, dict(run, losses=[4.0, float("nan")]), 1e-4, 1e-4)["passed"]
    with pytest.raises(SystemExit):
        check.parse_args(["--device", "cpu", "--backend", "nccl"])
    with pytest.raises(SystemExit):
        check.parse_args(["--checks", "dtensor,nope"])


def test_plain_tensors_never_look_for_dtensors(monkeypatch):
    """The DTensor hook costs the plain path one class test: nothing else of it runs."""
    import fusedops
    from fusedops import _validate
    from fusedops.ops import layernorm, rmsnorm, softmax

    def boom(t):
        raise AssertionError("is_dtensor called on the plain path")

    for module in (softmax, layernorm, rmsnorm):
        monkeypatch.setattr(module, "is_dtensor", boom)
    monkeypatch.setattr(_validate, "is_dtensor", boom)
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.nn.Parameter(torch.ones(16))
    with fusedops.use_backend("reference"):
        for _ in range(2):  # (the second call may take a replay)
            y = fusedops.fused_softmax(x, -1) + fusedops.fused_layernorm(x, 16, w)
            y = y + fusedops.fused_rmsnorm(x, 16, w) + fusedops.fused_softmax(x, scale=0.5)
            y = y + fusedops.fused_layernorm(x, 16, w, residual=x)[0]
            y.sum().backward()
            with torch.no_grad():
                fusedops.fused_layernorm(x, 16, w)
    assert x.grad is not None and torch.isfinite(x.grad).all()
