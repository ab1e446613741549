"""Proven epilogue patterns for :func:`fusedops.patch_model`: ``softmax(scores * c + mask)`` and
``LayerNorm(a + b)`` inside a module's forward, rewritten to one fused call each.

A module's forward is only rewritten when its graph is provably what Python would run:

* The bytecode is checked first (:func:`check_forward`): no loops, ``with``, ``try``, closures or
  generators; the only branches test whether an argument is None (and that argument is never
  reassigned); globals are torch/math/operator modules, torch functions or a few pure builtins;
  ``self`` is used only to read attributes. Attributes that are child modules, parameters or
  buffers stay live in the graph; any other attribute (``self.scale``, ``self.n_heads``) gets
  baked into the trace, so its value is snapshotted and compared on every call (a *guard*).
* Then torch.fx traces it once per None-pattern of the tested arguments, every child module a
  leaf (never traced into), and the rewrite works on that graph.
* At run time a call whose guards fail, or whose None-pattern has no trace, runs the original
  forward. The fused helpers check their operands (shapes, dtypes, hooks) and run the exact
  unfused ops whenever the fused op would not compute the same thing.
"""

from __future__ import annotations

import builtins
import dis
import inspect
import itertools
import math
import operator
import re
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fusedops import _dispatch
from fusedops._validate import broadcasts_to
from fusedops.patching import routing
from fusedops.patching.routing import routing_off
from fusedops.patching.wrappers import ForwardWrapper

_BANNED_OPS = {
    "FOR_ITER", "GET_ITER", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP_ABSOLUTE",
    "SETUP_FINALLY", "SETUP_WITH", "SETUP_ASYNC_WITH", "BEFORE_WITH", "BEFORE_ASYNC_WITH",
    "PUSH_EXC_INFO", "YIELD_VALUE", "RETURN_GENERATOR", "SEND", "MAKE_FUNCTION", "LOAD_DEREF",
    "LOAD_CLOSURE", "STORE_GLOBAL", "STORE_ATTR", "DELETE_ATTR", "IMPORT_NAME", "RAISE_VARARGS",
    "CALL_FUNCTION_EX",
}
_SAFE_MODULE_ROOTS = {"torch", "math", "operator"}
_SAFE_BUILTINS = {int, float, bool, tuple, list, len, min, max, abs, slice, range}
# torch attributes whose call would run once, at trace time, and never again (global state, or
# random draws without a traced argument); module attributes like torch.cuda are refused too.
_TRACE_TIME_ONLY = re.compile(
    r"^(manual_seed|seed|initial_seed|set_.*|get_rng_state|use_deterministic_algorithms|"
    r"rand|randn|randint|randperm|rand_like|randn_like|randint_like|normal|bernoulli|"
    r"multinomial|poisson|cuda|mps|backends|distributed|compiler|_dynamo|_C|autograd|"
    r"no_grad|enable_grad|inference_mode|save|load|print|empty_cache|synchronize)$")
_GUARD_TYPES = (int, float, bool, str, type(None))
_MAX_TESTED = 3  # arguments tested for None: 2**3 traces at most


@dataclass
class ForwardInfo:
    """What :func:`check_forward` found: the arguments tested for None and the guarded
    attributes (name -> value at patch time)."""

    tested: tuple[str, ...]
    guards: dict[str, Any] = field(default_factory=dict)


def _guard_value(v: Any) -> bool:
    if isinstance(v, tuple):
        return all(_guard_value(x) for x in v)
    return isinstance(v, _GUARD_TYPES)


def _global_ok(obj: Any) -> bool:
    if isinstance(obj, types.ModuleType):
        return obj.__name__.split(".")[0] in _SAFE_MODULE_ROOTS
    if isinstance(obj, types.BuiltinFunctionType | type) and obj in _SAFE_BUILTINS:
        return True
    module = getattr(obj, "__module__", None) or ""
    return callable(obj) and module.split(".")[0] == "torch" and not isinstance(obj, type) \
        or obj is torch.Tensor


def _plain_forward(module: nn.Module) -> tuple[types.FunctionType | None, str | None]:
    """(the class's forward, None) when its signature and form can be traced, else (None, why)."""
    own = module.__dict__.get("forward")
    if own is not None and not isinstance(own, GraphForward):  # (ours: rebuilding after load)
        return None, "has an instance-level forward"
    fn = type(module).forward
    if not isinstance(fn, types.FunctionType) or hasattr(fn, "__wrapped__"):
        return None, "forward is wrapped or not a plain function"
    code = fn.__code__
    if code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS | inspect.CO_GENERATOR
                        | inspect.CO_COROUTINE):
        return None, "forward takes *args/**kwargs or is a generator"
    if fn.__closure__:
        return None, "forward is a closure"
    if code.co_kwonlyargcount:
        return None, "forward has keyword-only arguments"
    if not code.co_argcount:
        return None, "forward has no self"
    return fn, None


def _child_read_why(module: nn.Module, attr: str, after: Any) -> str | None:
    """Why ``self.<attr>.<after>`` (``attr`` a child) cannot be traced, or None."""
    if after is None or after.opname not in ("LOAD_ATTR", "LOAD_METHOD"):
        return None
    # self.child.x: a child's parameter/buffer/submodule stays live; anything else (a number,
    # a method such as a cache's update) would be baked in.
    child = module._modules[attr]
    if after.argval not in child._parameters and after.argval not in child._buffers and \
            after.argval not in child._modules:
        return f"forward reads self.{attr}.{after.argval}, which a trace would bake in unguarded"
    return None


def check_forward(module: nn.Module) -> tuple[ForwardInfo | None, str | None]:
    """(info, None) when ``type(module).forward`` can be traced exactly, else (None, why)."""
    fn, why = _plain_forward(module)
    if fn is None:
        return None, why
    code = fn.__code__
    argnames = code.co_varnames[:code.co_argcount]
    self_name, params = argnames[0], set(argnames[1:])
    instrs = [i for i in dis.get_instructions(code)
              if i.opname not in ("CACHE", "EXTENDED_ARG", "NOP", "RESUME", "PRECALL")]
    tested: set[str] = set()
    stored: set[str] = set()
    guards: dict[str, Any] = {}
    children = module._modules
    for k, ins in enumerate(instrs):
        op = ins.opname
        if op in _BANNED_OPS:
            return None, f"forward uses {op} (loops, with, try, closures, imports, stores)"
        if op.startswith("INPLACE_") or op == "BINARY_OP" and ins.argrepr.endswith("=") \
                and ins.argrepr not in ("==", "!=", "<=", ">="):
            # fx records `x += y` as an out-of-place add: the caller's tensor would not change.
            return None, "forward updates a value in place (+= and the like)"
        if op in ("STORE_FAST", "DELETE_FAST"):
            stored.add(ins.argval)
        if op == "IS_OP" and k >= 2 and instrs[k - 1].opname == "LOAD_CONST" and \
                instrs[k - 1].argval is None and instrs[k - 2].opname == "LOAD_FAST" and \
                instrs[k - 2].argval in params:
            tested.add(instrs[k - 2].argval)  # `arg is None` as a value: traced per pattern
        if op == "LOAD_GLOBAL":
            name = ins.argval
            obj = fn.__globals__.get(name, getattr(builtins, name, None))
            if not _global_ok(obj):
                return None, f"forward uses global {name!r}, whose behaviour a trace cannot see"
            nxt = instrs[k + 1] if k + 1 < len(instrs) else None
            if isinstance(obj, types.ModuleType) and nxt is not None and \
                    nxt.opname in ("LOAD_ATTR", "LOAD_METHOD") and \
                    _TRACE_TIME_ONLY.match(str(nxt.argval)):
                return None, (f"forward calls {name}.{nxt.argval}, which a trace would run once "
                              "instead of on every call")
        if "JUMP" in op and op not in ("JUMP_FORWARD",):
            # Only `if arg is None` / `if arg is not None` on an argument.
            prev = [p for p in instrs[max(0, k - 4):k] if p.opname != "TO_BOOL"]
            if op.endswith(("IF_NONE", "IF_NOT_NONE")) and prev and \
                    prev[-1].opname == "LOAD_FAST" and prev[-1].argval in params:
                tested.add(prev[-1].argval)
                continue
            if len(prev) >= 3 and prev[-1].opname == "IS_OP" and \
                    prev[-2].opname == "LOAD_CONST" and prev[-2].argval is None and \
                    prev[-3].opname == "LOAD_FAST" and prev[-3].argval in params:
                tested.add(prev[-3].argval)
                continue
            return None, "forward branches on something other than an argument being None"
        names = ins.argval if op == "LOAD_FAST_LOAD_FAST" else (ins.argval,)
        if op.startswith("LOAD_FAST") and self_name in names:
            if op == "LOAD_FAST_LOAD_FAST" and names[-1] != self_name:
                return None, "forward uses self other than to read attributes"
            nxt = instrs[k + 1] if k + 1 < len(instrs) else None
            if nxt is None or nxt.opname not in ("LOAD_ATTR", "LOAD_METHOD"):
                return None, "forward uses self other than to read attributes"
            attr = nxt.argval
            if attr in module._parameters or attr in module._buffers:
                continue
            if attr in children:
                why = _child_read_why(module, attr, instrs[k + 2] if k + 2 < len(instrs) else None)
                if why is not None:
                    return None, why
                continue
            if not hasattr(module, attr):
                return None, f"forward reads a missing attribute self.{attr}"
            value = getattr(module, attr)
            if attr in module.__dict__ and _guard_value(value):
                guards[attr] = value
                continue
            return None, f"forward reads self.{attr}, which a trace would bake in unguarded"
    if tested & stored:
        return None, "forward reassigns an argument it tests for None"
    if len(tested) > _MAX_TESTED:
        return None, f"forward tests more than {_MAX_TESTED} arguments for None"
    return ForwardInfo(tuple(sorted(tested)), guards), None


class _LeafTracer(fx.Tracer):
    """Traces the root's forward only: every child module is one opaque call."""

    def __init__(self, root: nn.Module | None = None) -> None:
        # root may be None: fx rebuilds graphs with a bare tracer when a GraphModule is unpickled
        super().__init__()
        self._root_module = root

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return m is not self._root_module


# --- fused helpers the rewritten graphs call --------------------------------------------------


# Per-helper call counts (``"softmax_epilogue"``, ``"softmax_epilogue:unfused"``, ...) while
# patch_model's verification pass runs; None otherwise.
counts: Counter | None = None


def count(key: str) -> None:
    if counts is not None:
        counts[key] += 1


def _softmax_fusable(scores: Any, scale: Any, mask: Any, dim: int) -> bool:
    return (isinstance(scores, torch.Tensor) and scores.is_floating_point()
            and (scale is None or isinstance(scale, int | float) and not isinstance(scale, bool)
                 and math.isfinite(scale))
            and (mask is None or isinstance(mask, torch.Tensor) and mask.is_floating_point()
                 and mask.device == scores.device and broadcasts_to(mask.shape, scores.shape)
                 and torch.result_type(scores, mask) == scores.dtype)
            and dim in (-1, scores.dim() - 1))


def softmax_epilogue(scores: Any, scale: Any, mask: Any, dim: int,
                     module: nn.Module | None = None) -> Any:
    """``softmax(scores * scale + mask, dim)``, fused where it is the same computation.
    ``module``: the ``nn.Softmax`` child the pattern ended in (None for a functional softmax);
    with hooks on it, or a changed ``dim``, it is called on the unfused sum instead."""
    from fusedops.ops.softmax import fused_softmax

    if module is not None and (module.dim != dim or _has_hooks(module)):
        count("softmax_epilogue:unfused")
        z = scores if scale is None else scores * scale
        return module(z if mask is None else z + mask)
    # The checks too run with routing off (each tensor attribute read would otherwise pass
    # through the routing mode); the unfused fallback runs with it, as the original code did.
    with routing_off():
        fusable = _softmax_fusable(scores, scale, mask, dim)
        if fusable:
            count("softmax_epilogue")
            return fused_softmax(scores, -1, scale=scale, mask=mask)
    count("softmax_epilogue:unfused")
    z = scores if scale is None else scores * scale
    return torch.softmax(z if mask is None else z + mask, dim)


def _ln_fusable(a: Any, b: Any, ln: nn.Module) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.is_floating_point() and a.shape == b.shape and a.dtype == b.dtype
            and a.device == b.device and a.dim() >= 1 and _plain_module(ln, nn.LayerNorm)
            and tuple(ln.normalized_shape) == tuple(a.shape[a.dim() - len(ln.normalized_shape):])
            and not _has_hooks(ln))


def _native_size(a: Any, b: Any, ln: nn.Module | None) -> bool:
    """Whether ``ln(a + b)`` runs PyTorch's ops anyway (fusedops._dispatch's size rule): the
    original computation then runs, without the checks a fused call needs."""
    if a.__class__ is not torch.Tensor:
        return False
    weight = None if ln is None else ln.weight
    grad = torch.is_grad_enabled() and (a.requires_grad or getattr(b, "requires_grad", False)
                                        or weight is not None and weight.requires_grad)
    return _dispatch.runs_native("layernorm_epilogue", a, grad)


def _user_hooks(hooks: dict) -> bool:
    # patch_model's verification pass counts module calls with hooks marked _fusedops_count;
    # any other hook must see the module run, so the pattern is not fused around it.
    return any(not getattr(h, "_fusedops_count", False) for h in hooks.values())


def _has_hooks(m: nn.Module) -> bool:
    """Forward or backward hooks on ``m``, or global module hooks (ours excepted)."""
    g = nn.modules.module
    return bool(_user_hooks(m._forward_hooks) or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks or g._global_forward_hooks
                or g._global_forward_pre_hooks or g._global_backward_hooks
                or g._global_backward_pre_hooks)


# The forwards a pattern may stand in for: torch's own and fusedops' swapped classes'.
_OWN_FORWARD_MODULES = ("torch.nn.modules.", "fusedops.")


def _plain_module(m: nn.Module, base: type) -> bool:
    """An instance of ``base`` whose forward is torch's or fusedops' (a user subclass that
    overrides forward must run it)."""
    return isinstance(m, base) and \
        getattr(type(m).forward, "__module__", "").startswith(_OWN_FORWARD_MODULES)


def add_layernorm(a: Any, b: Any, ln: nn.Module) -> Any:
    """``ln(a + b)``, fused where it is the same computation (checked with routing off, as
    in :func:`softmax_epilogue`) and the call is large enough to gain from it."""
    if _native_size(a, b, ln):
        count("add_layernorm:native")
        return ln(a + b)
    with routing_off():
        if _ln_fusable(a, b, ln):
            from fusedops.ops.layernorm import fused_layernorm

            count("add_layernorm")
            return fused_layernorm(b, ln.normalized_shape, ln.weight, ln.bias, ln.eps,
                                   residual=a)[0]
    count("add_layernorm:unfused")
    return ln(a + b)


def add_layernorm_pair(a: Any, b: Any, ln: nn.Module) -> tuple[Any, Any]:
    """``(ln(a + b), a + b)``: the sum is used elsewhere too."""
    if _native_size(a, b, ln):
        count("add_layernorm:native")
        s = a + b
        return ln(s), s
    with routing_off():
        if _ln_fusable(a, b, ln):
            from fusedops.ops.layernorm import fused_layernorm

            count("add_layernorm")
            return fused_layernorm(b, ln.normalized_shape, ln.weight, ln.bias, ln.eps,
                                   residual=a)
    count("add_layernorm:unfused")
    s = a + b
    return ln(s), s


# --- graph rewriting --------------------------------------------------------------------------

_ADD_FUNCS = (operator.add, torch.add)
_MUL_FUNCS = (operator.mul, torch.mul)
_SOFTMAX_FUNCS = (torch.softmax, F.softmax, torch.nn.functional.softmax)


def _is_binary(node: fx.Node, funcs: tuple, method: str) -> bool:
    if node.op == "call_function" and node.target in funcs:
        return len(node.args) == 2 and not node.kwargs
    return node.op == "call_method" and node.target == method and len(node.args) == 2 \
        and not node.kwargs


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _softmax_dim(node: fx.Node, gm: nn.Module) -> int | None:
    """The dim of a softmax node with nothing else (no dtype), or None when it is not one."""
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if _plain_module(mod, nn.Softmax) and isinstance(mod.dim, int) and len(node.args) == 1 \
                and not node.kwargs:
            return mod.dim
        return None
    if node.op == "call_function" and node.target in _SOFTMAX_FUNCS or \
            node.op == "call_method" and node.target == "softmax":
        kwargs = dict(node.kwargs)
        kwargs.pop("_stacklevel", None)
        if kwargs.pop("dtype", None) is not None:
            return None
        args = list(node.args[1:])
        dim = kwargs.pop("dim", args.pop(0) if args else None)
        if kwargs or args or not isinstance(dim, int):
            return None
        return dim
    return None


def _single_user(node: Any, user: fx.Node) -> bool:
    return isinstance(node, fx.Node) and list(node.users) == [user]


def rewrite_softmax(graph: fx.Graph, gm: nn.Module) -> list[str]:
    """softmax(t * c + m) / softmax(t * c) / softmax(t + m) -> softmax_epilogue(t, c, m, dim)."""
    sites = []
    for node in list(graph.nodes):
        dim = _softmax_dim(node, gm)
        if dim is None or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        inp = node.args[0]
        scores, scale, mask, dead = inp, None, None, []
        if _is_binary(inp, _ADD_FUNCS, "add") and _single_user(inp, node):
            lhs, rhs = inp.args
            # The scores are the operand made by a multiply when there is one.
            if isinstance(rhs, fx.Node) and _is_binary(rhs, _MUL_FUNCS, "mul") and not (
                    isinstance(lhs, fx.Node) and _is_binary(lhs, _MUL_FUNCS, "mul")):
                lhs, rhs = rhs, lhs
            if not isinstance(lhs, fx.Node) or not isinstance(rhs, fx.Node):
                continue
            scores, mask, dead = lhs, rhs, [inp]
        if _is_binary(scores, _MUL_FUNCS, "mul") and _single_user(scores, dead[0] if dead
                                                                   else node):
            t, c = scores.args
            if _number(t) and isinstance(c, fx.Node):
                t, c = c, t
            if isinstance(t, fx.Node) and _number(c):
                dead.append(scores)
                scores, scale = t, float(c)
        if not dead:
            continue  # a plain softmax: the module swap / functional routing covers it
        with graph.inserting_before(node):
            module = graph.get_attr(node.target) if node.op == "call_module" else None
            fused = graph.call_function(softmax_epilogue, (scores, scale, mask, dim, module))
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        for d in dead:
            graph.erase_node(d)
        parts = ["softmax(", "scores", f" * {scale:.4g}" if scale is not None else "",
                 " + mask" if mask is not None else "", ")"]
        sites.append("".join(parts))
    return sites


def rewrite_layernorm(graph: fx.Graph, gm: nn.Module, widths: list[int] | None = None
                      ) -> list[str]:
    """ln(a + b) -> add_layernorm(a, b, ln); with other users of a + b, the pair form.
    ``widths``: gets each rewritten LayerNorm's row length."""
    sites = []
    for node in list(graph.nodes):
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            continue
        mod = gm.get_submodule(node.target)
        if not _plain_module(mod, nn.LayerNorm):
            continue
        add = node.args[0]
        if not (isinstance(add, fx.Node) and _is_binary(add, _ADD_FUNCS, "add")):
            continue
        a, b = add.args
        if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
            continue
        if widths is not None:
            widths.append(math.prod(mod.normalized_shape))
        with graph.inserting_before(node):
            ln = graph.get_attr(node.target)
            if _single_user(add, node):
                fused = graph.call_function(add_layernorm, (a, b, ln))
                node.replace_all_uses_with(fused)
                graph.erase_node(node)
                graph.erase_node(add)
                sites.append(f"{node.target}(a + b)")
                continue
            pair = graph.call_function(add_layernorm_pair, (a, b, ln))
            out = graph.call_function(operator.getitem, (pair, 0))
            s = graph.call_function(operator.getitem, (pair, 1))
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        add.replace_all_uses_with(s)
        graph.erase_node(add)
        sites.append(f"{node.target}(a + b), the sum reused")
    return sites


@dataclass
class FusedForward:
    """A module's rewritten forward: one GraphModule per None-pattern of ``info.tested``."""

    info: ForwardInfo
    signature: inspect.Signature
    variants: dict[tuple[bool, ...], fx.GraphModule]
    sites: list[str]
    children: dict[str, nn.Module]  # the child modules the traces call, as they were
    tensors: dict[str, torch.Tensor]  # the module's own parameters/buffers the traces read
    # (names, defaults, indices of info.tested among names) where every argument after self is
    # positional-or-keyword: calls without keywords then skip Signature.bind (host time)
    positional: tuple | None = None
    layernorm_only: bool = False  # every fused site is a LayerNorm(a + b)
    ln_width: int = 0  # the longest row of those LayerNorms


def fuse_module(module: nn.Module, softmax: bool, layernorm: bool,
                route_ops: tuple[str, ...] = ()) -> tuple[FusedForward | None, str | None]:
    """Trace and rewrite ``module``'s forward; (None, why) when nothing provable was fused.
    ``route_ops``: the ops whose remaining functional calls in the traces go to the fused ops
    (``fusedops.patching.routing``), as the module's routed forward would have sent them."""
    info, why = check_forward(module)
    if info is None:
        return None, why
    variants: dict[tuple[bool, ...], fx.GraphModule] = {}
    sites: list[str] = []
    widths: list[int] = [0]
    for pattern in itertools.product((False, True), repeat=len(info.tested)):
        concrete = {name: None for name, is_none in zip(info.tested, pattern, strict=True)
                    if is_none}
        try:
            graph = _LeafTracer(module).trace(module, concrete_args=concrete or None)
        except Exception as exc:  # a trace error means "not provable", never a failure
            return None, f"torch.fx could not trace forward ({type(exc).__name__})"
        if any(n.op == "get_attr" and str(n.target).startswith("_tensor_constant")
               for n in graph.nodes):
            return None, "forward makes a tensor a trace would freeze (e.g. a random draw)"
        found = []
        if softmax:
            found += rewrite_softmax(graph, module)
        if layernorm:
            found += rewrite_layernorm(graph, module, widths)
        if found:
            _route_calls(graph, route_ops)
            graph.lint()
            variants[pattern] = fx.GraphModule(module, graph, class_name=type(module).__name__)
            sites += [s for s in found if s not in sites]
    if not variants:
        return None, "no fusable pattern in forward"
    children = dict(module._modules)
    tensors = {name: t for name, t in itertools.chain(module._parameters.items(),
                                                       module._buffers.items())}
    signature = inspect.signature(type(module).forward)
    return FusedForward(info, signature, variants, sites, children, tensors,
                        _positional_layout(signature, info.tested),
                        all("(a + b)" in site for site in sites), max(widths)), None


def _route_calls(graph: fx.Graph, ops: tuple[str, ...]) -> None:
    """Point the graph's routable calls (``F.softmax``, ``x.softmax``, ...) of ``ops`` at
    their routing wrappers."""
    for node in graph.nodes:
        if node.op == "call_function" and routing.ROUTED.get(node.target) in ops:
            node.target = routing.routing_wrapper(node.target)
        elif node.op == "call_method" and node.target == "softmax" and "softmax" in ops:
            node.op, node.target = "call_function", routing.routing_wrapper(torch.Tensor.softmax)


def _positional_layout(signature: inspect.Signature, tested: tuple[str, ...]) -> tuple | None:
    """FusedForward.positional for ``signature`` (a forward's, self first), or None."""
    params = list(signature.parameters.values())[1:]
    if any(p.kind is not p.POSITIONAL_OR_KEYWORD for p in params):
        return None
    names = tuple(p.name for p in params)
    if any(t not in names for t in tested):
        return None
    return names, tuple(p.default for p in params), tuple(names.index(t) for t in tested)


def select_variant(fused: FusedForward, module: nn.Module, args: tuple, kwargs: dict
                   ) -> tuple[fx.GraphModule, tuple] | None:
    """The trace for this call and its positional arguments, or None when the original forward
    must run (a guard failed, a child or tensor was replaced, or the call's None-pattern has no
    rewrite)."""
    d = module.__dict__
    for name, value in fused.info.guards.items():
        v = d.get(name, _MISSING)
        if v.__class__ is not value.__class__ or v != value:  # 4 == 4.0, but not for a slice
            return None
    current = module._modules
    for name, child in fused.children.items():
        if current.get(name) is not child:  # a child replaced since: the traces call the old one
            return None
    params, buffers = module._parameters, module._buffers
    for name, t in fused.tensors.items():
        if params.get(name, buffers.get(name)) is not t:  # e.g. .half() or .to() of a buffer
            return None
    if not fused.info.tested and not kwargs:
        gm = fused.variants.get(())
        return None if gm is None else (gm, args)
    layout = fused.positional
    if layout is not None and not kwargs and len(args) <= len(layout[0]):
        # What Signature.bind + apply_defaults gives for a positional call, without it.
        names, defaults, tested_at = layout
        full = args + defaults[len(args):]
        # (a missing argument: bind below fails, and the original forward raises the error)
        if not any(v is inspect.Parameter.empty for v in defaults[len(args):]):
            gm = fused.variants.get(tuple(full[i] is None for i in tested_at))
            return None if gm is None else (gm, full)
    try:
        bound = fused.signature.bind(module, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    key = tuple(bound.arguments[name] is None for name in fused.info.tested)
    gm = fused.variants.get(key)
    # Positionally, in signature order: the traces may have renamed specialised arguments.
    return None if gm is None else (gm, tuple(bound.args[1:]))


_MISSING = object()
_EPILOGUE_RULES = _dispatch.SIZE_RULES["layernorm_epilogue"]
_grad_enabled = torch.is_grad_enabled
_native_now = _dispatch.native_now


class GraphForward(ForwardWrapper):
    """A module's forward rewritten to call the fused epilogues; the original runs whenever a
    guard fails. The traces are rebuilt after unpickling (a pickled GraphModule re-traces its
    code on load, which would call the fused helpers instead of recording them)."""

    def __init__(self, module: nn.Module, inner: Any, fused: FusedForward,
                 softmax: bool, layernorm: bool, route_ops: tuple[str, ...]) -> None:
        super().__init__(module, inner)
        self.fused: FusedForward | None = fused
        self.ops = (softmax, layernorm, route_ops)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fused = self.fused
        if fused is None:
            fused = self.fused = fuse_module(self.module, *self.ops)[0] or False
        if fused and fused.layernorm_only and args and args[0].__class__ is torch.Tensor:
            # Calls this small run the LayerNorm epilogues as PyTorch's ops: the original
            # forward is the same computation, without the helpers' checks. (The size rule
            # inline, and the original called directly: host cost per call.) The first
            # argument's leading dims are taken as the LayerNorms' rows (a block's hidden
            # states); where they are not, the helpers still apply the rule themselves.
            a = args[0]
            grad = a.requires_grad and _grad_enabled()
            key = (True, a.dtype, grad) if a.is_cuda else (
                "cpu" if a.is_cpu else a.device.type, a.dtype, grad)
            below = _EPILOGUE_RULES.get(key)
            if below is None:
                below = _dispatch.size_rule("layernorm_epilogue", key)
            last = a.shape[-1] if a.ndim else 1
            if (a.numel() // last * fused.ln_width if last else 0) < below or _native_now():
                if counts is not None:
                    counts["add_layernorm:native"] += 1
                inner = self.inner
                if inner is not None:
                    return inner(*args, **kwargs)
                return self.module.__class__.forward(self.module, *args, **kwargs)
        chosen = select_variant(fused, self.module, args, kwargs) if fused else None
        if chosen is None:
            return self.call_inner(*args, **kwargs)
        gm, positional = chosen
        return gm.forward(*positional)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["fused"] = None
        return state
