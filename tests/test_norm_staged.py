"""The staged RMSNorm and LayerNorm forwards (``rms_fwd_staged`` in
``kernels/rmsnorm_staged.py``, ``ln_fwd_staged`` in ``kernels/layernorm_pieces.py``): a row's
pieces land in the shared memory of one thread-block cluster by ``cp.async``.

CPU: the rules (``STAGED_FWD`` of each op: asked first, whole pieces of a cluster size, the
rules without it as the fallback) and the kernels compiled for sm_90 (PTX through ptxas, no
GPU needed): x is read only by the asynchronous copies, the piece twice from shared memory,
the parameters by 16-byte vectors, y stored by 16-byte vectors, one exchange. GPU: forced
rules of every dtype, parameter dtype and piece count against float64, statistics included,
and the calls the kernels cannot take.
"""

from __future__ import annotations

import pytest
import torch
from _reliability import gpu
from _sm90 import compile_counts
from conftest import EXHAUSTIVE, assert_close_to_ref

from fusedops.backends.triton.configs import layernorm as ln_rules
from fusedops.backends.triton.configs import rmsnorm as rms_rules
from fusedops.backends.triton.runtime.facts import DeviceFacts

HOPPER = DeviceFacts(True, 132, "NVIDIA H200", True, True)
EPS = 1e-5


def _rms(n, elt, hopper=HOPPER, vec=0, aligned=True, staged=True):
    return rms_rules.forward_config(n, elt, vec, aligned, hopper, True, staged)


def _ln(n, elt, hopper=HOPPER, vec=0, aligned=True, staged=True):
    return ln_rules.forward_config(n, elt, vec, 64, True, aligned, hopper, staged)


def _staged(op: str, cfg) -> tuple | None:
    """(piece, pieces, warps) of a staged config, None for another kernel."""
    if op == "rmsnorm":
        return (cfg.block, None, cfg.warps) if cfg.kernel == "staged" else None
    return (cfg.piece, cfg.pieces, cfg.warps) if cfg.variant == "staged" else None


@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_staged_forward_rules(op, launch_rules):
    """STAGED_FWD: aligned rows in a rule's range that are C whole pieces, C a cluster size,
    take the staged forward on a GPU that runs clusters, ahead of every other rule, with the
    rules without it as the fallback (the streamed pieces where those have a rule); unaligned
    rows, rows of partial pieces or other piece counts, rows outside the range and GPUs
    without clusters do not."""
    fwd = _rms if op == "rmsnorm" else _ln
    no_clusters = HOPPER._replace(clusters=False)
    for elt, rules in (rms_rules if op == "rmsnorm" else ln_rules).STAGED_FWD.items():  # shipped
        for shortest, longest, (piece, warps) in rules:
            for n in (shortest, longest):
                cfg = fwd(n, elt)
                assert _staged(op, cfg) in ((piece, None, warps), (piece, n // piece, warps))
                assert cfg.fallback == fwd(n, elt, staged=False)
                assert _staged(op, fwd(n, elt, no_clusters)) is None
    launch_rules(op, STAGED_FWD={2: ((32768, 262144, (16384, 16)),),
                                 4: ((65536, 65536, (8192, 4)),)})
    for n, c in ((32768, 2), (65536, 4), (131072, 8), (262144, 16)):
        cfg = fwd(n, 2)
        assert _staged(op, cfg) in ((16384, None, 16), (16384, c, 16)), n
        assert cfg.fallback == fwd(n, 2, staged=False) and _staged(op, cfg.fallback) is None
        assert _staged(op, fwd(n, 2, vec=8)) is None  # unaligned rows
        assert _staged(op, fwd(n, 2, aligned=False)) is None  # row stride off 16 bytes
        assert _staged(op, fwd(n, 2, no_clusters)) is None
    if op == "layernorm":
        cfg = fwd(131072, 2)
        assert (cfg.grid, cfg.stats) == (64 * 8, True)
        assert ln_rules.forward_config(131072, 2, 0, 64, False, True, HOPPER).stats is False
    assert _staged(op, fwd(65536, 4)) in ((8192, None, 4), (8192, 8, 4))
    assert _staged(op, fwd(131072, 4)) is None  # outside the float32 range
    assert _staged(op, fwd(98304, 2)) is None  # 6 pieces: no cluster size
    assert _staged(op, fwd(16384 * 3 + 8, 2)) is None  # 4 pieces, the last partial
    assert _staged(op, fwd(16384, 2)) is None  # below the range
    launch_rules(op, STAGED_FWD={})
    assert _staged(op, fwd(131072, 2)) is None


def test_stageable_calls():
    """The staged kernels take 16-byte aligned x, y and parameters, y of x's dtype, and
    parameters of one dtype, x's or (16-bit x) float32; any other call runs the other rules."""
    from fusedops.backends.triton.runtime.clusters import stageable

    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    x = torch.empty(2, 64, dtype=bf)
    y = torch.empty_like(x)
    w, wf = torch.empty(64, dtype=bf), torch.empty(64, dtype=f32)
    assert stageable(x, y) and stageable(x, y, w) and stageable(x, y, None, w)
    assert stageable(x, y, wf, wf) and stageable(x, y, w, w)
    assert stageable(x.float(), y.float(), wf)
    assert not stageable(x, y.float(), w)  # another output dtype
    assert not stageable(x, y, w, wf)  # parameters of two dtypes
    assert not stageable(x, y, w.to(f16))  # 16-bit parameters of another dtype
    assert not stageable(x.float(), y.float(), w)  # float32 x, 16-bit parameters
    assert not stageable(x, y, wf.double())
    base = torch.empty(200, dtype=bf)
    assert not stageable(base[1:129].view(2, 64), y)  # x off a 16-byte boundary
    assert not stageable(x, y, base[1:65])  # a parameter off one
    assert stageable(base[8:136].view(2, 64), y, base[8:72])


_COMPILE = """
    from fusedops.backends.triton.kernels.layernorm_pieces import ln_fwd_staged
    from fusedops.backends.triton.kernels.rmsnorm_staged import rms_fwd_staged

    out = {}
    for name, fn in (("rms", rms_fwd_staged), ("ln", ln_fwd_staged)):
        for dt, pdt, L in (("bf16", "bf16", 16384), ("fp16", "fp32", 16384),
                           ("fp32", "fp32", 8192)):
            consts = dict(L=L, C=4, C_P2=4, VB=128, HAS_W=True, HAS_B=True, STATS=True)
            asm = compile_sm90(fn, consts, dt, types={"w_ptr": f"*{pdt}", "b_ptr": f"*{pdt}"})
            c = {t: asm["ptx"].count(t) for t in (
                "cp.async.cg.shared.global", "cp.async.commit_group", "cp.async.wait_group 0",
                "ld.shared.v4.b32", "ld.global.nc.v4.b32", "st.global.v4.b32", "ld.global",
                "st.global", "barrier.cluster.arrive.relaxed", "barrier.cluster.arrive.release",
                "barrier.cluster.wait.acquire", "st.shared::cluster", "atom.")}
            c["cubin"] = len(asm["cubin"])
            out[f"{name} {dt} {pdt}"] = c
    print(json.dumps(out))
"""



@EXHAUSTIVE  # (compiles in a fresh interpreter: seconds)
def test_staged_norm_kernels_compile_for_sm90():
    """ptxas accepts both kernels for 16-bit x with parameters in x's dtype or float32 and for
    float32 x; a CTA's 16-byte vectors (a 32 KB piece on 128 threads: 16 each) are copied
    once, read twice from shared memory (LayerNorm: once more, one vector for the thread's
    shift) and stored once; each parameter is read by one or two 16-byte vectors a step;
    the only other global accesses are the statistics' stores (and LayerNorm's x0); one
    exchange, no atomics."""
    got = compile_counts(_COMPILE)
    for case, counts in got.items():
        op, dt, pdt = case.split()
        steps = 16  # 32 KB / 16 bytes / 128 threads
        params = (2 if op == "ln" else 1) * (2 if pdt != dt else 1)
        stats = 2 if op == "ln" else 1
        assert counts["cubin"] > 0, case
        assert counts["cp.async.cg.shared.global"] == steps, case
        assert counts["cp.async.commit_group"] == counts["cp.async.wait_group 0"] == 1, case
        assert counts["ld.shared.v4.b32"] == 2 * steps + (op == "ln"), case
        assert counts["ld.global.nc.v4.b32"] == params * steps, case
        assert counts["st.global.v4.b32"] == steps, case
        assert counts["st.global"] == steps + stats, case
        assert counts["ld.global"] == params * steps + (op == "ln"), case
        assert counts["atom."] == 0, case
        assert counts["barrier.cluster.arrive.relaxed"] == 1, case
        assert counts["barrier.cluster.arrive.release"] == 1, case
        assert counts["barrier.cluster.wait.acquire"] == 2, case
        assert counts["st.shared::cluster"] == 1, case


# ------------------------------------------------------------------------------------ GPU

def _rows(m: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """Random rows with special ones: far from zero (1e4 + a small spread: LayerNorm's mean),
    all zeros, and a lone large value in the last piece."""
    g = torch.Generator().manual_seed(n + m)
    x = torch.randn(m, n, generator=g) * 2
    if m > 3:
        x[1] = (1e4 if dtype == torch.float32 and op == "layernorm" else 8.0) + x[1] * 0.01
        x[2] = 0.0
        x[3, -3] = 300.0
    return x.to(dtype).cuda()


def _params(n: int, dtype: torch.dtype | None, bias: bool):
    if dtype is None:
        return None, None
    g = torch.Generator().manual_seed(n)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).cuda()
    b = (0.1 * torch.randn(n, generator=g)).to(dtype).cuda() if bias else None
    return w, b


def _reference(op: str, x, w, b):
    """(y, mean or None, rstd) in float64."""
    x64 = x.double()
    n = x.shape[-1]
    if op == "rmsnorm":
        rstd = torch.rsqrt(x64.square().mean(-1) + EPS)
        y = x64 * rstd[:, None]
        mean = None
    else:
        mean = x64.mean(-1)
        rstd = torch.rsqrt(x64.var(-1, unbiased=False) + EPS)
        y = (x64 - mean[:, None]) * rstd[:, None]
    if w is not None:
        y = y * w.double()
    if b is not None:
        y = y + b.double()
    assert y.shape[-1] == n
    return y, mean, rstd


def _run(op: str, x, w, b, out_dtype):
    """The backend's forward with statistics, with its launches recorded: (y, mean, rstd,
    whether the staged kernel ran)."""
    from fusedops.backends.triton import layernorm as tln
    from fusedops.backends.triton import rmsnorm as trms
    from fusedops.backends.triton.runtime.recording import record_launches

    with record_launches() as record:
        if op == "rmsnorm":
            (y, rstd), mean = trms.rmsnorm_forward(x, w, EPS, out_dtype), None
        else:
            y, mean, rstd = tln.layernorm_forward(x, w, b, EPS, out_dtype)
    launcher = (trms if op == "rmsnorm" else tln)._launch_fwd_staged
    staged = [(grid, args) for ln, grid, args, _ in record if ln is launcher]
    return y, mean, rstd, staged


@gpu
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize(("dtype", "pdtype", "m", "n", "piece", "warps"), [
    (torch.bfloat16, torch.bfloat16, 40, 32768, 16384, 8),  # 2 pieces
    (torch.float16, torch.float32, 7, 65536, 16384, 8),  # 4, float32 parameters
    (torch.bfloat16, None, 33, 262144, 32768, 8),  # 8, no parameters
    (torch.bfloat16, torch.float32, 5, 65536, 4096, 4),  # 16, 4 warps
    (torch.float16, torch.float16, 300, 16384, 8192, 16),
    (torch.float32, torch.float32, 64, 65536, 8192, 4),
    (torch.float32, None, 9, 262144, 16384, 4)], ids=str)  # 16 pieces of 64 KB
def test_staged_forward(op, dtype, pdtype, m, n, piece, warps, launch_rules):
    """Forced STAGED_FWD rules (2-16 pieces of 4K-32K elements, 4-16 warps), with special
    rows: y, mean and rstd against float64, and the forward launches the staged kernel on one
    cluster per row on Hopper (elsewhere the rules without it)."""
    hopper = torch.cuda.get_device_capability()[0] >= 9
    elt = torch.empty((), dtype=dtype).element_size()
    launch_rules(op, STAGED_FWD={elt: ((n, n, (piece, warps)),)})
    x = _rows(m, n, dtype, op)
    w, b = _params(n, pdtype, op == "layernorm")
    y, mean, rstd, staged = _run(op, x, w, b, dtype)
    want, want_mean, want_rstd = _reference(op, x, w, b)
    assert_close_to_ref(y, want, dtype)
    torch.testing.assert_close(rstd.double(), want_rstd, rtol=1e-5, atol=0)
    if mean is not None:
        torch.testing.assert_close(mean.double(), want_mean, rtol=1e-6, atol=1e-6)
    assert bool(staged) == hopper, staged
    if hopper:
        ((grid, args),) = staged
        c = n // piece
        at = 8 if op == "rmsnorm" else 10  # num_progs, then the constexprs
        assert grid == (m,) and args[at - 1:at + 4] == (m * c, piece, c, c, 32 * warps)


@gpu
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_staged_forward_other_calls(op, launch_rules):
    """Calls the staged kernels cannot take run the rules without them, right: x starting off
    a 16-byte boundary, another output dtype, float32 x with 16-bit parameters, a weight and
    bias of different dtypes; inference calls (no statistics) and a bias alone take it."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("clusters need Hopper")
    n = 65536
    launch_rules(op, STAGED_FWD={2: ((n, n, (16384, 8)),), 4: ((n, n, (8192, 4)),)})
    bf, f32 = torch.bfloat16, torch.float32
    base = (torch.randn(2 * n + 8) * 3).to(bf).cuda()
    x = base[:2 * n].view(2, n)
    w, b = _params(n, bf, True)
    cases = [  # x, weight, bias, out dtype, staged
        (base[1:n + 1].view(1, n), w, b, bf, False),
        (x, w, b, f32, False),
        (x.float(), w, b, f32, False),
        (x, w, b, bf, True),
        (x, w.float(), b.float(), bf, True),
        (x, None, None, bf, True),
    ]
    if op == "layernorm":
        cases += [(x, w, b.float(), bf, False), (x, None, b, bf, True)]
    for x_, w_, b_, out, expect in cases:
        y, mean, rstd, staged = _run(op, x_, w_, b_ if op == "layernorm" else None, out)
        want, _, want_rstd = _reference(op, x_, w_, b_ if op == "layernorm" else None)
        assert y.dtype == out
        assert_close_to_ref(y, want, out)
        torch.testing.assert_close(rstd.double(), want_rstd, rtol=1e-5, atol=0)
        assert bool(staged) == expect, (x_.dtype, w_ is None, out)
    from fusedops.backends.triton import layernorm as tln
    from fusedops.backends.triton import rmsnorm as trms
    from fusedops.backends.triton.runtime.recording import record_launches

    with record_launches() as record:
        y = (trms.rmsnorm_forward_y(x, w, EPS, bf) if op == "rmsnorm"
             else tln.layernorm_forward_y(x, w, b, EPS, bf))
    assert any(ln is (trms if op == "rmsnorm" else tln)._launch_fwd_staged
               for ln, *_ in record)
    assert_close_to_ref(y, _reference(op, x, w, b if op == "layernorm" else None)[0], bf)
