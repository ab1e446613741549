"""Launch-side internals of the Triton backend: unaligned rows (body + edges) and the split-row
rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    EXHAUSTIVE,
    assert_close_to_ref,
    assert_row_sum_close,
    exhaustive_unless,
    ln_backward_vec,
    one_of_each,
    tol,
)

import fusedops
from fusedops.backends.triton.configs import common as tcfg
from fusedops.backends.triton.runtime import device as rt_device
from fusedops.backends.triton.runtime import plans as rt_plans
from fusedops.backends.triton.runtime import split as rt_split

DTYPES = [torch.float32, torch.bfloat16]


def _t(n: int, dtype=torch.bfloat16, offset: int = 0) -> torch.Tensor:
    return torch.empty(n + offset, dtype=dtype)[offset:]


def test_unaligned_vec_rule():
    a = _t(64)
    assert tcfg.unaligned_vec(33, (33, 33), 2, (a, a)) == 8  # unaligned rows: body + edges
    assert tcfg.unaligned_vec(33, (33, 33), 4, (a, a)) == 4
    assert tcfg.unaligned_vec(32, (32, 32), 2, (a, a)) == 0  # aligned rows need no split
    assert tcfg.unaligned_vec(33, (40, 33), 2, (a, a)) == 0  # strides differ: no common split
    assert tcfg.unaligned_vec(15, (15, 15), 2, (a, a)) == 0  # rows shorter than two vectors
    assert tcfg.unaligned_vec(33, (33, 33), 2, (a, _t(64, offset=1))) == 0  # base unaligned
    assert tcfg.body_len(8193, 8) == 8192
    assert tcfg.body_len(8193, 4) == 8192
    assert tcfg.body_len(8192, 0) == 8192


def test_unaligned_fused_backward_rule(monkeypatch, launch_rules):
    from fusedops.backends.triton.configs import layernorm as ln_rules

    # the aligned-body fused backward from 2K bodies (2049), one row per tile; 1025 stays
    # scalar (padded to 2048)
    for n, vec, block in [(8193, 8, 8192), (4097, 8, 4096), (2049, 8, 2048), (1025, 0, 2048)]:
        plan = ln_rules.fused_plan(4096, n, 2, 8, 132)
        assert plan[:3] == (vec, block, 1 if vec else 2)
    # float32 bodies of 4K+: two rows of 4K or one of 8K per 16-warp program, one per SM
    assert ln_rules.fused_plan(4096, 4097, 4, 4, 132)[:4] == (4, 4096, 2, 16)


def test_unaligned_split_can_be_turned_off(monkeypatch, launch_rules):
    launch_rules(ROW_BODY=False)
    a = _t(64)
    assert tcfg.unaligned_vec(33, (33, 33), 2, (a, a)) == 0


# (float32 on one row of 17 and nine of 23 by default; the other shapes and bfloat16, whose
# elements the interpreter converts one by one, exhaustive)
@exhaustive_unless(lambda dtype, m, n: dtype == torch.float32 and n in (17, 23))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n", [(1, 17), (3, 33), (7, 1025), (5, 255), (9, 23)])
def test_unaligned_rows_match_float64(triton_backend, device, dtype, m, n):
    # Every row start has a different misalignment (head 0..VEC-1), including rows whose body
    # is one vector (n = 17 bf16) and rows whose edges hold VEC - 1 elements on both sides.
    torch.manual_seed(m * n)
    x = (torch.randn(m, n, device=device) * 3 + 1).to(dtype).requires_grad_(True)
    assert tcfg.unaligned_vec(n, (n, n), x.element_size(), (x, x)) > 0  # the split path runs
    w = torch.randn(n, device=device, requires_grad=True)
    b = torch.randn(n, device=device, requires_grad=True)
    g = torch.randn(m, n, device=device).to(dtype)
    x64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, w, b))

    y = fusedops.fused_softmax(x)
    r = torch.softmax(x64, -1)
    assert_close_to_ref(y, r, dtype)
    (dx,) = torch.autograd.grad(y, x, g)
    (dr,) = torch.autograd.grad(r, x64, g.double())
    assert_close_to_ref(dx, dr, dtype, scale=4)

    y = fusedops.fused_layernorm(x, n, w, b)
    r = F.layer_norm(x64, (n,), w64, b64)
    assert_close_to_ref(y, r, dtype, scale=4)
    got = torch.autograd.grad(y, (x, w, b), g)
    want = torch.autograd.grad(r, (x64, w64, b64), g.double())
    assert_close_to_ref(got[0], want[0], dtype, scale=8)
    for a, e in zip(got[1:], want[1:], strict=True):  # float32 parameters: float32 sums
        assert_row_sum_close(a, e, m, scale=4)


def test_split_rows_rule():
    cuda = torch.device("cuda")
    enabled = rt_split.SPLIT_STATE["enabled"] and not rt_device.interpreting()
    # equal pieces of at most `chunk`; all pieces of a row must be resident at once
    assert rt_split.split_rows_enabled(cuda, 4 * 8192 + 1, 8192) == enabled
    assert rt_split.split_rows_enabled(torch.device("cpu"), 8 * 8192, 8192) is False


@exhaustive_unless(lambda dtype: dtype == torch.float32)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unaligned_rows_on_a_persistent_grid(launch_rules, triton_backend, device, dtype):
    # More row tiles than programs: each program loops over tiles that must all share one
    # misalignment, since it holds the weight shifted by it (grid rounded to a multiple of VEC).
    launch_rules(num_sms=lambda dev: 1)
    m, n = 1100, 33
    assert tcfg.grid_size(100, 8, "ln_bwd", torch.device(device), vec=8) == 8
    assert tcfg.grid_size(100, 16, "ln_bwd", torch.device(device), vec=8) == 8
    torch.manual_seed(0)
    x = (torch.randn(m, n, device=device) * 2 - 1).to(dtype).requires_grad_(True)
    w = torch.randn(n, device=device)  # no gradient: the dx row kernel runs
    g = torch.randn(m, n, device=device).to(dtype)
    x64 = x.detach().double().requires_grad_(True)
    y = fusedops.fused_layernorm(x, n, w)
    r = F.layer_norm(x64, (n,), w.double())
    assert_close_to_ref(y, r, dtype, scale=4)
    (dx,) = torch.autograd.grad(y, x, g)
    (dr,) = torch.autograd.grad(r, x64, g.double())
    assert_close_to_ref(dx, dr, dtype, scale=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
# Rows enough that every program loops over several tiles (few SMs, so few rows suffice: the
# interpreter's time grows with them); float32 at 1025 puts several programs on one
# misalignment. The split cases lift the partial-row budget (an eighth of x, which would leave
# these small batches fewer than VEC programs); 3 x 33 keeps it and takes the scalar path.
# Default run: the scalar path in float32. (The split cases, whose tile loops take the
# interpreter seconds, and bfloat16: exhaustive; test_unaligned_rows_match_float64 checks the
# fused backward's dweight/dbias of unaligned rows by default.)
@exhaustive_unless(lambda dtype, m, split, **_: not split and dtype == torch.float32)
@pytest.mark.parametrize("m,n,sms,split", [(160, 33, 4, True), (96, 1025, 8, True),
                                           (3, 33, 8, False)])
def test_unaligned_fused_backward_partials(monkeypatch, triton_backend, device, dtype, m, n, sms,
                                           split, launch_rules):
    """dweight/dbias of unaligned rows from the fused backward: each program accumulates its
    columns shifted by its rows' misalignment plus (2·VEC,) edge columns, and writes a complete
    partial row. Programs loop over row tiles that must share one misalignment (a grid of a
    multiple of VEC programs); a batch too small for VEC partial rows (3 x 33: scratch is capped
    at an eighth of x) is read with scalar accesses instead."""
    from fusedops.backends.triton.configs import layernorm as ln_rules

    launch_rules(num_sms=lambda dev: sms)
    # short bodies take the scalar variant by default (measured faster); force the body one
    launch_rules("layernorm", FUSED_BWD_UNALIGNED_MIN_BLOCK=16)
    if split:
        launch_rules("layernorm", max_partial_rows=lambda m, n, elt_size: 1 << 20)
    torch.manual_seed(m + n)
    x = (torch.randn(m, n, device=device) * 2 + 3).to(dtype)
    dy = torch.randn(m, n, device=device).to(dtype)
    plan = ln_rules.fused_plan(m, n, x.element_size(), ln_backward_vec(x, dy), sms)
    vec = 16 // x.element_size()
    assert plan is not None and plan[0] == (vec if split else 0)
    tiles, progs = plan[5], plan[6]
    if split:
        assert progs < tiles and progs % vec == 0
    w = torch.randn(n, device=device, requires_grad=True)
    b = torch.randn(n, device=device, requires_grad=True)
    xl = x.clone().requires_grad_(True)
    y = fusedops.fused_layernorm(xl, n, w, b)
    got = torch.autograd.grad(y, (xl, w, b), dy)
    r = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    want = torch.autograd.grad(F.layer_norm(r[0], (n,), r[1], r[2]), r, dy.double())
    assert_close_to_ref(got[0], want[0], dtype, scale=4)
    for a, e in zip(got[1:], want[1:], strict=True):  # float32 parameters: float32 sums
        assert_row_sum_close(a, e, m, scale=4)


# (bfloat16 rows of 48 in two reductions by default; the others exhaustive)
@exhaustive_unless(lambda n, paired, dtype: (n, paired, dtype) == (48, False, torch.bfloat16))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("paired", [True, False], ids=["paired", "separate"])
@pytest.mark.parametrize("n", [64, 48])
def test_fused_backward_row_sums(monkeypatch, triton_backend, device, dtype, paired, n,
                                 launch_rules):
    """The fused backward's two row sums as one paired reduction or two (the rule picks paired
    for aligned 16-bit rows up to 4K and for unaligned 16-bit bodies), on full and padded rows
    (48 of a 64-lane block: masked lanes carry dy = 0 and no select) and with a NaN row: dx,
    dweight, dbias against float64; the NaN row's dx NaN, every other row finite, dweight NaN,
    dbias finite."""
    from fusedops.backends.triton import layernorm as tln
    from fusedops.backends.triton import layernorm_bwd as tlnb
    from fusedops.backends.triton.configs import layernorm as ln_rules

    assert ln_rules.paired_sums(2, 0, 4096) and not ln_rules.paired_sums(2, 0, 8192)
    assert not ln_rules.paired_sums(4, 0, 1024) and not ln_rules.paired_sums(4, 4, 8192)
    assert ln_rules.paired_sums(2, 8, 1024) and ln_rules.paired_sums(2, 8, 8192)
    launch_rules("layernorm", paired_sums=lambda elt, vec, block: paired)
    torch.manual_seed(n)
    m = 37  # not a multiple of the rows per tile: masked rows in the last tile
    x = (torch.randn(m, n, device=device) * 3 + 2).to(dtype)
    dy = torch.randn(m, n, device=device).to(dtype)
    w = torch.randn(n, device=device).to(dtype)
    _, mean, rstd = tln.layernorm_forward(x, w, None, 1e-5, dtype)
    plan = ln_rules.fused_plan(m, n, x.element_size(), ln_backward_vec(x, dy), 4)
    assert plan is not None and plan[0] == 0
    dx, dw, db = tlnb.layernorm_backward(dy, x, w, mean, rstd, True, True, True)
    r = [t.detach().double().requires_grad_(True) for t in (x, w)]
    want = torch.autograd.grad(F.layer_norm(r[0], (n,), r[1]), r, dy.double())
    assert_close_to_ref(dx, want[0], dtype, scale=4)
    assert_row_sum_close(dw, want[1], m, scale=4)
    assert_row_sum_close(db, dy.double().sum(0), m, scale=4)
    x_nan = x.clone()
    x_nan[5, 7] = float("nan")
    _, mean, rstd = tln.layernorm_forward(x_nan, w, None, 1e-5, dtype)
    dx, dw, db = tlnb.layernorm_backward(dy, x_nan, w, mean, rstd, True, True, True)
    assert torch.isnan(dx[5]).all() and torch.isfinite(dx[torch.arange(m) != 5]).all()
    assert torch.isnan(dw).all() and torch.isfinite(db).all()


# Unaligned 16-bit rows (not a multiple of 8); the kernels are the same code for both 16-bit
# dtypes, so each row length runs in one of them.
# (exhaustive: seconds per case in the interpreter; test_layernorm_backward_memory.py's
# test_dx_pieces_kernel_matches_float64 runs ln_bwd_dx_pieces by default)
@EXHAUSTIVE
@pytest.mark.parametrize("n,dtype", [(67, torch.bfloat16), (41, torch.float16)], ids=str)
@pytest.mark.parametrize("mode", ["low_memory", "fast"])
def test_dx_pieces_backward_matches_float64(monkeypatch, triton_backend, device, dtype, n, mode,
                                            launch_rules):
    """Long unaligned 16-bit rows (here: longer than a 32-column fused block) take dx from
    ln_bwd_dx_pieces on their aligned bodies (pieces of 16, so several per row, plus the
    edges) and dweight/dbias from the column kernel (DX_PIECES_BWD): rows of every
    misalignment against float64, with and without weight, for each gradient subset; a NaN row
    stays in its row (dx) and dweight; a dy with its own row stride takes the other path."""
    from fusedops.backends.triton import layernorm as tln
    from fusedops.backends.triton import layernorm_bwd as tlnb
    from fusedops.backends.triton.configs import layernorm as ln_rules

    launch_rules("layernorm", FUSED_BWD_MAX_BLOCK=32)
    launch_rules("layernorm", DX_PIECES_BWD=(16, 1))
    torch.manual_seed(n)
    m = 11
    x = (torch.randn(m, n, device=device) * 3 + 2).to(dtype)
    dy = torch.randn(m, n, device=device).to(dtype)
    w = torch.randn(n, device=device).to(dtype)
    assert ln_rules.dx_pieces_plan(n, 2, ln_backward_vec(x, dy))[1:3] == (16, 8)
    assert ln_rules.dx_pieces_plan(n, 4, ln_backward_vec(x.float(), dy.float())) is None
    _, mean, rstd = tln.layernorm_forward(x, w, None, 1e-5, dtype)
    r = [t.detach().double().requires_grad_(True) for t in (x, w)]
    want = torch.autograd.grad(F.layer_norm(r[0], (n,), r[1]), r, dy.double())
    want_nw = torch.autograd.grad(F.layer_norm(r[0], (n,)), r[0], dy.double())[0]
    with fusedops.layernorm_backward_mode(mode):
        for parts in [(True, True, True), (True, False, False), (True, False, True)]:
            dx, dw, db = tlnb.layernorm_backward(dy, x, w, mean, rstd, *parts)
            assert_close_to_ref(dx, want[0], dtype, scale=4)
            assert (dw is None) != parts[1] and (db is None) != parts[2]
            if dw is not None:
                assert_row_sum_close(dw, want[1], m, scale=4)
            if db is not None:
                assert_row_sum_close(db, dy.double().sum(0), m, scale=4)
        dx, _, _ = tlnb.layernorm_backward(dy, x, None, mean, rstd, True, False, False)
        assert_close_to_ref(dx, want_nw, dtype, scale=4)
        wide = torch.zeros(m, n + 5, device=device, dtype=dtype)
        wide[:, :n] = dy
        assert ln_rules.dx_pieces_plan(n, 2, ln_backward_vec(x, wide[:, :n])) is None
        dx, dw, _ = tlnb.layernorm_backward(wide[:, :n], x, w, mean, rstd, True, True, False)
        assert_close_to_ref(dx, want[0], dtype, scale=4)
        assert_row_sum_close(dw, want[1], m, scale=4)
        x_nan = x.clone()
        x_nan[5, 7] = float("nan")
        _, mean, rstd = tln.layernorm_forward(x_nan, w, None, 1e-5, dtype)
        dx, dw, db = tlnb.layernorm_backward(dy, x_nan, w, mean, rstd, True, True, True)
    assert torch.isnan(dx[5]).all() and torch.isfinite(dx[torch.arange(m) != 5]).all()
    assert torch.isnan(dw).all() and torch.isfinite(db).all()


def _torch_error_far_from_zero(x, n, w, b, want):
    """PyTorch's own LayerNorm error on rows far from zero (mean 1e4, small spread), the bound
    for ours: the float32 rounding of the mean limits any kernel, while a cancelling variance
    would be orders of magnitude worse. CUDA's kernel needs parameters of x's dtype and uses
    another summation, so ours may trail it by a little there."""
    w, b = (t.to(x.dtype) if t is not None else None for t in (w, b))
    theirs = (F.layer_norm(x, (n,), w, b).double() - want).abs().max()
    return theirs * (1.25 if x.is_cuda else 1.0)


def _ln_rows_far_and_near(n: int, device, dtype, affine: bool):
    """Six rows of n columns at row stride 72 (not contiguous), the first three far from zero
    (1e4 + small spread), and float32 weight/bias (or None): (x, w, b)."""
    torch.manual_seed(n)
    base = torch.randn(6, 72, device=device, dtype=torch.float64)
    base[:3] = 1e4 + base[:3] * 1e-2
    w = torch.randn(n, device=device) if affine else None
    b = torch.randn(n, device=device) if affine else None
    return base.to(dtype)[:, :n], w, b


def _check_ln_forward(x, w, b, dtype, far: int):
    """LayerNorm forward of rows x (the first ``far`` of them far from zero) against float64:
    y, mean, rstd, and the statistics-free call bitwise equal to it."""
    from fusedops.backends.triton import layernorm as tln

    n = x.shape[1]
    x64 = x.double()
    w64, b64 = (t.double() if t is not None else None for t in (w, b))
    want = F.layer_norm(x64, (n,), w64, b64)
    y, mean, rstd = tln.layernorm_forward(x, w, b, 1e-5, dtype)
    assert_close_to_ref(y[far:], want[far:], dtype, scale=4)
    # rows at 1e4: the float32 rounding of the mean itself bounds any kernel; no worse than torch
    ours = (y[:far].double() - want[:far]).abs().max()
    assert ours <= _torch_error_far_from_zero(x[:far], n, w, b, want[:far])
    torch.testing.assert_close(mean.double(), x64.mean(-1), atol=1e-6, rtol=1e-6)
    var = x64.var(-1, unbiased=False)
    torch.testing.assert_close(rstd[far:].double(), (var[far:] + 1e-5).rsqrt(), atol=0,
                               rtol=1e-4)
    assert torch.equal(tln.layernorm_forward_y(x, w, b, 1e-5, dtype), y)


# (the diagonal's first two cases: both dtypes, both THIRD_READ settings; the third exhaustive)
@exhaustive_unless(one_of_each({"dtype": DTYPES, "n": [64, 50, 40], "affine": [True, False],
                                "third": [False, True]},
                               where=lambda dtype, n, affine, third: n != 40))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [64, 50, 40])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("third", [False, True], ids=["keep", "third-read"])
def test_reload_kernels_match_float64(monkeypatch, triton_backend, device, dtype, n, affine,
                                      third, launch_rules):
    """The reload kernels (row read whole, then again in chunks from L2) on short rows: the
    rules shrunk to 64-element rows in 16-element second-pass chunks, so rows shorter than the
    padded block and chunks past the row's end are exercised; rows far from zero (mean 1e4,
    small spread) check the statistics' shift, strided x the row stride (float32 parameters
    with 16-bit rows: mixed dtypes). ``third``: the forward's THIRD_READ variant (x read again
    for the variance)."""
    from fusedops.backends.triton import layernorm as tln
    from fusedops.backends.triton import softmax as tsm

    elt = torch.empty((), dtype=dtype).element_size()
    launch_rules("layernorm", RELOAD_FWD={(elt, 64): (16, 4, third)})
    launch_rules("softmax", RELOAD_BWD={(elt, 64): (16, 4)})
    launch_rules("layernorm", RELOAD_FWD_ABOVE=0)
    launch_rules("softmax", RELOAD_BWD_ABOVE=0)
    calls = []
    real = tln._launch_fwd_reload
    monkeypatch.setattr(tln, "_launch_fwd_reload",
                        lambda g, a, w: calls.append(a[10]) or real(g, a, w))
    x, w, b = _ln_rows_far_and_near(n, device, dtype, affine)
    _check_ln_forward(x, w, b, dtype, far=3)
    assert calls == [64, 64]

    s = torch.softmax(torch.randn(6, n, device=device, dtype=torch.float64), -1)
    g = torch.randn(6, 2 * n, device=device, dtype=torch.float64)[:, :n]  # strided dy
    dx = tsm.softmax_backward(s.to(dtype), g.to(dtype), dtype)
    s_, g_ = s.to(dtype).double(), g.to(dtype).double()
    assert_close_to_ref(dx, s_ * (g_ - (s_ * g_).sum(-1, keepdim=True)), dtype, scale=4)


def _per_gpu_rules() -> list[tuple[int, int, int]]:
    """(padded row, chunk, warps) of the per-GPU 16-bit unrolled rules a power-of-two row of
    that length takes (the first config: its chunk divides the row)."""
    from fusedops.backends.triton.configs import layernorm as ln_rules

    return sorted({(padded, *configs[0]) for rules in ln_rules.UNROLLED_FWD_GPU.values()
                   for (elt, padded), configs in rules.items() if elt == 2 and configs[0][1]})


@pytest.mark.parametrize("n,chunk,warps", _per_gpu_rules())
def test_unrolled_forward_h100_configs(monkeypatch, triton_backend, device, n, chunk, warps,
                                       launch_rules):
    """The per-GPU 16-bit rules (UNROLLED_FWD_GPU) at their own shapes and configs, checked
    against float64."""
    from fusedops.backends.triton import layernorm as tln

    launch_rules("layernorm", UNROLLED_FWD={(2, n): ((chunk, warps),)})
    calls = []
    real = tln._launch_fwd_unrolled
    monkeypatch.setattr(tln, "_launch_fwd_unrolled",
                        lambda g, a, w: calls.append((a[10], a[11], w)) or real(g, a, w))
    torch.manual_seed(n)
    base = torch.randn(4, n + 8, device=device, dtype=torch.float64)  # strided rows
    base[:2] = 1e4 + base[:2] * 1e-2
    w, b = torch.randn(n, device=device), torch.randn(n, device=device)
    _check_ln_forward(base.to(torch.bfloat16)[:, :n], w, b, torch.bfloat16, far=2)
    assert calls and set(calls) == {(n, chunk, warps)}


@exhaustive_unless(one_of_each({"dtype": DTYPES, "n,chunk": [(64, 16), (48, 16), (16, 16)],
                                "affine": [True, False]}))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,chunk", [(64, 16), (48, 16), (16, 16)], ids=["4x", "3x", "1x"])
@pytest.mark.parametrize("affine", [True, False])
def test_unrolled_forward_matches_float64(monkeypatch, triton_backend, device, dtype, n, chunk,
                                          affine, launch_rules):
    """ln_fwd_unrolled (row length a compile-time multiple of the chunk, both passes
    unrolled): one, three and four chunks per row, rows far from zero (the per-lane shift),
    strided x, mixed parameter dtypes; a row length that is no multiple of its rule's chunk
    takes the other kernels."""
    from fusedops.backends.triton import layernorm as tln

    elt = torch.empty((), dtype=dtype).element_size()
    launch_rules("layernorm", UNROLLED_FWD={(elt, rt_device.next_pow2(n)): ((chunk, 4),)})
    launch_rules("layernorm", UNROLLED_FWD_ABOVE=0)
    calls = []
    real = tln._launch_fwd_unrolled

    class Spy:  # records (N, CHUNK) of each launch; launch plans still get the real entry
        entry = real.entry

        def __call__(self, grid, args, warps):
            calls.append((args[10], args[11]))
            return real(grid, args, warps)
    monkeypatch.setattr(tln, "_launch_fwd_unrolled", Spy())
    x, w, b = _ln_rows_far_and_near(n, device, dtype, affine)
    _check_ln_forward(x, w, b, dtype, far=3)
    assert calls == [(n, chunk)] * 2
    # constant rows: mean exact, variance zero (y = bias)
    c = torch.full((2, n), 3.0, device=device, dtype=dtype)
    y, mean, rstd = tln.layernorm_forward(c, w, b, 1e-5, dtype)
    assert torch.equal(mean, torch.full_like(mean, 3.0))
    torch.testing.assert_close(rstd, torch.full_like(rstd, 1e-5 ** -0.5), atol=0, rtol=1e-6)
    want = (b.double() if affine else torch.zeros(n, device=device, dtype=torch.float64))
    assert_close_to_ref(y, want.expand(2, n), dtype)
    calls.clear()
    launch_rules("layernorm", UNROLLED_FWD={(elt, 64): ((16, 4),)})
    tln.layernorm_forward(torch.randn(6, 40, device=device, dtype=dtype), None, None, 1e-5,
                          dtype)  # 40 % 16 != 0
    assert calls == []


@exhaustive_unless(one_of_each({"dtype": [torch.float32, torch.bfloat16], "n": [64, 48],
                                "cfg": [(16, 4), (16, 4, 32)], "unroll": [True, False]}))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [64, 48])  # 48: aligned rows, no power of two
@pytest.mark.parametrize("cfg", [(16, 4), (16, 4, 32)], ids=["whole", "pieces"])
@pytest.mark.parametrize("unroll", [True, False], ids=["even", "masked"])
def test_softmax_backward_reload_variants(monkeypatch, triton_backend, device, dtype, n, cfg,
                                          unroll, launch_rules):
    """The softmax backward reload kernel, first pass whole or in pieces, with power-of-two rows
    unrolled without masks (EVEN) or masked like every other row; strided dy."""
    from fusedops.backends.triton import softmax as tsm

    elt = torch.empty((), dtype=dtype).element_size()
    launch_rules("softmax", RELOAD_BWD={(elt, 64): cfg})
    launch_rules("softmax", RELOAD_BWD_ABOVE=0)
    launch_rules("softmax", UNROLL_RELOAD_BWD=unroll)
    calls = []
    real = tsm._launch_bwd_looped
    monkeypatch.setattr(tsm, "_launch_bwd_looped",
                        lambda g, a, w: calls.append(a[7:]) or real(g, a, w))
    torch.manual_seed(n)
    s = torch.softmax(torch.randn(5, n, device=device, dtype=torch.float64), -1)
    g = torch.randn(5, 2 * n, device=device, dtype=torch.float64)[:, :n]
    dx = tsm.softmax_backward(s.to(dtype), g.to(dtype), dtype)
    s_, g_ = s.to(dtype).double(), g.to(dtype).double()
    assert_close_to_ref(dx, s_ * (g_ - (s_ * g_).sum(-1, keepdim=True)), dtype, scale=4)
    whole = 0 if len(cfg) == 3 else 64
    assert calls == [(16, whole, cfg[2] if whole == 0 else 16, 64 if unroll and n == 64 else 0)]


def _check_softmax_special_rows(rows: int, n: int, device, dtype) -> torch.Tensor:
    """Softmax forward of ``rows`` rows (at least 6) of 80 columns cut to ``n``, strided then
    contiguous, against float64 torch: rows with -inf (masked attention), all -inf (NaN, as
    torch), a NaN, far from zero, a +inf (NaN, as torch). Returns the (rows, 80) input."""
    from fusedops.backends.triton import softmax as tsm

    torch.manual_seed(n)
    base = torch.randn(rows, 80, device=device, dtype=torch.float64) * 4
    base[1, ::3] = -float("inf")
    base[2] = -float("inf")
    base[3, 5] = float("nan")
    base[4] += 1e4
    base[5, 7] = float("inf")
    x = base.to(dtype)
    for xs in (x[:, :n], x[:, :n].contiguous()):  # row stride 80, then n
        y = tsm.softmax_forward(xs, dtype)
        want = torch.softmax(xs.double(), -1)
        torch.testing.assert_close(y.double(), want.to(dtype).double(), equal_nan=True,
                                   **tol(dtype, 2))
    return x


# (the diagonal's power-of-two row and its bfloat16 masked row; the others exhaustive)
@exhaustive_unless(one_of_each({"dtype": DTYPES, "n": [64, 48, 50], "chunk": [16, 64]},
                               where=lambda dtype, n, chunk: n != 50))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [64, 48, 50])  # a power of two (EVEN), 48 and 50 masked
@pytest.mark.parametrize("chunk", [16, 64])
def test_softmax_forward_reload(monkeypatch, triton_backend, device, dtype, n, chunk, launch_rules):
    """The softmax forward reload kernel (row read whole for max and sum, then again in chunks
    to write y) with its rule shrunk to 64-element rows: the unrolled power-of-two row, masked
    rows shorter than the padded block, chunks past the row's end, a strided input; rows with
    -inf (masked attention), all -inf (NaN, as torch), a NaN, a +inf, rows far from zero."""
    from fusedops.backends.triton import softmax as tsm

    elt = torch.empty((), dtype=dtype).element_size()
    launch_rules("softmax", RELOAD_FWD={(elt, 64): (chunk, 4)})
    launch_rules("softmax", RELOAD_FWD_ABOVE=0)
    monkeypatch.setattr(tsm, "_fwd_plans", rt_plans.PlanCache())
    calls = []
    real = tsm._launch_fwd_reload
    monkeypatch.setattr(tsm, "_launch_fwd_reload",
                        lambda g, a, w: calls.append((g, a[5:], w)) or real(g, a, w))
    _check_softmax_special_rows(7, n, device, dtype)
    # contiguous rows of 50 start unaligned: the single-block kernel's body + edges, not reload
    assert calls == [((7,), (64, chunk, 64 if n == 64 else 0), 4)] * (1 if n == 50 else 2)


# (bfloat16 rows of 48 in chunks of 16 by default; the others exhaustive)
@exhaustive_unless(lambda dtype, n, chunk: (n, dtype) == (48, torch.bfloat16))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n,chunk", [(64, 16), (48, 16), (16, 16)], ids=["4x", "3x", "1x"])
def test_softmax_forward_unrolled(monkeypatch, triton_backend, device, dtype, n, chunk,
                                  launch_rules):
    """softmax_fwd_unrolled (row length a compile-time multiple of the chunk, three unrolled
    passes): one, three and four chunks, strided and contiguous rows with -inf (masked
    attention), all -inf (NaN, as torch), a NaN, +inf (NaN, as torch) and rows far from zero;
    a length no config divides takes the other kernels."""
    from fusedops.backends.triton import softmax as tsm

    elt = torch.empty((), dtype=dtype).element_size()
    launch_rules("softmax", UNROLLED_FWD={(elt, rt_device.next_pow2(n)): ((chunk, 4),)})
    launch_rules("softmax", UNROLLED_FWD_ABOVE=0)
    monkeypatch.setattr(tsm, "_fwd_plans", rt_plans.PlanCache())
    calls = []
    real = tsm._launch_fwd_unrolled

    class Spy:  # records (N, CHUNK, warps); launch plans still get the real C entry
        entry = real.entry

        def __call__(self, grid, args, warps):
            calls.append((args[5], args[6], warps))
            return real(grid, args, warps)
    monkeypatch.setattr(tsm, "_launch_fwd_unrolled", Spy())
    x = _check_softmax_special_rows(8, n, device, dtype)
    assert calls == [(n, chunk, 4)] * 2
    calls.clear()
    launch_rules("softmax", UNROLLED_FWD={(elt, 64): ((16, 4),)})
    tsm.softmax_forward(x[:, :40], dtype)  # 40 % 16 != 0
    assert calls == []


@exhaustive_unless(lambda dtype, n: (n, dtype) == (67, torch.float32))  # (others: exhaustive)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [67, 73, 79])
def test_softmax_forward_unrolled_for_unaligned_rows(monkeypatch, triton_backend, device, dtype,
                                                     n, launch_rules):
    """softmax_fwd_unrolled_vec (unaligned rows: the first (n // VEC - 1)·VEC body elements
    in unrolled 16-element chunks, a partial last chunk masked where 16 does not divide it,
    the head and tail in the edge tile) with its rule shrunk to 64-element bodies: 17
    contiguous rows cover every head 0..VEC-1, with -inf, all -inf, NaN, +inf and far rows
    (_check_softmax_special_rows); the strided pass (row stride 80) takes the other kernels."""
    from fusedops.backends.triton import softmax as tsm

    elt = torch.empty((), dtype=dtype).element_size()
    launch_rules("softmax", UNROLLED_VEC_FWD={(elt, 64): (16, 1), (elt, 128): (16, 1)})
    launch_rules("softmax", RELOAD_FWD_ABOVE=0)
    calls = []
    real = tsm._launch_fwd_unrolled_vec
    monkeypatch.setattr(tsm, "_launch_fwd_unrolled_vec",
                        lambda g, a, w: calls.append((g, a[4], a[5], a[6])) or real(g, a, w))
    _check_softmax_special_rows(17, n, device, dtype)
    vec = 16 // elt
    assert calls == [((17,), n, (n // vec - 1) * vec, 16)]


def _unaligned_rows_and_affine(n: int, device, dtype, affine: str):
    """(x, weight, bias) for the unaligned-row forward tests: 17 rows of ``n`` (every head
    0..VEC-1), the first 4 far from zero (mean 1e4, spread 1e-2: the statistics' shift);
    ``affine`` in both / weight / bias / none / fp32-weight (a float32 weight, no bias)."""
    torch.manual_seed(n)
    base = torch.randn(17, n, device=device, dtype=torch.float64)
    base[:4] = 1e4 + base[:4] * 1e-2
    wdt = torch.float32 if affine == "fp32-weight" else dtype
    w = torch.randn(n, device=device, dtype=wdt) if affine not in ("bias", "none") else None
    b = torch.randn(n, device=device, dtype=dtype) if affine in ("both", "bias") else None
    return base.to(dtype), w, b


# (the diagonal's float32 rows of 33; the others exhaustive)
@exhaustive_unless(one_of_each({"dtype": DTYPES, "n": [33, 39, 61],
                                "affine": ["both", "weight", "bias", "none", "fp32-weight"]},
                               where=lambda dtype, n, affine: (n, dtype) == (33, torch.float32)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [33, 39, 61])
@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none", "fp32-weight"])
def test_reload_kernel_for_unaligned_rows_matches_float64(monkeypatch, triton_backend, device,
                                                          dtype, n, affine, launch_rules):
    """ln_fwd_reload_vec (unaligned rows: aligned body read whole, then again in chunks, weight
    and bias from copies shifted per head) with its rule shrunk to 32/64-element bodies in
    16-element chunks: 17 rows cover every head 0..VEC-1 with bodies shorter than the padded
    block and chunks past the body's end; rows far from zero check the statistics' shift."""
    from fusedops.backends.triton import layernorm as tln

    elt = torch.empty((), dtype=dtype).element_size()
    launch_rules("layernorm", RELOAD_VEC_FWD={(elt, 32): (16, 4), (elt, 64): (16, 2)})
    launch_rules("layernorm", RELOAD_VEC_MIN_ELEMS=0)
    calls = []
    real = tln._launch_fwd_reload_vec
    monkeypatch.setattr(tln, "_launch_fwd_reload_vec",
                        lambda g, a, w: calls.append((g, a[10], a[11], a[15])) or real(g, a, w))
    _check_ln_forward(*_unaligned_rows_and_affine(n, device, dtype, affine), dtype, far=4)
    vec = 16 // elt
    block = rt_device.next_pow2(n // vec * vec)
    assert calls == [((17,), block, 16, vec)] * 2


# (the diagonal's float32 rows of 99 in two chunks; the others exhaustive)
@exhaustive_unless(one_of_each({"dtype": DTYPES, "n,chunk": [(67, 16), (73, 16), (99, 32)],
                                "affine": ["both", "weight", "none", "fp32-weight"]},
                               where=lambda dtype, n, chunk, affine:
                                   (n, dtype) == (99, torch.float32)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,chunk", [(67, 16), (73, 16), (99, 32)], ids=str)
@pytest.mark.parametrize("affine", ["both", "weight", "none", "fp32-weight"])
def test_unrolled_kernel_for_unaligned_rows_matches_float64(monkeypatch, triton_backend, device,
                                                            dtype, n, chunk, affine, launch_rules):
    """ln_fwd_unrolled_vec (unaligned rows: the first (n // VEC - 1)·VEC body elements in
    unrolled chunks, a partial last chunk masked (99/32, and 67/16 in bfloat16), the head and
    the up to 2·VEC - 1 tail elements in the edge tile) with its rule shrunk to 64/128-element
    bodies: 17 rows cover every head 0..VEC-1; rows far from zero check the statistics' shift."""
    from fusedops.backends.triton import layernorm as tln

    elt = torch.empty((), dtype=dtype).element_size()
    launch_rules("layernorm", UNROLLED_VEC_FWD={(elt, 64): (chunk, 1), (elt, 128): (chunk, 2)})
    launch_rules("layernorm", RELOAD_VEC_FWD={})
    launch_rules("layernorm", RELOAD_VEC_MIN_ELEMS=0)
    calls = []
    real = tln._launch_fwd_unrolled_vec
    monkeypatch.setattr(tln, "_launch_fwd_unrolled_vec",
                        lambda g, a, w: calls.append((g, a[10], a[11], a[12])) or real(g, a, w))
    _check_ln_forward(*_unaligned_rows_and_affine(n, device, dtype, affine), dtype, far=4)
    vec = 16 // elt
    assert calls == [((17,), n, (n // vec - 1) * vec, chunk)] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shifted_weights(triton_backend, device, dtype):
    """Row h of the shifted copies is the weight from column h on, zero-padded to a multiple of
    16 elements; weight and bias of one dtype share one allocation, otherwise each has its own;
    an absent tensor has none."""
    from fusedops.backends.triton import layernorm as tln

    n, vec = 37, 16 // torch.empty((), dtype=dtype).element_size()
    w = torch.randn(n, device=device, dtype=dtype)
    b = torch.randn(n, device=device, dtype=dtype)
    for wt, bt in ((w, b), (w, b.float()), (w, None), (None, b)):
        ws, bs, ld = tln._shifted_weights(wt, bt, vec, n)
        assert ld == 48
        for src, got in ((wt, ws), (bt, bs)):
            if src is None:
                assert got is None
                continue
            assert got.shape == (vec, ld) and got.dtype == src.dtype
            for h in range(vec):
                want = torch.zeros(ld, dtype=src.dtype, device=device)
                want[:n - h] = src[h:]
                assert torch.equal(got[h], want)


# (the diagonal's unaligned float32 row of 67; the others exhaustive)
@exhaustive_unless(one_of_each({"n": [64, 48, 67, 73, 79], "dtype": DTYPES},
                               where=lambda n, dtype: n == 67))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [64, 48, 67, 73, 79])
def test_softmax_backward_unrolled(monkeypatch, triton_backend, device, dtype, n, launch_rules):
    """softmax_bwd_unrolled with its rules shrunk to 64-element rows in 16-element chunks:
    aligned rows (64: four full chunks; 48: three) with a strided and an expanded (row stride 0)
    dy; unaligned rows (67, 73, 79: 17 rows cover every head 0..VEC-1, a partial last chunk
    where 16 does not divide the body, head and tail in the edge tile) with a contiguous dy, and
    with a strided dy, which takes the other kernels; rows with NaN and inf gradients."""
    from fusedops.backends.triton import softmax as tsm

    elt = torch.empty((), dtype=dtype).element_size()
    vec = 16 // elt
    launch_rules("softmax", UNROLLED_BWD={(elt, 64): ((16, 4),)})
    launch_rules("softmax", UNROLLED_VEC_BWD={(elt, 64): (16, 2), (elt, 128): (16, 1)})
    launch_rules("softmax", UNROLLED_BWD_ABOVE=0)
    calls = []
    real = tsm._launch_bwd_unrolled
    monkeypatch.setattr(tsm, "_launch_bwd_unrolled",
                        lambda g, a, w: calls.append((g, a[5], a[6], a[7], a[8])) or real(g, a, w))
    torch.manual_seed(n)
    rows = 17
    s = torch.softmax(torch.randn(rows, n, device=device, dtype=torch.float64) * 3, -1)
    g = torch.randn(rows, 2 * n, device=device, dtype=torch.float64)
    g[2, 5] = float("nan")
    g[3, n - 1] = float("inf")  # the last column: in the tail of every unaligned row
    s_, g = s.to(dtype), g.to(dtype)
    aligned = n % vec == 0
    dys = [g[:, :n].contiguous(), g[:, :n]] + ([g[:1, :n].expand(rows, n)] if aligned else [])
    for dy in dys:
        dx = tsm.softmax_backward(s_, dy, dtype)
        sd, gd = s_.double(), dy.double()
        want = sd * (gd - (sd * gd).sum(-1, keepdim=True))
        torch.testing.assert_close(dx.double(), want.to(dtype).double(), equal_nan=True,
                                   **tol(dtype, 4))
    body = n if aligned else (n // vec - 1) * vec
    launched = ((rows,), n, body, 16, 0 if aligned else vec)
    assert calls == [launched] * (3 if aligned else 1)
