"""The masked softmax Metal shaders (metal/softmax_masked.metal), run on the CPU emulation, against
a float64 oracle (torch ops in float64).

Every kernel (forward single-row / looped for every (x, y, mask) type triple, backward single-row
/ looped for every (y, dx) pair) runs through the *real host code* of ``fusedops.backends.metal``
(``softmax_masked_*_with(launcher, ...)``). Cheap devices do most of the work: pipelines of 64
threads (single-row limit 256, so N = 257 and 600 run the looped kernels on two SIMD-groups);
the real boundaries (256 threads: N = 1024 / 1025, 1024 threads: N = 4096 / 4097) run once per
dtype pair. Also: every mask kind (none, bool, float of x's dtype, float32, other dtypes
converted), broadcast masks read through stride 0, transposed and misaligned masks, causal
(also with Q > N), rows where nothing is kept (zeros), NaN rows, masked positions holding NaN
(never read or never used), rows striding over threadgroups, empty shapes, and the public
functions through both implementation paths.
"""

from __future__ import annotations

import inspect
import warnings

import _oracles as oracles
import pytest
import torch
from conftest import assert_close_to_ref, tol

import fusedops
from fusedops.backends import metal
from fusedops.backends.metal import loader as metal_loader
from fusedops.backends.metal import rules as metal_rules
from fusedops.backends.metal import softmax as metal_softmax

emu = pytest.importorskip("metal_emu.emu", reason="needs the Metal emulation helper")
from metal_emu.harness import Recorder, mm_bindings  # noqa: E402

DTYPES = {"float": torch.float32, "half": torch.float16, "bfloat": torch.bfloat16}
FWD_TRIPLES = sorted(metal_rules.SOFTMAX_MASKED_FWD_TYPES)
FWD_PAIRS = sorted({(a, b) for a, b, _ in FWD_TRIPLES})
BWD_PAIRS = sorted(metal_rules.SOFTMAX_MASKED_BWD_TYPES)
# (n, max_threads): single-row on one / two SIMD-groups, looped on two SIMD-groups (several
# steps, a partial last one).
SMALL = [(33, 64), (129, 64), (600, 64)]
# The real boundaries: single-row / looped at 256 and at 1024 threads.
BIG = [(1024, 256), (1025, 256), (4096, 1024), (4097, 1024)]
SCALE = 0.37


def variant(n: int, max_threads: int) -> str:
    return "single" if n <= metal_rules.single_row_limit(max_threads) else "looped"


def oracle(x, mask, scale, causal):
    """float64 softmax of x * scale, masked and causal; rows with nothing kept are zeros
    (tests/_oracles.py)."""
    return oracles.softmax_masked(x, mask, scale, causal)


def make_mask(kind: str, shape, x_dtype, generator=None):
    """A mask of ``shape``: None, bool (about 30% dropped), or additive (-inf on some)."""
    if kind == "none":
        return None
    if kind == "bool":
        return torch.rand(shape, generator=generator) > 0.3
    dtype = {"x": x_dtype, "float": torch.float32, "half": torch.float16,
             "double": torch.float64}[kind]
    m = torch.randn(shape, generator=generator, dtype=torch.float64) * 2
    m = m.masked_fill(torch.rand(shape, generator=generator) < 0.2, -torch.inf)
    return m.to(dtype)


def run_forward(metal_lib, x, mask, causal, out_dtype, max_threads, seed=0, scale=SCALE):
    L = Recorder(metal_lib, max_threads, seed)
    full = None if mask is None else mask.expand(x.shape)
    y = metal_softmax.softmax_masked_forward_with(L, x, full, scale, causal, out_dtype)
    assert y.dtype == out_dtype and y.shape == x.shape and y.is_contiguous()
    return y, L


# --- forward ---------------------------------------------------------------------------------

MASK_TYPES = FWD_TRIPLES + [(a, b, "none") for a, b in FWD_PAIRS]


@pytest.mark.parametrize("n,max_threads", SMALL)
@pytest.mark.parametrize("types", MASK_TYPES, ids="_".join)
def test_metal_softmax_masked_forward(metal_lib, types, n, max_threads):
    """Every (x, y, mask) triple (and no mask) single-row and looped, causal on alternate cases;
    the mask broadcast over heads (stride 0)."""
    a, b, mk = types
    causal = (MASK_TYPES.index(types) + SMALL.index((n, max_threads))) % 2 == 1
    g = torch.Generator().manual_seed(n * 7 + causal)
    x_dtype, y_dtype = DTYPES[a], DTYPES[b]
    x = (torch.randn(1, 2, 2, n, generator=g, dtype=torch.float64) * 3).to(x_dtype)
    kind = {"bool": "bool", "none": "none"}.get(mk, "x" if mk == a else "float")
    mask = make_mask(kind, (1, 1, 2, n), x_dtype, g)
    y, L = run_forward(metal_lib, x, mask, causal, y_dtype, max_threads, seed=n)
    name = L.calls[0][0]
    kernel_mask = "bool" if mk == "none" else mk
    assert name == f"fusedops_softmax_masked_fwd_{variant(n, max_threads)}_{a}_{b}_{kernel_mask}"
    assert L.calls[0][1] == 4  # one threadgroup per row
    flags = L.args[0][-1]
    assert bool(flags & metal_rules.FLAG_MASK) == (mask is not None)
    assert bool(flags & metal_rules.FLAG_CAUSAL) == causal
    assert_close_to_ref(y, oracle(x, mask, SCALE, causal), y_dtype)


@pytest.mark.parametrize("n,max_threads", BIG)
@pytest.mark.parametrize("pair", FWD_PAIRS, ids=lambda p: "_".join(p))
def test_metal_softmax_masked_forward_boundaries(metal_lib, pair, n, max_threads):
    """The single-row / looped switch at 256 and at the real 1024 threads."""
    g = torch.Generator().manual_seed(n)
    x_dtype, y_dtype = DTYPES[pair[0]], DTYPES[pair[1]]
    x = (torch.randn(1, 1, 2, n, generator=g, dtype=torch.float64) * 3).to(x_dtype)
    mask = make_mask("bool" if n % 2 else "x", (1, 1, 1, n), x_dtype, g)
    y, L = run_forward(metal_lib, x, mask, False, y_dtype, max_threads, seed=n)
    assert L.calls[0][0].startswith(f"fusedops_softmax_masked_fwd_{variant(n, max_threads)}_")
    assert L.calls[0][2] <= max_threads
    assert_close_to_ref(y, oracle(x, mask, SCALE, False), y_dtype)


@pytest.mark.parametrize("queries,n,max_threads", [(7, 40, 64), (45, 40, 64), (45, 300, 64),
                                                   (5, 1025, 256)])
def test_metal_softmax_masked_causal(metal_lib, queries, n, max_threads):
    """Causal rows keep min(N, q + 1) columns (Q < N and Q > N); the dropped columns hold NaN in x
    and in the mask, which must neither be read into a result nor poison it."""
    g = torch.Generator().manual_seed(queries + n)
    x = torch.randn(1, 1, queries, n, generator=g)
    mask = make_mask("float", (1, 1, queries, n), torch.float32, g).clamp_min(-30.0)
    dropped = torch.ones(queries, n, dtype=torch.bool).triu(1)
    x_poisoned = x.masked_fill(dropped, torch.nan)
    mask_poisoned = mask.masked_fill(dropped, torch.nan)
    for m in (None, mask_poisoned):
        y, L = run_forward(metal_lib, x_poisoned, m, True, torch.float32, max_threads, seed=queries)
        ref = oracle(x, None if m is None else mask, SCALE, True)
        assert not y.isnan().any()
        assert torch.equal(y[..., dropped], torch.zeros_like(y[..., dropped]))
        assert_close_to_ref(y, ref, torch.float32)


BN = 160  # single-row on 64 threads, looped on 32
# pattern -> (mask shape to build, how to view it, expected (B, H, Q, N) strides, vector loads)
BROADCASTS = {
    "full": ((2, 2, 2, BN), None, (4 * BN, 2 * BN, BN, 1), True),
    "keys-padding": ((2, 1, 1, BN), None, (BN, 0, 0, 1), True),
    "per-query": ((1, 1, 2, BN), None, (0, 0, BN, 1), True),
    "one-row": ((1, 1, 1, BN), None, (0, 0, 0, 1), True),
    "per-row-scalar": ((2, 2, 2, 1), None, (4, 2, 1, 0), False),
    "transposed": ((2, 2, BN, 2), "transpose", (4 * BN, 2 * BN, 1, 2), False),
    "misaligned": ((2, 2, 2, BN + 1), "offset", (4 * (BN + 1), 2 * (BN + 1), BN + 1, 1), False),
}


@pytest.mark.parametrize("kind", ["bool", "x", "converted"])
@pytest.mark.parametrize("pattern", list(BROADCASTS))
def test_metal_softmax_masked_broadcast_patterns(metal_lib, pattern, kind):
    """Masks read through their strides: broadcast (stride 0) dims, a column stride of 0 or
    Q (transposed), a misaligned start; vector loads only for aligned unit-stride rows; a mask
    dtype the kernels lack (half, float64) is converted to float32 without materialising its
    broadcast dims."""
    shape, view, strides, vec = BROADCASTS[pattern]
    g = torch.Generator().manual_seed(len(pattern))
    x = torch.randn(2, 2, 2, BN, generator=g, dtype=torch.float64).to(torch.bfloat16)
    mk = kind if kind != "converted" else ("half", "double")[len(pattern) % 2]
    base = make_mask(mk, shape, torch.bfloat16, g)
    if view == "transpose":
        base = base.transpose(-1, -2)
    elif view == "offset":
        base = base[..., 1:]
    for causal, max_threads in ((False, 64), (True, 32)):  # single-row; looped
        y, L = run_forward(metal_lib, x, base, causal, torch.bfloat16, max_threads)
        assert L.calls[0][0].startswith(
            f"fusedops_softmax_masked_fwd_{variant(BN, max_threads)}_bfloat_bfloat_")
        bound, bound_strides = L.args[0][1], tuple(L.args[0][8:12])
        if mk in ("bool", "x"):  # read in place
            assert L.calls[0][0].endswith("_bool" if mk == "bool" else "_bfloat")
            assert bound_strides == strides
            assert bool(L.args[0][-1] & metal_rules.FLAG_MASK_VEC) == vec
        else:  # converted: the broadcast dims stay stride 0, none of them copied
            assert L.calls[0][0].endswith("_float") and bound.dtype == torch.float32
            assert [s == 0 for s in bound_strides] == [s == 0 for s in strides]
            assert bound.untyped_storage().nbytes() == 4 * base.numel()
        assert_close_to_ref(y, oracle(x, base, SCALE, causal), torch.bfloat16)


@pytest.mark.parametrize("n,max_threads", [(40, 64), (600, 64), (1025, 256)])
def test_metal_softmax_masked_empty_and_nan_rows(metal_lib, n, max_threads):
    """Rows where nothing is kept come out as zeros (bool mask all False, additive -inf, x -inf
    everywhere, causal row 0 with its only column masked); a NaN score makes its row NaN (also
    one arriving while the running max is -inf), as in torch."""
    x = torch.randn(1, 1, 6, n)
    keep = torch.ones(1, 1, 6, n, dtype=torch.bool)
    keep[..., 1, :] = False  # nothing kept
    keep[..., 0, 0] = False  # causal row 0 keeps column 0 only: empty
    keep[..., 2, : n // 2] = False  # first half dropped: the online max starts at -inf
    x[..., 3, :] = -torch.inf  # every score -inf
    x[..., 4, n - 1] = torch.nan
    x[..., 5, :] = -torch.inf
    x[..., 5, n - 2] = torch.nan  # NaN after -inf only
    for causal in (False, True):
        y, _ = run_forward(metal_lib, x, keep, causal, torch.float32, max_threads)
        ref = oracle(x, keep, SCALE, causal)
        torch.testing.assert_close(y.double(), ref, equal_nan=True, **tol(torch.float32))
        assert torch.equal(y[..., 1, :], torch.zeros(1, 1, n))
        assert torch.equal(y[..., 3, :], torch.zeros(1, 1, n))
        if causal:  # rows 0-5 keep columns 0-5: row 0 nothing, the NaNs dropped
            assert torch.equal(y[..., 0, :], torch.zeros(1, 1, n)) and not y.isnan().any()
        else:
            assert bool(y[..., 4, :].isnan().all()) and bool(y[..., 5, :].isnan().all())
    additive = torch.zeros(1, 1, 6, n)
    additive[..., 1, :] = -torch.inf
    y, _ = run_forward(metal_lib, torch.randn(1, 1, 6, n), additive, False, torch.float32,
                       max_threads)
    assert torch.equal(y[..., 1, :], torch.zeros(1, 1, n)) and not y.isnan().any()


@pytest.mark.parametrize("scale", [1.0, -1.5, 0.0])
def test_metal_softmax_masked_scales(metal_lib, scale):
    """Any scale: 1, negative (the masked scores stay -inf), 0 (uniform over the kept)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 1, 5, 150, generator=g)
    mask = make_mask("bool", (2, 1, 5, 150), torch.float32, g)
    for max_threads in (64, 32):  # single-row; looped on one SIMD-group
        y, L = run_forward(metal_lib, x, mask, True, torch.float32, max_threads, scale=scale)
        assert L.calls[0][0].startswith(
            f"fusedops_softmax_masked_fwd_{variant(150, max_threads)}_")
        assert_close_to_ref(y, oracle(x, mask, scale, True), torch.float32)


@pytest.mark.parametrize("n,max_threads", [(100, 64), (700, 64)])
def test_metal_softmax_masked_rows_stride_over_groups(metal_lib, monkeypatch, n, max_threads):
    """More rows than threadgroups: each threadgroup loops over rows whose (b, h, q) - and so
    their mask rows and causal limits - differ."""
    monkeypatch.setattr(metal_rules, "MAX_ROW_GROUPS", 3)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(2, 3, 5, n, generator=g).half()
    mask = make_mask("x", (2, 3, 5, n), torch.float16, g)
    y, L = run_forward(metal_lib, x, mask, True, torch.float32, max_threads)
    assert L.calls[0][1] == 3
    assert_close_to_ref(y, oracle(x, mask, SCALE, True), torch.float32)


def test_metal_softmax_masked_empty_shapes_and_fallbacks(metal_lib):
    L = Recorder(metal_lib, 64)
    for shape in ((0, 2, 3, 5), (2, 2, 3, 0), (2, 0, 3, 5)):
        y = metal_softmax.softmax_masked_forward_with(L, torch.randn(shape).half(), None, 0.5, True,
                                              torch.float32)
        assert y.shape == shape and y.dtype == torch.float32
    dx = metal_softmax.softmax_masked_backward_with(L, torch.empty(0, 4), torch.empty(0, 4), 2.0,
                                            torch.float32)
    assert dx.shape == (0, 4)
    assert L.calls == []
    # float x with a half output, float64 x: no kernel, the reference, no launch
    x = torch.randn(1, 2, 3, 9)
    mask = torch.rand(1, 1, 3, 9) > 0.5
    for xx, out in ((x, torch.float16), (x.double(), torch.float64)):
        y = metal_softmax.softmax_masked_forward_with(L, xx, mask.expand(x.shape), 0.5, True, out)
        assert y.dtype == out
        assert_close_to_ref(y, oracle(x, mask, 0.5, True), torch.float16)
    assert L.calls == []
    with pytest.raises(ValueError, match="B, H, Q, N"):
        metal_softmax.softmax_masked_forward_with(L, torch.randn(3, 9), None, 1.0, False,
                                                  torch.float32)


# --- backward --------------------------------------------------------------------------------

def backward_oracle(y, dy, scale):
    return oracles.softmax_backward(y, dy, scale)


@pytest.mark.parametrize("n,max_threads", SMALL + BIG[:2])
@pytest.mark.parametrize("pair", BWD_PAIRS, ids=lambda p: "_".join(p))
def test_metal_softmax_masked_backward(metal_lib, pair, n, max_threads):
    """dx = scale * y * (dy - sum(y * dy)) for every (y, dx) pair; masked positions (y = 0) and
    a row of zeros (nothing kept) give dx = 0."""
    g = torch.Generator().manual_seed(n + 1)
    y_dtype, dx_dtype = DTYPES[pair[0]], DTYPES[pair[1]]
    x = torch.randn(1, 1, 4, n, generator=g, dtype=torch.float64) * 2
    mask = make_mask("bool", (1, 1, 4, n), torch.float64, g)
    mask[..., 2, :] = False
    y = oracle(x, mask, 1.0, False).to(y_dtype).view(4, n)
    dy = torch.randn(4, n, generator=g, dtype=torch.float64).to(y_dtype)
    L = Recorder(metal_lib, max_threads, seed=n)
    dx = metal_softmax.softmax_masked_backward_with(L, y, dy, SCALE, dx_dtype)
    assert dx.dtype == dx_dtype and dx.shape == (4, n) and dx.is_contiguous()
    assert L.calls[0][0] == \
        f"fusedops_softmax_masked_bwd_{variant(n, max_threads)}_{pair[0]}_{pair[1]}"
    assert_close_to_ref(dx, backward_oracle(y, dy, SCALE), dx_dtype)
    assert torch.equal(dx[2], torch.zeros(n, dtype=dx_dtype))
    assert not dx[~mask.view(4, n)].any()


@pytest.mark.parametrize("layout", ["misaligned", "broadcast"])
@pytest.mark.parametrize("n,max_threads", [(33, 64), (600, 64), (4097, 1024)])
def test_metal_softmax_masked_backward_strided(metal_lib, layout, n, max_threads):
    """Row strides and offsets (scalar loads where misaligned), a stride-0 dy, a dy of another
    dtype (converted to y's), more rows than threadgroups."""
    from test_metal_emulation import rows

    torch.manual_seed(n)
    y = rows(5, n, torch.float32, "misaligned")
    y.copy_(torch.softmax(y * 2, -1))
    dy = rows(5, n, torch.float16 if layout == "broadcast" else torch.float32, layout)
    L = Recorder(metal_lib, max_threads)
    dx = metal_softmax.softmax_masked_backward_with(L, y, dy, -2.0, torch.bfloat16)
    assert L.args[0][-1] & metal_rules.FLAG_VEC == 0
    assert_close_to_ref(dx, backward_oracle(y, dy.float(), -2.0), torch.bfloat16)


# --- the public functions through the implementation chain -----------------------------------

@pytest.fixture
def fake_mps(monkeypatch):
    """macOS with MPS but no extension: the compile_shader path, backed by the emulation."""
    from test_metal_backend import fake_mps_compile_shader

    yield from fake_mps_compile_shader(monkeypatch, 17)


def test_metal_softmax_masked_compile_shader_path_end_to_end(fake_mps):
    """fused_softmax(scale=, mask=, causal=) forward and backward on the Metal kernels."""
    assert metal.implementation() == "compile_shader"
    g = torch.Generator().manual_seed(31)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the kernels ran
        for n, dtype, kind in ((7, torch.float16, "bool"), (300, torch.float32, "x"),
                               (1500, torch.bfloat16, "float")):
            x = torch.randn(2, 3, 5, n, generator=g).to(dtype).requires_grad_()
            mask = make_mask(kind, (2, 1, 5, n), dtype, g)
            with fusedops.count_fused_calls() as counts:
                y = fusedops.fused_softmax(x, -1, scale=0.125, mask=mask, causal=True)
                dy = torch.randn(y.shape, generator=g).to(dtype)
                y.backward(dy)
            assert counts["softmax_masked_forward"] == 1
            assert counts["softmax_masked_backward"] == 1
            y64 = oracle(x.detach(), mask, 0.125, True)
            assert_close_to_ref(y, y64, dtype)
            dx64 = backward_oracle(y64, dy, 0.125)  # empty rows: y = 0, so dx = 0
            assert_close_to_ref(x.grad, dx64, dtype, scale=2)
    y = metal.softmax_masked_forward(x.detach(), None, 1.0, False, torch.float32)
    assert_close_to_ref(y, oracle(x.detach(), None, 1.0, False), torch.float32)


class _FakeExt(emu.FakeExtension):
    """Stands in for fusedops._metal_ext: the masked softmax bindings, with the parameter names
    the extension declares, run the host code on the emulation (what the extension mirrors)."""

    def softmax_masked_forward(self, x, mask, scale, causal, out_dtype):
        self.calls.append("softmax_masked_forward")
        assert isinstance(scale, float) and isinstance(causal, bool)
        return metal_softmax.softmax_masked_forward_with(self.L, x, mask, scale, causal, out_dtype)

    def softmax_masked_backward(self, y, dy, scale, out_dtype):
        self.calls.append("softmax_masked_backward")
        assert isinstance(scale, float)
        return metal_softmax.softmax_masked_backward_with(self.L, y, dy, scale, out_dtype)


def test_metal_softmax_masked_extension_path(metal_lib, monkeypatch):
    """metal.softmax_masked_* on the extension path call the extension's bindings, whose
    argument lists (read from the .mm) match the calls; unsupported pairs use the reference."""
    bindings = mm_bindings()
    for name in ("softmax_masked_forward", "softmax_masked_backward"):
        params = list(inspect.signature(getattr(_FakeExt, name)).parameters)[1:]
        assert bindings[name] == params, name
    ext = _FakeExt(metal_lib)
    monkeypatch.setattr(metal_loader, "impl", metal_loader.Extension(ext))
    assert metal_loader.impl.softmax_masked_fwd == {(DTYPES[a], DTYPES[b]) for a, b in FWD_PAIRS}
    assert metal_loader.impl.softmax_masked_bwd == {(DTYPES[a], DTYPES[b]) for a, b in BWD_PAIRS}
    g = torch.Generator().manual_seed(32)
    x = torch.randn(2, 2, 3, 50, generator=g).half()
    mask = make_mask("half", (2, 1, 1, 50), torch.float16, g).expand(x.shape)
    y = metal.softmax_masked_forward(x, mask, 0.5, True, torch.float16)
    assert_close_to_ref(y, oracle(x, mask, 0.5, True), torch.float16)
    dy = torch.randn(12, 50, generator=g).half()
    dx = metal.softmax_masked_backward(y.view(12, 50), dy, 0.5, torch.float16)
    assert_close_to_ref(dx, backward_oracle(y.view(12, 50), dy, 0.5), torch.float16)
    y32 = metal.softmax_masked_forward(x.float(), None, 0.5, False, torch.float16)  # no kernel
    assert ext.calls == ["softmax_masked_forward", "softmax_masked_backward"]
    assert y32.dtype == torch.float16
    monkeypatch.setattr(metal_loader, "impl", None)
