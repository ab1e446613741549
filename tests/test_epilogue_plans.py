"""Replay plans of the LayerNorm epilogue kernels (``layernorm_epilogue_forward`` /
``_backward`` of fusedops.backends.triton): a call whose signature ran before through launches
alone relaunches them with the new call's tensors and seed, skipping the checks and launch rules.

Under the interpreter the plans are built with a recording C entry (conftest's
``recording_entries``) and compared launch by launch with the normal path of a call with the
same seed (same grids, same scalars, the seed words where the kernels take them, every pointer
at the same place relative to the call's inputs and outputs). With a GPU, replayed calls are
compared bit for bit with the normal path on compiled kernels (``gpu`` marker).
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
from fusedops.backends.triton import layernorm_epilogue as tle  # noqa: E402
from fusedops.backends.triton.configs import common as tcfg  # noqa: E402
from fusedops.backends.triton.runtime import launcher as rt_launcher  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32
SEED_A, SEED_B = 0x3A5F_1234_DEAD_BEEF, 12345


@pytest.fixture(autouse=True)
def _no_plans():
    """Each test starts without plans (other tests leave False entries: no C entries on CPU)."""
    tle._fwd_plans.clear()
    tle._bwd_plans.clear()
    yield
    tle._fwd_plans.clear()
    tle._bwd_plans.clear()


def _problem(M, N, dtype, residual=True, affine=True, ds=True, device="cpu"):
    g = torch.Generator().manual_seed(M * 31 + N)
    t = {
        "x": (torch.randn(M, N, generator=g) * 2 + 0.3).to(dtype),
        "residual": torch.randn(M, N, generator=g).to(dtype) if residual else None,
        "weight": (1 + 0.5 * torch.randn(N, generator=g)).to(dtype) if affine else None,
        "bias": (0.3 * torch.randn(N, generator=g)).to(dtype) if affine else None,
        "dout": torch.randn(M, N, generator=g).to(dtype),
        "ds": torch.randn(M, N, generator=g).to(dtype) if ds else None,
    }
    return {k: None if v is None else v.to(device) for k, v in t.items()}


def _forward(t, p, seed, act, need_stats=True):
    return tle.layernorm_epilogue_forward(t["x"], t["residual"], t["weight"], t["bias"], 1e-5,
                                          t["x"].dtype, p, seed, act, need_stats)


def _statistics(t):
    s = t["x"] if t["residual"] is None else t["x"] + t["residual"]
    sf = s.double()
    mean = sf.mean(1)
    rstd = torch.rsqrt(sf.var(1, unbiased=False) + 1e-5)
    return s, mean.float(), rstd.float()


def _backward(t, p, seed, act, need=(True, True, True), grad_dtypes="params"):
    s, mean, rstd = _statistics(t)
    if grad_dtypes == "params":
        grad_dtypes = (t["x"].dtype, t["x"].dtype)
    return tle.layernorm_epilogue_backward(t["dout"], t["ds"], s, t["weight"], t["bias"], mean,
                                           rstd, p, seed, act, *need, grad_dtypes=grad_dtypes)


pytestmark_interp = pytest.mark.skipif(
    not INTERPRETING, reason="CPU tensors need the Triton interpreter (the gpu tests cover this)")

FWD_CASES = {
    "2d, residual, dropout, relu": dict(M=37, N=64, dtype=BF16, p=0.1, act="relu"),
    "2d, plain x, no affine, gelu": dict(M=20, N=48, dtype=F32, p=0.0, act="gelu",
                                         residual=False, affine=False),
    "2d, no statistics": dict(M=9, N=32, dtype=F32, p=0.25, act=None, need_stats=False),
    "looped, dropout": dict(M=5, N=80, dtype=BF16, p=0.2, act="gelu", looped=True),
}
BWD_CASES = {
    "2d, partials, dropout": dict(M=64, N=64, dtype=BF16, p=0.1, act="relu"),
    "2d, one program": dict(M=3, N=32, dtype=F32, p=0.0, act=None),
    "2d, dx only": dict(M=40, N=48, dtype=F32, p=0.3, act="gelu", need=(True, False, False)),
    "2d, dweight only, no ds": dict(M=40, N=48, dtype=BF16, p=0.0, act="relu", ds=False,
                                    need=(False, True, False)),
    "looped, dropout": dict(M=12, N=80, dtype=BF16, p=0.2, act="gelu", looped=True),
}


def _run_case(kind, case, launch_rules):
    """(call(seed) -> outputs, the case's tensors): the backend call of ``case``."""
    case = dict(case)
    if case.pop("looped", False):  # rows past the single-block caps
        launch_rules("layernorm_epilogue", FWD_MAX_BLOCK=32, FWD_MAX_BLOCK_DROPOUT=32,
                     BWD_MAX_BLOCK=32, BWD_MAX_BLOCK_EPILOGUE=32)
    M, N, dtype, p, act = (case.pop(k) for k in ("M", "N", "dtype", "p", "act"))
    need = case.pop("need", (True, True, True))
    need_stats = case.pop("need_stats", True)
    t = _problem(M, N, dtype, **case)
    if kind == "forward":
        return (lambda seed: _forward(t, p, seed, act, need_stats)), \
            (t["x"], t["residual"], t["weight"], t["bias"])
    s, mean, rstd = _statistics(t)

    def call(seed):
        return tle.layernorm_epilogue_backward(t["dout"], t["ds"], s, t["weight"], t["bias"],
                                               mean, rstd, p, seed, act, *need,
                                               grad_dtypes=(dtype, dtype))
    return call, (t["dout"], t["ds"], s, t["weight"], t["bias"], mean, rstd)


# (the forward cases on the 2-D kernel and the cheap backward ones by default; the looped
# kernels and the backward cases with dropout or dx, slower in the interpreter, exhaustive)
@pytestmark_interp
@exhaustive_unless(lambda kind, name: (kind == "forward" and not name.startswith("looped"))
                   or name in ("2d, one program", "2d, dweight only, no ds"))
@pytest.mark.parametrize("kind,name", [("forward", n) for n in FWD_CASES]
                         + [("backward", n) for n in BWD_CASES])
def test_replay_repeats_the_normal_launches(recording_entries, launch_rules, kind, name):
    """A call of a signature seen before replays: the launches a normal call with its seed
    would make (grids, scalars with its seed words, pointers at the same places), into new
    outputs of the normal call's shapes and dtypes."""
    call, inputs = _run_case(kind, (FWD_CASES if kind == "forward" else BWD_CASES)[name],
                             launch_rules)
    plans = tle._fwd_plans if kind == "forward" else tle._bwd_plans
    log = recording_entries
    call(SEED_A)
    assert log and all(e[0] == "normal" for e in log)
    assert len(plans) == 1 and next(iter(plans.values()))
    log.clear()
    replayed = call(SEED_B)
    replay_log = list(log)
    assert replay_log and all(e[0] == "replay" for e in replay_log)
    plans.clear()
    log.clear()
    normal = call(SEED_B)
    assert len(log) == len(replay_log)
    for a, b in zip(normal, replayed, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)
            assert b.is_contiguous() and a.data_ptr() != b.data_ptr()
    for (_, grid1, args1), (_, grid2, raw2) in zip(log, replay_log, strict=True):
        assert grid1 == grid2
        assert relative_args(args1, (*inputs, *normal)) == relative_args(raw2, (*inputs, *replayed))


@pytestmark_interp
def test_replay_without_dropout_ignores_the_seed(recording_entries):
    """Without dropout the seed is not an argument of the result: a replay passes the recorded
    zero words whatever seed it is given, as the normal path does."""
    t = _problem(16, 32, F32)
    log = recording_entries
    _forward(t, 0.0, 0, "relu")
    log.clear()
    _forward(t, 0.0, SEED_A, "relu")
    ((kind, _, raw),) = log
    assert kind == "replay"
    at = tle._seed_position(tle._launch_fwd_2d)
    assert raw[at:at + 2] == (0, 0)


@pytestmark_interp
def test_replayed_seed_is_checked(recording_entries):
    """A replayed call with dropout rejects a seed outside [0, 2^64) as the normal path does."""
    t = _problem(8, 32, F32)
    _forward(t, 0.5, SEED_A, None)
    with pytest.raises(ValueError, match="seed"):
        _forward(t, 0.5, -1, None)
    with pytest.raises(ValueError, match="seed"):
        _forward(t, 0.5, 2**64, None)


@pytestmark_interp
@exhaustive_unless(lambda case: case == "strided weight")  # (the other cases: exhaustive)
@pytest.mark.parametrize("case", ["strided weight", "shared input", "hooks", "no grad_dtypes",
                                  "plans off"])
def test_calls_that_do_not_replay(recording_entries, monkeypatch, case, launch_rules):
    """A launch argument that is neither an input nor inside an output (a weight made
    contiguous for the call) or inputs sharing an address record no plan (a False entry, not
    recorded again); with a launch hook the normal path runs; backward calls without
    grad_dtypes (not the autograd path) and PLANS = False make none."""
    log = recording_entries
    t = _problem(16, 32, BF16)
    if case == "strided weight":
        t["weight"] = torch.randn(32, 2).to(BF16)[:, 0]
    if case == "shared input":
        t["residual"], t["ds"] = t["x"], t["dout"]
    if case == "plans off":
        launch_rules("layernorm_epilogue", PLANS=False)
    grad_dtypes = None if case == "no grad_dtypes" else "params"
    first = (_forward(t, 0.1, SEED_A, "relu"), _backward(t, 0.1, SEED_A, "relu",
                                                           grad_dtypes=grad_dtypes))
    if case == "hooks":
        monkeypatch.setattr(tle, "hooks_registered", lambda: True)
    log.clear()
    second = (_forward(t, 0.1, SEED_A, "relu"),)
    fwd_log = list(log)
    log.clear()
    second += (_backward(t, 0.1, SEED_A, "relu", grad_dtypes=grad_dtypes),)
    assert log and all(e[0] == "normal" for e in log)
    assert fwd_log and all(e[0] == ("replay" if case == "no grad_dtypes" else "normal")
                           for e in fwd_log)
    if case == "hooks":
        assert all(tle._fwd_plans.values()) and all(tle._bwd_plans.values())
    elif case == "plans off":
        assert not tle._fwd_plans and not tle._bwd_plans
    elif case == "no grad_dtypes":
        assert all(tle._fwd_plans.values()) and not tle._bwd_plans
    else:
        assert list(tle._fwd_plans.values()) == [False]
        assert list(tle._bwd_plans.values()) == [False]
    # (a replayed forward launched nothing here: its outputs are uninitialised)
    compared = first[1:] if case == "no grad_dtypes" else first
    for a, b in zip(compared, second[len(first) - len(compared):], strict=True):
        for u, v in zip(a, b, strict=True):
            assert (u is None) == (v is None)
            if u is not None:
                assert torch.equal(u, v)


@pytestmark_interp
def test_autograd_steps_replay(recording_entries, triton_backend):
    """Through fused_layernorm and autograd: the second training step's forward and backward
    both replay (the seed drawn for each step reaches the replayed launches)."""
    x = torch.randn(16, 32, requires_grad=True)
    r = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    log = recording_entries
    for step in range(2):
        log.clear()
        out, s = fusedops.fused_layernorm(x, 32, w, residual=r, dropout_p=0.1,
                                          activation="relu")
        torch.autograd.grad((out, s), (x, r, w), (torch.ones_like(out), torch.ones_like(s)))
        kinds = {e[0] for e in log}
        assert kinds == ({"normal"} if step == 0 else {"replay"})


def test_plans_cleared_with_the_launch_rules():
    """Plans go when the launch rules change (set_single_block_limit)."""
    tle._fwd_plans.put(("k",), lambda *a: None)
    tle._bwd_plans.put(("k",), lambda *a: None)
    tcfg.set_single_block_limit(None)
    assert not tle._fwd_plans and not tle._bwd_plans


def test_every_seeded_kernel_takes_k0_then_k1():
    """The replay substitutes the seed words at k0 and the argument after it: every launcher of
    the module whose kernel takes k0 takes k1 right after it, after its tensor arguments."""
    launchers = [v for v in vars(tle).values() if isinstance(v, rt_launcher.Launcher)]
    seeded = [la for la in launchers if tle._seed_position(la) is not None]
    assert len(seeded) == 5
    for la in seeded:
        names = list(la.kernel.arg_names)
        at = tle._seed_position(la)
        assert at > 0 and names[at:at + 2] == ["k0", "k1"]


# ------------------------------------------------------------------ end to end on the GPU

GPU_CASES = {  # every launch path, with and without dropout
    "fwd 2d": ("forward", dict(M=4096, N=768, dtype=BF16, p=0.1, act="relu")),
    "fwd 2d plain": ("forward", dict(M=3000, N=1024, dtype=F32, p=0.0, act=None)),
    "fwd looped": ("forward", dict(M=300, N=10000, dtype=BF16, p=0.1, act="gelu")),
    "bwd 2d": ("backward", dict(M=4096, N=768, dtype=BF16, p=0.1, act="relu")),
    "bwd 2d plain": ("backward", dict(M=4096, N=1024, dtype=F32, p=0.0, act=None)),
    "bwd 2d few rows": ("backward", dict(M=2, N=768, dtype=BF16, p=0.1, act=None)),
    "bwd looped": ("backward", dict(M=300, N=6000, dtype=BF16, p=0.1, act="gelu")),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_replay_is_bitwise_the_normal_path(name, monkeypatch):
    """The second call replays (no normal-path call) and gives the normal path's bits for its
    own seed, on a side stream too. Skipped where plans cannot run
    (conftest.require_replay_plans)."""
    require_replay_plans(tle.PLANS)
    kind, case = GPU_CASES[name]
    case = dict(case)
    M, N, dtype, p, act = (case.pop(k) for k in ("M", "N", "dtype", "p", "act"))
    t = _problem(M, N, dtype, device="cuda")
    run = (lambda seed: _forward(t, p, seed, act)) if kind == "forward" else \
        (lambda seed: _backward(t, p, seed, act))
    plans = tle._fwd_plans if kind == "forward" else tle._bwd_plans
    normal = count_calls(monkeypatch, tle, "_forward" if kind == "forward" else "_backward")
    plans.clear()
    first = run(SEED_A)
    assert len(plans) == 1 and next(iter(plans.values()))
    again = run(SEED_A)
    other = run(SEED_B)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = run(SEED_B)
    torch.cuda.current_stream().wait_stream(side)
    assert len(normal) == 1  # every call after the first replayed
    plans.clear()
    normal_b = run(SEED_B)
    assert len(normal) == 2
    for want, outs in ((first, again), (normal_b, other), (normal_b, on_side)):
        for a, b in zip(want, outs, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b)
    if p > 0:
        assert not torch.equal(first[0], other[0])  # the seed reached the replayed launches


# ------------------------------------------------------------------ rows of any rank

@pytestmark_interp
@pytest.mark.parametrize("p,act", [(0.0, None), (0.2, "gelu")])
def test_forward_takes_contiguous_rows_of_any_rank(p, act):
    """Contiguous (B, T, N) x and residual give the bits of their (B*T, N) views, in x's shape;
    other layouts of a rank other than 2 are refused."""
    t = _problem(12, 48, BF16)
    x3, r3 = t["x"].view(3, 4, 48), t["residual"].view(3, 4, 48)
    flat = _forward(t, p, SEED_A, act)
    nd = tle.layernorm_epilogue_forward(x3, r3, t["weight"], t["bias"], 1e-5, BF16, p, SEED_A,
                                        act, True)
    assert nd[0].shape == nd[1].shape == (3, 4, 48)
    for a, b in zip(flat, nd, strict=True):
        assert torch.equal(a.reshape(b.shape), b)
    with pytest.raises(ValueError, match="contiguous"):
        tle.layernorm_epilogue_forward(x3.transpose(0, 1), None, None, None, 1e-5, BF16, 0.0, 0,
                                       None, False)
    with pytest.raises(ValueError, match="residual"):
        tle.layernorm_epilogue_forward(x3, r3.transpose(0, 1).contiguous(), None, None, 1e-5,
                                       BF16, 0.0, 0, None, False)


# ------------------------------------------------------------------ the ops-level replay

@pytest.fixture
def ops_runner(recording_entries, monkeypatch):
    """An inference add + LayerNorm plan recorded for (2, 8, 32) float32 rows, with the ops
    layer's runner registered (CPU tensors pass its CUDA checks while registering)."""
    from fusedops import _replay

    x = torch.randn(2, 8, 32)
    r = torch.randn(2, 8, 32)
    w, b = torch.randn(32), torch.randn(32)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    # Forced: calls this small would otherwise run PyTorch's ops (the size rule).
    with fusedops.use_backend("triton"):
        tle.layernorm_epilogue_forward(x, r, w, b, 1e-5, F32, 0.0, 0, None, False)
        (sig,) = _replay.LAYERNORM_RESIDUAL
        assert sig == (x.shape, F32, -1, 1e-5)
        recording_entries.clear()
        yield _replay.LAYERNORM_RESIDUAL[sig], (x, r, w, b), recording_entries


@pytestmark_interp
def test_ops_layer_replays_inference_add_layernorm(ops_runner, monkeypatch):
    """A plain inference call of the signature goes straight to the runner: one replayed
    launch, no checks or dispatch; calls needing gradients take the normal path."""
    run, (x, r, w, b), log = ops_runner
    with torch.no_grad(), pytest.raises(TypeError, match="training"):
        fusedops.fused_layernorm(x, 32, w, b, residual=r, training="yes")  # still an error
    assert not log

    def checks(*args):
        raise LookupError("the call ran the checks")

    monkeypatch.setattr(fusedops.ops.layernorm, "check_layernorm_args", checks)
    with torch.no_grad():
        out, s = fusedops.fused_layernorm(x, 32, w, b, residual=r)
    assert [e[0] for e in log] == ["replay"]
    assert out.shape == s.shape == x.shape and out.dtype == x.dtype
    log.clear()
    with pytest.raises(LookupError, match="ran the checks"):  # needs gradients
        fusedops.fused_layernorm(x, 32, w.requires_grad_(), b, residual=r)


@pytestmark_interp
def test_ops_runner_declines_what_the_signature_does_not_fix(ops_runner, monkeypatch):
    run, (x, r, w, b), log = ops_runner
    assert run(x, r, w, b) is not None
    assert run(x, r, torch.nn.Parameter(w), b) is not None
    declined = [
        (x, [1.0], w, b),  # residual not a tensor
        (x, r.double(), w, b),
        (x, r[:1], w, b),
        (x, r.transpose(0, 1).contiguous().transpose(0, 1), w, b),
        (x, torch.randn(2 * 8 * 32 + 1)[1:].view(2, 8, 32), w, b),  # misaligned residual
        (torch.randn(2 * 8 * 32 + 1)[1:].view(2, 8, 32), r, w, b),  # misaligned x
        (x, r, w.double(), b),
        (x, r, None, b),
        (x, r, w, torch.randn(64)[::2]),
    ]
    assert [run(*call) for call in declined] == [None] * len(declined)
    monkeypatch.setattr(tle, "hooks_registered", lambda: True)
    assert run(x, r, w, b) is None
    assert [e[0] for e in log] == ["replay"] * 2
    tle._fwd_plans.clear()  # plans dropped: their runners go too
    from fusedops import _replay

    assert not _replay.LAYERNORM_RESIDUAL
