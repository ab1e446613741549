"""LayerNorm backward replay plans (fusedops.backends.triton.layernorm_bwd.layernorm_backward): a
call whose signature ran before through launches alone replays those launches with the new call's
tensors.

Under the interpreter the plans are built with a recording C entry and compared launch by launch
with the normal path (same grids, same scalars, every pointer at the same place relative to the
call's inputs and outputs). With a GPU, replayed calls of every backward path are compared bit
for bit with the normal path on compiled kernels (``gpu`` marker).
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    INTERPRETING,
    assert_close_to_ref,
    count_calls,
    exhaustive_unless,
    relative_args,
    require_replay_plans,
)

import fusedops
from fusedops.backends.triton import layernorm_bwd as tlnb
from fusedops.backends.triton.configs import common as tcfg
from fusedops.backends.triton.configs import layernorm as ln_rules
from fusedops.backends.triton.runtime import launcher as rt_launcher
from fusedops.backends.triton.runtime import recording as rt_recording
from fusedops.backends.triton.runtime import split as rt_split

BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture(autouse=True)
def _no_plans():
    tlnb._bwd_plans.clear()
    yield
    tlnb._bwd_plans.clear()


def _inputs(M, N, dtype, weight=True, device=None):
    g = torch.Generator().manual_seed(M * 7 + N)
    x = (torch.randn(M, N, generator=g) * 2 + 0.3).to(dtype)
    dy = torch.randn(M, N, generator=g).to(dtype)
    w = (1 + 0.5 * torch.randn(N, generator=g)).to(dtype) if weight else None
    xf = x.double()
    mean = xf.mean(1)
    rstd = torch.rsqrt(xf.var(1, unbiased=False) + 1e-5)
    out = [dy, x, w, mean.float(), rstd.float()]
    return [None if t is None else t.to(device or "cpu") for t in out]


def _backward(inputs, need=(True, True, True), grad_dtypes=(None, None)):
    """The backend call as the eager autograd path makes it (grad_dtypes given)."""
    dy, x, w, mean, rstd = inputs
    return tlnb.layernorm_backward(dy, x, w, mean, rstd, *need, grad_dtypes=grad_dtypes)


pytestmark_interp = pytest.mark.skipif(
    not INTERPRETING, reason="CPU tensors need the Triton interpreter (the gpu tests cover this)")


# (the float32 cases and the column kernel's by default; the other bfloat16 ones, slower in the
# interpreter, exhaustive)
@pytestmark_interp
@exhaustive_unless(lambda case: case["dtype"] == F32 or case.get("need") == (False, True, True))
@pytest.mark.parametrize("case", [
    dict(M=37, N=64, dtype=BF16),
    dict(M=37, N=64, dtype=F32, weight=False),
    dict(M=300, N=48, dtype=F32, need=(True, False, False)),
    dict(M=300, N=48, dtype=BF16, need=(True, True, False), grad_dtypes=(BF16, BF16)),
    dict(M=90, N=65, dtype=BF16, body_from=16),  # unaligned rows: aligned body + edges
    dict(M=64, N=64, dtype=BF16, need=(False, True, True)),  # no dx: the column kernel
    dict(M=70, N=64, dtype=F32, max_block=32),  # column kernel (partials in dx), then dx rows
], ids=str)
def test_replay_repeats_the_normal_launches(recording_entries, monkeypatch, case, launch_rules):
    """The second call of a signature launches exactly what the first launched (grids, scalars,
    every pointer at the same place relative to the call's tensors) and allocates outputs like
    the first call's; the first call's results are right."""
    case = dict(case)
    if "body_from" in case:
        launch_rules("layernorm", FUSED_BWD_UNALIGNED_MIN_BLOCK=case.pop("body_from"))
    if "max_block" in case:
        launch_rules("layernorm", FUSED_BWD_MAX_BLOCK=case.pop("max_block"))
    need = case.pop("need", (True, True, True))
    grad_dtypes = case.pop("grad_dtypes", (None, None))
    inputs = _inputs(case.pop("M"), case.pop("N"), case.pop("dtype"), **case)
    log = recording_entries
    first = _backward(inputs, need, grad_dtypes)
    normal = [e for e in log if e[0] == "normal"]
    assert normal and len(normal) == len(log)
    assert len(tlnb._bwd_plans) == 1 and next(iter(tlnb._bwd_plans.values()))
    log.clear()
    second = _backward(inputs, need, grad_dtypes)
    assert [e[0] for e in log] == ["replay"] * len(normal)
    for a, b in zip(first, second, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)
            assert b.is_contiguous() and a.data_ptr() != b.data_ptr()
    bases1, bases2 = (*inputs, *first), (*inputs, *second)
    for (_, grid1, args1), (_, grid2, raw2) in zip(normal, log, strict=True):
        assert grid1 == grid2
        n = sum(isinstance(a, torch.Tensor) for a in args1)
        rel = relative_args(args1[:n], bases1)
        assert "scratch" not in rel and rel == relative_args(raw2[:n], bases2)
        assert tuple(args1[n:]) == tuple(raw2[n:])
    # the normal path's results against float64
    dy, x, w, mean, rstd = inputs
    ref_x = x.double().requires_grad_()
    ref_w = None if w is None else w.double().requires_grad_()
    y = torch.nn.functional.layer_norm(ref_x, (x.shape[1],), ref_w, None, 1e-5)
    want = torch.autograd.grad(y, [t for t in (ref_x, ref_w) if t is not None], dy.double())
    if need[0]:
        assert_close_to_ref(first[0], want[0], x.dtype, 4.0)
    if need[1] and w is not None:
        assert_close_to_ref(first[1].float(), want[1], x.dtype, 16.0)


@pytestmark_interp
@exhaustive_unless(lambda case: case == "fast mode")  # (the other cases: exhaustive)
@pytest.mark.parametrize("case", ["fast mode", "few rows", "hooks", "shared input", "compiled"])
def test_calls_that_do_not_replay(recording_entries, monkeypatch, case):
    """Paths whose results do not come from launches alone into the outputs (scratch of the
    fast mode, the column kernel's fallbacks, inputs sharing an address) record no plan (a
    False entry: not recorded again); with a launch hook registered the normal path runs;
    calls without grad_dtypes (torch.compile's custom op) neither make nor use plans."""
    log = recording_entries
    inputs = _inputs(2 if case == "few rows" else 64, 64, BF16)
    need = (True, True, True)
    if case == "shared input":
        inputs[0] = inputs[1]
    mode = "fast" if case == "fast mode" else "low_memory"
    grad_dtypes = None if case == "compiled" else (None, None)  # as torch.compile's custom op
    with fusedops.layernorm_backward_mode(mode):
        first = _backward(inputs, need, grad_dtypes)
        if case == "hooks":
            monkeypatch.setattr(tlnb, "hooks_registered", lambda: True)
        log.clear()
        second = _backward(inputs, need, grad_dtypes)
    assert log and all(e[0] == "normal" for e in log)
    if case == "compiled":
        assert not tlnb._bwd_plans
    else:
        (plan,) = tlnb._bwd_plans.values()
        assert plan if case == "hooks" else plan is False
    for a, b in zip(first, second, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


def test_plans_cleared_with_the_launch_rules(launch_rules):
    """Plans go when the launch rules change (set_single_block_limit) or the split-row kernels
    are disabled."""
    tlnb._bwd_plans.put(("k",), lambda *a: None)
    tcfg.set_single_block_limit(None)
    assert not tlnb._bwd_plans
    launch_rules(SPLIT_ROWS=True)
    tlnb._bwd_plans.put(("k",), lambda *a: None)
    with pytest.warns(RuntimeWarning, match="split-row kernels disabled"):
        rt_split.disable_split_rows("test")
    assert not tlnb._bwd_plans


# ------------------------------------------------------------------ end to end on the GPU

GPU_CASES = [  # (M, N, dtype, weight, need): every backward path that replays
    (4096, 1024, BF16, True, (True, True, True)),     # fused, aligned
    (3000, 768, F32, False, (True, True, True)),      # fused, no weight
    (1000, 8193, BF16, True, (True, True, True)),     # fused, unaligned body
    (512, 4096, F32, True, (True, True, False)),      # fused float32 tiles
    (256, 16384, BF16, True, (True, True, True)),     # split rows
    (200, 65537, torch.float16, True, (True, True, True)),  # split, unaligned pieces
    (128, 32768, F32, True, (True, False, False)),    # split, dx only
]


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,dtype,weight,need", GPU_CASES, ids=str)
def test_gpu_replayed_backward_is_bitwise_the_normal_path(monkeypatch, M, N, dtype, weight,
                                                          need):
    """The second call replays (no normal-path call) and gives the first call's bits; on a
    side stream too; and with plans dropped, the normal path again. Skipped where plans
    cannot run (see conftest.require_replay_plans)."""
    require_replay_plans(ln_rules.BWD_PLANS)
    normal = count_calls(monkeypatch, tlnb, "_backward")
    inputs = _inputs(M, N, dtype, weight, device="cuda")
    first = _backward(inputs, need, (dtype, dtype))
    assert len(tlnb._bwd_plans) == 1 and next(iter(tlnb._bwd_plans.values()))
    second = _backward(inputs, need, (dtype, dtype))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        third = _backward(inputs, need, (dtype, dtype))
    torch.cuda.current_stream().wait_stream(s)
    assert len(normal) == 1  # the second and third calls replayed
    tlnb._bwd_plans.clear()
    fourth = _backward(inputs, need, (dtype, dtype))
    assert len(normal) == 2
    for outs in (second, third, fourth):
        for a, b in zip(first, outs, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b)
    dy, x, w, mean, rstd = inputs
    ref_x = x.double().requires_grad_()
    y = torch.nn.functional.layer_norm(ref_x, (N,), None if w is None else w.double(), None,
                                       1e-5)
    (want,) = torch.autograd.grad(y, ref_x, dy.double())
    assert_close_to_ref(first[0], want, dtype, 8.0)


@pytest.mark.gpu
def test_gpu_autograd_backward_replays(monkeypatch):
    """Through fused_layernorm and autograd: repeated backward calls replay (one normal-path
    call in three) and give the same gradients."""
    require_replay_plans(ln_rules.BWD_PLANS)
    normal = count_calls(monkeypatch, tlnb, "_backward")
    x = torch.randn(2048, 2048, device="cuda", dtype=BF16, requires_grad=True)
    w = torch.randn(2048, device="cuda", dtype=BF16, requires_grad=True)
    b = torch.randn(2048, device="cuda", dtype=BF16, requires_grad=True)
    y = fusedops.fused_layernorm(x, 2048, w, b)
    dy = torch.randn_like(y)
    grads = [torch.autograd.grad(y, (x, w, b), dy, retain_graph=True) for _ in range(3)]
    for g in grads[1:]:
        assert all(torch.equal(a, c) for a, c in zip(grads[0], g, strict=True))
    assert any(tlnb._bwd_plans.values()) and len(normal) == 1


def test_recordings_are_per_thread():
    """Two threads recording at once (the autograd engine runs CUDA backward functions on one
    worker thread per device) each get their own launches only, and a nested recording in one
    thread gets its block's launches, which the outer one also gets, in order."""
    import threading

    device = "cpu" if INTERPRETING or not torch.cuda.is_available() else "cuda"
    tensors = [torch.ones(40, dtype=torch.int32, device=device) for _ in range(2)]
    # A timeout, so that a thread that fails cannot leave the other waiting forever.
    both_recording = threading.Barrier(2, timeout=120)
    # The launches themselves one at a time: Triton's interpreter patches triton.language
    # while it runs a kernel, so two interpreted launches at once interfere (a CI run hung
    # here). Both threads are recording throughout, which is what is tested.
    one_launch = threading.Lock()
    records, errors = [None, None], []

    def work(i):
        try:
            with rt_recording.record_launches() as record:
                both_recording.wait()
                with one_launch:
                    rt_split.zero_counters(tensors[i])
                rt_recording.mark_replayable()
                both_recording.wait()
            records[i] = record
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            both_recording.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, record in enumerate(records):
        assert record.replayable and len(record) == 1 and record[0][2][0] is tensors[i]
        assert not tensors[i].any()
    assert not rt_launcher.recording
    with rt_recording.record_launches() as outer:
        rt_split.zero_counters(tensors[1])
        with rt_recording.record_launches() as inner:
            rt_split.zero_counters(tensors[0])
            rt_recording.mark_replayable()
        rt_split.zero_counters(tensors[1])
    assert len(inner) == 1 and inner[0][2][0] is tensors[0] and inner.replayable
    assert [launch[2][0] for launch in outer] == [tensors[1], tensors[0], tensors[1]]
    assert not outer.replayable  # the outer call's own path says whether it replays
    assert not rt_launcher.recording
