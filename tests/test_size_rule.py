"""Where the fused ops run PyTorch's own ops: no fused backend (CPU), calls below the size rule
(fusedops._dispatch.NATIVE_BELOW), torch.compile and torch.func; and that those calls are
PyTorch's ops exactly (bitwise), their errors ours."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fusedops
from fusedops import _dispatch

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
def test_no_backend_calls_are_torchs_ops_bitwise(dtype, grad):
    """On CPU (no fused backend) every public op is the native op: same bits, same grads, and
    autograd nodes of torch's own (no Python Function)."""
    torch.manual_seed(0)
    x = torch.randn(6, 40, dtype=dtype, requires_grad=grad)
    w = torch.randn(40, dtype=dtype, requires_grad=grad)
    b = torch.randn(40, dtype=dtype, requires_grad=grad)
    pairs = [
        (fusedops.fused_softmax(x, -1), torch.softmax(x, -1)),
        (fusedops.fused_softmax(x, 0, dtype=torch.float32), torch.softmax(x, 0, torch.float32)),
        (fusedops.fused_layernorm(x, 40, w, b, 1e-5), F.layer_norm(x, (40,), w, b, 1e-5)),
        (fusedops.fused_rmsnorm(x, [40], w), F.rms_norm(x, (40,), w)),
    ]
    for ours, theirs in pairs:
        assert ours.dtype == theirs.dtype
        assert torch.equal(ours, theirs)
        if grad:
            assert type(ours.grad_fn).__name__ == type(theirs.grad_fn).__name__
            g1 = torch.autograd.grad(ours.float().square().sum(), (x, w), allow_unused=True)
            g2 = torch.autograd.grad(theirs.float().square().sum(), (x, w), allow_unused=True)
            for a, c in zip(g1, g2, strict=True):
                assert (a is None) == (c is None) and (a is None or torch.equal(a, c))


def test_no_backend_errors_name_the_argument():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="normalized_shape"):
        fusedops.fused_layernorm(x, 5)
    with pytest.raises(ValueError, match="weight"):
        fusedops.fused_layernorm(x, 8, torch.ones(5))
    with pytest.raises(TypeError, match="weight"):
        fusedops.fused_rmsnorm(x, 8, torch.ones(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="eps"):
        fusedops.fused_layernorm(x, 8, eps=-1.0)
    with pytest.raises(TypeError, match="dim"):
        fusedops.fused_softmax(x, True)
    with pytest.raises(ValueError, match="dim"):
        fusedops.fused_softmax(x, 5)
    with pytest.raises(TypeError, match="x"):
        fusedops.fused_softmax(torch.arange(4), -1)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        fusedops.fused_layernorm([1.0, 2.0], 2)


def test_size_rule_table_for_cuda_keys():
    """The rule in force for CUDA tensors: NATIVE_BELOW per op and autograd need; zeros while a
    backend is forced; inf where no kernel takes the dtype."""
    if not _dispatch.backend_for(torch.empty(0)).NAME == "reference":
        pytest.skip("a backend is forced for CPU tensors here")
    if _dispatch._load("triton") is None:
        pytest.skip("Triton is not installed")
    nodes = getattr(_dispatch._load("triton"), "NATIVE_AUTOGRAD", False)
    for (op, grad), below in _dispatch.NATIVE_BELOW.items():
        if grad is True and nodes and (op, "node") in _dispatch.NATIVE_BELOW:
            below = _dispatch.NATIVE_BELOW[op, "node"]  # (training calls with C++ nodes)
        assert _dispatch.size_rule(op, (True, torch.bfloat16, grad)) == below
        assert _dispatch.size_rule(op, (True, torch.float64, grad)) == math.inf
        assert _dispatch.size_rule(op, ("cpu", torch.float32, grad)) == math.inf
    with fusedops.use_backend("triton"):
        assert _dispatch.size_rule("softmax", (True, torch.bfloat16, True)) == 0
    # A grad-needing call waits for sizes at least as large as an inference call (its host
    # cost is higher). A masked softmax call is always fused (its exact composition costs more);
    # patch_model's attention keeps a BERT-base block of 8x512 tokens (2^24.6 scores) on the
    # model's own function and fuses one of 32x512.
    for op in ("softmax", "layernorm", "rmsnorm", "layernorm_epilogue", "softmax_masked",
               "attention"):
        assert _dispatch.NATIVE_BELOW[op, True] >= _dispatch.NATIVE_BELOW[op, False]
    assert _dispatch.NATIVE_BELOW["softmax_masked", True] == 0
    for grad in (False, True):
        assert 8 * 12 * 512 * 512 < _dispatch.NATIVE_BELOW["attention", grad] \
            <= 32 * 12 * 512 * 512


def test_forced_reference_runs_fusedops_functions():
    """A forced "reference" backend runs fusedops' own autograd Functions on its pure-PyTorch
    rows (for tests and debugging), not torch's op in their place."""
    x = torch.randn(4, 16, requires_grad=True)
    with fusedops.use_backend("reference"):
        y = fusedops.fused_layernorm(x, 16)
    assert type(y.grad_fn).__name__ == "LayerNormFunctionBackward"
    y = fusedops.fused_layernorm(x, 16)
    assert type(y.grad_fn).__name__ == "NativeLayerNormBackward0"


def test_torch_func_transforms_run_torchs_ops():
    """grad, vmap(grad) and jacrev through the fused ops: torch's ops run under transforms."""
    x = torch.randn(3, 5, dtype=torch.float64)
    w = torch.randn(5, dtype=torch.float64)

    def f(x):
        return (fusedops.fused_layernorm(x, 5, w) * fusedops.fused_softmax(x, -1)).sum()

    def g(x):
        return (F.layer_norm(x, (5,), w) * torch.softmax(x, -1)).sum()

    for backend in (None, "reference"):
        with fusedops.use_backend(backend):
            torch.testing.assert_close(torch.func.grad(f)(x), torch.func.grad(g)(x))
            torch.testing.assert_close(torch.func.vmap(torch.func.grad(f))(x[None]),
                                       torch.func.vmap(torch.func.grad(g))(x[None]))
            torch.testing.assert_close(torch.func.jacrev(
                lambda x: fusedops.fused_rmsnorm(x, 5, w))(x),
                torch.func.jacrev(lambda x: F.rms_norm(x, (5,), w))(x))


@pytest.mark.gpu
@pytest.mark.auto_backend
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_small_calls_native_large_calls_fused():
    """On CUDA, automatically: a call below the size rule is torch's op (its grad_fn torch's),
    one above runs the fused kernel."""
    small = torch.randn(8, 64, device="cuda", requires_grad=True)
    large = torch.randn(1 << 14, 1 << 12, device="cuda", dtype=torch.bfloat16)
    with fusedops.count_fused_calls() as counts:
        y = fusedops.fused_layernorm(small, 64)
        with torch.no_grad():
            fusedops.fused_softmax(large, -1)
    assert type(y.grad_fn).__name__ == "NativeLayerNormBackward0"
    assert counts == {"softmax_forward": 1}


def test_torch_func_through_the_epilogues():
    """The masked softmax and the LayerNorm epilogue under grad / vmap(grad) / jacrev, on the
    automatic and the forced reference backend (fusedops' Functions step aside for torch's
    ops while a transform is active)."""
    torch.manual_seed(3)
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    r = torch.randn(2, 3, 4, dtype=torch.float64)
    mask = torch.zeros(3, 4, dtype=torch.float64)
    mask[:, -1] = -torch.inf

    def f(x):
        y = fusedops.fused_softmax(x, -1, scale=0.5, mask=mask)
        z, _ = fusedops.fused_layernorm(x, 4, residual=r, activation="gelu")
        return (y * z).sum()

    def g(x):
        y = torch.softmax(x * 0.5 + mask, -1)
        z = F.gelu(F.layer_norm(x + r, (4,)))
        return (y * z).sum()

    for backend in (None, "reference"):
        with fusedops.use_backend(backend):
            torch.testing.assert_close(torch.func.grad(f)(x), torch.func.grad(g)(x))
            torch.testing.assert_close(torch.func.vmap(torch.func.grad(f))(x[None]),
                                       torch.func.vmap(torch.func.grad(g))(x[None]))
            torch.testing.assert_close(torch.func.jacrev(f)(x), torch.func.jacrev(g)(x))
