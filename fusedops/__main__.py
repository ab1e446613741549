"""Command line: ``python -m fusedops <command> [options]`` (``--help`` on each command).

Bad input (an unknown name or target, a missing file, a device this machine lacks) ends a
command with one line on stderr and exit status 2 (:class:`fusedops.tools.cli.UsageError`; a file
that cannot be read or written: exit status 1). Set ``FUSEDOPS_DEBUG=1`` to get the traceback
instead.
"""

from __future__ import annotations

import importlib
import os
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
USAGE = "usage: python -m fusedops [--version] <command> [options]"


def usage() -> str:
    lines = [USAGE, "", "commands:"]
    lines += [f"  {name:<13} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "python -m fusedops <command> --help: that command's options"]
    return "\n".join(lines)


def run_command(name: str, argv: list[str] | None = None) -> int:
    """Run one command's ``main(argv)``; bad input becomes one line on stderr and a non-zero
    exit status (2: a bad argument, target or device; 1: a file that cannot be read or written;
    130: interrupted)."""
    from fusedops.tools.cli import UsageError

    argv = list(sys.argv[1:] if argv is None else argv)
    module = importlib.import_module(f"fusedops.tools.{COMMANDS[name][0]}")
    try:
        return int(module.main(argv) or 0)
    except (UsageError, OSError, KeyboardInterrupt) as exc:
        if os.environ.get("FUSEDOPS_DEBUG"):
            raise
        if isinstance(exc, KeyboardInterrupt):
            print(f"fusedops {name}: interrupted", file=sys.stderr)
            return 130
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        print(f"fusedops {name}: error: {lines[0]}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from fusedops import __version__

        print(f"fusedops {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"fusedops: unknown command {name!r}; commands: {', '.join(COMMANDS)} "
              "(try --help)", file=sys.stderr)
        return 2
    return run_command(name, rest)


if __name__ == "__main__":
    sys.exit(main())
