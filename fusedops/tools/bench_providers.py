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
chain for ``naive``, the AOTAutograd-compiled backward for ``compile``). A provider whose
forward records no backward names that op in :attr:`Provider.unsupported`; the sweep then
records the point as skipped with the reason instead of timing it.
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fusedops import fused_layernorm, fused_rmsnorm, fused_softmax

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
    return fused_softmax(x, -1)


def fusedops_layernorm(x, w, b):
    return fused_layernorm(x, (x.shape[-1],), w, b, EPS)


def fusedops_rmsnorm(x, w, b=None):
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


class Float32Copies:
    """float32 copies of parameter tensors, made once per tensor (again only after the tensor is
    changed in place), for kernels that take float32 weights whatever x's dtype: the sweep calls
    a row function once untimed before timing it on the same weight, so the conversion stays out
    of the timed calls. Entries go when their tensor does."""

    def __init__(self) -> None:
        self._copies: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

    def get(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` as float32 (same shape and device; ``t`` itself when already float32)."""
        if t is None or t.dtype == torch.float32:
            return t
        key = id(t)
        hit = self._copies.get(key)
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[2]
        copy = t.detach().to(torch.float32)
        # The callback runs before the id can be reused by another tensor.
        ref = weakref.ref(t, lambda _ref, key=key: self._copies.pop(key, None))
        self._copies[key] = (ref, t._version, copy)
        return copy

    def __len__(self) -> int:
        return len(self._copies)


QUACK_FP32 = Float32Copies()


def _quack_softmax(x, w=None, b=None):
    # quack.softmax.softmax(x): SoftmaxFunction.apply, with a backward (its softmax_bwd kernel).
    # It takes 2-D x only (fp16/bf16/fp32); the host-latency shapes include 3-D ones.
    softmax = importlib.import_module("quack.softmax").softmax
    if x.dim() == 2:
        return softmax(x)
    return softmax(x.reshape(-1, x.shape[-1])).reshape(x.shape)


def _quack_layernorm(x, w, b):
    # quack.rmsnorm.layernorm_fwd(x, weight, bias=None, eps=1e-6, return_rstd=False,
    # return_mean=False): forward only (no autograd), 2-D x, weight and bias float32 only.
    layernorm_fwd = importlib.import_module("quack.rmsnorm").layernorm_fwd
    w32, b32 = QUACK_FP32.get(w), QUACK_FP32.get(b)
    if x.dim() == 2:
        return layernorm_fwd(x, w32, b32, eps=EPS)
    return layernorm_fwd(x.reshape(-1, x.shape[-1]), w32, b32, eps=EPS).reshape(x.shape)


def _quack_rmsnorm(x, w, b=None):
    # quack.rmsnorm.rmsnorm(x, weight=None, bias=None, residual=None, out_dtype=None,
    # residual_dtype=None, eps=1e-6, prenorm=False, weight_offset=0.0): RMSNormFunction.apply,
    # with a backward (dx, dweight); weight in fp16/bf16/fp32, so the sweep's own weight; it
    # flattens leading dims itself. QuACK's default eps is 1e-6: pass the sweep's.
    return importlib.import_module("quack.rmsnorm").rmsnorm(x, w, eps=EPS)


# --- provider objects -----------------------------------------------------------------------------


@dataclass
class Provider:
    """One implementation under test.

    One row function per family: ``softmax`` and ``layernorm`` are required, ``rmsnorm`` may be
    left out (None), in which case ``make("rmsnorm")`` raises and the harness records the error
    for that family's points only. ``unsupported`` maps an op (``"layernorm_bwd"``) this
    provider cannot run to the reason; the sweep records those points as skipped with it.

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
    unsupported: dict[str, str] = field(default_factory=dict)

    def unavailable_reason(self, device_type: str,
                           families: Iterable[str] | None = None) -> str | None:
        """None when this provider can run on ``device_type`` (for the op ``families`` a sweep
        runs; None: all of :data:`FAMILIES`), else why not."""
        if device_type not in self.devices:
            return f"{self.name} does not run on {device_type}"
        return None

    def unsupported_reason(self, op: str) -> str | None:
        """Why this provider does not run ``op`` (e.g. ``"layernorm_bwd"``), or None."""
        return self.unsupported.get(op)

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


# The QuACK function each family runs (module, function). The package re-exports functions named
# like the submodules (quack.softmax, quack.rmsnorm), so the submodules are imported by name.
QUACK_FUNCTIONS = {
    "softmax": ("quack.softmax", "softmax"),
    "layernorm": ("quack.rmsnorm", "layernorm_fwd"),
    "rmsnorm": ("quack.rmsnorm", "rmsnorm"),
}
# quack.rmsnorm.layernorm_fwd records no autograd backward; the module's layernorm_bwd is a bare
# kernel call (it needs the forward's rstd and mean), not something autograd.grad can reach.
QUACK_NO_LAYERNORM_BWD = ("QuACK has no LayerNorm backward (layernorm_fwd is forward only, "
                          "without autograd)")


@dataclass
class PackageProvider(Provider):
    """A provider from another package: ``functions`` maps each family to the (module, name)
    it runs, ``package`` is its distribution name (its version goes into every record)."""

    package: str = ""
    functions: dict[str, tuple[str, str]] = field(default_factory=dict)

    def unavailable_reason(self, device_type: str,
                           families: Iterable[str] | None = None) -> str | None:
        """Also requires the package's function for every family the sweep runs (all three
        when ``families`` is None), so a build that lacks one family's op is reported
        unavailable only for sweeps that need it. Importing can fail for reasons other than a
        missing package (a Triton, CUTLASS or driver error at import time)."""
        reason = super().unavailable_reason(device_type, families)
        if reason is not None:
            return reason
        for fam in FAMILIES if families is None else families:
            module, name = self.functions[fam]
            try:
                getattr(importlib.import_module(module), name)
            except Exception as exc:
                return f"{self.name} not importable: {type(exc).__name__}: {exc}"
        return None

    def backend(self, x: torch.Tensor) -> str:
        try:
            from importlib.metadata import version

            return f"{self.package} {version(self.package)}"
        except Exception:
            return self.package


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
        "liger": PackageProvider(
            "liger", "Liger-Kernel LigerSoftmaxFunction / LigerLayerNormFunction / "
            "LigerRMSNormFunction (offset 0, casting llama, not in place)",
            _liger_softmax, _liger_layernorm, _liger_rmsnorm, devices=("cuda",),
            package="liger-kernel", functions=LIGER_FUNCTIONS,
        ),
        "quack": PackageProvider(
            "quack", "QuACK (quack-kernels, CuTe DSL): quack.softmax.softmax(x) / "
            f"quack.rmsnorm.layernorm_fwd(x, weight.float(), bias.float(), eps={EPS:g}), "
            "forward only, its float32 weight and bias converted once per weight tensor outside "
            f"the timed calls / quack.rmsnorm.rmsnorm(x, weight, eps={EPS:g}); inputs of more "
            "than 2 dims flattened to rows",
            _quack_softmax, _quack_layernorm, _quack_rmsnorm, devices=("cuda",),
            unsupported={"layernorm_bwd": QUACK_NO_LAYERNORM_BWD},
            package="quack-kernels", functions=QUACK_FUNCTIONS,
        ),
        "naive": Provider(
            "naive", "unfused eager composition (max/exp/sum/div; mean/var/sub/mul/add; "
            "pow/mean/rsqrt/mul)",
            naive_softmax, naive_layernorm, naive_rmsnorm, runs_on="eager (unfused)",
        ),
    }


PROVIDER_NAMES = tuple(all_providers())
