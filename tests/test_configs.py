"""Each op's launch decision as one pure function: ``configs.<op>.forward_config`` /
``backward_config`` (docs/design.md, "How a launch is chosen").

The properties every configuration keeps whatever the measured rule values are: every row
length gets one, its tiles, pieces and grids cover the rows, warps are powers of two, variants
appear only where their preconditions hold (split rows where the device runs them, unaligned
variants for unaligned rows, replay plans for launches a signature fixes); the functions read
their arguments and rule data only (no tensors, no device); ``configs.override`` reaches them,
and the host files' memos of them are dropped with the other config caches. The rule values
themselves are not restated here.
"""

from __future__ import annotations

import pytest
import torch
from conftest import forced_split_config

from fusedops.backends.triton import configs
from fusedops.backends.triton import layernorm as tln
from fusedops.backends.triton import layernorm_bwd as tlnb
from fusedops.backends.triton import layernorm_epilogue as tle
from fusedops.backends.triton import rmsnorm as trms
from fusedops.backends.triton import rmsnorm_bwd as trmsb
from fusedops.backends.triton import softmax as tsm
from fusedops.backends.triton import softmax_masked as tsmm
from fusedops.backends.triton.configs import common
from fusedops.backends.triton.configs import layernorm as ln_rules
from fusedops.backends.triton.configs import layernorm_epilogue as le_rules
from fusedops.backends.triton.configs import rmsnorm as rms_rules
from fusedops.backends.triton.configs import softmax as sm_rules
from fusedops.backends.triton.configs import softmax_masked as smm_rules
from fusedops.backends.triton.runtime.caches import config_caches
from fusedops.backends.triton.runtime.clusters import CLUSTER_SIZES
from fusedops.backends.triton.runtime.device import next_pow2
from fusedops.backends.triton.runtime.facts import DeviceFacts, device_facts

ROW_LENGTHS = sorted(set(range(1, 301)) | {
    512, 768, 1000, 1024, 1025, 2048, 2049, 4096, 4097, 8192, 8193, 12000, 16384, 16385, 32768,
    32769, 65536, 65537, 131072, 131073, 262144, 262145})
ROW_COUNTS = (1, 37, 4096)
ELT_SIZES = (2, 4)
FACTS = {
    "cpu": device_facts(-1),
    "gpu": DeviceFacts(True, 132, "NVIDIA H100 80GB HBM3", True, True),
    "gpu-h200": DeviceFacts(True, 132, "NVIDIA H200", True, True),  # (its per-GPU rules)
    "gpu-no-split": DeviceFacts(True, 80, "NVIDIA A100-SXM4-80GB", False, False),
}
GPU = FACTS["gpu"]


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def _vecs(n: int, elt: int) -> tuple[int, ...]:
    """VEC values rows of n can get (configs.common.unaligned_vec): 0, and for rows that are
    no multiple of 16 bytes long but hold two vectors, the elements per 16 bytes."""
    vec = 16 // elt
    return (0, vec) if n % vec and n >= 2 * vec else (0,)


def _cases(ns=ROW_LENGTHS, ms=ROW_COUNTS, facts=FACTS):
    for n in ns:
        for elt in ELT_SIZES:
            for vec in _vecs(n, elt):
                for m in ms:
                    for name, dev in facts.items():
                        yield n, elt, vec, m, name, dev


def _check_split(cfg, n: int, vec: int, dev: DeviceFacts) -> None:
    """A split launch: its device runs split rows, all C pieces of a row are resident at once,
    the pieces cover the row, BLOCK holds a piece, and a refused launch has a looped fallback
    (a cluster launch: the rules without clusters, for aligned rows of a cluster size)."""
    assert dev.split_rows and cfg.pieces <= dev.num_sms
    assert cfg.pieces * cfg.piece >= n and cfg.block == next_pow2(cfg.piece)
    assert cfg.piece <= cfg.chunk or (vec and cfg.piece <= cfg.chunk + 16)
    if getattr(cfg, "cluster", 0):
        assert dev.clusters and not vec and cfg.pieces in CLUSTER_SIZES
        assert cfg.fallback is not None and not cfg.fallback.cluster
        return
    assert cfg.fallback is not None and cfg.fallback.variant == "looped"


def _check_single(cfg, n: int, m: int) -> None:
    assert _pow2(cfg.block) and cfg.block >= common.body_len(n, cfg.vec)
    assert _pow2(cfg.rows) and cfg.tiles * cfg.rows >= m
    assert 1 <= cfg.grid <= max(1, cfg.tiles)


# ------------------------------------------------------------------------------------ softmax

@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_softmax_configs(direction):
    """Every row length gets a launch; each variant's tiles, chunks and pieces cover the row;
    unrolled chunks divide aligned rows; the reload kernel reads aligned rows whole; only
    launches fixed by the call's signature may be kept as replay plans."""
    fn = getattr(sm_rules, f"{direction}_config")
    for n, elt, vec, m, _, dev in _cases():
        cfg = fn(n, elt, vec, m, dev)
        assert _pow2(cfg.warps) and cfg.warps <= 32, (n, elt, vec, cfg)
        if cfg.variant == "single":
            _check_single(cfg, n, m)
            assert cfg.vec in (0, vec)
        elif cfg.variant == "split":
            _check_split(cfg, n, vec, dev)
        elif cfg.variant == "looped":
            assert cfg.grid == m and _pow2(cfg.block)
        elif cfg.variant == "reload":
            assert not vec and cfg.grid == m and 0 < cfg.chunk
            assert cfg.whole in (0, next_pow2(n)) and cfg.even in (0, n)
        elif cfg.variant == "staged":  # one cluster per row, whole pieces
            assert dev.clusters and not vec and cfg.cluster and cfg.pieces in CLUSTER_SIZES
            assert cfg.pieces * cfg.piece == n and cfg.grid == m * cfg.pieces
            assert cfg.fallback is not None and not cfg.fallback.cluster
            assert cfg.piece * elt % (16 * 32 * cfg.warps) == 0  # whole vectors per thread
        else:
            assert cfg.variant in ("unrolled", "unrolled_vec"), cfg
            assert cfg.grid == m and 0 < cfg.chunk <= n
            if cfg.vec:
                assert cfg.body == (n // vec - 1) * vec >= cfg.chunk
            else:
                assert not vec and n % cfg.chunk == 0
        assert not cfg.plan or (direction == "forward" and not cfg.vec
                                and cfg.variant in ("single", "unrolled"))


def test_softmax_overrides_reach_the_config():
    """An override of a rule table or rule function changes what the config returns."""
    unrolled = [(n, elt) for n in ROW_LENGTHS for elt in ELT_SIZES
                if sm_rules.forward_config(n, elt, 0, 4, GPU).variant == "unrolled"]
    split = [(n, elt) for n in ROW_LENGTHS for elt in ELT_SIZES
             if sm_rules.backward_config(n, elt, 0, 4, GPU).variant == "split"]
    assert unrolled and split, "the rules have no unrolled or split rows to override"
    with configs.override("softmax", UNROLLED_FWD={}):
        assert all(sm_rules.forward_config(n, elt, 0, 4, GPU).variant != "unrolled"
                   for n, elt in unrolled)
    with configs.override("softmax", split_config=forced_split_config(None, (16384, 4, 0))):
        for n, elt in split:
            cfg = sm_rules.backward_config(n, elt, 0, 4, GPU)
            assert cfg.variant == "split" and (cfg.chunk, cfg.warps) == (16384, 4)
    with configs.override(SINGLE_BLOCK_LIMIT=256):
        assert sm_rules.forward_config(1000, 2, 0, 4, GPU).variant in ("looped", "split")


# ---------------------------------------------------------------------------------- LayerNorm

def test_layernorm_forward_configs():
    """Every row length gets a launch covering its rows; statistics are written whenever the
    call asks for them; the unaligned-row kernels take unaligned rows only; split rows only
    where the device runs them; replay plans only for launches the signature fixes (no VEC,
    statistics as asked)."""
    for n, elt, vec, m, _, dev in _cases():
        for with_stats in (False, True):
            for aligned in (False, True):
                cfg = ln_rules.forward_config(n, elt, vec, m, with_stats, aligned, dev)
                assert _pow2(cfg.warps) and cfg.warps <= 32, (n, elt, vec, m, cfg)
                assert cfg.stats or not with_stats
                assert not cfg.plan or (cfg.stats == with_stats and not cfg.vec)
                if cfg.variant == "single":
                    _check_single(cfg, n, m)
                elif cfg.variant == "split":
                    _check_split(cfg, n, vec, dev)
                elif cfg.variant == "pieces":  # whole pieces of whole chunks, in clusters
                    assert dev.clusters and aligned and not vec and cfg.pieces in CLUSTER_SIZES
                    assert n == cfg.pieces * cfg.piece and cfg.piece % cfg.chunk == 0
                    assert cfg.grid in (0, m * cfg.pieces) and cfg.fallback.variant != "pieces"
                elif cfg.variant == "staged":  # one cluster per row, whole pieces
                    assert dev.clusters and aligned and not vec and cfg.pieces in CLUSTER_SIZES
                    assert n == cfg.pieces * cfg.piece and cfg.grid == m * cfg.pieces
                    assert cfg.stats == with_stats and cfg.fallback.variant != "staged"
                    assert cfg.piece * elt % (16 * 32 * cfg.warps) == 0
                elif cfg.variant in ("looped", "reload", "unrolled"):
                    assert cfg.grid == m and not (cfg.variant != "looped" and vec)
                    if cfg.variant == "unrolled":
                        assert n % cfg.chunk == 0
                    if cfg.variant == "reload":
                        assert cfg.block == next_pow2(n)
                else:
                    assert cfg.variant in ("reload_vec", "unrolled_vec"), cfg
                    assert vec and cfg.vec == vec and cfg.grid == m
                    assert cfg.variant == "reload_vec" or cfg.body >= cfg.chunk


NEEDS = [(True, True, True), (True, False, False), (False, True, True), (True, True, False),
         (False, False, True)]


def _backward_chain(cfg):
    while cfg is not None:
        yield cfg
        cfg = cfg.fallback


@pytest.mark.exhaustive  # (every row, dtype, gradient set and device of the table: seconds)
def test_layernorm_backward_configs():
    """Every call gets a path whose launches cover the rows: the fused kernel's tiles and grid
    (a multiple of VEC or a tile per program), the split kernel's pieces with fallbacks that end
    in the row kernels or PyTorch's, the dx row kernel's tiles and the column kernel's blocks;
    PyTorch's kernel only on CUDA for 16-bit rows it takes; clusters only where the device and
    the piece count allow them."""
    col_block = ln_rules.COLUMN_TILE[0]
    for n, elt, vec, m, _, dev in _cases(ms=(0, 1, 37, 4096)):
        strides = (n, n) if vec else (n + 8, n)
        for need in NEEDS:
            for parked in (False, True):
                for plain in (False, True):
                    cfg = ln_rules.backward_config(m, n, elt, strides, vec, *need, parked,
                                                   plain, dev)
                    assert (cfg.variant == "empty") == (m == 0), (n, elt, m, cfg)
                    for step in _backward_chain(cfg):
                        _check_backward_step(step, m, n, elt, vec, need, parked, plain, dev,
                                             col_block)


def _check_backward_step(cfg, m, n, elt, vec, need, parked, plain, dev, col_block):
    if cfg.variant == "native":
        assert dev.cuda and elt == 2 and n % 8 and plain
    if cfg.variant == "columns":
        assert parked and not need[0]
    if cfg.columns is not None:
        col_blocks, splits, rows_per_split = cfg.columns
        assert col_blocks * col_block >= n and splits * rows_per_split >= m
    if cfg.columns_direct is not None:
        assert cfg.columns_direct[1] == 1
    if cfg.variant == "fused":
        f = cfg.fused
        assert _pow2(f.block) and f.block >= common.body_len(n, f.vec) and f.vec in (0, vec)
        assert f.tiles * f.rows >= m and 1 <= f.programs <= f.tiles and f.resident >= 1
        assert not f.vec or f.programs % f.vec == 0 or f.programs == f.tiles
        assert _pow2(f.warps) and f.warps <= 32
    if cfg.variant == "split":
        s = cfg.split
        assert dev.split_rows and s.pieces <= dev.num_sms and s.pieces * s.piece >= n
        assert not s.clusters or (need[0] and not s.vec and dev.clusters
                                  and s.pieces in CLUSTER_SIZES)
        assert cfg.fallback is not None and cfg.fallback.variant in ("split", "rows", "native")
    if cfg.variant == "dx_pieces":
        pieces, piece, pvec, warps, _ = cfg.pieces
        assert pvec == vec > 0 and pieces * piece >= n and _pow2(warps)
    if cfg.variant == "rows" and need[0]:
        r = cfg.rows
        assert _pow2(r.warps) and r.warps <= 32
        if r.single:
            assert r.block >= common.body_len(n, r.vec) and r.tiles * r.rows >= m
            assert 1 <= r.programs <= r.tiles
        else:
            assert r.rows == 1 and _pow2(r.block)


def test_layernorm_overrides_reach_the_config():
    """Overrides of rule tables, thresholds and rule functions change the configs."""
    reload = [(n, elt) for n in ROW_LENGTHS for elt in ELT_SIZES
              if ln_rules.forward_config(n, elt, 0, 4, True, True, GPU).variant == "reload"]
    split = [n for n in ROW_LENGTHS
             if ln_rules.forward_config(n, 4, 0, 4, True, True, GPU).variant == "split"]
    assert reload and split, "the rules have no reload or split rows to override"
    with configs.override("layernorm", RELOAD_FWD={}):
        assert all(ln_rules.forward_config(n, elt, 0, 4, True, True, GPU).variant != "reload"
                   for n, elt in reload)
    with configs.override("layernorm", split_config=forced_split_config(None, None)):
        assert all(ln_rules.forward_config(n, 4, 0, 4, True, True, GPU).variant == "looped"
                   for n in split)
    fused = [n for n in ROW_LENGTHS if ln_rules.backward_config(
        64, n, 2, (n, n), 0, True, True, True, True, True, GPU).variant == "fused"]
    assert fused
    with configs.override("layernorm", FUSED_BWD_MAX_BLOCK=0):
        assert all(ln_rules.backward_config(64, n, 2, (n, n), 0, True, True, True, True, True,
                                            GPU).variant != "fused" for n in fused)


# ----------------------------------------------------------------- masked softmax, epilogues

def test_masked_softmax_configs():
    """Single-block launches hold the padded row and cover the rows; longer rows loop."""
    for n, elt, _, m, _, dev in _cases():
        for cfg in (smm_rules.forward_config(n, elt, False, m, dev),
                    smm_rules.forward_config(n, elt, True, m, dev),
                    smm_rules.backward_config(n, elt, m, dev)):
            assert _pow2(cfg.warps) and cfg.warps <= 32
            if cfg.variant == "single":
                _check_single(cfg, n, m)
            else:
                assert cfg.variant == "looped" and cfg.grid == m and _pow2(cfg.block)
    with configs.override("softmax_masked", FWD_SINGLE_CAP={2: 256, 4: 256}):
        assert smm_rules.forward_config(1000, 2, False, 4, GPU).variant == "looped"


def test_epilogue_configs():
    """Single-block launches hold the padded row and cover the rows with a grid no larger than
    the tiles; the long-row backward's column grid covers every column and row."""
    for n, elt, _, m, _, dev in _cases(ns=[n for n in ROW_LENGTHS if n <= 65537]):
        for dropout in (False, True):
            for extra in (False, True):
                fwd = le_rules.forward_config(n, elt, m, dropout, extra, dev)
                bwd = le_rules.backward_config(n, elt, m, dropout, 2 if extra else 0,
                                               (n, n, n) if extra else (n, n), dev)
                for cfg in (fwd, bwd):
                    assert _pow2(cfg.warps) and cfg.warps <= 32
                    if cfg.variant == "single":
                        assert cfg.block == next_pow2(n) and cfg.tiles * cfg.rows >= m
                        assert 1 <= cfg.grid <= cfg.tiles
                    else:
                        assert cfg.variant == "looped" and cfg.grid == m and cfg.groups >= 1
                if bwd.variant == "looped":
                    assert bwd.col_blocks * 1024 >= n and bwd.splits * bwd.rows_per_split >= m
    with configs.override("layernorm_epilogue", FWD_MAX_BLOCK=16, BWD_MAX_BLOCK=16):
        assert le_rules.forward_config(64, 2, 4, False, False, GPU).variant == "looped"
        assert le_rules.backward_config(64, 2, 4, False, 0, (64, 64), GPU).variant == "looped"


# ------------------------------------------------------------------------------------ RMSNorm

def test_rmsnorm_configs():
    """Every row length gets a launch; single-block launches hold the padded row (or body);
    unrolled launches only for aligned rows their chunk divides; VEC only where the call's
    rows have one; split rows only where the device runs them and every piece of a row is
    resident; the shifted weight copies only with VEC."""
    for n, elt, vec, _, _, dev in _cases(ms=(37,)):
        for aligned in (False, True):
            for large in (False, True):
                fwd = rms_rules.forward_config(n, elt, vec, aligned, dev, large)
                assert _pow2(fwd.warps) and fwd.warps <= 32 and fwd.vec in (0, vec)
                assert not fwd.shifted_w or (fwd.vec and large)
                if fwd.kernel in ("single", "reload_vec"):
                    assert _pow2(fwd.block) and fwd.block >= common.body_len(n, fwd.vec)
                elif fwd.kernel == "unrolled":
                    assert aligned and not vec and n % fwd.chunk == 0
                    assert fwd.chunk % (32 * fwd.warps) == 0
                elif fwd.kernel == "unrolled_vec":
                    assert fwd.vec and large and fwd.shifted_w
                    assert fwd.block == (n // vec - 1) * vec >= fwd.chunk
                    assert fwd.chunk % (32 * fwd.warps) == 0
                elif fwd.kernel == "split":
                    assert common.split_fits(dev, n, fwd.chunk)
                elif fwd.kernel == "pieces":  # whole pieces of whole chunks, in clusters
                    assert dev.clusters and aligned and not fwd.vec and fwd.cluster
                    assert n // fwd.block in CLUSTER_SIZES and n % fwd.block == 0
                    assert fwd.block % fwd.chunk == 0 and fwd.chunk % (32 * fwd.warps) == 0
                elif fwd.kernel == "staged":  # one cluster per row, whole pieces
                    assert dev.clusters and aligned and not fwd.vec and fwd.cluster
                    assert n // fwd.block in CLUSTER_SIZES and n % fwd.block == 0
                    assert fwd.block * elt % (16 * 32 * fwd.warps) == 0  # vectors per thread
                    assert fwd.fallback is not None and fwd.fallback.kernel != "staged"
                else:
                    assert fwd.kernel == "looped" and _pow2(fwd.block)
            bwd = rms_rules.backward_config(n, elt, vec, aligned, dev)
            assert _pow2(bwd.warps) and bwd.warps <= 32 and bwd.vec in (0, vec)
            if bwd.kernel == "fused":
                assert _pow2(bwd.block) and bwd.block >= common.body_len(n, bwd.vec)
                assert bwd.block <= rms_rules.FUSED_BWD_MAX_BLOCK
            elif bwd.kernel == "split":
                assert common.split_fits(dev, n, bwd.chunk) and (dev.clusters or not bwd.cluster)
            elif bwd.kernel == "pieces":  # whole pieces of whole chunks, in clusters
                assert dev.clusters and aligned and not bwd.vec and bwd.cluster
                assert n // bwd.block in CLUSTER_SIZES and n % bwd.block == 0
                assert bwd.block % bwd.chunk == 0 and bwd.block // bwd.chunk <= 4
                assert bwd.chunk % (32 * bwd.warps) == 0
                assert bwd.fallback == rms_rules.backward_config(
                    n, elt, vec, aligned, dev._replace(clusters=False))
            else:
                assert bwd.kernel == "looped" and _pow2(bwd.block)
    with configs.override("rmsnorm", VEC_EDGES=False, SPLIT_ROWS_MIN=1 << 62):
        assert rms_rules.forward_config(8193, 2, 8, False, GPU, True).vec == 0
        assert rms_rules.backward_config(262144, 4, 0, True, GPU).kernel == "looped"


# ---------------------------------------------------------------------- purity and the memos

def test_configs_read_no_tensor_and_no_device(monkeypatch):
    """The decisions read their arguments and rule data only: with allocation and every CUDA
    query failing, they still answer, and the same arguments give the same config."""
    def fail(*args, **kwargs):
        raise AssertionError("a launch rule allocated or asked the device")

    for name in ("empty", "zeros", "empty_like"):
        monkeypatch.setattr(torch, name, fail)
    for name in ("get_device_properties", "get_device_name", "get_device_capability"):
        monkeypatch.setattr(torch.cuda, name, fail)
    for n in (100, 4096, 8193, 65537):
        for dev in FACTS.values():
            calls = [
                (sm_rules.forward_config, (n, 2, 8 if n % 8 else 0, 37, dev)),
                (sm_rules.backward_config, (n, 2, 0, 37, dev)),
                (ln_rules.forward_config, (n, 2, 0, 37, False, True, dev)),
                (ln_rules.backward_config, (37, n, 2, (n, n), 0, True, True, True, True, True,
                                            dev)),
                (smm_rules.forward_config, (n, 2, True, 37, dev)),
                (le_rules.backward_config, (n, 2, 37, True, 1, (n, n), dev)),
                (rms_rules.forward_config, (n, 2, 8 if n % 8 else 0, False, dev, True)),
                (rms_rules.backward_config, (n, 4, 0, True, dev)),
            ]
            for fn, args in calls:
                assert fn(*args) == fn(*args)


# The host files' memos of the decisions: (memo, arguments of a call on the CPU).
MEMOS = {
    "softmax forward": (tsm._fwd_config, (1000, 2, 0, 4, -1)),
    "softmax backward": (tsm._bwd_config, (1000, 2, 0, 4, -1)),
    "masked softmax forward": (tsmm._fwd_config, (1000, 2, True, 4, -1)),
    "masked softmax backward": (tsmm._bwd_config, (1000, 2, 4, -1)),
    "layernorm forward": (tln._fwd_config, (1000, 2, 0, 4, True, True, -1)),
    "layernorm backward": (tlnb._bwd_config, (4, 1000, 2, (1000, 1000), 0, True, True, True,
                                              True, True, -1)),
    "epilogue forward": (tle._fwd_config, (1000, 2, 4, False, False, -1)),
    "epilogue backward": (tle._bwd_config, (1000, 2, 4, False, 0, (1000, 1000), -1)),
    "rmsnorm forward": (trms._fwd_config, (1000, 2, 0, True, -1, False)),
    "rmsnorm backward": (trmsb._bwd_config, (1000, 2, 0, True, -1)),
}


@pytest.mark.parametrize("op", sorted(MEMOS))
def test_host_memos_are_dropped_with_the_rules(op):
    """Each host file memoizes its decision per call signature in a cache that is cleared
    with the other config caches, so a call after ``configs.override`` sees the new rules."""
    memo, args = MEMOS[op]
    assert memo in config_caches
    before = memo(*args)
    with configs.override(SINGLE_BLOCK_LIMIT=256):
        during = memo(*args)
    assert during != before and memo(*args) == before
