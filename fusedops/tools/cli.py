"""Pieces every ``python -m fusedops`` command shares: the error type for bad input, argparse
number types, the device check, ``--threads`` and the optional plotting dependency.

A tool signals bad input (an unknown name, a missing or unreadable target, a device this machine
lacks) by raising :class:`UsageError`; ``fusedops.__main__`` prints it as one line on stderr and
exits 2. Nothing else in the tools needs a try/except for that.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

import torch

DEVICE_TYPES = ("cuda", "mps", "cpu")
PLOTS_SKIPPED = "plots skipped: pip install 'fusedops[tools]'"


class UsageError(ValueError):
    """Bad input from the command line or a caller: the message names the problem in one line.

    A ``ValueError``, so library callers that catch ``ValueError`` keep working."""


@contextlib.contextmanager
def bad_input(what: str, *types: type[BaseException]) -> Iterator[None]:
    """Re-raise the exceptions of ``types`` (default: any ``Exception``) raised inside as
    :class:`UsageError` ``"<what>: <Type>: <message>"`` (first line only)."""
    catch = types or (Exception,)
    try:
        yield
    except UsageError:
        raise
    except catch as exc:
        text = str(exc).strip().splitlines()
        detail = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
        raise UsageError(f"{what}: {detail}") from exc


# --- argparse types ------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = nonnegative_float(text)
    if value == 0.0:
        raise argparse.ArgumentTypeError("must be greater than 0, got 0")
    return value


# --- devices -------------------------------------------------------------------------------------


def mps_available() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def best_device_type() -> str:
    """cuda if available, else mps, else cpu."""
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if mps_available() else "cpu"


def check_device(name: str | torch.device | None) -> torch.device:
    """``name`` as a ``torch.device`` (None: the best one present), after checking that this
    machine has it; :class:`UsageError` otherwise."""
    if name is None or name == "":
        return torch.device(best_device_type())
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise UsageError(f"unknown device {str(name)!r}; use one of {', '.join(DEVICE_TYPES)}"
                         " (cuda:N for a given GPU)") from None
    if device.type not in DEVICE_TYPES:
        raise UsageError(f"unsupported device {str(name)!r}; use one of "
                         f"{', '.join(DEVICE_TYPES)}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA" if torch.version.cuda is None
                   else "no CUDA GPU is visible")
            raise UsageError(f"--device {name}: CUDA is not available ({why})")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UsageError(f"--device {name}: this machine has {count} CUDA device(s)")
    if device.type == "mps" and not mps_available():
        raise UsageError(f"--device {name}: MPS is not available on this machine")
    return device


# --- threads -------------------------------------------------------------------------------------


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[int]:
    """Run the block with ``torch.set_num_threads(n)`` (``n`` None: unchanged), restoring the
    previous count after; yields the count in effect."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(int(n))
    try:
        yield torch.get_num_threads()
    finally:
        if n:
            torch.set_num_threads(before)


# --- optional plotting ---------------------------------------------------------------------------


def can_plot(stream=None) -> bool:
    """True when matplotlib imports; otherwise print one line on ``stream`` (default stderr)
    saying that the plots are skipped and how to get them, and return False."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(PLOTS_SKIPPED, file=stream if stream is not None else sys.stderr, flush=True)
        return False
    return True
