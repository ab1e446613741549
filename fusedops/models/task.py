"""A deterministic synthetic regression task that needs attention across positions.

Each sequence is one *query* token followed by ``L - 1`` key/value tokens (``L`` varies per
sequence, the rest is padding). Features per token (``n_features = key_dim + 2``)::

    [ key (key_dim) | value (1) | is_query flag (1) ]

The query token carries the query vector ``q`` in the key slot. The target is a soft lookup::

    y = sum_i softmax_i(beta * q . k_i / sqrt(key_dim)) * v_i      over the real tokens i >= 1

so a model has to compare the query token with every other token (attention) and must ignore
the padding (mask). Predicting the training mean scores R^2 = 0; a perfect model scores 1.
Data are drawn from a seeded ``torch.Generator``: the same seed gives the same batches.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class SyntheticTask:
    max_len: int = 32
    min_len: int | None = None  # default: max_len // 2
    key_dim: int = 4
    beta: float = 3.0
    noise: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.key_dim < 1:
            raise ValueError(f"key_dim must be >= 1, got {self.key_dim}")
        if self.max_len < 2:
            raise ValueError("max_len must be >= 2 (one query token and at least one key)")
        if not 2 <= self.lengths[0] <= self.max_len:
            raise ValueError(f"min_len must be in [2, max_len], got {self.min_len}")

    @property
    def n_features(self) -> int:
        return self.key_dim + 2

    @property
    def lengths(self) -> tuple[int, int]:
        lo = self.min_len if self.min_len is not None else max(2, self.max_len // 2)
        return lo, self.max_len

    def to_dict(self) -> dict:
        return asdict(self)

    def generator(self, stream: int = 0) -> torch.Generator:
        """A CPU generator for stream ``stream`` (0: training, 1: held-out, others: free)."""
        return torch.Generator().manual_seed(self.seed * 1_000_003 + stream)

    def sample(
        self, batch_size: int, generator: torch.Generator, full_length: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draw ``(x, mask, y)``: ``(B, max_len, n_features)`` float32, ``(B, max_len)`` bool
        and ``(B, 1)`` float32, on CPU. ``full_length=True`` makes every sequence ``max_len``
        long (no padding)."""
        b, s, dk = batch_size, self.max_len, self.key_dim
        lo, hi = self.lengths
        if full_length:
            lengths = torch.full((b,), hi)
        else:
            lengths = torch.randint(lo, hi + 1, (b,), generator=generator)
        mask = torch.arange(s)[None, :] < lengths[:, None]
        keys = torch.randn(b, s, dk, generator=generator)
        values = torch.randn(b, s, generator=generator)
        logits = self.beta * (keys[:, 1:] * keys[:, :1]).sum(-1) / math.sqrt(dk)  # (B, S-1)
        logits = logits.masked_fill(~mask[:, 1:], float("-inf"))
        y = (torch.softmax(logits, dim=-1) * values[:, 1:]).sum(-1, keepdim=True)
        if self.noise:
            y = y + self.noise * torch.randn(b, 1, generator=generator)
        values[:, 0] = 0.0
        flag = torch.zeros(b, s)
        flag[:, 0] = 1.0
        x = torch.cat([keys, values[..., None], flag[..., None]], dim=-1)
        x = x * mask[..., None]
        return x, mask, y

    def heldout(self, n: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fixed held-out set (stream 1): identical for every call with the same ``n``."""
        return self.sample(n, self.generator(1))

    def batches(self, batch_size: int, stream: int = 0):
        """An endless, deterministic iterator of training batches."""
        gen = self.generator(stream)
        while True:
            yield self.sample(batch_size, gen)


def task_for(config, **overrides) -> SyntheticTask:
    """The task matching a :class:`PredictorConfig` (same ``max_len``; ``n_features`` checked)."""
    if config.n_features < 3:
        raise ValueError("the synthetic task needs n_features >= 3 (key_dim >= 1)")
    return SyntheticTask(max_len=config.max_len, key_dim=config.n_features - 2, **overrides)
