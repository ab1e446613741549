"""The LayerNorm forward in thread-block clusters of streamed pieces (``ln_fwd_pieces``,
``PIECES_FWD`` in ``configs/layernorm.py``): each of a row's C programs runs the unrolled
kernel's two passes on its piece and the cluster exchanges (mean offset, M2) on chip.

CPU: the launch rules, the host's launch (the cluster launcher stubbed) and its fallback when
the launch is refused, and the kernel compiled for sm_90 (PTX through ptxas, no GPU needed; a
subprocess, as the interpreter replaces ``triton.jit``). GPU (``gpu`` marker): forced rules of
2-16 pieces, one cluster per row and persistent, against float64 (y, mean and rstd), rows far
from zero and constant rows, with and without weight and bias.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _reliability import gpu
from _sm90 import assert_one_exchange, compile_counts
from conftest import EXHAUSTIVE, INTERPRETING, assert_close_to_ref, tol

from fusedops.backends.triton import layernorm as tln
from fusedops.backends.triton.configs import layernorm as ln_rules
from fusedops.backends.triton.runtime.facts import DeviceFacts
from fusedops.backends.triton.runtime.recording import record_launches

EPS = 1e-5
HOPPER = DeviceFacts(True, 132, "NVIDIA H200", True, True)


def _fwd(n: int, elt: int, dev: DeviceFacts = HOPPER, m: int = 64, aligned: bool = True,
         vec: int = 0):
    return ln_rules.forward_config(n, elt, vec, m, True, aligned, dev)


def _names(record) -> list[str]:
    return [launcher.kernel.__name__ for launcher, *_ in record]


def test_pieces_rules(launch_rules):
    """Shipped PIECES_FWD rules take ln_fwd_pieces on a GPU that runs clusters, with the rules
    without clusters as the fallback; rows no whole pieces fill, piece counts that are no
    cluster size, unaligned rows and GPUs without clusters do not."""
    assert ln_rules.PIECES_FWD
    for elt, rules in ln_rules.PIECES_FWD.items():
        for _shortest, longest, (piece, chunk, warps, persistent) in rules:
            cfg = _fwd(longest, elt)
            assert (cfg.variant, cfg.piece, cfg.pieces, cfg.chunk, cfg.warps) == (
                "pieces", piece, longest // piece, chunk, warps)
            assert cfg.grid == (0 if persistent else 64 * (longest // piece))
            assert cfg.fallback == _fwd(longest, elt, HOPPER._replace(clusters=False))
            assert cfg.fallback.variant != "pieces"
    launch_rules("layernorm", PIECES_FWD={2: ((32768, 262144, (16384, 4096, 16, False)),)})
    for n in (32768, 65536, 131072, 262144):
        cfg = _fwd(n, 2, m=10)
        assert (cfg.variant, cfg.pieces, cfg.grid, cfg.stats) == ("pieces", n // 16384,
                                                                  10 * (n // 16384), True)
    assert _fwd(98304, 2).variant != "pieces"  # 6 pieces: no cluster size
    assert _fwd(65536 + 8, 2).variant != "pieces"  # no whole pieces
    assert _fwd(65536, 4).variant != "pieces"  # no float32 rule
    assert _fwd(65536, 2, aligned=False).variant != "pieces"
    assert _fwd(65536, 2, HOPPER._replace(clusters=False)).variant != "pieces"
    assert ln_rules.forward_config(65536, 2, 0, 64, False, True, HOPPER).stats is False
    launch_rules("layernorm", PIECES_FWD={2: ((65536, 65536, (16384, 3072, 16, True)),)})
    assert _fwd(65536, 2).variant != "pieces"  # no whole chunks


@pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need the Triton interpreter")
@pytest.mark.parametrize("refused", [False, True])
@pytest.mark.parametrize("with_stats", [False, True])
def test_pieces_launch_path(monkeypatch, refused, with_stats, launch_rules):
    """A pieces config: the cluster launcher gets the rows' C pieces, the grid the rule gives
    (None: the launcher sizes a persistent one), x, weight, bias, y and the statistics;
    refused, the call runs the fallback rules (here the CPU's) with the right values."""
    calls = []

    def cluster(items, chunks, runtime, consts, num_warps, device, progs=None, vec=0):
        calls.append((items, chunks, runtime, consts, num_warps, progs))
        return 0 if refused else items

    fallback = ln_rules.forward_config(256, 2, 0, 8, with_stats, True,
                                       DeviceFacts(False, 1, "", False, False))
    cfg = ln_rules.LayerNormForward("pieces", 0, 4, chunk=32, stats=with_stats, pieces=4,
                                    piece=64, fallback=fallback)
    monkeypatch.setattr(tln, "_launch_fwd_pieces", cluster)
    monkeypatch.setattr(tln, "_fwd_config", lambda *a: cfg)
    launch_rules("layernorm")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 256, generator=g) + 3).to(torch.bfloat16)
    w = (1 + 0.5 * torch.randn(256, generator=g)).to(torch.bfloat16)
    b = (0.5 * torch.randn(256, generator=g)).to(torch.bfloat16)
    with record_launches() as record:
        y, mean, rstd = tln._forward(x, w, b, EPS, torch.bfloat16, with_stats)
    (items, chunks, runtime, consts, warps, progs), = calls
    assert (items, chunks, warps, progs) == (8 * 4, 4, 4, None)
    assert consts == (64, 32, 4, 4, True, True, with_stats)
    assert runtime[:4] == (x, w, b, y) and runtime[6:9] == (8, 256, 256)
    if with_stats and not refused:
        assert runtime[4] is mean and runtime[5] is rstd
    assert bool(_names(record)) == refused
    if refused:
        y64 = F.layer_norm(x.double(), (256,), w.double(), b.double(), EPS)
        assert_close_to_ref(y, y64, torch.bfloat16)


_COMPILE = """
    from fusedops.backends.triton.kernels.layernorm_pieces import ln_fwd_pieces as fn

    consts = dict(L=4096, CHUNK=1024, C=4, C_P2=4, HAS_W=True, HAS_B=True, STATS=True)
    ptx = compile_sm90(fn, consts)["ptx"]
    print(json.dumps({t: ptx.count(t) for t in (
        "barrier.cluster.arrive.release", "barrier.cluster.wait.acquire",
        "mapa.shared::cluster", "st.shared::cluster", "atom.", "red.global",
        "ld.global")}))
"""



@EXHAUSTIVE  # (a compile in a fresh interpreter: seconds)
def test_pieces_kernel_compiles_for_sm90():
    """ptxas accepts the kernel: it meets its cluster at the start and once per row (one
    exchange: stores into the peers' shared memory), with no atomics."""
    got = compile_counts(_COMPILE)
    assert_one_exchange(got)
    assert got["ld.global"] > 0


def _case(m: int, n: int, dtype: torch.dtype, affine: bool, kind: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed + n)
    if kind == "far":  # far from zero: the statistics as offsets from the row's first element
        x = 1e3 + torch.randn(m, n, generator=g)
    elif kind == "constant":  # zero variance: y = bias
        x = torch.full((m, n), 2.5) + torch.arange(m)[:, None]
    else:
        x = 2 * torch.randn(m, n, generator=g) + 0.3
    w = (1 + 0.5 * torch.randn(n, generator=g)).to(dtype).cuda() if affine else None
    b = (0.5 * torch.randn(n, generator=g)).to(dtype).cuda() if affine else None
    return x.to(dtype).cuda(), w, b


@gpu
@pytest.mark.parametrize("dtype,m,n,piece,chunk,warps", [
    (torch.bfloat16, 48, 131072, 16384, 4096, 16), (torch.float32, 40, 131072, 16384, 4096, 16),
    (torch.float16, 7, 65536, 32768, 2048, 8), (torch.bfloat16, 300, 32768, 16384, 2048, 8),
    (torch.float32, 20, 262144, 16384, 4096, 16), (torch.bfloat16, 64, 65536, 8192, 2048, 8)],
    ids=str)
@pytest.mark.parametrize("persistent", [False, True])
def test_gpu_pieces_forward(dtype, m, n, piece, chunk, warps, persistent, launch_rules):
    """Forced PIECES_FWD rules: y, mean and rstd against float64 for ordinary rows, rows far
    from zero and constant rows, with and without weight and bias; the forward launches
    ln_fwd_pieces (Hopper; elsewhere the rules without clusters)."""
    hopper = torch.cuda.get_device_capability()[0] >= 9
    elt = torch.empty((), dtype=dtype).element_size()
    launch_rules("layernorm", PIECES_FWD={elt: ((n, n, (piece, chunk, warps, persistent)),)})
    for kind, affine in (("plain", True), ("plain", False), ("far", True), ("constant", True)):
        x, w, b = _case(m, n, dtype, affine, kind)
        with record_launches() as record:
            y, mean, rstd = tln.layernorm_forward(x, w, b, EPS, dtype)
        assert ("ln_fwd_pieces" in _names(record)) == hopper, _names(record)
        x64 = x.double()
        y64 = F.layer_norm(x64, (n,), None if w is None else w.double(),
                           None if b is None else b.double(), EPS)
        assert_close_to_ref(y, y64, dtype)
        var64 = x64.var(-1, unbiased=False)
        torch.testing.assert_close(mean.double(), x64.mean(-1), **tol(torch.float32))
        torch.testing.assert_close(rstd.double(), torch.rsqrt(var64 + EPS),
                                   **tol(torch.float32))
