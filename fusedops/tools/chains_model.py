"""The fused epilogue chains that ``python -m fusedops bench-chains`` times: what each chain
computes (eager and fused), its data, and the bytes it must move.

Chains (:data:`CHAINS`): ``attn_softmax`` (``softmax(x * scale + mask)``, additive float padding
mask ``(B, 1, 1, S)``), ``attn_softmax_causal`` (the same plus the causal triangle),
``add_layernorm`` (``s = x + r; y = layer_norm(s)``, returning ``(y, s)``),
``layernorm_dropout_relu`` and ``add_layernorm_dropout_gelu`` (dropout p = 0.1, training).

Bytes (:func:`bytes_terms`): the fused *floor* (each input read once, each output written once)
and the eager chain's sum of per-op floors (dropout's bool mask included). Also the names and
shapes the command line accepts (:func:`resolve_chains`, :func:`resolve_sizes`, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fusedops.tools.bench_harness import parse_size, split_list
from fusedops.tools.bench_harness import resolve_dtypes as resolve_bench_dtypes
from fusedops.tools.cli import UsageError

HEAD_DIM = 64
SCALE = 1.0 / math.sqrt(HEAD_DIM)
DROPOUT_P = 0.1
EPS = 1e-5


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
    c = get_chain(chain)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    bwd = mode == "fwd_bwd"
    fused: list[tuple[str, int]] = []
    eager: list[tuple[str, int]] = []
    if c.kind == "attn":
        B, H, S = attn_shape(shape)
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
    M, N = ln_shape(shape)
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


def attn_shape(shape: Sequence[int]) -> tuple[int, int, int]:
    """(B, H, S) of an attention chain's shape."""
    if len(shape) != 3:
        raise ValueError(f"attention chains take a (B, H, S) shape, got {tuple(shape)}")
    return int(shape[0]), int(shape[1]), int(shape[2])


def ln_shape(shape: Sequence[int]) -> tuple[int, int]:
    """(M, N) of a LayerNorm chain's shape."""
    if len(shape) != 2:
        raise ValueError(f"LayerNorm chains take an (M, N) shape, got {tuple(shape)}")
    return int(shape[0]), int(shape[1])


def get_chain(name: str) -> Chain:
    """The :class:`Chain` called ``name``; :class:`UsageError` for an unknown name."""
    if name not in CHAINS:
        raise UsageError(f"unknown chain {name!r}; choose from {', '.join(CHAINS)}")
    return CHAINS[name]


def format_shape(shape: Sequence[int]) -> str:
    return "x".join(str(int(s)) for s in shape)


# --- the functions under test --------------------------------------------------------------------


def make_eager(chain: str, p: float | None = None) -> Callable:
    """The eager chain as a function of the chain's arguments (:func:`chain_args`); ``p``
    overrides the dropout probability (the correctness check runs it at 0)."""
    c = get_chain(chain)
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

    c = get_chain(chain)
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
    c = get_chain(chain)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if c.kind == "attn":
        B, H, S = attn_shape(shape)
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
        M, N = ln_shape(shape)
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


# --- names on the command line -------------------------------------------------------------------


def resolve_chains(chains: str | Sequence[str] | None) -> tuple[str, ...]:
    """'all' (default), chain names (``-`` for ``_`` allowed), or the groups 'attn' / 'ln'."""
    names = split_list(chains)
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
            raise UsageError(f"unknown chain {raw!r}; choose from {', '.join(CHAINS)} "
                             "(or all, attn, ln)")
        chosen.extend(m for m in match if m not in chosen)
    return tuple(c for c in CHAINS if c in chosen)


def resolve_modes(modes: str | Sequence[str] | None) -> tuple[str, ...]:
    names = split_list(modes)
    if not names or names == ["all"]:
        return MODES
    out = []
    for n in names:
        n = {"fwd+bwd": "fwd_bwd", "fwdbwd": "fwd_bwd", "train": "fwd_bwd", "forward": "fwd",
             "fwd-bwd": "fwd_bwd"}.get(n.lower(), n.lower())
        if n not in MODES:
            raise UsageError(f"unknown mode {n!r}; choose from {', '.join(MODES)}")
        if n not in out:
            out.append(n)
    return tuple(m for m in MODES if m in out)


def resolve_providers(providers: str | Sequence[str] | None) -> tuple[str, ...]:
    names = split_list(providers)
    if not names or names == ["all"]:
        return PROVIDERS
    out = []
    for n in names:
        n = {"fused": "fusedops", "torch": "eager", "unfused": "eager", "inductor": "compile",
             "torch.compile": "compile"}.get(n.lower(), n.lower())
        if n not in PROVIDERS:
            raise UsageError(f"unknown provider {n!r}; choose from {', '.join(PROVIDERS)}")
        if n not in out:
            out.append(n)
    return tuple(p for p in PROVIDERS if p in out)


def resolve_dtypes(dtypes: str | Sequence[str] | None) -> tuple[str, ...]:
    if dtypes is None:
        return DEFAULT_DTYPES
    return resolve_bench_dtypes(dtypes)


def parse_shape(text: str, rows: int = ROWS) -> tuple[int, ...]:
    """'768' or '1K' -> (rows, N); '16384x768' -> (M, N); '8x12x512' -> (B, H, S). Each part
    takes :func:`fusedops.tools.bench_harness.parse_size` syntax ('16K', '2^14')."""
    parts = [p for p in text.strip().lower().replace("*", "x").split("x")]
    if not all(parts) or not 1 <= len(parts) <= 3:
        raise UsageError(f"bad size {text!r}: expected N, MxN or BxHxS")
    try:
        dims = tuple(parse_size(p) for p in parts)
    except ValueError:
        raise UsageError(f"bad size {text!r}: expected N, MxN or BxHxS") from None
    if any(d < 1 for d in dims):
        raise UsageError(f"sizes must be positive, got {text!r}")
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
        items = split_list(sizes) or []
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
