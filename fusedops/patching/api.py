"""patch_model / unpatch_model / patched: swap the fused ops into an existing model, reversibly,
and report what changed (see ``docs/patching.md``).

What is patched, all decided once at patch time and scoped to this model:

1. **Modules**: torch's LayerNorm / RMSNorm / Softmax instances, and hand-written norms that
   ``norms`` proves equal to one, get a fused class (``swaps``).
2. **Epilogue patterns**: Hugging Face eager attention through Transformers' attention
   registry, each attention module with a private config view (``hf_attention``); forwards
   that compute ``softmax(t * c + m)`` or ``LayerNorm(a + b)``, traced and rewritten
   (``fx_patterns``).
3. **Functional calls** in a module's own code (``routing``): a copy of its forward with
   routed globals, or a mode around its own code for ``tensor.softmax`` calls.

Nothing runs per call that could be decided here: no hook on every torch call, no signature
inspection. On a device with no fused backend the model is left as it is unless ``force``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from fusedops import _dispatch
from fusedops.patching import fx_patterns, hf_attention, norms, routing, swaps, verify, wrappers
from fusedops.patching.report import OPS, PatchReport

__all__ = ["PatchReport", "is_patched", "patch_model", "patched", "unpatch_model"]

STATE_ATTR = "_fusedops_patch"
# module -> the PatchState of the patched model it belongs to (weak: never keeps models alive)
_owners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class PatchState:
    """What patch_model changed on one model (kept on it, so unpatch_model can undo it and it
    pickles with the model)."""

    ops: tuple[str, ...]
    functional: bool
    exclude: tuple
    patterns: bool | str
    force: bool
    swapped: list[tuple[nn.Module, type]] = dataclasses.field(default_factory=list)
    wrappers: list[tuple[nn.Module, Any]] = dataclasses.field(default_factory=list)
    configs: list[tuple[nn.Module, Any]] = dataclasses.field(default_factory=list)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.configs:  # a loaded model's attention modules name fusedops' implementation
            hf_attention.register()


def _check_ops(ops: object) -> tuple[str, ...]:
    if isinstance(ops, str):
        ops = (ops,)
    if not isinstance(ops, Iterable):
        raise TypeError(f"ops must be an op name or an iterable of {OPS}, got "
                        f"{type(ops).__name__}")
    ops = tuple(ops)
    for op in ops:
        if op not in OPS:
            raise ValueError(f"ops must be a subset of {OPS}, got {op!r}")
    return tuple(op for op in OPS if op in ops)


def _check_exclude(exclude: object) -> tuple[tuple, list[str], list[type]]:
    if isinstance(exclude, str | type):
        exclude = (exclude,)
    if not isinstance(exclude, Iterable):
        raise TypeError("exclude must be a qualified module name (str), an nn.Module subclass "
                        f"or an iterable of those, got {type(exclude).__name__}")
    exclude = tuple(exclude)
    names, types_ = [], []
    for e in exclude:
        if isinstance(e, str):
            names.append(e)
        elif isinstance(e, type) and issubclass(e, nn.Module):
            types_.append(e)
        else:
            raise TypeError("exclude entries must be qualified module names (str) or "
                            f"nn.Module subclasses, got {e!r}")
    return exclude, names, types_


def _check_flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _check_patterns(value: object) -> bool | str:
    if not (value is True or value is False or isinstance(value, str) and value == "attention"):
        raise ValueError(f"patterns must be True, False or 'attention', got {value!r}")
    return value


def _probe_tensor(model: nn.Module, example_inputs: Any) -> torch.Tensor | None:
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            return t
    return verify.first_float_tensor(example_inputs)


def _backend_of(t: torch.Tensor | None) -> tuple[str, bool]:
    """(description, whether a fused backend runs such tensors)."""
    if t is None:
        return "unknown (no floating-point tensor)", False
    backend = _dispatch.backend_for(t)
    fused = backend.NAME != "reference"
    name = backend.NAME if fused else "native"
    return f"{name} ({t.device.type} {str(t.dtype).replace('torch.', '')})", fused


def patch_model(
    model: nn.Module,
    *,
    ops: str | Iterable[str] = OPS,
    functional: bool = True,
    exclude: str | type | Iterable[str | type] = (),
    example_inputs: Any = None,
    patterns: bool | str = "attention",
    force: bool = False,
) -> PatchReport:
    """Swap the fused softmax / LayerNorm / RMSNorm into ``model`` in place and report what
    changed.

    Args:
        model: any ``nn.Module``. It is modified in place; :func:`unpatch_model` undoes it.
        ops: which ops to patch, a subset of ``("softmax", "layernorm", "rmsnorm")``.
        functional: also route the functional calls (``F.softmax``, ``torch.softmax``,
            ``Tensor.softmax``, ``F.layer_norm``, ``torch.layer_norm``, ``F.rms_norm``,
            ``torch.rms_norm``) written in the model's modules' own code.
        exclude: qualified module names (a name also excludes everything under it, e.g.
            ``"encoder.layer.0"``) and/or module classes (every instance and its subtree).
            Excluded subtrees are not patched at all.
        example_inputs: if given, run one forward before and after patching (eval mode, no
            grad, same RNG state) and put per-op call counts and per-output differences in
            the report. A tensor is passed as ``model(x)``, a tuple/list as ``model(*args)``, a
            dict as ``model(**kwargs)``.
        patterns: ``"attention"`` (default): fuse the softmax of attention (Hugging Face eager
            attention through Transformers' registry, ``softmax(t * c + m)`` in forwards that
            torch.fx traces exactly). ``True``: also ``LayerNorm(a + b)`` in such forwards, for
            large-batch inference (a forward rewritten for that alone costs host-bound models
            its per-call size check; by default it is reported as left alone). ``False``: none.
        force: patch even where the model's tensors have no fused backend (e.g. on CPU): the
            patched calls then run PyTorch's own ops. Without it such a model is left as it is
            and the report says why.

    Returns:
        A :class:`PatchReport`. Patching an already patched model first undoes the previous
        patch, so patching twice is harmless (the second call's options win). A module inside
        a patched model (outside its excluded subtrees) cannot be patched or unpatched on its
        own (ValueError); patching a model replaces the patches its submodules had of their
        own, except in excluded subtrees, which keep theirs.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    ops = _check_ops(ops)
    exclude_arg, exclude_names, exclude_types = _check_exclude(exclude)
    functional = _check_flag(functional, "functional")
    patterns = _check_patterns(patterns)
    force = _check_flag(force, "force")
    owner = _owners.get(model)
    if owner is not None and model.__dict__.get(STATE_ATTR) is not owner:
        raise ValueError(f"this {type(model).__name__} is part of a model already patched by "
                         "fusedops.patch_model; unpatch that model first, or patch it whole")
    unpatch_model(model)
    tree = _Tree(model, exclude_names, exclude_types)
    for _, sub, excluded in tree.items():
        if sub is not model and not excluded and sub.__dict__.get(STATE_ATTR) is not None:
            unpatch_model(sub)  # the model's patch replaces a submodule's own (not excluded)
    backend, fused = _backend_of(_probe_tensor(model, example_inputs))
    report = PatchReport(model=type(model).__name__, ops=ops, functional=functional,
                         backend=backend)
    if not fused and not force:
        return _left_alone(report)
    reference = None
    if example_inputs is not None:
        with verify.eval_no_grad(model):
            reference = verify.run_once(model, example_inputs)
    state = PatchState(ops, functional, exclude_arg, patterns, force)
    report.excluded = tree.excluded_roots()
    report.unmatched_exclude = [e for e in exclude_names if e not in tree.used_names]
    _apply(state, report, tree)
    object.__setattr__(model, STATE_ATTR, state)
    for _, m, excluded in tree.items():
        if not excluded:
            _owners[m] = state
    if example_inputs is not None:
        report.verification = _verify(model, state, example_inputs, reference)
    return report


def _left_alone(report: PatchReport) -> PatchReport:
    """``report`` of a model no fused backend runs, left as it is."""
    report.applied = False
    report.functional = False
    report.reason = (
        f"no fused backend runs this model's tensors ({report.backend.partition(' ')[2][1:-1]}); "
        "the fused kernels run on CUDA (Triton) and Apple MPS (Metal). The model is left "
        "as it is: it would only run the same PyTorch ops through more Python. "
        "patch_model(model, force=True) patches it anyway.")
    return report


def _apply(state: PatchState, report: PatchReport, tree: _Tree) -> None:
    """The three mechanisms of the module docstring, in order, on ``tree``."""
    _swap_modules(state, report, tree)
    if state.patterns is not False:
        _patch_patterns(state, report, tree, add_layernorm=state.patterns is True)
    if state.functional and state.ops:
        _route_functions(state, report, tree)
        # A hand-written norm that is not recognised but whose own calls are routed is fused.
        routed = {r["name"] for r in report.routed_functions}
        report.skipped = [s for s in report.skipped
                          if not (s["op"] == "norm" and s["name"] in routed)]
    else:  # nothing routes a hand-written softmax module's calls
        for s in report.skipped:
            if s["op"] == "softmax" and s["reason"].endswith("(its functional calls are routed)"):
                s["reason"] = "a hand-written softmax module, not nn.Softmax: left alone"


class _Tree:
    """Every module of a model once (shared modules have several names; the first is used),
    with the exclusion each inherits from any path to it."""

    def __init__(self, model: nn.Module, names: list[str], types_: list[type]) -> None:
        self.model = model
        self.modules: dict[int, nn.Module] = {}
        self.name: dict[int, str] = {}
        self.excluded: dict[int, str] = {}
        self.roots: list[str] = []
        self.used_names: set[str] = set()
        self._walk(model, "", None, names, types_)

    def _walk(self, module: nn.Module, name: str, inherited: str | None, names: list[str],
              types_: list[type]) -> None:
        key = id(module)
        self.modules[key] = module
        self.name.setdefault(key, name)
        reason = inherited
        if reason is None:
            hit = next((e for e in names if e == "" or name == e or name.startswith(e + ".")),
                       None)
            if hit is not None:
                self.used_names.add(hit)
                reason = f"excluded by name {hit!r}"
            else:
                t = next((t for t in types_ if isinstance(module, t)), None)
                reason = None if t is None else f"excluded by type {t.__name__}"
            if reason is not None:
                self.roots.append(name)
        if reason is not None:
            self.excluded.setdefault(key, reason)
        if isinstance(module, torch.jit.ScriptModule):
            return
        for child_name, child in module._modules.items():
            if child is not None:
                self._walk(child, f"{name}.{child_name}" if name else child_name, reason,
                           names, types_)

    def excluded_roots(self) -> list[str]:
        roots = self.roots
        return sorted(n for n in roots
                      if not any(o != n and (o == "" or n.startswith(o + ".")) for o in roots))

    def items(self) -> Iterator[tuple[str, nn.Module, str | None]]:
        for key, module in self.modules.items():
            yield self.name[key], module, self.excluded.get(key)


def _swap_modules(state: PatchState, report: PatchReport, tree: _Tree) -> None:
    """Module level: torch classes, then hand-written norms (module docstring, point 1)."""
    for name, module, excluded in tree.items():
        cls = type(module)
        if cls is nn.Dropout:
            # (exactly nn.Dropout: a subclass may do more in eval mode)
            if not excluded and _swap(state, report, module, cls, swaps.LeanDropout, None):
                report.lean_dropout.append(name)
            continue
        base = swaps.torch_base(cls)
        if base is None:
            _recognise(state, report, name, module, excluded)
            continue
        op = swaps.BASES[base][1]
        entry = {"name": name, "type": cls.__name__, "op": op}
        if isinstance(module, swaps.FUSED_CLASSES):
            entry["reason"] = f"already fused ({cls.__name__})"
        elif op not in state.ops:
            entry["reason"] = f"op {op!r} not selected (ops={list(state.ops)})"
        elif excluded:
            entry["reason"] = excluded
        elif cls.forward is not base.forward:
            entry["reason"] = f"{cls.__name__} overrides forward; left alone" + (
                " (its functional calls are routed)" if state.functional else "")
        elif (why := swaps.unsupported(module, base)) is not None:
            entry["reason"] = why
        else:
            _swap(state, report, module, cls, swaps.fused_class_for(cls), entry)
            continue
        report.skipped.append(entry)


def _swap(state: PatchState, report: PatchReport, module: nn.Module, cls: type,
          new_cls: type, entry: dict | None) -> bool:
    """Swap ``module``'s class; ``entry``: its row of ``report.replaced`` (or of
    ``report.skipped`` if the swap fails), None for a Dropout (``report.lean_dropout``)."""
    try:
        module.__class__ = new_cls
    except TypeError as exc:  # e.g. an incompatible __slots__ layout
        if entry is not None:
            entry["reason"] = f"class swap failed: {exc}"
            report.skipped.append(entry)
        return False
    state.swapped.append((module, cls))
    if entry is None:
        return True
    shape, config = swaps.module_config(module)
    report.replaced.append({**entry, "fused_type": new_cls.__name__, "shape": shape,
                            "config": config})
    return True


def _recognise(state: PatchState, report: PatchReport, name: str, module: nn.Module,
               excluded: str | None) -> None:
    """A hand-written norm: recognised by what it computes (``norms``), or reported; a
    hand-written softmax module is reported (its functional calls are routed)."""
    if "softmax" in type(module).__name__.lower():
        report.skipped.append({"name": name, "type": type(module).__name__, "op": "softmax",
                               "reason": excluded or "a hand-written softmax module, not "
                               "nn.Softmax: left alone (its functional calls are routed)"})
        return
    if not norms.looks_like_norm(module):
        return
    entry = {"name": name, "type": type(module).__name__, "op": "norm"}
    eps_attr, why = norms.candidate(module)
    if excluded:
        entry["reason"] = excluded
    elif eps_attr is None:
        entry["reason"] = f"not recognised as a norm: {why}"
    else:
        spec, why = norms.recognise(module, eps_attr)
        if spec is None:
            entry["reason"] = f"not recognised as a norm: {why}"
        elif spec.op not in state.ops:
            entry["op"] = spec.op
            entry["reason"] = f"op {spec.op!r} not selected (ops={list(state.ops)})"
        else:
            entry["op"] = spec.op
            module.__dict__[swaps.NORM_ATTR] = spec
            if _swap(state, report, module, type(module),
                     swaps.recognised_class_for(type(module)), entry):
                report.replaced[-1]["via"] = "recognised by a probe"
            else:
                del module.__dict__[swaps.NORM_ATTR]
            return
    report.skipped.append(entry)


_LN_ONLY_OFF = ("LayerNorm(a + b) fusable, left unfused: patterns='attention' (the default) "
                "rewrites no forward for that alone (its per-call size check costs host-bound "
                "models more than the add it saves); patterns=True fuses it")


def _patch_patterns(state: PatchState, report: PatchReport, tree: _Tree,
                    add_layernorm: bool) -> None:
    """Epilogue patterns (module docstring, point 2); ``LayerNorm(a + b)`` only where
    ``add_layernorm``."""
    # (A Transformers model has imported transformers: other models skip its 2 s import.)
    if "softmax" in state.ops and "transformers" in sys.modules and hf_attention.available():
        _patch_hf_attention(state, report, tree)
    want_softmax, want_ln = "softmax" in state.ops, "layernorm" in state.ops
    if not (want_softmax or want_ln):
        return
    report_ln = want_ln and not add_layernorm  # traced to say so, not rewritten
    want_ln = want_ln and add_layernorm
    route_ops = state.ops if state.functional else ()
    for name, module, excluded in tree.items():
        if excluded or isinstance(module, (torch.jit.ScriptModule, *swaps.FUSED_CLASSES)) \
                or swaps.NORM_ATTR in module.__dict__:
            continue
        if not _pattern_candidate(module, want_softmax, want_ln or report_ln):
            continue
        if any(id(c) in tree.excluded for c in module.children()):
            report.pattern_skipped.append(
                {"name": name, "type": type(module).__name__, "reason": "has an excluded child"})
            continue
        fused, why = fx_patterns.fuse_module(module, want_softmax, want_ln, route_ops)
        if fused is None and report_ln and fx_patterns.fuse_module(module, False, True)[0]:
            why = _LN_ONLY_OFF
        if fused is None:
            report.pattern_skipped.append(
                {"name": name, "type": type(module).__name__, "reason": why})
            continue
        _install(state, module, fx_patterns.GraphForward(
            module, None, fused, want_softmax, want_ln, route_ops))
        report.fused_patterns += [
            {"name": name, "type": type(module).__name__, "pattern": site,
             "via": "traced forward"} for site in fused.sites]


def _patch_hf_attention(state: PatchState, report: PatchReport, tree: _Tree) -> None:
    """Each eager attention module of a Transformers model that declares the attention
    registry gets a private config view naming fusedops' attention."""
    from transformers import PreTrainedModel

    if not any(isinstance(m, PreTrainedModel) and getattr(type(m), "_supports_attention_backend",
                                                           False) for m in tree.modules.values()):
        return
    views: dict[int, Any] = {}
    for name, module, excluded in tree.items():
        config = module.__dict__.get("config")
        if config is None or not hf_attention.uses_attention_registry(module) \
                or getattr(config, "_attn_implementation", None) != "eager":
            continue
        entry = {"name": name, "type": type(module).__name__}
        if excluded:
            report.pattern_skipped.append({**entry, "reason": excluded})
            continue
        if hf_attention.model_eager_function(module) is None:
            report.pattern_skipped.append({**entry, "reason": "its modeling file has no "
                                           "eager_attention_forward to fall back on"})
            continue
        hf_attention.register()
        view = views.get(id(config))
        if view is None:
            view = views[id(config)] = hf_attention.config_view(config)
        state.configs.append((module, config))
        module.__dict__["config"] = view
        report.fused_patterns.append({**entry, "via": "hf attention",
                                      "pattern": "softmax(q @ k^T * scaling + mask)"})


def _pattern_candidate(module: nn.Module, softmax: bool, layernorm: bool) -> bool:
    """A LayerNorm/Softmax child, or a forward that names softmax (cheap; the trace decides)."""
    for child in module.children():
        if layernorm and isinstance(child, nn.LayerNorm) or softmax and isinstance(
                child, nn.Softmax):
            return True
    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    return softmax and code is not None and "softmax" in code.co_names


def _route_functions(state: PatchState, report: PatchReport, tree: _Tree) -> None:
    """Functional calls (module docstring, point 3), decided per module from its code."""
    fused_attention = {id(m) for m, _ in state.configs}
    mode_sites: list[nn.Module] = []
    for name, module, excluded in tree.items():
        if excluded or isinstance(module, (torch.jit.ScriptModule, *swaps.FUSED_CLASSES)) \
                or swaps.NORM_ATTR in module.__dict__ \
                or isinstance(module.__dict__.get("forward"), wrappers.ForwardWrapper):
            continue
        if "forward" in module.__dict__:  # an instance-level forward, e.g. accelerate's
            via = _route_instance_forward(state, module)
            if via is not None:
                if "mode" in via:
                    mode_sites.append(module)
                report.routed_functions.append({"name": name, "type": type(module).__name__,
                                                "calls": ["instance forward"], "via": via})
            continue
        # The eager attention function is replaced through the registry for these.
        skip = frozenset(("eager_attention_forward",)) if id(module) in fused_attention \
            else frozenset()
        analysis = routing.analyze(type(module).forward, state.ops, module, skip)
        if not analysis.routes():
            continue
        calls = sorted({".".join((g, *p)) if p else g for g, ps in analysis.globals.items()
                        for p in ps} | set(analysis.helpers) | set(analysis.methods)
                       | {f"self.{a}" for a in analysis.attributes})
        if analysis.rewrites():
            _install(state, module, wrappers.RoutedFunction(module, None, "forward", analysis))
        for method, sub in analysis.methods.items():
            if sub.rewrites():
                _install(state, module, wrappers.RoutedFunction(
                    module, module.__dict__.get(method), method, sub))
        for attr, sub in analysis.attributes.items():
            if sub is None or sub.rewrites():
                _install(state, module, wrappers.RoutedAttribute(
                    module, module.__dict__[attr], attr, sub))
        via = "globals"
        if analysis.needs_mode():
            mode_sites.append(module)
            via = "globals, mode" if analysis.rewrites() else "mode"
            calls.append("tensor.softmax")
        report.routed_functions.append(
            {"name": name, "type": type(module).__name__, "calls": calls, "via": via})
    _scope_modes(state, mode_sites)


def _route_instance_forward(state: PatchState, module: nn.Module) -> str | None:
    """Route an instance-level forward (a plain function the instance holds): how ("globals",
    "mode" or both, the caller making the module a mode site for the latter), or None."""
    sub = routing.callable_analysis(module.__dict__["forward"], state.ops, frozenset(), 0)
    if sub is False:
        return None
    via = []
    if sub is None or sub.rewrites():
        _install(state, module, wrappers.RoutedAttribute(
            module, module.__dict__["forward"], "forward", sub))
        via.append("globals")
    if sub is not None and sub.needs_mode():
        via.append("mode")
    return ", ".join(via)


def _scope_modes(state: PatchState, sites: list[nn.Module]) -> None:
    """Mode sites enter the routing mode around their own code; their children pop it."""
    site_ids = {id(m) for m in sites}
    for site in sites:
        _install(state, site, wrappers.ModeSite(site, site.__dict__.get("forward"), state.ops))
    for site in sites:
        for child in _called_children(site):
            if id(child) not in site_ids and wrappers.find(child, wrappers.ModeChild) is None:
                _install(state, child, wrappers.ModeChild(child, child.__dict__.get("forward")))


def _called_children(module: nn.Module) -> Iterator[nn.Module]:
    """The submodules ``module``'s forward can call: its children, containers that are indexed
    rather than called (ModuleList, ModuleDict) looked through."""
    for child in module.children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            yield from _called_children(child)
        else:
            yield child


def _install(state: PatchState, module: nn.Module, wrapper: wrappers.ForwardWrapper) -> None:
    wrappers.install(module, wrapper)
    state.wrappers.append((module, wrapper))


def _verify(model: nn.Module, state: PatchState, example_inputs: Any, reference: Any) -> dict:
    module_calls: Counter = Counter()
    hooks = []

    def count(op: str):
        def hook(module, args, output):
            module_calls[op] += 1

        hook._fusedops_count = True  # not a user hook: fused patterns may bypass the module
        return hook

    for module, _ in state.swapped:
        if isinstance(module, swaps.LeanDropout):
            continue
        spec = module.__dict__.get(swaps.NORM_ATTR)
        op = spec.op if spec is not None else swaps.BASES[swaps.torch_base(type(module))][1]
        hooks.append(module.register_forward_hook(count(op)))
    routing.counts = routed = Counter()
    fx_patterns.counts = pattern_calls = Counter()
    try:
        with verify.eval_no_grad(model), _dispatch.count_fused_calls() as fused:
            out = verify.run_once(model, example_inputs)
    finally:
        routing.counts = fx_patterns.counts = None
        for h in hooks:
            h.remove()
    backend, is_fused = _backend_of(_probe_tensor(model, example_inputs))
    keys = ("softmax_forward", "layernorm_forward", "rmsnorm_forward", "softmax_masked_forward",
            "layernorm_epilogue_forward")
    fused_calls = {k: int(fused.get(k, 0)) for k in keys}
    result = {
        "mode": "one forward, eval mode, no grad",
        "backend": backend,
        "fused_calls": fused_calls,
        "module_calls": {op: int(module_calls.get(op, 0)) for op in OPS},
        "routed_calls": {op: int(routed.get(op, 0)) for op in OPS},
        "pattern_calls": dict(sorted(pattern_calls.items())),
        "outputs": verify.compare(reference, out),
        "note": None,
    }
    if not is_fused:
        result["note"] = ("no fused backend runs these tensors: the patched calls ran "
                          "PyTorch's own ops")
    elif not sum(fused_calls.values()):
        result["note"] = ("calls this small run PyTorch's own op (fusedops._dispatch."
                          "NATIVE_BELOW: cheaper on the host); larger inputs run fused")
    return result


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model`: original classes and configs back, fusedops' wrappers removed.

    Parameters and buffers were never replaced, so nothing else changes. Returns ``model``.
    Calling it on a model that is not patched does nothing; calling it on a module inside a
    patched model raises ValueError (unpatch the model it belongs to).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    state = model.__dict__.get(STATE_ATTR)
    if state is None:
        if _owners.get(model) is not None:
            raise ValueError(f"this {type(model).__name__} is part of a model patched by "
                             "fusedops.patch_model; unpatch that model instead")
        return model
    for module, wrapper in reversed(state.wrappers):
        wrappers.uninstall(module, wrapper)
    for module, config in state.configs:
        module.__dict__["config"] = config
    for module, cls in state.swapped:
        module.__dict__.pop(swaps.NORM_ATTR, None)
        module.__class__ = cls
    for m in model.modules():
        if _owners.get(m) is state:
            del _owners[m]
    del model.__dict__[STATE_ATTR]
    return model


@contextlib.contextmanager
def patched(model: nn.Module, **kwargs: Any) -> Iterator[PatchReport]:
    """``with fusedops.patched(model, **patch_model_kwargs) as report:`` patch for the block only.

    The model is unpatched on exit, also when the block raises. If the model was already
    patched on entry, it is restored to that patch (with its original options) on exit.
    """
    previous = model.__dict__.get(STATE_ATTR) if isinstance(model, nn.Module) else None
    report = patch_model(model, **kwargs)
    try:
        yield report
    finally:
        unpatch_model(model)
        if previous is not None:
            patch_model(model, ops=previous.ops, functional=previous.functional,
                        exclude=previous.exclude, patterns=previous.patterns,
                        force=previous.force)


def is_patched(model: nn.Module) -> bool:
    """Whether ``model`` is currently patched by :func:`patch_model`."""
    return isinstance(model, nn.Module) and model.__dict__.get(STATE_ATTR) is not None
