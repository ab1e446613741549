"""fusedops.backends.metal on Linux: availability and fallback, shader sources as Metal will
receive them, the extension's mirror of the host contract, the compile_shader path end to end (with
torch.mps.compile_shader replaced by the CPU emulation), and the Apple chip table."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_to_ref

import fusedops
from fusedops import _dispatch
from fusedops.backends import metal
from fusedops.backends.metal import loader as metal_loader
from fusedops.backends.metal import rules as metal_rules
from fusedops.tools import apple_chips

emu = pytest.importorskip("metal_emu.emu", reason="needs the Metal emulation helper")

REPO = Path(__file__).resolve().parent.parent
MM = REPO / "csrc" / "fusedops_metal.mm"
sys.path.insert(0, str(REPO / "csrc"))
import embed_shaders  # noqa: E402

# --- availability ---------------------------------------------------------------------------

@pytest.mark.skipif(sys.platform == "darwin", reason="Linux behaviour")
def test_metal_not_available_off_macos():
    assert metal.is_available() is False
    assert metal.implementation() == "none"
    with pytest.raises(RuntimeError, match="not available"):
        metal.softmax_forward(torch.randn(2, 3), torch.float32)


@pytest.mark.skipif(sys.platform == "darwin", reason="Linux behaviour")
def test_metal_forced_backend_falls_back_with_one_warning():
    x = torch.randn(4, 10, requires_grad=True)
    _dispatch._warned.clear()
    with fusedops.use_backend("metal"):
        with pytest.warns(UserWarning, match="metal backend is not available"):
            y = fusedops.fused_softmax(x, -1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y2 = fusedops.fused_softmax(x, -1)
    torch.testing.assert_close(y, torch.softmax(x, -1))
    torch.testing.assert_close(y2, y)


# --- shader sources -------------------------------------------------------------------------

def test_metal_library_source_is_self_contained_ascii():
    src = metal_loader.library_source()
    src.encode("ascii")  # torch hands the source to Metal as an ASCII string
    assert not re.search(r'^\s*#\s*include\s+"', src, re.MULTILINE)
    assert len(re.findall(r"^\s*#\s*include\s+<metal_stdlib>", src, re.MULTILINE)) == 1
    for path in sorted((REPO / "metal").glob("*.metal")):
        path.read_text(encoding="ascii")


def test_metal_library_source_compiles_in_one_unit():
    """The inlined source (what newLibraryWithSource gets) is one valid translation unit."""
    res = subprocess.run(
        [emu.CXX, "-std=c++17", "-fsyntax-only", "-Wno-attributes", "-x", "c++",
         "-I", str(emu.SHIM_DIR), "-I", str(emu.RUNTIME_DIR), "-"],
        input=metal_loader.library_source(), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]


def test_metal_instantiated_kernels_match_the_host_tables():
    names = {k.host_name for f in emu.SHADER_FILES
             for k in emu.scan_kernels(emu.SHADER_DIR / f, [emu.SHADER_DIR])}
    expected = {"fusedops_layernorm_dwdb_reduce"}
    for op, pairs in (("softmax_fwd", metal_rules.SOFTMAX_FWD_TYPES),
                      ("softmax_bwd", metal_rules.SOFTMAX_BWD_TYPES),
                      ("layernorm_fwd", metal_rules.LAYERNORM_TYPES),
                      ("layernorm_bwd", metal_rules.LAYERNORM_TYPES),
                      ("rmsnorm_fwd", metal_rules.RMSNORM_TYPES),
                      ("rmsnorm_bwd", metal_rules.RMSNORM_TYPES),
                      ("softmax_masked_fwd", metal_rules.SOFTMAX_MASKED_FWD_TYPES),
                      ("softmax_masked_bwd", metal_rules.SOFTMAX_MASKED_BWD_TYPES),
                      ("layernorm_epilogue_fwd", metal_rules.LAYERNORM_EPILOGUE_TYPES),
                      ("layernorm_epilogue_bwd", metal_rules.LAYERNORM_EPILOGUE_TYPES)):
        for types in pairs:
            for variant in ("single", "looped"):
                expected.add(f"fusedops_{op}_{variant}_{'_'.join(types)}")
    assert names == expected


def test_metal_embedded_header_matches_runtime_source(tmp_path):
    header = tmp_path / "shaders_embedded.h"
    embed_shaders.write_embedded_header(REPO / "metal", header)
    text = header.read_text()
    body = text.split('R"FUSEDOPS_METAL(\n', 1)[1].rsplit(')FUSEDOPS_METAL"', 1)[0]
    assert body == metal_loader.library_source()
    mtime = header.stat().st_mtime_ns
    embed_shaders.write_embedded_header(REPO / "metal", header)  # unchanged: not rewritten
    assert header.stat().st_mtime_ns == mtime
    # The header is valid C++ and the string is the source, byte for byte.
    prog = tmp_path / "dump.cpp"
    prog.write_text('#include <cstdio>\n#include "shaders_embedded.h"\n'
                    "int main() { std::fputs(kFusedopsMetalSource, stdout); }\n")
    exe = tmp_path / "dump"
    subprocess.run([emu.CXX, "-I", str(tmp_path), str(prog), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    assert out == "\n" + metal_loader.library_source()


# --- the extension mirrors the host contract ------------------------------------------------

def _mm_constants() -> dict[str, int]:
    text = MM.read_text()
    out = {}
    for name, expr in re.findall(r"constexpr int64_t (k\w+) = ([^;]+);", text):
        expr = expr.replace("int64_t(1)", "1")
        out[name] = int(eval(expr, {}))  # literals and shifts only
    return out


def test_metal_extension_constants_match_host_and_shaders():
    mm = _mm_constants()
    R = metal_rules
    py = {
        "kSimdWidth": R.SIMD_WIDTH, "kReads": R.READS, "kMaxThreads": R.MAX_THREADS,
        "kMaxRowGroups": R.MAX_ROW_GROUPS, "kLnBwdPartialBudget": R.LN_BWD_PARTIAL_BUDGET,
        "kLnBwdMinGroups": R.LN_BWD_MIN_GROUPS, "kLnBwdMaxGroups": R.LN_BWD_MAX_GROUPS,
        "kReduceThreads": R.REDUCE_THREADS, "kFlagVec": R.FLAG_VEC,
        "kFlagWeight": R.FLAG_WEIGHT, "kFlagBias": R.FLAG_BIAS, "kFlagDx": R.FLAG_DX,
        "kFlagDw": R.FLAG_DW, "kFlagDb": R.FLAG_DB, "kFlagMask": R.FLAG_MASK,
        "kFlagMaskVec": R.FLAG_MASK_VEC, "kFlagCausal": R.FLAG_CAUSAL,
        "kFlagAdd": R.FLAG_ADD, "kFlagDropout": R.FLAG_DROPOUT,
        "kFlagRelu": R.FLAG_RELU, "kFlagGelu": R.FLAG_GELU,
        "kFlagStats": R.FLAG_STATS, "kFlagPhilox": R.FLAG_PHILOX,
        "kPhiloxW": R.PHILOX_W,
    }
    assert mm == py
    common = (REPO / "metal" / "common.metal").read_text()
    defines = dict(re.findall(r"#define FUSEDOPS_(\w+) (\d+)", common))
    assert int(defines["SIMD_WIDTH"]) == R.SIMD_WIDTH
    assert int(defines["READS"]) == R.READS
    for flag in ("VEC", "WEIGHT", "BIAS", "DX", "DW", "DB", "MASK", "MASK_VEC", "CAUSAL", "ADD",
                 "DROPOUT", "RELU", "GELU", "STATS", "PHILOX"):
        assert int(defines[f"FLAG_{flag}"]) == getattr(R, f"FLAG_{flag}")
    assert int(defines["PHILOX_W"]) == R.PHILOX_W


def test_metal_extension_geometry_matches_host(tmp_path):
    """Compile the extension's constants and geometry functions (plain C++) and compare them
    with fusedops.backends.metal over many shapes and pipeline limits."""
    text = MM.read_text()
    start = text.index("namespace {")
    end = text.index("// --- Kernels")
    src = tmp_path / "geometry.cpp"
    src.write_text(
        "#include <algorithm>\n#include <cstdint>\n#include <cstdio>\n"
        + text[start:end] + "}  // namespace\n"
        "int main() {\n"
        "  long n, t;\n"
        "  while (std::scanf(\"%ld %ld\", &n, &t) == 2) {\n"
        "    std::printf(\"%ld %ld %ld %ld %ld %ld\\n\", (long)threadgroup_limit(t),\n"
        "                (long)single_row_limit(t), (long)row_threads(n, t), (long)row_groups(n),\n"
        "                (long)layernorm_bwd_groups(n, n), (long)reduce_threads(t));\n"
        "  }\n}\n")
    exe = tmp_path / "geometry"
    subprocess.run([emu.CXX, "-std=c++17", str(src), "-o", str(exe)], check=True)
    cases = [(n, t) for n in (1, 2, 31, 32, 33, 127, 1000, 1024, 1025, 4096, 4097, 65536, 70000,
                              1 << 20, 1 << 24)
             for t in (32, 64, 100, 256, 448, 896, 1024, 2048)]
    out = subprocess.run([str(exe)], input="".join(f"{n} {t}\n" for n, t in cases),
                         capture_output=True, text=True, check=True).stdout.split("\n")
    for (n, t), line in zip(cases, out, strict=False):
        expect = [metal_rules.threadgroup_limit(t), metal_rules.single_row_limit(t),
                  metal_rules.row_threads(n, t), metal_rules.row_groups(n),
                  metal_rules.layernorm_bwd_groups(n, n), metal_rules.reduce_threads(t)]
        assert [int(v) for v in line.split()] == expect, (n, t)


def test_metal_extension_launch_arguments_match_kernel_signatures():
    """Each encode() in the extension binds, in order, a tensor where the kernel has a buffer
    pointer and an int64 / float where it has a constant scalar."""
    kinds = {emu.KIND_POINTER: "Buf", emu.KIND_INT: "Int", emu.KIND_FLOAT: "Float"}
    lib = emu.load()
    calls = re.findall(r"\bencode\((\w+),\s*\{(.*?)\}\s*,", MM.read_text(), re.DOTALL)
    launched = [  # in source order
        "fusedops_softmax_fwd_single_float_float",
        "fusedops_softmax_bwd_single_float_float",
        "fusedops_layernorm_fwd_single_float_float",
        "fusedops_layernorm_bwd_single_float_float",
        "fusedops_layernorm_dwdb_reduce",
        "fusedops_rmsnorm_fwd_single_float_float",
        "fusedops_rmsnorm_bwd_single_float_float",
        "fusedops_layernorm_dwdb_reduce",  # RMSNorm dweight, stage 2
        "fusedops_softmax_masked_fwd_single_float_float_bool",
        "fusedops_softmax_masked_bwd_single_float_float",
        "fusedops_layernorm_epilogue_fwd_single_float_float",
        "fusedops_layernorm_epilogue_bwd_single_float_float",
        "fusedops_layernorm_dwdb_reduce",  # LayerNorm epilogue dweight/dbias, stage 2
    ]
    assert len(calls) == len(launched)
    for (_, body), kernel in zip(calls, launched, strict=True):
        args = re.findall(r"Arg::(Buf|Int|Float)\(", body)
        assert args == [kinds[k] for k, _, _ in lib.signature(kernel)], kernel


# --- the compile_shader path, end to end ----------------------------------------------------

class _FakeKernel:
    """One kernel of a fake torch.mps.compile_shader library, run on the emulation with the
    semantics of the real one: arguments bound by position, dispatchThreads(threads,
    group_size)."""

    def __init__(self, lib, name, max_threads):
        self._lib, self._name = lib, name
        self.max_threads_per_threadgroup = max_threads
        self.thread_execution_width = 32

    def __call__(self, *args, threads=None, group_size=None):
        assert isinstance(threads, int) and isinstance(group_size, int)
        assert group_size <= self.max_threads_per_threadgroup
        assert threads % group_size == 0
        L = emu.EmuLauncher(self._lib, self.max_threads_per_threadgroup)
        L(self._name, list(args), threads // group_size, group_size)


class _FakeShaderLibrary:
    compiled: list[str] = []

    def __init__(self, source, max_threads):
        _FakeShaderLibrary.compiled.append(source)
        self._lib = emu.load()
        self._max = max_threads

    def __dir__(self):
        return list(self._lib.kernels)

    def __getattr__(self, name):
        if name.startswith("_") or name not in self._lib.kernels:
            raise AttributeError(name)
        return _FakeKernel(self._lib, name, self._max)


def fake_mps_compile_shader(monkeypatch, seed: int):
    """Generator for fixtures: macOS with MPS but no extension, i.e. the compile_shader path,
    backed by the emulation (random fiber schedule ``seed``), with the Metal backend forced."""
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "compile_shader",
                        lambda src: _FakeShaderLibrary(src, 256), raising=False)
    monkeypatch.setitem(sys.modules, "fusedops._metal_ext", None)  # import fails
    monkeypatch.setattr(metal_loader, "impl", None)
    emu.load().set_mode("fibers-random", seed)
    with fusedops.use_backend("metal"):
        yield
    monkeypatch.setattr(metal_loader, "impl", None)


@pytest.fixture
def fake_mps(monkeypatch):
    """Pretend to be macOS with MPS but without the extension: fusedops.backends.metal must take the
    compile_shader path (here backed by the emulation, on CPU tensors)."""
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "compile_shader",
                        lambda src: _FakeShaderLibrary(src, 256), raising=False)
    monkeypatch.setitem(sys.modules, "fusedops._metal_ext", None)  # import fails
    monkeypatch.setattr(metal_loader, "impl", None)
    emu.load().set_mode("fibers-random", 11)
    _FakeShaderLibrary.compiled.clear()
    with fusedops.use_backend("metal"):
        yield
    monkeypatch.setattr(metal_loader, "impl", None)


def test_metal_compile_shader_path_end_to_end(fake_mps):
    assert metal.is_available() and metal.implementation() == "compile_shader"
    assert _FakeShaderLibrary.compiled == [metal_loader.library_source()]  # compiled once
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the kernels ran
        for n in (7, 1000, 1500):
            with fusedops.count_fused_calls() as counts:
                x = torch.randn(2, 3, n, dtype=torch.float16, requires_grad=True)
                y = fusedops.fused_softmax(x, dim=-1)
                g = torch.randn_like(y)
                y.backward(g)
            assert counts["softmax_forward"] == 1 and counts["softmax_backward"] == 1
            x64 = x.detach().double().requires_grad_()
            y64 = torch.softmax(x64, -1)
            y64.backward(g.double())
            assert_close_to_ref(y, y64, torch.float16)
            assert_close_to_ref(x.grad, x64.grad, torch.float16)

            x = torch.randn(3, n, dtype=torch.bfloat16, requires_grad=True)
            w = torch.randn(n, requires_grad=True)
            b = torch.randn(n, requires_grad=True)
            y = fusedops.fused_layernorm(x, (n,), w, b, 1e-5)
            g = torch.randn_like(y)
            y.backward(g)
            x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
            y64 = F.layer_norm(x64, (n,), w64, b64, 1e-5)
            y64.backward(g.double())
            assert_close_to_ref(y, y64, torch.bfloat16)
            assert_close_to_ref(x.grad, x64.grad, torch.bfloat16, scale=2)
            assert_close_to_ref(w.grad, w64.grad, torch.float32, scale=10)
            assert_close_to_ref(b.grad, b64.grad, torch.float32, scale=10)


def test_metal_compile_shader_path_transposed_and_masked(fake_mps):
    x = torch.randn(40, 6).t()  # softmax over a non-contiguous dim
    x[0, :5] = float("-inf")
    y = fusedops.fused_softmax(x, dim=-1)
    torch.testing.assert_close(y.double(), torch.softmax(x.double(), -1), atol=1e-5, rtol=1e-5)
    y = fusedops.fused_softmax(torch.randn(3, 5, 9), dim=1, dtype=torch.float32)
    assert y.shape == (3, 5, 9)


# --- Apple chips ----------------------------------------------------------------------------

@pytest.mark.parametrize("name,gbps", [
    ("Apple M1", 68.25), ("Apple M1 Max", 400.0), ("apple m2 ultra", 800.0), ("M3 Pro", 150.0),
    ("Apple M3 Max", 400.0), ("Apple M3 Max (30-core GPU)", 300.0), ("Apple M4 Pro", 273.0),
    ("Apple M4 Max 32-core GPU", 410.0), ("Apple M4 Max (40-core GPU)", 546.0),
    ("Apple M4", 120.0), ("Apple M5", 153.0),
])
def test_metal_apple_chip_bandwidth(name, gbps):
    assert apple_chips.peak_bandwidth_gbps(name) == gbps


@pytest.mark.parametrize("name", ["", "Intel(R) Core(TM) i9", "Apple M9 Mega", "NVIDIA H100"])
def test_metal_apple_chip_unknown(name):
    assert apple_chips.peak_bandwidth_gbps(name) is None
