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
  launch rules of the plain softmax forward (``row_config`` / ``grid_programs``, kind
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

import functools

import torch

from fusedops import _replay
from fusedops.backends.triton.configs.softmax_masked import (
    PLANS,
    MaskedSoftmaxConfig,
    backward_config,
    forward_config,
)
from fusedops.backends.triton.kernels.softmax_masked import (
    smm_bwd_looped,
    smm_bwd_single,
    smm_fwd_looped,
    smm_fwd_single,
)
from fusedops.backends.triton.runtime import host_ext
from fusedops.backends.triton.runtime.caches import signature_cache
from fusedops.backends.triton.runtime.facts import device_facts
from fusedops.backends.triton.runtime.launcher import Launcher, hooks_registered
from fusedops.backends.triton.runtime.plans import SequencePlans, replay_runner, tensor_key
from fusedops.backends.triton.runtime.recording import mark_replayable, record_launches

_LOG2E = 1.4426950408889634

# Mask kinds (the MASK_KIND constexpr).
NO_MASK, BOOL_MASK, FLOAT_MASK = 0, 1, 2


_launch_fwd_single = Launcher(smm_fwd_single)
_launch_fwd_looped = Launcher(smm_fwd_looped)
_launch_bwd_single = Launcher(smm_bwd_single)
_launch_bwd_looped = Launcher(smm_bwd_looped)


def _mask_kind(mask: torch.Tensor | None) -> int:
    if mask is None:
        return NO_MASK
    if mask.dtype == torch.bool:
        return BOOL_MASK
    if not mask.is_floating_point():
        raise TypeError(f"mask must be bool or floating point, got dtype {mask.dtype}")
    return FLOAT_MASK


# The launch of each call signature (rows, element size, masked, row count, device), decided
# once by the rules in configs/softmax_masked.py.
@signature_cache
def _fwd_config(n: int, elt_size: int, masked: bool, m: int, index: int) -> MaskedSoftmaxConfig:
    return forward_config(n, elt_size, masked, m, device_facts(index))


@signature_cache
def _bwd_config(n: int, elt_size: int, m: int, index: int) -> MaskedSoftmaxConfig:
    return backward_config(n, elt_size, m, device_facts(index))


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
        return _with_native(run, plan, scale, x_align, 0)
    m_align = mask.data_ptr() & 15

    def run_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        if ((x.data_ptr() & 15) != x_align or (mask.data_ptr() & 15) != m_align
                or not x.is_contiguous() or mask.get_device() != device or hooks_registered()):
            return None
        return plan(x, mask)[0]
    return _with_native(run_masked, plan, scale, x_align, m_align)


def _with_native(run, plan, scale: float, x_align: int, m_align: int):
    """Give runner ``run`` its C++ autograd path: ``run.native`` is None until
    ``run.make_native(y, dy)`` has run a training call's backward (the call's gradient, None
    where it did not), then ``native(x, mask) -> y or None`` (``fusedops._host_ext``: forward
    and backward launched from C++, no Python in the backward) or False where the plans do not
    convert (host_ext.py) or the extension is not built."""
    run.native = None if host_ext.AVAILABLE else False

    def make_native(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor | None:
        if (torch.is_grad_enabled() or not y.is_contiguous() or not dy.is_contiguous()
                or dy.dtype != y.dtype or (y.data_ptr() | dy.data_ptr()) & 15
                or hooks_registered()):
            return None  # (not this call: asked again at the next)
        run.native = False
        n = y.shape[-1]
        y2, dy2 = y.view(-1, n), dy.view(-1, n)
        dx2 = softmax_masked_backward(y2, dy2, scale, y.dtype)  # (replayed, or its plan made)
        backward = _bwd_plans.get(_bwd_key(y2, dy2, scale, y.dtype))
        fwd = host_ext.host_plan(plan.steps)
        bwd = host_ext.host_plan(backward.steps) if backward and fwd is not None else None
        if bwd is not None:
            apply = functools.partial(host_ext.ext.masked_softmax, fwd, bwd, x_align, m_align,
                                      float(scale))

            def native(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
                return None if hooks_registered() else apply(x, mask)
            run.native = native
        return dx2.view(y.shape)

    run.make_native = make_native
    return run


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
    cfg = _fwd_config(N, elt, bool(kind) or causal, M, x.get_device())
    if cfg.variant == "single":
        _launch_fwd_single((cfg.grid,), (x, m, y, M, N, Q, H, sb, sh, sq, sn, scale2, cfg.tiles,
                                         cfg.grid, cfg.block, cfg.rows, cfg.vec, kind, mcols,
                                         causal), cfg.warps)
    else:
        _launch_fwd_looped((M,), (x, m, y, N, Q, H, sb, sh, sq, sn, scale2,
                                  cfg.block, cfg.vec, kind, mcols, causal), cfg.warps)
    mark_replayable()
    return y


def softmax_masked_backward(y: torch.Tensor, dy: torch.Tensor, scale: float,
                            out_dtype: torch.dtype) -> torch.Tensor:
    """dx = scale · y · (dy - Σ dy·y) per row. y: (M, N) contiguous; dy: (M, N) unit column
    stride, any row stride (0 for expanded gradients). Returns contiguous (M, N) of
    ``out_dtype``. A call whose signature ran before is replayed (see ``_planned``)."""
    key = _bwd_key(y, dy, scale, out_dtype) if PLANS else None
    return _planned(_bwd_plans, key, (y, dy), lambda: _backward(y, dy, scale, out_dtype))


def _bwd_key(y, dy, scale, out_dtype) -> tuple:
    return (y.shape, y.stride(), y.dtype, y.data_ptr() & 15, tensor_key(dy), scale, out_dtype,
            y.get_device())


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
    cfg = _bwd_config(N, y.element_size(), M, y.get_device())
    if cfg.variant == "single":
        _launch_bwd_single((cfg.grid,), (y, dy, dx, M, N, dy.stride(0), scale, cfg.tiles,
                                         cfg.grid, cfg.block, cfg.rows), cfg.warps)
    else:
        _launch_bwd_looped((M,), (y, dy, dx, N, dy.stride(0), scale, cfg.block), cfg.warps)
    mark_replayable()
    return dx


