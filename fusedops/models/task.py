"""A deterministic synthetic regression task that needs attention across positions.

Each sequence is one *query* token followed by ``L - 1`` tokens (``L`` varies per sequence, the
rest is padding). Every token has a category ``c_i`` in ``{0..C-1}`` and a value ``v_i``; each
sequence draws its own category means ``mu ~ N(0, 1)^C`` and ``v_i = mu[c_i] + spread * noise``.
Features per token (``n_features = C + 2``)::

    [ one-hot category (C) | value (1) | is_query flag (1) ]

The query token carries a category ``q`` (and value 0). The target is the mean value of the real
tokens of the query's category::

    y = mean { v_i : i >= 1, token i is real, c_i == q }

(at least one such token is always present). A model has to match the query token against every
other token (content-based attention) and must ignore the padding (mask); averaging all tokens
alone does not solve it. The target's spread does not shrink with the sequence length, so the
same rule is learnable at 16 and at 1024 positions. Predicting the training mean scores
R^2 = 0; a perfect model scores 1. Data come from a seeded ``torch.Generator``: the same seed
gives the same batches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SyntheticTask:
    max_len: int = 16
    min_len: int | None = None  # default: max_len // 2 (at least 2)
    n_categories: int = 4
    spread: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_categories < 1:
            raise ValueError(f"n_categories must be >= 1, got {self.n_categories}")
        if self.max_len < 2:
            raise ValueError("max_len must be >= 2 (one query token and at least one other)")
        if not 2 <= self.lengths[0] <= self.max_len:
            raise ValueError(f"min_len must be in [2, max_len], got {self.min_len}")

    @property
    def n_features(self) -> int:
        return self.n_categories + 2

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
        b, s, c = batch_size, self.max_len, self.n_categories
        lo, hi = self.lengths
        if full_length:
            lengths = torch.full((b,), hi)
        else:
            lengths = torch.randint(lo, hi + 1, (b,), generator=generator)
        mask = torch.arange(s)[None, :] < lengths[:, None]
        cats = torch.randint(0, c, (b, s), generator=generator)
        query = torch.randint(0, c, (b,), generator=generator)
        # one real token (at a random position) always shares the query's category
        pos = 1 + (torch.rand(b, generator=generator) * (lengths - 1)).long()
        rows = torch.arange(b)
        cats[rows, pos] = query
        cats[:, 0] = query
        mu = torch.randn(b, c, generator=generator)
        values = mu.gather(1, cats) + self.spread * torch.randn(b, s, generator=generator)
        match = (cats == query[:, None]) & mask
        match[:, 0] = False
        y = (values * match).sum(1, keepdim=True) / match.sum(1, keepdim=True)
        values[:, 0] = 0.0
        flag = torch.zeros(b, s)
        flag[:, 0] = 1.0
        x = torch.cat([F.one_hot(cats, c).float(), values[..., None], flag[..., None]], dim=-1)
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
    """The task matching a :class:`PredictorConfig` (same ``max_len``,
    ``n_categories = n_features - 2``)."""
    if config.n_features < 3:
        raise ValueError("the synthetic task needs n_features >= 3 (n_categories >= 1)")
    return SyntheticTask(max_len=config.max_len, n_categories=config.n_features - 2,
                         **overrides)
