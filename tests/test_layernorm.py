"""fused_layernorm / LayerNormFunction against a float64 PyTorch oracle (reference and Triton).

Every case checks the forward output and each gradient that is asked for (dx, dweight, dbias).
The Triton path runs through the interpreter on CPU, so tensors stay small.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    TOLERANCES,
    assert_close_to_ref,
    assert_row_sum_close,
    exhaustive_unless,
    one_of_each,
    single_block_limits,
)

from fusedops import LayerNormFunction, fused_layernorm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INF, NAN = float("inf"), float("nan")


# Tensors are created on the GPU when there is one (conftest's _tensors_on_device).
ON_DEVICE = True

# Every kernel-variant boundary, including the forward and backward single-block limits (they
# may differ) and one above each (the looped kernels).
LIMITS = single_block_limits("ln_fwd", "ln_bwd")
SIZES = [1, 31, 32, 33, 1000, 1024, 1025] + [n for lim in LIMITS for n in (lim, lim + 1)]
LOOPED_SIZES = [17, 32, 33, 100, 161]


def rows_for(n: int) -> int:
    return 5 if n <= 1025 else 2


def make_params(shape, dtype, weight=True, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)  # CPU generator: same values on every device
    w = (1 + 0.5 * torch.randn(shape, generator=g, device="cpu")).to(dtype) if weight else None
    b = (0.5 * torch.randn(shape, generator=g, device="cpu")).to(dtype) if bias else None
    dev = torch.empty(0).device
    return (None if w is None else w.to(dev)), (None if b is None else b.to(dev))


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(True)


def ref_layernorm(x, shape, w, b, eps, dy):
    """float64 oracle: y and the gradients (dx, dw, db) of F.layer_norm in float64."""
    x64 = x.detach().double().requires_grad_(True)
    w64 = None if w is None else w.detach().double().requires_grad_(True)
    b64 = None if b is None else b.detach().double().requires_grad_(True)
    y64 = F.layer_norm(x64, shape, w64, b64, eps)
    inputs = [t for t in (x64, w64, b64) if t is not None]
    grads = torch.autograd.grad(y64, inputs, dy.double())
    it = iter(grads)
    dx = next(it)
    dw = next(it) if w is not None else None
    db = next(it) if b is not None else None
    return y64.detach(), dx, dw, db


def check(x, shape, w=None, b=None, eps=1e-5, dy=None, need=(True, True, True),
          grad_scale=4.0):
    """Forward and all requested gradients of fused_layernorm against the float64 oracle."""
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(shape)
    if dy is None:
        dy = torch.randn(x.shape).to(x.dtype)
    xl = x.detach().clone().requires_grad_(need[0])
    wl = None if w is None else w.detach().clone().requires_grad_(need[1])
    bl = None if b is None else b.detach().clone().requires_grad_(need[2])
    y = fused_layernorm(xl, shape, wl, bl, eps)
    assert y.dtype == x.dtype  # torch's rule: the output follows the input
    assert y.shape == x.shape
    y64, dx64, dw64, db64 = ref_layernorm(x, shape, w, b, eps, dy)
    assert_close_to_ref(y, y64, x.dtype)
    if not y.requires_grad:
        return y
    y.backward(dy)
    rows = max(x.numel() // max(math.prod(shape), 1), 1)
    if need[0]:
        assert xl.grad.dtype == x.dtype and xl.grad.shape == x.shape
        assert_close_to_ref(xl.grad, dx64, x.dtype, scale=grad_scale)
    else:
        assert xl.grad is None
    for leaf, ref, wanted in ((wl, dw64, need[1]), (bl, db64, need[2])):
        if leaf is None:
            continue
        if not wanted:
            assert leaf.grad is None
            continue
        assert leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape
        # A float32 sum over rows, compared in the parameter's own dtype (not x's).
        assert_row_sum_close(leaf.grad, ref, rows, scale=grad_scale)
    return y


# --------------------------------------------------------------------------- sizes and dtypes


# Default run: the reference at every size and dtype, the Triton kernels on rows of 1, 31, 33
# and 1025 in float32. (The other sizes, the rows at and past the single-block limits and the
# 16-bit dtypes: exhaustive; the looped kernels run by default in test_looped_path, the 16-bit
# rows in test_half_input_float32_params.)
@exhaustive_unless(lambda backend, n, dtype: backend == "reference"
                   or (dtype == torch.float32 and n in (1, 31, 33, 1025)))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sizes(backend, n, dtype):
    torch.manual_seed(n)
    x = (torch.randn(rows_for(n), n) * 2 + 0.5).to(dtype)
    w, b = make_params(n, dtype, seed=n)
    check(x, n, w, b)


# (the kernels on the diagonal: every row count and every row length once; the reference on
# all)
@exhaustive_unless(one_of_each({"m": [1, 2, 3, 7, 13, 64], "n": [1, 5, 32, 33]},
                               {"backend": "reference"}))
@pytest.mark.parametrize("m", [1, 2, 3, 7, 13, 64])
@pytest.mark.parametrize("n", [1, 5, 32, 33])
def test_row_count_tails(backend, m, n):
    """Short rows are packed several per program and dweight/dbias are reduced from per-program
    partials: every row count must be handled."""
    torch.manual_seed(m * 100 + n)
    check(torch.randn(m, n), n, *make_params(n, torch.float32, seed=m))


# (float32 rows of 17 by default; the other rows and dtypes exhaustive)
@exhaustive_unless(one_of_each({"n": LOOPED_SIZES, "dtype": DTYPES},
                               where=lambda n, dtype: n == 17))
@pytest.mark.parametrize("n", LOOPED_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_looped_path(triton_backend, small_single_block, n, dtype):
    """Rows longer than one block: Welford forward, two-pass dx, column-blocked dweight/dbias."""
    torch.manual_seed(n)
    x = (torch.randn(5, n) * 2 + 0.5).to(dtype)
    check(x, n, *make_params(n, dtype, seed=n))
    check(x, n, *make_params(n, torch.float32, seed=n))
    check(x, n, need=(True, False, False))


@exhaustive_unless(lambda affine: affine == "weight")  # (no weight, or a bias alone: exhaustive)
@pytest.mark.parametrize("affine", ["none", "weight", "bias"])
def test_looped_path_affine(triton_backend, small_single_block, affine):
    w, b = make_params(70, torch.float32, weight=affine == "weight", bias=affine == "bias")
    check(torch.randn(4, 70), 70, w, b)
    check(torch.randn(4, 70), 70, w, b, need=(False, True, True))


def test_looped_path_strides_and_rows(triton_backend, small_single_block):
    w, b = make_params(100, torch.float32)
    wide = torch.randn(4, 150)
    check(wide[:, 7:107], 100, w, b)  # row stride 150, storage offset 7
    check(torch.randn(3, 100), 100, w, b, dy=torch.randn(1, 100).expand(3, 100))
    check(torch.randn(1, 100).expand(3, 100), 100, w, b)  # x row stride 0
    check(torch.randn(37, 40), 40, *make_params(40, torch.float32))  # many row splits


def test_looped_path_numerics(triton_backend, small_single_block):
    """Welford merging across lanes and chunks on a large mean / small variance, constant rows,
    and special values, against torch."""
    torch.manual_seed(1)
    x = 300.0 + torch.randn(3, 100)
    y64 = F.layer_norm(x.double(), (100,))
    torch_err = (F.layer_norm(x, (100,)).double() - y64).abs().max().item()
    err = (fused_layernorm(x, 100).double() - y64).abs().max().item()
    assert err <= max(4 * torch_err, 1e-5), (err, torch_err)
    check(torch.stack([torch.full((100,), 2.5), torch.zeros(100)]), 100)
    s = torch.randn(4, 100)
    s[0, 50] = INF
    s[1, 3] = NAN
    s[2, 99] = -INF
    torch.testing.assert_close(fused_layernorm(s, 100), F.layer_norm(s, (100,)), equal_nan=True,
                               atol=1e-5, rtol=1e-5)


# (the kernels in float32; the 16-bit dtypes: exhaustive)
@exhaustive_unless(lambda backend, affine, dtype: backend == "reference" or dtype == torch.float32)
@pytest.mark.parametrize("affine", ["none", "weight", "bias", "both"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_affine_variants(backend, affine, dtype):
    n = 40
    x = torch.randn(6, n).to(dtype)
    w, b = make_params(n, dtype, weight=affine in ("weight", "both"),
                       bias=affine in ("bias", "both"))
    check(x, n, w, b)


@pytest.mark.parametrize(
    "need",
    [(True, False, False), (False, True, False), (False, False, True), (False, True, True),
     (True, True, False), (False, False, False)],
    ids=lambda t: "".join("xwb"[i] for i, v in enumerate(t) if v) or "none",
)
def test_requires_grad_subsets(backend, need):
    torch.manual_seed(1)
    x = torch.randn(5, 33)
    check(x, 33, *make_params(33, torch.float32), need=need)


@exhaustive_unless(lambda backend, x_dtype, n: backend == "reference"
                   or (x_dtype, n) == (torch.bfloat16, 33))
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [33, 1025])
def test_half_input_float32_params(backend, x_dtype, n):
    """fp16/bf16 activations with fp32 weight and bias (the usual mixed-precision layout): the
    output keeps the input dtype and dweight/dbias stay float32."""
    torch.manual_seed(n)
    x = torch.randn(4, n).to(x_dtype)
    w, b = make_params(n, torch.float32)
    check(x, n, w, b)  # (torch's own layer_norm rejects mixed dtypes, on CPU and CUDA alike)


def test_float32_input_half_params(backend):
    """Low-precision parameters with a float32 input: output float32, grads in the params' dtype."""
    x = torch.randn(4, 20)
    w, b = make_params(20, torch.bfloat16)
    check(x, 20, w, b)


# --------------------------------------------------------------------------- shapes


# (the kernels on one and three leading dims; the others exhaustive)
@exhaustive_unless(lambda backend, shape: backend == "reference" or len(shape) in (2, 4))
@pytest.mark.parametrize("shape", [(9,), (4, 9), (2, 3, 9), (2, 2, 3, 9)], ids=str)
def test_leading_dims(backend, shape):
    torch.manual_seed(len(shape))
    check(torch.randn(shape), 9, *make_params(9, torch.float32))


# (the kernels with and without parameters on one shape each; the others exhaustive)
@exhaustive_unless(lambda backend, x_shape, ns, affine: backend == "reference"
                   or (x_shape, affine) in (((2, 3, 4), True), ((6, 2, 17), False)))
@pytest.mark.parametrize(
    "x_shape,ns",
    [((3, 4, 5), (4, 5)), ((2, 3, 4), (2, 3, 4)), ((2, 3, 1, 5), (1, 5)), ((6, 2, 17), [2, 17]),
     ((3, 4, 5), torch.Size([5]))],
    ids=str,
)
@pytest.mark.parametrize("affine", [True, False])
def test_multi_dim_normalized_shape(backend, x_shape, ns, affine):
    torch.manual_seed(2)
    x = torch.randn(x_shape)
    w, b = make_params(tuple(ns), torch.float32, weight=affine, bias=affine)
    check(x, tuple(ns), w, b)


def test_normalized_shape_spellings(backend):
    x = torch.randn(3, 4, 5)
    expected = fused_layernorm(x, (4, 5))
    for ns in ([4, 5], torch.Size([4, 5]), x.shape[1:]):
        torch.testing.assert_close(fused_layernorm(x, ns), expected, rtol=0, atol=0)
    torch.testing.assert_close(fused_layernorm(x, 5), fused_layernorm(x, (5,)), rtol=0, atol=0)


@pytest.mark.parametrize("x_shape,ns", [((0, 8), 8), ((2, 0, 8), 8), ((3, 0), 0), ((0,), 0)],
                         ids=str)
def test_empty(backend, x_shape, ns):
    x = torch.randn(x_shape)
    nshape = (ns,) if isinstance(ns, int) else ns
    y = fused_layernorm(x, nshape, torch.ones(nshape), torch.zeros(nshape))
    assert y.shape == x.shape and y.dtype == x.dtype
    assert fused_layernorm(x.half(), nshape).dtype == torch.float16


@pytest.mark.parametrize("x_shape,ns", [((0, 8), 8), ((2, 0, 8), 8), ((3, 0), 0)], ids=str)
def test_empty_backward(backend, x_shape, ns):
    """F.layer_norm on an empty input is differentiable: zero dweight/dbias, empty dx."""
    x = torch.randn(x_shape, requires_grad=True)
    w = torch.randn(ns, requires_grad=True)
    b = torch.randn(ns, requires_grad=True)
    y = fused_layernorm(x, (ns,), w, b)
    assert y.requires_grad
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    torch.testing.assert_close(w.grad, torch.zeros(ns))
    torch.testing.assert_close(b.grad, torch.zeros(ns))


# --------------------------------------------------------------------------- strides


def _strided_inputs(dtype=torch.float32, n=37):
    torch.manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape).to(dtype)

    wide = randn(6, n + 11)
    return {
        "sliced_rows": wide[:, :n],  # row stride n + 11
        "storage_offset": wide[1:5, 3 : 3 + n],
        "every_other_row": wide[::2, :n],
        "transposed": randn(n, 6).t(),
        "column_step": wide[:, ::2][:, :n // 2 + 1][:, :n // 2],
        "expanded_rows": randn(1, n).expand(5, n),  # row stride 0
        "permuted_3d": randn(3, n, 4).permute(0, 2, 1),
    }


# (the kernels on two float32 layouts; the others exhaustive)
@exhaustive_unless(lambda backend, kind, dtype: backend == "reference" or (
    dtype == torch.float32 and kind in ("transposed", "expanded_rows")))
@pytest.mark.parametrize("kind", list(_strided_inputs()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_contiguous_input(backend, kind, dtype):
    x = _strided_inputs(dtype)[kind]
    assert not x.is_contiguous()
    n = x.shape[-1]
    check(x, n, *make_params(n, dtype))


# (the kernels: exhaustive; the launcher's per-specialisation cache is exercised by default in
# test_softmax.py's test_specialisation_changes_between_calls)
@exhaustive_unless(lambda backend: backend == "reference")
def test_specialisation_changes_between_calls(backend):
    """Same row length, different pointer alignment / strides / row counts / affine flags in
    sequence: each call must run the kernel specialised for it."""
    base = torch.randn(9, 80)
    w, b = make_params(64, torch.float32)
    wide_w = torch.randn(70)
    views = [
        base[:4, :64],
        base[1:5, 1:65],
        base.view(-1)[3 : 3 + 4 * 65].view(4, 65)[:, :64],
        base[:1, :64],
        base[:4, 2:66],
    ]
    for x in views + views[::-1]:
        check(x, 64, w, b)
        check(x, 64, wide_w[1:65], None)  # weight pointer off by 4 bytes
        check(x.to(torch.float16), 64, None, b)


def test_input_not_modified(backend):
    wide = torch.randn(4, 20)
    before = wide.clone()
    w, b = make_params(13, torch.float32)
    fused_layernorm(wide[:, 2:15], 13, w, b)
    assert torch.equal(wide, before)


def test_non_contiguous_params(backend):
    wide = torch.randn(2, 40)
    w, b = wide[0, ::2], wide[1, 1::2]
    check(torch.randn(3, 20), 20, w, b)
    w2 = torch.randn(5, 4).t()  # (4, 5) transposed, for a 2-d normalized_shape
    check(torch.randn(3, 4, 5), (4, 5), w2, None)


@pytest.mark.parametrize(
    "make_dy",
    [
        pytest.param(lambda m, n: torch.randn(1, n).expand(m, n), id="row_stride_0"),
        pytest.param(lambda m, n: torch.randn(m, 1).expand(m, n), id="col_stride_0"),
        pytest.param(lambda m, n: torch.tensor(1.5).expand(m, n), id="all_strides_0"),
        pytest.param(lambda m, n: torch.randn(n, m).t(), id="transposed"),
        pytest.param(lambda m, n: torch.randn(m, 2 * n)[:, ::2], id="column_step"),
    ],
)
def test_strided_grad_output(backend, make_dy):
    torch.manual_seed(1)
    check(torch.randn(5, 33), 33, *make_params(33, torch.float32), dy=make_dy(5, 33))


def test_grad_of_sum(backend):
    """``.sum()`` gives an all-zero-stride gradient: dbias is the row count, dweight the column sums
    of x-hat, and without a weight dx is ~0."""
    x = torch.randn(4, 3, 50, requires_grad=True)
    w, b = (p.requires_grad_(True) for p in make_params(50, torch.float32))
    fused_layernorm(x, 50, w, b).sum().backward()
    torch.testing.assert_close(b.grad, torch.full((50,), 12.0))
    xhat = F.layer_norm(x.detach().double(), (50,))
    torch.testing.assert_close(w.grad.double(), xhat.sum((0, 1)), atol=1e-4, rtol=1e-5)
    x.grad = None
    fused_layernorm(x, 50).sum().backward()
    torch.testing.assert_close(x.grad, torch.zeros_like(x), atol=1e-5, rtol=0)
    check(x.detach(), 50, w.detach(), b.detach(), dy=torch.ones(()).expand(4, 3, 50))


# --------------------------------------------------------------------------- eps and numerics


@pytest.mark.parametrize("eps", [0.0, 1e-12, 1e-5, 1e-3, 0.5, 2])
def test_eps(backend, eps):
    """Rows with variance near eps so a wrong eps shows up; int eps is accepted like torch."""
    torch.manual_seed(4)
    x = torch.randn(5, 64) * torch.tensor([1e-3, 1e-2, 0.1, 1.0, 10.0])[:, None]
    check(x, 64, *make_params(64, torch.float32), eps=eps, grad_scale=50.0 if eps == 0 else 4.0)


def test_constant_rows(backend):
    """Zero variance: y = bias exactly (rstd = 1/sqrt(eps)), gradients finite."""
    x = torch.stack([torch.full((16,), 3.0), torch.zeros(16), torch.full((16,), -7.5)])
    w, b = make_params(16, torch.float32)
    y = check(x, 16, w, b)
    torch.testing.assert_close(y.detach(), b.expand(3, 16), rtol=0, atol=1e-6)


@pytest.mark.parametrize("offset", [100.0, 1000.0])
def test_large_mean_small_variance(backend, offset):
    """Mean far from zero: a one-pass E[x^2] - E[x]^2 variance in fp32 loses every digit here.
    The error must stay within a few times that of torch's own float32 layer_norm."""
    torch.manual_seed(5)
    x = offset + torch.randn(4, 512)
    y = fused_layernorm(x, 512)
    y64 = F.layer_norm(x.double(), (512,))
    torch_err = (F.layer_norm(x, (512,)).double() - y64).abs().max().item()
    err = (y.double() - y64).abs().max().item()
    assert err <= max(4 * torch_err, 1e-5), (err, torch_err)


SPECIAL_ROWS = {
    "pos_inf": [1.0, INF, 2.0, 0.0],
    "neg_inf": [1.0, -INF, 2.0, 0.0],
    "nan": [1.0, NAN, 2.0, 0.0],
    "all_inf": [INF, INF, INF, INF],
    "huge": [3.0e38, -3.0e38, 0.0, 1.0],
    "tiny": [1e-30, -1e-30, 0.0, 2e-30],
}


# (the kernels on the diagonal: every row kind and every dtype once; the reference on all)
@exhaustive_unless(one_of_each({"case": list(SPECIAL_ROWS), "dtype": DTYPES},
                               {"backend": "reference"}))
@pytest.mark.parametrize("case", list(SPECIAL_ROWS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values(backend, case, dtype):
    row = torch.tensor(SPECIAL_ROWS[case])
    if case == "huge":
        if dtype != torch.float16:
            pytest.skip("variance overflows float32: see test_statistics_overflow")
        row = torch.tensor([65504.0, -65504.0, 0.0, 1.0])
    x = torch.stack([row, torch.arange(4.0), row.flip(0)]).to(dtype)
    y = fused_layernorm(x, 4)
    expected = F.layer_norm(x, (4,))
    assert y.dtype == expected.dtype
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(y.double(), expected.double(), equal_nan=True, atol=atol * 4,
                               rtol=rtol * 4)


def test_half_extremes(backend):
    """|x| at fp16's max: squares overflow fp16, so the statistics must be fp32."""
    fmax = torch.finfo(torch.float16).max
    x = torch.tensor([[fmax, -fmax, 0.0, 1.0], [fmax, fmax, fmax, fmax], [-fmax, 0, 0, 0]],
                     dtype=torch.float16)
    y = fused_layernorm(x, 4)
    assert torch.isfinite(y).all()
    check(x, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_statistics_overflow(backend, dtype):
    """|x| near float32's max: the float32 variance overflows. PyTorch returns NaN for such rows;
    an answer close to the float64 one is fine too, but never a silent row of zeros."""
    fmax = torch.finfo(dtype).max
    x = torch.tensor([[fmax, -fmax, 0.0, 1.0], [0.0, 1.0, 2.0, 3.0]], dtype=dtype)
    y = fused_layernorm(x, 4).double()
    y64 = F.layer_norm(x.double(), (4,))
    assert torch.isnan(F.layer_norm(x, (4,))[0]).all()  # what torch does
    assert torch.isnan(y[0]).all() or torch.allclose(y[0], y64[0], atol=1e-2), y[0]
    torch.testing.assert_close(y[1], y64[1], **{"atol": 1e-2, "rtol": 1e-2})


# --------------------------------------------------------------------------- gradcheck


@pytest.mark.parametrize(
    "x_shape,ns,affine",
    [((5,), (5,), True), ((3, 7), (7,), True), ((3, 7), (7,), False), ((2, 3, 4), (3, 4), True),
     ((4, 1), (1,), True), ((2, 2, 3), (2, 2, 3), False)],
    ids=str,
)
def test_gradcheck_float64(x_shape, ns, affine):
    """Reference path in float64: gradients of x, weight and bias (float64 never hits a kernel)."""
    torch.manual_seed(6)
    x = torch.randn(x_shape, dtype=torch.float64, requires_grad=True)
    if affine:
        w = torch.randn(ns, dtype=torch.float64, requires_grad=True)
        b = torch.randn(ns, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x, w, b: fused_layernorm(x, ns, w, b), (x, w, b))
        n = math.prod(ns)
        assert torch.autograd.gradcheck(
            lambda x, w, b: LayerNormFunction.apply(x, n, w, b, 1e-5, torch.float64), (x, w, b)
        )
    else:
        assert torch.autograd.gradcheck(lambda x: fused_layernorm(x, ns), (x,))


def test_gradcheck_strided_float64():
    x = torch.randn(4, 12, dtype=torch.float64)[:, 1:9].clone().requires_grad_(True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: fused_layernorm(x.t(), 4, w), (x, w))


@exhaustive_unless(lambda n: n == 3)  # (rows of 33 and 1025: exhaustive)
@pytest.mark.parametrize("n", [3, 33, 1025])
def test_triton_grads_vs_float64(triton_backend, n):
    """gradcheck-like check of the kernels in float32: several random cotangents against the
    float64 oracle with the plain float32 tolerance."""
    torch.manual_seed(n)
    x = torch.randn(3, n)
    w, b = make_params(n, torch.float32)
    for _ in range(3):
        check(x, n, w, b, dy=torch.randn(3, n), grad_scale=1.0)


# --------------------------------------------------------------------------- saved statistics


@exhaustive_unless(lambda backend, dtype: backend == "reference" or dtype != torch.float16)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_saved_stats_are_float32(backend, dtype):
    x = (torch.randn(4, 50) * 3 + 1).to(dtype).requires_grad_(True)
    y = fused_layernorm(x, 50)
    saved = [t for t in y.grad_fn.saved_tensors if t is not None and t.dim() == 1]
    assert len(saved) == 2 and all(t.dtype == torch.float32 for t in saved)
    mean, rstd = saved
    x64 = x.detach().double()
    torch.testing.assert_close(mean.double(), x64.mean(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd.double(), torch.rsqrt(x64.var(-1, unbiased=False) + 1e-5),
                               rtol=1e-5, atol=1e-5)


def test_backend_contract_stats(backend):
    """The row contract directly: (y, mean, rstd) with float32 statistics for a bf16 input."""
    from fusedops import _dispatch

    x2 = torch.randn(6, 24).to(torch.bfloat16)
    impl = _dispatch.backend_for(x2)
    y, mean, rstd = impl.layernorm_forward(x2, None, None, 1e-5, torch.bfloat16)
    assert y.shape == (6, 24) and y.dtype == torch.bfloat16
    assert mean.shape == rstd.shape == (6,)
    assert mean.dtype == rstd.dtype == torch.float32


# --------------------------------------------------------------------------- misc


def test_deterministic_dweight(backend):
    """dweight/dbias come from per-program partials reduced in a fixed order: bitwise stable."""
    torch.manual_seed(7)
    x = torch.randn(100, 40)
    dy = torch.randn(100, 40)
    results = []
    for _ in range(2):
        w, b = (p.requires_grad_(True) for p in make_params(40, torch.float32))
        xl = x.clone().requires_grad_(True)
        fused_layernorm(xl, 40, w, b).backward(dy)
        results.append((xl.grad, w.grad, b.grad))
    for a, c in zip(*results, strict=True):
        assert torch.equal(a, c)


def test_inference_paths_match(backend):
    x = torch.randn(4, 33)
    w, b = make_params(33, torch.float32)
    y_plain = fused_layernorm(x, 33, w, b)
    with torch.no_grad():
        y_nograd = fused_layernorm(x.requires_grad_(True), 33, w, b)
    assert y_nograd.grad_fn is None
    y_grad = fused_layernorm(x, 33, w, b)
    assert y_grad.grad_fn is not None
    assert torch.equal(y_nograd, y_plain) and torch.equal(y_grad.detach(), y_plain)


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("n", [768, 1024, 1500, 2048])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_backward_pipelined(triton_backend, monkeypatch, n, dtype, stages, launch_rules):
    """The fused backward with its tile loop pipelined by Triton (three stages, as shipped for
    aligned 16-bit blocks of 1K-2K; forced here on every dtype and on unaligned rows too) and
    not: enough rows that every program loops over several tiles."""

    launch_rules("layernorm", fused_bwd_stages=lambda *args: stages)
    torch.manual_seed(n + stages)
    x = (torch.randn(3 * 132 * 4 + 5, n) * 2 + 0.5).to(dtype)
    check(x, n, *make_params(n, dtype, seed=n), grad_scale=8.0)
