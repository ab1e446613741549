"""The Metal kernels on OS threads under ThreadSanitizer and UBSan (a subprocess, because the
TSan runtime must be loaded first), and proof that TSan sees a missing barrier."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

emu = pytest.importorskip("metal_emu.emu", reason="needs the Metal emulation helper")

# The extended matrix only (CI's second step): the ThreadSanitizer build alone costs more CPU
# than most suites; the default run keeps the adversarial-schedule and barrier tests
# (test_metal_barriers.py) for races.
pytestmark = pytest.mark.exhaustive

TESTS = Path(__file__).resolve().parent


def _libtsan() -> str | None:
    try:
        path = subprocess.run([emu.CXX, "-print-file-name=libtsan.so"], capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


def run_sanitized(*args: str) -> subprocess.CompletedProcess:
    libtsan = _libtsan()
    if libtsan is None:
        pytest.skip("ThreadSanitizer runtime not found")
    env = dict(os.environ)
    env["LD_PRELOAD"] = libtsan
    env["TSAN_OPTIONS"] = "halt_on_error=1 exitcode=66 report_signal_unsafe=0"
    env["UBSAN_OPTIONS"] = "halt_on_error=1 print_stacktrace=1"
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent),
                                         env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)
    # sys.executable, not a wrapper script: the preload must not apply to a shell.
    return subprocess.run([sys.executable, "-m", "metal_emu.sanitize_check", *args],
                          capture_output=True, text=True, env=env, cwd=TESTS, timeout=600)


@pytest.fixture(scope="module")
def tsan_build():
    """Build the sanitizer variant here (not in the subprocess, where the compiler would run
    under the TSan preload); the barrier to remove: the one after the second level of
    fusedops_tg_sum, on which only the reuse of the threadgroup array across reductions depends,
    so only a race detector (or an adversarial schedule) notices it missing."""
    emu.build(variant="tsan")
    return [site for site in emu.barrier_sites() if site[0] == "common.metal"][1]


def test_metal_kernels_clean_under_tsan_and_ubsan(tsan_build):
    res = run_sanitized()
    assert res.returncode == 0, res.stderr[-6000:]
    assert "CLEAN-DONE" in res.stderr
    assert "ThreadSanitizer" not in res.stderr and "runtime error" not in res.stderr


def test_metal_tsan_reports_a_missing_barrier(tsan_build):
    fname, line = tsan_build
    res = run_sanitized("--remove-barrier", f"{fname}:{line}")
    assert res.returncode == 66, res.stderr[-6000:]
    assert "WARNING: ThreadSanitizer: data race" in res.stderr
    assert fname in res.stderr  # the race is reported in the shader source
