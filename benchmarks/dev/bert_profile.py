"""Patched BERT-base (eager attention, bf16) inference at two batch sizes (CUDA only): per
forward, the host issue time (no sync) and the wall time (synchronised), and the CUDA kernels
of one forward (torch.profiler): where a batch's time goes.

    python benchmarks/dev/bert_profile.py
"""

from __future__ import annotations

import sys
import time

import torch

sys.path.insert(0, "examples")
from bert_before_after import build, inputs_for  # noqa: E402

import fusedops  # noqa: E402


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = build(False, 512, dropout=0.1).to(dev, torch.bfloat16).eval()
    # As examples/bert_before_after.py: verified on batch-32 inputs.
    print(fusedops.patch_model(model, example_inputs=inputs_for(32, 512, dev)).fused_patterns)
    for batch in (32, 64):
        inputs = inputs_for(batch, 512, dev)
        with torch.no_grad():
            for _ in range(5):
                model(**inputs)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                model(**inputs)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            print(f"batch {batch}: issue {(t1 - t0) / 10 * 1e3:.2f} ms, wall "
                  f"{(t2 - t0) / 10 * 1e3:.2f} ms per forward")
            with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                model(**inputs)
                torch.cuda.synchronize()
        rows = [(e.device_time_total, e.count, e.key[:70]) for e in prof.key_averages()
                if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(r[0] for r in rows)
        print(f"  kernels {total / 1e3:.2f} ms")
        for t, c, k in sorted(rows, reverse=True)[:8]:
            print(f"    {t / 1e3:7.3f} ms {c:4d} x  {k}")


if __name__ == "__main__":
    main()
