"""The instance-level callables patch_model installs on modules (a ``forward``, or a method the
forward calls), and installing / removing them.

Each wraps what the attribute was (an instance-level callable set by someone else, e.g.
accelerate, or None for the class's own function) and is removed again by unpatch_model, also
when other wrappers were stacked on top of it since. They are plain picklable objects: what
they compute from code (routed copies of functions, traced graphs) is rebuilt after loading.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fusedops.patching import routing


class ForwardWrapper:
    """Base: stands in for ``module.<name>`` (``forward`` unless said otherwise)."""

    name = "forward"

    def __init__(self, module: nn.Module, inner: Any) -> None:
        self.module = module
        self.inner = inner  # a previous instance-level callable, or None for the class's

    @property
    def __name__(self) -> str:  # noqa: D401 - what inspect and torch.compile read
        return self.name

    @property
    def __wrapped__(self) -> Any:  # inspect.signature(module.forward) sees the real signature
        if self.inner is not None:
            return self.inner
        return getattr(type(self.module), self.name).__get__(self.module)

    def call_inner(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return getattr(type(self.module), self.name)(self.module, *args, **kwargs)


class RoutedFunction(ForwardWrapper):
    """The class's function with routed globals (``routing.routed_clone``) for this module.
    The copy is made here and again after unpickling (never while torch.compile traces)."""

    def __init__(self, module: nn.Module, inner: Any, name: str,
                 analysis: routing.Analysis) -> None:
        super().__init__(module, inner)
        self.name = name
        self.analysis = analysis
        self.function = getattr(type(module), name)  # pickles by reference
        self._fn = routing.routed_clone(self.function, analysis)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None or self._fn is None:
            return self.call_inner(*args, **kwargs)
        return self._fn(self.module, *args, **kwargs)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_fn"]  # a function with copied globals: made again after loading
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._fn = routing.routed_clone(self.function, self.analysis)


class RoutedAttribute(ForwardWrapper):
    """A callable the instance holds (``self.act = F.softmax``, a lambda) and its forward calls:
    the routing wrapper of a torch function, or a copy of a plain function with routed globals
    (``inner`` is the original, put back by unpatch_model)."""

    def __init__(self, module: nn.Module, inner: Any, name: str,
                 analysis: routing.Analysis | None) -> None:
        super().__init__(module, inner)
        self.name = name
        self.analysis = analysis
        self._fn = self._make()

    def _make(self) -> Any:
        if self.analysis is None:
            return routing.routing_wrapper(self.inner)
        return routing.routed_clone(self.inner, self.analysis) or self.inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_fn"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._fn = self._make()


class ModeSite(ForwardWrapper):
    """A module whose own code calls ``tensor.softmax``: its forward runs under a fresh
    :class:`routing.FusedFunctionMode` (unless one is active); its children pop it."""

    def __init__(self, module: nn.Module, inner: Any, ops: tuple[str, ...]) -> None:
        super().__init__(module, inner)
        self.ops = ops

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # (Under torch.compile too: Dynamo traces the mode away.)
        if routing.active_mode() is not None:
            return self.call_inner(*args, **kwargs)
        with routing.FusedFunctionMode(self.ops):
            return self.call_inner(*args, **kwargs)


class ModeChild(ForwardWrapper):
    """A child of a :class:`ModeSite`: the site's mode is popped while it runs, so its torch
    calls skip the mode (and its own sites enter their own)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        n = torch._C._len_torch_function_stack()
        if n and not torch.compiler.is_compiling():
            top = torch._C._get_function_stack_at(n - 1)
            if top.__class__ is routing.FusedFunctionMode:
                torch._C._pop_torch_function_stack()
                try:
                    return self.call_inner(*args, **kwargs)
                finally:
                    torch._C._push_on_torch_function_stack(top)
        return self.call_inner(*args, **kwargs)


def install(module: nn.Module, wrapper: ForwardWrapper) -> ForwardWrapper:
    """Put ``wrapper`` in ``module.__dict__`` under its name (a plain instance attribute:
    nn.Module.__setattr__ stores non-module values there too)."""
    module.__dict__[wrapper.name] = wrapper
    return wrapper


def uninstall(module: nn.Module, wrapper: ForwardWrapper) -> None:
    """Take ``wrapper`` out of ``module``'s attribute chain."""
    current = module.__dict__.get(wrapper.name)
    if current is wrapper:
        if wrapper.inner is None:
            del module.__dict__[wrapper.name]
        else:
            module.__dict__[wrapper.name] = wrapper.inner
        return
    while isinstance(current, ForwardWrapper):
        if current.inner is wrapper:
            current.inner = wrapper.inner
            return
        current = current.inner
    # Someone replaced the attribute after patching: leave theirs alone.


def find(module: nn.Module, kind: type, name: str = "forward") -> Any:
    """The wrapper of class ``kind`` in ``module``'s chain for ``name``, or None."""
    current = module.__dict__.get(name)
    while isinstance(current, ForwardWrapper):
        if isinstance(current, kind):
            return current
        current = current.inner
    return None
