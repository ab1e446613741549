"""Swap the fused ops into an existing model, reversibly, and report what changed.

Two mechanisms, both scoped to one model (torch itself is never monkeypatched):

1. **Module level.** Every ``nn.LayerNorm`` / ``nn.RMSNorm`` / ``nn.Softmax`` instance, and
   every instance of a subclass that does not override ``forward``, gets its ``__class__``
   swapped to a fused class that overrides only ``forward`` (a subclass of
   :class:`~fusedops.FusedLayerNorm` / :class:`~fusedops.FusedRMSNorm` /
   :class:`~fusedops.FusedSoftmax`; for a user subclass ``S``, a cached dynamic class
   ``FusedS(..., S)``, so ``isinstance(m, S)`` still holds and ``S``'s other methods are kept).
   Parameters, buffers, hooks and state_dict keys are untouched because the instance is.

2. **Functional level** (``functional=True``). An instance-level ``forward`` wrapper on the root
   module runs the original forward inside a :class:`torch.overrides.TorchFunctionMode` (a
   ``with`` block: exception-safe, and traced away by ``torch.compile``). The mode routes
   ``F.softmax``, ``torch.softmax``, ``Tensor.softmax``, ``torch.special.softmax``,
   ``F.layer_norm``, ``torch.layer_norm``, ``F.rms_norm`` and ``torch.rms_norm`` to the fused
   ops and passes every other call through. Nested and re-entrant calls reuse the outermost
   mode. Excluded subtrees get a wrapper that suspends routing while they run. Outside
   discovery forwards the mode is scoped to the modules whose own code makes routable calls
   (see ``REDISCOVER_EVERY``): every other torch call of the forward skips it.

3. **Epilogue patterns** (``patterns=True``). Hugging Face models that chose eager attention
   are switched to an eager attention whose ``softmax(scores * scaling + mask)`` is one kernel,
   through Transformers' own attention registry (``fusedops._hf_attention``). Modules whose
   forward provably computes ``softmax(t * c + m)`` or ``LayerNorm(a + b)`` get a traced,
   rewritten forward calling the fused epilogues (``fusedops._fx_patterns`` says what
   "provably" means). Anything that cannot be proven stays as it is.

See ``docs/patching.md`` for the user-facing description and how to read the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from fusedops import _dispatch, _fx_patterns, _hf_attention
from fusedops.modules import FusedLayerNorm, FusedRMSNorm, FusedSoftmax
from fusedops.ops.layernorm import fused_layernorm
from fusedops.ops.rmsnorm import fused_rmsnorm
from fusedops.ops.softmax import fused_softmax

__all__ = ["PatchReport", "patch_model", "patched", "unpatch_model"]

OPS = ("softmax", "layernorm", "rmsnorm")
_STATE_ATTR = "_fusedops_patch"
_ROUTABLE_DTYPES = frozenset(_dispatch.KERNEL_DTYPES)

_FUSED_CLASSES = (FusedLayerNorm, FusedRMSNorm, FusedSoftmax)
# user subclass -> dynamic fused subclass (created once per class)
_subclass_cache: dict[type[nn.Module], type[nn.Module]] = {}


# --------------------------------------------------------------------------------------------
# Functional level: the TorchFunctionMode
# --------------------------------------------------------------------------------------------


def _plain_types(types: Iterable[type]) -> bool:
    """True when no argument is a tensor subclass with its own ``__torch_function__``."""
    for t in types:
        if t is not torch.Tensor and (
            getattr(t, "__torch_function__", None) is not torch._C._disabled_torch_function_impl
        ):
            return False
    return True


def _routable(x: object) -> bool:
    """Whether a tensor can go to the fused kernels (else the call is passed to torch as is)."""
    if type(x) is not torch.Tensor and not isinstance(x, nn.Parameter):
        return False
    if x.dtype not in _ROUTABLE_DTYPES or x.layout != torch.strided:
        return False
    if torch.compiler.is_compiling():
        return True
    # Eager-only checks: functorch transforms (vmap/grad need setup_context) and CPU autocast
    # (whose dtype policy the fused ops do not reproduce) keep torch's op.
    if torch._C._are_functorch_transforms_active():
        return False
    return x.device.type == "cuda" or not torch.is_autocast_enabled(x.device.type)


_MISSING = object()


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = _MISSING) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _route_softmax(func: Any, args: tuple, kwargs: dict) -> Any:
    """Return the fused result, or ``_MISSING`` when this call must go to torch unchanged."""
    x = _arg(args, kwargs, 0, "input")
    if x is _MISSING and func is torch.Tensor.softmax:
        x = kwargs.get("self", _MISSING)
    if not _routable(x):
        return _MISSING
    dim = _arg(args, kwargs, 1, "dim", None)
    if func is F.softmax:  # F.softmax(input, dim=None, _stacklevel=3, dtype=None)
        dtype = _arg(args, kwargs, 3, "dtype", None)
        if dim is None:
            # torch's legacy implicit-dim rule, with torch's own deprecation warning.
            dim = F._get_softmax_dim("softmax", x.dim(), _arg(args, kwargs, 2, "_stacklevel", 3))
    else:  # torch.softmax(input, dim, dtype=None), Tensor.softmax(dim, dtype=None)
        dtype = _arg(args, kwargs, 2, "dtype", None)
    if not _is_int(dim) or not -max(x.dim(), 1) <= dim < max(x.dim(), 1):
        return _MISSING  # named dims and bad dims: torch's behaviour and error messages
    if dtype is not None and dtype not in _ROUTABLE_DTYPES:
        return _MISSING
    return fused_softmax(x, dim, dtype)


def _route_layernorm(func: Any, args: tuple, kwargs: dict) -> Any:
    x = _arg(args, kwargs, 0, "input")
    if not _routable(x):
        return _MISSING
    shape = _arg(args, kwargs, 1, "normalized_shape")
    if not isinstance(shape, Sequence) or len(shape) == 0 or not all(_is_int(s) for s in shape):
        return _MISSING  # e.g. SymInt shapes under dynamic compile: keep torch's op
    shape = tuple(shape)
    if x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape:
        return _MISSING  # let torch raise its own error
    weight = _arg(args, kwargs, 2, "weight", None)
    bias = _arg(args, kwargs, 3, "bias", None)
    for p in (weight, bias):
        if p is None:
            continue
        if not _routable(p) or tuple(p.shape) != shape or p.device != x.device:
            return _MISSING
    eps = _arg(args, kwargs, 4, "eps", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps >= 0:
        return _MISSING
    return fused_layernorm(x, shape, weight, bias, eps)


def _route_rmsnorm(func: Any, args: tuple, kwargs: dict) -> Any:
    # F.rms_norm / torch.rms_norm(input, normalized_shape, weight=None, eps=None)
    x = _arg(args, kwargs, 0, "input")
    if not _routable(x):
        return _MISSING
    shape = _arg(args, kwargs, 1, "normalized_shape")
    if not isinstance(shape, Sequence) or len(shape) == 0 or not all(_is_int(s) for s in shape):
        return _MISSING
    shape = tuple(shape)
    if x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape:
        return _MISSING  # let torch raise its own error
    weight = _arg(args, kwargs, 2, "weight", None)
    if weight is not None and (not _routable(weight) or tuple(weight.shape) != shape
                               or weight.device != x.device):
        return _MISSING
    eps = _arg(args, kwargs, 3, "eps", None)
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, int | float)
                            or not eps >= 0):
        return _MISSING
    return fused_rmsnorm(x, shape, weight, eps)


_ROUTED = {
    F.softmax: "softmax",
    torch.softmax: "softmax",
    torch.Tensor.softmax: "softmax",
    torch.special.softmax: "softmax",
    F.layer_norm: "layernorm",
    torch.layer_norm: "layernorm",
    F.rms_norm: "rmsnorm",
    torch.rms_norm: "rmsnorm",
}


_is_compiling = torch.compiler.is_compiling


def _routed_op(func: Any) -> str | None:
    if _is_compiling():  # identity tests: what Dynamo traces best
        if (
            func is F.softmax
            or func is torch.softmax
            or func is torch.Tensor.softmax
            or func is torch.special.softmax
        ):
            return "softmax"
        if func is F.layer_norm or func is torch.layer_norm:
            return "layernorm"
        if func is F.rms_norm or func is torch.rms_norm:
            return "rmsnorm"
        return None
    return _ROUTED.get(func)  # eager: one dict lookup on the hot path of every torch call


class _FusedFunctionMode(TorchFunctionMode):
    """Routes the functional softmax / layer_norm / rms_norm calls of one forward to the fused
    ops.

    Torch pops a mode off the mode stack while its ``__torch_function__`` runs, so the fused op's
    own torch calls never re-enter this mode. ``__enter__``/``__exit__`` are torch's, which lets
    Dynamo trace the mode (and resume it across graph breaks).
    """

    def __init__(self, ops: tuple[str, ...], counts: Counter | None = None,
                 sites: list | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.counts = counts  # Counter of routed calls during a verification pass, else None
        self.suspended = 0  # > 0 while an excluded module runs (per mode, so per thread)
        self.sites = sites  # a discovery forward's list of routing sites (_calling_module)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call of the forward passes here (tensor attribute reads included): the
        # common case, nothing to route, takes two calls and a dict lookup.
        if not _is_compiling() and _ROUTED.get(func) is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        if kwargs is None:
            kwargs = {}
        op = _routed_op(func)
        if op is not None and not self.suspended and op in self.ops and _plain_types(types):
            if self.sites is not None:
                self.sites.append(_calling_module())
            if op == "softmax":
                out = _route_softmax(func, args, kwargs)
            elif op == "layernorm":
                out = _route_layernorm(func, args, kwargs)
            else:
                out = _route_rmsnorm(func, args, kwargs)
            if out is not _MISSING:
                if self.counts is not None:
                    self.counts[op] += 1
                return out
        return func(*args, **kwargs)


_CALL_IMPL = getattr(getattr(nn.Module, "_call_impl", None), "__code__", None)


def _calling_module() -> nn.Module | None:
    """The module whose call (``nn.Module.__call__``) is innermost on this thread's Python
    stack: the module whose forward, its children aside, made the call being routed. None if
    no module call is on the stack (a forward called as ``model.forward(x)``)."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code is _CALL_IMPL:
            return f.f_locals.get("self")
        f = f.f_back
    return None


def _active_mode() -> _FusedFunctionMode | None:
    """The innermost fusedops mode on this thread's torch-function mode stack."""
    for i in range(torch._C._len_torch_function_stack() - 1, -1, -1):
        mode = torch._C._get_function_stack_at(i)
        if isinstance(mode, _FusedFunctionMode):
            return mode
    return None


class _ForwardWrapper:
    """Base of the instance-level ``forward`` that patch_model installs on a module.

    It wraps what ``module.forward`` was (the class's forward, or an instance-level forward set
    by someone else, e.g. accelerate) and is removed again by :func:`unpatch_model`. Unlike a
    forward pre-hook / hook pair, the mode is entered and left inside one Python frame, so
    ``torch.compile(model)`` traces it away completely (hooks of the compiled top module run
    as frames of their own, which would leave the mode active around the compiled code).
    """

    __name__ = "forward"

    def __init__(self, module: nn.Module, inner: Any) -> None:
        self.module = module
        self.inner = inner  # a previous instance-level forward, or None for the class's

    @property
    def __wrapped__(self) -> Any:  # inspect.signature(model.forward) sees the real signature
        if self.inner is not None:
            return self.inner
        return type(self.module).forward.__get__(self.module)

    def _call_inner(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


# Routing scope. A mode costs every torch call made under it a trip through Python (about 5
# µs per call on the lent GPU hosts: docs/patching.md), while the calls it routes are a
# handful per layer. So the model's forward runs under the mode only in *discovery* forwards,
# which also note the module whose call made each routable call (a *site*, the model itself
# for a call made in its own forward outside every submodule). Other forwards run the mode
# only while a site's own code runs: a site's forward enters it, and the forwards of a site's
# children that are not sites themselves pop it while they run (_ScopeForward's roles).
# Discovery: the first forward in each (training, grad enabled) state, every
# REDISCOVER_EVERY-th forward (a routable call that first appears later, in a branch the
# earlier forwards did not take, runs unfused until then: correct, only slower), every
# verification pass, and every forward under torch.compile (which traces the mode away).
REDISCOVER_EVERY = 64

# Per thread: how many patched models' forwards are running (sites route only inside one).
_scope = threading.local()


class _RoutedForward(_ForwardWrapper):
    """The patched model's forward: runs the original under a fresh :class:`_FusedFunctionMode`
    in discovery forwards (see REDISCOVER_EVERY), else with routing scoped to the sites found.

    A fresh mode per outermost call keeps its state per thread (the mode stack is thread-local).
    Re-entrant calls, and patched models called inside another patched model's forward, reuse
    the mode already active, so nothing is routed twice.
    """

    def __init__(self, module: nn.Module, inner: Any, state: _PatchState) -> None:
        super().__init__(module, inner)
        self.state = state
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _active_mode() is not None:
            return self._call_inner(*args, **kwargs)
        state = self.state
        if _is_compiling():
            with _FusedFunctionMode(state.ops, state.verify_counts):
                return self._call_inner(*args, **kwargs)
        self.calls += 1
        seen = (self.module.training, torch.is_grad_enabled())
        discover = (seen not in state.discovered or not self.calls % REDISCOVER_EVERY
                    or state.verify_counts is not None)
        sites = [] if discover else None
        _scope.depth = getattr(_scope, "depth", 0) + 1
        try:
            if sites is None and not state.root_site:
                return self._call_inner(*args, **kwargs)
            with _FusedFunctionMode(state.ops, state.verify_counts, sites):
                out = self._call_inner(*args, **kwargs)
        finally:
            _scope.depth -= 1
        if sites is not None:
            state.discovered.add(seen)
            self._adopt(sites)
        return out

    def _adopt(self, sites: list) -> None:
        """Make each new site's forward a "site" and its other children "child"s (see
        _ScopeForward); a site that is the model itself, or a module outside its tree, makes
        the model's whole forward run under the mode."""
        if not sites:
            return
        tree = {id(m) for m in self.module.modules()}
        found = []
        for module in dict.fromkeys(sites):  # (order kept, duplicates dropped)
            if module is None or module is self.module or id(module) not in tree:
                self.state.root_site = True
                module = self.module
            else:
                _set_role(self.state, module, "site")
            found.append(module)
        for site in found:
            for child in _called_children(site):
                if not isinstance(child, _FUSED_CLASSES) and _role(child) != "site":
                    _set_role(self.state, child, "child")


class _ScopeForward(_ForwardWrapper):
    """The forward of a module in the routing scope (see REDISCOVER_EVERY). ``role`` "site": a
    module whose call made a routable call in a discovery forward; it runs under a fresh mode
    while a patched model's forward is running and no mode is active. "child": a child of a
    site that is no site itself; where the site's mode is the innermost one, it is popped while
    the child runs (sites deeper inside enter their own)."""

    def __init__(self, module: nn.Module, inner: Any, state: _PatchState, role: str) -> None:
        super().__init__(module, inner)
        self.state = state
        self.role = role

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            return self._call_inner(*args, **kwargs)
        if self.role == "site":
            if not getattr(_scope, "depth", 0) or _active_mode() is not None:
                return self._call_inner(*args, **kwargs)
            with _FusedFunctionMode(self.state.ops, self.state.verify_counts):
                return self._call_inner(*args, **kwargs)
        n = torch._C._len_torch_function_stack()
        if n:
            top = torch._C._get_function_stack_at(n - 1)
            if top.__class__ is _FusedFunctionMode and top.sites is None:  # not discovering
                torch._C._pop_torch_function_stack()
                try:
                    return self._call_inner(*args, **kwargs)
                finally:
                    torch._C._push_on_torch_function_stack(top)
        return self._call_inner(*args, **kwargs)


def _called_children(module: nn.Module) -> Iterator[nn.Module]:
    """The submodules ``module``'s forward can call as its children: its children, with the
    containers that are indexed rather than called (ModuleList, ModuleDict) replaced by
    theirs."""
    for child in module.children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            yield from _called_children(child)
        else:
            yield child


def _find_wrapper(module: nn.Module, kind: type) -> Any:
    """The wrapper of class ``kind`` in ``module``'s instance-level forward chain, or None."""
    current = module.__dict__.get("forward")
    while isinstance(current, _ForwardWrapper):
        if isinstance(current, kind):
            return current
        current = current.inner
    return None


def _scope_wrapper(module: nn.Module) -> _ScopeForward | None:
    return _find_wrapper(module, _ScopeForward)


def _role(module: nn.Module) -> str | None:
    wrapper = _scope_wrapper(module)
    return None if wrapper is None else wrapper.role


def _set_role(state: _PatchState, module: nn.Module, role: str) -> None:
    wrapper = _scope_wrapper(module)
    if wrapper is None:
        _install(state, module, _ScopeForward(module, module.__dict__.get("forward"), state, role))
    else:
        wrapper.role = role


class _GraphForward(_ForwardWrapper):
    """A module's forward rewritten by torch.fx to call the fused epilogues
    (``fusedops._fx_patterns``); the original runs whenever a guard fails."""

    def __init__(self, module: nn.Module, inner: Any, fused: _fx_patterns.FusedForward) -> None:
        super().__init__(module, inner)
        self.fused = fused

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        chosen = _fx_patterns.select_variant(self.fused, self.module, args, kwargs)
        if chosen is None:
            return self._call_inner(*args, **kwargs)
        gm, positional = chosen
        return gm.forward(*positional)


class _SuspendedForward(_ForwardWrapper):
    """The forward of an excluded subtree's root: functional routing is off while it runs."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mode = _active_mode()
        if mode is None:
            return self._call_inner(*args, **kwargs)
        mode.suspended += 1
        try:
            return self._call_inner(*args, **kwargs)
        finally:
            mode.suspended -= 1


# --------------------------------------------------------------------------------------------
# Module level: class swap
# --------------------------------------------------------------------------------------------


class _SuspendRouting:
    """Mixin for the swapped-in classes: the fused forward runs without the functional mode,
    so the fused op's own torch calls (e.g. the reference backend's ``torch.softmax``) are
    neither routed a second time nor slowed down by the mode."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return super().forward(input)
        n = torch._C._len_torch_function_stack()
        if n == 0:
            return super().forward(input)
        if isinstance(torch._C._get_function_stack_at(n - 1), _FusedFunctionMode):
            mode = torch._C._pop_torch_function_stack()
            try:
                return super().forward(input)
            finally:
                torch._C._push_on_torch_function_stack(mode)
        mode = _active_mode()  # another mode above ours: just stop routing
        if mode is None:
            return super().forward(input)
        mode.suspended += 1
        try:
            return super().forward(input)
        finally:
            mode.suspended -= 1


class _PatchedFusedLayerNorm(_SuspendRouting, FusedLayerNorm):
    """What an ``nn.LayerNorm`` becomes under :func:`patch_model` (shows as FusedLayerNorm)."""


class _PatchedFusedRMSNorm(_SuspendRouting, FusedRMSNorm):
    """What an ``nn.RMSNorm`` becomes under :func:`patch_model` (shows as FusedRMSNorm)."""


class _PatchedFusedSoftmax(_SuspendRouting, FusedSoftmax):
    """What an ``nn.Softmax`` becomes under :func:`patch_model` (shows as FusedSoftmax)."""


# repr() uses the class __name__; pickling uses __qualname__, which stays importable.
_PatchedFusedLayerNorm.__name__ = "FusedLayerNorm"
_PatchedFusedSoftmax.__name__ = "FusedSoftmax"
_PatchedFusedRMSNorm.__name__ = "FusedRMSNorm"

# torch base class -> (swapped-in class, op name)
_BASES: dict[type[nn.Module], tuple[type[nn.Module], str]] = {
    nn.LayerNorm: (_PatchedFusedLayerNorm, "layernorm"),
    nn.Softmax: (_PatchedFusedSoftmax, "softmax"),
    nn.RMSNorm: (_PatchedFusedRMSNorm, "rmsnorm"),
}
_DYNAMIC_PREFIX = "_fused_subclass_"


def _torch_base(cls: type) -> type[nn.Module] | None:
    for base in _BASES:
        if issubclass(cls, base):
            return base
    return None


def _dynamic_name(cls: type) -> str:
    return _DYNAMIC_PREFIX + f"{cls.__module__}:{cls.__qualname__}".encode().hex()


def _fused_class_for(cls: type[nn.Module], base: type[nn.Module]) -> type[nn.Module]:
    """The class to swap in for an instance of ``cls`` (``base`` or a subclass of it).

    For a user subclass this is a dynamic ``Fused<cls>(patched fused class, cls)``, created
    once and cached. It is a module attribute under an importable name, so patched models
    pickle and deep-copy; :func:`__getattr__` recreates it when a pickle is loaded elsewhere.
    """
    fused, _ = _BASES[base]
    if cls is base:
        return fused
    new = _subclass_cache.get(cls)
    if new is None:
        qualname = _dynamic_name(cls)
        new = type(
            f"Fused{cls.__name__}",
            (fused, cls),
            {
                "__module__": __name__,
                "__qualname__": qualname,
                "__doc__": f"{cls.__qualname__} with the fused forward "
                "(created by fusedops.patch_model).",
            },
        )
        _subclass_cache[cls] = new
        globals()[qualname] = new
    return new


def __getattr__(name: str) -> Any:
    # Unpickling a patched model in a fresh process: rebuild the dynamic subclass by name.
    if name.startswith(_DYNAMIC_PREFIX):
        import importlib

        spec = bytes.fromhex(name[len(_DYNAMIC_PREFIX):]).decode()
        module_name, _, qualname = spec.partition(":")
        cls: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        base = _torch_base(cls)
        if base is not None:
            return _fused_class_for(cls, base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _module_config(module: nn.Module) -> tuple[list[int] | None, str]:
    if isinstance(module, nn.LayerNorm):
        shape = [int(s) for s in module.normalized_shape]
        affine = module.weight is not None
        bias = module.bias is not None
        return shape, f"eps={module.eps:g}, weight={'yes' if affine else 'no'}, " \
            f"bias={'yes' if bias else 'no'}"
    if isinstance(module, nn.RMSNorm):
        eps = "None" if module.eps is None else f"{module.eps:g}"
        return ([int(s) for s in module.normalized_shape],
                f"eps={eps}, weight={'yes' if module.weight is not None else 'no'}")
    if isinstance(module, nn.Softmax):
        return None, f"dim={module.dim}"
    return None, ""


def _unsupported(module: nn.Module, base: type[nn.Module]) -> str | None:
    if base is nn.Softmax:
        dim = module.dim
        if dim is not None and not _is_int(dim):
            return f"dim={dim!r} is not an int (named dims are not supported by the fused op)"
        return None
    for name in ("weight", "bias"):
        p = getattr(module, name, None)
        if p is not None and (not isinstance(p, torch.Tensor) or not p.is_floating_point()):
            return f"{name} is not a floating-point tensor"
    return None


# --------------------------------------------------------------------------------------------
# State, report
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _PatchState:
    ops: tuple[str, ...]
    functional: bool
    exclude: tuple
    swapped: list[tuple[nn.Module, type]]  # (module, original class)
    wrappers: list[tuple[nn.Module, Any]]  # (module, _ForwardWrapper) installed as forward
    verify_counts: Counter | None = None
    patterns: bool = True
    # Routing scope (see REDISCOVER_EVERY): the (training, grad enabled) states whose forwards
    # ran a discovery, and whether a routable call was made outside every submodule's call.
    discovered: set = dataclasses.field(default_factory=set)
    root_site: bool = False
    configs: list[tuple[Any, str]] = dataclasses.field(default_factory=list)  # (config, was)


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0:
        return "0"
    return f"{v:.3g}"


@dataclasses.dataclass
class PatchReport:
    """What :func:`patch_model` did. ``str(report)`` is a table; see also :meth:`to_dict`.

    Attributes:
        model: class name of the patched model.
        ops: the ops that were patched.
        functional: whether functional calls are intercepted during forward.
        replaced: one dict per swapped module: ``name`` (qualified), ``type`` (original class),
            ``fused_type``, ``op``, ``shape`` (LayerNorm/RMSNorm ``normalized_shape``, else
            None), ``config``.
        skipped: one dict per LayerNorm/RMSNorm/Softmax module left alone: ``name``, ``type``,
            ``op``, ``reason``.
        fused_patterns: one dict per module whose epilogue pattern now runs fused: ``name``,
            ``type``, ``pattern`` (what was fused) and ``via`` (``"hf attention"``: the config's
            attention implementation switched to fusedops' eager one; ``"traced forward"``: a
            torch.fx rewrite of that module's forward).
        pattern_skipped: candidate modules (a LayerNorm/Softmax child, or a forward that calls
            softmax) whose forward could not be proven exact, with ``name``, ``type``,
            ``reason``.
        excluded: the qualified names of the excluded subtrees (functional calls inside them
            are not routed either).
        unmatched_exclude: ``exclude`` entries that matched no module (typos, usually).
        verification: None, or (with ``example_inputs``) a dict with ``backend`` (the backend
            that ran), ``mode`` (how the pass ran), ``fused_calls`` (per-op calls that ran on
            fused kernels, from :func:`fusedops.count_fused_calls`), ``routed_calls`` (per-op
            calls sent to fusedops, whatever the backend), and ``outputs`` (per output: ``name``,
            ``shape``, ``dtype``, ``max_abs_diff``, ``max_rel_diff`` against the unpatched
            model).
    """

    model: str
    ops: tuple[str, ...]
    functional: bool
    replaced: list[dict] = dataclasses.field(default_factory=list)
    skipped: list[dict] = dataclasses.field(default_factory=list)
    fused_patterns: list[dict] = dataclasses.field(default_factory=list)
    pattern_skipped: list[dict] = dataclasses.field(default_factory=list)
    excluded: list[str] = dataclasses.field(default_factory=list)
    unmatched_exclude: list[str] = dataclasses.field(default_factory=list)
    verification: dict | None = None

    @property
    def max_abs_diff(self) -> float | None:
        """Largest ``max_abs_diff`` over all outputs (None without a verification pass)."""
        return self._worst("max_abs_diff")

    @property
    def max_rel_diff(self) -> float | None:
        """Largest ``max_rel_diff`` over all outputs (None without a verification pass)."""
        return self._worst("max_rel_diff")

    def _worst(self, key: str) -> float | None:
        if not self.verification or not self.verification["outputs"]:
            return None
        return max(o[key] for o in self.verification["outputs"])

    def to_dict(self) -> dict:
        """Plain-Python (JSON-serialisable) form of the report."""
        d = dataclasses.asdict(self)
        d["ops"] = list(self.ops)
        return d

    def to_json(self, **kwargs: Any) -> str:
        """JSON form of :meth:`to_dict`; keyword arguments go to :func:`json.dumps`."""
        kwargs.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        lines = [
            f"fusedops.patch_model({self.model}): ops={', '.join(self.ops) or 'none'}; "
            f"functional interception {'on' if self.functional else 'off'}",
            "",
            f"Replaced modules ({len(self.replaced)}):",
        ]
        lines += _table(
            ["name", "type", "fused type", "shape", "config"],
            [
                [r["name"] or "(root)", r["type"], r["fused_type"],
                 "-" if r["shape"] is None else "x".join(map(str, r["shape"])), r["config"]]
                for r in self.replaced
            ],
        )
        lines += ["", f"Skipped modules ({len(self.skipped)}):"]
        lines += _table(
            ["name", "type", "reason"],
            [[s["name"] or "(root)", s["type"], s["reason"]] for s in self.skipped],
        )
        lines += ["", f"Fused epilogue patterns ({len(self.fused_patterns)}):"]
        lines += _table(
            ["name", "type", "pattern", "via"],
            [[f["name"] or "(root)", f["type"], f["pattern"], f["via"]]
             for f in self.fused_patterns],
        )
        if self.pattern_skipped:
            lines += ["", f"Pattern candidates left alone ({len(self.pattern_skipped)}):"]
            lines += _table(
                ["name", "type", "reason"],
                [[s["name"] or "(root)", s["type"], s["reason"]] for s in self.pattern_skipped],
            )
        if self.excluded:
            lines += ["", "Excluded subtrees (no module swap, no functional routing): "
                      + ", ".join(n or "(root)" for n in self.excluded)]
        if self.unmatched_exclude:
            lines += ["", "Warning: exclude entries that matched nothing: "
                      + ", ".join(self.unmatched_exclude)]
        v = self.verification
        lines.append("")
        if v is None:
            lines.append("Verification: not run (pass example_inputs=... to run one forward).")
            return "\n".join(lines)
        lines.append(f"Verification ({v['mode']}; backend: {v['backend']}):")
        routed = v["routed_calls"]
        fused = v["fused_calls"]
        lines.append(
            "  calls routed to fusedops: "
            + ", ".join(f"{op}={routed.get(op, 0)}" for op in OPS)
        )
        if v.get("pattern_calls"):
            lines.append("  epilogue pattern calls: " + ", ".join(
                f"{k}={n}" for k, n in v["pattern_calls"].items()))
        lines.append(
            "  calls run on fused kernels: "
            + ", ".join(f"{k}={fused.get(k, 0)}" for k in sorted(fused))
        )
        if v.get("note"):
            lines.append(f"  note: {v['note']}")
        lines += _table(
            ["output", "shape", "dtype", "max abs diff", "max rel diff"],
            [
                [o["name"], "x".join(map(str, o["shape"])) or "()", o["dtype"],
                 _fmt(o["max_abs_diff"]), _fmt(o["max_rel_diff"])]
                for o in v["outputs"]
            ],
        )
        return "\n".join(lines)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return ["  (none)"]
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


# --------------------------------------------------------------------------------------------
# Verification pass
# --------------------------------------------------------------------------------------------


def _call(model: nn.Module, example_inputs: Any) -> Any:
    if isinstance(example_inputs, Mapping):
        return model(**example_inputs)
    if isinstance(example_inputs, tuple | list):
        return model(*example_inputs)
    return model(example_inputs)


def _flatten(obj: Any, prefix: str = "output", depth: int = 0) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every tensor in nested tuples/lists/dicts/dataclasses/HF outputs and
    iterable containers such as HF caches."""
    if depth > 32 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):  # dicts and HF ModelOutput
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}.{k}" if depth else str(k), depth + 1)
    elif isinstance(obj, tuple | list):
        for i, v in enumerate(obj):
            yield from _flatten(v, f"{prefix}[{i}]", depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _flatten(getattr(obj, f.name), f"{prefix}.{f.name}", depth + 1)
    elif hasattr(obj, "__iter__") and not isinstance(obj, str | bytes | nn.Module):
        try:
            items = list(obj)
        except Exception:  # noqa: BLE001 - not every __iter__ is a container
            return
        for i, v in enumerate(items):
            yield from _flatten(v, f"{prefix}[{i}]", depth + 1)


def _compare(ref: Any, out: Any) -> list[dict]:
    ref_items = dict(_flatten(ref))
    rows = []
    for name, o in _flatten(out):
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


def _first_float_tensor(*objs: Any) -> torch.Tensor | None:
    for obj in objs:
        for _, t in _flatten(obj):
            if t.is_floating_point():
                return t
    return None


@contextlib.contextmanager
def _eval_no_grad(model: nn.Module) -> Iterator[None]:
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


def _run_once(model: nn.Module, example_inputs: Any) -> Any:
    """One forward from the same RNG state every time (eval mode is set by the caller)."""
    with torch.random.fork_rng(devices=_fork_rng_devices()):
        torch.manual_seed(0)
        return _call(model, example_inputs)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _check_ops(ops: str | Iterable[str]) -> tuple[str, ...]:
    if isinstance(ops, str):
        ops = (ops,)
    ops = tuple(ops)
    for op in ops:
        if op not in OPS:
            raise ValueError(f"ops must be a subset of {OPS}, got {op!r}")
    return tuple(op for op in OPS if op in ops)


def _check_exclude(exclude: str | type | Iterable[str | type]) -> tuple[list[str], list[type]]:
    if isinstance(exclude, str | type):
        exclude = (exclude,)
    names, types = [], []
    for e in exclude:
        if isinstance(e, str):
            names.append(e)
        elif isinstance(e, type) and issubclass(e, nn.Module):
            types.append(e)
        else:
            raise TypeError(
                "exclude entries must be qualified module names (str) or nn.Module subclasses, "
                f"got {e!r}"
            )
    return names, types


def _name_match(name: str, names: list[str]) -> str | None:
    for e in names:
        if e == "" or name == e or name.startswith(e + "."):
            return e
    return None


def patch_model(
    model: nn.Module,
    *,
    ops: str | Iterable[str] = OPS,
    functional: bool = True,
    exclude: str | type | Iterable[str | type] = (),
    example_inputs: Any = None,
    patterns: bool = True,
) -> PatchReport:
    """Swap the fused softmax / LayerNorm / RMSNorm into ``model`` in place and report what
    changed.

    Args:
        model: any ``nn.Module``. It is modified in place; :func:`unpatch_model` undoes it.
        ops: which ops to patch, a subset of ``("softmax", "layernorm", "rmsnorm")``.
        functional: also route functional calls (``F.softmax``, ``torch.softmax``,
            ``Tensor.softmax``, ``F.layer_norm``, ``torch.layer_norm``, ``F.rms_norm``,
            ``torch.rms_norm``) made while ``model``'s
            forward runs, through a ``TorchFunctionMode`` scoped to that forward.
        exclude: qualified module names (a name also excludes everything under it, e.g.
            ``"encoder.layer.0"``) and/or module classes (every instance and its subtree).
            Excluded subtrees get neither module swaps nor functional routing.
        example_inputs: if given, run one forward before and after patching (eval mode, no
            grad, same RNG state) and put per-op fused-call counts and per-output differences in
            the report. A tensor is passed as ``model(x)``, a tuple/list as ``model(*args)``, a
            dict as ``model(**kwargs)``.
        patterns: also fuse the epilogue patterns it can prove: Hugging Face eager attention's
            ``softmax(scores * scaling + mask)`` (through Transformers' attention registry),
            and ``softmax(t * c + m)`` / ``LayerNorm(a + b)`` in forwards that torch.fx can
            trace exactly (see ``docs/patching.md``). Each fused site is in the report.

    Returns:
        A :class:`PatchReport`. Patching an already patched model first undoes the previous
        patch, so patching twice is harmless (the second call's options win).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    ops = _check_ops(ops)
    exclude_arg = (exclude,) if isinstance(exclude, str | type) else tuple(exclude)
    exclude_names, exclude_types = _check_exclude(exclude_arg)
    functional = bool(functional)
    if getattr(model, _STATE_ATTR, None) is not None:
        unpatch_model(model)

    reference = None
    if example_inputs is not None:
        with _eval_no_grad(model):
            reference = _run_once(model, example_inputs)

    report = PatchReport(model=type(model).__name__, ops=ops, functional=functional)
    state = _PatchState(
        ops=ops, functional=functional, exclude=exclude_arg, swapped=[], wrappers=[],
        patterns=bool(patterns),
    )

    # Walk every path to every module (shared modules have several names): a module is excluded
    # if any of its paths is inside an excluded subtree.
    used_names: set[str] = set()
    first_name: dict[int, str] = {}
    excluded_by: dict[int, str] = {}
    exclusion_roots: dict[int, tuple[nn.Module, str]] = {}
    modules: dict[int, nn.Module] = {}

    def walk(module: nn.Module, name: str, inherited: str | None) -> None:
        key = id(module)
        modules[key] = module
        first_name.setdefault(key, name)
        reason = inherited
        if reason is None:
            hit = _name_match(name, exclude_names)
            if hit is not None:
                used_names.add(hit)
                reason = f"excluded by name {hit!r}"
            else:
                for t in exclude_types:
                    if isinstance(module, t):
                        reason = f"excluded by type {t.__name__}"
                        break
            if reason is not None:
                exclusion_roots.setdefault(key, (module, name))
        if reason is not None:
            excluded_by.setdefault(key, reason)
        if isinstance(module, torch.jit.ScriptModule):
            return
        for child_name, child in module._modules.items():
            if child is not None:
                walk(child, f"{name}.{child_name}" if name else child_name, reason)

    walk(model, "", None)
    # Exclusion roots nested in other exclusion roots need no hooks of their own.
    root_names = [n for _, n in exclusion_roots.values()]
    report.excluded = sorted(
        n for n in root_names
        if not any(o != n and (o == "" or n.startswith(o + ".")) for o in root_names)
    )
    report.unmatched_exclude = [e for e in exclude_names if e not in used_names]

    for key, module in modules.items():
        cls = type(module)
        base = _torch_base(cls)
        if base is None:
            continue
        name = first_name[key]
        fused_cls, op = _BASES[base]
        entry = {"name": name, "type": cls.__name__, "op": op}
        if isinstance(module, _FUSED_CLASSES):
            entry["reason"] = f"already fused ({cls.__name__})"
        elif op not in ops:
            entry["reason"] = f"op {op!r} not selected (ops={list(ops)})"
        elif key in excluded_by:
            entry["reason"] = excluded_by[key]
        elif cls.forward is not base.forward:
            entry["reason"] = (
                f"{cls.__name__} overrides forward; left alone"
                + (" (its functional calls are routed)" if functional else "")
            )
        elif (why := _unsupported(module, base)) is not None:
            entry["reason"] = why
        else:
            try:
                new_cls = _fused_class_for(cls, base)
                module.__class__ = new_cls
            except TypeError as exc:  # e.g. an incompatible __slots__ layout
                entry["reason"] = f"class swap failed: {exc}"
            else:
                state.swapped.append((module, cls))
                shape, config = _module_config(module)
                entry.pop("reason", None)
                report.replaced.append(
                    {**entry, "fused_type": new_cls.__name__, "shape": shape, "config": config}
                )
                continue
        report.skipped.append(entry)

    if state.patterns:
        _patch_patterns(state, report, modules, first_name, excluded_by)

    # Functional routing: on for the model's forward, suspended inside excluded subtrees.
    state.functional = functional and bool(ops) and id(model) not in excluded_by
    if state.functional:
        _install(state, model, _RoutedForward(model, model.__dict__.get("forward"), state))
        for module, name in exclusion_roots.values():
            if name in report.excluded:
                _install(state, module, _SuspendedForward(module, module.__dict__.get("forward")))
    report.functional = state.functional
    object.__setattr__(model, _STATE_ATTR, state)

    if example_inputs is not None:
        report.verification = _verify(model, state, example_inputs, reference)
    return report


def _patch_patterns(state: _PatchState, report: PatchReport, modules: dict[int, nn.Module],
                    first_name: dict[int, str], excluded_by: dict[int, str]) -> None:
    """The epilogue patterns (module docstring, point 3)."""
    ops = state.ops
    # Hugging Face eager attention, switched per config object.
    if "softmax" in ops and _hf_attention.available() and _hf_supports_backend(modules):
        by_config: dict[int, list[tuple[str, nn.Module]]] = {}
        configs: dict[int, Any] = {}
        for key, module in modules.items():
            config = getattr(module, "config", None)
            if config is None or not _hf_attention.uses_attention_registry(module):
                continue
            if getattr(config, "_attn_implementation", None) != "eager":
                continue
            configs[id(config)] = config
            by_config.setdefault(id(config), []).append((first_name[key], module))
        for cid, sites in by_config.items():
            blocked = [n for n, m in sites if id(m) in excluded_by]
            no_eager = [n for n, m in sites if _hf_attention.model_eager_function(m) is None]
            if blocked or no_eager:
                why = (f"shares its config with excluded {blocked[0]!r}" if blocked else
                       "its modeling file has no eager_attention_forward to fall back on")
                report.pattern_skipped += [
                    {"name": n, "type": type(m).__name__, "reason": why} for n, m in sites]
                continue
            _hf_attention.register()
            config = configs[cid]
            state.configs.append((config, config._attn_implementation))
            config._attn_implementation = _hf_attention.NAME
            report.fused_patterns += [
                {"name": n, "type": type(m).__name__, "via": "hf attention",
                 "pattern": "softmax(q @ k^T * scaling + mask)"} for n, m in sites]
    # Traced forwards.
    want_softmax, want_ln = "softmax" in ops, "layernorm" in ops
    if not (want_softmax or want_ln):
        return
    for key, module in modules.items():
        if key in excluded_by or isinstance(module, (torch.jit.ScriptModule, *_FUSED_CLASSES)):
            continue
        if not _pattern_candidate(module, want_softmax, want_ln):
            continue
        name, cls_name = first_name[key], type(module).__name__
        if any(id(c) in excluded_by for c in module.children()):
            report.pattern_skipped.append(
                {"name": name, "type": cls_name, "reason": "has an excluded child"})
            continue
        fused, why = _fx_patterns.fuse_module(module, want_softmax, want_ln)
        if fused is None:
            report.pattern_skipped.append({"name": name, "type": cls_name, "reason": why})
            continue
        _install(state, module, _GraphForward(module, None, fused))
        report.fused_patterns += [
            {"name": name, "type": cls_name, "pattern": site, "via": "traced forward"}
            for site in fused.sites]


def _hf_supports_backend(modules: dict[int, nn.Module]) -> bool:
    """Whether a Transformers model in the tree declares that its attention runs through the
    attention registry (``_supports_attention_backend``)."""
    try:
        from transformers import PreTrainedModel
    except Exception:
        return False
    return any(isinstance(m, PreTrainedModel) and getattr(type(m), "_supports_attention_backend",
                                                          False) for m in modules.values())


def _pattern_candidate(module: nn.Module, softmax: bool, layernorm: bool) -> bool:
    """Whether a module may hold a pattern: a LayerNorm/Softmax child, or a forward that names
    softmax (cheap to check; the trace decides)."""
    for child in module.children():
        if layernorm and isinstance(child, nn.LayerNorm) or softmax and isinstance(
                child, nn.Softmax):
            return True
    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    return softmax and code is not None and "softmax" in code.co_names


def _install(state: _PatchState, module: nn.Module, wrapper: _ForwardWrapper) -> None:
    # A plain instance attribute (nn.Module.__setattr__ stores non-module values in __dict__).
    module.__dict__["forward"] = wrapper
    state.wrappers.append((module, wrapper))


def _uninstall(module: nn.Module, wrapper: _ForwardWrapper) -> None:
    """Take ``wrapper`` out of ``module``'s forward, also when other wrappers were stacked on
    top of it since (e.g. a parent model patched after this one)."""
    current = module.__dict__.get("forward")
    if current is wrapper:
        if wrapper.inner is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = wrapper.inner
        return
    while isinstance(current, _ForwardWrapper):
        if current.inner is wrapper:
            current.inner = wrapper.inner
            return
        current = current.inner
    # Someone replaced forward after patching: leave their attribute alone.


def _verify(model: nn.Module, state: _PatchState, example_inputs: Any, reference: Any) -> dict:
    routed: Counter = Counter()
    state.verify_counts = routed
    hooks = []

    def count(op: str):
        def hook(module, args, output):
            routed[op] += 1

        hook._fusedops_count = True  # not a user hook: fused patterns may bypass the module
        return hook

    for module, _ in state.swapped:
        op = _BASES[_torch_base(type(module))][1]
        hooks.append(module.register_forward_hook(count(op)))
    _fx_patterns.counts = pattern_calls = Counter()
    try:
        with _eval_no_grad(model), _dispatch.count_fused_calls() as fused:
            out = _run_once(model, example_inputs)
    finally:
        _fx_patterns.counts = None
        state.verify_counts = None
        for h in hooks:
            h.remove()
    probe = _first_float_tensor(example_inputs, out)
    if probe is None:
        probe = next((p for p in model.parameters() if p.is_floating_point()), None)
    backend = _dispatch.backend_for(probe).NAME if probe is not None else "unknown"
    fused_calls = {k: int(fused.get(k, 0)) for k in (
        "softmax_forward", "softmax_backward", "layernorm_forward", "layernorm_backward",
        "rmsnorm_forward", "rmsnorm_backward", "softmax_masked_forward",
        "layernorm_epilogue_forward")}
    result = {
        "mode": "one forward, eval mode, no grad",
        "backend": f"{backend} ({probe.device.type} {str(probe.dtype).replace('torch.', '')})"
        if probe is not None else backend,
        "fused_calls": fused_calls,
        "routed_calls": {op: int(routed.get(op, 0)) for op in OPS},
        "pattern_calls": dict(sorted(pattern_calls.items())),
        "outputs": _compare(reference, out),
        "note": None,
    }
    if backend == "reference" and sum(routed.values()):
        result["note"] = (
            "the reference backend runs these tensors (correct, not fused), so no call reaches a "
            "fused kernel; on CUDA/MPS, or with fusedops.use_backend('triton'), they would"
        )
    return result


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model`: original classes back, fusedops forward wrappers removed.

    Parameters and buffers were never replaced, so nothing else changes. Returns ``model``.
    Calling it on a model that is not patched does nothing.
    """
    state = model.__dict__.get(_STATE_ATTR)
    if state is None:
        return model
    for module, wrapper in reversed(state.wrappers):
        _uninstall(module, wrapper)
    for config, was in state.configs:
        config._attn_implementation = was
    for module, cls in state.swapped:
        module.__class__ = cls
    del model.__dict__[_STATE_ATTR]
    return model


@contextlib.contextmanager
def patched(model: nn.Module, **kwargs: Any) -> Iterator[PatchReport]:
    """``with fusedops.patched(model, **patch_model_kwargs) as report:`` patch for the block only.

    The model is unpatched on exit, also when the block raises. If the model was already
    patched on entry, it is restored to that patch (with its original options) on exit.
    """
    previous = model.__dict__.get(_STATE_ATTR)
    report = patch_model(model, **kwargs)
    try:
        yield report
    finally:
        unpatch_model(model)
        if previous is not None:
            patch_model(
                model, ops=previous.ops, functional=previous.functional, exclude=previous.exclude,
                patterns=previous.patterns,
            )


def is_patched(model: nn.Module) -> bool:
    """Whether ``model`` is currently patched by :func:`patch_model`."""
    return model.__dict__.get(_STATE_ATTR) is not None

