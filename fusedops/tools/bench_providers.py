"""Providers for the benchmark sweep: the implementations that ``fusedops bench`` compares.

Every provider exposes the same two row functions on a 2-D ``(M, N)`` input:

* ``softmax(x, w, b) -> y``   (``w``/``b`` ignored) -- softmax over the last dim;
* ``layernorm(x, w, b) -> y`` -- LayerNorm over the last dim with weight and bias, eps=EPS.

Backward passes are not separate entry points: the harness runs the forward with inputs that
require grad and times ``torch.autograd.grad`` on its output, so each provider's backward is the
one its own autograd graph records (a single node for the fused providers, the whole unfused
chain for ``naive``, the AOTAutograd-compiled backward for ``compile``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

EPS = 1e-5
FAMILIES = ("softmax", "layernorm")

RowFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


# --- the functions each provider runs ------------------------------------------------------------


def torch_softmax(x, w=None, b=None):
    return torch.softmax(x, dim=-1)


def torch_layernorm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, EPS)


def naive_softmax(x, w=None, b=None):
    """Textbook unfused softmax: max, subtract, exp, sum, divide (one kernel each)."""
    m = x.amax(dim=-1, keepdim=True)
    e = torch.exp(x - m)
    return e / e.sum(dim=-1, keepdim=True)


def naive_layernorm(x, w, b):
    """Textbook unfused LayerNorm: mean, subtract, square, mean (variance), rsqrt, scale, shift."""
    mean = x.mean(dim=-1, keepdim=True)
    xc = x - mean
    var = (xc * xc).mean(dim=-1, keepdim=True)
    return xc * torch.rsqrt(var + EPS) * w + b


def fusedops_softmax(x, w=None, b=None):
    from fusedops import fused_softmax

    return fused_softmax(x, -1)


def fusedops_layernorm(x, w, b):
    from fusedops import fused_layernorm

    return fused_layernorm(x, (x.shape[-1],), w, b, EPS)


def _liger_softmax(x, w=None, b=None):
    from liger_kernel.ops.softmax import LigerSoftmaxFunction

    return LigerSoftmaxFunction.apply(x)


def _liger_layernorm(x, w, b):
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    return LigerLayerNormFunction.apply(x, w, b, EPS)


# --- provider objects -----------------------------------------------------------------------------


@dataclass
class Provider:
    """One implementation under test.

    ``make(family)`` returns the callable for one sweep point; the ``compile`` provider resets
    Dynamo and returns a fresh ``torch.compile(dynamic=False)`` wrapper each time, so every shape
    is compiled for itself (the first call pays the compile, which the harness reports).
    """

    name: str
    description: str
    softmax: RowFn
    layernorm: RowFn
    compiles: bool = False
    devices: tuple[str, ...] = ("cuda", "mps", "cpu")
    runs_on: str = ""

    def unavailable_reason(self, device_type: str) -> str | None:
        """None when this provider can run on ``device_type``, else why not."""
        if device_type not in self.devices:
            return f"{self.name} does not run on {device_type}"
        return None

    def make(self, family: str) -> RowFn:
        fn = self.softmax if family == "softmax" else self.layernorm
        if not self.compiles:
            return fn
        torch._dynamo.reset()
        return torch.compile(fn, dynamic=False)

    def backend(self, x: torch.Tensor) -> str:
        """What actually runs for this provider on ``x`` (recorded in every result)."""
        return self.runs_on or self.name


class FusedopsProvider(Provider):
    def backend(self, x: torch.Tensor) -> str:
        from fusedops import _dispatch

        return _dispatch.backend_for(x).NAME


class LigerProvider(Provider):
    def unavailable_reason(self, device_type: str) -> str | None:
        reason = super().unavailable_reason(device_type)
        if reason is not None:
            return reason
        try:
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction  # noqa: F401
            from liger_kernel.ops.softmax import LigerSoftmaxFunction  # noqa: F401
        except Exception as exc:  # ImportError, or a Triton/driver error at import time
            return f"liger-kernel not importable: {type(exc).__name__}: {exc}"
        return None

    def backend(self, x: torch.Tensor) -> str:
        try:
            from importlib.metadata import version

            return f"liger-kernel {version('liger-kernel')}"
        except Exception:
            return "liger-kernel"


def all_providers() -> dict[str, Provider]:
    """Every known provider, in the order results are shown."""
    return {
        "fusedops": FusedopsProvider(
            "fusedops", "fusedops.fused_softmax / fused_layernorm", fusedops_softmax,
            fusedops_layernorm,
        ),
        "torch": Provider(
            "torch", "torch eager: torch.softmax / F.layer_norm", torch_softmax, torch_layernorm,
            runs_on="eager",
        ),
        "compile": Provider(
            "compile", "torch.compile(dynamic=False) of the torch eager op, recompiled per shape",
            torch_softmax, torch_layernorm, compiles=True, runs_on="inductor",
        ),
        "liger": LigerProvider(
            "liger", "Liger-Kernel LigerSoftmaxFunction / LigerLayerNormFunction",
            _liger_softmax, _liger_layernorm, devices=("cuda",),
        ),
        "naive": Provider(
            "naive", "unfused eager composition (max/exp/sum/div; mean/var/sub/mul/add)",
            naive_softmax, naive_layernorm, runs_on="eager (unfused)",
        ),
    }


PROVIDER_NAMES = tuple(all_providers())
