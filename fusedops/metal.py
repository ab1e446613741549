"""Metal backend for Apple GPUs (placeholder until the Metal issue lands)."""

from __future__ import annotations

NAME = "metal"


def is_available() -> bool:
    """True when a Metal kernel path can run in this process."""
    return False
