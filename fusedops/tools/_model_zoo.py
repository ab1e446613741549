"""The models of ``python -m fusedops bench-models``: Hugging Face configs built with random
weights (never downloaded), their inputs, and the step each benchmark mode times.

* ``bert``: ``BertModel``, BERT-base (12 layers, hidden 768, 12 heads, LayerNorm).
* ``gpt2``: ``GPT2LMHeadModel`` with the default ``GPT2Config`` (GPT-2 124M, LayerNorm).
* ``llama``: ``LlamaForCausalLM``, a Llama-style decoder of about 0.4B parameters with RMSNorm
  and grouped-query attention (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864,
  vocabulary 32000).

Every model uses eager attention (``attn_implementation="eager"``), the one ``patch_model``
can fuse. The ``tiny`` preset shrinks each to 2 layers, hidden 64 and a 512-token vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

MODELS = ("bert", "gpt2", "llama")
DECODERS = ("gpt2", "llama")
PRESETS = ("full", "tiny")

_FULL: dict[str, dict[str, Any]] = {
    "bert": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072},
    "gpt2": {},
    "llama": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 32000,
              "max_position_embeddings": 2048},
}
_TINY: dict[str, dict[str, Any]] = {
    "bert": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 1024},
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 512, "n_positions": 1024,
             "bos_token_id": 511, "eos_token_id": 511},
    "llama": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512,
              "max_position_embeddings": 1024},
}
_CLASSES = {
    "bert": ("BertConfig", "BertModel"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
}


def config_for(name: str, preset: str) -> Any:
    """The Hugging Face config of model ``name`` in ``preset`` (eager attention)."""
    import transformers

    cfg_cls = getattr(transformers, _CLASSES[name][0])
    table = _FULL if preset == "full" else _TINY
    return cfg_cls(**table[name], attn_implementation="eager")


def max_positions(config: Any) -> int:
    """The longest sequence the model's position embeddings (or RoPE table) allow."""
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if value:
            return int(value)
    return 1 << 30


def vocab_size(model: nn.Module) -> int:
    return int(model.config.vocab_size)


def build(name: str, preset: str, device: torch.device, seed: int = 0) -> nn.Module:
    """Model ``name`` with random weights (seeded), float32, on ``device``, in eval mode.

    Decoders get a generation config that never stops early: pad token 0, end-of-sequence the
    last vocabulary id (suppressed anyway until ``min_new_tokens``)."""
    import transformers

    config = config_for(name, preset)
    model_cls = getattr(transformers, _CLASSES[name][1])
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config)
    model.eval()
    if name in DECODERS:
        gen = model.generation_config
        gen.pad_token_id = 0
        gen.eos_token_id = config.vocab_size - 1
        gen.bos_token_id = None
    return model


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def make_inputs(name: str, vocab: int, batch: int, tokens: int, device: torch.device,
                seed: int = 0, labels: bool = False) -> dict[str, torch.Tensor]:
    """Random token ids in ``[1, vocab - 1)`` (no pad, no end-of-sequence) and an all-ones
    attention mask; ``labels`` adds ``labels = input_ids`` for the decoders' LM loss."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab - 1, (batch, tokens), generator=gen).to(device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if labels and name in DECODERS:
        inputs["labels"] = ids
    return inputs


def main_output(out: Any) -> torch.Tensor:
    """The tensor a model output is judged by: logits, else the last hidden state."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def loss_of(out: Any) -> torch.Tensor:
    """The LM loss when the model computed one (decoders with labels), else the mean square of
    the last hidden state (a plain sum would give the final LayerNorm a zero gradient)."""
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    return out.last_hidden_state.float().pow(2).mean()


def autocast_for(device: torch.device, dtype: torch.dtype | None) -> Callable[[], Any]:
    """A factory of the training step's autocast context (a null context for ``dtype=None``)."""
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def infer_step(model: nn.Module, inputs: dict) -> Callable[[], torch.Tensor]:
    """One inference forward under ``torch.no_grad()``; returns the judged output tensor."""
    def step() -> torch.Tensor:
        with torch.no_grad():
            return main_output(model(**inputs))
    return step


def train_step(model: nn.Module, inputs: dict, optimizer: torch.optim.Optimizer,
               autocast: Callable[[], Any]) -> Callable[[], torch.Tensor]:
    """One training step: forward (under ``autocast``), loss, backward, ``optimizer.step()``,
    ``zero_grad(set_to_none=True)``; returns the (detached) loss."""
    def step() -> torch.Tensor:
        with autocast():
            loss = loss_of(model(**inputs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def train_check(model: nn.Module, inputs: dict, autocast: Callable[[], Any]
                ) -> list[torch.Tensor]:
    """The training step's forward and backward without the update, in eval mode (dropout
    off, so variants are comparable): ``[output, loss, *param grads]``. Grads are cleared."""
    was_training = model.training
    model.eval()
    try:
        with autocast():
            out = model(**inputs)
            loss = loss_of(out)
        loss.backward()
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                 for p in params]
        for p in params:
            p.grad = None
        return [main_output(out).detach(), loss.detach(), *grads]
    finally:
        model.train(was_training)


def generate_step(model: nn.Module, inputs: dict, new_tokens: int) -> Callable[[], torch.Tensor]:
    """Greedy ``model.generate`` of exactly ``new_tokens`` tokens with the KV cache; returns the
    token ids (prompt included)."""
    def step() -> torch.Tensor:
        return model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, use_cache=True)
    return step
