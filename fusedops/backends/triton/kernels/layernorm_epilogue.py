"""``@triton.jit`` helpers of the LayerNorm epilogue kernels (activation, dropout, Philox
slices, partial sums); the kernels are in ``layernorm_epilogue_fwd.py`` / ``_bwd.py``."""

from __future__ import annotations

import triton
import triton.language as tl

from fusedops.backends.triton.kernels.layernorm_bwd import over_rows
from fusedops.backends.triton.kernels.philox import element_keep, philox4x32, uint32_key

# The dropout arguments (key words, threshold) change from call to call: they are passed as
# int32 bit patterns and never specialised on, so a new seed never compiles a new kernel.
RANDOM_ARGS = ["k0", "k1", "thresh"]


@triton.jit
def activate(y, ACT: tl.constexpr):
    # ACT: 0 none, 1 ReLU (NaN stays NaN, as torch.relu), 2 exact (erf) GELU.
    if ACT == 1:
        y = tl.where(y < 0.0, 0.0, y)
    elif ACT == 2:
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    return y


@triton.jit
def activation_grad(v, ACT: tl.constexpr):
    # d activation / dv (ACT 1 or 2), as fusedops.backends.reference.activation_grad.
    if ACT == 1:
        d = tl.where(v > 0.0, 1.0, 0.0)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(v * 0.7071067811865476))
        d = cdf + v * (tl.exp(-0.5 * v * v) * 0.3989422804014327)
    return d


@triton.jit
def row_sum(v):
    # [Q, R, G, NI] -> [R]: the slices first (held by one thread: plain adds), then the columns.
    return tl.sum(tl.sum(tl.sum(v, axis=0), axis=2), axis=1)


@triton.jit
def tile_cols(Q: tl.constexpr, G: tl.constexpr, NI: tl.constexpr):
    q = tl.arange(0, Q)[:, None, None, None]
    g = tl.arange(0, G)[None, None, :, None]
    i = tl.arange(0, NI)[None, None, None, :]
    return q, g, i


@triton.jit
def dropout(v, keep, scale):
    # v * scale where kept, v * 0 where dropped (NaN and inf stay NaN there, as torch's
    # x * mask * scale). A select on the mask rather than a product with a factor tensor: where
    # the mask is computed in another layout than v, the compiler converts the mask.
    return tl.where(keep, v * scale, v * 0.0)


@triton.jit
def round_sum(x, r, dtype, RNE: tl.constexpr):
    # x + r in float32, rounded once to x's dtype as torch's add. RNE: round bfloat16 to nearest
    # even by hand, for Triton's interpreter, whose float32 -> bfloat16 conversion truncates
    # (compiled kernels convert correctly and skip this).
    v = x.to(tl.float32) + r.to(tl.float32)
    if RNE:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def load_sum(x_row, r_row, s_row, c, valid, HAS_RES: tl.constexpr, STORE: tl.constexpr,
              RNE: tl.constexpr = False):
    # One chunk of s = x (+ residual, rounded to x's dtype) in float32; STORE writes s.
    x = tl.load(x_row + c, mask=valid, other=0.0, eviction_policy="evict_last")
    if HAS_RES:
        r = tl.load(r_row + c, mask=valid, other=0.0, eviction_policy="evict_first")
        s_lp = round_sum(x, r, x_row.dtype.element_ty, RNE)
        if STORE:
            tl.store(s_row + c, s_lp, mask=valid)
        s = s_lp.to(tl.float32)
    else:
        s = x.to(tl.float32)
    return s


@triton.jit
def random_keys(k0, k1, thresh, DROPOUT: tl.constexpr):
    # The Philox key words and keep threshold as uint32 scalars (zeros without dropout).
    if DROPOUT:
        return uint32_key(k0), uint32_key(k1), uint32_key(thresh)
    else:
        return 0, 0, 0


@triton.jit
def grad_at_norm(dout, xhat, w, b, rows, g, q, i, key0, key1, thr, scale,
                  Q: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                  DROPOUT: tl.constexpr, ACT: tl.constexpr):
    # The gradient reaching the LayerNorm's output y: dout * act'(dropout(y)) * keep / (1 - p),
    # with y = xhat * w + b recomputed (only an activation needs it).
    if DROPOUT:
        keep = element_keep(rows, g, q, i, key0, key1, thr, Q)
    gy = dout
    if ACT != 0:
        v = xhat
        if HAS_W:
            v = v * w
        if HAS_B:
            v = v + b
        if DROPOUT:
            v = dropout(v, keep, scale)
        gy = gy * activation_grad(v, ACT)
    if DROPOUT:
        gy = dropout(gy, keep, scale)
    return gy


@triton.jit
def slice_cols(j, q: tl.constexpr, Q: tl.constexpr):
    # Column of lane j in slice q of a row block cut into Q slices along fusedops._philox's
    # layout: slice q holds the columns that take Philox word q (col // 256 % 4 == q), so lane
    # j of every slice is served by the one call with counter j (with Q == 1, word 0 serves a
    # block of at most 256 columns, and without dropout the slice is the plain block).
    if Q == 1:
        return j
    else:
        return (j // 256) * 1024 + q * 256 + (j % 256)


@triton.jit
def philox_words(rows, j, k0, k1):
    # The four words of the calls with counters (j, row lo, row hi, 0): [ROWS, L] each.
    r64 = rows.to(tl.int64)
    c0 = j.to(tl.uint32)[None, :]
    c1 = (r64 & 0xFFFFFFFF).to(tl.uint32)[:, None]
    c2 = (r64 >> 32).to(tl.uint32)[:, None]
    zero = tl.zeros_like(c0 + c1)
    return philox4x32(c0 + zero, c1 + zero, c2 + zero, zero, uint32_key(k0), uint32_key(k1))


@triton.jit
def param_slice(ptr, cols, N, HAS: tl.constexpr):
    if HAS:
        return tl.load(ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    else:
        return 0.0


@triton.jit
def accumulate(acc, v, ACC_1D: tl.constexpr):
    if ACC_1D:
        return acc + tl.sum(v, axis=0)
    else:
        return acc + v


@triton.jit
def acc_zeros(ROWS: tl.constexpr, L: tl.constexpr, ACC_1D: tl.constexpr):
    if ACC_1D:
        return tl.zeros([L], tl.float32)
    else:
        return tl.zeros([ROWS, L], tl.float32)


@triton.jit
def store_partial(ptr, acc, cols, N, ACC_1D: tl.constexpr):
    tl.store(ptr + cols, over_rows(acc, ACC_1D), mask=cols < N)
