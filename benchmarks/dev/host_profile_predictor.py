"""Where the demo predictor's patched forward spends host time: the GPU preset's model (bf16,
inference, padded batches) unpatched, patched without the ops-level masked-softmax replay
(``fusedops._replay.SOFTMAX_MASKED`` lookups always missing) and patched. Per shape: forward
issue time (no synchronisation inside a round of forwards) and wall time, medians over
interleaved rounds (the lent hosts drift), and the synchronising calls torch's sync debug mode
reports; then a cProfile diff at the first shape: every function whose per-forward call count
differs from the unpatched model's, by cumulative and by own time.

Without CUDA (``--cpu-proxy``, needs ``TRITON_INTERPRET=1``): a narrow model on CPU tensors with
the Triton backend's kernels stubbed out (:func:`host_pieces.stub_kernels`) and CPU tensors
passing the replay runners' CUDA checks, so only Python and torch-dispatch time is real; torch's
CPU ops are cheaper to dispatch than its CUDA ones, and its matmuls really compute.

    python benchmarks/dev/host_profile_predictor.py [--shapes 16x1024,1x128] [--cpu-proxy]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import sys
import time
import warnings
from dataclasses import replace

import torch

import fusedops
from fusedops import _replay
from fusedops.models.predictor import Predictor, get_preset

sys.path.insert(0, "benchmarks/dev")
from _profile_diff import print_diff  # noqa: E402

FORWARDS = 20  # per round
ROUNDS = 12


class _Missing(dict):
    """A replay table whose lookups always miss (and which keeps nothing)."""

    def get(self, key, default=None):
        return default

    def __setitem__(self, key, value):
        pass


def inputs(batch: int, length: int, dev: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, length, 6, generator=g).to(dev, dtype)
    mask = torch.ones(batch, length, dtype=torch.bool)
    for b in range(1, batch, 2):
        mask[b, length - length // (b + 1):] = False
    return x, mask.to(dev)


def one_round(m, args, cuda: bool) -> tuple[float, float]:
    """(issue, wall) seconds per forward of FORWARDS back-to-back forwards."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(FORWARDS):
        m(*args)
    t1 = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / FORWARDS, (t2 - t0) / FORWARDS


def variant(name: str, m, real: dict):
    """``m`` as a callable, with the masked-softmax ops replay off for the 'no masked' one."""
    if name != "patched, no masked ops replay":
        return m

    def call(*args):
        _replay.SOFTMAX_MASKED = _Missing()
        try:
            return m(*args)
        finally:
            _replay.SOFTMAX_MASKED = real["table"]
    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-proxy", action="store_true")
    ap.add_argument("--shapes", default=None, help="batch x length, comma separated")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    preset = get_preset("gpu")
    cfg = preset.config
    cuda = not a.cpu_proxy
    if cuda:
        dev, dtype = "cuda", torch.bfloat16
        shapes = a.shapes or f"{preset.batch_size}x{cfg.max_len},1x128"
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
        dev, dtype = "cpu", torch.float32
        shapes = a.shapes or "2x32"
    torch.manual_seed(0)
    base = Predictor(cfg).to(dev, dtype).eval()
    patched = copy.deepcopy(base)
    fusedops.patch_model(patched)
    real = {"table": _replay.SOFTMAX_MASKED}
    models = {name: variant(name, m, real) for name, m in (
        ("unpatched", base), ("patched, no masked ops replay", patched), ("patched", patched))}
    stats = {}
    for si, shape in enumerate(shapes.split(",")):
        batch, length = (int(v) for v in shape.split("x"))
        args = inputs(batch, length, dev, dtype)
        print(f"\nbatch {batch} x {length} positions, {dtype}, {dev}: medians of {ROUNDS} "
              f"interleaved rounds of {FORWARDS} forwards")
        with torch.no_grad():
            for name, m in models.items():
                for _ in range(10):
                    m(*args)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode(1)
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        m(*args)
                    torch.cuda.set_sync_debug_mode(0)
                    if caught:
                        print(f"  {name}: {len(caught)} synchronising calls "
                              f"{[str(w.message)[:60] for w in caught]}")
            times: dict = {name: [] for name in models}
            for r in range(ROUNDS):
                order = list(models) if r % 2 == 0 else list(models)[::-1]
                for name in order:
                    times[name].append(one_round(models[name], args, cuda))
            for name, t in times.items():
                issue = statistics.median(v[0] for v in t)
                wall = statistics.median(v[1] for v in t)
                print(f"  {name:30s} issue {issue * 1e6:8.1f} us, wall {wall * 1e6:8.1f} us "
                      "per forward")
            if si == 0:
                for name in ("unpatched", "patched"):
                    pr = cProfile.Profile()
                    pr.enable()
                    for _ in range(FORWARDS):
                        models[name](*args)
                    pr.disable()
                    if cuda:
                        torch.cuda.synchronize()
                    stats[name] = pstats.Stats(pr)
    print_diff(stats["patched"], stats["unpatched"], FORWARDS, "patched, first shape",
               top=a.top, by_own=True)

if __name__ == "__main__":
    main()
