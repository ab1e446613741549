"""The shipped Metal shaders, run on the CPU emulation, against a float64 reference.

Every kernel (softmax / LayerNorm, forward / backward, single-row / looped, every instantiated dtype
pair, the dweight/dbias reduction) runs through the *real host code* of ``fusedops.backends.metal``
(``*_with(launcher, ...)``): the same kernel choice, argument order, flags and dispatch geometry as
the ``torch.mps.compile_shader`` path, which the extension mirrors. The emulator plays a device
whose pipelines allow 256 threads per threadgroup (single-row limit 1024, so N = 1024 / 1025 is the
switch) and, for the switch at the real 1024-thread limit, one allowing 1024 (N = 4096 / 4097). """

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_to_ref, exhaustive_unless, one_of_each, tol

from fusedops.backends.metal import norms as metal_norms
from fusedops.backends.metal import rules as metal_rules
from fusedops.backends.metal import softmax as metal_softmax

emu = pytest.importorskip("metal_emu.emu", reason="needs the Metal emulation helper")
from metal_emu.harness import launcher, rows  # noqa: E402

DTYPES = {"float": torch.float32, "half": torch.float16, "bfloat": torch.bfloat16}
FWD_PAIRS = sorted(metal_rules.SOFTMAX_FWD_TYPES)
BWD_PAIRS = sorted(metal_rules.SOFTMAX_BWD_TYPES)
LN_PAIRS = sorted(metal_rules.LAYERNORM_TYPES)

# (n, max_threads): every variant boundary of the two devices.
SIZES_256 = [1, 31, 32, 33, 127, 128, 129, 1000, 1024, 1025, 2049]
SIZES_1024 = [4096, 4097]
CASES = [(n, 256) for n in SIZES_256] + [(n, 1024) for n in SIZES_1024]


def expected_variant(n: int, max_threads: int) -> str:
    return "single" if n <= metal_rules.single_row_limit(max_threads) else "looped"


def check_calls(L, kernel_prefix: str, n: int, max_threads: int) -> None:
    name, groups, threads = L.calls[0]
    variant = expected_variant(n, max_threads)
    assert name.startswith(f"fusedops_{kernel_prefix}_{variant}_"), name
    assert threads % 32 == 0 and threads <= max_threads
    if variant == "single":
        assert threads * metal_rules.READS >= n


# --- softmax ---------------------------------------------------------------------------------

# (the default run: the diagonal, every size and every other value once)
@exhaustive_unless(one_of_each({"n,max_threads": CASES, "pair": FWD_PAIRS}))
@pytest.mark.parametrize("pair", FWD_PAIRS, ids=lambda p: "_".join(p))
@pytest.mark.parametrize("n,max_threads", CASES)
def test_metal_softmax_forward(metal_lib, pair, n, max_threads):
    torch.manual_seed(n)
    x_dtype, out_dtype = DTYPES[pair[0]], DTYPES[pair[1]]
    m = 3
    x = rows(m, n, x_dtype, scale=3.0)
    L = launcher(metal_lib, max_threads, seed=n)
    y = metal_softmax.softmax_forward_with(L, x, out_dtype)
    assert y.dtype == out_dtype and y.shape == (m, n) and y.is_contiguous()
    check_calls(L, "softmax_fwd", n, max_threads)
    assert_close_to_ref(y, torch.softmax(x.double(), -1), out_dtype)


# (the default run: the diagonal, every size and every other value once)
@exhaustive_unless(one_of_each({"n,max_threads": CASES, "pair": BWD_PAIRS}))
@pytest.mark.parametrize("pair", BWD_PAIRS, ids=lambda p: "_".join(p))
@pytest.mark.parametrize("n,max_threads", CASES)
def test_metal_softmax_backward(metal_lib, pair, n, max_threads):
    torch.manual_seed(n + 1)
    y_dtype, dx_dtype = DTYPES[pair[0]], DTYPES[pair[1]]
    m = 3
    y = torch.softmax(torch.randn(m, n, dtype=torch.float64) * 2, -1).to(y_dtype)
    dy = rows(m, n, y_dtype)
    L = launcher(metal_lib, max_threads, seed=n)
    dx = metal_softmax.softmax_backward_with(L, y, dy, dx_dtype)
    assert dx.dtype == dx_dtype and dx.shape == (m, n)
    check_calls(L, "softmax_bwd", n, max_threads)
    y64, dy64 = y.double(), dy.double()
    ref = y64 * (dy64 - (y64 * dy64).sum(-1, keepdim=True))
    assert_close_to_ref(dx, ref, dx_dtype)


@pytest.mark.parametrize("layout", ["misaligned", "aligned-strided", "broadcast"])
@pytest.mark.parametrize("n,max_threads", [(33, 256), (1000, 256), (1025, 256), (4097, 1024)])
def test_metal_softmax_strided_rows(metal_lib, layout, n, max_threads):
    """Any row stride and storage offset: vector loads only where aligned, scalar tails."""
    torch.manual_seed(7)
    x = rows(3, n, torch.float16, layout)
    dy = rows(3, n, torch.float32, layout)
    L = launcher(metal_lib, max_threads)
    y = metal_softmax.softmax_forward_with(L, x, torch.float32)
    assert_close_to_ref(y, torch.softmax(x.double(), -1), torch.float32)
    dx = metal_softmax.softmax_backward_with(L, y, dy, torch.float16)
    y64, dy64 = y.double(), dy.double()
    assert_close_to_ref(dx, y64 * (dy64 - (y64 * dy64).sum(-1, keepdim=True)), torch.float16)


@pytest.mark.parametrize("n,max_threads", [(40, 256), (1030, 256), (4100, 1024)])
def test_metal_softmax_infinities(metal_lib, n, max_threads):
    """Masked rows (-inf), fully masked rows (NaN as in torch), a leading masked chunk, and a NaN
    that arrives while a thread's running max is still -inf (the whole row must be NaN)."""
    x = torch.randn(6, n)
    x[0, : n // 2] = float("-inf")  # first half masked: the online max starts at -inf
    x[1, :] = float("-inf")  # fully masked
    x[2, 1::3] = float("-inf")
    x[4, :] = float("-inf")
    x[4, n - 3] = float("nan")  # a later chunk of some thread, after -inf only
    x[4, 0] = 1.0
    x[5, n // 3] = float("nan")
    L = launcher(metal_lib, max_threads)
    y = metal_softmax.softmax_forward_with(L, x, torch.float32)
    ref = torch.softmax(x.double(), -1)
    torch.testing.assert_close(y.double(), ref, equal_nan=True, **tol(torch.float32))


def test_metal_softmax_rows_stride_over_groups(metal_lib, monkeypatch):
    """More rows than threadgroups: each threadgroup loops over rows (shared memory reuse)."""
    monkeypatch.setattr(metal_rules, "MAX_ROW_GROUPS", 3)
    torch.manual_seed(3)
    for n in (100, 1500):
        x = torch.randn(8, n)
        L = launcher(metal_lib, 256)
        y = metal_softmax.softmax_forward_with(L, x, torch.float32)
        assert L.calls[0][1] == 3
        assert_close_to_ref(y, torch.softmax(x.double(), -1), torch.float32)
        dy = torch.randn(8, n)
        dx = metal_softmax.softmax_backward_with(L, y, dy, torch.float32)
        y64, dy64 = y.double(), dy.double()
        ref = y64 * (dy64 - (y64 * dy64).sum(-1, keepdim=True))
        assert_close_to_ref(dx, ref, torch.float32)


# --- LayerNorm -------------------------------------------------------------------------------

def layernorm_ref(x, w, b, eps, dy=None):
    x64 = x.double().requires_grad_(dy is not None)
    w64 = None if w is None else w.double().requires_grad_(dy is not None)
    b64 = None if b is None else b.double().requires_grad_(dy is not None)
    y = F.layer_norm(x64, (x.shape[1],), w64, b64, eps)
    mean = x64.detach().mean(-1)
    rstd = torch.rsqrt(x64.detach().var(-1, unbiased=False) + eps)
    if dy is None:
        return y.detach(), mean, rstd
    y.backward(dy.double())
    return (x64.grad, None if w64 is None else w64.grad, None if b64 is None else b64.grad)


# (the default run: the diagonal, every size and every other value once)
@exhaustive_unless(one_of_each({"n,max_threads": CASES, "pair": LN_PAIRS,
                                "affine": ["wb", "w", "none"]}))
@pytest.mark.parametrize("affine", ["wb", "w", "none"])
@pytest.mark.parametrize("pair", LN_PAIRS, ids=lambda p: "_".join(p))
@pytest.mark.parametrize("n,max_threads", CASES)
def test_metal_layernorm_forward(metal_lib, pair, affine, n, max_threads):
    torch.manual_seed(n + 2)
    x_dtype, y_dtype = DTYPES[pair[0]], DTYPES[pair[1]]
    m, eps = 3, 1e-5
    x = rows(m, n, x_dtype, scale=2.0, shift=0.5)
    w = torch.randn(n) if "w" in affine else None
    b = torch.randn(n) if "b" in affine else None
    L = launcher(metal_lib, max_threads)
    y, mean, rstd = metal_norms.layernorm_forward_with(L, x, w, b, eps, y_dtype)
    assert y.dtype == y_dtype and mean.dtype == rstd.dtype == torch.float32
    assert mean.shape == rstd.shape == (m,)
    check_calls(L, "layernorm_fwd", n, max_threads)
    y_ref, mean_ref, rstd_ref = layernorm_ref(x, w, b, eps)
    assert_close_to_ref(y, y_ref, y_dtype)
    assert_close_to_ref(mean, mean_ref, torch.float32)
    assert_close_to_ref(rstd, rstd_ref, torch.float32, scale=10)


# Every dtype pair with all three gradients; the other flag combinations on one pair.
LN_BWD_CASES = [(p, "dx-dw-db") for p in LN_PAIRS] + [
    (("half", "half"), need) for need in ("dx", "dw-db", "db", "dx-db")]


# (the default run: the diagonal, every size and every other value once)
@exhaustive_unless(one_of_each({"n,max_threads": CASES, "pair,need": LN_BWD_CASES}))
@pytest.mark.parametrize("pair,need", LN_BWD_CASES, ids=lambda v: "_".join(v)
                         if isinstance(v, tuple) else v)
@pytest.mark.parametrize("n,max_threads", CASES)
def test_metal_layernorm_backward(metal_lib, pair, need, n, max_threads):
    torch.manual_seed(n + 3)
    x_dtype, dy_dtype = DTYPES[pair[0]], DTYPES[pair[1]]
    m, eps = 5, 1e-5
    x = rows(m, n, x_dtype, scale=2.0, shift=-0.3)
    dy = rows(m, n, dy_dtype)
    w = torch.randn(n)
    b = torch.randn(n)
    mean = x.double().mean(-1).float()
    rstd = torch.rsqrt(x.double().var(-1, unbiased=False) + eps).float()
    L = launcher(metal_lib, max_threads)
    need_dx, need_dw, need_db = "dx" in need, "dw" in need, "db" in need
    dx, dw, db = metal_norms.layernorm_backward_with(L, dy, x, w, mean, rstd, need_dx, need_dw,
                                               need_db)
    check_calls(L, "layernorm_bwd", n, max_threads)
    assert (dx is not None, dw is not None, db is not None) == (need_dx, need_dw, need_db)
    dx_ref, dw_ref, db_ref = layernorm_ref(x, w, b, eps, dy)
    if need_dx:
        assert dx.dtype == x_dtype
        assert_close_to_ref(dx, dx_ref, x_dtype, scale=4)
    if need_dw:
        assert dw.dtype == torch.float32 and dw.shape == (n,)
        assert_close_to_ref(dw, dw_ref, torch.float32, scale=10)
    if need_db:
        assert_close_to_ref(db, db_ref, torch.float32, scale=10)
    if need_dw or need_db:
        assert L.calls[-1][0] == "fusedops_layernorm_dwdb_reduce"


@pytest.mark.parametrize("layout", ["misaligned", "aligned-strided", "broadcast"])
@pytest.mark.parametrize("n,max_threads", [(33, 256), (1000, 256), (1025, 256), (4097, 1024)])
def test_metal_layernorm_strided_rows(metal_lib, layout, n, max_threads):
    torch.manual_seed(11)
    eps = 1e-5
    x = rows(4, n, torch.bfloat16, layout if layout != "broadcast" else "misaligned")
    dy = rows(4, n, torch.bfloat16, layout)
    w, b = torch.randn(n), torch.randn(n)
    L = launcher(metal_lib, max_threads)
    y, mean, rstd = metal_norms.layernorm_forward_with(L, x, w, b, eps, torch.bfloat16)
    y_ref, _, _ = layernorm_ref(x, w, b, eps)
    assert_close_to_ref(y, y_ref, torch.bfloat16)
    dx, dw, db = metal_norms.layernorm_backward_with(L, dy, x, w, mean, rstd, True, True, True)
    dx_ref, dw_ref, db_ref = layernorm_ref(x, w, b, eps, dy)
    assert_close_to_ref(dx, dx_ref, torch.bfloat16, scale=2)
    assert_close_to_ref(dw, dw_ref, torch.float32, scale=10)
    assert_close_to_ref(db, db_ref, torch.float32, scale=10)


@pytest.mark.parametrize("n,max_threads", [(100, 256), (1500, 256)])
def test_metal_layernorm_groups_own_several_rows(metal_lib, monkeypatch, n, max_threads):
    """Forward rows striding over threadgroups; backward threadgroups accumulating the
    dweight/dbias partials of several rows (registers, or read-modify-write when looped),
    then the deterministic reduction."""
    monkeypatch.setattr(metal_rules, "MAX_ROW_GROUPS", 3)
    monkeypatch.setattr(metal_rules, "LN_BWD_MIN_GROUPS", 1)
    monkeypatch.setattr(metal_rules, "LN_BWD_MAX_GROUPS", 3)
    torch.manual_seed(5)
    m, eps = 8, 1e-5
    x = torch.randn(m, n, dtype=torch.float16)
    dy = torch.randn(m, n, dtype=torch.float16)
    w, b = torch.randn(n), torch.randn(n)
    L = launcher(metal_lib, max_threads)
    y, mean, rstd = metal_norms.layernorm_forward_with(L, x, w, b, eps, torch.float16)
    assert_close_to_ref(y, layernorm_ref(x, w, b, eps)[0], torch.float16)
    dx, dw, db = metal_norms.layernorm_backward_with(L, dy, x, w, mean, rstd, True, True, True)
    assert L.calls[1][1] == 3  # backward threadgroups
    dx_ref, dw_ref, db_ref = layernorm_ref(x, w, b, eps, dy)
    assert_close_to_ref(dx, dx_ref, torch.float16, scale=4)
    assert_close_to_ref(dw, dw_ref, torch.float32, scale=10)
    assert_close_to_ref(db, db_ref, torch.float32, scale=10)
    # Deterministic: a second run gives bitwise the same dweight/dbias.
    _, dw2, db2 = metal_norms.layernorm_backward_with(L, dy, x, w, mean, rstd, False, True, True)
    assert torch.equal(dw, dw2) and torch.equal(db, db2)


def test_metal_layernorm_constant_rows_and_eps(metal_lib):
    """Zero variance (rstd = 1/sqrt(eps)) and a large eps; constant rows whose sum is not exact
    in float32 still give mean = the value and y = bias exactly (single-row and looped)."""
    x = torch.full((2, 300), 3.25)
    for eps in (1e-5, 0.5):
        y, mean, rstd = metal_norms.layernorm_forward_with(launcher(metal_lib, 256), x, None, None,
                                                           eps,
                                                     torch.float32)
        y_ref, mean_ref, rstd_ref = layernorm_ref(x, None, None, eps)
        assert_close_to_ref(y, y_ref, torch.float32)
        assert_close_to_ref(rstd, rstd_ref, torch.float32)
    for n in (300, 2049):  # single-row and looped on the 256-thread device
        x = torch.full((3, n), 0.1)
        b = torch.randn(n)
        y, mean, _ = metal_norms.layernorm_forward_with(launcher(metal_lib, 256), x, None, b, 1e-5,
                                                  torch.float32)
        assert torch.equal(mean, torch.full((3,), 0.1))
        assert torch.equal(y, b.expand(3, n))


def test_metal_empty_and_degenerate_shapes(metal_lib):
    L = launcher(metal_lib, 256)
    assert metal_softmax.softmax_forward_with(L, torch.empty(0, 7), torch.float32).shape == (0, 7)
    y, mean, rstd = metal_norms.layernorm_forward_with(L, torch.empty(0, 5), None, None, 1e-5,
                                                 torch.float32)
    assert y.shape == (0, 5) and mean.shape == (0,)
    dx, dw, db = metal_norms.layernorm_backward_with(L, torch.empty(0, 5), torch.empty(0, 5),
                                               torch.ones(5), torch.empty(0), torch.empty(0),
                                               True, True, True)
    assert dx.shape == (0, 5) and torch.equal(dw, torch.zeros(5)) and torch.equal(db, dw)
    assert L.calls == []
