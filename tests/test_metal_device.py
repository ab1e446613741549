"""The Metal kernels on a real Apple GPU (skipped unless MPS and the Metal backend are available).

Run by .github/workflows/macos.yml on Apple7+ GPUs, or by hand on a Mac:

    pytest tests/test_metal_device.py

Every shipped shader (metal/*.metal: softmax, LayerNorm, RMSNorm, masked softmax, the LayerNorm
epilogue), forward and backward, against the float64 references of tests/_oracles.py (the ones
the emulation tests use) with the shared tolerance table. Both Metal paths are checked: the
compiled extension (when installed) and the torch.mps.compile_shader fallback over the same
sources. Elsewhere the same checks run on the CPU reference path (``test_checks_on_cpu``), so
the checks themselves are known to pass on correct results.
"""

from __future__ import annotations

import _oracles as oracles
import pytest
import torch
from conftest import assert_close_to_ref, assert_row_sum_close

import fusedops
from fusedops import _philox
from fusedops.backends import metal
from fusedops.backends.metal import loader as metal_loader

needs_metal = pytest.mark.skipif(not metal.is_available(),
                                 reason="needs an MPS device and the fusedops Metal backend")

SIZES = [1, 31, 32, 33, 1000, 1024, 1025, 4096, 4097, 20000]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5


def _paths():
    paths = []
    if metal.is_available():
        paths.append(metal.implementation())
        if hasattr(torch.mps, "compile_shader") and metal.implementation() == "extension":
            paths.append("compile_shader")
    return paths


@pytest.fixture(params=_paths() or ["none"])
def path(request, monkeypatch):
    if request.param == "compile_shader" and metal.implementation() != "compile_shader":
        monkeypatch.setattr(metal_loader, "impl",
                            metal_loader.ShaderLauncher(metal_loader.library_source()))
    with fusedops.use_backend("metal"):
        yield request.param


def _randn(*shape, scale=1.0, shift=0.0, dtype=torch.float32, device="cpu"):
    """CPU-generated values (the same on every device), then moved."""
    return (torch.randn(*shape) * scale + shift).to(dtype).to(device)


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(True)


# --- the checks (device: "mps" with the Metal backend, or "cpu" on the reference path) ---------


def check_softmax(device, n, dtype, fused=True):
    torch.manual_seed(n)
    x = _leaf(_randn(3, n, scale=3, dtype=dtype, device=device))
    with fusedops.count_fused_calls() as counts:
        y = fusedops.fused_softmax(x, -1)
        g = torch.randn_like(y)
        y.backward(g)
    assert counts["softmax_forward"] == int(fused) and counts["softmax_backward"] == int(fused)
    y64, dx64 = oracles.softmax(x, g)
    assert_close_to_ref(y.cpu(), y64, dtype)
    assert_close_to_ref(x.grad.cpu(), dx64, dtype, scale=4)


def check_layernorm(device, n, dtype, fused=True):
    torch.manual_seed(n + 1)
    m = 5
    x = _leaf(_randn(m, n, scale=2, shift=0.5, dtype=dtype, device=device))
    w, b = _leaf(_randn(n, device=device)), _leaf(_randn(n, device=device))
    with fusedops.count_fused_calls() as counts:
        y = fusedops.fused_layernorm(x, (n,), w, b, EPS)
        g = torch.randn_like(y)
        y.backward(g)
    assert counts["layernorm_forward"] == int(fused)
    y64 = oracles.layernorm(x, w, b, EPS)[0]
    dx64, dw64, db64 = oracles.layernorm(x, w, b, EPS, g)
    assert_close_to_ref(y.cpu(), y64, dtype)
    assert_close_to_ref(x.grad.cpu(), dx64, dtype, scale=4)
    assert_row_sum_close(w.grad.cpu(), dw64, m, scale=4)  # float32 sums over the rows
    assert_row_sum_close(b.grad.cpu(), db64, m, scale=4)


def check_rmsnorm(device, n, dtype, fused=True):
    torch.manual_seed(n + 2)
    m = 5
    x = _leaf(_randn(m, n, scale=2, shift=0.5, dtype=dtype, device=device))
    w = _leaf(_randn(n, shift=1.0, dtype=dtype, device=device))
    with fusedops.count_fused_calls() as counts:
        y = fusedops.fused_rmsnorm(x, (n,), w, EPS)
        g = torch.randn_like(y)
        y.backward(g)
    assert counts["rmsnorm_forward"] == int(fused) and counts["rmsnorm_backward"] == int(fused)
    y64 = oracles.rmsnorm(x, w, EPS)[0]
    dx64, dw64 = oracles.rmsnorm(x, w, EPS, g)
    assert y.dtype == dtype and w.grad.dtype == dtype
    assert_close_to_ref(y.cpu(), y64, dtype)
    assert_close_to_ref(x.grad.cpu(), dx64, dtype, scale=4)
    assert_row_sum_close(w.grad.cpu(), dw64, m, scale=4)


MASKS = ["bool", "additive", "causal"]


def check_softmax_masked(device, n, dtype, mask_kind, fused=True):
    """Attention's softmax(x * scale + mask) on (B, H, Q, N) scores: a bool key mask broadcast
    over heads and queries, an additive mask with -inf entries (a row of queries with nothing
    kept: zeros), or causal; forward and backward."""
    torch.manual_seed(n + 3)
    shape = (2, 2, 3, n)
    x = _leaf(_randn(*shape, scale=3, dtype=dtype, device=device))
    mask, causal = None, mask_kind == "causal"
    if mask_kind == "bool":
        mask = (torch.rand(2, 1, 1, n) > 0.3).to(device)
    elif mask_kind == "additive":
        add = torch.randn(1, 1, 3, n).masked_fill(torch.rand(1, 1, 3, n) < 0.2, -torch.inf)
        add[..., 1, :] = -torch.inf  # the second query keeps nothing
        mask = add.to(dtype).to(device)
    with fusedops.count_fused_calls() as counts:
        y = fusedops.fused_softmax(x, -1, scale=0.37, mask=mask, causal=causal)
        g = torch.randn_like(y)
        y.backward(g)
    assert counts["softmax_masked_forward"] == int(fused)
    assert counts["softmax_masked_backward"] == int(fused)
    y64, dx64 = oracles.softmax_masked(x, mask, 0.37, causal, g)
    assert_close_to_ref(y.cpu(), y64, dtype)
    assert_close_to_ref(x.grad.cpu(), dx64, dtype, scale=4)
    assert not y.isnan().any() and not x.grad.isnan().any()


ACTIVATIONS = [None, "relu", "gelu"]


def check_layernorm_epilogue(device, n, dtype, activation, fused=True):
    """activation(layer_norm(x + residual)) through the public op, forward and backward (the
    sum's own cotangent included; x and the residual get the same gradient)."""
    torch.manual_seed(n + 4)
    m = 4
    x = _leaf(_randn(m, n, scale=2, shift=0.5, dtype=dtype, device=device))
    r = _leaf(_randn(m, n, dtype=dtype, device=device))
    w, b = _leaf(_randn(n, device=device)), _leaf(_randn(n, device=device))
    with fusedops.count_fused_calls() as counts:
        out, s = fusedops.fused_layernorm(x, (n,), w, b, EPS, residual=r, activation=activation)
        g, gs = torch.randn_like(out), torch.randn_like(s)
        torch.autograd.backward([out, s], [g, gs])
    assert counts["layernorm_epilogue_forward"] == int(fused)
    assert counts["layernorm_epilogue_backward"] == int(fused)
    assert torch.equal(s.cpu(), (x + r).detach().cpu())
    out64 = oracles.layernorm_epilogue(x, r, w, b, EPS, None, activation)[0]
    dx64, dw64, db64 = oracles.layernorm_epilogue(x, r, w, b, EPS, None, activation, g, gs)
    assert_close_to_ref(out.cpu(), out64, dtype, scale=2)
    assert_close_to_ref(x.grad.cpu(), dx64, dtype, scale=8)
    assert torch.equal(x.grad, r.grad)
    assert_row_sum_close(w.grad.cpu(), dw64, m, scale=4)
    assert_row_sum_close(b.grad.cpu(), db64, m, scale=4)


def check_layernorm_epilogue_dropout(backend, device, n, dtype, p=0.25, seed=0x1234_5678_9ABC):
    """The backend's epilogue with dropout and an explicit seed: exactly
    fusedops._philox.keep_mask's elements kept (scaled by 1 / (1 - p)), regenerated in the
    backward; forward and backward against float64."""
    torch.manual_seed(n + 5)
    m = 3
    x = _randn(m, n, scale=2, shift=0.5, dtype=dtype, device=device)
    r = _randn(m, n, dtype=dtype, device=device)
    w, b = _randn(n, device=device), _randn(n, device=device)
    out, s, mean, rstd = backend.layernorm_epilogue_forward(x, r, w, b, EPS, dtype, p, seed,
                                                            "gelu", True)
    keep = _philox.keep_mask(seed, m, n, p)
    factor = keep.double() / (1 - p)
    out64, mean64, rstd64 = oracles.layernorm_epilogue(x, r, w, b, EPS, factor, "gelu")
    assert not out.cpu()[~keep].any()
    assert_close_to_ref(out.cpu(), out64, dtype, scale=2)
    assert_close_to_ref(mean.cpu(), mean64, torch.float32, scale=10)
    assert_close_to_ref(rstd.cpu(), rstd64, torch.float32, scale=10)
    dout, ds = _randn(m, n, dtype=dtype, device=device), _randn(m, n, dtype=dtype, device=device)
    dx, dw, db = backend.layernorm_epilogue_backward(dout, ds, s, w, b, mean, rstd, p, seed,
                                                     "gelu", True, True, True)
    dx64, dw64, db64 = oracles.layernorm_epilogue(x, r, w, b, EPS, factor, "gelu", dout, ds)
    assert_close_to_ref(dx.cpu(), dx64, dtype, scale=8)
    assert_row_sum_close(dw.cpu(), dw64, m, scale=4)
    assert_row_sum_close(db.cpu(), db64, m, scale=4)


# --- on the GPU --------------------------------------------------------------------------------


@needs_metal
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_metal_device_softmax(path, n, dtype):
    check_softmax("mps", n, dtype)


@needs_metal
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_metal_device_layernorm(path, n, dtype):
    check_layernorm("mps", n, dtype)


@needs_metal
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_metal_device_rmsnorm(path, n, dtype):
    check_rmsnorm("mps", n, dtype)


@needs_metal
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_metal_device_softmax_masked(path, n, dtype, mask_kind):
    check_softmax_masked("mps", n, dtype, mask_kind)


@needs_metal
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_metal_device_layernorm_epilogue(path, n, dtype, activation):
    check_layernorm_epilogue("mps", n, dtype, activation)


@needs_metal
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [31, 1000, 1025, 4097])
def test_metal_device_layernorm_epilogue_dropout(path, n, dtype):
    check_layernorm_epilogue_dropout(metal, "mps", n, dtype)


@needs_metal
def test_metal_device_strided_and_ordered(path):
    """Views with a storage offset and row stride, and ordering with surrounding torch ops on
    the same stream (no synchronisation in between)."""
    base = torch.randn(64, 1030, device="mps")
    x = base[:, 3:1027] * 2  # a new tensor produced by a torch op right before the kernel
    view = base[:, 3:1027]  # offset 3, row stride 1030
    y1 = fusedops.fused_softmax(view, -1) + 1  # consumed right after
    y2 = fusedops.fused_softmax(x, -1)
    rows = base.cpu()[:, 3:1027]
    assert_close_to_ref(y1.cpu() - 1, oracles.softmax(rows), torch.float32, scale=2)
    assert_close_to_ref(y2.cpu(), oracles.softmax(2 * rows), torch.float32)
    masked = torch.randn(8, 300, device="mps")
    masked[0, :200] = float("-inf")
    assert_close_to_ref(fusedops.fused_softmax(masked, -1).cpu(), oracles.softmax(masked),
                        torch.float32)


# --- the same checks on the CPU reference path ---------------------------------------------------


@pytest.mark.parametrize("check", ["softmax", "layernorm", "rmsnorm", "softmax_masked",
                                   "layernorm_epilogue", "layernorm_epilogue_dropout"])
def test_checks_on_cpu(check):
    """The device checks above, on the PyTorch reference path on the CPU (one size and dtype
    each): their references, tolerances and glue pass on correct results, wherever they run."""
    from fusedops.backends import reference

    n, dtype = 1025, torch.bfloat16
    with fusedops.use_backend("reference"):
        if check == "softmax_masked":
            for kind in MASKS:
                check_softmax_masked("cpu", n, dtype, kind, fused=False)
        elif check == "layernorm_epilogue":
            for activation in ACTIVATIONS:
                check_layernorm_epilogue("cpu", n, dtype, activation, fused=False)
        elif check == "layernorm_epilogue_dropout":
            check_layernorm_epilogue_dropout(reference, "cpu", n, dtype)
        else:
            globals()[f"check_{check}"]("cpu", n, dtype, fused=False)
