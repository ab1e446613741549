"""CUDA-graph capture and replay (``gpu`` marker; skipped without a GPU).

``test_compile.py`` already captures a single-block forward + backward (N = 1024, fp16), an
inference graph (N = 4096) and ``mode="reduce-overhead"``. This file adds:

* capture + replay of forward and backward of both ops for every kernel variant: single-block,
  looped (N = 70000) and the split-row softmax (N = 2 x 16384, cooperative launch and per-row
  arrival counters, which must be reset by every replay);
* capture + replay of a *patched model* (``fusedops.patch_model``: module swaps and the
  functional routing) forward + loss + backward, against the unpatched model run eagerly.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import tol

import fusedops
from fusedops import fused_layernorm, fused_softmax

pytestmark = pytest.mark.gpu


def _warm_up(fn, iters: int = 3) -> None:
    """The documented pattern: warm up (Triton compiles, configs cache) on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(iters):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


@pytest.mark.parametrize("n", [1000, 2 * 16384, 70000], ids=["single", "split", "looped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_graph_forward_backward_variants(launch_rules, n, dtype):
    if n == 70000:  # split rows take any long row on CUDA: turn them off for the looped kernels
        launch_rules(SPLIT_ROWS=False)
    m = 8
    g = torch.Generator().manual_seed(n)
    static_x = torch.randn(m, n, generator=g).to(dtype).cuda().requires_grad_(True)
    static_dy = torch.randn(m, n, generator=g).to(dtype).cuda()
    w = torch.randn(n, generator=g).cuda().requires_grad_(True)
    b = torch.randn(n, generator=g).cuda().requires_grad_(True)

    def step():
        y1 = fused_softmax(static_x, -1)
        y2 = fused_layernorm(static_x, n, w, b)
        torch.autograd.backward([y1, y2], [static_dy, static_dy])
        return y1, y2

    _warm_up(step)
    static_x.grad = w.grad = b.grad = None
    graph = torch.cuda.CUDAGraph()
    with fusedops.count_fused_calls() as counts, torch.cuda.graph(graph):
        static_y1, static_y2 = step()
    assert counts["softmax_forward"] == counts["softmax_backward"] == 1
    assert counts["layernorm_forward"] == counts["layernorm_backward"] == 1
    for replay in range(3):
        with torch.no_grad():
            static_x.copy_(torch.randn(m, n, generator=g).to(dtype))
            static_dy.copy_(torch.randn(m, n, generator=g).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        x_ref = static_x.detach().clone().requires_grad_(True)
        w_ref = w.detach().clone().requires_grad_(True)
        b_ref = b.detach().clone().requires_grad_(True)
        y1_ref = torch.softmax(x_ref.float(), -1).to(dtype)
        y2_ref = F.layer_norm(x_ref.float(), (n,), w_ref, b_ref).to(dtype)
        torch.autograd.backward([y1_ref, y2_ref], [static_dy, static_dy])
        msg = f"replay {replay}"
        torch.testing.assert_close(static_y1, y1_ref, **tol(dtype), msg=msg)
        torch.testing.assert_close(static_y2, y2_ref, **tol(dtype, 4), msg=msg)
        torch.testing.assert_close(static_x.grad, x_ref.grad, **tol(dtype, 8), msg=msg)
        torch.testing.assert_close(w.grad, w_ref.grad, **tol(torch.float32, 40), msg=msg)
        torch.testing.assert_close(b.grad, b_ref.grad, **tol(torch.float32, 40), msg=msg)


def test_gpu_graph_patched_model_training_step():
    """A patched Predictor: forward, loss and backward captured in one graph and replayed on new
    batches; loss and every parameter gradient match the unpatched model run eagerly."""
    from fusedops.models import Predictor, PredictorConfig

    torch.manual_seed(0)
    cfg = PredictorConfig(n_features=6, max_len=128, d_model=128, n_heads=4, n_layers=2,
                          d_ff=256)
    reference = Predictor(cfg).cuda()
    model = copy.deepcopy(reference)
    fusedops.patch_model(model, patterns=True)
    static_x = torch.randn(16, 128, 6, device="cuda")
    static_t = torch.randn(16, 1, device="cuda")

    def step():
        loss = F.mse_loss(model(static_x), static_t)
        loss.backward()
        return loss

    _warm_up(step)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with fusedops.count_fused_calls() as counts, torch.cuda.graph(graph):
        static_loss = step()
    # Per block: ln1, ln2(x + attn) as an epilogue and the attention softmax(scores * scale) as
    # a masked softmax; then the final LayerNorm and the pooling softmax.
    for op, n in (("layernorm", 3), ("layernorm_epilogue", 2), ("softmax", 1),
                  ("softmax_masked", 2)):
        assert counts[f"{op}_forward"] == n and counts[f"{op}_backward"] == n, counts
    for replay in range(3):
        with torch.no_grad():
            static_x.copy_(torch.randn(16, 128, 6, device="cuda"))
            static_t.copy_(torch.randn(16, 1, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        reference.zero_grad(set_to_none=True)
        ref_loss = F.mse_loss(reference(static_x), static_t)
        ref_loss.backward()
        torch.testing.assert_close(static_loss, ref_loss, atol=1e-5, rtol=1e-4,
                                   msg=f"replay {replay}")
        for (name, p), p_ref in zip(model.named_parameters(), reference.parameters(),
                                    strict=True):
            torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-4, rtol=1e-3,
                                       msg=f"replay {replay}: {name}")
