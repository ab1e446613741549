"""The RMSNorm Metal shaders (metal/rmsnorm.metal), run on the CPU emulation, against a float64
reference (``F.rms_norm`` in float64 and its autograd).

Every kernel (forward single-row / looped, backward single-row / looped, every instantiated
dtype pair, the dweight reduction) runs through the *real host code* of ``fusedops.backends.metal``
(``rmsnorm_*_with(launcher, ...)``), at the variant boundaries of test_metal_emulation.py: a
device whose pipelines allow 256 threads (single-row limit 1024) and one allowing 1024
(N = 4096 / 4097). Also: the public functions through both implementation paths (the
``torch.mps.compile_shader`` path with the emulation behind it, and the extension path with a
stand-in extension whose bindings are read from csrc/fusedops_metal.mm).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import _oracles as oracles
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_to_ref, exhaustive_unless, one_of_each, tol

import fusedops
from fusedops.backends import metal
from fusedops.backends.metal import loader as metal_loader
from fusedops.backends.metal import norms as metal_norms
from fusedops.backends.metal import rules as metal_rules

emu = pytest.importorskip("metal_emu.emu", reason="needs the Metal emulation helper")
from metal_emu.harness import launcher, mm_bindings, rows  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DTYPES = {"float": torch.float32, "half": torch.float16, "bfloat": torch.bfloat16}
PAIRS = sorted(metal_rules.RMSNORM_TYPES)
SIZES_256 = [1, 31, 32, 33, 127, 128, 129, 1000, 1024, 1025, 2049]
SIZES_1024 = [4096, 4097]
CASES = [(n, 256) for n in SIZES_256] + [(n, 1024) for n in SIZES_1024]
REDUCE = "fusedops_layernorm_dwdb_reduce"
EPS = 1e-5


def check_call(call, op: str, n: int, max_threads: int) -> None:
    name, _, threads = call
    variant = "single" if n <= metal_rules.single_row_limit(max_threads) else "looped"
    assert name.startswith(f"fusedops_rmsnorm_{op}_{variant}_"), name
    assert threads % 32 == 0 and threads <= max_threads
    if variant == "single":
        assert threads * metal_rules.READS >= n


def rmsnorm_ref(x, w, eps, dy=None):
    """float64 (y, rstd), or with dy the float64 gradients (dx, dw) (tests/_oracles.py)."""
    return oracles.rmsnorm(x, w, eps, dy)


def saved_rstd(x, eps=EPS):
    return torch.rsqrt(x.double().square().mean(-1) + eps).float()


# --- forward ---------------------------------------------------------------------------------

# (the default run: the diagonal, every size and every other value once)
@exhaustive_unless(one_of_each({"n,max_threads": CASES, "pair": PAIRS, "weight": ["w", "none"]}))
@pytest.mark.parametrize("weight", ["w", "none"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "_".join(p))
@pytest.mark.parametrize("n,max_threads", CASES)
def test_metal_rmsnorm_forward(metal_lib, pair, weight, n, max_threads):
    torch.manual_seed(n + 20)
    x_dtype, y_dtype = DTYPES[pair[0]], DTYPES[pair[1]]
    m = 3
    x = rows(m, n, x_dtype, scale=2.0, shift=0.5)
    w = torch.randn(n) if weight == "w" else None
    L = launcher(metal_lib, max_threads, seed=n)
    y, rstd = metal_norms.rmsnorm_forward_with(L, x, w, EPS, y_dtype)
    assert y.dtype == y_dtype and y.shape == (m, n) and y.is_contiguous()
    assert rstd.dtype == torch.float32 and rstd.shape == (m,)
    assert len(L.calls) == 1 and L.calls[0][1] == m
    check_call(L.calls[0], "fwd", n, max_threads)
    y_ref, rstd_ref = rmsnorm_ref(x, w, EPS)
    assert_close_to_ref(y, y_ref, y_dtype)
    assert_close_to_ref(rstd, rstd_ref, torch.float32, scale=10)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "_".join(p))
@pytest.mark.parametrize("n,max_threads", [(129, 256), (2049, 256), (4096, 1024), (4097, 1024)])
def test_metal_rmsnorm_forward_y(metal_lib, pair, n, max_threads):
    """forward_y: the same kernels, y only; bitwise what the forward gives."""
    torch.manual_seed(n + 21)
    x_dtype, y_dtype = DTYPES[pair[0]], DTYPES[pair[1]]
    x = rows(4, n, x_dtype)
    w = torch.randn(n).to(x_dtype)  # weight in x's dtype (converted to float32 by the host)
    L = launcher(metal_lib, max_threads)
    y = metal_norms.rmsnorm_forward_y_with(L, x, w, EPS, y_dtype)
    check_call(L.calls[0], "fwd", n, max_threads)
    assert y.dtype == y_dtype and y.shape == (4, n)
    assert_close_to_ref(y, rmsnorm_ref(x, w, EPS)[0], y_dtype)
    assert torch.equal(y, metal_norms.rmsnorm_forward_with(L, x, w, EPS, y_dtype)[0])


# --- backward --------------------------------------------------------------------------------

# Every dtype pair with dx and dweight; the other flag combinations (and no weight) on one pair.
BWD_CASES = [(p, "dx-dw") for p in PAIRS] + [
    (("half", "half"), need) for need in ("dx", "dw", "dx-noweight")]


# (the default run: the diagonal, every size and every other value once)
@exhaustive_unless(one_of_each({"n,max_threads": CASES, "pair,need": BWD_CASES}))
@pytest.mark.parametrize("pair,need", BWD_CASES, ids=lambda v: "_".join(v)
                         if isinstance(v, tuple) else v)
@pytest.mark.parametrize("n,max_threads", CASES)
def test_metal_rmsnorm_backward(metal_lib, pair, need, n, max_threads):
    torch.manual_seed(n + 22)
    x_dtype, dy_dtype = DTYPES[pair[0]], DTYPES[pair[1]]
    m = 5
    x = rows(m, n, x_dtype, scale=2.0, shift=-0.3)
    dy = rows(m, n, dy_dtype)
    w = None if "noweight" in need else torch.randn(n)
    need_dx, need_dw = "dx" in need, "dw" in need
    L = launcher(metal_lib, max_threads, seed=n)
    dx, dw = metal_norms.rmsnorm_backward_with(L, dy, x, w, saved_rstd(x), need_dx, need_dw)
    assert (dx is not None, dw is not None) == (need_dx, need_dw)
    check_call(L.calls[0], "bwd", n, max_threads)
    assert L.calls[0][1] == metal_rules.layernorm_bwd_groups(m, n)
    dx_ref, dw_ref = rmsnorm_ref(x, w, EPS, dy)
    if need_dx:
        assert dx.dtype == x_dtype and dx.shape == (m, n) and dx.is_contiguous()
        assert_close_to_ref(dx, dx_ref, x_dtype, scale=4)
    if need_dw:
        assert dw.dtype == torch.float32 and dw.shape == (n,)
        assert_close_to_ref(dw, dw_ref, torch.float32, scale=10)
        assert [c[0] for c in L.calls] == [L.calls[0][0], REDUCE]
    else:
        assert len(L.calls) == 1


@pytest.mark.parametrize("layout", ["misaligned", "aligned-strided", "broadcast"])
@pytest.mark.parametrize("n,max_threads", [(33, 256), (1000, 256), (1025, 256), (4097, 1024)])
def test_metal_rmsnorm_strided_rows(metal_lib, layout, n, max_threads):
    """Row strides > N and storage offsets (vector loads only where aligned), stride-0 dy."""
    torch.manual_seed(23)
    x = rows(4, n, torch.bfloat16, layout if layout != "broadcast" else "misaligned")
    dy = rows(4, n, torch.bfloat16, layout)
    assert x.stride(0) > n
    w = torch.randn(n)
    L = launcher(metal_lib, max_threads)
    y, rstd = metal_norms.rmsnorm_forward_with(L, x, w, EPS, torch.bfloat16)
    y_ref, rstd_ref = rmsnorm_ref(x, w, EPS)
    assert_close_to_ref(y, y_ref, torch.bfloat16)
    assert_close_to_ref(rstd, rstd_ref, torch.float32, scale=10)
    dx, dw = metal_norms.rmsnorm_backward_with(L, dy, x, w, rstd, True, True)
    dx_ref, dw_ref = rmsnorm_ref(x, w, EPS, dy)
    assert_close_to_ref(dx, dx_ref, torch.bfloat16, scale=2)
    assert_close_to_ref(dw, dw_ref, torch.float32, scale=10)


@pytest.mark.parametrize("n,max_threads", [(100, 256), (1500, 256)])
def test_metal_rmsnorm_groups_own_several_rows_deterministic(metal_lib, monkeypatch, n,
                                                             max_threads):
    """Forward rows striding over threadgroups; backward threadgroups accumulating the dweight
    partials of several rows (registers, or read-modify-write when looped), then the reduction:
    bitwise equal across runs under different fiber orders."""
    monkeypatch.setattr(metal_rules, "MAX_ROW_GROUPS", 3)
    monkeypatch.setattr(metal_rules, "LN_BWD_MIN_GROUPS", 1)
    monkeypatch.setattr(metal_rules, "LN_BWD_MAX_GROUPS", 3)
    torch.manual_seed(24)
    m = 8
    x = torch.randn(m, n, dtype=torch.float16)
    dy = torch.randn(m, n, dtype=torch.float16)
    w = torch.randn(n)
    L = launcher(metal_lib, max_threads, seed=1)
    y, rstd = metal_norms.rmsnorm_forward_with(L, x, w, EPS, torch.float16)
    assert L.calls[0][1] == 3
    assert_close_to_ref(y, rmsnorm_ref(x, w, EPS)[0], torch.float16)
    dx, dw = metal_norms.rmsnorm_backward_with(L, dy, x, w, rstd, True, True)
    assert L.calls[1][1] == 3  # backward threadgroups
    dx_ref, dw_ref = rmsnorm_ref(x, w, EPS, dy)
    assert_close_to_ref(dx, dx_ref, torch.float16, scale=4)
    assert_close_to_ref(dw, dw_ref, torch.float32, scale=10)
    for seed in (2, 5):  # other fiber orders (even: fine interleaving; odd: run-ahead)
        L2 = launcher(metal_lib, max_threads, seed=seed)
        _, dw2 = metal_norms.rmsnorm_backward_with(L2, dy, x, w, rstd, False, True)
        dx2, dw3 = metal_norms.rmsnorm_backward_with(L2, dy, x, w, rstd, True, True)
        assert torch.equal(dw, dw2) and torch.equal(dw, dw3) and torch.equal(dx, dx2)


def test_metal_rmsnorm_zero_rows_overflow_and_eps(metal_lib):
    """All-zero rows (rstd = 1/sqrt(eps), y = 0, dx = w * dy / sqrt(eps)), a large eps, and a row
    whose float32 mean square overflows: rstd 0 and y 0, as torch and the reference (single and
    looped)."""
    for n in (300, 2049):
        x = torch.zeros(3, n)
        x[1] = torch.randn(n)
        x[2, :] = 3e38  # x^2 overflows float32
        w = torch.randn(n)
        for eps in (1e-5, 0.5):
            y, rstd = metal_norms.rmsnorm_forward_with(launcher(metal_lib, 256), x, w, eps,
                                                       torch.float32)
            y_ref, rstd_ref = metal.reference.rmsnorm_forward(x, w, eps, torch.float32)
            assert rstd[2] == 0 and torch.equal(y[2], torch.zeros(n))
            torch.testing.assert_close(y[2], torch.nn.functional.rms_norm(x[2:], (n,), w, eps)[0])
            assert torch.equal(y[0], torch.zeros(n))
            torch.testing.assert_close(rstd, rstd_ref, equal_nan=True, **tol(torch.float32))
            torch.testing.assert_close(y, y_ref, equal_nan=True, **tol(torch.float32))
        dy = torch.randn(2, n)
        dx, dw = metal_norms.rmsnorm_backward_with(launcher(metal_lib, 256), dy, x[:2], w,
                                                   rstd[:2], True,
                                             True)
        dx_ref, dw_ref = rmsnorm_ref(x[:2], w, 0.5, dy)
        assert_close_to_ref(dx, dx_ref, torch.float32, scale=4)
        assert_close_to_ref(dw, dw_ref, torch.float32, scale=10)


def test_metal_rmsnorm_empty_shapes_and_nothing_needed(metal_lib):
    L = launcher(metal_lib, 256)
    y, rstd = metal_norms.rmsnorm_forward_with(L, torch.empty(0, 5), None, EPS, torch.float32)
    assert y.shape == (0, 5) and rstd.shape == (0,)
    y, rstd = metal_norms.rmsnorm_forward_with(L, torch.empty(3, 0), torch.ones(0), EPS,
                                         torch.float16)
    assert y.shape == (3, 0) and y.dtype == torch.float16 and rstd.shape == (3,)
    dx, dw = metal_norms.rmsnorm_backward_with(L, torch.empty(0, 5), torch.empty(0, 5),
                                               torch.ones(5),
                                         torch.empty(0), True, True)
    assert dx.shape == (0, 5) and torch.equal(dw, torch.zeros(5))
    x = torch.randn(2, 5)
    assert metal_norms.rmsnorm_backward_with(L, x, x, None, torch.ones(2), False, False) == (None,
                                                                                             None)
    assert L.calls == []


def test_metal_rmsnorm_unsupported_pair_uses_reference(metal_lib):
    """A pair the library lacks (float x, half y) falls back to the reference, no launch."""
    L = launcher(metal_lib, 256)
    x = torch.randn(3, 40)
    y, rstd = metal_norms.rmsnorm_forward_with(L, x, None, EPS, torch.float16)
    assert L.calls == [] and y.dtype == torch.float16
    assert_close_to_ref(y, rmsnorm_ref(x, None, EPS)[0], torch.float16)


# --- the public functions through the implementation chain -----------------------------------

@pytest.fixture
def fake_mps(monkeypatch):
    """macOS with MPS but no extension: the compile_shader path, backed by the emulation."""
    from test_metal_backend import fake_mps_compile_shader

    yield from fake_mps_compile_shader(monkeypatch, 13)


def test_metal_rmsnorm_compile_shader_path_end_to_end(fake_mps):
    assert metal.implementation() == "compile_shader"
    torch.manual_seed(25)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the kernels ran
        for n, dtype in ((7, torch.float16), (1000, torch.bfloat16), (1500, torch.float32)):
            x = torch.randn(2, 3, n, dtype=dtype, requires_grad=True)
            w = torch.randn(n, requires_grad=True)
            with fusedops.count_fused_calls() as counts:
                y = fusedops.fused_rmsnorm(x, (n,), w, EPS)
                g = torch.randn_like(y)
                y.backward(g)
            assert counts["rmsnorm_forward"] == 1 and counts["rmsnorm_backward"] == 1
            x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
            y64 = F.rms_norm(x64, (n,), w64, EPS)
            y64.backward(g.double())
            assert_close_to_ref(y, y64, dtype)
            assert_close_to_ref(x.grad, x64.grad, dtype, scale=4)
            assert_close_to_ref(w.grad, w64.grad, torch.float32, scale=10)
            with torch.no_grad():  # the inference path: rmsnorm_forward_y
                assert torch.equal(fusedops.fused_rmsnorm(x, (n,), w, EPS), y.detach())


class _FakeExt(emu.FakeExtension):
    """Stands in for fusedops._metal_ext: the RMSNorm bindings, with the parameter names the
    extension declares, run the host code on the emulation (what the extension mirrors)."""

    def rmsnorm_forward(self, x, weight, eps, out_dtype):
        self.calls.append("rmsnorm_forward")
        assert isinstance(eps, float)
        return metal_norms.rmsnorm_forward_with(self.L, x, weight, eps, out_dtype)

    def rmsnorm_backward(self, dy, x, weight, rstd, need_dx, need_dw):
        self.calls.append("rmsnorm_backward")
        assert isinstance(need_dx, bool) and isinstance(need_dw, bool)
        return metal_norms.rmsnorm_backward_with(self.L, dy, x, weight, rstd, need_dx, need_dw)


def test_metal_rmsnorm_extension_path(metal_lib, monkeypatch):
    """metal.rmsnorm_* on the extension path call the extension's bindings, whose argument lists
    (read from the .mm) match the calls; unsupported pairs use the reference."""
    import inspect

    bindings = mm_bindings()
    for name in ("rmsnorm_forward", "rmsnorm_backward"):
        params = list(inspect.signature(getattr(_FakeExt, name)).parameters)[1:]
        assert bindings[name] == params, name
    ext = _FakeExt(metal_lib)
    monkeypatch.setattr(metal_loader, "impl", metal_loader.Extension(ext))
    assert metal.implementation() == "extension"
    assert metal_loader.impl.rmsnorm_fwd == {(DTYPES[a], DTYPES[b]) for a, b in PAIRS}
    torch.manual_seed(26)
    x = torch.randn(4, 300, dtype=torch.float16)
    w = torch.randn(300, dtype=torch.float16)
    y, rstd = metal.rmsnorm_forward(x, w, 1e-6, torch.float16)
    assert torch.equal(metal.rmsnorm_forward_y(x, w, 1e-6, torch.float16), y)
    dy = torch.randn(4, 300, dtype=torch.float16)
    dx, dw = metal.rmsnorm_backward(dy, x, w, rstd, True, True, grad_dtypes=(torch.float16,))
    assert ext.calls == ["rmsnorm_forward", "rmsnorm_forward", "rmsnorm_backward"]
    assert_close_to_ref(y, rmsnorm_ref(x, w, 1e-6)[0], torch.float16)
    dx_ref, dw_ref = rmsnorm_ref(x, w, 1e-6, dy)
    assert_close_to_ref(dx, dx_ref, torch.float16, scale=4)
    assert_close_to_ref(dw, dw_ref, torch.float32, scale=10)
    y32, _ = metal.rmsnorm_forward(x.float(), None, 1e-6, torch.float16)  # no float->half kernel
    assert len(ext.calls) == 3 and y32.dtype == torch.float16
    monkeypatch.setattr(metal_loader, "impl", None)
