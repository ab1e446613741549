"""Host time per attention-softmax call (``fused_softmax(x, scale=, mask=)``), CUDA: torch's
``softmax(x * scale + mask)`` against fusedops' replayed Python autograd Function and its C++
autograd node (``fusedops._host_ext``), forward + backward (``torch.autograd.grad``) and the
grad-enabled forward alone, alternating over 6 rounds (each the median of 5 x 300 calls).

    OUT=/tmp python benchmarks/dev/masked_softmax_host.py   # writes $OUT/native_probe.json
"""

import json
import os
import statistics
import time

import torch

import fusedops
from fusedops import _replay
from fusedops.backends.triton.runtime import host_ext

OUT = os.environ.get("OUT", "/tmp")


def host_us(fn, calls: int = 300, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    print("host extension available:", host_ext.AVAILABLE)
    res = {}
    for dt, shape in ((torch.float16, (1, 12, 128, 128)), (torch.bfloat16, (8, 12, 128, 128))):
        x = torch.randn(shape, device="cuda", dtype=dt, requires_grad=True)
        m = torch.zeros(shape[0], 1, 1, shape[-1], device="cuda", dtype=dt)
        dy = torch.randn(shape, device="cuda", dtype=dt)

        def fused():
            return fusedops.fused_softmax(x, -1, scale=0.125, mask=m)

        def torch_op():
            return torch.softmax(x * 0.125 + m, -1)

        for _ in range(5):
            torch.autograd.grad(fused(), x, dy)
        run = [r for r in _replay.SOFTMAX_MASKED.values() if r][-1]
        native = run.native  # the C++ node's entry; False switches the runner to Python
        print(shape, "C++ node:", bool(native), fused().grad_fn.name())
        cases = (("torch fwd+bwd", lambda: torch.autograd.grad(torch_op(), x, dy), native),
                 ("python fwd+bwd", lambda: torch.autograd.grad(fused(), x, dy), False),
                 ("c++ fwd+bwd", lambda: torch.autograd.grad(fused(), x, dy), native),
                 ("torch fwd", torch_op, native), ("python fwd", fused, False),
                 ("c++ fwd", fused, native))
        rows: dict = {}
        for _ in range(6):
            for name, fn, use in cases:
                run.native = use
                for _ in range(20):
                    fn()
                rows.setdefault(name, []).append(host_us(fn))
        run.native = native
        key = f"{dt} {shape}"
        res[key] = {k: round(statistics.median(v), 2) for k, v in rows.items()}
        for k, v in res[key].items():
            print(f"{key:40s} {k:16s} {v:8.2f}")
    with open(f"{OUT}/native_probe.json", "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "host_us_median_of_6": res}, f, indent=1)


if __name__ == "__main__":
    main()
