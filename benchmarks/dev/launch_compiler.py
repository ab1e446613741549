"""Rebuild recorded launches as the JIT's compile inputs and compile them, in a process pool.

Used by ``compile_check.py compile``; needs ``TRITON_INTERPRET=0`` before Triton is imported
(``triton.jit`` must make JIT functions, whose parameters carry the specialisation rules).

A recorded launch (``launch_recorder``'s format) becomes ``ASTSource(fn, signature,
constexprs, attrs)`` by the rules of Triton's launcher (``create_function_from_signature`` and
the native ``specialize_impl``): constexpr parameters and None take their value; an int is
``i32``/``i64``/``u64`` by range, the constexpr 1 when it was 1 and divisible by 16 as an
attribute, both unless the kernel lists it in ``do_not_specialize``; a pointer is divisible by
16 when its data was 16-byte aligned (unless ``do_not_specialize_on_alignment``); a float is
``fp32`` and a bool ``u1``; an annotated parameter keeps its annotation's type. Parameters the
launch left out take the kernel's own defaults, as a compiled launch does.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from launch_recorder import describe


class Refused(Exception):
    """The record cannot compile as it stands: it no longer fits the kernel (recorded from
    another version of its source), or holds what a compiled launch refuses. A failure."""


class NotChecked(Exception):
    """The record cannot be rebuilt here (a kernel outside an importable module, an argument
    this check does not model): reported, not failed."""


def resolve(kernel: str) -> Any:
    """The JITFunction of ``module:qualname``, through autotune/heuristics wrappers."""
    from triton.runtime.jit import JITFunction

    module, _, qualname = kernel.partition(":")
    if "<locals>" in qualname:
        raise NotChecked("defined inside a function, cannot be imported")
    try:
        obj: Any = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise NotChecked(f"module {module} not importable here") from e
        raise
    for part in qualname.split("."):
        obj = getattr(obj, part)
    while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):
        obj = obj.fn
    if not isinstance(obj, JITFunction):
        raise NotChecked(f"{kernel} is a {type(obj).__name__}, not a JIT function")
    return obj


def preload(recs: list[dict]) -> None:
    """Import the recorded kernels' modules once, before the compile processes fork from this
    one (each would import torch and fusedops again otherwise); errors are left to ``check``."""
    for module in sorted({r["kernel"].partition(":")[0] for r in recs if "kernel" in r}):
        try:
            importlib.import_module(module)
        except Exception:
            pass


def distinct(recs: list[dict]) -> list[dict]:
    """The first record of each distinct compile input (kernel, signature, constexprs,
    attributes, options): records that differ only where the launcher does not specialise (an
    int in ``do_not_specialize``, a default passed explicitly) compile to the same binary."""
    seen, out = set(), []
    for rec in recs:
        try:
            sig, consts, divisible = compile_inputs(resolve(rec["kernel"]), rec)
            key = repr((rec["kernel"], sig, sorted(consts.items()), divisible,
                        sorted(rec.get("options", {}).items())))
        except Exception:  # checked, and reported, one by one
            key = repr(sorted(rec.items()))
        if key not in seen:
            seen.add(key)
            out.append(rec)
    return out


def decode_const(value: Any) -> Any:
    """A recorded constexpr value as the Python object the launch passed."""
    if isinstance(value, dict) and "dtype" in value:
        import triton.language as tl

        return tl.dtype(value["dtype"])
    if isinstance(value, dict) and "jit" in value:
        return resolve(value["jit"])
    return value


def arg_type(kp: Any, desc: list) -> tuple[str, Any, bool]:
    """(signature type, constexpr value or None, divisible by 16) of a non-constexpr parameter
    ``kp`` (a Triton ``KernelParam``) given its recorded description."""
    kind = desc[0]
    if kind == "const":
        return "constexpr", decode_const(desc[1]), False
    if kind == "rejected":
        raise Refused(f"{kp.name}: a compiled launch refuses {desc[1]} (the interpreter took it)")
    if kind == "unmodelled":
        raise NotChecked(f"{kp.name}: {desc[1]} arguments are not modelled")
    specialize, align = not kp.do_not_specialize, not kp.do_not_specialize_on_alignment
    annotated = kp.annotation_type
    if annotated and (annotated == "u1" or annotated[:2] in ("fp", "bf")):
        specialize = False  # Triton never specialises floats and bools declared as such
    if kind == "ptr":
        ty, div = ("*k" if kp.is_const else "*") + desc[1], desc[2] and specialize and align
    elif kind == "int":
        if desc[2] == "one" and specialize and not annotated:
            return "constexpr", 1, False
        ty, div = desc[1], desc[2] == "d16" and specialize and align
    elif kind in ("bool", "float"):
        ty, div = ("u1" if kind == "bool" else "fp32"), False
    else:
        raise NotChecked(f"{kp.name}: unknown description {desc}")
    return annotated or ty, None, div


def compile_inputs(fn: Any, rec: dict) -> tuple[dict, dict, list[int]]:
    """(signature, constexprs, indices divisible by 16) of one record for ``fn``."""
    args = rec["args"]
    names = [kp.name for kp in fn.params]
    extra = sorted(set(args) - set(names))
    if extra:
        raise Refused(f"the kernel has no parameter {', '.join(extra)} (record again)")
    sig, consts, divisible = {}, {}, []
    for i, kp in enumerate(fn.params):
        desc = args.get(kp.name)
        if desc is None:
            if not kp.has_default:
                raise Refused(f"no value recorded for {kp.name} (record again)")
            if kp.is_constexpr:
                sig[kp.name], consts[(i,)] = "constexpr", kp.default
                continue
            desc = describe(kp.default, False)
        if kp.is_constexpr:
            if desc[0] != "const":
                raise Refused(f"{kp.name} is constexpr here, recorded as {desc} (record again)")
            sig[kp.name], consts[(i,)] = "constexpr", decode_const(desc[1])
            continue
        ty, value, div = arg_type(kp, desc)
        sig[kp.name] = ty
        if ty == "constexpr":
            consts[(i,)] = value
        if div:
            divisible.append(i)
    return sig, consts, divisible


def compile_record(rec: dict, arch: int) -> None:
    """Compile one record to a cubin for sm_<arch>; raises what the compiler raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    fn = resolve(rec["kernel"])
    sig, consts, divisible = compile_inputs(fn, rec)
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    attrs = {(i,): backend.parse_attr("D") for i in divisible}
    options = {k: v for k, v in rec.get("options", {}).items() if v is not None}
    known = backend.parse_options(dict(options)).__dict__
    unknown = sorted(k for k in options if k not in known)
    if unknown:  # the launcher raises KeyError for these; the interpreter drops them
        raise Refused(f"launch options unknown to this Triton: {', '.join(unknown)}")
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    triton.compile(src, target=target, options=options)


def check(rec: dict, arch: int, tail: int) -> tuple[str | None, str | None, float]:
    """(error text, reason not checked, seconds) of one record; never raises."""
    start = time.perf_counter()
    err = why = None
    if "error" in rec:
        why = f"recording failed: {rec['error']}"
    else:
        try:
            compile_record(rec, arch)
        except NotChecked as e:
            why = str(e)
        except Exception as e:  # every compiler error is a finding, whatever its type
            lines = [ln for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
            err = "\n".join(lines[-tail:])
    return err, why, time.perf_counter() - start


def _isolated(rec: dict, arch: int, tail: int) -> tuple[str | None, str | None, float]:
    """One record in a process of its own: a compiler crash is then this record's failure."""
    with ProcessPoolExecutor(1) as ex:
        try:
            return ex.submit(check, rec, arch, tail).result()
        except BrokenProcessPool:
            return "the compiler process died (a crash inside Triton, not an exception)", None, 0.0


def run_all(recs: list[dict], jobs: int, arch: int,
            tail: int) -> Iterator[tuple[dict, str | None, str | None]]:
    """(record, error, reason not checked) for every record, as they finish. At most 2 x jobs
    are in flight; if a compiler crash takes the pool down, those are checked again one
    process each (so the crash is pinned on its record) and a new pool goes on."""
    todo = list(reversed(recs))
    while todo:
        suspects: list[dict] = []
        with ProcessPoolExecutor(max(jobs, 1)) as ex:
            running: dict[Any, dict] = {}
            while (todo or running) and not suspects:
                while todo and len(running) < 2 * max(jobs, 1):
                    rec = todo.pop()
                    running[ex.submit(check, rec, arch, tail)] = rec
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    rec = running.pop(fut)
                    try:
                        err, why, _ = fut.result()
                    except BrokenProcessPool:
                        suspects.append(rec)
                        continue
                    yield rec, err, why
            suspects += list(running.values())
        for rec in suspects:
            err, why, _ = _isolated(rec, arch, tail)
            yield rec, err, why
