"""fused_softmax / SoftmaxFunction against a float64 PyTorch oracle (reference and Triton paths).

Every case checks the forward output and the input gradient. The Triton path runs through the
interpreter on CPU (``TRITON_INTERPRET=1``), so tensors stay small: few rows, and large rows only
with one or two of them.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import (
    TOLERANCES,
    assert_close_to_ref,
    exhaustive_unless,
    one_of_each,
    single_block_limits,
)

from fusedops import SoftmaxFunction, fused_softmax

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INF, NAN = float("inf"), float("nan")


# Tensors are created on the GPU when there is one (conftest's _tensors_on_device).
ON_DEVICE = True

# Every kernel-variant boundary: tiny rows, warp-size edges, power-of-2 edges, the single-block
# limit of the forward and backward kernels and one above it (the looped path).
LIMITS = single_block_limits("softmax_fwd", "softmax_bwd")
LIMIT = max(LIMITS)
SIZES = [1, 31, 32, 33, 1000, 1024, 1025] + [n for lim in LIMITS for n in (lim, lim + 1)]
# With the single-block limit shrunk to 16 (fixture small_single_block): rows spanning one
# partial chunk, several chunks, and a chunk plus one element.
LOOPED_SIZES = [17, 32, 33, 100, 161]


def rows_for(n: int) -> int:
    """Keep the interpreter fast: several rows for short rows, one or two for long ones."""
    return 5 if n <= 1025 else 2


def ref_softmax(x: torch.Tensor, dim: int, dy: torch.Tensor | None = None, dtype=None):
    """float64 oracle: (y, dx) of torch.softmax(x, dim, dtype) computed in float64."""
    xin = x.detach()
    if dtype is not None:
        xin = xin.to(dtype)  # torch casts the input first
    x64 = xin.to(torch.float64).requires_grad_(True)
    y64 = torch.softmax(x64, dim)
    if dy is None:
        return y64.detach(), None
    (dx64,) = torch.autograd.grad(y64, x64, dy.to(torch.float64))
    return y64.detach(), dx64


def run_fused(x: torch.Tensor, dim: int, dy: torch.Tensor, dtype=None):
    x = x.detach().clone().requires_grad_(True) if x.is_leaf else x
    y = fused_softmax(x, dim, dtype=dtype)
    y.backward(dy)
    return y.detach(), x.grad


def check(x: torch.Tensor, dim: int = -1, dtype=None, dy: torch.Tensor | None = None,
          grad_scale: float = 4.0):
    """Forward and backward of fused_softmax against the float64 oracle."""
    out_dtype = dtype or x.dtype
    if dy is None:
        dy = torch.randn(x.shape, dtype=torch.float32).to(out_dtype)
    leaf = x.detach().clone().requires_grad_(True)
    y = fused_softmax(leaf, dim, dtype=dtype)
    assert y.dtype == torch.softmax(x.detach(), dim, dtype=dtype).dtype
    assert y.shape == x.shape
    y.backward(dy)
    y64, dx64 = ref_softmax(x, dim, dy, dtype)
    assert_close_to_ref(y, y64, out_dtype)
    assert leaf.grad.dtype == x.dtype
    assert leaf.grad.shape == x.shape
    # dx = y * (dy - <dy, y>) is computed from the saved, rounded y: allow a few output ulps.
    assert_close_to_ref(leaf.grad, dx64, x.dtype if dtype is None else max_err_dtype(x, dtype),
                        scale=grad_scale)
    return y, leaf.grad


def max_err_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """Tolerance key for a gradient that passed through two dtypes: the coarser one."""
    return max((x.dtype, dtype), key=lambda d: TOLERANCES[d][1])


# --------------------------------------------------------------------------- sizes and dtypes


# Default run: the reference at every size; float32 on the short rows and one past each
# single-block limit (the other float32 sizes exhaustive: their compensated row sums take the
# interpreter seconds per row); the 16-bit single-block limit and one past it.
@exhaustive_unless(lambda backend, n, dtype: backend == "reference"
                   or (dtype == torch.float32 and n in (1, 31, 32, 33, 1000, 1025)
                       + tuple(lim + 1 for lim in LIMITS))
                   or (dtype, n) in ((torch.bfloat16, LIMIT), (torch.float16, LIMIT + 1)))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sizes(backend, n, dtype):
    torch.manual_seed(n)
    x = (torch.randn(rows_for(n), n) * 3).to(dtype)
    y, _ = check(x)
    torch.testing.assert_close(y.float().sum(-1), torch.ones(y.shape[0]), **_sum_tol(dtype, n))


def _sum_tol(dtype, n):
    eps = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    return {"atol": eps * max(n, 1) ** 0.5 * 4, "rtol": 0}


# (the kernels on the diagonal: every row count and every row length once; the reference on
# all)
@exhaustive_unless(one_of_each({"m": [1, 2, 3, 7, 13, 64], "n": [1, 5, 32, 33]},
                               {"backend": "reference"}))
@pytest.mark.parametrize("m", [1, 2, 3, 7, 13, 64])
@pytest.mark.parametrize("n", [1, 5, 32, 33])
def test_row_count_tails(backend, m, n):
    """Short rows are packed several per program: every row count must be handled (tail rows)."""
    torch.manual_seed(m * 100 + n)
    check(torch.randn(m, n))


def test_large_values_are_stable(backend):
    """The row max is subtracted first: large logits must not overflow."""
    x = torch.tensor([[1000.0, 1001.0, 999.0], [-1000.0, -1001.0, -999.0], [88.0, 89.0, 90.0]])
    check(x)


# (the diagonal's rows of 17 and 32, two dtypes; the longer ones, more chunks of the same loop,
# exhaustive)
@exhaustive_unless(one_of_each({"n": LOOPED_SIZES, "dtype": DTYPES},
                               where=lambda n, dtype: n <= 32))
@pytest.mark.parametrize("n", LOOPED_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_looped_path(triton_backend, small_single_block, n, dtype):
    """Rows longer than one block: chunked kernels (online max/sum forward, two-pass backward)."""
    torch.manual_seed(n)
    x = (torch.randn(3, n) * 3).to(dtype)
    check(x)
    check(x, 0)  # rows of 3: single block; reduction across rows of length n
    check(x, -1, dtype=torch.float32 if dtype != torch.float32 else torch.float16)


def test_looped_path_strides(triton_backend, small_single_block):
    wide = torch.randn(4, 150)
    check(wide[:, 7:107])  # row stride 150, storage offset 7
    check(torch.randn(3, 70), dy=torch.randn(1, 70).expand(3, 70))  # dy row stride 0
    check(torch.randn(1, 70).expand(3, 70))  # x row stride 0


def test_looped_path_special_values(triton_backend, small_single_block):
    """Chunk-wise online softmax: lanes that have only seen -inf must not turn into NaN, a fully
    masked row is NaN (as torch), NaN/inf anywhere poison the row (as torch)."""
    n = 100
    x = torch.randn(6, n)
    x[0, :90] = -INF  # first chunks fully masked
    x[1, :] = -INF
    x[2, 50] = INF
    x[3, 99] = NAN
    x[4, ::2] = -INF  # every other lane masked in every chunk
    x[5, 16:] = -INF  # only the first chunk alive
    _same_as_torch(fused_softmax(x, -1), torch.softmax(x, -1))
    dy = torch.randn(6, n)
    xl = x.clone().requires_grad_(True)
    fused_softmax(xl, -1).backward(dy)
    xt = x.clone().requires_grad_(True)
    torch.softmax(xt, -1).backward(dy)
    torch.testing.assert_close(xl.grad, xt.grad, equal_nan=True, atol=1e-6, rtol=1e-5)


def test_looped_large_logits(triton_backend, small_single_block):
    """The running max grows chunk by chunk: earlier partial sums must be rescaled, not overflow."""
    x = torch.arange(100.0)[None, :].repeat(2, 1) * 50  # max grows by 800 per chunk
    x[1] = x[1].flip(0)
    check(x)


# --------------------------------------------------------------------------- shapes and dims

LEADING_SHAPES = [
    (),  # 0-d
    (7,),
    (4, 9),
    (2, 3, 9),
    (2, 2, 3, 9),
]


@pytest.mark.parametrize("shape", LEADING_SHAPES, ids=str)
def test_leading_dims(backend, shape):
    torch.manual_seed(len(shape))
    check(torch.randn(shape))


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0), (2, 0, 4), (0, 3, 4), (2, 3, 0)], ids=str)
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float16], ids=str)
def test_empty(backend, shape, dtype):
    for dim in range(-len(shape), len(shape)):
        x = torch.randn(shape, requires_grad=True)
        y = fused_softmax(x, dim, dtype=dtype)
        expected = torch.softmax(x.detach(), dim, dtype=dtype)
        assert y.shape == expected.shape and y.dtype == expected.dtype


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (2, 0, 4)], ids=str)
def test_empty_backward(backend, shape):
    """torch.softmax on an empty tensor is differentiable (zero-size gradient); so must we be."""
    x = torch.randn(shape, requires_grad=True)
    y = fused_softmax(x, -1)
    assert y.requires_grad
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_zero_dim(backend):
    x = torch.tensor(2.5, requires_grad=True)
    for dim in (0, -1):
        y = fused_softmax(x, dim)
        assert y.shape == () and y.item() == 1.0
        (g,) = torch.autograd.grad(y, x, torch.tensor(3.0))
        assert g.shape == () and g.item() == 0.0
    assert fused_softmax(torch.tensor(1.0, dtype=torch.float16), 0, dtype=torch.float32).dtype == (
        torch.float32
    )


@pytest.mark.parametrize("shape", [(3, 4, 5), (2, 3, 4, 6)], ids=str)
def test_every_dim(backend, shape):
    torch.manual_seed(sum(shape))
    x = torch.randn(shape)
    for dim in range(-len(shape), len(shape)):
        y, _ = check(x, dim)
        assert y.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_dim_half(backend, dtype):
    x = torch.randn(3, 4, 5).to(dtype)
    for dim in range(3):
        check(x, dim)


# --------------------------------------------------------------------------- strides


def _strided_inputs(dtype: torch.dtype = torch.float32, n: int = 37) -> dict:
    """Non-contiguous views of ``dtype`` tensors (built in ``dtype``: a cast would copy)."""
    torch.manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape).to(dtype)

    wide = randn(6, n + 11)
    return {
        "sliced_rows": wide[:, :n],  # row stride n + 11
        "storage_offset": wide[1:5, 3 : 3 + n],
        "every_other_row": wide[::2, :n],
        "transposed": randn(n, 6).t(),  # column stride 6: one copy
        "column_step": wide[:, ::2],  # column stride 2
        "expanded_rows": randn(1, n).expand(5, n),  # row stride 0
        "permuted_3d": randn(n, 3, 4).permute(1, 2, 0),
        "channels_last": randn(2, 3, 4, n).to(memory_format=torch.channels_last),
    }


# (the kernels on the diagonal's float32 cases; bfloat16: exhaustive)
@exhaustive_unless(one_of_each({"kind": list(_strided_inputs()),
                                "dtype": [torch.float32, torch.bfloat16]},
                               {"backend": "reference"},
                               where=lambda backend, kind, dtype:
                                   backend == "reference" or dtype == torch.float32))
@pytest.mark.parametrize("kind", list(_strided_inputs()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_contiguous_input(backend, kind, dtype):
    x = _strided_inputs(dtype)[kind]
    assert not x.is_contiguous()
    for dim in (-1, 0):
        y, _ = check(x, dim)
        assert y.is_contiguous()


def test_specialisation_changes_between_calls(backend):
    """The launcher caches compiled kernels per specialisation (16-byte alignment of pointers,
    divisibility of sizes and strides, row count 1): calls that differ only in those must each
    get the right kernel, in any order."""
    base = torch.randn(9, 80)
    views = [
        base[:4, :64],  # aligned, row stride 80 (divisible by 16)
        base[1:5, 1:65],  # pointer off by 4 bytes
        base.view(-1)[3 : 3 + 4 * 65].view(4, 65)[:, :64],  # row stride 65
        base[:1, :64],  # one row
        base[2:6, :64].contiguous(),  # aligned, stride 64
        base[:4, 2:66],  # off by 8 bytes
    ]
    for x in views + views[::-1]:
        check(x)
        check(x.to(torch.bfloat16))


def test_input_not_modified(backend):
    wide = torch.randn(4, 20)
    before = wide.clone()
    x = wide[:, 2:15].requires_grad_(False)
    fused_softmax(x, -1)
    torch.testing.assert_close(wide, before, rtol=0, atol=0)


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
@pytest.mark.parametrize("dim", [-1, 0])
def test_strided_grad_output(backend, make_dy, dim):
    torch.manual_seed(1)
    x = torch.randn(5, 33)
    check(x, dim, dy=make_dy(5, 33))


def test_grad_of_sum_and_mean(backend):
    """``.sum()`` / ``.mean()`` produce all-zero-stride gradients (and the true dx is ~0)."""
    x = torch.randn(4, 50, requires_grad=True)
    fused_softmax(x, -1).sum().backward()
    torch.testing.assert_close(x.grad, torch.zeros_like(x), atol=1e-6, rtol=0)
    x.grad = None
    (fused_softmax(x, 0) * torch.arange(50.0)).mean().backward()
    x64 = x.detach().double().requires_grad_(True)
    (torch.softmax(x64, 0) * torch.arange(50.0, dtype=torch.float64)).mean().backward()
    assert_close_to_ref(x.grad, x64.grad, torch.float32)


def test_non_leaf_and_chained(backend):
    """Softmax inside a larger graph: gradients flow through upstream and downstream ops."""
    torch.manual_seed(3)
    a = torch.randn(4, 20, requires_grad=True)
    w = torch.randn(20, 20, requires_grad=True)
    proj = torch.randn(4, 20)

    def loss(softmax, a, w, proj):
        return (softmax(softmax(a @ w * 0.5, -1) * 3, 0) * proj).sum()

    loss(fused_softmax, a, w, proj).backward()
    a64 = a.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    loss(torch.softmax, a64, w64, proj.double()).backward()
    assert_close_to_ref(a.grad, a64.grad, torch.float32, scale=10)
    assert_close_to_ref(w.grad, w64.grad, torch.float32, scale=10)


# --------------------------------------------------------------------------- dtype argument

DTYPE_PAIRS = [
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16),
    (torch.float16, torch.bfloat16),
    (torch.float32, torch.float32),
    (torch.float16, torch.float16),
]


# (the kernels on rows of 1025: exhaustive)
@exhaustive_unless(lambda backend, in_dtype, dtype, n: backend == "reference" or n == 7)
@pytest.mark.parametrize("in_dtype,dtype", DTYPE_PAIRS, ids=str)
@pytest.mark.parametrize("n", [7, 1025])
def test_dtype_argument(backend, in_dtype, dtype, n):
    torch.manual_seed(n)
    x = (torch.randn(3, n) * 2).to(in_dtype)
    y, g = check(x, -1, dtype=dtype)
    assert y.dtype == dtype
    assert g.dtype == in_dtype
    for dim in (0, 1):
        check(x, dim, dtype=dtype)


def test_dtype_float64_upcast(backend):
    """dtype=float64 on a float32 input: the computation runs in float64 (reference path)."""
    x = torch.randn(3, 8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Triton backend may warn that it falls back
        y = fused_softmax(x, -1, dtype=torch.float64)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, torch.softmax(x.double(), -1), rtol=1e-12, atol=1e-12)
    y.sum().backward()
    assert x.grad.dtype == torch.float32


# --------------------------------------------------------------------------- special values

SPECIAL_ROWS = {
    "all_neg_inf": [-INF, -INF, -INF, -INF],
    "some_neg_inf": [-INF, 0.0, 1.0, -INF],
    "one_finite": [-INF, -INF, 3.0, -INF],
    "pos_inf": [1.0, INF, 2.0, 0.0],
    "two_pos_inf": [INF, INF, 2.0, 0.0],
    "nan": [1.0, NAN, 2.0, 0.0],
    "nan_and_inf": [NAN, INF, -INF, 0.0],
    "all_equal": [5.0, 5.0, 5.0, 5.0],
    "huge_spread": [3.0e38, -3.0e38, 0.0, 1.0],
}


def _same_as_torch(y: torch.Tensor, expected: torch.Tensor):
    assert y.dtype == expected.dtype
    torch.testing.assert_close(y.double(), expected.double(), equal_nan=True,
                               **_special_tol(y.dtype))


def _special_tol(dtype):
    atol, rtol = TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}


# (the kernels on the diagonal: every row kind and every dtype once; the reference on all)
@exhaustive_unless(one_of_each({"case": list(SPECIAL_ROWS), "dtype": DTYPES},
                               {"backend": "reference"}))
@pytest.mark.parametrize("case", list(SPECIAL_ROWS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values(backend, case, dtype):
    row = torch.tensor(SPECIAL_ROWS[case])
    if dtype != torch.float32 and case == "huge_spread":
        row = torch.tensor([torch.finfo(dtype).max, torch.finfo(dtype).min, 0.0, 1.0])
    x = torch.stack([row, torch.arange(4.0), row.flip(0)]).to(dtype)
    _same_as_torch(fused_softmax(x, -1), torch.softmax(x, -1))
    _same_as_torch(fused_softmax(x, 0), torch.softmax(x, 0))
    f32 = torch.float32
    _same_as_torch(fused_softmax(x, -1, dtype=f32), torch.softmax(x, -1, dtype=f32))


@pytest.mark.parametrize("case", ["all_neg_inf", "some_neg_inf"])
def test_special_values_backward(backend, case):
    """Masked (-inf) positions get zero gradient; fully masked rows give NaN like torch."""
    row = torch.tensor(SPECIAL_ROWS[case])
    x = torch.stack([row, torch.arange(4.0)]).requires_grad_(True)
    dy = torch.randn(2, 4)
    fused_softmax(x, -1).backward(dy)
    xt = x.detach().clone().requires_grad_(True)
    torch.softmax(xt, -1).backward(dy)
    torch.testing.assert_close(x.grad, xt.grad, equal_nan=True, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_extremes(backend, dtype):
    fmax = torch.finfo(dtype).max
    x = torch.tensor(
        [
            [fmax, fmax, fmax, fmax],
            [-fmax, -fmax, -fmax, -fmax],
            [fmax, -fmax, 0.0, 1.0],
            [-fmax, -fmax, -fmax * 0.9, -fmax * 0.95],
            [6.0e-8, -6.0e-8, 0.0, 1.0e-4],  # fp16 subnormals
        ],
        dtype=dtype,
    )
    _same_as_torch(fused_softmax(x, -1), torch.softmax(x, -1))
    check(x[1:3] if dtype == torch.float16 else x[4:], -1)


# (the kernels: exhaustive; test_looped_path_special_values rescales a -inf running max on
# short rows by default)
@exhaustive_unless(lambda backend: backend == "reference")
def test_masked_long_row(backend):
    """A long row whose first part is all -inf (the looped path rescales a -inf running max)."""
    n = LIMIT + 5
    x = torch.randn(2, n)
    x[0, : n - 3] = -INF
    x[1, :] = -INF
    _same_as_torch(fused_softmax(x, -1), torch.softmax(x, -1))


# --------------------------------------------------------------------------- gradcheck


@pytest.mark.parametrize(
    "shape,dim",
    [((5,), 0), ((3, 7), -1), ((3, 7), 0), ((2, 3, 4), 1), ((), 0), ((4, 1), -1)],
    ids=str,
)
def test_gradcheck_float64(shape, dim):
    """Reference path in float64 (float64 is never sent to the kernels)."""
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: fused_softmax(t, dim), (x,))
    assert torch.autograd.gradcheck(lambda t: SoftmaxFunction.apply(t, dim % max(t.dim(), 1),
                                                                    t.dtype), (x,))


def test_gradcheck_strided_float64():
    base = torch.randn(4, 12, dtype=torch.float64)
    x = base[:, 2:9].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: fused_softmax(t.t(), 0), (x,))


@exhaustive_unless(lambda n: n <= 33)  # (rows of 1025: exhaustive)
@pytest.mark.parametrize("n", [3, 33, 1025])
def test_triton_grads_vs_float64(triton_backend, n):
    """gradcheck-like check of the kernels: fp32 analytic Jacobian-vector products against float64
    for several random cotangents (gradcheck itself needs float64, which the kernels don't take)."""
    torch.manual_seed(n)
    x = torch.randn(3, n)
    for _ in range(3):
        dy = torch.randn(3, n)
        check(x, -1, dy=dy, grad_scale=1.0)


# --------------------------------------------------------------------------- no-grad paths


def test_inference_paths_match(backend):
    x = torch.randn(4, 33)
    with torch.no_grad():
        y_nograd = fused_softmax(x.requires_grad_(True), -1)
    assert y_nograd.grad_fn is None and not y_nograd.requires_grad
    y_plain = fused_softmax(x.detach(), -1)
    y_grad = fused_softmax(x, -1)
    assert y_grad.grad_fn is not None
    torch.testing.assert_close(y_nograd, y_plain, rtol=0, atol=0)
    torch.testing.assert_close(y_grad.detach(), y_plain, rtol=0, atol=0)


def test_deterministic(backend):
    x = torch.randn(6, 300)
    dy = torch.randn(6, 300)
    a = run_fused(x, -1, dy)
    b = run_fused(x, -1, dy)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_inference_mode(backend):
    with torch.inference_mode():
        x = torch.randn(3, 10)
        y = fused_softmax(x, 1)
    torch.testing.assert_close(y, torch.softmax(x, 1))
