"""Launch rules of the Triton backend as data: one module per op, shared rules in ``common``.

Each module holds its rule tables and thresholds (UPPER_CASE data, each with the measurement
that chose it) and the pure functions that read them (shape, dtype, strides and device facts
in; a configuration out; nothing allocated, nothing launched), ending in the op's whole
decision, ``forward_config`` / ``backward_config``: a NamedTuple of the kernel variant and
every launch parameter (``rmsnorm`` keeps its rule functions). The host file of each op
(``triton/<op>.py``) memoizes the decision per call signature and dispatches on the variant.

:func:`override` is the one way to change rules, for experiments and tests::

    from fusedops.backends.triton import configs

    with configs.override("layernorm", UNROLLED_FWD={}, FUSED_BWD_MAX_BLOCK=0):
        ...  # every call in the block sees the changed rules
    with configs.override(SPLIT_ROWS=False, SINGLE_BLOCK_LIMIT=256):
        ...

Any module-level name of a rules module can be replaced (tables, thresholds, and rule
functions, e.g. ``split_config=lambda *a, **k: (8192, 8, 1)`` to force the split-row
configuration); ``op`` may be left out where the name is defined by one module only. Switches
(also set from the environment at import, ``docs/api.md``): ``SINGLE_BLOCK_LIMIT`` (a power of
two >= 16), ``SPLIT_ROWS`` (``FUSEDOPS_SPLIT_ROWS``), ``CLUSTERS`` (``FUSEDOPS_CLUSTERS``),
``ROW_BODY`` (``FUSEDOPS_ROW_BODY``) and ``layernorm``'s ``BWD_PLANS`` (``FUSEDOPS_BWD_PLANS``).
Launch-config caches (the hosts' per-signature memos among them) and replay plans are dropped
on entry and on exit, so nothing decided under one set of rules serves a call under another.
Overrides are process-wide (not per thread).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import ModuleType

from fusedops.backends.triton.configs import (
    common,
    layernorm,
    layernorm_epilogue,
    rmsnorm,
    softmax,
    softmax_masked,
)
from fusedops.backends.triton.runtime import clusters as _clusters
from fusedops.backends.triton.runtime import split as _split
from fusedops.backends.triton.runtime.caches import config_caches

OPS: dict[str, ModuleType] = {
    "common": common,
    "softmax": softmax,
    "softmax_masked": softmax_masked,
    "layernorm": layernorm,
    "layernorm_epilogue": layernorm_epilogue,
    "rmsnorm": rmsnorm,
}
# Host modules of each op: they bind its rules by name at import.
_HOSTS = {
    "softmax": ("softmax",),
    "softmax_masked": ("softmax_masked",),
    "layernorm": ("layernorm", "layernorm_bwd"),
    "layernorm_epilogue": ("layernorm_epilogue",),
    "rmsnorm": ("rmsnorm",),
}
_PACKAGE = "fusedops.backends.triton."
_SWITCHES = {
    "SINGLE_BLOCK_LIMIT": (common.single_block_limit, common.set_single_block_limit),
    "SPLIT_ROWS": (lambda: _split.SPLIT_STATE["enabled"],
                   lambda v: _split.SPLIT_STATE.__setitem__("enabled", bool(v))),
    "CLUSTERS": (lambda: _clusters.CLUSTER_STATE["enabled"],
                 lambda v: _clusters.CLUSTER_STATE.__setitem__("enabled", bool(v))),
    "ROW_BODY": (lambda: common.ROW_BODY["enabled"],
                 lambda v: common.ROW_BODY.__setitem__("enabled", bool(v))),
}
_MISSING = object()


def clear_caches() -> None:
    """Drop every cached launch configuration and replay plan (they are remade on next use)."""
    for cache in config_caches:
        cache.cache_clear()


def _owner(op: str | None, name: str) -> str:
    if op is not None:
        if op not in OPS:
            raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
        if not hasattr(OPS[op], name) or name.startswith("_"):
            raise ValueError(f"configs.{op} has no rule {name!r}")
        return op
    owners = [o for o, mod in OPS.items() if not name.startswith("_") and hasattr(mod, name)]
    if "common" in owners and all(getattr(OPS[o], name) is getattr(common, name) for o in owners):
        owners = ["common"]  # a shared rule other modules imported
    if len(owners) != 1:
        raise ValueError(f"rule {name!r} is defined by {owners or 'no rules module'}: "
                         "name the op, override(op, **rules)")
    return owners[0]


def _bindings(op: str, name: str) -> list[ModuleType]:
    """The modules whose global ``name`` is the rule: its rules module, the op's host modules
    (which import rules by name), and any other module of the backend bound to the very same
    object (a shared rule imported elsewhere; scalars are matched by name in the op's modules
    only, since equal small ints or bools of other ops' rules are the same object)."""
    mod = OPS[op]
    value = getattr(mod, name)
    found = [mod]
    hosts = _HOSTS.get(op, ()) if op != "common" else tuple(
        h for hs in _HOSTS.values() for h in hs)
    for host in hosts:
        m = sys.modules.get(_PACKAGE + host)
        if m is not None and name in vars(m) and m not in found:
            found.append(m)
    if isinstance(value, (bool, int, float, str, type(None))):
        return found
    for key, m in list(sys.modules.items()):
        if (key.startswith(_PACKAGE) and m is not None and m not in found
                and vars(m).get(name, _MISSING) is value):
            found.append(m)
    return found


@contextlib.contextmanager
def override(op: str | None = None, /, **rules: object) -> Iterator[None]:
    """Replace launch rules inside the block (see the module docstring); restores them on
    exit, also after an exception."""
    undo: list = []
    try:
        for name, value in rules.items():
            if name in _SWITCHES:
                get, put = _SWITCHES[name]
                undo.append((put, get()))
                put(value)
                continue
            owner = _owner(op, name)
            for mod in _bindings(owner, name):
                undo.append((mod, name, vars(mod)[name]))
                setattr(mod, name, value)
        clear_caches()
        yield
    finally:
        for entry in reversed(undo):
            if len(entry) == 2:
                entry[0](entry[1])
            else:
                setattr(*entry)
        clear_caches()
