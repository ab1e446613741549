"""Loading a model to profile and calling it: ``MODULE:FACTORY`` targets, inputs of any nesting
(used by ``python -m fusedops profile`` and the demo)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def load_target(spec: str) -> tuple[nn.Module, Any]:
    """Import ``MODULE:FACTORY`` and call the factory; returns ``(model, example_inputs)``.

    ``MODULE`` is a dotted module name or a path to a ``.py`` file.
    """
    if ":" not in spec:
        raise ValueError(f"expected MODULE:FACTORY, got {spec!r}")
    module_name, _, attr = spec.rpartition(":")
    if module_name.endswith(".py") or os.path.sep in module_name:
        path = os.path.abspath(module_name)
        if not os.path.exists(path):
            raise FileNotFoundError(path)
        name = "_fusedops_user_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        spec_obj = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec_obj)
        sys.modules[name] = module
        spec_obj.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(module_name)
    factory = getattr(module, attr, None)
    if factory is None:
        raise AttributeError(f"{module_name} has no attribute {attr!r}")
    result = factory() if callable(factory) else factory
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise TypeError(f"{spec} must return (model, example_inputs)")
    return result


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for a dict, ``model(*inputs)`` for a tuple/list, else ``model(x)``."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def move_inputs(inputs: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> Any:
    """Move every tensor in a nested tuple/list/dict to ``device``; floating tensors also to
    ``dtype`` when given."""
    if isinstance(inputs, torch.Tensor):
        if dtype is not None and inputs.is_floating_point():
            return inputs.to(device=device, dtype=dtype)
        return inputs.to(device)
    if isinstance(inputs, Mapping):
        return {k: move_inputs(v, device, dtype) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(move_inputs(v, device, dtype) for v in inputs)
    return inputs


def model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")
