"""Deterministic sums of per-program float32 partial rows (dweight/dbias of the norm backwards)."""

from __future__ import annotations

import torch

from fusedops.backends.triton.kernels.layernorm_bwd import sum_partials
from fusedops.backends.triton.runtime.device import cdiv
from fusedops.backends.triton.runtime.launcher import Launcher

launch_sum = Launcher(sum_partials)


def reduce_partials(part: torch.Tensor, need_dw: bool, need_db: bool, out=None,
                     dtypes=None):
    """Sum (2, P, N) float32 partials over P in a fixed order: (dweight, dbias), each a separate
    (N,) tensor (outputs of a custom op must not alias each other) or None, in ``dtypes``
    (weight's, bias's; None: float32); ``out``: two (N,) tensors to write instead."""
    _, P, N = part.shape
    if out is not None:
        dw = out[0] if need_dw else None
        db = out[1] if need_db else None
    else:
        dt_w, dt_b = dtypes or (None, None)
        dw = (torch.empty((N,), dtype=dt_w or torch.float32, device=part.device)
              if need_dw else None)
        db = (torch.empty((N,), dtype=dt_b or torch.float32, device=part.device)
              if need_db else None)
    block_p, block_c = 32, 64
    launch_sum((cdiv(N, block_c), int(need_dw) + int(need_db)), (
        part, dw if need_dw else db, db if need_db else dw, P, N, 0 if need_dw else 1,
        block_p, block_c), 4)
    return dw, db
