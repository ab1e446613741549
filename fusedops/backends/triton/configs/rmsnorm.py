"""rmsnorm launch rules."""

from __future__ import annotations
