"""Process-wide choices that trade speed for something else (today: LayerNorm backward memory).

``FUSEDOPS_LAYERNORM_BACKWARD`` (``fast`` or ``low_memory``) sets the initial value.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from fusedops import _replay

LAYERNORM_BACKWARD_MODES = ("fast", "low_memory")
_state = {"layernorm_backward": "low_memory"}


def set_layernorm_backward(mode: str) -> None:
    """How the CUDA (Triton) LayerNorm backward keeps its dweight/dbias scratch.

    The fused and long-row kernels read x and dy once (3 passes over memory); each program
    accumulates float32 dweight/dbias partials, summed afterwards in a fixed order.

    ``"low_memory"`` (default): no scratch beyond the outputs, so peak memory is no larger
    than PyTorch's: the partials (and the long-row kernel's per-row statistics) are parked at
    the end of dx's storage (allocated, not yet written); once they are summed, a second
    launch writes the dx of those last rows (at most 1/8 of them, read twice). Measured 1-3%
    slower than ``"fast"`` at most shapes, up to 7% at unaligned 16-bit rows (H100,
    2026-11-21). Without a dx to park in (x needs no gradient), or with too few rows to hold
    the partials, dweight/dbias come from a column pass straight into the outputs (slower for
    many rows).

    ``"fast"``: the scratch in separate memory (at most 1/8 of x's bytes, so peak memory up
    to a few percent above PyTorch's), one launch.

    Both modes are deterministic and give the same bits wherever both use the partials
    (every shape with a dx and 8 or more rows).
    """
    if mode not in LAYERNORM_BACKWARD_MODES:
        raise ValueError(f"mode must be one of {LAYERNORM_BACKWARD_MODES}, got {mode!r}")
    if _state["layernorm_backward"] != mode:
        _replay.LAYERNORM_NODE.clear()  # (nodes replay the backward of the mode they saw)
    _state["layernorm_backward"] = mode


def get_layernorm_backward() -> str:
    """The current LayerNorm backward mode (see :func:`set_layernorm_backward`)."""
    return _state["layernorm_backward"]


@contextlib.contextmanager
def layernorm_backward_mode(mode: str) -> Iterator[None]:
    """``with fusedops.layernorm_backward_mode("fast"):`` for a block of code."""
    old = get_layernorm_backward()
    set_layernorm_backward(mode)
    try:
        yield
    finally:
        set_layernorm_backward(old)


set_layernorm_backward(os.environ.get("FUSEDOPS_LAYERNORM_BACKWARD", "low_memory")
                       or "low_memory")
