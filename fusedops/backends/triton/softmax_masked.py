"""Triton kernels of the softmax of attention: ``softmax(x * scale + mask)`` over the last dim,
optionally causal, forward and backward, and their launch wrappers.

Contract (``fusedops.backends.reference.softmax_masked_forward`` / ``_backward`` are the oracle):

* forward: x (B, H, Q, N) contiguous; mask None or a (B, H, Q, N) view with any strides (0
  along broadcast dims) of dtype bool (True = keep) or float (added to the scaled scores);
  causal drops column j of query row q (the index along dim 2) when j > q (top-left aligned, Q
  may differ from N). A row with nothing left (all -inf) comes out as zeros, not NaN.
* backward: dx = scale · y · (dy - Σ dy·y) per row of the (M, N) views.

Bytes moved (the floor): forward reads x once and writes y once, plus the mask through its
strides (a broadcast mask, (B, 1, 1, N) or (1, 1, Q, N), is re-read from cache); backward reads
y and dy once and writes dx once (3·M·N·elt).

Kernel variants (the mask kind, none / bool / float, and causal are compile-time
specialisations; ``scale`` is a float32 runtime scalar, with log2(e) folded in for exp2 except
with a float mask, see ``_exp``):

* forward single-block (padded rows up to ``FWD_SINGLE_CAP`` and the single-block limit):
  ``ROWS`` whole rows per program in registers, one max and one sum, one read and one write;
  launch rules of the plain softmax forward (``row_config`` / ``grid_size``, kind
  ``softmax_fwd``): several short rows per program, one program per row tile.
* forward looped (longer rows): one program per row; pass 1 streams the row in ``CHUNK``
  pieces keeping a per-lane online (max, sum), pass 2 re-reads it (from L2) and writes y.
* backward single-block / looped: the plain softmax backward's structure and launch rules
  (kind ``softmax_bwd``), the scale applied in-kernel (one multiply per element).

Causal rows load x (and the mask) only up to the diagonal, rounded up to a 16-byte vector so
the loads stay vectorised (the columns past the diagonal inside that vector are dropped in
registers); the zeros past it are still written. The looped forward's first pass stops at the
diagonal. All math is float32; row and mask offsets are 64-bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedops import _replay
from fusedops.backends.triton.configs.common import grid_size, row_config, single_block_limit
from fusedops.backends.triton.runtime.caches import config_cache
from fusedops.backends.triton.runtime.device import cdiv
from fusedops.backends.triton.runtime.launcher import Launcher, hooks_registered
from fusedops.backends.triton.runtime.plans import SequencePlans, replay_runner, tensor_key
from fusedops.backends.triton.runtime.recording import mark_replayable, record_launches

LOG2E = tl.constexpr(1.4426950408889634)
_LOG2E = 1.4426950408889634

# Mask kinds (the MASK_KIND constexpr).
NO_MASK, BOOL_MASK, FLOAT_MASK = 0, 1, 2

# Largest padded row the forward keeps in registers (elements, by x's element size): a float
# mask tile is held next to the row until they are combined, so this stays below the plain
# softmax forward's 32K cap. Longer rows take the looped (online) kernel.
FWD_SINGLE_CAP = {2: 16384, 4: 16384}
# The looped forward: (chunk elements, warps) per iteration of its two passes.
FWD_LOOPED = (4096, 8)


@triton.jit
def _scores(x_row, m_row, cols, q, row_ok, N, sn, scale, VEC: tl.constexpr,
            MASK_KIND: tl.constexpr, MASK_COLS: tl.constexpr, CAUSAL: tl.constexpr,
            POLICY: tl.constexpr):
    """The scores z of columns ``cols``: x · scale (``scale`` holds log2(e)) without a mask or
    with a bool one, x · scale + mask with a float mask (natural units, see _exp); -inf where
    dropped (bool mask False, causal, past N). ``x_row`` / ``m_row`` point at the rows' first
    elements, ``q`` is their query index, ``row_ok`` whether they exist (nothing is loaded
    otherwise); shapes broadcast (a [ROWS, BLOCK] tile or one row's [CHUNK] piece). The mask's
    column stride ``sn``: MASK_COLS 1 a unit stride, 2 any other (64-bit column offsets)."""
    if CAUSAL:
        # Loads stop at the diagonal rounded up to a multiple of VEC (a bound whose divisibility
        # the compiler sees, so the masked loads stay 16-byte vectors); one compare per element
        # then drops everything past the diagonal and past N.
        ld = row_ok & (cols < N) & (cols < (q // VEC + 1) * VEC)
        keep = cols < tl.minimum(q + 1, N)
    else:
        ld = row_ok & (cols < N)
        keep = cols < N
    x = tl.load(x_row + cols, mask=ld, other=0.0, eviction_policy=POLICY).to(tl.float32)
    z = x * scale
    # The mask without an eviction hint: a broadcast one is re-read by many rows, a full one
    # streams like x (POLICY is the looped kernel's hint for x: kept for, then dropped after,
    # its second pass).
    if MASK_COLS == 1:
        m_ptrs = m_row + cols
    else:
        m_ptrs = m_row + cols.to(tl.int64) * sn
    if MASK_KIND == 1:
        mv = tl.load(m_ptrs, mask=ld, other=0)
        keep = keep & (mv != 0)
    elif MASK_KIND == 2:
        mv = tl.load(m_ptrs, mask=ld, other=0.0)
        z = z + mv.to(tl.float32)  # natural units (see _exp)
    return tl.where(keep, z, -float("inf"))


@triton.jit
def _exp(d, MASK_KIND: tl.constexpr):
    """exp of score differences ``d`` (<= 0) as _scores makes them: in log2 units (log2(e)
    folded into the scale) without a float mask; in natural units with one, converted after the
    subtraction. A float mask can hold finfo.min (Hugging Face's "drop"): times log2(e) it
    would overflow to -inf and turn a row of finite scores into an empty one, where torch gives
    the uniform distribution."""
    if MASK_KIND == 2:
        return tl.exp2(d * LOG2E)
    return tl.exp2(d)


@triton.jit
def _mask_row_offset(rows, Q, H, sb, sh, sq):
    """Offset (int64) of the mask row of flattened rows ``rows`` (row r: q = r % Q,
    h = (r // Q) % H, b = r // (Q·H))."""
    q = rows % Q
    t = rows // Q
    return (t // H).to(tl.int64) * sb + (t % H).to(tl.int64) * sh + q.to(tl.int64) * sq


@triton.jit
def _smm_fwd_single(
    x_ptr, m_ptr, y_ptr, M, N, Q, H, sb, sh, sq, sn, scale, num_tiles, num_progs,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, VEC: tl.constexpr, MASK_KIND: tl.constexpr,
    MASK_COLS: tl.constexpr, CAUSAL: tl.constexpr,
):
    # x and y contiguous: row stride N.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    for tile in range(pid, num_tiles, num_progs):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_ok = (rows < M)[:, None]
        start = rows.to(tl.int64)[:, None] * N
        q = (rows % Q)[:, None]
        if MASK_KIND > 0:
            m_row = m_ptr + _mask_row_offset(rows, Q, H, sb, sh, sq)[:, None]
        else:
            m_row = m_ptr
        z = _scores(x_ptr + start, m_row, cols, q, row_ok, N, sn, scale, VEC, MASK_KIND,
                    MASK_COLS, CAUSAL, "")
        row_max = tl.max(z, axis=1)
        # A row with nothing kept (max -inf): e = exp2(-inf - 0) = 0 everywhere, then y = 0.
        row_max = tl.where(row_max == -float("inf"), 0.0, row_max)
        e = _exp(z - row_max[:, None], MASK_KIND)
        denom = tl.sum(e, axis=1)
        # (denominator 0: nothing kept, e == 0, so any finite inverse gives the zeros)
        inv = 1.0 / tl.where(denom == 0.0, 1.0, denom)
        tl.store(y_ptr + start + cols, (e * inv[:, None]).to(y_ptr.dtype.element_ty),
                 mask=row_ok & (cols < N))


@triton.jit
def _smm_fwd_looped(
    x_ptr, m_ptr, y_ptr, N, Q, H, sb, sh, sq, sn, scale,
    CHUNK: tl.constexpr, VEC: tl.constexpr, MASK_KIND: tl.constexpr, MASK_COLS: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    row = tl.program_id(0)
    start = row.to(tl.int64) * N
    x_row = x_ptr + start
    y_row = y_ptr + start
    q = row % Q
    if MASK_KIND > 0:
        m_row = m_ptr + _mask_row_offset(row, Q, H, sb, sh, sq)
    else:
        m_row = m_ptr
    if CAUSAL:
        end = tl.minimum(N, q + 1)  # nothing past the diagonal enters the statistics
    else:
        end = N
    lanes = tl.arange(0, CHUNK)
    # Per-lane online softmax statistics: running max and sum of exp relative to it.
    m = tl.full([CHUNK], -float("inf"), tl.float32)
    s = tl.zeros([CHUNK], tl.float32)
    for c0 in range(0, end, CHUNK):
        cols = c0 + lanes
        # evict_last keeps the row in L2 for the second pass; evict_first lets it go after it.
        z = _scores(x_row, m_row, cols, q, True, N, sn, scale, VEC, MASK_KIND, MASK_COLS,
                    CAUSAL, "evict_last")
        # A lane that has only seen -inf keeps s = 0 (exp2(-inf - 0)). NaN needs no special
        # case: tl.maximum may drop it, but exp(NaN - m) makes the lane's s NaN for good.
        m_new = tl.maximum(m, z)
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * _exp(m - m_safe, MASK_KIND) + _exp(z - m_safe, MASK_KIND)
        m = m_new
    row_max = tl.max(m, axis=0)
    row_max = tl.where(row_max == -float("inf"), 0.0, row_max)
    denom = tl.sum(s * _exp(m - row_max, MASK_KIND), axis=0)
    inv = 1.0 / tl.where(denom == 0.0, 1.0, denom)  # nothing kept: z == -inf, y == 0
    for c0 in range(0, N, CHUNK):
        cols = c0 + lanes
        z = _scores(x_row, m_row, cols, q, True, N, sn, scale, VEC, MASK_KIND, MASK_COLS,
                    CAUSAL, "evict_first")
        y = _exp(z - row_max, MASK_KIND) * inv
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _smm_bwd_single(
    y_ptr, dy_ptr, dx_ptr, M, N, stride_dy, scale, num_tiles, num_progs,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):
    # y and dx contiguous (row stride N); dy any row stride.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    for tile in range(pid, num_tiles, num_progs):
        rows = tile * ROWS + tl.arange(0, ROWS)
        mask = (rows < M)[:, None] & (cols < N)
        rows64 = rows.to(tl.int64)[:, None]
        offs = rows64 * N + cols
        y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        dot = tl.sum(y * dy, axis=1)
        dx = (y * scale) * (dy - dot[:, None])
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _smm_bwd_looped(
    y_ptr, dy_ptr, dx_ptr, N, stride_dy, scale, CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * N
    dy_row = dy_ptr + row * stride_dy
    dx_row = dx_ptr + row * N
    lanes = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], tl.float32)
    for c0 in range(0, N, CHUNK):
        cols = c0 + lanes
        mask = cols < N
        y = tl.load(y_row + cols, mask=mask, other=0.0, eviction_policy="evict_last")
        dy = tl.load(dy_row + cols, mask=mask, other=0.0, eviction_policy="evict_last")
        acc += y.to(tl.float32) * dy.to(tl.float32)
    dot = tl.sum(acc, axis=0)
    for c0 in range(0, N, CHUNK):
        cols = c0 + lanes
        mask = cols < N
        y = tl.load(y_row + cols, mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        dy = tl.load(dy_row + cols, mask=mask, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        tl.store(dx_row + cols, ((y * scale) * (dy - dot)).to(dx_ptr.dtype.element_ty),
                 mask=mask)


_launch_fwd_single = Launcher(_smm_fwd_single)
_launch_fwd_looped = Launcher(_smm_fwd_looped)
_launch_bwd_single = Launcher(_smm_bwd_single)
_launch_bwd_looped = Launcher(_smm_bwd_looped)


@config_cache
def fwd_config(n: int, elt_size: int, masked: bool = False) -> tuple[bool, int, int, int]:
    """(single_block, BLOCK, ROWS, num_warps) of the forward for rows of ``n`` elements of
    ``elt_size`` bytes (``masked``: a mask or the causal triangle). Single-block: BLOCK is the
    padded row, ROWS rows per program (the plain softmax forward's rules). Looped: BLOCK is the
    chunk, one row per program."""
    single, block, rows, warps = row_config(n, "softmax_fwd", elt_size)
    if single and block <= FWD_SINGLE_CAP[elt_size]:
        if masked and block >= 16384:
            # The causal/mask predicates next to 64 values per thread on 8 warps: 150-190
            # registers (ptxas sm_90, one program per SM); 16 warps: 64-106.
            warps = max(warps, 16)
        return True, block, rows, warps
    chunk, warps = FWD_LOOPED
    chunk = min(chunk, single_block_limit())
    return False, chunk, 1, max(1, min(warps, chunk // 256))


@config_cache
def bwd_config(n: int, elt_size: int) -> tuple[bool, int, int, int]:
    """(single_block, BLOCK, ROWS, num_warps) of the backward (the plain softmax backward's
    single-block / looped rules)."""
    return row_config(n, "softmax_bwd", elt_size)


def _mask_kind(mask: torch.Tensor | None) -> int:
    if mask is None:
        return NO_MASK
    if mask.dtype == torch.bool:
        return BOOL_MASK
    if not mask.is_floating_point():
        raise TypeError(f"mask must be bool or floating point, got dtype {mask.dtype}")
    return FLOAT_MASK


# Replay plans (see _common.record_launches), per call signature: the shapes, strides, dtypes
# and 16-byte alignment of every tensor, scale, causal, the output dtype and the device. A call
# seen before allocates its output and relaunches the recorded kernel with its own tensors'
# addresses (the launch rules and checks cost more host time than the kernel takes on a small
# batch's attention). PLANS = False turns them off.
PLANS = True
_fwd_plans = SequencePlans(_replay.SOFTMAX_MASKED)  # (clearing the plans clears the runners)
_bwd_plans = SequencePlans()


def _planned(plans, key, inputs: tuple, normal):
    """``normal()``'s result, replayed from ``plans[key]`` where a call of ``key`` ran before
    through launches alone (``inputs``: the call's tensors, in the order the plan takes them;
    ``normal`` returns one output tensor)."""
    plan = plans.get(key)
    if plan and not hooks_registered():
        return plan(*inputs)[0]
    if plan is False or key is None:
        return normal()
    with record_launches() as record:
        out = normal()
    plans.put(key, replay_runner(record, inputs, (out,)) or False)
    return out


def softmax_masked_forward(x: torch.Tensor, mask: torch.Tensor | None, scale: float,
                           causal: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """``softmax(x * scale + mask)`` over the last dim (see the module docstring).

    x: (B, H, Q, N), float32/float16/bfloat16 (made contiguous if it is not); mask: None or a
    (B, H, Q, N) view, any strides, bool or float. Returns (B, H, Q, N) contiguous of
    ``out_dtype``. A call whose signature ran before is replayed (see ``_planned``).
    """
    key = (x.shape, x.stride(), x.dtype, x.data_ptr() & 15, tensor_key(mask), scale, causal,
           out_dtype, x.get_device()) if PLANS else None
    return _planned(_fwd_plans, key, (x, mask),
                    lambda: _forward(x, mask, scale, causal, out_dtype))


def softmax_masked_ops_runner(x: torch.Tensor, mask: torch.Tensor | None, x4: torch.Tensor,
                              mask4: torch.Tensor | None, scale: float, causal: bool):
    """The ``fusedops._replay.SOFTMAX_MASKED`` runner for an inference call just made: the ops
    layer's 4-d ``x`` and ``mask`` (as the user passed it), which it sent here as ``x4`` and
    ``mask4`` (the mask expanded to x's shape), output in x's dtype. Returns ``run(x, mask)``
    replaying this call's plan with the new tensors' addresses, False where the call has no
    plan and will not get one, None where that is not decided yet (plans off, or hooks kept
    this call from recording). The signature fixes x's shape and dtype and the mask's shape,
    strides and dtype; ``run`` checks the rest (x contiguous, both on x's device at the
    recorded 16-byte alignment, no launch hooks) and returns None where it cannot run the call
    as recorded."""
    if not PLANS:
        return None
    if not x.is_cuda:
        return False  # (the interpreter's CPU tensors)
    if x4.data_ptr() != x.data_ptr():
        return None  # x was copied to be contiguous; a later call's x may not need it
    if mask is not None and (mask4.data_ptr() != mask.data_ptr()
                             or mask.get_device() != x.get_device()):
        return False  # the mask was converted (its signature fixes that), or on another device
    plan = _fwd_plans.get((x4.shape, x4.stride(), x4.dtype, x4.data_ptr() & 15,
                           tensor_key(mask4), scale, causal, x.dtype, x4.get_device()))
    if not plan:
        return None if plan is None else False
    device, x_align = x.get_device(), x.data_ptr() & 15
    if mask is None:
        def run(x: torch.Tensor, mask: None) -> torch.Tensor | None:
            if (x.data_ptr() & 15) != x_align or not x.is_contiguous() or hooks_registered():
                return None
            return plan(x, None)[0]
        return run
    m_align = mask.data_ptr() & 15

    def run_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        if ((x.data_ptr() & 15) != x_align or (mask.data_ptr() & 15) != m_align
                or not x.is_contiguous() or mask.get_device() != device or hooks_registered()):
            return None
        return plan(x, mask)[0]
    return run_masked


def _forward(x, mask, scale, causal, out_dtype):
    """:func:`softmax_masked_forward` through the launch rules."""
    if x.dim() != 4:
        raise ValueError(f"x must be (B, H, Q, N), got shape {list(x.shape)}")
    if not x.is_contiguous():
        x = x.contiguous()
    B, H, Q, N = x.shape
    y = torch.empty_like(x, dtype=out_dtype)
    M = B * H * Q
    if M == 0 or N == 0:
        return y
    kind = _mask_kind(mask)
    if kind:
        if mask.shape != x.shape:
            raise ValueError(f"mask must be a {list(x.shape)} view, got {list(mask.shape)}")
        sb, sh, sq, sn = mask.stride()
        m = mask
        mcols = 1 if sn == 1 or N == 1 else 2
    else:
        sb = sh = sq = sn = 0
        m = x
        mcols = 0
    elt = x.element_size()
    causal = bool(causal)
    scale2 = float(scale) if kind == FLOAT_MASK else float(scale) * _LOG2E
    single, block, rows, warps = fwd_config(N, elt, bool(kind) or causal)
    vec = 16 // elt
    if single:
        tiles = cdiv(M, rows)
        progs = grid_size(tiles, warps, "softmax_fwd", x.device)
        _launch_fwd_single((progs,), (x, m, y, M, N, Q, H, sb, sh, sq, sn, scale2, tiles, progs,
                                      block, rows, vec, kind, mcols, causal), warps)
    else:
        _launch_fwd_looped((M,), (x, m, y, N, Q, H, sb, sh, sq, sn, scale2,
                                  block, vec, kind, mcols, causal), warps)
    mark_replayable()
    return y


def softmax_masked_backward(y: torch.Tensor, dy: torch.Tensor, scale: float,
                            out_dtype: torch.dtype) -> torch.Tensor:
    """dx = scale · y · (dy - Σ dy·y) per row. y: (M, N) contiguous; dy: (M, N) unit column
    stride, any row stride (0 for expanded gradients). Returns contiguous (M, N) of
    ``out_dtype``. A call whose signature ran before is replayed (see ``_planned``)."""
    key = (y.shape, y.stride(), y.dtype, y.data_ptr() & 15, tensor_key(dy), scale, out_dtype,
           y.get_device()) if PLANS else None
    return _planned(_bwd_plans, key, (y, dy), lambda: _backward(y, dy, scale, out_dtype))


def _backward(y, dy, scale, out_dtype):
    """:func:`softmax_masked_backward` through the launch rules."""
    M, N = y.shape
    dx = torch.empty((M, N), dtype=out_dtype, device=y.device)
    if M == 0 or N == 0:
        return dx
    if not y.is_contiguous():
        y = y.contiguous()
    if N > 1 and dy.stride(1) != 1:
        dy = dy.contiguous()
    scale = float(scale)
    single, block, rows, warps = bwd_config(N, y.element_size())
    if single:
        tiles = cdiv(M, rows)
        progs = grid_size(tiles, warps, "softmax_bwd", y.device)
        _launch_bwd_single((progs,), (y, dy, dx, M, N, dy.stride(0), scale, tiles, progs,
                                      block, rows), warps)
    else:
        _launch_bwd_looped((M,), (y, dy, dx, N, dy.stride(0), scale, block), warps)
    mark_replayable()
    return dx


