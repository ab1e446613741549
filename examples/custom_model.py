"""A small "user" model for the profile -> patch -> re-profile example.

It is deliberately written the way real code often is: one LayerNorm is an ``nn.LayerNorm``
module, the other normalisation and the attention softmax are functional calls
(``F.layer_norm``, ``Tensor.softmax``), so ``fusedops.patch_model`` has to cover both forms.

``make_model()`` is a factory in the ``MODULE:FACTORY`` form the CLI accepts::

    python -m fusedops profile examples/custom_model.py:make_model --patch
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TinyTransformerClassifier(nn.Module):
    def __init__(self, vocab: int = 1000, dim: int = 128, heads: int = 4, layers: int = 2,
                 classes: int = 10, max_len: int = 256):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(max_len, dim))
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(layers))
        self.norm_w = nn.ParameterList(nn.Parameter(torch.ones(dim)) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)  # module form
        self.cls = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        x = self.tok(tokens) + self.pos[:s]
        for qkv, out, mlp, w in zip(self.qkv, self.out, self.mlp, self.norm_w, strict=True):
            h = F.layer_norm(x, (x.shape[-1],), w)  # functional form, weight only
            q, k, v = qkv(h).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            att = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).softmax(dim=-1)  # Tensor method
            x = x + out((att @ v).transpose(1, 2).reshape(b, s, -1))
            x = x + mlp(self.norm(x))
        return self.cls(x.mean(dim=1))


def make_model():
    """Factory for ``python -m fusedops profile``: returns ``(model, example_inputs)``."""
    torch.manual_seed(0)
    model = TinyTransformerClassifier().eval()
    tokens = torch.randint(0, 1000, (8, 128))
    return model, tokens
