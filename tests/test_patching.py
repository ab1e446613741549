"""patch_model / unpatch_model / patched on hand-written modules: the mechanics.

Models are tiny; the Triton kernels run through the interpreter (TRITON_INTERPRET=1, set in
conftest) where a test counts fused-kernel calls.
"""

from __future__ import annotations

import copy
import inspect
import json
import pickle
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import EXHAUSTIVE, exhaustive_unless
from test_patching_utils import (
    FP32_TOL,
    HANDWRITTEN_LN_CALLS,
    HANDWRITTEN_SOFTMAX_CALLS,
    GraphRecorder,
    HandWritten,
    LayerNorm2d,
    NanoLayerNorm,
    PlainSubLayerNorm,
    PlainSubSoftmax,
    assert_outputs_close,
    assert_same_training,
    force_patch,  # noqa: F401 - a fixture
    fused_counts,
    handwritten_inputs,
    has_cxx_compiler,
    python_calls,
    run,
    structure,
    twins,
)
from torch import nn

import fusedops
from fusedops import FusedLayerNorm, FusedSoftmax, PatchReport, patch_model, unpatch_model
from fusedops.patching import is_patched, routing, wrappers
from fusedops.patching.routing import active_mode as _active_mode

pytestmark = pytest.mark.usefixtures("force_patch")


def all_calls(verification: dict) -> dict:
    """Calls that reached fusedops per op: swapped modules' and routed functional calls."""
    return {op: verification["module_calls"][op] + verification["routed_calls"][op]
            for op in ("softmax", "layernorm", "rmsnorm")}


def handwritten(bias: bool = True):
    return HandWritten(bias=bias), (handwritten_inputs(),)


def stack_len() -> int:
    return torch._C._len_torch_function_stack()


# ---------------------------------------------------------------------------------------------
# Numerics and coverage
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_handwritten_matches_unpatched(bias, training):
    model, ref, inputs = twins(lambda: handwritten(bias))
    model.train(training)
    ref.train(training)
    report = patch_model(model)
    assert report.functional
    assert_same_training(model, ref, inputs)
    assert stack_len() == 0


def test_handwritten_report_and_module_swaps():
    model, _, inputs = twins(handwritten)
    report = patch_model(model, example_inputs=inputs)
    replaced = {r["name"]: r for r in report.replaced}
    assert set(replaced) == {"ln_sub", "ln_plain", "sm", "sm_sub"}
    assert replaced["ln_plain"]["shape"] == [8]
    assert replaced["ln_plain"]["fused_type"] == "FusedLayerNorm"
    assert replaced["sm"]["config"] == "dim=-1"
    skipped = {s["name"]: s for s in report.skipped}
    assert set(skipped) == {"ln2d", "variants"}
    assert "overrides forward" in skipped["ln2d"]["reason"]
    assert "hand-written softmax module" in skipped["variants"]["reason"]
    # LayerNorm2d keeps its class (its F.layer_norm call is routed functionally).
    assert type(model.ln2d) is LayerNorm2d
    # Subclasses without forward: dynamic subclass, isinstance of both, helpers kept.
    assert isinstance(model.ln_sub, PlainSubLayerNorm)
    assert isinstance(model.ln_sub, FusedLayerNorm)
    assert isinstance(model.sm_sub, PlainSubSoftmax) and isinstance(model.sm_sub, FusedSoftmax)
    assert model.ln_sub.n_features() == 8
    assert isinstance(model.ln_plain, nn.LayerNorm) and isinstance(model.ln_plain, FusedLayerNorm)
    assert repr(model.ln_plain).startswith("FusedLayerNorm((8,), eps=1e-05")
    assert repr(model.ln_sub).startswith("FusedPlainSubLayerNorm((8,)")
    assert repr(model.sm) == "FusedSoftmax(dim=-1)"
    v = report.verification
    assert all_calls(v) == {"softmax": HANDWRITTEN_SOFTMAX_CALLS,
                                 "layernorm": HANDWRITTEN_LN_CALLS, "rmsnorm": 0}
    assert report.max_abs_diff is not None and report.max_rel_diff < 1e-5


def test_dynamic_subclass_is_cached():
    a, b = PlainSubLayerNorm(4), PlainSubLayerNorm(6)
    patch_model(a)
    patch_model(b)
    assert type(a) is type(b)
    unpatch_model(a)
    unpatch_model(b)
    assert type(a) is PlainSubLayerNorm


def test_fused_kernels_really_run(triton_on_cpu):
    model, ref, inputs = twins(handwritten)
    patch_model(model)
    counts = fused_counts(model, inputs)
    assert counts == {
        "layernorm_forward": HANDWRITTEN_LN_CALLS,
        "layernorm_backward": HANDWRITTEN_LN_CALLS,
        "softmax_forward": HANDWRITTEN_SOFTMAX_CALLS,
        "softmax_backward": HANDWRITTEN_SOFTMAX_CALLS,
    }
    # Same numbers with the Triton kernels (interpreted) as with torch.
    assert_same_training(model, ref, inputs, atol=1e-4, rtol=1e-4)
    # The unpatched twin never reaches a fused kernel.
    assert fused_counts(ref, inputs) == {}


def test_verification_counts_fused_kernels(triton_on_cpu):
    model, _, inputs = twins(handwritten)
    report = patch_model(model, example_inputs=inputs)
    v = report.verification
    assert v["backend"].startswith("triton")
    assert v["fused_calls"] == {
        "softmax_forward": HANDWRITTEN_SOFTMAX_CALLS, "layernorm_forward": HANDWRITTEN_LN_CALLS,
        "rmsnorm_forward": 0, "softmax_masked_forward": 0, "layernorm_epilogue_forward": 0,
    }
    assert v["note"] is None
    assert report.max_rel_diff < 1e-4


def test_nanogpt_layernorm_functional_only():
    for bias in (True, False):
        model = nn.Sequential(nn.Linear(6, 6), NanoLayerNorm(6, bias), nn.GELU())
        ref = copy.deepcopy(model)
        report = patch_model(model, example_inputs=torch.randn(3, 6))
        assert report.replaced == [] and report.skipped == []
        assert report.verification["routed_calls"] == {"softmax": 0, "layernorm": 1, "rmsnorm": 0}
        assert_same_training(model, ref, (torch.randn(3, 6),))


def test_functional_false_routes_modules_only():
    model, ref, inputs = twins(handwritten)
    report = patch_model(model, functional=False, example_inputs=inputs)
    assert not report.functional
    assert report.verification["module_calls"] == {"softmax": 2, "layernorm": 2, "rmsnorm": 0}
    assert report.verification["routed_calls"] == {"softmax": 0, "layernorm": 0, "rmsnorm": 0}
    assert "functional calls are routed" not in report.skipped[0]["reason"]
    assert model._forward_pre_hooks == {} and model._forward_hooks == {}
    assert_same_training(model, ref, inputs)


def test_ops_subset():
    model, ref, inputs = twins(handwritten)
    report = patch_model(model, ops=("layernorm",), example_inputs=inputs)
    assert {r["name"] for r in report.replaced} == {"ln_sub", "ln_plain"}
    assert {s["name"] for s in report.skipped} == {"ln2d", "sm", "sm_sub", "variants"}
    assert all_calls(report.verification) == {"softmax": 0, "layernorm": 4, "rmsnorm": 0}
    report = patch_model(model, ops="softmax", example_inputs=inputs)
    assert all_calls(report.verification) == {"softmax": HANDWRITTEN_SOFTMAX_CALLS,
                                                   "layernorm": 0, "rmsnorm": 0}
    assert_same_training(model, ref, inputs)
    with pytest.raises(ValueError, match="ops"):
        patch_model(model, ops=("gelu",))


# ---------------------------------------------------------------------------------------------
# Functional routing: every spelling, legacy dim=None, pass-through cases
# ---------------------------------------------------------------------------------------------


class Calls(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


SOFTMAX_SPELLINGS = {
    "F.softmax-pos": lambda x: F.softmax(x, -1),
    "F.softmax-kw-dtype": lambda x: F.softmax(x, dim=1, dtype=torch.float32),
    "F.softmax-stacklevel": lambda x: F.softmax(x, 0, 3, torch.float32),
    "torch.softmax-pos-dtype": lambda x: torch.softmax(x, -1, torch.float32),
    "torch.softmax-kw": lambda x: torch.softmax(input=x, dim=-2),
    "Tensor.softmax-pos": lambda x: x.softmax(-1),
    "Tensor.softmax-kw": lambda x: x.softmax(dim=0, dtype=torch.float32),
    "Tensor.softmax-unbound": lambda x: torch.Tensor.softmax(x, 1),
    "special.softmax": lambda x: torch.special.softmax(x, -1),
    "F.softmax-half-to-float": lambda x: F.softmax(x.half(), -1, dtype=torch.float32),
    "F.softmax-bf16": lambda x: F.softmax(x.bfloat16(), -1),
}


@pytest.mark.parametrize("name", list(SOFTMAX_SPELLINGS))
def test_softmax_spellings_routed(name):
    fn = SOFTMAX_SPELLINGS[name]
    model = Calls(fn)
    x = torch.randn(3, 4, 5)
    expected = fn(x)
    report = patch_model(model, example_inputs=(x,))
    assert report.verification["routed_calls"]["softmax"] == 1
    out = model(x)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, atol=1e-2 if out.dtype == torch.bfloat16 else 1e-6,
                               rtol=1e-2 if out.dtype == torch.bfloat16 else 1e-5)


LAYERNORM_SPELLINGS = {
    "F.layer_norm-pos": lambda x, w, b: F.layer_norm(x, (5,), w, b, 1e-3),
    "F.layer_norm-kw": lambda x, w, b: F.layer_norm(x, normalized_shape=[5], weight=w, eps=1e-6),
    "F.layer_norm-2d-shape": lambda x, w, b: F.layer_norm(x, (4, 5)),
    "torch.layer_norm": lambda x, w, b: torch.layer_norm(x, [5], w, b, 1e-5, True),
    "torch.layer_norm-kw": lambda x, w, b: torch.layer_norm(x, [5], bias=b),
}


@pytest.mark.parametrize("name", list(LAYERNORM_SPELLINGS))
def test_layernorm_spellings_routed(name):
    fn = LAYERNORM_SPELLINGS[name]
    w, b = torch.randn(5), torch.randn(5)
    model = Calls(lambda x: fn(x, w, b))
    x = torch.randn(3, 4, 5)
    expected = fn(x, w, b)
    report = patch_model(model, example_inputs=(x,))
    assert report.verification["routed_calls"]["layernorm"] == 1
    torch.testing.assert_close(model(x), expected, **FP32_TOL)


def test_legacy_implicit_softmax_dim():
    x2, x3 = torch.randn(3, 4), torch.randn(2, 3, 4)
    model = Calls(lambda x: F.softmax(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exp2, exp3 = F.softmax(x2), F.softmax(x3)
    report = patch_model(model, example_inputs=(x2,))
    assert report.verification["routed_calls"]["softmax"] == 1
    with pytest.warns(UserWarning, match="Implicit dimension choice"):
        out2 = model(x2)
    with pytest.warns(UserWarning, match="Implicit dimension choice"):
        out3 = model(x3)
    torch.testing.assert_close(out2, exp2)  # dim=1 for 2-d
    torch.testing.assert_close(out3, exp3)  # dim=0 for 3-d
    sm = nn.Softmax()  # nn.Softmax(dim=None): the same legacy rule, module level
    expected = sm(x3)
    patch_model(sm)
    torch.testing.assert_close(sm(x3), expected)


@pytest.mark.parametrize(
    "fn, routed",
    [
        (lambda x: F.softmax(x.double(), -1), 0),  # float64: torch's own op
        (lambda x: F.softmax(x, -1, dtype=torch.float64), 0),
        (lambda x: F.layer_norm(x.double(), (5,)), 0),
        (lambda x: x[:0].softmax(-1), 1),  # empty: routed, fused op returns an empty tensor
    ],
    ids=["float64", "dtype-float64", "ln-float64", "empty"],
)
def test_pass_through_cases(fn, routed):
    x = torch.randn(2, 5)
    model = Calls(fn)
    expected = fn(x)
    report = patch_model(model, example_inputs=(x,))
    assert sum(report.verification["routed_calls"].values()) == routed
    torch.testing.assert_close(model(x), expected)


def test_torch_errors_unchanged():
    model = Calls(lambda x: F.layer_norm(x, (7,)))
    patch_model(model)
    with pytest.raises(RuntimeError):  # torch's error, not a fusedops one
        model(torch.randn(2, 5))
    assert stack_len() == 0
    model = Calls(lambda x: x.softmax(3))
    patch_model(model)
    with pytest.raises(IndexError):
        model(torch.randn(2, 5))
    assert stack_len() == 0


class TaggedTensor(torch.Tensor):
    """A tensor subclass with its own __torch_function__: never routed."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def test_tensor_subclass_with_torch_function_passes_through():
    model = Calls(lambda x: x.softmax(-1))
    x = torch.randn(2, 5).as_subclass(TaggedTensor)
    report = patch_model(model, example_inputs=(x,))
    assert report.verification["routed_calls"]["softmax"] == 0
    assert type(model(x)) is TaggedTensor


def test_vmap_passes_through():
    model = Calls(lambda x: F.layer_norm(x.softmax(-1), (5,)))
    x = torch.randn(3, 4, 5)
    expected = torch.vmap(model)(x)
    patch_model(model)
    torch.testing.assert_close(torch.vmap(model)(x), expected)


def test_cpu_autocast_passes_through():
    model = Calls(lambda x: F.layer_norm(x, (5,)) + x.softmax(-1))
    x = torch.randn(3, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    report = patch_model(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert report.functional and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected)


# ---------------------------------------------------------------------------------------------
# Scope of the mode: only this model, only during forward
# ---------------------------------------------------------------------------------------------


def test_mode_active_only_during_forward(triton_on_cpu):
    seen = []
    model = Calls(lambda x: (seen.append(_active_mode()), x.softmax(-1))[1])
    patch_model(model)
    assert stack_len() == 0
    x = torch.randn(2, 4)
    with fusedops.count_fused_calls() as counts:
        model(x)
        x.softmax(-1)  # outside forward: torch's op
        F.layer_norm(x, (4,))
    assert seen[0] is not None
    assert counts == {"softmax_forward": 1}
    assert stack_len() == 0


def test_other_models_unaffected(triton_backend):
    patched_model, other, inputs = twins(handwritten)
    patch_model(patched_model)
    with fusedops.count_fused_calls() as counts:
        other(*inputs)
    assert counts == {}
    assert not is_patched(other)
    assert type(other.ln_plain) is nn.LayerNorm


def test_exception_in_forward_does_not_leak_mode():
    class Boom(nn.Module):
        def forward(self, x):
            x.softmax(-1)
            raise ValueError("boom")

    model = Boom()
    patch_model(model)
    for _ in range(3):
        with pytest.raises(ValueError, match="boom"):
            model(torch.randn(2, 3))
        assert stack_len() == 0


def test_exception_in_user_pre_hook_does_not_leak_mode():
    model = Calls(lambda x: x.softmax(-1))
    patch_model(model)

    def bad_hook(module, args):
        raise KeyError("hook")

    h = model.register_forward_pre_hook(bad_hook)
    with pytest.raises(KeyError):
        model(torch.randn(2, 3))
    assert stack_len() == 0
    h.remove()
    model(torch.randn(2, 3))
    assert stack_len() == 0


class Recursive(nn.Module):
    """Calls itself (re-entrant forward) and holds a separately patched child."""

    def __init__(self):
        super().__init__()
        self.child = Calls(lambda x: F.layer_norm(x, (4,)))

    def forward(self, x, depth=2):
        x = x.softmax(-1)
        if depth:
            x = self(x, depth - 1)
        return self.child(x)


def test_reentrant_and_nested_patched_models(triton_on_cpu):
    model = Recursive()
    x = torch.randn(2, 4)
    expected = model(x)
    patch_model(model.child)
    patch_model(model)  # takes over the child's own patch
    assert not fusedops.is_patched(model.child)
    with fusedops.count_fused_calls() as counts:
        out = model(x)
    # 3 softmax (one per recursion level) and 3 layer norms, each routed exactly once.
    assert counts == {"softmax_forward": 3, "layernorm_forward": 3}
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert stack_len() == 0
    # A module of a patched model is patched and unpatched with it, never on its own.
    with pytest.raises(ValueError, match="part of a model"):
        patch_model(model.child)
    with pytest.raises(ValueError, match="part of a model"):
        unpatch_model(model.child)
    unpatch_model(model)
    with fusedops.count_fused_calls() as counts:
        model.child(x)
    assert counts == {}


def test_reference_backend_does_not_reroute_module_softmax():
    # FusedSoftmax on CPU runs the reference backend, which calls torch.softmax; that call
    # must not be routed again by the functional mode.
    model = nn.Sequential(nn.Softmax(dim=-1))
    report = patch_model(model, example_inputs=(torch.randn(2, 3),))
    assert all_calls(report.verification) == {"softmax": 1, "layernorm": 0, "rmsnorm": 0}


def test_threads_each_get_their_own_mode():
    # Reference backend: the Triton interpreter itself is not thread-safe.
    model, ref, inputs = twins(handwritten)
    model.eval()
    ref.eval()
    patch_model(model)
    expected = ref(*inputs)
    errors = []

    def work():
        try:
            for _ in range(3):
                torch.testing.assert_close(model(*inputs), expected, **FP32_TOL)
            assert stack_len() == 0
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_direct_forward_call_and_signature(triton_on_cpu):
    model, _, inputs = twins(handwritten)
    signature = inspect.signature(model.forward)
    patch_model(model)
    assert inspect.signature(model.forward) == signature
    with fusedops.count_fused_calls() as counts:
        model.forward(*inputs)  # bypassing __call__ still routes
    assert counts["softmax_forward"] == HANDWRITTEN_SOFTMAX_CALLS
    assert stack_len() == 0


def test_existing_instance_forward_is_wrapped_and_restored(triton_on_cpu):
    model = nn.Sequential(nn.Linear(4, 4))
    calls = []

    def custom_forward(x):  # e.g. what accelerate installs
        calls.append(1)
        return nn.Sequential.forward(model, x).softmax(-1)

    model.forward = custom_forward
    patch_model(model)
    with fusedops.count_fused_calls() as counts:
        model(torch.randn(2, 4))
    assert calls == [1] and counts == {"softmax_forward": 1}
    unpatch_model(model)
    assert model.__dict__["forward"] is custom_forward


def test_unpatch_order_of_nested_patches():
    model, _, inputs = twins(lambda: (TwoBlocks(), (handwritten_inputs(),)))
    before = structure(model)
    patch_model(model.block1)
    patch_model(model, exclude=["block1"])
    unpatch_model(model.block1)  # inner first: the outer wrapper stays in place
    assert isinstance(model.block0.ln_plain, FusedLayerNorm)
    model(*inputs)
    unpatch_model(model)
    assert structure(model) == before


class CountingDict(dict):
    def __init__(self, *args):
        super().__init__(*args)
        self.lookups = 0

    def get(self, key, default=None):
        self.lookups += 1
        return super().get(key, default)


def test_mode_not_active_around_compiled_code():
    # The mode is entered and left inside the traced forward, so compiled code runs without it
    # (no per-op Python dispatch at run time).
    torch._dynamo.reset()
    model, _, inputs = twins(handwritten)
    model.eval()
    patch_model(model)
    watched = {routing.FusedFunctionMode.__torch_function__.__code__, routing.route.__code__}
    with python_calls(watched) as calls:
        model(*inputs)
    assert calls  # eager: the tensor.softmax site's torch calls pass through the mode
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(*inputs)
    with python_calls(watched) as calls:
        compiled(*inputs)
    assert not calls


# ---------------------------------------------------------------------------------------------
# Exclude
# ---------------------------------------------------------------------------------------------


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.block0 = HandWritten()
        self.block1 = HandWritten()
        self.block10 = HandWritten()

    def forward(self, x):
        return self.block10(self.block1(self.block0(x)))


def test_exclude_by_name_prefix():
    model, ref, inputs = twins(lambda: (TwoBlocks(), (handwritten_inputs(),)))
    report = patch_model(model, exclude=("block1", "nope"), example_inputs=inputs)
    # "block1" excludes block1.* but not block10.*
    assert type(model.block1.ln_plain) is nn.LayerNorm
    assert isinstance(model.block10.ln_plain, FusedLayerNorm)
    assert report.excluded == ["block1"]
    assert report.unmatched_exclude == ["nope"]
    reasons = {s["name"]: s["reason"] for s in report.skipped}
    assert reasons["block1.ln_plain"] == "excluded by name 'block1'"
    routed = all_calls(report.verification)
    # Functional calls inside the excluded block are not routed either.
    assert routed == {
        "softmax": 2 * HANDWRITTEN_SOFTMAX_CALLS, "layernorm": 2 * HANDWRITTEN_LN_CALLS,
        "rmsnorm": 0,
    }
    assert_same_training(model, ref, inputs)
    assert "nope" in str(report)


def test_exclude_by_type_and_exact_name(triton_on_cpu):
    model, _, inputs = twins(lambda: (TwoBlocks(), (handwritten_inputs(),)))
    report = patch_model(model, exclude=[nn.Softmax, "block0.ln_nano"])
    reasons = {s["name"]: s["reason"] for s in report.skipped}
    assert reasons["block0.sm"] == "excluded by type Softmax"
    assert reasons["block10.sm_sub"] == "excluded by type Softmax"
    assert "block0.ln_nano" in report.excluded
    with fusedops.count_fused_calls() as counts:
        model(*inputs)
    # per block: 9 softmax minus the two nn.Softmax modules; LN: 4 minus block0's nano LN
    assert counts == {"softmax_forward": 3 * (HANDWRITTEN_SOFTMAX_CALLS - 2),
                      "layernorm_forward": 3 * HANDWRITTEN_LN_CALLS - 1}


def test_exclude_validation():
    model = HandWritten()
    with pytest.raises(TypeError, match="exclude"):
        patch_model(model, exclude=[3])
    report = patch_model(model, exclude="")  # the whole model
    assert report.replaced == [] and report.routed_functions == []
    assert model._forward_pre_hooks == {} and "forward" not in model.__dict__
    with pytest.raises(TypeError, match="exclude must be"):
        patch_model(model, exclude=5)
    with pytest.raises(TypeError, match="model must be an nn.Module, got str"):
        unpatch_model("x")


@pytest.mark.parametrize("bad", ["all", 1, 1.0, None])
def test_patterns_validation(bad):
    with pytest.raises(ValueError, match="patterns must be True, False or 'attention'"):
        patch_model(HandWritten(), patterns=bad)


# ---------------------------------------------------------------------------------------------
# Identity, hooks, state_dict, repatch, unpatch
# ---------------------------------------------------------------------------------------------


def test_parameters_state_dict_and_user_hooks_kept():
    model = HandWritten()
    fired = []
    model.ln_plain.register_forward_hook(lambda m, a, o: fired.append("ln"))
    model.register_forward_pre_hook(lambda m, a: fired.append("root"))
    before = structure(model)
    sd_before = {k: v.clone() for k, v in model.state_dict().items()}
    patch_model(model)
    after = structure(model)
    assert after["params"] == before["params"]
    assert after["buffers"] == before["buffers"]
    assert after["state_dict_keys"] == before["state_dict_keys"]
    model(handwritten_inputs())
    assert fired == ["root", "ln"]
    # A state_dict saved before patching loads into the patched model and vice versa.
    model.load_state_dict(sd_before)
    fresh = HandWritten()
    fresh.load_state_dict(model.state_dict())
    unpatch_model(model)
    assert structure(model) == before


def test_patch_twice_is_harmless_and_unpatch_restores():
    model, ref, inputs = twins(handwritten)
    before = structure(model)
    r1 = patch_model(model)
    once = structure(model)
    r2 = patch_model(model)
    assert structure(model) == once  # same classes, same number of hooks
    assert r1.replaced == r2.replaced
    wrapper = model.variants.__dict__["forward"]  # (its code calls tensor.softmax)
    assert type(wrapper) is wrappers.ModeSite  # not wrapped twice:
    assert type(wrapper.inner) is wrappers.RoutedFunction and wrapper.inner.inner is None
    assert model._forward_pre_hooks == {} and model._forward_hooks == {}
    assert_same_training(model, ref, inputs)
    unpatch_model(model)
    unpatch_model(model)  # harmless too
    assert structure(model) == before
    assert not is_patched(model)
    assert_same_training(model, ref, inputs)


def test_no_fused_call_after_unpatch(triton_on_cpu):
    model, _, inputs = twins(handwritten)
    patch_model(model)
    assert fused_counts(model, inputs)
    unpatch_model(model)
    assert fused_counts(model, inputs) == {}


def test_patched_context_manager(triton_on_cpu):
    model, _, inputs = twins(handwritten)
    before = structure(model)
    with fusedops.patched(model, ops=("softmax",)) as report:
        assert isinstance(report, PatchReport)
        assert fused_counts(model, inputs, backward=False) == {
            "softmax_forward": HANDWRITTEN_SOFTMAX_CALLS}
    assert structure(model) == before
    with pytest.raises(RuntimeError, match="inside"):
        with fusedops.patched(model):
            raise RuntimeError("inside")
    assert structure(model) == before
    # Patched on entry: restored to that patch (with its options) on exit.
    patch_model(model, ops=("layernorm",), exclude=("ln_plain",))
    patched_once = structure(model)
    with fusedops.patched(model):
        assert isinstance(model.ln_plain, FusedLayerNorm)
    assert structure(model) == patched_once
    assert type(model.ln_plain) is nn.LayerNorm
    unpatch_model(model)
    assert structure(model) == before


def test_optimizer_built_before_patching_trains():
    model, ref, inputs = twins(handwritten)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    patch_model(model)
    assert opt.param_groups[0]["params"] == list(model.parameters())
    for m, o in ((model, opt), (ref, opt_ref)):
        o.zero_grad()
        run(m, inputs).square().mean().backward()
        o.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert not torch.equal(p, start[n]), f"{n} did not train"
        torch.testing.assert_close(p, q, **FP32_TOL, msg=lambda m, n=n: f"{n}: {m}")
    assert_same_training(model, ref, inputs)


def test_deepcopy_and_pickle_of_patched_model(triton_on_cpu):
    model, ref, inputs = twins(handwritten)
    patch_model(model)
    clone = copy.deepcopy(model)
    loaded = pickle.loads(pickle.dumps(model))
    for m in (clone, loaded):
        assert isinstance(m.ln_sub, PlainSubLayerNorm) and isinstance(m.ln_sub, FusedLayerNorm)
        counts = fused_counts(m, inputs, backward=False)
        assert counts == {"softmax_forward": HANDWRITTEN_SOFTMAX_CALLS,
                          "layernorm_forward": HANDWRITTEN_LN_CALLS}
        unpatch_model(m)
        assert type(m.ln_sub) is PlainSubLayerNorm
        assert fused_counts(m, inputs, backward=False) == {}
    # The original is still patched and independent of its copies.
    assert fused_counts(model, inputs, backward=False)


def test_report_formats():
    model, _, inputs = twins(handwritten)
    report = patch_model(model, example_inputs=inputs)
    text = str(report)
    for needle in ("Replaced modules (4)", "ln_plain", "FusedLayerNorm", "Skipped modules (2)",
                   "overrides forward", "functional routing on", "max abs diff",
                   "swapped module calls: softmax=2, layernorm=2",
                   "calls routed to fusedops: softmax=6, layernorm=2"):
        assert needle in text, needle
    d = report.to_dict()
    assert d == json.loads(report.to_json())
    assert d["ops"] == ["softmax", "layernorm", "rmsnorm"]
    assert d["verification"]["outputs"][0]["name"] == "output"
    assert "Verification: not run" in str(patch_model(model))


class NestedOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(4)

    def forward(self, x):
        y = self.ln(x)
        return {"a": (y, y.softmax(-1)), "b": [y.sum()], "c": None, "n": 3}


def test_report_nested_outputs():
    model = NestedOutputs()
    report = patch_model(model, example_inputs={"x": torch.randn(2, 4)})
    names = [o["name"] for o in report.verification["outputs"]]
    assert names == ["a[0]", "a[1]", "b[0]"]
    assert all(o["max_abs_diff"] < 1e-5 for o in report.verification["outputs"])


def test_verification_restores_training_flags_and_rng():
    model, _, inputs = twins(handwritten)
    model.train()
    model.ln2d.eval()
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    patch_model(model, example_inputs=inputs)
    assert torch.equal(torch.rand(3), expected)
    assert model.training and model.ln_plain.training and not model.ln2d.training


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------


# (train-auto by default; a forced backend's kernels in a compiled graph run by default in
# test_patching_models.py's test_hf_compile_fullgraph and in test_compile.py)
@exhaustive_unless(lambda training, forced: training and not forced)
@pytest.mark.parametrize("forced", [False, True], ids=["auto", "forced"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_compile_fullgraph_no_graph_break(training, forced):
    """One graph, no recompiles. Chosen automatically, the fused ops step aside under
    torch.compile (torch's own softmax / layer_norm in the graph, for Inductor to fuse); a
    forced backend keeps every one of them as a fusedops op."""
    torch._dynamo.reset()
    model, ref, inputs = twins(handwritten)
    model.train(training)
    ref.train(training)
    patch_model(model)
    recorder = GraphRecorder()
    compiled = torch.compile(model, fullgraph=True, backend=recorder)
    with fusedops.use_backend("triton" if forced else None):
        out = run(compiled, inputs)
        assert_outputs_close(out, run(ref, inputs))
        assert len(recorder.graphs) == 1
        assert recorder.count("softmax_forward") == (HANDWRITTEN_SOFTMAX_CALLS if forced else 0)
        assert recorder.count("layernorm_forward") == (HANDWRITTEN_LN_CALLS if forced else 0)
        if forced:
            assert "aten.softmax" not in recorder.code() and "layer_norm(" not in recorder.code()
        else:
            assert "softmax" in recorder.code() and "layer_norm" in recorder.code()
        # Later calls reuse the graph (nothing per call triggers a recompile).
        for _ in range(2):
            run(compiled, inputs)
        assert len(recorder.graphs) == 1
        # Gradients through the compiled model match eager torch.
        assert_same_training(compiled, ref, inputs)
    assert stack_len() == 0


# (exhaustive: a forced backend's kernels in a compiled graph run by default in
# test_patching_models.py's test_hf_compile_fullgraph)
@EXHAUSTIVE
def test_compile_function_calling_patched_model():
    torch._dynamo.reset()
    model, ref, inputs = twins(handwritten)
    model.eval()
    ref.eval()
    patch_model(model)
    recorder = GraphRecorder()

    @torch.compile(fullgraph=True, backend=recorder)
    def step(x):
        return model(x).sum(-1)

    with fusedops.use_backend("triton"):
        torch.testing.assert_close(step(*inputs), ref(*inputs).sum(-1), **FP32_TOL)
    assert recorder.count("softmax_forward") == HANDWRITTEN_SOFTMAX_CALLS
    assert stack_len() == 0


# (exhaustive: Inductor's C++ build; test_compile.py's test_inductor_fwd_bwd compiles the fused
# ops with Inductor by default, test_exclude_by_type_and_exact_name runs exclude)
@EXHAUSTIVE
def test_compile_with_exclude_and_inductor():
    if not has_cxx_compiler():
        pytest.skip("inductor on CPU needs a C++ compiler")
    torch._dynamo.reset()
    model, ref, inputs = twins(lambda: (TwoBlocks(), (handwritten_inputs(),)))
    model.eval()
    ref.eval()
    patch_model(model, exclude=["block1"])
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        assert_outputs_close(compiled(*inputs), ref(*inputs))


# ---------------------------------------------------------------------------------------------
# GPU (CUDA machines only: `pytest -m gpu`)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_gpu_compile_handwritten_triton(mode, monkeypatch):
    torch._dynamo.reset()
    model, ref, inputs = twins(handwritten)
    model, ref = model.cuda().eval(), ref.cuda().eval()
    inputs = tuple(i.cuda() for i in inputs)
    patch_model(model)
    # The conv would run in TF32 by default, which amplifies last-bit differences.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    with fusedops.count_fused_calls() as counts, torch.no_grad():
        assert_outputs_close(model(*inputs), ref(*inputs), atol=1e-4, rtol=1e-4)
    assert counts == {"softmax_forward": HANDWRITTEN_SOFTMAX_CALLS,
                      "layernorm_forward": HANDWRITTEN_LN_CALLS}
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    with torch.no_grad():
        for _ in range(4):  # warm-up, then CUDA-graph replays for reduce-overhead
            x = torch.randn_like(inputs[0])
            assert_outputs_close(compiled(x), ref(x), atol=1e-4, rtol=1e-4)
