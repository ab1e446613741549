"""A patched model under DistributedDataParallel (2 processes) trains like the unpatched one.

Runs ``examples/ddp_check.py`` (see its docstring) in a subprocess: gloo on CPU with the PyTorch
reference backend and with the Triton kernels through the interpreter, and NCCL on two GPUs
(``gpu`` marker, skipped unless there are two). The script's own PASS/FAIL logic is unit-tested
on fabricated results so a FAIL cannot go unnoticed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import triton_kernels_ready

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "ddp_check.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("ddp_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_check(*args: str, interpret: bool | None = None, timeout: int = 300):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if interpret is not None:
        env["TRITON_INTERPRET"] = "1" if interpret else "0"
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def _assert_passed(rc: int, out: str, err: str, steps: int) -> None:
    assert rc == 0 and "PASS:" in out, out + err[-3000:]
    assert "FAIL" not in out
    loss_rows = [line for line in out.splitlines() if line.strip().split(" ")[0].isdigit()]
    assert len(loss_rows) == steps, out
    assert "parameters identical across ranks: unpatched True, patched True" in out


# (exhaustive: two spawned ranks, seconds; test_ddp_check_reports_failures runs the script's
# PASS/FAIL logic by default)
@pytest.mark.exhaustive
def test_ddp_gloo_cpu_reference():
    rc, out, err = run_check("--backend", "gloo", "--device", "cpu", "--steps", "5")
    _assert_passed(rc, out, err, 5)
    assert "fusedops backend of the patched run: reference" in out
    # Every op of the predictor went to fusedops: the pooling softmax, ln1 x 2 and ln_f, the
    # attention softmaxes as epilogue patterns; the ln2(x + attn) x 2 patterns run their
    # original forward (PyTorch's ops: no fused backend), whose LayerNorm is fusedops'.
    assert "'softmax': 1, 'layernorm': 5" in out
    assert "'add_layernorm:native': 2, 'softmax_epilogue': 2" in out


@pytest.mark.exhaustive  # (two spawned ranks through the interpreter: tens of seconds)
@pytest.mark.skipif(not triton_kernels_ready(), reason="Triton kernels not available")
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CPU-only check: on CUDA machines the NCCL test covers the compiled "
                           "kernels (and Triton 3.6's interpreter fails there in a range() "
                           "loop: int() of a 1-element NumPy array)")
def test_ddp_gloo_cpu_triton_interpreter():
    rc, out, err = run_check("--backend", "gloo", "--device", "cpu", "--steps", "3",
                             "--fused-backend", "triton", interpret=True)
    _assert_passed(rc, out, err, 3)
    # 3 steps: per step 1 plain softmax, 2 masked (attention), 3 LayerNorms, 2 epilogues.
    for op, n in (("softmax", 3), ("softmax_masked", 6), ("layernorm", 9),
                  ("layernorm_epilogue", 6)):
        assert f"'{op}_backward': {n}" in out, out


def test_ddp_check_reports_failures():
    """The PASS/FAIL logic: diverging or non-finite losses, ranks out of sync, an inactive
    patch and fused kernels that never ran are all FAIL."""
    check = _load_script()
    args = check.parse_args(["--steps", "2"])
    good = {
        "plain": {"losses": [1.0, 0.5], "in_sync": True, "fused_calls": {},
                  "routed_calls": None},
        "fused": {"losses": [1.0, 0.5 + 1e-7], "in_sync": True,
                  "fused_calls": {"softmax_forward": 2}, "routed_calls": {"softmax": 1}},
        "max_param_diff": 0.0,
        "fused_backend": "triton",
    }
    assert check.evaluate(good, args)[0]

    def broken(**changes):
        bad = {k: dict(v) if isinstance(v, dict) else v for k, v in good.items()}
        for key, value in changes.items():
            run, field = key.split("__")
            bad[run][field] = value
        return check.evaluate(bad, args)[0]

    assert not broken(fused__losses=[1.0, 0.6])
    assert not broken(fused__losses=[1.0, float("nan")])
    assert not broken(plain__in_sync=False)
    assert not broken(fused__routed_calls={"softmax": 0})
    assert not broken(fused__fused_calls={})
    with pytest.raises(SystemExit):
        check.parse_args(["--backend", "nccl", "--device", "cpu"])


def test_ddp_check_teardown_crash(tmp_path, monkeypatch):
    """A rank killed by a signal after rank 0 wrote its result (torch.distributed's teardown)
    is tolerated and reported; before that, and any exception, is a failure."""
    check = _load_script()
    args = check.parse_args(["--steps", "1"])
    out_path = str(tmp_path / "rank0.json")

    def killed(*a, **k):
        raise check.mp.ProcessExitedException("process 1 terminated with signal SIGABRT",
                                               error_index=1, error_pid=1, exit_code=-6,
                                               signal_name="SIGABRT")
    monkeypatch.setattr(check.mp, "spawn", killed)
    assert "SIGABRT" in check.run_workers(args, out_path)  # no result yet: a failure
    (tmp_path / "rank0.json").write_text("{}")
    assert check.run_workers(args, out_path) is None

    def raised(*a, **k):
        raise RuntimeError("boom")
    monkeypatch.setattr(check.mp, "spawn", raised)
    assert "boom" in check.run_workers(args, out_path)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ddp_nccl_two_gpus(dtype):
    rc, out, err = run_check("--backend", "nccl", "--device", "cuda", "--steps", "10",
                             "--dtype", dtype, "--seq-len", "128", "--d-model", "128",
                             interpret=False, timeout=600)
    _assert_passed(rc, out, err, 10)
    assert "fusedops backend of the patched run: triton" in out
