"""Peak memory bandwidth of Apple silicon chips, for reporting MPS results as a fraction of peak.

Apple GPUs share the SoC's unified memory, so the GPU's bandwidth ceiling is the chip's memory
bandwidth as Apple publishes it (GB/s, 1 GB = 10^9 bytes). Where a chip was sold in variants
with different memory interfaces (M3 Max, M4 Max), the figure depends on the GPU core count;
pass a name that contains it (``"Apple M4 Max (32-core GPU)"``), otherwise the higher figure is
used, so the reported fraction of peak errs low rather than high.

    >>> peak_bandwidth_gbps("Apple M2 Pro")
    200.0
    >>> peak_bandwidth_gbps("M4 Max (32-core GPU)")
    410.0
"""

from __future__ import annotations

import re

# name -> GB/s, or {GPU cores: GB/s} for chips sold with two memory configurations.
APPLE_CHIPS: dict[str, float | dict[int, float]] = {
    "M1": 68.25,
    "M1 Pro": 200.0,
    "M1 Max": 400.0,
    "M1 Ultra": 800.0,
    "M2": 100.0,
    "M2 Pro": 200.0,
    "M2 Max": 400.0,
    "M2 Ultra": 800.0,
    "M3": 100.0,
    "M3 Pro": 150.0,
    "M3 Max": {30: 300.0, 40: 400.0},
    "M3 Ultra": 819.0,
    "M4": 120.0,
    "M4 Pro": 273.0,
    "M4 Max": {32: 410.0, 40: 546.0},
    "M5": 153.0,
}

_NAME = re.compile(r"\bM(\d+)(?:\s+(Pro|Max|Ultra))?\b", re.IGNORECASE)
_CORES = re.compile(r"(\d+)[- ]core GPU", re.IGNORECASE)


def normalize(name: str) -> str | None:
    """The table key for a chip name such as ``"Apple M2 Max"`` (None if not recognised)."""
    m = _NAME.search(name or "")
    if m is None:
        return None
    key = f"M{m.group(1)}" + (f" {m.group(2).capitalize()}" if m.group(2) else "")
    return key if key in APPLE_CHIPS else None


def peak_bandwidth_gbps(name: str) -> float | None:
    """Published peak memory bandwidth (GB/s) of the Apple chip called ``name``, or None.

    Accepts the strings macOS and PyTorch report (``sysctl machdep.cpu.brand_string``,
    ``torch.mps`` device names): ``"Apple M1"``, ``"Apple M3 Max"``, ... An optional
    ``"<n>-core GPU"`` in the name selects the variant of chips sold in two configurations.
    """
    key = normalize(name)
    if key is None:
        return None
    value = APPLE_CHIPS[key]
    if isinstance(value, dict):
        m = _CORES.search(name)
        if m is not None:
            cores = int(m.group(1))
            # The variant with the most GPU cores not above the given count.
            fitting = [c for c in value if c <= cores]
            if fitting:
                return value[max(fitting)]
        return max(value.values())
    return value


def known_chips() -> list[str]:
    return list(APPLE_CHIPS)
