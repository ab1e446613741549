"""What a profile is made of: op categories, the softmax / layer_norm calls a forward makes
(captured with their shapes) and the profiler events that are device work."""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from fusedops.tools.profile_target import call_model

FORWARD_RANGE = "fusedops.profile.forward"
FUSED_OPS = ("softmax", "layernorm")
CATEGORIES = ("softmax", "layernorm", "matmul", "elementwise", "reduction", "memory", "view",
              "other")

# ----------------------------------------------------------------------------------------------
# op classification


_PATTERNS = [
    ("other", re.compile(r"log_?softmax")),
    # (fusedops' kernels: softmax_*, smm_* the masked softmax; ln_*, ln_epi_* the
    # LayerNorm epilogues.)
    ("softmax", re.compile(r"softmax|(^|_)smm_(fwd|bwd)")),
    ("layernorm", re.compile(r"layer_?norm|(^|_)ln_(epi_)?(fwd|bwd)")),
    ("matmul", re.compile(
        r"gemm|matmul|cutlass|xmma|cublas|nvjet|sm\d\d_|aten::(mm|addmm|bmm|baddbmm|linear|"
        r"_addmm_activation|scaled_dot_product)")),
    ("memory", re.compile(
        r"memcpy|memset|copy|contiguous|clone|aten::(cat|to|_to_copy|empty|empty_like|zeros|"
        r"zeros_like|ones|full|new_empty|new_zeros|resize_)$")),
    ("view", re.compile(
        r"aten::(view|_unsafe_view|reshape|permute|transpose|t|unsqueeze|squeeze|select|slice|"
        r"expand|as_strided|detach|alias|unbind|split|chunk|lift_fresh|unflatten|flatten|"
        r"movedim|narrow)$")),
    ("reduction", re.compile(r"reduce|aten::(sum|mean|amax|amin|max|min|norm|var|std|prod)$")),
    ("elementwise", re.compile(
        r"elementwise|aten::(add|add_|sub|rsub|mul|mul_|div|div_|gelu|relu|silu|tanh|sigmoid|exp|"
        r"rsqrt|sqrt|neg|pow|square|masked_fill|masked_fill_|where|fill_|dropout|clamp|abs|"
        r"bitwise_not|logical_not|lt|gt|le|ge|eq|ne|arange|scalar_tensor)$")),
]


_WRAPPERS = {"AUnaryFunctor", "BUnaryFunctor", "BinaryFunctor", "gpu_kernel_impl_nocast",
             "gpu_kernel_impl", "func_wrapper_t", "ReduceOp", "launch_kernel"}
_DETAIL = re.compile(
    r"[A-Za-z_]\w*(?:Functor\w*|functor|_kernel_cuda|KernelImpl|_kernel)\b|cutlass_\w+")


def short_name(name: str) -> str:
    """A readable name for a long C++ kernel signature: the kernel's own name plus the functor or
    kernel it instantiates, e.g. ``elementwise_kernel[CUDAFunctor_add]``."""
    if len(name) <= 40 or ("<" not in name and "(" not in name):
        return name
    text = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    head = re.split(r"[<(]", text, maxsplit=1)[0]
    base = head.split("::")[-1] or head
    rest = text[len(head):]
    details = [m.group(0) for m in _DETAIL.finditer(rest)
               if m.group(0) not in _WRAPPERS and m.group(0) != base]
    return f"{base}[{details[0]}]" if details else base


def categorize(name: str) -> str:
    """Coarse category of an ATen op or a device kernel name (see ``CATEGORIES``)."""
    n = name.lower()
    for category, pattern in _PATTERNS:
        if pattern.search(n):
            return category
    return "other"


# ----------------------------------------------------------------------------------------------
# capturing the shapes the model feeds to softmax / layer_norm


class _CallRecorder(TorchFunctionMode):
    """Counts the softmax / layer_norm calls of a forward by signature (shape, dtype, args)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            sig = _signature(func, args, kwargs)
        except Exception:  # noqa: BLE001 - recording must never break the model
            sig = None
        if sig is not None:
            self.calls[sig] += 1
        return func(*args, **kwargs)


def _get(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _dt(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def _signature(func, args, kwargs) -> tuple | None:
    if func in (F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax):
        x = _get(args, kwargs, 0, "input")
        if not isinstance(x, torch.Tensor):
            return None
        dim = _get(args, kwargs, 1, "dim")
        if func is F.softmax:
            dtype = _get(args, kwargs, 3, "dtype")
            if dim is None:
                dim = 0 if x.dim() in (0, 1, 3) else 1
        else:
            dtype = _get(args, kwargs, 2, "dtype")
        if not isinstance(dim, int):
            return None
        return ("softmax", tuple(x.shape), _dt(x.dtype), dim, _dt(dtype))
    if func in (F.layer_norm, torch.layer_norm):
        x = _get(args, kwargs, 0, "input")
        shape = _get(args, kwargs, 1, "normalized_shape")
        if not isinstance(x, torch.Tensor):
            return None
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        w = _get(args, kwargs, 2, "weight")
        b = _get(args, kwargs, 3, "bias")
        eps = float(_get(args, kwargs, 4, "eps", 1e-5))
        return ("layernorm", tuple(x.shape), _dt(x.dtype), shape,
                None if w is None else _dt(w.dtype), None if b is None else _dt(b.dtype), eps)
    return None


def capture_calls(model: nn.Module, inputs: Any) -> list[dict]:
    """Run one forward (eval, no grad) and return the softmax / layer_norm calls it made, one dict
    per distinct signature with ``count``.

    Both module and functional forms are seen (``nn.Softmax``/``nn.LayerNorm`` call the
    functional ops). Run this on the *unpatched* model: a patched model's calls go to fusedops.
    """
    recorder = _CallRecorder()
    with torch.no_grad(), recorder:
        call_model(model, inputs)
    out = []
    for sig, count in recorder.calls.items():
        if sig[0] == "softmax":
            _, shape, dtype, dim, out_dtype = sig
            out.append({"op": "softmax", "shape": list(shape), "dtype": dtype, "dim": dim,
                        "out_dtype": out_dtype, "count": count})
        else:
            _, shape, dtype, nshape, w, b, eps = sig
            out.append({"op": "layernorm", "shape": list(shape), "dtype": dtype,
                        "normalized_shape": list(nshape), "weight_dtype": w, "bias_dtype": b,
                        "eps": eps, "count": count})
    return out


# ----------------------------------------------------------------------------------------------
# profiler events


def is_device_event(evt) -> bool:
    """An event recorded on the device (not the CPU)."""
    return evt.device_type != torch.autograd.DeviceType.CPU


def is_device_work(evt) -> bool:
    """A kernel / memcpy / memset on the device (not a mirrored user-annotation range)."""
    return (is_device_event(evt) and not evt.is_user_annotation
            and getattr(evt, "activity_type", None) != "gpu_user_annotation"
            and evt.name != FORWARD_RANGE and not evt.name.startswith("fusedops::"))


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total

