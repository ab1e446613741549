"""Benchmark of the fused epilogue chains (issue 8): ``python -m fusedops bench-chains``.

Each chain is timed three ways on the same data in the same process:

* ``fusedops``: one fused call (``fused_softmax(..., scale=, mask=, causal=)`` or
  ``fused_layernorm(..., residual=, dropout_p=, activation=)``);
* ``eager``: the unfused chain of torch ops a user writes today (:func:`make_eager`);
* ``compile``: ``torch.compile(dynamic=False)`` of that same eager chain, compiled afresh for
  every point (``torch._dynamo.reset()``), its first-call time reported as ``compile_s``.

Chains (:data:`CHAINS`): ``attn_softmax`` (``softmax(x * scale + mask)``, additive float padding
mask ``(B, 1, 1, S)``), ``attn_softmax_causal`` (the same plus the causal triangle),
``add_layernorm`` (``s = x + r; y = layer_norm(s)``, returning ``(y, s)``),
``layernorm_dropout_relu`` and ``add_layernorm_dropout_gelu`` (dropout p = 0.1, training).

Modes: ``fwd`` (forward under ``torch.no_grad()``; dropout still on, ``training=True``) and
``fwd_bwd`` (forward with grad enabled plus ``torch.autograd.grad`` of every output with a fixed
upstream gradient, into x, the residual, the weight and the bias: what a training step pays for
the chain, including what each forward saves for its backward).

Bytes (:func:`bytes_terms`): the fused *floor* (each input read once, each output written once)
and the eager chain's sum of per-op floors (dropout's bool mask included). TB/s is always the
*fused floor* / time, for every provider, so the providers compare on one scale; ``own_tbps`` is
each provider's own floor / time where it is known (fusedops, eager).

Correctness: the fused chain and the eager chain are compared on the same data with dropout
p forced to 0 (their random masks differ otherwise): outputs in ``fwd``, outputs and gradients
in ``fwd_bwd``. ReLU's gradient jumps at 0, so where the pre-activation is within rounding of 0
two correct implementations can take opposite sides (a *tie*) and their gradients differ at that
element by the whole upstream gradient; the ReLU chain's gradients are therefore compared with an
eager reference that keeps exactly the elements the fused forward kept, and the elements where
that differs from eager's own ReLU are counted (``relu_ties``) and must all lie within rounding
of 0 (:func:`relu_tie_reference`). The dropout itself is checked separately on the fused
forward with p = 0.1: every element must be either 0 (dropped) or ``act(layer_norm(s) / (1 -
p))`` (kept), and the dropped fraction must be p within sampling noise.

Timing, device name, versions and the copy bandwidth come from :mod:`fusedops.tools.bench`
(``triton.testing.do_bench`` medians with an L2 flush before each call on CUDA, a synchronised
``time.perf_counter`` loop elsewhere). On CUDA every record also has ``ms_gpu``, the GPU's own
time with the host far ahead (:meth:`fusedops.tools.bench.Timer.gpu_ahead`), and
``speedup_gpu`` from it: where a provider's host time per call exceeds its GPU time (a
fwd_bwd step through Python autograd at 16K rows of 768), ``ms`` is the host's and ``ms_gpu``
what the kernels take once the host keeps ahead (inside a larger model, or under CUDA graphs).
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fusedops.tools import bench
from fusedops.tools.bench import (
    CHECK_TOL,
    DTYPES,
    Progress,
    Timer,
    default_device,
    device_name,
    empty_cache,
    measure_copy_bandwidth,
    parse_size,
    rel_error,
    synchronize,
)

# --- the chains ----------------------------------------------------------------------------------

HEAD_DIM = 64
SCALE = 1.0 / math.sqrt(HEAD_DIM)
DROPOUT_P = 0.1
EPS = 1e-5
# How close to 0 (relative to max |layer_norm(x)|) eager's pre-activation may be where the fused
# forward's ReLU took the other side: rounding of a float32 LayerNorm, a little more for half
# types whose eager kernels round differently.
RELU_TIE_TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-4, torch.float16: 1e-4}


@dataclass(frozen=True)
class Chain:
    name: str
    kind: str  # "attn": x (B, H, S, S); "ln": x (M, N)
    eager: str  # the eager chain, as code
    fused: str  # the fused call
    residual: bool = False
    dropout_p: float = 0.0
    activation: str | None = None
    causal: bool = False


CHAIN_LIST = (
    Chain("attn_softmax", "attn",
          "torch.softmax(x * scale + mask, -1)",
          "fused_softmax(x, -1, scale=scale, mask=mask)"),
    Chain("attn_softmax_causal", "attn",
          "torch.softmax((x * scale + mask).masked_fill(triu(ones(S, S), 1), -inf), -1)",
          "fused_softmax(x, -1, scale=scale, mask=mask, causal=True)", causal=True),
    Chain("add_layernorm", "ln",
          "s = x + r; y = F.layer_norm(s, (N,), w, b); return y, s",
          "fused_layernorm(x, (N,), w, b, residual=r)", residual=True),
    Chain("layernorm_dropout_relu", "ln",
          "F.relu(F.dropout(F.layer_norm(x, (N,), w, b), p=0.1, training=True))",
          "fused_layernorm(x, (N,), w, b, dropout_p=0.1, activation='relu')",
          dropout_p=DROPOUT_P, activation="relu"),
    Chain("add_layernorm_dropout_gelu", "ln",
          "s = x + r; y = F.gelu(F.dropout(F.layer_norm(s, (N,), w, b), p=0.1, training=True)); "
          "return y, s",
          "fused_layernorm(x, (N,), w, b, residual=r, dropout_p=0.1, activation='gelu')",
          residual=True, dropout_p=DROPOUT_P, activation="gelu"),
)
CHAINS: dict[str, Chain] = {c.name: c for c in CHAIN_LIST}
CHAIN_GROUPS = {
    "attn": tuple(c.name for c in CHAIN_LIST if c.kind == "attn"),
    "ln": tuple(c.name for c in CHAIN_LIST if c.kind == "ln"),
}
MODES = ("fwd", "fwd_bwd")
PROVIDERS = ("fusedops", "eager", "compile")
DEFAULT_DTYPES = ("bf16", "fp32")
ROWS = 16384
LN_SIZES = tuple((ROWS, n) for n in (768, 1024, 2048, 4096, 8192))
ATTN_SIZES = ((8, 12, 512), (4, 16, 1024), (2, 16, 2048))
# --device cpu without --sizes: tiny shapes (the CPU path exists for tests and smoke runs).
CPU_ROWS = 64
CPU_LN_SIZES = ((CPU_ROWS, 256),)
CPU_ATTN_SIZES = ((2, 2, 64),)

# P = B*H*S*S (elements of x), E = M*N, e = bytes per element of x (mask, weight and bias have
# x's dtype); the causal triangle and dropout's mask are bool (1 byte); mean + rstd are float32
# (8 bytes a row), written by a training forward and read by the backward.
BYTES_MODEL = {
    "attn_softmax": {
        "fwd": {"fused": "2Pe + BSe (read x, mask (B,1,1,S); write y)",
                "eager": "6Pe + BSe (mul 2Pe; add 2Pe + BSe; softmax 2Pe)"},
        "fwd_bwd": {"fused": "5Pe + BSe (fwd; bwd: read y, dy; write dx)",
                    "eager": "11Pe + BSe (fwd; softmax bwd 3Pe; add bwd passes the grad; "
                             "mul bwd 2Pe)"},
    },
    "attn_softmax_causal": {
        "fwd": {"fused": "2Pe + BSe (the triangle is computed, not read)",
                "eager": "8Pe + BSe + S^2 (mul; add; masked_fill 2Pe + S^2; softmax)"},
        "fwd_bwd": {"fused": "5Pe + BSe",
                    "eager": "15Pe + BSe + 2S^2 (fwd; softmax bwd 3Pe; masked_fill bwd "
                             "2Pe + S^2; mul bwd 2Pe)"},
    },
    "add_layernorm": {
        "fwd": {"fused": "4Ee + 2Ne (read x, r, w, b; write y, s)",
                "eager": "5Ee + 2Ne (add 3Ee; layer_norm 2Ee + 2Ne)"},
        "fwd_bwd": {"fused": "8Ee + 5Ne + 16M (fwd + 8M stats; bwd: read s, dy, ds, w, stats; "
                             "write dx (= dr), dw, db)",
                    "eager": "11Ee + 5Ne + 16M (fwd + 8M; layer_norm bwd 3Ee + 3Ne + 8M; "
                             "ds accumulation 3Ee; add bwd passes the grad)"},
    },
    "layernorm_dropout_relu": {
        "fwd": {"fused": "2Ee + 2Ne (read x, w, b; write out; the mask is regenerated)",
                "eager": "6Ee + E + 2Ne (layer_norm 2Ee + 2Ne; dropout 2Ee + E mask; "
                         "relu 2Ee)"},
        "fwd_bwd": {"fused": "5Ee + 6Ne + 16M (fwd + 8M; bwd: read x, dout, w, b, stats; "
                             "write dx, dw, db)",
                    "eager": "14Ee + 2E + 5Ne + 16M (fwd + 8M; relu bwd 3Ee; dropout bwd "
                             "2Ee + E; layer_norm bwd 3Ee + 3Ne + 8M)"},
    },
    "add_layernorm_dropout_gelu": {
        "fwd": {"fused": "4Ee + 2Ne (read x, r, w, b; write out, s)",
                "eager": "9Ee + E + 2Ne (add 3Ee; layer_norm 2Ee + 2Ne; dropout 2Ee + E; "
                         "gelu 2Ee)"},
        "fwd_bwd": {"fused": "8Ee + 6Ne + 16M (fwd + 8M; bwd: read s, dout, ds, w, b, stats; "
                             "write dx (= dr), dw, db)",
                    "eager": "20Ee + 2E + 5Ne + 16M (fwd + 8M; gelu bwd 3Ee; dropout bwd "
                             "2Ee + E; layer_norm bwd 3Ee + 3Ne + 8M; ds accumulation 3Ee)"},
    },
}


def bytes_terms(chain: str, mode: str, shape: Sequence[int], elt: int
                ) -> dict[str, list[tuple[str, int]]]:
    """The byte floors, op by op: ``{"fused": [(what, bytes)...], "eager": [...]}``.

    ``shape`` is (B, H, S) for the attention chains, (M, N) for the LayerNorm chains; ``elt`` is
    the element size of x (and of the mask, weight and bias, which share its dtype). Each entry is
    one op's floor (inputs read once, outputs written once); the eager chain is the sum of its
    ops', the fused chain one kernel per direction. See :data:`BYTES_MODEL` for the formulas.
    """
    c = _chain(chain)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    bwd = mode == "fwd_bwd"
    fused: list[tuple[str, int]] = []
    eager: list[tuple[str, int]] = []
    if c.kind == "attn":
        B, H, S = _attn_shape(shape)
        P = B * H * S * S
        x = P * elt
        m = B * S * elt  # the mask at its stored (B, 1, 1, S) size
        tri = S * S  # the bool causal triangle the eager chain reads
        fused.append(("fused softmax fwd: read x, mask; write y", 2 * x + m))
        eager.append(("x * scale", 2 * x))
        eager.append(("+ mask", 2 * x + m))
        if c.causal:
            eager.append(("masked_fill(triangle)", 2 * x + tri))
        eager.append(("softmax", 2 * x))
        if bwd:
            fused.append(("fused softmax bwd: read y, dy; write dx", 3 * x))
            eager.append(("softmax bwd", 3 * x))
            if c.causal:
                eager.append(("masked_fill bwd", 2 * x + tri))
            eager.append(("mul bwd (add bwd passes the grad through)", 2 * x))
        return {"fused": fused, "eager": eager}
    M, N = _ln_shape(shape)
    E = M * N * elt
    mask = M * N  # dropout's bool mask
    wb = 2 * N * elt  # weight + bias
    stats = 8 * M if bwd else 0  # float32 mean + rstd
    n_io = 2 if c.residual else 1  # tensors of x's shape read (x[, r]) and written (out[, s])
    fused.append(("fused fwd: read x" + (", r" if c.residual else "") + ", w, b; write out"
                  + (", s" if c.residual else "") + (", mean, rstd" if bwd else ""),
                  2 * n_io * E + wb + stats))
    if c.residual:
        eager.append(("x + r", 3 * E))
    eager.append(("layer_norm" + (" (+ mean, rstd)" if bwd else ""), 2 * E + wb + stats))
    if c.dropout_p:
        eager.append(("dropout (+ bool mask)", 2 * E + mask))
    if c.activation:
        eager.append((c.activation, 2 * E))
    if bwd:
        # read s (or x), dout[, ds], w[, b] (b to recompute the activation's input), mean, rstd;
        # write dx (also the residual's gradient), dw, db
        reads = 2 * E + (E if c.residual else 0)
        wb_bwd = (4 if c.activation else 3) * N * elt
        fused.append(("fused bwd: read " + ("s, dout, ds" if c.residual else "x, dout")
                      + ", w" + (", b" if c.activation else "")
                      + ", mean, rstd; write dx, dw, db", reads + E + wb_bwd + 8 * M))
        if c.activation:
            eager.append((f"{c.activation} bwd", 3 * E))
        if c.dropout_p:
            eager.append(("dropout bwd (reads the mask)", 2 * E + mask))
        eager.append(("layer_norm bwd", 3 * E + 3 * N * elt + 8 * M))
        if c.residual:
            eager.append(("ds + grad of s (accumulation; add bwd passes it through)", 3 * E))
    return {"fused": fused, "eager": eager}


def bytes_moved(chain: str, mode: str, shape: Sequence[int], elt: int) -> tuple[int, int]:
    """(fused floor, eager chain floor) in bytes; see :func:`bytes_terms`."""
    t = bytes_terms(chain, mode, shape, elt)
    return sum(b for _, b in t["fused"]), sum(b for _, b in t["eager"])


def _attn_shape(shape: Sequence[int]) -> tuple[int, int, int]:
    if len(shape) != 3:
        raise ValueError(f"attention chains take a (B, H, S) shape, got {tuple(shape)}")
    return int(shape[0]), int(shape[1]), int(shape[2])


def _ln_shape(shape: Sequence[int]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"LayerNorm chains take an (M, N) shape, got {tuple(shape)}")
    return int(shape[0]), int(shape[1])


def _chain(name: str) -> Chain:
    if name not in CHAINS:
        raise ValueError(f"unknown chain {name!r}; choose from {', '.join(CHAINS)}")
    return CHAINS[name]


def format_shape(shape: Sequence[int]) -> str:
    return "x".join(str(int(s)) for s in shape)


# --- the functions under test --------------------------------------------------------------------


def make_eager(chain: str, p: float | None = None) -> Callable:
    """The eager chain as a function of the chain's arguments (:func:`chain_args`); ``p``
    overrides the dropout probability (the correctness check runs it at 0)."""
    c = _chain(chain)
    p = c.dropout_p if p is None else p
    if c.name == "attn_softmax":
        def attn_softmax(x, mask):
            return torch.softmax(x * SCALE + mask, -1)
        return attn_softmax
    if c.name == "attn_softmax_causal":
        def attn_softmax_causal(x, mask, tri):
            return torch.softmax((x * SCALE + mask).masked_fill(tri, float("-inf")), -1)
        return attn_softmax_causal
    if c.name == "add_layernorm":
        def add_layernorm(x, r, w, b):
            s = x + r
            return F.layer_norm(s, (s.shape[-1],), w, b, EPS), s
        return add_layernorm
    if c.name == "layernorm_dropout_relu":
        def layernorm_dropout_relu(x, w, b):
            y = F.layer_norm(x, (x.shape[-1],), w, b, EPS)
            return F.relu(F.dropout(y, p=p, training=True))
        return layernorm_dropout_relu

    def add_layernorm_dropout_gelu(x, r, w, b):
        s = x + r
        y = F.layer_norm(s, (s.shape[-1],), w, b, EPS)
        return F.gelu(F.dropout(y, p=p, training=True)), s
    return add_layernorm_dropout_gelu


def make_fused(chain: str, p: float | None = None) -> Callable:
    """The fused call, with the same arguments as :func:`make_eager`'s function."""
    import fusedops

    c = _chain(chain)
    p = c.dropout_p if p is None else p
    if c.kind == "attn":
        if c.causal:
            def fused_causal(x, mask, tri):
                return fusedops.fused_softmax(x, -1, scale=SCALE, mask=mask, causal=True)
            return fused_causal

        def fused(x, mask):
            return fusedops.fused_softmax(x, -1, scale=SCALE, mask=mask)
        return fused
    act = c.activation
    if c.residual:
        def fused_res(x, r, w, b):
            return fusedops.fused_layernorm(x, (x.shape[-1],), w, b, EPS, residual=r,
                                            dropout_p=p, activation=act)
        return fused_res

    def fused_ln(x, w, b):
        return fusedops.fused_layernorm(x, (x.shape[-1],), w, b, EPS, dropout_p=p,
                                        activation=act)
    return fused_ln


def make_inputs(chain: str, shape: Sequence[int], dtype: torch.dtype, device: str,
                seed: int = 0) -> dict[str, Any]:
    """Fresh random data for one point: ``args`` (the chain functions' arguments), ``grad_idx``
    (which of them get gradients in ``fwd_bwd``) and ``grad_out`` (the fixed upstream gradient of
    each output).

    The attention mask is additive, ``(B, 1, 1, S)`` in x's dtype: 0 where kept, and the last
    ``L_b`` keys of batch b (0 <= L_b <= S/4, at least one key for b = 0) masked with ``-inf``
    (even b) or ``finfo.min`` (odd b), like a padding mask; the first key is never masked, so no
    row is empty (also under the causal triangle)."""
    c = _chain(chain)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if c.kind == "attn":
        B, H, S = _attn_shape(shape)
        x = torch.randn(B, H, S, S, device=device, dtype=dtype)
        mask = torch.zeros(B, 1, 1, S, dtype=torch.float32)
        max_pad = min(S // 4, S - 1)
        for b in range(B):
            low = 1 if b == 0 and max_pad > 0 else 0
            pad = int(torch.randint(low, max_pad + 1, (1,), generator=gen))
            if pad:
                mask[b, ..., S - pad:] = float("-inf") if b % 2 == 0 else torch.finfo(dtype).min
        mask = mask.to(device=device, dtype=dtype)
        args: tuple = (x, mask)
        if c.causal:
            args += (torch.ones(S, S, dtype=torch.bool, device=device).triu(1),)
        n_out = 1
        out_shape = x.shape
        grad_idx: tuple[int, ...] = (0,)
    else:
        M, N = _ln_shape(shape)
        x = torch.randn(M, N, device=device, dtype=dtype)
        w = (1.0 + 0.1 * torch.randn(N, device=device)).to(dtype)
        b = (0.1 * torch.randn(N, device=device)).to(dtype)
        if c.residual:
            r = torch.randn(M, N, device=device, dtype=dtype)
            args, grad_idx, n_out = (x, r, w, b), (0, 1, 2, 3), 2
        else:
            args, grad_idx, n_out = (x, w, b), (0, 1, 2), 1
        out_shape = x.shape
    return {"args": args, "grad_idx": grad_idx,
            "grad_out": None, "n_out": n_out, "out_shape": out_shape}


def _grad_out(inputs: dict, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    if inputs["grad_out"] is None:
        inputs["grad_out"] = tuple(torch.randn(inputs["out_shape"], device=device, dtype=dtype)
                                   for _ in range(inputs["n_out"]))
    return inputs["grad_out"]


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class _Step:
    """Forward + ``torch.autograd.grad`` of every output with the fixed upstream gradients."""

    def __init__(self, fn: Callable, inputs: dict, device: str, dtype: torch.dtype):
        args = list(inputs["args"])
        self.leaves = []
        for i in inputs["grad_idx"]:
            args[i] = args[i].detach().requires_grad_(True)
            self.leaves.append(args[i])
        self.args = tuple(args)
        self.fn = fn
        self.grad_out = _grad_out(inputs, device, dtype)

    def __call__(self):
        outs = _as_tuple(self.fn(*self.args))
        grads = torch.autograd.grad(outs, self.leaves, self.grad_out)
        return outs, grads


def _run(fn: Callable, inputs: dict, mode: str, device: str, dtype: torch.dtype):
    """One call of ``fn`` in ``mode``: (outputs, gradients) -- gradients empty in fwd."""
    if mode == "fwd":
        with torch.no_grad():
            return _as_tuple(fn(*inputs["args"])), ()
    with torch.enable_grad():
        outs, grads = _Step(fn, inputs, device, dtype)()
    return tuple(o.detach() for o in outs), tuple(grads)


def compare(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> tuple[float, float]:
    """(max abs error, max relative error) over tensors; relative = abs error / max |ref| of
    each tensor (:func:`fusedops.tools.bench.rel_error`); inf on a shape mismatch."""
    worst_abs = worst_rel = 0.0
    if len(got) != len(ref):
        return math.inf, math.inf
    for a, b in zip(got, ref, strict=True):
        if a.shape != b.shape:
            return math.inf, math.inf
        d = (a.detach().float() - b.detach().float()).abs().max().item() if b.numel() else 0.0
        r = rel_error(a, b)
        worst_abs = _worse(worst_abs, d)
        worst_rel = _worse(worst_rel, r)
    return worst_abs, worst_rel


def relu_tie_reference(chain: str, inputs: dict, fused_out: torch.Tensor, device: str,
                       dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], int, float]:
    """The eager ReLU chain at p = 0 with ReLU replaced by the fused forward's own keep pattern
    (``fused_out > 0``, a constant): ``(outputs + gradients, ties, worst)``. ``ties`` counts the
    elements where that pattern differs from eager's ``layer_norm(x) > 0``; ``worst`` is the
    largest ``|layer_norm(x)|`` among them over ``max |layer_norm(x)|`` -- a tie is only
    legitimate within rounding of 0 (a wrongly masked element anywhere else makes ``worst``
    large). Shapes as :func:`make_inputs`; ``fused_out`` is x's shape and dtype."""
    c = _chain(chain)
    if c.activation != "relu" or c.residual:
        raise ValueError(f"relu_tie_reference: chain {chain!r} is not a LayerNorm + ReLU chain")
    keep = fused_out.detach() > 0

    def kept(x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b, EPS) * keep

    outs, grads = _run(kept, inputs, "fwd_bwd", device, dtype)
    with torch.no_grad():
        x, w, b = inputs["args"]
        y = F.layer_norm(x, (x.shape[-1],), w, b, EPS)
        tied = keep != (y > 0)
        ties = int(tied.sum())
        worst = (float(y[tied].float().abs().max() / y.float().abs().max().clamp_min(1e-30))
                 if ties else 0.0)
    return outs + grads, ties, worst


def _worse(a: float, b: float) -> float:
    """The larger of two errors, nan (a non-finite output) winning."""
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return max(a, b)


def dropout_check(chain: str, inputs: dict, out: torch.Tensor, p: float) -> dict[str, Any]:
    """Check a fused forward output taken with dropout ``p``: each element is either 0 (dropped)
    or ``act(layer_norm(s) / (1 - p))`` computed in float32 (kept); ``drop_frac`` is the share
    of dropped elements among those whose kept value is not 0 (expected ``p``), ``max_abs_err`` /
    ``max_rel_err`` the error of the kept ones."""
    c = _chain(chain)
    args = inputs["args"]
    if c.residual:
        x, r, w, b = args
        s = x + r
    else:
        s, w, b = args
    v = F.layer_norm(s.float(), (s.shape[-1],), w.float(), b.float(), EPS) / (1.0 - p)
    ref = torch.relu(v) if c.activation == "relu" else F.gelu(v)
    out = out.detach().float()
    nz = ref != 0
    dropped = (out == 0) & nz
    n = int(nz.sum())
    frac = float(dropped.sum()) / max(n, 1)
    kept = ~dropped
    err = (out - ref).abs()[kept]
    max_abs = float(err.max()) if err.numel() else 0.0
    max_rel = max_abs / max(float(ref.abs().max()), 1e-12)
    # the dropped share is binomial: allow 6 standard deviations (and at least 0.005)
    slack = max(0.005, 6 * math.sqrt(p * (1 - p) / max(n, 1)))
    tol = CHECK_TOL.get(args[0].dtype, 1e-3)
    return {"p": p, "elements": n, "drop_frac": frac, "drop_frac_ok": abs(frac - p) <= slack,
            "max_abs_err": max_abs, "max_rel_err": max_rel,
            "ok": abs(frac - p) <= slack and max_rel <= tol}


# --- parsing -------------------------------------------------------------------------------------


def _split(values: str | Sequence[str] | None) -> list[str] | None:
    return bench._split(values)


def resolve_chains(chains: str | Sequence[str] | None) -> tuple[str, ...]:
    """'all' (default), chain names (``-`` for ``_`` allowed), or the groups 'attn' / 'ln'."""
    names = _split(chains)
    if not names or names == ["all"]:
        return tuple(CHAINS)
    chosen: list[str] = []
    for raw in names:
        name = raw.strip().lower().replace("-", "_")
        if name in CHAINS:
            match: tuple[str, ...] = (name,)
        elif name in CHAIN_GROUPS:
            match = CHAIN_GROUPS[name]
        elif name in ("layernorm", "norm"):
            match = CHAIN_GROUPS["ln"]
        elif name in ("attention", "softmax"):
            match = CHAIN_GROUPS["attn"]
        else:
            raise ValueError(f"unknown chain {raw!r}; choose from {', '.join(CHAINS)} "
                             "(or all, attn, ln)")
        chosen.extend(m for m in match if m not in chosen)
    return tuple(c for c in CHAINS if c in chosen)


def resolve_modes(modes: str | Sequence[str] | None) -> tuple[str, ...]:
    names = _split(modes)
    if not names or names == ["all"]:
        return MODES
    out = []
    for n in names:
        n = {"fwd+bwd": "fwd_bwd", "fwdbwd": "fwd_bwd", "train": "fwd_bwd", "forward": "fwd",
             "fwd-bwd": "fwd_bwd"}.get(n.lower(), n.lower())
        if n not in MODES:
            raise ValueError(f"unknown mode {n!r}; choose from {', '.join(MODES)}")
        if n not in out:
            out.append(n)
    return tuple(m for m in MODES if m in out)


def resolve_providers(providers: str | Sequence[str] | None) -> tuple[str, ...]:
    names = _split(providers)
    if not names or names == ["all"]:
        return PROVIDERS
    out = []
    for n in names:
        n = {"fused": "fusedops", "torch": "eager", "unfused": "eager", "inductor": "compile",
             "torch.compile": "compile"}.get(n.lower(), n.lower())
        if n not in PROVIDERS:
            raise ValueError(f"unknown provider {n!r}; choose from {', '.join(PROVIDERS)}")
        if n not in out:
            out.append(n)
    return tuple(p for p in PROVIDERS if p in out)


def resolve_dtypes(dtypes: str | Sequence[str] | None) -> tuple[str, ...]:
    if dtypes is None:
        return DEFAULT_DTYPES
    return bench.resolve_dtypes(dtypes)


def parse_shape(text: str, rows: int = ROWS) -> tuple[int, ...]:
    """'768' or '1K' -> (rows, N); '16384x768' -> (M, N); '8x12x512' -> (B, H, S). Each part
    takes :func:`fusedops.tools.bench.parse_size` syntax ('16K', '2^14')."""
    parts = [p for p in text.strip().lower().replace("*", "x").split("x")]
    if not all(parts) or not 1 <= len(parts) <= 3:
        raise ValueError(f"bad size {text!r}: expected N, MxN or BxHxS")
    try:
        dims = tuple(parse_size(p) for p in parts)
    except ValueError:
        raise ValueError(f"bad size {text!r}: expected N, MxN or BxHxS") from None
    if any(d < 1 for d in dims):
        raise ValueError(f"sizes must be positive, got {text!r}")
    return (rows,) + dims if len(dims) == 1 else dims


def resolve_sizes(sizes: str | Sequence[str | Sequence[int]] | None, rows: int | None = None,
                  device: str = "cuda") -> dict[str, tuple[tuple[int, ...], ...]]:
    """``{"ln": ((M, N), ...), "attn": ((B, H, S), ...)}``. Entries with one or two parts go to
    the LayerNorm chains (one part: N, with M = ``rows``), three parts to the attention chains;
    a kind that gets no entry keeps its default grid (tiny ones on CPU)."""
    cpu = device == "cpu"
    if rows is None:
        rows = CPU_ROWS if cpu else ROWS
    ln_default = tuple((rows, n) for _, n in (CPU_LN_SIZES if cpu else LN_SIZES))
    out: dict[str, list[tuple[int, ...]]] = {"ln": [], "attn": []}
    items: list = []
    if isinstance(sizes, str):
        items = _split(sizes) or []
    elif sizes is not None:
        items = list(sizes)
    for item in items:
        shape = (parse_shape(item, rows) if isinstance(item, str)
                 else (rows, int(item)) if isinstance(item, int) else tuple(int(v) for v in item))
        kind = "attn" if len(shape) == 3 else "ln"
        if shape not in out[kind]:
            out[kind].append(shape)
    return {
        "ln": tuple(out["ln"]) or ln_default,
        "attn": tuple(out["attn"]) or (CPU_ATTN_SIZES if cpu else ATTN_SIZES),
    }


# --- the run -------------------------------------------------------------------------------------


def _base_record(chain: str, mode: str, dtype_name: str, shape: tuple[int, ...], provider: str,
                 elt: int) -> dict[str, Any]:
    c = CHAINS[chain]
    fused, eager = bytes_moved(chain, mode, shape, elt)
    dims = (dict(zip(("B", "H", "S"), shape, strict=True)) if c.kind == "attn"
            else dict(zip(("M", "N"), shape, strict=True)))
    own = {"fusedops": fused, "eager": eager}.get(provider)
    return {
        "chain": chain, "mode": mode, "dtype": dtype_name, "shape": format_shape(shape),
        **dims, "provider": provider, "backend": None, "status": "error", "ok": None,
        "ms": None, "ms_p20": None, "ms_p80": None, "ms_gpu": None, "speedup_gpu": {},
        "bytes_fused": fused, "bytes_eager": eager, "traffic_ratio": eager / fused,
        "bytes_own": own, "tbps": None, "own_tbps": None, "copy_tbps": None, "frac_copy": None,
        "speedup": {}, "max_abs_err": None, "max_rel_err": None, "check": None,
        "dropout_check": None, "relu_ties": None, "relu_tie_worst": None, "compile_s": None,
        "first_call_s": None, "error": None,
    }


def _backend_name(provider: str, x: torch.Tensor, compile_backend: str) -> str:
    if provider == "eager":
        return "eager"
    if provider == "compile":
        return f"torch.compile({compile_backend})"
    try:
        from fusedops import _dispatch

        return _dispatch.backend_for(x).NAME
    except Exception:
        return "fusedops"


def annotate_speedups(records: list[dict]) -> None:
    """``speedup`` = {other provider: other ms / this ms} within each (chain, mode, dtype,
    shape); ``speedup_gpu`` the same of the GPU-ahead times (``ms_gpu``, CUDA only)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["chain"], r["mode"], r["dtype"], r["shape"]), []).append(r)
    for group in groups.values():
        for r in group:
            for key, out in (("ms", "speedup"), ("ms_gpu", "speedup_gpu")):
                r[out] = {o["provider"]: o[key] / r[key] for o in group
                          if o is not r and r.get(key) and o.get(key)}


def run_chains(
    chains: str | Sequence[str] | None = None,
    dtypes: str | Sequence[str] | None = None,
    sizes: str | Sequence | None = None,
    modes: str | Sequence[str] | None = None,
    providers: str | Sequence[str] | None = None,
    device: str | None = None,
    rows: int | None = None,
    warmup_ms: float | None = None,
    rep_ms: float | None = None,
    check: bool = True,
    time_budget_s: float | None = None,
    compile_budget_s: float | None = None,
    compile_backend: str = "inductor",
    copy_elements: int | None = None,
    progress: bool = True,
    seed: int = 0,
    on_point: Callable[[dict], None] | None = None,
) -> dict[str, Any]:
    """Run the chain benchmark and return the result dict (what ``--out`` writes as JSON).

    Args:
        chains, dtypes, modes, providers: subsets (names, comma strings or lists); defaults:
            every chain, bf16 + fp32, fwd + fwd_bwd, fusedops + eager + compile.
        sizes: shapes (:func:`resolve_sizes`); default the grid of :data:`LN_SIZES` and
            :data:`ATTN_SIZES` (tiny shapes on CPU).
        rows: M for sizes given as N alone (default 16384; 64 on CPU).
        warmup_ms, rep_ms: timing windows per measurement (default 5 / 25 ms on CUDA, 1 / 3
            on CPU).
        check: compare fused (and compiled, where it has no dropout) with eager on the same data.
        time_budget_s: start no new point after this many seconds (the rest is skipped).
        compile_budget_s: stop running the compile provider once compiling took this long.
        compile_backend: torch.compile backend (default inductor; "eager" for a quick dry run).
        on_point: called with the partial result after every point (e.g. to save progress).
    """
    device = device or default_device()
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but CUDA is not available")
    if device == "mps" and not (getattr(torch.backends, "mps", None)
                                and torch.backends.mps.is_available()):
        raise RuntimeError("--device mps requested but MPS is not available")
    chains_t = resolve_chains(chains)
    dtypes_t = resolve_dtypes(dtypes)
    modes_t = resolve_modes(modes)
    prov_t = resolve_providers(providers)
    sizes_d = resolve_sizes(sizes, rows, device)
    defaults = {"cuda": (5.0, 25.0), "mps": (10.0, 50.0), "cpu": (1.0, 3.0)}[device]
    warmup_ms = defaults[0] if warmup_ms is None else warmup_ms
    rep_ms = defaults[1] if rep_ms is None else rep_ms
    if copy_elements is None:
        copy_elements = 2**14 if device == "cpu" else bench.TOTAL_ELEMENTS

    timer = Timer(device, warmup_ms, rep_ms)
    t_start = time.perf_counter()
    now = _dt.datetime.now(_dt.timezone.utc)
    name = device_name(device)
    result: dict[str, Any] = {
        "benchmark": "chains",
        "device": name,
        "device_type": device,
        **bench._versions(),
        "date": now.strftime("%Y-%m-%d"),
        "timestamp": now.isoformat(timespec="seconds"),
        "copy_tbps": None,
        "copy": None,
        "config": {
            "chains": list(chains_t), "dtypes": list(dtypes_t), "modes": list(modes_t),
            "providers": list(prov_t),
            "sizes": {c: [format_shape(s) for s in sizes_d[CHAINS[c].kind]] for c in chains_t},
            "scale": SCALE, "dropout_p": DROPOUT_P, "eps": EPS,
            "warmup_ms": warmup_ms, "rep_ms": rep_ms, "check": check,
            "compile_backend": compile_backend,
            "timing": "triton.testing.do_bench median (L2 flushed before each call)"
            if device == "cuda" else "time.perf_counter median, synchronised per call",
            "fwd": "forward under torch.no_grad() (dropout on, training=True)",
            "fwd_bwd": "forward with grad + torch.autograd.grad of every output with a fixed "
                       "upstream gradient, into every input but the mask",
            "tbps": "fused floor bytes / median time, for every provider",
            "check_desc": "max error of the provider vs the eager chain on the same data, "
                          "dropout p forced to 0 for both (fwd: outputs; fwd_bwd: outputs and "
                          "gradients); fused dropout checked separately at p (dropout_check)",
            "check_tolerance": {k: CHECK_TOL[v] for k, v in DTYPES.items()},
        },
        "chains": {c: {"eager": CHAINS[c].eager, "fused": CHAINS[c].fused} for c in chains_t},
        "bytes_model": {c: BYTES_MODEL[c] for c in chains_t},
        "records": [],
        "skipped": [],
        "truncated": False,
    }
    copy = measure_copy_bandwidth(device, timer, copy_elements)
    result["copy"] = copy
    result["copy_tbps"] = copy_tbps = copy["tbps"]
    if progress:
        print(f"fusedops bench-chains: {name}, copy {copy_tbps:.3f} TB/s", file=sys.stderr)

    points = [(dt, c, s) for dt in dtypes_t for c in chains_t for s in sizes_d[CHAINS[c].kind]]
    bar = Progress(len(points), enabled=progress)
    records = result["records"]
    compile_spent = 0.0
    for idx, (dt_name, chain, shape) in enumerate(points):
        label = f"{chain} {dt_name} {format_shape(shape)}"
        if time_budget_s is not None and time.perf_counter() - t_start > time_budget_s:
            result["truncated"] = True
            result["skipped"].extend({"chain": c2, "dtype": d2, "shape": format_shape(s2),
                                      "reason": "time budget"} for d2, c2, s2 in points[idx:])
            break
        bar.update(label)
        dtype = DTYPES[dt_name]
        skip_compile = compile_budget_s is not None and compile_spent > compile_budget_s
        recs = _run_point(chain, shape, dt_name, dtype, device, modes_t, prov_t, timer, check,
                          copy_tbps, compile_backend, skip_compile, seed + idx)
        compile_spent += sum(r["compile_s"] or 0.0 for r in recs)
        records.extend(recs)
        annotate_speedups(records)
        empty_cache(device)
        result["elapsed_s"] = time.perf_counter() - t_start
        bar.update(label, advance=1)
        if on_point:
            on_point(result)
    bar.close()
    annotate_speedups(records)
    result["compile_s_total"] = compile_spent
    result["elapsed_s"] = time.perf_counter() - t_start
    return result


def _run_point(chain: str, shape: tuple[int, ...], dt_name: str, dtype: torch.dtype, device: str,
               modes: Sequence[str], providers: Sequence[str], timer: Timer, check: bool,
               copy_tbps: float | None, compile_backend: str, skip_compile: bool,
               seed: int) -> list[dict]:
    """Every provider and mode at one (chain, dtype, shape) point, on one set of data."""
    elt = torch.empty((), dtype=dtype).element_size()
    records: list[dict] = []
    try:
        inputs = make_inputs(chain, shape, dtype, device, seed)
        if any(m == "fwd_bwd" for m in modes):
            _grad_out(inputs, device, dtype)
    except Exception as exc:
        for p in providers:
            for m in modes:
                rec = _base_record(chain, m, dt_name, shape, p, elt)
                rec["error"] = "setup: " + bench._short_error(exc)
                records.append(rec)
        return records
    x = inputs["args"][0]
    refs: dict[str, tuple] = {}
    check_error: str | None = None
    if check:
        # The eager chain with dropout off is the reference of every mode.
        try:
            eager0 = make_eager(chain, p=0.0)
            for m in modes:
                outs, grads = _run(eager0, inputs, m, device, dtype)
                refs[m] = outs + grads
        except Exception as exc:
            refs = {}
            check_error = "reference: " + bench._short_error(exc)
    for prov in providers:
        fn: Callable | None = None
        try:
            if prov == "fusedops":
                fn = make_fused(chain)
            elif prov == "eager":
                fn = make_eager(chain)
            else:
                torch._dynamo.reset()
                fn = torch.compile(make_eager(chain), dynamic=False, backend=compile_backend)
            make_error = None
        except Exception as exc:
            make_error = bench._short_error(exc)
        for m in modes:
            rec = _base_record(chain, m, dt_name, shape, prov, elt)
            records.append(rec)
            rec["backend"] = _backend_name(prov, x, compile_backend)
            if prov == "compile" and skip_compile:
                rec["status"] = "skipped"
                rec["error"] = "compile budget spent"
                continue
            if make_error is not None:
                rec["error"] = make_error
                continue
            try:
                _measure(rec, chain, fn, inputs, m, device, dtype, timer, check, refs,
                         check_error, copy_tbps)
            except Exception as exc:
                rec["status"] = "error"
                rec["error"] = bench._short_error(exc)
                if isinstance(exc, bench._OOM):
                    empty_cache(device)
        fn = None
        if prov == "compile":
            torch._dynamo.reset()
    del inputs, refs
    return records


def _measure(rec: dict, chain: str, fn: Callable, inputs: dict, mode: str, device: str,
             dtype: torch.dtype, timer: Timer, check: bool, refs: dict, check_error: str | None,
             copy_tbps: float | None) -> None:
    c = CHAINS[chain]
    prov = rec["provider"]
    if mode == "fwd":
        args = inputs["args"]

        def call(fn=fn, args=args):
            return fn(*args)

        with torch.no_grad():
            t0 = time.perf_counter()
            out = _as_tuple(call())
            synchronize(device)
            first = time.perf_counter() - t0
            got = out
            del out
    else:
        step = _Step(fn, inputs, device, dtype)
        with torch.enable_grad():
            t0 = time.perf_counter()
            outs, grads = step()
            synchronize(device)
            first = time.perf_counter() - t0
            got = tuple(o.detach() for o in outs) + tuple(grads)
            del outs, grads

        def call(step=step):
            with torch.enable_grad():
                return step()

    rec["first_call_s"] = first
    if prov == "compile":
        rec["compile_s"] = first
    # --- correctness -----------------------------------------------------------------------
    if check:
        if check_error is not None:
            rec["check"] = check_error
        elif prov == "eager":
            rec["check"] = "reference"
        elif prov == "compile" and c.dropout_p:
            rec["check"] = "not compared (its dropout masks differ from eager's)"
        else:
            ref = refs[mode]
            tie_ok = True
            if prov == "fusedops" and c.dropout_p:
                # Same chain with dropout off, on the same data.
                got = _run(make_fused(chain, p=0.0), inputs, mode, device, dtype)
                got = got[0] + got[1]
                rec["check"] = "vs eager, dropout p = 0 for both"
                if c.activation == "relu" and mode == "fwd_bwd":
                    ref, ties, worst = relu_tie_reference(chain, inputs, got[0], device, dtype)
                    rec["relu_ties"], rec["relu_tie_worst"] = ties, worst
                    rec["check"] += ", ReLU ties kept as the fused forward broke them"
                    tie_ok = worst <= RELU_TIE_TOL.get(dtype, 1e-5)
            else:
                rec["check"] = "vs eager"
            rec["max_abs_err"], rec["max_rel_err"] = compare(got, ref)
            rec["ok"] = rec["max_rel_err"] <= CHECK_TOL.get(dtype, 1e-3) and tie_ok
            if prov == "fusedops" and c.dropout_p and mode == "fwd":
                with torch.no_grad():
                    out_p = _as_tuple(fn(*inputs["args"]))[0]
                rec["dropout_check"] = dropout_check(chain, inputs, out_p, c.dropout_p)
                del out_p
                rec["ok"] = bool(rec["ok"] and rec["dropout_check"]["ok"])
    del got
    # --- timing ------------------------------------------------------------------------------
    if mode == "fwd":
        with torch.no_grad():
            ms, lo, hi = timer(call)
    else:
        ms, lo, hi = timer(call)
    rec["ms"], rec["ms_p20"], rec["ms_p80"] = ms, lo, hi
    gpu_ahead = getattr(timer, "gpu_ahead", None)
    if gpu_ahead is not None:
        try:  # an extra measurement: its failure must not cost the record
            if mode == "fwd":
                with torch.no_grad():
                    rec["ms_gpu"] = gpu_ahead(call)
            else:
                rec["ms_gpu"] = gpu_ahead(call)
        except Exception as exc:
            rec["ms_gpu_error"] = bench._short_error(exc)
    rec["tbps"] = rec["bytes_fused"] / (ms * 1e-3) / 1e12
    if rec["bytes_own"] is not None:
        rec["own_tbps"] = rec["bytes_own"] / (ms * 1e-3) / 1e12
    rec["copy_tbps"] = copy_tbps
    rec["frac_copy"] = rec["tbps"] / copy_tbps if copy_tbps else None
    rec["status"] = "ok" if rec["ok"] in (True, None) else "wrong"


# --- outputs -------------------------------------------------------------------------------------

CSV_FIELDS = (
    "chain", "mode", "dtype", "shape", "B", "H", "S", "M", "N", "provider", "backend", "status",
    "ok", "ms", "ms_p20", "ms_p80", "ms_gpu", "bytes_fused", "bytes_eager", "traffic_ratio",
    "bytes_own",
    "tbps", "own_tbps", "copy_tbps", "frac_copy", "speedup_vs_fusedops", "speedup_vs_eager",
    "speedup_vs_compile", "gpu_speedup_vs_fusedops", "gpu_speedup_vs_eager",
    "gpu_speedup_vs_compile", "max_abs_err", "max_rel_err", "check", "relu_ties", "relu_tie_worst",
    "drop_frac", "dropout_max_rel_err", "compile_s", "first_call_s", "error",
    "device", "torch", "triton", "fusedops", "date",
)


def default_stem(result: dict, tag: str | None = None) -> str:
    from fusedops.tools.bench_report import slug

    return tag or f"chains-{slug(str(result.get('device', 'device')))}-{result.get('date')}"


def write_csv(result: dict, path: str | Path) -> Path:
    """One row per record; every row also names the device, versions and date."""
    from fusedops.tools.bench_report import _csv_value  # the bench's cell format
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    run = {k: result.get(k) for k in ("device", "torch", "triton", "fusedops", "date")}
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in result["records"]:
            row = {k: r.get(k) for k in CSV_FIELDS}
            for p, s in (r.get("speedup") or {}).items():
                row[f"speedup_vs_{p}"] = s
            for p, s in (r.get("speedup_gpu") or {}).items():
                row[f"gpu_speedup_vs_{p}"] = s
            dc = r.get("dropout_check") or {}
            row["drop_frac"] = dc.get("drop_frac")
            row["dropout_max_rel_err"] = dc.get("max_rel_err")
            row.update(run)
            w.writerow({k: _csv_value(v) for k, v in row.items()})
    return path




def _grid(records: Sequence[dict]) -> dict[tuple, dict[str, dict]]:
    rows: dict[tuple, dict[str, dict]] = {}
    for r in records:
        rows.setdefault((r["chain"], r["dtype"], r["shape"], r["mode"]), {})[r["provider"]] = r
    return rows


def _order(result: dict, keys) -> list[tuple]:
    chains = list(CHAINS)
    dtypes = list(DTYPES)
    return sorted(keys, key=lambda k: (chains.index(k[0]) if k[0] in chains else 99,
                                       dtypes.index(k[1]) if k[1] in dtypes else 9,
                                       [int(v) for v in k[2].split("x")],
                                       MODES.index(k[3]) if k[3] in MODES else 9))


def _err(r: dict | None, key: str) -> str:
    v = (r or {}).get(key)
    return "-" if v is None else f"{v:.1e}"


def format_table(result: dict) -> str:
    """The short table: per chain, dtype, shape and mode: the traffic ratio, each provider's
    median ms, fused speedups, fused TB/s and fraction of copy, the fused max abs / relative
    error against the eager chain."""
    grid = _grid(result.get("records", []))

    def ms(r):
        if r is None:
            return "-"
        if r.get("ms") is None:
            return r.get("status") or "-"
        return f"{r['ms']:.3f}" + ("!" if r.get("ok") is False else "")

    def sp(r, other, key="speedup"):
        v = (r or {}).get(key, {}).get(other)
        return f"{v:.2f}x" if v else "-"

    head = ["chain", "dtype", "shape", "mode", "bytes x", "fused ms", "eager ms", "compile ms",
            "vs eager", "vs compile", "gpu vs eager", "TB/s", "of copy", "abs err", "rel err"]
    rows = []
    for key in _order(result, grid):
        row = grid[key]
        f = row.get("fusedops")
        any_rec = next(iter(row.values()))
        rows.append([
            key[0], key[1], key[2], key[3], f"{any_rec['traffic_ratio']:.2f}", ms(f),
            ms(row.get("eager")), ms(row.get("compile")), sp(f, "eager"), sp(f, "compile"),
            sp(f, "eager", "speedup_gpu"), f"{f['tbps']:.2f}" if f and f.get("tbps") else "-",
            f"{f['frac_copy']:.2f}" if f and f.get("frac_copy") else "-",
            _err(f, "max_abs_err"), _err(f, "max_rel_err"),
        ])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    lines = [f"fused epilogue chains on {result.get('device')} ({result.get('date')}), copy "
             f"{result.get('copy_tbps') or 0:.3f} TB/s; TB/s = fused floor bytes / time; "
             "bytes x = eager / fused floor; ! = wrong output; gpu vs eager = the same speedup "
             "of GPU-ahead times (host far ahead, CUDA only)"]
    lines.append("  ".join(h.rjust(w) if i >= 4 else h.ljust(w)
                           for i, (h, w) in enumerate(zip(head, widths, strict=True))))
    for r in rows:
        lines.append("  ".join(v.rjust(w) if i >= 4 else v.ljust(w)
                               for i, (v, w) in enumerate(zip(r, widths, strict=True))))
    if result.get("truncated"):
        lines.append(f"truncated: {len(result.get('skipped', []))} points skipped (time budget)")
    return "\n".join(lines)


DTYPE_COLORS = {"bf16": ("#d62728", "#ff9896"), "fp16": ("#ff7f0e", "#ffbb78"),
                "fp32": ("#1f77b4", "#aec7e8")}


def plot_speedups(result: dict, path: str | Path) -> Path:
    """One PNG: a panel per (mode, chain), a group of bars per shape: fused speedup vs eager
    (solid) and vs compile (hatched) per dtype; a black tick over each 'vs eager' bar marks the
    traffic ratio (the speedup at equal bandwidth); the dashed line is 1x."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recs = [r for r in result.get("records", []) if r["provider"] == "fusedops"]
    chains = [c for c in CHAINS if any(r["chain"] == c for r in recs)] or ["(none)"]
    modes = [m for m in MODES if any(r["mode"] == m for r in recs)] or ["fwd"]
    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in recs)]
    fig = Figure(figsize=(4.2 * len(chains), 0.6 + 3.4 * len(modes)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(modes), len(chains), squeeze=False)
    for row, mode in zip(axes, modes, strict=True):
        for ax, chain in zip(row, chains, strict=True):
            sub = [r for r in recs if r["chain"] == chain and r["mode"] == mode]
            shapes = sorted({r["shape"] for r in sub},
                            key=lambda s: [int(v) for v in s.split("x")])
            nbars = max(1, 2 * len(dtypes))
            width = 0.8 / nbars
            for di, dt in enumerate(dtypes):
                solid, light = DTYPE_COLORS.get(dt, ("#7f7f7f", "#c7c7c7"))
                for bi, other in enumerate(("eager", "compile")):
                    xs, ys, ratios = [], [], []
                    for si, shape in enumerate(shapes):
                        r = next((r for r in sub if r["shape"] == shape and r["dtype"] == dt),
                                 None)
                        v = (r or {}).get("speedup", {}).get(other)
                        if v:
                            xs.append(si - 0.4 + width * (2 * di + bi + 0.5))
                            ys.append(v)
                            ratios.append(r["traffic_ratio"])
                    if not xs:
                        continue
                    ax.bar(xs, ys, width=width, color=solid if other == "eager" else light,
                           hatch=None if other == "eager" else "//", edgecolor=solid,
                           label=f"{dt} vs {other}")
                    if other == "eager":
                        ax.scatter(xs, ratios, marker="_", s=120, color="black", zorder=5,
                                   label="traffic ratio" if di == 0 else None)
            ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
            ax.set_xticks(range(len(shapes)))
            ax.set_xticklabels(shapes, fontsize=7, rotation=20)
            ax.set_title(f"{chain} {mode}", fontsize=9)
            ax.set_ylim(bottom=0)
            ax.grid(True, axis="y", alpha=0.3)
        row[0].set_ylabel("fused speedup (x)")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle(f"fused epilogue chains on {result.get('device')} ({result.get('date')})",
                 fontsize=10)
    fig.savefig(path, dpi=110)
    return path


def write_outputs(result: dict, out_dir: str | Path, stem: str | None = None,
                  plot: bool = True) -> list[Path]:
    """``<stem>.json``, ``<stem>.csv``, ``<stem>.txt`` (the table) and ``<stem>-speedup.png``."""
    from fusedops.tools.bench_report import write_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = default_stem(result, stem)
    paths = [write_json(result, out / f"{stem}.json"), write_csv(result, out / f"{stem}.csv")]
    txt = out / f"{stem}.txt"
    txt.write_text(format_table(result) + "\n")
    paths.append(txt)
    if plot and result.get("records"):
        paths.append(plot_speedups(result, out / f"{stem}-speedup.png"))
    return paths


# --- CLI -----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fusedops bench-chains",
        description="Benchmark the fused epilogue chains (scale + mask (+ causal) + softmax; "
        "residual + LayerNorm + dropout + activation) against the unfused eager chain and "
        "torch.compile of it: bytes moved, time, TB/s, fraction of copy bandwidth, speedups, "
        "correctness; JSON/CSV/TXT/PNG under --out.",
    )
    p.add_argument("--device", choices=("cuda", "mps", "cpu"), default=None,
                   help="default: cuda if available, else mps, else cpu (tiny sizes)")
    p.add_argument("--chains", default=None,
                   help=f"comma list of {', '.join(CHAINS)}, or attn / ln (default all)")
    p.add_argument("--dtypes", default=None,
                   help="comma list of bf16,fp16,fp32 or all (default bf16,fp32)")
    p.add_argument("--sizes", default=None,
                   help="comma list of shapes: N or MxN for the LayerNorm chains (N alone: M = "
                   "--rows), BxHxS for the attention chains; a kind with no entry keeps its "
                   "default (LN: 16384 x 768,1K,2K,4K,8K; attention: 8x12x512,4x16x1024,"
                   "2x16x2048)")
    p.add_argument("--rows", type=parse_size, default=None,
                   help="M for LayerNorm sizes given as N (default 16384; 64 on cpu)")
    p.add_argument("--modes", default=None, help="fwd, fwd_bwd or both (default both)")
    p.add_argument("--providers", default=None,
                   help=f"comma list of {', '.join(PROVIDERS)} (default all)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up ms per measurement")
    p.add_argument("--rep", type=float, default=None, help="measurement ms per measurement")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds; start no new point after this (the rest is listed as skipped)")
    p.add_argument("--compile-budget", type=float, default=None,
                   help="seconds of compiling after which the compile provider is skipped")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend (default inductor; 'eager' for a dry run)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness comparison")
    p.add_argument("--out", default="out/bench-chains",
                   help="output folder (default out/bench-chains)")
    p.add_argument("--tag", default=None,
                   help="file name stem (default chains-<gpu>-<date>)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = args.device or default_device()
    try:
        chains = resolve_chains(args.chains)
        dtypes = resolve_dtypes(args.dtypes)
        modes = resolve_modes(args.modes)
        providers = resolve_providers(args.providers)
        sizes = resolve_sizes(args.sizes, args.rows, device)
    except ValueError as exc:
        print(f"fusedops bench-chains: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    state: dict[str, Any] = {}

    def checkpoint(partial: dict) -> None:
        # Keep a JSON of what is done so far: a killed run still leaves its results.
        from fusedops.tools.bench_report import write_json

        state["stem"] = state.get("stem") or default_stem(partial, args.tag)
        write_json(partial, out_dir / f"{state['stem']}.json")

    flat_sizes = list(sizes["ln"]) + list(sizes["attn"])
    try:
        result = run_chains(
            chains=chains, dtypes=dtypes, sizes=flat_sizes, modes=modes, providers=providers,
            device=device, rows=args.rows, warmup_ms=args.warmup, rep_ms=args.rep,
            check=not args.no_check, time_budget_s=args.budget,
            compile_budget_s=args.compile_budget, compile_backend=args.compile_backend,
            progress=not args.quiet, seed=args.seed, on_point=checkpoint,
        )
    except RuntimeError as exc:
        print(f"fusedops bench-chains: {exc}", file=sys.stderr)
        return 2
    paths = write_outputs(result, out_dir, stem=state.get("stem") or args.tag,
                          plot=not args.no_plot)
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr, flush=True)
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
