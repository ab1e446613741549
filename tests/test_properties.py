"""Property-based tests (hypothesis): random shapes, layouts, dims, dtypes and affine options of
both ops, forward and backward, against the float64 oracle with the shared tolerance table.

The Triton kernels run through the interpreter on CPU (or compiled, on a CUDA machine); shapes
stay small (at most 8 rows, rows of at most 300 elements, with extra weight on the kernel
boundaries 1, 15-17, 31-33, 63-65, 127-129, 255-257). Inputs come as views of a larger tensor
(sliced rows with a storage offset, transposes/permutes, expanded (zero-stride) rows, column
steps), gradients likewise. ``derandomize=True`` makes every run (and CI) draw the same examples:
12 per property in the default run, 50 in the extended matrix (``-m exhaustive``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _reliability import coarsest, interpreting, single_block_limit
from conftest import HAS_CUDA, assert_close_to_ref, assert_row_sum_close, triton_kernels_ready
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fusedops
from fusedops import fused_layernorm, fused_softmax

if not triton_kernels_ready() or not (HAS_CUDA or interpreting()):
    pytest.skip("needs the Triton kernels (interpreter on CPU or a CUDA GPU)",
                allow_module_level=True)

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BOUNDARY_N = [1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 300]
LAYOUTS = ["contiguous", "sliced", "permuted", "expanded", "column_step"]

SETTINGS = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
# The default run draws the first QUICK examples; the extended matrix (``exhaustive``) all 50.
QUICK = settings(SETTINGS, max_examples=1)

row_lengths = st.one_of(st.sampled_from(BOUNDARY_N), st.integers(1, 300))


@st.composite
def leading_shapes(draw) -> tuple[int, ...]:
    """0 to 2 leading dims with at most 8 rows in all."""
    dims = draw(st.integers(0, 2))
    shape: list[int] = []
    for _ in range(dims):
        budget = 8 // max(math.prod(shape), 1)
        shape.append(draw(st.integers(1, max(budget, 1))))
    return tuple(shape)


def make_view(shape: tuple[int, ...], dtype: torch.dtype, layout: str, seed: int,
              scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
    """A tensor of ``shape`` laid out as ``layout`` (a view of a larger or permuted buffer)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*s: int) -> torch.Tensor:
        return (torch.randn(*s, generator=g) * scale + offset).to(dtype).to(DEVICE)

    if not shape:
        return randn()
    if layout == "sliced":  # row stride > row length, storage offset 2
        return randn(*shape[:-1], shape[-1] + 5)[..., 2:2 + shape[-1]]
    if layout == "permuted" and len(shape) >= 2:  # reversed dims: no unit stride on the last
        order = list(range(len(shape)))[::-1]
        return randn(*shape[::-1]).permute(*order)
    if layout == "expanded" and len(shape) >= 2:  # first dim has stride 0
        return randn(1, *shape[1:]).expand(*shape)
    if layout == "column_step":
        return randn(*shape[:-1], 2 * shape[-1])[..., ::2]
    return randn(*shape)


def leaf_view(shape: tuple[int, ...], dtype: torch.dtype, layout: str, seed: int,
              scale: float = 1.0, offset: float = 0.0, requires_grad: bool = True
              ) -> torch.Tensor:
    """make_view's tensor as a view of a leaf buffer, so the kernels see the strided view and
    gradients with respect to the view itself can be taken."""
    view = make_view(shape, dtype, layout, seed, scale, offset)
    base = (view._base if view._base is not None else view).detach()
    return _rebuild_view(base.requires_grad_(requires_grad), shape, layout)


def _grad(out: torch.Tensor, inputs: list[torch.Tensor], dy: torch.Tensor) -> tuple:
    return torch.autograd.grad(out, inputs, dy, allow_unused=True)


# --------------------------------------------------------------------------- softmax


SOFTMAX_CASES = dict(
    lead=leading_shapes(),
    n=row_lengths,
    dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(LAYOUTS),
    dy_layout=st.sampled_from(LAYOUTS),
    dim_pos=st.integers(0, 2),
    out_float32=st.booleans(),
    looped=st.booleans(),
    seed=st.integers(0, 2**16),
)


def softmax_property(lead, n, dtype, layout, dy_layout, dim_pos, out_float32, looped, seed):
    """Softmax over any dim (the long axis put at any position), any layout, optional
    ``dtype=float32`` output, single-block or looped kernels."""
    shape = list(lead)
    pos = min(dim_pos, len(shape))
    shape.insert(pos, n)
    shape = tuple(shape)
    out_dtype = torch.float32 if out_float32 else None
    x = leaf_view(shape, dtype, layout, seed, scale=3.0)
    dy = make_view(shape, out_dtype or dtype, dy_layout, seed + 1)
    with fusedops.use_backend("triton"), single_block_limit(16 if looped else None):
        y = fused_softmax(x, pos, dtype=out_dtype)
        (dx,) = _grad(y, [x], dy)
    x64 = x.detach().double().requires_grad_(True)  # exact: the dtype=float32 cast is too
    y64 = torch.softmax(x64, pos)
    (dx64,) = _grad(y64, [x64], dy.double())
    assert y.shape == shape and y.dtype == (out_dtype or dtype) and y.is_contiguous()
    assert dx.shape == shape and dx.dtype == dtype
    assert_close_to_ref(y, y64, out_dtype or dtype)
    assert_close_to_ref(dx, dx64, coarsest(dtype, out_dtype or dtype), scale=4.0)


test_softmax_property = QUICK(given(**SOFTMAX_CASES)(softmax_property))
test_softmax_property_full = pytest.mark.exhaustive(
    SETTINGS(given(**SOFTMAX_CASES)(softmax_property)))


def _rebuild_view(base: torch.Tensor, shape: tuple[int, ...], layout: str) -> torch.Tensor:
    """The same view as make_view, applied to a leaf ``base`` (the buffer make_view sliced)."""
    if layout == "sliced":
        return base[..., 2:2 + shape[-1]]
    if layout == "permuted" and len(shape) >= 2:
        return base.permute(*range(len(shape) - 1, -1, -1))
    if layout == "expanded" and len(shape) >= 2:
        return base.expand(*shape)
    if layout == "column_step":
        return base[..., ::2]
    return base


# --------------------------------------------------------------------------- layernorm


LAYERNORM_CASES = dict(
    lead=leading_shapes(),
    norm=st.one_of(st.tuples(row_lengths),
                   st.tuples(st.integers(1, 12), st.integers(1, 25))),
    dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(LAYOUTS),
    dy_layout=st.sampled_from(LAYOUTS),
    weight=st.sampled_from(["none", "same", "float32"]),
    bias=st.sampled_from(["none", "same", "float32"]),
    grads=st.sampled_from(["all", "params_only", "x_only"]),
    eps=st.sampled_from([1e-5, 1e-3, 0.1]),
    looped=st.booleans(),
    seed=st.integers(0, 2**16),
)


def layernorm_property(lead, norm, dtype, layout, dy_layout, weight, bias, grads, eps, looped,
                       seed):
    """LayerNorm over 1- or 2-dim normalized shapes, any layout, weight / bias absent, in the
    input's dtype or float32 (half activations with float32 parameters), any subset of
    gradients, single-block or looped kernels."""
    shape = tuple(lead) + tuple(norm)
    n = math.prod(norm)
    g = torch.Generator().manual_seed(seed + 2)

    def param(kind: str, center: float) -> torch.Tensor | None:
        if kind == "none":
            return None
        p_dtype = dtype if kind == "same" else torch.float32
        return (center + 0.5 * torch.randn(norm, generator=g)).to(p_dtype).to(DEVICE)

    w, b = param(weight, 1.0), param(bias, 0.0)
    need_x = grads != "params_only"
    need_p = grads != "x_only"
    x = leaf_view(shape, dtype, layout, seed, scale=2.0, offset=0.5, requires_grad=need_x)
    wl = None if w is None else w.detach().requires_grad_(need_p)
    bl = None if b is None else b.detach().requires_grad_(need_p)
    dy = make_view(shape, dtype, dy_layout, seed + 1)
    wanted = [t for t in (x, wl, bl) if t is not None and t.requires_grad]
    with fusedops.use_backend("triton"), single_block_limit(16 if looped else None):
        y = fused_layernorm(x, norm, wl, bl, eps)
        grads_out = _grad(y, wanted, dy) if wanted else ()
    x64 = x.detach().double().requires_grad_(need_x)
    w64 = None if w is None else w.double().requires_grad_(need_p)
    b64 = None if b is None else b.double().requires_grad_(need_p)
    y64 = F.layer_norm(x64, norm, w64, b64, eps)
    wanted64 = [t for t in (x64, w64, b64) if t is not None and t.requires_grad]
    grads64 = _grad(y64, wanted64, dy.double()) if wanted64 else ()
    assert y.shape == shape and y.dtype == dtype and y.is_contiguous()
    assert_close_to_ref(y, y64, coarsest(dtype, *(p.dtype for p in (w, b) if p is not None)))
    rows = max(x.numel() // max(n, 1), 1)
    for t, got, ref in zip(wanted, grads_out, grads64, strict=True):
        assert got.dtype == t.dtype and got.shape == t.shape
        if t is x:
            assert_close_to_ref(got, ref, dtype, scale=4.0 if eps < 0.1 else 8.0)
        else:  # a float32 sum over rows, in the parameter's own dtype (not x's)
            assert_row_sum_close(got, ref, rows, scale=4.0)


test_layernorm_property = QUICK(given(**LAYERNORM_CASES)(layernorm_property))
test_layernorm_property_full = pytest.mark.exhaustive(
    SETTINGS(given(**LAYERNORM_CASES)(layernorm_property)))
