"""Running a chain once and checking it: the training step of ``fwd_bwd``, the comparison with
the eager chain, ReLU ties and the dropout check (see :mod:`fusedops.tools.bench_chains`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from fusedops.tools.bench_harness import CHECK_TOL, rel_error
from fusedops.tools.chains_model import EPS, get_chain

# How close to 0 (relative to max |layer_norm(x)|) eager's pre-activation may be where the fused
# forward's ReLU took the other side: rounding of a float32 LayerNorm, a little more for half
# types whose eager kernels round differently.
RELU_TIE_TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-4, torch.float16: 1e-4}


def grad_out(inputs: dict, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The fixed upstream gradient of each output of ``inputs`` (made on first use)."""
    if inputs["grad_out"] is None:
        inputs["grad_out"] = tuple(torch.randn(inputs["out_shape"], device=device, dtype=dtype)
                                   for _ in range(inputs["n_out"]))
    return inputs["grad_out"]


def as_tuple(out) -> tuple[torch.Tensor, ...]:
    """A chain's output(s) as a tuple."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class Step:
    """Forward + ``torch.autograd.grad`` of every output with the fixed upstream gradients."""

    def __init__(self, fn: Callable, inputs: dict, device: str, dtype: torch.dtype):
        args = list(inputs["args"])
        self.leaves = []
        for i in inputs["grad_idx"]:
            args[i] = args[i].detach().requires_grad_(True)
            self.leaves.append(args[i])
        self.args = tuple(args)
        self.fn = fn
        self.grad_out = grad_out(inputs, device, dtype)

    def __call__(self):
        outs = as_tuple(self.fn(*self.args))
        grads = torch.autograd.grad(outs, self.leaves, self.grad_out)
        return outs, grads


def run_mode(fn: Callable, inputs: dict, mode: str, device: str, dtype: torch.dtype):
    """One call of ``fn`` in ``mode``: (outputs, gradients) -- gradients empty in fwd."""
    if mode == "fwd":
        with torch.no_grad():
            return as_tuple(fn(*inputs["args"])), ()
    with torch.enable_grad():
        outs, grads = Step(fn, inputs, device, dtype)()
    return tuple(o.detach() for o in outs), tuple(grads)


def compare(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> tuple[float, float]:
    """(max abs error, max relative error) over tensors; relative = abs error / max |ref| of
    each tensor (:func:`fusedops.tools.bench_harness.rel_error`); inf on a shape mismatch."""
    worst_abs = worst_rel = 0.0
    if len(got) != len(ref):
        return math.inf, math.inf
    for a, b in zip(got, ref, strict=True):
        if a.shape != b.shape:
            return math.inf, math.inf
        d = (a.detach().float() - b.detach().float()).abs().max().item() if b.numel() else 0.0
        r = rel_error(a, b)
        worst_abs = worse(worst_abs, d)
        worst_rel = worse(worst_rel, r)
    return worst_abs, worst_rel


def relu_tie_reference(chain: str, inputs: dict, fused_out: torch.Tensor, device: str,
                       dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], int, float]:
    """The eager ReLU chain at p = 0 with ReLU replaced by the fused forward's own keep pattern
    (``fused_out > 0``, a constant): ``(outputs + gradients, ties, worst)``. ``ties`` counts the
    elements where that pattern differs from eager's ``layer_norm(x) > 0``; ``worst`` is the
    largest ``|layer_norm(x)|`` among them over ``max |layer_norm(x)|`` -- a tie is only
    legitimate within rounding of 0 (a wrongly masked element anywhere else makes ``worst``
    large). Shapes as :func:`make_inputs`; ``fused_out`` is x's shape and dtype."""
    c = get_chain(chain)
    if c.activation != "relu" or c.residual:
        raise ValueError(f"relu_tie_reference: chain {chain!r} is not a LayerNorm + ReLU chain")
    keep = fused_out.detach() > 0

    def kept(x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b, EPS) * keep

    outs, grads = run_mode(kept, inputs, "fwd_bwd", device, dtype)
    with torch.no_grad():
        x, w, b = inputs["args"]
        y = F.layer_norm(x, (x.shape[-1],), w, b, EPS)
        tied = keep != (y > 0)
        ties = int(tied.sum())
        worst = (float(y[tied].float().abs().max() / y.float().abs().max().clamp_min(1e-30))
                 if ties else 0.0)
    return outs + grads, ties, worst


def worse(a: float, b: float) -> float:
    """The larger of two errors, nan (a non-finite output) winning."""
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return max(a, b)


def dropout_check(chain: str, inputs: dict, out: torch.Tensor, p: float) -> dict[str, Any]:
    """Check a fused forward output taken with dropout ``p``: each element is either 0 (dropped)
    or ``act(layer_norm(s) / (1 - p))`` computed in float32 (kept); ``drop_frac`` is the share
    of dropped elements among those whose kept value is not 0 (expected ``p``), ``max_abs_err`` /
    ``max_rel_err`` the error of the kept ones."""
    c = get_chain(chain)
    args = inputs["args"]
    if c.residual:
        x, r, w, b = args
        s = x + r
    else:
        s, w, b = args
    v = F.layer_norm(s.float(), (s.shape[-1],), w.float(), b.float(), EPS) / (1.0 - p)
    ref = torch.relu(v) if c.activation == "relu" else F.gelu(v)
    out = out.detach().float()
    nz = ref != 0
    dropped = (out == 0) & nz
    n = int(nz.sum())
    frac = float(dropped.sum()) / max(n, 1)
    kept = ~dropped
    err = (out - ref).abs()[kept]
    max_abs = float(err.max()) if err.numel() else 0.0
    max_rel = max_abs / max(float(ref.abs().max()), 1e-12)
    # the dropped share is binomial: allow 6 standard deviations (and at least 0.005)
    slack = max(0.005, 6 * math.sqrt(p * (1 - p) / max(n, 1)))
    tol = CHECK_TOL.get(args[0].dtype, 1e-3)
    return {"p": p, "elements": n, "drop_frac": frac, "drop_frac_ok": abs(frac - p) <= slack,
            "max_abs_err": max_abs, "max_rel_err": max_rel,
            "ok": abs(frac - p) <= slack and max_rel <= tol}
