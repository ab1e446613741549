"""The emulation has teeth: remove barriers from the shaders and the kernel results go wrong,
under a deterministic schedule (all barriers) and under seeded adversarial schedules (each
barrier alone). A removed barrier is a call site the emulation's runtime lets through at once
(EmuLibrary.remove_barriers), so one compiled library serves every variant. See also
test_metal_sanitizers.py (ThreadSanitizer sees a missing barrier too)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tol

from fusedops import _philox
from fusedops.backends.metal import epilogue as metal_epilogue
from fusedops.backends.metal import norms as metal_norms
from fusedops.backends.metal import rules as metal_rules
from fusedops.backends.metal import softmax as metal_softmax

emu = pytest.importorskip("metal_emu.emu", reason="needs the Metal emulation helper")

MAX_THREADS = 256  # single-row up to 1024 columns
SIZES = (100, 1000, 3000)  # one SIMD-group (no barrier needed), single-row, looped
OPS = ("softmax_fwd", "softmax_bwd", "layernorm_fwd", "layernorm_bwd", "rmsnorm_fwd",
       "rmsnorm_bwd", "softmax_masked_fwd", "softmax_masked_bwd", "layernorm_epilogue_fwd",
       "layernorm_epilogue_bwd")
SEEDS = (1, 2, 3)


@pytest.fixture(autouse=True)
def several_rows_per_threadgroup(monkeypatch):
    """5 rows on 2 threadgroups: threadgroup memory is reused from row to row."""
    monkeypatch.setattr(metal_rules, "MAX_ROW_GROUPS", 2)
    monkeypatch.setattr(metal_rules, "LN_BWD_MIN_GROUPS", 1)
    monkeypatch.setattr(metal_rules, "LN_BWD_MAX_GROUPS", 2)


def case_ok(L, op: str, n: int) -> bool:
    """Runs one op on 5 rows; True when it matches the float64 reference."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, n, generator=g)
    dy = torch.randn(5, n, generator=g)
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    close = lambda a, e: torch.allclose(a.double(), e, **tol(torch.float32, scale=10))
    try:
        if op == "softmax_fwd":
            return close(metal_softmax.softmax_forward_with(L, x, torch.float32),
                         torch.softmax(x.double(), -1))
        if op == "softmax_bwd":
            y = torch.softmax(x, -1)
            y64 = y.double()
            ref = y64 * (dy.double() - (y64 * dy.double()).sum(-1, keepdim=True))
            return close(metal_softmax.softmax_backward_with(L, y, dy, torch.float32), ref)
        if op.startswith("softmax_masked"):
            y64 = torch.softmax((x.double() * 0.5).masked_fill(x < -1.0, -torch.inf), -1)
            if op == "softmax_masked_fwd":
                y = metal_softmax.softmax_masked_forward_with(L, x.view(1, 1, 5, n),
                                                              (x >= -1.0).view(
                    1, 1, 5, n), 0.5, False, torch.float32)
                return close(y.view(5, n), y64)
            ref = 0.5 * y64 * (dy.double() - (y64 * dy.double()).sum(-1, keepdim=True))
            return close(metal_softmax.softmax_masked_backward_with(L, y64.float(), dy, 0.5,
                                                            torch.float32), ref)
        if op.startswith("layernorm_epilogue"):
            # Dropout (the Philox layout: 256 threads) only where more than one SIMD-group runs
            # anyway; one SIMD-group (n = 100) needs no barrier.
            p = 0.2 if n > 100 else 0.0
            f = 1.0 if p == 0 else _philox.keep_mask(7, 5, n, p).double() / (1 - p)
            s64 = (x + dy).double().requires_grad_()
            w64 = w.double().requires_grad_()
            out64 = F.gelu(F.layer_norm(s64, (n,), w64, b.double(), 1e-5) * f)
            if op == "layernorm_epilogue_fwd":
                out = metal_epilogue.layernorm_epilogue_forward_with(L, x, dy, w, b, 1e-5,
                                                                     torch.float32,
                                                            p, 7, "gelu", False)[0]
                return close(out, out64.detach())
            s = x + dy
            var, mean = torch.var_mean(s.double(), -1, correction=0)
            dx, dw, _ = metal_epilogue.layernorm_epilogue_backward_with(
                L, dy, x, s, w, b, mean.float(), torch.rsqrt(var + 1e-5).float(), p, 7, "gelu",
                True, True, True)
            out64.backward(dy.double())
            return close(dx, s64.grad + x.double()) and close(dw, w64.grad)
        if op.startswith("rmsnorm"):
            x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
            ref = F.rms_norm(x64, (n,), w64, 1e-5)
            if op == "rmsnorm_fwd":
                return close(metal_norms.rmsnorm_forward_with(L, x, w, 1e-5, torch.float32)[0],
                             ref.detach())
            rstd = torch.rsqrt(x.double().square().mean(-1) + 1e-5).float()
            dx, dw = metal_norms.rmsnorm_backward_with(L, dy, x, w, rstd, True, True)
            ref.backward(dy.double())
            return close(dx, x64.grad) and close(dw, w64.grad)
        ref = F.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-5)
        if op == "layernorm_fwd":
            return close(metal_norms.layernorm_forward_with(L, x, w, b, 1e-5, torch.float32)[0],
                         ref)
        mean = x.double().mean(-1).float()
        rstd = torch.rsqrt(x.double().var(-1, unbiased=False) + 1e-5).float()
        dx, dw, _ = metal_norms.layernorm_backward_with(L, dy, x, w, mean, rstd, True, True, True)
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        F.layer_norm(x64, (n,), w64, b.double(), 1e-5).backward(dy.double())
        return close(dx, x64.grad) and close(dw, w64.grad)
    except emu.EmuError:
        return False


def results(lib, mode: str, seed: int = 1, stop_at_first_wrong: bool = False) -> dict:
    lib.set_mode(mode, seed)
    L = emu.EmuLauncher(lib, MAX_THREADS)
    out = {}
    for n in SIZES:
        for op in OPS:
            out[(op, n)] = case_ok(L, op, n)
            if stop_at_first_wrong and not out[(op, n)]:
                return out
    return out


def test_metal_shipped_shaders_pass_adversarial_schedules(metal_lib):
    for mode, seeds in (("fibers", (1,)), ("fibers-random", SEEDS)):
        for seed in seeds:
            res = results(metal_lib, mode, seed)
            assert all(res.values()), (mode, seed, [k for k, ok in res.items() if not ok])


def test_metal_without_barriers_results_are_wrong(metal_lib):
    """Every barrier removed: every case that uses more than one SIMD-group goes wrong, even
    under the plain FIFO schedule; one SIMD-group (n = 100, 32 threads) needs no barrier."""
    with metal_lib.barriers_removed(None):
        res = results(metal_lib, "fibers")
    assert all(ok for (op, n), ok in res.items() if n == 100)
    assert not any(ok for (op, n), ok in res.items() if n > 100), res


@pytest.mark.parametrize("site", emu.barrier_sites(), ids=[f"{f}:{line}" for f, line in
                                                           emu.barrier_sites()])
def test_metal_every_barrier_is_needed(metal_lib, site):
    """Each barrier alone: removing it makes some result wrong under a seeded adversarial
    schedule (one SIMD-group racing ahead of the others)."""
    wrong = []
    with metal_lib.barriers_removed([site]):
        for seed in SEEDS:
            res = results(metal_lib, "fibers-random", seed, stop_at_first_wrong=True)
            wrong += [key for key, ok in res.items() if not ok]
            if wrong:
                break
    assert wrong, f"removing barrier {site} changed no result"
