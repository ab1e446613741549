"""The RMSNorm kernels LayerNorm's refinements brought: unaligned rows as an aligned body plus
edges (forward single-block and reload kernels, the weight from shifted copies; the fused
backward's rms_bwd_vec), split rows for long rows (rms_fwd_split, rms_bwd_split, in
clusters on Hopper) and the unrolled forward of aligned rows (rms_fwd_unrolled, its launch
plans replayed), each against a float64 oracle, each asserting from the recorded launches
that it ran (a silent fallback fails), and the launch rules that pick them.

CPU: the Triton interpreter; the split-row kernels with their programs as concurrent threads
(tests/_concurrent_programs.py), on rows shrunk to a few pieces of a few dozen columns. GPU
(``gpu`` marker): the same paths at real sizes with the shipped rules.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    HAS_CUDA,
    INTERPRETING,
    assert_close_to_ref,
    assert_row_sum_close,
    exhaustive_unless,
    one_of_each,
    tol,
    triton_backend_module,
)

tb = triton_backend_module()

from _concurrent_programs import concurrent_programs  # noqa: E402

from fusedops.backends.triton import rmsnorm as trms  # noqa: E402
from fusedops.backends.triton import rmsnorm_bwd as trmsb  # noqa: E402
from fusedops.backends.triton.configs import rmsnorm as rms_rules  # noqa: E402
from fusedops.backends.triton.runtime import split as rt_split  # noqa: E402
from fusedops.backends.triton.runtime.facts import DeviceFacts, device_facts  # noqa: E402
from fusedops.backends.triton.runtime.launcher import Launcher  # noqa: E402
from fusedops.backends.triton.runtime.recording import record_launches  # noqa: E402

ON_DEVICE = True  # tensors on the GPU where there is one (conftest's _tensors_on_device)
EPS = 1e-5
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
GRAD = 4.0  # dx and dweight are sums over a row / over rows
# The VEC constexpr's place in each kernel's arguments (the launch's last or next-to-last).
VEC_AT = {"rms_fwd_single": -1, "rms_fwd_reload_vec": -1, "rms_fwd_unrolled_vec": -1,
          "rms_bwd_vec": -1,
          "rms_fwd_split": -2, "rms_bwd_split": -2}


def _dev() -> torch.device:
    return torch.empty(0).device


def make(m: int, n: int, dtype: torch.dtype, w_mode: str = "same", seed: int = 0):
    """(x, weight, dy) on the test device: x off zero so rstd matters; w_mode "none", "same"
    (x's dtype) or "fp32"."""
    g = torch.Generator().manual_seed(seed)  # a CPU generator: the same values on any device
    x = (2 * torch.randn(m, n, generator=g, device="cpu") + 0.3).to(dtype)
    dy = torch.randn(m, n, generator=g, device="cpu").to(dtype)
    w = None if w_mode == "none" else (1 + 0.5 * torch.randn(n, generator=g, device="cpu")).to(
        FP32 if w_mode == "fp32" else dtype)
    return x.to(_dev()), None if w is None else w.to(_dev()), dy.to(_dev())


def oracle(x, w, dy):
    """float64 y, rstd, dx, and dweight (Σ dy·x̂ also without a weight) of F.rms_norm."""
    n = x.shape[-1]
    x64 = x.detach().double().requires_grad_(True)
    w64 = None if w is None else w.detach().double().requires_grad_(True)
    y64 = F.rms_norm(x64, (n,), w64, EPS)
    grads = torch.autograd.grad(y64, [x64] + ([w64] if w64 is not None else []), dy.double())
    rstd64 = torch.rsqrt(x64.detach().square().mean(-1) + EPS)
    dw64 = grads[1] if w64 is not None else (dy.double() * x.double() * rstd64[:, None]).sum(0)
    return y64.detach(), rstd64, grads[0], dw64


def launched(record) -> dict[str, list[tuple]]:
    """Kernel name -> the argument tuples of its launches, from a LaunchRecord."""
    out: dict[str, list[tuple]] = {}
    for launcher, _grid, args, _warps in record:
        out.setdefault(launcher.kernel.__name__, []).append(args)
    return out


def vecs(runs: dict, name: str) -> list[int]:
    return [args[VEC_AT[name]] for args in runs.get(name, [])]


def check(x, w, dy, need=(True, True), stats=True):
    """Forward (with rstd, and ``stats`` False: y only) and the backward's needed gradients
    against the oracle; returns the launches made (kernel name -> argument tuples)."""
    dtype = x.dtype
    y64, rstd64, dx64, dw64 = oracle(x, w, dy)
    with record_launches() as record:
        y, rstd = tb.rmsnorm_forward(x, w, EPS, dtype)
        y_only = tb.rmsnorm_forward_y(x, w, EPS, dtype) if not stats else y
        dx, dw = tb.rmsnorm_backward(dy, x, w, rstd, *need)
    assert_close_to_ref(y, y64, dtype)
    assert_close_to_ref(y_only, y64, dtype)
    torch.testing.assert_close(rstd.double(), rstd64, **tol(FP32))
    assert (dx is not None) == need[0] and (dw is not None) == need[1]
    if need[0]:
        assert dx.dtype == dtype and dx.is_contiguous()
        assert_close_to_ref(dx, dx64, dtype, GRAD)
    if need[1]:
        assert dw.dtype == FP32
        assert_row_sum_close(dw, dw64, x.shape[0], GRAD)
    return launched(record)


# ------------------------------------------------------------------ aligned body and edges


def _vec_expected(n: int, dtype: torch.dtype) -> int:
    vec = 16 // torch.empty((), dtype=dtype).element_size()
    return vec if n % vec and n >= 2 * vec else 0


FWD_ROWS = [(BF16, 15), (BF16, 16), (BF16, 17), (BF16, 23), (BF16, 25), (BF16, 1025),
            (FP16, 33), (FP32, 7), (FP32, 8), (FP32, 9), (FP32, 13), (FP32, 1023)]


# (the diagonal's single rows and its float32 cases; the others exhaustive)
@exhaustive_unless(one_of_each({"dtype,n": FWD_ROWS, "w_mode": ["none", "same", "fp32"],
                                "m": [1, 17]},
                               where=lambda dtype, n, w_mode, m: (m == 1 or dtype == FP32)))
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("w_mode", ["none", "same", "fp32"])
@pytest.mark.parametrize("dtype,n", FWD_ROWS, ids=str)
def test_forward_body_and_edges(dtype, n, w_mode, m):
    """Row lengths around the vector width (VEC elements per 16 bytes): rows that start
    unaligned run the single-block kernel on an aligned body plus edges (VEC > 0); aligned
    rows and rows shorter than two vectors do not."""
    x, w, dy = make(m, n, dtype, w_mode, seed=n + m)
    runs = check(x, w, dy, need=(True, w is not None), stats=m == 1)
    assert vecs(runs, "rms_fwd_single") == [_vec_expected(n, dtype)] * (1 if m == 1 else 2)


# (the other cases: exhaustive)
@exhaustive_unless(lambda case: case in ("column-slice", "offset-misaligned"))
@pytest.mark.parametrize("case", ["column-slice", "offset-misaligned", "offset-aligned",
                                  "expanded-dy"])
def test_misaligned_row_starts(case):
    """Rows whose starts rule the split out run on scalar accesses (a row stride other than
    y's, a base pointer off 16 bytes, dy broadcast over rows); a storage offset of whole
    vectors keeps it (forward and the fused backward)."""
    m, n = 6, 2049
    x, w, dy = make(m, n, BF16, "fp32", seed=3)
    if case == "column-slice":
        wide = make(m, n + 1, BF16, "none", seed=4)[0]
        wide[:, 1:] = x
        x = wide[:, 1:]
    elif case.startswith("offset"):
        off = 1 if case == "offset-misaligned" else 8
        buf = torch.empty(m * n + off, dtype=BF16)
        buf[off:] = x.flatten()
        x = buf[off:].view(m, n)
    else:
        dy = dy[:1].expand(m, n)
    runs = check(x, w, dy)
    fwd = 8 if case in ("offset-aligned", "expanded-dy") else 0
    bwd = 8 if case == "offset-aligned" else 0
    assert vecs(runs, "rms_fwd_single") == [fwd]
    assert vecs(runs, "rms_bwd_vec") == ([bwd] if bwd else [])
    assert ("rms_bwd_single" in runs) == (not bwd)


@exhaustive_unless(one_of_each({"hold": [True, False],
                                "dtype,w_mode": [(BF16, "fp32"), (FP32, "same")]}))
@pytest.mark.parametrize("hold", [True, False], ids=["held", "per-tile"])
@pytest.mark.parametrize("dtype,w_mode", [(BF16, "same"), (BF16, "fp32"), (FP32, "same")],
                         ids=str)
def test_forward_shifted_weight(dtype, w_mode, hold, launch_rules):
    """Large calls (SHIFTED_W_MIN_ELEMS, here 0) read the weight from copies shifted per row
    misalignment (w_ld > 1), held across a program's tiles or reloaded per tile."""
    launch_rules("rmsnorm", SHIFTED_W_MIN_ELEMS=0, RELOAD_VEC_FWD={})
    if not hold:
        launch_rules("rmsnorm", HOLD_W_MAX_PER_THREAD=0)
    x, w, dy = make(11, 97, dtype, w_mode, seed=5)
    runs = check(x, w, dy, need=(False, False), stats=False)
    assert "shift_weight" in runs
    for args in runs["rms_fwd_single"]:
        assert args[11] == 112 and args[-1] == 16 // x.element_size()  # w_ld, VEC
        assert args[-3] == hold  # HOLD_W


@pytest.mark.parametrize("w_mode", ["none", "same", "fp32"])
def test_forward_reload_vec(w_mode, launch_rules):
    """Unaligned 16-bit rows of large calls: rms_fwd_reload_vec (the body read whole for the
    sum of squares, then again in chunks), the weight from the shifted copies."""
    launch_rules("rmsnorm", SHIFTED_W_MIN_ELEMS=0, RELOAD_VEC_FWD={(2, 256): (64, 2)})
    x, w, dy = make(5, 259, FP16, w_mode, seed=6)
    runs = check(x, w, dy, need=(False, False), stats=False)
    assert vecs(runs, "rms_fwd_reload_vec") == [8, 8] and "rms_fwd_single" not in runs
    assert ("shift_weight" in runs) == (w is not None)


@exhaustive_unless(lambda dtype, n, w_mode: (dtype, w_mode) in ((FP16, "none"), (FP32, "same")))
@pytest.mark.parametrize("dtype,n,w_mode", [(FP16, 259, "none"), (FP16, 259, "same"),
                                            (BF16, 275, "fp32"), (FP32, 259, "same")], ids=str)
def test_forward_unrolled_vec(dtype, n, w_mode, launch_rules):
    """Unaligned rows of large calls with an UNROLLED_VEC_FWD config: rms_fwd_unrolled_vec (the
    aligned body in unrolled vector chunks, its last one partial, the edges in one tile) on
    rows of every misalignment, the weight from the shifted copies."""
    from fusedops.backends.triton.configs.common import body_len
    from fusedops.backends.triton.runtime.device import next_pow2

    elt = torch.empty((), dtype=dtype).element_size()
    vec = 16 // elt
    launch_rules("rmsnorm", SHIFTED_W_MIN_ELEMS=0, RELOAD_VEC_FWD={},
                 UNROLLED_VEC_FWD={(elt, next_pow2(body_len(n, vec))): (64, 2)})
    x, w, dy = make(vec + 1, n, dtype, w_mode, seed=7)
    runs = check(x, w, dy, need=(False, False), stats=False)
    assert vecs(runs, "rms_fwd_unrolled_vec") == [vec, vec] and "rms_fwd_single" not in runs
    body = (n // vec - 1) * vec
    assert body % 64 and all(args[9:11] == (body, 64) for args in runs["rms_fwd_unrolled_vec"])
    assert ("shift_weight" in runs) == (w is not None)


BWD_ROWS = [(BF16, 2047), (BF16, 2049), (FP16, 2051), (FP32, 2049), (FP32, 2050)]


# (the diagonal's rows of 2047 and 2050; the others exhaustive)
@exhaustive_unless(one_of_each({"dtype,n": BWD_ROWS, "w_mode": ["none", "same", "fp32"],
                                "need": [(True, True), (True, False), (False, True)],
                                "m": [3, 20]},
                               where=lambda dtype, n, w_mode, need, m: n in (2047, 2050)))
@pytest.mark.parametrize("m", [3, 20])
@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True)], ids=str)
@pytest.mark.parametrize("w_mode", ["none", "same", "fp32"])
@pytest.mark.parametrize("dtype,n", BWD_ROWS, ids=str)
def test_backward_body_and_edges(dtype, n, w_mode, need, m):
    """Unaligned rows with bodies of 2K+: rms_bwd_vec (one row per iteration, dweight
    partials on fixed columns: 20 rows loop over 8 programs, 3 rows one program each)."""
    x, w, dy = make(m, n, dtype, w_mode, seed=n + m)
    runs = check(x, w, dy, need=need)
    assert vecs(runs, "rms_bwd_vec") == [16 // x.element_size()]
    assert "rms_bwd_single" not in runs


def test_backward_short_bodies_and_no_vec_grid_stay_scalar(launch_rules):
    """Bodies under FUSED_BWD_VEC_MIN_BLOCK take the scalar fused kernel, as do rows for which
    no grid that is a multiple of VEC fits (here: no programs per SM)."""
    x, w, dy = make(9, 1031, BF16, "same", seed=7)
    runs = check(x, w, dy)
    assert "rms_bwd_single" in runs and "rms_bwd_vec" not in runs
    launch_rules("rmsnorm", vec_bwd_config=lambda block, elt: (4, 0))
    x, w, dy = make(9, 2049, BF16, "same", seed=8)
    runs = check(x, w, dy)
    assert "rms_bwd_single" in runs and "rms_bwd_vec" not in runs


def test_vec_edges_switch(launch_rules):
    """VEC_EDGES off: every unaligned row on scalar accesses, as before the split."""
    launch_rules("rmsnorm", VEC_EDGES=False)
    x, w, dy = make(4, 2049, BF16, "same", seed=9)
    runs = check(x, w, dy)
    assert vecs(runs, "rms_fwd_single") == [0] and "rms_bwd_vec" not in runs


# -------------------------------------------------------------------------- unrolled rows

# Small rows on rms_fwd_unrolled (the shipped rules start at 8K columns): 256 in chunks of 64;
# padded 512, the first chunk dividing N: 384 in chunks of 128, 448 of 64.
SMALL_UNROLLED = {(2, 256): ((64, 2),), (4, 256): ((64, 2),), (2, 512): ((128, 4), (64, 2))}
UNROLLED_ROWS = [(BF16, 256, 64), (FP16, 384, 128), (FP32, 256, 64), (BF16, 448, 64),
                 (FP16, 192, 64)]


def unrolled(runs: dict) -> list[tuple]:
    """(N, CHUNK, HAS_W, STATS) of each rms_fwd_unrolled launch."""
    return [args[-4:] for args in runs.get("rms_fwd_unrolled", [])]


@exhaustive_unless(one_of_each({"dtype,n,chunk": UNROLLED_ROWS,
                                "w_mode": ["none", "same", "fp32"]}))
@pytest.mark.parametrize("w_mode", ["none", "same", "fp32"])
@pytest.mark.parametrize("dtype,n,chunk", UNROLLED_ROWS, ids=str)
def test_forward_unrolled(dtype, n, chunk, w_mode, launch_rules):
    """Aligned rows a rule's chunk divides: rms_fwd_unrolled (per-lane sums of squares over
    unrolled chunks, then y from a second read), with rstd and without (STATS)."""
    launch_rules("rmsnorm", UNROLLED_FWD=SMALL_UNROLLED)
    x, w, dy = make(3, n, dtype, w_mode, seed=n + 20)
    runs = check(x, w, dy, need=(False, False), stats=False)
    has_w = w is not None
    assert unrolled(runs) == [(n, chunk, has_w, True), (n, chunk, has_w, False)]
    assert "rms_fwd_single" not in runs


@pytest.mark.parametrize("dtype,n,chunk,warps", [(BF16, 16384, 8192, 16), (FP16, 12288, 4096, 16),
                                                 (FP32, 8192, 4096, 32), (BF16, 768, 256, 1),
                                                 (FP16, 3072, 1024, 8), (BF16, 5120, 1024, 8)],
                         ids=str)
def test_forward_unrolled_shipped_rules(dtype, n, chunk, warps, launch_rules):
    """The shipped UNROLLED_FWD at its real row lengths (2 rows): 16-bit 16K, 12K (padded to
    16K, three chunks), float32 8K, and 16-bit rows between powers of two (768, 3072, 5120)."""
    launch_rules("rmsnorm")  # no launch plan from before (a replay is not recorded)
    x, w, dy = make(2, n, dtype, "same", seed=n)
    y64, rstd64, _, _ = oracle(x, w, dy)
    with record_launches() as record:
        y, rstd = tb.rmsnorm_forward(x, w, EPS, dtype)
        y_only = tb.rmsnorm_forward_y(x, w, EPS, dtype)
        y_no_w, _ = tb.rmsnorm_forward(x, None, EPS, dtype)
    assert_close_to_ref(y, y64, dtype)
    assert torch.equal(y_only, y)
    torch.testing.assert_close(rstd.double(), rstd64, **tol(FP32))
    assert_close_to_ref(y_no_w, oracle(x, None, dy)[0], dtype)
    got = [(args[-4:], num_warps) for launcher, _grid, args, num_warps in record
           if launcher.kernel.__name__ == "rms_fwd_unrolled"]
    assert got == [((n, chunk, True, True), warps), ((n, chunk, True, False), warps),
                   ((n, chunk, False, True), warps)]


@pytest.mark.parametrize("n", [1024, 2048])
def test_power_of_two_rows_keep_their_kernel(n, launch_rules):
    """16-bit 1024 and 2048 keep the single-block kernel (0-warp configs in UNROLLED_FWD ahead
    of the chunks that serve 768 and 1536)."""
    launch_rules("rmsnorm")
    x, w, dy = make(2, n, BF16, "same", seed=n)
    with record_launches() as record:
        y = tb.rmsnorm_forward_y(x, w, EPS, BF16)
    assert_close_to_ref(y, oracle(x, w, dy)[0], BF16)
    names = [launcher.kernel.__name__ for launcher, *_ in record]
    assert names and "rms_fwd_unrolled" not in names


@pytest.mark.parametrize("case", ["not-divided", "unaligned", "column-slice", "switched-off"])
def test_rows_the_unrolled_kernel_leaves(case, launch_rules):
    """Rows no chunk divides, rows that start unaligned (N = 2^k + 1), rows whose stride is
    not a multiple of 16 bytes, and every row with the table emptied keep the single-block
    kernel."""
    launch_rules("rmsnorm", UNROLLED_FWD={} if case == "switched-off" else SMALL_UNROLLED)
    n = {"not-divided": 248, "unaligned": 257}.get(case, 256)
    x, w, dy = make(3, n, BF16, "same", seed=22)
    if case == "column-slice":
        x = make(3, n + 4, BF16, "none", seed=23)[0][:, :n]
    runs = check(x, w, dy, need=(False, False), stats=False)
    assert "rms_fwd_unrolled" not in runs and len(runs["rms_fwd_single"]) == 2


def _at(address: int, like: torch.Tensor) -> torch.Tensor:
    """A 1-D CPU tensor of ``like``'s dtype and size over the memory at ``address``."""
    nbytes = like.numel() * like.element_size()
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=like.dtype)


@pytest.fixture
def interpreted_plans(monkeypatch, fake_stream):
    """Launch plans on CPU tensors: a launcher's direct entry (raw addresses, as Triton 3.6's
    C entry takes them) runs the interpreted kernel on tensors rebuilt at those addresses, so
    a replayed call computes its result. Returns the kernel names of the replayed launches."""
    if HAS_CUDA:
        pytest.skip("CUDA replays compiled kernels (tests/test_replay.py)")
    replayed = []

    def entry(self, args, num_warps):
        like = [a for a in args if isinstance(a, torch.Tensor)]

        def go(grid, stream, raw):
            replayed.append(self.kernel.__name__)
            n = len(like)
            self(grid, (*map(_at, raw[:n], like), *raw[n:]), num_warps)

        def launch(g, gy, gz, stream, *rest):  # the C entry the ops layer's runner calls
            go((g,), stream, rest[9:])

        go.raw_pointers = True
        go.c_entry = (launch, None, False, False, None)
        return go

    monkeypatch.setattr(Launcher, "entry", entry)
    return replayed


# (the unrolled kernel's 16-bit rows: exhaustive)
@exhaustive_unless(lambda kernel, dtype, w_mode: kernel == "rms_fwd_single" or dtype == FP32)
@pytest.mark.parametrize("kernel", ["rms_fwd_unrolled", "rms_fwd_single"])
@pytest.mark.parametrize("dtype,w_mode", [(BF16, "same"), (FP16, "fp32"), (FP32, "none")],
                         ids=str)
def test_forward_plans_replay(interpreted_plans, monkeypatch, launch_rules, kernel, dtype,
                              w_mode):
    """A second call of a signature replays the launch the first recorded (rstd allocated for
    the plan's rows), and the ops layer's runner (fusedops._replay.RMSNORM) an inference
    plan: the first call's bits from the unrolled kernel as from the single-block one."""
    from fusedops import _replay

    launch_rules("rmsnorm", UNROLLED_FWD=SMALL_UNROLLED if kernel == "rms_fwd_unrolled" else {})
    x, w, _ = make(5, 256, dtype, w_mode, seed=24)
    kept = []  # (no output of a replay lands where an earlier result was freed)
    for stats in (True, False):
        first = trms._forward(x, w, EPS, dtype, stats)
        again = trms._forward(x, w, EPS, dtype, stats)
        kept += [first, again]
        assert torch.equal(again[0], first[0])
        assert (again[1] is None) == (not stats)
        if stats:
            assert again[1].shape == (5,) and torch.equal(again[1], first[1])
    run = _replay.RMSNORM[(x.shape, dtype, -1, EPS)]
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        by_runner = run(x, w)
    assert torch.equal(by_runner, first[0])
    assert interpreted_plans == [kernel] * 3


def test_rules_pick_the_unrolled_kernel(launch_rules):
    """forward_config: aligned rows with an UNROLLED_FWD config take rms_fwd_unrolled (16-bit
    16K on 8192 x 16); rows of 16385 (unaligned or not), misaligned row strides, rows without a
    rule, shrunk block limits and an emptied table do not."""
    launch_rules("rmsnorm")  # (the caches dropped around the test)
    fwd = rms_rules.forward_config
    for dev in (DeviceFacts(True, 132, "NVIDIA H200", True, True), device_facts(-1)):
        assert fwd(16384, 2, 0, True, dev, True)[:1] + fwd(16384, 2, 0, True, dev, True)[3:] \
            == ("unrolled", 16, False, 0, 8192, 0, False, False, None)
        assert fwd(16384, 2, 0, True, dev, False).kernel == "unrolled"
        assert fwd(12288, 2, 0, True, dev, True)[3:7:3] == (16, 4096)
        assert fwd(8192, 2, 0, True, dev, True)[3:7:3] == (16, 4096)
        assert fwd(6144, 2, 0, True, dev, True)[3:7:3] == (8, 2048)
        assert fwd(8192, 4, 0, True, dev, True)[3:7:3] == (32, 4096)
        assert fwd(16384, 4, 0, True, dev, True)[3:7:3] == (32, 4096)
        assert fwd(32768, 2, 0, True, dev, True)[3:7:3] == (32, 8192)
        assert fwd(65536, 2, 0, True, dev, True)[3:7:3] == (32, 8192)
        assert fwd(4096, 2, 0, True, dev, True)[3:7:3] == (8, 2048)
        assert fwd(16385, 2, 8, False, dev, True).kernel != "unrolled"
        assert fwd(16385, 2, 0, False, dev, True).kernel != "unrolled"  # scalar accesses
        assert fwd(16384, 2, 0, False, dev, True).kernel == "single"  # a misaligned stride
        assert fwd(32768, 4, 0, True, dev, True)[3:7:3] == (32, 32768)  # float32: one chunk
        assert fwd(2048, 4, 0, True, dev, True)[3:7:3] == (8, 2048)
        assert fwd(4096, 4, 0, True, dev, True)[3:7:3] == (16, 4096)
        assert fwd(3072, 4, 0, True, dev, True).kernel == "single"  # no chunk divides it
        assert fwd(2048, 2, 0, True, dev, True).kernel == "single"
    launch_rules(SINGLE_BLOCK_LIMIT=8192)
    assert fwd(8192, 2, 0, True, device_facts(-1), True).kernel == "single"
    launch_rules(SINGLE_BLOCK_LIMIT=None)
    launch_rules("rmsnorm", UNROLLED_FWD={})
    assert fwd(16384, 2, 0, True, device_facts(-1), True).kernel == "single"


# ----------------------------------------------------------------------------- split rows


@pytest.fixture
def split_rows(monkeypatch, launch_rules):
    """Split rows on CPU tensors: rows past a 64-element single-block limit in pieces of at
    most ``piece`` columns (forced rules), their programs run concurrently; ``sms`` sets the
    programs a grid may hold (4 per SM, as the interpreter's occupancy estimate is 1)."""

    def setup(piece: int, prefetch: int, sms: int = 64):
        rules = {"SPLIT_FWD": {k: (piece, 1, prefetch) for k in rms_rules.SPLIT_FWD},
                 "SPLIT_BWD": {e: ((1 << 62, (piece, 1, prefetch, None)),) for e in (2, 4)},
                 "SCALAR_SPLIT_BWD_16BIT": ((1 << 62, (piece, 1, prefetch, None)),),
                 "VEC_SPLIT_BWD": {e: (piece, 1, prefetch, None) for e in (2, 4)},
                 "CLUSTER_BWD": {}}
        launch_rules("rmsnorm", **rules)
        launch_rules(SINGLE_BLOCK_LIMIT=64)
        # Split rows allowed (every row's pieces resident), no clusters; the grid's programs
        # come from ``sms`` at launch.
        facts = DeviceFacts(True, 1 << 10, "", True, False)
        for host in (trms, trmsb):
            monkeypatch.setattr(host, "device_facts", lambda index: facts)
        monkeypatch.setattr(rt_split, "num_sms", lambda device: sms)

    if HAS_CUDA:
        pytest.skip("the CPU split-row cases (the gpu tests cover CUDA)")
    with concurrent_programs():
        yield setup


SPLIT_CASES = [  # (dtype, m, n, layout, prefetch, sms): VEC expected from the layout
    (FP32, 5, 200, "aligned", 1, 64),
    (BF16, 9, 203, "contiguous", 3, 32),  # VEC pieces, a grid of C·VEC < items: rows loop
    (FP16, 4, 203, "strided", 2, 64),  # a row stride unlike y's: scalar pieces
    (FP32, 6, 203, "contiguous", 0, 64),
]


# (the strided case, scalar pieces, both gradients by default; the others exhaustive: the
# interpreter takes seconds per case)
@exhaustive_unless(lambda dtype, m, n, layout, prefetch, sms, w_mode, need:
                   (layout, w_mode, need) == ("strided", "same", (True, True)))
@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True)], ids=str)
@pytest.mark.parametrize("w_mode", ["none", "same", "fp32"])
@pytest.mark.parametrize("dtype,m,n,layout,prefetch,sms", SPLIT_CASES, ids=str)
def test_split_rows(split_rows, dtype, m, n, layout, prefetch, sms, w_mode, need):
    """Long rows in pieces that exchange their sums of squares (forward) and Σ x̂·w·dy
    (backward, whose pieces also keep dweight partials): aligned rows, unaligned contiguous
    rows (aligned-body pieces plus edges), strided rows (scalar pieces); every PREFETCH."""
    split_rows(64, prefetch, sms)
    if w_mode == "fp32" and dtype == FP32:
        w_mode = "same"
    x, w, dy = make(m, n, dtype, w_mode, seed=m * n + prefetch)
    if layout == "strided":
        x = torch.cat([x, x[:, :5]], 1)[:, :n]
    runs = check(x, w, dy, need=need)
    want = 16 // x.element_size() if layout == "contiguous" else 0
    assert vecs(runs, "rms_fwd_split") == [want]
    assert vecs(runs, "rms_bwd_split") == ([want] if any(need) else [])
    assert not {"rms_fwd_looped", "rms_bwd_dx_looped", "rms_bwd_dw_columns"} & set(runs)


def test_split_rows_fallbacks(split_rows, launch_rules):
    """No grid of C·VEC programs fits (4 programs, VEC 8): scalar pieces; SPLIT_ROWS_MIN
    above the row: the looped kernels."""
    split_rows(64, 1, sms=1)
    x, w, dy = make(3, 203, BF16, "same", seed=11)
    runs = check(x, w, dy)
    assert vecs(runs, "rms_fwd_split") == [0] and vecs(runs, "rms_bwd_split") == [0]
    launch_rules("rmsnorm", SPLIT_ROWS_MIN=204)
    runs = check(x, w, dy)
    assert "rms_fwd_split" not in runs and "rms_bwd_split" not in runs
    assert {"rms_fwd_looped", "rms_bwd_dx_looped", "rms_bwd_dw_columns"} <= set(runs)


@pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need the Triton interpreter")
@pytest.mark.parametrize("path", ["cluster", "cluster-fails", "cooperative"])
def test_split_backward_launch_paths(monkeypatch, path):
    """The split backward's host side with recording launchers: a cluster launch gets rstd
    in place of the statistics and counters it never reads and CLUSTER True; a cooperative
    one (first, or after a failed cluster launch, on the same pieces) zeroed int32 counters,
    float32 statistics and CLUSTER False; the partial rows follow the grid."""
    calls = []

    class Launch:
        def __init__(self, kind):
            self.kind = kind

        def programs(self, items, chunks, runtime, consts, num_warps, device, vec=0):
            return 2 * chunks

        def __call__(self, items, chunks, runtime, consts, num_warps, device, progs=None,
                     vec=0):
            calls.append((self.kind, runtime, consts, progs))
            return 0 if self.kind == "cluster" and path == "cluster-fails" else progs

    monkeypatch.setattr(trmsb, "cluster_launcher", lambda cap: Launch("cluster"))
    monkeypatch.setattr(trmsb, "split_launcher", lambda cap: Launch("coop"))
    monkeypatch.setattr(trmsb, "clusters_enabled", lambda *a: path != "cooperative")
    monkeypatch.setattr(trmsb, "reduce_partials", lambda part, *a, **k: calls.append(part))
    x, w, dy = make(8, 256, BF16, "same")
    rstd = torch.rsqrt(x.float().square().mean(1) + EPS)
    cfg = rms_rules.BwdConfig("split", 0, 1, 4, 0, True, 0, 64, 1, None, True)
    assert trmsb._split(dy, x, w, True, rstd, torch.empty_like(x), torch.empty(256), cfg)
    kinds = [c[0] for c in calls[:-1]]
    assert kinds == {"cluster": ["cluster"], "cluster-fails": ["cluster", "coop"],
                     "cooperative": ["coop"]}[path]
    for kind, runtime, consts, progs in calls[:-1]:
        assert consts[-1] is (kind == "cluster") and progs == 8
        stats, count = runtime[6], runtime[7]
        if kind == "cluster":
            assert stats is rstd and count is rstd
        else:
            assert stats.shape == (8 * 4,) and stats.dtype == FP32
            assert count.dtype == torch.int32 and count.shape == (8,) and not count.any()
    assert calls[-1].shape == (1, 2, 256) and calls[-1].dtype == FP32  # 8 programs / 4 pieces


@pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need the Triton interpreter")
@pytest.mark.parametrize("refused", [False, True])
def test_cluster_forward_launch_path(monkeypatch, refused, launch_rules):
    """A cluster forward config: the cluster launcher gets the rows' C pieces, rstd in place of
    the statistics and counters it never reads and CLUSTER True; refused, the call runs the
    rules without clusters (here the CPU's), with the right values."""
    calls = []

    def cluster(items, chunks, runtime, consts, num_warps, device, progs=None, vec=0):
        calls.append((items, chunks, runtime, consts, num_warps))
        return 0 if refused else 2 * chunks

    cpu_rules = rms_rules.forward_config(256, 2, 0, True, device_facts(-1), True)
    cfg = rms_rules.FwdConfig("split", 0, 1, 4, False, 0, 64, 1, False, True, cpu_rules)
    monkeypatch.setattr(trms, "_launch_fwd_cluster", cluster)
    monkeypatch.setattr(trms, "_fwd_config", lambda *a: cfg)
    launch_rules("rmsnorm")  # (caches and plans dropped: the patched rule is asked)
    x, w, dy = make(8, 256, BF16, "same")
    with record_launches() as record:
        y, rstd = tb.rmsnorm_forward(x, w, EPS, BF16)
    (items, chunks, runtime, consts, warps), = calls
    assert (items, chunks, warps) == (8 * 4, 4, 4) and consts[-1] is True
    assert consts[:3] == (64, 4, 4) and runtime[4] is rstd and runtime[5] is rstd
    assert bool(launched(record)) == refused  # nothing else ran unless refused
    if refused:
        y64, rstd64, _, _ = oracle(x, w, dy)
        assert_close_to_ref(y, y64, BF16)


@pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need the Triton interpreter")
@pytest.mark.parametrize("refused", [False, True])
@pytest.mark.parametrize("persistent", [False, True])
def test_pieces_forward_launch_path(monkeypatch, refused, persistent, launch_rules):
    """A streamed-pieces config: the cluster launcher gets the rows' C pieces, one cluster per
    row unless persistent (then the launcher sizes the grid), with the weight, y and rstd;
    refused, the call runs the rules without clusters (here the CPU's), with the right
    values."""
    calls = []

    def cluster(items, chunks, runtime, consts, num_warps, device, progs=None, vec=0):
        calls.append((items, chunks, runtime, consts, num_warps, progs))
        return 0 if refused else items

    cpu_rules = rms_rules.forward_config(256, 2, 0, True, device_facts(-1), True)
    cfg = rms_rules.FwdConfig("pieces", 64, 1, 4, persistent, 0, 32, 0, False, True, cpu_rules)
    monkeypatch.setattr(trms, "_launch_fwd_pieces", cluster)
    monkeypatch.setattr(trms, "_fwd_config", lambda *a: cfg)
    launch_rules("rmsnorm")
    x, w, dy = make(8, 256, BF16, "same")
    with record_launches() as record:
        y, rstd = tb.rmsnorm_forward(x, w, EPS, BF16)
    (items, chunks, runtime, consts, warps, progs), = calls
    assert (items, chunks, warps, progs) == (8 * 4, 4, 4, None if persistent else 8 * 4)
    assert consts == (256, 64, 32, 4, 4, True, True)
    assert runtime[:4] == (x, w, y, rstd) and runtime[4:7] == (8, 256, 256)
    assert bool(launched(record)) == refused
    if refused:
        y64, rstd64, _, _ = oracle(x, w, dy)
        assert_close_to_ref(y, y64, BF16)


def test_cluster_forward_rules(launch_rules):
    """CLUSTER_FWD: aligned rows in a rule's range whose pieces make a cluster size take the
    cluster split forward on a GPU that runs clusters, ahead of the unrolled kernel; rows
    outside it, unaligned rows, other piece counts and GPUs without clusters do not."""
    hopper = DeviceFacts(True, 132, "NVIDIA H200", True, True)
    no_clusters = hopper._replace(clusters=False)
    fwd = rms_rules.forward_config
    for elt, rules in rms_rules.CLUSTER_FWD.items():  # shipped
        for shortest, longest, (piece, warps, prefetch) in rules:
            cfg = fwd(longest, elt, 0, True, hopper, True)
            assert cfg == rms_rules.FwdConfig("split", 0, 1, warps, False, 0, piece, prefetch,
                                              False, True, fwd(longest, elt, 0, True,
                                                               no_clusters, True))
            assert not fwd(longest, elt, 0, True, no_clusters, True).cluster
            if not any(lo <= shortest // 2 <= hi for lo, hi, _ in rules):
                assert not fwd(shortest // 2, elt, 0, True, hopper, True).cluster
    assert fwd(262144, 2, 0, True, no_clusters, True).kernel == "unrolled"
    launch_rules("rmsnorm", CLUSTER_FWD={2: ((32768, 262144, (16384, 16, 1)),)}, PIECES_FWD={})
    for n, c in ((32768, 2), (65536, 4), (131072, 8), (262144, 16)):
        cfg = fwd(n, 2, 0, True, hopper, True)
        assert (cfg.kernel, cfg.chunk, cfg.warps, cfg.prefetch, cfg.cluster) == (
            "split", 16384, 16, 1, True), n
        assert -(-n // cfg.chunk) == c
        assert not fwd(n, 2, 0, True, no_clusters, True).cluster
        assert not fwd(n, 4, 0, True, hopper, True).cluster  # no float32 rule
        assert not fwd(n, 2, 0, False, hopper, True).cluster  # misaligned rows
    assert not fwd(98304, 2, 0, True, hopper, True).cluster  # 6 pieces: no cluster size
    assert fwd(16384, 2, 0, True, hopper, True).kernel == "unrolled"  # below the range
    assert not fwd(65537, 2, 8, False, hopper, True).cluster
    launch_rules("rmsnorm", CLUSTER_FWD={}, PIECES_FWD={})
    assert fwd(131072, 2, 0, True, hopper, True).kernel == "unrolled"


def test_pieces_forward_rules(launch_rules):
    """PIECES_FWD: aligned rows in a rule's range that whole pieces of whole chunks fill, in a
    cluster size, take the streamed-pieces kernel on a GPU that runs clusters, ahead of
    CLUSTER_FWD; unaligned rows, rows no piece divides, other piece counts and GPUs without
    clusters do not."""
    hopper = DeviceFacts(True, 132, "NVIDIA H200", True, True)
    no_clusters = hopper._replace(clusters=False)
    fwd = rms_rules.forward_config
    assert rms_rules.PIECES_FWD  # shipped
    for elt, rules in rms_rules.PIECES_FWD.items():
        for shortest, longest, (piece, chunk, warps, persistent) in rules:
            for n in {shortest, longest}:
                assert fwd(n, elt, 0, True, hopper, True) == rms_rules.FwdConfig(
                    "pieces", piece, 1, warps, persistent, 0, chunk, 0, False, True,
                    fwd(n, elt, 0, True, no_clusters, True))
                assert fwd(n, elt, 0, True, no_clusters, True).kernel != "pieces"
                assert fwd(n, elt, 0, False, hopper, True).kernel != "pieces"
    launch_rules("rmsnorm", PIECES_FWD={2: ((32768, 262144, (16384, 4096, 16, False)),)},
                 CLUSTER_FWD={2: ((32768, 262144, (16384, 16, 1)),)})
    for n in (32768, 65536, 131072, 262144):  # 2 to 16 pieces
        cfg = fwd(n, 2, 0, True, hopper, True)
        assert (cfg.kernel, cfg.block, cfg.chunk, cfg.warps, cfg.persistent, cfg.cluster) == (
            "pieces", 16384, 4096, 16, False, True), n
        assert fwd(n, 2, 0, True, no_clusters, True).kernel == "unrolled"
    assert fwd(98304, 2, 0, True, hopper, True).kernel != "pieces"  # 6 pieces
    assert fwd(65536 + 16, 2, 0, True, hopper, True).kernel != "pieces"  # no whole pieces
    assert fwd(65536, 4, 0, True, hopper, True).kernel != "pieces"  # no float32 rule
    launch_rules("rmsnorm", PIECES_FWD={2: ((65536, 65536, (16384, 3072, 16, True)),)})
    assert fwd(65536, 2, 0, True, hopper, True).kernel == "split"  # no whole chunks


# ------------------------------------------------------------------------------ the rules


def test_rules_pick_the_variants(monkeypatch, launch_rules):
    """forward_config / backward_config on CUDA device facts (split rows allowed): which
    kernel each row length takes, and the switches that turn the new paths off."""
    cuda = DeviceFacts(True, 132, "NVIDIA H100 80GB HBM3", True, True)
    fwd, bwd = rms_rules.forward_config, rms_rules.backward_config
    launch_rules("rmsnorm")  # (the caches dropped around the test)
    assert fwd(8193, 2, 8, False, cuda, True)[:2] == ("reload_vec", 8192)
    assert fwd(8193, 2, 8, False, cuda, False).kernel == "single"
    assert fwd(8193, 4, 4, False, cuda, True)[:1] + fwd(8193, 4, 4, False, cuda, True)[5:9] == (
        "single", 4, 0, 0, True)
    assert fwd(65537, 2, 8, False, cuda, True)[:1] + fwd(65537, 2, 8, False, cuda, True)[5:9] \
        == ("unrolled_vec", 8, 8192, 0, True)
    assert fwd(65537, 2, 8, False, cuda, False).kernel == "split"  # (a small call)
    launch_rules("rmsnorm", UNROLLED_VEC_FWD={})
    assert fwd(65537, 2, 8, False, cuda, True)[:1] + fwd(65537, 2, 8, False, cuda, True)[5:8] \
        == ("split", 8, 8192, 3)
    assert fwd(65536, 4, 0, True, cuda._replace(clusters=False), True)[5:8] == (0, 8192, 1)
    cfg = fwd(65536, 4, 0, True, cuda, True)
    assert (cfg.vec, cfg.chunk, cfg.cluster) == (0, 16384, True)  # (clusters)
    assert fwd(65536, 2, 0, True, cuda, True).kernel == "unrolled"  # (measured faster)
    assert fwd(131072, 2, 0, True, cuda, True)[:1] + fwd(131072, 2, 0, True, cuda, True)[3:7:3] \
        == ("pieces", 16, 4096)
    assert fwd(131072, 2, 0, True, cuda._replace(clusters=False), True)[:1] + fwd(
        131072, 2, 0, True, cuda._replace(clusters=False), True)[3:7:3] == ("unrolled", 32, 16384)
    assert fwd(98304, 2, 0, True, cuda, True).kernel == "unrolled"  # (6 chunks of 16K)
    assert fwd(131072, 4, 0, True, cuda, True).kernel == "pieces"
    assert fwd(262144, 4, 0, True, cuda._replace(clusters=False), True).kernel == "split"
    assert bwd(8193, 2, 8, False, cuda)[:1] + bwd(8193, 2, 8, False, cuda)[6:7] == ("fused", 8)
    assert bwd(16385, 2, 8, False, cuda).kernel == "fused"  # a 16K body
    assert bwd(32769, 2, 8, False, cuda)[6:8] == (8, 2048)
    assert bwd(32768, 2, 0, True, cuda)[:1] + bwd(32768, 2, 0, True, cuda)[7:8] == (
        "pieces", 8192)  # (PIECES_BWD; its fallback: held pieces in clusters)
    assert bwd(32768, 2, 0, True, cuda).fallback[7:11] == (2048, 1, 128, True)
    assert bwd(131072, 4, 0, True, cuda)[7:11] == (8192, 2, None, False)
    assert bwd(65537, 2, 0, False, cuda)[3:8:4] == (16, 8192)  # scalar pieces
    launch_rules("rmsnorm", VEC_EDGES=False, SPLIT_ROWS_MIN=1 << 62)
    assert fwd(8193, 2, 8, False, cuda, True)[5] == 0
    assert fwd(65537, 2, 8, False, cuda, True).kernel == "looped"
    launch_rules("rmsnorm", UNROLLED_FWD={})
    assert fwd(65536, 2, 0, True, cuda, True).kernel == "looped"
    assert bwd(8193, 2, 8, False, cuda)[6] == 0
    assert bwd(131072, 4, 0, True, cuda).kernel == "looped"


def test_rules_off_cuda_never_split():
    cpu = device_facts(-1)
    assert rms_rules.forward_config(65537, 2, 8, False, cpu, True).kernel == "unrolled_vec"
    assert rms_rules.forward_config(65537, 2, 8, False, cpu, False).kernel == "looped"
    assert rms_rules.backward_config(65537, 2, 8, False, cpu).kernel == "looped"


# ------------------------------------------------------------------------ compiled code

_COMPILE = textwrap.dedent("""
    import json, re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fusedops.backends.triton.kernels import rmsnorm as k, rmsnorm_split as ks

    def build(fn, consts, div=()):
        # pointers 16-byte aligned and the ints in ``div`` multiples of 16, as Triton
        # specialises them at a launch with such arguments
        names = fn.arg_names
        f32 = {"rstd_ptr": "*fp32", "part_ptr": "*fp32", "stats_ptr": "*fp32",
               "count_ptr": "*i32"}
        sig = {a: f32.get(a, "*bf16") if a.endswith("_ptr") else "fp32" if a == "eps"
               else "constexpr" if a in consts else "i32" for a in names}
        src = ASTSource(fn=fn, signature=sig,
                        constexprs={(names.index(a),): v for a, v in consts.items()},
                        attrs={(names.index(a),): [["tt.divisibility", 16]]
                               for a in names if a.endswith("_ptr") or a in div})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 4}).asm["ptx"]
        out = {t: ptx.count(t) for t in ("barrier.cluster.arrive.release",
                                         "mapa.shared::cluster", "atom.", "red.global")}
        out["ld.v4"] = len(re.findall(r"ld\\.global[.\\w:]*\\.v4", ptx))
        out["st.v4"] = len(re.findall(r"st\\.global[.\\w:]*\\.v4", ptx))
        return out

    split = dict(BLOCK=2048, C=8, C_P2=8, HAS_W=True, NEED_DX=True, NEED_DW=True,
                 PREFETCH=1, VEC=0)
    aligned = ("N", "L", "stride_dy", "stride_x", "stride_dx")
    out = {
        "cluster": build(ks.rms_bwd_split, dict(split, CLUSTER=True), aligned),
        "coop": build(ks.rms_bwd_split, dict(split, CLUSTER=False, VEC=8, PREFETCH=3), ("L",)),
        "fwd_vec": build(k.rms_fwd_single, dict(BLOCK_N=2048, ROWS=2, HAS_W=True,
                                                HOLD_W=True, STATS=True, VEC=8), ("w_ld",)),
        "fwd_reload": build(k.rms_fwd_reload_vec, dict(BLOCK_N=4096, CHUNK=1024, HAS_W=True,
                                                       STATS=True, VEC=8), ("w_ld",)),
        "fwd_unrolled_vec": build(k.rms_fwd_unrolled_vec, dict(N=16385, BODY=16376, CHUNK=4096,
                                                               HAS_W=True, STATS=True, VEC=8),
                                  ("w_ld",)),
        "fwd_unrolled": build(k.rms_fwd_unrolled, dict(N=16384, CHUNK=4096, HAS_W=True,
                                                       STATS=True), ("stride_x", "stride_y")),
        "fwd_split": build(ks.rms_fwd_split, dict(BLOCK=2048, C=8, C_P2=8, HAS_W=True,
                                                  STATS=True, PREFETCH=3, VEC=8,
                                                  CLUSTER=False), ("L",)),
        "fwd_cluster": build(ks.rms_fwd_split, dict(BLOCK=2048, C=8, C_P2=8, HAS_W=True,
                                                    STATS=True, PREFETCH=1, VEC=0,
                                                    CLUSTER=True),
                             ("N", "L", "stride_x", "stride_y")),
        "fwd_pieces": build(ks.rms_fwd_pieces, dict(N=16384, L=4096, CHUNK=1024, C=4, C_P2=4,
                                                    HAS_W=True, STATS=True),
                            ("stride_x", "stride_y")),
        "bwd_vec": build(k.rms_bwd_vec, dict(BLOCK_N=4096, HAS_W=True, HOLD_W=True,
                                             NEED_DX=True, NEED_DW=True, VEC=8)),
    }
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def sm90():
    """The new kernels compiled for sm_90 (ptxas, no GPU needed; a subprocess, as the
    interpreter replaces ``triton.jit`` here): PTX instruction counts per kernel."""
    import json

    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.exhaustive  # (a compile in a fresh interpreter: seconds)
def test_kernels_compile_for_sm90(sm90):
    """Every new kernel compiles for sm_90 (the interpreter checks no compile-time rules).
    The cluster variants (backward, forward, streamed pieces) exchange on chip (cluster
    barrier, stores into peers' shared memory, no atomics), the cooperative ones through
    counters; unaligned bodies
    (and the weight copies), and the unrolled kernel's chunks, are read and written with
    16-byte vectors."""
    cluster, coop = sm90["cluster"], sm90["coop"]
    assert cluster["barrier.cluster.arrive.release"] == 2 and cluster["mapa.shared::cluster"]
    assert cluster["atom."] + cluster["red.global"] == 0
    assert coop["barrier.cluster.arrive.release"] == 0 and coop["atom."] + coop["red.global"]
    fwd, fwd_coop = sm90["fwd_cluster"], sm90["fwd_split"]
    assert fwd["barrier.cluster.arrive.release"] == 2 and fwd["mapa.shared::cluster"]
    assert fwd["atom."] + fwd["red.global"] == 0
    assert fwd_coop["barrier.cluster.arrive.release"] == 0
    pieces = sm90["fwd_pieces"]  # the barrier at the start and one exchange per row
    assert pieces["barrier.cluster.arrive.release"] == 2 and pieces["mapa.shared::cluster"]
    assert pieces["atom."] + pieces["red.global"] == 0
    for name, got in sm90.items():
        assert got["ld.v4"] >= 2 and got["st.v4"] >= 1, (name, got)


# ----------------------------------------------------------------------- GPU (compiled)

GPU_ROWS = [(BF16, 512, 8193), (FP32, 512, 8193), (FP16, 300, 4097), (BF16, 64, 65537),
            (FP32, 64, 65537), (BF16, 48, 131072), (FP32, 40, 262144), (BF16, 200, 32768),
            (FP32, 100, 16385), (BF16, 128, 32769)]


@pytest.mark.gpu
@pytest.mark.parametrize("w_mode", ["same", "fp32", "none"])
@pytest.mark.parametrize("dtype,m,n", GPU_ROWS, ids=str)
def test_gpu_variants(dtype, m, n, w_mode, launch_rules):
    """The shipped rules at real sizes (as large calls: the shifted weight copies and the
    reload kernel): values against float64, and the kernels the rules name in the launches."""
    launch_rules("rmsnorm", SHIFTED_W_MIN_ELEMS=0)
    if w_mode == "fp32" and dtype == FP32:
        pytest.skip("same as 'same'")
    x, w, dy = (t if t is None else t.cuda() for t in make(m, n, dtype, w_mode, seed=n))
    runs = check(x, w, dy)
    vec = _vec_expected(n, dtype)
    block = 1 << ((n // vec * vec if vec else n) - 1).bit_length()
    fwd_unrolled_vec = vec > 0 and (x.element_size(), block) in rms_rules.UNROLLED_VEC_FWD
    fwd_pieces = not vec and rms_rules.pieces_fwd_config(n, x.element_size(),
                                                         device_facts(0)) is not None
    fwd_split = (block > 32768 and (dtype == FP32 or vec > 0) and not fwd_unrolled_vec
                 and not fwd_pieces)
    assert ("rms_fwd_split" in runs) == fwd_split
    assert ("rms_fwd_pieces" in runs) == fwd_pieces
    assert vecs(runs, "rms_fwd_unrolled_vec") == ([vec] if fwd_unrolled_vec else [])
    bwd_pieces = not vec and rms_rules.pieces_bwd_config(n, x.element_size(),
                                                         device_facts(0)) is not None
    assert ("rms_bwd_pieces" in runs) == bwd_pieces
    assert ("rms_bwd_split" in runs) == (block > 16384 and not bwd_pieces)
    if vec and not fwd_unrolled_vec and not fwd_split:
        assert vecs(runs, "rms_fwd_single") + vecs(runs, "rms_fwd_reload_vec") == [vec]
    if vec and block <= 16384:
        assert vecs(runs, "rms_bwd_vec") == [vec]
    if vec and block > 16384:
        assert vecs(runs, "rms_bwd_split") == [vec]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,m,n,piece", [
    (BF16, 48, 131072, 16384), (BF16, 200, 32768, 4096), (FP16, 7, 65536, 16384),
    (BF16, 40, 262144, 16384), (FP32, 64, 65536, 8192), (BF16, 300, 16384, 8192),
    (BF16, 24, 262144, 32768)], ids=str)
@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
def test_gpu_cluster_forward(dtype, m, n, piece, prefetch, launch_rules):
    """Forced CLUSTER_FWD rules (2-16 pieces, every load placement): values against float64,
    and the forward launches rms_fwd_split with CLUSTER (Hopper; elsewhere the rules without
    clusters)."""
    hopper = torch.cuda.get_device_capability()[0] >= 9
    elt = torch.empty((), dtype=dtype).element_size()
    warps = 16 if piece > 16384 else 8  # (the shipped 32K pieces run on 16)
    launch_rules("rmsnorm", CLUSTER_FWD={elt: ((n, n, (piece, warps, prefetch)),)},
                 PIECES_FWD={})
    for w_mode in ("same", "none"):
        x, w, dy = (t if t is None else t.cuda() for t in make(m, n, dtype, w_mode, seed=n))
        runs = check(x, w, dy, stats=False)
        fwd = runs.get("rms_fwd_split", [])
        assert (len(fwd) == 2 and all(a[-1] is True for a in fwd)) == hopper, runs.keys()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,m,n,piece,chunk,warps", [
    (BF16, 48, 131072, 16384, 4096, 16), (BF16, 300, 32768, 16384, 2048, 8),
    (FP16, 7, 65536, 16384, 4096, 16), (BF16, 40, 262144, 16384, 4096, 16),
    (FP32, 64, 65536, 8192, 2048, 8), (FP32, 20, 262144, 16384, 4096, 16),
    (BF16, 24, 262144, 32768, 8192, 16)], ids=str)
@pytest.mark.parametrize("persistent", [False, True])
def test_gpu_pieces_forward(dtype, m, n, piece, chunk, warps, persistent, launch_rules):
    """Forced PIECES_FWD rules (2-16 pieces, one cluster per row or a persistent grid, fewer
    rows than clusters and more): values and rstd against float64, with and without a
    weight, and the forward launches rms_fwd_pieces (Hopper; elsewhere the rules without
    clusters)."""
    hopper = torch.cuda.get_device_capability()[0] >= 9
    elt = torch.empty((), dtype=dtype).element_size()
    launch_rules("rmsnorm", PIECES_FWD={elt: ((n, n, (piece, chunk, warps, persistent)),)})
    for w_mode in ("same", "none"):
        x, w, dy = (t if t is None else t.cuda() for t in make(m, n, dtype, w_mode, seed=n))
        runs = check(x, w, dy, stats=False)
        fwd = runs.get("rms_fwd_pieces", [])
        assert (len(fwd) == 2 and {a[11] for a in fwd} == {chunk}) == hopper, runs.keys()
        assert "rms_fwd_split" not in runs and "rms_fwd_unrolled" not in runs or not hopper
