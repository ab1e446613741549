"""The Triton RMSNorm kernels (fusedops.backends.triton.rmsnorm_forward / _forward_y / _backward,
the 2-D row contract) against a float64 oracle: F.rms_norm in float64 and autograd for dx/dweight.

On CPU they run through the Triton interpreter (conftest sets TRITON_INTERPRET=1 without CUDA),
so shapes stay small; the ``gpu`` tests at the end take large shapes on a CUDA device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_close_to_ref,
    exhaustive_unless,
    one_of_each,
    tol,
    triton_backend_module,
)

tb = triton_backend_module()

from fusedops.backends.triton.configs import common as tcfg  # noqa: E402
from fusedops.backends.triton.configs import rmsnorm as rms_rules  # noqa: E402

# Tensors are created on the GPU when there is one (conftest's _tensors_on_device).
ON_DEVICE = True

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5
GRAD_SCALE = 4.0  # dx and dweight are sums over a row / over rows


def _dev() -> torch.device:
    return torch.empty(0).device


def make(m: int, n: int, dtype: torch.dtype, w_mode: str, seed: int = 0):
    """(x, weight, dy): x scaled off 1 so rstd matters; w_mode "none", "same" (x's dtype) or
    "fp32" (float32 weight)."""
    g = torch.Generator().manual_seed(seed)  # CPU generator: same values on every device
    x = (2 * torch.randn(m, n, generator=g, device="cpu") + 0.3).to(dtype)
    dy = torch.randn(m, n, generator=g, device="cpu").to(dtype)
    w = None
    if w_mode != "none":
        w = (1 + 0.5 * torch.randn(n, generator=g, device="cpu")).to(
            torch.float32 if w_mode == "fp32" else dtype)
    dev = _dev()
    return x.to(dev), (None if w is None else w.to(dev)), dy.to(dev)


def oracle(x: torch.Tensor, w: torch.Tensor | None, dy: torch.Tensor, eps: float = EPS):
    """float64 (y, rstd, dx, dw) of F.rms_norm (dw None without a weight)."""
    n = x.shape[-1]
    x64 = x.detach().double().requires_grad_(True)
    w64 = None if w is None else w.detach().double().requires_grad_(True)
    y64 = F.rms_norm(x64, (n,), w64, eps)
    inputs = [x64] if w64 is None else [x64, w64]
    grads = torch.autograd.grad(y64, inputs, dy.double())
    rstd64 = torch.rsqrt(x64.detach().square().mean(-1) + eps)
    return y64.detach(), rstd64, grads[0], (grads[1] if w64 is not None else None)


def dw_oracle(x, dy, rstd64):
    """float64 Σ_rows dy · xhat (dweight's formula, also defined without a weight)."""
    return (dy.double() * x.double() * rstd64[:, None]).sum(0)


def check_all(x, w, dy, out_dtype=None, backward=True):
    """forward, forward_y and (``backward``) dx and dw against the oracle."""
    dtype = x.dtype
    out_dtype = out_dtype or dtype
    y64, rstd64, dx64, dw64 = oracle(x, w, dy)
    y, rstd = tb.rmsnorm_forward(x, w, EPS, out_dtype)
    assert y.shape == x.shape and y.dtype == out_dtype and y.is_contiguous()
    assert rstd.shape == (x.shape[0],) and rstd.dtype == torch.float32
    assert_close_to_ref(y, y64, dtype)
    torch.testing.assert_close(rstd.double(), rstd64, **tol(torch.float32))
    assert torch.equal(tb.rmsnorm_forward_y(x, w, EPS, out_dtype), y)
    if not backward:
        return
    dx, dw = tb.rmsnorm_backward(dy, x, w, rstd, True, True)
    assert dx.dtype == dtype and dx.shape == x.shape and dx.is_contiguous()
    assert dw.dtype == torch.float32 and dw.shape == (x.shape[1],)
    assert_close_to_ref(dx, dx64, dtype, GRAD_SCALE)
    expected_dw = dw64 if dw64 is not None else dw_oracle(x, dy, rstd64)
    assert_close_to_ref(dw, expected_dw, dtype, GRAD_SCALE)


def _w_modes(dtype):
    return ["none", "same"] + (["fp32"] if dtype != torch.float32 else [])


CASES = [pytest.param(dtype, w_mode, id=f"{str(dtype)[6:]}-{w_mode}")
         for dtype in DTYPES for w_mode in _w_modes(dtype)]


# (the diagonal but its 16-bit rows of 1025, exhaustive)
@exhaustive_unless(one_of_each({"dtype,w_mode": [(c.values[0], c.values[1]) for c in CASES],
                                "n": [1, 31, 32, 33, 1000, 1025], "m": [1, 3, 17]},
                               where=lambda n, m, dtype, w_mode:
                                   (n != 1025 or dtype == torch.float32)))
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("n", [1, 31, 32, 33, 1000, 1025])
@pytest.mark.parametrize("dtype, w_mode", CASES)
def test_matches_float64(n, m, dtype, w_mode):
    x, w, dy = make(m, n, dtype, w_mode, seed=n * 31 + m)
    check_all(x, w, dy)


def test_float32_output_of_16bit_input():
    """out_dtype other than x's (float32 under autocast)."""
    x, w, dy = make(5, 100, torch.bfloat16, "fp32")
    check_all(x, w, dy, out_dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [33, 1000])
def test_row_strides(n, dtype):
    """x and dy as column slices of wider tensors (row strides > N, different from each other)."""
    xw, w, dyw = make(6, n + 24, dtype, "same", seed=n)
    x, dy = xw[:, :n], dyw[:, 8:8 + n]
    w = w[:n].contiguous()
    assert x.stride(0) == n + 24 and not x.is_contiguous()
    check_all(x, w, dy)


@exhaustive_unless(lambda n, need: n == 33)  # (rows of 1025: exhaustive)
@pytest.mark.parametrize("n", [33, 1025])
@pytest.mark.parametrize("need", [(True, False), (False, True), (False, False)])
def test_need_combinations(n, need):
    x, w, dy = make(5, n, torch.float16, "fp32", seed=n)
    _, rstd64, dx64, dw64 = oracle(x, w, dy)
    rstd = tb.rmsnorm_forward(x, w, EPS, x.dtype)[1]
    dx, dw = tb.rmsnorm_backward(dy, x, w, rstd, *need)
    assert (dx is not None) == need[0] and (dw is not None) == need[1]
    if need[0]:
        assert_close_to_ref(dx, dx64, x.dtype, GRAD_SCALE)
    if need[1]:
        assert_close_to_ref(dw, dw64, x.dtype, GRAD_SCALE)


def test_dw_in_grad_dtype():
    """dweight rounded once into grad_dtypes[0] when given; (None,) means float32."""
    x, w, dy = make(7, 40, torch.bfloat16, "same", seed=3)
    _, _, _, dw64 = oracle(x, w, dy)
    rstd = tb.rmsnorm_forward(x, w, EPS, x.dtype)[1]
    _, dw = tb.rmsnorm_backward(dy, x, w, rstd, False, True, grad_dtypes=(torch.bfloat16,))
    assert dw.dtype == torch.bfloat16
    assert_close_to_ref(dw, dw64, torch.bfloat16, GRAD_SCALE)
    _, dw32 = tb.rmsnorm_backward(dy, x, w, rstd, False, True, grad_dtypes=(None,))
    assert dw32.dtype == torch.float32


@pytest.mark.parametrize("m, n", [(0, 33), (3, 0), (0, 0)])
def test_empty(m, n):
    x = torch.randn(m, n).to(torch.bfloat16)
    w = torch.ones(n)
    y, rstd = tb.rmsnorm_forward(x, w, EPS, x.dtype)
    assert y.shape == (m, n) and rstd.shape == (m,) and rstd.dtype == torch.float32
    assert tb.rmsnorm_forward_y(x, w, EPS, x.dtype).shape == (m, n)
    dx, dw = tb.rmsnorm_backward(x, x, w, rstd, True, True)
    assert dx.shape == (m, n) and dx.dtype == x.dtype
    assert dw.shape == (n,) and dw.dtype == torch.float32 and not dw.any()


def _fwd_limit() -> int:
    return min(tcfg.single_block_limit(), tcfg.KIND_CAPS["ln_fwd"])


def _bwd_limit() -> int:
    return min(tcfg.single_block_limit(), rms_rules.FUSED_BWD_MAX_BLOCK_UNALIGNED)


def test_unaligned_16k_rows_fused_on_32_warps(launch_rules):
    """Rows of 8K-16K whose N is not a multiple of 16, on scalar accesses (the body/edge
    split off): the fused backward on 32 warps."""
    assert rms_rules.bwd_config(16384, 2, aligned=False) == (1, 32, 1, True)
    assert rms_rules.bwd_config(16384, 2) == rms_rules.BWD_RULES_16BIT[16384]
    assert rms_rules.bwd_config(16384, 4) == (1, 16, 1, True)  # float32: one 16-warp program per SM
    assert rms_rules.bwd_config(8192, 2) == rms_rules.BWD_RULES_16BIT[8192]
    assert rms_rules.bwd_config(8192, 2, aligned=False) != rms_rules.BWD_RULES_16BIT[8192]
    launch_rules("rmsnorm", VEC_EDGES=False)
    if _bwd_limit() >= 16384:
        x, w, dy = make(2, 8193, torch.bfloat16, "fp32", seed=13)
        check_all(x, w, dy)


@exhaustive_unless(lambda dtype: dtype == torch.float32)  # (bfloat16: exhaustive)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_rows_backward_looped(dtype, launch_rules):
    """One column past the fused backward's limit, on scalar accesses (the body/edge split
    off; split rows do not run here): the looped dx kernel and the column kernel (the forward
    still single-block)."""
    launch_rules("rmsnorm", VEC_EDGES=False)
    n = _bwd_limit() + 1
    assert n <= _fwd_limit()
    x, w, dy = make(2, n, dtype, "same", seed=5)
    check_all(x, w, dy)


# (one column past the limit: exhaustive; the looped kernels run by default in
# test_looped_kernels)
@exhaustive_unless(lambda extra: extra == 0)
@pytest.mark.parametrize("extra", [0, 1], ids=["limit", "looped"])
def test_long_rows_forward(extra, launch_rules):
    """The forward's single-block limit (the weight reloaded per tile there) and one column
    past it (every kernel a looped one)."""
    launch_rules("rmsnorm", UNROLLED_FWD={})  # (aligned 32K rows would take the unrolled kernel)
    x, w, dy = make(2, _fwd_limit() + extra, torch.bfloat16, "fp32", seed=6)
    check_all(x, w, dy, backward=bool(extra))  # (the backward at the limit: as past it)


# (the diagonal's rows of 17 and 33; the longer one, more chunks of the same loop, exhaustive)
@exhaustive_unless(lambda n, dtype: (n, dtype) in ((17, DTYPES[0]), (33, DTYPES[1])))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [17, 33, 100])
def test_looped_kernels(small_single_block, n, dtype):
    """A 16-element single-block limit: short rows in several chunks through the looped
    forward, the looped dx kernel and the column kernel."""
    x, w, dy = make(3, n, dtype, "fp32" if dtype != torch.float32 else "same", seed=n)
    check_all(x, w, dy)
    x, _, dy = make(3, n, dtype, "none", seed=n + 1)
    check_all(x, None, dy)


def test_looped_kernels_strides(small_single_block):
    """Looped kernels on column slices of wider tensors (row strides > N)."""
    xw, w, dyw = make(3, 50, torch.float32, "same", seed=9)
    x, dy, w = xw[:, 3:36], dyw[:, :33], w[:33].contiguous()
    check_all(x, w, dy)


def test_column_kernel_splits(small_single_block):
    """Enough rows that the dweight column kernel splits them (float32 partials summed in a
    fixed order): close to the oracle and the same bits on every run. (rstd from the PyTorch
    reference: the looped forward over this many rows is slow in the interpreter.)"""
    from fusedops.backends import reference

    xw, w, dy = make(130, 40, torch.bfloat16, "fp32", seed=10)
    x, w, dy = xw[:, :33], w[:33].contiguous(), dy[:, 7:40]
    _, _, _, dw64 = oracle(x, w, dy)
    rstd = reference.rmsnorm_forward(x, w, EPS, x.dtype)[1]
    runs = [tb.rmsnorm_backward(dy, x, w, rstd, False, True)[1] for _ in range(2)]
    assert_close_to_ref(runs[0], dw64, x.dtype, GRAD_SCALE)
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("persistent", [False, True])
def test_forward_rules(monkeypatch, persistent, launch_rules):
    """A measured forward rule (FWD_RULES: rows per program, warps, persistent grid) in place of
    LayerNorm's: the same results, tiles looped over by fewer programs when persistent."""
    launch_rules("rmsnorm", FWD_RULES={(4, 64): (2, 2, persistent)})
    x, w, dy = make(11, 64, torch.float32, "same", seed=12)
    check_all(x, w, dy)


def test_deterministic():
    """dweight (per-program partials summed in a fixed order: the shape gives 8 programs for
    9 row tiles) and dx: the same bits on every run."""
    x, w, dy = make(17, 1025, torch.float32, "same", seed=11)
    runs = []
    for _ in range(2):
        rstd = tb.rmsnorm_forward(x, w, EPS, x.dtype)[1]
        runs.append((rstd, *tb.rmsnorm_backward(dy, x, w, rstd, True, True)))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- GPU (compiled)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n", [(4096, 4096), (64, 65536), (8192, 1000), (3000, 8193),
                                  (16, 32769), (1024, 8192), (256, 32768), (512, 16384),
                                  (700, 2048)])
@pytest.mark.parametrize("dtype, w_mode", [(torch.bfloat16, "fp32"), (torch.bfloat16, "same"),
                                           (torch.float32, "same"), (torch.float16, "none")],
                         ids=["bf16-fp32w", "bf16", "fp32", "fp16-now"])
def test_gpu_large(m, n, dtype, w_mode):
    x, w, dy = make(m, n, dtype, w_mode, seed=m + n)
    x, dy, w = x.cuda(), dy.cuda(), (None if w is None else w.cuda())
    check_all(x, w, dy)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n", [(4096, 4096), (64, 65536)])
def test_gpu_deterministic(m, n):
    x, w, dy = make(m, n, torch.bfloat16, "fp32", seed=1)
    x, dy, w = x.cuda(), dy.cuda(), w.cuda()
    rstd = tb.rmsnorm_forward(x, w, EPS, x.dtype)[1]
    first = tb.rmsnorm_backward(dy, x, w, rstd, True, True)
    for _ in range(3):
        again = tb.rmsnorm_backward(dy, x, w, rstd, True, True)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
