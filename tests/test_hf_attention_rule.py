"""When patch_model's Hugging Face attention function runs the fused softmax and when the
model's own eager function: the size rule, and below it, inference calls with a mask from the
second call of their shape in each attention module on (fusedops.patching.hf_attention.SEEN)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import tol
from test_patching_utils import assert_outputs_close, hf_bert, hf_gpt2, run, twins

import fusedops
from fusedops import _dispatch
from fusedops.patching import fx_patterns, hf_attention

pytest.importorskip("transformers")

RULES = _dispatch.SIZE_RULES["attention"]
LAYERS = 2  # the tiny models' attention calls per forward


@pytest.fixture
def rule_above_every_call(monkeypatch):
    """The reference backend runs the fused paths on CPU; the attention rule is set above any
    tiny model's scores (as on a GPU for a small batch), the table of seen shapes emptied."""
    monkeypatch.setattr(hf_attention, "SEEN", {})
    with fusedops.use_backend("reference"):
        for grad in (False, True):
            RULES["cpu", torch.float32, grad] = 1 << 40
        yield
        RULES.clear()


def calls(model, inputs, grad: bool = False) -> Counter:
    fx_patterns.counts = counts = Counter()
    try:
        with torch.set_grad_enabled(grad):
            run(model, inputs)
    finally:
        fx_patterns.counts = None
    return counts


def patched_gpt2():
    model, ref, inputs = twins(hf_gpt2)
    fusedops.patch_model(model.eval(), force=True)
    return model, ref.eval(), inputs


def test_a_masked_shape_runs_fused_from_its_second_call(rule_above_every_call):
    model, ref, inputs = patched_gpt2()
    assert calls(model, inputs) == {"hf_attention:unfused": LAYERS}
    assert calls(model, inputs) == {"hf_attention": LAYERS}
    with torch.no_grad():
        assert_outputs_close(run(model, inputs), run(ref, inputs), atol=1e-5, rtol=1e-5)
    # Another length is a shape of its own: the model's function first, then fused.
    longer = (torch.randint(0, 40, (2, 7)),)
    assert calls(model, longer) == {"hf_attention:unfused": LAYERS}
    assert calls(model, longer) == {"hf_attention": LAYERS}
    assert calls(model, inputs) == {"hf_attention": LAYERS}


def test_calls_that_need_autograd_wait_for_the_rule(rule_above_every_call):
    # Without a C++ autograd node (_dispatch.NATIVE_AUTOGRAD) a training call's Python
    # backward costs more than the model's own ops.
    model, _, inputs = patched_gpt2()
    for _ in range(3):
        assert calls(model, inputs, grad=True) == {"hf_attention:unfused": LAYERS}
    assert hf_attention.SEEN == {}


@pytest.mark.parametrize("make", [patched_gpt2, lambda: twins(hf_bert)])
def test_training_calls_run_fused_from_their_second_call_with_a_cpp_node(
        rule_above_every_call, monkeypatch, make):
    """Where the backend has the C++ node, a training call below the rule follows the seen-shape
    rule, with a mask (GPT-2) or without (BERT, no padding), and its gradients are the model's."""
    from fusedops.backends import reference

    # (As a backend with the node says it; the size rules of other ops refill the table.)
    monkeypatch.setattr(reference, "NATIVE_AUTOGRAD", True, raising=False)
    monkeypatch.setitem(_dispatch.NATIVE_AUTOGRAD, ("cpu", torch.float32), True)
    model, ref, inputs = make()
    fusedops.patch_model(model, force=True)
    model.eval()
    ref.eval()
    assert calls(model, inputs, grad=True) == {"hf_attention:unfused": LAYERS}
    assert calls(model, inputs, grad=True) == {"hf_attention": LAYERS}
    for m in (model, ref):
        out = run(m, inputs)
        (out if isinstance(out, torch.Tensor) else out[0]).float().square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        # (float32 sums over every position: the shared tolerance, widened as for row sums)
        torch.testing.assert_close(p.grad, q.grad, **tol(torch.float32, 10.0))


def test_calls_without_a_mask_wait_for_the_rule(rule_above_every_call):
    # BERT with no padding gets no mask: fusing would save one multiply, less than it costs.
    model, _, inputs = twins(hf_bert)
    fusedops.patch_model(model.eval(), force=True)
    for _ in range(3):
        assert calls(model, inputs) == {"hf_attention:unfused": LAYERS}
    padded = (inputs[0], torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]))
    assert calls(model, padded) == {"hf_attention:unfused": LAYERS}
    assert calls(model, padded) == {"hf_attention": LAYERS}


def test_calls_at_the_rule_run_fused_at_once(rule_above_every_call):
    model, _, inputs = patched_gpt2()
    scores = inputs[0].shape[0] * 2 * inputs[0].shape[1] ** 2  # B * heads * T * T
    RULES["cpu", torch.float32, False] = scores
    assert calls(model, inputs) == {"hf_attention": LAYERS}
    RULES["cpu", torch.float32, True] = scores
    assert calls(model, inputs, grad=True) == {"hf_attention": LAYERS}
    assert hf_attention.SEEN == {}


def test_seen_shapes_are_bounded(rule_above_every_call, monkeypatch):
    monkeypatch.setattr(hf_attention, "SEEN_MAX", 2)
    model, _, _ = patched_gpt2()
    for t in (3, 4, 5):
        calls(model, (torch.randint(0, 40, (1, t)),))
    # Emptied whenever it holds two (module, shape) entries: only the last call's are left.
    assert len(hf_attention.SEEN) == 2
    assert {shape[2] for _, shape, _ in hf_attention.SEEN} == {5}


def test_without_a_fused_backend_the_model_runs_its_own(monkeypatch):
    # No fused backend for CPU tensors (the rule is inf): never fused, nothing remembered.
    monkeypatch.setattr(hf_attention, "SEEN", {})
    model, _, inputs = patched_gpt2()
    for _ in range(3):
        assert calls(model, inputs) == {"hf_attention:unfused": LAYERS}
    assert hf_attention.SEEN == {}


def test_fused_inference_calls_replay_from_the_attention_function(rule_above_every_call,
                                                                  monkeypatch):
    # A signature with a replay runner (fusedops._replay, made by the GPU backend) is launched
    # straight from the attention function; calls that need autograd, and a runner that
    # declines (None), take masked_softmax.
    from fusedops.ops.softmax_masked import masked_softmax

    ran = Counter()

    def runner(x, mask, scale, causal):
        def run(x2, mask2):
            ran["run"] += 1
            return masked_softmax(x2, -1, None, scale, mask2, causal)

        def native(x2, mask2):
            ran["native"] += 1
            return masked_softmax(x2, -1, None, scale, mask2, causal)
        run.native = native if ran["with_native"] else False
        if ran["decline"]:
            declined = lambda x2, mask2: None  # noqa: E731
            declined.native = lambda x2, mask2: None
            return declined
        return run

    monkeypatch.setattr(hf_attention, "replay_runner", runner)
    model, ref, inputs = patched_gpt2()
    calls(model, inputs)
    with torch.no_grad():
        assert_outputs_close(run(model, inputs), run(ref, inputs), atol=1e-5, rtol=1e-5)
    assert ran["run"] == LAYERS
    ran["decline"] = 1
    with torch.no_grad():
        assert_outputs_close(run(model, inputs), run(ref, inputs), atol=1e-5, rtol=1e-5)
    assert ran["run"] == LAYERS
    ran["decline"] = 0
    RULES["cpu", torch.float32, True] = 0  # training calls fused too: never the runner
    out = run(model, inputs)
    out = out if isinstance(out, torch.Tensor) else out[0]
    out.float().sum().backward()
    assert ran["run"] == LAYERS and ran["native"] == 0
    # A runner with a C++ node (``native``) takes the training calls, under autocast too.
    ran["with_native"] = 1
    out = run(model, inputs)
    (out if isinstance(out, torch.Tensor) else out[0]).float().sum().backward()
    assert ran["run"] == LAYERS and ran["native"] == LAYERS
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(model, inputs)
    (out if isinstance(out, torch.Tensor) else out[0]).float().sum().backward()
    assert ran["native"] == 2 * LAYERS
    ran["with_native"] = 0
    # Under count_fused_calls (plain_eager is False) the runner is not used either.
    with _dispatch.count_fused_calls(), torch.no_grad():
        run(model, inputs)
    assert ran["run"] == LAYERS


def test_fused_call_frees_the_scores_before_the_second_matmul(rule_above_every_call,
                                                              monkeypatch):
    # As in the model's own function, the scores are not alive beside the weights and the
    # output of weights @ v (the peak memory of large inference calls).
    import weakref

    from fusedops.ops import softmax_masked

    model, _, inputs = patched_gpt2()
    calls(model, inputs)  # each module's first call of the shape: the model's own
    scores_refs: list = []
    seen_alive: list[bool] = []
    real_softmax, real_matmul = softmax_masked.masked_softmax, torch.matmul

    def softmax_spy(x, *args):
        scores_refs.append(weakref.ref(x))
        return real_softmax(x, *args)

    def matmul_spy(a, b):
        if scores_refs and a.dim() == 4 and b.shape[-2] == a.shape[-1] \
                and len(seen_alive) < len(scores_refs):
            seen_alive.append(scores_refs[-1]() is not None)
        return real_matmul(a, b)

    monkeypatch.setattr(hf_attention, "masked_softmax", softmax_spy)
    monkeypatch.setattr(torch, "matmul", matmul_spy)
    assert calls(model, inputs) == {"hf_attention": LAYERS}
    assert len(scores_refs) == LAYERS and seen_alive == [False] * LAYERS


def test_no_replay_while_torch_compile_traces_with_a_forced_backend(monkeypatch):
    # A forced backend keeps the fused attention under torch.compile; its replay runners hold
    # raw addresses and are for eager calls only.
    torch._dynamo.reset()
    asked = []
    monkeypatch.setattr(hf_attention, "replay_runner", lambda *a: asked.append(a) or None)
    model, ref, inputs = patched_gpt2()
    with fusedops.use_backend("reference"), torch.no_grad():
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        assert_outputs_close(run(compiled, inputs), run(ref, inputs), atol=1e-5, rtol=1e-5)
        assert asked == []
        run(model, inputs)  # eager: the runner is asked
    assert len(asked) == LAYERS
    torch._dynamo.reset()


@pytest.mark.parametrize("mask_shape", [None, (2, 1, 4, 8), (1, 1, 1, 8)])
def test_replay_lookup_and_registration_share_the_signature(monkeypatch, mask_shape):
    """replay_runner (the attention function's lookup, its key written out) finds exactly the
    entry registered under replay_key, and not one of another scale, causal flag or mask."""
    from fusedops import _replay
    from fusedops.ops import softmax_masked as sm

    monkeypatch.setattr(_replay, "SOFTMAX_MASKED", {})
    x = torch.randn(2, 3, 4, 8)
    mask = None if mask_shape is None else torch.zeros(mask_shape)
    sentinel = object()
    _replay.SOFTMAX_MASKED[sm.replay_key(x, mask, 0.125, False)] = sentinel
    assert sm.replay_runner(x, mask, 0.125, False) is sentinel
    assert sm.replay_runner(x, mask, 0.25, False) is None
    assert sm.replay_runner(x, mask, 0.125, True) is None
    other = torch.zeros(2, 3, 4, 8) if mask is None else None
    assert sm.replay_runner(x, other, 0.125, False) is None
