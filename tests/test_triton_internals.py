"""Launch-side internals of the Triton backend: unaligned rows (body + edges) and the split-row
rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_to_ref

import fusedops
from fusedops.triton import _common


def _t(n: int, dtype=torch.bfloat16, offset: int = 0) -> torch.Tensor:
    return torch.empty(n + offset, dtype=dtype)[offset:]


def test_unaligned_vec_rule():
    a = _t(64)
    assert _common.unaligned_vec(33, (33, 33), 2, (a, a)) == 8  # unaligned rows: body + edges
    assert _common.unaligned_vec(33, (33, 33), 4, (a, a)) == 4
    assert _common.unaligned_vec(32, (32, 32), 2, (a, a)) == 0  # aligned rows need no split
    assert _common.unaligned_vec(33, (40, 33), 2, (a, a)) == 0  # strides differ: no common split
    assert _common.unaligned_vec(15, (15, 15), 2, (a, a)) == 0  # rows shorter than two vectors
    assert _common.unaligned_vec(33, (33, 33), 2, (a, _t(64, offset=1))) == 0  # base unaligned
    assert _common.body_len(8193, 8) == 8192
    assert _common.body_len(8193, 4) == 8192
    assert _common.body_len(8192, 0) == 8192


def test_unaligned_fused_backward_rule(monkeypatch):
    from fusedops.triton import layernorm as tln

    monkeypatch.setattr(tln, "num_sms", lambda dev: 132)

    # the aligned-body fused backward from 8K bodies (8193); 4097 stays scalar (padded to 8192)
    for n, vec in [(8193, 8), (4097, 0), (1025, 0)]:
        x = torch.empty(4096, n, dtype=torch.bfloat16)
        assert tln._fused_plan(4096, n, x, x)[:2] == (vec, 8192 if n > 1025 else 2048)


def test_unaligned_split_can_be_turned_off(monkeypatch):
    monkeypatch.setitem(_common._BODY, "enabled", False)
    a = _t(64)
    assert _common.unaligned_vec(33, (33, 33), 2, (a, a)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n", [(1, 17), (3, 33), (7, 1025), (5, 255), (9, 23)])
def test_unaligned_rows_match_float64(triton_backend, device, dtype, m, n):
    # Every row start has a different misalignment (head 0..VEC-1), including rows whose body
    # is one vector (n = 17 bf16) and rows whose edges hold VEC - 1 elements on both sides.
    torch.manual_seed(m * n)
    x = (torch.randn(m, n, device=device) * 3 + 1).to(dtype).requires_grad_(True)
    assert _common.unaligned_vec(n, (n, n), x.element_size(), (x, x)) > 0  # the split path runs
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
    enabled = _common._split_state["enabled"] and not _common._interpreting()
    # equal pieces of at most `chunk`; all pieces of a row must be resident at once
    assert _common.split_rows_enabled(cuda, 4 * 8192 + 1, 8192) == enabled
    assert _common.split_rows_enabled(torch.device("cpu"), 8 * 8192, 8192) is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_unaligned_rows_on_a_persistent_grid(monkeypatch, triton_backend, device, dtype):
    # More row tiles than programs: each program loops over tiles that must all share one
    # misalignment, since it holds the weight shifted by it (grid rounded to a multiple of VEC).
    monkeypatch.setattr(_common, "num_sms", lambda dev: 1)
    m, n = 1100, 33
    assert _common.grid_size(100, 8, "ln_bwd", torch.device(device), vec=8) == 8
    assert _common.grid_size(100, 16, "ln_bwd", torch.device(device), vec=8) == 8
    torch.manual_seed(0)
    x = (torch.randn(m, n, device=device) * 2 - 1).to(dtype).requires_grad_(True)
    w = torch.randn(n, device=device)  # no gradient: the dx row kernel runs
    g = torch.randn(m, n, device=device).to(dtype)
    x64 = x.detach().double().requires_grad_(True)
    y = fusedops.fused_layernorm(x, n, w)
    r = F.layer_norm(x64, (n,), w.double())
    assert_close_to_ref(y, r, dtype, scale=4)
    (dx,) = torch.autograd.grad(y, x, g)
    (dr,) = torch.autograd.grad(r, x64, g.double())
    assert_close_to_ref(dx, dr, dtype, scale=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,sms,split", [(4000, 33, 4, True), (600, 1025, 8, True),
                                           (3, 33, 8, False)])
def test_unaligned_fused_backward_partials(monkeypatch, triton_backend, device, dtype, m, n, sms,
                                           split):
    """dweight/dbias of unaligned rows from the fused backward: each program accumulates its
    columns shifted by its rows' misalignment plus (2·VEC,) edge columns, and writes a complete
    partial row. Programs loop over row tiles that must share one misalignment (a grid of a
    multiple of VEC programs); a batch too small for VEC partial rows (3 x 33: scratch is capped
    at an eighth of x) is read with scalar accesses instead."""
    from fusedops.triton import layernorm as tln

    monkeypatch.setattr(_common, "num_sms", lambda dev: sms)
    monkeypatch.setattr(tln, "num_sms", lambda dev: sms)
    # short bodies take the scalar variant by default (measured faster); force the body one
    monkeypatch.setattr(tln, "FUSED_BWD_UNALIGNED_MIN_BLOCK", 16)
    torch.manual_seed(m + n)
    x = (torch.randn(m, n, device=device) * 2 + 3).to(dtype)
    dy = torch.randn(m, n, device=device).to(dtype)
    plan = tln._fused_plan(m, n, x, dy)
    vec = 16 // x.element_size()
    assert plan is not None and plan[0] == (vec if split else 0)
    tiles, progs = plan[5], plan[6]
    if split:
        assert progs < tiles and progs % vec == 0
    w = torch.randn(n, device=device, requires_grad=True)
    b = torch.randn(n, device=device, requires_grad=True)
    xl = x.clone().requires_grad_(True)
    y = fusedops.fused_layernorm(xl, n, w, b)
    got = torch.autograd.grad(y, (xl, w, b), dy)
    r = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    want = torch.autograd.grad(F.layer_norm(r[0], (n,), r[1], r[2]), r, dy.double())
    assert_close_to_ref(got[0], want[0], dtype, scale=4)
    for a, e in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a.double(), e, atol=2e-2 * m ** 0.5, rtol=2e-2)
