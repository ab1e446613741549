"""LayerNorm backward memory. Default ``"low_memory"`` mode (``fusedops.set_layernorm_backward``):
no scratch beyond the outputs, so forward + backward peak memory is no larger than PyTorch's:
the fused and split-row kernels' float32 partials (and the split kernel's per-row statistics)
are parked at the end of dx's storage, and dx of the rows there is written by a second launch
after the partials are summed; the dx row kernel's path computes dweight/dbias by a column pass
parked in dx before dx (both modes). ``"fast"``: separate scratch, the same bits.

CPU (Triton interpreter): results against float64 in both modes, the modes bitwise equal,
repeatability, the mode API, where the partial sums live, the second launch, the split
kernel's dx-of-parked-rows kernels. GPU (``gpu`` marker): the peak memory against torch's (no
slack), the modes bitwise equal on every kernel path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _reliability import forward_backward_peak
from conftest import (
    assert_close_to_ref,
    assert_row_sum_close,
    exhaustive_unless,
    ln_backward_vec,
    one_of_each,
)

import fusedops


def test_mode_api():
    assert fusedops.get_layernorm_backward() == "low_memory"  # the default
    with fusedops.layernorm_backward_mode("fast"):
        assert fusedops.get_layernorm_backward() == "fast"
    assert fusedops.get_layernorm_backward() == "low_memory"
    with pytest.raises(ValueError, match="mode"):
        fusedops.set_layernorm_backward("small")


def _grads(x, w, b, g, mode, need_x=True):
    n = x.shape[-1]
    leaves = [x.clone().requires_grad_(need_x)] + [
        None if t is None else t.clone().requires_grad_(True) for t in (w, b)]
    with fusedops.layernorm_backward_mode(mode):
        y = fusedops.fused_layernorm(leaves[0], n, leaves[1], leaves[2])
        ins = [t for t in leaves if t is not None and t.requires_grad]
        return torch.autograd.grad(y, ins, g)


CASES = {  # (M, N, row padding of x, affine)
    "many_rows": (300, 64, 0, "both"),
    "unaligned": (300, 33, 0, "both"),
    "strided_x": (50, 100, 7, "both"),
    "few_rows": (3, 64, 0, "both"),  # no room in dx for the partials: straight into dw/db
    "one_row": (1, 40, 0, "both"),
    # The affine variants need partials from several programs, not many_rows' count (the
    # interpreter's bfloat16 makes each row cost).
    "weight_only": (100, 64, 0, "weight"),
    "bias_only": (100, 64, 0, "bias"),
    "params_in_x_dtype": (100, 64, 0, "both-x"),  # summed straight into x's dtype
}


def _one_mode(case: str, dtype: torch.dtype) -> str:
    """The mode a case runs in by default: alternating over the cases, the other one for
    bfloat16."""
    return ("fast", "low_memory")[(list(CASES).index(case) + (dtype == torch.bfloat16)) % 2]


# Default run: the row layouts with dx in float32, each in one mode (alternating, so both
# modes run), and the parameter gradients alone in bfloat16 summed into x's dtype (the
# interpreter's bfloat16 makes each row cost); the rest in the extended matrix.
@exhaustive_unless(lambda dtype, case, need_x, mode: mode == _one_mode(case, dtype) and (
    (dtype == torch.float32 and need_x and CASES[case][3] == "both")
    or (dtype, need_x, case) == (torch.bfloat16, False, "params_in_x_dtype")))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("need_x", [True, False], ids=["dx", "params-only"])
@pytest.mark.parametrize("mode", ["fast", "low_memory"])
def test_backward_matches_float64(triton_backend, device, dtype, case, need_x, mode):
    m, n, pad, affine = CASES[case]
    torch.manual_seed(m * n + pad)
    x = (torch.randn(m, n + pad, device=device) * 2 + 1).to(dtype)[:, :n]
    pdt = dtype if affine == "both-x" else torch.float32
    w = torch.randn(n, device=device).to(pdt) if affine != "bias" else None
    b = torch.randn(n, device=device).to(pdt) if affine in ("both", "bias", "both-x") else None
    g = torch.randn(m, n, device=device).to(dtype)
    got = _grads(x, w, b, g, mode, need_x)
    assert all(t.dtype == pdt for t in got[int(need_x):])
    r = [x.double().requires_grad_(need_x)] + [
        None if t is None else t.double().requires_grad_(True) for t in (w, b)]
    want = torch.autograd.grad(F.layer_norm(r[0], (n,), r[1], r[2]),
                               [t for t in r if t is not None and t.requires_grad], g.double())
    if need_x:
        assert_close_to_ref(got[0], want[0], dtype, scale=8)
    for a, e in zip(got[int(need_x):], want[int(need_x):], strict=True):
        assert_row_sum_close(a, e, m, scale=4)  # in the parameters' dtype, not x's
    again = _grads(x, w, b, g, mode, need_x)
    assert all(torch.equal(p, q) for p, q in zip(got, again, strict=True))  # deterministic


def _modes_bitwise_equal(m: int, n: int, dtype: torch.dtype, device: str) -> None:
    """dx always; dweight/dbias from 8 rows on (with fewer, dx may have no room for the
    partials and low_memory sums them by columns: another order)."""
    torch.manual_seed(m + n)
    x = (torch.randn(m, n, device=device) * 2 + 0.5).to(dtype)
    w, b = (torch.randn(n, device=device).to(dtype) for _ in range(2))
    g = torch.randn(m, n, device=device).to(dtype)
    fast, low = (_grads(x, w, b, g, mode) for mode in ("fast", "low_memory"))
    names = ("dx", "dweight", "dbias") if m >= 8 else ("dx",)
    for name, p, q in zip(names, fast[:len(names)], low[:len(names)], strict=True):
        assert torch.equal(p, q), f"{name}: the modes differ"


# (the diagonal's float32 cases; bfloat16: exhaustive)
@exhaustive_unless(one_of_each({"m,n": [(137, 33), (70, 24), (300, 64)],
                                "dtype": [torch.float32, torch.bfloat16]},
                               where=lambda m, n, dtype: dtype == torch.float32))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n", [(300, 64), (137, 33), (70, 24)])
def test_modes_give_the_same_bits(triton_backend, device, m, n, dtype):
    """low_memory's second launch (dx of the rows that held the parked partials) writes the
    bits the single launch of the fast mode writes; dweight/dbias are the same sums, rounded
    once to the parameters' dtype either way."""
    _modes_bitwise_equal(m, n, dtype, device)


@pytest.mark.parametrize("m,expect_in_dx", [(300, True), (3, False)])
def test_partials_are_parked_in_dx(monkeypatch, triton_backend, device, m, expect_in_dx,
                                   launch_rules):
    """The column path (dx row kernel + column kernel, forced at every length here; split rows
    off, which would otherwise take these rows on CUDA)."""
    from fusedops.backends.triton import layernorm as tln
    from fusedops.backends.triton import layernorm_bwd as tlnb

    launch_rules("layernorm", FUSED_BWD_MAX_BLOCK=0)
    launch_rules(SPLIT_ROWS=False)
    seen = []
    real = tlnb._launch_dwdb_columns
    monkeypatch.setattr(tlnb, "_launch_dwdb_columns", lambda grid, args, warps: seen.append(
        (grid, args[4].untyped_storage().data_ptr())) or real(grid, args, warps))
    x = torch.randn(m, 64, device=device)
    dy = torch.randn(m, 64, device=device)
    w = torch.randn(64, device=device)
    _, mean, rstd = tln.layernorm_forward(x, w, None, 1e-5, x.dtype)
    with fusedops.layernorm_backward_mode("low_memory"):
        dx, dw, db = tlnb.layernorm_backward(dy, x, w, mean, rstd, True, True, True)
    (grid, ptr), = seen
    # separate outputs (a custom op's outputs must not alias), none of them in dx
    ptrs = {t.untyped_storage().data_ptr() for t in (dx, dw, db)}
    assert len(ptrs) == 3
    if expect_in_dx:
        assert grid[1] > 1 and ptr == dx.untyped_storage().data_ptr()
    else:
        assert grid[1] == 1 and ptr == dw.untyped_storage().data_ptr()


def _inside(t: torch.Tensor, owner: torch.Tensor) -> bool:
    """Whether t's storage is owner's (a view parked in it)."""
    return t.untyped_storage().data_ptr() == owner.untyped_storage().data_ptr()


# (float32 on 300 rows with the body variant forced (body_from) by default; the others
# exhaustive)
@exhaustive_unless(one_of_each({"m,n": [(300, 64), (8, 48), (137, 33)],
                                "dtype": [torch.float32, torch.bfloat16],
                                "body_from": [None, 16]}, {"dtype": torch.float32, "m": 300},
                               where=lambda m, n, dtype, body_from:
                                   (m, dtype, body_from) == (300, torch.float32, 16)))
@pytest.mark.parametrize("body_from", [None, 16], ids=["aligned", "unaligned-body"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n", [(300, 64), (137, 33), (8, 48)])
def test_fused_partials_parked_in_dx(monkeypatch, triton_backend, device, m, n, dtype,
                                     body_from, launch_rules):
    """low_memory mode, fused kernel: partials in dx's storage, dx of the rows from M_dx on by
    a second launch of the same kernel (no dweight/dbias), dweight/dbias in the parameters'
    dtypes; the same values (bitwise) as with the partials in separate scratch."""
    from fusedops.backends.triton import layernorm as tln
    from fusedops.backends.triton import layernorm_bwd as tlnb

    if body_from is not None:  # the aligned-body variant (VEC > 0) even for short rows
        launch_rules("layernorm", FUSED_BWD_UNALIGNED_MIN_BLOCK=body_from)
    launches = []
    real = tlnb._launch_bwd_single
    monkeypatch.setattr(tlnb, "_launch_bwd_single", lambda grid, args, warps: launches.append(
        (grid, args)) or real(grid, args, warps))
    torch.manual_seed(m + n)
    x = (torch.randn(m, n, device=device) * 3 + 2).to(dtype)
    dy = torch.randn(m, n, device=device).to(dtype)
    w = torch.randn(n, device=device).to(dtype)
    _, mean, rstd = tln.layernorm_forward(x, w, None, 1e-5, x.dtype)
    with fusedops.layernorm_backward_mode("low_memory"):
        dx, dw, db = tlnb.layernorm_backward(dy, x, w, mean, rstd, True, True, True,
                                            grad_dtypes=(dtype, dtype))
    assert dw.dtype == db.dtype == dtype
    (_, main), (tail_grid, tail) = launches
    assert main[25] and tail[25]  # the PARKED variant
    part, m_dx = main[6], main[15]
    assert _inside(part, dx) and 0 <= m_dx < m
    # the partials start at or after row m_dx, and the tail launch covers rows m_dx..m
    assert part.storage_offset() * 4 >= m_dx * n * x.element_size()
    rows = main[17]  # the ROWS constexpr
    assert tail[14] == m_dx // rows and tail[15] == m and tail[20:22] == (False, False)
    assert not (_inside(dw, dx) or _inside(db, dx) or _inside(db, dw))  # separate outputs
    # partials in a separate buffer instead (every row's dx from the first launch): same bits
    ref = _separate_scratch(tln, dy, x, w, mean, rstd, dtype)
    for got, want in zip((dx, dw, db), ref, strict=True):
        assert torch.equal(got, want)


def test_fast_mode_keeps_separate_scratch(monkeypatch, triton_backend, device):
    """fast mode: one launch of the fused kernel (not its parked variant), partials in their
    own buffer."""
    from fusedops.backends.triton import layernorm as tln
    from fusedops.backends.triton import layernorm_bwd as tlnb

    launches = []
    real = tlnb._launch_bwd_single
    monkeypatch.setattr(tlnb, "_launch_bwd_single", lambda grid, args, warps: launches.append(
        args) or real(grid, args, warps))
    x, dy = torch.randn(300, 64, device=device), torch.randn(300, 64, device=device)
    w = torch.randn(64, device=device)
    _, mean, rstd = tln.layernorm_forward(x, w, None, 1e-5, x.dtype)
    with fusedops.layernorm_backward_mode("fast"):
        dx, _, _ = tlnb.layernorm_backward(dy, x, w, mean, rstd, True, True, True)
    (main,) = launches
    assert not main[25] and main[15] == 300 and not _inside(main[6], dx)


def _separate_scratch(tln, dy, x, w, mean, rstd, dtype):
    """The fused backward's parked variant with its partials in a separate buffer: dx from the
    first launch for every row."""
    from fusedops.backends.triton import layernorm_bwd as tlnb
    from fusedops.backends.triton.configs import layernorm as ln_rules
    from fusedops.backends.triton.runtime.device import num_sms

    M, N = x.shape
    plan = ln_rules.fused_plan(M, N, x.element_size(), ln_backward_vec(x, dy),
                               num_sms(x.device))
    vec, block, rows, warps, acc_1d, tiles, progs = plan
    dx = torch.empty_like(x)
    part = torch.empty((2, progs, N), dtype=torch.float32, device=x.device)
    tlnb._launch_bwd_single((progs,), (
        dy, x, w, mean, rstd, dx, part, M, N, dy.stride(0), x.stride(0), N, tiles, progs, 0, M,
        block, rows, True, True, True, True, vec, True, acc_1d, True,
        ln_rules.paired_sums(x.element_size(), vec, block),
        ln_rules.fused_bwd_stages(block, x.element_size(), (dy.stride(0), x.stride(0), N))), warps)
    dw, db = tlnb.reduce_partials(part, True, True, dtypes=(dtype, dtype))
    return dx, dw, db


def _pieces_case(device, dtype, n: int, piece: int, vec: bool):
    """Inputs of the split rows' second kernels: 7 rows of n, the first 3 not written; rows cut
    into C pieces of L columns as the split kernel cuts them. ``vec``: contiguous rows read as
    an aligned body (pieces of L, a multiple of 16) plus edges, VEC = 16 bytes of elements;
    else strided rows (VEC 0)."""
    from fusedops.backends.triton import layernorm as tln
    from fusedops.backends.triton.configs import common as tcfg
    from fusedops.backends.triton.runtime import split as rt_split

    torch.manual_seed(n)
    m, row0 = 7, 3
    v = 16 // torch.empty((), dtype=dtype).element_size() if vec else 0
    x = (torch.randn(m, n + 5, device=device) * 2 - 1).to(dtype)[:, :n]
    if vec:
        x = x.contiguous()
        assert tcfg.unaligned_vec(n, (n, n), x.element_size(), (x,)) == v
    dy = torch.randn(m, n, device=device).to(dtype)
    w = torch.randn(n, device=device).to(dtype)
    _, mean, rstd = tln.layernorm_forward(x, w, None, 1e-5, x.dtype)
    return (m, row0, x, dy, w, mean, rstd, v, *rt_split.split_pieces(n, piece, v))


def _piece_columns(r: int, n: int, v: int, C: int, L: int) -> list[list[int]]:
    """The columns of row r that each of the C pieces of the split kernel owns (VEC = v)."""
    if not v:
        return [[c for c in range(p * L, (p + 1) * L) if c < n] for p in range(C)]
    head = -(r * n) % v
    body = (n - head) // v * v
    pieces = [[head + c for c in range(p * L, (p + 1) * L) if c < body] for p in range(C)]
    pieces[0] += list(range(head)) + list(range(head + body, n))  # piece 0 owns the edges
    return pieces


PIECE_CASES = [(40, 16, False), (37, 8, False), (64, 64, False), (37, 16, True),
               (99, 32, True), (61, 64, True)]
_PIECES_DIAGONAL = one_of_each({"n,piece,vec": PIECE_CASES,
                                "dtype": [torch.float32, torch.bfloat16]})


def _pieces_default(dtype, n, piece, vec) -> bool:
    """The default run: the diagonal's float32 rows of 64 (one piece) and of 99 (unaligned, in
    pieces of 32); the rest exhaustive."""
    return _PIECES_DIAGONAL(dtype=dtype, n=n, piece=piece, vec=vec) and (
        dtype == torch.float32 and n in (64, 99))


@exhaustive_unless(_pieces_default)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n,piece,vec", PIECE_CASES)
def test_dx_pieces_kernel_matches_float64(triton_backend, device, dtype, n, piece, vec):
    """ln_bwd_dx_pieces (dx of the rows that held the split kernel's parked scratch): rows
    row0.. against float64, rows before row0 untouched, pieces past the row's end masked;
    unaligned rows (vec) as body pieces plus edges, every head 0..VEC-1 among the rows."""
    from fusedops.backends.triton import layernorm_bwd as tlnb
    from fusedops.backends.triton.configs import layernorm as ln_rules
    from fusedops.backends.triton.runtime import device as rt_device

    m, row0, x, dy, w, mean, rstd, v, C, L = _pieces_case(device, dtype, n, piece, vec)
    dx = torch.full((m, n), 7.0, device=device).to(dtype)
    tlnb._launch_dx_pieces((m - row0,), (
        dy, x, w, mean, rstd, dx, n, L, dy.stride(0), x.stride(0), n, row0,
        rt_device.next_pow2(L), C, rt_device.next_pow2(C), True, False, v, ln_rules.SPLIT_PAIRED),
        4)
    assert torch.all(dx[:row0] == 7)
    r = x.double().requires_grad_()
    want, = torch.autograd.grad(F.layer_norm(r, (n,), w.double()), r, dy.double())
    assert_close_to_ref(dx[row0:], want[row0:], dtype, scale=8)


@exhaustive_unless(_pieces_default)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n,piece,vec", PIECE_CASES)
def test_dx_published_kernel_matches_float64(triton_backend, device, dtype, n, piece, vec):
    """ln_bwd_dx_published (dx of the rows over the split kernel's parked scratch, from the
    per-piece statistics it published): rows row0.. against float64, rows before untouched.
    Here the statistics sit in a buffer of their own, so no program has to wait (late_from =
    the grid); the overlapping layout and the waiting are GPU-tested (modes bitwise)."""
    from fusedops.backends.triton import layernorm_bwd as tlnb
    from fusedops.backends.triton.runtime import device as rt_device

    m, row0, x, dy, w, mean, rstd, v, C, L = _pieces_case(device, dtype, n, piece, vec)
    xhat = (x.float() - mean[:, None]) * rstd[:, None]
    wdy = dy.float() * w.float()
    stats = torch.zeros(m, C, 2, device=device)  # what the split kernel stores per piece
    for r in range(m):
        for p, cols in enumerate(_piece_columns(r, n, v, C, L)):
            stats[r, p, 0] = (xhat[r, cols] * wdy[r, cols]).sum()
            stats[r, p, 1] = wdy[r, cols].sum()
    stats = stats.reshape(-1)
    done = torch.zeros(1, dtype=torch.int32, device=device)
    dx = torch.full((m, n), 7.0, device=device).to(dtype)
    grid = (m - row0) * C
    tlnb._launch_dx_published((grid,), (
        dy, x, w, mean, rstd, dx, stats, done, n, L, dy.stride(0), x.stride(0), n, row0, grid,
        grid, rt_device.next_pow2(L), C, rt_device.next_pow2(C), True, False, v), 4)
    assert torch.all(dx[:row0] == 7) and done.item() == grid
    r = x.double().requires_grad_()
    want, = torch.autograd.grad(F.layer_norm(r, (n,), w.double()), r, dy.double())
    assert_close_to_ref(dx[row0:], want[row0:], dtype, scale=8)


PEAK_SHAPES = [(4096, 1024), (1024, 4096), (300, 8193), (64, 70000), (8, 2 * 16384),
               (16384, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n", PEAK_SHAPES, ids=[f"{m}x{n}" for m, n in PEAK_SHAPES])
def test_gpu_low_memory_peak_not_above_torch(m, n, dtype):
    """Forward + backward peak in low_memory mode <= torch's, with no slack: the kernels'
    scratch lives in dx's storage until dweight/dbias are summed (in the parameters' dtypes),
    then dx of those rows is written over it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, n, generator=g).to(dtype).cuda()
    dy = torch.randn(m, n, generator=g).to(dtype).cuda()
    w = torch.randn(n, generator=g).cuda().to(dtype)
    b = torch.randn(n, generator=g).cuda().to(dtype)

    with fusedops.layernorm_backward_mode("low_memory"):
        fused = forward_backward_peak(
            lambda x, w, b: fusedops.fused_layernorm(x, (n,), w, b), [x, w, b], dy)
    ref = forward_backward_peak(lambda x, w, b: F.layer_norm(x, (n,), w, b), [x, w, b], dy)
    assert fused <= ref, (fused, ref)


MODE_SHAPES = [(4096, 1024), (1000, 4097), (300, 8193), (2, 8193), (64, 70000), (8, 2 * 16384),
               (3, 6 * 16384 + 5), (1, 65536), (16384, 64), (300, 16384), (100, 65536)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n", MODE_SHAPES, ids=[f"{m}x{n}" for m, n in MODE_SHAPES])
def test_gpu_modes_give_the_same_bits(m, n, dtype):
    """Every kernel path in both modes, bitwise: low_memory's second launches (the fused
    kernel's dx-only variant; for split rows ln_bwd_dx_published on the statistics the split
    launch left, or with too few rows ln_bwd_dx_pieces) reproduce the rows the fast mode's
    single launch writes (on Hopper, 16K-64K rows run the split kernel in clusters)."""
    _modes_bitwise_equal(m, n, dtype, "cuda")
