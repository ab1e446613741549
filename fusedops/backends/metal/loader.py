"""Which Metal path runs (the extension, ``torch.mps.compile_shader``, or none) and where the
shader sources are."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

from fusedops.backends.metal import shader_source as _shader_source
from fusedops.backends.metal.rules import (
    LAYERNORM_EPILOGUE_TYPES,
    LAYERNORM_TYPES,
    RMSNORM_TYPES,
    SHADER_FILES,
    SOFTMAX_BWD_TYPES,
    SOFTMAX_FWD_TYPES,
    SOFTMAX_MASKED_BWD_TYPES,
    SOFTMAX_MASKED_FWD_TYPES,
    TYPE_NAMES,
)


def shader_dir() -> Path | None:
    """Where the .metal sources are: the installed package, else the source checkout."""
    package = Path(__file__).resolve().parents[2]  # fusedops/
    for d in (package / "_shaders", package.parent / "metal"):
        if all((d / f).is_file() for f in SHADER_FILES):
            return d
    return None


def library_source(directory: Path | None = None) -> str:
    """One Metal source holding every kernel: the shader files with their includes inlined."""
    directory = shader_dir() if directory is None else directory
    if directory is None:
        raise FileNotFoundError("fusedops: Metal shader sources not found")
    return _shader_source.library_source(directory)


class ShaderLauncher:
    """The launcher protocol on ``torch.mps.compile_shader`` (the extension-less path)."""

    def __init__(self, source: str):
        self._lib = torch.mps.compile_shader(source)
        try:
            self._names = set(dir(self._lib))
        except Exception:  # pragma: no cover - older torch without __dir__
            self._names = None
        self.kernel_names: dict[str, object] = {}
        self._max: dict[str, int] = {}

    def _kernel(self, name: str):
        k = self.kernel_names.get(name)
        if k is None:
            k = self.kernel_names[name] = getattr(self._lib, name)
            self._max[name] = int(getattr(k, "max_threads_per_threadgroup", 256))
        return k

    def has(self, name: str) -> bool:
        if self._names is not None:
            return name in self._names
        try:  # pragma: no cover
            self._kernel(name)
        except Exception:  # pragma: no cover
            return False
        return True  # pragma: no cover

    def max_threads(self, name: str) -> int:
        self._kernel(name)
        return self._max[name]

    def __call__(self, name: str, args: list, groups: int, threads: int) -> None:
        self._kernel(name)(*args, threads=groups * threads, group_size=threads)


class Extension:
    """The compiled extension, with the dtype pairs its library has kernels for."""

    def __init__(self, ext):
        ext.initialize()  # compiles the embedded shaders once; raises if Metal rejects them
        self.ext = ext
        names = set(ext.kernel_names())
        dtypes = {v: k for k, v in TYPE_NAMES.items()}

        def pairs(op: str, supported: set) -> set:
            return {(dtypes[a], dtypes[b]) for a, b in supported
                    if f"fusedops_{op}_single_{a}_{b}" in names
                    and f"fusedops_{op}_looped_{a}_{b}" in names}

        self.softmax_fwd = pairs("softmax_fwd", SOFTMAX_FWD_TYPES)
        self.softmax_bwd = pairs("softmax_bwd", SOFTMAX_BWD_TYPES)
        self.layernorm_fwd = pairs("layernorm_fwd", LAYERNORM_TYPES)
        self.layernorm_bwd = pairs("layernorm_bwd", LAYERNORM_TYPES)
        self.rmsnorm_fwd = pairs("rmsnorm_fwd", RMSNORM_TYPES)
        self.rmsnorm_bwd = pairs("rmsnorm_bwd", RMSNORM_TYPES)
        # Masked softmax forward: the (x, y) pairs with kernels for every mask kind.
        fwd = {(a, b) for a, b, _ in SOFTMAX_MASKED_FWD_TYPES}
        self.softmax_masked_fwd = {
            (dtypes[a], dtypes[b]) for a, b in fwd
            if all(f"fusedops_softmax_masked_fwd_{v}_{a}_{b}_{k}" in names
                   for v in ("single", "looped") for k in ("bool", a, "float"))}
        self.softmax_masked_bwd = pairs("softmax_masked_bwd", SOFTMAX_MASKED_BWD_TYPES)
        self.layernorm_epilogue_fwd = pairs("layernorm_epilogue_fwd", LAYERNORM_EPILOGUE_TYPES)
        self.layernorm_epilogue_bwd = pairs("layernorm_epilogue_bwd", LAYERNORM_EPILOGUE_TYPES)


impl: object = None  # an Extension, a ShaderLauncher, or False (nothing works)


def _warn(msg: str) -> None:
    warnings.warn(f"fusedops: {msg}", UserWarning, stacklevel=3)


def _load_impl() -> object:
    if sys.platform != "darwin":
        return False
    try:
        if not torch.backends.mps.is_available():
            return False
    except Exception:
        return False
    try:
        from fusedops import _metal_ext  # type: ignore[attr-defined]
    except ImportError:
        _metal_ext = None
    if _metal_ext is not None:
        try:
            return Extension(_metal_ext)
        except Exception as e:  # pragma: no cover - needs a Mac
            _warn(f"the Metal extension failed to initialise ({e}); trying compile_shader")
    if hasattr(torch.mps, "compile_shader"):
        try:
            return ShaderLauncher(library_source())
        except Exception as e:  # pragma: no cover - needs a Mac
            _warn(f"torch.mps.compile_shader could not build the fusedops shaders ({e})")
    return False


def get_impl() -> object:
    global impl
    if impl is None:
        impl = _load_impl()
    if impl is False:
        raise RuntimeError("fusedops: the Metal backend is not available in this process "
                           "(needs macOS with an MPS device); see "
                           "fusedops.backends.metal.is_available()")
    return impl


def is_available() -> bool:
    """True when a Metal kernel path can run in this process (cached; False off macOS)."""
    global impl
    if impl is None:
        impl = _load_impl()
    return impl is not False


def implementation() -> str:
    """Which Metal path runs: ``"extension"``, ``"compile_shader"`` or ``"none"``."""
    if not is_available():
        return "none"
    return "compile_shader" if isinstance(impl, ShaderLauncher) else "extension"
