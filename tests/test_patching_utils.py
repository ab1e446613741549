"""Shared helpers for the patch_model tests: small hand-written and Hugging Face models, and
checks that a patched model matches its unpatched twin (outputs, gradients, structure).

No tests live here; ``test_patching.py`` and ``test_patching_models.py`` import from it.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedops
from fusedops.patching.verify import flatten as _flatten


@pytest.fixture
def reference_backend():
    """fusedops' own paths on its pure-PyTorch row code (``use_backend("reference")``): the
    patterns' fused helpers then run as they do on a GPU, not PyTorch's ops in their place."""
    with fusedops.use_backend("reference"):
        yield


@pytest.fixture
def traced_patterns(monkeypatch):
    """patch_model rewrites traced forwards' epilogues (``patterns=True``) unless a test passes
    ``patterns`` itself (the default fuses only Hugging Face attention)."""
    import fusedops.patching.api

    monkeypatch.setitem(fusedops.patching.api.patch_model.__kwdefaults__, "patterns", True)


@pytest.fixture
def force_patch(monkeypatch):
    """patch_model patches CPU models (``force=True``) unless a test passes ``force`` itself:
    these tests exercise the patching, which on CPU runs PyTorch's own ops (without ``force``,
    patch_model leaves a model with no fused backend as it is)."""
    import fusedops.patching.api

    monkeypatch.setitem(fusedops.patching.api.patch_model.__kwdefaults__, "force", True)


# ---------------------------------------------------------------------------------------------
# Hand-written modules of the kinds patch_model must handle
# ---------------------------------------------------------------------------------------------


class NanoLayerNorm(nn.Module):
    """nanoGPT-style LayerNorm with an optional bias, calling F.layer_norm."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class LayerNorm2d(nn.LayerNorm):
    """Channels-first LayerNorm (ConvNeXt style): overrides forward with permutes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class PlainSubLayerNorm(nn.LayerNorm):
    """A LayerNorm subclass that does not override forward (only adds a helper)."""

    def n_features(self) -> int:
        return int(self.normalized_shape[0])


class PlainSubSoftmax(nn.Softmax):
    """An nn.Softmax subclass that does not override forward."""


class SoftmaxVariants(nn.Module):
    """Calls every softmax spelling the functional mode must route."""

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        a = s.softmax(-1)
        b = torch.softmax(s, dim=1)
        c = F.softmax(s, -1)
        d = torch.softmax(s, -1, torch.float32)  # positional dtype
        e = s.softmax(dim=-2, dtype=torch.float32)
        f = torch.special.softmax(s, 0)
        return a + b + c + d + e + f


class HandWritten(nn.Module):
    """A small model mixing every hand-written case: nanoGPT LN (F.layer_norm), a LayerNorm
    subclass without forward, a channels-first LayerNorm2d, nn.Softmax and a subclass of it,
    and functional softmax calls with and without dtype."""

    def __init__(self, d: int = 8, bias: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.ln_nano = NanoLayerNorm(d, bias)
        self.ln_sub = PlainSubLayerNorm(d)
        self.ln_plain = nn.LayerNorm(d, bias=bias)
        self.conv = nn.Conv2d(2, 4, 1)
        self.ln2d = LayerNorm2d(4)
        self.sm = nn.Softmax(dim=-1)
        self.sm_sub = PlainSubSoftmax(dim=1)
        self.variants = SoftmaxVariants()
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, d)
        h = self.ln_nano(self.inp(x))
        h = self.ln_sub(h) + self.ln_plain(h)
        s = h @ h.transpose(-1, -2) / 3.0
        att = self.sm(s) + self.sm_sub(s) + self.variants(s)
        h = self.drop(att) @ h
        b, t, d = h.shape
        img = self.ln2d(self.conv(h.reshape(b, 2, t, d // 2)))
        h = h + img.permute(0, 2, 1, 3).reshape(b, t, -1)[..., :d]
        return self.out(h)


def handwritten_inputs(batch: int = 2, t: int = 4, d: int = 8) -> torch.Tensor:
    return torch.randn(batch, t, d)


# Expected routed calls for one HandWritten forward (module level + functional).
HANDWRITTEN_LN_CALLS = 4  # nano (functional), sub (module), plain (module), 2d (functional)
HANDWRITTEN_SOFTMAX_CALLS = 8  # sm, sm_sub (module) + 6 variants (functional)


# ---------------------------------------------------------------------------------------------
# Hugging Face models from tiny random configs (no downloads)
# ---------------------------------------------------------------------------------------------


def hf_bert() -> tuple[nn.Module, tuple]:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, attn_implementation="eager",
    )
    return BertModel(cfg), (torch.randint(0, 40, (2, 5)),)


def hf_gpt2() -> tuple[nn.Module, tuple]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=40, n_embd=16, n_layer=2, n_head=2, n_positions=16,
        bos_token_id=0, eos_token_id=0, attn_implementation="eager",
    )
    return GPT2LMHeadModel(cfg), (torch.randint(0, 40, (2, 5)),)


def hf_vit() -> tuple[nn.Module, tuple]:
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=32, attn_implementation="eager",
    )
    return ViTModel(cfg), (torch.randn(2, 3, 8, 8),)


# name -> (factory, expected LayerNorm modules, softmax calls per forward)
HF_MODELS: dict[str, tuple[Callable[[], tuple[nn.Module, tuple]], int, int]] = {
    "bert": (hf_bert, 5, 2),  # embeddings LN + 2 per layer; one softmax per layer
    "gpt2": (hf_gpt2, 5, 2),  # ln_1, ln_2 per layer + ln_f
    "vit": (hf_vit, 5, 2),  # before/after per layer + final layernorm
}


# ---------------------------------------------------------------------------------------------
# Comparison helpers
# ---------------------------------------------------------------------------------------------

# patched vs unpatched in float32: the fused/reference kernels round differently from torch's
# (e.g. two-pass vs Welford variance), and a few layers amplify that a little.
FP32_TOL = {"atol": 1e-4, "rtol": 5e-4}


def tensors(out: Any) -> dict[str, torch.Tensor]:
    return dict(_flatten(out))


def assert_outputs_close(actual: Any, expected: Any, **tol: float) -> None:
    a, e = tensors(actual), tensors(expected)
    assert a.keys() == e.keys()
    assert a, "no tensor outputs to compare"
    for k in a:
        torch.testing.assert_close(a[k], e[k], msg=lambda m, k=k: f"{k}: {m}", **(tol or FP32_TOL))


def loss_of(out: Any) -> torch.Tensor:
    """A scalar that depends on every floating-point output (with fixed random weights)."""
    g = torch.Generator().manual_seed(1234)
    total = 0.0
    for t in tensors(out).values():
        if t.is_floating_point() and t.requires_grad:
            w = torch.randn(t.shape, generator=g).to(t.device, t.dtype)
            total = total + (t * w).sum()
    return total


def run(model: nn.Module, inputs: tuple, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return model(*inputs)


def grads(model: nn.Module, inputs: tuple, seed: int = 0) -> tuple[Any, dict, list]:
    """Forward + backward; returns (outputs, param grads by name, float input grads)."""
    model.zero_grad(set_to_none=True)
    ins = tuple(
        i.detach().clone().requires_grad_(True) if i.is_floating_point() else i for i in inputs
    )
    out = run(model, ins, seed)
    loss_of(out).backward()
    pgrads = {
        n.removeprefix("_orig_mod."): p.grad  # torch.compile's wrapper prefixes the names
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    igrads = [i.grad for i in ins if i.is_floating_point()]
    return out, pgrads, igrads


def assert_same_training(patched: nn.Module, reference: nn.Module, inputs: tuple,
                         **tol: float) -> None:
    """Outputs, parameter gradients and input gradients of ``patched`` match ``reference``."""
    out_p, pg_p, ig_p = grads(patched, inputs)
    out_r, pg_r, ig_r = grads(reference, inputs)
    assert_outputs_close(out_p, out_r, **tol)
    assert pg_p.keys() == pg_r.keys()
    assert pg_p, "no parameter received a gradient"
    for k in pg_p:
        torch.testing.assert_close(pg_p[k], pg_r[k], msg=lambda m, k=k: f"grad {k}: {m}",
                                   **(tol or FP32_TOL))
    for a, b in zip(ig_p, ig_r, strict=True):
        torch.testing.assert_close(a, b, **(tol or FP32_TOL))


def twins(factory: Callable[[], tuple[nn.Module, tuple]], seed: int = 0):
    """(model, unpatched deep copy, inputs) with identical weights."""
    torch.manual_seed(seed)
    model, inputs = factory()
    return model, copy.deepcopy(model), inputs


def structure(model: nn.Module) -> dict:
    """Everything patch/unpatch must leave as it was (besides the swapped classes)."""
    return {
        "classes": {n: type(m) for n, m in model.named_modules()},
        "dict_keys": {n: sorted(m.__dict__) for n, m in model.named_modules()},
        "hooks": {  # hook functions in order, and which forward hooks are always called
            n: (
                list(m._forward_pre_hooks.values()),
                [(h, k in m._forward_hooks_always_called) for k, h in m._forward_hooks.items()],
            )
            for n, m in model.named_modules()
        },
        "params": {n: id(p) for n, p in model.named_parameters()},
        "buffers": {n: id(b) for n, b in model.named_buffers()},
        "state_dict_keys": list(model.state_dict().keys()),
    }


def fused_counts(model: nn.Module, inputs: tuple, backward: bool = True) -> dict[str, int]:
    """Per-op calls that run on the Triton kernels (interpreted on CPU) for one step."""
    with fusedops.use_backend("triton"), fusedops.count_fused_calls() as counts:
        out = run(model, inputs)
        if backward:
            loss_of(out).backward()
    return dict(counts)


class GraphRecorder:
    """A torch.compile backend that records Dynamo's graphs and runs them with aot_eager."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs.append(gm)
        return aot_eager(gm, example_inputs)

    def code(self) -> str:
        return "\n".join(
            m.code for g in self.graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule)
        )

    def count(self, op: str) -> int:
        return self.code().count(f"fusedops.{op}")


@contextlib.contextmanager
def python_calls(codes: set) -> Any:
    """Collects the Python calls made in the block to functions whose code is in ``codes``
    (a profile hook: nothing torch.compile traces or replays)."""
    seen: list = []

    def hook(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            seen.append(frame.f_code.co_name)

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield seen
    finally:
        sys.setprofile(previous)


def has_cxx_compiler() -> bool:
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))
