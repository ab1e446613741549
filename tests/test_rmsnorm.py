"""fused_rmsnorm / RMSNormFunction / FusedRMSNorm against a float64 PyTorch oracle (reference
and Triton backends), and patch_model's RMSNorm routing.

Every case checks the forward output and each gradient asked for (dx, dweight). The Triton path
runs through the interpreter on CPU, so tensors stay small; the kernels' own boundary cases are
in tests/test_rmsnorm_triton.py.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_to_ref, assert_row_sum_close, exhaustive_unless, one_of_each
from torch import nn

import fusedops
from fusedops import FusedRMSNorm, RMSNormFunction, fused_rmsnorm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Tensors are created on the GPU when there is one (conftest's _tensors_on_device).
ON_DEVICE = True

SIZES = [1, 31, 32, 33, 1000, 1024, 1025, 4097]


def _param(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)  # CPU generator: same values on every device
    w = (1 + 0.5 * torch.randn(shape, generator=g, device="cpu")).to(dtype)
    return w.to(torch.empty(0).device)


def ref_rmsnorm(x, shape, w, eps, dy):
    """float64 oracle: y and the gradients (dx, dw) of F.rms_norm in float64."""
    x64 = x.detach().double().requires_grad_(True)
    w64 = None if w is None else w.detach().double().requires_grad_(True)
    y64 = F.rms_norm(x64, shape, w64, eps)
    inputs = [t for t in (x64, w64) if t is not None]
    grads = torch.autograd.grad(y64, inputs, dy.double())
    return y64.detach(), grads[0], (grads[1] if w is not None else None)


def check(x, shape, w=None, eps=None, dy=None, need=(True, True), grad_scale=4.0):
    """Forward and the requested gradients of fused_rmsnorm against the float64 oracle (with
    torch's eps=None rule: float32's epsilon for 16-bit and float32 inputs)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if dy is None:
        dy = torch.randn(x.shape).to(x.dtype)
    xl = x.detach().clone().requires_grad_(need[0])
    wl = None if w is None else w.detach().clone().requires_grad_(need[1])
    y = fused_rmsnorm(xl, shape, wl, eps)
    assert y.dtype == x.dtype and y.shape == x.shape
    ref_eps = torch.finfo(torch.float32).eps if eps is None else eps
    y64, dx64, dw64 = ref_rmsnorm(x, shape, w, ref_eps, dy)
    assert_close_to_ref(y, y64, x.dtype)
    if not y.requires_grad:
        return y
    y.backward(dy)
    if need[0]:
        assert xl.grad.dtype == x.dtype and xl.grad.shape == x.shape
        assert_close_to_ref(xl.grad, dx64, x.dtype, scale=grad_scale)
    else:
        assert xl.grad is None
    if wl is not None:
        if not need[1]:
            assert wl.grad is None
        else:
            rows = max(x.numel() // max(math.prod(shape), 1), 1)
            assert wl.grad.dtype == wl.dtype and wl.grad.shape == wl.shape
            # a float32 sum over rows, compared in the weight's own dtype (not x's)
            assert_row_sum_close(wl.grad, dw64, rows, scale=grad_scale)
    return y


_SIZES_DIAGONAL = one_of_each({"n": SIZES, "dtype": DTYPES}, {"backend": "reference"})


# Default run: the reference at every size and dtype, the kernels on the diagonal (every size
# and every dtype once), its rows of 4097 in float32.
@exhaustive_unless(lambda backend, n, dtype: backend == "reference"
                   or (dtype, n) == (torch.float32, 4097)
                   or (n != 4097 and _SIZES_DIAGONAL(backend=backend, n=n, dtype=dtype)))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sizes(backend, n, dtype):
    torch.manual_seed(n)
    x = (torch.randn(5 if n <= 1025 else 2, n) * 2 + 0.5).to(dtype)
    check(x, n, _param(n, dtype, seed=n))


# (the kernels on the diagonal: every row count and every row length once; the reference on
# all)
@exhaustive_unless(one_of_each({"m": [1, 2, 3, 7, 13, 64], "n": [1, 5, 32, 33]},
                               {"backend": "reference"}))
@pytest.mark.parametrize("m", [1, 2, 3, 7, 13, 64])
@pytest.mark.parametrize("n", [1, 5, 32, 33])
def test_row_count_tails(backend, m, n):
    """Short rows packed several per program, dweight from per-program partials."""
    torch.manual_seed(m * 100 + n)
    check(torch.randn(m, n), n, _param(n, torch.float32, seed=m))


# (the kernels on the diagonal: every weight variant and every dtype once)
@exhaustive_unless(one_of_each({"weight": ["none", "same", "float32"], "dtype": DTYPES},
                               {"backend": "reference"}))
@pytest.mark.parametrize("weight", ["none", "same", "float32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weight_variants(backend, weight, dtype):
    """No weight, a weight in x's dtype, float32 weight with 16-bit x (mixed precision): the
    output follows x, dweight the weight."""
    w = None if weight == "none" else _param(40, dtype if weight == "same" else torch.float32)
    check(torch.randn(6, 40).to(dtype), 40, w)


# (the kernels with one of the two gradients; the others exhaustive)
@exhaustive_unless(lambda backend, need: backend == "reference" or sum(need) == 1)
@pytest.mark.parametrize("need", [(True, False), (False, True), (True, True), (False, False)],
                         ids=lambda t: "".join("xw"[i] for i, v in enumerate(t) if v) or "none")
def test_requires_grad_subsets(backend, need):
    torch.manual_seed(1)
    check(torch.randn(5, 33), 33, _param(33, torch.float32), need=need)


@pytest.mark.parametrize("eps", [None, 0.0, 1e-6, 1e-2, 1])
def test_eps(backend, eps):
    torch.manual_seed(2)
    x = torch.randn(4, 24) * 1e-2  # small rows: eps matters
    check(x, 24, _param(24, torch.float32), eps=eps)


def test_eps_none_is_torchs_rule(backend):
    """eps=None: float32's machine epsilon for float32/16-bit inputs, as F.rms_norm."""
    x = torch.randn(3, 16) * 1e-4
    for dtype in DTYPES:
        xd = x.to(dtype)
        assert_close_to_ref(fused_rmsnorm(xd, 16), F.rms_norm(xd.double(), (16,),
                                                              eps=torch.finfo(torch.float32).eps),
                            dtype)


@pytest.mark.parametrize("x_shape,ns", [((2, 3, 9), 9), ((3, 4, 5), (4, 5)),
                                        ((2, 3, 4), (2, 3, 4)), ((2, 2, 3, 9), [9])], ids=str)
def test_shapes(backend, x_shape, ns):
    torch.manual_seed(3)
    shape = (ns,) if isinstance(ns, int) else tuple(ns)
    check(torch.randn(x_shape), shape, _param(shape, torch.float32))
    check(torch.randn(x_shape), shape, None)


def test_non_contiguous(backend):
    torch.manual_seed(4)
    wide = torch.randn(6, 48)
    check(wide[:, 5:42], 37, _param(37, torch.float32))  # row stride 48, storage offset 5
    check(torch.randn(37, 6).t(), 37, None)  # transposed: one copy into rows
    check(torch.randn(1, 37).expand(4, 37), 37, _param(37, torch.float32))  # row stride 0
    check(torch.randn(3, 37), 37, _param(37, torch.float32),
          dy=torch.randn(1, 37).expand(3, 37))  # a zero-stride gradient
    w = torch.randn(2, 37)[0]  # a weight view
    check(torch.randn(3, 37), 37, w)


@pytest.mark.parametrize("x_shape,ns", [((0, 8), 8), ((2, 0, 8), 8), ((3, 0), 0)], ids=str)
def test_empty(backend, x_shape, ns):
    x = torch.randn(x_shape, requires_grad=True)
    w = torch.randn(ns, requires_grad=True)
    y = fused_rmsnorm(x, (ns,), w)
    assert y.shape == x.shape and y.dtype == x.dtype
    y.sum().backward()
    assert x.grad.shape == x.shape
    torch.testing.assert_close(w.grad, torch.zeros(ns))


def test_special_values(backend):
    """inf / nan in a row spread to that row only, as in torch (an inf makes the mean square
    infinite: the row's other elements come out 0, the inf NaN); zero rows give zeros."""
    x = torch.randn(4, 20)
    x[0, 3] = float("inf")
    x[1, 5] = float("nan")
    x[2] = 0
    got = fused_rmsnorm(x, 20)
    want = F.rms_norm(x, (20,))
    torch.testing.assert_close(got, want, equal_nan=True, atol=1e-5, rtol=1e-5)


def test_large_values_do_not_overflow(backend):
    """float16 rows near the top of the range: the mean square is accumulated in float32."""
    x = torch.full((2, 64), 6e4, dtype=torch.float16)
    torch.testing.assert_close(fused_rmsnorm(x, 64), torch.ones(2, 64, dtype=torch.float16))


@pytest.mark.parametrize("affine", [True, False])
def test_gradcheck_float64(affine):
    """float64 runs the reference path (the kernels' dtypes are float32/16-bit)."""
    torch.manual_seed(5)
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True) if affine else None
    inputs = (x, w) if affine else (x,)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time float64 fallback warning
        def fn(*t):
            return fused_rmsnorm(t[0], 7, t[1] if affine else None, 1e-5)

        assert torch.autograd.gradcheck(fn, inputs)
        assert torch.autograd.gradgradcheck(fn, inputs)


def test_double_backward_float32(backend):
    """create_graph=True: the gradient is itself differentiable (second derivatives)."""
    torch.manual_seed(6)
    x = torch.randn(3, 9, requires_grad=True)
    w = torch.randn(9, requires_grad=True)
    (gx,) = torch.autograd.grad(fused_rmsnorm(x, 9, w).square().sum(), x, create_graph=True)
    (gx_ref,) = torch.autograd.grad(F.rms_norm(x, (9,), w).square().sum(), x,
                                    create_graph=True)
    torch.testing.assert_close(gx, gx_ref, atol=1e-5, rtol=1e-5)
    hx = torch.autograd.grad(gx.sum(), (x, w))
    hx_ref = torch.autograd.grad(gx_ref.sum(), (x, w))
    for a, b in zip(hx, hx_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_saved_rstd_is_float32(backend):
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    y = RMSNormFunction.apply(x, 16, None, 1e-6, torch.bfloat16)
    (_, _, rstd) = y.grad_fn.saved_tensors
    assert rstd.dtype == torch.float32 and rstd.shape == (4,)
    want = torch.rsqrt(x.detach().float().square().mean(-1) + 1e-6)
    torch.testing.assert_close(rstd, want, atol=1e-6, rtol=1e-5)


def test_deterministic_dweight(backend):
    torch.manual_seed(7)
    x = torch.randn(67, 48)
    dy = torch.randn(67, 48)
    grads = []
    for _ in range(2):
        w = torch.ones(48, requires_grad=True)
        fused_rmsnorm(x, 48, w).backward(dy)
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1])


def test_inference_matches_training_forward(backend):
    torch.manual_seed(8)
    x = torch.randn(5, 40)
    w = _param(40, torch.float32)
    with torch.no_grad():
        a = fused_rmsnorm(x, 40, w)
    b = fused_rmsnorm(x.requires_grad_(), 40, w)
    assert torch.equal(a, b.detach())


# ------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("call,err,match", [
    (lambda x: fused_rmsnorm(x.long(), 8), TypeError, "x must be a floating-point"),
    (lambda x: fused_rmsnorm("x", 8), TypeError, "x must be a torch.Tensor"),
    (lambda x: fused_rmsnorm(x, 7), ValueError, "normalized_shape"),
    (lambda x: fused_rmsnorm(x, 8, torch.ones(7)), ValueError, "weight must have shape"),
    (lambda x: fused_rmsnorm(x, 8, torch.ones(8).long()), TypeError, "weight"),
    (lambda x: fused_rmsnorm(x, 8, eps=-1.0), ValueError, "eps"),
    (lambda x: fused_rmsnorm(x, 8, eps="1"), ValueError, "eps"),
    (lambda x: fused_rmsnorm(x, [1.5]), TypeError, "normalized_shape"),
], ids=["int x", "not a tensor", "shape", "weight shape", "int weight", "negative eps",
        "str eps", "float shape"])
def test_bad_input(call, err, match):
    with pytest.raises(err, match=match):
        call(torch.randn(2, 8))


# ------------------------------------------------------------------------------- module, patch


def test_module_is_a_drop_in():
    ref = nn.RMSNorm((4, 6), eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(4, 6))
    fused = FusedRMSNorm((4, 6), eps=1e-6)
    fused.load_state_dict(ref.state_dict())
    assert list(fused.state_dict()) == list(ref.state_dict()) == ["weight"]
    assert repr(fused) == repr(ref).replace("RMSNorm", "FusedRMSNorm")
    assert isinstance(fused, nn.RMSNorm)
    x = torch.randn(3, 4, 6)
    torch.testing.assert_close(fused(x), ref(x), atol=1e-5, rtol=1e-5)
    assert FusedRMSNorm(8, elementwise_affine=False).weight is None


class _RMSModel(nn.Module):
    """An nn.RMSNorm module, a functional F.rms_norm and torch.rms_norm in one forward."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(16, eps=1e-6)
        self.proj = nn.Linear(16, 16)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(16))

    def forward(self, x):
        h = self.proj(self.norm(x))
        h = F.rms_norm(h, (16,), self.scale)
        return torch.rms_norm(h, [16], None, 1e-5)


def test_patch_model_routes_rmsnorm():
    torch.manual_seed(9)
    model = _RMSModel()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 16)
    report = fusedops.patch_model(model, example_inputs=x, force=True)
    assert [r["name"] for r in report.replaced] == ["norm"]
    assert report.replaced[0]["fused_type"] == "FusedRMSNorm"
    assert report.replaced[0]["config"] == "eps=1e-06, weight=yes"
    v = report.verification  # the module and the functional calls
    assert v["module_calls"]["rmsnorm"] + v["routed_calls"]["rmsnorm"] == 3
    assert report.max_abs_diff < 1e-5
    # training matches the unpatched twin
    xg = torch.randn(4, 16)
    model(xg).square().sum().backward()
    ref(xg).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=name)
    fusedops.unpatch_model(model)
    assert type(model.norm) is nn.RMSNorm


def test_patch_model_rmsnorm_subset_and_exclusions():
    model = _RMSModel()
    report = fusedops.patch_model(model, ops=("layernorm",), example_inputs=torch.randn(2, 16),
                                  force=True)
    assert report.replaced == [] and report.verification["routed_calls"]["rmsnorm"] == 0
    assert [s["name"] for s in report.skipped] == ["norm"]
    report = fusedops.patch_model(model, ops="rmsnorm", example_inputs=torch.randn(2, 16),
                                  force=True)
    v = report.verification
    assert v["module_calls"]["rmsnorm"] + v["routed_calls"]["rmsnorm"] == 3
    assert report.verification["routed_calls"]["layernorm"] == 0
    fusedops.unpatch_model(model)


def test_patch_model_leaves_unprovable_calls_alone():
    """Calls the fused op cannot take as they are (named shapes that do not match, integer
    inputs) go to torch, which keeps its own errors."""

    class Bad(nn.Module):
        def forward(self, x):
            return F.rms_norm(x, (7,))

    model = Bad()
    assert fusedops.patch_model(model, force=True).routed_functions  # routed, yet:
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 8))


def test_compile_fullgraph():
    torch._dynamo.reset()
    w = torch.randn(32)
    fn = torch.compile(lambda t: fused_rmsnorm(t, 32, w), fullgraph=True, backend="eager")
    x = torch.randn(4, 32)
    torch.testing.assert_close(fn(x), F.rms_norm(x, (32,), w), atol=1e-5, rtol=1e-5)
    xg = x.clone().requires_grad_()
    fn(xg).sum().backward()
    xr = x.clone().requires_grad_()
    F.rms_norm(xr, (32,), w).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad, atol=1e-5, rtol=1e-5)
