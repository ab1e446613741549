"""Kernels compiled for sm_90 without a GPU: a script (Triton's ``ASTSource`` through ptxas)
run in a subprocess, as the interpreter replaces ``triton.jit`` in the test process, and the
PTX of a cluster kernel checked for its exchange."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def compile_counts(script: str):
    """Run ``script`` with the interpreter off; returns the JSON it printed last."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def assert_one_exchange(got: dict) -> None:
    """PTX counts of a cluster kernel: the barrier at its start and one per row (arrive and
    wait), one store into the peers' shared memory, no atomics."""
    assert got["barrier.cluster.arrive.release"] == got["barrier.cluster.wait.acquire"] == 2
    assert got["mapa.shared::cluster"] == got["st.shared::cluster"] == 1
    assert got["atom."] + got["red.global"] == 0
