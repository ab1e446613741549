"""softmax_masked launch rules."""

from __future__ import annotations
