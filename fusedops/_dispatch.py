"""Backend selection: which implementation runs a call, chosen from the tensor's device.

Every backend module (``fusedops.backends.triton``, ``.metal``, ``.reference``) implements the
same *2-D row contract* (typed as ``fusedops.backends.Backend``; see ``docs/design.md``):

* ``softmax_forward(x, out_dtype) -> y``
* ``softmax_backward(y, dy, out_dtype) -> dx``
* ``layernorm_forward(x, weight, bias, eps, out_dtype) -> (y, mean, rstd)``
* ``layernorm_forward_y(x, weight, bias, eps, out_dtype) -> y`` (no backward will follow)
* ``layernorm_backward(dy, x, weight, mean, rstd, need_dx, need_dw, need_db, grad_dtypes=None)
  -> (dx, dw, db)``
* ``rmsnorm_forward(x, weight, eps, out_dtype) -> (y, rstd)``
* ``rmsnorm_forward_y(x, weight, eps, out_dtype) -> y``
* ``rmsnorm_backward(dy, x, weight, rstd, need_dx, need_dw, grad_dtypes=None) -> (dx, dw)``

where ``x``/``dy`` are ``(M, N)`` with unit column stride and any row stride, ``y`` is ``(M, N)``
contiguous, ``mean``/``rstd`` are ``(M,)`` float32 and ``dw``/``db`` come back as float32 ``(N,)``
(or already in ``grad_dtypes``, the parameters' dtypes, where a backend chose to cast them).
The autograd Functions in ``fusedops.ops`` reduce every user call to this contract.

The public ops ask :func:`fused_backend` first: it answers None where PyTorch's own op is the
better choice for the call (no fused backend for the device or dtype, a call too small for the
fused kernel to pay for its host cost, torch.compile tracing, torch.func transforms), and the
op then calls torch's native op itself. Choices are cached per (device type, dtype), so the hot
path is a dict lookup and a size test.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from fusedops import _replay

if TYPE_CHECKING:
    from fusedops.backends import Backend

BACKENDS = ("triton", "metal", "reference")
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_forced: str | None = None
_cache: dict[tuple[str, torch.dtype], Backend] = {}
_warned: set[str] = set()
# Per-op counts of calls that ran on a fused backend; None (the default) means "not counting",
# which keeps the hot path to one `is None` test.
_counts: Counter | None = None


def _check_name(name: str | None) -> str | None:
    if name is None or name == "":
        return None
    name = name.lower()
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {name!r}")
    return name


def set_backend(name: str | None) -> None:
    """Force every call onto one backend (``"triton"``, ``"metal"``, ``"reference"``).

    ``None`` restores automatic selection from each tensor's device. The environment variable
    ``FUSEDOPS_BACKEND`` sets the initial value. Forcing ``"triton"`` on CPU tensors needs
    ``TRITON_INTERPRET=1`` (set before Triton is imported); without it such calls fall back to
    PyTorch's ops with a one-time warning saying so. A forced backend runs every call it can
    take, whatever its size (the size rule of :data:`NATIVE_BELOW` is for automatic selection);
    ``"reference"`` runs fusedops' autograd Functions on its pure-PyTorch implementation of the
    row contract (``fusedops.backends.reference``), for tests and debugging.
    """
    global _forced, _below
    _forced = _check_name(name)
    _below = NATIVE_BELOW if _forced is None else _NEVER_NATIVE
    _cache.clear()
    for table in SIZE_RULES.values():
        table.clear()
    NATIVE_AUTOGRAD.clear()
    _replay.clear()  # runners were registered by the backends chosen before
    # ... when their plans were made: drop those too, so the next calls make both again.
    triton_configs = sys.modules.get("fusedops.backends.triton.configs")
    if triton_configs is not None:
        triton_configs.clear_caches()


def get_backend() -> str | None:
    """The forced backend name, or ``None`` when selection is automatic."""
    return _forced


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Context manager form of :func:`set_backend`; restores the previous setting on exit."""
    previous = _forced
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


_INTERNAL_DIRS = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(torch.__file__))


def warn_once(key: str, message: str) -> None:
    """Emit ``message`` as a UserWarning the first time ``key`` is seen in this process,
    attributed to the first caller outside fusedops and torch (the user's line)."""
    if key in _warned:
        return
    _warned.add(key)
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


def _load(name: str) -> Backend | None:
    """Import a backend module, or None when it cannot run in this process."""
    if name == "reference":
        from fusedops.backends import reference

        return reference
    if name == "triton":
        try:
            from fusedops.backends import triton as triton_backend
        except ImportError:
            return None
        return triton_backend if triton_backend.AVAILABLE else None
    if name == "metal":
        from fusedops.backends import metal

        return metal if metal.is_available() else None
    raise AssertionError(name)


def _select(device_type: str, dtype: torch.dtype) -> Backend:
    from fusedops.backends import reference

    if _forced is not None:
        wanted = _forced
    elif device_type == "cuda":
        wanted = "triton"
    elif device_type == "mps":
        wanted = "metal"
    else:
        return reference
    if wanted == "reference":
        return reference
    backend = _load(wanted)
    if backend is not None and wanted == "triton" and device_type != "cuda" \
            and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        warn_once(
            f"no-interpreter:{device_type}",
            f"fusedops: the triton backend runs {device_type} tensors only through Triton's "
            "interpreter; set TRITON_INTERPRET=1 before importing triton (or move the tensors "
            "to CUDA). Using PyTorch's ops for these calls.")
        return reference
    if backend is None:
        warn_once(
            f"missing:{wanted}:{device_type}",
            f"fusedops: the {wanted} backend is not available for {device_type} tensors; "
            "using PyTorch's own ops (correct, not fused).",
        )
        return reference
    if dtype not in KERNEL_DTYPES:
        warn_once(
            f"dtype:{wanted}:{dtype}",
            f"fusedops: the {wanted} kernels support float32/float16/bfloat16, not {dtype}; "
            "using PyTorch's own ops for this dtype.",
        )
        return reference
    return backend


def backend_for(x: torch.Tensor) -> Backend:
    """The backend module that runs an op on ``x`` (cached per device type and dtype)."""
    # is_cuda is a cheap flag; building x.device costs more on the per-call path.
    key = ("cuda" if x.is_cuda else x.device.type, x.dtype)
    backend = _cache.get(key)
    if backend is None:
        backend = _cache[key] = _select(*key)
    return backend


# Calls on a fused backend's device with fewer elements than this, per (op, autograd will need
# the call), run PyTorch's own op: the fused call costs the host more (checks and plans in
# Python, an autograd.Function whose backward autograd's device thread runs in Python) than
# its kernel saves on the GPU, so it could only lose where the model is host-bound (which calls
# this small make it) and gain little where it is not. Per-call host and GPU times of both:
# benchmarks/results/h200/host_costs.json; whole models: benchmarks/results/h200/models.json
# (BERT at 8x512 is host-bound: its add + LayerNorm epilogues lose below 2^23 elements). A
# masked softmax call runs fused at every size: its exact composition in torch ops (scale, mask,
# softmax, rows with nothing kept set to zero) costs the host more than the replayed kernel
# (benchmarks/results/h200/host.txt). patch_model's attention function runs fused from 2^25
# scores ("attention"; a 32x512 block of BERT-base or GPT-2 gains, models.json: 0.84-0.88) and,
# below that, only inference calls with a mask that its attention module made before
# (fusedops.patching.hf_attention.SEEN, attention-calls.json: a replayed fused call costs the
# host less than the model's own, a first call more).
# Calls with dropout always run fused (the mask's generator is part of the op). A LayerNorm
# or RMSNorm training call runs as a C++ autograd node (fusedops._host_ext) from 2^22 elements
# where the backend has nodes ("node"): LayerNorm's kernels' GPU time is 0.3-0.7x torch's from
# 3M elements, its host cost per forward + backward a few µs above torch's
# (layernorm-node.json; RMSNorm: rmsnorm-node.json).
NATIVE_BELOW: dict[tuple[str, bool | str], int] = {
    ("softmax", False): 1 << 22, ("softmax", True): 1 << 24,
    ("layernorm", False): 1 << 22, ("layernorm", True): 1 << 26, ("layernorm", "node"): 1 << 22,
    ("rmsnorm", False): 1 << 22, ("rmsnorm", True): 1 << 26, ("rmsnorm", "node"): 1 << 22,
    ("layernorm_epilogue", False): 1 << 23, ("layernorm_epilogue", True): 1 << 26,
    ("softmax_masked", False): 0, ("softmax_masked", True): 0,
    ("attention", False): 1 << 25, ("attention", True): 1 << 25,
    ("dropout", False): 0, ("dropout", True): 0,
}
_NEVER_NATIVE = dict.fromkeys(NATIVE_BELOW, 0)
_functorch_active = torch._C._are_functorch_transforms_active
# Per op: (device type, or True for CUDA; dtype; autograd will need the call) -> the size below
# which PyTorch's own op runs (inf: no fused backend for that device and dtype). Filled on
# first sight of a key, emptied (in place: the ops hold them) when the choice of backend
# changes. The ops read them inline: one lookup and one size test per call.
SIZE_RULES: dict[str, dict[tuple, float]] = {op: {} for op, _ in NATIVE_BELOW}
# Per (device type or True, dtype), filled beside SIZE_RULES: whether the backend runs a
# replayed training call of the attention softmax from C++ autograd nodes
# (``NATIVE_AUTOGRAD``: fusedops._host_ext), which makes that call cost the host less than
# the native ops it replaces (patch_model's attention function reads it).
NATIVE_AUTOGRAD: dict[tuple, bool] = {}


def size_rule(op: str, key: tuple) -> float:
    """Fill ``SIZE_RULES[op][key]``: the native-below size, inf where no fused backend runs
    such tensors."""
    device_type = "cuda" if key[0] is True else key[0]
    backend = _select(device_type, key[1])
    # (A forced "reference" backend runs fusedops' own paths on its pure-PyTorch row code.)
    native_autograd = getattr(backend, "NATIVE_AUTOGRAD", False)
    if backend.NAME == "reference" and _forced != "reference":
        below = math.inf
    elif key[2] and native_autograd and (op, "node") in _below:
        below = _below[op, "node"]  # (the ops route calls without a node by python_rule)
    else:
        below = _below[op, key[2]]
    if not _is_compiling():  # (a table filled while Dynamo traces would make it recompile)
        SIZE_RULES[op][key] = below
        NATIVE_AUTOGRAD[key[:2]] = below != math.inf and native_autograd
    return below


def python_rule(op: str) -> float:
    """The size below which a training call of ``op`` that has no C++ node runs PyTorch's op
    (the rule of its Python autograd Function)."""
    return _below[op, True]


def native_now() -> bool:
    """Whether calls must run PyTorch's ops whatever their size: torch.compile tracing (unless
    a backend is forced: its kernels then run as custom ops) or torch.func transforms (the
    kernels have no batching rule; torch's ops do)."""
    return (_forced is None and _is_compiling()) or _functorch_active()


def runs_native(op: str, x: torch.Tensor, grad: bool) -> bool:
    """Whether a call of ``op`` on ``x`` runs PyTorch's ops (:func:`fused_backend` is None)."""
    return runs_native_numel(op, x, grad, x.numel())


def runs_native_numel(op: str, like: torch.Tensor, grad: bool, numel: int) -> bool:
    """:func:`runs_native` for a call on ``numel`` elements of ``like``'s device and dtype (a
    tensor not made yet)."""
    key = (True, like.dtype, grad) if like.is_cuda else (
        "cpu" if like.is_cpu else like.device.type, like.dtype, grad)
    below = SIZE_RULES[op].get(key)
    if below is None:
        below = size_rule(op, key)
    return numel < below or native_now()


def fused_backend(x: torch.Tensor, op: str, grad: bool) -> Backend | None:
    """The fused backend that should run this public call of ``op`` on ``x``, or None when
    PyTorch's own op should (see the module docstring). ``grad``: autograd will need the call.
    (The hot paths of the plain ops read :data:`SIZE_RULES` inline instead.)

    A forced backend (:func:`set_backend`) always runs, whatever the size, also under
    torch.compile (through the custom ops of ``fusedops.ops._library``)."""
    return None if runs_native(op, x, grad) else backend_for(x)


def native_below() -> dict[tuple[str, bool], int]:
    """The size rule in force: :data:`NATIVE_BELOW`, or zeros while a backend is forced."""
    return _below


def backend_fn(x: torch.Tensor, name: str) -> tuple[Backend, object]:
    """(backend, its function ``name``) for ``x``; a backend that lacks the function (an op added
    after it, e.g. an epilogue) falls back to the reference with a one-time warning."""
    backend = backend_for(x)
    fn = getattr(backend, name, None)
    if fn is None:
        from fusedops.backends import reference

        warn_once(
            f"missing-op:{backend.NAME}:{name}",
            f"fusedops: the {backend.NAME} backend has no {name}; using the PyTorch reference "
            "implementation (correct, not fused).")
        return reference, getattr(reference, name)
    return backend, fn


def is_fused(backend: Backend) -> bool:
    """True when ``backend`` is a real fused-kernel backend (not the reference)."""
    return backend.NAME != "reference"


def record(op: str, backend: Backend) -> None:
    """Count one call of ``op`` on a fused backend while counting is enabled."""
    if _counts is not None and backend.NAME != "reference":
        _counts[op] += 1


_is_compiling = torch.compiler.is_compiling
# Autocast on for any device type (one call); where this torch lacks it, CUDA's flag.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: torch.is_autocast_enabled("cuda"))


def plain_eager() -> bool:
    """Whether a call may take a replay runner (``fusedops._replay``) as far as global state
    goes: not traced by torch.compile (Dynamo must see the normal path), no autocast (it changes
    the output dtype), fused-call counting off (``count_fused_calls`` counts on the normal path).
    Whether the call needs gradients is the caller's check."""
    return _counts is None and not _is_compiling() and not _any_autocast()


def node_eager(x: torch.Tensor) -> bool:
    """Whether a training call on ``x`` may take (or make) a C++ node
    (``fusedops._replay.LAYERNORM_NODE``, ``RMSNORM_NODE``): as :func:`plain_eager`, except
    that autocast does not change the output dtype of a float32 ``x``."""
    return _counts is None and not _is_compiling() and (
        x.dtype is torch.float32 or not _any_autocast())


def plain_eager_checked() -> bool:
    """:func:`plain_eager` for a caller that has just found :func:`native_now` False, so Dynamo
    is not tracing unless a backend is forced: two fewer Python calls on a path taken once per
    attention layer."""
    return _counts is None and not _any_autocast() and (_forced is None or not _is_compiling())


def replay_checked() -> bool:
    """:func:`plain_eager_checked` for a caller whose replay runner's output dtype does not
    depend on autocast (patch_model's attention function, which makes the model's dtype)."""
    return _counts is None and (_forced is None or not _is_compiling())


@contextlib.contextmanager
def count_fused_calls() -> Iterator[Counter]:
    """Count calls routed to fused kernels, per op (e.g. ``softmax_forward``), inside the block.

    >>> with count_fused_calls() as counts:
    ...     model(x)
    >>> counts["layernorm_forward"]
    """
    global _counts
    previous = _counts
    counts: Counter = Counter()
    _counts = counts
    try:
        yield counts
    finally:
        if previous is not None:
            previous.update(counts)
        _counts = previous


_below: dict[tuple[str, bool], int] = NATIVE_BELOW

set_backend(os.environ.get("FUSEDOPS_BACKEND"))
