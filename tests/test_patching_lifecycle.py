"""patch_model on the models people use: hand-written norms recognised by what they compute,
nothing shared changed, save/load in a fresh process, torch.func, and no per-call analysis."""

from __future__ import annotations

import copy
import inspect
import io
import pickle
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from conftest import EXHAUSTIVE
from test_patching_utils import python_calls
from torch import nn

import fusedops
from fusedops.patching import fx_patterns, norms, routing, swaps

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, vocab_size=100, attn_implementation="eager")


def _family(name: str) -> nn.Module:
    t = transformers
    makers = {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**SMALL)),
        "mistral": lambda: t.MistralForCausalLM(t.MistralConfig(**SMALL)),
        "qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**SMALL)),
        "qwen3": lambda: t.Qwen3ForCausalLM(t.Qwen3Config(**SMALL, head_dim=8)),
        "gemma": lambda: t.GemmaForCausalLM(t.GemmaConfig(**SMALL, head_dim=8)),
        "t5": lambda: t.T5Model(t.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                           num_heads=4, vocab_size=100,
                                           attn_implementation="eager")),
    }
    torch.manual_seed(0)
    model = makers[name]().eval()
    for p in model.parameters():  # norms at random weights: a wrong formula shows
        if p.dim() == 1:
            p.data.normal_()
    return model


def _inputs(name: str) -> dict:
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "decoder_input_ids": ids} if name == "t5" else {"input_ids": ids}


def _norm_modules(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if "Norm" in type(m).__name__]


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "gemma", "t5"])
def test_family_norms_recognised_and_exact(name):
    """Every norm of the Llama family (Qwen3's q/k norms, Gemma's 1 + weight, T5's) is swapped
    for a fused class, found by a probe of what it computes; outputs and gradients match."""
    model = _family(name)
    ref = copy.deepcopy(model)
    inputs = _inputs(name)
    with fusedops.use_backend("reference"):  # fusedops' own paths on CPU tensors
        report = fusedops.patch_model(model, example_inputs=inputs, force=True)
        assert sorted(r["name"] for r in report.replaced) == sorted(_norm_modules(ref))
        assert all(r.get("via") == "recognised by a probe" for r in report.replaced)
        assert report.verification["module_calls"]["rmsnorm"] == len(report.replaced)
        assert report.max_rel_diff < 1e-5
        if name == "gemma":
            assert all("(1 + weight)" in r["config"] for r in report.replaced)
        out = model(**inputs)
        out.logits.float().square().mean().backward() if hasattr(out, "logits") else \
            out.last_hidden_state.square().mean().backward()
    want = ref(**inputs)
    (want.logits if hasattr(want, "logits") else want.last_hidden_state).float().square() \
        .mean().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=n)
    fusedops.unpatch_model(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]
    assert not any(swaps.NORM_ATTR in m.__dict__ for m in model.modules())


class ConstEpsRMSNorm(nn.Module):
    """A user's own RMSNorm with eps written in its code (no attribute holds it)."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class BiasLayerNorm(nn.Module):
    """LayerNorm written out, with its own eps attribute name."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.bias = nn.Parameter(torch.randn(n))
        self.epsilon = 1e-5

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + self.epsilon) * self.weight + self.bias


class ScaleNorm(nn.Module):
    """Looks like a norm (weight, eps), computes something else."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.eps = 1e-5

    def forward(self, x):
        return x / (x.norm(dim=-1, keepdim=True) + self.eps) * self.weight


class BufferedNorm(ConstEpsRMSNorm):
    def __init__(self, n):
        super().__init__(n)
        self.register_buffer("scale", torch.ones(()))


def test_users_own_norms_found_by_what_they_compute():
    n = 16
    model = nn.Sequential(ConstEpsRMSNorm(n), BiasLayerNorm(n), ScaleNorm(n), BufferedNorm(n))
    ref = copy.deepcopy(model)
    x = torch.randn(3, 5, n)
    with fusedops.use_backend("reference"):
        report = fusedops.patch_model(model, example_inputs=(x,), force=True)
        out = model(x)
    replaced = {r["name"]: r for r in report.replaced}
    assert set(replaced) == {"0", "1"}
    assert replaced["0"]["config"].startswith("rmsnorm: weight, eps=constant 1e-06")
    assert replaced["1"]["config"].startswith("layernorm: weight, bias, eps=self.epsilon")
    skipped = {s["name"]: s["reason"] for s in report.skipped}
    assert "computes none of RMSNorm / LayerNorm" in skipped["2"]
    assert "has buffers" in skipped["3"]
    torch.testing.assert_close(out, ref(x), atol=1e-5, rtol=1e-5)


def test_recognised_norm_returns_the_originals_dtype():
    """A Llama norm with float32 weights returns float32 for a bfloat16 input (weight * x.to(
    input dtype) promotes); with bfloat16 weights, bfloat16."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for w_dtype, want in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)):
        norm = LlamaRMSNorm(16).to(w_dtype)
        x = torch.randn(2, 16, dtype=torch.bfloat16)
        expected = copy.deepcopy(norm)(x)
        with fusedops.use_backend("reference"):
            fusedops.patch_model(norm, force=True)
            got = norm(x)
        assert got.dtype == expected.dtype == want
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_norm_candidates_need_one_tensor_argument():
    class TwoArgs(ConstEpsRMSNorm):
        def forward(self, x, y):
            return super().forward(x) + y

    eps, why = norms.candidate(TwoArgs(4))
    assert eps is None and "exactly one tensor" in why


def _bert_pair():
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval(), transformers.BertModel(cfg).eval(), cfg


def test_patching_one_model_leaves_another_of_the_same_config_alone():
    m1, m2, cfg = _bert_pair()
    ids = torch.randint(0, 40, (1, 8))
    with fusedops.use_backend("reference"):
        fusedops.patch_model(m1, force=True)
        assert cfg._attn_implementation == "eager"
        assert m2.encoder.layer[0].attention.self.config is cfg
        fx_patterns.counts = counts = Counter()
        try:
            m2(ids)
            assert counts == Counter()  # the other model runs nothing of fusedops
            m1(ids)
            assert counts["hf_attention"] == 1
        finally:
            fx_patterns.counts = None
    fusedops.unpatch_model(m1)
    assert m1.encoder.layer[0].attention.self.config is cfg
    assert cfg._attn_implementation == "eager"


_LOAD_SCRIPT = textwrap.dedent("""
    import io, sys, torch
    from collections import Counter
    import fusedops
    from fusedops.patching import fx_patterns
    model = torch.load(io.BytesIO(sys.stdin.buffer.read()), weights_only=False)
    assert fusedops.is_patched(model)
    ids = torch.arange(8)[None] % 40
    fx_patterns.counts = counts = Counter()
    out = model(ids)
    fx_patterns.counts = None
    print(sorted(counts.items()))
    print(sorted({type(m).__name__ for m in model.modules() if "Fused" in type(m).__name__}))
    print(float(out.last_hidden_state.double().abs().sum()))
""")


# (exhaustive: a fresh interpreter importing torch and transformers; the in-process pickle
# round trips, test_pickle_keeps_traced_patterns and test_patching.py's, run by default)
@EXHAUSTIVE
def test_torch_save_load_in_a_fresh_process_keeps_every_fusion():
    """A saved patched model loads where only ``import fusedops`` ran: the attention registry
    knows fusedops' attention again, traced patterns are rebuilt (not re-traced into plain
    calls), swapped classes resolve."""
    model, _, _ = _bert_pair()
    with fusedops.use_backend("reference"):
        fusedops.patch_model(model, force=True, patterns=True)
        fx_patterns.counts = counts = Counter()
        want = model(torch.arange(8)[None] % 40)
        fx_patterns.counts = None
    buf = io.BytesIO()
    torch.save(model, buf)
    env = {"FUSEDOPS_BACKEND": "reference", "PYTHONPATH": ":".join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT], input=buf.getvalue(),
                          capture_output=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    pattern_line, classes_line, total = proc.stdout.decode().strip().splitlines()
    assert pattern_line == str(sorted(counts.items()))
    assert "add_layernorm" in pattern_line and "hf_attention" in pattern_line
    assert "FusedLayerNorm" in classes_line
    assert abs(float(total) - float(want.last_hidden_state.double().abs().sum())) < 1e-6


class AddLN(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)

    def forward(self, a, b):
        return self.ln(a + b)


def test_pickle_keeps_traced_patterns():
    """A pickled GraphModule would re-trace its code on load (calling the fused helpers rather
    than recording them): the patched module rebuilds its traces instead."""
    model = AddLN()
    a, b = torch.randn(2, 8), torch.randn(2, 8)
    with fusedops.use_backend("reference"):
        fusedops.patch_model(model, force=True, patterns=True)
        loaded = pickle.loads(pickle.dumps(model))
        fx_patterns.counts = counts = Counter()
        out = loaded(a, b)
        fx_patterns.counts = None
    assert counts == {"add_layernorm": 1}
    torch.testing.assert_close(out, F.layer_norm(a + b, (8,), model.ln.weight, model.ln.bias))


def test_torch_func_through_a_patched_model():
    """grad, vmap(grad) and jacrev through a patched model equal the unpatched model's."""
    model = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Softmax(-1)).double()
    ref = copy.deepcopy(model)
    fusedops.patch_model(model, force=True)
    params = dict(model.named_parameters())
    x = torch.randn(3, 6, dtype=torch.float64)

    def loss(m):
        return lambda p, x: torch.func.functional_call(m, p, (x,)).square().sum()

    for transform in (lambda f: torch.func.grad(f), lambda f: torch.func.jacrev(f)):
        got, want = transform(loss(model))(params, x), transform(loss(ref))(params, x)
        for k in got:
            torch.testing.assert_close(got[k], want[k])
    per_sample = torch.func.vmap(torch.func.grad(loss(model)), in_dims=(None, 0))
    per_sample_ref = torch.func.vmap(torch.func.grad(loss(ref)), in_dims=(None, 0))
    for k, v in per_sample(params, x[:, None]).items():
        torch.testing.assert_close(v, per_sample_ref(params, x[:, None])[k])


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_patched_forward_does_no_per_call_analysis(name):
    """A patched Hugging Face forward reads no bytecode, traces nothing, inspects no signature
    and enters no TorchFunctionMode: all of it was decided at patch time."""
    if name == "bert":
        model, _, _ = _bert_pair()
        ids = torch.randint(0, 40, (1, 8))
    else:
        model = _family("llama")
        ids = torch.randint(0, 100, (1, 8))
    fusedops.patch_model(model, force=True)
    model(ids)  # (first calls may fill caches)
    watched = {f.__code__ for f in (routing.analyze, fx_patterns.check_forward,
                                     fx_patterns.fuse_module, norms.recognise,
                                     routing.FusedFunctionMode.__init__,
                                     routing.FusedFunctionMode.__torch_function__,
                                     torch.overrides.TorchFunctionMode.__enter__)}
    with python_calls(watched) as calls:
        model(ids)
    assert calls == []
    signature_calls = []

    def caller(frame, event, arg):
        if event == "call" and frame.f_code is inspect.signature.__code__:
            signature_calls.append(frame.f_back.f_code.co_filename)

    sys.setprofile(caller)
    try:
        model(ids)
    finally:
        sys.setprofile(None)
    assert not any("fusedops" in f for f in signature_calls)


class MySoftmax(nn.Module):
    def forward(self, x):
        return torch.softmax(x, -1)


def test_hand_written_softmax_module_is_reported():
    model = nn.Sequential(nn.Linear(4, 4), MySoftmax())
    report = fusedops.patch_model(model, force=True, example_inputs=(torch.randn(2, 4),))
    (entry,) = [s for s in report.skipped if s["type"] == "MySoftmax"]
    assert entry["op"] == "softmax" and "its functional calls are routed" in entry["reason"]
    assert report.verification["routed_calls"]["softmax"] == 1


@EXHAUSTIVE  # (a fresh interpreter importing torch: seconds)
def test_forcing_triton_without_gpu_or_interpreter_falls_back_with_a_warning():
    script = textwrap.dedent("""
        import warnings, torch
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import fusedops
            y = fusedops.fused_softmax(torch.randn(2, 8), -1)
        print(torch.allclose(y, torch.softmax(torch.randn(2, 8) * 0 + y.log(), -1)) or True)
        print([str(x.message) for x in w if "fusedops" in str(x.message)])
    """)
    env = {"FUSEDOPS_BACKEND": "triton", "TRITON_INTERPRET": "0",
           "PYTHONPATH": ":".join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    out = proc.stdout.decode()
    assert "TRITON_INTERPRET=1" in out and "PyTorch's ops" in out


def test_instance_forward_routed_through_globals_is_reported():
    model = nn.Sequential(nn.Linear(4, 4))
    model.forward = lambda x: F.softmax(nn.Sequential.forward(model, x), -1)
    report = fusedops.patch_model(model, force=True, example_inputs=(torch.randn(2, 4),))
    assert report.routed_functions == [{"name": "", "type": "Sequential",
                                        "calls": ["instance forward"], "via": "globals"}]
    assert report.verification["routed_calls"]["softmax"] == 1


def test_compile_with_a_forced_backend_and_layernorm_epilogues():
    """The LayerNorm epilogues have no custom op: under torch.compile they trace to torch's ops
    even with a backend forced (the plain ops keep their kernels as custom ops)."""
    torch._dynamo.reset()
    model = AddLN()
    a, b = torch.randn(2, 8), torch.randn(2, 8)
    with fusedops.use_backend("reference"):
        fusedops.patch_model(model, force=True)
        out = torch.compile(model, fullgraph=True, backend="aot_eager")(a, b)
    torch.testing.assert_close(out, F.layer_norm(a + b, (8,), model.ln.weight, model.ln.bias))
