"""The staged softmax forward (``softmax_fwd_staged`` in ``kernels/softmax.py``, helpers in
``kernels/staging.py``): a row's pieces land in the shared memory of one thread-block cluster
by ``cp.async``.

CPU: the words' unpacking and packing (plain Triton, interpreted) against torch's own bit
views and roundings, and the kernel compiled for sm_90 (PTX through ptxas, no GPU needed): x
is read only by the asynchronous copies, the piece three times from shared memory, and the
cluster meets at its start barrier (split around the copies) and once for the exchange. The
GPU cases against float64: ``test_softmax_cluster_forward*`` in test_split_rows.py.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from _sm90 import compile_counts
from conftest import EXHAUSTIVE, INTERPRETING

from fusedops.backends.triton.kernels.staging import pack_word, word_hi, word_lo


@triton.jit
def _words(w_ptr, lo_ptr, hi_ptr, out_ptr, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    w = tl.load(w_ptr + offs)
    lo = word_lo(w, KIND)
    hi = word_hi(w, KIND) if KIND != 2 else lo
    tl.store(lo_ptr + offs, lo)
    tl.store(hi_ptr + offs, hi)
    tl.store(out_ptr + offs, pack_word(lo * 3.0, hi * 3.0, KIND))


@pytest.mark.skipif(not INTERPRETING, reason="CPU tensors need the Triton interpreter")
@pytest.mark.parametrize("dtype,kind", [(torch.bfloat16, 0), (torch.float16, 1),
                                        (torch.float32, 2)], ids=str)
def test_words_unpack_and_pack(dtype, kind):
    """A word's elements as float32 (the first in its low half), and float32 values rounded
    back into words as ``.to(dtype)`` rounds them; specials (±0, ±inf, NaN, subnormals,
    float16's largest finite value) too."""
    per = 4 // torch.empty((), dtype=dtype).element_size()
    vals = torch.cat([torch.randn(64 * per - 8) * 50,
                      torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"),
                                    1e-6, -3e-7, 65504.0])]).to(dtype)
    words = vals.view(torch.int32)
    lo, hi = torch.empty(64), torch.empty(64)
    out = torch.empty(64, dtype=torch.int32)
    _words[(1,)](words, lo, hi, out, kind, 64)
    want = vals.float().view(64, per)
    torch.testing.assert_close(lo, want[:, 0], equal_nan=True, rtol=0, atol=0)
    if per == 2:
        torch.testing.assert_close(hi, want[:, 1], equal_nan=True, rtol=0, atol=0)
    tripled = (want * 3.0).to(dtype).reshape(-1)
    # The interpreter truncates float32 to bfloat16 (the GPU rounds to nearest even, as .to
    # does): one bfloat16 ulp apart at most there.
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(out.view(dtype), tripled, equal_nan=True, rtol=ulp, atol=0)


_COMPILE = """
    from fusedops.backends.triton.kernels.softmax import softmax_fwd_staged as fn

    out = {}
    for dt, L in (("bf16", 16384), ("fp32", 8192)):
        asm = compile_sm90(fn, dict(L=L, C=4, C_P2=4, VB=128), dt)
        out[dt] = {t: asm["ptx"].count(t) for t in (
            "cp.async.cg.shared.global", "cp.async.commit_group", "cp.async.wait_group 0",
            "ld.shared.v4.b32", "st.global.v4.b32", "ld.global", "st.global",
            "barrier.cluster.arrive.relaxed", "barrier.cluster.arrive.release",
            "barrier.cluster.wait.acquire", "st.shared::cluster", "atom.")}
        out[dt]["cubin"] = len(asm["cubin"])
    print(json.dumps(out))
"""



@EXHAUSTIVE  # (a compile in a fresh interpreter: seconds)
def test_staged_kernel_compiles_for_sm90():
    """ptxas accepts the kernel; a CTA's 16-byte vectors (a 32 KB piece on 128 threads: 16
    each) are copied once, read three times from shared memory and stored once, with no other
    global access and no atomics; one exchange."""
    got = compile_counts(_COMPILE)
    for dt, counts in got.items():
        steps = 16  # 32 KB / 16 bytes / 128 threads
        assert counts["cubin"] > 0, dt
        assert counts["cp.async.cg.shared.global"] == steps, dt
        assert counts["cp.async.commit_group"] == counts["cp.async.wait_group 0"] == 1, dt
        assert counts["ld.shared.v4.b32"] == 3 * steps, dt
        assert counts["st.global.v4.b32"] == counts["st.global"] == steps, dt
        assert counts["ld.global"] == 0 and counts["atom."] == 0, dt
        assert counts["barrier.cluster.arrive.relaxed"] == 1, dt
        assert counts["barrier.cluster.arrive.release"] == 1, dt
        assert counts["barrier.cluster.wait.acquire"] == 2, dt
        assert counts["st.shared::cluster"] == 1, dt
