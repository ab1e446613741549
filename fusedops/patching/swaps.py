"""Module-level patching: an instance's ``__class__`` swapped to a fused class that overrides
only ``forward``.

* ``nn.LayerNorm`` / ``nn.RMSNorm`` / ``nn.Softmax`` and their subclasses that keep torch's
  forward become :class:`~fusedops.FusedLayerNorm` / :class:`~fusedops.FusedRMSNorm` /
  :class:`~fusedops.FusedSoftmax` (a user subclass ``S``: a cached ``FusedS(fused class, S)``).
* Hand-written norm modules that :mod:`fusedops.patching.norms` proves equal to an RMSNorm or a
  LayerNorm become ``FusedS(_RecognisedNorm, S)``, whose forward calls the fused op with the
  instance's own weight, bias and eps (read per call) and casts the result to the dtype the
  original forward returns.

Parameters, buffers, hooks and state_dict keys are untouched because the instance is, and
``isinstance(m, S)`` still holds. Dynamic classes live in this module under importable names,
so patched models pickle, deep-copy and load in a fresh process (:func:`__getattr__` rebuilds
them by name).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fusedops import _dispatch
from fusedops.modules import MISSING, FusedLayerNorm, FusedRMSNorm, FusedSoftmax
from fusedops.ops.layernorm import fused_layernorm
from fusedops.ops.rmsnorm import fused_rmsnorm

FUSED_CLASSES = (FusedLayerNorm, FusedRMSNorm, FusedSoftmax)
NORM_ATTR = "_fusedops_norm"  # a recognised norm's NormSpec, in the instance's __dict__
_any_autocast = _dispatch._any_autocast


class _PatchedFusedLayerNorm(FusedLayerNorm):
    """What an ``nn.LayerNorm`` becomes under patch_model (shows as FusedLayerNorm)."""


class _PatchedFusedRMSNorm(FusedRMSNorm):
    """What an ``nn.RMSNorm`` becomes under patch_model (shows as FusedRMSNorm)."""


class _PatchedFusedSoftmax(FusedSoftmax):
    """What an ``nn.Softmax`` becomes under patch_model (shows as FusedSoftmax)."""


_stack_depth = torch._C._len_torch_function_stack


class LeanDropout(nn.Dropout):
    """What an ``nn.Dropout`` becomes under patch_model: in eval mode its call returns the
    input itself, which is what ``F.dropout`` returns there, without that call (about 1.7 µs of
    host time per module call on a CPU, where a host-bound forward has one or two per layer).
    Training mode, tensor subclasses and active torch function modes take ``F.dropout``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.training or input.__class__ is not torch.Tensor or _stack_depth() \
                or not 0.0 <= self.p <= 1.0:
            return F.dropout(input, self.p, self.training, self.inplace)
        return input


# repr() uses the class __name__; pickling uses __qualname__, which stays importable.
_PatchedFusedLayerNorm.__name__ = "FusedLayerNorm"
_PatchedFusedSoftmax.__name__ = "FusedSoftmax"
_PatchedFusedRMSNorm.__name__ = "FusedRMSNorm"

# torch base class -> (swapped-in class, op name)
BASES: dict[type[nn.Module], tuple[type[nn.Module], str]] = {
    nn.LayerNorm: (_PatchedFusedLayerNorm, "layernorm"),
    nn.Softmax: (_PatchedFusedSoftmax, "softmax"),
    nn.RMSNorm: (_PatchedFusedRMSNorm, "rmsnorm"),
}


class NormSpec:
    """How a recognised norm computes: ``op`` ("rmsnorm" or "layernorm"), the attribute holding
    eps, whether the weight is used as ``1 + weight`` and the output dtype per (input dtype,
    weight dtype) that the original forward returns."""

    __slots__ = ("op", "eps_attr", "offset", "has_bias", "out_dtypes", "eps")

    def __init__(self, op: str, eps_attr: str, offset: bool, has_bias: bool,
                 out_dtypes: dict[tuple, torch.dtype], eps: float | None = None) -> None:
        self.op, self.eps_attr, self.offset = op, eps_attr, offset
        self.has_bias, self.out_dtypes = has_bias, out_dtypes
        self.eps = eps  # the constant of the forward's code, where no attribute holds eps

    def __getstate__(self) -> tuple:
        return (self.op, self.eps_attr, self.offset, self.has_bias, self.out_dtypes, self.eps)

    def __setstate__(self, state: tuple) -> None:
        self.op, self.eps_attr, self.offset, self.has_bias, self.out_dtypes, self.eps = state

    def eps_of(self, module: nn.Module) -> float:
        return self.eps if self.eps is not None else getattr(module, self.eps_attr)

    def describe(self, module: nn.Module) -> str:
        w = "(1 + weight)" if self.offset else "weight"
        where = f"self.{self.eps_attr}=" if self.eps is None else "constant "
        return (f"{self.op}: {w}{', bias' if self.has_bias else ''}, "
                f"eps={where}{self.eps_of(module):g}")


class _RecognisedNorm:
    """Mixin of a recognised norm's fused class: ``forward`` runs the fused op."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        spec = self.__dict__[NORM_ATTR]
        weight = self._parameters.get("weight", MISSING)  # (fusedops.modules.MISSING)
        if weight is MISSING or weight is None:
            weight = self.weight
        n = weight.shape[0]
        if args or kwargs or hidden_states.dim() == 0 or hidden_states.shape[-1] != n:
            # Whatever the original does with that (the probe covered one tensor argument).
            return super().forward(hidden_states, *args, **kwargs)
        cast = None
        if _any_autocast():
            device = "cuda" if hidden_states.is_cuda else hidden_states.device.type
            if torch.is_autocast_enabled(device):
                cast = torch.get_autocast_dtype(device)
        key = (hidden_states.dtype, weight.dtype, cast)
        out_dtype = spec.out_dtypes.get(key)
        if out_dtype is None:
            # A dtype combination (or autocast state) the probe did not see: the original's
            # result dtype on one row, once (an unknown dtype: the original runs).
            if torch.compiler.is_compiling() or not hidden_states.is_floating_point():
                return super().forward(hidden_states)
            with torch.no_grad():
                row = super().forward(hidden_states.detach().reshape(-1, n)[:1])
            out_dtype = spec.out_dtypes[key] = row.dtype
        eps = spec.eps
        if eps is None:
            eps = getattr(self, spec.eps_attr)
        if spec.offset:
            weight = weight.float() + 1.0
        if spec.op == "rmsnorm":
            y = fused_rmsnorm(hidden_states, n, weight, eps)
        else:
            y = fused_layernorm(hidden_states, n, weight, self.bias if spec.has_bias else None,
                                eps)
        return y if y.dtype == out_dtype else y.to(out_dtype)


_DYNAMIC_PREFIX = "_fused_subclass_"
_RECOGNISED_PREFIX = "_fused_norm_"
_cache: dict[tuple[str, type], type] = {}


def torch_base(cls: type) -> type[nn.Module] | None:
    """The torch norm/softmax class ``cls`` derives from, or None."""
    for base in BASES:
        if issubclass(cls, base):
            return base
    return None


def _encode(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}".encode().hex()


def _dynamic(kind: str, mixin: type, cls: type) -> type:
    key = (kind, cls)
    new = _cache.get(key)
    if new is None:
        qualname = kind + _encode(cls)
        new = type(f"Fused{cls.__name__}", (mixin, cls), {
            "__module__": __name__,
            "__qualname__": qualname,
            "__doc__": f"{cls.__qualname__} with the fused forward "
                       "(created by fusedops.patch_model).",
        })
        _cache[key] = new
        globals()[qualname] = new
    return new


def fused_class_for(cls: type[nn.Module]) -> type[nn.Module]:
    """The class to swap in for an instance of ``cls`` (a torch norm/softmax class or a
    subclass of one that keeps its forward)."""
    base = torch_base(cls)
    fused, _ = BASES[base]
    return fused if cls is base else _dynamic(_DYNAMIC_PREFIX, fused, cls)


def recognised_class_for(cls: type[nn.Module]) -> type[nn.Module]:
    """The class to swap in for a recognised hand-written norm of class ``cls``."""
    return _dynamic(_RECOGNISED_PREFIX, _RecognisedNorm, cls)


def __getattr__(name: str) -> Any:
    # Unpickling a patched model in a fresh process: rebuild the dynamic class by name.
    for prefix in (_DYNAMIC_PREFIX, _RECOGNISED_PREFIX):
        if name.startswith(prefix):
            module_name, _, qualname = bytes.fromhex(name[len(prefix):]).decode().partition(":")
            cls: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                cls = getattr(cls, part)
            if prefix == _RECOGNISED_PREFIX:
                return recognised_class_for(cls)
            if torch_base(cls) is not None:
                return fused_class_for(cls)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def module_config(module: nn.Module) -> tuple[list[int] | None, str]:
    """(normalized_shape or None, a one-line description) for the report."""
    spec = module.__dict__.get(NORM_ATTR)
    if spec is not None:
        return [int(module.weight.shape[0])], spec.describe(module)
    if isinstance(module, nn.LayerNorm):
        return [int(s) for s in module.normalized_shape], (
            f"eps={module.eps:g}, weight={'yes' if module.weight is not None else 'no'}, "
            f"bias={'yes' if module.bias is not None else 'no'}")
    if isinstance(module, nn.RMSNorm):
        eps = "None" if module.eps is None else f"{module.eps:g}"
        return ([int(s) for s in module.normalized_shape],
                f"eps={eps}, weight={'yes' if module.weight is not None else 'no'}")
    if isinstance(module, nn.Softmax):
        return None, f"dim={module.dim}"
    return None, ""


def unsupported(module: nn.Module, base: type[nn.Module]) -> str | None:
    """Why a torch norm/softmax instance cannot take the fused class, or None."""
    if base is nn.Softmax:
        dim = module.dim
        if dim is not None and dim.__class__ is not int:
            return f"dim={dim!r} is not an int (named dims are not supported by the fused op)"
        return None
    for name in ("weight", "bias"):
        p = getattr(module, name, None)
        if p is not None and (not isinstance(p, torch.Tensor) or not p.is_floating_point()):
            return f"{name} is not a floating-point tensor"
    return None
