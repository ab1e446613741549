"""Split-row kernels (CUDA only: they need a cooperative grid): every variant against the
float64 reference.

Variants: where a program loads its next row (PREFETCH 0, 1, 2, 3), the LayerNorm backward with and
without a register cap, aligned rows and unaligned
rows (N = 2^k + 1 and other odd lengths: an aligned body cut into pieces plus the row's edges,
VEC > 0), a grid smaller than the work (programs loop over rows, so they prefetch and, with
unaligned rows, must keep one misalignment), non-contiguous input rows and an expanded
gradient (different row strides: the aligned-body split is off there).
"""

from __future__ import annotations

import pytest
import torch
from _reliability import gpu
from conftest import assert_close_to_ref, assert_row_sum_close, forced_split_config

from fusedops import fused_layernorm, fused_softmax
from fusedops.backends.triton import layernorm as tln
from fusedops.backends.triton import layernorm_bwd as tlnb
from fusedops.backends.triton.runtime import split as rt_split

pytestmark = gpu

DTYPES = [torch.float32, torch.bfloat16]
# (rows, N): one round of programs, and more rows than programs (the grid loops over rows).
SHAPES = [(3, 65537), (2, 40000 + 3), (300, 65537), (64, 131072)]


def _softmax_case(m, n, dtype, x=None, dy=None):
    g = torch.Generator().manual_seed(n + m)
    if x is None:
        x = (torch.randn(m, n, generator=g) * 3).to(dtype).cuda()
    if dy is None:
        dy = torch.randn(m, n, generator=g).to(dtype).cuda()
    leaf = x.detach().clone().requires_grad_(True)
    y = fused_softmax(leaf, -1)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_(True)
    y64 = torch.softmax(x64, -1)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    assert_close_to_ref(y, y64, dtype)
    assert_close_to_ref(leaf.grad, dx64, dtype, scale=4)


def _layernorm_case(m, n, dtype):
    g = torch.Generator().manual_seed(n + m + 1)
    x = (torch.randn(m, n, generator=g) * 2 + 5).to(dtype).cuda()  # offset: no cancellation
    w = (1 + 0.5 * torch.randn(n, generator=g)).to(dtype).cuda()
    b = (0.5 * torch.randn(n, generator=g)).to(dtype).cuda()
    dy = torch.randn(m, n, generator=g).to(dtype).cuda()
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, b)]
    y = fused_layernorm(leaves[0], n, leaves[1], leaves[2])
    y.backward(dy)
    r = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    y64 = torch.nn.functional.layer_norm(r[0], (n,), r[1], r[2])
    grads = torch.autograd.grad(y64, r, dy.double())
    assert_close_to_ref(y, y64, dtype)
    assert_close_to_ref(leaves[0].grad, grads[0], dtype, scale=4)
    # dweight/dbias sum m rows: float32 sums grow their error with sqrt(m) (conftest)
    for got, want in zip((leaves[1].grad, leaves[2].grad), grads[1:], strict=True):
        assert_row_sum_close(got, want, m, scale=4)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
def test_softmax_split(monkeypatch, shape, dtype, prefetch, launch_rules):
    forced = (8192, 8, prefetch)
    launch_rules("softmax", split_config=forced_split_config(forced, forced))
    # 16-bit rows of these shapes: unrolled kernels
    launch_rules("softmax", UNROLLED_VEC_FWD={}, UNROLLED_BWD={}, UNROLLED_VEC_BWD={})
    _softmax_case(*shape, dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
@pytest.mark.parametrize("cap", [None, 128], ids=["uncapped", "cap128"])
def test_layernorm_split(monkeypatch, shape, dtype, prefetch, cap, launch_rules):
    launch_rules("layernorm", split_config=forced_split_config(
        (8192, 8, prefetch), (8192, 8, prefetch) if cap is None else (4096, 8, prefetch, cap)))
    launch_rules("layernorm", NATIVE_UNALIGNED_16BIT_BWD=False)
    launch_rules("layernorm", DX_PIECES_BWD=None)
    _layernorm_case(*shape, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_defaults(dtype):
    """The measured configs as shipped (16-bit 65537 LayerNorm backward: dx pieces + column
    kernel, see DX_PIECES_BWD)."""
    for m, n in [(300, 65537), (64, 131072), (40, 65536)]:
        _softmax_case(m, n, dtype)
        _layernorm_case(m, n, dtype)


def test_softmax_split_strided_rows():
    x = torch.randn(5, 70001, device="cuda")[:, 3:65540]  # row stride 70001, not 16-byte
    assert x.stride(0) != x.shape[1]
    _softmax_case(5, 65537, torch.float32, x=x)
    dy = torch.randn(1, 65537, device="cuda").expand(5, 65537)  # row stride 0
    _softmax_case(5, 65537, torch.float32, dy=dy)


def test_unaligned_grid_is_a_multiple_of_pieces_times_vec():
    """More rows than fit at once: the grid is a multiple of C·VEC, so a program's rows share
    one misalignment (the LayerNorm forward holds its weight columns)."""
    m, n = 400, 65537
    x = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    stats = torch.empty(4, device="cuda")
    count = torch.zeros(4, dtype=torch.int32, device="cuda")
    C, L = rt_split.split_pieces(n, 8192, 8)
    assert L % 16 == 0 and (C - 1) * L < n - 16  # every piece has part of every row's body
    runtime = (x, x, x, x, stats, stats, stats, count, n, L, n, n, 1e-5, m * C)
    consts = (8192, C, 16, True, True, 1, 8)
    progs = tln._launch_fwd_split.programs(m * C, C, runtime, consts, 8, x.device, vec=8)
    assert 0 < progs < m * C and progs % (C * 8) == 0
    _layernorm_case(m, n, torch.bfloat16)



VEC_RULE_16 = {2: ((2048, 8, 1), 0)}  # forces 16-bit rows onto aligned-body pieces


@pytest.mark.parametrize("dtype,m,n,rule,want", [
    (torch.float32, 300, 65537, None, [((4096, 4, 2), 4)]),  # C·VEC programs, rows loop
    (torch.float32, 2, 6 * 16384 + 5, None, [((4096, 4, 2), 4)]),  # one item per program
    (torch.float32, 300, 65537, {}, [((8192, 8, 2), 0)]),  # no rule: scalar pieces
    (torch.bfloat16, 300, 65537, None, ["pieces"]),  # dx pieces + column kernel
    (torch.bfloat16, 300, 65537, {}, ["native"]),  # neither: PyTorch's kernel
    (torch.bfloat16, 300, 65537, VEC_RULE_16, [((2048, 8, 1), 8)]),
    (torch.bfloat16, 2, 6 * 16384 + 5, VEC_RULE_16, [((2048, 8, 1), 8)]),
    (torch.bfloat16, 64, 262145, VEC_RULE_16, [((2048, 8, 1), 8), "native"]),  # no grid fits
    (torch.float32, 64, 262145, {4: ((2048, 8, 2), 0)},  # no grid fits: scalar pieces
     [((2048, 8, 2), 4), ((8192, 8, 2), 0)]),
])
def test_unaligned_layernorm_backward_paths(monkeypatch, dtype, m, n, rule, want, launch_rules):
    """Long unaligned rows in the LayerNorm backward: 16-bit rows on dx pieces + the column
    kernel (DX_PIECES_BWD; off in the cases with a rule, ``{}`` or not); else the split kernel
    on aligned-body pieces plus edges where VEC_SPLIT_BWD has a rule and a grid fits, else
    scalar pieces (float32) or PyTorch's native kernel (16-bit); values against float64 on
    every path."""
    if rule is not None:
        launch_rules("layernorm", VEC_SPLIT_BWD=rule)
        launch_rules("layernorm", DX_PIECES_BWD=None)
    seen = []
    real_split, real_native = tlnb._split_backward, tlnb._native_backward
    real_cols = tlnb._columns_first_backward
    def split(*a):  # a[10]: the LayerNormBackward decision; its split kernel's parameters
        sp = a[10].split
        seen.append(((sp.chunk, sp.warps, sp.prefetch), sp.vec))
        return real_split(*a)

    monkeypatch.setattr(tlnb, "_split_backward", split)
    monkeypatch.setattr(tlnb, "_native_backward",
                        lambda *a: seen.append("native") or real_native(*a))
    monkeypatch.setattr(tlnb, "_columns_first_backward", lambda *a: seen.append(
        "pieces" if a[10].pieces else "columns") or real_cols(*a))
    _layernorm_case(m, n, dtype)
    assert seen == want


def test_unaligned_layernorm_backward_deterministic_mode_is_scalar(monkeypatch):
    seen = []
    real = tlnb._native_backward
    monkeypatch.setattr(tlnb, "_native_backward", lambda *a: seen.append(1) or real(*a))
    torch.use_deterministic_algorithms(True)
    try:
        _layernorm_case(16, 65537, torch.bfloat16)
    finally:
        torch.use_deterministic_algorithms(False)
    assert seen == [1]


@pytest.mark.parametrize(("dtype", "m", "n", "piece", "warps"), [
    (torch.bfloat16, 40, 32768, 16384, 8),  # 2 pieces
    (torch.float16, 7, 65536, 16384, 8),  # 4
    (torch.bfloat16, 33, 262144, 32768, 8),  # 8
    (torch.bfloat16, 5, 65536, 4096, 4),  # 16, 4 warps
    (torch.float32, 64, 65536, 8192, 4),
    (torch.float32, 9, 262144, 16384, 4),  # 16 pieces of 64 KB
    (torch.float16, 300, 16384, 8192, 16)], ids=str)
def test_softmax_cluster_forward(dtype, m, n, piece, warps, launch_rules):
    """Forced CLUSTER_FWD rules (2-16 pieces of 4K-32K elements, 4-16 warps), with special
    rows (one all -inf, one with a NaN in its last piece, one whose maximum sits alone in its
    last piece, one of a single finite value): values against float64, and the forward
    launches softmax_fwd_staged on one cluster per row on Hopper (elsewhere the rules without
    clusters)."""
    from fusedops.backends.triton import softmax as tsm
    from fusedops.backends.triton.runtime.recording import record_launches

    hopper = torch.cuda.get_device_capability()[0] >= 9
    elt = torch.empty((), dtype=dtype).element_size()
    launch_rules("softmax", CLUSTER_FWD={elt: ((n, n, (piece, warps)),)})
    g = torch.Generator().manual_seed(n + m)
    x = torch.randn(m, n, generator=g) * 3
    x[1] = -float("inf")
    x[2, -5] = float("nan")
    x[3, -1] = 80.0
    x[4] = -float("inf")
    x[4, n // 2 + 1] = -3.0
    x = x.to(dtype).cuda()
    with record_launches() as record:
        y = tsm.softmax_forward(x, dtype)
    ref = torch.softmax(x.double(), -1)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    assert y[4, n // 2 + 1] == 1 and y[4].float().sum() == 1
    keep = torch.ones(m, dtype=torch.bool)
    keep[1:3] = False
    assert_close_to_ref(y[keep.cuda()], ref[keep.cuda()], dtype)
    staged = [(grid, args) for launcher, grid, args, _ in record
              if launcher is tsm._launch_fwd_staged]
    assert bool(staged) == hopper, record
    if hopper:
        ((grid, args),) = staged
        assert grid == (m,) and args[4:9] == (m * (n // piece), piece, n // piece,
                                             n // piece, 32 * warps)


def test_softmax_cluster_forward_other_calls(launch_rules):
    """Calls the staged forward cannot take run the rules without clusters, right: a single
    row that starts off a 16-byte boundary and an output dtype other than the input's."""
    from fusedops.backends.triton import softmax as tsm
    from fusedops.backends.triton.runtime.recording import record_launches

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("clusters need Hopper")
    n = 65536
    launch_rules("softmax", CLUSTER_FWD={2: ((n, n, (16384, 8)),)})
    base = (torch.randn(n + 8) * 3).to(torch.bfloat16).cuda()
    for x, out in ((base[1:n + 1].view(1, n), torch.bfloat16),
                   (base[:n].view(1, n), torch.float32),
                   (base[:n].view(1, n), torch.bfloat16)):
        with record_launches() as record:
            y = tsm.softmax_forward(x, out)
        assert y.dtype == out
        assert_close_to_ref(y, torch.softmax(x.double(), -1), out)
        staged = any(launcher is tsm._launch_fwd_staged for launcher, *_ in record)
        assert staged == (x.data_ptr() % 16 == 0 and out == torch.bfloat16), record
