"""Build, load and launch the CPU emulation of the Metal shaders.

The shipped ``metal/*.metal`` files are compiled unchanged as C++17 against the
``shim/metal_stdlib`` header and linked with ``runtime/emu_runtime.cpp`` into one shared
library, loaded with ctypes:

1. ``g++ -E`` in scan mode preprocesses each shader and the kernel signatures are read from it:
   every ``[[kernel]]`` function, its ``template [[host_name("...")]]`` instantiations, and for
   each parameter its ``[[buffer(i)]]`` index or built-in attribute.
2. A wrapper translation unit per shader ``#include``s the shader and defines, per kernel,
   ``extern "C" int emu_kernel_<host_name>(args, grid, tg, err, errlen)``: the per-thread body
   binds buffer slot ``i`` to the parameter marked ``[[buffer(i)]]`` and each built-in to its
   value, then calls the kernel. It also exports the parameter kinds and element sizes, so a
   launch with a wrongly typed tensor or scalar is refused.
3. The library is cached under ``tests/metal_emu/_build/<variant>-<hash>/``, keyed by the hash
   of the shaders, the shim, the runtime, this file and the compiler flags.

:class:`EmuLauncher` exposes the launcher protocol of ``fusedops.backends.metal`` (the same one the
``torch.mps.compile_shader`` path implements), so the tests drive the real host code: the same
kernel names, argument order, flags and dispatch geometry. Tensors are bound through guarded
copies (poison before and after, and in the gaps between rows), so reads outside a tensor
poison the result and writes outside it are reported.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

if not sys.platform.startswith("linux"):  # futex waits, ELF symbol tables
    raise ImportError("the Metal CPU emulation runs on Linux only")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SHADER_DIR = REPO / "metal"
SHADER_FILES = ("softmax.metal", "layernorm.metal", "rmsnorm.metal", "softmax_masked.metal",
                "layernorm_epilogue.metal")
SHIM_DIR = HERE / "shim"
RUNTIME_DIR = HERE / "runtime"
BUILD_ROOT = HERE / "_build"
CXX = os.environ.get("CXX", "g++")
if shutil.which(CXX) is None or shutil.which("objdump") is None:
    raise ImportError(f"the Metal CPU emulation needs {CXX} and objdump")


def _tool_env() -> dict:
    """Environment for the compiler and binutils: without a sanitizer preload (the sanitizer
    subprocess runs with LD_PRELOAD=libtsan.so)."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    return env

COMMON_FLAGS = ["-std=c++17", "-fPIC", "-pthread", "-Wall", "-Wextra", "-Wno-attributes",
                "-Wno-unused-parameter"]
VARIANT_FLAGS = {
    # Natural alignment for vector types: a misaligned vector access cannot crash the process.
    "fast": ["-O1", "-DFUSEDOPS_EMU_NATURAL_ALIGN"],
    # ThreadSanitizer for races, UBSan (Metal's vector alignment included) for the rest.
    "tsan": ["-O1", "-g", "-fsanitize=thread", "-fsanitize=undefined",
             "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"],
}

BUILTINS = {
    "thread_position_in_grid": "b->thread_position_in_grid",
    "thread_position_in_threadgroup": "b->thread_position_in_threadgroup",
    "threadgroup_position_in_grid": "b->threadgroup_position_in_grid",
    "threads_per_threadgroup": "b->threads_per_threadgroup",
    "threadgroups_per_grid": "b->threadgroups_per_grid",
    "threads_per_grid": "b->threads_per_grid",
    "thread_index_in_threadgroup": "b->thread_index_in_threadgroup",
    "thread_index_in_simdgroup": "b->thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup": "b->simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup": "b->simdgroups_per_threadgroup",
    "threads_per_simdgroup": "b->threads_per_simdgroup",
    "thread_execution_width": "b->threads_per_simdgroup",
}

KIND_BUILTIN, KIND_POINTER, KIND_INT, KIND_FLOAT = 0, 1, 2, 3


class EmuError(RuntimeError):
    """A launch failed in the emulation (deadlock, divergent barrier, bad arguments, ...)."""


@dataclasses.dataclass
class Param:
    decl: str
    attr: str  # "buffer" or a built-in name
    index: int | None  # buffer index


@dataclasses.dataclass
class Kernel:
    host_name: str
    call: str  # C++ expression naming the function, e.g. foo<float, half>
    params: list[Param]
    source: str  # shader file name

    @property
    def n_buffers(self) -> int:
        idx = [p.index for p in self.params if p.attr == "buffer"]
        return max(idx) + 1 if idx else 0


# ---------------------------------------------------------------------------------------------
# Scanning kernel signatures.

_KERNEL_DEF = re.compile(r"(?:\[\[\s*kernel\s*\]\]|\bkernel\b)\s*void\s+(\w+)\s*\(")
_INSTANTIATION = re.compile(
    r"template\s*\[\[\s*host_name\s*\(\s*((?:\"[^\"]*\"\s*)+)\)\s*\]\]\s*"
    r"\[\[\s*kernel\s*\]\]\s*decltype\s*\(\s*(\w+)\s*<([^()]*?)>\s*\)\s*\w+\s*<[^;]*?>\s*;"
)
_ATTR = re.compile(r"\[\[\s*([A-Za-z_]\w*)\s*(?:\(\s*(\d+)\s*\))?\s*\]\]")


def _matching_paren(text: str, open_pos: int) -> int:
    depth = 0
    for i in range(open_pos, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise EmuError("unbalanced parentheses in a kernel signature")


def _split_params(text: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _parse_params(plist: str, where: str) -> list[Param]:
    params = []
    for decl in _split_params(plist):
        attrs = _ATTR.findall(decl)
        if len(attrs) != 1:
            raise EmuError(f"{where}: parameter {decl!r} needs exactly one [[attribute]]")
        name, index = attrs[0]
        if name == "buffer":
            params.append(Param(decl, "buffer", int(index)))
        elif name in BUILTINS:
            params.append(Param(decl, name, None))
        else:
            raise EmuError(f"{where}: attribute [[{name}]] is not supported by the emulation")
    return params


def preprocess(shader: Path, include_dirs: Sequence[Path]) -> str:
    cmd = [CXX, "-E", "-P", "-x", "c++", "-std=c++17", "-DFUSEDOPS_EMU_SCAN", "-I", str(SHIM_DIR)]
    for d in include_dirs:
        cmd += ["-I", str(d)]
    cmd.append(str(shader))
    res = subprocess.run(cmd, capture_output=True, text=True, env=_tool_env())
    if res.returncode != 0:
        raise EmuError(f"preprocessing {shader} failed:\n{res.stderr}")
    return res.stdout


def scan_kernels(shader: Path, include_dirs: Sequence[Path]) -> list[Kernel]:
    """The kernels a shader defines, with their host names and parameter bindings."""
    text = preprocess(shader, include_dirs)
    defs: dict[str, tuple[list[Param], bool]] = {}
    for m in _KERNEL_DEF.finditer(text):
        name = m.group(1)
        close = _matching_paren(text, m.end() - 1)
        params = _parse_params(text[m.end():close], f"{shader.name}:{name}")
        is_template = text[: m.start()].rstrip().endswith(">")
        defs[name] = (params, is_template)
    kernels = []
    for name, (params, is_template) in defs.items():
        if not is_template:
            kernels.append(Kernel(name, name, params, shader.name))
    for m in _INSTANTIATION.finditer(text):
        host = "".join(re.findall(r"\"([^\"]*)\"", m.group(1)))
        func, targs = m.group(2), " ".join(m.group(3).split())
        if func not in defs:
            raise EmuError(f"{shader.name}: {host} instantiates unknown kernel {func}")
        kernels.append(Kernel(host, f"{func}<{targs}>", defs[func][0], shader.name))
    names = [k.host_name for k in kernels]
    if len(set(names)) != len(names):
        raise EmuError(f"{shader.name}: duplicate kernel names")
    return kernels


# ---------------------------------------------------------------------------------------------
# Code generation and build.

def _wrapper_source(shader: Path, kernels: list[Kernel]) -> str:
    lines = [
        "// Generated by tests/metal_emu/emu.py; do not edit.",
        f'#include "{shader}"',
        "",
    ]
    for k in kernels:
        f = f"decltype(&{k.call})"
        args = []
        for pos, p in enumerate(k.params):
            ptype = f"emu::arg_t<{f}, {pos}>"
            if p.attr == "buffer":
                args.append(f"emu::bind_buffer<{ptype}>(a, {p.index})")
            else:
                args.append(f"emu::bind_builtin<{ptype}>({BUILTINS[p.attr]})")
        joined = ",\n      ".join(args)
        # Per buffer slot: kind, element (or scalar) size, const-ness of the pointee.
        kinds, sizes, consts = ["0"] * k.n_buffers, ["0"] * k.n_buffers, ["0"] * k.n_buffers
        for pos, p in enumerate(k.params):
            if p.attr != "buffer":
                continue
            ptype = f"emu::arg_t<{f}, {pos}>"
            pointee = f"std::remove_pointer_t<std::remove_reference_t<{ptype}>>"
            kinds[p.index] = (
                f"(std::is_pointer_v<{ptype}> ? {KIND_POINTER} : "
                f"std::is_floating_point_v<std::remove_cv_t<{pointee}>> ? {KIND_FLOAT} : "
                f"{KIND_INT})"
            )
            sizes[p.index] = f"int(sizeof({pointee}))"
            consts[p.index] = f"int(std::is_const_v<{pointee}>)"
        h = k.host_name
        lines += [
            "namespace {",
            f"void emu_thread_{h}(void* const* a, const emu::Builtins* b) {{",
            "  (void)b;",
            f"  {k.call}(\n      {joined});",
            "}",
            "}  // namespace",
            f'extern "C" int emu_kernel_{h}(void* const* a, const unsigned* grid, '
            "const unsigned* tg, char* err, int errlen) {",
            f"  return emu_run(emu_thread_{h}, a, grid, tg, err, errlen);",
            "}",
            f'extern "C" const int emu_kinds_{h}[] = {{{", ".join(kinds) or "0"}}};',
            f'extern "C" const int emu_sizes_{h}[] = {{{", ".join(sizes) or "0"}}};',
            f'extern "C" const int emu_consts_{h}[] = {{{", ".join(consts) or "0"}}};',
            "",
        ]
    return "\n".join(lines)


def _hash_files(paths: Sequence[Path], extra: str) -> str:
    h = hashlib.sha256()
    for p in paths:
        if p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    h.update(extra.encode())
    try:
        h.update(subprocess.run([CXX, "--version"], capture_output=True, env=_tool_env()).stdout)
    except OSError as e:  # pragma: no cover - no compiler
        raise EmuError(f"cannot run {CXX}: {e}") from e
    return h.hexdigest()[:16]


def _hash_inputs(shader_dir: Path, files: Sequence[str], variant: str) -> str:
    paths = sorted(shader_dir.glob("*.metal")) + [shader_dir / f for f in files]
    paths += sorted(SHIM_DIR.iterdir()) + sorted(RUNTIME_DIR.iterdir()) + [Path(__file__)]
    return _hash_files(paths, " ".join([CXX, *COMMON_FLAGS, *VARIANT_FLAGS[variant], *files]))


def _runtime_object(variant: str) -> Path:
    """The compiled runtime, shared by every build of a variant (cached)."""
    flags = [*COMMON_FLAGS, *VARIANT_FLAGS[variant]]
    key = _hash_files(sorted(RUNTIME_DIR.iterdir()), " ".join([CXX, *flags]))
    obj = BUILD_ROOT / f"runtime-{variant}-{key}.o"
    if not obj.exists():
        tmp = obj.with_suffix(f".{os.getpid()}.tmp.o")
        _compile_all([[CXX, *flags, "-I", str(RUNTIME_DIR), "-c",
                       str(RUNTIME_DIR / "emu_runtime.cpp"), "-o", str(tmp)]])
        tmp.rename(obj)
    return obj


def _compile_all(jobs: list[list[str]]) -> None:
    procs = [(cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=_tool_env())) for cmd in jobs]
    errors = []
    for cmd, proc in procs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            errors.append(f"$ {' '.join(cmd)}\n{err}")
    if errors:
        raise EmuError("emulation build failed:\n" + "\n".join(errors))


def build(shader_dir: Path = SHADER_DIR, files: Sequence[str] = SHADER_FILES,
          variant: str = "fast") -> Path:
    """Compile the shaders (cached) and return the path of the shared library."""
    shader_dir = Path(shader_dir).resolve()
    key = _hash_inputs(shader_dir, files, variant)
    out_dir = BUILD_ROOT / f"{variant}-{key}"
    lib_path = out_dir / "libfusedops_metal_emu.so"
    if lib_path.exists():
        return lib_path
    BUILD_ROOT.mkdir(parents=True, exist_ok=True)
    with open(BUILD_ROOT / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib_path.exists():
            return lib_path
        tmp = Path(tempfile.mkdtemp(prefix=f"{variant}-", dir=BUILD_ROOT))
        try:
            flags = [*COMMON_FLAGS, *VARIANT_FLAGS[variant]]
            inc = ["-I", str(SHIM_DIR), "-I", str(RUNTIME_DIR), "-I", str(shader_dir)]
            jobs, objs, manifest = [], [], []
            for name in files:
                shader = shader_dir / name
                kernels = scan_kernels(shader, [shader_dir])
                manifest += [f"{k.host_name} {k.n_buffers}" for k in kernels]
                src = tmp / f"{shader.stem}_emu.cpp"
                src.write_text(_wrapper_source(shader, kernels))
                obj = src.with_suffix(".o")
                jobs.append([CXX, *flags, *inc, "-c", str(src), "-o", str(obj)])
                objs.append(obj)
            _compile_all(jobs)
            rt_obj = _runtime_object(variant)
            link = [CXX, *flags, "-shared", "-o", str(tmp / lib_path.name),
                    *map(str, objs), str(rt_obj)]
            _compile_all([link])
            (tmp / "kernels.txt").write_text("\n".join(manifest) + "\n")
            if out_dir.exists():
                shutil.rmtree(out_dir)
            tmp.rename(out_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return lib_path


# ---------------------------------------------------------------------------------------------
# Loading and launching.

class EmuLibrary:
    """A loaded emulation library: raw launches with ctypes arguments."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lib = ctypes.CDLL(str(self.path))
        self.kernels: dict[str, int] = {}
        for line in (self.path.parent / "kernels.txt").read_text().split("\n"):
            if line.strip():
                name, n = line.split()
                self.kernels[name] = int(n)
        self._lib.emu_run.restype = ctypes.c_int
        self._lib.emu_set_timeout_ms.argtypes = [ctypes.c_int]
        self._lib.emu_set_mode.argtypes = [ctypes.c_int, ctypes.c_ulonglong]
        self._lib.emu_remove_barriers.argtypes = [ctypes.POINTER(ctypes.c_char_p),
                                                  ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        self._set_poison()

    def _set_poison(self) -> None:
        """Find the threadgroup variables (function-local statics in shader code, which Metal
        does not otherwise allow) and register them to be poisoned before every threadgroup."""
        res = subprocess.run(["objdump", "-t", str(self.path)],
                             capture_output=True, text=True, check=True, env=_tool_env())
        symbols = {}
        for line in res.stdout.splitlines():
            m = re.match(r"^([0-9a-f]+)\s.*?\s(\S+)\s+([0-9a-f]+)\s+(\S+)$", line)
            if m:
                symbols[m.group(4)] = (int(m.group(1), 16), int(m.group(3), 16), m.group(2))
        base = ctypes.cast(self._lib.emu_run, ctypes.c_void_p).value - symbols["emu_run"][0]
        # Function-local statics in writable sections, outside std:: and the runtime.
        regions = [(base + addr, size) for name, (addr, size, section) in symbols.items()
                   if name.startswith("_ZZ") and not name.startswith(("_ZZNSt", "_ZZN3emu"))
                   and size > 0 and section in (".bss", ".data")]
        n = len(regions)
        addrs = (ctypes.c_void_p * max(n, 1))(*[a for a, _ in regions])
        sizes = (ctypes.c_size_t * max(n, 1))(*[s for _, s in regions])
        self._lib.emu_set_poison(addrs, sizes, n)
        self.threadgroup_variables = n

    MODES = {"threads": 0, "fibers": 1, "fibers-random": 2}

    def set_mode(self, mode: str, seed: int = 1) -> None:
        """Run threadgroups as OS threads, or as fibers in FIFO / seeded random order."""
        if self._lib.emu_set_mode(self.MODES[mode], seed) != 0:
            raise EmuError(f"mode {mode!r} is not available in {self.path.parent.name}")

    @property
    def mode(self) -> str:
        return {v: k for k, v in self.MODES.items()}[self._lib.emu_get_mode()]

    def set_timeout(self, seconds: float) -> None:
        self._lib.emu_set_timeout_ms(int(seconds * 1000))

    def remove_barriers(self, sites: Sequence[tuple[str, int]] | None) -> None:
        """Make the ``threadgroup_barrier`` calls at ``sites`` ((shader file name, line), as
        :func:`barrier_sites` lists them) return at once, as if deleted from the shaders;
        ``None`` removes every barrier, ``[]`` restores them all. The same compiled library
        serves every such variant (no rebuild per removed barrier)."""
        if sites is None:
            self._lib.emu_remove_barriers(None, None, -1)
            return
        files = (ctypes.c_char_p * max(len(sites), 1))(*[f.encode() for f, _ in sites])
        lines = (ctypes.c_int * max(len(sites), 1))(*[line for _, line in sites])
        self._lib.emu_remove_barriers(files, lines, len(sites))

    @contextlib.contextmanager
    def barriers_removed(self, sites: Sequence[tuple[str, int]] | None) -> Iterator[None]:
        """:meth:`remove_barriers` for the duration of a ``with`` block."""
        self.remove_barriers(sites)
        try:
            yield
        finally:
            self.remove_barriers([])

    def signature(self, name: str) -> list[tuple[int, int, bool]]:
        """Per buffer slot: (kind, element or scalar size, pointee is const)."""
        n = self.kernels[name]
        kinds = (ctypes.c_int * n).in_dll(self._lib, f"emu_kinds_{name}")
        sizes = (ctypes.c_int * n).in_dll(self._lib, f"emu_sizes_{name}")
        consts = (ctypes.c_int * n).in_dll(self._lib, f"emu_consts_{name}")
        return [(kinds[i], sizes[i], bool(consts[i])) for i in range(n)]

    def launch_raw(self, name: str, pointers: Sequence[int | None],
                   grid: Sequence[int], tg: Sequence[int]) -> None:
        if name not in self.kernels:
            raise EmuError(f"no kernel named {name!r} in the emulation library")
        fn = getattr(self._lib, f"emu_kernel_{name}")
        argv = (ctypes.c_void_p * max(len(pointers), 1))(*pointers)
        g = (ctypes.c_uint * 3)(*(list(grid) + [1] * (3 - len(grid))))
        t = (ctypes.c_uint * 3)(*(list(tg) + [1] * (3 - len(tg))))
        err = ctypes.create_string_buffer(2048)
        if fn(argv, g, t, err, len(err)) != 0:
            raise EmuError(f"{name}: {err.value.decode(errors='replace')}")


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
GUARD = 64  # elements of poison before and after each bound tensor


class _Guarded:
    """A copy of tensor ``t`` in a poisoned buffer, at the same alignment modulo 16 bytes."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        es = t.element_size()
        self.span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) \
            if t.numel() > 0 else 0
        self.lead = GUARD + t.storage_offset() % 16
        self.buf = torch.empty(self.lead + self.span + GUARD, dtype=t.dtype)
        self.buf.view(torch.uint8).fill_(0xFF)
        self.inner = self.buf[self.lead:self.lead + self.span]
        self.view = self.inner.as_strided(t.shape, t.stride()) if t.numel() > 0 else None
        self.covered = torch.zeros(self.span, dtype=torch.bool)
        if self.span:
            # Element positions inside the span (rows may overlap, e.g. a stride-0 row).
            pos = torch.arange(self.span).as_strided(t.shape, t.stride()).reshape(-1)
            self.inner[pos] = t.reshape(-1)
            self.covered[pos] = True
        self.ints = _INT_VIEW[es]
        self.before = self.inner.view(self.ints).clone() if self.span else None

    @property
    def pointer(self) -> int:
        return self.buf.data_ptr() + self.lead * self.t.element_size()

    def check(self, slot: int, const: bool) -> None:
        raw = self.buf.view(self.ints)
        outside = torch.cat([raw[: self.lead], raw[self.lead + self.span:]])
        if self.span:
            outside = torch.cat([outside, raw[self.lead:self.lead + self.span][~self.covered]])
        if bool((outside != -1).any()):
            raise EmuError(f"buffer({slot}): the kernel wrote outside the tensor")
        if self.view is None:
            return
        if const:
            if not torch.equal(self.inner.view(self.ints), self.before):
                raise EmuError(f"buffer({slot}) is const but the kernel changed it")
        else:
            self.t.copy_(self.view)


class EmuLauncher:
    """The ``fusedops.backends.metal`` launcher protocol on top of the emulation.

    ``launcher(name, args, groups, threads)`` mirrors
    ``torch.mps.compile_shader(...).<name>(*args, threads=groups*threads, group_size=threads)``:
    argument ``i`` is bound to ``[[buffer(i)]]``, tensors by address (storage offset included),
    Python ints as 64-bit and floats as 32-bit scalars. ``max_threads`` plays the pipeline's
    ``maxTotalThreadsPerThreadgroup``.
    """

    def __init__(self, lib: EmuLibrary, max_threads: int = 1024):
        self.lib = lib
        self._max_threads = max_threads
        self.calls: list[tuple[str, int, int]] = []

    def has(self, name: str) -> bool:
        return name in self.lib.kernels

    def max_threads(self, name: str) -> int:
        return self._max_threads

    def __call__(self, name: str, args: Sequence, groups: int, threads: int) -> None:
        if threads > self._max_threads:
            raise EmuError(f"{name}: threadgroup size {threads} exceeds {self._max_threads}")
        sig = self.lib.signature(name)
        if len(args) != len(sig):
            raise EmuError(f"{name}: {len(args)} arguments for {len(sig)} buffer slots")
        keep, pointers, guarded = [], [], []
        for i, (a, (kind, size, const)) in enumerate(zip(args, sig, strict=True)):
            if isinstance(a, torch.Tensor):
                if kind != KIND_POINTER:
                    raise EmuError(f"{name}: buffer({i}) is a scalar but got a tensor")
                if a.numel() > 0 and a.element_size() != size:
                    raise EmuError(f"{name}: buffer({i}) holds {size}-byte elements, "
                                   f"got {a.dtype}")
                g = _Guarded(a)
                guarded.append((i, g, const))
                pointers.append(g.pointer)
            elif isinstance(a, bool) or not isinstance(a, int | float):
                raise EmuError(f"{name}: unsupported argument {type(a).__name__}")
            elif isinstance(a, int):
                if kind != KIND_INT or size != 8:
                    raise EmuError(f"{name}: buffer({i}) is not a 64-bit integer scalar")
                c = ctypes.c_int64(a)
                keep.append(c)
                pointers.append(ctypes.addressof(c))
            else:
                if kind != KIND_FLOAT or size != 4:
                    raise EmuError(f"{name}: buffer({i}) is not a float scalar")
                c = ctypes.c_float(a)
                keep.append(c)
                pointers.append(ctypes.addressof(c))
        self.calls.append((name, groups, threads))
        self.lib.launch_raw(name, pointers, (groups,), (threads,))
        for i, g, const in guarded:
            g.check(i, const)


class FakeExtension:
    """Base of the tests' stand-ins for ``fusedops._metal_ext``: the extension's bindings (each
    subclass adds those of its op, with the parameter names the extension declares) run the
    host code on this emulation, through ``self.L``; ``calls`` records what they were asked."""

    def __init__(self, lib: EmuLibrary, max_threads: int = 256):
        self.L = EmuLauncher(lib, max_threads)
        self.calls: list = []

    def initialize(self) -> None:
        pass

    def kernel_names(self) -> list[str]:
        return list(self.L.lib.kernels)


_cache: dict[tuple, EmuLibrary] = {}


def load(shader_dir: Path = SHADER_DIR, files: Sequence[str] = SHADER_FILES,
         variant: str = "fast") -> EmuLibrary:
    """Build (cached on disk) and load (cached per process) an emulation library."""
    path = build(shader_dir, files, variant)
    key = (str(path),)
    if key not in _cache:
        _cache[key] = EmuLibrary(path)
    return _cache[key]


# ---------------------------------------------------------------------------------------------
# Barrier sites (the teeth tests remove them at run time: EmuLibrary.remove_barriers).

BARRIER = re.compile(r"threadgroup_barrier\s*\([^;]*\)\s*;")


def barrier_sites(shader_dir: Path = SHADER_DIR) -> list[tuple[str, int]]:
    """Every threadgroup_barrier call in the shaders: (file name, line), in a fixed order."""
    sites = []
    for path in sorted(Path(shader_dir).glob("*.metal")):
        text = path.read_text()
        sites += [(path.name, text.count("\n", 0, m.start()) + 1)
                  for m in BARRIER.finditer(text)]
    return sites
