"""The caches that hold launch-rule results: cleared together whenever a rule changes
(``configs.override``, ``set_single_block_limit``) or the split-row kernels or clusters are
disabled."""

from __future__ import annotations

import functools

config_caches: list = []

# Call signatures whose launch configuration a host file keeps (per op and direction); a
# workload cycling through more recomputes the rules, as every call did before caching.
MAX_SIGNATURES = 4096


def config_cache(fn):
    """functools.cache that ``set_single_block_limit`` also clears."""
    cached = functools.cache(fn)
    config_caches.append(cached)
    return cached


def signature_cache(fn):
    """functools.lru_cache of MAX_SIGNATURES entries, cleared with the other config caches: the
    host files' memo of ``configs.<op>.forward_config`` / ``backward_config`` per call
    signature."""
    cached = functools.lru_cache(maxsize=MAX_SIGNATURES)(fn)
    config_caches.append(cached)
    return cached
