"""Routed calls from C++ (fusedops.ops._route, csrc/host/route.cpp): a public call below its
size rule returns torch's own result, bit for bit and with torch's autograd graph, in one
Python frame; every call it does not take (larger, rule not made, subclasses, modes, unusual
arguments, errors) goes on to the Python path unchanged."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fusedops
from fusedops import _dispatch
from fusedops.ops import _route

try:
    from fusedops import _host_ext
except ImportError:
    _host_ext = None

needs_ext = pytest.mark.skipif(_host_ext is None, reason="the C++ host extension is not built")

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.auto_backend])]
N = 48


def _inputs(device, dtype, grad):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, N, generator=g, dtype=torch.float64).to(device, dtype)
    r = torch.randn(3, 5, N, generator=g, dtype=torch.float64).to(device, dtype)
    w = torch.nn.Parameter(torch.randn(N, generator=g, dtype=torch.float64).to(device, dtype))
    b = torch.nn.Parameter(torch.randn(N, generator=g, dtype=torch.float64).to(device, dtype))
    for t in (x, r, w, b):
        t.requires_grad_(grad)
    return x, r, w, b


def _cases(x, r, w, b):
    """(name, torch's composition, the fused call, route call) per routed entry point."""
    return [
        ("softmax", lambda: torch.softmax(x, -1), lambda: fusedops.fused_softmax(x),
         lambda: _route.softmax(x, -1, None, None, None, False)),
        ("softmax dim 1 to float32", lambda: torch.softmax(x, 1, torch.float32),
         lambda: fusedops.fused_softmax(x, 1, torch.float32),
         lambda: _route.softmax(x, 1, torch.float32, None, None, False)),
        ("layernorm", lambda: F.layer_norm(x, (N,), w, b, 1e-5),
         lambda: fusedops.fused_layernorm(x, N, w, b, 1e-5),
         lambda: _route.layernorm(x, N, w, b, 1e-5, None, 0.0, None, True)),
        ("layernorm two dims, no bias", lambda: F.layer_norm(x, (5, N), None, None, 1e-3),
         lambda: fusedops.fused_layernorm(x, [5, N], eps=1e-3),
         lambda: _route.layernorm(x, [5, N], None, None, 1e-3, None, 0, None, False)),
        ("add+layernorm", lambda: F.layer_norm(x + r, (N,), w, b, 1e-5),
         lambda: fusedops.fused_layernorm(x, N, w, b, 1e-5, residual=r)[0],
         lambda: _route.layernorm(x, N, w, b, 1e-5, r, 0.0, None, True)[0]),
        ("rmsnorm", lambda: F.rms_norm(x, (N,), w, 1e-6),
         lambda: fusedops.fused_rmsnorm(x, N, w, 1e-6),
         lambda: _route.rmsnorm(x, torch.Size([N]), w, 1e-6)),
        ("rmsnorm eps None", lambda: F.rms_norm(x, (N,), None),
         lambda: fusedops.fused_rmsnorm(x, (N,)),
         lambda: _route.rmsnorm(x, (N,), None, None)),
    ]


@needs_ext
def test_enabled_with_the_extension():
    assert _route.ENABLED
    assert _route.softmax is _host_ext.route_softmax


@needs_ext
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
def test_routed_calls_are_torchs(device, dtype, grad):
    """Below the rule: torch's bits, torch's graph and torch's gradients."""
    x, r, w, b = _inputs(device, dtype, grad)
    inputs = [x, r, w, b]
    for name, native, fused, route in _cases(x, r, w, b):
        fusedops.fused_softmax(x), fusedops.fused_layernorm(x, N, w, b)  # (rules made)
        fusedops.fused_rmsnorm(x, N, w), fusedops.fused_layernorm(x, N, residual=r)
        want, got, direct = native(), fused(), route()
        assert direct is not None, name
        assert torch.equal(got, want) and torch.equal(direct, want), name
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if grad:
            assert type(got.grad_fn) is type(want.grad_fn), name
            dy = torch.randn_like(want)
            used = [t for t in inputs if t.requires_grad]
            g_want = torch.autograd.grad(want, used, dy, allow_unused=True)
            g_got = torch.autograd.grad(got, used, dy, allow_unused=True)
            for a, c in zip(g_want, g_got, strict=True):
                assert (a is None and c is None) or torch.equal(a, c), name
        else:
            assert got.grad_fn is None, name


@needs_ext
def test_epilogue_returns_the_sum():
    x, r, w, b = _inputs("cpu", torch.float32, True)
    y, s = _route.layernorm(x, N, w, b, 1e-5, r, 0.0, None, False)
    assert torch.equal(s, x + r) and torch.equal(y, F.layer_norm(x + r, (N,), w, b, 1e-5))
    assert type(s.grad_fn).__name__ == "AddBackward0"


@needs_ext
def test_modules_route():
    x = torch.randn(4, N)
    ln, rms = fusedops.FusedLayerNorm(N), fusedops.FusedRMSNorm(N, eps=1e-6)
    ln(x), rms(x)
    assert torch.equal(ln(x), torch.nn.LayerNorm(N)(x))
    assert torch.equal(rms(x), torch.nn.RMSNorm(N, eps=1e-6)(x))
    assert _route.layernorm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps,
                            None, 0.0, None, True) is not None


@needs_ext
def test_modules_read_parametrized_weights():
    """A parametrized weight is not in ``_parameters``: the modules read the attribute."""
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    x = torch.randn(4, N)
    ln, rms = fusedops.FusedLayerNorm(N), fusedops.FusedRMSNorm(N, eps=1e-6)
    with torch.no_grad():
        ln.weight.uniform_(), rms.weight.uniform_()
    for m in (ln, rms):
        parametrize.register_parametrization(m, "weight", Double())
    ln(x), rms(x)
    assert torch.equal(ln(x), F.layer_norm(x, (N,), ln.weight, ln.bias))
    assert torch.equal(rms(x), F.rms_norm(x, (N,), rms.weight, 1e-6))
    assert not torch.equal(rms(x), F.rms_norm(x, (N,), rms.weight / 2, 1e-6))


class _Logged(torch.Tensor):
    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


class _Mode(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@needs_ext
def test_declined_calls():
    """Every call the route does not take returns None (the Python path goes on)."""
    x, r, w, b = _inputs("cpu", torch.float32, False)
    fusedops.fused_softmax(x), fusedops.fused_layernorm(x, N, w, b)
    fusedops.fused_rmsnorm(x, N, w), fusedops.fused_layernorm(x, N, residual=r)
    sm = lambda *a: _route.softmax(*a)  # noqa: E731
    ln = lambda *a: _route.layernorm(*a)  # noqa: E731
    declined = [
        sm(x, -1, None, 0.5, None, False), sm(x, -1, None, None, x, False),
        sm(x, -1, None, None, None, True), sm(x, True, None, None, None, False),
        sm(x, -1.0, None, None, None, False), sm(x, -1, "float32", None, None, False),
        sm(x.as_subclass(_Logged), -1, None, None, None, False), sm(x, -1, None),
        sm(x.long(), -1, None, None, None, False),  # (torch raises: Python names it)
        sm(x, 7, None, None, None, False),  # (out of range)
        ln(x, N, w.double(), b, 1e-5, None, 0.0, None, True),  # mixed dtypes
        ln(x, N, w, b, -1.0, None, 0.0, None, True), ln(x, N, w, b, float("nan"), None, 0.0,
                                                       None, True),
        ln(x, N, w, b, 0, None, 0.0, None, True),  # (an int eps: Python checks it)
        ln(x, N, w, b, 1e-5, None, 0.1, None, True), ln(x, N, w, b, 1e-5, None, False, None,
                                                       True),
        ln(x, N, w, b, 1e-5, None, 0.0, "gelu", True), ln(x, N, w, b, 1e-5, None, 0.0, None, 1),
        ln(x, N, w, b, 1e-5, r[:1], 0.0, None, True), ln(x, N, w, b, 1e-5, r.half(), 0.0, None,
                                                        True),
        ln(x, (N, 1.0), w, b, 1e-5, None, 0.0, None, True), ln(x, "N", w, b, 1e-5, None, 0.0,
                                                               None, True),
        ln(x, N + 1, None, None, 1e-5, None, 0.0, None, True),  # (torch raises)
        _route.rmsnorm(x, N, w, 1), _route.rmsnorm(x, N, w.half(), None),
        _route.rmsnorm(x, N, w.detach().as_subclass(_Logged), None),
    ]
    assert all(d is None for d in declined), [i for i, d in enumerate(declined) if d is not None]
    with _Mode():
        assert _route.softmax(x, -1, None, None, None, False) is None


@needs_ext
@pytest.mark.parametrize("op", ["softmax", "layernorm", "rmsnorm"])
def test_rule_is_read_per_call(op, monkeypatch):
    """The route reads SIZE_RULES itself: no rule yet, or a call at or above it, is declined."""
    x, r, w, b = _inputs("cpu", torch.float32, False)
    call = {"softmax": lambda: _route.softmax(x, -1, None, None, None, False),
            "layernorm": lambda: _route.layernorm(x, N, w, b, 1e-5, None, 0.0, None, True),
            "rmsnorm": lambda: _route.rmsnorm(x, N, w, None)}[op]
    table = _dispatch.SIZE_RULES[op]
    key = ("cpu", torch.float32, False)
    monkeypatch.delitem(table, key, raising=False)
    assert call() is None
    monkeypatch.setitem(table, key, x.numel())
    assert call() is None
    monkeypatch.setitem(table, key, x.numel() + 1)
    assert call() is not None
    monkeypatch.setitem(table, key, float("inf"))
    assert call() is not None
    with fusedops.use_backend("reference"):  # (a forced backend: rule 0, the fused path)
        assert call() is None


@needs_ext
def test_python_path_sees_subclasses_and_modes():
    x = torch.randn(4, N)
    _Logged.seen.clear()
    fusedops.fused_softmax(x.as_subclass(_Logged))
    assert "softmax" in _Logged.seen
    with _Mode() as mode:
        y = fusedops.fused_layernorm(x, N)
    assert "layer_norm" in mode.seen and torch.equal(y, F.layer_norm(x, (N,)))


def test_errors_still_name_the_argument():
    x = torch.randn(4, N)
    with pytest.raises(ValueError, match="dim=5"):
        fusedops.fused_softmax(x, 5)
    with pytest.raises((ValueError, RuntimeError), match="normalized_shape"):
        fusedops.fused_layernorm(x, N + 1)
    with pytest.raises(ValueError, match="eps"):
        fusedops.fused_rmsnorm(x, N, eps=-1.0)
    with pytest.raises(TypeError, match="dim"):
        fusedops.fused_softmax(x, True)


@needs_ext
def test_one_python_frame_per_routed_call():
    """A routed call runs no fusedops or torch Python beyond the public function (and the
    constant is_dynamo_compiling; a module's parameters are read without nn.Module.__getattr__):
    counted with a profile hook."""
    x, r, w, b = _inputs("cpu", torch.float32, True)
    ln, rms = fusedops.FusedLayerNorm(N), fusedops.FusedRMSNorm(N)
    calls = [lambda: fusedops.fused_softmax(x), lambda: fusedops.fused_layernorm(x, N, w, b),
             lambda: fusedops.fused_layernorm(x, N, w, b, residual=r),
             lambda: fusedops.fused_rmsnorm(x, N, w), lambda: ln.forward(x),
             lambda: rms.forward(x)]
    for call in calls:
        call()
        frames = []

        def hook(frame, event, arg, frames=frames):
            if event == "call":
                frames.append(frame.f_code.co_name)

        sys.setprofile(hook)
        try:
            call()
        finally:
            sys.setprofile(None)
        assert len(frames) == 3 and frames[0] == "<lambda>", frames
        assert frames[2] == "is_dynamo_compiling", frames


def test_compile_fullgraph_skips_the_route():
    """Dynamo reads is_dynamo_compiling() as True and traces the Python path."""
    x = torch.randn(4, N)
    w = torch.randn(N)

    @torch.compile(fullgraph=True, backend="eager")
    def f(t):
        return fusedops.fused_rmsnorm(fusedops.fused_softmax(t), N, w) + \
            fusedops.fused_layernorm(t, N, w)

    want = F.rms_norm(torch.softmax(x, -1), (N,), w) + F.layer_norm(x, (N,), w)
    torch.testing.assert_close(f(x), want)


@pytest.mark.exhaustive  # (a fresh interpreter importing torch)
def test_switched_off_without_losing_the_ops():
    """FUSEDOPS_HOST_EXT=0: the route declines everything; the ops give the same results."""
    code = ("import torch, fusedops\nfrom fusedops.ops import _route\n"
            "x = torch.randn(4, 8)\nassert not _route.ENABLED\n"
            "assert _route.softmax(x, -1, None, None, None, False) is None\n"
            "assert torch.equal(fusedops.fused_softmax(x), torch.softmax(x, -1))\n"
            "assert torch.equal(fusedops.fused_rmsnorm(x, 8), torch.rms_norm(x, (8,)))\n")
    env = dict(os.environ, FUSEDOPS_HOST_EXT="0")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


@needs_ext
def test_autocast_inference_mode_and_layouts_as_torch():
    """What the dispatcher decides (autocast's casts, inference tensors, strided and 0-d or
    empty inputs) comes out as from torch's own calls."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(N, generator=g)
    x = torch.randn(6, 2 * N, generator=g)[:, ::2]  # (non-contiguous rows)
    fusedops.fused_layernorm(x, N, w), fusedops.fused_rmsnorm(x, N, w), fusedops.fused_softmax(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pairs = [(fusedops.fused_layernorm(x, N, w), F.layer_norm(x, (N,), w)),
                 (fusedops.fused_rmsnorm(x, N, w), F.rms_norm(x, (N,), w)),
                 (fusedops.fused_softmax(x, 0), torch.softmax(x, 0))]
    with torch.inference_mode():
        pairs += [(fusedops.fused_layernorm(x, N, w), F.layer_norm(x, (N,), w)),
                  (fusedops.fused_softmax(x), torch.softmax(x, -1))]
    for t in (torch.randn(()), torch.randn(0, N)):
        pairs.append((fusedops.fused_softmax(t), torch.softmax(t, -1)))
    for got, want in pairs:
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.stride() == want.stride() and torch.equal(got, want)
    assert _route.softmax(x, -1, None, None, None, False) is not None  # (these were routed)
