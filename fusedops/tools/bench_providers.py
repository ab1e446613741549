"""Providers for the benchmark sweep: the implementations that ``fusedops bench`` compares.

Every provider exposes one row function per op family (:data:`FAMILIES`) on a 2-D ``(M, N)``
input, all with the same signature:

* ``softmax(x, w, b) -> y``   (``w``/``b`` ignored) -- softmax over the last dim;
* ``layernorm(x, w, b) -> y`` -- LayerNorm over the last dim with weight and bias, eps=EPS;
* ``rmsnorm(x, w, b) -> y``   (``b`` ignored) -- RMSNorm over the last dim with weight, eps=EPS
  (``F.rms_norm`` semantics: ``x * rsqrt(mean(x^2) + eps) * w``).

Backward passes are not separate entry points: the harness runs the forward with inputs that
require grad and times ``torch.autograd.grad`` on its output, so each provider's backward is the
one its own autograd graph records (a single node for the fused providers, the whole unfused
chain for ``naive``, the AOTAutograd-compiled backward for ``compile``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

EPS = 1e-5
FAMILIES = ("softmax", "layernorm", "rmsnorm")

RowFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


# --- the functions each provider runs ------------------------------------------------------------


def torch_softmax(x, w=None, b=None):
    return torch.softmax(x, dim=-1)


def torch_layernorm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, EPS)


def torch_rmsnorm(x, w, b=None):
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


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


def naive_rmsnorm(x, w, b=None):
    """Textbook unfused RMSNorm: square, mean, add eps, rsqrt, scale, weight."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS) * w


def fusedops_softmax(x, w=None, b=None):
    from fusedops import fused_softmax

    return fused_softmax(x, -1)


def fusedops_layernorm(x, w, b):
    from fusedops import fused_layernorm

    return fused_layernorm(x, (x.shape[-1],), w, b, EPS)


def fusedops_rmsnorm(x, w, b=None):
    from fusedops import fused_rmsnorm

    return fused_rmsnorm(x, (x.shape[-1],), w, EPS)


def _liger_softmax(x, w=None, b=None):
    from liger_kernel.ops.softmax import LigerSoftmaxFunction

    return LigerSoftmaxFunction.apply(x)


def _liger_layernorm(x, w, b):
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    return LigerLayerNormFunction.apply(x, w, b, EPS)


def _liger_rmsnorm(x, w, b=None):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    # forward(ctx, X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None)
    # (liger-kernel 0.8.5; autograd's apply takes no keywords). offset 0.0: plain x/rms(x) * w
    # (Gemma's 1.0 would scale by w + 1). casting_mode "llama", Liger's default: rstd in float32,
    # x * rstd cast back to x's dtype before the weight -- what a Llama model patched with
    # Liger runs. in_place=False: the default True writes dx into the incoming dy, which the
    # harness reuses for every timed backward call and for the next providers' checks.
    return LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)


# --- provider objects -----------------------------------------------------------------------------


@dataclass
class Provider:
    """One implementation under test.

    One row function per family: ``softmax`` and ``layernorm`` are required, ``rmsnorm`` may be
    left out (None), in which case ``make("rmsnorm")`` raises and the harness records the error
    for that family's points only.

    ``make(family)`` returns the callable for one sweep point; the ``compile`` provider resets
    Dynamo and returns a fresh ``torch.compile(dynamic=False)`` wrapper each time, so every shape
    is compiled for itself (the first call pays the compile, which the harness reports).
    """

    name: str
    description: str
    softmax: RowFn
    layernorm: RowFn
    rmsnorm: RowFn | None = None
    compiles: bool = False
    devices: tuple[str, ...] = ("cuda", "mps", "cpu")
    runs_on: str = ""

    def unavailable_reason(self, device_type: str,
                           families: Iterable[str] | None = None) -> str | None:
        """None when this provider can run on ``device_type`` (for the op ``families`` a sweep
        runs; None: all of :data:`FAMILIES`), else why not."""
        if device_type not in self.devices:
            return f"{self.name} does not run on {device_type}"
        return None

    def row_fn(self, family: str) -> RowFn:
        """The (uncompiled) row function of ``family``; ValueError when there is none."""
        if family not in FAMILIES:
            raise ValueError(f"unknown op family {family!r}; expected one of {FAMILIES}")
        fn = getattr(self, family)
        if fn is None:
            raise ValueError(f"provider {self.name!r} has no {family} function")
        return fn

    def make(self, family: str) -> RowFn:
        fn = self.row_fn(family)
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


# The Liger-Kernel autograd function each family runs (module, class).
LIGER_FUNCTIONS = {
    "softmax": ("liger_kernel.ops.softmax", "LigerSoftmaxFunction"),
    "layernorm": ("liger_kernel.ops.layer_norm", "LigerLayerNormFunction"),
    "rmsnorm": ("liger_kernel.ops.rms_norm", "LigerRMSNormFunction"),
}


class LigerProvider(Provider):
    def unavailable_reason(self, device_type: str,
                           families: Iterable[str] | None = None) -> str | None:
        """Also requires Liger's function for every family the sweep runs (all three when
        ``families`` is None), so a Liger build that lacks one family's op is reported
        unavailable only for sweeps that need it."""
        reason = super().unavailable_reason(device_type, families)
        if reason is not None:
            return reason
        import importlib

        for fam in FAMILIES if families is None else families:
            module, name = LIGER_FUNCTIONS[fam]
            try:
                getattr(importlib.import_module(module), name)
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
            "fusedops", "fusedops.fused_softmax / fused_layernorm / fused_rmsnorm",
            fusedops_softmax, fusedops_layernorm, fusedops_rmsnorm,
        ),
        "torch": Provider(
            "torch", "torch eager: torch.softmax / F.layer_norm / F.rms_norm", torch_softmax,
            torch_layernorm, torch_rmsnorm, runs_on="eager",
        ),
        "compile": Provider(
            "compile", "torch.compile(dynamic=False) of the torch eager op, recompiled per shape",
            torch_softmax, torch_layernorm, torch_rmsnorm, compiles=True, runs_on="inductor",
        ),
        "liger": LigerProvider(
            "liger", "Liger-Kernel LigerSoftmaxFunction / LigerLayerNormFunction / "
            "LigerRMSNormFunction (offset 0, casting llama, not in place)",
            _liger_softmax, _liger_layernorm, _liger_rmsnorm, devices=("cuda",),
        ),
        "naive": Provider(
            "naive", "unfused eager composition (max/exp/sum/div; mean/var/sub/mul/add; "
            "pow/mean/rsqrt/mul)",
            naive_softmax, naive_layernorm, naive_rmsnorm, runs_on="eager (unfused)",
        ),
    }


PROVIDER_NAMES = tuple(all_providers())
