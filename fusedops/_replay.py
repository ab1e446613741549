"""Replay tables: the shortest host path for small inference calls seen before.

A kernel that runs for a few microseconds is bound by host time (docs/performance.md, "Small
shapes"), and most of that time goes to argument checks, dispatch and launch rules that give
the same answer every time a model calls an op with the same shapes. After a backend has run a
call through the normal path and recorded a launch plan for it (``fusedops.backends.triton``'s
``PlanCache``), it registers here a *runner* under a signature the ops layer computes in a few
hundred nanoseconds. The next call with that signature goes straight to the runner.

* ``SOFTMAX``: ``(x.shape, x.dtype, x.get_device())`` -> ``run(x) -> y or None``: softmax over
  the last dim of ``x``, ``y`` in ``x.dtype``.
* ``LAYERNORM``: ``(x.shape, x.dtype, x.get_device(), eps)`` -> ``run(x, weight, bias) -> y or
  None``: LayerNorm over the last dim of ``x`` (``eps`` a float), ``y`` in ``x.dtype``.
* ``RMSNORM``: ``(x.shape, x.dtype, x.get_device(), eps)`` -> ``run(x, weight) -> y or None``:
  RMSNorm over the last dim of ``x`` (``eps`` the float the op resolved ``None`` to), ``y`` in
  ``x.dtype``.
* ``LAYERNORM_RESIDUAL``: ``(x.shape, x.dtype, x.get_device(), eps)`` -> ``run(x, residual,
  weight, bias) -> (y, x + residual) or None``: LayerNorm of ``x + residual`` over the last
  dim, no dropout or activation, ``y`` in ``x.dtype`` (``residual`` is not checked by the ops
  layer before the runner: the runner checks it).
* ``SOFTMAX_MASKED``: ``(x.shape, x.dtype, x.get_device(), scale, causal, mask signature)`` ->
  ``run(x, mask) -> y or None``: ``softmax(x * scale + mask)`` over the last dim of a 4-d ``x``
  (attention scores), ``scale`` a float (None resolved to 1.0), ``causal`` a bool, the mask
  signature None or ``(mask.shape, mask.stride(), mask.dtype)``; ``y`` in ``x.dtype``. A value
  of False marks a signature the backend cannot replay (not looked up again). A runner also
  carries ``native``, its training calls' C++ path: False (none), a callable ``(x, mask) -> y
  or None`` whose result has a C++ autograd node, or None while undecided, when
  ``make_native(y, dy)`` (called by the first replayed backward, returning its gradient or None)
  may make one.

* ``LAYERNORM_NODE``: ``(x.shape, x.dtype, x.get_device(), eps)`` -> ``node(x, weight, bias)
  -> y or None`` for *training* calls: LayerNorm over the last dim of a contiguous ``x`` as a
  C++ autograd node (``fusedops._host_ext``: forward and backward launched from C++), or False
  where the backend made none (or is making one: the first call's backward decides). A node
  checks in C++ that the tensors are those it was recorded for (dtypes, shapes, alignment,
  requires_grad) and returns None otherwise.
* ``RMSNORM_NODE``: ``(x.shape, x.dtype, x.get_device(), eps)`` -> ``node(x, weight) -> y or
  None``: the same for RMSNorm (``eps`` the float the op resolved ``None`` to).

The ops consult the inference tables only for plain eager inference calls
(``fusedops._dispatch.plain_eager``, no gradient needed; the node tables for training calls
under ``fusedops._dispatch.node_eager``), arguments of the exact types the signature assumes.
A runner re-checks what its signature does not fix (``x`` contiguous at a 16-byte aligned
CUDA address, the parameters' types, dtypes, shapes, devices and layouts, Triton launch hooks)
and returns None when it cannot run the call as the registering call ran, which then takes the
normal path: a replay never changes a result, and never turns an error into a result.

Tables are cleared whenever the choice of backend or the launch rules change
(``fusedops.set_backend``, ``fusedops.backends.triton.configs.override``) and when a backend
drops its plans.
"""

from __future__ import annotations

SOFTMAX: dict = {}
LAYERNORM: dict = {}
RMSNORM: dict = {}
LAYERNORM_RESIDUAL: dict = {}
SOFTMAX_MASKED: dict = {}
LAYERNORM_NODE: dict = {}
RMSNORM_NODE: dict = {}


def clear() -> None:
    """Drop every runner (the next call of each signature takes the normal path)."""
    SOFTMAX.clear()
    LAYERNORM.clear()
    RMSNORM.clear()
    LAYERNORM_RESIDUAL.clear()
    SOFTMAX_MASKED.clear()
    LAYERNORM_NODE.clear()
    RMSNORM_NODE.clear()
