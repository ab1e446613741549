"""The Metal kernels on a real Apple GPU (skipped unless MPS and the Metal backend are available).

Run by .github/workflows/macos.yml on Apple7+ GPUs, or by hand on a Mac:

    pytest tests/test_metal_device.py

Both Metal paths are checked: the compiled extension (when installed) and the
torch.mps.compile_shader fallback over the same sources.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_to_ref

import fusedops
from fusedops import metal

pytestmark = pytest.mark.skipif(not metal.is_available(),
                                reason="needs an MPS device and the fusedops Metal backend")

SIZES = [1, 31, 32, 33, 1000, 1024, 1025, 4096, 4097, 20000]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


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
        monkeypatch.setattr(metal, "_impl", metal.ShaderLauncher(metal.library_source()))
    with fusedops.use_backend("metal"):
        yield request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_metal_device_softmax(path, n, dtype):
    torch.manual_seed(n)
    x = (torch.randn(3, n) * 3).to(dtype).to("mps").requires_grad_()
    with fusedops.count_fused_calls() as counts:
        y = fusedops.fused_softmax(x, -1)
        g = torch.randn_like(y)
        y.backward(g)
    assert counts["softmax_forward"] == 1
    x64 = x.detach().cpu().double().requires_grad_()
    y64 = torch.softmax(x64, -1)
    y64.backward(g.cpu().double())
    assert_close_to_ref(y.cpu(), y64, dtype)
    assert_close_to_ref(x.grad.cpu(), x64.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_metal_device_layernorm(path, n, dtype):
    torch.manual_seed(n + 1)
    x = (torch.randn(5, n) * 2 + 0.5).to(dtype).to("mps").requires_grad_()
    w = torch.randn(n, device="mps", requires_grad=True)
    b = torch.randn(n, device="mps", requires_grad=True)
    y = fusedops.fused_layernorm(x, (n,), w, b, 1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    x64, w64, b64 = (t.detach().cpu().double().requires_grad_() for t in (x, w, b))
    y64 = F.layer_norm(x64, (n,), w64, b64, 1e-5)
    y64.backward(g.cpu().double())
    assert_close_to_ref(y.cpu(), y64, dtype)
    assert_close_to_ref(x.grad.cpu(), x64.grad, dtype, scale=4)
    assert_close_to_ref(w.grad.cpu(), w64.grad, torch.float32, scale=10)
    assert_close_to_ref(b.grad.cpu(), b64.grad, torch.float32, scale=10)


def test_metal_device_strided_and_ordered(path):
    """Views with a storage offset and row stride, and ordering with surrounding torch ops on
    the same stream (no synchronisation in between)."""
    base = torch.randn(64, 1030, device="mps")
    x = base[:, 3:1027] * 2  # a new tensor produced by a torch op right before the kernel
    view = base[:, 3:1027]  # offset 3, row stride 1030
    y1 = fusedops.fused_softmax(view, -1) + 1  # consumed right after
    y2 = fusedops.fused_softmax(x, -1)
    rows = base.cpu().double()[:, 3:1027]
    torch.testing.assert_close(y1.cpu().double() - 1, torch.softmax(rows, -1), atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(y2.cpu().double(), torch.softmax(2 * rows, -1), atol=1e-5,
                               rtol=1e-5)
    masked = torch.randn(8, 300, device="mps")
    masked[0, :200] = float("-inf")
    torch.testing.assert_close(fusedops.fused_softmax(masked, -1).cpu(),
                               torch.softmax(masked.cpu(), -1), atol=1e-5, rtol=1e-5)
