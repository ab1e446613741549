"""The caches that hold launch-rule results: cleared together whenever a rule changes
(``configs.override``, ``set_single_block_limit``) or the split-row kernels are disabled."""

from __future__ import annotations

import functools

config_caches: list = []


def config_cache(fn):
    """functools.cache that ``set_single_block_limit`` also clears."""
    cached = functools.cache(fn)
    config_caches.append(cached)
    return cached
