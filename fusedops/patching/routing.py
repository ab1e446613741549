"""Functional routing: ``F.softmax`` / ``torch.softmax`` / ``F.layer_norm`` / ``F.rms_norm`` (and
their aliases) called in a module's own code go to the fused ops.

Decided once per forward function, never per call, and torch is never monkeypatched:

* :func:`analyze` reads a forward's bytecode (and that of the plain-Python helpers and methods
  it calls, two levels deep, nested functions included) for the routable functions it names.
* A call written as a module attribute or a global (``F.softmax(x)``,
  ``torch.nn.functional.layer_norm(...)``, ``from torch import softmax``) is routed by giving
  the function a copy of its globals in which those names lead to routing wrappers
  (:func:`routed_clone`). Every other torch call of the forward runs exactly as before, at no
  cost: the copy holds the same objects.
* A call that no global can reach, ``tensor.softmax(-1)``, is routed by
  :class:`FusedFunctionMode` (a ``TorchFunctionMode``) while that module's own code runs; its
  child modules pop the mode while they run (``fusedops.patching.api``), so only the site's own
  torch calls pass through it.

A routing wrapper sends a call to the fused op when its arguments are what the op takes (plain
float tensors, int dims, matching shapes) and to torch's function unchanged otherwise (named
dims, tensor subclasses, other dtypes), so a routed forward behaves as the original.
"""

from __future__ import annotations

import builtins
import dis
import itertools
import sys
import types
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fusedops.ops.layernorm import fused_layernorm
from fusedops.ops.rmsnorm import fused_rmsnorm
from fusedops.ops.softmax import fused_softmax

OPS = ("softmax", "layernorm", "rmsnorm")
# The dtypes the fused kernels take; calls in others keep torch's function.
_FLOAT_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16))

# The functions routed, by identity, and the op each computes.
ROUTED: dict[Callable, str] = {
    F.softmax: "softmax",
    torch.softmax: "softmax",
    torch.Tensor.softmax: "softmax",
    torch.special.softmax: "softmax",
    F.layer_norm: "layernorm",
    torch.layer_norm: "layernorm",
    F.rms_norm: "rmsnorm",
    torch.rms_norm: "rmsnorm",
}
# Tensor methods only a mode can route (``x.softmax(...)``).
_METHODS = {"softmax": "softmax"}

# Per-op counts of routed calls while patch_model's verification pass runs; None otherwise.
counts: Counter | None = None
_MISSING = object()


# --------------------------------------------------------------------------------------------
# The routing decision of one call
# --------------------------------------------------------------------------------------------


def _plain(x: object) -> bool:
    """A plain float tensor (or Parameter) the fused ops take as they take any tensor."""
    cls = x.__class__
    return (cls is torch.Tensor or cls is torch.nn.Parameter) and x.dtype in _FLOAT_DTYPES \
        and x.layout == torch.strided


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = _MISSING) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _is_int(v: object) -> bool:
    return v.__class__ is int


def _route_softmax(func: Any, args: tuple, kwargs: dict) -> Any:
    """The fused result, or ``_MISSING`` when this call must go to torch unchanged."""
    x = _arg(args, kwargs, 0, "input")
    if x is _MISSING and func is torch.Tensor.softmax:
        x = kwargs.get("self", _MISSING)
    if not _plain(x):
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
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        return _MISSING
    return fused_softmax(x, dim, dtype)


def _shape_of(args: tuple, kwargs: dict, x: torch.Tensor) -> tuple[int, ...] | None:
    shape = _arg(args, kwargs, 1, "normalized_shape")
    if not isinstance(shape, Sequence) or len(shape) == 0 or not all(_is_int(s) for s in shape):
        return None  # e.g. SymInt shapes under dynamic compile: keep torch's op
    shape = tuple(shape)
    if x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape:
        return None  # let torch raise its own error
    return shape


def _param_ok(p: object, shape: tuple[int, ...], x: torch.Tensor) -> bool:
    return p is None or _plain(p) and tuple(p.shape) == shape and p.device == x.device


def _eps_ok(eps: object, allow_none: bool) -> bool:
    if eps is None:
        return allow_none
    return eps.__class__ in (int, float) and eps >= 0


def _route_layernorm(func: Any, args: tuple, kwargs: dict) -> Any:
    # F.layer_norm / torch.layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5)
    x = _arg(args, kwargs, 0, "input")
    if not _plain(x) or (shape := _shape_of(args, kwargs, x)) is None:
        return _MISSING
    weight = _arg(args, kwargs, 2, "weight", None)
    bias = _arg(args, kwargs, 3, "bias", None)
    eps = _arg(args, kwargs, 4, "eps", 1e-5)
    if not (_param_ok(weight, shape, x) and _param_ok(bias, shape, x) and _eps_ok(eps, False)):
        return _MISSING
    return fused_layernorm(x, shape, weight, bias, float(eps))


def _route_rmsnorm(func: Any, args: tuple, kwargs: dict) -> Any:
    # F.rms_norm / torch.rms_norm(input, normalized_shape, weight=None, eps=None)
    x = _arg(args, kwargs, 0, "input")
    if not _plain(x) or (shape := _shape_of(args, kwargs, x)) is None:
        return _MISSING
    weight = _arg(args, kwargs, 2, "weight", None)
    eps = _arg(args, kwargs, 3, "eps", None)
    if not (_param_ok(weight, shape, x) and _eps_ok(eps, True)):
        return _MISSING
    return fused_rmsnorm(x, shape, weight, None if eps is None else float(eps))


_ROUTE = {"softmax": _route_softmax, "layernorm": _route_layernorm, "rmsnorm": _route_rmsnorm}


def route(func: Any, op: str, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` computed by the fused op ``op`` where it takes the call, else
    by ``func`` itself."""
    if torch._C._len_torch_function_stack() and not torch.compiler.is_compiling():
        # Inside a mode site: the fused op's own torch calls must not pass through the mode.
        with routing_off():
            out = _ROUTE[op](func, args, kwargs)
    else:
        out = _ROUTE[op](func, args, kwargs)
    if out is _MISSING:
        return func(*args, **kwargs)
    if counts is not None:
        counts[op] += 1
    return out


# --------------------------------------------------------------------------------------------
# Routing through globals
# --------------------------------------------------------------------------------------------

_wrappers: dict[Callable, Callable] = {}


def routing_wrapper(func: Callable) -> Callable:
    """The stand-in for torch's ``func`` in routed globals (one per function, shared)."""
    wrapper = _wrappers.get(func)
    if wrapper is None:
        op = ROUTED[func]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return route(func, op, args, kwargs)

        wrapper.__name__ = getattr(func, "__name__", op)
        wrapper.__qualname__ = f"fusedops_routed_{wrapper.__name__}"
        wrapper.__doc__ = f"{func.__name__}, computed by fusedops' {op} where it takes the call."
        wrapper.__wrapped__ = func
        _wrappers[func] = wrapper
    return wrapper


class _Shim(types.ModuleType):
    """A module object standing in for a torch module in routed globals: the real module's
    attributes (copied once, so reading them costs what it did), some of them routing wrappers
    or shims of submodules; names the real module gains later are read from it."""

    def __init__(self, real: types.ModuleType, overrides: dict[str, Any]) -> None:
        super().__init__(real.__name__, real.__doc__)
        self.__dict__.update(real.__dict__)
        self.__dict__.update(overrides)
        self.__dict__["_fusedops_real"] = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_fusedops_real"], name)

    def __reduce__(self) -> Any:  # never pickled as a copy: the real module
        return (_import, (self.__name__,))


def _import(name: str) -> types.ModuleType:
    import importlib

    return importlib.import_module(name)


_shims: dict[tuple, _Shim] = {}


def _stand_in(obj: Any, paths: frozenset[tuple[str, ...]]) -> Any:
    """What replaces ``obj`` (a global) when the attribute ``paths`` under it (``()``: obj
    itself) lead to routable functions."""
    if () in paths:
        return routing_wrapper(obj)
    key = (id(obj), paths)
    shim = _shims.get(key)
    if shim is None:
        heads: dict[str, set[tuple[str, ...]]] = {}
        for path in paths:
            heads.setdefault(path[0], set()).add(path[1:])
        overrides = {name: _stand_in(getattr(obj, name), frozenset(rest))
                     for name, rest in heads.items()}
        shim = _shims[key] = _Shim(obj, overrides)
    return shim


_THROUGH_CLASS = ("<class>",)  # a routed function reached through a class: only a mode routes


def _resolve(obj: Any, attrs: list[str], ops: tuple[str, ...]) -> tuple[str, ...] | None:
    """The prefix of ``attrs`` under ``obj`` that reaches a routed function of ``ops`` through
    modules only, :data:`_THROUGH_CLASS` where it is reached through a class (e.g.
    ``torch.Tensor.softmax``), or None."""
    path: list[str] = []
    current = obj
    through_class = False
    for name in [None, *attrs]:
        if name is not None:
            if not isinstance(current, types.ModuleType):
                if not isinstance(current, type):
                    return None
                through_class = True
            current = getattr(current, name, None)
            path.append(name)
        try:
            op = ROUTED.get(current)
        except TypeError:  # unhashable
            return None
        if op is not None:
            if op not in ops:
                return None
            return _THROUGH_CLASS if through_class else tuple(path)
    return None


# --------------------------------------------------------------------------------------------
# Static analysis
# --------------------------------------------------------------------------------------------

_ATTR_OPS = ("LOAD_ATTR", "LOAD_METHOD")
_MAX_DEPTH = 2


class Analysis:
    """What one function's code routes: ``globals`` (global name -> set of attribute paths to
    routed functions), ``helpers`` (global name -> plain-Python function whose own code routes),
    ``methods`` (names of methods read from the first argument, e.g. ``self.attend``, whose code
    routes, with their analyses), ``attributes`` (callables the instance holds and the forward
    calls, e.g. ``self.act = F.softmax``: None for a routed torch function itself, else the
    analysis of a plain function) and ``method_style`` (a ``tensor.softmax(...)`` call)."""

    __slots__ = ("globals", "helpers", "methods", "attributes", "cells", "method_style")

    def __init__(self) -> None:
        self.globals: dict[str, set[tuple[str, ...]]] = {}
        self.helpers: dict[str, Analysis] = {}
        self.methods: dict[str, Analysis] = {}
        self.attributes: dict[str, Analysis | None] = {}
        self.cells: dict[str, Analysis | None] = {}  # closure variables, like attributes
        self.method_style = False

    def routes(self) -> bool:
        return bool(self.globals or self.helpers or self.methods or self.attributes
                    or self.cells or self.method_style)

    def rewrites(self) -> bool:
        """Whether a copy of the function routes something (else only a mode can)."""
        return bool(self.globals or self.helpers or self.cells)

    def needs_mode(self) -> bool:
        subs = (*self.helpers.values(), *self.methods.values(),
                *(a for a in (*self.attributes.values(), *self.cells.values()) if a is not None))
        return self.method_style or any(a.needs_mode() for a in subs)


def unwrap(fn: Any) -> list[Callable]:
    """``fn`` and the functions it wraps (``__wrapped__``), outermost first."""
    chain = [fn]
    while hasattr(chain[-1], "__wrapped__") and len(chain) < 16:
        chain.append(chain[-1].__wrapped__)
    return chain


def analyze(fn: Any, ops: tuple[str, ...], owner: Any = None,
            skip: frozenset[str] = frozenset(), depth: int = 0) -> Analysis:
    """What ``fn`` (unwrapped) routes for ``ops``. ``owner``: the module instance (or class)
    whose attributes its first argument's attribute calls resolve to; ``skip``: global helper
    names not followed."""
    inner = unwrap(fn)[-1]
    result = Analysis()
    if not isinstance(inner, types.FunctionType):
        return result
    first = inner.__code__.co_varnames[0] if inner.__code__.co_argcount else None
    _scan(inner.__code__, inner.__globals__, ops, owner, skip, depth, first, result)
    for name, cell in zip(inner.__code__.co_freevars, inner.__closure__ or (), strict=False):
        try:
            value = cell.cell_contents
        except ValueError:  # not filled yet
            continue
        sub = callable_analysis(value, ops, skip, depth)
        if sub is not False:
            result.cells[name] = sub
    return result


def callable_analysis(value: Any, ops: tuple[str, ...], skip: frozenset[str],
                       depth: int) -> Analysis | None | bool:
    """For a callable held in an attribute or a closure cell: None when it is a routed torch
    function, its analysis when it is a plain function whose code routes, else False."""
    try:
        op = ROUTED.get(value)
    except TypeError:
        return False
    if op is not None:
        return None if op in ops else False
    if depth < _MAX_DEPTH and _followed(value):
        sub = analyze(value, ops, None, skip, depth + 1)
        if sub.routes():
            return sub
    return False


def _scan(code: types.CodeType, globs: dict, ops: tuple[str, ...], owner: Any,
          skip: frozenset[str], depth: int, first: str | None, result: Analysis) -> None:
    instrs = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "EXTENDED_ARG")]
    consumed: set[int] = set()
    for k, ins in enumerate(instrs):
        if ins.opname == "LOAD_GLOBAL":
            name = ins.argval
            attrs, j = [], k + 1
            while j < len(instrs) and instrs[j].opname in _ATTR_OPS:
                attrs.append(instrs[j].argval)
                consumed.add(j)
                j += 1
            obj = globs.get(name, getattr(builtins, name, _MISSING))
            path = None if obj is _MISSING else _resolve(obj, attrs, ops)
            if path is _THROUGH_CLASS:
                result.method_style = True
            elif path is not None:
                result.globals.setdefault(name, set()).add(path)
            elif not attrs and depth < _MAX_DEPTH and name not in skip and _followed(obj):
                sub = analyze(obj, ops, None, skip, depth + 1)
                if sub.routes():
                    result.helpers[name] = sub
        elif ins.opname in _ATTR_OPS and k not in consumed:
            prev = instrs[k - 1] if k else None
            if owner is not None and first is not None and prev is not None \
                    and prev.opname.startswith("LOAD_FAST") and prev.argval == first \
                    and depth < _MAX_DEPTH:
                if _held(owner, ins.argval, ops, skip, depth, result):
                    continue
                method = _method_of(type(owner) if isinstance(owner, torch.nn.Module)
                                    else owner, ins.argval)
                if method is not None:
                    sub = analyze(method, ops, owner, skip, depth + 1)
                    if sub.routes():
                        result.methods[ins.argval] = sub
                    continue
            if _METHODS.get(ins.argval) in ops:
                result.method_style = True
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions and lambdas
            _scan(const, globs, ops, owner, skip, depth, None, result)


def _held(owner: Any, name: str, ops: tuple[str, ...], skip: frozenset[str], depth: int,
          result: Analysis) -> bool:
    """Whether ``self.<name>`` is a callable the instance holds in its ``__dict__`` (noted in
    ``result.attributes`` where it routes)."""
    if not isinstance(owner, torch.nn.Module) or name not in owner.__dict__:
        return False
    sub = callable_analysis(owner.__dict__[name], ops, skip, depth)
    if sub is not False:
        result.attributes[name] = sub
    return True


def _followed(obj: Any) -> bool:
    """A plain-Python function outside torch, whose code is read too."""
    inner = unwrap(obj)[-1]
    return isinstance(inner, types.FunctionType) and \
        not (getattr(inner, "__module__", None) or "").startswith(("torch", "fusedops"))


def _method_of(owner: type, name: str) -> Any:
    """The plain function ``owner.name`` when it is a method defined below nn.Module."""
    for cls in owner.__mro__:
        if cls is torch.nn.Module:
            return None
        value = cls.__dict__.get(name)
        if value is not None:
            return value if isinstance(unwrap(value)[-1], types.FunctionType) else None
    return None


# --------------------------------------------------------------------------------------------
# Routed copies of functions
# --------------------------------------------------------------------------------------------

_clones: dict[tuple, Any] = {}


def routed_clone(fn: Any, analysis: Analysis) -> Any:
    """A copy of ``fn`` (through its ``__wrapped__`` chain) whose globals route, or None where
    a wrapper in the chain does not hold the function it wraps in a closure cell. Cached per
    (function, what it routes), so every instance of a class shares one copy."""
    key = (fn, _fingerprint(analysis))
    if key in _clones:
        return _clones[key]
    chain = unwrap(fn)
    inner = chain[-1]
    clone = _with_globals(inner, _routed_globals(inner.__globals__, analysis),
                          _routed_closure(inner, analysis))
    for wrapper, wrapped in zip(reversed(chain[:-1]), reversed(chain[1:]), strict=True):
        clone = _rewrap(wrapper, wrapped, clone)
        if clone is None:
            break
    _clones[key] = clone
    return clone


def _fingerprint(analysis: Analysis | None) -> tuple:
    if analysis is None:
        return ()
    return (tuple(sorted((k, tuple(sorted(v))) for k, v in analysis.globals.items())),
            tuple(sorted((k, _fingerprint(a)) for k, a in analysis.helpers.items())),
            tuple(sorted((k, _fingerprint(a)) for k, a in analysis.cells.items())))


_count = itertools.count()


def _routed_globals(globs: dict, analysis: Analysis) -> dict:
    """A copy of ``globs`` that routes. It is the namespace of a module registered in
    ``sys.modules`` under a name of its own: torch.compile reads a function's globals back
    through the module its ``__name__`` names."""
    name = f"fusedops_routed.{globs.get('__name__', 'globals')}.{next(_count)}"
    module = types.ModuleType(name)
    new = module.__dict__
    new.update(globs)
    new["__name__"] = name
    sys.modules[name] = module
    for name, paths in analysis.globals.items():
        new[name] = _stand_in(globs.get(name, getattr(builtins, name, None)), frozenset(paths))
    for name, sub in analysis.helpers.items():
        helper = routed_clone(globs[name], sub)
        if helper is not None:
            new[name] = helper
    return new


def _routed_closure(fn: types.FunctionType, analysis: Analysis) -> tuple | None:
    if not analysis.cells:
        return fn.__closure__
    cells = []
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__, strict=True):
        if name in analysis.cells:
            value, sub = cell.cell_contents, analysis.cells[name]
            routed = routing_wrapper(value) if sub is None else routed_clone(value, sub)
            cell = types.CellType(value if routed is None else routed)
        cells.append(cell)
    return tuple(cells)


def _with_globals(fn: types.FunctionType, globs: dict,
                  closure: tuple | None) -> types.FunctionType:
    clone = types.FunctionType(fn.__code__, globs, fn.__name__, fn.__defaults__, closure)
    clone.__kwdefaults__ = fn.__kwdefaults__
    clone.__dict__.update(fn.__dict__)
    clone.__qualname__ = fn.__qualname__
    clone.__module__ = fn.__module__
    clone.__doc__ = fn.__doc__
    clone.__annotations__ = fn.__annotations__
    return clone


def _rewrap(wrapper: Any, wrapped: Any, clone: Any) -> Any:
    """``wrapper`` (a decorator's closure around ``wrapped``) around ``clone`` instead."""
    if not isinstance(wrapper, types.FunctionType) or not wrapper.__closure__:
        return None
    cells, found = [], False
    for cell in wrapper.__closure__:
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell
            cells.append(cell)
            continue
        if held is wrapped:
            cells.append(types.CellType(clone))
            found = True
        else:
            cells.append(cell)
    if not found:
        return None
    new = types.FunctionType(wrapper.__code__, wrapper.__globals__, wrapper.__name__,
                             wrapper.__defaults__, tuple(cells))
    new.__kwdefaults__ = wrapper.__kwdefaults__
    new.__dict__.update(wrapper.__dict__)
    new.__wrapped__ = clone
    new.__qualname__ = wrapper.__qualname__
    new.__module__ = wrapper.__module__
    new.__doc__ = wrapper.__doc__
    return new


# --------------------------------------------------------------------------------------------
# The mode, for tensor-method calls
# --------------------------------------------------------------------------------------------


def _plain_types(types_: Any) -> bool:
    """True when no argument is a tensor subclass with its own ``__torch_function__``."""
    disabled = torch._C._disabled_torch_function_impl
    for t in types_:
        if t is not torch.Tensor and getattr(t, "__torch_function__", None) is not disabled:
            return False
    return True


class FusedFunctionMode(TorchFunctionMode):
    """Routes the routable torch calls made while it is the innermost mode (a site's own code,
    see the module docstring) to the fused ops of ``ops``.

    Torch pops a mode off the mode stack while its ``__torch_function__`` runs, so the fused op's
    own torch calls never re-enter it.
    """

    def __init__(self, ops: tuple[str, ...]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        op = ROUTED.get(func)
        if op is None or op not in self.ops or not _plain_types(types):
            return func(*args, **(kwargs or {}))
        return route(func, op, args, kwargs or {})


def active_mode() -> FusedFunctionMode | None:
    """The innermost fusedops mode on this thread's torch-function mode stack."""
    for i in range(torch._C._len_torch_function_stack() - 1, -1, -1):
        mode = torch._C._get_function_stack_at(i)
        if isinstance(mode, FusedFunctionMode):
            return mode
    return None


class routing_off:
    """Pops fusedops' mode off the mode stack while a block runs (a fused helper that computes
    what its site asked for: its own torch calls must not be routed again)."""

    __slots__ = ("popped",)

    def __enter__(self) -> None:
        self.popped = None
        if torch.compiler.is_compiling():
            return
        depth = torch._C._len_torch_function_stack()
        if depth and isinstance(torch._C._get_function_stack_at(depth - 1), FusedFunctionMode):
            self.popped = torch._C._pop_torch_function_stack()

    def __exit__(self, *exc: object) -> None:
        if self.popped is not None:
            torch._C._push_on_torch_function_stack(self.popped)
