"""Launch-side internals of the Triton backend: opt-in row windows and the split-row rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_to_ref

import fusedops
from fusedops.triton import _common


@pytest.fixture
def row_windows(monkeypatch):
    monkeypatch.setattr(_common, "_WINDOWS", True)


def test_window_vec_rule(row_windows):
    assert _common.window_vec(33, (33, 33), 2) == 8  # unaligned contiguous rows: windowed
    assert _common.window_vec(33, (33, 33), 4) == 4
    assert _common.window_vec(32, (32, 32), 2) == 0  # aligned rows need no window
    assert _common.window_vec(33, (40, 33), 2) == 0  # different strides: one window can't serve


def test_window_off_by_default():
    assert _common.window_vec(33, (33, 33), 2) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n", [(1, 17), (3, 33), (7, 1025), (5, 255)])
def test_windowed_kernels_match_float64(row_windows, triton_backend, device, dtype, m, n):
    torch.manual_seed(m * n)
    x = (torch.randn(m, n, device=device) * 3 + 1).to(dtype).requires_grad_(True)
    w = torch.randn(n, device=device, requires_grad=True)
    b = torch.randn(n, device=device, requires_grad=True)
    g = torch.randn(m, n, device=device).to(dtype)
    x64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, w, b))

    y = fusedops.fused_softmax(x)
    r = torch.softmax(x64, -1)
    assert_close_to_ref(y, r, dtype)
    (dx,) = torch.autograd.grad(y, x, g)
    (dr,) = torch.autograd.grad(r, x64, g.double())
    assert_close_to_ref(dx, dr, dtype, scale=4)

    y = fusedops.fused_layernorm(x, n, w, b)
    r = F.layer_norm(x64, (n,), w64, b64)
    assert_close_to_ref(y, r, dtype, scale=4)
    got = torch.autograd.grad(y, (x, w, b), g)
    want = torch.autograd.grad(r, (x64, w64, b64), g.double())
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), e, atol=5e-2 if dtype != torch.float32 else 1e-4,
                                   rtol=5e-2 if dtype != torch.float32 else 1e-4)


def test_split_rows_rule():
    cuda = torch.device("cuda")
    chunk = _common.SPLIT_CHUNK
    enabled = _common._split_state["enabled"] and not _common._interpreting()
    assert _common.split_rows_enabled(cuda, 4 * chunk) == enabled
    assert _common.split_rows_enabled(cuda, 4 * chunk + 1) is False
    assert _common.split_rows_enabled(cuda, 6 * chunk + 1) == enabled
    assert _common.split_rows_enabled(torch.device("cpu"), 8 * chunk) is False
