"""Replay plans of the masked softmax kernels (fusedops.backends.triton.softmax_masked_forward /
_backward): a call whose signature ran before relaunches the recorded kernel with the new call's
tensors, skipping the checks and launch rules.

Under the interpreter the plans are built with a recording C entry (conftest's
``recording_entries``) and compared with the normal path's launch (same grid, same scalars,
pointers at the same places relative to the call's tensors); with a GPU, replayed calls are
compared bit for bit with the normal path (``gpu`` marker).
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    INTERPRETING,
    count_calls,
    exhaustive_unless,
    relative_args,
    require_replay_plans,
)

pytest.importorskip("triton")
from fusedops.backends import triton as tb  # noqa: E402

if not tb.AVAILABLE:
    pytest.skip("Triton not available", allow_module_level=True)

import fusedops  # noqa: E402
from fusedops.backends.triton import softmax_masked as tsmm  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture(autouse=True)
def _no_plans():
    tsmm._fwd_plans.clear()
    tsmm._bwd_plans.clear()
    yield
    tsmm._fwd_plans.clear()
    tsmm._bwd_plans.clear()


def _mask(kind: str, shape, device="cpu", dtype=F32):
    B, H, Q, N = shape
    g = torch.Generator().manual_seed(1)
    if kind == "none":
        return None
    if kind == "bool":
        m = torch.rand(B, 1, Q, N, generator=g) > 0.2
        m[..., 0] = True
        return m.to(device).expand(shape)
    m = torch.where(torch.rand(B, 1, 1, N, generator=g) > 0.2, 0.0, float("-inf"))
    m[..., 0] = 0.0
    return m.to(device, dtype).expand(shape)


CASES = {
    "float mask, broadcast": dict(shape=(2, 3, 5, 48), mask="float", causal=False),
    "bool mask, causal": dict(shape=(1, 2, 7, 40), mask="bool", causal=True),
    "no mask, causal": dict(shape=(1, 1, 3, 80), mask="none", causal=True),
}


@pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need the Triton interpreter")
# (the looped kernels with a mask: exhaustive)
@exhaustive_unless(lambda single_block_or_looped, name: single_block_or_looped == "single-block"
                   or name == "no mask, causal")
@pytest.mark.parametrize("name", list(CASES))
def test_replay_repeats_the_normal_launch(recording_entries, single_block_or_looped, name):
    case = CASES[name]
    x = torch.randn(*case["shape"])
    mask = _mask(case["mask"], case["shape"])
    log = recording_entries
    calls = {
        "forward": (tsmm._fwd_plans, lambda: tsmm.softmax_masked_forward(
            x, mask, 0.25, case["causal"], F32), (x, mask)),
    }
    y = calls["forward"][1]()
    dy = torch.randn_like(y)
    calls["backward"] = (tsmm._bwd_plans, lambda: tsmm.softmax_masked_backward(
        y.view(-1, y.shape[-1]), dy.view(-1, y.shape[-1]), 0.25, F32),
        (y.view(-1, y.shape[-1]), dy.view(-1, y.shape[-1])))
    for kind, (plans, call, inputs) in calls.items():
        log.clear()
        plans.clear()
        normal = call()
        normal_log = list(log)
        assert normal_log and all(e[0] == "normal" for e in normal_log), kind
        assert len(plans) == 1 and next(iter(plans.values())), kind
        log.clear()
        replayed = call()
        assert [e[0] for e in log] == ["replay"], kind
        assert (replayed.shape, replayed.dtype) == (normal.shape, normal.dtype)
        assert replayed.data_ptr() != normal.data_ptr()
        (_, g1, a1), (_, g2, a2) = normal_log[0], log[0]
        assert g1 == g2
        assert relative_args(a1, (*inputs, normal)) == relative_args(a2, (*inputs, replayed)), kind


@pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need the Triton interpreter")
def test_calls_that_do_not_replay(recording_entries, monkeypatch, launch_rules):
    """A strided x (made contiguous for the call) records no plan; a launch hook takes the
    normal path; PLANS = False makes none."""
    log = recording_entries
    x = torch.randn(2, 3, 16, 8).transpose(2, 3)
    tsmm.softmax_masked_forward(x, None, 0.5, False, F32)
    assert list(tsmm._fwd_plans.values()) == [False]
    x = x.contiguous()
    tsmm.softmax_masked_forward(x, None, 0.5, False, F32)
    monkeypatch.setattr(tsmm, "hooks_registered", lambda: True)
    log.clear()
    tsmm.softmax_masked_forward(x, None, 0.5, False, F32)
    assert [e[0] for e in log] == ["normal"]
    launch_rules("softmax_masked", PLANS=False)
    tsmm._fwd_plans.clear()
    tsmm.softmax_masked_forward(x, None, 0.5, False, F32)
    assert not tsmm._fwd_plans


@pytest.mark.gpu
@pytest.mark.parametrize("shape,mask,causal,dtype", [
    ((8, 12, 128, 128), "float", False, BF16),
    ((2, 4, 100, 300), "bool", True, F32),
    ((1, 2, 16, 40000), "none", False, BF16),  # looped rows
])
def test_gpu_replay_is_bitwise_the_normal_path(monkeypatch, shape, mask, causal, dtype):
    """Through the public op, forward and backward: repeated steps replay (no normal-path
    call) and give the first step's bits; with plans dropped, the normal path gives them
    again. Skipped where plans cannot run (conftest.require_replay_plans)."""
    require_replay_plans(tsmm.PLANS)
    normal_fwd = count_calls(monkeypatch, tsmm, "_forward")
    normal_bwd = count_calls(monkeypatch, tsmm, "_backward")
    x = torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
    m = _mask(mask, shape, "cuda", dtype)
    dy = torch.randn(*shape, device="cuda", dtype=dtype)

    def step():
        y = fusedops.fused_softmax(x, -1, scale=0.125, mask=m, causal=causal)
        return y, torch.autograd.grad(y, x, dy)[0]

    first = step()
    assert any(tsmm._fwd_plans.values()) and any(tsmm._bwd_plans.values())
    again = step()
    assert len(normal_fwd) == len(normal_bwd) == 1  # the second step replayed
    tsmm._fwd_plans.clear()
    tsmm._bwd_plans.clear()
    fresh = step()
    assert len(normal_fwd) == len(normal_bwd) == 2
    for a, b, c in zip(first, again, fresh, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


# ------------------------------------------------------------------ the ops-level replay

@pytest.fixture
def masked_runner(recording_entries, monkeypatch):
    """An inference attention softmax of (2, 3, 5, 48) float32 scores with a (2, 1, 1, 48)
    additive mask, recorded and registered in ``fusedops._replay.SOFTMAX_MASKED`` (CPU tensors
    pass the runner's CUDA check while registering)."""
    from fusedops import _replay

    x = torch.randn(2, 3, 5, 48)
    m = _mask("float", (2, 1, 1, 48))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    # Forced: calls this small would otherwise run PyTorch's ops (the size rule).
    with fusedops.use_backend("triton"):
        with torch.no_grad():
            fusedops.fused_softmax(x, -1, scale=0.25, mask=m)
        (sig,) = _replay.SOFTMAX_MASKED
        assert sig == (x.shape, F32, -1, 0.25, False, (m.shape, m.stride(), F32))
        recording_entries.clear()
        yield _replay.SOFTMAX_MASKED[sig], x, m, recording_entries
    _replay.SOFTMAX_MASKED.clear()


@pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need the Triton interpreter")
def test_ops_layer_replays_inference_masked_softmax(masked_runner, monkeypatch):
    """A plain inference call of the signature goes straight to the runner (one replayed
    launch, no checks, views or dispatch); bad arguments still raise; calls needing gradients,
    an int scale or counting take the normal path."""
    run, x, m, log = masked_runner
    with torch.no_grad():
        with pytest.raises(TypeError, match="scale"):
            fusedops.fused_softmax(x, -1, scale=True, mask=m)
        with pytest.raises(TypeError, match="causal"):
            fusedops.fused_softmax(x, -1, scale=0.25, mask=m, causal=0)
        with pytest.raises(ValueError, match="finite"):
            fusedops.fused_softmax(x, -1, scale=float("nan"), mask=m)
    assert not log

    def checks(*args):
        raise LookupError("the call ran the checks")

    monkeypatch.setattr(fusedops.ops.softmax_masked, "check_mask_args", checks)
    with torch.no_grad():
        y = fusedops.fused_softmax(x, -1, scale=0.25, mask=m)
    assert [e[0] for e in log] == ["replay"]
    assert y.shape == x.shape and y.dtype == x.dtype
    with torch.no_grad(), pytest.raises(LookupError, match="ran the checks"):
        fusedops.fused_softmax(x, -1, scale=1, mask=m)  # an int scale: not the signature's
    with pytest.raises(LookupError, match="ran the checks"):
        fusedops.fused_softmax(x, -1, scale=0.25, mask=m.clone().requires_grad_())
    with torch.no_grad(), fusedops.count_fused_calls(), pytest.raises(LookupError):
        fusedops.fused_softmax(x, -1, scale=0.25, mask=m)


def test_ops_layer_replays_training_masked_softmax(monkeypatch):
    """A call needing x's gradient whose signature has a runner replays the forward through
    ReplayedMaskedSoftmax (no checks, the runner's output) and gets the masked softmax's
    gradient from the usual backward; where the runner declines the tensors (returns None),
    the launch rules run instead. (A stand-in runner: replayed launches need CUDA tensors.)"""
    from fusedops import _replay

    x = torch.randn(2, 3, 5, 48, dtype=torch.float64)
    m = _mask("float", (2, 1, 1, 48), dtype=torch.float64)
    dy = torch.randn(x.shape, dtype=torch.float64)
    ran = []

    def run(xr, mr):
        ran.append(xr)
        return None if len(ran) > 1 else torch.softmax(xr.detach() * 0.25 + mr, -1)

    def checks(*args):
        raise LookupError("the call ran the checks")

    run.native = False  # (no C++ path: the Python Function's replay)
    key = (x.shape, x.dtype, -1, 0.25, False, (m.shape, m.stride(), m.dtype))
    monkeypatch.setitem(_replay.SOFTMAX_MASKED, key, run)
    monkeypatch.setattr(fusedops.ops.softmax_masked, "check_mask_args", checks)
    xr = x.clone().requires_grad_()
    y = fusedops.fused_softmax(xr, -1, scale=0.25, mask=m)
    assert len(ran) == 1 and y.grad_fn.__class__.__name__.startswith("ReplayedMaskedSoftmax")
    dx, = torch.autograd.grad(y, xr, dy)
    r = x.clone().requires_grad_()
    want = torch.softmax(r * 0.25 + m, -1)
    want_dx, = torch.autograd.grad(want, r, dy)
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(dx, want_dx)
    y2 = fusedops.fused_softmax(x.clone().requires_grad_(), -1, scale=0.25, mask=m)
    assert len(ran) == 2  # declined: the launch rules ran the call
    torch.testing.assert_close(y2, want)
    with torch.no_grad():  # a mask needing its gradient: the normal path, with its checks
        with pytest.raises(LookupError, match="ran the checks"):
            fusedops.fused_softmax(xr, -1, scale=0.25, mask=m.clone().requires_grad_())


@pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need the Triton interpreter")
def test_masked_ops_runner_declines_what_the_signature_does_not_fix(masked_runner, monkeypatch):
    run, x, m, log = masked_runner
    assert run(x, m) is not None
    misaligned_x = torch.randn(x.numel() + 1)[1:].view(x.shape)
    misaligned_m = torch.randn(m.numel() + 1)[1:].view(m.shape)
    strided_x = torch.randn(2, 3, 48, 5).transpose(2, 3)
    assert [run(*call) for call in ((misaligned_x, m), (x, misaligned_m),
                                    (strided_x, m))] == [None] * 3
    monkeypatch.setattr(tsmm, "hooks_registered", lambda: True)
    assert run(x, m) is None
    assert [e[0] for e in log] == ["replay"]
    from fusedops import _replay

    tsmm._fwd_plans.clear()  # plans dropped: their runners go too
    assert not _replay.SOFTMAX_MASKED


@pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need the Triton interpreter")
def test_masked_ops_runner_registration(recording_entries, monkeypatch, launch_rules):
    """What gets a runner: inference calls on 4-d scores whose views the kernel reads are the
    caller's tensors. A float64 mask (converted for the kernel) is marked False; a strided x
    (copied) is asked again; other ranks, CPU tensors and plans off register
    nothing usable; training calls register as inference calls do."""
    from fusedops import _replay

    m64 = _mask("float", (2, 1, 1, 48), dtype=torch.float64)
    # Forced: calls this small would otherwise run PyTorch's ops (the size rule).
    with fusedops.use_backend("triton"), torch.no_grad():
        fusedops.fused_softmax(torch.randn(2, 3, 5, 48), -1, scale=0.5, mask=m64)
        assert list(_replay.SOFTMAX_MASKED.values()) == [False]  # CPU tensors
        _replay.SOFTMAX_MASKED.clear()
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        fusedops.fused_softmax(torch.randn(2, 3, 5, 48), -1, scale=0.5, mask=m64)
        assert list(_replay.SOFTMAX_MASKED.values()) == [False]  # converted mask
        _replay.SOFTMAX_MASKED.clear()
        fusedops.fused_softmax(torch.randn(2, 3, 48, 5).transpose(2, 3), -1, scale=0.5)
        assert not _replay.SOFTMAX_MASKED  # copied x: undecided
        fusedops.fused_softmax(torch.randn(3, 5, 48), -1, scale=0.5)
        assert not _replay.SOFTMAX_MASKED  # 3-d: the ops layer views it, no runner
        fusedops.fused_softmax(torch.randn(2, 3, 5, 48), -1, causal=True)
        (sig,) = _replay.SOFTMAX_MASKED
        assert sig == ((2, 3, 5, 48), F32, -1, 1.0, True, None) and _replay.SOFTMAX_MASKED[sig]
        _replay.SOFTMAX_MASKED.clear()
        with torch.enable_grad():  # a training call (the Function's forward) registers too
            fusedops.fused_softmax(torch.randn(2, 3, 5, 48, requires_grad=True), -1, causal=True)
        assert list(_replay.SOFTMAX_MASKED) == [sig]
        launch_rules("softmax_masked", PLANS=False)
        fusedops.fused_softmax(torch.randn(2, 3, 5, 48), -1, causal=True)
        assert not _replay.SOFTMAX_MASKED


@pytest.mark.gpu
@pytest.mark.parametrize("mask,causal,dtype", [("float", False, BF16), ("bool", True, F32),
                                               ("none", True, BF16)])
def test_gpu_ops_replay_is_bitwise_the_normal_path(monkeypatch, mask, causal, dtype):
    """Inference calls through the ops-level runner (no normal-path call) give the normal
    path's bits, also on a side stream. Skipped where plans cannot run
    (conftest.require_replay_plans)."""
    from fusedops import _replay

    require_replay_plans(tsmm.PLANS)
    normal = count_calls(monkeypatch, tsmm, "_forward")
    shape = (4, 6, 64, 200)
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    m = _mask(mask, shape, "cuda", dtype)
    m = None if m is None else m[:, :1, :, :] if mask == "float" else m
    with torch.no_grad():
        first = fusedops.fused_softmax(x, -1, scale=0.125, mask=m, causal=causal)
        assert any(_replay.SOFTMAX_MASKED.values())
        again = fusedops.fused_softmax(x, -1, scale=0.125, mask=m, causal=causal)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            on_side = fusedops.fused_softmax(x, -1, scale=0.125, mask=m, causal=causal)
        torch.cuda.current_stream().wait_stream(side)
        assert len(normal) == 1  # the later calls replayed
        tsmm._fwd_plans.clear()
        fresh = fusedops.fused_softmax(x, -1, scale=0.125, mask=m, causal=causal)
        assert len(normal) == 2
    assert torch.equal(first, again) and torch.equal(first, on_side)
    assert torch.equal(first, fresh)
