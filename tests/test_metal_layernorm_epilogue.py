"""The LayerNorm epilogue Metal shaders (metal/layernorm_epilogue.metal), run on the CPU emulation,
against a float64 oracle (``F.layer_norm`` in float64, the dropout mask of fusedops._philox, the
activation in float64, and autograd for the gradients).

Every kernel (forward / backward, single-row / looped, every dtype pair) runs through the *real host
code* of ``fusedops.backends.metal.epilogue`` (``layernorm_epilogue_*_with(launcher, ...)``) in the
thread layouts the host picks: a thread's READS consecutive columns (no dropout, or a pipeline below
256 threads: one Philox call per element) and the Philox layout (columns W = 256 apart, one Philox
call per thread and step). The residual / dropout / activation combinations run in each; the dropout
mask is checked bit for bit against ``fusedops._philox.keep_mask`` in the forward (zero pattern of
the output) and in the backward (the per-threadgroup dbias partials read back); the GELU (Metal has
no erf: a fitted approximation) and its derivative against float64. """

from __future__ import annotations

import inspect
import re
import subprocess
import warnings
from pathlib import Path

import _oracles as oracles
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_to_ref, exhaustive_unless, one_of_each, tol

import fusedops
from fusedops import _philox
from fusedops.backends import metal
from fusedops.backends.metal import epilogue as metal_epilogue
from fusedops.backends.metal import loader as metal_loader
from fusedops.backends.metal import rules as metal_rules

emu = pytest.importorskip("metal_emu.emu", reason="needs the Metal emulation helper")
from metal_emu.harness import Recorder, mm_bindings, rows  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DTYPES = {"float": torch.float32, "half": torch.float16, "bfloat": torch.bfloat16}
PAIRS = sorted(metal_rules.LAYERNORM_EPILOGUE_TYPES)
EPS = 1e-5
SEED = 0x1234_5678_9ABC  # key words both non-zero
REDUCE = "fusedops_layernorm_dwdb_reduce"
# (n, max_threads): consecutive-column single-row / looped (64 threads: no Philox layout, one
# call per element with dropout), Philox-layout single-row / looped (256 threads).
CASES = [(40, 64), (300, 64), (129, 256), (1100, 256)]
COMBOS = [(r, p, a) for r in (True, False) for p in (0.0, 0.25) for a in (None, "relu", "gelu")]


def expected_kernel(op: str, n: int, max_threads: int, dropout: bool) -> tuple[str, bool]:
    """(kernel name prefix, Philox layout) the host should pick."""
    philox = dropout and metal_rules.philox_threadgroup_limit(max_threads) > 0
    limit = metal_rules.READS * (metal_rules.philox_threadgroup_limit(max_threads) if philox
                           else metal_rules.threadgroup_limit(max_threads))
    v = "single" if n <= limit else "looped"
    return f"fusedops_layernorm_epilogue_{op}_{v}_", philox


def keep_factor(m: int, n: int, p: float, seed: int = SEED) -> torch.Tensor | None:
    if p == 0.0:
        return None
    return _philox.keep_mask(seed, m, n, p).double() / (1.0 - p)


def oracle(x, residual, w, b, p, activation, dout=None, ds=None, seed=SEED):
    """float64 (out, mean, rstd), or with dout the float64 (dx, dw, db) (tests/_oracles.py)."""
    m, n = x.shape
    return oracles.layernorm_epilogue(x, residual, w, b, EPS, keep_factor(m, n, p, seed),
                                      activation, dout, ds)


def stats(s):
    var, mean = torch.var_mean(s.double(), -1, correction=0)
    return mean.float(), torch.rsqrt(var + EPS).float()


def forward(metal_lib, x, residual, w, b, p, activation, out_dtype, max_threads, need_stats=True,
            seed=SEED, fiber_seed=0):
    L = Recorder(metal_lib, max_threads, fiber_seed)
    res = metal_epilogue.layernorm_epilogue_forward_with(L, x, residual, w, b, EPS, out_dtype, p,
                                                         seed,
                                                activation, need_stats)
    return res, L


def check_forward(res, L, x, residual, w, b, p, activation, out_dtype, n, max_threads):
    out, s, mean, rstd = res
    m = x.shape[0]
    prefix, philox = expected_kernel("fwd", n, max_threads, p > 0)
    assert L.calls[0][0].startswith(prefix), L.calls[0][0]
    assert bool(L.args[0][-1] & metal_rules.FLAG_PHILOX) == philox
    if philox:
        assert L.calls[0][2] % metal_rules.PHILOX_W == 0
    assert out.dtype == out_dtype and out.shape == (m, n) and out.is_contiguous()
    if residual is None:
        assert s is None
    else:
        assert s.dtype == x.dtype and s.is_contiguous() and torch.equal(s, x + residual)
    ref, mean_ref, rstd_ref = oracle(x, residual, w, b, p, activation)
    assert_close_to_ref(out, ref, out_dtype, scale=2)
    assert_close_to_ref(mean, mean_ref, torch.float32, scale=10)
    assert_close_to_ref(rstd, rstd_ref, torch.float32, scale=10)
    if p > 0:  # dropped elements are exactly 0 (act(0) = 0 for every activation)
        keep = _philox.keep_mask(SEED, m, n, p)
        assert not out[~keep].any()


# --- forward ---------------------------------------------------------------------------------

# (the default run: the diagonal, every size and every other value once)
@exhaustive_unless(one_of_each({"n,max_threads": CASES, "residual,p,activation": COMBOS}))
@pytest.mark.parametrize("n,max_threads", CASES)
@pytest.mark.parametrize("residual,p,activation", COMBOS,
                         ids=lambda v: {True: "res", False: "nores"}.get(v, str(v)))
def test_metal_layernorm_epilogue_forward(metal_lib, residual, p, activation, n, max_threads):
    """Every residual / dropout / activation combination in every variant and thread layout."""
    g = torch.Generator().manual_seed(n + int(p * 8))
    m = 3
    x = torch.randn(m, n, generator=g) * 2 + 0.5
    r = torch.randn(m, n, generator=g) if residual else None
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    res, L = forward(metal_lib, x, r, w, b, p, activation, torch.float32, max_threads, fiber_seed=n)
    assert L.calls[0][1] == m
    check_forward(res, L, x, r, w, b, p, activation, torch.float32, n, max_threads)


@pytest.mark.parametrize("n,max_threads", [(40, 64), (300, 64), (129, 256)])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "_".join(p))
def test_metal_layernorm_epilogue_forward_dtypes(metal_lib, pair, n, max_threads):
    """Every (x, out) pair with residual, dropout and GELU; parameters in x's dtype."""
    g = torch.Generator().manual_seed(n + 1)
    x_dtype, out_dtype = DTYPES[pair[0]], DTYPES[pair[1]]
    x = rows(3, n, x_dtype, scale=2.0)
    r = rows(3, n, x_dtype)
    w, b = torch.randn(n, generator=g).to(x_dtype), torch.randn(n, generator=g).to(x_dtype)
    res, L = forward(metal_lib, x, r, w, b, 0.3, "gelu", out_dtype, max_threads)
    assert L.calls[0][0].endswith(f"_{pair[0]}_{pair[1]}")
    check_forward(res, L, x, r, w, b, 0.3, "gelu", out_dtype, n, max_threads)


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("n", [4096, 4097])
def test_metal_layernorm_epilogue_forward_at_1024_threads(metal_lib, n, p):
    """The single-row / looped switch at the real 1024-thread limit, both layouts."""
    g = torch.Generator().manual_seed(n)
    x, r = torch.randn(2, n, generator=g).half(), torch.randn(2, n, generator=g).half()
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    res, L = forward(metal_lib, x, r, w, b, p, "relu", torch.float16, 1024)
    check_forward(res, L, x, r, w, b, p, "relu", torch.float16, n, 1024)


# --- backward --------------------------------------------------------------------------------

def backward(metal_lib, dout, ds, s, w, b, p, activation, max_threads, need=(True, True, True),
             fiber_seed=0, seed=SEED):
    mean, rstd = stats(s)
    L = Recorder(metal_lib, max_threads, fiber_seed)
    res = metal_epilogue.layernorm_epilogue_backward_with(L, dout, ds, s, w, b, mean, rstd, p, seed,
                                                 activation, *need)
    return res, L


def check_backward(res, L, x, r, w, b, p, activation, dout, ds, n, max_threads, need,
                   dx_scale=4):
    dx, dw, db = res
    m = x.shape[0]
    prefix, philox = expected_kernel("bwd", n, max_threads, p > 0)
    assert L.calls[0][0].startswith(prefix), L.calls[0][0]
    assert bool(L.args[0][-1] & metal_rules.FLAG_PHILOX) == philox
    assert L.calls[0][1] == metal_rules.layernorm_bwd_groups(m, n)
    need_dx, need_dw, need_db = need
    assert (dx is not None, dw is not None, db is not None) == need
    assert [c[0] for c in L.calls[1:]] == ([REDUCE] if need_dw or need_db else [])
    dx_ref, dw_ref, db_ref = oracle(x, r, w, b, p, activation, dout, ds)
    if need_dx:
        assert dx.dtype == x.dtype and dx.shape == (m, n) and dx.is_contiguous()
        assert_close_to_ref(dx, dx_ref, x.dtype, scale=dx_scale)
    if need_dw:
        assert dw.dtype == torch.float32 and dw.shape == (n,)
        assert_close_to_ref(dw, dw_ref, torch.float32, scale=20)
    if need_db:
        assert db.dtype == torch.float32 and db.shape == (n,)
        assert_close_to_ref(db, db_ref, torch.float32, scale=20)


# (the default run: the diagonal, every size and every other value once)
@exhaustive_unless(one_of_each({"n,max_threads": CASES, "residual,p,activation": COMBOS}))
@pytest.mark.parametrize("n,max_threads", CASES)
@pytest.mark.parametrize("residual,p,activation", COMBOS,
                         ids=lambda v: {True: "res", False: "nores"}.get(v, str(v)))
def test_metal_layernorm_epilogue_backward(metal_lib, residual, p, activation, n, max_threads):
    """dx (+ ds when there is a residual), dweight, dbias for every combination, variant and
    thread layout: the dropout mask regenerated, the activation's input recomputed."""
    g = torch.Generator().manual_seed(n + 2 + int(p * 8))
    m = 3
    x = torch.randn(m, n, generator=g) * 2 + 0.5
    r = torch.randn(m, n, generator=g) if residual else None
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    s = x if r is None else x + r
    dout, ds = torch.randn(m, n, generator=g), torch.randn(m, n, generator=g) if residual else None
    res, L = backward(metal_lib, dout, ds, s, w, b, p, activation, max_threads, fiber_seed=n)
    check_backward(res, L, x, r, w, b, p, activation, dout, ds, n, max_threads,
                   (True, True, True))


@pytest.mark.parametrize("n,max_threads", [(40, 64), (300, 64), (129, 256)])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "_".join(p))
def test_metal_layernorm_epilogue_backward_dtypes(metal_lib, pair, n, max_threads):
    """Every (s, dout) pair with ds, dropout and GELU."""
    g = torch.Generator().manual_seed(n + 3)
    s_dtype, dout_dtype = DTYPES[pair[0]], DTYPES[pair[1]]
    x, r = rows(3, n, s_dtype, scale=2.0), rows(3, n, s_dtype)
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    dout, ds = rows(3, n, dout_dtype), rows(3, n, s_dtype)
    res, L = backward(metal_lib, dout, ds, x + r, w, b, 0.3, "gelu", max_threads)
    assert L.calls[0][0].endswith(f"_{pair[0]}_{pair[1]}")
    check_backward(res, L, x, r, w, b, 0.3, "gelu", dout, ds, n, max_threads,
                   (True, True, True), dx_scale=8)


NEEDS = [(True, False, False), (False, True, False), (False, False, True), (True, True, False),
         (False, True, True)]


@pytest.mark.parametrize("need", NEEDS, ids=lambda v: "-".join("xwb"[i] for i in range(3)
                                                               if v[i]))
@pytest.mark.parametrize("n,max_threads", [(300, 64), (1100, 256)])
def test_metal_layernorm_epilogue_backward_needs(metal_lib, need, n, max_threads):
    """Each gradient alone and in pairs (the kernel skips the row reduction without dx); no
    weight and no bias (the bias only enters through the activation)."""
    g = torch.Generator().manual_seed(n + 4)
    x, r = torch.randn(4, n, generator=g), torch.randn(4, n, generator=g)
    w = None if need[0] and not need[1] else torch.randn(n, generator=g)
    b = torch.randn(n, generator=g) if need[2] else None
    dout, ds = torch.randn(4, n, generator=g), torch.randn(4, n, generator=g)
    res, L = backward(metal_lib, dout, ds, x + r, w, b, 0.2, "relu", max_threads, need)
    check_backward(res, L, x, r, w, b, 0.2, "relu", dout, ds, n, max_threads, need)


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("n", [4096, 4097])
def test_metal_layernorm_epilogue_backward_at_1024_threads(metal_lib, n, p):
    g = torch.Generator().manual_seed(n + 5)
    x, r = torch.randn(2, n, generator=g).bfloat16(), torch.randn(2, n, generator=g).bfloat16()
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    dout, ds = torch.randn(2, n, generator=g).bfloat16(), torch.randn(2, n, generator=g).bfloat16()
    res, L = backward(metal_lib, dout, ds, x + r, w, b, p, "gelu", 1024)
    check_backward(res, L, x, r, w, b, p, "gelu", dout, ds, n, 1024, (True, True, True))


# --- the dropout mask, bit for bit -------------------------------------------------------------

# (n, max_threads): per-element Philox single-row / looped; the Philox layout single-row at
# exactly 4W columns, looped with a partial last block, single-row on 1024 threads.
MASK_CASES = [(200, 64), (700, 64), (1024, 256), (2100, 256), (3000, 1024)]
MASK_SEEDS = [(0, 0.5), (1, 0.1), (2**32 + 7, 0.9), (2**62 - 1, 0.37), (2**64 - 1, 0.75)]


# each layout with two seeds, each seed in two layouts
MASK_RUNS = [(*c, *MASK_SEEDS[(i + k) % len(MASK_SEEDS)]) for i, c in enumerate(MASK_CASES)
             for k in (0, 2)]


@pytest.mark.parametrize("n,max_threads,seed,p", MASK_RUNS,
                         ids=[f"{n}-{t}-{s:#x}-{p}" for n, t, s, p in MASK_RUNS])
def test_metal_layernorm_epilogue_dropout_mask_is_philox_keep_mask(metal_lib, monkeypatch, n,
                                                                   max_threads, seed, p):
    """The kernels keep exactly fusedops._philox.keep_mask(seed, M, N, p): in the forward the
    nonzero pattern of the output (LayerNorm output never 0 here; kept values are the p = 0
    output times 1 / (1 - p)), in the backward the per-threadgroup dbias
    partials with dout = 1 (one row per threadgroup: exactly the factors). Rows stride over two
    forward threadgroups (the row index of the counter)."""
    monkeypatch.setattr(metal_rules, "MAX_ROW_GROUPS", 2)
    m = 5
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(n))
    keep = _philox.keep_mask(seed, m, n, p)
    scale = torch.tensor(1.0 / (1.0 - p), dtype=torch.float32)
    (out0, *_), _ = forward(metal_lib, x, None, None, None, 0.0, None, torch.float32, max_threads)
    assert out0.ne(0).all()  # the precondition: nothing is 0 before dropout
    (out, *_), L = forward(metal_lib, x, None, None, None, p, None, torch.float32, max_threads,
                           need_stats=False, seed=seed)
    assert L.calls[0][1] == 2
    assert torch.equal(out != 0, keep)
    # (the layouts differ, and so the order of the row sums: not bitwise)
    torch.testing.assert_close(out[keep], out0[keep] * scale, rtol=1e-5, atol=1e-5)
    # backward: g = dout * f = f, and threadgroup t owns row t alone
    (_, _, db), L = backward(metal_lib, torch.ones(m, n), None, x, None, None, p, None, max_threads,
                             need=(False, False, True), seed=seed)
    assert L.calls[0][1] == m
    partials = L.args[0][9]
    assert torch.equal(partials, keep.float() * scale)
    torch.testing.assert_close(db, partials.sum(0))


# --- GELU ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,max_threads", [(1000, 256), (1500, 64)])
def test_metal_layernorm_epilogue_gelu_accuracy(metal_lib, n, max_threads):
    """The fitted erf (Metal has none): GELU and its derivative at the kernel's own pre-activation
    values over [-12, 12] against float64, to float32 accuracy (tails included)."""
    x = torch.linspace(-1.0, 1.0, n).repeat(2, 1)
    w = torch.full((n,), 7.0)
    b = torch.zeros(n)
    (v, *_), _ = forward(metal_lib, x, None, w, b, 0.0, None, torch.float32, max_threads)
    assert v.min() < -11.5 and v.max() > 11.5
    (out, *_), _ = forward(metal_lib, x, None, w, b, 0.0, "gelu", torch.float32, max_threads)
    v64 = v.double()
    torch.testing.assert_close(out.double(), F.gelu(v64), rtol=2e-6, atol=1e-12)
    # derivative: one row per threadgroup, dout = 1, so the dbias partials are act'(v)
    (_, _, _), L = backward(metal_lib, torch.ones(2, n), None, x, w, b, 0.0, "gelu", max_threads,
                            need=(False, False, True))
    cdf = 0.5 * (1.0 + torch.erf(v64 / 2**0.5))
    grad = cdf + v64 * torch.exp(-0.5 * v64 * v64) / (2 * torch.pi) ** 0.5
    torch.testing.assert_close(L.args[0][9].double(), grad, rtol=2e-6, atol=2e-7)


def test_metal_shaders_call_no_erf():
    """erf is not in the Metal standard library (the emulation's shim has one): the shaders
    must use their own."""
    for path in sorted((REPO / "metal").glob("*.metal")):
        code = re.sub(r"//[^\n]*", "", path.read_text())
        assert not re.search(r"(?<![\w])(?:metal::|precise::|fast::)?erfc?\s*\(", code), path.name


# --- layouts, threadgroups owning several rows, degenerate cases -----------------------------

@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("n,max_threads", [(130, 64), (700, 64), (1100, 256)])
def test_metal_layernorm_epilogue_strided_rows(metal_lib, n, max_threads, p):
    """Misaligned and strided x / residual / ds, a stride-0 dout (expanded gradient), half
    parameters (converted), no vector loads."""
    torch.manual_seed(n)
    x = rows(4, n, torch.float16, "misaligned", scale=2.0)
    r = rows(4, n, torch.float16, "aligned-strided")
    w, b = torch.randn(n).half(), torch.randn(n).half()
    res, L = forward(metal_lib, x, r, w, b, p, "gelu", torch.float16, max_threads)
    assert L.args[0][-1] & metal_rules.FLAG_VEC == 0
    check_forward(res, L, x, r, w, b, p, "gelu", torch.float16, n, max_threads)
    dout, ds = rows(4, n, torch.float16, "broadcast"), rows(4, n, torch.float16, "misaligned")
    out, s, mean, rstd = res
    L = Recorder(metal_lib, max_threads)
    bres = metal_epilogue.layernorm_epilogue_backward_with(L, dout, ds, s, w, b, mean, rstd, p,
                                                           SEED,
                                                  "gelu", True, True, True)
    check_backward(bres, L, x, r, w, b, p, "gelu", dout, ds, n, max_threads, (True, True, True))


@pytest.mark.parametrize("n,max_threads", [(100, 64), (129, 256), (700, 64), (1100, 256)])
def test_metal_layernorm_epilogue_groups_own_several_rows_deterministic(metal_lib, monkeypatch, n,
                                                                        max_threads):
    """Forward rows striding over threadgroups; backward threadgroups accumulating the partials
    of several rows (registers, or read-modify-write when looped) in both layouts, then the
    reduction: bitwise equal across fiber orders."""
    monkeypatch.setattr(metal_rules, "MAX_ROW_GROUPS", 3)
    monkeypatch.setattr(metal_rules, "LN_BWD_MIN_GROUPS", 1)
    monkeypatch.setattr(metal_rules, "LN_BWD_MAX_GROUPS", 3)
    g = torch.Generator().manual_seed(n + 6)
    m = 8
    x, r = torch.randn(m, n, generator=g).half(), torch.randn(m, n, generator=g).half()
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    res, L = forward(metal_lib, x, r, w, b, 0.3, "gelu", torch.float32, max_threads, fiber_seed=1)
    assert L.calls[0][1] == 3
    check_forward(res, L, x, r, w, b, 0.3, "gelu", torch.float32, n, max_threads)
    dout, ds = torch.randn(m, n, generator=g), torch.randn(m, n, generator=g).half()
    bres, L = backward(metal_lib, dout, ds, res[1], w, b, 0.3, "gelu", max_threads, fiber_seed=1)
    assert L.calls[0][1] == 3
    check_backward(bres, L, x, r, w, b, 0.3, "gelu", dout, ds, n, max_threads, (True, True, True))
    for fiber_seed in (2, 5):  # other fiber orders (even: fine interleaving; odd: run-ahead)
        again, _ = backward(metal_lib, dout, ds, res[1], w, b, 0.3, "gelu", max_threads,
                            fiber_seed=fiber_seed)
        assert all(torch.equal(a, c) for a, c in zip(again, bres, strict=True))


def test_metal_layernorm_epilogue_constant_rows_and_stats(metal_lib):
    """Constant rows (s = x + r constant): v is exactly the bias, so out = act(b); without
    need_stats no statistics are written or returned."""
    for n, max_threads in ((50, 64), (700, 64)):
        x, r = torch.full((3, n), 1.5), torch.full((3, n), 0.25)
        b = torch.randn(n)
        (out, s, mean, rstd), L = forward(metal_lib, x, r, torch.randn(n), b, 0.0, "relu",
                                          torch.float32, max_threads, need_stats=False)
        assert mean is None and rstd is None and L.args[0][-1] & metal_rules.FLAG_STATS == 0
        assert torch.equal(out, torch.relu(b).expand(3, n)) and torch.equal(s, x + r)


def test_metal_layernorm_epilogue_empty_shapes_and_fallbacks(metal_lib):
    L = Recorder(metal_lib, 64)
    out, s, mean, rstd = metal_epilogue.layernorm_epilogue_forward_with(
        L, torch.empty(0, 5), torch.empty(0, 5), None, None, EPS, torch.float32, 0.5, 1, "gelu",
        True)
    assert out.shape == (0, 5) and s.shape == (0, 5) and mean.shape == (0,)
    out, s, mean, rstd = metal_epilogue.layernorm_epilogue_forward_with(
        L, torch.empty(3, 0).half(), None, None, None, EPS, torch.float16, 0.0, 1, None, True)
    assert out.shape == (3, 0) and s is None and mean.isnan().all() and rstd.isnan().all()
    dx, dw, db = metal_epilogue.layernorm_epilogue_backward_with(
        L, torch.empty(0, 5), None, torch.empty(0, 5), torch.ones(5), None, torch.empty(0),
        torch.empty(0), 0.5, 1, "relu", True, True, True)
    assert dx.shape == (0, 5) and torch.equal(dw, torch.zeros(5)) and torch.equal(db, dw)
    x = torch.randn(2, 5)
    assert metal_epilogue.layernorm_epilogue_backward_with(
        L, x, None, x, None, None, torch.zeros(2), torch.ones(2), 0.0, 1, None, False, False,
        False) == (None, None, None)
    assert L.calls == []
    # no kernel for float x -> half out, nor for a residual of another dtype: the reference
    for xx, rr, out_dtype in ((x, None, torch.float16), (x, x.half(), torch.float32)):
        got = metal_epilogue.layernorm_epilogue_forward_with(L, xx, rr, None, None, EPS, out_dtype,
                                                             0.5,
                                                    7, "relu", True)
        want = metal.reference.layernorm_epilogue_forward(xx, rr, None, None, EPS, out_dtype,
                                                          0.5, 7, "relu", True)
        assert torch.equal(got[0], want[0])
    assert L.calls == []
    with pytest.raises(ValueError, match="activation"):
        metal_epilogue.layernorm_epilogue_forward_with(L, x, None, None, None, EPS, torch.float32,
                                                       0.0, 1,
                                              "tanh", False)
    with pytest.raises(ValueError, match="dropout_p"):
        metal_epilogue.layernorm_epilogue_forward_with(L, x, None, None, None, EPS, torch.float32,
                                                       1.0, 1,
                                              None, False)


def test_metal_layernorm_epilogue_geometry_matches_extension(tmp_path):
    """The extension's Philox-layout geometry (plain C++ in the .mm) equals
    fusedops.backends.metal's."""
    text = (REPO / "csrc" / "fusedops_metal.mm").read_text()
    src = tmp_path / "geometry.cpp"
    src.write_text(
        "#include <algorithm>\n#include <cstdint>\n#include <cstdio>\n"
        + text[text.index("namespace {"):text.index("// --- Kernels")] + "}  // namespace\n"
        "int main() {\n  long n, t;\n"
        "  while (std::scanf(\"%ld %ld\", &n, &t) == 2) {\n"
        "    std::printf(\"%ld %ld\\n\", (long)philox_threadgroup_limit(t),\n"
        "                (long)philox_row_threads(n, t));\n  }\n}\n")
    exe = tmp_path / "geometry"
    subprocess.run([emu.CXX, "-std=c++17", str(src), "-o", str(exe)], check=True)
    cases = [(n, t) for n in (1, 255, 256, 1024, 1025, 2048, 3000, 4096, 4097)
             for t in (32, 64, 255, 256, 448, 768, 896, 1024, 2048)]
    out = subprocess.run([str(exe)], input="".join(f"{n} {t}\n" for n, t in cases),
                         capture_output=True, text=True, check=True).stdout.split("\n")
    for (n, t), line in zip(cases, out, strict=False):
        assert [int(v) for v in line.split()] == [metal_rules.philox_threadgroup_limit(t),
                                                  metal_rules.philox_row_threads(n, t)], (n, t)


# --- the public functions through the implementation chain -----------------------------------

@pytest.fixture
def fake_mps(monkeypatch):
    """macOS with MPS but no extension: the compile_shader path, backed by the emulation."""
    from test_metal_backend import fake_mps_compile_shader

    yield from fake_mps_compile_shader(monkeypatch, 19)


def _chain(backend, x, w, b, r, dout, dr):
    """fused_layernorm with every epilogue and its gradients, on one backend, seed fixed."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b, r)]
    torch.manual_seed(123)  # the dropout seed comes from torch's generator
    with fusedops.use_backend(backend), fusedops.count_fused_calls() as counts:
        out, s = fusedops.fused_layernorm(leaves[0], (x.shape[-1],), leaves[1], leaves[2], EPS,
                                          residual=leaves[3], dropout_p=0.25,
                                          activation="gelu", training=True)
        torch.autograd.backward((out, s), (dout, dr))
    return out.detach(), s.detach(), [t.grad for t in leaves], counts


def test_metal_layernorm_epilogue_compile_shader_path_end_to_end(fake_mps):
    """fused_layernorm(residual=, dropout_p=, activation=) forward and backward on the Metal
    kernels equals the reference backend (same seed: the same dropout mask)."""
    assert metal.implementation() == "compile_shader"
    g = torch.Generator().manual_seed(33)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the kernels ran
        for n, dtype in ((40, torch.float16), (1500, torch.float32)):
            x, r = (torch.randn(2, 3, n, generator=g).to(dtype) for _ in range(2))
            w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
            dout, dr = (torch.randn(2, 3, n, generator=g).to(dtype) for _ in range(2))
            out, s, grads, counts = _chain("metal", x, w, b, r, dout, dr)
            assert counts["layernorm_epilogue_forward"] == 1
            assert counts["layernorm_epilogue_backward"] == 1
            out_ref, s_ref, grads_ref, _ = _chain("reference", x, w, b, r, dout, dr)
            assert torch.equal(s, s_ref)
            torch.testing.assert_close(out, out_ref, **tol(dtype, 2))
            for got, want in zip(grads, grads_ref, strict=True):
                torch.testing.assert_close(got, want, **tol(dtype, 20))


class _FakeExt(emu.FakeExtension):
    """Stands in for fusedops._metal_ext: the LayerNorm epilogue bindings, with the parameter
    names the extension declares, run the host code on the emulation."""

    def layernorm_epilogue_forward(self, x, residual, weight, bias, eps, out_dtype, dropout_p,
                                   seed, activation, need_stats):
        self.calls.append("layernorm_epilogue_forward")
        assert isinstance(eps, float) and isinstance(dropout_p, float)
        assert -2**63 <= seed < 2**63 and isinstance(need_stats, bool)
        return metal_epilogue.layernorm_epilogue_forward_with(self.L, x, residual, weight, bias,
                                                              eps,
                                                     out_dtype, dropout_p, seed, activation,
                                                     need_stats)

    def layernorm_epilogue_backward(self, dout, ds, s, weight, bias, mean, rstd, dropout_p, seed,
                                    activation, need_dx, need_dw, need_db):
        self.calls.append("layernorm_epilogue_backward")
        assert isinstance(dropout_p, float) and -2**63 <= seed < 2**63
        assert all(isinstance(v, bool) for v in (need_dx, need_dw, need_db))
        return metal_epilogue.layernorm_epilogue_backward_with(self.L, dout, ds, s, weight, bias,
                                                               mean,
                                                      rstd, dropout_p, seed, activation,
                                                      need_dx, need_dw, need_db)


def test_metal_layernorm_epilogue_extension_path(metal_lib, monkeypatch):
    """metal.layernorm_epilogue_* on the extension path call the extension's bindings, whose
    argument lists (read from the .mm) match the calls (a seed of 2^64 - 1 passed as the signed
    64-bit integer with the same bits); unsupported pairs use the reference."""
    bindings = mm_bindings()
    for name in ("layernorm_epilogue_forward", "layernorm_epilogue_backward"):
        params = list(inspect.signature(getattr(_FakeExt, name)).parameters)[1:]
        assert bindings[name] == params, name
    ext = _FakeExt(metal_lib)
    monkeypatch.setattr(metal_loader, "impl", metal_loader.Extension(ext))
    assert metal_loader.impl.layernorm_epilogue_fwd == {(DTYPES[a], DTYPES[b]) for a, b in PAIRS}
    g = torch.Generator().manual_seed(34)
    x, r = torch.randn(4, 300, generator=g).half(), torch.randn(4, 300, generator=g).half()
    w, b = torch.randn(300, generator=g), torch.randn(300, generator=g)
    seed = 2**64 - 1
    out, s, mean, rstd = metal.layernorm_epilogue_forward(x, r, w, b, EPS, torch.float16, 0.5,
                                                          seed, "relu", True)
    assert_close_to_ref(out, oracle(x, r, w, b, 0.5, "relu", seed=seed)[0], torch.float16,
                        scale=2)
    dout = torch.randn(4, 300, generator=g).half()
    dx, dw, db = metal.layernorm_epilogue_backward(dout, None, s, w, b, mean, rstd, 0.5, seed,
                                                   "relu", True, True, True)
    dx_ref, dw_ref, db_ref = oracle(x, r, w, b, 0.5, "relu", dout, seed=seed)
    assert_close_to_ref(dx, dx_ref, torch.float16, scale=4)
    assert_close_to_ref(dw, dw_ref, torch.float32, scale=20)
    out32 = metal.layernorm_epilogue_forward(x.float(), None, None, None, EPS, torch.float16,
                                             0.0, 0, None, False)[0]  # no float -> half kernel
    assert ext.calls == ["layernorm_epilogue_forward", "layernorm_epilogue_backward"]
    assert out32.dtype == torch.float16
    monkeypatch.setattr(metal_loader, "impl", None)
