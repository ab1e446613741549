"""Process-wide choices that trade speed for something else (today: LayerNorm backward memory).

``FUSEDOPS_LAYERNORM_BACKWARD`` (``fast`` or ``low_memory``) sets the initial value.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

LAYERNORM_BACKWARD_MODES = ("fast", "low_memory")
_state = {"layernorm_backward": "fast"}


def set_layernorm_backward(mode: str) -> None:
    """How the CUDA (Triton) LayerNorm backward computes dweight/dbias.

    ``"fast"`` (default): x and dy are read once (3 passes over memory); each program keeps
    float32 dweight/dbias partials that are then summed in a fixed order. The partials (and the
    long-row kernel's per-row statistics) are scratch memory (at most 1/8 of x's bytes), so
    peak memory is a few percent above PyTorch's.

    ``"low_memory"``: no scratch beyond the outputs, so peak memory is no larger than
    PyTorch's: the same kernels park their scratch at the end of dx's storage (allocated, not
    yet written), and a second launch writes the dx of those last rows once the partials are
    summed. Those rows are read twice; measured 0-27% slower than ``"fast"`` (more for long
    rows; H200). Without a dx to park in (x needs no gradient), dweight/dbias come from a
    column pass straight into the outputs (slow for many rows). Results are deterministic in
    both modes, but the two modes round differently, so they are not bitwise equal to each
    other.
    """
    if mode not in LAYERNORM_BACKWARD_MODES:
        raise ValueError(f"mode must be one of {LAYERNORM_BACKWARD_MODES}, got {mode!r}")
    _state["layernorm_backward"] = mode


def get_layernorm_backward() -> str:
    """The current LayerNorm backward mode (see :func:`set_layernorm_backward`)."""
    return _state["layernorm_backward"]


@contextlib.contextmanager
def layernorm_backward_mode(mode: str) -> Iterator[None]:
    """``with fusedops.layernorm_backward_mode("low_memory"):`` for a block of code."""
    old = get_layernorm_backward()
    set_layernorm_backward(mode)
    try:
        yield
    finally:
        set_layernorm_backward(old)


set_layernorm_backward(os.environ.get("FUSEDOPS_LAYERNORM_BACKWARD", "fast") or "fast")
