"""Where the demo predictor's patched forward spends host time: the GPU preset's model
(bf16, batch 16 x 1024 positions, padded) unpatched and patched, inference. Prints per-forward
issue time (no synchronisation inside the timed loop) and wall time, the synchronising calls
torch's sync debug mode reports, then a cProfile diff: every function whose per-forward call
count differs from the unpatched model's, by cumulative time.

Without CUDA (``--cpu-proxy``, needs ``TRITON_INTERPRET=1``): a narrow model on CPU tensors with
the Triton backend's kernels stubbed out (:func:`host_pieces.stub_kernels`) and CPU tensors
passing the replay runners' CUDA checks, so only Python and torch-dispatch time is real; torch's
CPU ops are cheaper to dispatch than its CUDA ones, and its matmuls really compute.

    python benchmarks/dev/host_profile_predictor.py [--cpu-proxy] [--top 40]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import sys
import time
import warnings
from dataclasses import replace

import torch

import fusedops
from fusedops.models.predictor import Predictor, get_preset

FORWARDS = 50


def inputs(batch: int, length: int, dev: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, length, 6, generator=g).to(dev, dtype)
    mask = torch.ones(batch, length, dtype=torch.bool)
    for b in range(1, batch, 2):
        mask[b, length - length // (b + 1):] = False
    return x, mask.to(dev)


def timed(m, args, cuda: bool) -> tuple[float, float]:
    """(issue, wall) seconds per forward over FORWARDS forwards, best of 5 rounds."""
    best_issue = best_wall = float("inf")
    for _ in range(5):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(FORWARDS):
            m(*args)
        t1 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        best_issue = min(best_issue, (t1 - t0) / FORWARDS)
        best_wall = min(best_wall, (t2 - t0) / FORWARDS)
    return best_issue, best_wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-proxy", action="store_true")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    preset = get_preset("gpu")
    cfg = preset.config
    cuda = not a.cpu_proxy
    if cuda:
        dev, dtype, batch, length = "cuda", torch.bfloat16, preset.batch_size, cfg.max_len
    else:
        sys.path.insert(0, "benchmarks/dev")
        from host_pieces import stub_kernels

        from fusedops import _dispatch

        stub_kernels()
        _dispatch.set_backend("triton")
        # CPU tensors pass the replay runners' CUDA checks (registration and calls), so the
        # host path is the one a GPU takes; nothing launches.
        torch.Tensor.is_cuda = property(lambda self: True)
        torch.set_num_threads(1)
        cfg = replace(cfg, max_len=32, d_model=64, d_ff=128)
        dev, dtype, batch, length = "cpu", torch.float32, 2, 32
    torch.manual_seed(0)
    base = Predictor(cfg).to(dev, dtype).eval()
    patched = copy.deepcopy(base)
    report = fusedops.patch_model(patched)
    print(str(report).splitlines()[0] if str(report) else "")
    args = inputs(batch, length, dev, dtype)
    stats = {}
    with torch.no_grad():
        for name, m in (("unpatched", base), ("patched", patched)):
            for _ in range(10):
                m(*args)
            caught = []
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode(1)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    m(*args)
                torch.cuda.set_sync_debug_mode(0)
            issue, wall = timed(m, args, cuda)
            print(f"{name:10s} issue {issue * 1e6:8.1f} us, wall {wall * 1e6:8.1f} us per "
                  f"forward, {len(caught)} synchronising calls "
                  f"{[str(w.message)[:60] for w in caught]}")
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(FORWARDS):
                m(*args)
            pr.disable()
            if cuda:
                torch.cuda.synchronize()
            stats[name] = pstats.Stats(pr)
    base_calls = {k: v[1] for k, v in stats["unpatched"].stats.items()}
    st = stats["patched"]
    print(f"\npatched: {st.total_calls / FORWARDS:.0f} calls per forward (unpatched "
          f"{stats['unpatched'].total_calls / FORWARDS:.0f}); profiled "
          f"{st.total_tt / FORWARDS * 1e6:.0f} us per forward (unpatched "
          f"{stats['unpatched'].total_tt / FORWARDS * 1e6:.0f})")
    rows = []
    for k, v in st.stats.items():
        n = v[1] / FORWARDS
        if n != base_calls.get(k, 0) / FORWARDS:
            rows.append((v[3] / FORWARDS * 1e6, v[2] / FORWARDS * 1e6, n,
                         base_calls.get(k, 0) / FORWARDS, f"{k[0].split('/')[-1]}:{k[1]}({k[2]})"))
    print(f"{'cum us':>8} {'own us':>8} {'calls':>6} {'was':>6}  function")
    for r in sorted(rows, reverse=True)[:a.top]:
        print(f"{r[0]:8.1f} {r[1]:8.1f} {r[2]:6.1f} {r[3]:6.1f}  {r[4]}")
    print("\nthe same functions by own time")
    for r in sorted(rows, key=lambda r: -r[1])[:a.top]:
        print(f"{r[0]:8.1f} {r[1]:8.1f} {r[2]:6.1f} {r[3]:6.1f}  {r[4]}")


if __name__ == "__main__":
    main()
