"""Training calls through C++ autograd nodes (the ``*_NODE`` tables of ``fusedops._replay``):
the lookup an op makes per training call above its size rule, and the registration a
signature's first backward makes."""

from __future__ import annotations

import torch

from fusedops import _dispatch
from fusedops.ops._rows import is_last_dim

_Tensor = torch.Tensor
_node_eager = _dispatch.node_eager


def take(nodes: dict, x: torch.Tensor, normalized_shape: object, eps: object,
         params: tuple) -> tuple[torch.Tensor | None, tuple | None]:
    """``(y, sig)`` for a training call: ``y`` from the node of its signature (x's shape,
    dtype, device and a float ``eps``, normalised over the last dim) where that node ran it;
    else ``sig``, the signature whose node the op's Python Function should make (its first
    sight: marked False meanwhile), or None (no node for this call: the op's own rules)."""
    if eps.__class__ is float and x.__class__ is _Tensor and _node_eager(x) \
            and is_last_dim(normalized_shape, x.shape[-1]):
        sig = (x.shape, x.dtype, x.get_device(), eps)
        node = nodes.get(sig)
        if node:
            y = node(x, *params)
            if y is not None:
                return y, None
        elif node is None and x.is_contiguous():
            nodes[sig] = False  # (until the Function's backward has made the node)
            return None, sig
    return None, None


def make(nodes: dict, sig: tuple, maker: str, x: torch.Tensor, *args) -> None:
    """Register the node of ``sig`` made by the backend's ``maker(x, *args)`` (False where the
    backend has no such maker or makes none)."""
    make_node = getattr(_dispatch.backend_for(x), maker, None)
    made = None if make_node is None else make_node(x, *args)
    nodes[sig] = made or False
