"""The variants of one model that ``python -m fusedops bench-models`` compares: deep copies of one
prototype, patched with ``fusedops.patch_model`` and/or compiled, reloaded with the prototype's
weights before every shape, and unpatched once their mode is done."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusedops.tools.bench_models_common import Options, short_error

LR = 1e-4  # the SGD step of the train mode


@dataclass
class Variant:
    """One variant's own copy of the model (and its optimizer in ``train`` mode)."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    error: str | None = None


def patch_model_fn() -> Callable[..., Any]:
    """``fusedops.patch_model``, looked up at each call: the one place to substitute it."""
    import fusedops

    return fusedops.patch_model


def apply_patch(model: nn.Module, opts: Options) -> dict:
    """``patch_model`` on ``model``; returns what it did (counts, time, ``applied``)."""
    kwargs = {"force": True} if opts.force_patch and opts.patch_accepts_force else {}
    t0 = time.perf_counter()
    report = patch_model_fn()(model, **kwargs)
    seconds = time.perf_counter() - t0
    replaced = list(getattr(report, "replaced", []) or [])
    patterns = list(getattr(report, "fused_patterns", []) or [])
    return {
        "seconds": seconds,
        "applied": getattr(report, "applied", None),
        "forced": bool(kwargs),
        "replaced": len(replaced),
        "fused_types": _counts(r.get("fused_type") for r in replaced),
        "fused_patterns": len(patterns),
        "patterns": _counts(f"{r.get('pattern')} ({r.get('via')})" for r in patterns),
        "skipped": len(getattr(report, "skipped", []) or []),
        "pattern_skipped": len(getattr(report, "pattern_skipped", []) or []),
    }


def _counts(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[str(item)] = out.get(str(item), 0) + 1
    return out


def same_weights(models: Sequence[nn.Module]) -> bool:
    """True when every model's parameters equal the first model's."""
    first = [p.detach() for p in models[0].parameters()]
    for model in models[1:]:
        params = [p.detach() for p in model.parameters()]
        if len(params) != len(first) or not all(
                torch.equal(a, b) for a, b in zip(first, params, strict=True)):
            return False
    return True


def make_variants(proto: nn.Module, mode: str, opts: Options) -> tuple[list[Variant], dict]:
    """One deep copy of ``proto`` per variant, patched and/or compiled (``nn.Module.compile``,
    in place, so ``generate``'s own ``self(...)`` calls run compiled). Returns the variants and
    ``{"patch": {variant: what patch_model did}}``."""
    variants, patch = [], {}
    for name in opts.variants:
        v = Variant(name, copy.deepcopy(proto))
        try:
            if "patched" in name:
                patch[name] = apply_patch(v.model, opts)
            if name.startswith("compiled"):
                v.model.compile(backend=opts.compile_backend,
                                dynamic=None if mode == "generate" else False)
        except Exception as exc:
            v.error = short_error(exc)
        if mode == "train":
            v.model.train()
            v.optimizer = torch.optim.SGD(v.model.parameters(), lr=LR)
        variants.append(v)
    return variants, {"patch": patch}


def reset_weights(variants: Sequence[Variant], proto: nn.Module) -> bool:
    """Load ``proto``'s parameters and buffers into every variant (in place, so compiled graphs
    and optimizers keep theirs): training steps of an earlier shape moved each copy's weights
    differently (dropout draws differ). True when every variant now equals ``proto``."""
    state = proto.state_dict()
    for v in variants:
        v.model.load_state_dict(state)
    return same_weights([proto, *(v.model for v in variants)])


def unpatch_variants(variants: Sequence[Variant]) -> dict[str, bool]:
    """``unpatch_model`` on the patched copies; True where every module class (and the attention
    implementation) is back to the unpatched copy's."""
    import fusedops

    plain = next((v.model for v in variants if "patched" not in v.name), None)
    out = {}
    for v in variants:
        if "patched" not in v.name:
            continue
        fusedops.unpatch_model(v.model)
        if plain is None:
            out[v.name] = not getattr(fusedops.patching, "is_patched", lambda m: False)(v.model)
            continue
        same_types = [type(m) for m in v.model.modules()] == [type(m) for m in plain.modules()]
        same_attn = (getattr(v.model.config, "_attn_implementation", None)
                     == getattr(plain.config, "_attn_implementation", None))
        out[v.name] = same_types and same_attn
    return out
