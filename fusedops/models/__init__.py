"""The example model of the measure-first workflow: a Transformer-encoder "predictor".

>>> from fusedops.models import Predictor, get_preset, task_for, train_predictor
>>> preset = get_preset("cpu")
>>> model = Predictor(preset.config)
>>> task = task_for(preset.config)
>>> result = train_predictor(model, task, steps=preset.train_steps)
>>> result.heldout_after["r2"]
"""

from fusedops.models.predictor import (
    PRESETS,
    Block,
    Predictor,
    PredictorConfig,
    Preset,
    SelfAttention,
    get_preset,
    sinusoidal_positions,
)
from fusedops.models.task import SyntheticTask, task_for
from fusedops.models.training import (
    TrainResult,
    evaluate,
    load_checkpoint,
    predict,
    regression_metrics,
    save_checkpoint,
    train_predictor,
)

__all__ = [
    "PRESETS",
    "Block",
    "Predictor",
    "PredictorConfig",
    "Preset",
    "SelfAttention",
    "SyntheticTask",
    "TrainResult",
    "evaluate",
    "get_preset",
    "load_checkpoint",
    "predict",
    "regression_metrics",
    "save_checkpoint",
    "sinusoidal_positions",
    "task_for",
    "train_predictor",
]
