"""The QuACK provider of ``python -m fusedops bench``, on CPU: stand-in ``quack.softmax`` and
``quack.rmsnorm`` modules record how the provider calls QuACK (QuACK itself needs CUDA and the
CuTe DSL), and the sweep records QuACK's missing LayerNorm backward as skipped."""

from __future__ import annotations

import dataclasses
import importlib.abc
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from fusedops.tools import bench, bench_providers, bench_report, bench_sweep
from fusedops.tools.bench_providers import EPS, QUACK_NO_LAYERNORM_BWD, all_providers

LN_OPS = ["layernorm_fwd", "layernorm_bwd"]


class FakeQuack:
    """``quack.softmax`` / ``quack.rmsnorm`` stand-ins with QuACK 0.6.5's signatures and checks
    (2-D x where QuACK asserts it, float32 LayerNorm weight and bias), computed with torch ops;
    ``layernorm_fwd`` records no autograd graph, like QuACK's."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.softmax_mod = types.ModuleType("quack.softmax")
        self.softmax_mod.softmax = self.softmax
        self.rmsnorm_mod = types.ModuleType("quack.rmsnorm")
        self.rmsnorm_mod.rmsnorm = self.rmsnorm
        self.rmsnorm_mod.layernorm_fwd = self.layernorm_fwd

    def install(self, monkeypatch) -> FakeQuack:
        monkeypatch.setitem(sys.modules, "quack.softmax", self.softmax_mod)
        monkeypatch.setitem(sys.modules, "quack.rmsnorm", self.rmsnorm_mod)
        return self

    def softmax(self, x):
        self.calls.append(("softmax", (x,), {}))
        assert x.dim() == 2, "Input must be 2D"
        return torch.softmax(x, dim=-1)

    def rmsnorm(self, x, weight=None, bias=None, residual=None, out_dtype=None,
                residual_dtype=None, eps=1e-6, prenorm=False, weight_offset=0.0):
        self.calls.append(("rmsnorm", (x, weight), {"eps": eps, "bias": bias,
                                                    "weight_offset": weight_offset}))
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def layernorm_fwd(self, x, weight, bias=None, eps=1e-6, return_rstd=False,
                      return_mean=False):
        self.calls.append(("layernorm_fwd", (x, weight, bias), {"eps": eps}))
        assert x.dim() == 2, "Input must be 2D"
        assert weight.dtype == torch.float32, "Weight must be float32"
        assert bias is None or bias.dtype == torch.float32, "Bias must be float32"
        with torch.no_grad():
            return F.layer_norm(x.float(), (x.shape[-1],), weight, bias, eps).to(x.dtype)

    def named(self, name: str) -> list[tuple[tuple, dict]]:
        return [(args, kw) for n, args, kw in self.calls if n == name]


@pytest.fixture
def fake_quack(monkeypatch):
    return FakeQuack().install(monkeypatch)


def _point(fam, ops, dtype=torch.float32, M=8, N=32):
    point = bench.Point(fam, ops, dtype, M, N, "cpu", seed=3)
    point.compute_refs(all_providers()["torch"])
    return point


def _run(point, ops, provider=None):
    return bench.run_provider(point, provider or all_providers()["quack"], ops, "x",
                              bench.Timer("cpu", 0.1, 0.2), True, 1.0, None, True)


# --- availability ---------------------------------------------------------------------------------


def test_quack_is_listed_cuda_only():
    quack = all_providers()["quack"]
    assert "quack" in bench.resolve_providers(None)
    assert bench.resolve_providers("quack-kernels") == ("quack",)
    assert quack.devices == ("cuda",)
    assert "does not run on cpu" in quack.unavailable_reason("cpu")


def test_quack_missing_is_reported(monkeypatch):
    for mod in ("quack.softmax", "quack.rmsnorm"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    monkeypatch.setitem(sys.modules, "quack", None)  # the package cannot be imported
    reason = all_providers()["quack"].unavailable_reason("cuda")
    assert reason.startswith("quack not importable: ModuleNotFoundError")


def test_quack_import_error_of_any_kind_is_reported(monkeypatch):
    # Importing QuACK loads the CuTe DSL, which can fail with other errors than ImportError.
    class Broken(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "quack" or name.startswith("quack."):
                raise RuntimeError("CUDA driver too old")
            return None

    for mod in ("quack", "quack.softmax", "quack.rmsnorm"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    reason = all_providers()["quack"].unavailable_reason("cuda", ["softmax"])
    assert reason == "quack not importable: RuntimeError: CUDA driver too old"


def test_quack_availability_per_family(monkeypatch, fake_quack):
    quack = all_providers()["quack"]
    assert quack.unavailable_reason("cuda") is None
    # A QuACK without layernorm_fwd: unavailable only to sweeps that run LayerNorm.
    monkeypatch.delattr(fake_quack.rmsnorm_mod, "layernorm_fwd")
    assert quack.unavailable_reason("cuda", ["softmax", "rmsnorm"]) is None
    assert "AttributeError" in quack.unavailable_reason("cuda", ["layernorm"])


# --- what the provider calls ----------------------------------------------------------------------


def test_quack_softmax_call(fake_quack):
    fn = all_providers()["quack"].make("softmax")
    x = torch.randn(4, 16)
    torch.testing.assert_close(fn(x, None, None), torch.softmax(x, -1))
    assert fake_quack.named("softmax") == [((x,), {})]
    # 3-D host-latency shapes go in as rows; the result keeps x's shape
    x3 = torch.randn(2, 3, 16)
    y3 = fn(x3, None, None)
    assert y3.shape == x3.shape and fake_quack.named("softmax")[-1][0][0].shape == (6, 16)
    torch.testing.assert_close(y3, torch.softmax(x3, -1))


def test_quack_rmsnorm_call(fake_quack):
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w = torch.randn(16, dtype=torch.bfloat16)
    y = all_providers()["quack"].make("rmsnorm")(x, w, None)
    [(args, kw)] = fake_quack.named("rmsnorm")
    # the sweep's weight as it is (QuACK's RMSNorm takes 16-bit weights), the sweep's eps
    # rather than QuACK's default 1e-6, no bias and no weight offset
    assert args[0] is x and args[1] is w
    assert kw == {"eps": EPS, "bias": None, "weight_offset": 0.0}
    assert EPS == 1e-5
    torch.testing.assert_close(y, F.rms_norm(x, (16,), w, EPS))


def test_quack_layernorm_call_float32_params_once(fake_quack):
    fn = all_providers()["quack"].make("layernorm")
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(16)).to(torch.bfloat16)
    b = (0.1 * torch.randn(16)).to(torch.bfloat16)
    y = fn(x, w, b)
    for _ in range(3):
        fn(x, w, b)
    calls = fake_quack.named("layernorm_fwd")
    assert len(calls) == 4
    (x0, w0, b0), kw = calls[0]
    assert x0 is x and kw == {"eps": EPS}
    assert w0.dtype == b0.dtype == torch.float32
    assert torch.equal(w0, w.float()) and torch.equal(b0, b.float())
    # converted on the first call only: the later (timed) calls get the same float32 tensors
    assert all(args[1] is w0 and args[2] is b0 for args, _ in calls[1:])
    torch.testing.assert_close(y, F.layer_norm(x.float(), (16,), w.float(), b.float(),
                                               EPS).to(torch.bfloat16))
    # a weight changed in place is converted again
    w.mul_(2)
    fn(x, w, b)
    (_, w1, b1), _ = fake_quack.named("layernorm_fwd")[-1]
    assert w1 is not w0 and torch.equal(w1, w.float()) and b1 is b0


def test_float32_copies_follow_their_tensors():
    import gc

    copies = bench_providers.Float32Copies()
    w32 = torch.randn(8)
    assert copies.get(w32) is w32 and copies.get(None) is None and len(copies) == 0
    w = torch.randn(8, dtype=torch.float16)
    first = copies.get(w)
    assert first.dtype == torch.float32 and copies.get(w) is first and len(copies) == 1
    del w
    gc.collect()
    assert len(copies) == 0  # the entry goes with its tensor


# --- the sweep ------------------------------------------------------------------------------------


def test_quack_layernorm_backward_is_skipped(fake_quack):
    fwd, bwd = _run(_point("layernorm", LN_OPS, dtype=torch.bfloat16), LN_OPS)
    assert fwd["status"] == "ok" and fwd["ms"] > 0 and fwd["backend"] == "quack-kernels"
    assert bwd["status"] == "skipped" and bwd["error"] == QUACK_NO_LAYERNORM_BWD
    assert "no LayerNorm backward" in bwd["error"]
    assert bwd["ms"] is None and bwd["tbps"] is None and bwd["ok"] is None
    assert bwd["ms_gpu"] is None  # every record has the field, timed or not
    assert fake_quack.named("layernorm_fwd")
    # a backward-only point runs nothing of QuACK's
    fake_quack.calls.clear()
    [bwd] = _run(_point("layernorm", ["layernorm_bwd"]), ["layernorm_bwd"])
    assert bwd["status"] == "skipped" and fake_quack.calls == []


def test_quack_layernorm_backward_is_not_timed_as_something_else(fake_quack):
    # Without the skip, the forward-only LayerNorm would fail in autograd.grad, not be timed.
    quack = all_providers()["quack"]
    no_skip = dataclasses.replace(quack, unsupported={})
    recs = _run(_point("layernorm", LN_OPS), LN_OPS, no_skip)
    assert [r["status"] for r in recs] == ["ok", "error"]


@pytest.mark.parametrize("fam", ["softmax", "rmsnorm"])
def test_quack_backward_is_timed_through_autograd(fake_quack, fam):
    ops = [f"{fam}_fwd", f"{fam}_bwd"]
    recs = _run(_point(fam, ops), ops)
    assert [r["status"] for r in recs] == ["ok", "ok"]
    assert all(r["ok"] is True and r["ms"] > 0 for r in recs)
    assert fake_quack.named(fam)


def test_quack_sweep_reports_unsupported(monkeypatch, fake_quack):
    # The quack provider made to run on CPU through the whole sweep and its report.
    table = bench_sweep.all_providers

    def cpu_quack():
        providers = table()
        providers["quack"].devices = ("cuda", "cpu")
        return providers

    monkeypatch.setattr(bench_sweep, "all_providers", cpu_quack)
    r = bench.run_sweep(ops="layernorm,softmax_bwd", dtypes="fp32", sizes=[32, 64],
                        providers="torch,quack", device="cpu", total=256, warmup_ms=0.1,
                        rep_ms=0.2, host_latency=False, progress=False)
    assert r["providers_unavailable"] == {}
    recs = {(x["op"], x["N"], x["provider"]): x for x in r["records"]}
    for n in (32, 64):
        assert recs[("layernorm_fwd", n, "quack")]["status"] == "ok"
        assert recs[("softmax_bwd", n, "quack")]["status"] == "ok"
        skipped = recs[("layernorm_bwd", n, "quack")]
        assert skipped["status"] == "skipped" and skipped["error"] == QUACK_NO_LAYERNORM_BWD
        assert recs[("layernorm_bwd", n, "torch")]["status"] == "ok"
        # a skipped record compares with nothing
        assert "quack" not in recs[("layernorm_bwd", n, "torch")]["speedup"]
    assert "QuACK" in r["providers"]["quack"] and "layernorm_fwd" in r["providers"]["quack"]
    text = bench_report.format_report(r)
    assert f"skipped: quack layernorm_bwd (2 points): {QUACK_NO_LAYERNORM_BWD}" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("layernorm_bwd"))
    assert row.split()[5] == "skip"  # op dtype N M torch quack


def test_plan_leaves_out_quack_layernorm_backward():
    both = bench.plan(["layernorm_fwd", "layernorm_bwd"], ["bf16"], [1024, 2048],
                      ["torch", "quack"], 5.0, 25.0)
    assert both["measurements"] == 2 * 2 + 1 * 2  # torch fwd + bwd, quack fwd only
    assert both["cute_kernels"] == 2
    assert bench.plan(["softmax_bwd"], ["bf16"], [1024], ["torch"], 5.0, 25.0)[
        "cute_kernels"] == 0
