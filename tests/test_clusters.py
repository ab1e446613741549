"""The LayerNorm backward's split-row kernel in thread-block clusters (``fusedops/backends/triton/
_clusters.py``): a row's pieces exchange their sums through distributed shared memory and the
cluster barrier (inline PTX) instead of global memory and counters.

CPU: the launch rules, that clusters stay off without a Hopper GPU, and that the kernel's
cluster variant compiles for sm_90 (PTX through ptxas, no GPU needed; a subprocess, since the
interpreter replaces ``triton.jit``). GPU (``gpu`` marker): every cluster size (2-16 pieces)
and load placement against float64, dx bit for bit as the cooperative kernel writes it, the
low_memory mode's parked rows, and the fallback when a cluster launch fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from _reliability import gpu
from conftest import (
    EXHAUSTIVE,
    INTERPRETING,
    assert_close_to_ref,
    assert_row_sum_close,
    forced_split_config,
)

import fusedops
from fusedops.backends.triton import layernorm_bwd as tlnb
from fusedops.backends.triton.configs import layernorm as ln_rules
from fusedops.backends.triton.kernels import layernorm_bwd_split as k_layernorm_bwd_split
from fusedops.backends.triton.runtime import clusters as _clusters
from fusedops.backends.triton.runtime import device as rt_device
from fusedops.backends.triton.runtime import recording as rt_recording
from fusedops.backends.triton.runtime import split as rt_split


def _clustered(cfg) -> bool:
    return cfg is not None and len(cfg) > 4 and bool(cfg[4])


@pytest.mark.parametrize("n,elt,aligned,clustered", [
    (16384, 2, True, True), (32768, 2, True, True), (65536, 2, True, True),
    (16384, 4, True, True), (65536, 4, True, True),
    (8192, 2, True, False), (8192, 4, True, False),  # shorter rows: one program per row
    (131072, 2, True, False), (131072, 4, True, False),  # longer: cooperative grids
    (32768, 4, False, False), (65537, 2, False, False),  # rows not 16-byte aligned
])
def test_cluster_rules(n, elt, aligned, clustered):
    """The rows the cluster rules are for (docs: aligned 16-bit and float32 rows of 16K-64K)
    take clusters, in pieces that fit one cluster; no other row does."""
    cfg = ln_rules.split_config("bwd", n, elt, aligned)
    assert _clustered(cfg) == clustered, cfg
    if clustered:
        assert rt_device.cdiv(n, cfg[0]) in (2, 4, 8, 16)


def test_cluster_rules_can_be_turned_off(monkeypatch, launch_rules):
    """CLUSTER_BWD off: no config asks for clusters, and the rows keep a split config."""
    launch_rules("layernorm", CLUSTER_BWD=False)
    for n in (16384, 32768, 65536):
        for elt in (2, 4):
            cfg = ln_rules.split_config("bwd", n, elt, True)
            assert cfg is not None and not _clustered(cfg), (n, elt, cfg)


def test_clusters_off_without_a_hopper_gpu():
    cpu = torch.device("cpu")
    assert not _clusters.clusters_enabled(cpu, 16384, 2048, 8)
    if torch.cuda.is_available() and not rt_device.interpreting():
        dev = torch.device("cuda", torch.cuda.current_device())
        hopper = torch.cuda.get_device_capability(dev)[0] >= 9
        assert _clusters.clusters_enabled(dev, 16384, 2048, 8) == hopper
        assert not _clusters.clusters_enabled(dev, 16384 * 17, 16384, 17)  # > 16 per cluster
        assert not _clusters.clusters_enabled(dev, 16384, 16384, 1)
        assert not _clusters.clusters_enabled(dev, 20480, 2048, 10)  # untested sizes


_COMPILE = textwrap.dedent("""
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fusedops.backends.triton import layernorm as tln
    from fusedops.backends.triton.kernels import layernorm_bwd_split as k_layernorm_bwd_split
    from fusedops.backends.triton import layernorm_bwd as tlnb

    fn = k_layernorm_bwd_split.ln_bwd_split
    names = fn.arg_names
    f32 = ("mean_ptr", "rstd_ptr", "part_ptr", "stats_ptr")
    sig = {a: ("*fp32" if a in f32 else "*i32" if a == "count_ptr" else "*bf16")
           if a.endswith("_ptr") else "i32" for a in names}
    out = {}
    for case in sys.argv[1:]:
        prefetch, cluster = case.split(",")
        consts = dict(BLOCK=2048, C=8, C_P2=8, HAS_W=True, NEED_DX=True, NEED_DW=True,
                      NEED_DB=True, PREFETCH=int(prefetch), PARKED=True, VEC=0, PAIRED=True,
                      CLUSTER=cluster == "1")
        case_sig = dict(sig, **{k: "constexpr" for k in consts})
        src = ASTSource(fn=fn, signature=case_sig, constexprs={(names.index(k),): v
                                                               for k, v in consts.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "maxnreg": 128})
        ptx = k.asm["ptx"]
        out[case] = {t: ptx.count(t) for t in (
            "barrier.cluster.arrive.release", "barrier.cluster.wait.acquire",
            "mapa.shared::cluster", "st.shared::cluster", "%dynamic_smem_size", "atom.",
            "red.global")} | {"cubin": len(k.asm["cubin"]), "shared": k.metadata.shared}
    print(json.dumps(out))
""")
PREFETCHES = [1, 2]


@pytest.fixture(scope="module")
def sm90_builds():
    """``build(prefetch)``: the split backward compiled for sm_90 (PTX through ptxas, no GPU
    needed), cluster and cooperative variants, in one subprocess per PREFETCH (the interpreter
    replaces ``triton.jit`` in this one); cached for the module."""
    import json

    cache: dict[int, dict] = {}

    def build(prefetch: int) -> dict:
        if prefetch not in cache:
            env = dict(os.environ, TRITON_INTERPRET="0")
            out = subprocess.run([sys.executable, "-c", _COMPILE, f"{prefetch},1",
                                  f"{prefetch},0"], capture_output=True, text=True, env=env,
                                 timeout=600)
            assert out.returncode == 0, out.stderr[-2000:]
            got = json.loads(out.stdout.strip().splitlines()[-1])
            cache[prefetch] = {"cluster": got[f"{prefetch},1"], "coop": got[f"{prefetch},0"]}
        return cache[prefetch]

    return build


@EXHAUSTIVE  # (a compile in a fresh interpreter per PREFETCH: seconds)
@pytest.mark.parametrize("prefetch", PREFETCHES)
def test_cluster_kernel_compiles_for_sm90(sm90_builds, prefetch):
    """ptxas accepts the inline PTX; the cluster variant meets at the barrier at its start and
    once per row (one publish), stores into the peers' shared memory, and has no atomics (the
    cooperative variant's counters)."""
    got, coop = sm90_builds(prefetch)["cluster"], sm90_builds(prefetch)["coop"]
    assert got["cubin"] > 0
    assert got["barrier.cluster.arrive.release"] == got["barrier.cluster.wait.acquire"] == 2
    assert got["mapa.shared::cluster"] == got["st.shared::cluster"] == 1
    assert got["%dynamic_smem_size"] == 2  # the slots sit at the end of the launch's bytes
    assert got["atom."] == got["red.global"] == 0
    assert coop["barrier.cluster.arrive.release"] == 0
    assert coop["atom."] + coop["red.global"] > 0


@pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need the Triton interpreter")
@pytest.mark.parametrize("parked", [True, False], ids=["low_memory", "fast"])
@pytest.mark.parametrize("path", ["cluster", "cluster-fails", "cooperative"])
def test_split_backward_buffers(monkeypatch, parked, path):
    """_split_backward's host side with recording launchers (the kernels need a GPU): the
    cluster launch gets ``mean`` for the row counters it never reads (no zeroing launch; its
    launch key is the grid estimate's); a cooperative launch, first or after a failed cluster
    launch on the same pieces and grid, gets zeroed int32 counters."""
    calls = []

    class Cluster(_clusters.ClusterLauncher):
        def __init__(self):
            pass

        def programs(self, items, chunks, runtime, consts, num_warps, device, vec=0):
            return 2 * chunks

        def __call__(self, items, chunks, runtime, consts, num_warps, device, progs=None,
                     vec=0):
            calls.append(("cluster", runtime[8], consts, progs))
            return 0 if path == "cluster-fails" else progs

    class Coop:
        def programs(self, items, chunks, runtime, consts, num_warps, device, vec=0):
            return 4 * chunks

        def __call__(self, items, chunks, runtime, consts, num_warps, device, progs=None,
                     vec=0):
            calls.append(("coop", runtime[8].clone(), consts, progs))
            return progs

    monkeypatch.setattr(tlnb, "_bwd_cluster_launcher", lambda cap: Cluster())
    monkeypatch.setattr(tlnb, "_bwd_split_launcher", lambda cap: Coop())
    # the parked rows' second launch waits on other programs (the interpreter runs them in turn)
    monkeypatch.setattr(tlnb, "_launch_dx_published", lambda grid, args, warps: calls.append(
        ("published", args[7].clone(), args[6], grid)))
    m, n = 64, 256
    x, dy, w = torch.randn(m, n), torch.randn(m, n), torch.randn(n)
    mean, rstd = x.mean(1), torch.rsqrt(x.var(1, unbiased=False) + 1e-5)
    pieces, piece = rt_split.split_pieces(n, 64, 0)
    split = ln_rules.SplitBackward(64, 4, 1, None, path != "cooperative", 0, pieces, piece,
                                   True, ln_rules.max_partial_rows(m, n, 4))
    cfg = ln_rules.LayerNormBackward("split", split=split,
                                     columns_direct=ln_rules.column_splits(m, n, 4, 1))
    out = tlnb._split_backward(dy, x, w, True, mean, rstd, torch.empty_like(x), True, True, None,
                              cfg, parked)
    assert out is not None
    if parked:  # the parked rows: their own zeroed counter, the split launch's statistics
        done, stats, grid = calls.pop()[1:]
        assert calls[-1][0] in ("cluster", "coop") and grid[0] > 0
        assert done.dtype == torch.int32 and done.shape == (1,) and not done.any()
        assert stats.dtype == torch.float32
    kinds = [c[0] for c in calls]
    assert kinds == {"cluster": ["cluster"], "cluster-fails": ["cluster", "coop"],
                     "cooperative": ["coop"]}[path]
    if path != "cooperative":
        assert calls[0][1] is mean and calls[0][2][-1] is True and calls[0][3] == 8
    if kinds[-1] == "coop":
        count, consts, progs = calls[-1][1:]
        assert count.dtype == torch.int32 and count.shape == (m,) and not count.any()
        assert consts[-1] is False
        assert progs == (16 if path == "cooperative" else 8)  # after a failure: the same grid


# ------------------------------------------------------------------------------------- GPU
def _case(m, n, dtype, weight=True, seed=0):
    g = torch.Generator().manual_seed(seed + m + n)
    x = (torch.randn(m, n, generator=g) * 2 + 5).to(dtype).cuda()  # offset: no cancellation
    dy = torch.randn(m, n, generator=g).to(dtype).cuda()
    w = (1 + 0.5 * torch.randn(n, generator=g)).to(dtype).cuda() if weight else None
    xf = x.double()
    mean = xf.mean(1).float()
    rstd = torch.rsqrt(xf.var(1, unbiased=False) + 1e-5).float()
    return dy, x, w, mean, rstd


def _reference(dy, x, w):
    n = x.shape[1]
    r = [x.double().requires_grad_()] + ([w.double().requires_grad_()] if w is not None else [])
    y = torch.nn.functional.layer_norm(r[0], (n,), r[1] if w is not None else None, None, 1e-5)
    grads = torch.autograd.grad(y, r, dy.double())
    return grads[0], grads[1] if w is not None else None, dy.double().sum(0)


# A split-row launch on a cooperative grid (SplitLauncher launches through a Launcher), and one
# in clusters, as _launchers lists them.
COOP = ("Launcher", "ln_bwd_split")
CLUSTER = ("ClusterLauncher", "ln_bwd_split")


def _launchers(record) -> set:
    return {(type(launcher).__name__, launcher.kernel.__name__) for launcher, *_ in record}


def _backward(dy, x, w, mean, rstd, need=(True, True, True)):
    # (no grad_dtypes: no replay plans, so every call runs the launch rules)
    with rt_recording.record_launches() as record:
        out = tlnb.layernorm_backward(dy, x, w, mean, rstd, *need)
    return out, _launchers(record)


def _check(out, dy, x, w, dtype, need=(True, True, True)):
    want = _reference(dy, x, w)
    m = x.shape[0]
    if need[0]:
        assert_close_to_ref(out[0], want[0], dtype, scale=4)
    for got, exp, needed in zip(out[1:], want[1:], need[1:], strict=True):
        if needed and exp is not None:
            assert_row_sum_close(got, exp, m, scale=4)


# (rows, N, piece): 2, 4, 8 and 16 pieces; fewer rows than clusters, and more (rows loop)
CLUSTER_CASES = [(5, 16384, 8192), (300, 16384, 4096), (40, 32768, 4096), (200, 32768, 2048),
                 (7, 65536, 4096), (64, 65536, 8192)]


@gpu
@pytest.mark.parametrize("m,n,piece", CLUSTER_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
def test_gpu_cluster_backward_matches_float64(monkeypatch, m, n, piece, dtype, prefetch,
                                              launch_rules):
    """Forced configs: every cluster size and load placement, against float64, dx bit for bit
    as the cooperative kernel with the same pieces writes it (the same per-piece sums, combined
    in the same order)."""
    warps = max(4, min(16, piece // 512))
    cluster_cfg, coop_cfg = (piece, warps, prefetch, None, True), (piece, warps, prefetch)
    inputs = _case(m, n, dtype)
    got = {}
    for mode in ("fast", "low_memory"):  # low_memory: few rows leave no room to park: the
        with fusedops.layernorm_backward_mode(mode):  # dx-pieces kernel instead
            launch_rules("layernorm", split_config=forced_split_config(None, cluster_cfg))
            got[mode], used = _backward(*inputs)
            assert mode == "low_memory" or (CLUSTER in used and COOP not in used)
            _check(got[mode], *inputs[:3], dtype)
            launch_rules("layernorm", split_config=forced_split_config(None, coop_cfg))
            coop, used = _backward(*inputs)
            assert CLUSTER not in used and (mode == "low_memory" or COOP in used)
            assert torch.equal(got[mode][0], coop[0])
    names = (0, 1, 2) if m >= 8 else (0,)  # see test_layernorm_backward_memory
    assert all(torch.equal(got["fast"][i], got["low_memory"][i]) for i in names)


@gpu
@pytest.mark.parametrize("m,n", [(300, 16384), (33, 32768), (100, 65536)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gpu_cluster_defaults(m, n, dtype):
    """The shipped rules take clusters on Hopper; no weight; dx alone; dweight/dbias alone
    (no exchange: the cooperative kernel)."""
    hopper = torch.cuda.get_device_capability()[0] >= 9
    with fusedops.layernorm_backward_mode("fast"):  # split launches at any row count
        _defaults(m, n, dtype, hopper)


def _defaults(m, n, dtype, hopper):
    for weight in (True, False):
        inputs = _case(m, n, dtype, weight, seed=1)
        out, used = _backward(*inputs)
        assert (CLUSTER in used) == hopper and (COOP in used) != hopper
        _check(out, *inputs[:3], dtype)
    inputs = _case(m, n, dtype, seed=2)
    for need in ((True, False, False), (False, True, True)):
        out, used = _backward(*inputs, need=need)
        assert (CLUSTER in used) == (hopper and need[0])
        _check(out, *inputs[:3], dtype, need)


@gpu
def test_gpu_cluster_launch_failure_falls_back(monkeypatch, launch_rules):
    """A cluster launch that fails turns clusters off (one warning) and the call runs the same
    pieces on a cooperative grid."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("clusters need Hopper")
    launch_rules(CLUSTERS=True)
    inputs = _case(64, 16384, torch.bfloat16, seed=3)

    def refuse(self, *args):
        raise RuntimeError("refused")

    monkeypatch.setattr(_clusters.ClusterLauncher, "_prepare", refuse)
    with fusedops.layernorm_backward_mode("fast"):
        with pytest.warns(RuntimeWarning, match="cluster split-row kernels disabled"):
            out, used = _backward(*inputs)
        assert CLUSTER not in used and COOP in used
        _check(out, *inputs[:3], torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once
            out, used = _backward(*inputs)
        assert COOP in used


@gpu
def test_gpu_max_active_clusters():
    """The driver's count for compiled cluster kernels of 2 and 16 pieces of the same size:
    no more CTAs than the SMs hold, and no more for the larger clusters."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("clusters need Hopper")
    ctas = {}
    for n in (16384, 131072):
        dy, x, w, mean, rstd = _case(16, n, torch.bfloat16)
        C = n // 8192
        launcher = _clusters.ClusterLauncher(k_layernorm_bwd_split.ln_bwd_split, maxnreg=128)
        runtime = (dy, x, w, mean, rstd, x, mean, mean, mean, n, 8192, n, n, n, 16, 16 * C)
        consts = (8192, C, C, True, True, True, True, 1, False, 0, True, True)
        ctas[C] = launcher.programs(1 << 20, C, runtime, consts, 16, x.device)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert 0 < ctas[16] <= ctas[2] <= sms  # 16 warps of 128 registers: one CTA per SM
