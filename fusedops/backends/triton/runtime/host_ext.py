"""Replay plans handed to the C++ host extension, ``fusedops._host_ext`` (``csrc/host/``).

A replay runner's steps (``plans.replay_runner``) become a plan the extension launches itself
through the CUDA driver, behind C++ autograd nodes: no Python in a replayed call's backward. A
step converts where its kernel's launch is a plain one (no cooperative grid, programmatic
launch or cluster), every argument's type is one the extension packs, and the compiled
kernel's parameter count (read from its PTX) is the runtime arguments plus Triton's trailing
scratch pointers. Anything else keeps the Python path.
"""

from __future__ import annotations

import functools
import os
import struct

import torch

from fusedops.backends.triton.runtime.launcher import hooks_registered

try:
    from fusedops import _host_ext as ext
except ImportError:  # not built (pip's isolated build, no compiler): the Python paths
    ext = None

# Launches kernels (a CUDA build) and not switched off (FUSEDOPS_HOST_EXT=0).
AVAILABLE = ext is not None and ext.WITH_CUDA and os.environ.get("FUSEDOPS_HOST_EXT") != "0"

_INT_BYTES = {"i1": 1, "u1": 1, "i8": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4,
              "i64": 8, "u64": 8}
_U64 = (1 << 64) - 1


def scalar_bits(ty: str, value: object) -> int | None:
    """A scalar kernel argument of Triton type ``ty`` as the 64-bit word whose low bytes are
    the parameter (little-endian), or None for a type the extension does not pack."""
    if ty in _INT_BYTES:
        return int(value) & _U64
    if ty in ("fp32", "f32"):
        return struct.unpack("<I", struct.pack("<f", float(value)))[0]
    if ty == "fp64":
        return struct.unpack("<Q", struct.pack("<d", float(value)))[0]
    return None


def ptx_param_count(ptx: str, name: str) -> int | None:
    """The number of parameters of kernel ``name``'s ``.entry`` in ``ptx`` (None: not found)."""
    start = ptx.find(f".entry {name}(")
    if start < 0:
        return None
    return ptx.count(".param", start, ptx.find(")", start))


def kernel_args(compiled, slots: tuple, tail: tuple) -> list | None:
    """The extension's argument list ``[(slot, bits), ...]`` of one launch of ``compiled``
    with pointer ``slots`` ``(tensor index, byte offset)`` then ``tail`` (scalars and
    constexprs, in signature order), or None where it cannot be packed."""
    try:
        types = list(compiled.src.signature.values())
        count = ptx_param_count(compiled.asm["ptx"], compiled.name)
    except (AttributeError, KeyError, TypeError):
        return None
    if count is None or len(types) != len(slots) + len(tail):
        return None
    args = []
    for i, ty in enumerate(types):
        if ty == "constexpr":
            continue
        if i < len(slots):
            if not ty.startswith("*"):
                return None
            args.append(slots[i])
            continue
        bits = None if ty.startswith("*") else scalar_bits(ty, tail[i - len(slots)])
        if bits is None:
            return None
        args.append((-1, bits))
    scratch = count - len(args)  # Triton's global and profile scratch pointers, passed null
    if not 0 <= scratch <= 2:
        return None
    return args + [(-1, 0)] * scratch


def host_plan(steps: tuple) -> int | None:
    """The extension's handle for replay ``steps`` (a runner's ``steps``), or None where a
    step cannot be converted (see the module docstring) or the extension is unavailable."""
    if not AVAILABLE or not steps:
        return None
    plan = []
    for go, grid, slots, tail, seeded in steps:
        entry, compiled = getattr(go, "c_entry", None), getattr(go, "compiled", None)
        if seeded is not None or entry is None or compiled is None:
            return None
        _, function, coop, pdl, (num_warps, num_ctas, shared) = entry
        if coop or pdl or num_ctas != 1:
            return None
        args = kernel_args(compiled, slots, tail)
        if args is None:
            return None
        plan.append((function, list((*grid, 1, 1)[:3]), 32 * num_warps, shared, args))
    handle = ext.make_plan(plan)
    return None if handle < 0 else handle


# c10::ScalarType codes of the dtypes a node's tensors may have.
_DTYPE_CODES = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
                torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.bool: 11,
                torch.bfloat16: 15}


def node_input(t: torch.Tensor | None) -> tuple:
    """What a node records of one input: (present, shape, dtype code, 16-byte alignment,
    requires_grad)."""
    if t is None:
        return (False, [], 6, 0, False)
    return (True, list(t.shape), _DTYPE_CODES[t.dtype], t.data_ptr() & 15, t.requires_grad)


def node_made(meta: tuple | None) -> tuple:
    """A new tensor of a node, from ``(shape, dtype)`` or None (absent: address 0)."""
    if meta is None:
        return (False, [], 6)
    return (True, list(meta[0]), _DTYPE_CODES[meta[1]])


def host_node(fwd_steps: tuple, bwd_steps: tuple, inputs: tuple, fwd_made: tuple, kept: tuple,
              bwd_made: tuple, grads: tuple, differentiable=None):
    """``node(x, a=None, b=None) -> y or None``: one call signature of an op as a C++ autograd
    node (``csrc/host/node.cpp``), or None where a plan does not convert or a dtype is not
    packed. ``inputs``: the recorded call's inputs (x first; None where absent); ``fwd_made``
    / ``bwd_made``: ``(shape, dtype)`` or None per new tensor of the forward (the output first)
    and the backward; ``kept``: forward slots (inputs, then the forward's new tensors) the
    backward reads after dy; ``grads``: per input, ``(index into bwd_made or -1, dtype,
    shape)``; ``differentiable``: the backward under ``create_graph=True``, ``(dy, kept, needs)
    -> [gradient or None per input]`` in differentiable torch ops (None: such a backward
    raises). The node refuses (None) calls whose tensors differ from ``inputs``, and Triton
    launch hooks (a profiler's) send every call to the Python path."""
    try:
        spec = ([node_input(t) for t in inputs], [node_made(m) for m in fwd_made], list(kept),
                [node_made(m) for m in bwd_made],
                [(g[0], _DTYPE_CODES[g[1]], list(g[2])) for g in grads])
    except KeyError:
        return None
    fwd = host_plan(fwd_steps)
    bwd = host_plan(bwd_steps) if fwd is not None else None
    if bwd is None:
        return None
    handle = ext.make_node(fwd, bwd, *spec, differentiable)
    if handle < 0:
        return None
    apply = functools.partial(ext.node, handle)

    def node(x: torch.Tensor, a: torch.Tensor | None = None, b: torch.Tensor | None = None
             ) -> torch.Tensor | None:
        return None if hooks_registered() else apply(x, a, b)
    return node


def input_grads(metas: tuple, inputs: tuple) -> tuple:
    """``host_node``'s ``grads`` where the backward's new tensors begin with the inputs'
    gradients in input order (``metas``: their ``(shape, dtype)`` or None, then any scratch):
    per input, that tensor (-1 where the backward makes none) in the input's dtype and shape."""
    like = inputs[0]
    return tuple((i if meta is not None else -1, (like if t is None else t).dtype,
                  () if t is None else t.shape)
                 for i, (meta, t) in enumerate(zip(metas[:len(inputs)], inputs, strict=True)))
