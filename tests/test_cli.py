"""``python -m fusedops``: exit codes, one-line errors for bad input, ``--threads``, CPU labels, and
matplotlib as an optional extra."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import fusedops
from fusedops.__main__ import main
from fusedops.tools import bench_harness, bench_report, cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The smallest bench and bench-chains runs the commands allow (well under a second each).
TINY_BENCH = ["bench", "--device", "cpu", "--ops", "softmax_fwd", "--dtypes", "fp32", "--sizes",
              "64", "--providers", "fusedops,torch", "--total", "256", "--warmup", "0.1",
              "--rep", "0.2", "--no-host-latency", "--quiet", "--table", "short"]
TINY_CHAINS = ["bench-chains", "--device", "cpu", "--chains", "add_layernorm", "--dtypes",
               "fp32", "--sizes", "8x32", "--modes", "fwd", "--providers", "fusedops,eager",
               "--warmup", "0.1", "--rep", "0.2", "--quiet"]


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"fusedops {command}: error: "), err
    return err[0]


# --- the top level -------------------------------------------------------------------------------


def test_no_command_prints_usage_and_fails(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m fusedops") and "bench-chains" in err


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fusedops {fusedops.__version__}"


def test_unknown_command(capsys):
    assert main(["benchmark"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'benchmark'" in err and "bench-chains" in err


# --- bad input: one line, non-zero exit ----------------------------------------------------------


@pytest.mark.parametrize("target, needle", [
    ("no_colon_here", "expected MODULE:FACTORY"),
    ("fusedops_no_such_module_xyz:make", "ModuleNotFoundError"),
])
def test_profile_bad_target(capsys, target, needle):
    assert main(["profile", target, "--device", "cpu"]) == 2
    line = _one_line_error(capsys, "profile")
    assert repr(target) in line and needle in line


def test_profile_target_that_raises(tmp_path, capsys):
    path = tmp_path / "broken.py"
    path.write_text("def make():\n    raise RuntimeError('no weights here')\n")
    assert main(["profile", f"{path}:make", "--device", "cpu"]) == 2
    line = _one_line_error(capsys, "profile")
    assert "RuntimeError: no weights here" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("command", ["profile", "demo", "train", "verify", "bench",
                                     "bench-chains"])
def test_device_cuda_without_cuda(capsys, tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    assert main([command, "--device", "cuda"]) == 2
    assert "CUDA is not available" in _one_line_error(capsys, command)
    assert not any(tmp_path.iterdir())  # refused before writing anything (demo, bench: --out)


@pytest.mark.skipif(cli.mps_available(), reason="this machine has MPS")
def test_device_mps_without_mps(capsys):
    assert main(["bench", "--device", "mps"]) == 2
    assert "MPS is not available" in _one_line_error(capsys, "bench")


def test_bad_names_and_files(capsys, tmp_path):
    assert main(["profile", "--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in _one_line_error(capsys, "profile")
    assert main(["verify", "--dtypes", "float8"]) == 2
    assert "unknown dtype 'float8'" in _one_line_error(capsys, "verify")
    assert main(["bench", "--device", "cpu", "--sizes", "1K,big"]) == 2
    assert "bad size 'big'" in _one_line_error(capsys, "bench")
    # a file that is not there: exit 1, one line naming it
    missing = tmp_path / "missing.json"
    assert main(["bench", "--report", str(missing)]) == 1
    assert str(missing) in _one_line_error(capsys, "bench")
    not_json = tmp_path / "notes.json"
    not_json.write_text("hello")
    assert main(["bench", "--report", str(not_json)]) == 2
    assert "not a bench result JSON" in _one_line_error(capsys, "bench")


@pytest.mark.parametrize("argv", [
    ["bench", "--threads", "0"], ["bench", "--total", "0"], ["bench-chains", "--rep", "-1"],
    ["profile", "--iters", "0"], ["demo", "--rounds", "x"], ["train", "--preset", "huge"],
])
def test_bad_numbers_are_usage_errors(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error: argument" in capsys.readouterr().err


# --- --threads and CPU labels --------------------------------------------------------------------


def test_bench_threads(tmp_path, capsys):
    before = torch.get_num_threads()
    assert main([*TINY_BENCH, "--threads", "1", "--no-plots", "--out", str(tmp_path),
                 "--tag", "t"]) == 0
    assert torch.get_num_threads() == before  # restored after the run
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["config"]["threads"] == 1
    assert data["note"] == bench_harness.CPU_NOTE
    assert {r["status"] for r in data["records"]} == {"ok"}
    out = capsys.readouterr().out
    assert "CPU run:" in out and "(1 thread)" in out
    assert "not evaluated on CPU" in out and "beats" not in out


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
def test_cpu_defaults_to_one_thread_unless_told(tmp_path):
    assert main([*TINY_BENCH, "--table", "none", "--no-plots", "--out", str(tmp_path),
                 "--tag", "d"]) == 0
    assert json.loads((tmp_path / "d.json").read_text())["config"]["threads"] == 1
    assert main([*TINY_BENCH, "--table", "none", "--no-plots", "--out", str(tmp_path),
                 "--tag", "two", "--threads", "2"]) == 0
    assert json.loads((tmp_path / "two.json").read_text())["config"]["threads"] == 2


def test_bench_chains_threads(tmp_path, capsys):
    assert main([*TINY_CHAINS, "--threads", "1", "--no-plot", "--out", str(tmp_path),
                 "--tag", "c"]) == 0
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["config"]["threads"] == 1 and data["device_type"] == "cpu"
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("CPU run:")


def test_cpu_timer_is_a_median_of_repeats():
    # One call in five sleeps 3 ms: a mean would be ~0.6 ms; the median stays with the fast calls.
    calls = []

    def fn():
        calls.append(1)
        if len(calls) % 5 == 0:
            time.sleep(3e-3)

    timer = bench_harness.Timer("cpu", warmup_ms=0.0, rep_ms=0.0)
    assert timer.repeats == bench_harness.CPU_REPEATS
    ms, p20, p80 = timer(fn)
    assert ms < 0.5 and p20 <= ms
    # estimate (4 calls) + warm-up (1) + repeats x at least one call each, 5 calls in all
    assert len(calls) == 4 + 1 + bench_harness.CPU_REPEATS


# --- matplotlib is optional ----------------------------------------------------------------------


def test_plots_skipped_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # "import matplotlib" now fails
    assert cli.can_plot() is False
    assert capsys.readouterr().err.strip() == cli.PLOTS_SKIPPED
    assert main([*TINY_BENCH, "--out", str(tmp_path / "b"), "--tag", "b"]) == 0
    assert main([*TINY_CHAINS, "--out", str(tmp_path / "c"), "--tag", "c"]) == 0
    err = capsys.readouterr().err
    assert err.count(cli.PLOTS_SKIPPED) == 2
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["b.csv", "b.json", "b.txt"]
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["c.csv", "c.json", "c.txt"]
    # re-rendering a result without matplotlib: files, no PNG, no traceback
    result = bench_report.load_result(tmp_path / "b" / "b.json")
    paths = bench_report.write_outputs(result, tmp_path / "r", stem="r", plots=True)
    assert [p.suffix for p in paths] == [".json", ".csv", ".txt"]


@pytest.mark.exhaustive  # (a fresh interpreter importing torch)
def test_import_and_help_do_not_import_matplotlib():
    code = ("import sys, contextlib, io\n"
            "import fusedops\n"
            "from fusedops.__main__ import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['--help']) == 0\n"
            "import fusedops.tools.bench, fusedops.tools.bench_chains, fusedops.tools.demo\n"
            "import fusedops.tools.profile\n"
            "print('matplotlib' in sys.modules)\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
