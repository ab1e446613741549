"""Kernels compiled for sm_90 without a GPU: a script (Triton's ``ASTSource`` through ptxas)
run in a subprocess, as the interpreter replaces ``triton.jit`` in the test process, and the
PTX of a cluster kernel checked for its exchange."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

# Prepended to a compile script: ``compile_sm90(fn, consts, dt, ...)`` is ``fn`` compiled for
# sm_90 (its ``asm``: "ptx", "cubin"), pointers of dtype ``dt`` but the float32 ones named in
# ``fp32``, ``eps`` float32, other runtime parameters int32, then ``types`` (for the names ``fn``
# has); pointers and strides 16-divisible.
PRELUDE = textwrap.dedent("""
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_sm90(fn, consts, dt="bf16", num_warps=4, types=None,
                     fp32=("mean_ptr", "rstd_ptr", "part_ptr", "stats_ptr")):
        names = fn.arg_names
        consts = {a: v for a, v in consts.items() if a in names}
        sig = {a: "constexpr" if a in consts else ("*fp32" if a in fp32 else f"*{dt}")
               if a.endswith("_ptr") else "fp32" if a == "eps" else "i32" for a in names}
        sig.update({a: t for a, t in (types or {}).items() if a in names})
        src = ASTSource(fn=fn, signature=sig,
                        constexprs={(names.index(a),): v for a, v in consts.items()},
                        attrs={(names.index(a),): [["tt.divisibility", 16]] for a in names
                               if a.endswith("_ptr") or a.startswith("stride")})
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps}).asm
""")


def compile_counts(script: str):
    """Run ``script`` (after :data:`PRELUDE`) with the interpreter off; returns the JSON it
    printed last."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(script)],
                         capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def assert_one_exchange(got: dict) -> None:
    """PTX counts of a cluster kernel: the barrier at its start and one per row (arrive and
    wait), one store into the peers' shared memory, no atomics."""
    assert got["barrier.cluster.arrive.release"] == got["barrier.cluster.wait.acquire"] == 2
    assert got["mapa.shared::cluster"] == got["st.shared::cluster"] == 1
    assert got["atom."] + got["red.global"] == 0
