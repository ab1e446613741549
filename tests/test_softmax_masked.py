"""fused_softmax(scale=, mask=, causal=): the softmax of attention, ``softmax(x * scale + mask)``
with an optional causal triangle, against an UNFUSED float64 eager reference (plain torch ops).

Every case checks the forward output against the oracle with the shared tolerance table, and
(where differentiable) the gradient of x, and of a float mask that requires grad, against
float64 autograd of the same oracle. Tests taking the ``backend`` fixture run on the reference
backend and on the Triton kernels (interpreted on CPU, ``TRITON_INTERPRET=1``): where the Triton
backend has no masked kernels yet, the op layer falls back to the reference with a warning, so the
same tests pass there and check the kernels as soon as they land. Tensors stay small (the
interpreter is slow).
"""

from __future__ import annotations

import importlib
import math
import warnings

import pytest
import torch
from conftest import TOLERANCES, assert_close_to_ref, tol

import fusedops
from fusedops import _dispatch, fused_softmax

# Tensors are created on the GPU when there is one (conftest's _tensors_on_device).
ON_DEVICE = True

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INF, NAN = float("inf"), float("nan")
# The gradient dx = scale * y * (dy - <dy, y>) is computed from the saved, rounded output y:
# allow a few output ulps (the same widening as tests/test_softmax.py).
GRAD_SCALE = 4.0

softmax_module = importlib.import_module("fusedops.ops.softmax")


# --------------------------------------------------------------------------- oracle and check


def ref_masked_softmax(x64: torch.Tensor, scale=None, mask=None, causal: bool = False,
                       dim: int = -1) -> torch.Tensor:
    """Unfused float64 eager reference: z = x * scale; a bool mask drops (-inf) where False, a
    float mask is added; causal drops [..., i, j] for j > i (top-left aligned); softmax over
    ``dim``; a row with nothing left (all -inf) is zeros. Differentiable in x64 and in a float64
    mask (autograd sums its gradient over the broadcast dims)."""
    z = x64 * (1.0 if scale is None else float(scale))
    if mask is not None:
        if mask.dtype == torch.bool:
            z = z.masked_fill(~mask, -INF)
        else:
            z = z + mask.to(torch.float64)
    if causal:
        q, n = z.shape[-2], z.shape[-1]
        upper = torch.ones(q, n, dtype=torch.bool, device=z.device).triu(1)
        z = z.masked_fill(upper, -INF)
    empty = (z == -INF).all(dim=dim, keepdim=True)
    # Softmax of the empty rows taken on zeros (never NaN, so no NaN leaks into the gradient).
    return torch.softmax(z.masked_fill(empty, 0.0), dim=dim).masked_fill(empty, 0.0)


def coarsest(*dtypes: torch.dtype) -> torch.dtype:
    """Tolerance key for a value that passed through several dtypes: the coarsest one."""
    return max(dtypes, key=lambda d: TOLERANCES[d][1])


def check(x, *, scale=None, mask=None, causal=False, dim=-1, dtype=None, grad_x=True,
          grad_mask=False, dy=None, grad_scale=GRAD_SCALE):
    """fused_softmax forward and the requested gradients against the float64 oracle. Returns
    (y, x.grad, mask.grad)."""
    out_dtype = dtype or x.dtype
    xl = x.detach().clone().requires_grad_(grad_x)
    ml = mask
    if grad_mask:
        ml = mask.detach().clone().requires_grad_(True)
    y = fused_softmax(xl, dim, dtype, scale=scale, mask=ml, causal=causal)
    assert y.dtype == out_dtype, "the mask's dtype must not promote the result"
    assert y.shape == x.shape

    xin = x.detach() if dtype is None else x.detach().to(dtype)  # torch casts the input first
    x64 = xin.to(torch.float64).requires_grad_(True)
    m64 = mask
    if grad_mask:
        m64 = mask.detach().to(torch.float64).requires_grad_(True)
    y64 = ref_masked_softmax(x64, scale, m64, causal, dim)
    assert_close_to_ref(y, y64, out_dtype)
    if not (grad_x or grad_mask):
        return y, None, None

    if dy is None:
        dy = torch.randn(x.shape).to(out_dtype)
    y.backward(dy)
    wanted = ([x64] if grad_x else []) + ([m64] if grad_mask else [])
    grads = list(torch.autograd.grad(y64, wanted, dy.to(torch.float64)))
    if grad_x:
        dx64 = grads.pop(0)
        assert xl.grad.dtype == x.dtype and xl.grad.shape == x.shape
        assert_close_to_ref(xl.grad, dx64, coarsest(x.dtype, out_dtype), scale=grad_scale)
    if grad_mask:
        (dm64,) = grads
        assert ml.grad.dtype == mask.dtype and ml.grad.shape == mask.shape
        # A sum over the dims the mask was broadcast along: widen like a sum of k terms.
        k = max(x.numel() // max(mask.numel(), 1), 1)
        assert_close_to_ref(ml.grad, dm64, coarsest(x.dtype, out_dtype, mask.dtype),
                            scale=grad_scale * math.sqrt(k))
    return y, (xl.grad if grad_x else None), (ml.grad if grad_mask else None)


def bool_mask(shape, keep=0.6, seed=0):
    g = torch.Generator().manual_seed(seed)  # CPU generator: same mask on every device
    return (torch.rand(shape, generator=g, device="cpu") < keep).to(torch.empty(0).device)


def float_mask(shape, dtype=torch.float32, seed=0, neg_inf=0.2):
    """Additive mask: random offsets, about ``neg_inf`` of the entries -inf."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(shape, generator=g, device="cpu")
    m = m.masked_fill(torch.rand(shape, generator=g, device="cpu") < neg_inf, -INF)
    return m.to(dtype).to(torch.empty(0).device)


def hf_mask(shape, dtype=torch.float32, seed=0):
    """Hugging Face style additive mask: 0 to keep, finfo(dtype).min to drop."""
    keep = bool_mask(shape, seed=seed)
    m = torch.zeros(shape, dtype=dtype)
    return m.masked_fill(~keep, torch.finfo(dtype).min)


def make_mask(kind, shape, dtype=torch.float32, seed=0):
    return {"bool": lambda: bool_mask(shape, seed=seed),
            "float": lambda: float_mask(shape, dtype, seed=seed),
            "hf": lambda: hf_mask(shape, dtype, seed=seed)}[kind]()


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which one-time warnings were already given."""
    monkeypatch.setattr(_dispatch, "_warned", set())


# --------------------------------------------------------------------------- scale only


@pytest.mark.parametrize("dtype,scale", [
    (torch.float32, 0.125), (torch.float32, 3), (torch.float16, 2.0), (torch.bfloat16, -0.7)],
    ids=str)
def test_scale_only(backend, dtype, scale):
    torch.manual_seed(1)
    x = (torch.randn(2, 5, 33) * 3).to(dtype)
    check(x, scale=scale)


def test_scale_zero_is_uniform(backend):
    x = torch.randn(3, 9) * 100
    y, _, _ = check(x, scale=0.0)
    torch.testing.assert_close(y, torch.full((3, 9), 1 / 9), **tol(torch.float32))


# --------------------------------------------------------------------------- masks

X_SHAPE = (2, 3, 5, 7)  # (B, H, Q, N)
MASK_SHAPES = {
    "B11N": (2, 1, 1, 7),
    "11QN": (1, 1, 5, 7),
    "QN": (5, 7),
    "N": (7,),
    "full": (2, 3, 5, 7),
    "B1Q1": (2, 1, 5, 1),  # whole rows kept or dropped: fully masked rows for a bool mask
}


@pytest.mark.parametrize("kind,mshapes", [
    ("bool", list(MASK_SHAPES)),
    ("float", ["B11N", "11QN", "QN", "full"]),
    ("hf", ["B11N", "B1Q1"]),
])
def test_mask_broadcast_shapes(backend, kind, mshapes):
    torch.manual_seed(2)
    x = torch.randn(X_SHAPE) * 2
    for seed, mshape in enumerate(mshapes):
        mask = make_mask(kind, MASK_SHAPES[mshape], seed=seed)
        # Scale None (the plain softmax backward) for bool masks, a real scale for float ones.
        check(x, scale=None if kind == "bool" else 0.5, mask=mask)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_mask_half_inputs(backend, dtype):
    """16-bit x with a mask in x's dtype (bool for the bool kind)."""
    torch.manual_seed(3)
    x = (torch.randn(X_SHAPE) * 2).to(dtype)
    for kind in ("bool", "float", "hf"):
        check(x, scale=0.25, mask=make_mask(kind, (2, 1, 5, 7), dtype=dtype))


def _non_contiguous_masks():
    base = bool_mask((2, 1, 5, 1), seed=4)
    fbase = float_mask((2, 1, 5, 1), seed=4)
    wide = float_mask((2, 3, 5, 12), seed=5)
    return {
        "bool_expanded": lambda: base.expand(X_SHAPE),  # strides 0, not contiguous
        "float_expanded": lambda: fbase.expand(X_SHAPE),
        "float_transposed": lambda: float_mask((2, 3, 7, 5), seed=6).mT,
        "bool_transposed": lambda: bool_mask((2, 3, 7, 5), seed=6).mT,
        "float_sliced": lambda: wide[..., 2:9],  # row stride 12, storage offset 2
        "bool_step": lambda: bool_mask((5, 14), seed=7)[:, ::2],  # column stride 2
    }


def test_mask_non_contiguous(backend):
    torch.manual_seed(4)
    x = torch.randn(X_SHAPE)
    for kind, make in _non_contiguous_masks().items():
        mask = make()
        assert not mask.is_contiguous(), kind
        check(x, scale=0.8, mask=mask)


@pytest.mark.parametrize("x_dtype,mask_dtype", [
    (torch.float32, torch.float64), (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32)], ids=str)
def test_mask_dtype_does_not_promote(backend, x_dtype, mask_dtype):
    torch.manual_seed(5)
    x = torch.randn(X_SHAPE).to(x_dtype)
    mask = float_mask((1, 1, 5, 7), mask_dtype, seed=5)
    y, _, _ = check(x, scale=0.5, mask=mask)
    assert y.dtype == x_dtype


# --------------------------------------------------------------------------- causal


@pytest.mark.parametrize("q,n", [(6, 6), (4, 9), (9, 4), (1, 5)], ids=str)
def test_causal(backend, q, n):
    """Top-left aligned: element [..., i, j] is dropped when j > i, also for Q != N."""
    torch.manual_seed(q * 10 + n)
    x = torch.randn(2, 3, q, n)
    y, _, _ = check(x, scale=0.3, causal=True)
    upper = torch.ones(q, n, dtype=torch.bool).triu(1)
    assert (y[..., upper] == 0).all()
    # Row i keeps exactly min(i + 1, n) columns, which sum to one.
    torch.testing.assert_close(y.sum(-1), torch.ones(2, 3, q), **tol(torch.float32, scale=4))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_causal_no_scale(backend, dtype):
    torch.manual_seed(6)
    check(torch.randn(3, 8, 8).to(dtype), causal=True)


@pytest.mark.parametrize("kind", ["bool", "float", "hf"])
def test_causal_with_mask(backend, kind):
    """Causal and a mask together; the bool mask drops column 0 of batch 0, which leaves row 0
    (causal keeps only column 0 there) with nothing: zeros, zero gradient."""
    torch.manual_seed(7)
    x = torch.randn(2, 2, 6, 8)
    mask = make_mask(kind, (2, 1, 1, 8), seed=7)
    if kind == "bool":
        mask[0, ..., 0] = False
        mask[1, ..., 0] = True
    y, dx, _ = check(x, scale=0.6, mask=mask, causal=True)
    if kind == "bool":
        assert (y[0, :, 0] == 0).all() and (dx[0, :, 0] == 0).all()


# --------------------------------------------------------------------------- ranks


@pytest.mark.parametrize("shape,mshape,causal", [
    ((9,), (9,), False),  # 1-D: a mask, no causal
    ((6, 9), (9,), True),  # 2-D: the (Q, N) scores themselves
    ((6, 9), (6, 9), True),
    ((3, 6, 9), (1, 6, 9), True),
    ((2, 3, 6, 9), (2, 1, 1, 9), True),
    ((2, 2, 3, 4, 9), (2, 1, 3, 1, 9), True),  # 5-D: leading dims merged
    ((2, 2, 3, 4, 9), (4, 9), False),
], ids=str)
def test_ranks(backend, shape, mshape, causal):
    torch.manual_seed(len(shape))
    kind = "bool" if len(shape) % 2 else "float"  # both kinds across the ranks
    x = torch.randn(shape) * 2
    check(x, scale=0.7, mask=make_mask(kind, mshape, seed=len(shape)), causal=causal)


def test_five_d_non_contiguous_mask(backend):
    """More than 4 dims and a mask whose strides do not merge (the op layer copies it)."""
    torch.manual_seed(8)
    x = torch.randn(2, 3, 2, 4, 6)
    mask = float_mask((2, 2, 3, 6, 4), seed=8).transpose(1, 2).mT
    assert mask.shape == x.shape and not mask.is_contiguous()
    check(x, scale=0.5, mask=mask, causal=True, grad_mask=True)


# --------------------------------------------------------------------------- special values


def test_fully_masked_rows_are_zero_with_zero_gradient(backend):
    """Rows with nothing kept: a bool mask all False, a float mask all -inf, an x row all -inf
    (scale only), causal + mask. Zeros (not torch's NaN) and an exactly zero gradient."""
    torch.manual_seed(9)
    x = torch.randn(4, 6, 8)
    bmask = torch.ones(4, 6, 8, dtype=torch.bool)
    bmask[0, 2] = False
    fmask = torch.zeros(4, 6, 8)
    fmask[1, 3] = -INF
    xs = x.clone()
    xs[2, 4] = -INF
    cmask = torch.ones(4, 1, 8, dtype=torch.bool)
    cmask[3, :, 0] = False  # causal keeps only column 0 in row 0: nothing left
    cases = [
        (x, {"mask": bmask}, (0, 2)),
        (x, {"mask": fmask, "scale": 0.5}, (1, 3)),
        (xs, {"scale": 1.0}, (2, 4)),
        (x, {"mask": cmask, "causal": True}, (3, 0)),
    ]
    for xin, kwargs, (b, row) in cases:
        grad_mask = kwargs.get("mask") is not None and kwargs["mask"].is_floating_point()
        y, dx, dm = check(xin, grad_mask=grad_mask, **kwargs)
        assert not y.isnan().any()
        assert (y[b, row] == 0).all()
        assert (dx[b, row] == 0).all()
        if grad_mask:
            assert (dm[b, row] == 0).all()
        # The other rows are untouched by the empty one and sum to one.
        others = torch.ones(4, 6, dtype=torch.bool)
        others[b, row] = False
        torch.testing.assert_close(y.sum(-1)[others], torch.ones(int(others.sum())),
                                   **tol(torch.float32, scale=4))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fully_masked_rows_half(backend, dtype):
    x = torch.randn(3, 5, 16).to(dtype)
    mask = torch.ones(3, 5, 16, dtype=torch.bool)
    mask[1, 1:3] = False
    y, dx, _ = check(x, scale=0.5, mask=mask)
    assert (y[1, 1:3] == 0).all() and (dx[1, 1:3] == 0).all()


def test_nan_propagates(backend):
    """A NaN at a kept position poisons its row (as torch's softmax); a NaN in a float mask
    poisons its row; the other rows are unaffected."""
    torch.manual_seed(10)
    x = torch.randn(2, 6, 8)
    x[0, 3, 2] = NAN
    mask = float_mask((6, 8), seed=10, neg_inf=0.0)
    mask[4, 5] = NAN
    for kwargs in ({"scale": 0.5}, {"mask": mask}, {"scale": 2.0, "mask": mask},
                   {"causal": True, "mask": mask}):
        y = fused_softmax(x, **kwargs)
        nan_rows = y.isnan().all(-1)
        expected = torch.zeros(2, 6, dtype=torch.bool)
        expected[0, 3] = True  # x[0, 3, 2]: column 2 <= row 3, kept under causal too
        if "mask" in kwargs and not kwargs.get("causal"):
            # mask[4, 5] poisons row 4 of every batch, unless causal drops column 5 > row 4.
            expected[:, 4] = True
        assert torch.equal(nan_rows, expected), kwargs
        # NaN rows are NaN throughout; the rest agree with the oracle.
        assert not y[~expected].isnan().any()
        y64 = ref_masked_softmax(x.double(), kwargs.get("scale"), kwargs.get("mask"),
                                 kwargs.get("causal", False))
        assert_close_to_ref(y[~expected], y64[~expected], torch.float32)


# --------------------------------------------------------------------------- dtype, autocast


@pytest.mark.parametrize("in_dtype,dtype", [
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32),
    (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
    (torch.float32, torch.float64), (torch.float16, torch.float16)], ids=str)
def test_dtype_argument(backend, in_dtype, dtype):
    """As torch.softmax(dtype=): the input is cast first, the result has ``dtype``, the gradient
    has x's dtype; with a mask and causal."""
    torch.manual_seed(11)
    x = torch.randn(2, 3, 6, 10).to(in_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fused backend may say it sends float64 to torch
        check(x, dtype=dtype, scale=0.4, mask=float_mask((1, 1, 6, 10), seed=11), causal=True)


def test_autocast_float32_output(backend, monkeypatch):
    """CUDA autocast semantics, simulated on CPU: where autocast would run softmax in float32
    (fusedops.ops._rows.autocast_fp32), 16-bit x comes out float32 with float32 accuracy, and the
    gradient keeps x's dtype. An explicit ``dtype`` overrides autocast."""
    monkeypatch.setattr(fusedops.ops._rows, "autocast_fp32", lambda x: True)
    torch.manual_seed(12)
    x = torch.randn(2, 3, 6, 10).to(torch.bfloat16)
    mask = bool_mask((2, 1, 6, 10), seed=12)
    xl = x.clone().requires_grad_(True)
    y = fused_softmax(xl, scale=0.4, mask=mask, causal=True)
    assert y.dtype == torch.float32
    x64 = x.double().requires_grad_(True)
    y64 = ref_masked_softmax(x64, 0.4, mask, True)
    assert_close_to_ref(y, y64, torch.float32)
    dy = torch.randn(y.shape)
    y.backward(dy)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    assert xl.grad.dtype == torch.bfloat16
    assert_close_to_ref(xl.grad, dx64, torch.bfloat16, scale=GRAD_SCALE)
    assert fused_softmax(x, dtype=torch.float16, mask=mask).dtype == torch.float16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cpu_autocast_keeps_dtype(dtype):
    """CPU autocast does not upcast softmax (torch's CPU policy): neither do the extras."""
    x = torch.randn(2, 5, 8).to(dtype)
    mask = bool_mask((5, 8), seed=13)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fused_softmax(x.cpu(), scale=0.5, mask=mask.cpu(), causal=True)
    assert y.dtype == dtype
    assert_close_to_ref(y, ref_masked_softmax(x.cpu().double(), 0.5, mask.cpu(), True), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_cuda_autocast(dtype):
    """Real CUDA autocast: softmax is on its float32 list, so the result is float32 (the 16-bit
    scores read as they are); the gradient of the 16-bit scores keeps their dtype."""
    torch.manual_seed(14)
    x = torch.randn(2, 3, 6, 10, device="cuda")
    w = torch.randn(10, 10, device="cuda")
    mask = bool_mask((2, 1, 6, 10), seed=14).cuda()
    with torch.autocast("cuda", dtype=dtype):
        h = (x @ w).detach().requires_grad_(True)
        assert h.dtype == dtype
        y = fused_softmax(h, scale=0.3, mask=mask, causal=True)
        assert torch.softmax(h, -1).dtype == torch.float32  # torch's own policy
    assert y.dtype == torch.float32
    h64 = h.detach().double().requires_grad_(True)
    y64 = ref_masked_softmax(h64, 0.3, mask, True)
    assert_close_to_ref(y, y64, torch.float32)
    dy = torch.randn(y.shape, device="cuda")
    y.backward(dy)
    (dh64,) = torch.autograd.grad(y64, h64, dy.double())
    assert h.grad.dtype == dtype
    assert_close_to_ref(h.grad, dh64, dtype, scale=GRAD_SCALE)


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("mshape,grad_x", [
    ("B11N", True), ("11QN", False), ("QN", True), ("full", True), ("B1Q1", False)], ids=str)
def test_float_mask_gradient(backend, mshape, grad_x):
    """A float mask that requires grad gets dmask = y * (dy - <dy, y>) (unscaled), summed over the
    dims it was broadcast along, in its own dtype."""
    torch.manual_seed(15)
    x = torch.randn(X_SHAPE)
    mask = float_mask(MASK_SHAPES[mshape], seed=15)
    check(x, scale=0.5, mask=mask, causal=True, grad_x=grad_x, grad_mask=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_float_mask_gradient_half(backend, dtype):
    torch.manual_seed(16)
    x = torch.randn(X_SHAPE).to(dtype)
    check(x, scale=2.0, mask=float_mask((1, 1, 5, 7), dtype, seed=16), grad_mask=True)


def test_float64_mask_gradient_with_float32_x(backend):
    torch.manual_seed(17)
    _, _, dm = check(torch.randn(X_SHAPE), scale=0.5,
                     mask=float_mask((2, 1, 1, 7), torch.float64, seed=17), grad_mask=True)
    assert dm.dtype == torch.float64


def test_mask_gradient_through_expand(backend):
    """A non-contiguous (expanded) mask that requires grad: its gradient reaches the leaf
    through the expand."""
    torch.manual_seed(18)
    x = torch.randn(X_SHAPE, requires_grad=True)
    leaf = float_mask((2, 1, 5, 1), seed=18, neg_inf=0.0).requires_grad_(True)
    y = fused_softmax(x, scale=0.5, mask=leaf.expand(X_SHAPE), causal=True)
    x64 = x.detach().double().requires_grad_(True)
    leaf64 = leaf.detach().double().requires_grad_(True)
    y64 = ref_masked_softmax(x64, 0.5, leaf64.expand(X_SHAPE), True)
    assert_close_to_ref(y, y64, torch.float32)
    dy = torch.randn(X_SHAPE)
    dx, dleaf = torch.autograd.grad(y, (x, leaf), dy)
    dx64, dleaf64 = torch.autograd.grad(y64, (x64, leaf64), dy.double())
    assert_close_to_ref(dx, dx64, torch.float32, scale=GRAD_SCALE)
    assert dleaf.shape == leaf.shape
    assert_close_to_ref(dleaf, dleaf64, torch.float32, scale=GRAD_SCALE * math.sqrt(3 * 7))


def test_strided_grad_output(backend):
    """dy with row stride 0 (the gradient of a broadcast) and a transposed dy."""
    torch.manual_seed(19)
    x = torch.randn(4, 9)
    mask = bool_mask((4, 9), seed=19)
    mask[:, 0] = True
    check(x, scale=0.5, mask=mask, dy=torch.randn(1, 9).expand(4, 9))
    check(x, scale=0.5, mask=mask, causal=True, dy=torch.randn(9, 4).t())


def test_inference_paths_match(backend):
    """With grad, without grad (no autograd Function) and under inference_mode: same values."""
    torch.manual_seed(20)
    x = torch.randn(2, 3, 6, 10)
    mask = float_mask((1, 1, 6, 10), seed=20)
    kwargs = {"scale": 0.3, "mask": mask, "causal": True}
    y_grad = fused_softmax(x.clone().requires_grad_(True), **kwargs)
    assert y_grad.grad_fn is not None
    with torch.no_grad():
        y_nograd = fused_softmax(x.clone().requires_grad_(True), **kwargs)
    assert y_nograd.grad_fn is None
    with torch.inference_mode():
        y_inf = fused_softmax(x, **kwargs)
    torch.testing.assert_close(y_grad.detach(), y_nograd, atol=0, rtol=0)
    torch.testing.assert_close(y_inf, y_nograd, atol=0, rtol=0)
    assert_close_to_ref(y_nograd, ref_masked_softmax(x.double(), 0.3, mask, True), torch.float32)


def _gradcheck_case(kind):
    """(fn, inputs) in float64 with scale, mask and causal."""
    torch.manual_seed(21)
    x = torch.randn(2, 1, 3, 4, dtype=torch.float64, requires_grad=True)
    if kind == "float_mask_grad":
        mask = torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True)
        return (lambda x, mask: fused_softmax(x, scale=0.7, mask=mask, causal=True)), (x, mask)
    if kind == "float_mask":
        mask = torch.randn(2, 1, 1, 4, dtype=torch.float64)
        return (lambda x: fused_softmax(x, scale=0.7, mask=mask, causal=True)), (x,)
    bmask = torch.ones(2, 1, 1, 4, dtype=torch.bool)
    bmask[0, ..., 2] = False
    bmask[1, ..., 0] = False  # row 0 of batch 1: nothing left under causal (zeros)
    return (lambda x: fused_softmax(x, scale=1.3, mask=bmask, causal=True)), (x,)


@pytest.mark.parametrize("kind", ["float_mask_grad", "float_mask", "bool_empty_row"])
def test_gradcheck_float64(kind):
    """float64 runs the reference path: the analytic backward (custom Function) against finite
    differences, with scale, mask and causal."""
    fn, inputs = _gradcheck_case(kind)
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("kind", [
    "float_mask_grad", "float_mask", "bool_empty_row"])
def test_gradgradcheck_float64(kind):
    """Second order (create_graph=True runs the torch-ops backward on the saved output)."""
    fn, inputs = _gradcheck_case(kind)
    # fast_mode: random projections of the second-order Jacobian (a wrong one fails too).
    assert torch.autograd.gradgradcheck(fn, inputs, fast_mode=True)


def test_float64_gradients_with_mask_grad():
    torch.manual_seed(27)
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64)
    check(x, scale=0.5, mask=torch.randn(1, 1, 4, 6, dtype=torch.float64), causal=True,
          grad_mask=True, grad_scale=1.0)


def test_gradcheck_non_last_dim_float64():
    x = torch.randn(3, 4, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(4, 1, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time "not fused over this dim" warning
        assert torch.autograd.gradcheck(
            lambda x, m: fused_softmax(x, 1, scale=0.5, mask=m, causal=True), (x, mask))


# --------------------------------------------------------------------------- other dims


@pytest.mark.parametrize("dim", [0, 1, -2])
def test_non_last_dim_warns_once_and_is_correct(backend, fresh_warnings, dim):
    torch.manual_seed(22)
    x = torch.randn(3, 5, 6)
    mask = float_mask((5, 1), seed=22, neg_inf=0.0)

    def call():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check(x, dim=dim, scale=0.5, mask=mask, causal=True, grad_mask=True)
        return [w for w in caught
                if issubclass(w.category, UserWarning) and "last dim" in str(w.message)]

    first = call()
    assert len(first) == 1, [str(w.message) for w in first]
    assert "test_softmax_masked" in first[0].filename  # attributed to the caller's line
    assert call() == []  # one time only


def test_last_dim_spelled_positively_does_not_warn(backend, fresh_warnings):
    x = torch.randn(2, 4, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(x, dim=2, scale=0.5, mask=bool_mask((4, 6), seed=23), causal=True)
    assert not [w for w in caught if "last dim" in str(w.message)]


# --------------------------------------------------------------------------- plain call


def test_plain_call_unaffected(backend):
    """No extras (or the defaults spelled out): the plain softmax (its Function, torch's NaN for
    an all -inf row); scale=1.0 takes the masked path and agrees except there (zeros)."""
    torch.manual_seed(24)
    x = torch.randn(4, 9, requires_grad=True)
    with torch.no_grad():
        x[2] = -INF
    y = fused_softmax(x)
    y_spelled = fused_softmax(x, -1, None, scale=None, mask=None, causal=False)
    assert type(y.grad_fn).__name__ == "SoftmaxFunctionBackward"
    assert type(y_spelled.grad_fn).__name__ == "SoftmaxFunctionBackward"
    torch.testing.assert_close(y, y_spelled, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(y, torch.softmax(x, -1), equal_nan=True, **tol(torch.float32))
    assert y[2].isnan().all()  # torch's semantics are kept for the plain call
    y1 = fused_softmax(x, scale=1.0)
    assert type(y1.grad_fn).__name__ != "SoftmaxFunctionBackward"
    assert (y1[2] == 0).all()
    rows = torch.tensor([0, 1, 3])
    torch.testing.assert_close(y1[rows], y[rows], **tol(torch.float32))


def test_plain_call_counts_plain_kernel(backend):
    """With counting on: the plain call runs the plain softmax kernel, never the masked one; a call
    with extras runs the masked kernel where the backend has it."""
    x = torch.randn(3, 8)
    with fusedops.count_fused_calls() as counts:
        y = fused_softmax(x)
    assert counts["softmax_masked_forward"] == 0
    assert counts["softmax_forward"] == (1 if backend == "triton" else 0)
    torch.testing.assert_close(y, torch.softmax(x, -1), **tol(torch.float32))
    with fusedops.count_fused_calls() as counts:
        y = fused_softmax(x, scale=0.5)
    assert counts["softmax_forward"] == 0
    fused = backend == "triton" and hasattr(_dispatch.backend_for(x), "softmax_masked_forward")
    assert counts["softmax_masked_forward"] == (1 if fused else 0)
    torch.testing.assert_close(y, torch.softmax(x * 0.5, -1), **tol(torch.float32))


# --------------------------------------------------------------------------- argument errors


@pytest.fixture
def no_dispatch(monkeypatch):
    """Any backend dispatch fails the test: errors must come before any kernel runs."""

    def fail(x):
        raise AssertionError("a backend was dispatched before the argument error")

    monkeypatch.setattr(_dispatch, "backend_for", fail)


def _meta_mask():
    return torch.ones(5, 7, dtype=torch.bool, device="meta")


ERROR_CASES = {
    "scale_str": ({"scale": "2"}, TypeError, "scale"),
    "scale_bool": ({"scale": True}, TypeError, "scale"),
    "scale_tensor": ({"scale": "tensor"}, TypeError, "scale"),
    "scale_inf": ({"scale": INF}, ValueError, "scale"),
    "scale_neg_inf": ({"scale": -INF}, ValueError, "scale"),
    "scale_nan": ({"scale": NAN}, ValueError, "scale"),
    "mask_int": ({"mask": "int"}, TypeError, "mask"),
    "mask_list": ({"mask": "list"}, TypeError, "mask"),
    "mask_device": ({"mask": "meta"}, ValueError, "mask"),
    "mask_shape": ({"mask": "shape"}, ValueError, "mask"),
    "mask_grows_x": ({"mask": "grows"}, ValueError, "mask"),
    "causal_int": ({"causal": 1}, TypeError, "causal"),
    "causal_none": ({"causal": None}, TypeError, "causal"),
    "causal_str": ({"causal": "yes"}, TypeError, "causal"),
    "causal_1d": ({"causal": True, "x": "1d"}, ValueError, "causal"),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_argument_errors(no_dispatch, case):
    kwargs, exc, name = ERROR_CASES[case]
    kwargs = dict(kwargs)
    x = torch.randn(2, 3, 5, 7, requires_grad=True)
    if kwargs.pop("x", None) == "1d":
        x = torch.randn(7, requires_grad=True)
    special = {
        "tensor": lambda: torch.tensor(2.0),
        "int": lambda: torch.ones(5, 7, dtype=torch.int64),
        "list": lambda: [[True] * 7] * 5,
        "meta": _meta_mask,
        "shape": lambda: torch.ones(3, 7, dtype=torch.bool),
        "grows": lambda: torch.ones(4, 2, 3, 5, 7, dtype=torch.bool),
    }
    for key, value in kwargs.items():
        if isinstance(value, str) and value in special:
            kwargs[key] = special[value]()
    with pytest.raises(exc, match=rf"^{name}\b"):
        fused_softmax(x, **kwargs)


# --------------------------------------------------------------------------- empty tensors


@pytest.mark.parametrize("shape,mshape,causal", [
    ((0, 7), (7,), False),
    ((0, 7), (0, 7), True),
    ((2, 0, 7), (1, 1, 7), True),  # Q = 0
    ((0, 3, 5, 7), (5, 7), True),
], ids=str)
def test_empty(backend, shape, mshape, causal):
    for kind in ("bool", "float"):
        x = torch.randn(shape, requires_grad=True)
        mask = make_mask(kind, mshape).requires_grad_(kind == "float")
        y = fused_softmax(x, scale=0.5, mask=mask, causal=causal)
        assert y.shape == x.shape and y.dtype == x.dtype
        y.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
        if kind == "float":
            assert mask.grad is not None and mask.grad.shape == mask.shape
            assert (mask.grad == 0).all()


@pytest.mark.parametrize("shape,kwargs", [((3, 0), {"scale": 2.0}),
                                          ((2, 4, 0), {"causal": True})], ids=str)
def test_empty_softmax_dim(shape, kwargs):
    x = torch.randn(shape, requires_grad=True)
    assert fused_softmax(x).shape == x.shape  # the plain call follows torch
    y = fused_softmax(x, **kwargs)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape


# --------------------------------------------------------------------------- long rows (Triton)


def test_looped_kernels(triton_backend, small_single_block):
    """Rows longer than the (shrunk) single-block limit take the looped kernels, if the masked
    kernels have them: whole first chunks masked, a fully masked row, a float mask with its
    gradient, causal rows ending inside a chunk."""
    torch.manual_seed(25)
    x = torch.randn(1, 1, 3, 50) * 3
    bmask = torch.ones(1, 1, 3, 50, dtype=torch.bool)
    bmask[..., 0, :35] = False
    bmask[..., 2, :] = False
    y, dx, _ = check(x, scale=0.5, mask=bmask)
    assert (y[..., 2, :] == 0).all() and (dx[..., 2, :] == 0).all()
    check(x, scale=0.5, mask=float_mask((1, 1, 1, 50), seed=25), grad_mask=True)
    check(torch.randn(1, 3, 50), scale=0.9, causal=True)


# --------------------------------------------------------------------------- torch.compile


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compile_fullgraph(fresh_dynamo):
    """torch.compile(fullgraph=True) (aot_eager, as tests/test_compile.py) of a function calling
    fused_softmax with scale, a bool mask and causal, and with a float mask that requires grad:
    no graph break, the same values and gradients as eager."""
    torch.manual_seed(26)
    x = torch.randn(2, 2, 5, 6)
    bmask = bool_mask((2, 1, 1, 6), seed=26)
    fmask = float_mask((1, 1, 5, 6), seed=26, neg_inf=0.1)

    def fn(x, bmask, fmask):
        return (fused_softmax(x, scale=0.5, mask=bmask, causal=True)
                + 2 * fused_softmax(x, mask=fmask, causal=True))

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    dy = torch.randn(x.shape)
    results = []
    for f in (compiled, fn):
        xl = x.clone().requires_grad_(True)
        fl = fmask.clone().requires_grad_(True)
        y = f(xl, bmask, fl)
        y.backward(dy)
        results.append((y.detach(), xl.grad, fl.grad))
    (y_c, dx_c, dm_c), (y_e, dx_e, dm_e) = results
    assert y_c.dtype == y_e.dtype == torch.float32
    torch.testing.assert_close(y_c, y_e, **tol(torch.float32))
    torch.testing.assert_close(dx_c, dx_e, **tol(torch.float32, scale=GRAD_SCALE))
    # dmask: a sum over the 2 * 2 broadcast rows.
    torch.testing.assert_close(dm_c, dm_e, **tol(torch.float32, scale=GRAD_SCALE * 2))
    y64 = (ref_masked_softmax(x.double(), 0.5, bmask, True)
           + 2 * ref_masked_softmax(x.double(), None, fmask, True))
    assert_close_to_ref(y_c, y64, torch.float32, scale=3)  # a sum of two outputs, one doubled


@pytest.mark.parametrize("shape,target", [
    ((), (2, 3)), ((3,), (2, 3)), ((1, 3), (2, 3)), ((2, 1), (2, 3)), ((4,), (2, 3)),
    ((2, 3), (3,)), ((1, 1, 1), (2, 3)), ((2, 1, 1, 5), (2, 3, 4, 5)), ((5, 1, 1, 5), (2, 3, 4, 5)),
    ((0,), (2, 0)), ((1,), (2, 0)), ((2,), (2, 0)), ((0,), (1,)), ((1, 0), (3, 0)),
])
def test_broadcasts_to_matches_torch(shape, target):
    """The host-side broadcast check of the mask (plain Python) agrees with torch's rule."""
    from fusedops._validate import broadcasts_to

    try:
        want = torch.broadcast_shapes(shape, target) == torch.Size(target)
    except RuntimeError:
        want = False
    assert broadcasts_to(shape, target) == want
