"""LayerNorm backward's ``low_memory`` mode (``fusedops.set_layernorm_backward``): no scratch
beyond the outputs, so forward + backward peak memory is no larger than PyTorch's.

CPU (Triton interpreter): results against float64, bitwise repeatability, the mode API, and
where the partial sums live (in dx's storage, or written straight into dweight/dbias when dx
has no room or is not needed). GPU (``gpu`` marker): the peak memory against torch's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _reliability import forward_backward_peak
from conftest import assert_close_to_ref

import fusedops


def test_mode_api():
    assert fusedops.get_layernorm_backward() == "fast"
    with fusedops.layernorm_backward_mode("low_memory"):
        assert fusedops.get_layernorm_backward() == "low_memory"
    assert fusedops.get_layernorm_backward() == "fast"
    with pytest.raises(ValueError, match="mode"):
        fusedops.set_layernorm_backward("small")


def _grads(x, w, b, g, mode, need_x=True):
    n = x.shape[-1]
    leaves = [x.clone().requires_grad_(need_x)] + [
        None if t is None else t.clone().requires_grad_(True) for t in (w, b)]
    with fusedops.layernorm_backward_mode(mode):
        y = fusedops.fused_layernorm(leaves[0], n, leaves[1], leaves[2])
        ins = [t for t in leaves if t is not None and t.requires_grad]
        return torch.autograd.grad(y, ins, g)


CASES = {  # (M, N, row padding of x, affine)
    "many_rows": (300, 64, 0, "both"),
    "unaligned": (300, 33, 0, "both"),
    "strided_x": (50, 100, 7, "both"),
    "few_rows": (3, 64, 0, "both"),  # dx too small for two partial rows: straight into dw/db
    "one_row": (1, 40, 0, "both"),
    "weight_only": (300, 64, 0, "weight"),
    "bias_only": (300, 64, 0, "bias"),
    "params_in_x_dtype": (300, 64, 0, "both-x"),  # cast from the sums parked in dx
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("need_x", [True, False], ids=["dx", "params-only"])
def test_low_memory_matches_float64(triton_backend, device, dtype, case, need_x):
    m, n, pad, affine = CASES[case]
    torch.manual_seed(m * n + pad)
    x = (torch.randn(m, n + pad, device=device) * 2 + 1).to(dtype)[:, :n]
    pdt = dtype if affine == "both-x" else torch.float32
    w = torch.randn(n, device=device).to(pdt) if affine != "bias" else None
    b = torch.randn(n, device=device).to(pdt) if affine in ("both", "bias", "both-x") else None
    g = torch.randn(m, n, device=device).to(dtype)
    got = _grads(x, w, b, g, "low_memory", need_x)
    assert all(t.dtype == pdt for t in got[int(need_x):])
    r = [x.double().requires_grad_(need_x)] + [
        None if t is None else t.double().requires_grad_(True) for t in (w, b)]
    want = torch.autograd.grad(F.layer_norm(r[0], (n,), r[1], r[2]),
                               [t for t in r if t is not None and t.requires_grad], g.double())
    if need_x:
        assert_close_to_ref(got[0], want[0], dtype, scale=8)
    tol = 5e-2 if pdt != torch.float32 or dtype != torch.float32 else 1e-4
    for a, e in zip(got[int(need_x):], want[int(need_x):], strict=True):
        torch.testing.assert_close(a.double(), e, atol=tol * (1 + e.abs().max().item()), rtol=0)
    again = _grads(x, w, b, g, "low_memory", need_x)
    assert all(torch.equal(p, q) for p, q in zip(got, again, strict=True))  # deterministic


@pytest.mark.parametrize("m,expect_in_dx", [(300, True), (3, False)])
def test_partials_are_parked_in_dx(monkeypatch, triton_backend, device, m, expect_in_dx):
    from fusedops.triton import layernorm as tln

    seen = []
    real = tln._launch_dwdb_columns
    monkeypatch.setattr(tln, "_launch_dwdb_columns", lambda grid, args, warps: seen.append(
        (grid, args[4].untyped_storage().data_ptr())) or real(grid, args, warps))
    x = torch.randn(m, 64, device=device)
    dy = torch.randn(m, 64, device=device)
    w = torch.randn(64, device=device)
    _, mean, rstd = tln.layernorm_forward(x, w, None, 1e-5, x.dtype)
    with fusedops.layernorm_backward_mode("low_memory"):
        dx, dw, db = tln.layernorm_backward(dy, x, w, mean, rstd, True, True, True)
    (grid, ptr), = seen
    # separate outputs (a custom op's outputs must not alias), none of them in dx
    ptrs = {t.untyped_storage().data_ptr() for t in (dx, dw, db)}
    assert len(ptrs) == 3
    if expect_in_dx:
        assert grid[1] > 1 and ptr == dx.untyped_storage().data_ptr()
    else:
        assert grid[1] == 1 and ptr == dw.untyped_storage().data_ptr()


PEAK_SHAPES = [(4096, 1024), (1024, 4096), (64, 70000), (8, 2 * 16384), (16384, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n", PEAK_SHAPES, ids=[f"{m}x{n}" for m, n in PEAK_SHAPES])
def test_gpu_low_memory_peak_not_above_torch(m, n, dtype):
    """Forward + backward peak in low_memory mode <= torch's, with no slack: the partials and
    their float32 sums live in dx's storage until dweight/dbias are cast to the parameters'
    dtypes, then dx is written over them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, n, generator=g).to(dtype).cuda()
    dy = torch.randn(m, n, generator=g).to(dtype).cuda()
    w = torch.randn(n, generator=g).cuda().to(dtype)
    b = torch.randn(n, generator=g).cuda().to(dtype)

    with fusedops.layernorm_backward_mode("low_memory"):
        fused = forward_backward_peak(
            lambda x, w, b: fusedops.fused_layernorm(x, (n,), w, b), [x, w, b], dy)
    ref = forward_backward_peak(lambda x, w, b: F.layer_norm(x, (n,), w, b), [x, w, b], dy)
    assert fused <= ref, (fused, ref)
