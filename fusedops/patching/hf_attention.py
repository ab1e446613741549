"""Hugging Face eager attention with the fused ``softmax(scores * scaling + mask)``.

Hugging Face models whose class declares ``_supports_attention_backend`` run attention through
``ALL_ATTENTION_FUNCTIONS``, picked by ``config._attn_implementation``; its contract is the
eager function's: ``fn(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
-> (attn_output, attn_weights)``, query/key/value ``(B, heads, L, head_dim)``, the output
``(B, L, heads, head_dim)``. That registry is Transformers' documented extension point (it is how
SDPA and flash attention plug in). :func:`patch_model` registers :func:`fused_eager_attention`
there under :data:`NAME` and gives each attention module whose config chose ``"eager"`` a
private view of that config (:func:`config_view`) that names it, so the shared config object,
and every other model built from it, stays as it was; unpatching puts the shared config back.

The function computes what the model's own ``eager_attention_forward`` does, with the scale,
mask add and softmax in one kernel (in float32, rounded once). Calls with arguments it does not
implement (``softcap``, attention sinks ``s_aux``, a ``head_mask``, a non-4-D mask or query) are
handed to the model's own eager function unchanged.
"""

from __future__ import annotations

import copy
import inspect
import sys
from typing import Any

import torch
from torch import nn

from fusedops import _dispatch
from fusedops.ops.softmax_masked import masked_softmax, replay_runner
from fusedops.patching import fx_patterns
from fusedops.patching.routing import routing_off

NAME = "fusedops_eager"
_DELEGATED_KWARGS = frozenset(("softcap", "s_aux", "sinks", "head_mask"))
_registered = False


def available() -> bool:
    try:
        from transformers import AttentionInterface  # noqa: F401
        from transformers.masking_utils import AttentionMaskInterface  # noqa: F401
    except Exception:
        return False
    return True


def register() -> None:
    """Register :func:`fused_eager_attention` (and the eager mask format) under :data:`NAME`."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, fused_eager_attention)
    AttentionMaskInterface.register(NAME, eager_mask)  # the same masks eager gets
    _registered = True


def config_view(config: Any) -> Any:
    """A shallow copy of ``config`` whose attention implementation is :data:`NAME` (set
    directly: the property's setter would also switch the sub-configs it shares)."""
    view = copy.copy(config)
    slot = "_attn_implementation_internal"
    view.__dict__[slot if slot in config.__dict__ else "_attn_implementation"] = NAME
    return view


def model_eager_function(module: nn.Module) -> Any:
    """The ``eager_attention_forward`` of the module's own modeling file, or None."""
    mod = sys.modules.get(type(module).__module__)
    return getattr(mod, "eager_attention_forward", None)


def uses_attention_registry(module: nn.Module) -> bool:
    """Whether the module's forward reads ``ALL_ATTENTION_FUNCTIONS`` (so the config's
    ``_attn_implementation`` picks its attention function)."""
    fn = inspect.unwrap(type(module).forward)
    code = getattr(fn, "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


# module class -> (its modeling file's eager function, whether that returns a contiguous
# output): what the fused function stands in for, read once per class.
_eager_of: dict[type, tuple[Any, bool]] = {}


def _eager(module: nn.Module) -> tuple[Any, bool]:
    found = _eager_of.get(type(module))
    if found is None:
        eager = model_eager_function(module)
        code = getattr(inspect.unwrap(eager), "__code__", None)
        found = _eager_of[type(module)] = (eager, code is not None
                                           and "contiguous" in code.co_names)
    return found


_ATTENTION_RULES = _dispatch.SIZE_RULES["attention"]
_NATIVE_AUTOGRAD = _dispatch.NATIVE_AUTOGRAD
_grad_enabled = torch.is_grad_enabled
_native_now = _dispatch.native_now
_plain_eager_checked = _dispatch.plain_eager_checked
_replay_checked = _dispatch.replay_checked
_any_autocast = _dispatch._any_autocast
_stack_depth = torch._C._len_torch_function_stack
_INF = float("inf")
# Calls below the size rule that may run fused (inference calls with a mask; training calls
# where _dispatch.NATIVE_AUTOGRAD), by (id of the attention module, query shape, key length):
# present once that module has run a call of that shape. Its second such
# call runs fused, and the fused op replays its launch from then on (fusedops._replay, one plan
# per shape for every layer); a shape a module meets once (each decoding step's new key length
# in a single generate) stays on the model's own function, whose host cost is lower than the
# fused op's first, unreplayed call. Bounded: emptied when it reaches SEEN_MAX.
SEEN: dict[tuple, bool] = {}
SEEN_MAX = 1 << 16


def fused_eager_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention, ``softmax(q @ k^T * scaling + mask) @ v``, its softmax fused; the
    model's own eager function where the fused softmax would not pay (the size rule of
    ``fusedops._dispatch``, :data:`SEEN`) or that does more (``softcap``, sinks, a head
    mask)."""
    eager, contiguous = _eager_of.get(module.__class__) or _eager(module)
    shape = query.shape
    # The size rule inline, as the ops read it (host cost per call: decoding steps and small
    # batches call this many times per forward, the model's own function below the rule).
    grad = (query.requires_grad or key.requires_grad) and _grad_enabled()
    rule = (True, query.dtype, grad) if query.is_cuda else (
        "cpu" if query.is_cpu else query.device.type, query.dtype, grad)
    below = _ATTENTION_RULES.get(rule)
    if below is None:
        below = _dispatch.size_rule("attention", rule)
    if len(shape) != 4 or attention_mask is not None and attention_mask.ndim != 4:
        fused = False
    elif shape[0] * shape[1] * shape[2] * key.shape[-2] >= below:
        fused = not _native_now()
    elif (not _NATIVE_AUTOGRAD.get(rule[:2]) if grad else attention_mask is None) \
            or below == _INF or _native_now():
        # (Below the rule, a maskless inference call saves one native multiply, less than the
        # fused call's host cost: benchmarks/results/h200/attention-calls.json; a training
        # call pays less than the native ops only where its forward and backward replay from
        # C++ (_dispatch.NATIVE_AUTOGRAD). Nothing is entered in SEEN while torch.compile
        # traces: a guard on it would recompile.)
        fused = False
    else:
        seen = (id(module), shape, key.shape[-2])
        fused = seen in SEEN
        if not fused:
            if len(SEEN) >= SEEN_MAX:
                SEEN.clear()
            SEEN[seen] = True
    if not fused or kwargs and not _DELEGATED_KWARGS.isdisjoint(kwargs) \
            and any(kwargs.get(k) is not None for k in _DELEGATED_KWARGS):
        if fx_patterns.counts is not None:
            fx_patterns.count("hf_attention:unfused")
        return eager(module, query, key, value, attention_mask, scaling=scaling,
                     dropout=dropout, **kwargs)
    if fx_patterns.counts is not None:
        fx_patterns.count("hf_attention")
    # Routing off for the whole body: its one softmax is the fused op already, and none of its
    # other torch calls is routed (each would otherwise pass through the routing mode).
    if _stack_depth():
        with routing_off():
            return _attention(module, query, key, value, attention_mask, scaling, dropout,
                              contiguous, not grad)
    return _attention(module, query, key, value, attention_mask, scaling, dropout, contiguous,
                      not grad)


def _attention(module, query, key, value, attention_mask, scaling, dropout, contiguous,
               inference):
    """The fused body of :func:`fused_eager_attention` (arguments as it was given them;
    ``inference``: no gradient needed, and torch.compile/torch.func were checked)."""
    shape = query.shape
    if scaling is None:
        scaling = shape[-1] ** -0.5
    if key.shape[1] != shape[1]:  # grouped-query attention: a KV head per group
        groups = shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3))
    mask = attention_mask
    if mask is not None and mask.shape[-1] != key.shape[-2]:
        mask = mask[:, :, :, : key.shape[-2]]
    scale = scaling if scaling.__class__ is float else float(scaling)
    weights = None
    if scores.__class__ is torch.Tensor and (
            mask is None or mask.__class__ is torch.Tensor and not mask.requires_grad):
        # A replayed launch straight from here: masked_softmax's own checks would repeat what
        # this call has established (host cost per attention layer). A training call replays
        # through its C++ autograd node, under autocast too: its weights come out in the
        # scores' dtype, as the model's own function makes them.
        if inference:
            run = replay_runner(scores, mask, scale, False) if _plain_eager_checked() else None
            if run:
                weights = run(scores, mask)
        elif _replay_checked():
            run = replay_runner(scores, mask, scale, False)
            node = run.native if run else None
            if node:
                weights = node(scores, mask)
    if weights is None:
        if inference or not _any_autocast():
            weights = masked_softmax(scores, -1, None, scale, mask, False)
        else:
            # (Without autocast the call can register its replay and make its C++ node.)
            with torch.autocast(scores.device.type, enabled=False):
                weights = masked_softmax(scores, -1, None, scale, mask, False)
    # Freed before the second matmul (the model's own function rebinds its one name): held,
    # the scores would stay alive beside the weights and the output, raising the peak.
    del scores
    if dropout:
        weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights if weights.dtype == value.dtype else weights.to(value.dtype),
                       value).transpose(1, 2)
    return out.contiguous() if contiguous else out, weights
