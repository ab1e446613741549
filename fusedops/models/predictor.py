"""The example "predictor": a compact Transformer-encoder sequence regressor.

``(B, S, F)`` features -> linear embedding + positions -> ``n_layers`` pre-LN encoder blocks ->
final LayerNorm -> attention pooling -> regression head ``(B, n_outputs)``.

Attention is written out explicitly, ``softmax(q @ k^T * scale + mask) @ v``, so the softmax and
the LayerNorms are separate ops a profiler can see and ``fusedops.patch_model`` can replace. The
model deliberately uses both forms patching has to cover:

* module form: every LayerNorm is an ``nn.LayerNorm`` and the attention softmax is an
  ``nn.Softmax(dim=-1)`` module;
* functional form: the pooling head calls ``F.softmax`` over the sequence positions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class PredictorConfig:
    """Architecture of a :class:`Predictor` (all fields JSON-serialisable)."""

    n_features: int = 6
    max_len: int = 16
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 128
    n_outputs: int = 1
    dropout: float = 0.0
    positions: str = "learned"  # "learned" or "sinusoidal"
    ln_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.positions not in ("learned", "sinusoidal"):
            raise ValueError(f"positions must be 'learned' or 'sinusoidal', got {self.positions!r}")
        for name in ("n_features", "max_len", "d_model", "n_heads", "n_layers", "d_ff",
                     "n_outputs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> PredictorConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class Preset:
    """A predictor size plus the workload the tools run it on."""

    name: str
    config: PredictorConfig
    batch_size: int  # batch used for profiling / latency measurements
    train_steps: int
    train_batch_size: int
    lr: float
    dtype: str = "float32"  # inference dtype used by the demo
    task: dict = field(default_factory=dict)  # extra SyntheticTask arguments
    curriculum: tuple[int, ...] | None = None  # training lengths, see train_predictor
    description: str = ""


PRESETS: dict[str, Preset] = {
    "cpu": Preset(
        name="cpu",
        config=PredictorConfig(n_features=6, max_len=16, d_model=64, n_heads=4, n_layers=2,
                               d_ff=128),
        batch_size=64,
        train_steps=250,
        train_batch_size=64,
        lr=3e-3,
        description="tiny: trains in well under a minute on 2 CPU cores",
    ),
    "gpu": Preset(
        name="gpu",
        config=PredictorConfig(n_features=6, max_len=1024, d_model=256, n_heads=8, n_layers=4,
                               d_ff=1024),
        batch_size=16,
        train_steps=450,
        train_batch_size=32,
        lr=1e-3,
        dtype="bfloat16",
        # learn the matching rule on short sequences (cheap), then adapt to the full length
        curriculum=(16, 16, 1024),
        description="S=1024, d=256, 8 heads: attention softmax is a real share of GPU time",
    ),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None


def sinusoidal_positions(length: int, dim: int) -> torch.Tensor:
    """The classic fixed sine/cosine position table, ``(length, dim)`` float32."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq[: dim // 2])
    return table


class SelfAttention(nn.Module):
    """Multi-head self-attention with the softmax as its own ``nn.Softmax`` module."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.softmax = nn.Softmax(dim=-1)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (B, H, S, Dh)
        scores = q @ k.transpose(-2, -1) * self.scale  # (B, H, S, S)
        if mask is not None:
            scores = scores + mask  # additive, (B, 1, 1, S)
        probs = self.drop(self.softmax(scores))
        out = (probs @ v).transpose(1, 2).reshape(b, s, d)
        return self.proj(out)


class Block(nn.Module):
    """Pre-LN encoder block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: PredictorConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.attn = SelfAttention(cfg.d_model, cfg.n_heads, cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_ff),
            nn.GELU(),
            nn.Linear(cfg.d_ff, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class Predictor(nn.Module):
    """Transformer-encoder sequence regressor ``(B, S, F) -> (B, n_outputs)``.

    Args:
        config: a :class:`PredictorConfig` (or keyword overrides of the default one).

    ``forward(x, mask=None)``: ``x`` is ``(B, S, n_features)`` with ``S <= max_len``; ``mask`` is
    an optional ``(B, S)`` bool tensor, True for real positions and False for padding (each row
    needs at least one True). Padding is excluded from attention keys and from the pooling.
    """

    def __init__(self, config: PredictorConfig | None = None, **overrides):
        super().__init__()
        cfg = config or PredictorConfig()
        if overrides:
            cfg = replace(cfg, **overrides)
        self.config = cfg
        self.embed = nn.Linear(cfg.n_features, cfg.d_model)
        if cfg.positions == "learned":
            self.pos = nn.Parameter(torch.randn(cfg.max_len, cfg.d_model) * 0.02)
        else:
            self.register_buffer("pos", sinusoidal_positions(cfg.max_len, cfg.d_model),
                                 persistent=False)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.pool_score = nn.Linear(cfg.d_model, 1)
        self.head = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_model), nn.GELU(), nn.Linear(cfg.d_model, cfg.n_outputs)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.config.n_features:
            raise ValueError(
                f"x must be (B, S, n_features={self.config.n_features}), got {tuple(x.shape)}"
            )
        b, s, _ = x.shape
        if s > self.config.max_len:
            raise ValueError(f"sequence length {s} exceeds max_len={self.config.max_len}")
        if mask is not None and (mask.shape != (b, s) or mask.dtype != torch.bool):
            raise ValueError(f"mask must be a ({b}, {s}) bool tensor, got "
                             f"{tuple(mask.shape)} {mask.dtype}")
        h = self.embed(x) + self.pos[:s].to(x.dtype)
        additive = None
        if mask is not None:
            # 0 for real keys, the most negative finite value for padding: exp() of it is 0.
            neg = torch.finfo(h.dtype).min
            additive = torch.zeros(b, 1, 1, s, dtype=h.dtype, device=h.device)
            additive = additive.masked_fill(~mask[:, None, None, :], neg)
        for block in self.blocks:
            h = block(h, additive)
        h = self.ln_f(h)
        # Attention pooling over positions (functional softmax, padding excluded).
        score = self.pool_score(h).squeeze(-1)  # (B, S)
        if mask is not None:
            score = score.masked_fill(~mask, torch.finfo(score.dtype).min)
        weights = F.softmax(score, dim=-1)
        pooled = (weights.unsqueeze(-1) * h).sum(dim=1)
        return self.head(pooled)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
