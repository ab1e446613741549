"""The example predictor: shapes, mask, gradients, the synthetic task, training, checkpoints, and
patched-vs-unpatched agreement (reference backend and the Triton kernels in the interpreter)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import EXHAUSTIVE, INTERPRETING
from torch import nn

import fusedops
from fusedops.models import (
    PRESETS,
    Predictor,
    PredictorConfig,
    SyntheticTask,
    evaluate,
    get_preset,
    load_checkpoint,
    save_checkpoint,
    task_for,
    train_predictor,
)

TINY = PredictorConfig(n_features=5, max_len=12, d_model=16, n_heads=2, n_layers=2, d_ff=32)


def tiny_batch(b=3, seed=0, cfg=TINY):
    task = task_for(cfg)
    return task.sample(b, task.generator(seed))


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_shapes_and_dtype(positions):
    torch.manual_seed(0)
    model = Predictor(TINY, positions=positions)
    x, mask, _ = tiny_batch()
    assert model(x, mask).shape == (3, 1)
    assert model(x).shape == (3, 1)
    assert model(x[:, :5], mask[:, :5]).shape == (3, 1)  # shorter sequences
    assert Predictor(TINY, n_outputs=3)(x, mask).shape == (3, 3)
    assert model.double()(x.double(), mask).dtype == torch.float64


def test_bad_inputs_raise():
    model = Predictor(TINY)
    x, mask, _ = tiny_batch()
    with pytest.raises(ValueError, match="n_features"):
        model(x[..., :3])
    with pytest.raises(ValueError, match="max_len"):
        model(torch.randn(1, TINY.max_len + 1, TINY.n_features))
    with pytest.raises(ValueError, match="mask"):
        model(x, mask.float())
    with pytest.raises(ValueError, match="divisible"):
        PredictorConfig(d_model=10, n_heads=4)
    with pytest.raises(ValueError, match="positions"):
        PredictorConfig(positions="rotary")
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("tpu")


def test_padding_is_ignored():
    """Changing the features of padded positions must not change the output."""
    torch.manual_seed(0)
    model = Predictor(TINY).eval()
    x, mask, _ = tiny_batch(4)
    assert (~mask).any()
    noisy = x.clone()
    noisy[~mask] = torch.randn(int((~mask).sum()), TINY.n_features) * 100
    torch.testing.assert_close(model(noisy, mask), model(x, mask), atol=1e-5, rtol=1e-5)
    # ...while without the mask they do matter
    assert not torch.allclose(model(noisy), model(x))


def test_gradients_reach_every_parameter():
    torch.manual_seed(0)
    model = Predictor(TINY)
    x, mask, y = tiny_batch(4)
    torch.nn.functional.mse_loss(model(x, mask), y).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
    assert sum(p.grad.abs().sum() for p in model.parameters()) > 0


def test_uses_module_and_functional_softmax_and_layernorm_modules():
    model = Predictor(TINY)
    kinds = [type(m) for m in model.modules()]
    assert kinds.count(nn.Softmax) == TINY.n_layers
    assert kinds.count(nn.LayerNorm) == 2 * TINY.n_layers + 1
    from fusedops.tools.profile import capture_calls

    x, mask, _ = tiny_batch(2)
    calls = {(c["op"], len(c["shape"])): c["count"] for c in capture_calls(model, (x, mask))}
    assert calls[("softmax", 4)] == TINY.n_layers  # attention: nn.Softmax on (B, H, S, S)
    assert calls[("softmax", 2)] == 1  # pooling: F.softmax on (B, S)
    assert calls[("layernorm", 3)] == 2 * TINY.n_layers + 1


def test_presets():
    assert set(PRESETS) >= {"cpu", "gpu"}
    gpu = get_preset("gpu").config
    assert 512 <= gpu.max_len <= 1024 and 256 <= gpu.d_model <= 512
    for p in PRESETS.values():
        Predictor(p.config)  # constructible
        assert task_for(p.config).n_features == p.config.n_features


def test_task_is_deterministic_and_correct():
    task = SyntheticTask(max_len=8, n_categories=3, spread=0.5, seed=7)
    a = task.sample(6, task.generator(0))
    b = task.sample(6, task.generator(0))
    for u, v in zip(a, b, strict=True):
        assert torch.equal(u, v)
    assert not torch.equal(task.heldout(6)[0], a[0])
    torch.testing.assert_close(task.heldout(16)[2], task.heldout(16)[2])
    x, mask, y = a
    assert x.shape == (6, 8, 5) and mask.shape == (6, 8) and y.shape == (6, 1)
    assert mask[:, 0].all() and (x[:, 0, -1] == 1).all() and (x[:, 1:, -1] == 0).all()
    assert (x[~mask] == 0).all()
    assert (x[mask][:, :3].sum(-1) == 1).all()  # one-hot categories on real tokens
    # the target, recomputed by hand from the features
    for i in range(6):
        q = int(x[i, 0, :3].argmax())
        vals = [x[i, j, 3] for j in range(1, 8) if mask[i, j] and int(x[i, j, :3].argmax()) == q]
        assert vals, "at least one token matches the query"
        torch.testing.assert_close(y[i, 0], torch.stack(vals).mean(), atol=1e-6, rtol=1e-6)
    full = task.sample(3, task.generator(0), full_length=True)[1]
    assert full.all()
    with pytest.raises(ValueError, match="min_len"):
        SyntheticTask(max_len=8, min_len=9)


def test_task_needs_content_matching():
    """Averaging every value (what attention does before it learns to match) explains only part
    of the target: the task needs content-based attention."""
    task = SyntheticTask(max_len=64, seed=1)
    x, mask, y = task.sample(4096, task.generator(0))
    values = x[..., -2]
    mean_all = ((values * mask).sum(1) / (mask.sum(1) - 1)).unsqueeze(1)
    r = torch.corrcoef(torch.cat([mean_all, y], 1).T)[0, 1]
    assert r**2 < 0.5


@pytest.fixture
def one_thread():
    """One intra-op thread: on a small shared CPU, far steadier than several spinning threads."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@EXHAUSTIVE  # (150 training steps)
def test_training_beats_the_mean_baseline(one_thread):
    preset = get_preset("cpu")
    torch.manual_seed(0)
    model = Predictor(preset.config)
    task = task_for(preset.config)
    result = train_predictor(model, task, steps=150, batch_size=64, lr=preset.lr,
                             heldout_n=512)
    after = result.heldout_after
    assert result.steps == 150 and len(result.history) > 0
    assert after["mse"] < 0.9 * after["baseline_mse"], after
    assert after["r2"] > 0.5
    assert after["mse"] < result.heldout_before["mse"]


def test_checkpoint_roundtrip(tmp_path):
    torch.manual_seed(0)
    model = Predictor(TINY, positions="sinusoidal").eval()
    task = task_for(TINY, spread=0.5)
    path = tmp_path / "sub" / "ckpt.pt"
    save_checkpoint(path, model, task, note="hello", train_mean=0.25)
    loaded, meta = load_checkpoint(path)
    assert meta["config"] == model.config
    assert meta["task"] == task
    assert meta["info"] == {"note": "hello", "train_mean": 0.25}
    x, mask, _ = tiny_batch(4)
    torch.testing.assert_close(loaded(x, mask), model(x, mask), atol=0, rtol=0)
    assert not loaded.training
    payload = torch.load(path, weights_only=True)  # plain data only
    assert payload["format"].startswith("fusedops.predictor")
    evaluate(loaded, task, n=32)
    bad = tmp_path / "bad.pt"
    torch.save({"format": "something else"}, bad)
    with pytest.raises(ValueError, match="not a fusedops predictor checkpoint"):
        load_checkpoint(bad)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _fwd_bwd(model, x, mask, y):
    model.zero_grad(set_to_none=True)
    out = model(x, mask)
    torch.nn.functional.mse_loss(out, y).backward()
    return out.detach(), _grads(model)


# The Triton interpreter evaluates masked-off lanes too (e.g. -inf - -inf in padding rows).
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("backend", [None, "triton"])
def test_patched_predictor_matches_unpatched(backend):
    """Outputs and gradients of the patched predictor match the unpatched one, on the automatic
    backend and on the real Triton kernels (interpreted on CPU)."""
    if backend == "triton" and not INTERPRETING:
        pytest.skip("CPU tensors need the Triton interpreter; the CUDA demo/patching tests "
                    "cover the compiled kernels here")
    torch.manual_seed(0)
    model = Predictor(TINY).train()
    x, mask, y = tiny_batch(3)
    ref_out, ref_grads = _fwd_bwd(model, x, mask, y)
    patched = copy.deepcopy(model)
    with fusedops.use_backend(backend):
        # force: automatically, CPU tensors have no fused backend (the patched calls then run
        # PyTorch's ops, which must match as well).
        report = fusedops.patch_model(patched, force=backend is None, patterns=True)
        assert len(report.replaced) == 3 * TINY.n_layers + 1
        with fusedops.count_fused_calls() as counts:
            out, grads = _fwd_bwd(patched, x, mask, y)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")
    if backend == "triton":
        # Every softmax and LayerNorm ran fused: the attention's softmax(scores * scale + mask)
        # and each block's ln2(x + attn) as epilogue patterns, the pooling softmax, ln1 and
        # ln_f as plain ops.
        n = TINY.n_layers
        assert counts["softmax_masked_forward"] == counts["softmax_masked_backward"] == n
        assert counts["softmax_forward"] == counts["softmax_backward"] == 1
        assert counts["layernorm_epilogue_forward"] == counts["layernorm_epilogue_backward"] == n
        assert counts["layernorm_forward"] == counts["layernorm_backward"] == n + 1
    fusedops.unpatch_model(patched)
    assert [type(m) for m in patched.modules()] == [type(m) for m in model.modules()]
