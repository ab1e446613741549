"""patch_model's lean Dropout: an nn.Dropout's eval-mode call returns its input without calling
F.dropout (which returns that same tensor there); training mode, tensor subclasses and torch
function modes still call F.dropout; subclasses and excluded modules are left alone."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from test_patching_utils import assert_same_training, hf_bert, run, twins
from torch import nn
from torch.overrides import TorchFunctionMode

import fusedops
from fusedops.patching.swaps import LeanDropout


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.25)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.drop(self.lin(x)) + x)


class MyDropout(nn.Dropout):
    pass


def test_eval_call_returns_the_input_itself():
    d = LeanDropout(0.5).eval()
    x = torch.randn(4, 8)
    assert d(x) is x
    assert F.dropout(x, 0.5, False) is x  # what it stands in for


def test_training_call_is_f_dropout():
    d, ref = LeanDropout(0.5), nn.Dropout(0.5)
    x = torch.randn(64, 64, requires_grad=True)
    torch.manual_seed(3)
    y = d(x)
    torch.manual_seed(3)
    assert torch.equal(y, ref(x))
    assert y.grad_fn is not None and not torch.equal(y, x)


def test_modes_subclasses_and_bad_p_take_f_dropout():
    seen = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    d = LeanDropout(0.5).eval()
    x = torch.randn(4, 8)
    with Spy():
        assert torch.equal(d(x), x)
    assert F.dropout in seen
    d.p = 1.5  # torch's own check still raises
    with pytest.raises(ValueError, match="dropout probability"):
        d(x)


def test_patch_model_swaps_exact_dropouts_and_unpatch_restores():
    model = nn.Sequential(Block(), Block(), MyDropout(0.1))
    ref = nn.Sequential(*[m for m in model])  # the same modules: classes checked after unpatch
    report = fusedops.patch_model(model, force=True, exclude="1")
    assert report.lean_dropout == ["0.drop"]  # block 1 excluded, the subclass left alone
    assert type(model[0].drop) is LeanDropout and type(model[1].drop) is nn.Dropout
    assert type(model[2]) is MyDropout
    assert "Dropout modules whose eval-mode call skips F.dropout (1" in str(report)
    fusedops.unpatch_model(model)
    assert all(type(m) is nn.Dropout for m in (ref[0].drop, ref[1].drop))


def test_patched_bert_matches_unpatched_in_eval_and_training():
    model, ref, inputs = twins(hf_bert)
    report = fusedops.patch_model(model, force=True)
    n = sum(type(m) is nn.Dropout for m in ref.modules())
    assert n and len(report.lean_dropout) == n
    model.eval()
    ref.eval()
    with torch.no_grad():
        out, expected = run(model, inputs), run(ref, inputs)
    assert torch.equal(out.last_hidden_state, expected.last_hidden_state)
    model.train()
    ref.train()
    assert_same_training(model, ref, inputs)  # the same dropout masks from the same seed


def test_a_patched_model_pickles_with_its_lean_dropouts():
    model = nn.Sequential(Block())
    fusedops.patch_model(model, force=True)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded[0].drop) is LeanDropout
    fusedops.unpatch_model(loaded)
    assert type(loaded[0].drop) is nn.Dropout
