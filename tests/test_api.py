"""Public API: export surface, argument checking, backend control and fallbacks, modules.

These run on the default path (the PyTorch reference for CPU tensors) unless a test forces a
backend; kernel numerics live in test_softmax.py / test_layernorm.py.
"""

from __future__ import annotations

import copy
import inspect
import io
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA, triton_kernels_ready
from torch import nn

import fusedops
from fusedops import (
    FusedLayerNorm,
    FusedSoftmax,
    LayerNormFunction,
    SoftmaxFunction,
    _dispatch,
    count_fused_calls,
    fused_layernorm,
    fused_softmax,
)

needs_triton = pytest.mark.skipif(not triton_kernels_ready(), reason="Triton kernels unavailable")
# Tests that force the Triton backend put their tensors where the kernels can run: the GPU when
# there is one (compiled kernels), else the CPU (interpreter).
DEV = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which one-time warnings were already given, and drop the backend cache."""
    monkeypatch.setattr(_dispatch, "_warned", set())
    _dispatch._cache.clear()
    yield
    _dispatch._cache.clear()


# --------------------------------------------------------------------------- export surface

CORE_NAMES = {
    "fused_softmax",
    "fused_layernorm",
    "SoftmaxFunction",
    "LayerNormFunction",
    "FusedSoftmax",
    "FusedLayerNorm",
    "set_backend",
    "get_backend",
    "use_backend",
    "count_fused_calls",
}


def test_export_surface():
    assert CORE_NAMES <= set(fusedops.__all__)
    for name in fusedops.__all__:
        assert hasattr(fusedops, name), name
    namespace: dict = {}
    exec("from fusedops import *", namespace)
    assert CORE_NAMES <= set(namespace)
    assert isinstance(fusedops.__version__, str) and fusedops.__version__.count(".") >= 1


def test_function_classes():
    assert issubclass(SoftmaxFunction, torch.autograd.Function)
    assert issubclass(LayerNormFunction, torch.autograd.Function)
    x = torch.randn(3, 5, requires_grad=True)
    y = SoftmaxFunction.apply(x, 1, torch.float32)
    torch.testing.assert_close(y, torch.softmax(x, 1))
    y.sum().backward()
    assert x.grad.shape == x.shape
    w = torch.randn(5, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    y = LayerNormFunction.apply(x, 5, w, b, 1e-5, torch.float32)
    torch.testing.assert_close(y, F.layer_norm(x, (5,), w, b))
    y.sum().backward()
    assert w.grad.shape == b.grad.shape == (5,)


def test_import_without_gpu_is_cheap():
    """``import fusedops`` works without a GPU and does not start CUDA."""
    code = (
        "import fusedops, torch, sys; "
        "assert not torch.cuda.is_initialized(); "
        "print(fusedops.get_backend())"
    )
    env = {k: v for k, v in os.environ.items() if k != "FUSEDOPS_BACKEND"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"


# --------------------------------------------------------------------------- bad inputs


@pytest.fixture
def no_kernel(monkeypatch):
    """Bad input must raise before any backend is even chosen."""

    def fail(*args, **kwargs):
        raise AssertionError("a backend was reached before the arguments were checked")

    monkeypatch.setattr(_dispatch, "backend_for", fail)


X = torch.randn(2, 3)

SOFTMAX_BAD = [
    ("int_tensor", lambda: fused_softmax(torch.ones(2, 3, dtype=torch.int64)), TypeError, "x"),
    ("bool_tensor", lambda: fused_softmax(torch.ones(2, 3, dtype=torch.bool)), TypeError, "x"),
    ("complex", lambda: fused_softmax(torch.ones(2, 3, dtype=torch.complex64)), TypeError, "x"),
    ("not_a_tensor", lambda: fused_softmax([[1.0, 2.0]]), TypeError, "x"),
    ("dim_too_big", lambda: fused_softmax(X, 2), ValueError, "dim"),
    ("dim_too_small", lambda: fused_softmax(X, -3), ValueError, "dim"),
    ("dim_0d", lambda: fused_softmax(torch.tensor(1.0), 1), ValueError, "dim"),
    ("dim_float", lambda: fused_softmax(X, 1.0), TypeError, "dim"),
    ("dim_bool", lambda: fused_softmax(X, True), TypeError, "dim"),
    ("dim_none", lambda: fused_softmax(X, None), TypeError, "dim"),
    ("dtype_int", lambda: fused_softmax(X, 1, dtype=torch.int32), TypeError, "dtype"),
    ("dtype_str", lambda: fused_softmax(X, 1, dtype="float32"), TypeError, "dtype"),
    ("dtype_complex", lambda: fused_softmax(X, 1, dtype=torch.complex64), TypeError, "dtype"),
]

W4 = torch.ones(4)
X4 = torch.randn(2, 4)
LAYERNORM_BAD = [
    ("int_tensor", lambda: fused_layernorm(torch.ones(2, 4, dtype=torch.int32), 4), TypeError,
     "input|x"),
    ("not_a_tensor", lambda: fused_layernorm([[1.0] * 4], 4), TypeError, "input|x"),
    ("shape_mismatch", lambda: fused_layernorm(X4, 5), ValueError, "normalized_shape"),
    ("shape_mismatch_2d", lambda: fused_layernorm(X4, (3, 4)), ValueError, "normalized_shape"),
    ("shape_too_long", lambda: fused_layernorm(X4, (1, 2, 4)), ValueError, "normalized_shape"),
    ("shape_empty", lambda: fused_layernorm(X4, ()), ValueError, "normalized_shape"),
    ("shape_negative", lambda: fused_layernorm(X4, -4), ValueError, "normalized_shape"),
    ("shape_float", lambda: fused_layernorm(X4, 4.0), TypeError, "normalized_shape"),
    ("shape_float_item", lambda: fused_layernorm(X4, [4.0]), TypeError, "normalized_shape"),
    ("shape_bool", lambda: fused_layernorm(X4, True), TypeError, "normalized_shape"),
    ("weight_shape", lambda: fused_layernorm(X4, 4, torch.ones(5)), ValueError, "weight"),
    ("weight_shape_2d", lambda: fused_layernorm(X4, 4, torch.ones(1, 4)), ValueError, "weight"),
    ("bias_shape", lambda: fused_layernorm(X4, 4, W4, torch.ones(3)), ValueError, "bias"),
    ("weight_int", lambda: fused_layernorm(X4, 4, torch.ones(4, dtype=torch.int64)), TypeError,
     "weight"),
    ("bias_int", lambda: fused_layernorm(X4, 4, None, torch.ones(4, dtype=torch.int64)),
     TypeError, "bias"),
    ("weight_list", lambda: fused_layernorm(X4, 4, [1.0] * 4), TypeError, "weight"),
    ("weight_device", lambda: fused_layernorm(X4, 4, torch.ones(4, device="meta")), ValueError,
     "weight"),
    ("bias_device", lambda: fused_layernorm(X4, 4, W4, torch.ones(4, device="meta")), ValueError,
     "bias"),
    ("eps_negative", lambda: fused_layernorm(X4, 4, eps=-1e-5), ValueError, "eps"),
    ("eps_str", lambda: fused_layernorm(X4, 4, eps="1e-5"), (TypeError, ValueError), "eps"),
    ("eps_none", lambda: fused_layernorm(X4, 4, eps=None), (TypeError, ValueError), "eps"),
    ("eps_nan", lambda: fused_layernorm(X4, 4, eps=float("nan")), ValueError, "eps"),
]


@pytest.mark.parametrize("call,exc,name", [c[1:] for c in SOFTMAX_BAD],
                         ids=[c[0] for c in SOFTMAX_BAD])
def test_softmax_bad_input(no_kernel, call, exc, name):
    with pytest.raises(exc, match=name):
        call()


@pytest.mark.parametrize("call,exc,name", [c[1:] for c in LAYERNORM_BAD],
                         ids=[c[0] for c in LAYERNORM_BAD])
def test_layernorm_bad_input(no_kernel, call, exc, name):
    with pytest.raises(exc, match=name):
        call()


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_bad_input_under_forced_backend(backend_name):
    """Forcing a backend changes nothing about argument checking."""
    if backend_name == "triton" and not triton_kernels_ready():
        pytest.skip("Triton kernels unavailable")
    with fusedops.use_backend(backend_name):
        with pytest.raises(TypeError, match="x"):
            fused_softmax(torch.arange(4))
        with pytest.raises(ValueError, match="normalized_shape"):
            fused_layernorm(X4, 3)
        with pytest.raises(ValueError, match="weight"):
            fused_layernorm(X4, 4, torch.ones(4, device="meta"))


@pytest.mark.parametrize("backend_name", [None, "reference"])
def test_valid_edge_arguments(backend_name):
    """Spellings torch accepts too give torch's results (native and fusedops' own path)."""
    w = torch.ones(4, dtype=torch.float64).float()
    cases = [
        (lambda: fused_softmax(torch.tensor(1.0), -1),
         lambda: torch.softmax(torch.tensor(1.0), -1)),
        (lambda: fused_softmax(X, dim=-2), lambda: torch.softmax(X, -2)),
        (lambda: fused_softmax(X, torch.tensor(1).item()), lambda: torch.softmax(X, 1)),
        (lambda: fused_layernorm(X4, 4, eps=0), lambda: F.layer_norm(X4, (4,), eps=0.0)),
        (lambda: fused_layernorm(X4, torch.Size([4])), lambda: F.layer_norm(X4, (4,))),
        (lambda: fused_layernorm(X4, [2, 4]), lambda: F.layer_norm(X4, (2, 4))),
        (lambda: fused_layernorm(X4, 4, w), lambda: F.layer_norm(X4, (4,), w)),
    ]
    with fusedops.use_backend(backend_name):
        for ours, theirs in cases:
            torch.testing.assert_close(ours(), theirs(), atol=1e-6, rtol=1e-5)


def test_modules_check_inputs():
    with pytest.raises(ValueError, match="normalized_shape"):
        FusedLayerNorm(4)(torch.randn(2, 5))
    with pytest.raises(TypeError):
        FusedSoftmax(dim=1)(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="dim"):
        FusedSoftmax(dim=3)(torch.randn(2, 3))


# --------------------------------------------------------------------------- backend control


def test_set_get_use_backend():
    assert fusedops.get_backend() is None or "FUSEDOPS_BACKEND" in os.environ
    before = fusedops.get_backend()
    try:
        fusedops.set_backend("TRITON")
        assert fusedops.get_backend() == "triton"
        fusedops.set_backend("")
        assert fusedops.get_backend() is None
        fusedops.set_backend("reference")
        with fusedops.use_backend("metal"):
            assert fusedops.get_backend() == "metal"
            with fusedops.use_backend(None):
                assert fusedops.get_backend() is None
            assert fusedops.get_backend() == "metal"
        assert fusedops.get_backend() == "reference"
        with pytest.raises(ValueError, match="backend"):
            fusedops.set_backend("cuda")
        assert fusedops.get_backend() == "reference"  # unchanged by the failed call
        with pytest.raises(RuntimeError, match="boom"), fusedops.use_backend("triton"):
            raise RuntimeError("boom")
        assert fusedops.get_backend() == "reference"
    finally:
        fusedops.set_backend(before)


def test_default_selection_on_cpu(fresh_warnings):
    from fusedops.backends import reference

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        assert _dispatch.backend_for(torch.empty(1, dtype=dtype)) is reference
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CPU tensors use the reference silently
        fused_softmax(torch.randn(2, 3), -1)
        fused_layernorm(torch.randn(2, 3), 3)


@needs_triton
def test_forced_triton_selection(fresh_warnings):
    with fusedops.use_backend("triton"):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            assert _dispatch.backend_for(torch.empty(1, dtype=dtype, device=DEV)).NAME == "triton"


@needs_triton
def test_float64_falls_back_with_one_warning(fresh_warnings):
    x = torch.randn(3, 7, dtype=torch.float64, device=DEV, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, device=DEV, requires_grad=True)
    with fusedops.use_backend("triton"):
        with pytest.warns(UserWarning, match="float64") as record:
            y = fused_softmax(x, -1)
        assert len(record) == 1
        assert "PyTorch's own ops" in str(record[0].message)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # second call, other op, backward: no new warning
            y2 = fused_softmax(x, 0)
            z = fused_layernorm(x, 7, w)
            (y.sum() + (y2 * 2).sum() + (z * z).sum()).backward()
    torch.testing.assert_close(y, torch.softmax(x, -1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z, F.layer_norm(x, (7,), w), rtol=1e-12, atol=1e-12)
    with fusedops.use_backend("triton"), warnings.catch_warnings():
        warnings.simplefilter("error")  # re-forcing clears the cache, not the once-only record
        fused_softmax(x, -1)


@needs_triton
def test_float64_fallback_not_counted_as_fused(fresh_warnings):
    x = torch.randn(3, 7, dtype=torch.float64, device=DEV)
    with fusedops.use_backend("triton"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with count_fused_calls() as counts:
            fused_softmax(x, -1)
            fused_softmax(x.float(), -1)
    assert counts["softmax_forward"] == 1


def test_unavailable_backend_falls_back_once(fresh_warnings):
    """Forcing the Metal backend where it cannot run (any Linux box): reference + one warning."""
    x = torch.randn(3, 5)
    with fusedops.use_backend("metal"):
        with pytest.warns(UserWarning, match="metal") as record:
            y = fused_softmax(x, -1)
            z = fused_layernorm(x, 5)
        assert len(record) == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fused_softmax(x, 0)
    torch.testing.assert_close(y, torch.softmax(x, -1))
    torch.testing.assert_close(z, F.layer_norm(x, (5,)))


def test_triton_missing_falls_back(fresh_warnings, monkeypatch):
    import fusedops.backends.triton as triton_backend

    monkeypatch.setattr(triton_backend, "AVAILABLE", False)
    x = torch.randn(3, 5)
    with fusedops.use_backend("triton"):
        with pytest.warns(UserWarning, match="triton"):
            y = fused_softmax(x, -1)
        assert _dispatch.backend_for(x).NAME == "reference"
    torch.testing.assert_close(y, torch.softmax(x, -1))


# (exhaustive: a fresh interpreter each; set_backend, which takes the variable's value, runs
# by default in test_set_get_use_backend)
@pytest.mark.exhaustive
@pytest.mark.parametrize("value,expected", [("reference", "reference"), ("Triton", "triton")])
def test_env_var_forces_backend(value, expected):
    env = dict(os.environ, FUSEDOPS_BACKEND=value)
    out = subprocess.run([sys.executable, "-c", "import fusedops; print(fusedops.get_backend())"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected


# (exhaustive: a fresh interpreter; set_backend, which takes the variable's value, rejects the
# same name in test_set_get_use_backend by default)
@pytest.mark.exhaustive
def test_env_var_invalid_is_an_error():
    env = dict(os.environ, FUSEDOPS_BACKEND="cuda")
    out = subprocess.run([sys.executable, "-c", "import fusedops"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0
    assert "ValueError" in out.stderr and "backend" in out.stderr


# --------------------------------------------------------------------------- count_fused_calls


def test_count_fused_calls_reference_counts_nothing():
    with fusedops.use_backend("reference"), count_fused_calls() as counts:
        x = torch.randn(2, 3, requires_grad=True)
        fused_softmax(x, -1).sum().backward()
        fused_layernorm(x, 3).sum().backward()
    assert sum(counts.values()) == 0


@needs_triton
def test_count_fused_calls_triton():
    x = torch.randn(2, 8, device=DEV, requires_grad=True)
    w = torch.ones(8, device=DEV, requires_grad=True)
    with fusedops.use_backend("triton"), count_fused_calls() as outer:
        fused_softmax(x.detach(), -1)  # inference path
        with count_fused_calls() as inner:
            fused_softmax(x, -1).sum().backward()
            fused_layernorm(x, 8, w).sum().backward()
            FusedLayerNorm(8, device=DEV)(x.detach())
        assert inner == {"softmax_forward": 1, "softmax_backward": 1, "layernorm_forward": 2,
                         "layernorm_backward": 1}
    assert outer["softmax_forward"] == 2 and outer["layernorm_forward"] == 2
    assert _dispatch._counts is None  # counting is off outside the block
    fused_softmax(x.detach(), -1)


# --------------------------------------------------------------------------- modules


def test_module_classes_and_signatures():
    assert issubclass(FusedSoftmax, nn.Softmax) and issubclass(FusedLayerNorm, nn.LayerNorm)
    assert inspect.signature(FusedSoftmax) == inspect.signature(nn.Softmax)
    assert inspect.signature(FusedLayerNorm) == inspect.signature(nn.LayerNorm)
    # only forward is overridden
    assert "forward" in vars(FusedSoftmax) and "forward" in vars(FusedLayerNorm)
    assert "__init__" not in vars(FusedSoftmax) and "__init__" not in vars(FusedLayerNorm)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"eps": 1e-3}, {"elementwise_affine": False}, {"bias": False},
     {"elementwise_affine": False, "bias": False}, {"dtype": torch.bfloat16},
     {"device": "meta"}],
    ids=str,
)
@pytest.mark.parametrize("shape", [8, (4, 8)], ids=str)
def test_layernorm_module_matches_nn(kwargs, shape):
    ours, theirs = FusedLayerNorm(shape, **kwargs), nn.LayerNorm(shape, **kwargs)
    assert ours.extra_repr() == theirs.extra_repr()
    assert repr(ours) == repr(theirs).replace("LayerNorm", "FusedLayerNorm", 1)
    assert ours.normalized_shape == theirs.normalized_shape and ours.eps == theirs.eps
    sd_ours, sd_theirs = ours.state_dict(), theirs.state_dict()
    assert list(sd_ours) == list(sd_theirs)
    for key in sd_theirs:
        assert sd_ours[key].dtype == sd_theirs[key].dtype
        assert sd_ours[key].shape == sd_theirs[key].shape
        assert sd_ours[key].device == sd_theirs[key].device
        if sd_theirs[key].device.type != "meta":
            assert torch.equal(sd_ours[key], sd_theirs[key])
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]


def test_softmax_module_matches_nn():
    for dim in (None, 0, -1, 2):
        ours, theirs = FusedSoftmax(dim), nn.Softmax(dim)
        assert ours.dim == theirs.dim
        assert ours.extra_repr() == theirs.extra_repr()
        assert repr(ours) == repr(theirs).replace("Softmax", "FusedSoftmax", 1)
        assert ours.state_dict() == {} == theirs.state_dict()
    assert FusedSoftmax(dim=1).dim == 1


def test_load_state_dict_both_ways():
    torch.manual_seed(0)
    theirs = nn.LayerNorm((3, 5))
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    ours = FusedLayerNorm((3, 5))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 3, 5)
    torch.testing.assert_close(ours(x), theirs(x))
    with torch.no_grad():
        ours.weight.mul_(2)
    back = nn.LayerNorm((3, 5))
    back.load_state_dict(ours.state_dict(), strict=True)
    torch.testing.assert_close(back(x), ours(x))
    # missing/unexpected keys are reported exactly as nn.LayerNorm does
    with pytest.raises(RuntimeError, match="bias"):
        FusedLayerNorm((3, 5), bias=False).load_state_dict(theirs.state_dict(), strict=True)


def test_layernorm_module_forward_and_grads():
    torch.manual_seed(1)
    theirs = nn.LayerNorm((4, 6), eps=1e-4)
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    ours = FusedLayerNorm((4, 6), eps=1e-4)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 4, 6, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    dy = torch.randn(3, 4, 6)
    ours(x).backward(dy)
    theirs(x2).backward(dy)
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.bias.grad, theirs.bias.grad, atol=1e-5, rtol=1e-5)


def test_layernorm_module_no_affine_and_dtype_conversion():
    x = torch.randn(2, 8)
    torch.testing.assert_close(FusedLayerNorm(8, elementwise_affine=False)(x),
                               F.layer_norm(x, (8,)))
    torch.testing.assert_close(FusedLayerNorm(8, bias=False)(x), F.layer_norm(x, (8,)))
    m = FusedLayerNorm(8).to(torch.bfloat16)
    y = m(x.bfloat16())
    assert y.dtype == torch.bfloat16 and m.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("ndim", [0, 1, 2, 3, 4])
def test_softmax_module_legacy_dim_none(ndim):
    """dim=None: torch's implicit-dim rule (0 for 0-, 1- and 3-d input, else 1)."""
    x = torch.randn((2, 3, 4, 5)[:ndim])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nn.Softmax() warns about the implicit dim
        expected = nn.Softmax()(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FusedSoftmax() does not
        y = FusedSoftmax()(x)
    torch.testing.assert_close(y, expected)
    legacy = 0 if ndim in (0, 1, 3) else 1
    torch.testing.assert_close(y, torch.softmax(x, legacy))


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax_module_forward_and_grad(dim):
    x = torch.randn(3, 4, 5, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    dy = torch.randn(3, 4, 5)
    FusedSoftmax(dim)(x).backward(dy)
    nn.Softmax(dim)(x2).backward(dy)
    torch.testing.assert_close(x.grad, x2.grad)


def test_modules_copy_and_pickle():
    m = nn.Sequential(nn.Linear(4, 6), FusedLayerNorm(6), FusedSoftmax(-1))
    x = torch.randn(2, 4)
    expected = m(x)
    clone = copy.deepcopy(m)
    assert type(clone[1]) is FusedLayerNorm and type(clone[2]) is FusedSoftmax
    torch.testing.assert_close(clone(x), expected)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded(x), expected)
    # a state_dict saved from fused modules loads into the plain torch model
    plain = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Softmax(-1))
    plain.load_state_dict(m.state_dict())
    torch.testing.assert_close(plain(x), expected)


def test_old_pickle_without_dim():
    """nn.Softmax.__setstate__ fills a missing ``dim`` from old pickles; the subclass keeps it."""
    m = FusedSoftmax(1)
    state = m.__dict__.copy()
    del state["dim"]
    fresh = FusedSoftmax.__new__(FusedSoftmax)
    fresh.__setstate__(state)
    assert fresh.dim is None
    x = torch.randn(2, 3)
    torch.testing.assert_close(fresh(x), torch.softmax(x, 1))


@needs_triton
def test_modules_use_triton_when_forced():
    torch.manual_seed(2)
    x = torch.randn(3, 16, device=DEV).to(torch.float16)
    ln, sm = FusedLayerNorm(16, device=DEV), FusedSoftmax(-1)
    with fusedops.use_backend("triton"), count_fused_calls() as counts:
        y = sm(ln(x))
    assert counts["layernorm_forward"] == 1 and counts["softmax_forward"] == 1
    expected = torch.softmax(F.layer_norm(x.float(), (16,)), -1)
    torch.testing.assert_close(y.float(), expected, atol=2e-3, rtol=2e-3)


# --------------------------------------------------------------------------- double backward


def _second_derivative(softmax, layernorm, dtype=torch.float64, device="cpu"):
    """d/dx of |d(y.v)/dW|^2 with y = softmax(layernorm(x @ W)): needs the ops' double backward."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, dtype=torch.float64, generator=g).to(device, dtype).requires_grad_(True)
    w = torch.randn(5, 5, dtype=torch.float64, generator=g).to(device, dtype).requires_grad_(True)
    v = torch.randn(3, 5, dtype=torch.float64, generator=g).to(device, dtype)
    y = softmax(layernorm(x @ w), -1)
    (gw,) = torch.autograd.grad((y * v).sum(), w, create_graph=True)
    (gx,) = torch.autograd.grad(gw.pow(2).sum(), x)
    return gx


@pytest.mark.parametrize("op", ["softmax", "layernorm"])
@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_double_backward(op, backend_name):
    """Gradient penalties differentiate the backward: the second derivative must match torch's
    (float64 on the reference; float32 through the Triton forward, against float64)."""
    if backend_name == "triton" and not triton_kernels_ready():
        pytest.skip("Triton kernels unavailable")
    dtype, dev = (torch.float64, "cpu") if backend_name == "reference" else (torch.float32, DEV)
    ours = (fused_softmax if op == "softmax" else torch.softmax,
            (lambda t: fused_layernorm(t, 5)) if op == "layernorm" else
            (lambda t: F.layer_norm(t, (5,))))
    expected = _second_derivative(torch.softmax, lambda t: F.layer_norm(t, (5,)))
    with fusedops.use_backend(backend_name):
        got = _second_derivative(*ours, dtype=dtype, device=dev)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(got.double().cpu(), expected, atol=tol, rtol=tol)


def test_cpu_autocast_matches_torch():
    """CPU autocast has its own policy (softmax/layer_norm keep bf16 there): follow torch."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    ln = nn.LayerNorm(8)
    fused_ln = FusedLayerNorm(8)
    fused_ln.load_state_dict(ln.state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ w
        pairs = [
            (fused_softmax(h, -1), torch.softmax(h, -1)),
            (fused_softmax(x, 0), torch.softmax(x, 0)),
            (fused_layernorm(h, 8), F.layer_norm(h, (8,))),
            (fused_ln(h), ln(h)),
        ]
    for ours, theirs in pairs:
        assert ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs, atol=1e-2, rtol=1e-2)
