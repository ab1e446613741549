"""Command line: ``python -m fusedops <command> [options]`` (``--help`` on each command)."""

from __future__ import annotations

import importlib
import sys

# command -> (module under fusedops.tools, one-line help). Each module has ``main(argv) -> int``.
COMMANDS = {
    "demo": ("demo", "profile -> patch -> verify -> re-profile the predictor (the main job)"),
    "profile": ("profile", "profile a model: per-op table, dispatch tax, Amdahl bound"),
    "train": ("train", "train the built-in predictor on its synthetic task"),
    "bench": ("bench", "kernel benchmark sweep vs torch eager / torch.compile / Liger"),
    "bench-chains": ("bench_chains", "fused epilogue chains vs the eager chain / torch.compile"),
    "bench-models": ("bench_models", "whole models: eager / patched / compiled / compiled+patched"),
    "verify": ("verify", "check the fused ops against PyTorch on this machine"),
    "amdahl": ("amdahl", "Amdahl's law from per-op fractions and speed-ups"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m fusedops <command> [options]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<8} {help_text}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}; try --help", file=sys.stderr)
        return 2
    module = importlib.import_module(f"fusedops.tools.{COMMANDS[name][0]}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
