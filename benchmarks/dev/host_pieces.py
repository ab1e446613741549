"""Host time per call of the pieces of a patched BERT layer (inference, no grad),
microseconds per call, the fastest of many batches (the shared machine's noise only ever adds
time): the unpatched piece against the fused API and the patched piece.

On a CUDA machine: bf16 BERT-base-wide tensors at batch 1 x 16 tokens, real kernels (each a few
µs of GPU time, so the host's issue rate is what is timed). Without one (``TRITON_INTERPRET=1``):
the Triton backend's host code on CPU tensors with kernel launches stubbed out and replay plans
made as with Triton 3.6's C entries (launching nothing): only Python and torch-dispatch time is
real, and torch's own CPU ops are cheaper to dispatch than its CUDA ones.

    PYTHONPATH=$PWD [TRITON_INTERPRET=1] python benchmarks/dev/host_pieces.py
"""

from __future__ import annotations

import copy
import sys
import time

import torch

sys.path.insert(0, "examples")
from bert_before_after import inputs_for  # noqa: E402

import fusedops  # noqa: E402
from fusedops import _dispatch  # noqa: E402
from fusedops.triton import _common  # noqa: E402
from fusedops.triton import layernorm as tln  # noqa: E402
from fusedops.triton import layernorm_epilogue as tle  # noqa: E402
from fusedops.triton import rmsnorm as trms  # noqa: E402
from fusedops.triton import softmax as tsm  # noqa: E402
from fusedops.triton import softmax_masked as tsmm  # noqa: E402


def stub_kernels() -> None:
    """No kernels; launches recorded for replay plans; C entries that launch nothing."""
    def entry(self, args, num_warps):
        def go(grid, stream, raw):
            return None
        go.raw_pointers = True
        go.c_entry = (lambda *a: None, None, False, False, None)  # (launch, function, ...)
        return go

    _common.Launcher.__call__ = (lambda self, grid, args, num_warps:
                                 _common._record(self, grid, args, num_warps))
    _common.Launcher.entry = entry
    for mod in (_common, tln, tle, trms, tsm, tsmm):
        if hasattr(mod, "current_stream"):
            mod.current_stream = lambda index: 0


CUDA = torch.cuda.is_available()


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def us_per_call(fn, batches: int = 40, n: int = 50) -> float:
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(batches):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def main() -> None:
    torch.set_num_threads(1)
    if not CUDA:
        stub_kernels()
        _dispatch.set_backend("triton")
    dev = torch.device("cuda" if CUDA else "cpu")
    dt = torch.bfloat16 if CUDA else torch.float32
    d, heads = (768, 12) if CUDA else (64, 4)
    torch.manual_seed(0)
    from transformers import BertConfig, BertModel
    base = BertModel(BertConfig(hidden_size=d, num_hidden_layers=2, num_attention_heads=heads,
                                intermediate_size=4 * d, attn_implementation="eager"))
    base = base.to(dev, dt).eval()
    inputs = inputs_for(1, 16, dev)
    patched, modules = copy.deepcopy(base), copy.deepcopy(base)
    fusedops.patch_model(patched)
    fusedops.patch_model(modules, patterns=False)
    h = torch.randn(1, 16, d, device=dev, dtype=dt)
    r = torch.randn(1, 16, d, device=dev, dtype=dt)
    ln = base.encoder.layer[0].output.LayerNorm
    rows = {}
    with torch.no_grad():
        for m in (base, patched, modules):
            m(**inputs)
        rows["whole model (2 layers)"] = [us_per_call(lambda m=m: m(**inputs), 10, 10)
                                          for m in (base, modules, patched)]
        hidden = torch.randn(1, 16, d, device=dev, dtype=dt)
        inter = torch.randn(1, 16, 4 * d, device=dev, dtype=dt)
        ext_mask = torch.zeros(1, 1, 1, 16, device=dev, dtype=dt)

        def piece(model, name):
            layer = model.encoder.layer[0]
            if name == "output":
                return lambda: layer.output(inter, r)
            if name == "self output":
                return lambda: layer.attention.output(h, r)
            return lambda: layer.attention.self(hidden, attention_mask=ext_mask)

        for name in ("self attention", "self output", "output"):
            rows[f"BERT {name} module"] = [us_per_call(piece(m, name))
                                           for m in (base, modules, patched)]
        rows["add + LayerNorm"] = [
            us_per_call(lambda: ln(h + r)),
            us_per_call(lambda: fusedops.fused_layernorm(h, (d,), ln.weight, ln.bias,
                                                         residual=r)),
            us_per_call(lambda: fusedops._fx_patterns.add_layernorm(r, h, ln)),
        ]
        rows["LayerNorm module"] = [us_per_call(lambda: ln(h)), us_per_call(
            lambda: modules.encoder.layer[0].output.LayerNorm(h)), float("nan")]
        scores = torch.randn(1, heads, 16, 16, device=dev, dtype=dt)
        mask = torch.zeros(1, 1, 1, 16, device=dev, dtype=dt)
        rows["scale + mask + softmax"] = [
            us_per_call(lambda: torch.softmax(scores * 0.125 + mask, -1)),
            us_per_call(lambda: fusedops.fused_softmax(scores, -1, scale=0.125, mask=mask)),
            float("nan"),
        ]
    print(f"{'us per call':28s} {'torch':>10s} {'fused API':>10s} {'patched':>10s}")
    print("(model and module rows: unpatched, modules only, patched; add + LayerNorm: torch, "
          "fused_layernorm, the pattern helper)")
    for k, v in rows.items():
        print(f"{k:28s} " + " ".join(f"{x:10.1f}" for x in v))


if __name__ == "__main__":
    main()
