"""Replay tables (fusedops._replay): small inference calls seen before go straight to the runner
their backend registered, and every call a runner cannot run exactly as the registering call ran
takes the normal path (same result, same error).

The ops-layer half runs anywhere with stand-in runners. The Triton runners are tested on CPU
with a recording C entry (tensors made to look like CUDA ones) and, with a GPU, end to end on
compiled kernels (``gpu`` marker).
"""

from __future__ import annotations

import pytest
import torch
from conftest import tol

import fusedops
from fusedops import _dispatch, _replay
from fusedops.backends.triton.configs import common as tcfg
from fusedops.backends.triton.runtime import plans as rt_plans


@pytest.fixture(autouse=True)
def _clean_tables():
    # A forced backend: CPU tensors then take fusedops' own path (automatically they run
    # PyTorch's ops, before any replay table is read).
    with fusedops.use_backend("reference"):
        _replay.clear()
        yield
        _replay.clear()


class _Runner:
    """A stand-in runner: records its calls and returns ``result`` (None: "cannot run this")."""

    def __init__(self, result):
        self.result, self.calls = result, []

    def __call__(self, *args):
        self.calls.append(args)
        return self.result


def _softmax_runner(x, result):
    run = _replay.SOFTMAX[(x.shape, x.dtype, x.get_device())] = _Runner(result)
    return run


def _layernorm_runner(x, eps, result):
    run = _replay.LAYERNORM[(x.shape, x.dtype, x.get_device(), eps)] = _Runner(result)
    return run


# ------------------------------------------------------------------ the ops layer's fast path


def test_softmax_replays_plain_inference_calls():
    x = torch.randn(4, 8)
    marker = torch.zeros(4, 8)
    run = _softmax_runner(x, marker)
    assert fusedops.fused_softmax(x) is marker
    assert fusedops.fused_softmax(x, -1) is marker
    with torch.no_grad():
        assert fusedops.fused_softmax(x.clone().requires_grad_()) is marker
    with torch.inference_mode():
        assert fusedops.fused_softmax(x) is marker
    assert len(run.calls) == 4


@pytest.mark.parametrize("case", [
    "dtype", "other dim spelling", "grad", "autocast", "counting", "parameter", "other shape",
    "other dtype", "runner declines",
])
def test_softmax_takes_the_normal_path(case):
    """Calls the signature does not cover: the normal path's result, the runner not called
    (or called and declining)."""
    x = torch.randn(4, 8)
    run = _softmax_runner(x, None if case == "runner declines" else torch.zeros(4, 8))
    expected = torch.softmax(x, -1)
    if case == "dtype":
        out = fusedops.fused_softmax(x, dtype=torch.float32)
    elif case == "other dim spelling":
        out = fusedops.fused_softmax(x, 1)
    elif case == "grad":
        xg = x.clone().requires_grad_()
        out = fusedops.fused_softmax(xg)
        assert out.grad_fn is not None
    elif case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fusedops.fused_softmax(x)
    elif case == "counting":
        with fusedops.count_fused_calls():
            out = fusedops.fused_softmax(x)
    elif case == "parameter":
        out = fusedops.fused_softmax(torch.nn.Parameter(x, requires_grad=False))
    elif case == "other shape":
        x = x[:2].clone()
        expected = torch.softmax(x, -1)
        out = fusedops.fused_softmax(x)
    elif case == "other dtype":
        x = x.double()
        expected = torch.softmax(x, -1)
        out = fusedops.fused_softmax(x)
    else:
        out = fusedops.fused_softmax(x)
    torch.testing.assert_close(out, expected.to(out.dtype), **tol(out.dtype))
    assert len(run.calls) == (1 if case == "runner declines" else 0)


@pytest.mark.parametrize("dim", [-1.0, True])
def test_softmax_bad_dim_still_raises(dim):
    """-1.0 == -1 and True == 1 as dict keys and comparisons: the fast path must not let them
    through where the normal path raises."""
    x = torch.randn(4, 2)
    _softmax_runner(x, torch.zeros(4, 2))
    with pytest.raises(TypeError, match="dim"):
        fusedops.fused_softmax(x, dim)


@pytest.mark.parametrize("normalized_shape", [8, (8,), torch.Size([8])])
def test_layernorm_replays_plain_inference_calls(normalized_shape):
    x = torch.randn(3, 8)
    w, b = torch.randn(8), torch.randn(8)
    marker = torch.zeros(3, 8)
    run = _layernorm_runner(x, 1e-5, marker)
    assert fusedops.fused_layernorm(x, normalized_shape, w, b) is marker
    assert fusedops.fused_layernorm(x, normalized_shape) is marker
    assert run.calls == [(x, w, b), (x, None, None)]


@pytest.mark.parametrize("case", [
    "list shape", "other last dim", "two dims", "int eps", "other eps", "autocast", "counting",
    "grad", "grad weight", "runner declines",
])
def test_layernorm_takes_the_normal_path(case):
    x = torch.randn(3, 2, 8)
    w, b = torch.randn(8), torch.randn(8)
    run = _layernorm_runner(x, 1e-5, None if case == "runner declines" else torch.zeros(3, 2, 8))
    shape, eps = (8,), 1e-5
    if case == "list shape":
        shape = [8]
    elif case == "two dims":
        shape, w, b = (2, 8), torch.randn(2, 8), torch.randn(2, 8)
    elif case == "int eps":
        eps = 0
    elif case == "other eps":
        eps = 1e-6
    expected = torch.nn.functional.layer_norm(x, tuple(shape), w, b, eps)
    if case == "other last dim":
        with pytest.raises(ValueError, match="normalized_shape"):
            fusedops.fused_layernorm(x, (2,), w, b, eps)
        assert not run.calls
        return
    if case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fusedops.fused_layernorm(x, shape, w, b, eps)
    elif case == "counting":
        with fusedops.count_fused_calls():
            out = fusedops.fused_layernorm(x, shape, w, b, eps)
    elif case == "grad":
        out = fusedops.fused_layernorm(x.clone().requires_grad_(), shape, w, b, eps)
        assert out.grad_fn is not None
    elif case == "grad weight":
        out = fusedops.fused_layernorm(x, shape, torch.nn.Parameter(w), b, eps)
        assert out.grad_fn is not None
        with torch.no_grad():  # no gradient wanted: replayed
            assert fusedops.fused_layernorm(x, shape, torch.nn.Parameter(w), b, eps) is run.result
        run.calls.clear()
    else:
        out = fusedops.fused_layernorm(x, shape, w, b, eps)
    torch.testing.assert_close(out, expected.to(out.dtype), **tol(out.dtype))
    assert len(run.calls) == (1 if case == "runner declines" else 0)


def _rmsnorm_runner(x, eps, result):
    run = _replay.RMSNORM[(x.shape, x.dtype, x.get_device(), eps)] = _Runner(result)
    return run


def test_rmsnorm_replays_plain_inference_calls():
    """eps=None looks up the float it resolves to (float32's epsilon for these dtypes)."""
    x = torch.randn(3, 2, 8)
    w = torch.randn(8)
    marker = torch.zeros(3, 2, 8)
    run = _rmsnorm_runner(x, torch.finfo(torch.float32).eps, marker)
    assert fusedops.fused_rmsnorm(x, 8, w) is marker
    assert fusedops.fused_rmsnorm(x, [8]) is not marker  # a list: the normal path
    assert fusedops.fused_rmsnorm(x, (8,)) is marker
    assert run.calls == [(x, w), (x, None)]
    run6 = _rmsnorm_runner(x, 1e-6, marker)
    assert fusedops.fused_rmsnorm(x, 8, w, 1e-6) is marker and run6.calls == [(x, w)]


@pytest.mark.parametrize("case", ["grad", "grad weight", "int eps", "counting", "declines",
                                  "bad weight"])
def test_rmsnorm_takes_the_normal_path(case):
    x = torch.randn(4, 8)
    w = torch.randn(8)
    run = _rmsnorm_runner(x, 1e-5, None if case == "declines" else torch.zeros(4, 8))
    eps = 1e-5
    if case == "grad":
        out = fusedops.fused_rmsnorm(x.clone().requires_grad_(), 8, w, eps)
        assert out.grad_fn is not None
    elif case == "grad weight":
        out = fusedops.fused_rmsnorm(x, 8, torch.nn.Parameter(w), eps)
        assert out.grad_fn is not None
    elif case == "int eps":
        eps = 0
        out = fusedops.fused_rmsnorm(x, 8, w, eps)
    elif case == "counting":
        with fusedops.count_fused_calls():
            out = fusedops.fused_rmsnorm(x, 8, w, eps)
    elif case == "bad weight":  # the runner is not consulted before the checks would raise?
        run.result = None  # it declines what it cannot run; the normal path raises
        with pytest.raises(ValueError, match="weight"):
            fusedops.fused_rmsnorm(x, 8, torch.randn(7), eps)
        return
    else:
        out = fusedops.fused_rmsnorm(x, 8, w, eps)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (8,), w, eps),
                               **tol(out.dtype))
    assert len(run.calls) == (1 if case == "declines" else 0)


def test_layernorm_bad_parameters_still_raise():
    """A runner that declines (here: a weight of the wrong shape) leaves the error to the normal
    path's checks."""
    x = torch.randn(3, 8)
    _layernorm_runner(x, 1e-5, None)
    with pytest.raises(ValueError, match="weight"):
        fusedops.fused_layernorm(x, 8, torch.randn(9))
    with pytest.raises(TypeError, match="weight"):
        fusedops.fused_layernorm(x, 8, [1.0] * 8)


def test_compiled_calls_never_replay():
    """Under torch.compile the ops trace their normal path (Dynamo must see the custom ops)."""
    x = torch.randn(4, 8)
    run = _softmax_runner(x, torch.zeros(4, 8))
    compiled = torch.compile(lambda t: fusedops.fused_softmax(t), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), torch.softmax(x, -1))
    assert not run.calls


def test_backend_changes_clear_the_tables():
    x = torch.randn(4, 8)
    _softmax_runner(x, torch.zeros(4, 8))
    _layernorm_runner(x, 1e-5, torch.zeros(4, 8))
    with fusedops.use_backend("reference"):
        assert not _replay.SOFTMAX and not _replay.LAYERNORM
        torch.testing.assert_close(fusedops.fused_softmax(x), torch.softmax(x, -1))


def test_plain_eager_reads_global_state():
    assert _dispatch.plain_eager()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not _dispatch.plain_eager()
    with fusedops.count_fused_calls():
        assert not _dispatch.plain_eager()
    assert _dispatch.plain_eager()


# ------------------------------------------------------------------ the Triton runners


class _Launch:
    """Triton 3.6's C entry stand-in: records the arguments of every launch."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


class _Entry:
    """A direct entry (``rt_launcher.direct_entry``'s go) exposing a recording C entry."""

    raw_pointers = True

    def __init__(self, launch):
        self.c_entry = (launch, 77, False, False, (4, 1, 0))


class _FakeLauncher:
    def __init__(self, entry):
        self._entry = entry

    def entry(self, args, num_warps):
        return self._entry


@pytest.fixture
def as_cuda(monkeypatch, fake_stream):
    """CPU tensors pass the runners' CUDA checks; streams and hooks are stand-ins."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))


def _launch_head(grid: int, device: int) -> tuple:
    return (grid, 1, 1, ("stream", device), 77, False, False, None, None, (4, 1, 0), None, None,
            None)


def test_softmax_runner_launches_the_plan(as_cuda, monkeypatch):
    """A new plan with out dtype = x's dtype registers a runner; a plain call then launches the
    plan's kernel with (x, y) addresses and the recorded tail; calls it cannot run decline."""
    from fusedops.backends.triton import softmax as tsm

    x = torch.randn(6, 64)
    launch = _Launch()
    key = (x.shape, x.dtype, x.dtype, x.get_device())
    tsm._fwd_plans.add(key, _FakeLauncher(_Entry(launch)), (3,), (x, x, 6, 64, "c"), 4, 2)
    tsm._fwd_plans.add((x.shape, x.dtype, torch.float64, -1),  # another out dtype: no runner
                       _FakeLauncher(_Entry(launch)), (3,), (x, x, 6), 4, 2)
    assert list(_replay.SOFTMAX) == [(x.shape, x.dtype, x.get_device())]
    y = fusedops.fused_softmax(x)
    assert launch.calls == [_launch_head(3, -1) + (x.data_ptr(), y.data_ptr(), 6, 64, "c")]
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    run = _replay.SOFTMAX[(x.shape, x.dtype, -1)]
    strided = torch.randn(6, 80)[:, :64]
    misaligned = torch.randn(6 * 64 + 1)[1:].view(6, 64)
    assert run(strided) is None and run(misaligned) is None
    monkeypatch.setattr(tsm, "hooks_registered", lambda: True)  # e.g. Proton is profiling
    assert run(x) is None
    assert len(launch.calls) == 1
    tsm._fwd_plans.clear()  # plans dropped: their runners go too
    assert not _replay.SOFTMAX


@pytest.mark.parametrize("affine", ["both", "none", "weight", "bias"])
def test_layernorm_runner_launches_the_plan(as_cuda, affine):
    """The LayerNorm runner passes (x, weight, bias, y, y, y) addresses (y's address for absent
    parameters and the absent statistics) and the recorded tail; only inference plans in x's
    dtype register one."""
    from fusedops.backends.triton import layernorm as tln

    x = torch.randn(5, 48, dtype=torch.bfloat16)
    w = torch.randn(48) if affine in ("both", "weight") else None
    b = torch.randn(48) if affine in ("both", "bias") else None
    launch = _Launch()
    key = (x.shape, x.dtype, x.dtype, -1, 1e-5, False, None if w is None else w.dtype,
           None if b is None else b.dtype)
    args = (x, x, x, x, x, x, 5, "tail")
    tln._fwd_plans.add(key, _FakeLauncher(_Entry(launch)), (2,), args, 4, 6)
    for other in (key[:5] + (True,) + key[6:], key[:2] + (torch.float32,) + key[3:]):
        tln._fwd_plans.add(other, _FakeLauncher(_Entry(launch)), (2,), args, 4, 6)
    assert list(_replay.LAYERNORM) == [(x.shape, x.dtype, -1, 1e-5)]
    y = fusedops.fused_layernorm(x, 48, w, b)
    yp = y.data_ptr()
    assert launch.calls == [_launch_head(2, -1) + (
        x.data_ptr(), yp if w is None else w.data_ptr(), yp if b is None else b.data_ptr(),
        yp, yp, yp, 5, "tail")]
    assert y.shape == x.shape and y.dtype == x.dtype


def test_layernorm_runner_declines_other_parameters(as_cuda):
    """Every parameter property the plan depends on is re-checked: presence, class, dtype,
    shape, layout, alignment (and x's layout)."""
    from fusedops.backends.triton import layernorm as tln

    x = torch.randn(5, 48)
    w = torch.randn(48)
    launch = _Launch()
    key = (x.shape, x.dtype, x.dtype, -1, 1e-5, False, torch.float32, None)
    tln._fwd_plans.add(key, _FakeLauncher(_Entry(launch)), (2,), (x,) * 6 + (5,), 4, 6)
    run = _replay.LAYERNORM[(x.shape, x.dtype, -1, 1e-5)]
    assert run(x, w, None) is not None
    assert run(x, torch.nn.Parameter(w), None) is not None  # Parameters are fine
    declined = [
        (x, None, None),  # the plan reads a weight
        (x, w, w),  # ... and no bias
        (x, w.double(), None),
        (x, torch.randn(49), None),
        (x, torch.randn(1, 48), None),
        (x, torch.randn(96)[::2], None),
        (x, torch.randn(49)[1:], None),
        (x, [1.0] * 48, None),
        (x[:, :48].clone().t().contiguous().t(), w, None),
    ]
    results = [run(*call) for call in declined]
    assert results == [None] * len(declined)
    assert len(launch.calls) == 2


def test_plan_cache_registers_runners_for_one_dimensional_grids_only():
    t = torch.zeros(4)
    table = {}
    plans = rt_plans.PlanCache(table, lambda key, plan: (key, plan))
    plans.add("a", _FakeLauncher(_Entry(_Launch())), (1,), (t, t, 3), 4, 2)
    plans.add("b", _FakeLauncher(_Entry(_Launch())), (1, 2), (t, t, 3), 4, 2)
    assert list(table) == ["a"] and table["a"] is plans["a"]
    tcfg.set_single_block_limit(None)
    assert not plans and not table


@pytest.mark.parametrize("weighted", [True, False])
def test_rmsnorm_runner_launches_the_plan(as_cuda, weighted):
    """The RMSNorm runner passes (x, weight, y, y) addresses (y's for an absent weight and the
    absent rstd) and the recorded tail; only inference plans in x's dtype register one, and it
    declines a weight unlike the registering call's."""
    from fusedops.backends.triton import rmsnorm as trms

    x = torch.randn(5, 48, dtype=torch.bfloat16)
    w = torch.randn(48) if weighted else None
    launch = _Launch()
    key = (x.shape, x.dtype, x.dtype, -1, 1e-5, False, None if w is None else w.dtype)
    args = (x, x, x, x, 5, "tail")
    trms._fwd_plans.add(key, _FakeLauncher(_Entry(launch)), (2,), args, 4, 4)
    for other in (key[:5] + (True,) + key[6:], key[:2] + (torch.float32,) + key[3:]):
        trms._fwd_plans.add(other, _FakeLauncher(_Entry(launch)), (2,), args, 4, 4)
    assert list(_replay.RMSNORM) == [(x.shape, x.dtype, -1, 1e-5)]
    y = fusedops.fused_rmsnorm(x, 48, w, 1e-5)
    yp = y.data_ptr()
    assert launch.calls == [_launch_head(2, -1) + (
        x.data_ptr(), yp if w is None else w.data_ptr(), yp, yp, 5, "tail")]
    assert y.shape == x.shape and y.dtype == x.dtype
    run = _replay.RMSNORM[(x.shape, x.dtype, -1, 1e-5)]
    other_w = torch.randn(48, dtype=torch.float64)
    assert run(x, None if weighted else torch.randn(48)) is None and run(x, other_w) is None
    trms._fwd_plans.clear()
    assert not _replay.RMSNORM


# ------------------------------------------------------------------ end to end on the GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="runners need compiled kernels")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_replayed_calls_match_the_normal_path(dtype):
    """Second calls replay (the tables hold a runner) and give the first call's bits, on any
    stream; calls a runner declines still give the right result."""
    tcfg.set_single_block_limit(None)
    x = torch.randn(8, 128, 768, device="cuda", dtype=dtype)
    w = torch.randn(768, device="cuda", dtype=dtype)
    b = torch.randn(768, device="cuda", dtype=dtype)
    # The Triton backend, over this module's forced reference one (its runners are under test).
    with torch.no_grad(), fusedops.use_backend("triton"):
        first_sm = fusedops.fused_softmax(x)
        first_ln = fusedops.fused_layernorm(x, (768,), w, b)
        first_rms = fusedops.fused_rmsnorm(x, (768,), w)
        assert len(_replay.SOFTMAX) == 1 and len(_replay.LAYERNORM) == 1
        assert len(_replay.RMSNORM) == 1
        assert torch.equal(fusedops.fused_rmsnorm(x, 768, w), first_rms)
        assert torch.equal(fusedops.fused_softmax(x), first_sm)
        assert torch.equal(fusedops.fused_layernorm(x, (768,), w, b), first_ln)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            on_stream = fusedops.fused_layernorm(x, 768, w, b)
        s.synchronize()
        assert torch.equal(on_stream, first_ln)
        # the same signature with other parameters: declined, then that call's runner
        first_ln_plain = fusedops.fused_layernorm(x, 768)
        assert torch.equal(fusedops.fused_layernorm(x, 768), first_ln_plain)
        assert torch.equal(fusedops.fused_layernorm(x, 768, w, b), first_ln)
        torch.testing.assert_close(fusedops.fused_layernorm(x, 768, None, b),
                                   torch.nn.functional.layer_norm(x, (768,), None, b),
                                   **tol(dtype))
        strided = torch.randn(8, 128, 800, device="cuda", dtype=dtype)[..., :768]
        torch.testing.assert_close(fusedops.fused_softmax(strided), torch.softmax(strided, -1),
                                   **tol(dtype))
    torch.testing.assert_close(first_sm, torch.softmax(x, -1), **tol(dtype))
    torch.testing.assert_close(
        first_ln, torch.nn.functional.layer_norm(x.float(), (768,), w.float(), b.float())
        .to(dtype), **tol(dtype, 4))
    tcfg.set_single_block_limit(None)
    assert not _replay.SOFTMAX and not _replay.LAYERNORM


@pytest.mark.skipif(not torch.cuda.is_available(), reason="plans need compiled kernels")
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,dtype", [
    (8192, 4096, torch.bfloat16),  # the reload kernel (one program per row, N first)
    (12000, 8192, torch.float32),  # the unrolled kernel (M first)
    (3000, 768, torch.float16),  # the single-block kernel
])
def test_layernorm_forward_statistics_replayed_with_every_row(m, n, dtype):
    """A replayed forward that keeps its statistics allocates mean and rstd for every row,
    whichever row kernel the plan recorded: more rows than columns, so sizing them by any
    other launch argument would leave rows out (writes past the end)."""
    from fusedops.backends.triton import layernorm as tln

    x = torch.randn(m, n, device="cuda", dtype=dtype)
    w = torch.randn(n, device="cuda", dtype=dtype)
    b = torch.randn(n, device="cuda", dtype=dtype)
    tln._fwd_plans.clear()
    first = tln.layernorm_forward(x, w, b, 1e-5, dtype)
    assert len(tln._fwd_plans) == 1  # the second call replays this plan
    y, mean, rstd = tln.layernorm_forward(x, w, b, 1e-5, dtype)
    assert mean.shape == (m,) and rstd.shape == (m,)
    assert torch.equal(y, first[0]) and torch.equal(mean, first[1])
    assert torch.equal(rstd, first[2])
    var, mu = torch.var_mean(x.double(), dim=1, unbiased=False)
    torch.testing.assert_close(mean.double(), mu, **tol(torch.float32))
    torch.testing.assert_close(rstd.double(), (var + 1e-5).rsqrt(), **tol(torch.float32, 4))
