"""What every part of ``python -m fusedops bench-models`` shares: the variants, modes and dtypes,
the ratio and verdict thresholds, the resolved :class:`Options` of a run, and two small helpers
(the one-line text of an error, giving freed device memory back)."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch

from fusedops.tools import _model_zoo as zoo

VARIANTS = ("eager", "patched", "compiled", "compiled+patched")
MODES = ("infer", "train", "generate")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
RATIOS = (("patched", "eager"), ("compiled+patched", "compiled"))
NOISE = 0.02  # ratios within 1 +- NOISE are "same"
MIN_VERDICT_ROUNDS = 5


@dataclass
class Options:
    """Everything one run needs, resolved and validated (see
    :func:`fusedops.tools.bench_models.resolve`)."""

    models: tuple[str, ...] = zoo.MODELS
    shapes: tuple[tuple[int, int], ...] = ((1, 128), (8, 512), (32, 512))
    gen_shapes: tuple[tuple[int, int], ...] = ((1, 32), (8, 32))
    modes: tuple[str, ...] = MODES
    variants: tuple[str, ...] = ("eager", "patched")
    device: str = "cpu"
    preset: str = "tiny"
    dtype: str = "fp32"
    rounds: int = 10
    gen_rounds: int = 5
    min_round_ms: float = 0.0
    warmup: int = 3
    new_tokens: int = 128
    threads: int | None = None
    out: str = "bench_models_out"
    compile_backend: str = "inductor"
    force_patch: bool = False
    patch_accepts_force: bool = False
    seed: int = 0
    quiet: bool = False
    plot: bool = True
    busy: bool = True  # CUDA: the GPU busy times after the timed rounds
    argv: list[str] = field(default_factory=list)


def short_error(exc: BaseException) -> str:
    """``"Type: first line of the message"``, at most 300 characters."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def free_memory(device: torch.device) -> None:
    """Return freed device memory to the driver (CUDA only; a no-op elsewhere)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
