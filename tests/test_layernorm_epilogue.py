"""fused_layernorm(residual=, dropout_p=, activation=, training=):
``activation(dropout(layer_norm(x + residual)))`` against an UNFUSED float64 eager reference.

Every case checks the output (and the returned sum ``x + residual``) and each gradient asked for
(x, residual, weight, bias) against float64 autograd of the eager chain, with the shared
tolerance table. Dropout: with p = 0 exactly the chain without dropout; with p > 0 the kept
positions must be exactly those where ``fusedops._philox.keep_mask(seed, ...)`` is True (the seed
predicted by re-seeding torch and calling ``fusedops._philox.draw_seed()``), the kept values the
eager chain's times ``1 / (1 - p)``, the keep fraction within a few sigma of ``1 - p``, and
backward must use forward's mask. Tests taking the ``backend`` fixture run on the reference
backend and on the Triton kernels (interpreted on CPU); where a backend has no epilogue kernels
the op layer falls back to the reference with a warning, so the tests pass either way and check
the kernels once they land. Tensors stay small (the interpreter is slow).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_to_ref, assert_row_sum_close, exhaustive_unless, one_of_each, tol

from fusedops import _dispatch, _philox, fused_layernorm

# Tensors are created on the GPU when there is one (conftest's _tensors_on_device).
ON_DEVICE = True

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INF, NAN = float("inf"), float("nan")
# Gradients are computed from rounded saved values (the sum s in x's dtype, float32 statistics):
# a few output ulps, as in tests/test_layernorm.py.
GRAD_SCALE = 4.0

layernorm_module = importlib.import_module("fusedops.ops.layernorm")


# --------------------------------------------------------------------------- oracle and check


def dev():
    return torch.empty(0).device


def make_params(shape, dtype, weight=True, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)  # CPU generator: same values on every device
    w = (1 + 0.5 * torch.randn(shape, generator=g, device="cpu")).to(dtype) if weight else None
    b = (0.5 * torch.randn(shape, generator=g, device="cpu")).to(dtype) if bias else None
    return (None if w is None else w.to(dev())), (None if b is None else b.to(dev()))


def predicted_keep(seed_k: int, x: torch.Tensor, n: int, p: float) -> torch.Tensor:
    """The keep mask a call made right after ``torch.manual_seed(seed_k)`` must use, shaped like x:
    Philox numbers of the (M, n) row view for the seed that call draws."""
    torch.manual_seed(seed_k)
    seed = _philox.draw_seed()
    m = x.numel() // n if n else 0
    return _philox.keep_mask(seed, m, n, p, device=x.device).reshape(x.shape)


def activate64(y, activation):
    if activation == "relu":
        return torch.relu(y)
    if activation == "gelu":
        return F.gelu(y)  # exact (erf) GELU
    assert activation is None
    return y


def ref_chain(s, shape, w, b, eps, keep, p, activation):
    """Unfused float64 eager chain on the LayerNorm input ``s`` (x + residual, already rounded to
    x's dtype as torch's add does): leaves s64, w64, b64 and the output y64."""
    s64 = s.detach().double().requires_grad_(True)
    w64 = None if w is None else w.detach().double().requires_grad_(True)
    b64 = None if b is None else b.detach().double().requires_grad_(True)
    y64 = F.layer_norm(s64, shape, w64, b64, eps)
    if keep is not None:
        y64 = y64 * keep.double() * (1.0 / (1.0 - p))
    return s64, w64, b64, activate64(y64, activation)


def check(x, shape, w=None, b=None, *, residual=None, p=0.0, activation=None, eps=1e-5,
          seed_k=0, need="xrwb", dout=None, ds=None, grad_scale=GRAD_SCALE):
    """One fused_layernorm call (after torch.manual_seed(seed_k)) against the float64 eager chain,
    forward and the requested gradients. ``need``: which of x, residual (r), weight, bias require
    grad. ``ds``: a gradient for the returned sum too. Returns (out, s, keep, grads)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    n = math.prod(shape)

    def leaf(t, key):
        return None if t is None else t.detach().clone().requires_grad_(key in need)

    xl, rl, wl, bl = leaf(x, "x"), leaf(residual, "r"), leaf(w, "w"), leaf(b, "b")
    torch.manual_seed(seed_k)
    result = fused_layernorm(xl, shape, wl, bl, eps, residual=rl, dropout_p=p,
                             activation=activation)
    keep = predicted_keep(seed_k, x, n, p) if p > 0 else None
    if residual is None:
        assert isinstance(result, torch.Tensor)
        out, s = result, None
        s_val = x.detach()
    else:
        assert isinstance(result, tuple) and len(result) == 2
        out, s = result
        s_val = x.detach() + residual.detach()  # torch's add, in x's dtype
        assert s.dtype == x.dtype and s.shape == x.shape
        assert torch.equal(s, s_val), "the returned sum must be exactly x + residual"
    assert out.dtype == x.dtype and out.shape == x.shape

    s64, w64, b64, y64 = ref_chain(s_val, shape, w, b, eps, keep, p, activation)
    assert_close_to_ref(out, y64, x.dtype)
    if keep is not None:
        # Dropped positions are exactly zero (activation(0) == 0 for relu and gelu).
        assert (out[~keep] == 0).all()

    grads = {}
    if not out.requires_grad:
        return out, s, keep, grads
    if dout is None:
        dout = torch.randn(x.shape).to(x.dtype)
    if ds is not None and s is not None:
        torch.autograd.backward([out, s], [dout, ds])
    else:
        out.backward(dout)
    inputs = [t for t in (s64, w64, b64) if t is not None]
    names = ["s"] + (["w"] if w64 is not None else []) + (["b"] if b64 is not None else [])
    g64 = dict(zip(names, torch.autograd.grad(y64, inputs, dout.double()), strict=True))
    ds64 = g64["s"] + (ds.double() if ds is not None and s is not None else 0)
    for key, lf in (("x", xl), ("r", rl)):
        if lf is None:
            continue
        if key not in need:
            assert lf.grad is None
            continue
        assert lf.grad.dtype == x.dtype and lf.grad.shape == x.shape
        assert_close_to_ref(lf.grad, ds64, x.dtype, scale=grad_scale)
        grads[key] = lf.grad
    if "x" in grads and "r" in grads:
        assert torch.equal(grads["x"], grads["r"]), "residual's gradient is x's"
    rows = max(x.numel() // max(n, 1), 1)
    for key, lf in (("w", wl), ("b", bl)):
        if lf is None:
            continue
        if key not in need:
            assert lf.grad is None
            continue
        assert lf.grad.dtype == lf.dtype and lf.grad.shape == lf.shape
        # A float32 sum over rows, compared in the parameter's own dtype (not x's).
        assert_row_sum_close(lf.grad, g64[key], rows, scale=grad_scale)
        grads[key] = lf.grad
    return out, s, keep, grads


# --------------------------------------------------------------------------- residual, activation


@exhaustive_unless(lambda backend, dtype: backend == "reference" or dtype == torch.float32)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_residual_only(backend, dtype):
    """Returns (out, x + residual): out = layer_norm(x + residual), the sum exactly torch's
    x + residual; gradients of x and residual (equal), weight and bias; with and without a
    gradient flowing into the returned sum."""
    torch.manual_seed(1)
    x = (torch.randn(4, 6, 40) * 2 + 0.5).to(dtype)
    r = torch.randn(4, 6, 40).to(dtype)
    w, b = make_params(40, dtype, seed=1)
    check(x, 40, w, b, residual=r)
    check(x, 40, w, b, residual=r, ds=torch.randn(x.shape).to(dtype))


# (the kernels on the diagonal's bfloat16 case, gelu with a residual; the others exhaustive)
@exhaustive_unless(one_of_each({"activation": ["relu", "gelu"],
                                "with_residual": [False, True],
                                "dtype": [torch.float32, torch.bfloat16]},
                               {"backend": "reference"},
                               where=lambda backend, activation, with_residual, dtype:
                                   backend == "reference" or dtype == torch.bfloat16))
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_activation(backend, activation, with_residual, dtype):
    torch.manual_seed(2)
    x = torch.randn(5, 33).to(dtype)
    r = torch.randn(5, 33).to(dtype) if with_residual else None
    w, b = make_params(33, dtype, seed=2)
    out, _, _, _ = check(x, 33, w, b, residual=r, activation=activation,
                         ds=None if r is None else torch.randn(5, 33).to(dtype))
    if activation == "relu":
        assert (out >= 0).all()


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_dropout_p0_is_exactly_no_dropout(backend, activation):
    """dropout_p=0 (training) is no dropout: the same values as the call without it, bit for bit,
    and the eager chain; no random number is drawn."""
    torch.manual_seed(3)
    x = torch.randn(6, 48)
    r = torch.randn(6, 48)
    w, b = make_params(48, torch.float32, seed=3)
    out, s, _, _ = check(x, 48, w, b, residual=r, p=0.0, activation=activation)
    plain = fused_layernorm(x, 48, w, b, residual=r, activation=activation)
    assert torch.equal(out, plain[0]) and torch.equal(s, plain[1])
    torch.manual_seed(5)
    fused_layernorm(x, 48, w, b, residual=r, dropout_p=0.0, activation=activation)
    after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(1)), "p == 0 must not consume torch's generator"


# --------------------------------------------------------------------------- dropout


def _dropout_inputs(case):
    """(x, normalized_shape, weight, bias, residual) for the dropout mask tests."""
    torch.manual_seed(4)
    if case == "row_1100":  # a row spanning two 4W groups, the second partial
        x, shape = torch.randn(3, 1100), (1100,)
    elif case == "multi_dim_shape":  # rows of 3 * 40 = 120 over two dims
        x, shape = torch.randn(2, 5, 3, 40), (3, 40)
    else:  # non-contiguous rows of 260 (> W = 256): row stride 300, storage offset 10
        x, shape = torch.randn(4, 300)[:, 10:270], (260,)
        assert not x.is_contiguous()
    w, b = make_params(shape, torch.float32, seed=4)
    r = torch.randn(x.shape)
    if case == "strided_x":
        r = torch.randn(x.shape[::-1]).t()  # a transposed residual too
        assert not r.is_contiguous()
    return x, shape, w, b, r


# (the kernels on a row spanning two 4W groups; the other cases exhaustive)
@exhaustive_unless(lambda backend, case, p: backend == "reference"
                   or (case, p) == ("row_1100", 0.1))
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("case", ["row_1100", "multi_dim_shape", "strided_x"])
def test_dropout_mask_values_and_backward(backend, case, p):
    """Forward: zeros exactly where keep_mask(seed) is False, the eager chain * 1/(1-p) where it is
    True. Backward: matches the eager chain with that same mask (x, residual, weight, bias, with a
    gradient into the returned sum)."""
    x, shape, w, b, r = _dropout_inputs(case)
    out, _, keep, _ = check(x, shape, w, b, residual=r, p=p, seed_k=7,
                            ds=torch.randn(x.shape))
    assert 0 < keep.sum() < keep.numel()
    assert (out[keep] != 0).all(), "kept positions must carry the (nonzero) normalised value"


# (the kernels in bfloat16 with gelu; the others exhaustive)
@exhaustive_unless(lambda backend, activation, dtype: backend == "reference"
                   or (activation, dtype) == ("gelu", torch.bfloat16))
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_dropout_with_activation_half(backend, activation, dtype):
    torch.manual_seed(5)
    x = torch.randn(4, 300).to(dtype)
    r = torch.randn(4, 300).to(dtype)
    w, b = make_params(300, torch.float32, seed=5)  # float32 params with 16-bit x
    check(x, 300, w, b, residual=r, p=0.25, activation=activation, seed_k=11)


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_backward_mask_is_forwards(backend, activation):
    """One row (x of shape (1, *normalized_shape)): dbias = dout * keep / (1 - p) (through the
    activation), so it is exactly zero at dropped positions and nonzero at kept ones. Two calls
    made before either backward: each backward uses its own forward's mask."""
    p = 0.3
    torch.manual_seed(6)
    shape = (4, 275)  # one row of 1100
    x = torch.randn(1, *shape)
    w, b = make_params(shape, torch.float32, seed=6)
    runs = []
    for seed_k in (21, 22):
        wl, bl = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
        torch.manual_seed(seed_k)
        out = fused_layernorm(x, shape, wl, bl, dropout_p=p, activation=activation)
        runs.append((seed_k, out, wl, bl))
    keeps = [predicted_keep(k, x, 1100, p) for k in (21, 22)]
    assert not torch.equal(keeps[0], keeps[1])
    for (_, out, wl, bl), keep in zip(reversed(runs), reversed(keeps), strict=True):
        dout = torch.randn(x.shape)
        out.backward(dout)
        keep = keep[0]  # (4, 275), like the parameters
        assert (wl.grad[~keep] == 0).all() and (bl.grad[~keep] == 0).all()
        assert (bl.grad[keep] != 0).all()
        _, w64, b64, y64 = ref_chain(x, shape, w, b, 1e-5, keep, p, activation)
        dw64, db64 = torch.autograd.grad(y64, (w64, b64), dout.double())
        assert_close_to_ref(wl.grad, dw64, torch.float32, scale=GRAD_SCALE)
        assert_close_to_ref(bl.grad, db64, torch.float32, scale=GRAD_SCALE)
        if activation is None:
            assert_close_to_ref(bl.grad, dout[0].double() * keep / (1 - p), torch.float32)


# (the kernels: exhaustive; test_layernorm_epilogue_triton.py's
# test_philox_matches_reference_bits checks their Philox bits against the reference's)
@exhaustive_unless(lambda backend, p: backend == "reference")
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keep_fraction(backend, p):
    """Over 64K elements the kept fraction is 1 - p within 5 sigma, for the whole tensor and for
    each of the four Philox output words (column groups of W = 256)."""
    torch.manual_seed(8)
    x = torch.randn(32, 2048)
    with torch.no_grad():
        out = fused_layernorm(x, 2048, dropout_p=p)
    kept = out != 0
    sigma = math.sqrt(p * (1 - p) / kept.numel())
    assert abs(kept.double().mean().item() - (1 - p)) < 5 * sigma
    # Column c takes Philox word q = (c // 256) % 4: (row, group, q, lane) -> (q, elements).
    words = kept.view(32, 2, 4, 256).permute(2, 0, 1, 3).reshape(4, -1)
    sigma_q = math.sqrt(p * (1 - p) / words.shape[1])
    for q in range(4):
        assert abs(words[q].double().mean().item() - (1 - p)) < 5 * sigma_q, q
    # Kept values are the LayerNorm scaled by 1 / (1 - p).
    y64 = F.layer_norm(x.double(), (2048,)) / (1 - p)
    assert_close_to_ref(out[kept], y64[kept], torch.float32)


def test_dropout_reproducible_and_fresh(backend):
    """torch.manual_seed reproduces the mask; another seed, or the next call, gives another."""
    x = torch.randn(8, 128)
    r = torch.randn(8, 128)

    def run(seed_k=None):
        if seed_k is not None:
            torch.manual_seed(seed_k)
        return fused_layernorm(x, 128, residual=r, dropout_p=0.5)[0]

    a = run(30)
    b = run(30)
    c = run(31)
    d = run()  # the next call after c: a fresh seed
    assert torch.equal(a, b)
    assert not torch.equal(a != 0, c != 0)
    assert not torch.equal(c != 0, d != 0)
    assert torch.equal(a != 0, predicted_keep(30, x, 128, 0.5))


def test_training_false_disables_dropout(backend):
    """training=False: no dropout (the eager chain without it), no random number drawn, and
    the same result as dropout_p=0."""
    torch.manual_seed(9)
    x = torch.randn(4, 64, requires_grad=True)
    r = torch.randn(4, 64)
    w, b = make_params(64, torch.float32, seed=9)
    torch.manual_seed(40)
    out, s = fused_layernorm(x, 64, w, b, residual=r, dropout_p=0.5, activation="gelu",
                             training=False)
    after = torch.rand(1)
    torch.manual_seed(40)
    assert torch.equal(after, torch.rand(1)), "training=False must not draw a seed"
    ref, ref_s = fused_layernorm(x, 64, w, b, residual=r, activation="gelu")
    assert torch.equal(out, ref) and torch.equal(s, ref_s)
    _, _, _, y64 = ref_chain(x + r, (64,), w, b, 1e-5, None, 0.0, "gelu")
    assert_close_to_ref(out, y64, torch.float32)
    # Without residual/activation it is the plain LayerNorm.
    plain = fused_layernorm(x, 64, w, b, dropout_p=0.5, training=False)
    assert type(plain.grad_fn).__name__ == "LayerNormFunctionBackward"
    assert_close_to_ref(plain, F.layer_norm(x.double(), (64,), w.double(), b.double()),
                        torch.float32)


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_dropout_p1_gives_zeros(backend, with_residual):
    x = torch.randn(3, 16, requires_grad=True)
    r = torch.randn(3, 16, requires_grad=True) if with_residual else None
    w = torch.randn(16, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    result = fused_layernorm(x, 16, w, b, residual=r, dropout_p=1.0, activation="gelu")
    out = result[0] if with_residual else result
    assert torch.equal(out, torch.zeros(3, 16))
    ds = torch.randn(3, 16)
    if with_residual:
        assert torch.equal(result[1], x + r)
        torch.autograd.backward(list(result), [torch.randn(3, 16), ds])
        assert torch.equal(x.grad, ds) and torch.equal(r.grad, ds)
    else:
        out.backward(torch.randn(3, 16))
        assert torch.equal(x.grad, torch.zeros(3, 16))
    assert torch.equal(w.grad, torch.zeros(16)) and torch.equal(b.grad, torch.zeros(16))


# (the kernels: exhaustive; the generator's restore before the recomputation is the same for
# both backends)
@exhaustive_unless(lambda backend: backend == "reference")
def test_checkpoint_recomputes_the_same_mask(backend):
    """torch.utils.checkpoint restores the generator before recomputing: the recomputed forward
    draws the same seed, so gradients equal those without checkpointing."""
    torch.manual_seed(10)
    x = torch.randn(4, 64)
    w, b = make_params(64, torch.float32, seed=10)
    dout = torch.randn(4, 64)

    def f(x, w, b):
        return fused_layernorm(x, 64, w, b, dropout_p=0.4, activation="relu") * 3

    grads = []
    for use_checkpoint in (False, True):
        xl, wl, bl = (t.clone().requires_grad_(True) for t in (x, w, b))
        torch.manual_seed(50)
        if use_checkpoint:
            out = torch.utils.checkpoint.checkpoint(f, xl, wl, bl, use_reentrant=False)
        else:
            out = f(xl, wl, bl)
        out.backward(dout)
        grads.append((out.detach(), xl.grad, wl.grad, bl.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    for g, g_ref in zip(grads[1][1:], grads[0][1:], strict=True):
        torch.testing.assert_close(g, g_ref, **tol(torch.float32))


# --------------------------------------------------------------------------- shapes and params


@exhaustive_unless(lambda backend, x_shape, shape: backend == "reference" or len(shape) == 3)
@pytest.mark.parametrize("x_shape,shape", [
    ((2, 3, 5, 8), (5, 8)), ((4, 2, 3, 4), (2, 3, 4)), ((1, 6, 8), (6, 8)), ((7,), (7,))],
    ids=str)
def test_multi_dim_normalized_shape(backend, x_shape, shape):
    torch.manual_seed(11)
    x = torch.randn(x_shape) * 3
    r = torch.randn(x_shape)
    w, b = make_params(shape, torch.float32, seed=11)
    check(x, shape, w, b, residual=r, activation="gelu", ds=torch.randn(x_shape))
    check(x, shape, w, b, residual=r, p=0.2, seed_k=12)


@pytest.mark.parametrize("epilogue", [False, True], ids=["plain", "epilogue"])
def test_x_is_normalized_shape_2d(epilogue):
    """x of exactly normalized_shape, 2-D: one row of 6 * 8 elements."""
    torch.manual_seed(21)
    x = torch.randn(6, 8)
    if epilogue:
        w, b = make_params((6, 8), torch.float32, seed=21)
        check(x, (6, 8), w, b, residual=torch.randn(6, 8), activation="gelu")
        check(x, (6, 8), p=0.5, seed_k=3, need="x")
    else:
        assert_close_to_ref(fused_layernorm(x, (6, 8)), F.layer_norm(x.double(), (6, 8)),
                            torch.float32)


# (the kernels on the diagonal's "none" case; the others exhaustive)
@exhaustive_unless(one_of_each({"dtype": [torch.float16, torch.bfloat16],
                                "params": ["none", "weight", "bias", "same", "float32"]},
                               {"backend": "reference"},
                               where=lambda backend, dtype, params:
                                   backend == "reference" or params == "none"))
@pytest.mark.parametrize("params", ["none", "weight", "bias", "same", "float32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_params_variants(backend, dtype, params):
    """weight/bias None, one of them, in x's dtype, or float32 with 16-bit x (mixed precision):
    the output follows x, the parameter gradients their parameter."""
    torch.manual_seed(12)
    x = torch.randn(5, 72).to(dtype)
    r = torch.randn(5, 72).to(dtype)
    pdtype = torch.float32 if params == "float32" else dtype
    w, b = make_params(72, pdtype, weight=params != "bias", bias=params != "weight", seed=12)
    if params == "none":
        w = b = None
    check(x, 72, w, b, residual=r, activation="relu", ds=torch.randn(5, 72).to(dtype))


@exhaustive_unless(lambda backend, need: backend == "reference" or len(need) == 1)
@pytest.mark.parametrize("need", ["x", "r", "w", "b", "xr", "rwb"])
def test_requires_grad_subsets(backend, need):
    torch.manual_seed(13)
    x = torch.randn(4, 40)
    r = torch.randn(4, 40)
    w, b = make_params(40, torch.float32, seed=13)
    check(x, 40, w, b, residual=r, p=0.3, activation="gelu", need=need, seed_k=14,
          ds=torch.randn(4, 40))


def test_only_the_sum_is_used(backend):
    """The output unused downstream (only the returned sum): x's gradient is exactly ds."""
    x = torch.randn(3, 32, requires_grad=True)
    r = torch.randn(3, 32, requires_grad=True)
    _, s = fused_layernorm(x, 32, residual=r, dropout_p=0.2, activation="gelu")
    ds = torch.randn(3, 32)
    s.backward(ds)
    torch.testing.assert_close(x.grad, ds, **tol(torch.float32))
    torch.testing.assert_close(r.grad, ds, **tol(torch.float32))


def test_inference_paths_match(backend):
    """With grad (saved statistics) and without (no autograd Function): the same values and the
    same mask for the same seed."""
    torch.manual_seed(14)
    x = torch.randn(4, 96)
    r = torch.randn(4, 96)
    w, b = make_params(96, torch.float32, seed=14)
    kwargs = {"residual": r, "dropout_p": 0.3, "activation": "gelu"}
    torch.manual_seed(60)
    out_g, s_g = fused_layernorm(x.clone().requires_grad_(True), 96, w, b, **kwargs)
    assert out_g.grad_fn is not None
    torch.manual_seed(60)
    with torch.no_grad():
        out_n, s_n = fused_layernorm(x, 96, w, b, **kwargs)
    torch.manual_seed(60)
    with torch.inference_mode():
        out_i, s_i = fused_layernorm(x, 96, w, b, **kwargs)
    torch.testing.assert_close(out_g.detach(), out_n, atol=0, rtol=0)
    torch.testing.assert_close(out_i, out_n, atol=0, rtol=0)
    assert torch.equal(s_g.detach(), s_n) and torch.equal(s_i, s_n)


# --------------------------------------------------------------------------- gradcheck


def _gradcheck_case(activation, residual, p):
    torch.manual_seed(15)
    x = torch.randn(2, 2, 3, dtype=torch.float64, requires_grad=True)
    r = torch.randn(2, 2, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)

    def fn(x, r, w, b):
        torch.manual_seed(0)  # the same dropout mask on every evaluation
        return fused_layernorm(x, (2, 3), w, b, residual=r if residual else None, dropout_p=p,
                               activation=activation)

    return fn, (x, r, w, b) if residual else (x, x.detach(), w, b)


# (two of the combinations by default; the others exhaustive)
@exhaustive_unless(lambda activation, residual, p: (activation, residual) in (
    ("gelu", True), ("relu", False)))
@pytest.mark.parametrize("activation,residual,p", [
    (None, True, 0.0), ("gelu", True, 0.3), ("relu", False, 0.5), ("gelu", False, 0.0)],
    ids=str)
def test_gradcheck_float64(activation, residual, p):
    fn, inputs = _gradcheck_case(activation, residual, p)
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("activation,residual,p", [("gelu", True, 0.3), (None, False, 0.5)],
                         ids=str)
def test_gradgradcheck_float64(activation, residual, p):
    fn, inputs = _gradcheck_case(activation, residual, p)
    # fast_mode: random projections of the second-order Jacobian (a wrong one fails too).
    assert torch.autograd.gradgradcheck(fn, inputs, fast_mode=True)


# --------------------------------------------------------------------------- errors


@pytest.fixture
def no_dispatch(monkeypatch):
    """Any backend dispatch fails the test: errors must come before any kernel runs."""

    def fail(x):
        raise AssertionError("a backend was dispatched before the argument error")

    monkeypatch.setattr(_dispatch, "backend_for", fail)


ERROR_CASES = {
    "residual_shape": ({"residual": "short"}, ValueError, "residual"),
    "residual_broadcastable": ({"residual": "row"}, ValueError, "residual"),
    "residual_dtype": ({"residual": "half"}, TypeError, "residual"),
    "residual_device": ({"residual": "meta"}, ValueError, "residual"),
    "residual_list": ({"residual": "list"}, TypeError, "residual"),
    "dropout_negative": ({"dropout_p": -0.1}, ValueError, "dropout_p"),
    "dropout_above_one": ({"dropout_p": 1.5}, ValueError, "dropout_p"),
    "dropout_nan": ({"dropout_p": NAN}, ValueError, "dropout_p"),
    "dropout_true": ({"dropout_p": True}, ValueError, "dropout_p"),
    "dropout_str": ({"dropout_p": "0.1"}, ValueError, "dropout_p"),
    "dropout_none": ({"dropout_p": None}, ValueError, "dropout_p"),
    "activation_unknown": ({"activation": "tanh"}, ValueError, "activation"),
    "activation_case": ({"activation": "ReLU"}, ValueError, "activation"),
    "activation_callable": ({"activation": "fn"}, ValueError, "activation"),
    "training_int": ({"training": 1, "dropout_p": 0.1}, TypeError, "training"),
    "training_none": ({"training": None, "dropout_p": 0.1}, TypeError, "training"),
    "training_str_residual": ({"training": "no", "residual": "ok"}, TypeError, "training"),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_argument_errors(no_dispatch, case):
    kwargs, exc, name = ERROR_CASES[case]
    x = torch.randn(4, 8, requires_grad=True)
    special = {
        "short": lambda: torch.randn(3, 8),
        "row": lambda: torch.randn(8),
        "half": lambda: torch.randn(4, 8, dtype=torch.float16),
        "meta": lambda: torch.randn(4, 8, device="meta"),
        "list": lambda: [[0.0] * 8] * 4,
        "ok": lambda: torch.randn(4, 8),
        "fn": lambda: torch.relu,
    }
    kwargs = {k: special[v]() if isinstance(v, str) and v in special else v
              for k, v in kwargs.items()}
    with pytest.raises(exc, match=rf"^{name}\b"):
        fused_layernorm(x, 8, **kwargs)


def test_dropout_p_false_is_rejected():
    with pytest.raises(ValueError, match=r"^dropout_p\b"):
        fused_layernorm(torch.randn(4, 8), 8, dropout_p=False)


def test_training_non_bool_is_rejected_alone():
    with pytest.raises(TypeError, match=r"^training\b"):
        fused_layernorm(torch.randn(4, 8), 8, training="no")


# --------------------------------------------------------------------------- empty tensors


@pytest.mark.parametrize("x_shape,shape", [((0, 8), (8,)), ((2, 0, 8), (8,)),
                                           ((3, 0), (0,)), ((0, 2, 4), (2, 4))], ids=str)
@pytest.mark.parametrize("p", [0.0, 0.5])
def test_empty(backend, x_shape, shape, p):
    x = torch.randn(x_shape, requires_grad=True)
    r = torch.randn(x_shape, requires_grad=True)
    w = torch.randn(shape, requires_grad=True)
    b = torch.randn(shape, requires_grad=True)
    out, s = fused_layernorm(x, shape, w, b, residual=r, dropout_p=p, activation="gelu")
    assert out.shape == s.shape == x.shape and out.dtype == s.dtype == x.dtype
    (out.sum() + s.sum()).backward()
    assert x.grad.shape == r.grad.shape == x.shape
    assert w.grad is not None and (w.grad == 0).all() and (b.grad == 0).all()
    out = fused_layernorm(x.detach(), shape, dropout_p=p, activation="relu")
    assert out.shape == x.shape


# --------------------------------------------------------------------------- autocast


def test_autocast_float32_output(backend, monkeypatch):
    """CUDA autocast semantics, simulated on CPU: where autocast would run layer_norm in float32
    (fusedops.ops._rows.autocast_fp32), 16-bit x gives a float32 output with float32 accuracy,
    while the returned sum stays x + residual in x's dtype; gradients keep x's dtype."""
    monkeypatch.setattr(layernorm_module, "autocast_fp32", lambda x: True)
    torch.manual_seed(16)
    x = torch.randn(4, 64).to(torch.bfloat16).requires_grad_(True)
    r = torch.randn(4, 64).to(torch.bfloat16)
    w, b = make_params(64, torch.float32, seed=16)
    out, s = fused_layernorm(x, 64, w, b, residual=r, activation="gelu")
    assert out.dtype == torch.float32 and s.dtype == torch.bfloat16
    assert torch.equal(s, x.detach() + r)
    s64, _, _, y64 = ref_chain(s, (64,), w, b, 1e-5, None, 0.0, "gelu")
    assert_close_to_ref(out, y64, torch.float32)
    dout = torch.randn(4, 64)
    out.backward(dout)
    (dx64,) = torch.autograd.grad(y64, s64, dout.double())
    assert x.grad.dtype == torch.bfloat16
    assert_close_to_ref(x.grad, dx64, torch.bfloat16, scale=GRAD_SCALE)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_cuda_autocast(dtype):
    """Real CUDA autocast: layer_norm is on its float32 list, so out is float32; the sum stays in
    the 16-bit dtype."""
    torch.manual_seed(17)
    x = torch.randn(8, 64, device="cuda")
    proj = torch.randn(64, 64, device="cuda")
    w, b = make_params(64, torch.float32, seed=17)
    w, b = w.cuda(), b.cuda()
    with torch.autocast("cuda", dtype=dtype):
        h = (x @ proj).detach().requires_grad_(True)
        r = torch.randn(8, 64, device="cuda").to(dtype)
        out, s = fused_layernorm(h, 64, w, b, residual=r, activation="gelu")
        assert F.layer_norm(h, (64,)).dtype == torch.float32  # torch's own policy
    assert h.dtype == s.dtype == dtype and out.dtype == torch.float32
    assert torch.equal(s, h.detach() + r)
    s64, _, _, y64 = ref_chain(s, (64,), w, b, 1e-5, None, 0.0, "gelu")
    assert_close_to_ref(out, y64, torch.float32)


# --------------------------------------------------------------------------- long rows (Triton)


def test_looped_kernels(triton_backend, small_single_block):
    """Rows longer than the (shrunk) single-block limit take the looped kernels, if the epilogue
    kernels have them: residual, dropout and activation over several chunks."""
    torch.manual_seed(18)
    x = torch.randn(3, 100)
    r = torch.randn(3, 100)
    w, b = make_params(100, torch.float32, seed=18)
    check(x, 100, w, b, residual=r, p=0.3, activation="gelu", seed_k=19,
          ds=torch.randn(3, 100))


# --------------------------------------------------------------------------- torch.compile


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compile_fullgraph(fresh_dynamo):
    """torch.compile(fullgraph=True) (aot_eager, as tests/test_compile.py) of functions calling
    fused_layernorm with residual + activation (dropout_p=0), no graph break: the same values
    and gradients as eager."""
    torch.manual_seed(20)
    x = torch.randn(4, 16)
    r = torch.randn(4, 16)
    w, b = make_params(16, torch.float32, seed=20)

    def fn(x, r, w, b):
        out, s = fused_layernorm(x, 16, w, b, residual=r, activation="gelu", dropout_p=0.0)
        return out * 2, s

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    dout, ds = torch.randn(4, 16), torch.randn(4, 16)
    results = []
    for f in (compiled, fn):
        leaves = [t.clone().requires_grad_(True) for t in (x, r, w, b)]
        out, s = f(*leaves)
        torch.autograd.backward([out, s], [dout, ds])
        results.append([out.detach(), s.detach()] + [t.grad for t in leaves])
    for got, want in zip(*results, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, **tol(torch.float32, scale=GRAD_SCALE))
    s64 = x.double() + r.double()
    y64 = 2 * F.gelu(F.layer_norm(s64, (16,), w.double(), b.double()))
    assert_close_to_ref(results[0][0], y64, torch.float32)
