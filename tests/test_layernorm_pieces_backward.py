"""The LayerNorm backward in thread-block clusters of streamed pieces (``ln_bwd_pieces``,
``PIECES_BWD`` in ``configs/layernorm.py``): each of a row's C programs streams its piece of x
and dy for its shares of Σ x̂·g and Σ g, the cluster exchanges the pair on chip, and a second
pass over the piece writes dx and adds to the piece's dweight and dbias accumulators. In the
low_memory mode the partials sit at the end of dx's storage and a second launch writes the dx
of the rows under them.

CPU: the launch rules, the host's launches (the cluster launcher stubbed) in both modes and its
fallback (a refused launch), and the kernel compiled for sm_90 (PTX through ptxas, no GPU
needed; a subprocess, as the interpreter replaces ``triton.jit``). GPU (``gpu`` marker): forced
rules of 2-16 pieces of 1-4 chunks, fewer rows than clusters and more, with and without a
weight, every subset of gradients, both modes bit for bit, against float64.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from _reliability import gpu
from _sm90 import assert_one_exchange, compile_counts
from conftest import INTERPRETING, assert_close_to_ref, assert_row_sum_close

import fusedops
from fusedops.backends.triton import layernorm_bwd as tlnb
from fusedops.backends.triton.configs import layernorm as ln_rules
from fusedops.backends.triton.runtime.facts import DeviceFacts, device_facts
from fusedops.backends.triton.runtime.recording import record_launches

HOPPER = DeviceFacts(True, 132, "NVIDIA H200", True, True)
BF16, FP32 = torch.bfloat16, torch.float32


def _bwd(m: int, n: int, elt: int, dev: DeviceFacts = HOPPER, stride: int | None = None,
         vec: int = 0, need=(True, True, True), parked: bool = True):
    strides = (stride or n, stride or n)
    return ln_rules.backward_config(m, n, elt, strides, vec, *need, parked, True, dev)


def test_pieces_backward_rules(launch_rules):
    """PIECES_BWD: calls with dx on aligned rows in a rule's range that whole pieces of whole
    chunks fill, in a cluster size, with enough rows (PIECES_BWD_MIN_ROWS times what the parked
    partials cover), take the streamed-pieces backward on a GPU that runs clusters, ahead of
    every other backward (the fallback: the rules without clusters). Unaligned rows, rows no
    piece divides, other piece counts, calls without dx, few rows and GPUs without clusters do
    not."""
    no_clusters = HOPPER._replace(clusters=False)
    for elt, rules in ln_rules.PIECES_BWD.items():  # shipped
        for shortest, longest, (piece, chunk, warps) in rules:
            for n in {shortest, longest}:
                m = 2 ** 27 // n
                cfg = _bwd(m, n, elt)
                assert (cfg.variant, cfg.streamed) == ("pieces", (n // piece, piece, chunk,
                                                                  warps))
                assert cfg.fallback == _bwd(m, n, elt, no_clusters)
    launch_rules("layernorm", PIECES_BWD={2: ((16384, 262144, (8192, 4096, 32)),),
                                          4: ((32768, 32768, (8192, 2048, 16)),)})
    for n in (16384, 32768, 65536, 131072):  # 2 to 16 pieces
        m = 2 ** 27 // n
        for parked in (True, False):
            for need in ((True, True, True), (True, False, False), (True, True, False)):
                cfg = _bwd(m, n, 2, need=need, parked=parked)
                assert (cfg.variant, cfg.streamed) == ("pieces", (n // 8192, 8192, 4096, 32))
                assert cfg.fallback == _bwd(m, n, 2, no_clusters, need=need, parked=parked)
                assert cfg.fallback.variant != "pieces" and cfg.rows is not None
        assert _bwd(m, n, 2, no_clusters).variant != "pieces"
        assert _bwd(m, n, 2, stride=n + 4).variant != "pieces"  # rows not 16-byte aligned
        assert _bwd(m, n, 2, need=(False, True, True)).variant != "pieces"  # no dx
        assert _bwd(m, n, 2, need=(False, True, True), parked=False).variant != "pieces"
        assert (_bwd(m, n, 4).variant == "pieces") == (n == 32768)
    assert _bwd(512, 262144, 2).variant != "pieces"  # 32 pieces: no cluster size
    assert _bwd(1024, 49152, 2).variant != "pieces"  # 6 pieces
    assert _bwd(1024, 65536 + 8, 2).variant != "pieces"  # no whole pieces
    assert _bwd(1024, 65537, 2, stride=65537, vec=8).variant != "pieces"
    assert _bwd(2048, 8192, 2).variant == "fused"  # below the range
    # Few rows: at 32 warps at most 2 CTAs an SM, 132 clusters of 2 pieces park 8 · 132 / 2 + 1
    # bf16 rows of 16K; the rule asks for PIECES_BWD_MIN_ROWS times as many.
    least = ln_rules.PIECES_BWD_MIN_ROWS * (8 * 132 // 2 + 1)
    assert _bwd(least, 16384, 2).variant == "pieces"
    assert _bwd(least - 1, 16384, 2).variant != "pieces"
    launch_rules("layernorm", PIECES_BWD={2: ((65536, 65536, (16384, 3072, 16)),)})
    assert _bwd(2048, 65536, 2).variant != "pieces"  # no whole chunks


class _StubLauncher:
    """Stands in for the cluster launcher: records the calls and, where it launches, writes the
    first launch's values (dx rows below M_dx: 7, partials: 1) or the second's (dx rows from
    row0: 9), as if the kernel ran."""

    def __init__(self, held: int, refused: bool = False) -> None:
        self.held, self.refused, self.calls = held, refused, []

    def programs(self, items, chunks, runtime, consts, num_warps, device, vec=0):
        return 0 if self.refused else min(self.held, items // chunks) * chunks

    def __call__(self, items, chunks, runtime, consts, num_warps, device, progs=None, vec=0):
        self.calls.append((items, chunks, runtime, consts, num_warps, progs))
        dx, part, row0, m, m_dx = runtime[5:10]
        if consts[-2] or consts[-1]:  # NEED_DW, NEED_DB: the first launch
            dx[:m_dx].fill_(7.0)
            part.fill_(1.0)
        else:
            dx[row0:m].fill_(9.0)
        return progs


@pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need the Triton interpreter")
@pytest.mark.parametrize("mode", ["low_memory", "fast"])
@pytest.mark.parametrize("with_w", [True, False])
def test_pieces_backward_launches(monkeypatch, mode, with_w):
    """A streamed-pieces config: the cluster launcher gets the rows' C pieces on the grid it
    sizes, x, dy, the weight (or a placeholder), mean, rstd, dx and (2, progs / C, N) float32
    partials, whose rows sum into dweight and dbias. low_memory: the partials sit at the end of
    dx's storage, the first launch writes dx below the rows they cover (M_dx), and a second
    launch without partials (NEED_DW = NEED_DB = False) writes rows M_dx.. on at most as many
    programs; fast: scratch partials, one launch."""
    m, n, piece, chunk = 64, 256, 64, 32
    stub = _StubLauncher(held=3)
    cfg = ln_rules.LayerNormBackward("pieces", streamed=(4, piece, chunk, 4))
    monkeypatch.setattr(tlnb, "_launch_bwd_pieces", stub)
    monkeypatch.setattr(tlnb, "_bwd_config", lambda *a: cfg)
    x, dy = torch.randn(m, n).bfloat16(), torch.randn(m, n).bfloat16()
    w = torch.randn(n).bfloat16() if with_w else None
    mean, rstd = x.float().mean(1), x.float().var(1).rsqrt()
    with fusedops.layernorm_backward_mode(mode):
        dx, dw, db = tlnb.layernorm_backward(dy, x, w, mean, rstd, True, True, True)
    first, *second = stub.calls
    items, chunks, runtime, consts, warps, progs = first
    assert (items, chunks, warps, progs) == (m * 4, 4, 4, 12)
    assert consts == (n, piece, chunk, 4, 4, with_w, True, True)
    assert runtime[:2] == (dy, x) and runtime[3] is mean and runtime[4] is rstd
    assert runtime[2] is (w if with_w else x)  # (a placeholder without a weight)
    assert runtime[5] is dx and runtime[10:] == (n, n, n)
    part = runtime[6]
    assert part.shape == (2, 3, n) and part.dtype == FP32  # a row pair per cluster
    assert torch.equal(dw, torch.full_like(dw, 3)) and torch.equal(db, torch.full_like(db, 3))
    if mode == "fast":
        assert not second and runtime[7:10] == (0, m, m)
        assert part.untyped_storage().data_ptr() != dx.untyped_storage().data_ptr()
        assert torch.equal(dx, torch.full_like(dx, 7.0))
        return
    m_dx = m - 2 * 3 * n * 4 // (n * 2)  # (the partials' 6 float32 rows: 12 bf16 rows of dx)
    assert runtime[7:10] == (0, m, m_dx)
    assert part.untyped_storage().data_ptr() == dx.untyped_storage().data_ptr()
    assert part.storage_offset() * 4 == m_dx * n * 2  # (16-byte aligned at a row's start here)
    (items2, chunks2, runtime2, consts2, warps2, progs2), = second
    assert (items2, chunks2, warps2, progs2) == ((m - m_dx) * 4, 4, 4, 12)
    assert consts2 == (*consts[:-2], False, False)
    assert runtime2[7:10] == (m_dx, m, m)
    assert torch.equal(dx[:m_dx], torch.full_like(dx[:m_dx], 7.0))
    assert torch.equal(dx[m_dx:], torch.full_like(dx[m_dx:], 9.0))


@pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need the Triton interpreter")
@pytest.mark.parametrize("mode", ["low_memory", "fast"])
def test_pieces_backward_refused(monkeypatch, mode):
    """A refused cluster launch (a profiler's launch hooks, or no cluster fits) runs the
    fallback rules (here the CPU's) with the right values."""
    m, n = 12, 256
    stub = _StubLauncher(held=3, refused=True)
    fallback = ln_rules.backward_config(m, n, 4, (n, n), 0, True, True, True,
                                        mode == "low_memory", True, device_facts(-1))
    cfg = ln_rules.LayerNormBackward("pieces", streamed=(4, 64, 32, 4), fallback=fallback)
    monkeypatch.setattr(tlnb, "_launch_bwd_pieces", stub)
    monkeypatch.setattr(tlnb, "_bwd_config", lambda *a: cfg)
    g = torch.Generator().manual_seed(3)
    x, dy, w = torch.randn(m, n, generator=g), torch.randn(m, n, generator=g), torch.randn(n)
    xd = x.double()
    mean = xd.mean(1).float()
    rstd = torch.rsqrt(xd.var(1, unbiased=False) + 1e-5).float()
    with fusedops.layernorm_backward_mode(mode), record_launches() as record:
        dx, dw, db = tlnb.layernorm_backward(dy, x, w, mean, rstd, True, True, True)
    assert not stub.calls and len(record)
    r = [xd.requires_grad_(), w.double().requires_grad_()]
    want = torch.autograd.grad(torch.nn.functional.layer_norm(r[0], (n,), r[1], None, 1e-5), r,
                               dy.double())
    assert_close_to_ref(dx, want[0], FP32)
    assert_row_sum_close(dw, want[1], m)
    assert_row_sum_close(db, dy.double().sum(0), m)


_COMPILE = textwrap.dedent("""
    import json, re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fusedops.backends.triton.kernels.layernorm_pieces import ln_bwd_pieces as fn

    names = fn.arg_names
    consts = dict(N=32768, L=8192, CHUNK=4096, C=4, C_P2=4, HAS_W=True, NEED_DW=True,
                  NEED_DB=True)
    f32 = ("mean_ptr", "rstd_ptr", "part_ptr")
    sig = {a: ("*fp32" if a in f32 else "*bf16") if a.endswith("_ptr")
           else "constexpr" if a in consts else "i32" for a in names}
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(names.index(a),): v for a, v in consts.items()},
                    attrs={(names.index(a),): [["tt.divisibility", 16]] for a in names
                           if a.endswith("_ptr") or a.startswith("stride")})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 16}).asm["ptx"]
    out = {t: ptx.count(t) for t in (
        "barrier.cluster.arrive.release", "barrier.cluster.wait.acquire",
        "mapa.shared::cluster", "st.shared::cluster", "atom.", "red.global")}
    out["ld.v4"] = len(re.findall(r"ld\\.global[.\\w:]*\\.v4", ptx))
    out["st.v4"] = len(re.findall(r"st\\.global[.\\w:]*\\.v4", ptx))
    print(json.dumps(out))
""")


def test_pieces_backward_compiles_for_sm90():
    """ptxas accepts the kernel: it meets its cluster at the start and once per row (one
    exchange of the pair: stores into the peers' shared memory), with no atomics, and reads
    and writes 16-byte vectors."""
    got = compile_counts(_COMPILE)
    assert_one_exchange(got)
    assert got["ld.v4"] >= 4 and got["st.v4"] >= 2, got


def _case(m: int, n: int, dtype: torch.dtype, weight: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, n, generator=g) * 2 + 5).to(dtype).cuda()  # offset: no cancellation
    dy = torch.randn(m, n, generator=g).to(dtype).cuda()
    w = (1 + 0.5 * torch.randn(n, generator=g)).to(dtype).cuda() if weight else None
    xd = x.double()
    mean = xd.mean(1).float()
    rstd = torch.rsqrt(xd.var(1, unbiased=False) + 1e-5).float()
    return dy, x, w, mean, rstd


@gpu
@pytest.mark.parametrize("dtype,m,n,piece,chunk,warps", [
    (BF16, 48, 131072, 8192, 4096, 32), (BF16, 300, 32768, 8192, 2048, 8),
    (torch.float16, 7, 65536, 16384, 4096, 32), (BF16, 40, 262144, 16384, 8192, 32),
    (FP32, 64, 65536, 8192, 4096, 16), (FP32, 20, 262144, 16384, 4096, 32),
    (BF16, 1000, 16384, 4096, 4096, 8), (FP32, 513, 32768, 8192, 2048, 32)], ids=str)
def test_gpu_pieces_backward(dtype, m, n, piece, chunk, warps, launch_rules):
    """Forced PIECES_BWD rules (2-16 pieces of 1-4 chunks, fewer rows than clusters and more;
    no least row count, so the parked rows may be most of dx): dx, dweight and dbias against
    float64 with and without a weight, every subset of gradients with dx, both modes bit for
    bit, and the calls launch ln_bwd_pieces (Hopper: twice where partials are parked;
    elsewhere the rules without clusters)."""
    hopper = torch.cuda.get_device_capability()[0] >= 9
    elt = torch.empty((), dtype=dtype).element_size()
    launch_rules("layernorm", PIECES_BWD={elt: ((n, n, (piece, chunk, warps)),)},
                 PIECES_BWD_MIN_ROWS=0)
    for weight, need in ((True, (True, True, True)), (False, (True, False, True)),
                         (True, (True, False, False)), (True, (True, True, False))):
        dy, x, w, mean, rstd = _case(m, n, dtype, weight, seed=n + m)
        r = [x.double().requires_grad_()] + ([w.double().requires_grad_()] if weight else [])
        y = torch.nn.functional.layer_norm(r[0], (n,), r[1] if weight else None, None, 1e-5)
        want = (*torch.autograd.grad(y, r, dy.double()), dy.double().sum(0))
        got = {}
        for mode in ("fast", "low_memory"):
            with fusedops.layernorm_backward_mode(mode), record_launches() as record:
                got[mode] = tlnb.layernorm_backward(dy, x, w, mean, rstd, *need)
            pieces = [launcher for launcher, *_ in record
                      if launcher.kernel.__name__ == "ln_bwd_pieces"]
            assert bool(pieces) == hopper, [launcher.kernel.__name__ for launcher, *_ in record]
            dx, dw, db = got[mode]
            assert_close_to_ref(dx, want[0], dtype, scale=4)
            if need[1] and weight:
                assert_row_sum_close(dw, want[1], m, scale=4)
            if need[2]:
                assert_row_sum_close(db, want[-1], m, scale=4)
            assert (dw is None) != need[1] and (db is None) != need[2]
        for a, b in zip(got["fast"], got["low_memory"], strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
