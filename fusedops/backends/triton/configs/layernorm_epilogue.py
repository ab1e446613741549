"""layernorm_epilogue launch rules."""

from __future__ import annotations
