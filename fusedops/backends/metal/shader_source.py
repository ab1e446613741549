"""The one Metal source handed to the compiler, built from ``metal/*.metal``.

Standard library only, so ``csrc/embed_shaders.py`` can load this file by path at build time
(without importing fusedops or torch) and embed exactly the source that ``fusedops.backends.metal``
hands to ``torch.mps.compile_shader`` at run time.
"""

from __future__ import annotations

import re
from pathlib import Path

SHADER_FILES = ("softmax.metal", "layernorm.metal", "rmsnorm.metal", "softmax_masked.metal",
                "layernorm_epilogue.metal")
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)


def inline_includes(path: Path, seen: set[str] | None = None) -> str:
    """``path``'s text with each ``#include "file"`` (relative to its folder) replaced by that
    file's text, each file at most once."""
    seen = set() if seen is None else seen
    seen.add(path.name)

    def repl(m: re.Match) -> str:
        name = m.group(1)
        if name in seen:
            return f"// (already included: {name})"
        return inline_includes(path.parent / name, seen)

    return _INCLUDE.sub(repl, path.read_text(encoding="ascii"))


def library_source(directory: Path) -> str:
    """Every kernel in one source: the shader files of ``directory`` with includes inlined."""
    seen: set[str] = set()
    return "\n".join(inline_includes(Path(directory) / f, seen) for f in SHADER_FILES)
