"""One launch each of fusedops' LayerNorm forward (single-block and looped 2048x8) and Inductor's,
at bf16 8192 x 16384, for an Nsight Compute comparison:

    ncu --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats python benchmarks/dev/ncu_ln16k.py
"""

import torch
import torch.nn.functional as F

from fusedops.triton import _common
from fusedops.triton import layernorm as tln

M, N = 8192, 16384
x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
tln.layernorm_forward(x, w, b, 1e-5, x.dtype)
_common.KIND_CAPS["ln_fwd"] = 1
_common._split_state["enabled"] = False
_common.OVERRIDES["ln_fwd"] = {"looped": (2048, 8)}
_common.set_single_block_limit(None)
tln.layernorm_forward(x, w, b, 1e-5, x.dtype)
f = torch.compile(lambda x: F.layer_norm(x, (N,), w, b), dynamic=False)
f(x)
torch.cuda.synchronize()
