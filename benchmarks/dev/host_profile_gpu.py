"""Where a patched small-batch BERT forward's host time goes (CUDA only): a 2-layer BERT-base-wide
model at batch 1 x 16 tokens (bf16, every kernel a few µs, so the host's issue rate is the
forward's time). For unpatched, module swaps only and the full patch: synchronising calls
(torch's sync debug mode), per-forward issue and wall time, then a cProfile of 50 forwards of
each patched variant listing the functions whose per-forward call counts differ from the
unpatched model's, by cumulative time.

    python benchmarks/dev/host_profile_gpu.py
"""

from __future__ import annotations

import copy
import cProfile
import pstats
import sys
import time
import warnings

import torch

sys.path.insert(0, "examples")
sys.path.insert(0, "benchmarks/dev")
from _profile_diff import print_diff  # noqa: E402
from bert_before_after import inputs_for  # noqa: E402

import fusedops  # noqa: E402


def main() -> None:
    from transformers import BertConfig, BertModel

    dev = torch.device("cuda")
    torch.manual_seed(0)
    base = BertModel(BertConfig(hidden_size=768, num_hidden_layers=2, num_attention_heads=12,
                                intermediate_size=3072, attn_implementation="eager"))
    base = base.to(dev, torch.bfloat16).eval()
    modules, patched = copy.deepcopy(base), copy.deepcopy(base)
    fusedops.patch_model(modules, patterns=False)
    fusedops.patch_model(patched)
    inputs = inputs_for(1, 16, dev)
    models = {"unpatched": base, "modules only": modules, "patched": patched}
    stats = {}
    with torch.no_grad():
        for name, m in models.items():
            for _ in range(10):
                m(**inputs)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode(1)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                m(**inputs)
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                m(**inputs)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            print(f"{name:13s} issue {(t1 - t0) / 50 * 1e6:8.1f} us, wall "
                  f"{(t2 - t0) / 50 * 1e6:8.1f} us per forward, "
                  f"{len(caught)} synchronising calls {[str(w.message)[:60] for w in caught]}")
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(50):
                m(**inputs)
            pr.disable()
            stats[name] = pstats.Stats(pr)
    for name, st in stats.items():
        print(f"\n{name}: cumulative us per forward of the model's and fusedops' functions")
        rows = sorted(((v[3] / 50 * 1e6, v[1] / 50, f"{k[0].split('/')[-1]}:{k[1]}({k[2]})")
                       for k, v in st.stats.items()
                       if "transformers" in k[0] or "fusedops" in k[0] or "<eval" in k[0]),
                      reverse=True)
        for cum, n, fn in rows[:28]:
            print(f"{cum:8.1f} {n:6.1f}  {fn}")
    for name in ("modules only", "patched"):
        print_diff(stats[name], stats["unpatched"], 50, name)


if __name__ == "__main__":
    main()
