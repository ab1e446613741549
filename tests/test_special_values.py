"""Special values: NaN / +inf / -inf appear exactly where PyTorch puts them, forward and backward.

Each case builds rows of non-finite or extreme values (all -inf, masked prefixes, +inf, NaN,
fp16's 65504, subnormal inputs and outputs, a mean of 1e4 with a small spread, constant rows
with ``eps=0``), runs the fused op and PyTorch's own op on the same dtype and device, and checks

* the NaN, +inf and -inf masks of the output and of every gradient are identical to torch's;
* every position where torch is finite is within the shared tolerance (conftest.TOLERANCES) of
  the float64 oracle.

Targets (tests/_reliability.py): the PyTorch reference on CPU, the Triton kernels through the
interpreter on CPU (single-block and looped variants), and the compiled kernels on CUDA
(``gpu`` marker), plus CUDA-only rows long enough for the split-row and looped kernels.
``test_softmax.py`` / ``test_layernorm.py`` cover the forward of a few of these rows; this file
adds the gradients, the masks and the remaining kinds of values.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from _reliability import (
    DTYPES,
    INF,
    NAN,
    assert_finite_close,
    assert_same_nonfinite,
    enter_target,
    gpu,
    target_params,
)
from conftest import exhaustive_unless, one_of_each

from fusedops import fused_layernorm, fused_softmax

N = 37  # not a power of two; three chunks of 16 in the looped variant


@pytest.fixture(params=target_params())
def target(request):
    with warnings.catch_warnings():
        # numpy (under the interpreter) warns on inf - inf; the NaN it produces is the point.
        warnings.filterwarnings("ignore", category=RuntimeWarning)
        with enter_target(request.param) as device:
            yield device


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _subnormal(dtype: torch.dtype) -> float:
    """A magnitude well inside ``dtype``'s subnormal range."""
    return torch.finfo(dtype).tiny / 8


# --------------------------------------------------------------------------- softmax


def softmax_rows(dtype: torch.dtype, n: int = N) -> tuple[torch.Tensor, list[str]]:
    """(rows, names): one row per kind of special value, built in float32 then cast."""
    g = _gen(0)
    fmax = torch.finfo(dtype).max

    def r() -> torch.Tensor:
        return torch.randn(n, generator=g) * 3

    rows: dict[str, torch.Tensor] = {}
    rows["all_neg_inf"] = torch.full((n,), -INF)
    t = r()
    t[: n - 5] = -INF  # only the last chunk alive (looped: a -inf running max rescaled)
    rows["masked_prefix"] = t
    t = r()
    t[::2] = -INF
    rows["masked_every_other"] = t
    t = r()
    t[n // 2] = INF
    rows["one_pos_inf"] = t
    t = r()
    t[3] = t[n - 1] = INF
    rows["two_pos_inf"] = t
    t = r()
    t[20] = NAN  # (NaNs where a lane's running max is still -inf: test_softmax_nan_lane_...)
    rows["nan"] = t
    t = r()
    t[0], t[1], t[2] = NAN, INF, -INF
    rows["nan_and_infs"] = t
    t = r()
    t[0], t[1], t[n - 1] = fmax, -fmax, fmax  # logits at the dtype's extremes (fp16: 65504)
    rows["extremes"] = t
    rows["all_max"] = torch.full((n,), fmax)
    rows["all_lowest"] = torch.full((n,), -fmax)
    t = torch.randn(n, generator=g) * _subnormal(dtype)
    t[0] = 0.0
    rows["subnormal_inputs"] = t
    # exp() of the tail lands in the dtype's subnormal range (fp16 below 6.1e-5, else 1.2e-38).
    depth = 16.0 if dtype == torch.float16 else 100.0
    rows["subnormal_outputs"] = torch.linspace(0.0, -depth, n)
    rows["control"] = r()
    return torch.stack(list(rows.values())).to(dtype), list(rows)


def _softmax_oracle(x: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype | None = None):
    """float64 (y, dx) of torch.softmax(x.to(dtype)) on CPU."""
    xin = x.detach().cpu()
    if dtype is not None:
        xin = xin.to(dtype)
    x64 = xin.double().requires_grad_(True)
    y64 = torch.softmax(x64, -1)
    (dx64,) = torch.autograd.grad(y64, x64, dy.detach().cpu().double())
    return y64.detach(), dx64


def _softmax_both(x: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype | None = None):
    """(y, dx) of the fused op and of torch's op, same input, dtype and device."""
    out = []
    for fn in (fused_softmax, torch.softmax):
        leaf = x.detach().clone().requires_grad_(True)
        y = fn(leaf, -1, dtype=dtype)
        y.backward(dy)
        out.append((y.detach(), leaf.grad))
    return out


def check_softmax_special(x: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype | None = None):
    (y, dx), (yt, dxt) = _softmax_both(x, dy, dtype)
    assert y.dtype == yt.dtype and dx.dtype == dxt.dtype == x.dtype
    y64, dx64 = _softmax_oracle(x, dy, dtype)
    out_dtype = dtype or x.dtype
    assert_same_nonfinite(y, yt, "softmax forward")
    assert_finite_close(y, y64, torch.isfinite(yt.cpu()), out_dtype, 1.0, "softmax forward")
    assert_same_nonfinite(dx, dxt, "softmax backward")
    grad_key = max((x.dtype, out_dtype), key=lambda d: torch.finfo(d).eps)
    assert_finite_close(dx, dx64, torch.isfinite(dxt.cpu()), grad_key, 4.0, "softmax backward")


# (the kernels: float32 single-block and bfloat16 looped by default; the others exhaustive)
@exhaustive_unless(lambda target, dtype: target[0] == "reference"
                   or (target[2], dtype) in (("single", torch.float32), ("looped", torch.bfloat16)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_special_rows(target, dtype):
    x, names = softmax_rows(dtype)
    x = x.to(target)
    dy = torch.randn(x.shape, generator=_gen(1)).to(dtype).to(target)
    check_softmax_special(x, dy)
    # The NaN rows are exactly the rows torch makes NaN (guards the oracle itself).
    nan_rows = {names[i] for i in torch.isnan(fused_softmax(x, -1)).all(-1).nonzero().flatten()}
    assert nan_rows == {"all_neg_inf", "one_pos_inf", "two_pos_inf", "nan", "nan_and_infs"}


# (the looped kernels: exhaustive)
@exhaustive_unless(lambda target, dtype: target[2] == "single")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_softmax_special_rows_float32_output(target, dtype):
    """dtype=float32 on half input: the kernel reads fp16/bf16 and writes float32 (no cast)."""
    x, _ = softmax_rows(dtype)
    x = x.to(target)
    dy = torch.randn(x.shape, generator=_gen(2)).to(target)
    check_softmax_special(x, dy, dtype=torch.float32)


# (float32 on the single-block kernel by default; the others exhaustive)
@exhaustive_unless(lambda target, dtype: target[0] == "reference"
                   or (target[2], dtype) == ("single", torch.float32))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softmax_nonfinite_grad_output(target, dtype):
    """NaN / inf in the incoming gradient: dx = y * (dy - <dy, y>) poisons exactly the rows
    torch's backward poisons (an inf at a masked position gives 0 * inf = NaN, as in torch)."""
    g = _gen(3)
    x = torch.randn(5, N, generator=g) * 2
    x[1, :10] = -INF
    x[2, :10] = -INF
    dy = torch.randn(5, N, generator=g)
    dy[0, 7] = NAN
    dy[1, 3] = INF  # at a masked (y = 0) position
    dy[2, 20] = -INF  # at a live position
    check_softmax_special(x.to(dtype).to(target), dy.to(dtype).to(target))


def test_softmax_fp16_extremes_gradients(target):
    """fp16 logits at +-65504 with gradients: row max subtraction must not overflow, and the
    gradient rows are finite exactly where torch's are."""
    fmax = torch.finfo(torch.float16).max
    x = torch.tensor([[fmax, fmax, -fmax, 0.0], [-fmax, -fmax, -fmax, -fmax],
                      [fmax, -fmax, 1.0, -1.0], [fmax * 0.5, fmax, fmax * 0.75, fmax]])
    x = x.to(torch.float16).to(target)
    dy = torch.tensor([[1.0, -1.0, 0.5, 2.0]]).expand(4, 4).to(torch.float16).to(target)
    check_softmax_special(x, dy)
    (y, dx), _ = _softmax_both(x, dy)
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()


def _nan_lane_rows(n: int, chunk: int) -> torch.Tensor:
    """NaNs in lanes whose running max is still -inf when the NaN arrives."""
    g = _gen(14)
    x = torch.randn(4, n, generator=g)
    x[0, 0] = NAN  # first element of the row (first chunk)
    x[1, : chunk + 5] = -INF  # a masked prefix, then a NaN in the next chunk's same lane
    x[1, chunk + 5] = NAN
    x[2, :chunk] = -INF  # a chunk of -inf and one NaN
    x[2, 3] = NAN
    x[3] = NAN
    return x


# (bfloat16 on the looped kernels by default; the others exhaustive)
@exhaustive_unless(lambda target, dtype: target[0] == "reference"
                   or (target[2], dtype) == ("looped", torch.bfloat16))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softmax_nan_lane_with_neg_inf_running_max(target, dtype):
    """Any NaN in a row makes the whole softmax row NaN (torch), also when the NaN comes first
    in its lane or after -inf values only (the looped kernel's running max is still -inf there,
    and tl.maximum ignores NaN), or shares a chunk with -inf values only (split rows)."""
    x = _nan_lane_rows(N, 16).to(dtype).to(target)
    dy = torch.randn(x.shape, generator=_gen(15)).to(dtype).to(target)
    check_softmax_special(x, dy)
    assert torch.isnan(fused_softmax(x, -1)).all()


# --------------------------------------------------------------------------- layernorm

FINITE_ROWS = ("extremes", "subnormal", "constant", "control")
NONFINITE_ROWS = ("pos_inf", "neg_inf", "nan", "all_pos_inf", "pos_and_neg_inf", "control")


def layernorm_rows(dtype: torch.dtype, names: tuple[str, ...], n: int = N) -> torch.Tensor:
    g = _gen(4)
    # Large but whose float32 variance does not overflow: fp16's max, or 1e18.
    big = min(torch.finfo(dtype).max, 1e18)
    rows = []
    for name in names:
        t = torch.randn(n, generator=g) * 2 + 0.5
        if name == "pos_inf":
            t[n // 3] = INF
        elif name == "neg_inf":
            t[n - 1] = -INF
        elif name == "nan":
            t[4] = NAN
        elif name == "all_pos_inf":
            t = torch.full((n,), INF)
        elif name == "pos_and_neg_inf":
            t[2], t[30] = INF, -INF
        elif name == "extremes":
            t = t.clamp(-3.0, 3.0) * big / 4
            t[0], t[1] = big, -big
        elif name == "subnormal":
            t = torch.randn(n, generator=g) * _subnormal(dtype)
        elif name == "constant":
            t = torch.full((n,), 2.0)  # exactly representable; the row sum is exact
        rows.append(t)
    return torch.stack(rows).to(dtype)


def _layernorm_run(fn, x, w, b, eps, dy):
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in (x, w, b)]
    y = fn(leaves[0], (x.shape[-1],), leaves[1], leaves[2], eps)
    y.backward(dy)
    return [y.detach()] + [None if t is None else t.grad for t in leaves]


def _layernorm_oracle(x, w, b, eps, dy):
    def to64(t):
        return None if t is None else t.detach().cpu().double()

    return _layernorm_run(F.layer_norm, to64(x), to64(w), to64(b), eps, to64(dy))


def check_layernorm_special(x, w, b, dy, eps=1e-5, dx_kinds=True):
    got = _layernorm_run(fused_layernorm, x, w, b, eps, dy)
    native = _layernorm_run(F.layer_norm, x, w, b, eps, dy)
    ref = _layernorm_oracle(x, w, b, eps, dy)
    rows = x.shape[0]
    for name, a, t, r in zip(("y", "dx", "dweight", "dbias"), got, native, ref, strict=True):
        if t is None:
            assert a is None, name
            continue
        assert a.dtype == t.dtype and a.shape == t.shape, name
        assert_same_nonfinite(a, t, f"layernorm {name}", kinds=dx_kinds or name != "dx")
        # dweight/dbias: float32 sums over rows, compared in the parameters' own dtype
        dtype, scale = (x.dtype, 4.0) if name in ("y", "dx") else (
            a.dtype, 4.0 * (math.sqrt(rows) if a.dtype == torch.float32 else 1.0))
        assert_finite_close(a, r, torch.isfinite(t.cpu()), dtype, scale, f"layernorm {name}")
    return got


_LN_SPECIAL_DIAGONAL = one_of_each({"dtype": DTYPES, "group": ["finite", "nonfinite"],
                                    "affine": [False, True]},
                                   {"dtype": torch.float32},
                                   {"target": ("reference", "cpu", "single")})


# Default run: the reference everywhere, float32 with parameters and a diagonal of the 16-bit
# cases on the looped kernels (the single-block kernels' 16-bit rows: exhaustive).
@exhaustive_unless(lambda target, dtype, group, affine: target[0] == "reference" or (
    _LN_SPECIAL_DIAGONAL(target=target, dtype=dtype, group=group, affine=affine)
    and ((dtype == torch.float32 and affine) or target[2] == "looped")))
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
@pytest.mark.parametrize("group", ["finite", "nonfinite"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layernorm_special_rows(target, dtype, group, affine):
    """Forward, dx, dweight and dbias. A non-finite row makes its y and dx rows NaN and every
    dweight column NaN (its x-hat row is NaN); dbias stays finite (a sum of dy only)."""
    names = FINITE_ROWS if group == "finite" else NONFINITE_ROWS
    x = layernorm_rows(dtype, names).to(target)
    g = _gen(5)
    w = (1 + 0.5 * torch.randn(N, generator=g)).to(dtype).to(target) if affine else None
    b = (0.5 * torch.randn(N, generator=g)).to(dtype).to(target) if affine else None
    dy = torch.randn(x.shape, generator=g).to(dtype).to(target)
    y, dx, dw, db = check_layernorm_special(x, w, b, dy)
    bad = torch.tensor([name != "control" for name in names])
    if group == "nonfinite":
        assert torch.isnan(y.cpu()[bad]).all() and torch.isnan(dx.cpu()[bad]).all()
        assert torch.isfinite(y.cpu()[~bad]).all()
        if affine:
            assert torch.isnan(dw).all() and torch.isfinite(db).all()
    else:
        assert torch.isfinite(y).all() and torch.isfinite(dx).all()
        if affine:  # the constant row: y is the bias, exactly
            const = names.index("constant")
            torch.testing.assert_close(y[const], b, rtol=0, atol=0)


# (bfloat16 on the single-block kernels: exhaustive)
@exhaustive_unless(lambda target, dtype: target[2] == "looped" or dtype == torch.float32
                   or target[0] == "reference")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layernorm_nonfinite_grad_output(target, dtype):
    """NaN / inf in dy: the dweight / dbias columns they touch go NaN / inf exactly as torch's
    do, and the same dx rows become non-finite. (With an infinite dy, torch's dx row is all NaN
    while the fused formula (wdy - (xhat * c1 + c2)) * rstd gives a mix of +-inf and NaN: only
    the non-finite positions are compared for dx.)"""
    g = _gen(6)
    x = (torch.randn(4, N, generator=g) * 2).to(dtype).to(target)
    w = torch.randn(N, generator=g).to(dtype).to(target)
    b = torch.randn(N, generator=g).to(dtype).to(target)
    dy = torch.randn(4, N, generator=g)
    dy[0, 5] = NAN
    dy[2, 11] = INF
    dy[3, 11] = INF  # same column twice: dbias[11] = inf, not NaN
    _, dx, _, _ = check_layernorm_special(x, w, b, dy.to(dtype).to(target), dx_kinds=False)
    assert torch.isnan(dx[0]).all()  # a NaN dy: NaN row, exactly as torch
    assert torch.isfinite(dx[1]).all()


def test_layernorm_eps_zero_constant_rows(target):
    """eps=0 and a constant row: variance 0, rstd = inf and 0 * inf = NaN, as in torch; the
    other rows are unaffected."""
    x = torch.stack([torch.full((16,), 2.0), torch.zeros(16), torch.randn(16, generator=_gen(7))])
    x = x.to(target)
    w = torch.linspace(0.5, 1.5, 16).to(target)
    b = torch.linspace(-1.0, 1.0, 16).to(target)
    dy = torch.randn(3, 16, generator=_gen(8)).to(target)
    y, dx, dw, db = check_layernorm_special(x, w, b, dy, eps=0.0)
    assert torch.isnan(y[:2]).all() and torch.isfinite(y[2]).all()
    assert torch.isnan(dx[:2]).all() and torch.isfinite(dx[2]).all()
    assert torch.isnan(dw).all() and torch.isfinite(db).all()


# (the looped kernels on the first draw by default; its other draws exhaustive)
@exhaustive_unless(lambda target, offset, spread: target[2] == "single"
                   or (offset, spread) == (1e4, 1.0))
@pytest.mark.parametrize("offset,spread", [(1e4, 1.0), (1e4, 0.1), (-1e4, 1.0)])
def test_layernorm_large_mean_cancellation(target, offset, spread):
    """Mean 1e4 with a small spread (float32): the variance comes from centred values, so y, dx
    and dweight stay within a few times torch's own float32 error (an E[x^2] - E[x]^2 variance
    would lose every digit and could go negative). Also: finite, and each row of y has mean ~0
    and variance ~1."""
    n = 256
    g = _gen(9)
    x = (offset + spread * torch.randn(4, n, generator=g)).to(target)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(target)
    b = (0.1 * torch.randn(n, generator=g)).to(target)
    dy = torch.randn(4, n, generator=g).to(target)
    got = _layernorm_run(fused_layernorm, x, w, b, 1e-5, dy)
    native = _layernorm_run(F.layer_norm, x, w, b, 1e-5, dy)
    ref = _layernorm_oracle(x, w, b, 1e-5, dy)
    for name, a, t, r in zip(("y", "dx", "dweight", "dbias"), got, native, ref, strict=True):
        assert torch.isfinite(a).all(), name
        err = (a.double().cpu() - r).abs().max().item()
        torch_err = (t.double().cpu() - r).abs().max().item()
        floor = 1e-4 * max(r.abs().max().item(), 1.0)
        assert err <= max(4 * torch_err, floor), (name, err, torch_err)
    xhat = (got[0].double().cpu() - b.double().cpu()) / w.double().cpu()
    torch.testing.assert_close(xhat.mean(-1), torch.zeros(4, dtype=torch.float64), atol=2e-2,
                               rtol=0)
    torch.testing.assert_close(xhat.var(-1, unbiased=False), torch.ones(4, dtype=torch.float64),
                               atol=5e-2, rtol=0)


# --------------------------------------------------------------------------- CUDA: long rows


PIECE = 8192  # the split-row kernels' piece length (at most; rows are cut into equal pieces)


def _long_softmax_rows(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = _gen(10)
    x = torch.randn(6, n, generator=g) * 3
    x[0] = -INF
    x[1, : n - 7] = -INF  # every chunk but the last fully masked
    x[2, PIECE + 3] = INF  # +inf in the second piece
    x[3, n - 1] = NAN  # NaN in the last chunk
    x[4, ::2] = -INF
    return x.to(dtype)


def _looped_only_at_70000(launch_rules, n: int) -> None:
    """Rows of 70000 run the looped kernels (split rows, which take any long row on CUDA, off)."""
    if n == 70000:
        launch_rules(SPLIT_ROWS=False)


@gpu
@pytest.mark.parametrize("n", [2 * 16384, 6 * 16384 + 5, 70000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_long_rows_special_values(launch_rules, n, dtype):
    """Rows spanning several chunks: split-row kernels (2 x 16384, 6 x 16384 + 5) and the
    looped kernels (70000, split rows turned off: they would take it), for softmax and
    LayerNorm, forward and backward."""
    _looped_only_at_70000(launch_rules, n)
    x = _long_softmax_rows(n, dtype).cuda()
    dy = torch.randn(x.shape, generator=_gen(11)).to(dtype).cuda()
    check_softmax_special(x, dy)
    xl = x.clone()
    xl[0] = torch.randn(n, generator=_gen(12)).to(dtype)  # LayerNorm of an all -inf row: NaN
    w = torch.randn(n, generator=_gen(13)).to(dtype).cuda()
    check_layernorm_special(xl, w, None, dy)


@gpu
@pytest.mark.parametrize("n", [2 * 16384, 6 * 16384 + 5, 70000])
def test_gpu_long_rows_nan_in_masked_chunk(launch_rules, n):
    """NaNs where the running max is -inf, in rows long enough for the split-row (2 x 16384,
    6 x 16384 + 5) and looped (70000) kernels: the rows are NaN, as in torch."""
    _looped_only_at_70000(launch_rules, n)
    x = _nan_lane_rows(n, PIECE).cuda()
    dy = torch.randn(x.shape, generator=_gen(16)).cuda()
    check_softmax_special(x, dy)
