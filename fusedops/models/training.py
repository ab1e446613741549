"""Training, evaluation and checkpoints for the predictor on its synthetic task."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from fusedops.models.predictor import Predictor, PredictorConfig
from fusedops.models.task import SyntheticTask

CHECKPOINT_FORMAT = "fusedops.predictor/1"


@torch.no_grad()
def predict(
    model: torch.nn.Module,
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    batch_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Model outputs for ``x`` (in chunks of ``batch_size``; default: chunks whose attention
    scores stay near 2^26 elements), returned as float32 on CPU."""
    param = next(model.parameters())
    device, dtype = param.device, dtype or param.dtype
    if batch_size is None:
        heads = getattr(getattr(model, "config", None), "n_heads", 1)
        s = x.shape[1] if x.dim() > 1 else 1
        batch_size = int(max(1, min(256, 2**26 // (s * s * heads))))
    outs = []
    for i in range(0, x.shape[0], batch_size):
        xb = x[i : i + batch_size].to(device=device, dtype=dtype)
        mb = None if mask is None else mask[i : i + batch_size].to(device)
        outs.append(model(xb, mb).float().cpu())
    return torch.cat(outs)


def regression_metrics(pred: torch.Tensor, y: torch.Tensor, baseline_mean: float | None = None
                       ) -> dict:
    """MSE, the MSE of predicting a constant mean (``baseline_mean``, default the mean of ``y``)
    and R^2 = 1 - MSE / var(y)."""
    pred, y = pred.double(), y.double()
    mse = F.mse_loss(pred, y).item()
    var = y.var(unbiased=False).item()
    mean = y.mean().item() if baseline_mean is None else float(baseline_mean)
    base = ((y - mean) ** 2).mean().item()
    return {
        "mse": mse,
        "baseline_mse": base,
        "r2": 1.0 - mse / var if var > 0 else float("nan"),
        "n": int(y.shape[0]),
    }


def evaluate(
    model: torch.nn.Module,
    task: SyntheticTask,
    n: int = 1024,
    baseline_mean: float | None = None,
    dtype: torch.dtype | None = None,
) -> dict:
    """Held-out metrics of ``model`` on ``task`` (see :func:`regression_metrics`)."""
    was_training = model.training
    model.eval()
    try:
        x, mask, y = task.heldout(n)
        return regression_metrics(predict(model, x, mask, dtype=dtype), y, baseline_mean)
    finally:
        model.train(was_training)


@dataclass
class TrainResult:
    steps: int
    seconds: float
    train_mean: float
    history: list = field(default_factory=list)  # (step, smoothed loss)
    heldout_before: dict = field(default_factory=dict)
    heldout_after: dict = field(default_factory=dict)
    stopped_early: bool = False

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "seconds": self.seconds,
            "train_mean": self.train_mean,
            "history": [list(h) for h in self.history],
            "heldout_before": self.heldout_before,
            "heldout_after": self.heldout_after,
            "stopped_early": self.stopped_early,
        }


def train_predictor(
    model: torch.nn.Module,
    task: SyntheticTask,
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 3e-3,
    weight_decay: float = 0.01,
    warmup: int | None = None,
    time_limit: float | None = None,
    heldout_n: int = 1024,
    progress: Callable[[int, int, float], None] | None = None,
    seed: int = 0,
    curriculum: Sequence[int] | None = None,
) -> TrainResult:
    """Train ``model`` in place with AdamW (linear warm-up, cosine decay, grad-clip 1.0) on fresh
    batches of ``task``; returns held-out metrics before and after.

    ``curriculum``: sequence lengths to train on in equal shares of the steps (e.g.
    ``(16, 64, 256, 1024)``), short first; the lookup rule does not depend on the length, so
    short sequences teach it cheaply and the later stages adapt it to long ones. Default: train
    on ``task`` as is. ``time_limit`` (seconds) stops early; ``progress(step, steps, loss)`` is
    called every step. The run is deterministic for a given ``seed`` and device (data come from
    the task's seed).
    """
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    # The constant a mean-predictor would learn, from training data only.
    train_mean = task.sample(4096, task.generator(2))[2].mean().item()
    before = evaluate(model, task, heldout_n, train_mean)
    warmup = max(1, steps // 20) if warmup is None else warmup
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    history: list[tuple[int, float]] = []
    smooth = None
    start = time.perf_counter()
    stopped = False
    done = 0
    gen = task.generator(0)
    stages = [task] if not curriculum else [
        replace(task, max_len=int(n), min_len=None) for n in curriculum]
    for step in range(steps):
        stage = stages[min(len(stages) - 1, step * len(stages) // steps)]
        x, mask, y = stage.sample(batch_size, gen)
        x, mask, y = x.to(device), mask.to(device), y.to(device)
        loss = F.mse_loss(model(x, mask).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        done = step + 1
        value = loss.item()
        smooth = value if smooth is None else 0.9 * smooth + 0.1 * value
        if step % 10 == 0 or done == steps:
            history.append((done, smooth))
        if progress is not None:
            progress(done, steps, smooth)
        if time_limit is not None and time.perf_counter() - start > time_limit:
            stopped = done < steps
            break
    seconds = time.perf_counter() - start
    model.eval()
    after = evaluate(model, task, heldout_n, train_mean)
    return TrainResult(done, seconds, train_mean, history, before, after, stopped)


def save_checkpoint(
    path: str | os.PathLike,
    model: Predictor,
    task: SyntheticTask | None = None,
    **info,
) -> None:
    """Save ``model`` (config + float32 CPU state_dict), its task and any JSON-able ``info``.

    The file loads with ``torch.load(path, weights_only=True)``.
    """
    state = {k: v.detach().float().cpu() if v.is_floating_point() else v.detach().cpu()
             for k, v in model.state_dict().items()}
    payload = {
        "format": CHECKPOINT_FORMAT,
        "config": model.config.to_dict(),
        "task": None if task is None else task.to_dict(),
        "state_dict": state,
        "info": info,
    }
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_checkpoint(
    path: str | os.PathLike, map_location: str | torch.device = "cpu"
) -> tuple[Predictor, dict]:
    """Load a checkpoint written by :func:`save_checkpoint`.

    Returns ``(model, meta)`` where ``model`` is an eval-mode :class:`Predictor` on
    ``map_location`` and ``meta`` holds ``task`` (a :class:`SyntheticTask` or None), ``config``
    and ``info``.
    """
    payload = torch.load(os.fspath(path), map_location=map_location, weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a fusedops predictor checkpoint")
    config = PredictorConfig.from_dict(payload["config"])
    model = Predictor(config)
    model.load_state_dict(payload["state_dict"])
    model.to(map_location).eval()
    task = SyntheticTask(**payload["task"]) if payload.get("task") else None
    return model, {"config": config, "task": task, "info": payload.get("info", {})}
