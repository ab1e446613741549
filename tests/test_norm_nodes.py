"""LayerNorm and RMSNorm training calls as C++ autograd nodes: the extension's generic
replayed-op node (``csrc/host/node.cpp``), the backends' node makers and the ops layer's
routing.

On CPU the extension runs in its dry-run mode (launches logged, not made): the tests check
which tensors each launch of the forward and backward gets, the gradients' dtypes and shapes,
and every refusal. The ops layer's routing is checked with a stand-in node. The ``gpu`` tests
run real nodes against float64 and bitwise against the Python path.
"""

from __future__ import annotations

import pytest
import torch
from conftest import HAS_CUDA, assert_close_to_ref, assert_row_sum_close

import fusedops
from fusedops import _dispatch, _replay
from fusedops.backends.triton.runtime import host_ext

ext = host_ext.ext
needs_ext = pytest.mark.skipif(
    ext is None, reason="fusedops._host_ext is not built (python setup.py build_ext --inplace)")
needs_cuda_ext = pytest.mark.skipif(
    HAS_CUDA and not host_ext.AVAILABLE,
    reason="fusedops._host_ext is not built with CUDA here (python setup.py build_ext --inplace)")

# Forward plan slots: x, weight, bias, y, mean, rstd; backward: dy, x, weight, mean, rstd,
# dx, dweight, dbias.
FWD_ARGS = [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (-1, 9)]
BWD_ARGS = [(i, 0) for i in range(8)]


def _node(x, w, b, *, dw_dtype=torch.float32, needs_dx=True, differentiable=None):
    """A dry-run node of LayerNorm's layout for these tensors (its dweight/dbias in
    ``dw_dtype``)."""
    fwd = ext.make_plan([(11, [2, 1, 1], 128, 0, FWD_ARGS)])
    bwd = ext.make_plan([(12, [3, 1, 1], 64, 16, BWD_ARGS)])
    rows, n = x.numel() // x.shape[-1], x.shape[-1]
    stats = ((rows,), torch.float32)
    metas = ((((rows, n), x.dtype) if needs_dx else None),
             None if w is None else ((n,), dw_dtype), None if b is None else ((n,), dw_dtype))
    codes = host_ext._DTYPE_CODES
    handle = ext.make_node(
        fwd, bwd, [host_ext.node_input(t) for t in (x, w, b)],
        [host_ext.node_made(m) for m in ((x.shape, x.dtype), stats, stats)], [0, 1, 4, 5],
        [host_ext.node_made(m) for m in metas],
        [(i if m is not None else -1, codes[(t if t is not None else x).dtype],
          list((t if t is not None else x).shape))
         for i, (m, t) in enumerate(zip(metas, (x, w, b), strict=True))], differentiable)
    assert handle >= 0
    return handle


@needs_ext
@pytest.mark.parametrize("params", ["both", "bias only", "none"])
def test_node_wiring(params):
    """Forward: one launch on (x, weight, bias, y, mean, rstd), y returned with x's shape.
    Backward: one launch on (dy, x, weight, mean, rstd, dx, dweight, dbias), a non-contiguous
    dy copied first; dweight/dbias cast to the parameters' dtype and shape, each gradient
    reaching the input it belongs to (absent parameters: address 0, no gradient)."""
    x = torch.randn(2, 3, 16, requires_grad=True)
    w = torch.ones(16, dtype=torch.float16, requires_grad=True) if params == "both" else None
    b = torch.zeros(16, dtype=torch.float16, requires_grad=True) if params != "none" else None
    handle = _node(x, w, b)
    ext.set_dry_run(True)
    try:
        y = ext.node(handle, x, w, b)
        assert y.shape == x.shape and y.dtype == x.dtype and y.requires_grad
        assert "ReplayNode" in y.grad_fn.name()
        dy = torch.randn(16, 3, 2).permute(2, 1, 0)  # not contiguous
        y.backward(dy)
        log = ext.take_dry_log()
    finally:
        ext.set_dry_run(False)
    assert len(log) == 2
    fwd, bwd = log
    addr = [0 if t is None else t.data_ptr() for t in (w, b)]
    assert fwd[:6] == [11, 2, 1, 1, 128, 0]
    assert fwd[6:10] == [x.data_ptr(), *addr, y.data_ptr()] and fwd[12] == 9
    mean, rstd = fwd[10], fwd[11]
    assert bwd[:6] == [12, 3, 1, 1, 64, 16]
    assert bwd[6] not in (0, dy.data_ptr())
    assert bwd[7:11] == [x.data_ptr(), addr[0], mean, rstd]
    assert bwd[11] == x.grad.data_ptr() and x.grad.shape == x.shape
    for p, at in ((w, 12), (b, 13)):
        if p is None:
            assert bwd[at] == 0
        else:  # float32 sums cast to the parameter's dtype (a copy: another address)
            assert p.grad.dtype == torch.float16 and p.grad.shape == p.shape
            assert bwd[at] != 0


@needs_ext
def test_node_gradients_only_where_needed():
    """Inputs that need no gradient get none, whatever the plan made; autograd's edges are
    counted over the present inputs only (no weight, a bias that needs a gradient)."""
    x = torch.randn(4, 8)
    b = torch.zeros(8, requires_grad=True)
    handle = _node(x, None, b, needs_dx=False)
    ext.set_dry_run(True)
    try:
        y = ext.node(handle, x, None, b)
        y.sum().backward()
        ext.take_dry_log()
    finally:
        ext.set_dry_run(False)
    assert x.grad is None and b.grad is not None and b.grad.shape == (8,)


@needs_ext
def test_node_backward_with_create_graph_is_differentiable():
    """Under create_graph=True the node's backward is its differentiable callable, given dy,
    the kept tensors (absent ones None) and which inputs need a gradient; second derivatives
    flow through what it returns. Without one, such a backward raises."""
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(8, dtype=torch.float64, requires_grad=True)
    seen = []

    def differentiable(dy, kept, needs):
        seen.append(([t is None for t in kept], list(needs)))
        return [dy * x.sin(), None, dy.sum(0)]

    handle = _node(x, None, b, differentiable=differentiable)
    plain = _node(x, None, b)
    dy = torch.randn(4, 8, dtype=torch.float64)
    ext.set_dry_run(True)
    try:
        y = ext.node(handle, x, None, b)
        gx, gb = torch.autograd.grad(y, (x, b), dy, create_graph=True)
        assert seen == [([False, True, False, False], [True, False, True])]
        torch.testing.assert_close(gx, dy * x.sin())
        hx, = torch.autograd.grad(gx.sum(), x)
        torch.testing.assert_close(hx, dy * x.cos())
        y = ext.node(plain, x, None, b)
        with pytest.raises(RuntimeError, match="not differentiable"):
            torch.autograd.grad(y, x, dy, create_graph=True)
        y = ext.node(plain, x, None, b)
        assert not torch.autograd.grad(y, x, dy)[0].requires_grad  # (first order: the plans)
        ext.take_dry_log()
    finally:
        ext.set_dry_run(False)


@needs_ext
def test_node_refuses_other_tensors():
    """None for anything the plans were not recorded for: another dtype, shape, alignment,
    layout or requires_grad of any input, an absent or extra parameter, and autograd off."""
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    b = torch.zeros(8, requires_grad=True)
    handle = _node(x, w, b)
    ext.set_dry_run(True)
    try:
        bad = [
            (x.half(), w, b), (torch.randn(4, 16), w, b), (x, w.detach(), b), (x, w, None),
            (torch.randn(8, 4, requires_grad=True).t(), w, b),
            (torch.randn(33)[1:].view(4, 8).requires_grad_(), w, b),  # x at another alignment
            (x, torch.ones(8, dtype=torch.float64, requires_grad=True), b),
            (x, torch.ones(2, 4, requires_grad=True), b),
        ]
        for args in bad:
            assert ext.node(handle, *args) is None, [tuple(t.shape) for t in args if t is not None]
        with torch.no_grad():
            assert ext.node(handle, x, w, b) is None
        assert ext.node(handle, x, w, b) is not None
        assert ext.take_dry_log()
    finally:
        ext.set_dry_run(False)


@needs_ext
def test_make_node_checks_its_spec():
    x = torch.randn(4, 8)
    fwd = ext.make_plan([(1, [1, 1, 1], 32, 0, [(0, 0)])])
    inputs = [host_ext.node_input(x)]
    made = [host_ext.node_made((x.shape, x.dtype))]
    with pytest.raises(RuntimeError, match="two registered plans"):
        ext.make_node(fwd, 1 << 20, inputs, made, [], made, [(-1, 6, [])], None)
    with pytest.raises(RuntimeError, match="does not make"):
        ext.make_node(fwd, fwd, inputs, made, [], [host_ext.node_made(None)], [(0, 6, [4, 8])],
                      None)
    with pytest.raises(RuntimeError, match="kept slot"):
        ext.make_node(fwd, fwd, inputs, made, [5], made, [(0, 6, [4, 8])], None)


# ----------------------------------------------------------------------------------------------
# The ops layer's routing of training calls (a stand-in node; any device).

# Per op: its node table, the backend's maker, the public call on (x, w, b), torch's own result
# on (x, params) and eps, the Python Function's grad_fn name.
OPS = {
    "layernorm": (_replay.LAYERNORM_NODE, "layernorm_node",
                  lambda x, w, b: fusedops.fused_layernorm(x, x.shape[-1], w, b, 1e-5),
                  lambda x, p, eps: torch.nn.functional.layer_norm(x, x.shape[-1:], *p, eps),
                  "LayerNormFunctionBackward"),
    "rmsnorm": (_replay.RMSNORM_NODE, "rmsnorm_node",
                lambda x, w, b: fusedops.fused_rmsnorm(x, x.shape[-1], w, 1e-5),
                lambda x, p, eps: torch.rms_norm(x, x.shape[-1:], *p, eps),
                "RMSNormFunctionBackward"),
}


class _Maker:
    """A backend's node maker stand-in: makes a node computing torch's result plus 0 (an
    ``AddBackward0`` grad_fn), counting its calls; ``refuse``: the node returns None."""

    def __init__(self, ref):
        self.made, self.calls, self.refuse, self.ref = 0, 0, False, ref

    def __call__(self, x, *args):
        # (parameters, eps, out_dtype, dy, statistics, differentiable)
        at = next(i for i, a in enumerate(args) if isinstance(a, float))
        eps, dy, rstd, differentiable = args[at], args[at + 2], args[-2], args[-1]
        assert dy.is_contiguous() and rstd.dtype == torch.float32 and callable(differentiable)
        self.made += 1

        def node(x, *params):
            self.calls += 1
            return None if self.refuse else self.ref(x, params, eps) + 0.0
        return node


@pytest.fixture(params=sorted(OPS))
def routed(request, monkeypatch):
    """A norm's training calls on CPU as on a backend with C++ nodes: the reference backend
    forced (its Python Function runs every call), a node rule of 0, a stand-in maker. Yields
    (maker, node table, call, Function's grad_fn name)."""
    table, maker_name, call, ref, function = OPS[request.param]
    maker = _Maker(ref)
    from fusedops.backends import reference

    monkeypatch.setattr(reference, "NATIVE_AUTOGRAD", True, raising=False)
    monkeypatch.setattr(reference, maker_name, maker, raising=False)
    with _dispatch.use_backend("reference"):
        table.clear()
        yield maker, table, call, function, request.param
    table.clear()


def test_first_call_makes_the_node_and_later_calls_run_it(routed):
    maker, table, call, function, _ = routed
    x = torch.randn(3, 5, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    b = torch.randn(32, requires_grad=True)
    y = call(x, w, b)
    assert y.grad_fn.name() == function
    sig = (x.shape, x.dtype, -1, 1e-5)
    assert table[sig] is False  # (pending)
    y.backward(torch.randn_like(y).transpose(0, 1).contiguous().transpose(0, 1))
    assert maker.made == 1 and callable(table[sig])
    y2 = call(x, w, b)
    assert maker.calls == 1 and y2.grad_fn.name() == "AddBackward0"
    torch.testing.assert_close(y2, y)
    with torch.no_grad():  # inference calls never look at nodes
        call(x, w, b)
    assert maker.calls == 1


def test_calls_without_a_node_take_torch_below_the_python_rule(routed, monkeypatch):
    """A signature whose node is pending, refused or not made runs torch's op where the
    Python Function's size rule says so, the Function above it."""
    maker, table, call, function, op = routed
    monkeypatch.setitem(_dispatch._below, (op, True), 10**6)
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    y = call(x, w, None)  # first sight: the Function, making the node
    assert y.grad_fn.name() == function
    y2 = call(x, w, None)  # pending (no backward yet): torch
    assert y2.grad_fn.name() not in (function, "AddBackward0")
    maker.refuse = True
    y.sum().backward()
    y3 = call(x, w, None)  # refused by the node: torch
    assert maker.calls == 1 and y3.grad_fn.name() not in (function, "AddBackward0")
    monkeypatch.setitem(_dispatch._below, (op, True), 0)
    y4 = call(x, w, None)  # refused, above the Function's rule: the Function
    assert y4.grad_fn.name() == function


def test_no_node_under_autocast_for_16_bit_or_counting(routed):
    maker, table, call, _, _ = routed
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        call(x, None, None).float().sum().backward()
    assert not table and maker.made == 0
    with _dispatch.count_fused_calls():
        call(x, None, None).float().sum().backward()
    assert not table


def test_nodes_go_with_the_launch_rules():
    """Nodes replay plans made by the launch rules: when those change (the backend's caches
    cleared), the nodes go too."""
    pytest.importorskip("triton")
    from fusedops.backends.triton import configs

    _replay.LAYERNORM_NODE[("sig",)] = False
    _replay.RMSNORM_NODE[("sig",)] = False
    configs.clear_caches()
    assert not _replay.LAYERNORM_NODE and not _replay.RMSNORM_NODE


def test_set_layernorm_backward_drops_nodes(routed):
    _, table, call, _, op = routed
    if op != "layernorm":
        pytest.skip("the mode is LayerNorm's")
    x = torch.randn(4, 32, requires_grad=True)
    call(x, None, None).sum().backward()
    assert table
    previous = fusedops.get_layernorm_backward()
    other = "fast" if previous == "low_memory" else "low_memory"
    try:
        fusedops.set_layernorm_backward(other)
        assert not table
    finally:
        fusedops.set_layernorm_backward(previous)


FUNCTIONS = {"layernorm": "LayerNormFunctionBackward", "rmsnorm": "RMSNormFunctionBackward"}


def _norm(op, x, w, b):
    n = x.shape[-1]
    if op == "layernorm":
        return fusedops.fused_layernorm(x, n, w, b, 1e-5)
    return fusedops.fused_rmsnorm(x, n, w, 1e-5)


def _ref(op, x, w, b, eps=1e-5):
    """The op in float64 (RMSNorm ignores ``b``)."""
    xd = x.double()
    if op == "layernorm":
        xd = xd - xd.mean(-1, keepdim=True)
    y = xd / torch.sqrt((xd ** 2).mean(-1, keepdim=True) + eps)
    y = y * (1 if w is None else w.double())
    return y if b is None or op == "rmsnorm" else y + b.double()


@pytest.mark.gpu
@pytest.mark.auto_backend
@needs_cuda_ext
@pytest.mark.parametrize("op", sorted(FUNCTIONS))
def test_gpu_small_training_calls_stay_native(op):
    """Below the node rule a training call runs torch's op, node or not."""
    x = torch.randn(8, 256, device="cuda", requires_grad=True)
    assert x.numel() < _dispatch.NATIVE_BELOW[op, "node"]
    for _ in range(3):
        y = _norm(op, x, None, None)
        y.sum().backward()
    assert y.grad_fn.name() != FUNCTIONS[op] and "ReplayNode" not in y.grad_fn.name()


# ----------------------------------------------------------------------------------------------
# CUDA: real nodes against float64 and the Python path.


@pytest.fixture
def every_size(monkeypatch):
    """Training calls of every size take nodes (the size rules of nodes set to 0)."""
    for op in FUNCTIONS:
        monkeypatch.setitem(_dispatch.NATIVE_BELOW, (op, "node"), 0)
    _dispatch.set_backend(_dispatch.get_backend())  # (empties the size rules' tables)
    yield
    monkeypatch.undo()
    _dispatch.set_backend(_dispatch.get_backend())


@pytest.mark.parametrize("op", sorted(FUNCTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("shape", "params"), [
    ((4, 128), "both"), ((8, 128, 768), "both"), ((2, 7, 1000), "weight"), ((64, 4096), "none"),
    ((16, 768), "fp32 params"), ((3, 4097), "both")])
@pytest.mark.gpu
@needs_cuda_ext
def test_gpu_norm_node(op, dtype, shape, params, every_size):
    """From the second call of a signature on, a training call runs the C++ node (where its
    plans convert: every shape here but LayerNorm's and RMSNorm's unaligned 16-bit rows may
    keep the Function); outputs and gradients match float64 and, bitwise, the first (Python)
    call's."""
    torch.manual_seed(0)
    n = shape[-1]
    pdtype = torch.float32 if params == "fp32 params" else dtype
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(shape, generator=gen).to("cuda", dtype)
    dy = torch.randn(shape, generator=gen).to("cuda", dtype)
    w0 = (1 + 0.1 * torch.randn(n, generator=gen)).to("cuda", pdtype)
    b0 = (0.1 * torch.randn(n, generator=gen)).to("cuda", pdtype)
    with_b = params in ("both", "fp32 params") and op == "layernorm"
    results = []
    for _ in range(3):
        x = x0.clone().requires_grad_()
        w = None if params == "none" else w0.clone().requires_grad_()
        b = b0.clone().requires_grad_() if with_b else None
        y = _norm(op, x, w, b)
        grads = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], dy)
        results.append((y.grad_fn.name(), y.detach(), grads))
    assert results[0][0] == FUNCTIONS[op], results[0][0]
    if n % 8 == 0:
        assert "ReplayNode" in results[1][0] and "ReplayNode" in results[2][0]
    ref = _ref(op, x0, w if w is None else w0, b if b is None else b0)
    xr = x0.double().requires_grad_()
    wr = None if w is None else w0.double().requires_grad_()
    br = None if b is None else b0.double().requires_grad_()
    refs = torch.autograd.grad(_ref(op, xr, wr, br), [t for t in (xr, wr, br) if t is not None],
                               dy.double())
    rows = x0.numel() // n
    for _, y, grads in results:
        assert_close_to_ref(y, ref, dtype)
        assert_close_to_ref(grads[0], refs[0], dtype, scale=4.0)
        for g, r in zip(grads[1:], refs[1:], strict=True):
            assert g.dtype == pdtype
            assert_row_sum_close(g, r, rows)
    for _, y, grads in results[1:]:
        torch.testing.assert_close(y, results[0][1], atol=0, rtol=0)
        for g, g0 in zip(grads, results[0][2], strict=True):
            torch.testing.assert_close(g, g0, atol=0, rtol=0)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("op", sorted(FUNCTIONS))
def test_gpu_norm_node_takes_any_gradient_and_refuses_other_inputs(op, every_size):
    """An expanded gradient reaches the node's backward (copied to its recorded layout); a
    call whose weight needs no gradient is refused by the node and runs correctly."""
    n = 256
    x = torch.randn(8, n, device="cuda", dtype=torch.float16, requires_grad=True)
    w = torch.ones(n, device="cuda", dtype=torch.float16, requires_grad=True)
    b = torch.zeros(n, device="cuda", dtype=torch.float16, requires_grad=True)
    b = b if op == "layernorm" else None
    inputs = [t for t in (x, w, b) if t is not None]
    for _ in range(2):
        y = _norm(op, x, w, b)
        want = torch.autograd.grad(y, inputs, torch.ones_like(y))
    y = _norm(op, x, w, b)
    assert "ReplayNode" in y.grad_fn.name()
    got = torch.autograd.grad(y.sum(), inputs)
    for g, h in zip(got, want, strict=True):
        torch.testing.assert_close(g, h, atol=0, rtol=0)
    y = _norm(op, x, w.detach(), b)
    assert "ReplayNode" not in y.grad_fn.name()
    gx, = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(gx, want[0], atol=0, rtol=0)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("op", sorted(FUNCTIONS))
def test_gpu_norm_node_second_derivatives(op, every_size):
    """A training call run by the node and differentiated twice (create_graph=True) gives
    torch's second derivatives."""
    n = 64
    x0 = torch.randn(6, n, device="cuda", dtype=torch.float64)
    w0 = 1 + 0.1 * torch.randn(n, device="cuda", dtype=torch.float64)
    b0 = 0.1 * torch.randn(n, device="cuda", dtype=torch.float64)
    for _ in range(2):
        x, w, b = (t.float().requires_grad_() for t in (x0, w0, b0))
        _norm(op, x, w, b).square().sum().backward()
    x, w, b = (t.float().requires_grad_() for t in (x0, w0, b0))
    y = _norm(op, x, w, b)
    assert "ReplayNode" in y.grad_fn.name()
    gx, gw = torch.autograd.grad(y.square().sum(), (x, w), create_graph=True)
    got = torch.autograd.grad((gx.square().sum() + gw.sum()), (x, w))
    xr, wr, br = (t.clone().requires_grad_() for t in (x0, w0, b0))
    rx, rw = torch.autograd.grad(_ref(op, xr, wr, br).square().sum(), (xr, wr),
                                 create_graph=True)
    want = torch.autograd.grad((rx.square().sum() + rw.sum()), (xr, wr))
    for g, r in zip(got, want, strict=True):
        assert_close_to_ref(g, r, torch.float32, scale=16.0)
