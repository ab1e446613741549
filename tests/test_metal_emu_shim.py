"""Self-tests of the Metal CPU emulation (tests/metal_emu): the shim and the runtime must model
what the kernel tests rely on, and must report kernels that are wrong.

Each behaviour is checked in the three execution modes: fibers in FIFO order, fibers in a
seeded random order, and OS threads (the mode ThreadSanitizer runs in).
"""

from __future__ import annotations

import pytest
import torch

emu = pytest.importorskip("metal_emu.emu", reason="needs the Metal emulation helper")

MODES = ["fibers", "fibers-random", "threads"]


@pytest.fixture(scope="module")
def selftest():
    return emu.load(emu.HERE, ("selftest.metal",))


@pytest.fixture(params=MODES)
def mode(request, selftest):
    selftest.set_mode(request.param, seed=7)
    yield request.param
    selftest.set_mode("fibers")


def run(lib, name, args, grid, tg):
    """Raw launch with a (x, y) grid of threadgroups of (x, y) threads."""
    keep, ptrs = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            ptrs.append(a.data_ptr())
        else:
            import ctypes

            c = ctypes.c_int64(a)
            keep.append(c)
            ptrs.append(ctypes.addressof(c))
    lib.launch_raw(name, ptrs, grid, tg)


def test_metal_emu_scans_kernel_signatures(selftest):
    kernels = emu.scan_kernels(emu.HERE / "selftest.metal", [emu.HERE])
    by_name = {k.host_name: k for k in kernels}
    assert "selftest_simd" in by_name and by_name["selftest_simd"].n_buffers == 3
    attrs = [p.attr for p in by_name["selftest_builtins"].params]
    assert attrs[0] == "buffer" and "simdgroups_per_threadgroup" in attrs
    # The shipped shaders: every instantiation is found, with its host_name.
    names = {k.host_name for f in emu.SHADER_FILES
             for k in emu.scan_kernels(emu.SHADER_DIR / f, [emu.SHADER_DIR])}
    assert "fusedops_softmax_fwd_single_bfloat_float" in names
    assert "fusedops_layernorm_dwdb_reduce" in names
    assert "fusedops_rmsnorm_bwd_looped_bfloat_float" in names
    assert "fusedops_softmax_masked_fwd_looped_bfloat_float_bool" in names
    assert "fusedops_layernorm_epilogue_bwd_single_half_float" in names
    assert len(names) == 123


def test_metal_emu_builtins(selftest, mode):
    grid, tg = (3, 2), (8, 12)  # 96 threads: 3 SIMD-groups, the last one full
    n_threads = 3 * 2 * 8 * 12
    out = torch.full((n_threads, 10), -1, dtype=torch.int32)
    run(selftest, "selftest_builtins", [out], grid, tg)
    for gy in range(2):
        for gx in range(3):
            gid = gx + gy * 3
            for ty in range(12):
                for tx in range(8):
                    tiitg = tx + ty * 8
                    row = out[gid * 96 + tiitg].tolist()
                    assert row == [gx * 8 + tx, gy * 12 + ty, tx, ty, gx, gy, tiitg % 32,
                                   tiitg // 32, 3, 32]


@pytest.mark.parametrize("threads,delta", [(64, 1), (64, 5), (40, 3)])
def test_metal_emu_simd_functions(selftest, mode, threads, delta):
    """Every SIMD-group function against a direct model (a partial last SIMD-group included)."""
    torch.manual_seed(threads + delta)
    groups = 2
    x = (torch.randn(groups, threads) * 4).round() / 4  # exact sums in any order
    x[1, 5] = 0.5
    out = torch.full((groups, 16, threads), float("nan"))
    run(selftest, "selftest_simd", [x, out, delta], (groups,), (threads,))
    for g in range(groups):
        for s0 in range(0, threads, 32):
            v = x[g, s0:s0 + 32]
            n = v.numel()
            lanes = torch.arange(n)
            got = out[g, :, s0:s0 + 32]
            own = v
            down = torch.where(lanes + delta < n, v[(lanes + delta).clamp(max=n - 1)], own)
            up = torch.where(lanes - delta >= 0, v[(lanes - delta).clamp(min=0)], own)
            xor = torch.where((lanes ^ delta) < n, v[(lanes ^ delta).clamp(max=n - 1)], own)
            expect = [
                v.sum().expand(n), v.max().expand(n), v.min().expand(n), v.cumsum(0),
                v.cumsum(0) - v, down, up, xor, v[delta].expand(n), v[(lanes * 7) % 8],
                v[(lanes + delta) % n], v[(lanes - delta) % n],
                v[0].expand(n), v.prod().expand(n), (v > 0).all().float().expand(n),
                (v > 0).any().float().expand(n),
            ]
            for j, e in enumerate(expect):
                if e is not None:
                    torch.testing.assert_close(got[j], e, msg=f"result {j}")


def test_metal_emu_simd_shuffle_from_inactive_lane_is_an_error(selftest):
    x = torch.zeros(1, 36)  # the second SIMD-group has 4 lanes; lane 3 shuffles from lane 5
    out = torch.zeros(1, 16, 36)
    with pytest.raises(emu.EmuError, match="inactive lane"):
        run(selftest, "selftest_simd", [x, out, 1], (1,), (36,))


def test_metal_emu_barrier_orders_threadgroup_memory(selftest, mode):
    n, groups, rounds = 256, 3, 5
    x = torch.randn(groups, n)
    out = torch.empty(groups, n)
    run(selftest, "selftest_rotate", [x, out, rounds], (groups,), (n,))
    torch.testing.assert_close(out, torch.roll(x, -rounds, dims=1), rtol=0, atol=0)


def test_metal_emu_missing_barrier_changes_results(selftest):
    """Without barriers the rotation reads values of the wrong round (or poison): under the
    FIFO and random schedules, and with OS threads."""
    n, groups, rounds = 256, 3, 5
    x = torch.randn(groups, n)
    expect = torch.roll(x, -rounds, dims=1)
    for m in MODES:
        selftest.set_mode(m, seed=3)
        out = torch.empty(groups, n)
        run(selftest, "selftest_rotate_racy", [x, out, rounds], (groups,), (n,))
        assert not torch.equal(out, expect), m
    selftest.set_mode("fibers")


def test_metal_emu_threadgroup_memory_starts_poisoned(selftest, mode):
    out = torch.zeros(64)
    for _ in range(2):
        run(selftest, "selftest_uninitialized", [out, 1000], (1,), (64,))
        assert torch.isnan(out).all()


def test_metal_emu_reports_deadlock(selftest, mode):
    selftest.set_timeout(20)
    out = torch.zeros(64)
    with pytest.raises(emu.EmuError, match="deadlock"):
        run(selftest, "selftest_early_return", [out], (1,), (64,))


def test_metal_emu_reports_divergent_barrier(selftest, mode):
    out = torch.zeros(64)
    with pytest.raises(emu.EmuError, match="divergent threadgroup_barrier"):
        run(selftest, "selftest_divergent_barrier", [out], (1,), (64,))


def test_metal_emu_reports_divergent_simd_collective(selftest, mode):
    out = torch.zeros(32)
    with pytest.raises(emu.EmuError, match="divergent SIMD-group"):
        run(selftest, "selftest_divergent_simd", [out], (1,), (32,))


def test_metal_emu_vector_and_16bit_types(selftest):
    x = torch.tensor([[1.0, -2.5, 3.0e-5, 65504.0], [1 / 3, 1e-40, -0.0, 300.0],
                      [1.00390625, 1.01171875, -1.01171875, 7.0]])
    h = torch.empty(3, 4, dtype=torch.float16)
    b = torch.empty(3, 4, dtype=torch.bfloat16)
    f = torch.empty(3, 4)
    run(selftest, "selftest_types", [x, h, b, f], (3,), (1,))
    assert torch.equal(h, x.to(torch.float16))  # round to nearest even, as Metal
    assert torch.equal(b, x.to(torch.bfloat16))
    w = x * 2 + torch.tensor([1.0, 2.0, 3.0, 4.0])
    expect = torch.stack([torch.maximum(w[:, 0], w[:, 1]), torch.minimum(w[:, 2], w[:, 3]),
                          torch.zeros(3), torch.full((3,), 0.5)], dim=1)
    torch.testing.assert_close(f, expect)


def test_metal_emu_launcher_guards_buffers():
    """The launcher refuses wrong argument types and reports out-of-bounds writes."""
    lib = emu.load()
    lib.set_mode("fibers")
    L = emu.EmuLauncher(lib, 256)
    x = torch.randn(2, 40)
    y = torch.empty(2, 40)
    name = "fusedops_softmax_fwd_single_float_float"
    with pytest.raises(emu.EmuError, match="4-byte elements"):
        L(name, [x.half(), y, 2, 40, 40, 0], 2, 32)
    with pytest.raises(emu.EmuError, match="not a float scalar"):
        L(name, [x, y, 2, 40, 40.0, 0], 2, 32)
    with pytest.raises(emu.EmuError, match="is a scalar but got a tensor"):
        L(name, [x, y, x, 40, 40, 0], 2, 32)
    with pytest.raises(emu.EmuError, match="arguments"):
        L(name, [x, y, 2, 40, 40], 2, 32)
    # Claim 3 rows on a 2-row output: row 2 lands in the guard zone.
    with pytest.raises(emu.EmuError, match="outside the tensor"):
        L(name, [torch.randn(3, 40), y, 3, 40, 40, 0], 3, 32)
