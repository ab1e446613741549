"""RMSNorm backward replay plans (fusedops.backends.triton.rmsnorm_bwd.rmsnorm_backward): a
call whose signature ran before through launches alone replays those launches with the new
call's tensors, its dweight partials allocated as scratch.

Under the interpreter the replayed launches are compared launch by launch with the normal
path's (same grids, scalars, and every pointer at the same place relative to the call's
inputs, outputs and scratch). With a GPU, replayed calls are compared bit for bit with the
normal path on compiled kernels (``gpu`` marker).
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    INTERPRETING,
    assert_close_to_ref,
    count_calls,
    relative_args,
    require_replay_plans,
)

from fusedops.backends.triton import rmsnorm_bwd as trmsb

BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture(autouse=True)
def _no_plans():
    trmsb._bwd_plans.clear()
    yield
    trmsb._bwd_plans.clear()


def _inputs(M, N, dtype, weight=True, device="cpu"):
    g = torch.Generator().manual_seed(M * 7 + N)
    x = (torch.randn(M, N, generator=g) * 2 + 0.3).to(dtype)
    dy = torch.randn(M, N, generator=g).to(dtype)
    w = (1 + 0.5 * torch.randn(N, generator=g)).to(dtype) if weight else None
    rstd = torch.rsqrt(x.double().square().mean(1) + 1e-5).float()
    return [None if t is None else t.to(device) for t in (dy, x, w, rstd)]


def _backward(inputs, need=(True, True), grad_dtypes=None):
    """The backend call as the eager autograd path makes it (grad_dtypes given)."""
    dy, x, w, rstd = inputs
    if grad_dtypes is None:
        grad_dtypes = (None if w is None else w.dtype,)
    return trmsb.rmsnorm_backward(dy, x, w, rstd, *need, grad_dtypes=grad_dtypes)


def _reference(inputs):
    dy, x, w, _ = inputs
    xr = x.double().requires_grad_()
    wr = None if w is None else w.double().requires_grad_()
    y = torch.rms_norm(xr, (x.shape[1],), wr, 1e-5)
    return torch.autograd.grad(y, [t for t in (xr, wr) if t is not None], dy.double())


@pytest.mark.skipif(not INTERPRETING,
                    reason="CPU tensors need the Triton interpreter (the gpu tests cover this)")
@pytest.mark.parametrize("case", [
    dict(M=37, N=64, dtype=BF16),                        # many programs: float32 partials
    dict(M=37, N=64, dtype=F32, weight=False),           # no dweight: no partials
    dict(M=300, N=48, dtype=F32, need=(True, False)),    # dx only
    dict(M=64, N=64, dtype=BF16, need=(False, True)),    # dweight only
], ids=str)
def test_replay_repeats_the_normal_launches(recording_entries, monkeypatch, case):
    """The second call of a signature launches exactly what the first launched (grids,
    scalars, pointers at the same places relative to the call's tensors), outputs allocated
    as the first call's; the first call's results are right."""
    monkeypatch.setattr(trmsb, "hooks_registered", lambda: False)
    case = dict(case)
    need = case.pop("need", (True, True))
    inputs = _inputs(case.pop("M"), case.pop("N"), case.pop("dtype"), **case)
    log = recording_entries
    first = _backward(inputs, need)
    normal = [e for e in log if e[0] == "normal"]
    assert normal and len(normal) == len(log)
    (plan,) = trmsb._bwd_plans.values()
    assert plan
    log.clear()
    second = _backward(inputs, need)
    assert [e[0] for e in log] == ["replay"] * len(normal)
    for a, b in zip(first, second, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert (a.shape, a.dtype) == (b.shape, b.dtype) and a.data_ptr() != b.data_ptr()
    bases1, bases2 = (*inputs, *first), (*inputs, *second)
    for (_, grid1, args1), (_, grid2, raw2) in zip(normal, log, strict=True):
        assert grid1 == grid2
        n = sum(isinstance(a, torch.Tensor) for a in args1)
        assert relative_args(args1[:n], bases1) == relative_args(raw2[:n], bases2)
        assert tuple(args1[n:]) == tuple(raw2[n:])
    want = _reference(inputs)
    if need[0]:
        assert_close_to_ref(first[0], want[0], inputs[1].dtype, 4.0)
    if need[1] and inputs[2] is not None:
        assert_close_to_ref(first[1].float(), want[-1], inputs[1].dtype, 16.0)


def test_calls_without_grad_dtypes_make_no_plans():
    """torch.compile's custom op passes no grad_dtypes: it neither makes nor uses plans."""
    device = "cuda" if torch.cuda.is_available() and not INTERPRETING else "cpu"
    if device == "cpu" and not INTERPRETING:
        pytest.skip("CPU tensors need the Triton interpreter")
    dy, x, w, rstd = _inputs(16, 64, F32, device=device)
    trmsb.rmsnorm_backward(dy, x, w, rstd, True, True)
    assert not trmsb._bwd_plans


GPU_CASES = [  # (M, N, dtype, weight, need, replays)
    (4096, 1024, BF16, True, (True, True), True),      # fused, aligned
    (3000, 768, F32, False, (True, True), True),       # fused, no weight
    (1000, 8193, BF16, True, (True, True), True),      # unaligned rows
    (512, 4096, F32, True, (True, False), True),       # dx only
    (256, 65536, BF16, True, (True, True), False),     # split rows: no plan
]


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,dtype,weight,need,replays", GPU_CASES, ids=str)
def test_gpu_replayed_backward_is_bitwise_the_normal_path(monkeypatch, M, N, dtype, weight,
                                                          need, replays):
    """The second call replays (no normal-path call) where its path replays, and gives the
    first call's bits; on a side stream too."""
    require_replay_plans()
    normal = count_calls(monkeypatch, trmsb, "_backward")
    inputs = _inputs(M, N, dtype, weight, device="cuda")
    first = _backward(inputs, need)
    (plan,) = trmsb._bwd_plans.values()
    assert bool(plan) == replays
    second = _backward(inputs, need)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        third = _backward(inputs, need)
    torch.cuda.current_stream().wait_stream(s)
    if plan:
        assert len(normal) == 1  # the second and third calls replayed
    for outs in (second, third):
        for a, b in zip(first, outs, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b)
    assert_close_to_ref(first[0], _reference(inputs)[0], dtype, 8.0)
