"""The host-side launch rules of the Triton backend (fusedops/triton/_common.py, layernorm.py).

These rules were chosen from H200 measurements (benchmarks/results/tune-h200-2026-11-21/); the
tests pin the decisions the docs describe, and the invariants every kernel relies on (a split
grid is a multiple of its chunk count, chunks cover the row, partial buffers stay bounded).
They need no GPU: they call the pure-Python rule functions.
"""

from __future__ import annotations

import pytest
import torch
import triton
from conftest import assert_close_to_ref

from fusedops.triton import _common
from fusedops.triton import layernorm as tln
from fusedops.triton import softmax as tsm


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 9, 1000, 1024, 1025, 65537, 1 << 20])
def test_next_pow2_matches_triton(n):
    assert _common.next_pow2(n) == triton.next_power_of_2(max(n, 1))


def test_cdiv_matches_triton():
    for a in range(0, 70):
        for b in range(1, 17):
            assert _common.cdiv(a, b) == triton.cdiv(a, b)


def test_row_config_rules():
    rc = _common.row_config
    # softmax forward: 4 KB tiles on 4 warps for short rows; 8 warps at 16K columns; 16 above
    assert rc(256, "softmax_fwd", 4) == (True, 256, 4, 4)
    assert rc(1024, "softmax_fwd", 2) == (True, 1024, 2, 4)
    # short 16-bit rows: one warp per 1K-element softmax tile, 2K-element LayerNorm tile
    assert rc(256, "softmax_fwd", 2) == (True, 256, 4, 1)
    assert rc(128, "softmax_fwd", 2) == (True, 128, 8, 1)
    assert rc(1024, "ln_fwd", 2) == (True, 1024, 2, 1)
    assert rc(512, "ln_fwd", 2) == (True, 512, 8, 2)
    # 16-bit softmax backward: 16 warps up to 8K-element tiles from 2K rows, 8 for 16K/32K
    assert rc(2048, "softmax_bwd", 2)[3] == 16
    assert rc(16384, "softmax_bwd", 2)[3] == 8
    assert rc(2048, "softmax_bwd", 4)[3] == 8
    assert rc(8192, "softmax_fwd", 2)[3] == 8  # a 16 KB row: 8 warps
    assert rc(16384, "softmax_fwd", 4)[3] == 8
    assert rc(32768, "softmax_fwd", 2)[3] == 16
    # float32 softmax backward: 32K rows go to the split-row/looped kernels, 16-bit stay
    assert rc(32768, "softmax_bwd", 4)[0] is False
    assert rc(32768, "softmax_bwd", 2)[0] is True
    # short float32 LayerNorm rows: 8 KB tiles on 4 warps
    assert rc(256, "ln_fwd", 2) == (True, 256, 8, 1)
    assert rc(256, "ln_fwd", 4) == (True, 256, 8, 4)
    assert rc(4096, "ln_fwd", 2) == (True, 4096, 2, 4)  # 8192-element tiles above 2 KB rows
    # above every cap: looped chunks
    assert rc(1 << 20, "ln_bwd", 2)[0] is False


def test_grid_size_rules():
    dev = torch.device("cpu")  # num_sms reports 4 off-GPU
    # one program per tile for softmax and short LayerNorm forward rows
    assert _common.grid_size(1000, 4, "softmax_fwd", dev, 256) == 1000
    assert _common.grid_size(1000, 4, "ln_fwd", dev, 8192) == 1000
    # persistent: one resident wave (2048 threads per SM), never more programs than tiles
    assert _common.grid_size(1000, 16, "ln_fwd", dev, 16384) == 4 * 4
    assert _common.grid_size(3, 16, "ln_fwd", dev, 16384) == 3
    assert _common.grid_size(1000, 8, "ln_bwd", dev, 1024) == 4 * 8


@pytest.mark.parametrize("n", [8193, 16385, 65537, 100000, 262144, (1 << 22) + 3])
@pytest.mark.parametrize("chunk", [2048, 4096, 8192])
@pytest.mark.parametrize("vec", [0, 4, 8])
def test_split_pieces_cover_the_row(n, chunk, vec):
    c, length = _common.split_pieces(n, chunk, vec)
    assert length <= chunk
    # the pieces cover the row and the last one starts inside it (with unaligned rows it covers
    # part of the aligned body, up to 2·(VEC - 1) shorter than the row, and may be empty for
    # some rows when there are thousands of pieces: the kernels give an empty piece weight 0)
    assert c * length >= n > (c - 1) * length
    if c <= 132:  # no empty pieces where split rows run (all pieces resident on an H100/H200)
        assert (c - 1) * length < n - 2 * vec
    assert c == _common.cdiv(n, chunk)
    if vec:
        assert length % 16 == 0  # pieces of the body start 16-byte aligned


def test_split_config_rules():
    cfg = tln._split_config
    # forward (piece, warps, prefetch): aligned float32 8192/4, 16-bit 8192/8
    assert cfg("fwd", 65537, 2, False) == (8192, 4, 3)  # unaligned rows
    assert cfg("fwd", 65536, 4, True) == (8192, 4, 1)
    assert cfg("fwd", 65537, 4, False) == (8192, 4, 3)
    assert cfg("fwd", 65536, 2, True) == (8192, 8, 1)
    assert cfg("fwd", 131072, 2, True) == (8192, 8, 1)
    assert cfg("fwd", 262144, 2, True) is None  # aligned 16-bit 256K: looped measured faster
    # backward (piece, warps, prefetch[, register cap[, clusters]]); the cluster rules (16-bit
    # 16K-64K, float32 16K-64K, aligned rows) in tests/test_clusters.py
    assert cfg("bwd", 8192, 2, True) == (4096, 8, 1, 128)
    assert cfg("bwd", 131072, 2, True) == (8192, 16, 1)
    assert cfg("bwd", 262144, 2, True) == (8192, 8, 3)
    assert cfg("bwd", 8193, 2, False) == (8192, 8, 2)
    assert cfg("bwd", 65537, 2, False) == (8192, 16, 1)
    # unaligned rows as aligned-body pieces plus edges (VEC > 0): float32 bodies of 16K+
    # (rounds 28-29); None = scalar pieces (16-bit: PyTorch's native kernel, see below)
    assert tln.VEC_SPLIT_BWD == {4: ((4096, 4, 2), 16384)}
    assert cfg("bwd", 16385, 4, False, 4) == cfg("bwd", 262145, 4, False, 4) == (4096, 4, 2)
    assert cfg("bwd", 8193, 4, False, 4) is None
    assert cfg("bwd", 65537, 2, False, 8) is None
    assert cfg("bwd", 8193, 4, False) == (2048, 4, 2)
    assert cfg("bwd", 32768, 4, False) == (2048, 4, 0)
    assert cfg("bwd", 65536, 4, False) == (4096, 4, 2)
    assert cfg("bwd", 262144, 4, True) == (8192, 8, 2)
    # softmax: prefetch by direction, dtype and alignment
    assert tsm._split_config("fwd", 2, 0, 65536) == (4096, 4, 3)
    assert tsm._split_config("fwd", 2, 0, 131072) == (8192, 8, 3)
    assert tsm._split_config("fwd", 4, 0, 65536) == (8192, 8, 1)
    assert tsm._split_config("fwd", 2, 8, 65537) == (4096, 4, 3)  # unaligned rows
    assert tsm._split_config("fwd", 4, 4, 65537) == (8192, 8, 3)
    assert tsm._split_config("bwd", 2) == (8192, 8, 1)
    assert tsm._split_config("bwd", 4) == tsm._split_config("bwd", 4, 4) == (8192, 8, 0)
    assert tsm._split_config("bwd", 2, 8) == (8192, 8, 2)  # unaligned rows


def test_fused_backward_stages_rule(monkeypatch, device):
    """Pipelined tile loop (three stages) for aligned 16-bit blocks of 1K and 2K only; the
    launch passes it (STAGES, the kernel's last argument), also to the parked dx launch."""
    stages = tln._fused_bwd_stages
    assert stages(1024, 2, (768, 768, 768)) == stages(2048, 2, (2048, 2048, 2048)) == 3
    assert stages(512, 2, (512,) * 3) == stages(4096, 2, (4096,) * 3) == 1
    assert stages(1024, 4, (1024,) * 3) == 1  # float32
    assert stages(2048, 2, (1500,) * 3) == 1  # unaligned rows
    assert stages(2048, 2, (2048, 2048, 1500)) == 1
    monkeypatch.setattr(tln, "FUSED_BWD_STAGES", 2)
    assert stages(4096, 4, (4096,) * 3) == 2
    monkeypatch.setattr(tln, "FUSED_BWD_STAGES", None)
    seen = []
    real = tln._launch_bwd_single
    monkeypatch.setattr(tln, "_launch_bwd_single", lambda grid, args, warps: seen.append(
        args[-1]) or real(grid, args, warps))
    for n, want in ((768, 3), (4096, 1)):
        x = torch.randn(16, n, dtype=torch.bfloat16, device=device)
        w = torch.randn(n, dtype=torch.bfloat16, device=device)
        _, mean, rstd = tln.layernorm_forward(x, w, None, 1e-5, x.dtype)
        seen.clear()
        tln.layernorm_backward(torch.randn_like(x), x, w, mean, rstd, True, True, True)
        assert seen and set(seen) == {want}, n  # (a parked dx launch follows in low_memory)


def test_split_config_overrides(monkeypatch):
    monkeypatch.setattr(tln, "SPLIT_CONFIG", (1024, 2, 0))
    monkeypatch.setattr(tln, "SPLIT_BWD_CONFIG", (512, 4, 2))
    assert tln._split_config("fwd", 1 << 20, 2, True) == (1024, 2, 0)
    assert tln._split_config("bwd", 16384, 2, True) == (512, 4, 2)
    monkeypatch.setitem(tsm.SPLIT_CONFIG, "bwd", (4096, 4, 2))
    assert tsm._split_config("bwd", 4) == (4096, 4, 2)


def test_fused_backward_config():
    # (ROWS, warps, programs per SM, ACC_1D)
    assert tln._fused_bwd_config(256) == (16, 8, 2, False)  # 2-D accumulators for short rows
    assert tln._fused_bwd_config(512, False, 2) == (4, 4, 4, False)  # 16-bit: 2K tiles, 4/SM
    assert tln._fused_bwd_config(512, False, 4) == (8, 8, 2, False)
    assert tln._fused_bwd_config(1024) == (4, 8, 2, False)
    assert tln._fused_bwd_config(2048) == (2, 8, 2, True)
    assert tln._fused_bwd_config(4096) == (4, 16, 1, True)  # 16K-element tiles from 4K
    assert tln._fused_bwd_config(8192) == (2, 16, 1, True)
    # float32 rows of 4K-8K: 8K-element tiles (round 51), aligned or not
    assert tln._fused_bwd_config(8192, False, 4) == (1, 16, 1, True)
    assert tln._fused_bwd_config(4096, False, 4) == (2, 16, 1, True)
    assert tln._fused_bwd_config(2048, False, 4) == (2, 8, 2, True)
    # the body variant of unaligned rows: one row per tile (multi-row tiles spill), two programs
    # per SM; float32 bodies of 4K+ on 8K-element tiles, one program per SM
    assert tln._fused_bwd_config(8192, True, 2) == (1, 16, 2, True)
    assert tln._fused_bwd_config(4096, True, 2) == (1, 8, 2, True)
    assert tln._fused_bwd_config(2048, True, 4) == (1, 4, 2, True)
    assert tln._fused_bwd_config(4096, True, 4) == (2, 16, 1, True)
    assert tln._fused_bwd_config(8192, True, 4) == (1, 16, 1, True)


def test_partial_rows_bounded_by_an_eighth_of_x():
    for m, n, dtype in [(4096, 1024, torch.float32), (8, 32768, torch.bfloat16),
                        (1, 300, torch.float16), (100000, 64, torch.bfloat16)]:
        x = torch.empty(m, n, dtype=dtype)
        rows = tln._max_partial_rows(x)
        assert rows >= 1
        if rows > 1:
            assert 2 * rows * n * 4 <= x.numel() * x.element_size() / 8 + 1


def test_native_backward_only_for_unaligned_long_16bit_cuda_rows():
    # CPU tensors never take the native path (it is measured and enabled on CUDA only)
    x = torch.empty(2, 8193, dtype=torch.bfloat16)
    assert not tln._native_unaligned(x, x, torch.empty(8193, dtype=torch.bfloat16))


def test_split_programs_are_a_multiple_of_the_chunks(monkeypatch):
    launcher = _common.SplitLauncher(tln._ln_fwd_split)
    dev = torch.device("cpu")
    x = torch.empty(2, 8)
    runtime = (x, x, x, x, x, x, x, x, 8, 4, 8, 8, 1e-5, 6)
    consts = (4, 3, 4, True, True, 1, 0)
    first = launcher.programs(30, 3, runtime, consts, 4, dev)
    assert first % 3 == 0 and first >= 3
    # the same arguments always give the same grid (deterministic partial sums)
    assert launcher.programs(30, 3, runtime, consts, 4, dev) == first
    assert launcher.programs(3, 3, runtime, consts, 4, dev) == 3  # one row: all its pieces
    # unaligned rows: a multiple of C·VEC (rows of a program share one misalignment), all
    # items when they fit, 0 when no such grid fits
    assert launcher.programs(30, 3, runtime, consts, 4, dev, vec=8) in (0, 30)
    monkeypatch.setattr(_common, "num_sms", lambda device: 100)
    many = launcher.programs(3000, 3, runtime, consts, 4, dev, vec=2)
    assert many % 6 == 0 and 0 < many < 3000


def test_unaligned_config_rules():
    uc = _common.unaligned_config
    # aligned rows: row_config unchanged, VEC 0
    assert uc(8192, "softmax_fwd", 2, 0) == (*_common.row_config(8192, "softmax_fwd", 2), 0)
    # 2^k + 1 rows: configured for the 2^k aligned body (not padded to 2^(k+1)), with the
    # round-9 warps
    assert uc(8193, "softmax_fwd", 2, 8) == (True, 8192, 1, 4, 8)
    assert uc(8193, "softmax_bwd", 2, 8)[1:] == (8192, 1, 8, 8)
    assert uc(1025, "softmax_bwd", 2, 8)[3:] == (16, 8)
    assert uc(32769, "softmax_fwd", 2, 8)[:2] == (True, 32768)
    assert not uc(65537, "softmax_fwd", 2, 8)[0]  # softmax forward rows of 64K+: split rows
    # short float32 backward rows (and LayerNorm dx rows up to 1K) stay on scalar access
    assert uc(1025, "softmax_bwd", 4, 4) == (*_common.row_config(1025, "softmax_bwd", 4), 0)
    assert uc(1025, "ln_bwd", 2, 8)[-1] == 0
    assert uc(4097, "ln_bwd", 2, 8)[1:] == (4096, _common.row_config(4096, "ln_bwd", 2)[2], 4, 8)


NEEDS_KERNELS = pytest.mark.skipif(not _common._interpreting() and not torch.cuda.is_available(),
                                   reason="needs the Triton interpreter or a GPU")


def _recording(monkeypatch, mod, name, calls, pick):
    """Replace launcher ``mod.name`` by one that records ``pick(grid, args, warps)`` per launch
    (launch plans still get the real launcher's C entry)."""
    real = getattr(mod, name)

    class Recorder:
        entry = real.entry

        def __call__(self, grid, args, warps):
            calls.append(pick(grid, args, warps))
            return real(grid, args, warps)
    monkeypatch.setattr(mod, name, Recorder())


@NEEDS_KERNELS
def test_long_16bit_layernorm_forward_without_split_rows(monkeypatch):
    """16-bit rows of 64K take the split-row kernel (round 22); without it (the interpreter, a
    refused cooperative launch) the two-pass looped kernel, with row_config's chunk."""
    calls = []
    _recording(monkeypatch, tln, "_launch_fwd_looped", calls, lambda g, a, w: (a[10], w))
    monkeypatch.setattr(_common, "_split_state", {"enabled": False})
    monkeypatch.setattr(tln, "UNROLLED_FWD", {})  # 64K rows have an unrolled rule (below)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = (torch.randn(2, 65536, device=device) * 3 + 100).to(torch.bfloat16)
    w = torch.randn(65536, device=device)
    y, mean, rstd = tln.layernorm_forward(x, w, None, 1e-5, torch.bfloat16)
    single, block, _, warps = _common.row_config(65536, "ln_fwd", 2)
    assert not single and calls == [(block, warps)]
    ref = torch.nn.functional.layer_norm(x.double(), (65536,), w.double())
    torch.testing.assert_close(y.double(), ref, atol=0.05, rtol=0.02)
    torch.testing.assert_close(mean.double(), x.double().mean(-1), atol=1e-3, rtol=1e-5)


def test_reload_rules():
    # Rounds 16 and 18 (H200): rows read whole, then again from L2: (element size, padded row)
    # -> (second-pass chunk, warps[, THIRD_READ for LayerNorm | first-pass piece for softmax]).
    assert tln.RELOAD_FWD == {(2, 4096): (1024, 4), (2, 8192): (1024, 8),
                              (2, 16384): (4096, 16), (2, 32768): (8192, 32, True),
                              (4, 16384): (2048, 16), (4, 32768): (8192, 32)}
    assert tsm.RELOAD_BWD == {(2, 2048): (2048, 8), (2, 4096): (4096, 16),
                              (2, 16384): (4096, 32), (2, 32768): (32768, 32),
                              (4, 32768): (32768, 32)}
    # Round 27: the softmax forward's reload kernel
    assert tsm.RELOAD_FWD == {(2, 65536): (16384, 32), (4, 32768): (8192, 32)}
    assert min(k[1] for k in tsm.RELOAD_FWD) > tsm.RELOAD_FWD_ABOVE
    # the host paths skip the lookup for rows shorter than every key
    assert min(k[1] for k in tln.RELOAD_FWD) > tln.RELOAD_FWD_ABOVE
    assert min(k[1] for k in tsm.RELOAD_BWD) > tsm.RELOAD_BWD_ABOVE


@NEEDS_KERNELS
@pytest.mark.parametrize("n", [16384, 12000])
def test_reload_kernels_take_their_rows(monkeypatch, n):
    """Aligned rows whose padded length has a reload rule run the reload kernels (forward
    LayerNorm, backward softmax) with the rule's chunk and warps, unless the forward's unrolled
    rule takes them (16384: a multiple of its chunk; 12000 is not); unaligned rows do not
    (their forward has its own reload kernel, tested below)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fwd, bwd, unrolled = [], [], []
    _recording(monkeypatch, tln, "_launch_fwd_reload", fwd, lambda g, a, w: (g, a[10], a[11], w))
    _recording(monkeypatch, tln, "_launch_fwd_unrolled", unrolled,
               lambda g, a, w: (g, a[10], a[11], w))
    _recording(monkeypatch, tsm, "_launch_bwd_looped", bwd, lambda g, a, w: (g, a[7], a[8], w))
    x = torch.randn(3, n, device=device).to(torch.bfloat16)
    tln.layernorm_forward(x, None, None, 1e-5, torch.bfloat16)
    tsm.softmax_backward(torch.softmax(x, -1), x, torch.bfloat16)
    if n == 16384:
        assert unrolled == [((3,), 16384, 4096, 16)] and fwd == []
    else:
        assert fwd == [((3,), 16384, 4096, 16)] and unrolled == []
    assert bwd == [((3,), 4096, 16384, 32)]
    odd = torch.randn(3, n + 1, device=device).to(torch.bfloat16)
    tln.layernorm_forward(odd, None, None, 1e-5, torch.bfloat16)
    tsm.softmax_backward(torch.softmax(odd, -1), odd, torch.bfloat16)
    assert len(fwd) + len(unrolled) == 1 and len(bwd) == 1


def test_unrolled_rules():
    # Rounds 31-32 (H200): (element size, padded row) -> (chunk, warps) configs, the first whose
    # chunk divides N taken.
    assert tln.UNROLLED_FWD == {
        (2, 1024): ((512, 2),), (2, 2048): ((2048, 4), (512, 4)),
        (2, 4096): ((4096, 0), (1024, 4), (512, 4)), (2, 8192): ((2048, 8), (1024, 8)),
        (2, 16384): ((4096, 16),), (2, 32768): ((8192, 32), (1024, 8)),
        (2, 65536): ((16384, 32),), (2, 131072): ((16384, 32),), (2, 262144): ((16384, 32),),
        (4, 1024): ((1024, 4),), (4, 2048): ((2048, 8),),
        (4, 4096): ((2048, 16), (1024, 8), (512, 4)), (4, 8192): ((2048, 16), (1024, 8)),
        (4, 65536): ((16384, 32),)}
    for (_, padded), configs in tln.UNROLLED_FWD.items():
        assert padded > tln.UNROLLED_FWD_ABOVE  # the host path skips shorter rows' lookup
        for chunk, warps in configs:
            assert padded % chunk == 0 and (warps == 0 or chunk % (32 * warps) == 0)
    # Round 41: unaligned rows, (element size, padded body) -> (chunk, warps)
    assert tln.UNROLLED_VEC_FWD == {(2, 65536): (8192, 32), (4, 65536): (16384, 32),
                                    (2, 131072): (16384, 32), (2, 262144): (8192, 32),
                                    (4, 131072): (8192, 32), (4, 262144): (8192, 32)}
    for (_, padded), (chunk, warps) in tln.UNROLLED_VEC_FWD.items():
        assert padded % chunk == 0 and chunk % (32 * warps) == 0


def test_unrolled_rules_per_gpu(monkeypatch):
    # Round 50 (H100): 16-bit 4K and 8K entries replaced where the device name says H100.
    assert tln.UNROLLED_FWD_GPU == {"H100": {(2, 4096): ((2048, 8), (1024, 4), (512, 4)),
                                             (2, 8192): ((2048, 16), (1024, 8))}}
    for rules in tln.UNROLLED_FWD_GPU.values():
        for (_, padded), configs in rules.items():
            for chunk, warps in configs:
                assert padded % chunk == 0 and chunk % (32 * warps) == 0
    monkeypatch.setattr(tln, "device_name", lambda index: "NVIDIA H100 80GB HBM3")
    assert tln._unrolled_fwd_table(0, (2, 8192))[(2, 8192)] == ((2048, 16), (1024, 8))
    assert tln._unrolled_fwd_table(0, (2, 4096))[(2, 4096)] == ((2048, 8), (1024, 4), (512, 4))
    for key in tln.UNROLLED_FWD:  # every other entry: the shared table
        if key not in ((2, 4096), (2, 8192)):
            assert tln._unrolled_fwd_table(0, key) is tln.UNROLLED_FWD
    assert tln.UNROLLED_FWD[(2, 8192)] == ((2048, 8), (1024, 8))  # the shared table unchanged
    monkeypatch.setattr(tln, "device_name", lambda index: "NVIDIA H200")
    assert tln._unrolled_fwd_table(0, (2, 8192)) is tln.UNROLLED_FWD
    assert tln._unrolled_fwd_table(-1, (2, 8192)) is tln.UNROLLED_FWD  # CPU: no device name
    monkeypatch.setattr(tln, "device_name", lambda index: "NVIDIA H100 PCIe")
    monkeypatch.setattr(tln, "UNROLLED_FWD_GPU", {})
    assert tln._unrolled_fwd_table(0, (2, 8192)) is tln.UNROLLED_FWD


def test_softmax_unrolled_rules():
    # Round 35 (H200): the softmax forward's (element size, padded row) -> (chunk, warps).
    assert tsm.UNROLLED_FWD == {
        (2, 4096): ((2048, 8),), (2, 8192): ((2048, 8),), (2, 16384): ((2048, 8),),
        (2, 65536): ((8192, 16),), (4, 16384): ((4096, 16),)}
    assert tsm.UNROLLED_VEC_FWD == {(2, 65536): (8192, 16)}  # round 42: unaligned rows
    for (_, padded), configs in tsm.UNROLLED_FWD.items():
        assert padded > tsm.UNROLLED_FWD_ABOVE
        for chunk, warps in configs:
            assert padded % chunk == 0 and (warps == 0 or chunk % (32 * warps) == 0)


def test_softmax_unrolled_backward_rules():
    # Round 43 (H200): aligned (element size, padded row) -> configs; unaligned (element size,
    # padded body) -> (chunk, warps). float32 and aligned 16-bit 128K/256K stay on split rows.
    assert tsm.UNROLLED_BWD == {(2, 65536): ((16384, 32),)}
    assert tsm.UNROLLED_VEC_BWD == {(2, 65536): (8192, 32), (2, 131072): (16384, 32),
                                    (2, 262144): (8192, 16)}
    for (_, padded), configs in tsm.UNROLLED_BWD.items():
        assert padded > tsm.UNROLLED_BWD_ABOVE  # the host path skips shorter rows' lookup
        for chunk, warps in configs:
            assert padded % chunk == 0 and chunk % (32 * warps) == 0
    for (_, padded), (chunk, warps) in tsm.UNROLLED_VEC_BWD.items():
        # unaligned rows: N > padded / 2 + 1 > UNROLLED_BWD_ABOVE for any body padded to it
        assert padded // 2 >= tsm.UNROLLED_BWD_ABOVE and padded % chunk == 0
        assert chunk % (32 * warps) == 0


@NEEDS_KERNELS
@pytest.mark.parametrize("dtype,n,want", [
    (torch.bfloat16, 65536, (65536, 65536, 16384, 0, 32)),
    (torch.float16, 65537, (65537, 65528, 8192, 8, 32)),
    (torch.bfloat16, 131073, (131073, 131064, 16384, 8, 32)),
    (torch.bfloat16, 131072, None),  # aligned 128K: split rows
    (torch.float32, 65537, None),  # float32: split rows
    (torch.bfloat16, 32768, None),  # the reload kernel
])
def test_softmax_unrolled_backward_takes_its_rows(monkeypatch, dtype, n, want):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    calls = []
    _recording(monkeypatch, tsm, "_launch_bwd_unrolled", calls, lambda g, a, w: (g, *a[5:], w))
    y = torch.softmax(torch.randn(2, n, device=device), -1).to(dtype)
    dy = torch.randn(2, n, device=device, dtype=dtype)
    dx = tsm.softmax_backward(y, dy, dtype)
    assert calls == ([((2,), *want)] if want else [])
    yf, dyf = y.float(), dy.float()
    want_dx = yf * (dyf - (yf * dyf).sum(-1, keepdim=True))
    torch.testing.assert_close(dx.float(), want_dx, atol=1e-6, rtol=0.02)


@NEEDS_KERNELS
@pytest.mark.parametrize("dtype,n,want", [
    (torch.bfloat16, 16384, (16384, 2048, 8)),
    (torch.bfloat16, 12288, (12288, 2048, 8)),
    (torch.float16, 65536, (65536, 8192, 16)),
    (torch.float32, 16384, (16384, 4096, 16)),
    (torch.bfloat16, 32768, None),  # no rule: single-block
    (torch.bfloat16, 13000, None),  # 13000 % 2048 != 0
    (torch.float32, 65536, None),  # no rule
])
def test_softmax_unrolled_forward_takes_its_rows(monkeypatch, dtype, n, want):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    calls = []
    _recording(monkeypatch, tsm, "_launch_fwd_unrolled", calls, lambda g, a, w: (*a[5:], w))
    x = torch.randn(2, n, device=device, dtype=dtype)
    y = tsm.softmax_forward(x, dtype)
    assert calls == ([want] if want else [])
    torch.testing.assert_close(y.float(), torch.softmax(x.float(), -1), atol=2e-6, rtol=0.02)


@NEEDS_KERNELS
@pytest.mark.parametrize("dtype,n,want", [
    (torch.bfloat16, 8192, (8192, 2048, 8)),
    (torch.bfloat16, 6144, (6144, 2048, 8)),
    (torch.bfloat16, 5120, (5120, 1024, 8)),  # the second config: 5120 % 2048 != 0
    (torch.bfloat16, 4608, None),  # no config divides it: the reload kernel
    (torch.float32, 1024, (1024, 1024, 4)),
    (torch.bfloat16, 4096, None),  # (4096, 0): the reload kernel
    (torch.bfloat16, 3072, (3072, 1024, 4)),  # ... and below it the next configs
    (torch.bfloat16, 2560, (2560, 512, 4)),
    (torch.bfloat16, 16640, None),  # 32K padded, 16640 % 1024 != 0
    (torch.float32, 16384, None),  # no rule
])
def test_unrolled_forward_takes_its_rows(monkeypatch, dtype, n, want):
    monkeypatch.setattr(tln, "UNROLLED_FWD_GPU", {})  # the shared table (per-GPU: below)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    calls = []
    _recording(monkeypatch, tln, "_launch_fwd_unrolled", calls,
               lambda g, a, w: (a[10], a[11], w))
    x = torch.randn(2, n, device=device, dtype=dtype)
    w = torch.randn(n, device=device)
    y = tln.layernorm_forward_y(x, w, None, 1e-5, dtype)
    assert calls == ([want] if want else [])
    ref = torch.nn.functional.layer_norm(x.double(), (n,), w.double())
    torch.testing.assert_close(y.double(), ref, atol=0.05, rtol=0.02)


@NEEDS_KERNELS
@pytest.mark.parametrize("dtype,n,want", [
    (torch.bfloat16, 65536, (65536, 16384, 65536, 32)),
    (torch.bfloat16, 40000, (65536, 16384, 0, 32)),  # masked, not unrolled
    (torch.float32, 32768, (32768, 8192, 32768, 32)),
    (torch.bfloat16, 32768, None),  # no rule: single-block
    (torch.bfloat16, 65537, None),  # unaligned rows: split rows or looped
])
def test_softmax_forward_reload_takes_its_rows(monkeypatch, dtype, n, want):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    calls = []
    _recording(monkeypatch, tsm, "_launch_fwd_reload", calls, lambda g, a, w: (g, *a[5:], w))
    monkeypatch.setattr(tsm, "UNROLLED_FWD", {})  # 64K rows have an unrolled rule (above)
    x = torch.randn(3, n, device=device, dtype=dtype)
    y = tsm.softmax_forward(x, dtype)
    assert calls == ([((3,), *want)] if want else [])
    torch.testing.assert_close(y.float(), torch.softmax(x.float(), -1), atol=2e-6, rtol=0.02)


def test_reload_rules_for_unaligned_rows():
    # Round 19 (H100): 16-bit rows that start unaligned (N = 2^k + 1) read whole, then again in
    # chunks, weight/bias from shifted copies: (element size, padded body) -> (chunk, warps).
    assert tln.RELOAD_VEC_FWD == {(2, 4096): (1024, 4), (2, 8192): (1024, 8),
                                  (2, 16384): (4096, 16), (2, 32768): (8192, 32)}


@NEEDS_KERNELS
@pytest.mark.parametrize("n", [4097, 8193])
def test_unaligned_16bit_rows_take_the_reload_kernel(monkeypatch, n):
    """16-bit rows of 2^k + 1 with a RELOAD_VEC_FWD rule run _ln_fwd_reload_vec with the rule's
    chunk and warps in calls of RELOAD_VEC_MIN_ELEMS elements or more (float32 rows, and smaller
    calls, keep the single-block kernel); results against float64."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert tln.RELOAD_VEC_MIN_ELEMS == 1 << 24
    monkeypatch.setattr(tln, "RELOAD_VEC_MIN_ELEMS", 5 * n)
    calls = []
    _recording(monkeypatch, tln, "_launch_fwd_reload_vec", calls,
               lambda g, a, w: (g, a[10], a[11], a[15], w))
    x = (torch.randn(5, n, device=device) * 3 + 50).to(torch.bfloat16)
    w = torch.randn(n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, device=device, dtype=torch.bfloat16)
    y, mean, rstd = tln.layernorm_forward(x, w, b, 1e-5, torch.bfloat16)
    chunk, warps = tln.RELOAD_VEC_FWD[(2, n - 1)]
    assert calls == [((5,), n - 1, chunk, 8, warps)]
    ref = torch.nn.functional.layer_norm(x.double(), (n,), w.double(), b.double())
    torch.testing.assert_close(y.double(), ref, atol=0.05, rtol=0.02)
    torch.testing.assert_close(mean.double(), x.double().mean(-1), atol=1e-3, rtol=1e-5)
    tln.layernorm_forward(x.float(), w.float(), b.float(), 1e-5, torch.float32)
    tln.layernorm_forward(x[:4], w, b, 1e-5, torch.bfloat16)  # below the size threshold
    assert len(calls) == 1


@NEEDS_KERNELS
@pytest.mark.parametrize("n", [20000, 32768])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softmax_backward_32k_reads_whole_rows(monkeypatch, n, dtype):
    """Rows padded to 32K: the looped kernel reads the row whole for the dot product, then in
    one 32K piece again, 32 warps; a power-of-two row unrolled without masks (EVEN = N);
    results against float64."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bwd = []
    _recording(monkeypatch, tsm, "_launch_bwd_looped", bwd,
               lambda g, a, w: (g, a[7], a[8], a[9], a[10], w))
    y = torch.softmax(torch.randn(2, n, device=device, dtype=torch.float64), -1)
    dy = torch.randn(2, n, device=device, dtype=torch.float64)
    dx = tsm.softmax_backward(y.to(dtype), dy.to(dtype), dtype)
    assert bwd == [((2,), 32768, 32768, 32768, n if n == 32768 else 0, 32)]
    y_, dy_ = y.to(dtype).double(), dy.to(dtype).double()
    assert_close_to_ref(dx, y_ * (dy_ - (y_ * dy_).sum(-1, keepdim=True)), dtype, scale=4)
