"""float32 accuracy of LayerNorm, RMSNorm and the softmax forward on long rows, against torch's
own: every kernel variant a float32 row can take (single-block, unrolled, reload, looped,
split-row), single rows and small batches, data of several scales and far from zero.

The measure: the largest absolute error against the float64 result of the same float32 inputs
must stay within twice torch's own float32 error (same inputs, same reference), plus half an
ulp of the largest output. The floor keeps the comparison to what rounding can decide: below
it, two correct implementations differ only by which of their sums happened to round luckier
on one row. On CPU the Triton kernels run interpreted; on a GPU the same tests run compiled.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import INTERPRETING

from fusedops import fused_layernorm, fused_rmsnorm, fused_softmax

FLOOR_ULPS = 0.5
# (scale, shift) of the inputs: randn * scale + shift.
DATA = {"randn": (1.0, 0.0), "x10": (10.0, 0.0), "x100": (100.0, 0.0), "shifted": (1.0, 100.0)}
# Row lengths and the kernel each takes on CPU (on CUDA, rows past 32K take the split-row
# kernels instead of the looped ones).
LENGTHS = {
    1024: "single-block (LayerNorm: unrolled)",
    8193: "single-block, unaligned rows",
    16384: "LayerNorm: reload",
    17866: "single-block, unaligned",
    32768: "reload",
    65537: "looped (LayerNorm: looped), unaligned",
    131072: "looped",
    262144: "looped",
}
# The default run: every kind of data, single rows and batches, every kernel a CPU run takes
# (the longer rows, which add only loop trips, and more draws with the exhaustive cases).
DEFAULT = {(1024, "x100", 1), (8193, "randn", 2), (16384, "x10", 2), (32768, "shifted", 1),
           (65537, "x10", 2)}


def _rows(n: int, data: str, rows: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + n + rows)
    scale, shift = DATA[data]
    shape = (n,) if rows == 1 else (rows, n)
    x = torch.randn(shape, generator=g) * scale + shift
    dy = torch.randn(shape, generator=g)
    return x.to(device), dy.to(device)


def _ulp(v: float) -> float:
    t = torch.tensor(v, dtype=torch.float32)
    return (torch.nextafter(t, torch.tensor(float("inf"))) - t).item()


def assert_within_torch(got: torch.Tensor, native: torch.Tensor, ref: torch.Tensor, what: str):
    """``got`` within twice ``native``'s error against the float64 ``ref`` (plus the floor)."""
    ref = ref.double().cpu()
    err = (got.double().cpu() - ref).abs().max().item()
    torch_err = (native.double().cpu() - ref).abs().max().item()
    floor = FLOOR_ULPS * _ulp(ref.abs().max().item())
    assert err <= 2 * torch_err + floor, (what, err, torch_err, floor)


def _cases(default=DEFAULT):
    return [pytest.param(n, d, r, marks=() if (n, d, r) in default else pytest.mark.exhaustive,
                         id=f"{n}-{d}-{'row' if r == 1 else f'{r}rows'}")
            for n in LENGTHS for d in DATA for r in (1, 2)]


@pytest.mark.parametrize("n,data,rows", _cases())
def test_layernorm_float32(triton_backend, device, n, data, rows):
    x, _ = _rows(n, data, rows, device)
    g = torch.Generator().manual_seed(n)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(device)
    b = (0.1 * torch.randn(n, generator=g)).to(device)
    assert_within_torch(fused_layernorm(x, n, w, b), F.layer_norm(x, (n,), w, b),
                        F.layer_norm(x.double(), (n,), w.double(), b.double()), "with weights")
    assert_within_torch(fused_layernorm(x, n), F.layer_norm(x, (n,)),
                        F.layer_norm(x.double(), (n,)), "without weights")


# RMSNorm's eps given to both sides: torch's default (None) is the machine epsilon of each
# dtype, 2^-23 for float32 and 2^-52 for the float64 reference, itself an ulp of rstd apart.
RMS_EPS = 1e-6
# A single row of 16384 (randn) was 4.3x torch's error without the weight before rstd's
# Newton step (single-block and split-row kernels).
RMS_DEFAULT = {(1024, "x100", 1), (8193, "randn", 2), (16384, "randn", 1), (17866, "x10", 2),
               (65537, "shifted", 2)}


@pytest.mark.parametrize("n,data,rows", _cases(RMS_DEFAULT))
def test_rmsnorm_float32(triton_backend, device, n, data, rows):
    x, _ = _rows(n, data, rows, device)
    w = (1 + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(n))).to(device)
    assert_within_torch(fused_rmsnorm(x, n, w, RMS_EPS), F.rms_norm(x, (n,), w, RMS_EPS),
                        F.rms_norm(x.double(), (n,), w.double(), RMS_EPS), "with weight")
    assert_within_torch(fused_rmsnorm(x, n, eps=RMS_EPS), F.rms_norm(x, (n,), eps=RMS_EPS),
                        F.rms_norm(x.double(), (n,), eps=RMS_EPS), "without weight")


def test_rmsnorm_float32_unrolled(triton_backend, device, launch_rules):
    """Aligned float32 rows of 8K take the unrolled kernel (rms_fwd_unrolled, UNROLLED_FWD):
    per-lane sums of squares over unrolled chunks, rstd with the other kernels' Newton step."""
    from fusedops.backends.triton.runtime.recording import record_launches

    launch_rules("rmsnorm")  # no launch plan from before (a replay is not recorded)
    n = 8192
    w = (1 + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(n))).to(device)
    for data, rows in (("randn", 1), ("x100", 2), ("shifted", 3)):  # (one call per signature)
        x, _ = _rows(n, data, rows, device)
        with record_launches() as record:
            with_w, without_w = fused_rmsnorm(x, n, w, RMS_EPS), fused_rmsnorm(x, n, eps=RMS_EPS)
        assert [launcher.kernel.__name__ for launcher, *_ in record] == ["rms_fwd_unrolled"] * 2
        assert_within_torch(with_w, F.rms_norm(x, (n,), w, RMS_EPS),
                            F.rms_norm(x.double(), (n,), w.double(), RMS_EPS), data)
        assert_within_torch(without_w, F.rms_norm(x, (n,), eps=RMS_EPS),
                            F.rms_norm(x.double(), (n,), eps=RMS_EPS), data)


def test_layernorm_float32_unaligned_unrolled(triton_backend, device, launch_rules):
    """The unrolled kernel for unaligned rows (ln_fwd_unrolled_vec), which float32 rows of 64K+
    take in calls of 2^24 elements or more; the size threshold lifted to reach it here."""
    launch_rules("layernorm", RELOAD_VEC_MIN_ELEMS=0)
    n = 65537
    g = torch.Generator().manual_seed(n)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(device)
    b = (0.1 * torch.randn(n, generator=g)).to(device)
    for data in ("randn", "x10"):
        x, _ = _rows(n, data, 2, device)
        assert_within_torch(fused_layernorm(x, n, w, b), F.layer_norm(x, (n,), w, b),
                            F.layer_norm(x.double(), (n,), w.double(), b.double()), data)


# Draws the float32 softmax forward failed before its compensated row sums and Newton-refined
# division (interpreter: 32768 x100 on two rows, the reload kernel; H200: single x10 / x100
# rows of 17866, 131072 and 262144, h200/softmax-float32-before.json), and draws near them.
# Those draws, and the longer rows, run with the exhaustive cases (the interpreter takes
# seconds per float32 row of their kernels' compensated sums).
SOFTMAX_DEFAULT = {(1024, "x100", 1), (8193, "x10", 2)}


@pytest.mark.parametrize("n,data,rows", _cases(SOFTMAX_DEFAULT))
def test_softmax_float32(triton_backend, device, n, data, rows):
    x, _ = _rows(n, data, rows, device)
    assert_within_torch(fused_softmax(x, -1), torch.softmax(x, -1),
                        torch.softmax(x.double(), -1), "softmax")


# (exhaustive: seconds per float32 row in the interpreter; both kernels run by default on
# 16-bit rows in test_launch_rules.py)
@pytest.mark.exhaustive
@pytest.mark.parametrize("table,n", [("UNROLLED_FWD", 16384), ("RELOAD_FWD", 16384)])
def test_softmax_float32_two_pass_kernels(triton_backend, device, launch_rules, table, n):
    """The two-pass forwards float32 rows take by rule on a GPU (softmax_fwd_unrolled,
    softmax_fwd_reload), forced here: their sums and division as the single-block kernel's."""
    from fusedops.backends.triton.configs import softmax as sm_rules
    from fusedops.backends.triton.runtime.recording import record_launches

    rule = {"UNROLLED_FWD": {(4, n): ((4096, 16),)}, "RELOAD_FWD": {(4, n): (8192, 32)}}[table]
    launch_rules("softmax", **{"UNROLLED_FWD": {}, "RELOAD_FWD": {}, table: rule},
                 RELOAD_FWD_ABOVE=min(sm_rules.RELOAD_FWD_ABOVE, n // 2))
    kernel = {"UNROLLED_FWD": "softmax_fwd_unrolled", "RELOAD_FWD": "softmax_fwd_reload"}[table]
    for data, rows in (("randn", 1), ("x100", 2)):  # (one call per signature)
        x, _ = _rows(n, data, rows, device)
        with record_launches() as record:
            y = fused_softmax(x, -1)
        assert [launcher.kernel.__name__ for launcher, *_ in record] == [kernel]
        assert_within_torch(y, torch.softmax(x, -1), torch.softmax(x.double(), -1), data)


# --- the split-row kernels on the interpreter -------------------------------------------------
# CUDA runs long float32 rows on the split-row kernels, whose programs wait for each other; the
# interpreter runs programs one after another. Two launches compute what one cooperative launch
# does: the first publishes every piece's partials (arrival counters pre-filled, so no program
# waits; the rows it writes are discarded), the second recomputes with all partials in place.
SPLIT_PIECE = 8192  # the float32 piece of the split-row rules


@pytest.fixture
def split_on_interpreter(monkeypatch):
    if not INTERPRETING:
        pytest.skip("CUDA runs the split-row kernels themselves (the tests above)")
    import triton.runtime.interpreter as interpreter

    # The edge mask of unaligned rows ((chunk == 0) & ...) is an i1 compiled, an int32 array in
    # the interpreter, which its loads and stores reject.
    lib = interpreter._interpreter
    load, store = lib.load, lib.store
    monkeypatch.setattr(lib, "load", lambda p, m, o, d: load(p, m.astype(bool), o, d))
    monkeypatch.setattr(lib, "store", lambda p, v, m: store(p, v, m.astype(bool)))


def _split_launch(kernel, x, tensors, scalars, **consts):
    from fusedops.backends.triton.configs.common import unaligned_vec
    from fusedops.backends.triton.runtime.device import next_pow2
    from fusedops.backends.triton.runtime.split import split_pieces

    m, n = x.shape
    vec = unaligned_vec(n, (n, n), 4, (x,))
    c, length = split_pieces(n, SPLIT_PIECE, vec)
    stats = torch.zeros(m * c * 2)
    count = torch.full((m,), 2 * c, dtype=torch.int32)
    block = next_pow2(length)
    for _ in range(2):
        kernel[(m * c,)](*tensors, stats, count, n, length, *scalars, m * c, m * c,
                         BLOCK=block, C=c, C_P2=next_pow2(c), PREFETCH=0, VEC=vec, **consts)


@pytest.mark.parametrize("n,data,rows", [
    pytest.param(n, d, r, marks=() if (n, d, r) in {(65537, "x10", 1)}
                 else pytest.mark.exhaustive, id=f"{n}-{d}-{r}")
    for n in (65536, 65537, 131072, 262144) for d in DATA for r in (1, 2)])
def test_split_rows_layernorm_float32(triton_backend, split_on_interpreter, n, data, rows):
    from fusedops.backends.triton.kernels.layernorm_fwd import ln_fwd_split

    x, _ = _rows(n, data, rows, "cpu")
    x = x.reshape(-1, n)
    g = torch.Generator().manual_seed(n)
    w, b = 1 + 0.1 * torch.randn(n, generator=g), 0.1 * torch.randn(n, generator=g)
    yl = torch.empty_like(x)
    mean, rstd = torch.empty(x.shape[0]), torch.empty(x.shape[0])
    _split_launch(ln_fwd_split, x, (x, w, b, yl, mean, rstd), (n, n, 1e-5),
                  HAS_W=True, HAS_B=True)
    assert_within_torch(yl, F.layer_norm(x, (n,), w, b),
                        F.layer_norm(x.double(), (n,), w.double(), b.double()), "layernorm")


@pytest.mark.parametrize("n,data,rows", [
    pytest.param(n, d, r, marks=() if (n, d, r) in {(16384, "randn", 1)}
                 else pytest.mark.exhaustive, id=f"{n}-{d}-{r}")
    for n in (16384, 65536, 65537, 131072, 262144) for d in DATA for r in (1, 2)])
def test_split_rows_rmsnorm_float32(triton_backend, split_on_interpreter, n, data, rows):
    from fusedops.backends.triton.kernels.rmsnorm_split import rms_fwd_split

    x, _ = _rows(n, data, rows, "cpu")
    x = x.reshape(-1, n)
    w = 1 + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(n))
    for weight in (w, None):
        y, rstd = torch.empty_like(x), torch.empty(x.shape[0])
        _split_launch(rms_fwd_split, x, (x, x if weight is None else w, y, rstd),
                      (n, n, RMS_EPS), HAS_W=weight is not None, STATS=True, CLUSTER=False)
        w64 = None if weight is None else w.double()
        assert_within_torch(y, F.rms_norm(x, (n,), weight, RMS_EPS),
                            F.rms_norm(x.double(), (n,), w64, RMS_EPS), f"weight {w64 is not None}")
