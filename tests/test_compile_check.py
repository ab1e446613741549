"""benchmarks/dev/compile_check.py: launches described as Triton specialises them, rebuilt as the
JIT's compile inputs, and one offline sm_90 compile through the tool's command line, where a
kernel the interpreter runs but the compiler rejects must be reported."""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

DEV = Path(__file__).resolve().parents[1] / "benchmarks" / "dev"
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

TINY = textwrap.dedent("""
    import triton
    import triton.language as tl


    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


    def plus_one(x):
        return x + 1


    @triton.jit
    def calls_python(x_ptr, n, BLOCK: tl.constexpr):
        # a plain Python helper: the interpreter calls it, the compiler refuses it
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, plus_one(tl.load(x_ptr + offs, mask=mask)), mask=mask)
""")


@pytest.fixture
def dev(monkeypatch):
    """The tool's modules (benchmarks/dev is not a package)."""
    monkeypatch.syspath_prepend(str(DEV))
    rec, comp = importlib.import_module("launch_recorder"), importlib.import_module(
        "launch_compiler")
    monkeypatch.setattr(rec, "_SEEN", {})
    return rec, comp


def _kern(x_ptr, n, seed, scale: tl.float32, BLOCK: tl.constexpr, POLICY: tl.constexpr = "",
          STATS: tl.constexpr = False):
    pass


def test_arguments_described_as_triton_specialises(dev):
    rec, _ = dev
    d = rec.describe
    assert d(1, False) == ["int", "i32", "one"]
    assert d(0, False) == d(4096, False) == d(-16, False) == ["int", "i32", "d16"]
    assert d(17, False) == ["int", "i32", "any"]
    assert d(2**31, False) == ["int", "i64", "d16"] and d(-2**31 - 1, False)[1] == "i64"
    assert d(2**63 + 1, False) == ["int", "u64", "any"] and d(2**64, False)[0] == "rejected"
    assert d(True, False) == ["bool"] and d(0.5, False) == ["float"]
    assert d(None, False) == ["const", None] and d("rne", True) == ["const", "rne"]
    assert d("rne", False) == ["rejected", "str"]  # a compiled launch cannot specialise a str
    assert d(tl.float16, True) == ["const", {"dtype": "fp16"}]
    x = torch.zeros(8, dtype=torch.bfloat16)
    assert d(x, False) == ["ptr", "bf16", True] and d(x[1:], False) == ["ptr", "bf16", False]


def test_ints_agree_with_triton_native_specialisation(dev):
    rec, _ = dev
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.compiler import BaseBackend

    for v in (0, 1, 2, 16, 17, 48, 2**31 - 16, 2**31, -2**31, -2**31 - 1, 2**63, -7):
        ty, attr = native(BaseBackend, v, False, True, True)
        want = (["int", "i32", "one"] if ty == "constexpr"
                else ["int", ty, "d16" if attr == "D" else "any"])
        assert rec.describe(v, False) == want, v


def test_launch_options_apart_from_arguments(dev):
    rec, _ = dev
    x = torch.zeros(4)
    got = rec.launch_record(_kern, (x, 32), {"seed": 7, "scale": 2.0, "BLOCK": 64,
                                             "num_warps": 8, "launch_pdl": True})
    assert got["kernel"].endswith(":_kern")
    assert got["options"] == {"num_warps": 8, "launch_pdl": True}
    assert got["args"] == {"x_ptr": ["ptr", "fp32", True], "n": ["int", "i32", "d16"],
                           "seed": ["int", "i32", "any"], "scale": ["float"],
                           "BLOCK": ["const", 64]}  # defaults left to the compile step


def test_a_failing_record_is_kept_not_raised(dev):
    rec, _ = dev
    rec.record(_kern, (1, 2, 3, 4, 5, 6, 7, 8), {})  # one argument too many
    (line,) = rec._SEEN
    assert json.loads(line)["error"].startswith("TypeError") and "_kern" in line


def test_compile_inputs_follow_the_launcher(dev):
    _, comp = dev
    fn = triton.runtime.jit.JITFunction(_kern, do_not_specialize=["seed"])
    args = {"x_ptr": ["ptr", "bf16", True], "n": ["int", "i32", "one"],
            "seed": ["int", "i32", "one"], "scale": ["float"], "BLOCK": ["const", 128],
            "STATS": ["const", True]}
    sig, consts, divisible = comp.compile_inputs(fn, {"args": args})
    assert sig == {"x_ptr": "*bf16", "n": "constexpr", "seed": "i32", "scale": "fp32",
                   "BLOCK": "constexpr", "POLICY": "constexpr", "STATS": "constexpr"}
    assert consts == {(1,): 1, (4,): 128, (5,): "", (6,): True}  # POLICY: the default
    assert divisible == [0]
    args.update(n=["int", "i64", "d16"], seed=["int", "i32", "d16"], x_ptr=["ptr", "fp16", False])
    sig, consts, divisible = comp.compile_inputs(fn, {"args": args})
    assert (sig["n"], sig["seed"], sig["x_ptr"], divisible) == ("i64", "i32", "*fp16", [1])
    with pytest.raises(comp.Refused, match="no parameter"):
        comp.compile_inputs(fn, {"args": dict(args, gone=["float"])})
    with pytest.raises(comp.Refused, match="refuses str"):
        comp.compile_inputs(fn, {"args": dict(args, n=["rejected", "str"])})


def test_record_files_merged_and_selected(dev, tmp_path, monkeypatch):
    """Workers' files merge into distinct launches (the first test by name kept), errors
    apart; ``--only`` filters by kernel, ``--limit`` takes the kernels in turn; pytest's own
    arguments pass through ``record`` in order."""
    cc = importlib.import_module("compile_check")
    a = {"kernel": "m:k1", "args": {"n": ["int", "i32", "any"]}, "options": {}}
    b = {"kernel": "m:k2", "args": {}, "options": {"num_warps": 4}}
    (tmp_path / "launches-gw0.jsonl").write_text(
        json.dumps(a | {"test": "t_b"}) + "\n" + json.dumps({"error": "E", "kernel": "m:k3"}))
    (tmp_path / "launches-gw1.jsonl").write_text(
        json.dumps(a | {"test": "t_a"}) + "\n" + json.dumps(b | {"test": "t_c"}) + "\n")
    launches, errors = cc.merge(sorted(tmp_path.glob("launches-*.jsonl")))
    assert launches == [a | {"test": "t_a"}, b | {"test": "t_c"}]
    assert errors == [{"error": "E", "kernel": "m:k3", "test": ""}]
    recs = [dict(a, i=i) for i in range(3)] + [dict(b, i=i) for i in range(3)]
    assert [(r["kernel"], r["i"]) for r in cc.select(recs, None, 3)] == [
        ("m:k1", 0), ("m:k2", 0), ("m:k1", 1)]
    assert {r["kernel"] for r in cc.select(recs, "k2,zz", None)} == {"m:k2"}
    ns, rest = cc.parse_args(["record", "--out", "f.jsonl", "-k", "a and not b", "tests", "-x"])
    assert (ns.out, rest) == ("f.jsonl", ["-k", "a and not b", "tests", "-x"])


def _dies_on_5(rec: dict, arch: int, tail: int) -> tuple:
    """Stands in for launch_compiler.check: record 5 kills its process, as a compiler crash
    would, while 4, 6 and 7 are still running; every fourth record fails."""
    if rec["i"] == 5:
        os._exit(3)
    if rec["i"] in (4, 6, 7):
        time.sleep(0.2)
    return (None if rec["i"] % 4 else "boom"), None, 0.0


@pytest.mark.skipif(multiprocessing.get_start_method() != "fork",
                    reason="the stand-in reaches forked compile processes only")
def test_a_compiler_crash_is_pinned_on_its_record(dev, monkeypatch):
    _, comp = dev
    monkeypatch.setattr(comp, "check", _dies_on_5)
    got = sorted((r["i"], err) for r, err, _ in comp.run_all([{"i": i} for i in range(12)],
                                                             2, 90, 6))
    assert [i for i, _ in got] == list(range(12))  # every record once
    # the records running beside the crash are checked again, each in a process of its own
    assert [i for i, err in got if err] == [0, 4, 5, 8] and "died" in got[5][1]
    assert got[4][1] == "boom"


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A module of two tiny kernels (``TINY``) importable here and by subprocesses."""
    (tmp_path / "cc_tiny.py").write_text(TINY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cc_tiny", raising=False)
    return importlib.import_module("cc_tiny")


@pytest.mark.skipif(not INTERPRETING, reason="records launches of the Triton interpreter")
def test_interpreted_launches_are_recorded(dev, tiny, monkeypatch):
    rec, _ = dev
    cls = triton.runtime.interpreter.InterpretedFunction
    monkeypatch.setattr(cls, "run", cls.run)  # restored after the test
    rec.install()
    x = torch.zeros(16)
    tiny.add_one[(1,)](x, 10, BLOCK=16, num_warps=1)
    tiny.add_one[(1,)](x, 10, BLOCK=16, num_warps=1)  # the same signature again
    tiny.calls_python[(1,)](x, 10, BLOCK=16, num_warps=1)
    assert x[:10].eq(3).all() and x[10:].eq(0).all()  # the launches themselves ran
    got = sorted(json.loads(line)["kernel"] for line in rec._SEEN)
    assert got == ["cc_tiny:add_one", "cc_tiny:calls_python"]
    assert all(t.endswith("test_interpreted_launches_are_recorded") for t in rec._SEEN.values())


def test_compile_reports_a_kernel_the_compiler_rejects(dev, tiny, tmp_path):
    """``compile_check.py compile`` in its own process (no interpreter there): the plain kernel
    compiles for sm_90, the one calling a Python function is a failure, and the exit status
    says so."""
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton has no CUDA backend, so nothing compiles for sm_90 here")
    rec, _ = dev
    x = torch.zeros(16)
    with open(tmp_path / "launches.jsonl", "w") as f:
        for kernel in (tiny.add_one, tiny.calls_python):
            line = rec.launch_record(kernel.fn, (x, 10), {"BLOCK": 16, "num_warps": 1})
            f.write(json.dumps(line) + "\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(DEV / "compile_check.py"), "compile", "--input",
                          str(tmp_path / "launches.jsonl"), "--jobs", "1"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    fails = [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 1 and "cc_tiny:calls_python [BLOCK=16] [num_warps=1]" in fails[0]
    assert "plus_one" in out.stdout  # the compiler's message, under the failure
    assert "2 signatures of 2 kernels, 1 failed, 0 not checked" in out.stdout
