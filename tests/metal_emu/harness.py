"""Helpers shared by the Metal emulation suites (tests/test_metal_*.py): the emulated device,
test layouts, a launcher that remembers its arguments, and the extension's declared bindings."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from metal_emu import emu

REPO = Path(__file__).resolve().parent.parent.parent


def launcher(lib: emu.EmuLibrary, max_threads: int, seed: int = 0) -> emu.EmuLauncher:
    """The emulated device: fibers in a random order drawn from ``seed`` (reproducible)."""
    lib.set_mode("fibers-random", seed + 1)
    return emu.EmuLauncher(lib, max_threads)


class Recorder(emu.EmuLauncher):
    """The emulated device (fibers in a seeded random order) remembering each launch's args."""

    def __init__(self, lib: emu.EmuLibrary, max_threads: int, seed: int = 0):
        lib.set_mode("fibers-random", seed + 1)
        super().__init__(lib, max_threads)
        self.args: list[list] = []

    def __call__(self, name, args, groups, threads):
        self.args.append(list(args))
        super().__call__(name, args, groups, threads)


def rows(m: int, n: int, dtype: torch.dtype, layout: str = "contiguous", scale: float = 1.0,
         shift: float = 0.0) -> torch.Tensor:
    """(m, n) test input in one of several memory layouts."""
    data = lambda k: (torch.randn(m, k, dtype=torch.float64) * scale + shift).to(dtype)
    if layout == "contiguous":
        return data(n)
    if layout == "misaligned":  # storage offset 1, row stride n + 3
        return data(n + 3)[:, 1:n + 1]
    if layout == "aligned-strided":  # storage offset 4, row stride n + 4 + (-n % 4)
        pad = 4 + (-n % 4)
        return data(n + pad)[:, 4:4 + n]
    if layout == "broadcast":  # row stride 0
        return data(n)[:1].expand(m, n)
    raise AssertionError(layout)


def mm_bindings() -> dict[str, list[str]]:
    """name -> py::arg names of every m.def in the extension (csrc/fusedops_metal.mm)."""
    text = (REPO / "csrc" / "fusedops_metal.mm").read_text()
    out = {}
    for name, rest in re.findall(r'm\.def\("(\w+)",(.*?)\);', text, re.DOTALL):
        out[name] = re.findall(r'py::arg\("(\w+)"\)', rest)
    return out
