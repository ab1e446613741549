"""The lean per-call host path: inference calls hand contiguous N-d tensors to the Triton backend
as they are, LayerNorm inference allocates no statistics, and the launch cache key tells apart
every argument property Triton specialises a compiled kernel on.

On CPU the kernels run through the Triton interpreter; with a GPU the same tests run the compiled
kernels (``ON_DEVICE``), which is where the direct-launch cache is exercised.
"""

from __future__ import annotations

import pytest
import torch
from conftest import INTERPRETING, exhaustive_unless, triton_kernels_ready

import fusedops
from fusedops import _dispatch
from fusedops.backends.triton.configs import common as tcfg
from fusedops.backends.triton.runtime import launcher as rt_launcher
from fusedops.backends.triton.runtime import plans as rt_plans

ON_DEVICE = True

pytestmark = pytest.mark.skipif(not triton_kernels_ready(), reason="Triton not available")


def _dev() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _triton_only():
    if _dev() == "cpu" and not INTERPRETING:
        pytest.skip("CPU tensors need the Triton interpreter")
    with fusedops.use_backend("triton"):
        yield


# (float32 on the aligned shapes, bfloat16 on one; the others exhaustive)
@exhaustive_unless(lambda shape, dtype: (dtype == torch.float32 and shape[-1] == 96)
                   or shape == (7, 96))
@pytest.mark.parametrize("shape", [(3, 5, 96), (7, 96), (96,), (2, 3, 4, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_nd_matches_rows(shape, dtype):
    """The N-d inference path gives the same bits as the 2-D row path (same kernel)."""
    x = torch.randn(shape, dtype=dtype, device=_dev())
    n = shape[-1]
    w = torch.randn(n, dtype=dtype, device=x.device)
    b = torch.randn(n, dtype=dtype, device=x.device)
    with torch.no_grad():
        y = fusedops.fused_softmax(x)
        z = fusedops.fused_layernorm(x, (n,), w, b)
    backend = _dispatch.backend_for(x)
    rows = x.reshape(-1, n)
    assert y.shape == x.shape and y.is_contiguous()
    assert z.shape == x.shape and z.is_contiguous()
    assert torch.equal(y, backend.softmax_forward(rows, dtype).view(shape))
    assert torch.equal(z, backend.layernorm_forward(rows, w, b, 1e-5, dtype)[0].view(shape))
    # and the autograd path (2-D rows, statistics kept) agrees bit for bit
    xr = x.clone().requires_grad_()
    assert torch.equal(fusedops.fused_softmax(xr), y)
    assert torch.equal(fusedops.fused_layernorm(xr, (n,), w, b), z)


def test_inference_non_contiguous_and_inner_dims():
    """Inputs the N-d path does not take (strided, softmax over an inner dim, several normalised
    dims) still go through the row views and match torch."""
    x = torch.randn(4, 6, 40, device=_dev())
    with torch.no_grad():
        t = x.transpose(0, 1)
        torch.testing.assert_close(fusedops.fused_softmax(t), torch.softmax(t, -1))
        torch.testing.assert_close(fusedops.fused_softmax(x, 1), torch.softmax(x, 1))
        torch.testing.assert_close(fusedops.fused_layernorm(x, (6, 40)),
                                   torch.nn.functional.layer_norm(x, (6, 40)),
                                   atol=1e-5, rtol=1e-5)
        s = x[:, :, :33]
        torch.testing.assert_close(fusedops.fused_layernorm(s, (33,)),
                                   torch.nn.functional.layer_norm(s, (33,)),
                                   atol=1e-5, rtol=1e-5)


def test_layernorm_inference_allocates_no_statistics(monkeypatch, launch_rules):
    from fusedops.backends.triton import configs
    from fusedops.backends.triton import layernorm as tln

    # the rule below belongs to the reload and single-block kernels (8K rows would otherwise
    # take the unrolled kernel, which measured no slower without statistics)
    launch_rules("layernorm", UNROLLED_FWD={})
    launch_rules("layernorm", UNROLLED_FWD_GPU={})

    x = torch.randn(8, 64, device=_dev())
    y, mean, rstd = tln._forward(x, None, None, 1e-5, x.dtype, False)
    assert mean is None and rstd is None
    y2, mean2, rstd2 = tln._forward(x, None, None, 1e-5, x.dtype, True)
    assert torch.equal(y, y2) and mean2.shape == (8,) and rstd2.shape == (8,)
    # large 16-bit inputs take the variant with statistics (it measured faster there)
    h = torch.randn(2, 8192, device=_dev(), dtype=torch.bfloat16)
    assert tln._forward(h, None, None, 1e-5, h.dtype, False)[1] is None
    with configs.override("layernorm", STATS_FREE_16BIT_MAX=16):
        yh, mh, _ = tln._forward(h, None, None, 1e-5, h.dtype, False)
    assert mh is not None and torch.equal(yh, tln._forward(h, None, None, 1e-5, h.dtype, True)[0])
    # long rows (looped / split kernels) keep their statistics buffers internally
    long = torch.randn(2, 70000, device=_dev()) if _dev() == "cuda" else None
    if long is not None:
        torch.testing.assert_close(tln.layernorm_forward_y(long, None, None, 1e-5, long.dtype),
                                   torch.nn.functional.layer_norm(long, (70000,)),
                                   atol=1e-5, rtol=1e-5)


def test_launch_key_separates_specialisations():
    """Every property Triton specialises on changes the key; nothing else does."""
    base = torch.zeros(64, dtype=torch.float32)
    key = rt_launcher.launch_key

    def k(*args, warps=4, n=None):
        return key(warps, args, len(args) if n is None else n)

    same = k(base, 32, 7, 1e-5)
    assert k(torch.ones(64), 48, 23, 2e-3) == same  # same alignment, divisibility, ==1, dtype
    assert k(base[1:], 32, 7, 1e-5) != same  # pointer no longer 16-byte aligned
    assert k(base.half(), 32, 7, 1e-5) != same  # dtype
    assert k(base, 33, 7, 1e-5) != same  # not a multiple of 16
    assert k(base, 32, 1, 1e-5) != same  # equal to 1 (Triton makes it a constant)
    assert k(base, 32, 2**31 + 7, 1e-5) != same  # 64-bit integer
    assert k(base, 32, 7, 1e-5, warps=8) != same
    # constexprs (after the runtime arguments) enter by value
    assert k(base, 32, 7, 64, n=3) != k(base, 32, 7, 128, n=3)
    assert k(base, 32, 7, 64, n=3)[0] == base.get_device()  # the device index comes first


@pytest.mark.skipif(not torch.cuda.is_available(), reason="direct launches need a GPU")
@pytest.mark.gpu
def test_direct_launch_matches_triton_launch():
    """After the first (Triton) launch of a specialisation, later calls take the cached direct
    path; results stay identical, including on a non-default stream and for a misaligned view
    that needs a different compiled kernel."""
    from fusedops.backends.triton import softmax as tsm

    x = torch.randn(300, 1000, device="cuda")
    first = tsm.softmax_forward(x, x.dtype)
    assert tsm._launch_fwd_single.compiled, "the compiled kernel was not cached"
    again = tsm.softmax_forward(x, x.dtype)
    assert torch.equal(first, again)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        on_stream = tsm.softmax_forward(x, x.dtype)
    s.synchronize()
    assert torch.equal(first, on_stream)
    flat = torch.randn(300 * 1001 + 1, device="cuda")
    odd = flat[1:].view(300, 1001)[:, :1000]  # misaligned base pointer, row stride 1001
    torch.testing.assert_close(tsm.softmax_forward(odd, odd.dtype), torch.softmax(odd, -1))


def test_generated_key_equals_the_generic_key():
    """The per-kernel generated key gives the generic key's value for arguments of the kinds it
    was generated for, and raises (so the launcher falls back to the generic key) for others."""
    t = torch.zeros(64)
    n = 8
    first = (t, t[1:], 32, 7, 1, 2**31 + 5, 1e-5, True, 128, "const")
    key = rt_launcher._key_function(first, n)
    for args in (first, (t.half(), t, 48, 1, 33, -(2**31) - 1, 2.0, False, 64, "other"),
                 (t[3:], t[4:], 0, 16, 2, 3, 0.0, True, 1, None)):
        assert key(8, args) == rt_launcher.launch_key(8, args, n)
    for other in ((1, t, 32, 7, 1, 5, 1e-5, True, 1, 2),  # an int where a tensor was
                  (t, t, t, 7, 1, 5, 1e-5, True, 1, 2),  # a tensor where an int was
                  (t, t, 32, 7.0, 1, 5, 1e-5, True, 1, 2),  # a float where an int was
                  (t, t, 32, 7, 1, 5, 0, True, 1, 2),  # an int where a float was
                  (t, t, 32, 7, 1, 5, 1e-5, 1, 1, 2)):  # an int where a bool was
        with pytest.raises((TypeError, AttributeError, RuntimeError)):
            key(8, other)
    assert rt_launcher._key_function((4, 2), 0)(8, (4, 2)) == rt_launcher.launch_key(8, (4, 2), 0)


class _FakeCompiled:
    """What Launcher reads from Triton's compiled kernel, with a recording launcher."""

    def __init__(self, run):
        self.run, self.function, self.packed_metadata = run, 77, (4, 1, 0)


def test_direct_entry_calls_the_c_entry_on_known_triton(monkeypatch):
    calls = []

    class CudaLauncher:  # Triton 3.6's runner: __call__ (Python) wrapping launch (C)
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, False

        def launch(self, *a):
            calls.append(("launch", a))

        def __call__(self, *a):
            calls.append(("run", a))

    monkeypatch.setattr(rt_launcher.triton, "__version__", "3.6.0")
    go = rt_launcher.direct_entry(_FakeCompiled(CudaLauncher()))
    go((5,), 123, ("x", 1))
    go((5, 2), 123, ("x", 1))
    assert calls == [
        ("launch", (5, 1, 1, 123, 77, False, False, None, None, (4, 1, 0), None, None, None,
                    "x", 1)),
        ("launch", (5, 2, 1, 123, 77, False, False, None, None, (4, 1, 0), None, None, None,
                    "x", 1))]
    # another Triton version, or a kernel that needs scratch memory: Triton's runner
    calls.clear()
    monkeypatch.setattr(rt_launcher.triton, "__version__", "3.9.0")
    rt_launcher.direct_entry(_FakeCompiled(CudaLauncher()))((5,), 123, ("x",))
    monkeypatch.setattr(rt_launcher.triton, "__version__", "3.6.0")
    runner = CudaLauncher()
    runner.global_scratch_size = 256
    rt_launcher.direct_entry(_FakeCompiled(runner))((5,), 123, ("x",))
    assert [c[0] for c in calls] == ["run", "run"]
    assert calls[0][1] == (5, 1, 1, 123, 77, (4, 1, 0), None, None, None, "x")


# --------------------------------------------------------------------------- launch plans


class _Recorder:
    """A direct entry that records its launches instead of running a kernel."""

    raw_pointers = True

    def __init__(self):
        self.calls = []

    def __call__(self, grid, stream, args):
        self.calls.append((grid, stream, args))


def test_softmax_plan_replays_the_recorded_launch(fake_stream, monkeypatch):
    """A call whose plan exists allocates its output and launches the plan's kernel with the
    tensors' addresses first, then the recorded tail; calls the plan's key cannot describe
    (strided rows, misaligned base, launch hooks) take the normal path."""
    from fusedops.backends.triton import softmax as tsm

    x = torch.randn(6, 64, device=_dev())
    go = _Recorder()
    tsm._fwd_plans[(x.shape, x.dtype, torch.float32, x.get_device())] = (
        go, (3,), x.get_device(), ("tail", 1), 0)
    y = tsm.softmax_forward(x, torch.float32)
    assert go.calls == [((3,), ("stream", x.get_device()), (x.data_ptr(), y.data_ptr(),
                                                            "tail", 1))]
    assert y.shape == x.shape and y.dtype == torch.float32 and y.is_contiguous()
    strided = torch.randn(6, 80, device=_dev())[:, :64]
    misaligned = torch.randn(6 * 64 + 1, device=_dev())[1:].view(6, 64)
    for other in (strided, misaligned):
        torch.testing.assert_close(tsm.softmax_forward(other, torch.float32),
                                   torch.softmax(other, -1))
    monkeypatch.setattr(tsm, "hooks_registered", lambda: True)  # e.g. Proton is profiling
    torch.testing.assert_close(tsm.softmax_forward(x, torch.float32), torch.softmax(x, -1))
    assert len(go.calls) == 1


@pytest.mark.parametrize("with_stats", [False, True])
@pytest.mark.parametrize("affine", ["both", "none", "weight"])
def test_layernorm_plan_replays_the_recorded_launch(fake_stream, with_stats, affine):
    """The LayerNorm forward plan passes (x, weight, bias, y, mean, rstd) addresses in the
    kernel's order, y's address where a parameter or the statistics are absent (the kernel's
    placeholders), and allocates the statistics only when asked for."""
    from fusedops.backends.triton import layernorm as tln

    x = torch.randn(5, 48, device=_dev(), dtype=torch.bfloat16)
    w = torch.randn(48, device=_dev()) if affine != "none" else None
    b = torch.randn(48, device=_dev()) if affine == "both" else None
    key = (x.shape, x.dtype, x.dtype, x.get_device(), 1e-5, with_stats,
           None if w is None else w.dtype, None if b is None else b.dtype)
    go = _Recorder()
    tln._fwd_plans[key] = (go, (2,), x.get_device(), (5, "tail"), 5)
    y, mean, rstd = tln._forward(x, w, b, 1e-5, x.dtype, with_stats)
    (grid, stream, args), = go.calls
    yp = y.data_ptr()
    assert grid == (2,) and stream == ("stream", x.get_device()) and args[6:] == (5, "tail")
    assert args[:4] == (x.data_ptr(), yp if w is None else w.data_ptr(),
                        yp if b is None else b.data_ptr(), yp)
    if with_stats:
        assert mean.shape == rstd.shape == (5,) and mean.dtype == rstd.dtype == torch.float32
        assert args[4:6] == (mean.data_ptr(), rstd.data_ptr())
    else:
        assert mean is None and rstd is None and args[4:6] == (yp, yp)
    # another eps, or a weight at a misaligned address: another (or no) plan
    tln._forward(x, w, b, 1e-6, x.dtype, with_stats)
    if w is not None:
        tln._forward(x, torch.randn(49, device=_dev())[1:], b, 1e-5, x.dtype, with_stats)
    assert len(go.calls) == 1


def test_plan_cache_keeps_only_direct_c_entries(monkeypatch):
    plans = rt_plans.PlanCache()
    go = _Recorder()

    class FakeLauncher:
        def __init__(self, entry):
            self.entry_fn = entry

        def entry(self, args, num_warps):
            return self.entry_fn

    t = torch.zeros(4)
    plans.add("k", FakeLauncher(go), (1,), (t, t, 3, 4), 4, 2)
    assert plans["k"] == (go, (1,), t.get_device(), (3, 4), 0)
    plans.add("other", FakeLauncher(lambda *a: None), (1,), (t, t, 3), 4, 2)  # not a C entry
    plans.add("none", FakeLauncher(None), (1,), (t, t, 3), 4, 2)  # nothing compiled
    assert set(plans) == {"k"}
    monkeypatch.setattr(rt_plans.PlanCache, "MAX_PLANS", 1)
    plans.add("next", FakeLauncher(go), (1,), (t, t), 4, 2)  # full: start again
    assert set(plans) == {"next"}
    tcfg.set_single_block_limit(None)  # rule changes clear every plan cache
    assert not plans


@pytest.mark.skipif(not torch.cuda.is_available(), reason="plans need compiled kernels")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plans_replay_compiled_kernels(dtype):
    """On the GPU the first call of a signature records a plan and later calls replay it: same
    bits as the first call, on any stream, for every LayerNorm parameter combination and with
    the statistics; a registered launch hook sends calls back through Triton."""
    from fusedops.backends.triton import layernorm as tln
    from fusedops.backends.triton import softmax as tsm

    tcfg.set_single_block_limit(None)
    x = torch.randn(8, 128, 768, device="cuda", dtype=dtype)
    w = torch.randn(768, device="cuda", dtype=dtype)
    b = torch.randn(768, device="cuda", dtype=dtype)
    first = tsm.softmax_forward(x, torch.float32)
    assert len(tsm._fwd_plans) == 1
    assert torch.equal(tsm.softmax_forward(x, torch.float32), first)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        on_stream = tsm.softmax_forward(x, torch.float32)
    s.synchronize()
    assert torch.equal(on_stream, first)
    torch.testing.assert_close(first, torch.softmax(x.float(), -1))
    for weight, bias in ((w, b), (None, None), (w, None), (None, b)):
        for stats in (False, True):
            ref = tln._forward(x, weight, bias, 1e-5, dtype, stats)
            again = tln._forward(x, weight, bias, 1e-5, dtype, stats)
            for r, a in zip(ref, again, strict=True):
                assert (r is None and a is None) or torch.equal(r, a)
            torch.testing.assert_close(
                again[0], torch.nn.functional.layer_norm(x, (768,), weight, bias, 1e-5))
    assert len(tln._fwd_plans) == 8
    hooks = getattr(getattr(__import__("triton"), "knobs", None), "runtime", None)
    if hooks is not None:
        seen = []
        chain = hooks.launch_enter_hook

        def hook(metadata):
            seen.append(1)
        if hasattr(chain, "add"):  # Triton >= 3.5: a HookChain
            chain.add(hook)
        else:
            hooks.launch_enter_hook = hook
        try:
            assert torch.equal(tsm.softmax_forward(x, torch.float32), first)
        finally:
            if hasattr(chain, "remove"):
                chain.remove(hook)
            else:
                hooks.launch_enter_hook = chain
        assert seen, "the launch hook did not see the launch"
    tcfg.set_single_block_limit(None)
    assert not tsm._fwd_plans and not tln._fwd_plans


@pytest.mark.skipif(not torch.cuda.is_available(), reason="plans need compiled kernels")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unrolled_layernorm_plans_replay(monkeypatch, dtype, launch_rules):
    """The unrolled LayerNorm forward records plans too: replayed calls give the first call's
    bits, with and without statistics."""
    from fusedops.backends.triton import layernorm as tln

    elt = torch.empty((), dtype=dtype).element_size()
    launch_rules("layernorm", UNROLLED_FWD={(elt, 2048): ((512, 4),)})
    tcfg.set_single_block_limit(None)
    launched = []
    real = tln._launch_fwd_unrolled

    class Spy:  # counts launches through Triton; plans keep the real C entry
        entry = real.entry

        def __call__(self, grid, args, warps):
            launched.append(1)
            return real(grid, args, warps)
    monkeypatch.setattr(tln, "_launch_fwd_unrolled", Spy())
    x = torch.randn(64, 1536, device="cuda", dtype=dtype)  # 3 chunks of the 2K rule
    w = torch.randn(1536, device="cuda", dtype=dtype)
    b = torch.randn(1536, device="cuda", dtype=dtype)
    for stats in (False, True):
        ref = tln._forward(x, w, b, 1e-5, dtype, stats)
        again = tln._forward(x, w, b, 1e-5, dtype, stats)
        for r, a in zip(ref, again, strict=True):
            assert (r is None and a is None) or torch.equal(r, a)
        torch.testing.assert_close(again[0].float(), torch.nn.functional.layer_norm(
            x.float(), (1536,), w.float(), b.float(), 1e-5), atol=2e-2, rtol=2e-2)
    assert len(launched) == 2 and len(tln._fwd_plans) == 2
    tcfg.set_single_block_limit(None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="plans need compiled kernels")
@pytest.mark.gpu
def test_unrolled_softmax_plans_replay(monkeypatch, launch_rules):
    """The unrolled softmax forward records plans: a replayed call gives the first call's bits."""
    from fusedops.backends.triton import softmax as tsm

    launch_rules("softmax", UNROLLED_FWD={(2, 2048): ((512, 4),)})
    tcfg.set_single_block_limit(None)
    x = torch.randn(64, 1536, device="cuda", dtype=torch.bfloat16)  # 3 chunks
    first = tsm.softmax_forward(x, torch.bfloat16)
    assert len(tsm._fwd_plans) == 1
    assert torch.equal(tsm.softmax_forward(x, torch.bfloat16), first)
    torch.testing.assert_close(first.float(), torch.softmax(x.float(), -1), atol=1e-2, rtol=2e-2)
    tcfg.set_single_block_limit(None)
