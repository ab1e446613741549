"""patch_model on Hugging Face models built from tiny random configs (eager attention, no
downloads): BERT, GPT-2 and ViT. Outputs and gradients must match the unpatched model, the
fused kernels must really run (Triton interpreter), and everything must be undone by unpatch.
"""

from __future__ import annotations

import pytest
import torch
from conftest import exhaustive_unless
from test_patching_utils import (
    HF_MODELS,
    GraphRecorder,
    assert_outputs_close,
    assert_same_training,
    force_patch,  # noqa: F401 - a fixture
    fused_counts,
    run,
    structure,
    twins,
)
from torch import nn

import fusedops
from fusedops import FusedLayerNorm, patch_model, unpatch_model

pytest.importorskip("transformers")

MODELS = list(HF_MODELS)
# name -> traced-forward LayerNorm(a + b) sites (BERT's BertSelfOutput and BertOutput per
# layer; GPT-2's and ViT's blocks have decorated forwards, which are left alone).
HF_LN_PATTERNS = {"bert": 4, "gpt2": 0, "vit": 0}

pytestmark = pytest.mark.usefixtures("force_patch")


def make(name: str):
    factory, n_ln, n_softmax = HF_MODELS[name]
    model, ref, inputs = twins(factory)
    return model, ref, inputs, n_ln, n_softmax


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", MODELS)
def test_hf_matches_unpatched(name, training):
    model, ref, inputs, n_ln, n_softmax = make(name)
    model.train(training)
    ref.train(training)
    # patterns=False: this test is about the module swap and functional routing (the epilogue
    # patterns, which take over some of these calls, are tested below).
    report = patch_model(model, example_inputs=inputs, patterns=False)
    assert len(report.replaced) == n_ln
    assert all(r["fused_type"] == "FusedLayerNorm" for r in report.replaced)
    assert report.skipped == []
    # The eager attention's functional softmax and every LayerNorm go through fusedops.
    assert report.verification["module_calls"] == {"softmax": 0, "layernorm": n_ln,
                                                   "rmsnorm": 0}
    assert report.verification["routed_calls"] == {"softmax": n_softmax, "layernorm": 0,
                                                   "rmsnorm": 0}
    assert report.max_rel_diff < 1e-5
    assert model.training == training  # the verification pass restores the mode
    # Dropout is active in train mode: both twins draw the same masks from the same seed.
    assert_same_training(model, ref, inputs)


@exhaustive_unless(lambda name: name == "gpt2")  # (the interpreted kernels: one model by default)
@pytest.mark.parametrize("name", MODELS)
def test_hf_fused_kernels_run(name, triton_on_cpu):
    model, ref, inputs, n_ln, n_softmax = make(name)
    patch_model(model, patterns=False)
    assert fused_counts(model, inputs) == {
        "layernorm_forward": n_ln, "layernorm_backward": n_ln,
        "softmax_forward": n_softmax, "softmax_backward": n_softmax,
    }
    assert_same_training(model, ref, inputs, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("name", MODELS)
def test_hf_structure_unpatch_and_optimizer(name, triton_backend):
    model, ref, inputs, _, _ = make(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.01)
    before = structure(model)
    patch_model(model)
    after = structure(model)
    assert after["params"] == before["params"]
    assert after["buffers"] == before["buffers"]
    assert after["state_dict_keys"] == before["state_dict_keys"]
    assert all(isinstance(m, FusedLayerNorm) for m in model.modules()
               if isinstance(m, nn.LayerNorm))
    assert "FusedLayerNorm(" in repr(model)
    with fusedops.use_backend(None):  # a training step (reference backend on CPU)
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            out = run(m, inputs)
            (out[0].float().square().mean()).backward()
            o.step()
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
    unpatch_model(model)
    assert structure(model) == before
    assert fused_counts(model, inputs) == {}
    with fusedops.use_backend(None):
        assert_same_training(model, ref, inputs)


# (ViT with the forced backend by default; the automatic choice under torch.compile runs by
# default in test_patching.py's test_compile_fullgraph_no_graph_break)
@exhaustive_unless(lambda name, forced: (name, forced) == ("vit", True))
@pytest.mark.parametrize("forced", [False, True], ids=["auto", "forced"])
@pytest.mark.parametrize("name", MODELS)
def test_hf_compile_fullgraph(name, forced):
    """No graph break. Chosen automatically, the fused ops step aside under torch.compile (the
    graph holds torch's own ops, which Inductor fuses with their neighbours as it does for the
    unpatched model); a forced backend keeps its kernels as custom ops."""
    torch._dynamo.reset()
    model, ref, inputs, n_ln, n_softmax = make(name)
    model.eval()
    ref.eval()
    patch_model(model, patterns=False)
    recorder = GraphRecorder()
    compiled = torch.compile(model, fullgraph=True, backend=recorder)
    with torch.no_grad(), fusedops.use_backend("triton" if forced else None):
        assert_outputs_close(compiled(*inputs), ref(*inputs))
        compiled(*inputs)
    assert len(recorder.graphs) == 1  # no graph break, no recompile
    assert recorder.count("layernorm_forward") == (n_ln if forced else 0)
    assert recorder.count("softmax_forward") == (n_softmax if forced else 0)
    if not forced:
        assert recorder.code().count("layer_norm") >= n_ln


# ---------------------------------------------------------------------------------------------
# GPU: Triton kernels compiled for real, torch.compile with inductor and CUDA graphs
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", MODELS)
def test_gpu_hf_eager_triton(name, dtype):
    model, ref, inputs, n_ln, n_softmax = make(name)
    model, ref = model.cuda().to(dtype), ref.cuda().to(dtype)
    inputs = tuple(i.cuda().to(dtype) if i.is_floating_point() else i.cuda() for i in inputs)
    patch_model(model, patterns=True)
    with fusedops.count_fused_calls() as counts:
        out = run(model, inputs)
        torch.cuda.synchronize()
    n_add_ln = HF_LN_PATTERNS[name]  # LayerNorm(x + residual) sites run the epilogue kernel
    assert counts == {k: v for k, v in {
        "layernorm_forward": n_ln - n_add_ln, "layernorm_epilogue_forward": n_add_ln,
        "softmax_masked_forward": n_softmax}.items() if v}
    tol = {"atol": 1e-4, "rtol": 1e-3} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 5e-2}
    assert_outputs_close(out, run(ref, inputs), **tol)
    if dtype == torch.float32:
        assert_same_training(model, ref, inputs, **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.parametrize("name", MODELS)
def test_gpu_hf_compile(name, mode):
    torch._dynamo.reset()
    model, ref, inputs, n_ln, n_softmax = make(name)
    model, ref = model.cuda().eval(), ref.cuda().eval()
    inputs = tuple(i.cuda() for i in inputs)
    patch_model(model)
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    with torch.no_grad():
        for _ in range(4):  # warm-up, recording, then CUDA-graph replays
            ins = tuple(
                torch.randn_like(i) if i.is_floating_point() else torch.randint_like(i, 0, 40)
                for i in inputs
            )
            assert_outputs_close(compiled(*ins), ref(*ins), atol=1e-4, rtol=1e-3)




# (BERT by default: its attention and its LayerNorm(x + residual) patterns; the others
# exhaustive)
@exhaustive_unless(lambda name: name == "bert")
@pytest.mark.parametrize("name", MODELS)
def test_hf_epilogue_patterns(name, triton_on_cpu):
    """Eager attention goes through fusedops' registered attention function (one fused
    softmax(scores * scaling + mask) per layer) and BERT's LayerNorm(x + residual) through the
    traced forwards; outputs and gradients match, the fused kernels run, unpatch restores."""
    model, ref, inputs, _, n_softmax = make(name)
    # By default a forward whose only pattern is LayerNorm(a + b) is reported, not rewritten.
    report = patch_model(model)
    left = [p for p in report.pattern_skipped if "LayerNorm(a + b) fusable" in p["reason"]]
    assert len(left) == HF_LN_PATTERNS[name]
    assert [p["via"] for p in report.fused_patterns].count("hf attention") == n_softmax
    report = patch_model(model, example_inputs=inputs, patterns=True)
    via = [p["via"] for p in report.fused_patterns]
    assert via.count("hf attention") == n_softmax
    assert via.count("traced forward") == HF_LN_PATTERNS[name]
    assert report.verification["pattern_calls"].get("hf_attention") == n_softmax
    assert report.verification["pattern_calls"].get("add_layernorm", 0) == HF_LN_PATTERNS[name]
    assert not any(k.endswith(":unfused") for k in report.verification["pattern_calls"])
    assert report.max_rel_diff < 1e-5
    # Each attention module reads a private view of the config; the shared one is untouched.
    assert model.config._attn_implementation == "eager"
    views = {id(m.config) for m in model.modules() if "config" in m.__dict__
             and m.config is not model.config and hasattr(m.config, "_attn_implementation")}
    assert views and all(m.config._attn_implementation == "fusedops_eager"
                         for m in model.modules() if id(getattr(m, "config", None)) in views)
    counts = fused_counts(model, inputs)
    assert counts.get("softmax_masked_forward") == n_softmax
    assert counts.get("layernorm_epilogue_forward", 0) == HF_LN_PATTERNS[name]
    assert counts.get("layernorm_epilogue_backward", 0) == HF_LN_PATTERNS[name]
    assert_same_training(model, ref, inputs, atol=1e-4, rtol=1e-3)
    unpatch_model(model)
    assert model.config._attn_implementation == "eager"
    assert all(getattr(m, "config", model.config) is model.config for m in model.modules()
               if "config" in m.__dict__)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_hf_attention_left_alone_when_not_eager():
    """A model that chose SDPA keeps it: only eager attention is switched."""
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, attn_implementation="sdpa")
    model = BertModel(cfg)
    report = patch_model(model)
    assert not any(p["via"] == "hf attention" for p in report.fused_patterns)
    assert model.config._attn_implementation == "sdpa"
