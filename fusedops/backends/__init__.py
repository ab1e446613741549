"""Backends: the implementations of the 2-D row contract, one per folder or file.

* ``triton/``: Triton kernels (CUDA, ROCm; CPU tensors under ``TRITON_INTERPRET=1``);
* ``metal/``: the host code of the Metal shaders (``metal/*.metal``) and the ``csrc/`` extension;
* ``reference.py``: PyTorch's own ops (every other device, and the fallback of the others).

Selection (which backend runs a call) lives in ``fusedops._dispatch``; :class:`Backend` is the
contract every backend module satisfies.
"""

from __future__ import annotations

from fusedops.backends.protocol import Backend

__all__ = ["Backend"]
