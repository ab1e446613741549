"""DTensor inputs to the public ops: each op runs on every rank's local shard and returns a
DTensor, forward and backward.

The public functions come here only when ``x`` is not a plain ``torch.Tensor`` and
:func:`is_dtensor` says it is a ``torch.distributed.tensor.DTensor``: the plain path pays one
class test per call and never imports ``torch.distributed``.

Placements, per mesh dimension, as ``torch.distributed.tensor``'s own ops treat them:

* ``Shard(d)`` of a dim the op does not reduce over (batch, sequence, heads): the op runs on
  the local shard as it is; the output keeps ``Shard(d)``.
* ``Shard(d)`` of a reduced dim (softmax's ``dim``, the causal triangle's last two dims, a
  norm's trailing ``normalized_shape`` dims) and ``Partial``: ``x`` is redistributed to
  ``Replicate`` on that mesh dim first, and the output is ``Replicate`` there (what
  ``torch.softmax`` / ``F.layer_norm`` give for such DTensors; a normalised value is no sum of
  partial values).
* ``weight``/``bias`` are used whole (redistributed to ``Replicate`` if they are not); their
  gradient is ``Partial`` over the mesh dims where ``x`` is sharded (each rank summed its own
  rows), as with torch's ops, and is reduced where the parameter's placements ask for it.
* ``residual`` takes ``x``'s placements, a ``mask`` the matching ones (``Shard`` of its
  corresponding dim, ``Replicate`` where it broadcasts); both are redistributed if need be.

Every tensor argument beside a DTensor ``x`` must be a DTensor on the same mesh (a plain tensor
raises, naming it: whether it holds the same values on every rank cannot be known without
communication). Dropout draws one seed from torch's default generator, as on one device, and
folds in the rank's shard coordinates: shards get independent masks, replicas the same one, so
ranks must seed alike (``torch.manual_seed`` with one value everywhere, as DTensor's own random
ops need).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from fusedops import _philox
from fusedops._validate import (
    check_float_dtype,
    check_float_tensor,
    check_layernorm_args,
    check_rmsnorm_args,
    is_dtensor,
    normalize_dim,
    normalize_shape,
)

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement


def _compute_placements(x: DTensor, whole: set[int]) -> tuple[Placement, ...]:
    """x's placements with every ``Partial`` and every ``Shard`` of a dim in ``whole`` (the
    dims the op reduces over) turned into ``Replicate``."""
    from torch.distributed.tensor import Replicate

    ndim = x.dim()
    out = []
    for p in x.placements:
        if p.is_replicate():
            out.append(p)
        elif p.is_shard():
            out.append(Replicate() if p.dim % ndim in whole else p)
        elif p.is_partial():
            out.append(Replicate())
        else:
            raise TypeError(f"x has placement {p!r}, which fusedops' ops do not take "
                            "(Shard, Replicate and Partial are supported)")
    return tuple(out)


def _with_dim(p: Placement, dim: int) -> Placement:
    """The shard placement ``p`` (Shard or a strided shard) of tensor dim ``dim`` instead."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):
        return _StridedShard(dim, split_factor=p.split_factor)
    return Shard(dim)


def _local(t: object, name: str, x: DTensor, compute: tuple[Placement, ...],
           target: Sequence[Placement]) -> torch.Tensor:
    """``t``'s local tensor laid out as ``target`` on x's mesh (redistributed if need be), with
    its gradient ``Partial`` on the mesh dims where x is sharded and ``t`` is not (each rank's
    gradient is then its own rows' share)."""
    from torch.distributed.tensor import Partial

    if not is_dtensor(t):
        raise TypeError(
            f"{name} is a plain torch.Tensor but x is a DTensor: pass {name} as a DTensor on "
            f"x's device mesh (e.g. torch.distributed.tensor.distribute_tensor({name}, mesh, "
            "[Replicate()]))")
    if t.device_mesh != x.device_mesh:
        raise ValueError(f"{name} is on device mesh {t.device_mesh} but x is on "
                         f"{x.device_mesh}")
    target = tuple(target)
    if tuple(t.placements) != target:
        t = t.redistribute(x.device_mesh, target)
    grads = [Partial() if xp.is_shard() and not tp.is_shard() else tp
             for xp, tp in zip(compute, target, strict=True)]
    return _materialised(t.to_local(grad_placements=grads))


def _replicated(t: object, name: str, x: DTensor,
                compute: tuple[Placement, ...]) -> torch.Tensor | None:
    from torch.distributed.tensor import Replicate

    if t is None:
        return None
    return _local(t, name, x, compute, [Replicate()] * len(compute))


def _mask_placements(mask: DTensor, x: DTensor,
                     compute: tuple[Placement, ...]) -> list[Placement]:
    """The mask's placements matching x's ``compute`` ones: Shard of its own dim that lines up
    with x's sharded dim (counted from the right, as broadcasting does), Replicate where it
    broadcasts along it."""
    from torch.distributed.tensor import Replicate

    lead = x.dim() - mask.dim()
    out = []
    for p in compute:
        if p.is_shard() and p.dim - lead >= 0 and mask.shape[p.dim - lead] != 1:
            out.append(_with_dim(p, p.dim - lead))
        else:
            out.append(Replicate())
    return out


def _wrap(y: torch.Tensor, x: DTensor, compute: tuple[Placement, ...]) -> DTensor:
    """The local result ``y`` (x's local shape, contiguous) as a DTensor of x's global shape."""
    from torch.distributed.tensor import DTensor

    if y.requires_grad:
        y = _Plain.apply(y)  # (the output's gradient reaches the op's backward plain)
    shape = x.shape
    stride, step = [0] * len(shape), 1
    for i in range(len(shape) - 1, -1, -1):
        stride[i] = step
        step *= max(shape[i], 1)
    return DTensor.from_local(y, x.device_mesh, compute, run_check=False, shape=shape,
                              stride=tuple(stride))


def _shard_salt(x: DTensor, compute: tuple[Placement, ...]) -> int:
    """A number identifying this rank's shard (0 when x is not sharded): dropout's seed is
    mixed with it so that shards draw independent masks and replicas the same one."""
    coord = x.device_mesh.get_coordinate()
    index = 0
    for i, p in enumerate(compute):
        if p.is_shard():
            index = index * x.device_mesh.size(i) + coord[i]
    return index


def softmax(x: DTensor, dim: int, dtype: torch.dtype | None, scale: float | None,
            mask: DTensor | None, causal: bool, fn: Callable) -> DTensor:
    """:func:`fusedops.fused_softmax` (``fn``) of a DTensor ``x``: a DTensor of x's shape, the
    normalised dim (and the last two with ``causal``) replicated."""
    from fusedops.ops.softmax_masked import check_mask_args

    check_float_tensor(x, "x")
    d = normalize_dim(dim, x.dim())
    check_float_dtype(dtype)
    check_mask_args(x, scale, mask, causal)
    whole = {d} | ({x.dim() - 2, x.dim() - 1} if causal else set())
    compute = _compute_placements(x, whole)
    local_mask = None
    if mask is not None:
        local_mask = _local(mask, "mask", x, compute, _mask_placements(mask, x, compute))
    x_local = _x_local(x, compute)
    y = fn(x_local, d, dtype, scale=scale, mask=local_mask, causal=causal)
    return _wrap(y, x, compute)


def layernorm(x: DTensor, normalized_shape: object, weight: DTensor | None,
              bias: DTensor | None, eps: float, residual: DTensor | None, dropout_p: float,
              activation: str | None, training: bool,
              fn: Callable) -> DTensor | tuple[DTensor, DTensor]:
    """:func:`fusedops.fused_layernorm` (``fn``) of a DTensor ``x`` (with its epilogue): a
    DTensor of x's shape (the pair ``(out, x + residual)`` with ``residual``), the normalised
    dims replicated."""
    from fusedops.ops.layernorm_epilogue import check_epilogue_args

    shape = normalize_shape(normalized_shape)
    check_layernorm_args(x, shape, weight, bias, eps)
    check_epilogue_args(x, residual, dropout_p, activation, training)
    compute = _compute_placements(x, set(range(x.dim() - len(shape), x.dim())))
    w = _replicated(weight, "weight", x, compute)
    b = _replicated(bias, "bias", x, compute)
    r = None if residual is None else _local(residual, "residual", x, compute, compute)
    x_local = _x_local(x, compute)
    dropout = training and dropout_p > 0.0
    with _philox.seed_salt(_shard_salt(x, compute) if dropout else 0):
        out = fn(x_local, normalized_shape, w, b, eps, residual=r, dropout_p=dropout_p,
                 activation=activation, training=training)
    if residual is None:
        return _wrap(out, x, compute)
    return _wrap(out[0], x, compute), _wrap(out[1], x, compute)


def rmsnorm(x: DTensor, normalized_shape: object, weight: DTensor | None, eps: float | None,
            fn: Callable) -> DTensor:
    """:func:`fusedops.fused_rmsnorm` (``fn``) of a DTensor ``x``: a DTensor of x's shape, the
    normalised dims replicated."""
    shape = normalize_shape(normalized_shape)
    check_rmsnorm_args(x, shape, weight, eps)
    compute = _compute_placements(x, set(range(x.dim() - len(shape), x.dim())))
    w = _replicated(weight, "weight", x, compute)
    y = fn(_x_local(x, compute), normalized_shape, w, eps)
    return _wrap(y, x, compute)


def _x_local(x: DTensor, compute: tuple[Placement, ...]) -> torch.Tensor:
    """x's local tensor laid out as ``compute`` (redistributed if need be)."""
    if tuple(x.placements) != compute:
        x = x.redistribute(x.device_mesh, compute)
    return _materialised(x.to_local())


def _waited(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``, or the plain tensor it wraps if it is a collective's result still in flight
    (``AsyncCollectiveTensor``: it waits when an op reads it, but the kernels read memory)."""
    if t is None or t.__class__ is torch.Tensor or not hasattr(t, "trigger_wait"):
        return t
    return t.trigger_wait()


class _Plain(torch.autograd.Function):
    """Identity that hands the kernels plain tensors both ways: the forward's input and the
    gradient coming back (DTensor's backward may deliver it still in flight)."""

    @staticmethod
    def forward(ctx, t):
        w = _waited(t)
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return _waited(grad)


def _materialised(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor (see :func:`_waited`), not copied, with autograd's link kept."""
    if t.__class__ is torch.Tensor or not hasattr(t, "trigger_wait"):
        return t
    return _Plain.apply(t) if t.requires_grad else t.trigger_wait()
