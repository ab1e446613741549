"""patch_model's routing scope: discovery forwards run the whole forward under the functional
mode and note the modules whose calls made routable calls (sites); other forwards enter the
mode only while a site runs (fusedops.patching, REDISCOVER_EVERY).

Checks that routing is the same in both kinds of forward, that the mode sees only the sites'
calls after discovery, and the edges: training-only branches, calls that appear late, calls
made outside every submodule, sites called outside the model's forward, unpatching, copies,
exceptions and threads.
"""

from __future__ import annotations

import copy
import threading
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedops
from fusedops import patch_model, patching, unpatch_model
from fusedops.patching import _active_mode, _role


class Attention(nn.Module):
    """A site: its own forward calls F.softmax (training adds a second, masked call)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.q(x) @ x.transpose(-1, -2)
        p = F.softmax(s, dim=-1)
        if self.training:
            p = p + torch.softmax(s * 0.5, dim=-1)
        return p @ x


class Mlp(nn.Module):
    """Not a site: many torch calls, none routable."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.a(x))
        for _ in range(5):
            h = h * 1.01 + 0.1
        return self.b(h)


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.attn, self.mlp = Attention(d), Mlp(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x + self.attn(x))


class Net(nn.Module):
    def __init__(self, d: int = 8, late: bool = False, root_call: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.late, self.root_call = late, root_call
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        for b in self.blocks:
            x = b(x)
        if self.root_call:
            x = x.softmax(-1)
        if self.late and self.steps > 3:  # a routable call that first appears later
            x = F.layer_norm(x, (x.shape[-1],))
        return x


# CUDA where there is one (the Triton kernels compiled), else the interpreter on CPU tensors.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def inputs() -> torch.Tensor:
    return torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0)).to(DEV)


@pytest.fixture
def mode_calls(monkeypatch):
    """Counts every call that reaches the fusedops mode's __torch_function__, and the routed
    ones per op."""
    seen = Counter()
    real = patching._FusedFunctionMode.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        seen["all"] += 1
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(patching._FusedFunctionMode, "__torch_function__", counting)
    return seen


def routed(model, x) -> dict:
    with fusedops.use_backend("triton"), fusedops.count_fused_calls() as counts:
        model(x)
    return dict(counts)


def sites(model) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return sorted(names[id(m)] for m in model.modules() if _role(m) == "site")


def test_sites_found_and_scoped(mode_calls):
    """The first forward finds the two attention modules; later forwards route the same calls
    while the mode sees only the sites' own calls (not the MLPs' or the blocks')."""
    torch.manual_seed(0)
    model = Net().to(DEV).eval()
    ref = copy.deepcopy(model)
    patch_model(model)
    x = inputs()
    with torch.no_grad():
        first = routed(model, x)
        assert sites(model) == ["blocks.0.attn", "blocks.1.attn"]
        calls_first = mode_calls["all"]
        mode_calls.clear()
        second = routed(model, x)
        assert first == second == {"softmax_forward": 2}
        assert 0 < mode_calls["all"] < calls_first / 2
        torch.testing.assert_close(model(x), ref(x))


def test_training_branch_discovered_on_first_training_forward():
    """Each (training, grad) state's first forward is a discovery: a call only made in training
    is routed from the first training step on."""
    model = Net().to(DEV)
    patch_model(model)
    x = inputs()
    model.eval()
    with torch.no_grad():
        assert routed(model, x) == {"softmax_forward": 2}
    model.train()
    for _ in range(2):
        with fusedops.use_backend("triton"), fusedops.count_fused_calls() as counts:
            model(x).sum().backward()
        assert counts["softmax_forward"] == 4 and counts["softmax_backward"] == 4


def test_late_call_routed_from_the_next_rediscovery(monkeypatch):
    """A routable call that first appears after the discovery forwards runs unfused (torch's
    op: correct) until the next rediscovery, then routed."""
    monkeypatch.setattr(patching, "REDISCOVER_EVERY", 6)
    model = Net(late=True).to(DEV).eval()
    ref = copy.deepcopy(model)
    patch_model(model)
    x = inputs()
    got = []
    with torch.no_grad():
        for _ in range(7):
            got.append(routed(model, x).get("layernorm_forward", 0))
            ref(x)
        torch.testing.assert_close(model(x), ref(x))
    # steps 1-3: no call; 4-5: made by the root, not yet routed; 6: rediscovery; 7: routed
    assert got == [0, 0, 0, 0, 0, 1, 1]
    assert model.__dict__[patching._STATE_ATTR].root_site


def test_root_call_scopes_the_mode_to_the_root_code(mode_calls):
    """A routable call in the model's own forward (outside every submodule's call): the model's
    forward runs under the mode, its children pop it while they run, and the sites inside them
    enter their own; the mode sees the root's and the sites' own calls only."""
    model = Net(root_call=True).to(DEV).eval()
    ref = copy.deepcopy(model)
    patch_model(model)
    x = inputs()
    with torch.no_grad():
        first = routed(model, x)
        calls_first = mode_calls["all"]
        assert model.__dict__[patching._STATE_ATTR].root_site
        assert _role(model.blocks) is None and _role(model.blocks[0]) == "child"
        assert _role(model.blocks[0].mlp) is None
        mode_calls.clear()
        assert first == routed(model, x) == {"softmax_forward": 3}
        assert 0 < mode_calls["all"] < calls_first / 2
        torch.testing.assert_close(model(x), ref(x))


def test_user_mode_above_ours_is_not_popped(mode_calls):
    """A child pops the mode only where ours is the innermost: under a user's mode it stays,
    and the user's mode sees every call."""
    from torch.overrides import TorchFunctionMode

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    model = Net(root_call=True).to(DEV).eval()
    patch_model(model)
    x = inputs()
    with torch.no_grad():
        routed(model, x)  # discovery
        with Counting():
            got = routed(model, x)
    assert got == {"softmax_forward": 3} and Counting.calls > 0
    assert _active_mode() is None


def test_site_called_outside_the_model_is_not_routed():
    """A site's wrapper routes only while a patched model's forward runs, as the whole-forward
    mode did."""
    model = Net().to(DEV).eval()
    patch_model(model)
    x = inputs()
    with torch.no_grad():
        routed(model, x)
        assert routed(model.blocks[0].attn, x) == {}
        assert _active_mode() is None


def test_unpatch_removes_site_wrappers_and_copies_keep_them():
    model = Net().to(DEV).eval()
    patch_model(model)
    x = inputs()
    with torch.no_grad():
        routed(model, x)
        twin = copy.deepcopy(model)
        assert sites(twin) == sites(model)
        assert routed(twin, x) == {"softmax_forward": 2}
        unpatch_model(model)
        assert all("forward" not in m.__dict__ for m in model.modules())
        assert routed(model, x) == {}
        patch_model(model)  # patching again starts a fresh discovery
        assert sites(model) == []
        assert routed(model, x) == {"softmax_forward": 2}


def test_failed_discovery_forward_is_not_recorded():
    class Failing(Net):
        def forward(self, x):
            if x.shape[0] == 1:
                raise RuntimeError("boom")
            return super().forward(x)

    model = Failing().to(DEV).eval()
    patch_model(model)
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"):
        model(inputs()[:1])
    state = model.__dict__[patching._STATE_ATTR]
    assert not state.discovered and _active_mode() is None
    with torch.no_grad():
        assert routed(model, inputs()) == {"softmax_forward": 2}
    assert state.discovered == {(False, False)}


def test_verification_pass_counts_every_routed_call():
    """patch_model's verification forward is a discovery: the report's counts are complete."""
    model = Net().to(DEV).eval()
    with fusedops.use_backend("triton"):
        report = patch_model(model, example_inputs=inputs())
    assert report.verification["routed_calls"]["softmax"] == 2


def test_threads_route_independently():
    """Scoped forwards in two threads at once: each routes its own sites' calls."""
    model = Net().to(DEV).eval()
    patch_model(model)
    x = inputs()
    with torch.no_grad():
        want = model(x)  # discovery
    errors, barrier = [], threading.Barrier(2, timeout=60)

    def work():
        try:
            barrier.wait()
            with torch.no_grad():
                for _ in range(3):
                    torch.testing.assert_close(model(x), want)
            assert _active_mode() is None
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
