"""patch_model(..., patterns=True): the torch.fx-proven epilogue rewrites of hand-written modules.

``fusedops.patching.fx_patterns`` rewrites ``softmax(t * c + m)`` and ``LayerNorm(a + b)`` inside a
module's forward when :func:`check_forward` proves the trace is what Python would run. These
tests cover what it accepts and rejects, the rewrites and their numerics (outputs and gradients
against an unpatched deep copy), the run-time fallbacks (guards, operand checks) and the
patch/unpatch mechanics. Everything runs on CPU with tiny shapes; the Triton kernels run through
the interpreter (``triton_on_cpu``) where a test counts fused-kernel calls.

The ``test_exact_*`` tests at the end pin cases where an earlier rewrite differed from Python.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import pickle
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from conftest import tol
from test_patching_utils import (  # noqa: F401 - fixtures
    force_patch,
    reference_backend,
    traced_patterns,
)
from torch import nn

import fusedops
from fusedops import patch_model, unpatch_model
from fusedops.patching import fx_patterns as _fx_patterns
from fusedops.patching import hf_attention as _hf_attention
from fusedops.patching import wrappers
from fusedops.patching.fx_patterns import GraphForward as _GraphForward
from fusedops.patching.fx_patterns import check_forward

B, L, D = 2, 5, 8
SCALE = 0.125  # exact in binary: the report prints it as "0.125"
FP32 = tol(torch.float32)

pytestmark = pytest.mark.usefixtures("force_patch", "reference_backend", "traced_patterns")


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_hf_attention(monkeypatch):
    """These modules are not Transformers models, so patch_model's Hugging Face attention step
    has nothing to do; it would still import transformers (many seconds per xdist worker) to
    find that out. The HF path is tested in test_patching_models.py."""
    monkeypatch.setattr(_hf_attention, "available", lambda: False)


@contextlib.contextmanager
def pattern_counts() -> Iterator[Counter]:
    """Count the fused helpers' calls (``softmax_epilogue``, ``add_layernorm:unfused``, ...),
    as patch_model's verification pass does."""
    previous = _fx_patterns.counts
    counts: Counter = Counter()
    _fx_patterns.counts = counts
    try:
        yield counts
    finally:
        _fx_patterns.counts = previous


def twins(factory, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(model, unpatched deep copy) with identical weights."""
    torch.manual_seed(seed)
    model = factory()
    return model, copy.deepcopy(model)


def graph_forward(module: nn.Module) -> _GraphForward | None:
    """The traced-forward wrapper installed on ``module`` (also under a routing wrapper)."""
    return wrappers.find(module, _GraphForward)


def scores_mask(seed: int = 1, mask_shape=(B, 1, L)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, D, generator=g)
    keep = torch.rand(mask_shape, generator=g) > 0.3
    mask = torch.where(keep, torch.zeros(()), torch.full((), -1e4))
    mask = mask + 0.1 * torch.randn(mask_shape, generator=g)  # distinct values: a real operand
    return x, mask


def _leaf(t):
    return t.detach().clone().requires_grad_(True) if torch.is_tensor(t) \
        and t.is_floating_point() else t


def step(model: nn.Module, args: tuple, kwargs: dict | None = None):
    """Forward + backward of a fixed random projection; (output, param grads, input grads)."""
    model.zero_grad(set_to_none=True)
    args = tuple(_leaf(a) for a in args)
    kwargs = {k: _leaf(v) for k, v in (kwargs or {}).items()}
    out = model(*args, **kwargs)
    g = torch.Generator().manual_seed(1234)
    (out * torch.randn(out.shape, generator=g).to(out.dtype)).sum().backward()
    pgrads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    igrads = [t.grad for t in (*args, *kwargs.values())
              if torch.is_tensor(t) and t.requires_grad]
    return out.detach(), pgrads, igrads


def assert_same_training(model: nn.Module, ref: nn.Module, args: tuple,
                         kwargs: dict | None = None) -> None:
    """Outputs, parameter gradients and input gradients of ``model`` match ``ref`` within the
    conftest float32 tolerance."""
    out, pg, ig = step(model, args, kwargs)
    out_r, pg_r, ig_r = step(ref, args, kwargs)
    torch.testing.assert_close(out, out_r, **FP32)
    assert pg.keys() == pg_r.keys()
    for k in pg:
        torch.testing.assert_close(pg[k], pg_r[k], msg=lambda m, k=k: f"grad {k}: {m}", **FP32)
    assert len(ig) == len(ig_r) and ig, "no input received a gradient"
    for a, b in zip(ig, ig_r, strict=True):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, **FP32)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


class _Attn(nn.Module):
    """q/k/v projections; subclasses spell the softmax differently."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.scale = SCALE  # a float attribute: baked into the trace, guarded


class AttnSoftmaxModule(_Attn):
    def __init__(self) -> None:
        super().__init__()
        self.sm = nn.Softmax(dim=-1)

    def forward(self, x, mask):
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        return self.sm(s * self.scale + mask) @ self.v(x)


class AttnFunctional(_Attn):
    def forward(self, x, mask):
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        return F.softmax(s * self.scale + mask, dim=-1) @ self.v(x)


class AttnTorch(_Attn):
    def forward(self, x, mask):
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        return torch.softmax(s * self.scale + mask, -1) @ self.v(x)


class AttnMethod(_Attn):
    def forward(self, x, mask):
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        return (s * self.scale + mask).softmax(-1) @ self.v(x)


class AttnMaskFirst(_Attn):
    def forward(self, x, mask):
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        return torch.softmax(mask + 0.125 * s, dim=-1) @ self.v(x)


class AttnTorchOps(_Attn):
    def forward(self, x, mask):
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        return torch.softmax(torch.add(torch.mul(s, self.scale), mask), 2) @ self.v(x)


class AttnScaleOnly(_Attn):
    def forward(self, x, mask):
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        return F.softmax(s * self.scale, -1) @ self.v(x) + mask.sum()


class AttnAddOnly(_Attn):
    def forward(self, x, mask):
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        return torch.softmax(s.add(mask), -1) @ self.v(x)


class AttnDivided(_Attn):
    """softmax(s / c + mask): no scale is extracted from a division, the add still fuses."""

    def forward(self, x, mask):
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        return torch.softmax(s / 8.0 + mask, -1) @ self.v(x)


SOFTMAX_CASES = {
    "nn.Softmax": (AttnSoftmaxModule, "softmax(scores * 0.125 + mask)"),
    "F.softmax": (AttnFunctional, "softmax(scores * 0.125 + mask)"),
    "torch.softmax": (AttnTorch, "softmax(scores * 0.125 + mask)"),
    "Tensor.softmax": (AttnMethod, "softmax(scores * 0.125 + mask)"),
    "mask+c*scores": (AttnMaskFirst, "softmax(scores * 0.125 + mask)"),
    "torch.add/mul": (AttnTorchOps, "softmax(scores * 0.125 + mask)"),
    "scale-only": (AttnScaleOnly, "softmax(scores * 0.125)"),
    "add-only": (AttnAddOnly, "softmax(scores + mask)"),
    "divided": (AttnDivided, "softmax(scores + mask)"),
}


class AddLN(nn.Module):
    """LayerNorm(a + b), the sum used only by the LayerNorm (post-LN residual)."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)

    def forward(self, x, residual):
        return self.ln(self.fc(x) + residual)


class PreLN(nn.Module):
    """Pre-LN residual stream: the sum feeds the LayerNorm and the next residual add."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.f = nn.Linear(d, d)
        self.g = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)

    def forward(self, x):
        x = x + self.f(x)
        y = self.ln(x)
        return x + self.g(y)


class MaskedAttn(_Attn):
    """``if mask is not None``: one trace per None-pattern of ``mask``."""

    def __init__(self) -> None:
        super().__init__()
        self.n_heads = 1  # an int attribute: guarded

    def forward(self, x, mask=None):
        s = self.q(x) @ self.k(x).transpose(-1, -2) * self.n_heads
        z = s * self.scale
        if mask is not None:
            z = z + mask
        return torch.softmax(z, -1) @ self.v(x)


class MaskedAttnIsNone(_Attn):
    """``if mask is None`` with an early return."""

    def forward(self, x, mask=None):
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        if mask is None:
            return torch.softmax(s * self.scale, -1) @ self.v(x)
        return torch.softmax(s * self.scale + mask, -1) @ self.v(x)


class Block(nn.Module):
    """A transformer-ish block: children whose forwards hold the patterns."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = AttnFunctional()
        self.post = AddLN()
        self.mlp = PreLN()

    def forward(self, x, mask):
        h = self.post(self.attn(x, mask), x)
        return self.mlp(h)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block0 = Block()
        self.block1 = Block()

    def forward(self, x, mask):
        return self.block1(self.block0(x, mask), mask)


# ---------------------------------------------------------------------------------------------
# check_forward: what it accepts
# ---------------------------------------------------------------------------------------------


def test_accepts_straight_line_forward_and_guards_scalar_attributes():
    info, why = check_forward(AttnFunctional())
    assert why is None
    assert info.tested == ()
    assert info.guards == {"scale": SCALE}  # children (q, k, v) are live, not guards
    info, why = check_forward(AddLN())
    assert why is None and info.tested == () and info.guards == {}


def test_accepts_none_branches_and_guards_int_and_float():
    info, why = check_forward(MaskedAttn())
    assert why is None
    assert info.tested == ("mask",)
    assert info.guards == {"scale": SCALE, "n_heads": 1}
    assert type(info.guards["n_heads"]) is int and type(info.guards["scale"]) is float
    info, why = check_forward(MaskedAttnIsNone())
    assert why is None and info.tested == ("mask",)


@pytest.mark.parametrize("cls", [MaskedAttn, MaskedAttnIsNone])
def test_none_pattern_variants_used_correctly(cls, monkeypatch):
    model, ref = twins(cls)
    report = patch_model(model, functional=False)
    fwd = graph_forward(model)
    assert fwd is not None
    assert set(fwd.fused.variants) == {(False,), (True,)}
    assert {p["pattern"] for p in report.fused_patterns} == {
        "softmax(scores * 0.125 + mask)", "softmax(scores * 0.125)"}
    chosen = []
    select = _fx_patterns.select_variant

    def spy(*args):
        picked = select(*args)  # (trace, positional arguments) or None
        chosen.append(None if picked is None else picked[0])
        return picked

    monkeypatch.setattr(_fx_patterns, "select_variant", spy)
    x, mask = scores_mask()
    calls = {  # name: (args, kwargs, mask is None)
        "positional mask": ((x, mask), {}, False),
        "keyword mask": ((x,), {"mask": mask}, False),
        "default (no mask)": ((x,), {}, True),
        "positional None": ((x, None), {}, True),
    }
    for what, (args, kwargs, is_none) in calls.items():
        chosen.clear()
        with pattern_counts() as counts:
            out = model(*args, **kwargs)
        # The trace made for this None-pattern ran (not the other one, not the original).
        assert chosen == [fwd.fused.variants[(is_none,)]], what
        assert counts == Counter({"softmax_epilogue": 1}), what
        torch.testing.assert_close(out, ref(*args, **kwargs), **FP32, msg=what)
    # The two variants really differ: the mask changes the result.
    assert not torch.allclose(model(x, mask), model(x))
    assert_same_training(model, ref, (x, mask))
    assert_same_training(model, ref, (x,))


def test_positional_calls_select_as_signature_bind_does():
    """The positional fast path of select_variant picks the trace and the positional arguments
    Signature.bind + apply_defaults gives; a missing argument still reaches the original
    forward's own error."""
    import dataclasses

    model, _ = twins(MaskedAttn)
    patch_model(model, functional=False)
    fused = graph_forward(model).fused
    assert fused.positional is not None
    slow = dataclasses.replace(fused, positional=None)
    x, mask = scores_mask()
    for args in ((x, mask), (x,), (x, None)):
        fast_pick = _fx_patterns.select_variant(fused, model, args, {})
        slow_pick = _fx_patterns.select_variant(slow, model, args, {})
        assert fast_pick[0] is slow_pick[0]
        assert len(fast_pick[1]) == len(slow_pick[1])
        assert all(a is b for a, b in zip(fast_pick[1], slow_pick[1], strict=True))
    assert _fx_patterns.select_variant(fused, model, (), {}) is None
    with pytest.raises(TypeError):
        model()
    assert _fx_patterns._positional_layout(
        inspect.signature(lambda self, x, *rest: x), ("x",)) is None


# ---------------------------------------------------------------------------------------------
# check_forward / patch_model: what they reject
# ---------------------------------------------------------------------------------------------


def _double(x):
    return x * 2


def _wrapping(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


def _closure_decorator(fn):
    def wrapper(self, x, y):  # no functools.wraps: a plain function, but a closure
        return fn(self, x, y)

    return wrapper


class _LNBase(nn.Module):
    """A LayerNorm child makes every subclass a pattern candidate."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.table = {"k": 2.0}
        self.factors = [2.0]

    def helper(self, x):
        return x * 2


class RejectLoop(_LNBase):
    def forward(self, x, y):
        for _ in range(2):
            x = x + y
        return self.ln(x + y)


class RejectTensorBranch(_LNBase):
    def forward(self, x, y):
        if x.sum() > 0:
            y = y * 2
        return self.ln(x + y)


class RejectShapeBranch(_LNBase):
    def forward(self, x, y):
        if x.shape[0] > 1:
            y = y * 2
        return self.ln(x + y)


class RejectGlobalHelper(_LNBase):
    def forward(self, x, y):
        return self.ln(_double(x) + y)


class RejectSelfMethod(_LNBase):
    def forward(self, x, y):
        return self.ln(self.helper(x) + y)


class RejectTry(_LNBase):
    def forward(self, x, y):
        try:
            s = x + y
        except RuntimeError:
            s = x
        return self.ln(s)


class RejectWith(_LNBase):
    def forward(self, x, y):
        with torch.no_grad():
            y = y * 2
        return self.ln(x + y)


class RejectVarargs(_LNBase):
    def forward(self, x, *rest):
        return self.ln(x + rest[0])


class RejectKwargs(_LNBase):
    def forward(self, x, **kwargs):
        return self.ln(x + kwargs["y"])


class RejectDictAttr(_LNBase):
    def forward(self, x, y):
        return self.ln(x + y) * self.table["k"]


class RejectListAttr(_LNBase):
    def forward(self, x, y):
        return self.ln(x + y) * self.factors[0]


class RejectReassignTested(_LNBase):
    def forward(self, x, y=None):
        if y is None:
            y = x
        return self.ln(x + y)


class RejectWrapped(_LNBase):
    @_wrapping
    def forward(self, x, y):
        return self.ln(x + y)


class RejectNoGradDecorated(_LNBase):
    @torch.no_grad()
    def forward(self, x, y):
        return self.ln(x + y)


class RejectClosureDecorated(_LNBase):
    @_closure_decorator
    def forward(self, x, y):
        return self.ln(x + y)


class InstanceForward(_LNBase):
    def forward(self, x, y):
        return self.ln(x + y)


def _instance_forward() -> nn.Module:
    m = InstanceForward()
    m.forward = lambda x, y: m.ln(x + y) * 3.0  # someone else's instance-level forward
    return m


REJECTED = {
    "for-loop": (RejectLoop, "GET_ITER"),
    "tensor-branch": (RejectTensorBranch, "branches on something other than"),
    "shape-branch": (RejectShapeBranch, "branches on something other than"),
    "global-helper": (RejectGlobalHelper, "uses global '_double'"),
    "self-method": (RejectSelfMethod, "reads self.helper"),
    "try": (RejectTry, "(loops, with, try"),
    "with": (RejectWith, "torch.no_grad"),  # refused at the global, before the with
    "*args": (RejectVarargs, "*args/**kwargs"),
    "**kwargs": (RejectKwargs, "*args/**kwargs"),
    "dict-attr": (RejectDictAttr, "reads self.table"),
    "list-attr": (RejectListAttr, "reads self.factors"),
    "reassigns-tested": (RejectReassignTested, "reassigns an argument it tests for None"),
    "wraps-decorated": (RejectWrapped, "wrapped or not a plain function"),
    "no_grad-decorated": (RejectNoGradDecorated, "wrapped or not a plain function"),
    "closure-decorated": (RejectClosureDecorated, "closure"),
    "instance-forward": (_instance_forward, "instance-level forward"),
}


@pytest.mark.parametrize("name", list(REJECTED))
def test_rejected_forwards_are_left_alone(name):
    factory, reason = REJECTED[name]
    model, ref = twins(factory)
    if name == "instance-forward":  # deepcopy rebinds nothing: give the twin its own lambda
        ref.forward = lambda x, y: ref.ln(x + y) * 3.0
    info, why = check_forward(model)
    assert info is None and reason in why
    before = model.__dict__.get("forward")
    report = patch_model(model, functional=False)
    assert report.fused_patterns == []
    assert report.pattern_skipped == [{"name": "", "type": type(model).__name__, "reason": why}]
    assert model.__dict__.get("forward") is before  # nothing installed
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(B, L, D, generator=g), torch.randn(B, L, D, generator=g)
    args = (x, y) if name != "**kwargs" else (x,)
    kwargs = {"y": y} if name == "**kwargs" else {}
    with pattern_counts() as counts:
        out = model(*args, **kwargs)
    assert not counts  # no fused helper ran
    torch.testing.assert_close(out, ref(*args, **kwargs), **FP32)


def test_rejection_in_a_child_leaves_siblings_fused():
    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bad = RejectLoop()
            self.good = AddLN()

        def forward(self, x, y):
            return self.good(self.bad(x, y), y)

    model, ref = twins(Parent)
    report = patch_model(model)
    assert [(s["name"], s["type"]) for s in report.pattern_skipped] == [("bad", "RejectLoop")]
    assert [(p["name"], p["pattern"], p["via"]) for p in report.fused_patterns] == [
        ("good", "ln(a + b)", "traced forward")]
    assert graph_forward(model.bad) is None and graph_forward(model.good) is not None
    x, y = scores_mask(mask_shape=(B, L, D))
    assert_same_training(model, ref, (x, y))


# ---------------------------------------------------------------------------------------------
# Rewrites and their numerics
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(SOFTMAX_CASES))
def test_softmax_rewrite_matches_unpatched(case):
    cls, pattern = SOFTMAX_CASES[case]
    model, ref = twins(cls)
    x, mask = scores_mask()
    report = patch_model(model, example_inputs=(x, mask))
    assert report.fused_patterns == [
        {"name": "", "type": cls.__name__, "pattern": pattern, "via": "traced forward"}]
    assert report.pattern_skipped == []
    assert report.verification["pattern_calls"] == {"softmax_epilogue": 1}
    assert report.max_rel_diff < 1e-5
    # The rewritten graph calls the fused helper and no softmax any more.
    gm = graph_forward(model).fused.variants[()]
    targets = [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method",
                                                            "call_module")]
    assert _fx_patterns.softmax_epilogue in targets
    assert not any(t in (torch.softmax, F.softmax, "softmax", "sm") for t in targets)
    # Gradients of the weights, x and the float mask (broadcast over dim 1, so its gradient is
    # summed by the fused backward).
    assert_same_training(model, ref, (x, mask))


def test_add_layernorm_rewrite_matches_unpatched():
    model, ref = twins(AddLN)
    x, r = scores_mask(mask_shape=(B, L, D))
    report = patch_model(model, example_inputs=(x, r))
    assert report.fused_patterns == [
        {"name": "", "type": "AddLN", "pattern": "ln(a + b)", "via": "traced forward"}]
    assert report.verification["pattern_calls"] == {"add_layernorm": 1}
    # The fused path bypasses the LayerNorm module: routed_calls does not count it.
    assert report.verification["routed_calls"]["layernorm"] == 0
    gm = graph_forward(model).fused.variants[()]
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [
        _fx_patterns.add_layernorm]
    assert_same_training(model, ref, (x, r))


def test_pre_ln_residual_stream_reuses_the_sum():
    model, ref = twins(PreLN)
    x, _ = scores_mask()
    report = patch_model(model, example_inputs=(x,))
    assert [p["pattern"] for p in report.fused_patterns] == ["ln(a + b), the sum reused"]
    assert report.verification["pattern_calls"] == {"add_layernorm": 1}
    gm = graph_forward(model).fused.variants[()]
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    # The pair helper returns (ln(a + b), a + b); the only add left is the final residual.
    assert calls.count(_fx_patterns.add_layernorm_pair) == 1
    assert sum(t is _fx_patterns.add_layernorm for t in calls) == 0
    assert_same_training(model, ref, (x,))


def test_add_layernorm_spellings():
    class TorchAdd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(D)

        def forward(self, a, b):
            return self.ln(torch.add(a, b))

    class MethodAdd(TorchAdd):
        def forward(self, a, b):
            return self.ln(a.add(b))

    for cls in (TorchAdd, MethodAdd):
        model, ref = twins(cls)
        report = patch_model(model)
        assert [p["pattern"] for p in report.fused_patterns] == ["ln(a + b)"]
        a, b = scores_mask(mask_shape=(B, L, D))
        with pattern_counts() as counts:
            model(a, b)
        assert counts == Counter({"add_layernorm": 1})
        assert_same_training(model, ref, (a, b))


def test_nested_sites_report_and_verification_counts():
    model, ref = twins(Stack)
    x, mask = scores_mask()
    report = patch_model(model, example_inputs=(x, mask))
    sites = {(p["name"], p["type"], p["pattern"]) for p in report.fused_patterns}
    expected = set()
    for blk in ("block0", "block1"):
        expected |= {
            (f"{blk}.attn", "AttnFunctional", "softmax(scores * 0.125 + mask)"),
            (f"{blk}.post", "AddLN", "ln(a + b)"),
            (f"{blk}.mlp", "PreLN", "ln(a + b), the sum reused"),
        }
    assert sites == expected
    assert len(report.fused_patterns) == 6
    assert {p["via"] for p in report.fused_patterns} == {"traced forward"}
    assert report.pattern_skipped == []
    assert report.verification["pattern_calls"] == {"add_layernorm": 4, "softmax_epilogue": 2}
    assert "Fused epilogue patterns (6):" in str(report)
    assert "block0.attn" in str(report) and "traced forward" in str(report)
    assert report.to_dict()["fused_patterns"] == report.fused_patterns
    assert_same_training(model, ref, (x, mask))


def test_verification_counts_none_pattern_variant():
    model, _ = twins(MaskedAttn)
    x, _ = scores_mask()
    report = patch_model(model, example_inputs={"x": x})  # mask left at its default None
    assert report.verification["pattern_calls"] == {"softmax_epilogue": 1}
    assert report.max_rel_diff < 1e-5


# ---------------------------------------------------------------------------------------------
# Run-time fallbacks: the fused helpers run the exact unfused ops
# ---------------------------------------------------------------------------------------------


class ScoresMask(nn.Module):
    """softmax(s * c + m) on the arguments themselves: any shapes/dtypes can be fed."""

    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, s, m):
        return torch.softmax(s * 0.5 + m, self.dim)


def _fallback_case(name: str):
    g = torch.Generator().manual_seed(7)
    s = torch.randn(B, L, L, generator=g)
    if name == "float64 mask (promotion)":
        return s, torch.randn(B, 1, L, generator=g, dtype=torch.float64)
    if name == "bool mask (bool + float)":
        return s, torch.rand(B, 1, L, generator=g) > 0.5
    if name == "int mask":
        return s, torch.randint(-2, 3, (B, 1, L), generator=g)
    if name == "scores broadcast":
        return torch.randn(B, 1, L, generator=g), torch.randn(B, L, L, generator=g)
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["float64 mask (promotion)", "bool mask (bool + float)",
                                  "int mask", "scores broadcast"])
def test_softmax_fallback_is_exact(name):
    model = ScoresMask()
    ref = copy.deepcopy(model)
    # functional=False: the fallback's torch.softmax is torch's own, so the result is bitwise
    # the unpatched one.
    report = patch_model(model, functional=False)
    assert [p["pattern"] for p in report.fused_patterns] == ["softmax(scores * 0.5 + mask)"]
    s, m = _fallback_case(name)
    with pattern_counts() as counts:
        out = model(s, m)
    assert counts == Counter({"softmax_epilogue:unfused": 1})
    expected = ref(s, m)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_softmax_fallback_float16_mask_stays_fused():
    """A float16 mask does not promote float32 scores: the fused op takes it."""
    model, ref = ScoresMask(), ScoresMask()
    patch_model(model)
    x, m = scores_mask()
    s = x @ x.transpose(-1, -2)
    with pattern_counts() as counts:
        out = model(s, m.half())
    assert counts == Counter({"softmax_epilogue": 1})
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref(s, m.half()), **FP32)


def test_softmax_fallback_other_dim():
    model, ref = ScoresMask(dim=1), ScoresMask(dim=1)
    patch_model(model, functional=False)
    s, m = _fallback_case("scores broadcast")[1], torch.zeros(B, 1, L)
    with pattern_counts() as counts:
        out = model(s, m)
    assert counts == Counter({"softmax_epilogue:unfused": 1})
    torch.testing.assert_close(out, ref(s, m), atol=0, rtol=0)


def test_layernorm_forward_hook_after_patching_still_fires():
    model, ref = twins(AddLN)
    patch_model(model)
    seen = []

    def hook(module, args, output):
        seen.append(args[0].shape)
        return output * 2  # the hook's effect is visible in the result

    model.ln.register_forward_hook(hook)
    ref.ln.register_forward_hook(hook)
    x, r = scores_mask(mask_shape=(B, L, D))
    with pattern_counts() as counts:
        out = model(x, r)
    assert counts == Counter({"add_layernorm:unfused": 1})
    assert seen == [(B, L, D)]
    # The unfused path calls the LayerNorm module (class-swapped to the fused LayerNorm, which
    # rounds differently from torch's): equal within the float32 tolerance.
    torch.testing.assert_close(out, ref(x, r), **FP32)
    assert_same_training(model, ref, (x, r))


def test_layernorm_pre_hook_after_patching_still_fires():
    model, ref = twins(PreLN)
    patch_model(model)
    seen = []
    model.ln.register_forward_pre_hook(lambda m, args: seen.append(1))
    x, _ = scores_mask()
    with pattern_counts() as counts:
        out = model(x)
    assert counts == Counter({"add_layernorm:unfused": 1}) and seen == [1]
    torch.testing.assert_close(out, ref(x), **FP32)


def test_layernorm_broadcast_add_falls_back():
    model, ref = twins(AddLN)
    patch_model(model)
    x, _ = scores_mask()
    r = torch.randn(D)  # a and b of different shapes: a broadcast add
    with pattern_counts() as counts:
        out = model(x, r)
    assert counts == Counter({"add_layernorm:unfused": 1})
    torch.testing.assert_close(out, ref(x, r), **FP32)
    assert_same_training(model, ref, (x, r))


def test_layernorm_dtype_mismatch_falls_back():
    model, ref = twins(AddLN)
    patch_model(model)
    x, r = scores_mask(mask_shape=(B, L, D))
    r16 = r.half()  # float32 + float16 -> float32: a and b of different dtypes
    with pattern_counts() as counts:
        out = model(x, r16)
    assert counts == Counter({"add_layernorm:unfused": 1})
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref(x, r16), **FP32)


def test_guard_change_runs_original_forward():
    model, ref = twins(AttnFunctional)
    patch_model(model)
    x, mask = scores_mask()
    before = model(x, mask)
    model.scale = 0.3
    ref.scale = 0.3
    with pattern_counts() as counts:
        out = model(x, mask)
    assert not counts  # the original forward ran: no fused helper
    torch.testing.assert_close(out, ref(x, mask), atol=0, rtol=0)
    assert not torch.allclose(out, before)  # the new value is used
    model.scale = SCALE  # the guard holds again: the rewrite is used again
    with pattern_counts() as counts:
        torch.testing.assert_close(model(x, mask), before, atol=0, rtol=0)
    assert counts == Counter({"softmax_epilogue": 1})


def test_int_guard_change_runs_original_forward():
    model, ref = twins(MaskedAttn)
    patch_model(model)
    x, mask = scores_mask()
    model.n_heads = ref.n_heads = 3
    with pattern_counts() as counts:
        out = model(x, mask)
    assert not counts
    torch.testing.assert_close(out, ref(x, mask), atol=0, rtol=0)


def test_training_flag_is_guarded():
    class Drop(nn.Module):
        def forward(self, s, m):
            return F.dropout(torch.softmax(s * 0.5 + m, -1), 0.5, self.training)

    model = Drop().eval()
    info, _ = check_forward(model)
    assert info.guards == {"training": False}
    ref = copy.deepcopy(model)
    patch_model(model)
    s, m = scores_mask(mask_shape=(B, L, D))
    with pattern_counts() as counts:
        torch.testing.assert_close(model(s, m), ref(s, m), **FP32)
    assert counts == Counter({"softmax_epilogue": 1})
    model.train()
    ref.train()
    with pattern_counts() as counts:
        torch.manual_seed(0)
        out = model(s, m)
    assert not counts  # training=True fails the guard: the original (with dropout) runs
    torch.manual_seed(0)
    torch.testing.assert_close(out, ref(s, m), atol=0, rtol=0)


def test_child_replaced_runs_original_forward():
    model, ref = twins(AddLN)
    patch_model(model)
    x, r = scores_mask(mask_shape=(B, L, D))
    model.ln = nn.Identity()
    ref.ln = nn.Identity()
    with pattern_counts() as counts:
        out = model(x, r)
    assert not counts
    torch.testing.assert_close(out, ref(x, r), atol=0, rtol=0)
    torch.testing.assert_close(out, model.fc(x) + r, atol=0, rtol=0)


def test_child_replaced_by_another_layernorm_runs_original_forward():
    model, ref = twins(AddLN)
    patch_model(model)
    x, r = scores_mask(mask_shape=(B, L, D))
    torch.manual_seed(5)
    new = nn.LayerNorm(D, eps=0.5)
    nn.init.normal_(new.weight)
    model.ln = new
    ref.ln = copy.deepcopy(new)
    with pattern_counts() as counts:
        out = model(x, r)
    assert not counts
    torch.testing.assert_close(out, ref(x, r), **FP32)


# ---------------------------------------------------------------------------------------------
# Fused kernels (Triton, interpreted on CPU)
# ---------------------------------------------------------------------------------------------


def test_triton_softmax_sites_run_fused_kernel(triton_on_cpu):
    x, mask = scores_mask()
    for cls in (AttnFunctional, AttnSoftmaxModule, AttnScaleOnly, AttnAddOnly, MaskedAttn):
        model, ref = twins(cls)
        patch_model(model)
        with fusedops.count_fused_calls() as counts, pattern_counts() as pcounts:
            out = model(x, mask)
        assert pcounts == Counter({"softmax_epilogue": 1}), cls.__name__
        assert counts["softmax_masked_forward"] == 1, cls.__name__
        torch.testing.assert_close(out, ref(x, mask), atol=1e-4, rtol=1e-4)
    # Training: forward and backward on the fused kernels (the mask needs no gradient).
    model, ref = twins(AttnFunctional)
    patch_model(model)
    xg = x.clone().requires_grad_(True)
    with fusedops.count_fused_calls() as counts:
        model(xg, mask).sum().backward()
    assert counts["softmax_masked_forward"] == 1
    assert counts["softmax_masked_backward"] == 1
    ref_x = x.clone().requires_grad_(True)
    ref(ref_x, mask).sum().backward()
    torch.testing.assert_close(xg.grad, ref_x.grad, atol=1e-4, rtol=1e-4)
    # The unpatched twin reaches no masked-softmax kernel.
    with fusedops.count_fused_calls() as counts:
        ref(x, mask)
    assert counts["softmax_masked_forward"] == 0


def test_triton_layernorm_sites_run_fused_kernel(triton_on_cpu):
    model, ref = twins(Block)
    x, mask = scores_mask()
    patch_model(model)
    with fusedops.count_fused_calls() as counts, torch.no_grad():
        out = model(x, mask)
    assert counts["layernorm_epilogue_forward"] == 2  # post (a + b) and mlp (the sum reused)
    torch.testing.assert_close(out, ref(x, mask), atol=1e-4, rtol=1e-4)
    with fusedops.count_fused_calls() as counts:
        step(model, (x, mask))
    assert counts["layernorm_epilogue_forward"] == 2
    assert counts["layernorm_epilogue_backward"] == 2


# ---------------------------------------------------------------------------------------------
# patterns=False, unpatch, exclude, torch.compile
# ---------------------------------------------------------------------------------------------


def test_patterns_false_leaves_forwards_alone():
    model, ref = twins(Stack)
    report = patch_model(model, patterns=False, functional=False)
    assert report.fused_patterns == [] and report.pattern_skipped == []
    assert not any("forward" in m.__dict__ for m in model.modules())
    x, mask = scores_mask()
    with pattern_counts() as counts:
        out = model(x, mask)
    assert not counts
    torch.testing.assert_close(out, ref(x, mask), **FP32)


def test_unpatch_removes_every_wrapper_and_restores_behaviour():
    model, ref = twins(Stack)
    x, mask = scores_mask()
    patch_model(model)
    wrapped = {n for n, m in model.named_modules() if "forward" in m.__dict__}
    # (The root's own code makes no routable call: it gets no wrapper.)
    assert {"block0.attn", "block0.post", "block0.mlp", "block1.attn", "block1.post",
            "block1.mlp"} == wrapped
    unpatch_model(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert {type(m) for m in model.modules()} == {type(m) for m in ref.modules()}
    with pattern_counts() as counts:
        out = model(x, mask)
    assert not counts
    torch.testing.assert_close(out, ref(x, mask), atol=0, rtol=0)
    # Patching again works (and is undone again).
    report = patch_model(model)
    assert len(report.fused_patterns) == 6
    unpatch_model(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_patched_context_manager_unpatches():
    model, ref = twins(Block)
    x, mask = scores_mask()
    with fusedops.patched(model) as report:
        assert len(report.fused_patterns) == 3
        assert graph_forward(model.attn) is not None
    assert not any("forward" in m.__dict__ for m in model.modules())
    torch.testing.assert_close(model(x, mask), ref(x, mask), atol=0, rtol=0)


def test_deepcopy_of_patched_model_uses_its_own_modules():
    model, ref = twins(Block)
    patch_model(model)
    clone = copy.deepcopy(model)
    x, mask = scores_mask()
    clone(x, mask)  # the copies re-trace their own modules on their first call
    for m in (clone.attn, clone.post, clone.mlp):
        fwd = graph_forward(m)
        assert fwd is not None and fwd.module is m
        assert all(c is getattr(m, n) for n, c in fwd.fused.children.items())
    with torch.no_grad():
        clone.post.fc.weight.mul_(-1)  # the clone's own weights, not the original's
        ref.post.fc.weight.mul_(-1)
    with pattern_counts() as counts:
        out = clone(x, mask)
    assert counts == Counter({"softmax_epilogue": 1, "add_layernorm": 2})
    torch.testing.assert_close(out, ref(x, mask), **FP32)
    assert not torch.allclose(model(x, mask), out)
    unpatch_model(clone)
    assert not any("forward" in m.__dict__ for m in clone.modules())
    assert graph_forward(model.post) is not None  # the original is still patched


def test_signature_of_patched_forward_is_the_original():
    model = MaskedAttn()
    patch_model(model)
    assert graph_forward(model) is not None
    assert inspect.signature(model.forward) == inspect.signature(MaskedAttn().forward)


def test_excluded_modules_are_not_rewritten():
    model, ref = twins(Stack)
    report = patch_model(model, exclude=["block0.attn", "block1"])
    names = {p["name"] for p in report.fused_patterns}
    assert names == {"block0.post", "block0.mlp"}
    # block0 itself (no LayerNorm/Softmax child, no softmax call) is no candidate.
    assert report.pattern_skipped == []
    assert graph_forward(model.block0.attn) is None
    for m in model.block1.modules():
        assert graph_forward(m) is None
    x, mask = scores_mask()
    with pattern_counts() as counts:
        out = model(x, mask)
    assert counts == Counter({"add_layernorm": 2})
    torch.testing.assert_close(out, ref(x, mask), **FP32)


def test_excluded_child_blocks_the_parent_rewrite():
    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(D, D)
            self.ln = nn.LayerNorm(D)

        def forward(self, x, r):
            return self.ln(self.fc(x) + r)

    model, ref = twins(Parent)
    report = patch_model(model, exclude="ln")
    assert report.fused_patterns == []
    assert report.pattern_skipped == [
        {"name": "", "type": "Parent", "reason": "has an excluded child"}]
    assert graph_forward(model) is None
    x, r = scores_mask(mask_shape=(B, L, D))
    torch.testing.assert_close(model(x, r), ref(x, r), atol=0, rtol=0)


def test_exclude_by_type():
    model, ref = twins(Block)
    report = patch_model(model, exclude=AddLN)
    assert {p["name"] for p in report.fused_patterns} == {"attn", "mlp"}
    assert graph_forward(model.post) is None
    x, mask = scores_mask()
    torch.testing.assert_close(model(x, mask), ref(x, mask), **FP32)


class SoftmaxThenLN(nn.Module):
    """Both patterns in one tiny forward."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(L)

    def forward(self, s, m, r):
        return self.ln(torch.softmax(s * 0.5 + m, -1) + r)


def test_torch_compile_of_patched_model():
    torch._dynamo.reset()
    model, ref = twins(SoftmaxThenLN)
    report = patch_model(model)
    assert [p["pattern"] for p in report.fused_patterns] == [
        "softmax(scores * 0.5 + mask)", "ln(a + b)"]
    compiled = torch.compile(model, fullgraph=False, backend="eager")
    g = torch.Generator().manual_seed(4)
    s, m, r = (torch.randn(B, L, L, generator=g) for _ in range(3))
    with torch.no_grad():
        torch.testing.assert_close(compiled(s, m, r), ref(s, m, r), **FP32)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# Cases where a rewrite once differed from Python's (review findings, now fixed): each must be
# exact, whether the module is fused or left alone
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [MaskedAttn, MaskedAttnIsNone])
def test_exact_tested_argument_passed_as_keyword_none(cls):
    model, ref = twins(cls)
    assert patch_model(model, functional=False).fused_patterns
    x, _ = scores_mask()
    torch.testing.assert_close(model(x, mask=None), ref(x, mask=None), **FP32)


class ScaledLayerNorm(nn.LayerNorm):
    """A LayerNorm subclass that overrides forward (patch_model does not swap it)."""

    def forward(self, x):
        return super().forward(x) * 2.0


class TemperatureSoftmax(nn.Softmax):
    """An nn.Softmax subclass that overrides forward."""

    def forward(self, x):
        return super().forward(x / 2.0)


def test_exact_layernorm_subclass_overriding_forward():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = ScaledLayerNorm(D)

        def forward(self, a, b):
            return self.ln(a + b)

    model, ref = twins(M)
    assert not patch_model(model).fused_patterns  # a subclass's own forward must run
    a, b = scores_mask(mask_shape=(B, L, D))
    torch.testing.assert_close(model(a, b), ref(a, b), **FP32)


def test_exact_softmax_subclass_overriding_forward():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sm = TemperatureSoftmax(dim=-1)

        def forward(self, s, m):
            return self.sm(s * 0.5 + m)

    model, ref = twins(M)
    assert not patch_model(model).fused_patterns  # a subclass's own forward must run
    s, m = scores_mask(mask_shape=(B, L, D))
    torch.testing.assert_close(model(s, m), ref(s, m), **FP32)


def test_exact_softmax_module_hook_after_patching():
    model, ref = twins(AttnSoftmaxModule)
    assert patch_model(model).fused_patterns  # the rewrite under test happened
    seen = []
    model.sm.register_forward_hook(lambda mod, args, out: seen.append(1))
    x, mask = scores_mask()
    model(x, mask)
    assert seen == [1]


def test_exact_layernorm_full_backward_hook_bypassed():
    model, _ = twins(AddLN)
    assert patch_model(model).fused_patterns  # the rewrite under test happened
    seen = []
    model.ln.register_full_backward_hook(lambda mod, gin, gout: seen.append(1))
    x, r = scores_mask(mask_shape=(B, L, D))
    model(x.requires_grad_(), r).sum().backward()
    assert seen == [1]


def test_exact_child_module_attribute_baked_unguarded():
    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.temperature = 0.5

        def forward(self, x):
            return x

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

        def forward(self, s, m):
            return torch.softmax(self.inner(s) * self.inner.temperature + m, -1)

    model, ref = twins(M)
    report = patch_model(model)
    assert not report.fused_patterns
    assert any('self.inner.temperature' in e["reason"] for e in report.pattern_skipped)
    model.inner.temperature = ref.inner.temperature = 3.0
    s, m = scores_mask(mask_shape=(B, L, D))
    torch.testing.assert_close(model(s, m), ref(s, m), **FP32)


class BufferBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.zeros(L))

    def forward(self, s):
        return torch.softmax(s * 0.5 + self.bias, -1)


@pytest.mark.parametrize("change", ["reassigned", "module.half()"])
def test_exact_root_buffer_replaced_after_patching_is_stale(change):
    model, ref = twins(BufferBias)
    assert patch_model(model).fused_patterns  # the rewrite under test happened
    s, _ = scores_mask()
    s = s @ s.transpose(-1, -2)
    if change == "reassigned":
        model.bias = torch.arange(float(L))
        ref.bias = torch.arange(float(L))
    else:
        model.half()
        ref.half()
        s = s.half()
    expected = ref(s)
    out = model(s)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, **tol(expected.dtype))


def test_exact_is_none_used_as_value():
    class M(nn.Module):
        def forward(self, s, mask=None):
            weight = 1.0 + (mask is None)
            return torch.softmax(s * 0.5, -1) * weight

    model, ref = twins(M)
    assert patch_model(model).fused_patterns  # the rewrite under test happened
    s, _ = scores_mask()
    torch.testing.assert_close(model(s), ref(s), **FP32)


def test_exact_trace_time_random_draw_is_frozen():
    class M(nn.Module):
        def forward(self, s):
            return torch.softmax(s * 0.5, -1) + torch.rand(8)  # a literal: globals reject

    model = M()
    report = patch_model(model)
    assert not report.fused_patterns
    assert any('torch.rand' in e["reason"] for e in report.pattern_skipped)
    s, _ = scores_mask()
    assert not torch.equal(model(s), model(s))  # unpatched: a fresh draw per call


def test_exact_print_in_forward_is_dropped(capsys):
    class M(nn.Module):
        def forward(self, s):
            print("forward ran")
            return torch.softmax(s * 0.5, -1)

    model = M()
    report = patch_model(model)
    assert not report.fused_patterns
    assert any("'print'" in e["reason"] for e in report.pattern_skipped)
    capsys.readouterr()
    s, _ = scores_mask()
    model(s)
    assert "forward ran" in capsys.readouterr().out


def test_exact_guard_ignores_value_type():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.width = 4

        def forward(self, s):
            return torch.softmax(s[..., :self.width] * 0.5, -1)

    model, ref = twins(M)
    assert patch_model(model).fused_patterns  # the rewrite under test happened
    model.width = ref.width = 4.0
    s, _ = scores_mask()
    with pytest.raises(TypeError):
        ref(s)  # Python: slice indices must be integers
    with pytest.raises(TypeError):
        model(s)


def test_exact_inplace_add_before_layernorm_loses_mutation():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(D)

        def forward(self, x, y):
            x += y
            return self.ln(x)

    model, ref = twins(M)
    report = patch_model(model)
    assert not report.fused_patterns
    assert any('in place' in e["reason"] for e in report.pattern_skipped)
    x, y = scores_mask(mask_shape=(B, L, D))
    x_model, x_ref = x.clone(), x.clone()
    torch.testing.assert_close(model(x_model, y), ref(x_ref, y), **FP32)
    torch.testing.assert_close(x_model, x_ref, atol=0, rtol=0)  # both mutated in place


def test_exact_pickle_round_trip_of_traced_forward():
    model, ref = twins(AddLN)
    assert patch_model(model).fused_patterns  # the rewrite under test happened
    loaded = pickle.loads(pickle.dumps(model))
    x, r = scores_mask(mask_shape=(B, L, D))
    torch.testing.assert_close(loaded(x, r), ref(x, r), **FP32)


# ---------------------------------------------------------------------------------------------
# routing_off: the routing mode off the stack while a fused helper runs
# ---------------------------------------------------------------------------------------------


class _SeeAllMode(torch.overrides.TorchFunctionMode):
    """A user's torch-function mode that records every function it sees."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_routing_off_pops_the_routing_mode_and_restores_it():
    """Innermost routing mode: popped for the helper (its torch calls skip the mode entirely),
    pushed back afterwards, also when the helper raises."""
    from fusedops.patching.routing import FusedFunctionMode as _FusedFunctionMode
    from fusedops.patching.routing import active_mode as _active_mode

    mode = _FusedFunctionMode(("softmax", "layernorm"))
    with mode:
        depth = torch._C._len_torch_function_stack()
        with _fx_patterns.routing_off():
            assert _active_mode() is None
            assert torch._C._len_torch_function_stack() == depth - 1
            # A functional softmax here is not routed (the helper's own ops are final).
            x = torch.randn(3, 5)
            torch.testing.assert_close(F.softmax(x, -1), torch.softmax(x, -1))
        assert torch._C._get_function_stack_at(depth - 1) is mode
        with pytest.raises(RuntimeError, match="inside"):
            with _fx_patterns.routing_off():
                raise RuntimeError("inside")
        assert _active_mode() is mode


def test_hf_attention_body_runs_outside_the_routing_mode(monkeypatch):
    """The fused eager attention's torch calls do not pass through the routing mode (they are
    not routed anyway), and its result is unchanged."""
    from fusedops.patching.routing import FusedFunctionMode as _FusedFunctionMode

    calls = Counter()
    original = _FusedFunctionMode.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        calls[func] += 1
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(_FusedFunctionMode, "__torch_function__", counting)
    module = nn.Module()
    module.training = False
    q, k, v = (torch.randn(2, 3, 4, 8) for _ in range(3))
    mask = torch.zeros(2, 1, 4, 4)
    want = _hf_attention.fused_eager_attention(module, q, k, v, mask, scaling=0.5)[0]
    with _FusedFunctionMode(("softmax",)):
        got = _hf_attention.fused_eager_attention(module, q, k, v, mask, scaling=0.5)[0]
    assert sum(calls.values()) <= 10  # at most the argument and size checks before the body
    torch.testing.assert_close(got, want)
