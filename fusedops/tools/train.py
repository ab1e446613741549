"""``python -m fusedops train``: train the built-in predictor on its synthetic task and save a
checkpoint (``--out``). Prints held-out MSE and R^2 against predicting the training mean."""

from __future__ import annotations

import argparse
import os

import torch

from fusedops.tools import _report
from fusedops.tools.cli import positive_float, positive_int, torch_threads


def default_checkpoint(preset: str) -> str:
    return f"fusedops-predictor-{preset}.pt"


def train_or_load(
    preset_name: str,
    device: torch.device,
    checkpoint: str | None = None,
    steps: int | None = None,
    retrain: bool = False,
    seed: int = 0,
    quiet: bool = False,
    time_limit: float | None = None,
) -> tuple[torch.nn.Module, object, dict]:
    """Load ``checkpoint`` if it exists (and ``retrain`` is False), else train the preset's
    predictor and save it there (when a path is given).

    Returns ``(model, task, info)``; ``info`` says whether it was trained or loaded, and holds
    the held-out metrics (``heldout``) and, when trained, the training summary (``train``).
    """
    from fusedops.models import (
        Predictor,
        evaluate,
        get_preset,
        load_checkpoint,
        save_checkpoint,
        task_for,
        train_predictor,
    )

    preset = get_preset(preset_name)
    if checkpoint and os.path.exists(checkpoint) and not retrain:
        model, meta = load_checkpoint(checkpoint, map_location=device)
        task = meta["task"] or task_for(model.config, **preset.task)
        train_mean = meta["info"].get("train_mean")
        heldout = evaluate(model, task, baseline_mean=train_mean)
        return model, task, {"source": "loaded", "checkpoint": checkpoint,
                             "heldout": heldout, "saved_info": meta["info"]}
    torch.manual_seed(seed)
    model = Predictor(preset.config).to(device)
    task = task_for(preset.config, **preset.task)
    steps = steps or preset.train_steps
    progress = _report.Progress(f"training predictor ({preset.name} preset, {steps} steps)",
                                steps, quiet=quiet)
    result = train_predictor(
        model, task, steps=steps, batch_size=preset.train_batch_size, lr=preset.lr, seed=seed,
        time_limit=time_limit, curriculum=preset.curriculum,
        progress=lambda done, total, loss: progress.update(done, total, f"loss {loss:.4f}"),
    )
    progress.close(f"(held-out R^2 {result.heldout_after['r2']:.3f})")
    info = {"source": "trained", "checkpoint": checkpoint, "heldout": result.heldout_after,
            "train": result.to_dict()}
    if checkpoint:
        save_checkpoint(checkpoint, model, task, preset=preset.name, train_mean=result.train_mean,
                        steps=result.steps, seconds=result.seconds,
                        heldout=result.heldout_after)
    model.eval()
    return model, task, info


def format_metrics(m: dict) -> str:
    return (f"MSE {m['mse']:.4f} vs {m['baseline_mse']:.4f} predicting the mean "
            f"(R^2 {m['r2']:.3f}, n={m['n']})")


def main(argv: list[str] | None = None) -> int:
    from fusedops.models import PRESETS

    parser = argparse.ArgumentParser(
        prog="python -m fusedops train",
        description="Train the built-in predictor on its synthetic task; save a checkpoint.",
    )
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS),
                        help="model size (default cpu)")
    parser.add_argument("--steps", type=positive_int,
                        help="training steps (default: the preset's)")
    parser.add_argument("--device", help="cuda, mps or cpu (default: best present)")
    parser.add_argument("--out", help="checkpoint path (default fusedops-predictor-PRESET.pt)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=positive_float,
                        help="stop after this many seconds")
    parser.add_argument("--threads", type=positive_int,
                        help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    device = _report.pick_device(args.device)
    out = args.out or default_checkpoint(args.preset)
    print(_report.heading(f"fusedops train: predictor, preset {args.preset}, on {device.type}"))
    with torch_threads(args.threads):
        model, task, info = train_or_load(args.preset, device, out, steps=args.steps,
                                          retrain=True, seed=args.seed, quiet=args.quiet,
                                          time_limit=args.time_limit)
    train = info["train"]
    print(f"parameters: {model.num_parameters():,}; task: {task.to_dict()}")
    print(f"trained {train['steps']} steps in {train['seconds']:.1f}s"
          + (" (stopped by --time-limit)" if train["stopped_early"] else ""))
    print(f"held-out before: {format_metrics(train['heldout_before'])}")
    print(f"held-out after:  {format_metrics(train['heldout_after'])}")
    print(f"checkpoint: {out}")
    return 0


if __name__ == "__main__":
    from fusedops.__main__ import run_command

    raise SystemExit(run_command("train"))
