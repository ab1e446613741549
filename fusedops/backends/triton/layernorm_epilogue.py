"""Triton LayerNorm with fused epilogues: ``out = activation(dropout(layer_norm(x + residual)))``.

The row contract of ``fusedops.backends.reference.layernorm_epilogue_forward`` / ``_backward`` (same
arguments, same results). Bytes moved: the forward reads x (and residual) once and writes out
(and s = x + residual) once; the backward reads dout and s (and ds) once and writes dx once, plus
float32 per-program dweight/dbias partials summed in a fixed order (``reduce_partials``).
The dropout mask is never stored: the backward regenerates it from the seed.

Kernels (``dropout_p == 0``, no activation, no residual, no weight / bias, no statistics are
constexpr specialisations: the plain paths carry none of the dropout or activation code):

* Forward, single-block (padded rows up to 16K, see ``fwd_cap``): ``ROWS`` whole rows per
  program as a [ROWS, BLOCK] tile in registers (about ``FWD_TILE`` elements, half that with
  dropout), one read and one write. With dropout the tile is held as Q column slices
  (``slice_cols``: slice q holds the columns that take Philox word q), so each Philox call
  serves four elements; without it Q = 1, the plain tile.
* Forward, looped (longer rows): one program per row; pass 1 streams the row in chunks of
  ``LOOPED_GROUPS`` x 1024 columns (writing s), keeping per-lane shifted sums merged with Chan's
  formula; pass 2 reads s (or x) again, from L2, and writes out. Its columns are a
  ``[Q, R, G, NI]`` tile (``col = g * 1024 + q * 256 + i``,
  ``fusedops.backends.triton.runtime.philox``)
  so each
  Philox counter is computed once for its four 256-column slices.
* Backward, single-block (padded rows up to 4K-8K, ``bwd_cap``): a persistent grid whose
  programs loop over [ROWS, BLOCK] row tiles (Q slices with dropout), write dx and accumulate
  dweight/dbias in float32 registers: one partial row each (with one program, the result
  itself). Plans from ``bwd_plan``: LayerNorm's measured ones without dropout or activation.
* Backward, longer rows: a row kernel computes the two row sums of dx (one program per row,
  chunks of ``LOOPED_GROUPS`` x 1024 columns), then a column-blocked kernel (1024 columns by a
  split of the rows per program) reads the rows again, writes dx and keeps float32 dweight/dbias
  partials per row split. dout and s are read twice there (five passes of M·N elements in all,
  against three).

Host path: calls of a signature seen before replay their recorded launches (``PLANS``, with
the new call's seed words), and the forward also takes contiguous rows of any rank (the ops
layer's ``EPILOGUE_ROWS_ND``); see docs/design.md, "Epilogue and masked-softmax replay plans".

The single-block kernels first held rows as ``[Q, R, G, NI]`` column tiles too (one Philox call
per counter); those measured 0.07-0.4 of copy bandwidth on an H200 even without dropout (up
to 255 registers and spills with Triton 3.6) and were replaced by the 2-D tiles. The forward's
tiles follow the other norm kernels' rules; the backward's plans were measured on an H200 by
timing the backend functions alone under each plan (``configs.override("layernorm_epilogue",
bwd_plan=...)``).
"""

from __future__ import annotations

import torch

from fusedops import _philox, _replay
from fusedops.backends.triton.configs.layernorm_epilogue import (
    PLANS,
    EpilogueConfig,
    backward_config,
    forward_config,
)
from fusedops.backends.triton.kernels.layernorm_epilogue_bwd import (
    ln_epi_bwd_2d,
    ln_epi_bwd_columns,
    ln_epi_bwd_row_sums,
)
from fusedops.backends.triton.kernels.layernorm_epilogue_fwd import ln_epi_fwd_2d, ln_epi_fwd_looped
from fusedops.backends.triton.runtime.caches import signature_cache
from fusedops.backends.triton.runtime.facts import device_facts
from fusedops.backends.triton.runtime.launcher import Launcher, hooks_registered
from fusedops.backends.triton.runtime.partials import reduce_partials
from fusedops.backends.triton.runtime.plans import (
    SequencePlans,
    param_ptr,
    replay_runner,
    tensor_key,
)
from fusedops.backends.triton.runtime.recording import mark_replayable, record_launches

ACTIVATIONS = {None: 0, "relu": 1, "gelu": 2}


# --- 2-D row tiles (the single-block paths) ----------------------------------------------------
# The [Q, R, G, NI] column tiles above compute each Philox counter once, but their multi-axis
# layouts measured 0.07-0.4 of copy bandwidth on an H200 (also without dropout). These kernels
# hold rows as plain [ROWS, BLOCK] tiles, as the other norm kernels do, and compute Philox per
# element (each counter four times): more integer work, full-speed loads and stores.


# No multiply-add contraction: the training and inference specialisations (statistics stored or
# not) then round alike, so a forward gives the same bits whether or not a backward follows.
_launch_fwd_2d = Launcher(ln_epi_fwd_2d, fp_fusion=False)
_launch_bwd_2d = Launcher(ln_epi_bwd_2d, fp_fusion=False)
_launch_fwd_looped = Launcher(ln_epi_fwd_looped)
_launch_bwd_row_sums = Launcher(ln_epi_bwd_row_sums)
_launch_bwd_columns = Launcher(ln_epi_bwd_columns)


def _rne(x: torch.Tensor) -> bool:
    """Whether the kernels must round bfloat16 sums by hand (Triton's interpreter, CPU tensors)."""
    return x.dtype == torch.bfloat16 and not x.is_cuda


def _random_args(dropout_p: float, seed: int) -> tuple[bool, float, int, int, int]:
    """(dropout on, scale, key word 0, key word 1, threshold): the key words and threshold as
    int32 bit patterns (one kernel argument type whatever the seed)."""
    if dropout_p == 0.0:
        return False, 1.0, 0, 0, 0
    thr = _philox.dropout_threshold(dropout_p)  # raises for p outside [0, 1)
    k0, k1 = _seed_words(seed)
    thr = thr - (1 << 32) if thr >= 1 << 31 else thr
    return True, 1.0 / (1.0 - float(dropout_p)), k0, k1, thr


def _act_code(activation: str | None) -> int:
    try:
        return ACTIVATIONS[activation]
    except (KeyError, TypeError):
        raise ValueError(f"activation must be one of None, 'relu', 'gelu', got {activation!r}") \
            from None


def _check_rows(name: str, t: torch.Tensor | None, shape, dtype) -> None:
    # The kernels index rows by their stride and columns as contiguous.
    if t is None:
        return
    if t.shape != shape or t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} of shape {tuple(shape)}, got {t.dtype} "
                         f"{tuple(t.shape)}")
    if t.stride(1) != 1 and shape[1] > 1:
        raise ValueError(f"{name} must have unit column stride, got strides {t.stride()}")


def _check_contiguous_rows(x: torch.Tensor, residual: torch.Tensor | None) -> None:
    # The forward's rows of any rank other than 2: contiguous, rows along the last dim.
    if x.dim() < 1 or not x.is_contiguous():
        raise ValueError(f"x of shape {tuple(x.shape)} must be contiguous with rows along its "
                         "last dim, or 2-D")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or not residual.is_contiguous()):
        raise ValueError(f"residual must be a contiguous {x.dtype} tensor of x's shape "
                         f"{tuple(x.shape)}, got {residual.dtype} {tuple(residual.shape)}")


def _vector(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.is_contiguous() else t.contiguous()


# The launch of each call signature, decided once by the rules in configs/layernorm_epilogue.py.
@signature_cache
def _fwd_config(n: int, elt_size: int, m: int, dropout: bool, has_res: bool,
                index: int) -> EpilogueConfig:
    return forward_config(n, elt_size, m, dropout, has_res, device_facts(index))


@signature_cache
def _bwd_config(n: int, elt_size: int, m: int, dropout: bool, act: int,
                strides: tuple[int, ...], index: int) -> EpilogueConfig:
    return backward_config(n, elt_size, m, dropout, act, strides, device_facts(index))


# Inference add + LayerNorm plans are also replayed from the ops layer (fusedops._replay); the
# runners go with the plans.
_fwd_plans = SequencePlans(_replay.LAYERNORM_RESIDUAL)
_bwd_plans = SequencePlans()


def _seed_words(seed: int) -> tuple[int, int]:
    """The Philox key of ``seed`` as two int32 bit patterns (the kernels' k0, k1)."""
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be a non-negative 64-bit integer, got {seed}")
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    return k0 - (1 << 32) if k0 >= 1 << 31 else k0, k1 - (1 << 32) if k1 >= 1 << 31 else k1


def _seed_position(launcher: Launcher) -> int | None:
    """Index of k0 in ``launcher``'s kernel arguments (k1 follows it), or None if it takes none."""
    names = list(getattr(launcher.kernel, "arg_names", ()))
    if "k0" not in names:
        return None
    i = names.index("k0")
    return i if names[i + 1:i + 2] == ["k1"] else -1


def layernorm_epilogue_forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
    dropout_p: float,
    seed: int,
    activation: str | None,
    need_stats: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``out = activation(dropout(layer_norm(x + residual)))`` over rows (the contract of
    ``fusedops.backends.reference.layernorm_epilogue_forward``).

    x, residual: (M, N) float32/float16/bfloat16, unit column stride, any row strides, the same
    dtype (residual may be None), or contiguous tensors of any other rank >= 1 (rows along the
    last dim; out and s then have x's shape); weight, bias: (N,) in any float dtype, or None.
    Returns ``(out, s, mean, rstd)``: out (M, N) contiguous of ``out_dtype``; s = x + residual
    rounded to x's dtype, (M, N) contiguous (None without residual); mean/rstd (M,) float32
    (None unless ``need_stats``). A call whose signature ran before is replayed. Dropout with
    ``dropout_p`` in [0, 1) (0: none) keeps an element when its Philox number for ``seed``
    (``fusedops._philox``) is >= the threshold and scales it by 1 / (1 - p); activation None,
    "relu" or "gelu" (exact).
    """
    key = (x.shape, x.stride(), x.dtype, x.data_ptr() & 15, tensor_key(residual),
           tensor_key(weight), tensor_key(bias), eps, out_dtype, dropout_p, activation,
           need_stats, x.get_device()) if PLANS else None
    plan = _fwd_plans.get(key)
    if plan and not hooks_registered():
        if plan.ops is not None and plan.ops[0] not in _replay.LAYERNORM_RESIDUAL:
            _replay.LAYERNORM_RESIDUAL[plan.ops[0]] = plan.ops[1]  # (tables cleared since)
        return plan(x, residual, weight, bias, words=_seed_words(seed) if dropout_p else None)
    if plan is False or key is None:
        return _forward(x, residual, weight, bias, eps, out_dtype, dropout_p, seed, activation,
                        need_stats)
    with record_launches() as record:
        out = _forward(x, residual, weight, bias, eps, out_dtype, dropout_p, seed, activation,
                       need_stats)
    run = replay_runner(record, (x, residual, weight, bias), out, (),
                        _seed_position if dropout_p else None)
    if run is not None:
        run.ops = _ops_runner(run, x, residual, weight, bias, eps, out_dtype, dropout_p,
                              activation, need_stats)
        if run.ops is not None:
            _replay.LAYERNORM_RESIDUAL[run.ops[0]] = run.ops[1]
    _fwd_plans.put(key, run or False)
    return out


def _ops_runner(run, x, residual, weight, bias, eps, out_dtype, dropout_p, activation,
                need_stats):
    """``(signature, replay)`` for ``fusedops._replay.LAYERNORM_RESIDUAL`` replaying the plan
    ``run`` just made, or None unless the call was an inference add + LayerNorm the ops layer
    can replay (residual, no dropout, activation or statistics, output in x's dtype, x and
    residual contiguous, every tensor 16-byte aligned, parameters (N,) vectors). ``replay``
    checks what the signature does not fix and returns None where the plan would not apply."""
    if (residual is None or dropout_p or activation is not None or need_stats
            or out_dtype is not x.dtype or not x.is_cuda or not x.is_contiguous()
            or not residual.is_contiguous() or (x.data_ptr() | residual.data_ptr()) & 15):
        return None
    shape, dtype, device, n = x.shape, x.dtype, x.get_device(), x.shape[-1]
    dtypes = []
    for t in (weight, bias):
        if t is not None and param_ptr(t, t.dtype, n, device) < 0:
            return None
        dtypes.append(None if t is None else t.dtype)
    w_dtype, b_dtype = dtypes

    def replay(x, residual, weight, bias):
        if (residual.__class__ is not torch.Tensor or residual.shape != shape
                or residual.dtype is not dtype or not residual.is_cuda
                or residual.get_device() != device or not x.is_contiguous()
                or not residual.is_contiguous() or (x.data_ptr() | residual.data_ptr()) & 15
                or param_ptr(weight, w_dtype, n, device) < 0
                or param_ptr(bias, b_dtype, n, device) < 0 or hooks_registered()):
            return None
        out, s, _, _ = run(x, residual, weight, bias)
        return out, s

    return (shape, dtype, device, eps), replay


def _forward(x, residual, weight, bias, eps, out_dtype, dropout_p, seed, activation,
             need_stats):
    """:func:`layernorm_epilogue_forward` through the launch rules."""
    dev = x.device
    has_res = residual is not None
    if x.dim() == 2:
        M, N = x.shape
        _check_rows("x", x, x.shape, x.dtype)
        _check_rows("residual", residual, x.shape, x.dtype)
        stride_x, stride_r = x.stride(0), residual.stride(0) if has_res else 0
    else:  # contiguous rows of another rank (ROWS_ND): no 2-D views to make
        _check_contiguous_rows(x, residual)
        N = x.shape[-1]
        M = x.numel() // N if N else 0
        stride_x = stride_r = N
    act = _act_code(activation)
    dropout, scale, k0, k1, thresh = _random_args(dropout_p, seed)
    out = torch.empty(x.shape, dtype=out_dtype, device=dev)
    s = torch.empty(x.shape, dtype=x.dtype, device=dev) if has_res else None
    mean = torch.empty((M,), dtype=torch.float32, device=dev) if need_stats else None
    rstd = torch.empty((M,), dtype=torch.float32, device=dev) if need_stats else None
    if M == 0 or N == 0:
        if need_stats:
            mean.fill_(float("nan"))  # statistics of no elements, as the reference has them
            rstd.fill_(float("nan"))
        return out, s, mean, rstd
    weight, bias = _vector(weight), _vector(bias)
    has_w, has_b = weight is not None, bias is not None
    # Placeholders for absent tensors are never read (the flags are constexpr).
    r = residual if has_res else x
    sp = s if has_res else out
    w = weight if has_w else out
    b = bias if has_b else out
    mp = mean if need_stats else out
    rp = rstd if need_stats else out
    cfg = _fwd_config(N, x.element_size(), M, dropout, has_res, x.get_device())
    if cfg.variant == "single":
        _launch_fwd_2d((cfg.grid,), (
            x, r, w, b, out, sp, mp, rp, M, N, stride_x, stride_r, eps, scale, k0, k1, thresh,
            cfg.tiles, cfg.grid, cfg.block, cfg.rows, cfg.slices, has_res, has_w, has_b,
            dropout, act, need_stats, _rne(x), cfg.stages,
        ), cfg.warps)
    else:
        _launch_fwd_looped((M,), (
            x, r, w, b, out, sp, mp, rp, N, stride_x, stride_r, eps, scale, k0, k1, thresh,
            cfg.groups, has_res, has_w, has_b, dropout, act, need_stats, _rne(x),
        ), cfg.warps)
    mark_replayable()
    return out, s, mean, rstd


def layernorm_epilogue_backward(
    dout: torch.Tensor,
    ds: torch.Tensor | None,
    s: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dropout_p: float,
    seed: int,
    activation: str | None,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
    grad_dtypes: tuple[torch.dtype, torch.dtype] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of :func:`layernorm_epilogue_forward` (the contract of
    ``fusedops.backends.reference.layernorm_epilogue_backward``).

    dout: (M, N) gradient of out; ds: (M, N) gradient reaching s, or None; s: the LayerNorm's
    input (x + residual, or x); all with unit column stride and any row strides. The dropout
    mask is regenerated from ``seed``, the activation's input recomputed from s, mean, rstd,
    weight and bias. With gy = dout * act'(v) * keep / (1 - p): dx = LayerNorm backward of gy
    plus ds, (M, N) contiguous in s's dtype (rounded once); dw = Σ_rows gy · xhat and
    db = Σ_rows gy, float32 (N,), or already in ``grad_dtypes`` (weight's, bias's) where the
    partials' sum writes them (it rounds once, as a cast of the float32 sum would). Each is None
    where not needed. Bitwise reproducible: the grid and the summation order depend on the
    shapes only.
    """
    if not PLANS or grad_dtypes is None:
        return _backward(dout, ds, s, weight, bias, mean, rstd, dropout_p, seed, activation,
                         need_dx, need_dw, need_db, grad_dtypes)[:3]
    key = (s.shape, s.stride(), s.dtype, s.data_ptr() & 15, tensor_key(dout), tensor_key(ds),
           tensor_key(weight), tensor_key(bias), tensor_key(mean), tensor_key(rstd),
           dropout_p, activation, need_dx, need_dw, need_db, grad_dtypes, s.get_device())
    plan = _bwd_plans.get(key)
    if plan and not hooks_registered():
        return plan(dout, ds, s, weight, bias, mean, rstd,
                    words=_seed_words(seed) if dropout_p else None)
    if plan is False:
        return _backward(dout, ds, s, weight, bias, mean, rstd, dropout_p, seed, activation,
                         need_dx, need_dw, need_db, grad_dtypes)[:3]
    with record_launches() as record:
        *out, scratch = _backward(dout, ds, s, weight, bias, mean, rstd, dropout_p, seed,
                                  activation, need_dx, need_dw, need_db, grad_dtypes)
    _bwd_plans.put(key, replay_runner(record, (dout, ds, s, weight, bias, mean, rstd),
                                      tuple(out), scratch,
                                      _seed_position if dropout_p else None) or False)
    return tuple(out)


def _backward(dout, ds, s, weight, bias, mean, rstd, dropout_p, seed, activation, need_dx,
              need_dw, need_db, grad_dtypes):
    """:func:`layernorm_epilogue_backward` through the launch rules: ``(dx, dw, db, scratch)``,
    scratch the tuple of temporaries its launches wrote (for ``replay_runner``)."""
    M, N = s.shape
    dev = s.device
    _check_rows("s", s, s.shape, s.dtype)
    _check_rows("dout", dout, s.shape, dout.dtype)
    _check_rows("ds", ds, s.shape, ds.dtype if ds is not None else None)
    act = _act_code(activation)
    dropout, scale, k0, k1, thresh = _random_args(dropout_p, seed)
    dx = torch.empty((M, N), dtype=s.dtype, device=dev) if need_dx else None
    if M == 0 or N == 0 or not (need_dx or need_dw or need_db):
        dw = torch.zeros((N,), dtype=torch.float32, device=dev) if need_dw else None
        db = torch.zeros((N,), dtype=torch.float32, device=dev) if need_db else None
        return dx, dw, db, ()
    weight, bias = _vector(weight), _vector(bias)
    mean, rstd = _vector(mean), _vector(rstd)
    has_w, has_b = weight is not None, bias is not None
    has_ds = ds is not None and need_dx
    w = weight if has_w else s  # placeholders, never read
    b = bias if has_b else s
    dsp = ds if has_ds else s
    stride_ds = ds.stride(0) if has_ds else 0
    dxp = dx if need_dx else s
    strides = (dout.stride(0), s.stride(0)) + ((stride_ds,) if has_ds else ())
    cfg = _bwd_config(N, s.element_size(), M, dropout, act, strides, s.get_device())
    scratch = ()
    if cfg.variant == "single":
        dw, db, dwp, dbp, part = _partials(cfg.grid, N, need_dw, need_db, dxp)
        _launch_bwd_2d((cfg.grid,), (
            dout, dsp, s, w, b, mean, rstd, dxp, dwp, dbp, M, N, dout.stride(0), stride_ds,
            s.stride(0), scale, k0, k1, thresh, cfg.tiles, cfg.grid,
            cfg.block, cfg.rows, cfg.slices, has_ds, has_w, has_b, dropout, act, need_dx,
            need_dw, need_db, cfg.acc_1d, cfg.paired, cfg.stages,
        ), cfg.warps)
    else:
        sums = dxp
        if need_dx:
            sums = torch.empty((M, 2), dtype=torch.float32, device=dev)
            scratch = (sums,)
            _launch_bwd_row_sums((M,), (
                dout, s, w, b, mean, rstd, sums, N, dout.stride(0), s.stride(0), scale, k0, k1,
                thresh, cfg.groups, has_w, has_b, dropout, act,
            ), cfg.sums_warps)
        dw, db, dwp, dbp, part = _partials(cfg.splits, N, need_dw, need_db, dxp)
        _launch_bwd_columns((cfg.col_blocks, cfg.splits), (
            dout, dsp, s, w, b, mean, rstd, sums, dxp, dwp, dbp, M, N, dout.stride(0),
            stride_ds, s.stride(0), scale, k0, k1, thresh, cfg.rows_per_split,
            cfg.column_rows, 1, has_ds, has_w, has_b, dropout, act, need_dx, need_dw, need_db,
        ), cfg.warps)
    if part is not None:
        dw, db = reduce_partials(part, need_dw, need_db, dtypes=grad_dtypes)
        scratch = (*scratch, part)
    mark_replayable()
    return dx, dw, db, scratch


def _partials(progs: int, N: int, need_dw: bool, need_db: bool, placeholder: torch.Tensor):
    """(dw, db, dweight target, dbias target, partials to sum or None) for ``progs`` programs
    writing one float32 row each: with one program the results themselves (float32 dw, db
    allocated here), else the two halves of a (2, progs, N) float32 buffer (the layout
    ``reduce_partials`` sums; dw, db None until it makes them)."""
    if not (need_dw or need_db):
        return None, None, placeholder, placeholder, None
    dev = placeholder.device
    if progs == 1:
        dw = torch.empty((N,), dtype=torch.float32, device=dev) if need_dw else None
        db = torch.empty((N,), dtype=torch.float32, device=dev) if need_db else None
        return dw, db, (dw if need_dw else placeholder), (db if need_db else placeholder), None
    part = torch.empty((2, progs, N), dtype=torch.float32, device=dev)
    return None, None, part[0], part[1], part
