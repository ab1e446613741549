"""torch.compile, CUDA graphs, autocast and large-tensor behaviour.

CPU part (runs in CI): ``torch.compile(fullgraph=True)`` of the functions and modules, forward
and backward, no graph break, with the reference backend and with the Triton kernels forced
(interpreted); ``torch.library.opcheck`` of the custom ops that stand in for the kernels while
Dynamo traces.

GPU part (``@pytest.mark.gpu``, skipped without CUDA; meant for the real Triton compiler, so run
it with ``TRITON_INTERPRET=0``): compile with Inductor, ``mode="reduce-overhead"``, manual
CUDA-graph capture after a warm-up, autocast, rows far beyond one block, big shapes, and tensors
with more than 2**31 elements (also marked ``slow``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    HAS_CUDA,
    assert_close_to_ref,
    exhaustive_unless,
    ln_backward_vec,
    one_of_each,
    triton_kernels_ready,
)
from torch import nn

import fusedops
from fusedops import FusedLayerNorm, FusedSoftmax, fused_layernorm, fused_softmax

needs_triton = pytest.mark.skipif(not triton_kernels_ready(), reason="Triton kernels unavailable")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compile_full(fn, backend="aot_eager", **kwargs):
    """fullgraph=True: any graph break is an error. aot_eager runs Dynamo + AOTAutograd (fake
    tensors, the custom ops' fake kernels, the traced backward) without Inductor's codegen."""
    return torch.compile(fn, fullgraph=True, backend=backend, **kwargs)


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(t.requires_grad)
            for t in tensors]


def run_and_grads(fn, inputs, dy):
    """Output and the gradients of every input that requires grad."""
    y = fn(*inputs)
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    grads = torch.autograd.grad(y, wanted, dy) if wanted else ()
    return y.detach(), grads


def assert_same(fn, ref_fn, inputs, dy, atol=1e-5, rtol=1e-5):
    y, grads = run_and_grads(fn, _leaves(*inputs), dy)
    y_ref, grads_ref = run_and_grads(ref_fn, _leaves(*inputs), dy)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    assert len(grads) == len(grads_ref)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert g.dtype == g_ref.dtype
        torch.testing.assert_close(g, g_ref, atol=atol, rtol=rtol)


# --------------------------------------------------------------------------- CPU: fullgraph


_SOFTMAX_DTYPES = [(torch.float32, None), (torch.bfloat16, None), (torch.float16, torch.float32),
                   (torch.float32, torch.float16)]


@exhaustive_unless(one_of_each({"dim": [-1, 0, 1], "dtype,arg": _SOFTMAX_DTYPES}))
@pytest.mark.parametrize("dim", [-1, 0, 1])
@pytest.mark.parametrize("dtype,arg", _SOFTMAX_DTYPES, ids=str)
def test_softmax_fullgraph(dim, dtype, arg):
    x = torch.randn(4, 6, 9).to(dtype).requires_grad_(True)
    dy = torch.randn(4, 6, 9).to(arg or dtype)

    def fn(t):
        return fused_softmax(t, dim, dtype=arg)

    tol = 1e-5 if dtype == torch.float32 and arg is None else 1e-2
    assert_same(compile_full(fn), lambda t: torch.softmax(t, dim, dtype=arg), [x], dy, tol, tol)


# (three of the parameter / gradient sets by default; the others exhaustive)
@exhaustive_unless(lambda affine, needs: (affine, needs) in (
    ("both", "xwb"), ("none", "x"), ("bias", "b")))
@pytest.mark.parametrize(
    "affine,needs",
    [("both", "xwb"), ("both", "x"), ("both", "wb"), ("none", "x"), ("weight", "xw"),
     ("bias", "b")],
)
def test_layernorm_fullgraph(affine, needs):
    """Every combination of missing parameters and requested gradients (the custom backward op
    returns placeholders for the gradients nobody asked for)."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8).requires_grad_("x" in needs)
    w = torch.randn(5, 8).requires_grad_("w" in needs) if affine in ("both", "weight") else None
    b = torch.randn(5, 8).requires_grad_("b" in needs) if affine in ("both", "bias") else None
    dy = torch.randn(3, 5, 8)

    def fn(x, w, b):
        return fused_layernorm(x, (5, 8), w, b, eps=1e-4)

    assert_same(compile_full(fn), lambda x, w, b: F.layer_norm(x, (5, 8), w, b, 1e-4),
                [x, w, b], dy)


def test_layernorm_fullgraph_half_input_float32_params():
    x = torch.randn(4, 16).to(torch.bfloat16).requires_grad_(True)
    w = torch.randn(16, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    y, (gx, gw, gb) = run_and_grads(compile_full(lambda x, w, b: fused_layernorm(x, 16, w, b)),
                                    _leaves(x, w, b), torch.randn(4, 16).bfloat16())
    assert y.dtype == gx.dtype == torch.bfloat16
    assert gw.dtype == gb.dtype == torch.float32


def test_modules_fullgraph():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), FusedLayerNorm(16), nn.GELU(), nn.Linear(16, 12),
                          FusedSoftmax(dim=-1))
    plain = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 12),
                          nn.Softmax(dim=-1))
    plain.load_state_dict(model.state_dict())
    x = torch.randn(5, 8)
    compiled = compile_full(model)
    y = compiled(x)
    torch.testing.assert_close(y, plain(x), atol=1e-5, rtol=1e-5)
    y.pow(2).sum().backward()
    plain(x).pow(2).sum().backward()
    for (name, p), p_ref in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_inference_fullgraph():
    x = torch.randn(3, 10)
    w = torch.randn(10)

    @torch.no_grad()
    def fn(x):
        return fused_softmax(fused_layernorm(x, 10, w), -1)

    torch.testing.assert_close(compile_full(fn)(x), torch.softmax(F.layer_norm(x, (10,), w), -1))


def test_zero_dim_and_empty_fullgraph():
    fn = compile_full(lambda t: fused_softmax(t, 0))
    assert fn(torch.tensor(3.0)).item() == 1.0
    assert fn(torch.empty(0, 4)).shape == (0, 4)


@pytest.mark.parametrize("which", ["softmax", "layernorm", "modules"])
def test_no_graph_breaks(which):
    x = torch.randn(4, 8, requires_grad=True)
    if which == "softmax":
        fn, args = (lambda t: fused_softmax(t, -1) * 2), (x,)
    elif which == "layernorm":
        w = torch.ones(8, requires_grad=True)
        fn, args = (lambda t, w: fused_layernorm(t, 8, w) + 1), (x, w)
    else:
        fn, args = nn.Sequential(FusedLayerNorm(8), FusedSoftmax(1)), (x,)
    explanation = torch._dynamo.explain(fn)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_inductor_fwd_bwd():
    """One run through Inductor's real code generation (CPU), both ops, forward and backward."""
    torch.manual_seed(2)
    x = torch.randn(6, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    b = torch.randn(32, requires_grad=True)
    dy = torch.randn(6, 32)

    def fn(x, w, b):
        return fused_softmax(fused_layernorm(x * 2, 32, w, b), -1) * 3

    def ref(x, w, b):
        return torch.softmax(F.layer_norm(x * 2, (32,), w, b), -1) * 3

    assert_same(compile_full(fn, backend="inductor"), ref, [x, w, b], dy)


def test_dynamic_shapes():
    fn = compile_full(lambda x, w: fused_softmax(fused_layernorm(x, x.shape[-1], w), 0),
                      dynamic=True)
    for m, n in ((3, 8), (5, 8), (4, 17)):
        x = torch.randn(m, n, requires_grad=True)
        w = torch.randn(n, requires_grad=True)
        assert_same(fn, lambda x, w: torch.softmax(F.layer_norm(x, x.shape[-1:], w), 0), [x, w],
                    torch.randn(m, n))


@needs_triton
def test_fullgraph_with_triton_kernels(monkeypatch):
    """Forced Triton backend under compile: the opaque custom ops run the (interpreted) kernels."""
    import fusedops.backends.triton as tb

    calls = []
    for name in ("softmax_forward", "softmax_backward", "layernorm_forward",
                 "layernorm_backward"):
        original = getattr(tb, name)

        def spy(*args, _original=original, _name=name):
            calls.append(_name)
            return _original(*args)

        monkeypatch.setattr(tb, name, spy)
    dev = "cuda" if HAS_CUDA else "cpu"
    x = torch.randn(4, 40, device=dev, requires_grad=True)
    w = torch.randn(40, device=dev, requires_grad=True)
    dy = torch.randn(4, 40, device=dev)

    def fn(x, w):
        return fused_softmax(fused_layernorm(x, 40, w), -1)

    with fusedops.use_backend("triton"):
        assert_same(compile_full(fn), lambda x, w: torch.softmax(F.layer_norm(x, (40,), w), -1),
                    [x, w], dy)
    assert set(calls) == {"softmax_forward", "softmax_backward", "layernorm_forward",
                          "layernorm_backward"}


# --------------------------------------------------------------------------- custom ops


def _opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor",
                                                "test_aot_dispatch_dynamic"))


# (the kernels in float32 by default; the others exhaustive)
@exhaustive_unless(lambda backend_name, dtype: (backend_name, dtype) == ("triton", torch.float32))
@pytest.mark.parametrize("backend_name", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
def test_opcheck_custom_ops(backend_name, dtype):
    if backend_name == "triton" and not triton_kernels_ready():
        pytest.skip("Triton kernels unavailable")
    if backend_name == "triton" and dtype == torch.float64:
        pytest.skip("float64 never reaches the kernels")
    ops = torch.ops.fusedops
    torch.set_default_device("cuda" if HAS_CUDA and backend_name == "triton" else "cpu")
    try:
        _opcheck_all(ops, dtype, backend_name)
    finally:
        # None (not "cpu") removes torch's default-device TorchFunctionMode from the stack;
        # a leftover mode would leak into later tests.
        torch.set_default_device(None)


def _opcheck_all(ops, dtype, backend_name):
    x = torch.randn(5, 12).to(dtype)
    w = torch.randn(12)
    with fusedops.use_backend(backend_name):
        for out_dtype in {dtype, torch.float32}:
            _opcheck(ops.softmax_forward, (x, out_dtype))
        y = ops.softmax_forward(x, dtype)
        _opcheck(ops.softmax_backward, (y, torch.randn(5, 12).to(dtype), dtype))
        for weight, bias in ((w, w + 1), (None, None), (w, None)):
            _opcheck(ops.layernorm_forward, (x, weight, bias, 1e-5, dtype))
        _, mean, rstd = ops.layernorm_forward(x, w, None, 1e-5, dtype)
        dy = torch.randn(5, 12).to(dtype)
        for need in [(True, True, True), (True, False, False), (False, True, False),
                     (False, False, True), (False, True, True)]:
            _opcheck(ops.layernorm_backward, (dy, x, w, mean, rstd, *need))
        _opcheck(ops.layernorm_backward, (dy, x, None, mean, rstd, True, False, False))


# --------------------------------------------------------------------------- GPU

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def gpu_test(fn):
    """A CUDA test for the compiled Triton kernels (skipped on CPU and under the interpreter)."""
    reason = "GPU tests target the Triton compiler: run them with TRITON_INTERPRET=0"
    return pytest.mark.gpu(pytest.mark.skipif(INTERPRETING, reason=reason)(fn))


def _cuda(*shape, dtype=torch.float32, scale=1.0, requires_grad=False):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype).requires_grad_(requires_grad)


def _coarse(dtype):
    return {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[dtype]


def _gpu_check_softmax(x, dim=-1, dtype=None):
    """Forward and dx on CUDA against the float64 oracle."""
    out_dtype = dtype or x.dtype
    xl = x.detach().clone().requires_grad_(True)
    y = fused_softmax(xl, dim, dtype=dtype)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = (x.detach().to(dtype) if dtype else x.detach()).double().requires_grad_(True)
    y64 = torch.softmax(x64, dim)
    y64.backward(dy.double())
    assert y.dtype == out_dtype
    assert_close_to_ref(y, y64.detach(), out_dtype)
    assert_close_to_ref(xl.grad, x64.grad, max(x.dtype, out_dtype, key=_coarse), scale=4)


def _gpu_check_layernorm(x, n, w, b, eps=1e-5):
    leaves = _leaves(x, w, b)
    for t in leaves:
        t.requires_grad_(True)
    y = fused_layernorm(leaves[0], n, leaves[1], leaves[2], eps)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    y64 = F.layer_norm(ref[0], (n,), ref[1], ref[2], eps)
    y64.backward(dy.double())
    assert y.dtype == x.dtype
    assert_close_to_ref(y, y64.detach(), x.dtype)
    assert_close_to_ref(leaves[0].grad, ref[0].grad, x.dtype, scale=4)
    rows = x.numel() // n
    for leaf, r in zip(leaves[1:], ref[1:], strict=True):
        key = max(x.dtype, leaf.dtype, key=_coarse)
        assert_close_to_ref(leaf.grad, r.grad, key, scale=4 * rows**0.5)


GPU_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gpu_compile_inductor(dtype):
    """fullgraph compile with Inductor on CUDA: the Triton kernels run behind the custom ops."""
    x = _cuda(64, 1000, dtype=dtype, requires_grad=True)
    w = _cuda(1000, requires_grad=True)
    b = _cuda(1000, requires_grad=True)

    def fn(x, w, b):
        return fused_softmax(fused_layernorm(x, 1000, w, b) * 2, -1)

    def eager(x, w, b):
        return fused_softmax(fused_layernorm(x, 1000, w, b) * 2, -1)

    assert_same(compile_full(fn, backend="inductor"), eager, [x, w, b],
                torch.randn(64, 1000, device="cuda").to(dtype), atol=GPU_TOL[dtype],
                rtol=GPU_TOL[dtype])
    with fusedops.count_fused_calls() as counts:
        eager(x, w, b)
    assert counts["softmax_forward"] == 1 and counts["layernorm_forward"] == 1


@gpu_test
def test_gpu_compile_modules_with_autocast():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), FusedLayerNorm(256), nn.Linear(256, 128),
                          FusedSoftmax(-1)).cuda()
    compiled = compile_full(model, backend="inductor")
    x = torch.randn(32, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_c = compiled(x)
        y_e = model(x)
    assert y_c.dtype == y_e.dtype == torch.float32
    torch.testing.assert_close(y_c, y_e, atol=1e-2, rtol=1e-2)
    y_c.sum().backward()


@gpu_test
@pytest.mark.parametrize("training", [False, True])
def test_gpu_reduce_overhead(training):
    """mode="reduce-overhead" records CUDA graphs of the compiled function; replays must be
    correct for fresh inputs."""
    torch.manual_seed(1)
    w = _cuda(512, requires_grad=training)
    b = _cuda(512, requires_grad=training)

    def fn(x):
        return fused_softmax(fused_layernorm(x, 512, w, b), -1)

    compiled = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
    for step in range(4):
        torch.compiler.cudagraph_mark_step_begin()  # a new iteration: earlier outputs may be reused
        w.grad = b.grad = None
        x = _cuda(128, 512, dtype=torch.bfloat16, requires_grad=training)
        y = compiled(x)
        expected = torch.softmax(F.layer_norm(x.detach().float(), (512,), w.detach(),
                                              b.detach()).bfloat16(), -1)
        torch.testing.assert_close(y.detach(), expected, atol=2e-2, rtol=2e-2, msg=f"step {step}")
        if training:
            y.float().pow(2).sum().backward()
            x_ref = x.detach().clone().requires_grad_(True)
            y_ref = torch.softmax(F.layer_norm(x_ref.float(), (512,), w.detach(),
                                               b.detach()).bfloat16(), -1)
            y_ref.float().pow(2).sum().backward()
            torch.testing.assert_close(x.grad, x_ref.grad, atol=2e-2, rtol=2e-2)
            assert w.grad is not None and torch.isfinite(w.grad).all()


@gpu_test
def test_gpu_cuda_graph_capture():
    """After a warm-up call (kernels compiled, configs cached), forward and backward of both ops
    can be captured in a CUDA graph and replayed on new data."""
    torch.manual_seed(2)
    n = 1024
    static_x = _cuda(256, n, dtype=torch.float16, requires_grad=True)
    static_dy = _cuda(256, n, dtype=torch.float16)
    w = _cuda(n, requires_grad=True)
    b = _cuda(n, requires_grad=True)

    def step():
        y = fused_softmax(fused_layernorm(static_x, n, w, b), -1)
        y.backward(static_dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    static_x.grad = w.grad = b.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()
    for _ in range(2):
        with torch.no_grad():
            static_x.copy_(torch.randn_like(static_x))
            static_dy.copy_(torch.randn_like(static_dy))
        graph.replay()
        torch.cuda.synchronize()
        x_ref = static_x.detach().clone().requires_grad_(True)
        w_ref = w.detach().clone().requires_grad_(True)
        b_ref = b.detach().clone().requires_grad_(True)
        y_ref = torch.softmax(F.layer_norm(x_ref.float(), (n,), w_ref, b_ref).half(), -1)
        y_ref.backward(static_dy)
        torch.testing.assert_close(static_y, y_ref, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(static_x.grad, x_ref.grad, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(w.grad, w_ref.grad, atol=1e-2, rtol=1e-3)
        torch.testing.assert_close(b.grad, b_ref.grad, atol=1e-2, rtol=1e-3)


@gpu_test
def test_gpu_inference_graph_capture():
    x = _cuda(64, 4096, dtype=torch.bfloat16)
    fused_softmax(x, -1)
    fused_layernorm(x, 4096)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fused_softmax(x, -1)
        z = fused_layernorm(x, 4096)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(y, torch.softmax(x, -1), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(z, F.layer_norm(x, (4096,)), atol=2e-2, rtol=2e-2)


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_autocast_matches_torch(dtype):
    """Both ops are on autocast's float32 list: output dtypes (and grads) must match torch's."""
    torch.manual_seed(3)
    x = _cuda(16, 300, requires_grad=True)
    proj = _cuda(300, 300)
    w = _cuda(300, requires_grad=True)
    b = _cuda(300, requires_grad=True)
    cases = {
        "softmax": (lambda h: fused_softmax(h, -1), lambda h: torch.softmax(h, -1)),
        "softmax_dim0": (lambda h: fused_softmax(h, 0), lambda h: torch.softmax(h, 0)),
        "softmax_dtype": (lambda h: fused_softmax(h, -1, dtype=dtype),
                          lambda h: torch.softmax(h, -1, dtype=dtype)),
        "layernorm": (lambda h: fused_layernorm(h, 300, w, b),
                      lambda h: F.layer_norm(h, (300,), w, b)),
        "layernorm_plain": (lambda h: fused_layernorm(h, 300), lambda h: F.layer_norm(h, (300,))),
    }
    for name, (ours, theirs) in cases.items():
        grads = []
        outs = []
        for fn in (ours, theirs):
            for t in (x, w, b):
                t.grad = None
            with torch.autocast("cuda", dtype=dtype):
                h = x @ proj  # low precision under autocast
                assert h.dtype == dtype
                out = fn(h)
            outs.append(out)
            out.float().pow(2).sum().backward()
            grads.append([None if t.grad is None else t.grad.clone() for t in (x, w, b)])
        assert outs[0].dtype == outs[1].dtype, name
        torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2, msg=name)
        for g, g_ref in zip(grads[0], grads[1], strict=True):
            assert (g is None) == (g_ref is None)
            if g is not None:
                assert g.dtype == g_ref.dtype
                torch.testing.assert_close(g, g_ref, atol=5e-2, rtol=5e-2, msg=name)


@gpu_test
@pytest.mark.parametrize("n", [32768, 32769, 65536, 131073, 262144, 1 << 20, (1 << 22) + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_long_rows(n, dtype):
    """Rows far beyond one block (no 64K limit), including odd lengths."""
    torch.manual_seed(n)
    rows = 3 if n <= 262144 else 2
    _gpu_check_softmax(_cuda(rows, n, dtype=dtype, scale=3))
    _gpu_check_layernorm(_cuda(rows, n, dtype=dtype, scale=2), n, _cuda(n), _cuda(n))


@gpu_test
@pytest.mark.parametrize("n", [8193, 65537])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_layernorm_unaligned_16bit_rows(n, dtype):
    """16-bit rows of 2^k + 1: 8193 on the fused kernel's aligned-body variant, 65537 (too long
    for it) on dx pieces + the column kernel (fusedops/backends/triton/layernorm.py: DX_PIECES_BWD),
    whatever the weights' dtype. Both must match the float64 oracle, and the fused forward must
    stay ours. Where the rows' starts rule out vector accesses, PyTorch's native backward would
    run (weights in x's dtype; NATIVE_UNALIGNED_16BIT_BWD)."""
    from fusedops.backends.triton.configs import layernorm as ln_rules
    from fusedops.backends.triton.runtime.facts import device_facts

    torch.manual_seed(n)
    x = _cuda(40, n, dtype=dtype, scale=2)
    vec = ln_backward_vec(x, x)
    assert (ln_rules.dx_pieces_plan(n, 2, vec) is not None) == (n > ln_rules.FUSED_BWD_MAX_BLOCK)
    gpu = device_facts(x.get_device())
    assert ln_rules.native_unaligned(n, 2, True, gpu)  # weights in x's dtype
    assert not ln_rules.native_unaligned(n, 2, False, gpu)  # float32 weights
    _gpu_check_layernorm(x, n, _cuda(n, dtype=dtype), _cuda(n, dtype=dtype))
    _gpu_check_layernorm(x, n, _cuda(n), _cuda(n))
    with fusedops.count_fused_calls() as counts:
        fused_layernorm(x, n, _cuda(n, dtype=dtype))
    assert counts["layernorm_forward"] == 1


@gpu_test
@pytest.mark.parametrize("shape", [(4096, 4096), (16384, 1024), (3000, 5000), (257, 16385),
                                   (100000, 33), (8, 262144)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gpu_big_shapes(shape, dtype):
    """Correctness at benchmark-like sizes: many programs, persistent loops, many partials."""
    m, n = shape
    torch.manual_seed(m + n)
    _gpu_check_softmax(_cuda(m, n, dtype=dtype, scale=3))
    _gpu_check_softmax(_cuda(n, m, dtype=dtype).t(), dim=0)
    _gpu_check_layernorm(_cuda(m, n, dtype=dtype), n, _cuda(n), _cuda(n))


def _rows_to_check(m):
    return sorted({0, 1, m // 2, m - 2, m - 1})


@gpu_test
@pytest.mark.slow
@pytest.mark.parametrize("n", [32768, 65537])
def test_gpu_softmax_over_2_31_elements(n):
    """64-bit offsets: rows past element 2**31 are computed right (forward and backward)."""
    m = (1 << 31) // n + 2
    assert m * n > (1 << 31)
    torch.manual_seed(4)
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    xl = x.requires_grad_(True)
    y = fused_softmax(xl, -1)
    y.backward(dy)
    for r in _rows_to_check(m):
        x64 = x[r].detach().double().requires_grad_(True)
        y64 = torch.softmax(x64, -1)
        y64.backward(dy[r].double())
        assert_close_to_ref(y[r].detach(), y64.detach(), torch.bfloat16)
        assert_close_to_ref(xl.grad[r], x64.grad, torch.bfloat16, scale=4)
    del x, dy, y, xl
    torch.cuda.empty_cache()


@gpu_test
@pytest.mark.slow
@pytest.mark.parametrize("n", [16384, 65537])
def test_gpu_layernorm_over_2_31_elements(n):
    m = (1 << 31) // n + 2
    torch.manual_seed(5)
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    w = torch.randn(n, device="cuda", requires_grad=True)
    b = torch.randn(n, device="cuda", requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    y = fused_layernorm(x, n, w, b)
    y.backward(dy)
    for r in _rows_to_check(m):
        x64 = x[r].detach().double().requires_grad_(True)
        y64 = F.layer_norm(x64, (n,), w.detach().double(), b.detach().double())
        y64.backward(dy[r].double())
        assert_close_to_ref(y[r].detach(), y64.detach(), torch.bfloat16)
        assert_close_to_ref(x.grad[r], x64.grad, torch.bfloat16, scale=4)
    # dweight / dbias over all rows against a float64 oracle, accumulated in row chunks
    dw64 = torch.zeros(n, dtype=torch.float64, device="cuda")
    db64 = torch.zeros(n, dtype=torch.float64, device="cuda")
    chunk = max(1, (1 << 26) // n)
    for start in range(0, m, chunk):
        xs = x[start : start + chunk].detach().double()
        dys = dy[start : start + chunk].double()
        xhat = (xs - xs.mean(-1, keepdim=True)) * torch.rsqrt(
            xs.var(-1, unbiased=False, keepdim=True) + 1e-5
        )
        dw64 += (dys * xhat).sum(0)
        db64 += dys.sum(0)
        del xs, dys, xhat
    assert_close_to_ref(b.grad, db64, torch.float32, scale=4 * m**0.5)
    assert_close_to_ref(w.grad, dw64, torch.float32, scale=4 * m**0.5)
    del x, dy, y
    torch.cuda.empty_cache()
