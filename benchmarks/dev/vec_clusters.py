"""Developer probe (GPU): which launcher (clusters or the cooperative fallback) and grid the
unaligned rows' cluster variants of tune round 53 actually ran, with their TB/s.

    PYTHONPATH=$PWD python benchmarks/dev/vec_clusters.py

Needs commit 053debf (VEC_CLUSTER_BWD, removed after this probe; output in
benchmarks/results/tune-h200-2026-11-25/vec_clusters.txt).
"""

import torch
from triton.testing import do_bench

from fusedops.triton import _clusters, _common
from fusedops.triton import layernorm as tln

N = 65537
for dt, elt, cfgs in ((torch.bfloat16, 2, ((4096, 16, 1, None), (4096, 8, 1, 128),
                                           (8192, 16, 1, 128))),
                      (torch.float32, 4, ((4096, 8, 1, None), (8192, 8, 1, None)))):
    M = (1 << 27) // N
    x = torch.randn(M, N, device="cuda", dtype=dt)
    dy = torch.randn_like(x)
    w = torch.randn(N, device="cuda", dtype=dt)
    _, mean, rstd = tln.layernorm_forward(x, w, w, 1e-5, dt)
    for cfg in cfgs:
        tln.VEC_CLUSTER_BWD = {elt: ((*cfg, True), 0)}
        _common.set_single_block_limit(_common.single_block_limit())
        _clusters._state["enabled"] = True
        with _common.record_launches() as rec:
            tln.layernorm_backward(dy, x, w, mean, rstd, True, True, True)
        used = [(type(r[0]).__name__, r[0].kernel.__name__, r[1]) for r in rec]
        ms = do_bench(lambda: tln.layernorm_backward(dy, x, w, mean, rstd, True, True, True),
                      warmup=10, rep=50, return_mode="median")
        print(dt, cfg, f"{3 * M * N * elt / ms / 1e9:.2f} TB/s", used, "clusters on:",
              _clusters._state["enabled"], flush=True)
