"""Hand-written norm modules recognised by what they compute.

A module is a *candidate* when it looks like a norm: no children, a 1-D floating ``weight``
(and optionally a ``bias`` of the same size) as its only parameters, no buffers, an eps
attribute (:data:`EPS_ATTRS`) and a forward that takes one tensor. It is *recognised* when its
forward, run on a copy with random parameters, equals one of the formulas below over the last
dim on probe inputs in float64 arithmetic (float32 probes, relative error below 1e-4), one
probe with rows small enough that eps matters:

* ``rmsnorm``: ``x / sqrt(mean(x^2) + eps) * weight`` (Llama, Mistral, Qwen, T5, ...);
* ``rmsnorm`` with ``1 + weight`` (Gemma);
* ``layernorm``: ``(x - mean) / sqrt(var + eps) * weight (+ bias)``.

The dtype the original returns for each (input dtype, weight dtype) is read from the same copy
in float32/float16/bfloat16, so the fused module returns what the original did (a Llama norm
with float32 weights returns float32 for a bfloat16 input). Nothing is recognised by name.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from fusedops.patching.swaps import NormSpec

EPS_ATTRS = ("variance_epsilon", "eps", "epsilon", "rms_norm_eps", "layer_norm_eps", "norm_eps")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TOL = 1e-4


def looks_like_norm(module: nn.Module) -> bool:
    """Whether the report should account for ``module`` as a norm-like module."""
    w = module._parameters.get("weight")
    return "norm" in type(module).__name__.lower() or (
        isinstance(w, torch.Tensor) and w.dim() == 1 and _eps_attr(module) is not None)


def _eps_attr(module: nn.Module) -> str | None:
    for name in EPS_ATTRS:
        v = module.__dict__.get(name)
        if v.__class__ in (float, int) and v >= 0:
            return name
    return None


def candidate(module: nn.Module) -> tuple[str | None, str | None]:
    """(eps attribute, or "" where eps is a constant of its code, None) for a candidate, else
    (None, why it is not one)."""
    params = module._parameters
    w, b = params.get("weight"), params.get("bias")
    if module._modules:
        return None, "has child modules"
    if set(params) - {"weight", "bias"}:
        return None, f"has parameters other than weight/bias ({', '.join(sorted(params))})"
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or not w.is_floating_point():
        return None, "has no 1-D floating-point weight"
    if b is not None and (b.shape != w.shape or not b.is_floating_point()):
        return None, "its bias is not a floating-point vector like its weight"
    if any(buf is not None for buf in module._buffers.values()):
        return None, "has buffers"
    if "forward" in module.__dict__:
        return None, "has an instance-level forward"
    try:
        params_ = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None, "forward has no readable signature"
    required = [p for p in params_ if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) != 1:
        return None, "forward does not take exactly one tensor"
    return _eps_attr(module) or "", None


def _copy(module: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """A shallow copy of ``module`` holding other parameters (the original is not touched)."""
    clone = type(module).__new__(type(module))
    clone.__dict__.update(module.__dict__)
    clone.__dict__["_parameters"] = {"weight": weight, **({} if bias is None else
                                                        {"bias": bias})}
    return clone


def _formulas(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float) -> dict:
    """The candidate results in float64."""
    rms = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    out = {("rmsnorm", False): rms * w, ("rmsnorm", True): rms * (1.0 + w)}
    ln = torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, eps)
    out[("layernorm", False)] = ln
    return out


def _probes(n: int, eps: float, gen: torch.Generator) -> list[torch.Tensor]:
    x = torch.randn(3, 4, n, generator=gen) * torch.tensor([0.5, 1.0, 3.0])[:, None, None]
    x[0, 0] += 2.0  # a row far from zero mean
    probes = [x]
    if eps > 0:
        probes.append(torch.randn(2, n, generator=gen) * math.sqrt(eps) * 0.7)
    return probes


def recognise(module: nn.Module, eps_attr: str) -> tuple[NormSpec | None, str]:
    """(spec, "") when ``module`` (a candidate) computes one of the formulas, else
    (None, why). ``eps_attr`` "": eps is read off the forward's results (a constant in its
    code), then checked like the formulas."""
    weight, bias = module._parameters["weight"], module._parameters.get("bias")
    n = weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=gen) * 0.5 + 1.0
    b = None if bias is None else torch.randn(n, generator=gen)
    clone = _copy(module, w, b)
    forward = type(module).forward
    try:
        eps = float(getattr(module, eps_attr)) if eps_attr else _read_eps(forward, clone, n, gen)
        if eps is None:
            return None, "no eps attribute, and no eps reads off its results"
        matches = None
        for x in _probes(n, eps, gen):
            with torch.no_grad():
                out = forward(clone, x)
            if not isinstance(out, torch.Tensor) or out.shape != x.shape:
                return None, "forward does not return a tensor of its input's shape"
            got = out.double()
            want = _formulas(x.double(), w.double(), None if b is None else b.double(), eps)
            ok = {k for k, v in want.items()
                  if (got - v).abs().max() <= _TOL * (v.abs().max() + 1e-6)}
            matches = ok if matches is None else matches & ok
    except Exception as exc:  # noqa: BLE001 - a probe that fails proves nothing
        return None, f"forward failed on a probe input ({type(exc).__name__})"
    if bias is not None:
        matches = {k for k in matches or () if k[0] == "layernorm"}
    if not matches:
        return None, "forward computes none of RMSNorm / LayerNorm over the last dim"
    op, offset = sorted(matches)[0]
    table = _dtype_table(module, n, b is not None)
    if not table:
        return None, "forward fails in float32/float16/bfloat16"
    return NormSpec(op, eps_attr, offset, b is not None, table,
                    None if eps_attr else eps), ""


def _read_eps(forward, clone: nn.Module, n: int, gen: torch.Generator) -> float | None:
    """eps of a norm whose forward holds it as a constant: rows of a mean square (or variance)
    far below any eps used in practice give ``out / (x * w) = 1 / sqrt(ms + eps)`` (RMSNorm) or
    the same for ``x - mean`` (LayerNorm); both read the same eps where ms is negligible."""
    x = torch.randn(4, n, generator=gen, dtype=torch.float32) * 1e-9
    w = clone._parameters["weight"]
    b = clone._parameters.get("bias")
    with torch.no_grad():
        out = forward(clone, x).double()
    if b is not None:
        out = out - b.double()
    xd = x.double()
    for centred in (xd, xd - xd.mean(-1, keepdim=True)):
        ratio = (out / (centred * w.double())).median().item()
        if ratio > 0 and math.isfinite(ratio):
            eps = 1.0 / ratio**2 - centred.square().mean().item()
            if 1e-30 < eps < 1.0:
                return float(f"{eps:.3g}")
    return None


def _dtype_table(module: nn.Module, n: int, with_bias: bool) -> dict:
    """(input dtype, weight dtype, None) -> the dtype the original forward returns."""
    table = {}
    forward = type(module).forward
    for wd in _DTYPES:
        clone = _copy(module, torch.ones(n, dtype=wd), torch.zeros(n, dtype=wd)
                      if with_bias else None)
        for xd in _DTYPES:
            try:
                with torch.no_grad():
                    out = forward(clone, torch.ones(2, n, dtype=xd))
            except Exception:  # noqa: BLE001 - that combination stays unfused
                continue
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                table[(xd, wd, None)] = out.dtype
    return table
