"""Build script.

Everything declarative lives in pyproject.toml. This file exists for two jobs that need code:

* copy the Metal shader sources (``metal/*.metal``, the single source of truth) into the package
  as ``fusedops/_shaders`` so the ``torch.mps.compile_shader`` fallback and the CPU emulation can
  find them in an installed wheel;
* build the Objective-C++ Metal extension (``csrc/*.mm``) on macOS;
* build the C++ host extension (``csrc/host/``, ``fusedops._host_ext``: replayed Triton launches
  behind C++ autograd nodes, and small calls routed to torch's ops) on Linux where torch is
  importable at build time (``pip install --no-build-isolation .``) and a C++ compiler exists;
  with the CUDA toolkit (``CUDA_HOME``) it launches kernels, without it only its routing and its
  tests' dry run work. It is optional:
  without it (``pip install .`` in pip's isolated build, ``FUSEDOPS_NO_HOST_EXT=1``, or a failed
  compile) fusedops takes its Python paths.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHADER_SRC = ROOT / "metal"


class BuildPyWithShaders(build_py):
    """Copies metal/*.metal into the built package (fusedops/_shaders/)."""

    def run(self) -> None:
        super().run()
        dest = Path(self.build_lib) / "fusedops" / "_shaders"
        dest.mkdir(parents=True, exist_ok=True)
        for src in sorted(SHADER_SRC.glob("*.metal")):
            shutil.copy2(src, dest / src.name)


def metal_extension_kwargs() -> dict:
    """The macOS-only extension; an empty dict elsewhere (or when FUSEDOPS_NO_METAL=1)."""
    if sys.platform != "darwin" or os.environ.get("FUSEDOPS_NO_METAL") == "1":
        return {}
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.mm"))
    if not sources:
        return {}
    # torch is needed only here, at build time, on macOS.
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    sys.path.insert(0, str(ROOT / "csrc"))
    from embed_shaders import write_embedded_header  # noqa: E402

    write_embedded_header(SHADER_SRC, ROOT / "csrc" / "shaders_embedded.h")
    ext = CppExtension(
        name="fusedops._metal_ext",
        sources=sources,
        # No -std here: torch.utils.cpp_extension adds the standard its headers need
        # (C++17 for older PyTorch, C++20 for current releases).
        extra_compile_args=["-ObjC++", "-fobjc-arc", "-O3"],
        extra_link_args=["-framework", "Metal", "-framework", "Foundation"],
    )

    class BuildExtWithShaders(BuildExtension):
        pass

    return {"ext_modules": [ext], "cmdclass_ext": BuildExtWithShaders}


def host_extension_kwargs() -> dict:
    """The Linux host extension; an empty dict where torch is not importable (pip's isolated
    build) or FUSEDOPS_NO_HOST_EXT=1."""
    if not sys.platform.startswith("linux") or os.environ.get("FUSEDOPS_NO_HOST_EXT") == "1":
        return {}
    try:
        from torch.utils import cpp_extension
    except ImportError:
        return {}
    sources = ["csrc/host/replay.cpp", "csrc/host/node.cpp", "csrc/host/route.cpp"]
    if cpp_extension.CUDA_HOME is not None:
        ext = cpp_extension.CUDAExtension(
            name="fusedops._host_ext", sources=sources,
            define_macros=[("FUSEDOPS_WITH_CUDA", None)], extra_compile_args={"cxx": ["-O2"]})
    else:
        ext = cpp_extension.CppExtension(name="fusedops._host_ext", sources=sources,
                                         extra_compile_args=["-O2"])
    ext.optional = True  # a failed compile leaves the Python paths, never a failed install
    return {"ext_modules": [ext], "cmdclass_ext": cpp_extension.BuildExtension}


kwargs = metal_extension_kwargs() or host_extension_kwargs()
cmdclass: dict = {"build_py": BuildPyWithShaders}
if "cmdclass_ext" in kwargs:
    cmdclass["build_ext"] = kwargs.pop("cmdclass_ext")
setup(cmdclass=cmdclass, **kwargs)
