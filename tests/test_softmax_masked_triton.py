"""The Triton kernels of the scaled / masked / causal softmax of attention
(fusedops.backends.triton.softmax_masked_forward / _backward) against a float64 oracle written with
torch ops here: z = x·scale, a bool mask fills -inf where False, a float mask is added, causal drops
column j of query row q when j > q, softmax over the last dim, rows with nothing kept give zeros; dx
from autograd through that oracle.

On CPU they run through the Triton interpreter (conftest sets TRITON_INTERPRET=1 without CUDA),
so shapes stay small; the ``gpu`` tests at the end take large shapes on a CUDA device.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    assert_close_to_ref,
    exhaustive_unless,
    one_of_each,
    tol,
    triton_backend_module,
)

tb = triton_backend_module()

from fusedops.backends.triton import configs  # noqa: E402
from fusedops.backends.triton import softmax_masked as tsm  # noqa: E402
from fusedops.backends.triton.configs import common as tcfg  # noqa: E402
from fusedops.backends.triton.configs import softmax_masked as smm_rules  # noqa: E402
from fusedops.backends.triton.runtime.facts import device_facts  # noqa: E402

# Tensors are created on the GPU when there is one (conftest's _tensors_on_device).
ON_DEVICE = True

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KINDS = ["none", "bool", "float"]
GRAD_SCALE = 4.0  # dx is computed from the rounded y and a sum over the row
INF, NAN = float("inf"), float("nan")
# Mask patterns: the dims the mask has (1 = broadcast), or a strided view.
PATTERNS = ["b11n", "11qn", "bhqn", "b1qn", "strided"]


def _dev() -> torch.device:
    return torch.empty(0).device


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)  # CPU generator: same values on every device


def make_x(shape, dtype, seed=0, spread=2.0):
    return (spread * torch.randn(*shape, generator=_gen(seed), device="cpu")).to(dtype).to(_dev())


def make_mask(kind: str, shape, pattern: str = "bhqn", dtype=torch.float32, seed=1):
    """A (B, H, Q, N) mask view of ``kind`` ("none", "bool", "float") broadcast per ``pattern``.

    "strided": a full mask read through a non-contiguous view (every other column of a wider
    tensor, and H and Q swapped in memory), so every stride is unusual. Bool masks keep about
    70% of the elements; float masks are random offsets with some -inf."""
    if kind == "none":
        return None
    B, H, Q, N = shape
    g = _gen(seed)
    dims = {"b11n": (B, 1, 1, N), "11qn": (1, 1, Q, N), "bhqn": (B, H, Q, N),
            "b1qn": (B, 1, Q, N), "strided": (B, Q, H, 2 * N)}[pattern]
    if kind == "bool":
        base = torch.rand(*dims, generator=g, device="cpu") > 0.3
    else:
        base = torch.randn(*dims, generator=g, device="cpu")
        base = base.masked_fill(torch.rand(*dims, generator=g, device="cpu") < 0.1, -INF).to(dtype)
    base = base.to(_dev())
    if pattern == "strided":
        view = base.transpose(1, 2)[..., ::2]
        assert view.stride(-1) == 2 and not view.is_contiguous()
        return view
    return base.expand(B, H, Q, N)


def oracle(x, mask, scale, causal, dy=None):
    """float64 (y, dx): the masked softmax in torch ops; dx = autograd with upstream ``dy``."""
    x64 = x.detach().double().requires_grad_(dy is not None)
    z = x64 * scale
    if mask is not None:
        z = z.masked_fill(~mask, -INF) if mask.dtype == torch.bool else z + mask.double()
    if causal:
        q, n = z.shape[-2:]
        z = z.masked_fill(torch.ones(q, n, dtype=torch.bool, device=z.device).triu(1), -INF)
    empty = z.amax(dim=-1, keepdim=True) == -INF
    # Empty rows: softmax of zeros, then masked to 0 (keeps NaN out of their gradient).
    y = torch.softmax(z.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    if dy is None:
        return y.detach(), None
    (dx,) = torch.autograd.grad(y, x64, dy.double())
    return y.detach(), dx


def check_forward(x, mask, scale=1.0, causal=False, out_dtype=None):
    out_dtype = out_dtype or x.dtype
    y = tb.softmax_masked_forward(x, mask, scale, causal, out_dtype)
    assert y.shape == x.shape and y.dtype == out_dtype and y.is_contiguous()
    y64, _ = oracle(x, mask, scale, causal)
    assert_close_to_ref(y, y64, x.dtype)
    return y, y64


def check_backward(y, dy, scale, x=None, mask=None, causal=False, out_dtype=None):
    """The backward on (M, N) views of ``y`` / ``dy``: against the formula on the given (rounded)
    y in float64 and, with ``x``, against autograd through the oracle."""
    out_dtype = out_dtype or y.dtype
    n = y.shape[-1]
    y2 = y.reshape(-1, n)
    dy2 = dy if dy.dim() == 2 else dy.reshape(-1, n)  # 2-D dy as given (its row stride)
    dx = tb.softmax_masked_backward(y2, dy2, scale, out_dtype)
    assert dx.shape == y2.shape and dx.dtype == out_dtype and dx.is_contiguous()
    yd, dyd = y2.double(), dy2.double()
    direct = scale * yd * (dyd - (yd * dyd).sum(-1, keepdim=True))
    assert_close_to_ref(dx, direct, y.dtype)
    if x is not None:
        _, dx64 = oracle(x, mask, scale, causal, dy.reshape(x.shape))
        assert_close_to_ref(dx, dx64.reshape(-1, n), y.dtype, GRAD_SCALE)
    return dx


def _spy(monkeypatch):
    """Record which forward/backward launcher runs (calls go through)."""
    seen = []
    for name in ("_launch_fwd_single", "_launch_fwd_looped", "_launch_bwd_single",
                 "_launch_bwd_looped"):
        real = getattr(tsm, name)

        def spy(grid, args, warps, _real=real, _name=name):
            seen.append(_name[len("_launch_"):])
            return _real(grid, args, warps)

        monkeypatch.setattr(tsm, name, spy)
    return seen


# --------------------------------------------------------------------------- forward


# Every mask pattern for float32 and bfloat16; float16 (the same code as bfloat16) with full
# masks only, to keep the interpreter run short (its other patterns: test_row_lengths).
CASES = [pytest.param(dtype, kind, pattern, id=f"{str(dtype)[6:]}-{kind}-{pattern}")
         for dtype in DTYPES
         for kind, pattern in [("none", None)] + [
             (k, p) for k in ("bool", "float")
             for p in (PATTERNS if dtype != torch.float16 else ["bhqn"])]]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, kind, pattern", CASES)
def test_masks_and_dtypes(dtype, kind, pattern, causal):
    shape = (2, 2, 4, 37)
    x = make_x(shape, dtype, seed=7)
    mask = make_mask(kind, shape, pattern, dtype=dtype)
    y, _ = check_forward(x, mask, scale=0.6, causal=causal)
    if kind == "bool":
        assert not y[~mask].any()  # dropped positions are exact zeros
    if causal:
        assert not y[..., torch.ones(4, 37, dtype=torch.bool).triu(1)].any()


# (the diagonal: every row length and every mask kind once)
@exhaustive_unless(one_of_each({"n": [1, 31, 32, 33, 1000, 1024, 1025], "kind": KINDS}))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 31, 32, 33, 1000, 1024, 1025])
def test_row_lengths(n, kind):
    """Tiny rows, warp-size and power-of-two edges; causal with Q > N and Q < N."""
    shape = (1, 2, 3, n)
    x = make_x(shape, torch.float16, seed=n)
    mask = make_mask(kind, shape, "b1qn", dtype=torch.float16, seed=n + 1)
    check_forward(x, mask, scale=0.5)
    check_forward(x, mask, scale=0.5, causal=True)


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.float16, torch.bfloat16,
                                        torch.float64], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_float_mask_dtypes(dtype, mask_dtype):
    """A float mask in a dtype other than x's (added in float32)."""
    shape = (2, 2, 4, 50)
    x = make_x(shape, dtype, seed=3)
    check_forward(x, make_mask("float", shape, "11qn", dtype=mask_dtype), scale=0.3)


@pytest.mark.parametrize("q, n", [(1, 9), (3, 40), (40, 3), (7, 7), (17, 16)])
@pytest.mark.parametrize("kind", KINDS)
def test_causal_shapes(q, n, kind):
    """Top-left aligned triangle for Q != N: rows past the last column keep the whole row."""
    shape = (2, 2, q, n)
    x = make_x(shape, torch.float32, seed=q * 100 + n)
    y, _ = check_forward(x, make_mask(kind, shape, "bhqn", seed=q), causal=True)
    if kind == "none":
        first = y[..., 0, :]
        assert torch.all(first[..., 0] == 1) and not first[..., 1:].any()


@pytest.mark.parametrize("scale", [1.0, 0.125, 3.0, -0.7, 0.0])
@pytest.mark.parametrize("kind", KINDS)
def test_scales(scale, kind):
    """Any finite scale, negative and zero included (dropped columns stay dropped: they must
    not depend on the sign of x · scale)."""
    shape = (2, 2, 5, 24)
    x = make_x(shape, torch.float32, seed=5)
    check_forward(x, make_mask(kind, shape, "b11n"), scale=scale, causal=True)
    check_forward(x, make_mask(kind, shape, "b11n"), scale=scale)


def test_out_dtype():
    """out_dtype other than x's: float32 probabilities of a bf16 input, and the reverse."""
    shape = (2, 2, 3, 70)
    x = make_x(shape, torch.bfloat16, seed=11)
    mask = make_mask("float", shape, "bhqn", dtype=torch.bfloat16)
    check_forward(x, mask, scale=0.4, causal=True, out_dtype=torch.float32)
    x32 = make_x(shape, torch.float32, seed=12)
    y = tb.softmax_masked_forward(x32, None, 1.0, False, torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert_close_to_ref(y, oracle(x32, None, 1.0, False)[0], torch.bfloat16)


def test_mask_broadcast_along_columns():
    """A mask with column stride 0 (one value per row, expanded over N): whole rows kept or
    dropped."""
    shape = (2, 3, 4, 20)
    x = make_x(shape, torch.float32, seed=2)
    keep = (torch.arange(2 * 3 * 4, device=_dev()) % 3 != 0).reshape(2, 3, 4, 1)
    mask = keep.expand(shape)
    assert mask.stride(-1) == 0
    y, _ = check_forward(x, mask, scale=0.5)
    assert not y[~keep.expand(shape)].any()
    add = torch.randn(2, 3, 4, 1, generator=_gen(4), device="cpu").to(_dev()).expand(shape)
    check_forward(x, add, scale=0.5, causal=True)


def test_fully_masked_rows_are_zero():
    """Rows where the bool mask drops everything, or keeps only columns causal drops, are
    zeros (not NaN); the other rows are unaffected."""
    shape = (2, 2, 4, 12)
    x = make_x(shape, torch.float16, seed=21)
    mask = make_mask("bool", shape, "bhqn", seed=22).clone()
    mask[0, 1, 2] = False                # nothing kept
    mask[1, 0, 1] = False
    mask[1, 0, 1, 5:] = True             # causal keeps columns 0..1 only: nothing left
    for causal in (False, True):
        y, _ = check_forward(x, mask, scale=1.3, causal=causal)
        assert not torch.isnan(y).any()
        assert not y[0, 1, 2].any()
    assert not tb.softmax_masked_forward(x, mask, 1.3, True, x.dtype)[1, 0, 1].any()


def test_additive_minus_inf_rows_are_zero():
    """A row of -inf offsets (a float padding mask) comes out as zeros, not NaN; so does a row
    of x that is -inf throughout with no mask."""
    shape = (1, 2, 3, 40)
    x = make_x(shape, torch.bfloat16, seed=31)
    mask = torch.zeros(shape, device=_dev())
    mask[0, 1, 1] = -INF
    mask[0, 0, 2, ::3] = -INF
    for causal in (False, True):
        y, _ = check_forward(x, mask, causal=causal)
        assert not torch.isnan(y).any() and not y[0, 1, 1].any()
    x2 = x.clone()
    x2[0, 0, 1] = -INF
    y, _ = check_forward(x2, None, scale=0.5)
    assert not torch.isnan(y).any() and not y[0, 0, 1].any()


@exhaustive_unless(lambda dtype, looped: not looped or dtype == torch.float32)
@pytest.mark.parametrize("looped", [False, True], ids=["single", "looped"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_finfo_min_mask(request, dtype, looped):
    """Hugging Face style additive masks (0 keeps, finfo(dtype).min drops): finite, so a row
    dropped throughout is not empty (no zeros); float32/bf16's min absorbs the scores, so it is
    uniform there, as in torch (it must not overflow to -inf inside the kernel)."""
    if looped:
        request.getfixturevalue("small_single_block")
    shape = (2, 1, 2, 40)
    x = make_x(shape, dtype, seed=35)
    keep = make_mask("bool", shape, "b1qn", seed=36).clone()
    keep[1, 0, 1] = False
    mask = torch.zeros(shape, dtype=dtype, device=_dev()).masked_fill(~keep, torch.finfo(dtype).min)
    for causal in (False, True):
        y, _ = check_forward(x, mask, scale=0.5, causal=causal)
        dropped = y[1, 0, 1] if not causal else y[1, 0, 1, :2]
        assert dropped.sum().item() == pytest.approx(1.0, abs=1e-2)
        if dtype == torch.float16:
            continue  # -65504 leaves the scores' differences (the oracle check covers it)
        torch.testing.assert_close(dropped.double(), torch.full_like(dropped, 1 / len(dropped),
                                   dtype=torch.float64), **tol(dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_nan_propagates(kind):
    """NaN in x at a kept position: the whole row NaN, as torch; at a position causal (or the
    bool mask) drops it does not matter; other rows are unaffected."""
    shape = (1, 2, 4, 16)
    x = make_x(shape, torch.float32, seed=41)
    mask = None
    if kind == "bool":
        mask = torch.ones(shape, dtype=torch.bool, device=_dev())
        mask[0, 0, 3, 2] = False
    elif kind == "float":
        mask = torch.zeros(shape, device=_dev())
    x[0, 1, 2, 1] = NAN       # kept: row NaN
    x[0, 0, 1, 9] = NAN       # dropped by causal (9 > 1)
    x[0, 0, 3, 2] = NAN       # dropped by the bool mask only
    y = tb.softmax_masked_forward(x, mask, 0.9, True, x.dtype)
    y64, _ = oracle(x, mask, 0.9, True)
    assert torch.isnan(y[0, 1, 2]).all()
    assert not torch.isnan(y[0, 0, 1]).any()
    assert torch.isnan(y[0, 0, 3]).all() == (kind != "bool")
    torch.testing.assert_close(y.double(), y64, equal_nan=True, **tol(torch.float32))


def test_large_scores_are_stable():
    """Scores far beyond exp's range (the max is subtracted first)."""
    shape = (1, 1, 4, 30)
    x = make_x(shape, torch.float32, seed=51) * 1000
    check_forward(x, make_mask("float", shape, "bhqn") * 100, scale=2.0, causal=True)


@pytest.mark.parametrize("shape", [(0, 2, 3, 8), (2, 2, 0, 8), (2, 2, 3, 0), (0, 0, 0, 0)])
@pytest.mark.parametrize("kind", KINDS)
def test_empty(monkeypatch, shape, kind):
    """Empty inputs: an empty result of the right shape and dtype, nothing launched."""
    seen = _spy(monkeypatch)
    x = torch.randn(shape).to(torch.bfloat16)
    mask = make_mask(kind, shape, "bhqn")
    y = tb.softmax_masked_forward(x, mask, 0.5, True, torch.float32)
    assert y.shape == shape and y.dtype == torch.float32
    m, n = (x.numel() // shape[-1] if shape[-1] else 0), shape[-1]
    y2 = torch.empty(m, n, dtype=torch.bfloat16)
    dx = tb.softmax_masked_backward(y2, y2, 0.5, torch.bfloat16)
    assert dx.shape == (m, n) and dx.dtype == torch.bfloat16
    assert seen == []


def test_non_contiguous_x():
    """x that is not contiguous is made so (the contract's x is contiguous)."""
    base = make_x((2, 5, 3, 20), torch.float32, seed=61)
    x = base.transpose(1, 2)
    check_forward(x, make_mask("bool", x.shape, "11qn"), scale=0.8, causal=True)


def test_deterministic():
    shape = (2, 3, 5, 300)
    x = make_x(shape, torch.bfloat16, seed=71)
    mask = make_mask("float", shape, "b1qn", dtype=torch.bfloat16)
    a = tb.softmax_masked_forward(x, mask, 0.7, True, x.dtype)
    assert torch.equal(a, tb.softmax_masked_forward(x, mask, 0.7, True, x.dtype))


# --------------------------------------------------------------------------- kernel variants


def _fwd_cap(elt: int) -> int:
    return min(tcfg.single_block_limit(), smm_rules.FWD_SINGLE_CAP[elt],
               tcfg.KIND_CAPS["softmax_fwd"])


def test_config_rules():
    """Single-block up to the cap (several short rows per program), looped above it; 16 warps
    for masked/causal rows at the cap."""
    cpu = device_facts(-1)
    for elt in (2, 4):
        cap = _fwd_cap(elt)
        cfg = smm_rules.forward_config(cap, elt, False, 1, cpu)
        assert cfg.variant == "single" and cfg.block == cap and cfg.rows == 1
        assert smm_rules.forward_config(cap + 1, elt, False, 1, cpu).variant == "looped"
        assert smm_rules.forward_config(128, elt, False, 1, cpu).rows > 1
        if cap >= 16384:
            assert smm_rules.forward_config(16384, elt, True, 1, cpu).warps == 16
        cfg = smm_rules.backward_config(1000, elt, 1, cpu)
        assert cfg.variant == "single" and cfg.block == 1024


@pytest.mark.parametrize("extra", [0, 1], ids=["cap", "looped"])
@pytest.mark.parametrize("kind", KINDS)
def test_single_block_cap(monkeypatch, kind, extra):
    """The forward's single-block cap and one column past it (the looped kernel); one or two
    rows, as the interpreter is slow."""
    seen = _spy(monkeypatch)
    n = _fwd_cap(2) + extra
    shape = (1, 1, 2, n)
    x = make_x(shape, torch.bfloat16, seed=81)
    mask = make_mask(kind, shape, "b11n", dtype=torch.bfloat16)
    check_forward(x, mask, scale=0.5, causal=kind == "float")
    assert seen == ["fwd_" + ("looped" if extra else "single")]


# (the diagonal's masked cases; the unmasked one, the plain looped softmax, exhaustive)
@exhaustive_unless(one_of_each({"kind": KINDS, "causal": [False, True],
                                "dtype": [torch.float32, torch.bfloat16]},
                               where=lambda dtype, kind, causal: kind != "none"))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_looped_forward(small_single_block, monkeypatch, dtype, kind, causal):
    """A 16-element single-block limit: the looped (online) kernel over rows of several
    16-element chunks, masks broadcast and strided."""
    seen = _spy(monkeypatch)
    for shape, pattern in (((1, 2, 3, 45), "b11n"), ((1, 1, 4, 33), "strided")):
        x = make_x(shape, dtype, seed=shape[-1])
        check_forward(x, make_mask(kind, shape, pattern, dtype=dtype), 0.7, causal)
    assert set(seen) == {"fwd_looped"}


@exhaustive_unless(lambda kind: kind == "bool")  # (the other mask kinds: exhaustive)
@pytest.mark.parametrize("kind", KINDS)
def test_looped_causal_q_beyond_n(small_single_block, kind):
    """Looped kernel, causal with Q > N (the last rows keep every column) and Q < N."""
    for shape in ((1, 1, 20, 18), (1, 2, 2, 40)):
        x = make_x(shape, torch.float32, seed=shape[2])
        check_forward(x, make_mask(kind, shape, "bhqn"), 0.9, causal=True)


@exhaustive_unless(lambda kind: kind == "float")  # (a bool mask: exhaustive)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_looped_special_rows(small_single_block, kind):
    """Looped kernel: a row with nothing kept, a NaN row, x all -inf (zeros; +inf scores
    under a negative scale: NaN, as torch), large scores, negative scale."""
    shape = (1, 2, 4, 40)
    x = make_x(shape, torch.float32, seed=91)
    x[0, 0, 0, 20:] = 1e4
    x[0, 0, 2, 1] = NAN
    x[0, 1, 3, :] = -INF
    mask = make_mask(kind, shape, "bhqn", seed=92).clone()
    mask[0, 1, 0] = False if kind == "bool" else -INF
    mask[0, 0, 2, 1] = True if kind == "bool" else 0.0  # keeps the NaN
    # The large scores unmasked: float32 offsets next to 1e4 would round (torch's too)
    mask[0, 0, 0] = True if kind == "bool" else 0.0
    for causal in (False, True):
        for scale in (1.0, -0.5):
            y = tb.softmax_masked_forward(x, mask, scale, causal, x.dtype)
            y64, _ = oracle(x, mask, scale, causal)
            torch.testing.assert_close(y.double(), y64, equal_nan=True, **tol(torch.float32))
            assert not y[0, 1, 0].any() and torch.isnan(y[0, 0, 2]).all()
            assert torch.isnan(y[0, 1, 3]).any() == (scale < 0)


# --------------------------------------------------------------------------- backward


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward(dtype, kind):
    """dx against autograd through the float64 oracle (masked and empty rows: zero gradient)."""
    shape = (2, 2, 5, 33)
    x = make_x(shape, dtype, seed=101)
    mask = make_mask(kind, shape, "b1qn", dtype=dtype)
    if mask is not None:
        mask = mask.clone()
        mask[1, 0, 2] = False if kind == "bool" else -INF
    y = tb.softmax_masked_forward(x, mask, 0.35, True, dtype)
    dy = make_x(shape, dtype, seed=102, spread=1.0)
    dx = check_backward(y, dy, 0.35, x, mask, causal=True)
    if mask is not None:
        assert not dx.reshape(shape)[1, 0, 2].any()


@pytest.mark.parametrize("n", [1, 31, 32, 33, 1000, 1025])
def test_backward_row_lengths(n):
    shape = (1, 1, 4, n)
    x = make_x(shape, torch.bfloat16, seed=n)
    y = tb.softmax_masked_forward(x, None, 2.0, False, x.dtype)
    check_backward(y, make_x(shape, torch.bfloat16, seed=n + 1), 2.0, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_backward_strided_dy(dtype):
    """dy rows as a column slice of a wider tensor (row stride > N), and an expanded dy (row
    stride 0); out_dtype float32 from a 16-bit y."""
    n = 40
    x = make_x((1, 1, 6, n), dtype, seed=111)
    y = tb.softmax_masked_forward(x, None, 0.5, True, dtype)
    wide = make_x((6, n + 13), dtype, seed=112)
    dy = wide[:, 5:5 + n]
    assert dy.stride(0) == n + 13
    check_backward(y, dy, 0.5, x, None, causal=True)
    dy0 = make_x((1, n), dtype, seed=113).expand(6, n)
    assert dy0.stride(0) == 0
    check_backward(y, dy0, 0.5, x, None, causal=True)
    dx = check_backward(y, dy, -1.5, out_dtype=torch.float32)
    assert dx.dtype == torch.float32


@exhaustive_unless(lambda dtype: dtype == torch.float32)  # (the 16-bit dtypes: exhaustive)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_looped(small_single_block, monkeypatch, dtype):
    """The looped backward (16-element single-block limit), strided dy."""
    seen = _spy(monkeypatch)
    shape = (1, 2, 3, 45)
    x = make_x(shape, dtype, seed=121)
    mask = make_mask("bool", shape, "b11n")
    y = tb.softmax_masked_forward(x, mask, 1.5, False, dtype)
    wide = make_x((6, 60), dtype, seed=122)
    check_backward(y, wide[:, 10:55], 1.5, x, mask)
    assert seen == ["fwd_looped", "bwd_looped"]


def test_backward_cap(monkeypatch):
    """The backward's single-block cap and one past it (the looped kernel)."""
    seen = _spy(monkeypatch)
    cpu = device_facts(-1)
    limit = max(2**k for k in range(4, 17)
                if smm_rules.backward_config(2**k, 4, 1, cpu).variant == "single")
    assert smm_rules.backward_config(limit + 1, 4, 1, cpu).variant == "looped"
    for n in (limit, limit + 1):
        x = make_x((1, 1, 1, n), torch.float32, seed=n)
        y = tb.softmax_masked_forward(x, None, 0.25, False, x.dtype)
        check_backward(y, make_x((1, n), torch.float32, seed=n + 1), 0.25, x)
    assert seen[1] == "bwd_single" and seen[3] == "bwd_looped"


# --------------------------------------------------------------------------- GPU (compiled)

GPU_NS = [128, 512, 1024, 2048, 4096, 8192, 16385]


@pytest.fixture(params=[False, True], ids=["rules", "looped"])
def force_looped(request):
    """Run under the default rules, then with the single-block limit at 64 (every row of the
    GPU sweep through the looped kernels)."""
    with configs.override(SINGLE_BLOCK_LIMIT=64 if request.param else None):
        yield request.param


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind, pattern", [("none", None), ("bool", "b11n"),
                                           ("float", "11qn"), ("bool", "bhqn"),
                                           ("float", "strided")],
                         ids=["none", "bool-b11n", "float-11qn", "bool-bhqn", "float-strided"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", GPU_NS)
def test_gpu_sweep(force_looped, n, dtype, kind, pattern, causal):
    q = max(8, min(256, 2**20 // (n * 8)))
    shape = (2, 4, q, n)
    x = make_x(shape, dtype, seed=n).cuda()
    mask = make_mask(kind, shape, pattern, dtype=dtype, seed=n + 1)
    mask = None if mask is None else mask.cuda()
    y, _ = check_forward(x, mask, scale=0.125, causal=causal)
    dy = make_x(shape, dtype, seed=n + 2, spread=1.0).cuda()
    check_backward(y, dy, 0.125, x, mask, causal=causal)


@pytest.mark.gpu
def test_gpu_query_rows_not_n():
    """Causal with Q != N (decoding-like Q = 1 and prefill-like Q > N) on the compiled kernels."""
    for q, n in ((1, 4096), (2048, 1024), (300, 5000)):
        shape = (1, 2, q, n)
        x = make_x(shape, torch.bfloat16, seed=q).cuda()
        mask = make_mask("bool", shape, "b11n").cuda()
        check_forward(x, mask, scale=0.1, causal=True)


@pytest.mark.gpu
def test_gpu_64bit_offsets():
    """More than 2^31 elements in x and in the mask (its batch offset b·sb past 2^31): the last
    rows checked against the oracle (the whole float64 oracle would not fit)."""
    B, H, Q, N = 3, 1, 2**16 + 8, 2**14
    try:
        x = torch.randn(B, H, Q, N, device="cuda", dtype=torch.bfloat16)
        mask = torch.randn(B, 1, Q, N, device="cuda", dtype=torch.bfloat16).expand(B, H, Q, N)
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory")
    assert x.numel() > 2**31 and mask.stride(0) * (B - 1) >= 2**31
    y = tb.softmax_masked_forward(x, mask, 0.5, True, x.dtype)
    tail = (slice(B - 1, B), slice(None), slice(Q - 4, Q))
    # The oracle on the tail rows; causal needs their query index, so drop columns > q by hand.
    z = x[tail].double() * 0.5 + mask[tail].double()
    q_idx = torch.arange(Q - 4, Q, device="cuda")[:, None]
    z = z.masked_fill(torch.arange(N, device="cuda")[None, :] > q_idx, -INF)
    assert_close_to_ref(y[tail], torch.softmax(z, -1), torch.bfloat16)
    dx = tb.softmax_masked_backward(y.view(-1, N), y.view(-1, N), 0.5, torch.bfloat16)
    yt = y.view(-1, N)[-3:].double()
    assert_close_to_ref(dx[-3:], 0.5 * yt * (yt - (yt * yt).sum(-1, keepdim=True)),
                        torch.bfloat16)
