"""The Triton LayerNorm-with-epilogue kernels (fusedops.backends.triton.layernorm_epilogue_forward /
_backward: ``out = activation(dropout(layer_norm(x + residual)))``, the 2-D row contract) against
a float64 oracle: F.layer_norm in float64, the dropout mask of ``fusedops._philox.keep_mask`` and
autograd for dx / dweight / dbias.

On CPU they run through the Triton interpreter (conftest sets TRITON_INTERPRET=1 without CUDA),
so shapes stay small and the kernels' single-block limits are shrunk (monkeypatched) to reach
the looped kernels; the ``gpu`` tests at the end take large shapes on a CUDA device.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    INTERPRETING,
    assert_close_to_ref,
    exhaustive_unless,
    one_of_each,
    tol,
    triton_backend_module,
)

tb = triton_backend_module()

from fusedops import _philox  # noqa: E402
from fusedops.backends import reference  # noqa: E402
from fusedops.backends.triton import configs  # noqa: E402
from fusedops.backends.triton.configs import layernorm as ln_rules  # noqa: E402
from fusedops.backends.triton.configs import layernorm_epilogue as le_rules  # noqa: E402
from fusedops.backends.triton.runtime import philox as tphilox  # noqa: E402

# Tensors are created on the GPU when there is one (conftest's _tensors_on_device).
ON_DEVICE = True

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5
GRAD_SCALE = 4.0  # dx, dweight and dbias are sums over a row / over rows
SEED = 0x3A5F_1234_DEAD_BEEF  # both key words with their high bit set


def _dev() -> torch.device:
    return torch.empty(0).device


def make(m: int, n: int, dtype: torch.dtype, w_mode: str = "fp32", residual: bool = True,
         ds: bool = True, seed: int = 0):
    """A problem: dict of x, residual, weight, bias, dout, ds (None where absent). x scaled off 1
    and shifted so mean and rstd matter; w_mode "none", "same" (x's dtype) or "fp32"."""
    g = torch.Generator().manual_seed(seed)  # CPU generator: the same values on every device

    def rnd(*shape, scale=1.0, shift=0.0):
        return scale * torch.randn(*shape, generator=g, device="cpu") + shift

    wdt = torch.float32 if w_mode == "fp32" else dtype
    t = {
        "x": rnd(m, n, scale=2.0, shift=0.3).to(dtype),
        "residual": rnd(m, n).to(dtype) if residual else None,
        "weight": None if w_mode == "none" else rnd(n, scale=0.5, shift=1.0).to(wdt),
        "bias": None if w_mode == "none" else rnd(n, scale=0.3).to(wdt),
        "dout": rnd(m, n).to(dtype),
        "ds": rnd(m, n).to(dtype) if ds else None,
    }
    dev = _dev()
    return {k: None if v is None else v.to(dev) for k, v in t.items()}


def assert_sum_rounded(s: torch.Tensor, x: torch.Tensor, residual: torch.Tensor) -> None:
    """s is x + residual rounded once to x's dtype, as torch's own sum: bit for bit. (The Triton
    interpreter rounds float32 to bfloat16 toward zero, so there it may be one unit off.)"""
    assert s.dtype == x.dtype and s.shape == x.shape and s.is_contiguous()
    expected = x + residual
    if INTERPRETING and x.dtype == torch.bfloat16:
        torch.testing.assert_close(s, expected, atol=0, rtol=2**-7)
    else:
        assert torch.equal(s, expected)


def oracle(t: dict, p: float, seed: int, act: str | None, s: torch.Tensor | None = None):
    """float64 (out, mean, rstd, dx, dw, db) with LayerNorm input ``s`` (default x + residual in
    x's dtype); dw / db are defined without a weight / bias too (the gradients of a unit weight
    and a zero bias). For ReLU, ``t["dout"]`` is zeroed where the activation's input lies within
    1e-3 of the kink, so that the float32 kernels and this float64 oracle cannot take different
    sides of it (a whole dout · w / (1 - p) apart) on large problems."""
    x, res = t["x"], t["residual"]
    m, n = x.shape
    if s is None:
        s = x if res is None else x + res
    s64 = s.detach().double().requires_grad_(True)
    ones = torch.ones(n, dtype=torch.float64, device=x.device)
    w64 = (ones if t["weight"] is None else t["weight"].double()).requires_grad_(True)
    b64 = (ones * 0 if t["bias"] is None else t["bias"].double()).requires_grad_(True)
    y = F.layer_norm(s64, (n,), w64, b64, EPS)
    if p:
        keep = _philox.keep_mask(seed, m, n, p, x.device)
        y = y * keep.double() / (1.0 - p)
    if act == "relu":
        t["dout"] = t["dout"].masked_fill(y.detach().abs() < 1e-3, 0)
        y = torch.relu(y)
    elif act == "gelu":
        y = F.gelu(y)
    dx, dw, db = torch.autograd.grad(y, (s64, w64, b64), t["dout"].double())
    if t["ds"] is not None:
        dx = dx + t["ds"].double()
    var, mean = torch.var_mean(s64.detach(), dim=-1, correction=0)
    return y.detach(), mean, torch.rsqrt(var + EPS), dx, dw, db


def forward(t: dict, p: float, seed: int, act: str | None, out_dtype=None, need_stats=True):
    x = t["x"]
    return tb.layernorm_epilogue_forward(x, t["residual"], t["weight"], t["bias"], EPS,
                                         out_dtype or x.dtype, p, seed, act, need_stats)


def backward(t: dict, s, mean, rstd, p: float, seed: int, act: str | None,
             need=(True, True, True)):
    s_in = t["x"] if s is None else s
    return tb.layernorm_epilogue_backward(t["dout"], t["ds"], s_in, t["weight"], t["bias"],
                                          mean, rstd, p, seed, act, *need)


def check(t: dict, p: float, act: str | None, seed: int = SEED, out_dtype=None):
    """Forward and backward against the oracle."""
    x = t["x"]
    dtype = x.dtype
    out_dtype = out_dtype or dtype
    out, s, mean, rstd = forward(t, p, seed, act, out_dtype)
    if t["residual"] is None:
        assert s is None
    else:
        assert_sum_rounded(s, x, t["residual"])
    out64, mean64, rstd64, dx64, dw64, db64 = oracle(t, p, seed, act, s)
    assert out.shape == x.shape and out.dtype == out_dtype and out.is_contiguous()
    assert_close_to_ref(out, out64, dtype)
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == rstd.shape == (x.shape[0],)
    torch.testing.assert_close(mean.double(), mean64, **tol(torch.float32))
    torch.testing.assert_close(rstd.double(), rstd64, **tol(torch.float32))
    dx, dw, db = backward(t, s, mean, rstd, p, seed, act)
    assert dx.dtype == dtype and dx.shape == x.shape and dx.is_contiguous()
    assert dw.dtype == db.dtype == torch.float32 and dw.shape == db.shape == (x.shape[1],)
    assert_close_to_ref(dx, dx64, dtype, GRAD_SCALE)
    assert_close_to_ref(dw, dw64, dtype, GRAD_SCALE)
    assert_close_to_ref(db, db64, dtype, GRAD_SCALE)
    return out, s, mean, rstd


# --------------------------------------------------------------------------- the generator


# (the seeds around 2^32 by default; the others exhaustive)
@exhaustive_unless(lambda seed: seed in (0xFFFF_FFFF, 2**32))
@pytest.mark.parametrize("seed", [0, 1, 0xFFFF_FFFF, 2**32, 0x8000_0001_8000_0001, 2**62 - 1,
                                  SEED])
def test_philox_matches_reference_bits(seed):
    """The Triton Philox4x32-10 (and its element -> counter/word map) reproduces
    fusedops._philox bit for bit: columns crossing the 256 / 1024 / 2048 boundaries, odd widths,
    seeds with high bits set in either key word."""
    for m, n in [(3, 2100), (2, 300), (5, 37), (1, 1)]:
        got = tphilox.random_bits(seed, m, n, _dev())
        assert torch.equal(got, _philox.random_bits(seed, m, n, _dev()))


def test_philox_known_answer():
    """Random123's published Philox4x32-10 test vector (counter and key all ones), through the
    reference and so through the Triton generator tested against it above."""
    ones = torch.full((1,), 0xFFFFFFFF, dtype=torch.int64)
    words = _philox.philox4x32(ones, ones, ones, ones, 0xFFFFFFFF, 0xFFFFFFFF)
    assert [int(w) for w in words] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


# --------------------------------------------------------------------------- the main matrix

# residual x dropout p x activation, each case with a different dtype / weight mode / ds, so
# that every value of each of those meets every value of the others somewhere.
W_MODES = ["none", "same", "fp32"]
MATRIX = [
    pytest.param(res, p, act, DTYPES[k % 3], W_MODES[(k // 3 + k) % 3], k % 2 == 0,
                 id=f"{'res' if res else 'nores'}-p{p}-{act}-{str(DTYPES[k % 3])[6:]}"
                    f"-{W_MODES[(k // 3 + k) % 3]}{'-ds' if k % 2 == 0 else ''}")
    for k, (res, p, act) in enumerate(itertools.product([False, True], [0.0, 0.1, 0.5],
                                                        [None, "relu", "gelu"]))
]


# Default run: a diagonal of residual x p x activation (float32, float16, bfloat16 among
# them, float32 parameters with float16 x); the rest of MATRIX in the extended one.
@exhaustive_unless(one_of_each({"residual": [False, True], "p": [0.0, 0.1, 0.5],
                                "act": [None, "relu", "gelu"]}))
@pytest.mark.parametrize("residual, p, act, dtype, w_mode, ds", MATRIX)
def test_matches_float64(residual, p, act, dtype, w_mode, ds):
    t = make(5, 300, dtype, w_mode, residual=residual, ds=ds, seed=int(p * 10) + len(str(act)))
    check(t, p, act)


# (float32 without parameters by default; test_matches_float64 runs the 16-bit dtypes and the
# other parameter modes)
@exhaustive_unless(lambda dtype, w_mode: (dtype, w_mode) == (torch.float32, "none"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("w_mode", W_MODES)
def test_dtypes_and_params(dtype, w_mode):
    """Every dtype with every kind of weight / bias (none, x's dtype, float32), with the full
    epilogue (residual, dropout, GELU)."""
    if dtype == torch.float32 and w_mode == "fp32":
        pytest.skip("the same as 'same' for float32 rows")
    check(make(3, 1000, dtype, w_mode, seed=7), 0.1, "gelu")


@exhaustive_unless(lambda n: n == 1025)
@pytest.mark.parametrize("n", [1, 31, 33, 256, 1000, 1025])
def test_row_lengths(n):
    """Rows shorter than a 256-column slice, across slice / group boundaries and not a multiple
    of 256 or 1024."""
    check(make(4, n, torch.float32, "same", seed=n), 0.3, "relu")


def test_float32_output_of_16bit_input():
    """out_dtype other than x's (float32 under autocast)."""
    t = make(3, 100, torch.bfloat16, "fp32", seed=2)
    t["dout"] = t["dout"].float()  # the gradient of a float32 out
    check(t, 0.2, "gelu", out_dtype=torch.float32)


def test_without_stats():
    """need_stats=False: no mean / rstd, the same out and s."""
    t = make(3, 300, torch.float16, "fp32", seed=4)
    out, s, mean, rstd = forward(t, 0.1, SEED, "relu")
    out2, s2, mean2, rstd2 = forward(t, 0.1, SEED, "relu", need_stats=False)
    assert mean2 is None and rstd2 is None
    assert torch.equal(out, out2) and torch.equal(s, s2)


# --------------------------------------------------------------------------- the dropout mask


@exhaustive_unless(lambda p: p == 0.5)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_forward_and_backward_masks_are_the_reference_mask(p):
    """The forward zeroes exactly the elements keep_mask drops; the backward regenerates the same
    mask: with dout = 1, no activation, db = Σ_rows keep / (1 - p) (exact at p = 0.5) and
    nothing flows through a dropped element (dweight's terms there are zero)."""
    m, n = 6, 1100
    t = make(m, n, torch.float32, "none", residual=False, ds=False, seed=3)
    keep = _philox.keep_mask(SEED, m, n, p, _dev())
    out, _, mean, rstd = forward(t, p, SEED, None)
    assert torch.equal(out != 0, keep)
    t["dout"] = torch.ones_like(t["x"])
    _, dw, db = backward(t, None, mean, rstd, p, SEED, None)
    expected_db = keep.to(torch.float64).sum(0) / (1 - p)
    if p == 0.5:
        assert torch.equal(db.double(), expected_db)
    assert_close_to_ref(db, expected_db, torch.float32)
    xhat = (t["x"].double() - mean.double()[:, None]) * rstd.double()[:, None]
    assert_close_to_ref(dw, (xhat * keep / (1 - p)).sum(0), torch.float32, GRAD_SCALE)


def test_relu_after_dropout_zero_pattern():
    """Dropout then ReLU: out is nonzero exactly where the element is kept and the normalised
    value positive."""
    m, n = 4, 600
    t = make(m, n, torch.float32, "fp32", seed=5)
    keep = _philox.keep_mask(SEED, m, n, 0.25, _dev())
    y64 = oracle(t, 0.0, SEED, None)[0]
    out = forward(t, 0.25, SEED, "relu")[0]
    assert not out[~keep].any()
    clear = y64.abs() > 1e-4  # (float32 and float64 agree on the sign there)
    assert clear.float().mean() > 0.99
    assert torch.equal((out != 0)[clear], (keep & (y64 > 0))[clear])


def test_seed_changes_mask_deterministically():
    """Same seed: the same bits; another seed: another mask (both the reference's)."""
    t = make(3, 500, torch.bfloat16, "same", seed=6)
    a = forward(t, 0.5, 11, None)[0]
    assert torch.equal(a, forward(t, 0.5, 11, None)[0])
    b = forward(t, 0.5, 11 + 2**40, None)[0]
    assert torch.equal(b != 0, _philox.keep_mask(11 + 2**40, 3, 500, 0.5, _dev()))
    assert not torch.equal(a != 0, b != 0)


# --------------------------------------------------------------------------- backward options


@pytest.mark.parametrize("need", [(True, False, False), (False, True, False),
                                  (False, False, True), (False, True, True),
                                  (False, False, False)])
# (the parameter gradients alone on long rows; the others exhaustive)
@exhaustive_unless(lambda need, looped: (need, looped) == ((False, True, True), True))
@pytest.mark.parametrize("looped", [False, True], ids=["single", "long-rows"])
def test_need_combinations(need, looped, monkeypatch, launch_rules):
    if looped:
        launch_rules("layernorm_epilogue", BWD_MAX_BLOCK_EPILOGUE=16)
    t = make(5, 300, torch.float16, "fp32", seed=8)
    _, s, mean, rstd = forward(t, 0.1, SEED, "gelu")
    _, _, _, dx64, dw64, db64 = oracle(t, 0.1, SEED, "gelu", s)
    dx, dw, db = backward(t, s, mean, rstd, 0.1, SEED, "gelu", need)
    for got, want, needed in ((dx, dx64, need[0]), (dw, dw64, need[1]), (db, db64, need[2])):
        assert (got is not None) == needed
        if needed:
            assert_close_to_ref(got, want, torch.float16, GRAD_SCALE)


def test_ds_added_once():
    """dx = LayerNorm backward + ds, rounded once (bf16): ds given and None."""
    t = make(4, 700, torch.bfloat16, "fp32", seed=9)
    check(t, 0.1, "relu")
    t["ds"] = None
    check(t, 0.1, "relu")


# --------------------------------------------------------------------------- layouts, shapes


@exhaustive_unless(lambda looped: not looped)  # (the looped kernels' strides: exhaustive)
@pytest.mark.parametrize("looped", [False, True], ids=["single", "looped"])
def test_row_strides(looped, monkeypatch, launch_rules):
    """x, residual, dout and ds as column slices of wider tensors (different row strides), s as
    one too, and an expanded dout (row stride 0)."""
    if looped:
        launch_rules("layernorm_epilogue", FWD_MAX_BLOCK_DROPOUT=256)
        launch_rules("layernorm_epilogue", BWD_MAX_BLOCK_EPILOGUE=256)
    m, n = 4, 300
    wide = make(m, n + 40, torch.bfloat16, "fp32", seed=10)
    t = {
        "x": wide["x"][:, :n], "residual": wide["residual"][:, 8:8 + n],
        "weight": wide["weight"][:n].contiguous(), "bias": wide["bias"][:n].contiguous(),
        "dout": wide["dout"][:, 40:], "ds": wide["ds"][:, 16:16 + n],
    }
    assert t["x"].stride(0) == n + 40 and not t["dout"].is_contiguous()
    _, s, mean, rstd = check(t, 0.1, "gelu")
    # s itself as a row-strided view (the backward's input without a residual)
    s_wide = torch.zeros(m, n + 24, dtype=s.dtype, device=s.device)
    s_wide[:, 24:] = s
    t2 = dict(t, residual=None, x=s_wide[:, 24:])
    check(t2, 0.1, "gelu")
    # an expanded gradient (row stride 0), as the ops layer passes one through
    t3 = dict(t, dout=t["dout"][:1].expand(m, n), ds=None)
    assert t3["dout"].stride(0) == 0
    check(t3, 0.1, "gelu")


@pytest.mark.parametrize("m, n", [(0, 33), (3, 0), (0, 0)])
def test_empty(m, n):
    t = make(m, n, torch.bfloat16, "fp32")
    out, s, mean, rstd = forward(t, 0.1, SEED, "relu")
    assert out.shape == s.shape == (m, n) and mean.shape == rstd.shape == (m,)
    assert mean.dtype == torch.float32 and (m == 0 or bool(rstd.isnan().all()))
    dx, dw, db = backward(t, s, mean, rstd, 0.1, SEED, "relu")
    assert dx.shape == (m, n) and dx.dtype == torch.bfloat16
    assert dw.shape == db.shape == (n,) and not dw.any() and not db.any()


def test_bad_arguments():
    t = make(2, 8, torch.float32)
    with pytest.raises(ValueError, match="activation"):
        forward(t, 0.1, SEED, "tanh")
    with pytest.raises(ValueError, match="dropout_p"):
        forward(t, 1.0, SEED, None)
    with pytest.raises(ValueError, match="column stride"):
        forward(dict(t, x=t["x"].t().contiguous().t(), residual=None), 0.1, SEED, None)
    with pytest.raises(ValueError, match="residual"):
        forward(dict(t, residual=t["residual"].half()), 0.1, SEED, None)


# --------------------------------------------------------------------------- kernel variants


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def test_launch_rules():
    """Invariants of the epilogue kernels' launch rules: the single-block caps are powers of two
    within the project's single-block limit (and shrink with it), dropout's cap no larger
    than the plain one (its per-element Philox registers); every single-block plan up to its
    cap is valid for the kernels (power-of-two rows per tile and warps, at least one element
    per thread, a software pipeline of 1-3 stages); without dropout or activation the
    backward takes LayerNorm's fused-backward configuration for its rows (what it is, plus a
    read of ds); the Philox column tiles cover the padded row exactly."""

    for dropout in (False, True):
        cap = le_rules.fwd_cap(dropout)
        assert _pow2(cap) and cap <= le_rules.single_block_limit()
        for act in (0, 1, 2):
            cap = le_rules.bwd_cap(dropout, act)
            assert _pow2(cap) and cap <= le_rules.single_block_limit()
    assert le_rules.fwd_cap(True) <= le_rules.fwd_cap(False)
    with configs.override(SINGLE_BLOCK_LIMIT=1024):
        assert le_rules.fwd_cap(False) <= 1024 and le_rules.bwd_cap(True, 2) <= 1024
    for elt in (2, 4):
        for dropout in (False, True):
            for k in range(0, le_rules.fwd_cap(dropout).bit_length()):
                block = 1 << k
                for has_res in (False, True):
                    rows, warps, per_sm, stages = le_rules.fwd_plan(block, elt, dropout, has_res)
                    assert _pow2(rows) and _pow2(warps) and warps <= 32
                    assert per_sm is None or per_sm >= 1
                    assert stages is None or 1 <= stages <= 3
            for act in (0, 1, 2):
                for k in range(0, le_rules.bwd_cap(dropout, act).bit_length()):
                    block = 1 << k
                    for strides in ((block, block), (block, block, block)):
                        rows, warps, per_sm, acc_1d, paired, stages = le_rules.bwd_plan(
                            block, elt, dropout, act, strides)
                        assert _pow2(rows) and _pow2(warps) and 4 <= warps <= 32
                        assert per_sm >= 1 and 1 <= stages <= 3
                        assert isinstance(acc_1d, bool) and isinstance(paired, bool)
                        if block >= 32 * warps:
                            assert rows * block >= 32 * warps
                        if not dropout and not act and block < 4096:
                            assert (rows, warps, per_sm, acc_1d) == \
                                ln_rules.fused_bwd_config(block, False, elt)
    # The column tiles: col = g * 1024 + q * 256 + i covers the padded row exactly.
    for block in (1, 64, 256, 512, 1024, 4096, 8192):
        g, q, i = tphilox.column_tile(block)
        cols = {gg * 1024 + qq * 256 + ii for gg in range(g) for qq in range(q) for ii in range(i)}
        assert cols == set(range(block))


@exhaustive_unless(one_of_each({"extra": [0, 1], "p": [0.0, 0.1]}))
@pytest.mark.parametrize("extra", [0, 1], ids=["at-cap", "past-cap"])
@pytest.mark.parametrize("p, act", [(0.0, None), (0.1, "relu")], ids=["plain", "epilogue"])
def test_single_block_caps(monkeypatch, extra, p, act, launch_rules):
    """Rows at each single-block cap and one column past it (the looped forward and the
    long-row backward), caps shrunk to 512 (plain) / 256 (dropout, activation)."""
    launch_rules("layernorm_epilogue", FWD_MAX_BLOCK=512)
    launch_rules("layernorm_epilogue", BWD_MAX_BLOCK=512)
    launch_rules("layernorm_epilogue", FWD_MAX_BLOCK_DROPOUT=256)
    launch_rules("layernorm_epilogue", BWD_MAX_BLOCK_EPILOGUE=256)
    n = (512 if p == 0 and act is None else 256) + extra
    t = make(3, n, torch.bfloat16, "fp32", seed=n)
    check(t, p, act)


@exhaustive_unless(lambda n, res, p, act, dtype: n < 1100)  # (the rows of 1100: exhaustive)
@pytest.mark.parametrize("n, res, p, act, dtype", [
    (17, True, 0.1, "gelu", torch.float32), (1000, False, 0.5, "relu", torch.bfloat16),
    (1100, True, 0.1, None, torch.float16), (1100, False, 0.0, "gelu", torch.bfloat16),
], ids=["17-res-gelu-fp32", "1000-relu-bf16", "1100-res-fp16", "1100-p0-gelu-bf16"])
def test_looped_kernels(small_single_block, n, res, p, act, dtype):
    """The project's single-block limit at 16 columns: every row through the looped forward
    (chunks of 1024 columns, two per row at 1100) and the long-row backward (row sums, then
    the column kernel)."""
    w_mode = "fp32" if dtype != torch.float32 else "same"
    check(make(2, n, dtype, w_mode, residual=res, seed=n), p, act)


def test_column_kernel_splits(small_single_block):
    """Enough rows that the long-row backward splits them over programs (float32 partials
    summed in a fixed order): close to the oracle, the same bits on every run. (s and the
    statistics from the PyTorch reference: the looped forward is slow in the interpreter.)"""
    t = make(9, 40, torch.bfloat16, "fp32", seed=12)
    _, s, mean, rstd = reference.layernorm_epilogue_forward(
        t["x"], t["residual"], t["weight"], t["bias"], EPS, torch.bfloat16, 0.1, SEED, "relu",
        True)
    _, _, _, dx64, dw64, db64 = oracle(t, 0.1, SEED, "relu", s)
    runs = [backward(t, s, mean, rstd, 0.1, SEED, "relu") for _ in range(2)]
    for got, want in zip(runs[0], (dx64, dw64, db64), strict=True):
        assert_close_to_ref(got, want, torch.bfloat16, GRAD_SCALE)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_deterministic_partials():
    """The single-block backward with several programs (dweight/dbias partials summed in a fixed
    order): close to the oracle, the same bits on every run."""
    t = make(9, 300, torch.float32, "same", seed=11)
    assert 9 > le_rules.BWD_TILE // 512  # several row tiles: several programs, several partials
    _, s, mean, rstd = forward(t, 0.1, SEED, "gelu")
    _, _, _, dx64, dw64, db64 = oracle(t, 0.1, SEED, "gelu", s)
    runs = [backward(t, s, mean, rstd, 0.1, SEED, "gelu") for _ in range(2)]
    for got, want in zip(runs[0], (dx64, dw64, db64), strict=True):
        assert_close_to_ref(got, want, torch.float32, GRAD_SCALE)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


# --------------------------------------------------------------------------- GPU (compiled)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n", [(4096, 768), (4096, 1024), (2048, 4096), (1024, 4097),
                                  (1024, 8192), (512, 8193), (256, 16384), (128, 16385),
                                  (64, 32768), (3000, 1000), (1001, 2048), (999, 4000)])
@pytest.mark.parametrize("dtype, w_mode", [(torch.bfloat16, "fp32"), (torch.float16, "same"),
                                           (torch.float32, "none")],
                         ids=["bf16-fp32w", "fp16", "fp32-now"])
@pytest.mark.parametrize("p, act", [(0.0, None), (0.1, "relu"), (0.2, "gelu")])
def test_gpu_large(m, n, dtype, w_mode, p, act):
    t = make(m, n, dtype, w_mode, seed=m + n)
    t = {k: None if v is None else v.cuda() for k, v in t.items()}
    check(t, p, act)


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_gpu_keep_fraction(p):
    """The fraction kept is 1 - p (within 6 standard deviations over 2^24 elements), and the
    kept values are scaled by 1 / (1 - p)."""
    m, n = 4096, 4096
    x = torch.randn(m, n, device="cuda")
    out = tb.layernorm_epilogue_forward(x, None, None, None, EPS, x.dtype, p, SEED, None,
                                        False)[0]
    kept = (out != 0).double().mean().item()
    assert abs(kept - (1 - p)) < 6 * ((p * (1 - p)) / (m * n)) ** 0.5
    y = F.layer_norm(x, (n,), eps=EPS)
    keep = out != 0
    torch.testing.assert_close(out[keep], y[keep] / (1 - p), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n", [(4096, 4096), (64, 32768)])
def test_gpu_deterministic(m, n):
    t = make(m, n, torch.bfloat16, "fp32", seed=1)
    t = {k: None if v is None else v.cuda() for k, v in t.items()}
    _, s, mean, rstd = forward(t, 0.1, SEED, "relu")
    first = backward(t, s, mean, rstd, 0.1, SEED, "relu")
    for _ in range(3):
        again = backward(t, s, mean, rstd, 0.1, SEED, "relu")
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
