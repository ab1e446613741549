"""patch_model on Hugging Face models built from tiny random configs (eager attention, no
downloads): BERT, GPT-2 and ViT. Outputs and gradients must match the unpatched model, the
fused kernels must really run (Triton interpreter), and everything must be undone by unpatch.
"""

from __future__ import annotations

import pytest
import torch
from test_patching_utils import (
    HF_MODELS,
    GraphRecorder,
    assert_outputs_close,
    assert_same_training,
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
    report = patch_model(model, example_inputs=inputs)
    assert len(report.replaced) == n_ln
    assert all(r["fused_type"] == "FusedLayerNorm" for r in report.replaced)
    assert report.skipped == []
    # The eager attention's functional softmax and every LayerNorm go through fusedops.
    assert report.verification["routed_calls"] == {"softmax": n_softmax, "layernorm": n_ln,
                                                   "rmsnorm": 0}
    assert report.max_rel_diff < 1e-5
    assert model.training == training  # the verification pass restores the mode
    # Dropout is active in train mode: both twins draw the same masks from the same seed.
    assert_same_training(model, ref, inputs)


@pytest.mark.parametrize("name", MODELS)
def test_hf_fused_kernels_run(name, triton_on_cpu):
    model, ref, inputs, n_ln, n_softmax = make(name)
    patch_model(model)
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


@pytest.mark.parametrize("name", MODELS)
def test_hf_compile_fullgraph(name):
    torch._dynamo.reset()
    model, ref, inputs, n_ln, n_softmax = make(name)
    model.eval()
    ref.eval()
    patch_model(model)
    recorder = GraphRecorder()
    compiled = torch.compile(model, fullgraph=True, backend=recorder)
    with torch.no_grad():
        assert_outputs_close(compiled(*inputs), ref(*inputs))
        compiled(*inputs)
    assert len(recorder.graphs) == 1  # no graph break, no recompile
    assert recorder.count("layernorm_forward") == n_ln
    assert recorder.count("softmax_forward") == n_softmax


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
    patch_model(model)
    with fusedops.count_fused_calls() as counts:
        out = run(model, inputs)
        torch.cuda.synchronize()
    assert counts == {"layernorm_forward": n_ln, "softmax_forward": n_softmax}
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
