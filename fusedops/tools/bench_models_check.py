"""Correctness in ``python -m fusedops bench-models``: every variant's outputs against the
reference variant's, as the largest relative difference within the dtype's tolerance, or (for
``generate``) the fraction of equal generated tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from fusedops.tools.bench_harness import CHECK_TOL
from fusedops.tools.bench_models_common import DTYPES


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (inf on a shape mismatch, nan on non-finite values)."""
    return _rel_many([out], [ref])


def _rel_many(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> float:
    """The largest |out - ref| over all tensors / the largest |ref| over all tensors."""
    if len(outs) != len(refs) or any(a.shape != b.shape for a, b in zip(outs, refs, strict=True)):
        return math.inf
    diff = scale = 0.0
    for a, b in zip(outs, refs, strict=True):
        if b.numel():
            diff = max(diff, (a.detach().float() - b.detach().float()).abs().max().item())
            scale = max(scale, b.detach().float().abs().max().item())
    if math.isnan(diff):
        return math.nan
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def compare(outputs: list[torch.Tensor], ref: list[torch.Tensor], ref_name: str, mode: str,
            dtype_name: str, new_tokens: int) -> dict:
    """One variant's outputs against the reference variant's: relative differences (output;
    for ``train`` also loss and all gradients), the tolerance of ``dtype_name`` and whether
    they are within it; for ``generate`` the fraction of equal generated tokens."""
    if mode == "generate":
        a, b = outputs[0][:, -new_tokens:], ref[0][:, -new_tokens:]
        match = (a == b).float().mean().item() if a.shape == b.shape else 0.0
        return {"vs": ref_name, "token_match": match, "ok": match == 1.0}
    tol = CHECK_TOL.get(DTYPES[dtype_name], 1e-3)
    d: dict[str, Any] = {"vs": ref_name, "output_rel": _rel(outputs[0], ref[0])}
    if mode == "train":
        d["loss_rel"] = _rel(outputs[1], ref[1])
        d["grad_rel"] = _rel_many(outputs[2:], ref[2:])
    values = [v for k, v in d.items() if k.endswith("_rel")]
    d["max_rel"] = math.nan if any(math.isnan(v) for v in values) else max(values)
    d["tol"] = tol
    d["ok"] = d["max_rel"] <= tol
    return d
