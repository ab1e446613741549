"""The verification pass of patch_model: one forward before and after, outputs compared."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn


def call(model: nn.Module, example_inputs: Any) -> Any:
    if isinstance(example_inputs, Mapping):
        return model(**example_inputs)
    if isinstance(example_inputs, tuple | list):
        return model(*example_inputs)
    return model(example_inputs)


def flatten(obj: Any, prefix: str = "output", depth: int = 0) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every tensor in nested tuples/lists/dicts/dataclasses/HF outputs and
    iterable containers such as HF caches."""
    if depth > 32 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):  # dicts and HF ModelOutput
        for k, v in obj.items():
            yield from flatten(v, f"{prefix}.{k}" if depth else str(k), depth + 1)
    elif isinstance(obj, tuple | list):
        for i, v in enumerate(obj):
            yield from flatten(v, f"{prefix}[{i}]", depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from flatten(getattr(obj, f.name), f"{prefix}.{f.name}", depth + 1)
    elif hasattr(obj, "__iter__") and not isinstance(obj, str | bytes | nn.Module):
        try:
            items = list(obj)
        except Exception:  # noqa: BLE001 - not every __iter__ is a container
            return
        for i, v in enumerate(items):
            yield from flatten(v, f"{prefix}[{i}]", depth + 1)


def compare(ref: Any, out: Any) -> list[dict]:
    ref_items = dict(flatten(ref))
    rows = []
    for name, o in flatten(out):
        r = ref_items.get(name)
        row = {"name": name, "shape": list(o.shape), "dtype": str(o.dtype).replace("torch.", "")}
        if r is None or r.shape != o.shape:
            row.update(max_abs_diff=math.inf, max_rel_diff=math.inf)
            rows.append(row)
            continue
        if o.numel() == 0:
            row.update(max_abs_diff=0.0, max_rel_diff=0.0)
            rows.append(row)
            continue
        a = o.detach().to("cpu", torch.float64) if not o.is_complex() else o.detach().cpu()
        b = r.detach().to("cpu", a.dtype)
        diff = (a - b).abs()
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))  # equal infs / NaN positions
        diff = torch.where(same, torch.zeros_like(diff), diff)
        diff = torch.nan_to_num(diff, nan=math.inf)
        max_abs = float(diff.max())
        scale = float(torch.nan_to_num(b.abs(), nan=0.0, posinf=0.0).max())
        row["max_abs_diff"] = max_abs
        row["max_rel_diff"] = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
        rows.append(row)
    return rows


def first_float_tensor(*objs: Any) -> torch.Tensor | None:
    for obj in objs:
        for _, t in flatten(obj):
            if t.is_floating_point():
                return t
    return None


@contextlib.contextmanager
def eval_no_grad(model: nn.Module) -> Iterator[None]:
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in flags:
            m.training = training


def _fork_rng_devices() -> list[int]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return list(range(torch.cuda.device_count()))
    return []


def run_once(model: nn.Module, example_inputs: Any) -> Any:
    """One forward from the same RNG state every time (eval mode is set by the caller)."""
    with torch.random.fork_rng(devices=_fork_rng_devices()):
        torch.manual_seed(0)
        return call(model, example_inputs)
