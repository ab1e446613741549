"""The host-side launch rules of the Triton backend (fusedops/backends/triton/configs/): the
invariants every rule must keep, whatever configs measurements pick.

Each test states the invariant it protects: every row length maps to a config, the kernel a
config picks covers the row, the single-block/looped switch sits at the documented limit and
moves with it, configs are valid for the kernels (powers of two, whole vectors per thread,
chunks dividing the rows they unroll), grids never exceed their work and keep the multiples
the kernels rely on, scratch stays bounded, and rows with a rule are routed to its kernel with
its config. The rule values themselves (which chunk, how many warps) are measured choices and
are not restated here; the kernels they pick are checked against float64 in the kernel suites.
They need no GPU: most call the pure-Python rule functions; the routing tests run the kernels
(interpreted on CPU).
"""

from __future__ import annotations

import pytest
import torch
import triton
from conftest import (
    assert_close_to_ref,
    exhaustive_unless,
    forced_split_config,
    ln_backward_vec,
)

from fusedops.backends.triton import configs as tconfigs
from fusedops.backends.triton import layernorm as tln
from fusedops.backends.triton import layernorm_bwd as tlnb
from fusedops.backends.triton import rmsnorm_bwd as trmsb
from fusedops.backends.triton import softmax as tsm
from fusedops.backends.triton.configs import common as tcfg
from fusedops.backends.triton.configs import layernorm as ln_rules
from fusedops.backends.triton.configs import rmsnorm as rms_rules
from fusedops.backends.triton.configs import softmax as sm_rules
from fusedops.backends.triton.runtime import device as rt_device
from fusedops.backends.triton.runtime import split as rt_split
from fusedops.backends.triton.runtime.facts import DeviceFacts, device_facts

KINDS = sorted(tcfg.KIND_CAPS)
ELT_SIZES = (2, 4)
# Row lengths around every power of two a rule may switch at, and a few others.
ROW_LENGTHS = sorted({1, 2, 3, 12000, 100000} | {
    (1 << k) + d for k in range(1, 21) for d in (-1, 0, 1)})


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 9, 1000, 1024, 1025, 65537, 1 << 20])
def test_next_pow2_matches_triton(n):
    assert rt_device.next_pow2(n) == triton.next_power_of_2(max(n, 1))


def test_cdiv_matches_triton():
    for a in range(0, 70):
        for b in range(1, 17):
            assert rt_device.cdiv(a, b) == triton.cdiv(a, b)


# ------------------------------------------------------------------------- single-block / looped


@pytest.mark.parametrize("elt", ELT_SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_every_row_length_maps_to_a_config_that_covers_it(kind, elt):
    """Invariant: row_config answers for every N, with a power-of-two block, rows per program
    and warps (1-32); a single-block config holds the whole row (BLOCK = next_pow2(N) >= N,
    within the kind's cap and the single-block limit), a looped one streams it in several
    chunks of one row per program."""
    limit = min(tcfg.single_block_limit(), tcfg._cap(kind, elt))
    for n in ROW_LENGTHS:
        single, block, rows, warps = tcfg.row_config(n, kind, elt)
        assert _pow2(block) and _pow2(rows) and _pow2(warps) and warps <= 32, (n, kind, elt)
        if single:
            assert block == rt_device.next_pow2(n) >= n and block <= limit, (n, kind, elt)
        else:
            assert rows == 1 and block < n, (n, kind, elt)


@pytest.mark.parametrize("elt", ELT_SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_single_block_switch_is_at_the_limit(kind, elt):
    """Invariant: one switch per kind, at min(single-block limit, the kind's cap): every row up
    to it is single-block, every longer one looped; shrinking the limit (what the looped-path
    tests do) moves the switch with it; the kernel suites' boundary sizes
    (conftest.single_block_limits) are these switch points."""
    from conftest import single_block_limits

    switch = min(tcfg.single_block_limit(), tcfg._cap(kind, elt))
    assert switch in single_block_limits(kind)
    for n in ROW_LENGTHS:
        assert tcfg.row_config(n, kind, elt)[0] == (n <= switch), (n, switch)
    with tconfigs.override(SINGLE_BLOCK_LIMIT=16):
        assert tcfg.row_config(16, kind, elt)[0]
        assert not tcfg.row_config(17, kind, elt)[0]
        assert tcfg.row_config(17, kind, elt)[1] <= 16  # chunks within the shrunk limit
    assert tcfg.row_config(switch, kind, elt)[0] and not tcfg.row_config(
        switch + 1, kind, elt)[0]


def test_single_block_limit_must_be_a_power_of_two():
    """Invariant: only limits the kernels can take (powers of two >= 16) are accepted."""
    for bad in (8, 24, 1000):
        with pytest.raises(ValueError, match="power of two"):
            tcfg.set_single_block_limit(bad)
    assert tcfg.single_block_limit() == tcfg.DEFAULT_SINGLE_BLOCK_LIMIT


@pytest.mark.parametrize("elt", ELT_SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_unaligned_rows_are_configured_for_their_body(kind, elt):
    """Invariant: rows whose starts are not 16-byte aligned (VEC = 16 / element size) are
    configured for their aligned body (N = 2^k + 1 on a 2^k block, not 2^(k+1)); where the
    config drops VEC (scalar access), it is row_config's own config for the row."""
    vec = 16 // elt
    for n in ROW_LENGTHS:
        if n < 2 * vec or n % vec == 0:
            continue
        single, block, rows, warps, v = tcfg.unaligned_config(n, kind, elt, vec)
        assert v in (0, vec) and _pow2(warps) and warps <= 32
        if v:
            body = tcfg.body_len(n, vec)
            assert body % vec == 0 and n - vec < body <= n
            assert (single, block, rows) == tcfg.row_config(body, kind, elt)[:3]
        else:
            assert (single, block, rows, warps) == tcfg.row_config(n, kind, elt)


def test_grid_sizes_stay_within_the_work():
    """Invariant: a single-block launch has 1 to `tiles` programs; kinds that are not
    persistent (for their block) get one program per tile; persistent grids hold at most one
    resident wave (2048 threads per SM) and, with unaligned rows (VEC > 0) and fewer programs
    than tiles, a multiple of VEC programs (a program's tiles share one misalignment)."""
    dev = torch.device("cpu")
    sms = rt_device.num_sms(dev)
    for kind in KINDS:
        for warps in (1, 2, 4, 8, 16, 32):
            for block in (256, 8192, 16384):
                for tiles in (1, 3, 100, 1000, 100000):
                    for vec in (0, 4, 8):
                        progs = tcfg.grid_size(tiles, warps, kind, dev, block, vec)
                        assert 1 <= progs <= tiles
                        per_block = tcfg.PERSISTENT_ABOVE.get(kind, 1 << 62)
                        if not tcfg.PERSISTENT[kind] and block <= per_block:
                            assert progs == tiles
                            continue
                        assert progs * warps * 32 <= max(sms * 2048, vec * warps * 32)
                        if vec and progs < tiles:
                            assert progs % vec == 0


# ------------------------------------------------------------------------------------ split rows


@pytest.mark.parametrize("n", [8193, 16385, 65537, 100000, 262144, (1 << 22) + 3])
@pytest.mark.parametrize("chunk", [2048, 4096, 8192])
@pytest.mark.parametrize("vec", [0, 4, 8])
def test_split_pieces_cover_the_row(n, chunk, vec):
    """Invariant: the C pieces of L elements cover the row, the last one starting inside it;
    with unaligned rows (VEC > 0) pieces of the body start 16-byte aligned."""
    c, length = rt_split.split_pieces(n, chunk, vec)
    assert length <= chunk
    # the pieces cover the row and the last one starts inside it (with unaligned rows it covers
    # part of the aligned body, up to 2·(VEC - 1) shorter than the row, and may be empty for
    # some rows when there are thousands of pieces: the kernels give an empty piece weight 0)
    assert c * length >= n > (c - 1) * length
    if c <= 132:  # no empty pieces where split rows run (all pieces resident on one GPU)
        assert (c - 1) * length < n - 2 * vec
    assert c == rt_device.cdiv(n, chunk)
    if vec:
        assert length % 16 == 0  # pieces of the body start 16-byte aligned


def _check_split_config(cfg, n, elt, aligned, vec):
    piece, warps, prefetch, *rest = cfg
    assert _pow2(piece) and _pow2(warps) and warps <= 32, cfg
    assert piece >= 32 * warps  # every thread holds part of its piece
    assert prefetch in (0, 1, 2, 3)  # the load placements the kernels implement
    if vec:
        assert piece % 16 == 0
    if rest:
        cap = rest[0]
        assert cap is None or 32 <= cap <= 255  # a register cap ptxas takes
    if len(rest) > 1 and rest[1]:  # thread-block clusters: aligned rows only
        assert aligned and not vec, (n, elt, cfg)
        if _pow2(n):  # the rows the cluster rules are for fit one cluster (2-16 pieces);
            # other piece counts run cooperative (clusters_enabled)
            assert rt_device.cdiv(n, piece) in (2, 4, 8, 16), (n, elt, cfg)


@pytest.mark.parametrize("elt", ELT_SIZES)
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_layernorm_split_configs_are_valid(elt, aligned):
    """Invariant: every split-row LayerNorm config (forward and backward, any row the split
    kernels may take, aligned or not, scalar or aligned-body pieces) is one the kernels can
    run: power-of-two pieces of at least one element per thread, a PREFETCH placement they
    implement, a register cap ptxas accepts, and clusters only for aligned rows, power-of-two
    rows in 2-16 pieces (what _clusters.clusters_enabled allows). None only where another
    kernel takes the row."""
    for n in (m for m in ROW_LENGTHS if m > 8192):
        for vec in ((0, 16 // elt) if not aligned else (0,)):
            for kind in ("fwd", "bwd"):
                cfg = ln_rules.split_config(kind, n, elt, aligned, vec)
                if cfg is None:
                    # forward: aligned 16-bit rows of 256K+ (looped); backward with VEC: the
                    # scalar pieces or PyTorch's native kernel (16-bit)
                    assert (kind == "fwd" and aligned and elt == 2) or (kind == "bwd" and vec)
                    continue
                _check_split_config(cfg, n, elt, aligned, vec)


def test_softmax_split_configs_are_valid():
    """Invariant: the softmax split-row configs, any row and dtype, aligned or not, are valid
    for the kernels (as for LayerNorm; no clusters)."""
    for n in (m for m in ROW_LENGTHS if m > 8192):
        for elt in ELT_SIZES:
            for vec in (0, 16 // elt):
                for kind in ("fwd", "bwd"):
                    cfg = sm_rules.split_config(kind, elt, vec, n)
                    assert len(cfg) == 3
                    _check_split_config(cfg, n, elt, not vec, vec)


def test_split_config_overrides(monkeypatch, launch_rules):
    launch_rules("layernorm", split_config=forced_split_config((1024, 2, 0), (512, 4, 2)))
    assert ln_rules.split_config("fwd", 1 << 20, 2, True) == (1024, 2, 0)
    assert ln_rules.split_config("bwd", 16384, 2, True) == (512, 4, 2)
    launch_rules("softmax", split_config=forced_split_config(None, (4096, 4, 2)))
    assert sm_rules.split_config("bwd", 4) == (4096, 4, 2)


def test_split_programs_are_a_multiple_of_the_chunks(monkeypatch):
    """Invariant: a split-row grid is a multiple of the pieces per row C (all pieces of a row
    in one round), deterministic for the same arguments, and with unaligned rows a multiple
    of C·VEC (a program's rows share one misalignment) or 0 where none fits."""
    launcher = rt_split.SplitLauncher(tln.ln_fwd_split)
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
    monkeypatch.setattr(rt_split, "num_sms", lambda device: 100)
    many = launcher.programs(3000, 3, runtime, consts, 4, dev, vec=2)
    assert many % 6 == 0 and 0 < many < 3000


# ------------------------------------------------------------------------ fused LayerNorm backward

FUSED_BITS = ln_rules.FUSED_BWD_MAX_BLOCK.bit_length() - 1  # log2 of the longest padded row


def test_fused_backward_configs_are_valid():
    """Invariant: for every padded row the fused backward takes (up to FUSED_BWD_MAX_BLOCK),
    a tile of a power-of-two number of whole rows (one per tile for the aligned-body variant),
    4-16 warps with at least one element per thread, and at least one program per SM."""
    for elt in ELT_SIZES:
        for k in range(0, FUSED_BITS + 1):
            block = 1 << k
            for body in (False, True):
                if body and block < ln_rules.FUSED_BWD_UNALIGNED_MIN_BLOCK:
                    continue  # shorter bodies take the scalar variant
                rows, warps, per_sm, acc_1d = ln_rules.fused_bwd_config(block, body, elt)
                assert _pow2(rows) and _pow2(warps) and 4 <= warps <= 16, (block, body, elt)
                assert rows * block >= 32 * warps and per_sm >= 1
                assert isinstance(acc_1d, bool)
                if body and elt == 2:
                    assert rows == 1  # multi-row tiles of the body variant spill


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_backward_plan_covers_the_rows(dtype):
    """Invariant: the fused backward's plan covers every row (tiles·ROWS >= M, the block holds
    the row or its aligned body), uses no more programs than tiles nor partial rows than the
    scratch budget, and with unaligned rows a multiple of VEC programs unless every tile has
    its own; rows longer than FUSED_BWD_MAX_BLOCK get no plan (the split / column paths)."""
    elt = torch.empty((), dtype=dtype).element_size()
    for m in (1, 3, 37, 300, 4096):
        for n in (1, 33, 64, 1000, 1025, 2049, 4097, 8192, 8193):
            x = torch.empty(m, n, dtype=dtype)
            plan = ln_rules.fused_plan(m, n, elt, ln_backward_vec(x, x), 132)
            if rt_device.next_pow2(n) > ln_rules.FUSED_BWD_MAX_BLOCK and n % (16 // elt) == 0:
                assert plan is None
                continue
            if plan is None:  # an unaligned body too long for the fused kernel
                assert rt_device.next_pow2(n) > ln_rules.FUSED_BWD_MAX_BLOCK
                continue
            vec, block, rows, warps, acc_1d, tiles, progs = plan
            assert block >= tcfg.body_len(n, vec) and _pow2(block)
            assert tiles * rows >= m
            assert 1 <= progs <= min(tiles, max(1, ln_rules.max_partial_rows(m, n, elt)))
            if vec and progs < tiles:
                assert progs % vec == 0


def test_partial_rows_bounded_by_an_eighth_of_x():
    """Invariant: the fused backward's float32 partial rows take at most an eighth of x's
    bytes (small batches do not pay scratch comparable to their activations)."""
    for m, n, dtype in [(4096, 1024, torch.float32), (8, 32768, torch.bfloat16),
                        (1, 300, torch.float16), (100000, 64, torch.bfloat16)]:
        x = torch.empty(m, n, dtype=dtype)
        rows = ln_rules.max_partial_rows(m, n, x.element_size())
        assert rows >= 1
        if rows > 1:
            assert 2 * rows * n * 4 <= x.numel() * x.element_size() / 8 + 1


@pytest.mark.exhaustive  # (16-bit rows of hundreds of columns through the interpreter: seconds)
def test_fused_backward_stages_rule(monkeypatch, device):
    """Invariant: the tile loop is pipelined (stages > 1) only for 16-bit rows of the blocks
    PIPELINED_BWD_BLOCKS lists whose row strides are 16-byte multiples, never for float32 or
    unaligned strides; an override of the rule replaces it; the launch passes the rule's value
    (STAGES, the kernel's last argument), also to the parked dx launch."""
    stages = ln_rules.fused_bwd_stages
    for k in range(4, FUSED_BITS + 1):
        block = 1 << k
        pipelined = block in ln_rules.PIPELINED_BWD_BLOCKS
        assert (stages(block, 2, (block,) * 3) > 1) == pipelined
        assert stages(block, 4, (block,) * 3) == 1  # float32
        assert stages(block, 2, (block, block, block - 4)) == 1  # unaligned rows
    with tconfigs.override("layernorm", fused_bwd_stages=lambda *args: 2):
        assert ln_rules.fused_bwd_stages(4096, 4, (4096,) * 3) == 2
    seen = []
    real = tlnb._launch_bwd_single
    monkeypatch.setattr(tlnb, "_launch_bwd_single", lambda grid, args, warps: seen.append(
        args[-1]) or real(grid, args, warps))
    piped = min(ln_rules.PIPELINED_BWD_BLOCKS)
    for n in (piped * 3 // 4, piped // 2):  # a pipelined block, one outside the set
        x = torch.randn(8, n, dtype=torch.bfloat16, device=device)
        w = torch.randn(n, dtype=torch.bfloat16, device=device)
        _, mean, rstd = tln.layernorm_forward(x, w, None, 1e-5, x.dtype)
        seen.clear()
        tlnb.layernorm_backward(torch.randn_like(x), x, w, mean, rstd, True, True, True)
        want = stages(rt_device.next_pow2(n), 2, (n,) * 3)
        assert seen and set(seen) == {want}, n  # (a parked dx launch follows in low_memory)


def test_native_backward_only_for_unaligned_long_16bit_cuda_rows():
    # CPU tensors never take the native path (it is measured and enabled on CUDA only)
    assert not ln_rules.native_unaligned(8193, 2, True, device_facts(-1))
    gpu = device_facts(-1)._replace(cuda=True)
    assert ln_rules.native_unaligned(8193, 2, True, gpu)
    assert not ln_rules.native_unaligned(8193, 2, False, gpu)  # (not what the kernel takes)
    assert not ln_rules.native_unaligned(8193, 4, True, gpu)  # float32 rows
    assert not ln_rules.native_unaligned(8200, 2, True, gpu)  # 16-byte multiples


# ----------------------------------------------------------------------- reload / unrolled tables


def _check_table(table: dict, above: int, min_warps: int = 0, third=bool):
    """Rule tables (element size, padded row or body) -> config(s): keys a kernel can meet
    (16-bit or float32, a power-of-two padded length above the host's lookup threshold, so
    no rule is skipped), each config's chunk a power of two dividing the padded length and
    split evenly over the threads (whole vectors per thread); ``third``: what a config's third
    value is (THIRD_READ, a bool, or the softmax backward's first-pass piece)."""
    for (elt, padded), configs in table.items():
        assert elt in ELT_SIZES and _pow2(padded) and padded > above, (elt, padded)
        for chunk, warps, *extra in (configs if isinstance(configs[0], tuple) else (configs,)):
            assert _pow2(chunk) and padded % chunk == 0, (elt, padded, chunk)
            assert warps == 0 or (warps >= min_warps and chunk % (32 * warps) == 0)
            assert len(extra) <= 1
            if extra and third is bool:
                assert isinstance(extra[0], bool)
            elif extra:  # a first pass in pieces
                assert _pow2(extra[0]) and padded % extra[0] == 0


def test_reload_and_unrolled_tables_are_valid():
    """Invariant: every reload / unrolled rule (LayerNorm, RMSNorm and softmax, forward and
    backward, aligned and unaligned rows, the per-GPU tables) is valid for its kernel and
    reachable."""
    _check_table(ln_rules.RELOAD_FWD, ln_rules.RELOAD_FWD_ABOVE)
    _check_table(ln_rules.RELOAD_VEC_FWD, 0, min_warps=1)
    _check_table(ln_rules.UNROLLED_FWD, ln_rules.UNROLLED_FWD_ABOVE)
    _check_table(ln_rules.UNROLLED_VEC_FWD, 0, min_warps=1)
    for rules in ln_rules.UNROLLED_FWD_GPU.values():
        _check_table(rules, ln_rules.UNROLLED_FWD_ABOVE)
    _check_table(rms_rules.UNROLLED_FWD, 0)
    _check_table(sm_rules.RELOAD_FWD, sm_rules.RELOAD_FWD_ABOVE, min_warps=1)
    _check_table(sm_rules.RELOAD_BWD, sm_rules.RELOAD_BWD_ABOVE, min_warps=1, third="piece")
    _check_table(sm_rules.UNROLLED_FWD, sm_rules.UNROLLED_FWD_ABOVE)
    _check_table(sm_rules.UNROLLED_VEC_FWD, sm_rules.RELOAD_FWD_ABOVE, min_warps=1)
    _check_table(sm_rules.UNROLLED_BWD, sm_rules.UNROLLED_BWD_ABOVE, min_warps=1)
    _check_table(sm_rules.UNROLLED_VEC_BWD, 0, min_warps=1)
    for (_, padded) in sm_rules.UNROLLED_VEC_BWD:
        # unaligned rows: N > padded / 2 + 1 > UNROLLED_BWD_ABOVE for any body padded to it
        assert padded // 2 >= sm_rules.UNROLLED_BWD_ABOVE


def test_unrolled_rules_per_gpu():
    """Invariant: a GPU whose name matches a per-GPU table reads that table's rules for the
    keys it holds and the shared table for every other key; other GPUs and the CPU read the
    shared table, which the per-GPU rules never change."""
    if not ln_rules.UNROLLED_FWD_GPU:
        pytest.skip("no per-GPU rules to check")
    shared = {k: v for k, v in ln_rules.UNROLLED_FWD.items()}
    for part, rules in ln_rules.UNROLLED_FWD_GPU.items():
        name = f"NVIDIA {part} X"
        for key in rules:
            assert ln_rules.unrolled_fwd_table(name, key) is rules
        for key in ln_rules.UNROLLED_FWD:
            if key not in rules:
                assert ln_rules.unrolled_fwd_table(name, key) is ln_rules.UNROLLED_FWD
        assert all(ln_rules.unrolled_fwd_table("", key) is ln_rules.UNROLLED_FWD for key in rules)
        assert all(ln_rules.unrolled_fwd_table("NVIDIA A100-SXM4-80GB", key)
                   is ln_rules.UNROLLED_FWD for key in rules)
    assert ln_rules.UNROLLED_FWD == shared
    with tconfigs.override("layernorm", UNROLLED_FWD_GPU={}):
        key = next(iter(ln_rules.UNROLLED_FWD))
        assert ln_rules.unrolled_fwd_table("NVIDIA H100", key) is ln_rules.UNROLLED_FWD



def test_backward_rules_per_gpu():
    """Invariant: a GPU whose name matches a per-GPU backward table (LayerNorm's pipelined
    blocks, RMSNorm's cluster pieces) reads it, every other GPU and the CPU the shared rules;
    a backward config on such a GPU takes the GPU's cluster pieces (where PIECES_BWD takes the
    row first, its fallback does)."""
    stages = ln_rules.fused_bwd_stages
    for part, blocks in ln_rules.PIPELINED_BWD_BLOCKS_GPU.items():
        for block in blocks:
            shared = 3 if block in ln_rules.PIPELINED_BWD_BLOCKS else 1
            assert stages(block, 2, (block,) * 3, f"NVIDIA {part} X") == 3
            assert stages(block, 2, (block,) * 3, "NVIDIA A100-SXM4-80GB") == shared
            assert stages(block, 2, (block,) * 3) == shared
            assert stages(block, 4, (block,) * 3, f"NVIDIA {part}") == 1  # float32
            assert stages(block, 2, (block, block, block - 4), f"NVIDIA {part}") == 1
    for part, tables in rms_rules.CLUSTER_BWD_GPU.items():
        dev = DeviceFacts(True, 132, f"NVIDIA {part}", True, True)
        for elt, rules in tables.items():
            assert rms_rules.cluster_bwd_table(dev.name, elt) is rules
            assert rms_rules.cluster_bwd_table("", elt) == rms_rules.CLUSTER_BWD.get(elt, ())
            for longest, (piece, warps, prefetch, cap) in rules:
                cfg = rms_rules.backward_config(longest, elt, 0, True, dev)
                cfg = cfg.fallback if cfg.kernel == "pieces" else cfg
                assert (cfg.kernel, cfg.chunk, cfg.warps, cfg.prefetch, cfg.maxnreg,
                        cfg.cluster) == ("split", piece, warps, prefetch, cap, True)
    for part, tables in ln_rules.SPLIT_BWD_GPU.items():
        dev = DeviceFacts(True, 132, f"NVIDIA {part}", True, True)
        other = DeviceFacts(True, 132, "NVIDIA A100-SXM4-80GB", True, True)
        for elt, rules in tables.items():
            for shortest, longest, cfg in rules:
                for n in (shortest, longest):
                    assert ln_rules.split_plan(n, elt, 0, True, dev) == (cfg, 0)
                    assert ln_rules.split_plan(n, elt, 0, True, other) == (
                        ln_rules.split_config("bwd", n, elt, True), 0)
                    assert ln_rules.split_plan(n, elt, 0, False, dev)[0] != cfg  # strides
    with tconfigs.override("rmsnorm", CLUSTER_BWD_GPU={}):
        assert rms_rules.cluster_bwd_table("NVIDIA H200", 2) == rms_rules.CLUSTER_BWD[2]

# ------------------------------------------------------------------- rows routed to their rules

NEEDS_KERNELS = pytest.mark.skipif(not rt_device.interpreting() and not torch.cuda.is_available(),
                                   reason="needs the Triton interpreter or a GPU")


def _dev() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _elt(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _first_dividing(table: dict, elt: int, n: int, above: int) -> tuple[int, int] | None:
    """The documented choice of an unrolled rule for aligned rows of n: the first config whose
    chunk divides n (0 warps: the row is left to the other kernels); None without a rule."""
    if n <= above or n % (16 // elt):
        return None
    for chunk, warps in table.get((elt, rt_device.next_pow2(n)), ()):
        if n % chunk == 0:
            return (chunk, warps) if warps else None
    return None


def recording(monkeypatch, mod, name, calls, pick):
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
def test_long_16bit_layernorm_forward_without_split_rows(monkeypatch, launch_rules):
    """16-bit rows of 64K take the split-row kernel on a GPU; without it (the interpreter, a
    refused cooperative launch) the two-pass looped kernel, with row_config's chunk."""
    calls = []
    recording(monkeypatch, tln, "_launch_fwd_looped", calls, lambda g, a, w: (a[10], w))
    launch_rules(SPLIT_ROWS=False)
    launch_rules("layernorm", UNROLLED_FWD={})  # 64K rows may have an unrolled rule
    x = (torch.randn(2, 65536, device=_dev()) * 3 + 100).to(torch.bfloat16)
    w = torch.randn(65536, device=_dev())
    y, mean, rstd = tln.layernorm_forward(x, w, None, 1e-5, torch.bfloat16)
    single, block, _, warps = tcfg.row_config(65536, "ln_fwd", 2)
    assert not single and calls == [(block, warps)]
    ref = torch.nn.functional.layer_norm(x.double(), (65536,), w.double())
    assert_close_to_ref(y, ref, torch.bfloat16, scale=2)
    assert_close_to_ref(mean, x.double().mean(-1), torch.float32)


@exhaustive_unless(lambda n: n == 12000)  # (the power of two: exhaustive)
@NEEDS_KERNELS
@pytest.mark.parametrize("n", [16384, 12000])
def test_reload_kernels_take_their_rows(monkeypatch, n):
    """Aligned rows whose padded length has a reload rule run the reload kernels (forward
    LayerNorm, backward softmax) with the rule's chunk and warps, unless the forward's unrolled
    rule takes them (a chunk divides the row); unaligned rows do not (their forward has its own
    reload kernel, tested below)."""
    fwd, bwd, unrolled = [], [], []
    recording(monkeypatch, tln, "_launch_fwd_reload", fwd, lambda g, a, w: (g, a[10], a[11], w))
    recording(monkeypatch, tln, "_launch_fwd_unrolled", unrolled,
               lambda g, a, w: (g, a[10], a[11], w))
    recording(monkeypatch, tsm, "_launch_bwd_looped", bwd, lambda g, a, w: (g, a[7], a[8], w))
    whole = rt_device.next_pow2(n)
    # the rows tested
    assert (2, whole) in ln_rules.RELOAD_FWD and (2, whole) in sm_rules.RELOAD_BWD
    x = torch.randn(3, n, device=_dev()).to(torch.bfloat16)
    tln.layernorm_forward(x, None, None, 1e-5, torch.bfloat16)
    tsm.softmax_backward(torch.softmax(x, -1), x, torch.bfloat16)
    table = ln_rules.unrolled_fwd_table(device_facts(x.get_device()).name, (2, whole))
    rule = _first_dividing(table, 2, n, ln_rules.UNROLLED_FWD_ABOVE)
    if rule:
        assert unrolled == [((3,), n, rule[0], rule[1])] and fwd == []
    else:
        chunk, warps = ln_rules.RELOAD_FWD[(2, whole)][:2]
        assert fwd == [((3,), whole, chunk, warps)] and unrolled == []
    chunk, warps = sm_rules.RELOAD_BWD[(2, whole)][:2]
    assert bwd == [((3,), chunk, whole, warps)]
    odd = torch.randn(3, n + 1, device=_dev()).to(torch.bfloat16)
    tln.layernorm_forward(odd, None, None, 1e-5, torch.bfloat16)
    tsm.softmax_backward(torch.softmax(odd, -1), odd, torch.bfloat16)
    assert len(fwd) + len(unrolled) == 1 and len(bwd) == 1


@NEEDS_KERNELS
@exhaustive_unless(lambda dtype, n: n < 131072)  # (the rows of 128K: exhaustive)
@pytest.mark.parametrize("dtype,n", [
    (torch.bfloat16, 65536),
    (torch.float16, 65537),
    (torch.bfloat16, 131073),
    (torch.bfloat16, 131072),  # no aligned rule at 128K: split rows
    (torch.float32, 65537),  # no float32 rule
    (torch.bfloat16, 32768),  # shorter than every rule: the reload kernel
], ids=str)
def test_softmax_unrolled_backward_takes_its_rows(monkeypatch, dtype, n):
    """Rows with an unrolled backward rule (aligned: the first config dividing N; unaligned: the
    rule for the padded body, if the body holds a chunk) run softmax_bwd_unrolled with its
    chunk and warps, the body of unaligned rows ((N // VEC - 1)·VEC) and VEC; other rows do
    not; results against float64."""
    calls = []
    recording(monkeypatch, tsm, "_launch_bwd_unrolled", calls, lambda g, a, w: (g, *a[5:], w))
    elt = _elt(dtype)
    vec = 0 if n % (16 // elt) == 0 else 16 // elt
    if vec:
        body = (n // vec - 1) * vec
        rule = sm_rules.UNROLLED_VEC_BWD.get((elt, rt_device.next_pow2(tcfg.body_len(n, vec))))
        rule = rule if rule and body >= rule[0] else None
    else:
        body = n
        rule = _first_dividing(sm_rules.UNROLLED_BWD, elt, n, sm_rules.UNROLLED_BWD_ABOVE)
    y = torch.softmax(torch.randn(2, n, device=_dev(), dtype=torch.float64), -1).to(dtype)
    dy = torch.randn(2, n, device=_dev(), dtype=torch.float64).to(dtype)
    dx = tsm.softmax_backward(y, dy, dtype)
    assert calls == ([((2,), n, body, rule[0], vec, rule[1])] if rule else [])
    y64, dy64 = y.double(), dy.double()
    assert_close_to_ref(dx, y64 * (dy64 - (y64 * dy64).sum(-1, keepdim=True)), dtype, scale=4)


# (the float32 rows: exhaustive; their compensated row sums take the interpreter seconds)
@NEEDS_KERNELS
@exhaustive_unless(lambda dtype, n: dtype != torch.float32)
@pytest.mark.parametrize("dtype,n", [
    (torch.bfloat16, 16384),
    (torch.bfloat16, 12288),
    (torch.float16, 65536),
    (torch.float32, 16384),
    (torch.bfloat16, 32768),
    (torch.bfloat16, 13000),  # no config's chunk divides it
    (torch.float32, 65536),
    (torch.bfloat16, 768),  # rows between powers of two
    (torch.float16, 3072),
    (torch.bfloat16, 5120),
    (torch.bfloat16, 1024),  # a 0-warp config: the other kernels
], ids=str)
def test_softmax_unrolled_forward_takes_its_rows(monkeypatch, dtype, n):
    """Aligned rows whose padded length has an unrolled forward rule with a chunk dividing N
    run softmax_fwd_unrolled with that chunk and warps; other rows do not; results against
    float64."""
    calls = []
    recording(monkeypatch, tsm, "_launch_fwd_unrolled", calls, lambda g, a, w: (*a[5:], w))
    x = torch.randn(2, n, device=_dev(), dtype=dtype)
    y = tsm.softmax_forward(x, dtype)
    rule = _first_dividing(sm_rules.UNROLLED_FWD, _elt(dtype), n, sm_rules.UNROLLED_FWD_ABOVE)
    assert calls == ([(n, *rule)] if rule else [])
    assert_close_to_ref(y, torch.softmax(x.double(), -1), dtype)


@NEEDS_KERNELS
@pytest.mark.parametrize("dtype,n", [
    (torch.bfloat16, 8192),
    (torch.bfloat16, 6144),
    (torch.bfloat16, 5120),
    (torch.bfloat16, 4608),
    (torch.float32, 1024),
    (torch.bfloat16, 4096),
    (torch.bfloat16, 3072),
    (torch.bfloat16, 2560),
    (torch.bfloat16, 16640),
    (torch.float32, 16384),
    (torch.bfloat16, 768),
    (torch.float16, 1536),
    (torch.bfloat16, 1024),
], ids=str)
def test_unrolled_forward_takes_its_rows(monkeypatch, dtype, n, launch_rules):
    """LayerNorm forward: aligned rows run ln_fwd_unrolled with the first config of their
    rule whose chunk divides N (a config of 0 warps, or none dividing: the other kernels);
    results against float64."""
    launch_rules("layernorm", UNROLLED_FWD_GPU={})  # the shared table (per-GPU: above)
    calls = []
    recording(monkeypatch, tln, "_launch_fwd_unrolled", calls,
               lambda g, a, w: (a[10], a[11], w))
    x = torch.randn(2, n, device=_dev(), dtype=dtype)
    w = torch.randn(n, device=_dev())
    y = tln.layernorm_forward_y(x, w, None, 1e-5, dtype)
    rule = _first_dividing(ln_rules.UNROLLED_FWD, _elt(dtype), n, ln_rules.UNROLLED_FWD_ABOVE)
    assert calls == ([(n, *rule)] if rule else [])
    ref = torch.nn.functional.layer_norm(x.double(), (n,), w.double())
    assert_close_to_ref(y, ref, dtype, scale=4)


# (the float32 row: exhaustive; its compensated row sums take the interpreter seconds)
@NEEDS_KERNELS
@exhaustive_unless(lambda dtype, n: dtype != torch.float32)
@pytest.mark.parametrize("dtype,n", [
    (torch.bfloat16, 65536),
    (torch.bfloat16, 40000),  # masked, not unrolled
    (torch.float32, 32768),
    (torch.bfloat16, 32768),
    (torch.bfloat16, 65537),  # unaligned rows: split rows or looped
], ids=str)
def test_softmax_forward_reload_takes_its_rows(monkeypatch, dtype, n, launch_rules):
    """Aligned rows longer than RELOAD_FWD_ABOVE whose padded length has a reload rule run
    softmax_fwd_reload with the rule's chunk and warps, unrolled without masks (EVEN = N) for
    power-of-two rows; unaligned rows and rows without a rule do not."""
    calls = []
    recording(monkeypatch, tsm, "_launch_fwd_reload", calls, lambda g, a, w: (g, *a[5:], w))
    launch_rules("softmax", UNROLLED_FWD={})  # rows with an unrolled rule take it first
    x = torch.randn(2, n, device=_dev(), dtype=dtype)
    y = tsm.softmax_forward(x, dtype)
    whole = rt_device.next_pow2(n)
    aligned = n % (16 // _elt(dtype)) == 0
    rule = (sm_rules.RELOAD_FWD.get((_elt(dtype), whole))
            if aligned and n > sm_rules.RELOAD_FWD_ABOVE else None)
    assert calls == ([((2,), whole, rule[0], n if n == whole else 0, rule[1])] if rule else [])
    assert_close_to_ref(y, torch.softmax(x.double(), -1), dtype)


@pytest.mark.parametrize(("dtype", "m", "n"), [
    (torch.float32, 7, 64), (torch.bfloat16, 13, 64), (torch.bfloat16, 5, 50),
    (torch.float16, 1, 128), (torch.float32, 9, 33),  # 33 fp32: unaligned, no prefetch
], ids=str)
def test_softmax_forward_next_tile_prefetch(monkeypatch, dtype, m, n, launch_rules):
    """Aligned rows whose padded length has a NEXT_FWD rule run softmax_fwd_single on a
    persistent grid of (SMs x programs per SM) programs with the next tile prefetched (NEXT =
    1), one row per tile, so a program loops over several tiles and prefetches past the last
    row; unaligned rows keep the other rules. Results against float64."""
    calls = []
    recording(monkeypatch, tsm, "_launch_fwd_single", calls, lambda g, a, w: (g, a[-1], w))
    block = rt_device.next_pow2(n)
    launch_rules("softmax", NEXT_FWD={(_elt(dtype), block): (2, 1)})
    monkeypatch.setattr(tsm, "device_facts", lambda index: device_facts(index)._replace(num_sms=2))
    x = torch.randn(m, n, device=_dev(), dtype=dtype)
    y = tsm.softmax_forward(x, dtype)
    assert_close_to_ref(y, torch.softmax(x.double(), -1), dtype)
    aligned = n % (16 // _elt(dtype)) == 0
    if aligned:
        assert calls == [((min(m, 2),), 1, 2)]
    else:
        assert all(nxt == 0 for _, nxt, _ in calls)


@pytest.mark.exhaustive  # (float32 rows of up to 2048 through the exact arithmetic: seconds)
def test_softmax_exact_rows_rule(monkeypatch, launch_rules):
    """The single-block forward takes the exact float32 arithmetic (EXACT_ROWS, the argument
    before NEXT) for rows of EXACT_MIN_N+ only; results against float64 either way."""
    launch_rules("softmax")  # (the caches and replay plans dropped around the test)
    calls = []
    recording(monkeypatch, tsm, "_launch_fwd_single", calls, lambda g, a, w: a[-2])
    for n in (256, 768, sm_rules.EXACT_MIN_N - 1, sm_rules.EXACT_MIN_N, 2048):
        cfg = sm_rules.forward_config(n, 4, 0, 8, device_facts(-1))
        assert cfg.variant != "single" or cfg.exact_rows == (n >= sm_rules.EXACT_MIN_N), n
        calls.clear()
        x = torch.randn(8, n, device=_dev()) * 10
        y = tsm.softmax_forward(x, torch.float32)
        assert calls == [n >= sm_rules.EXACT_MIN_N], n
        assert_close_to_ref(y, torch.softmax(x.double(), -1), torch.float32)


def test_softmax_cluster_forward_rules(launch_rules):
    """CLUSTER_FWD: aligned rows in a rule's range that are C whole pieces, C a cluster size,
    take the staged forward (one cluster of C CTAs per row: the grid is rows x C) on a GPU that
    runs clusters, ahead of every other rule, with the rules without clusters as the fallback;
    rows outside the range, unaligned rows, rows of partial pieces or other piece counts and
    GPUs without clusters do not."""
    hopper = DeviceFacts(True, 132, "NVIDIA H200", True, True)
    no_clusters = hopper._replace(clusters=False)
    fwd = sm_rules.forward_config
    for elt, rules in sm_rules.CLUSTER_FWD.items():  # shipped
        for shortest, longest, (piece, warps) in rules:
            for n in (shortest, longest):
                cfg = fwd(n, elt, 0, 64, hopper)
                assert (cfg.variant, cfg.piece, cfg.pieces, cfg.warps, cfg.grid, cfg.cluster) \
                    == ("staged", piece, n // piece, warps, 64 * (n // piece), True), (elt, n)
                assert cfg.fallback == fwd(n, elt, 0, 64, no_clusters)
                assert not fwd(n, elt, 0, 64, no_clusters).cluster
            if not any(lo <= shortest // 2 <= hi for lo, hi, _ in rules):
                assert not fwd(shortest // 2, elt, 0, 64, hopper).cluster
    launch_rules("softmax", CLUSTER_FWD={2: ((32768, 262144, (16384, 16)),),
                                         4: ((65536, 65536, (8192, 8)),)})
    for n, c in ((32768, 2), (65536, 4), (131072, 8), (262144, 16)):
        cfg = fwd(n, 2, 0, 64, hopper)
        assert (cfg.variant, cfg.pieces, cfg.piece, cfg.warps, cfg.grid, cfg.cluster) == (
            "staged", c, 16384, 16, 64 * c, True), n
        assert cfg.fallback == fwd(n, 2, 0, 64, no_clusters) and not cfg.fallback.cluster
        assert not fwd(n, 2, 8, 64, hopper).cluster  # unaligned rows
    cfg = fwd(65536, 4, 0, 64, hopper)
    assert (cfg.pieces, cfg.warps, cfg.cluster) == (8, 8, True)
    assert not fwd(131072, 4, 0, 64, hopper).cluster  # outside the float32 range
    assert not fwd(98304, 2, 0, 64, hopper).cluster  # 6 pieces: no cluster size
    assert not fwd(16384 * 3 + 8, 2, 0, 64, hopper).cluster  # 4 pieces, the last partial
    assert not fwd(16384, 2, 0, 64, hopper).cluster  # below the range
    launch_rules("softmax", CLUSTER_FWD={})
    assert not fwd(131072, 2, 0, 64, hopper).cluster


def test_rmsnorm_fused_backward_stages_rule(monkeypatch, device):
    """The RMSNorm fused backward's tile loop is pipelined (STAGES 3) only for 16-bit rows of
    the blocks PIPELINED_BWD_BLOCKS lists whose row strides and length are 16-byte multiples;
    the launch passes the rule's value (STAGES, the kernel's last argument)."""
    stages = rms_rules.fused_bwd_stages
    for k in range(4, 15):
        block = 1 << k
        assert (stages(block, 2, True) > 1) == (block in rms_rules.PIPELINED_BWD_BLOCKS)
        assert stages(block, 4, True) == 1 and stages(block, 2, False) == 1
    seen = []
    real = trmsb._launch_bwd_single
    monkeypatch.setattr(trmsb, "_launch_bwd_single", lambda grid, args, warps: seen.append(
        args[-1]) or real(grid, args, warps))
    piped = min(rms_rules.PIPELINED_BWD_BLOCKS)
    for n, stride in ((piped * 3 // 4, 0), (piped // 2, 0), (piped * 3 // 4, 4)):
        x = torch.randn(8, n + stride, dtype=torch.bfloat16, device=device)[:, :n]
        w = torch.randn(n, dtype=torch.bfloat16, device=device)
        rstd = torch.rand(8, device=device) + 0.5
        seen.clear()
        trmsb.rmsnorm_backward(torch.randn(8, n, dtype=x.dtype, device=device), x, w, rstd,
                               True, True)
        want = 3 if stride == 0 and rt_device.next_pow2(n) in rms_rules.PIPELINED_BWD_BLOCKS \
            else 1
        assert seen == [want], (n, stride)


@NEEDS_KERNELS
@exhaustive_unless(lambda n: n == 4097)  # (rows of 8193: exhaustive)
@pytest.mark.parametrize("n", [4097, 8193])
def test_unaligned_16bit_rows_take_the_reload_kernel(monkeypatch, n, launch_rules):
    """16-bit rows of 2^k + 1 with a RELOAD_VEC_FWD rule run ln_fwd_reload_vec with the rule's
    chunk and warps in calls of RELOAD_VEC_MIN_ELEMS elements or more (float32 rows, and smaller
    calls, keep the single-block kernel); results against float64."""
    launch_rules("layernorm", RELOAD_VEC_MIN_ELEMS=5 * n)
    calls = []
    recording(monkeypatch, tln, "_launch_fwd_reload_vec", calls,
               lambda g, a, w: (g, a[10], a[11], a[15], w))
    x = (torch.randn(5, n, device=_dev()) * 3 + 50).to(torch.bfloat16)
    w = torch.randn(n, device=_dev(), dtype=torch.bfloat16)
    b = torch.randn(n, device=_dev(), dtype=torch.bfloat16)
    y, mean, rstd = tln.layernorm_forward(x, w, b, 1e-5, torch.bfloat16)
    chunk, warps = ln_rules.RELOAD_VEC_FWD[(2, n - 1)]
    assert calls == [((5,), n - 1, chunk, 8, warps)]
    ref = torch.nn.functional.layer_norm(x.double(), (n,), w.double(), b.double())
    assert_close_to_ref(y, ref, torch.bfloat16, scale=4)
    assert_close_to_ref(mean, x.double().mean(-1), torch.float32)
    tln.layernorm_forward(x.float(), w.float(), b.float(), 1e-5, torch.float32)
    tln.layernorm_forward(x[:4], w, b, 1e-5, torch.bfloat16)  # below the size threshold
    assert len(calls) == 1


@NEEDS_KERNELS
@pytest.mark.parametrize("n", [20000, 32768])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softmax_backward_32k_reads_whole_rows(monkeypatch, n, dtype):
    """Rows whose padded length has a RELOAD_BWD rule run the looped kernel's reload variant
    with the rule's chunk, warps and first pass (the whole row, or pieces), power-of-two rows
    unrolled without masks (EVEN = N) while UNROLL_RELOAD_BWD is on; results against
    float64."""
    bwd = []
    recording(monkeypatch, tsm, "_launch_bwd_looped", bwd,
               lambda g, a, w: (g, a[7], a[8], a[9], a[10], w))
    y = torch.softmax(torch.randn(2, n, device=_dev(), dtype=torch.float64), -1)
    dy = torch.randn(2, n, device=_dev(), dtype=torch.float64)
    dx = tsm.softmax_backward(y.to(dtype), dy.to(dtype), dtype)
    whole = rt_device.next_pow2(n)
    assert (_elt(dtype), whole) in sm_rules.RELOAD_BWD, "the rows tested here need a reload rule"
    chunk, warps, *piece = sm_rules.RELOAD_BWD[(_elt(dtype), whole)]
    even = n if n == whole and sm_rules.UNROLL_RELOAD_BWD else 0
    first = (0, piece[0]) if piece else (whole, chunk)
    assert bwd == [((2,), chunk, *first, even, warps)]
    y_, dy_ = y.to(dtype).double(), dy.to(dtype).double()
    assert_close_to_ref(dx, y_ * (dy_ - (y_ * dy_).sum(-1, keepdim=True)), dtype, scale=4)
