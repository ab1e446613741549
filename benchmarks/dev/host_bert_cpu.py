"""Host time of a patched BERT forward without a GPU: the Triton backend's host code on CPU
tensors with every kernel launch stubbed out (outputs are uninitialised; only the Python and
torch-dispatch time is real). Prints per-forward milliseconds for the unpatched model, the
module swaps only and the full patch (patterns), then the top functions of a cProfile of the
patched forward.

    TRITON_INTERPRET=1 python benchmarks/dev/host_bert_cpu.py [--layers 12] [--profile 30] [--which patched]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import sys
import time

import torch

sys.path.insert(0, "examples")
from bert_before_after import inputs_for  # noqa: E402

import fusedops  # noqa: E402
from fusedops import _dispatch  # noqa: E402
from fusedops.triton import _common  # noqa: E402


def per_forward_ms(model, inputs, n=10, rounds=15):
    """Milliseconds per forward: the fastest of ``rounds`` rounds of ``n`` forwards (the shared
    machine's noise only ever adds time)."""
    best = float("inf")
    with torch.no_grad():
        for _ in range(3):
            model(**inputs)
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(n):
                model(**inputs)
            best = min(best, time.perf_counter() - t0)
    return best / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", type=int, default=30)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--which", choices=("unpatched", "modules only", "patched"),
                    default="patched", help="the model profiled")
    a = ap.parse_args()
    torch.set_num_threads(1)
    # No kernels; launches are still recorded for replay plans, as the real launcher does.
    _common.Launcher.__call__ = (lambda self, grid, args, num_warps:
                                 _common._record(self, grid, args, num_warps))
    _dispatch.set_backend("triton")
    torch.manual_seed(0)
    # BERT-base's 12 layers at a width where the matmuls cost little: the per-layer Python is
    # BERT-base's.
    from transformers import BertConfig, BertModel
    base = BertModel(BertConfig(hidden_size=64, num_hidden_layers=12, num_attention_heads=4,
                                intermediate_size=256, attn_implementation="eager",
                                hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)).eval()
    inputs = inputs_for(a.batch, a.seq, torch.device("cpu"))
    modules = copy.deepcopy(base)
    fusedops.patch_model(modules, patterns=False)
    patched = copy.deepcopy(base)
    fusedops.patch_model(patched)
    models = {"unpatched": base, "modules only": modules, "patched": patched}
    for name, m in models.items():
        print(f"{name:14s} {per_forward_ms(m, inputs):7.2f} ms per forward")
    pr = cProfile.Profile()
    with torch.no_grad():
        pr.enable()
        for _ in range(10):
            models[a.which](**inputs)
        pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(a.profile)


if __name__ == "__main__":
    main()
