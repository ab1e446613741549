"""Developer check (GPU): split-row kernels vs looped kernels, correctness and TB/s.

Host cost per call is measured by `python -m fusedops bench` (host latency table) and
`benchmarks/dev/probe.py`."""

import torch
from triton.testing import do_bench

from fusedops.triton import _common
from fusedops.triton import softmax as tsm

torch.manual_seed(0)
dev = "cuda"
for N in [65537, 100000, 131072, 262144, 1 << 20]:
    for dt in [torch.bfloat16, torch.float32]:
        M = max(1, (1 << 27) // N)
        x = torch.randn(M, N, device=dev, dtype=dt) * 4
        x[0, : N // 2] = -float("inf")
        dy = torch.randn_like(x)
        ref = torch.softmax(x.float(), -1)
        y = tsm.softmax_forward(x, dt)
        e1 = (y.float() - ref).abs().max().item()
        dref = torch._softmax_backward_data(dy.float(), ref, -1, torch.float32)
        dx = tsm.softmax_backward(y, dy, dt)
        e2 = (dx.float() - dref).abs().max().item()
        res = {}
        for mode in ["split", "looped"]:
            _common._split_state["enabled"] = mode == "split"
            f = do_bench(lambda: tsm.softmax_forward(x, dt), warmup=10, rep=40)
            b = do_bench(lambda: tsm.softmax_backward(y, dy, dt), warmup=10, rep=40)
            elt = x.element_size()
            res[mode] = (2 * M * N * elt / f / 1e9, 3 * M * N * elt / b / 1e9)
        _common._split_state["enabled"] = True
        print(f"N={N:8d} {str(dt):15s} err fwd {e1:.1e} bwd {e2:.1e} | split fwd {res['split'][0]:.2f} "
              f"bwd {res['split'][1]:.2f} | looped fwd {res['looped'][0]:.2f} bwd {res['looped'][1]:.2f} TB/s",
              flush=True)
print("blocks_per_sm", tsm._launch_fwd_split.blocks_per_sm, tsm._launch_bwd_split.blocks_per_sm)
