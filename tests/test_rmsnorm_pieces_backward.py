"""The RMSNorm backward in thread-block clusters of streamed pieces (``rms_bwd_pieces``,
``PIECES_BWD`` in ``configs/rmsnorm.py``): each of a row's C programs streams its piece of x and
dy for its share of Σ x̂·w·dy, the cluster exchanges the shares on chip, and a second pass over
the piece writes dx and adds to the piece's dweight accumulators.

CPU: the launch rules, the host's launch (the cluster launcher stubbed) and its fallbacks (a
refused launch, a call without dx), and the kernel compiled for sm_90 (PTX through ptxas, no
GPU needed; a subprocess, as the interpreter replaces ``triton.jit``). GPU (``gpu`` marker):
forced rules of 2-16 pieces of 1-4 chunks, fewer rows than clusters and more, with and without
a weight, dx alone and dweight alone, against float64.
"""

from __future__ import annotations

import pytest
import torch
from _reliability import gpu
from _sm90 import assert_one_exchange, compile_counts
from conftest import EXHAUSTIVE, INTERPRETING, assert_close_to_ref, assert_row_sum_close
from test_rmsnorm_variants import EPS, GRAD, check, launched, make, oracle, tb

from fusedops.backends.triton import rmsnorm_bwd as trmsb
from fusedops.backends.triton.configs import rmsnorm as rms_rules
from fusedops.backends.triton.runtime.facts import DeviceFacts, device_facts
from fusedops.backends.triton.runtime.recording import record_launches

HOPPER = DeviceFacts(True, 132, "NVIDIA H200", True, True)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _bwd(n: int, elt: int, dev: DeviceFacts = HOPPER, aligned: bool = True, vec: int = 0):
    return rms_rules.backward_config(n, elt, vec, aligned, dev)


def test_pieces_backward_rules(launch_rules):
    """PIECES_BWD: aligned rows in a rule's range that whole pieces of whole chunks fill, in a
    cluster size, take the streamed-pieces backward on a GPU that runs clusters, ahead of every
    other backward (the fallback: the rules without clusters); unaligned rows, rows no piece
    divides, other piece counts and GPUs without clusters do not."""
    no_clusters = HOPPER._replace(clusters=False)
    for elt, rules in rms_rules.PIECES_BWD.items():  # shipped
        for shortest, longest, (piece, chunk, warps) in rules:
            for n in {shortest, longest}:
                assert _bwd(n, elt) == rms_rules.BwdConfig(
                    "pieces", piece, 1, warps, 0, True, 0, chunk, 0, None, True,
                    fallback=_bwd(n, elt, no_clusters))
                assert _bwd(n, elt, aligned=False).kernel != "pieces"
    launch_rules("rmsnorm", PIECES_BWD={2: ((16384, 262144, (8192, 4096, 16)),)})
    for n in (16384, 32768, 65536, 131072):  # 2 to 16 pieces
        cfg = _bwd(n, 2)
        assert (cfg.kernel, cfg.block, cfg.chunk, cfg.warps, cfg.cluster) == (
            "pieces", 8192, 4096, 16, True), n
        assert cfg.fallback == _bwd(n, 2, no_clusters) and cfg.fallback.kernel != "pieces"
        assert _bwd(n, 2, no_clusters).kernel != "pieces"
        assert _bwd(n, 2, aligned=False).kernel != "pieces"
        assert _bwd(n, 4).kernel != "pieces"  # no float32 rule
    assert _bwd(262144, 2).kernel != "pieces"  # 32 pieces: no cluster size
    assert _bwd(49152, 2).kernel != "pieces"  # 6 pieces
    assert _bwd(65536 + 16, 2).kernel != "pieces"  # no whole pieces
    assert _bwd(65537, 2, aligned=False, vec=8).kernel != "pieces"
    assert _bwd(8192, 2).kernel == "fused"  # below the range
    launch_rules("rmsnorm", PIECES_BWD={2: ((65536, 65536, (16384, 3072, 16)),)})
    assert _bwd(65536, 2).kernel != "pieces"  # no whole chunks


class _StubLauncher:
    """Stands in for the cluster launcher: records the calls, and where it launches, writes
    ones into the partials and ``fill`` into dx (as if the kernel ran)."""

    def __init__(self, held: int, refused: bool = False) -> None:
        self.held, self.refused, self.calls = held, refused, []

    def programs(self, items, chunks, runtime, consts, num_warps, device, vec=0):
        return 0 if self.refused else min(self.held, items // chunks) * chunks

    def __call__(self, items, chunks, runtime, consts, num_warps, device, progs=None, vec=0):
        self.calls.append((items, chunks, runtime, consts, num_warps, progs))
        runtime[4].fill_(7.0)
        if consts[-1]:  # NEED_DW
            runtime[5].fill_(1.0)
        return progs


@pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need the Triton interpreter")
@pytest.mark.parametrize("refused", [False, True])
@pytest.mark.parametrize("with_w", [True, False])
def test_pieces_backward_launch_path(monkeypatch, refused, with_w, launch_rules):
    """A streamed-pieces config: the cluster launcher gets the rows' C pieces on the grid it
    sizes, x, dy, the weight, rstd, dx and (progs / C, N) float32 partials, whose rows sum into
    dweight; refused, the call runs the fallback rules (here the CPU's) with the right
    values."""
    m, n, piece, chunk = 10, 256, 64, 32
    stub = _StubLauncher(held=3, refused=refused)
    cpu_rules = rms_rules.backward_config(n, 2, 0, True, device_facts(-1))
    cfg = rms_rules.BwdConfig("pieces", piece, 1, 4, 0, True, 0, chunk, 0, None, True,
                              fallback=cpu_rules)
    monkeypatch.setattr(trmsb, "_launch_bwd_pieces", stub)
    monkeypatch.setattr(trmsb, "_bwd_config", lambda *a: cfg)
    launch_rules("rmsnorm")
    x, w, dy = make(m, n, BF16, "same" if with_w else "none")
    _, rstd = tb.rmsnorm_forward(x, w, EPS, BF16)
    with record_launches() as record:
        dx, dw = tb.rmsnorm_backward(dy, x, w, rstd, True, True)
    if refused:
        assert not stub.calls and launched(record)
        _, _, dx64, dw64 = oracle(x, w, dy)
        assert_close_to_ref(dx, dx64, BF16, GRAD)
        assert_row_sum_close(dw, dw64, m, GRAD)
        return
    (items, chunks, runtime, consts, warps, progs), = stub.calls
    assert (items, chunks, warps, progs) == (m * 4, 4, 4, 12)
    assert consts == (n, piece, chunk, 4, 4, with_w, True)
    assert runtime[:2] == (dy, x) and runtime[3] is rstd and runtime[4] is dx
    assert runtime[2] is (w if with_w else x)  # (a placeholder without a weight)
    assert runtime[5].shape == (3, n) and runtime[5].dtype == FP32  # a row per cluster
    assert runtime[6:] == (m, n, n, n)
    assert torch.equal(dx, torch.full_like(dx, 7.0)) and torch.equal(dw, torch.full_like(dw, 3))


@pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need the Triton interpreter")
def test_pieces_backward_without_dx(monkeypatch, launch_rules):
    """A call that needs dweight alone (no exchange to make) runs the fallback rules."""
    stub = _StubLauncher(held=3)
    cfg = rms_rules.BwdConfig("pieces", 64, 1, 4, 0, True, 0, 32, 0, None, True,
                              fallback=rms_rules.backward_config(256, 2, 0, True,
                                                                 device_facts(-1)))
    monkeypatch.setattr(trmsb, "_launch_bwd_pieces", stub)
    monkeypatch.setattr(trmsb, "_bwd_config", lambda *a: cfg)
    launch_rules("rmsnorm")
    x, w, dy = make(6, 256, BF16)
    _, rstd = tb.rmsnorm_forward(x, w, EPS, BF16)
    dx, dw = tb.rmsnorm_backward(dy, x, w, rstd, False, True)
    assert dx is None and not stub.calls
    assert_row_sum_close(dw, oracle(x, w, dy)[3], 6, GRAD)


_COMPILE = """
    import re
    from fusedops.backends.triton.kernels.rmsnorm_split import rms_bwd_pieces as fn

    consts = dict(N=32768, L=8192, CHUNK=2048, C=4, C_P2=4, HAS_W=True, NEED_DW=True)
    ptx = compile_sm90(fn, consts, num_warps=8)["ptx"]
    out = {t: ptx.count(t) for t in (
        "barrier.cluster.arrive.release", "barrier.cluster.wait.acquire",
        "mapa.shared::cluster", "st.shared::cluster", "atom.", "red.global")}
    out["ld.v4"] = len(re.findall(r"ld\\.global[.\\w:]*\\.v4", ptx))
    out["st.v4"] = len(re.findall(r"st\\.global[.\\w:]*\\.v4", ptx))
    print(json.dumps(out))
"""



@EXHAUSTIVE  # (a compile in a fresh interpreter: seconds)
def test_pieces_backward_compiles_for_sm90():
    """ptxas accepts the kernel: it meets its cluster at the start and once per row (one
    exchange: stores into the peers' shared memory), with no atomics, and reads and writes
    16-byte vectors."""
    got = compile_counts(_COMPILE)
    assert_one_exchange(got)
    assert got["ld.v4"] >= 4 and got["st.v4"] >= 2, got


@gpu
@pytest.mark.parametrize("dtype,m,n,piece,chunk,warps", [
    (BF16, 48, 131072, 8192, 4096, 16), (BF16, 300, 32768, 8192, 2048, 8),
    (FP16, 7, 65536, 16384, 4096, 16), (BF16, 40, 262144, 16384, 4096, 32),
    (FP32, 64, 65536, 8192, 4096, 16), (FP32, 20, 262144, 16384, 4096, 16),
    (BF16, 1000, 16384, 4096, 4096, 8), (FP32, 513, 32768, 16384, 4096, 16)], ids=str)
def test_gpu_pieces_backward(dtype, m, n, piece, chunk, warps, launch_rules):
    """Forced PIECES_BWD rules (2-16 pieces of 1-4 chunks, fewer rows than clusters and more):
    dx and dweight against float64 with and without a weight, dx alone and dweight alone, and
    the calls with dx launch rms_bwd_pieces (Hopper; elsewhere the rules without clusters)."""
    hopper = torch.cuda.get_device_capability()[0] >= 9
    elt = torch.empty((), dtype=dtype).element_size()
    launch_rules("rmsnorm", PIECES_BWD={elt: ((n, n, (piece, chunk, warps)),)})
    for w_mode, need in (("same", (True, True)), ("none", (True, True)),
                         ("same", (True, False)), ("same", (False, True))):
        x, w, dy = (t if t is None else t.cuda() for t in make(m, n, dtype, w_mode, seed=n))
        runs = check(x, w, dy, need=need, stats=False)
        bwd = runs.get("rms_bwd_pieces", [])
        assert (len(bwd) == 1 and bwd[0][12:15] == (piece, chunk, n // piece)) == (
            hopper and need[0]), runs.keys()
