"""pytest plugin: record every interpreted Triton launch as a compile signature.

    python -m pytest -p launch_recorder --record-launches DIR tests    # benchmarks/dev on sys.path

Under ``TRITON_INTERPRET=1`` every launch goes through ``InterpretedFunction.run``; this plugin
wraps it and writes, per pytest process, ``DIR/launches-<worker>.jsonl``: one line per distinct
launch with the kernel (``module:name``), each argument described by what Triton specialises on,
and the launch options. ``compile_check.py`` merges the files and compiles every line offline.

Argument descriptions (the facts a compiled launch keys its binary on, not the values):

- constexpr parameter: ``["const", value]``, the value itself (``{"dtype": "fp16"}`` for a
  Triton dtype, ``{"jit": "module:name"}`` for a jitted function);
- tensor: ``["ptr", "<triton dtype>", <data_ptr % 16 == 0>]``;
- int: ``["int", "i32"|"i64"|"u64", "one"|"d16"|"any"]``: Triton's width by range and its two
  specialisations, value 1 (a constexpr) and divisibility by 16 (an attribute);
- bool ``["bool"]``, float ``["float"]`` (fp32), None ``["const", null]``;
- ``["rejected", type]`` for values a compiled launch refuses (strings, numpy scalars, dtypes
  for a parameter that is not constexpr) although the interpreter takes them;
- ``["unmodelled", type]`` for what this record does not describe (tuples, descriptors).

Recording never disturbs the tests: a launch it cannot describe is written as
``{"error": ..., "kernel": ...}`` and the launch itself runs as before.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from typing import Any

import pytest

# torch dtype name -> Triton's pointer element type (what ``*<type>`` a launch compiles with)
TORCH_TO_TRITON = {
    "float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64",
    "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64",
    "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64", "bool": "u1",
    "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5", "float8_e4m3fnuz": "fp8e4b8",
    "float8_e5m2fnuz": "fp8e5b16",
}

_SEEN: dict[str, str] = {}  # canonical launch line -> the first test that made it
_PARAMS: dict[Any, tuple[inspect.Signature, frozenset[str]]] = {}


def encode_const(value: Any) -> Any:
    """A constexpr value as JSON (raises TypeError for one that has no JSON form here)."""
    value = getattr(value, "value", value) if type(value).__name__ == "constexpr" else value
    if value is None or isinstance(value, bool | int | float | str):
        return value
    cls = type(value)
    if cls.__name__ == "dtype" and cls.__module__.startswith("triton"):
        return {"dtype": str(value.name)}
    if cls.__name__ in ("JITFunction", "InterpretedFunction"):
        return {"jit": f"{value.fn.__module__}:{value.fn.__qualname__}"}
    raise TypeError(f"constexpr of type {type(value).__name__}")


def describe_int(value: int) -> list:
    """Triton's view of an int argument: its width by range, and value 1 / multiple of 16."""
    if -2**31 <= value < 2**31:
        width = "i32"
    elif -2**63 <= value < 2**63:
        width = "i64"
    elif 0 <= value < 2**64:
        width = "u64"
    else:
        return ["rejected", "int beyond 64 bits"]
    return ["int", width, "one" if value == 1 else "d16" if value % 16 == 0 else "any"]


def describe(value: Any, constexpr: bool) -> list:
    """The description of one argument (module docstring); ``constexpr``: the parameter is."""
    if constexpr or value is None or type(value).__name__ == "constexpr":
        try:
            return ["const", encode_const(value)]
        except TypeError as e:
            return ["unmodelled", str(e)]
    if isinstance(value, bool):
        return ["bool"]
    if isinstance(value, int):
        return describe_int(value)
    if isinstance(value, float):
        return ["float"]
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        name = str(value.dtype).removeprefix("torch.")
        if name not in TORCH_TO_TRITON:
            return ["rejected", f"tensor of {name}"]
        return ["ptr", TORCH_TO_TRITON[name], value.data_ptr() % 16 == 0]
    if isinstance(value, tuple) or type(value).__name__ == "TensorDescriptor":
        return ["unmodelled", type(value).__name__]
    return ["rejected", type(value).__name__]


def _signature(fn: Any) -> tuple[inspect.Signature, frozenset[str]]:
    """The kernel's Python signature and its constexpr parameters (cached per function)."""
    if fn not in _PARAMS:
        sig = inspect.signature(fn)
        consts = frozenset(n for n, p in sig.parameters.items() if "constexpr" in str(p.annotation))
        _PARAMS[fn] = (sig, consts)
    return _PARAMS[fn]


def launch_record(fn: Any, args: tuple, kwargs: dict) -> dict:
    """One launch of the Python function ``fn`` as a record: keyword arguments that are not
    parameters of the kernel are launch options (num_warps, num_stages, launch_pdl, ...), as in
    Triton's own launcher. Parameters left to their defaults are not recorded: the compile
    step takes them from the kernel's source, as a compiled launch does."""
    sig, consts = _signature(fn)
    params = {k: v for k, v in kwargs.items() if k in sig.parameters}
    options = {k: v for k, v in kwargs.items() if k not in sig.parameters}
    bound = sig.bind_partial(*args, **params).arguments
    return {
        "kernel": f"{fn.__module__}:{fn.__qualname__}",
        "args": {n: describe(v, n in consts) for n, v in bound.items()},
        "options": {k: encode_const(v) for k, v in options.items()},
    }


def record(fn: Any, args: tuple, kwargs: dict) -> None:
    """Add one launch to the set of this process; any failure becomes an error record."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    try:
        line = json.dumps(launch_record(fn, args, kwargs), sort_keys=True)
    except Exception as e:  # a record must never fail the test that launched
        name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', '?')}"
        line = json.dumps({"error": f"{type(e).__name__}: {e}", "kernel": name}, sort_keys=True)
    _SEEN.setdefault(line, test)


def install() -> None:
    """Wrap ``InterpretedFunction.run`` so every interpreted launch is recorded first."""
    from triton.runtime import interpreter

    cls = interpreter.InterpretedFunction
    if getattr(cls.run, "_records_launches", False):
        return
    original = cls.run

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        record(self.fn, args, kwargs)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    run._records_launches = True
    cls.run = run


def write(path: str) -> int:
    """Write this process's launches (one JSON object a line, ``test`` added); their count."""
    with open(path, "w") as f:
        for line, test in _SEEN.items():
            rec = json.loads(line)
            rec["test"] = test
            f.write(json.dumps(rec, sort_keys=True) + "\n")
    return len(_SEEN)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-launches", metavar="DIR", default=None,
                     help="write every interpreted Triton launch to DIR/launches-<worker>.jsonl")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--record-launches"):
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise pytest.UsageError("--record-launches needs TRITON_INTERPRET=1")
        install()


def pytest_unconfigure(config: pytest.Config) -> None:
    out = config.getoption("--record-launches")
    if not out:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    try:
        os.makedirs(out, exist_ok=True)
        write(os.path.join(out, f"launches-{worker}.jsonl"))
    except OSError as e:
        print(f"launch_recorder: could not write {out}: {e}", file=sys.stderr)
