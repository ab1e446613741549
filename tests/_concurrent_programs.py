"""Triton's interpreter with the programs of a launch run as concurrent threads.

The interpreter runs a grid's programs one after another, so a split-row kernel (whose pieces
wait for each other, ``runtime/split.py``) would wait forever on the CPU. Inside
:func:`concurrent_programs` every interpreted launch starts one thread per program, each with
its own program id, and joins them: the pieces publish, wait and combine as on a GPU whose
grid is resident at once. It replaces two pieces of the interpreter's internals (the launch
loop and the builder's program id); tests skip where they are not as expected.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import time
from collections.abc import Iterator

import pytest


def _interpreter():
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    needed = ("_init_args_hst", "_restore_args_dev")
    if (builder is None or not hasattr(interpreter, "GridExecutor")
            or not all(hasattr(interpreter.GridExecutor, n) for n in needed)
            or not hasattr(interpreter, "_patch_lang")
            or not hasattr(interpreter, "_implicit_cvt")
            or not hasattr(builder, "set_grid_idx")):
        pytest.skip("this Triton's interpreter is not the one concurrent_programs knows")
    return interpreter


@contextlib.contextmanager
def concurrent_programs(timeout: float = 240.0) -> Iterator[None]:
    """Run each interpreted launch's programs as concurrent threads inside the block (a launch
    whose programs are still waiting ``timeout`` seconds after they started raises: a generous
    bound: on a 2-core host busy with other work one such launch ran past a minute)."""
    ti = _interpreter()
    builder_cls = type(ti.interpreter_builder)
    local = threading.local()
    saved_idx = builder_cls.__dict__.get("grid_idx")
    saved_call = ti.GridExecutor.__call__
    saved_switch = sys.getswitchinterval()

    def call(self, *args_dev, **kwargs):
        spec = inspect.getfullargspec(self.fn)
        kwargs = {k: v for k, v in kwargs.items() if k in spec.args or k in spec.kwonlyargs}
        args_hst, kwargs_hst = self._init_args_hst(args_dev, kwargs)
        scope = ti._patch_lang(self.fn)
        errors: list[BaseException] = []
        try:
            args = inspect.getcallargs(self.fn, *args_hst, **kwargs_hst)
            args = {n: a if n in self.constexprs else ti._implicit_cvt(a)
                    for n, a in args.items()}
            grid = self.grid(args) if callable(self.grid) else self.grid
            grid = tuple(grid) + (1,) * (3 - len(grid))
            ti.interpreter_builder.set_grid_dim(*grid)

            def program(idx):
                try:
                    ti.interpreter_builder.set_grid_idx(*idx)
                    self.fn(**args)
                except BaseException as exc:  # noqa: BLE001 - reported by the launch
                    errors.append(exc)

            threads = [threading.Thread(target=program, args=((x, y, z),), daemon=True)
                       for x in range(grid[0]) for y in range(grid[1]) for z in range(grid[2])]
            for t in threads:
                t.start()
            deadline = time.monotonic() + timeout
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            if any(t.is_alive() for t in threads):
                raise TimeoutError("interpreted programs still waiting for each other")
        finally:
            scope.restore()
        if errors:
            raise errors[0]
        self._restore_args_dev(args_dev, args_hst, kwargs, kwargs_hst)

    # Each thread's program id; the launch loop above in place of the sequential one. Spinning
    # programs hand the interpreter lock on sooner with a short switch interval.
    builder_cls.grid_idx = property(lambda self: getattr(local, "idx", None),
                                    lambda self, v: setattr(local, "idx", v))
    ti.GridExecutor.__call__ = call
    sys.setswitchinterval(2e-4)
    try:
        yield
    finally:
        sys.setswitchinterval(saved_switch)
        ti.GridExecutor.__call__ = saved_call
        if saved_idx is None:
            del builder_cls.grid_idx
        else:
            builder_cls.grid_idx = saved_idx
