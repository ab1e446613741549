"""End-to-end model benchmark: ``python -m fusedops bench-models``.

Does ``fusedops.patch_model`` make whole models faster, and never slower? For each model (BERT-
base, GPT-2 124M, a Llama-style 0.4B decoder; random weights, eager attention, see
``fusedops.tools._model_zoo``), shape (batch x tokens) and mode it times up to four variants
of the same weights, interleaved round robin in one process so machine drift hits all alike:

* ``eager``: the unpatched model; ``patched``: after ``fusedops.patch_model``;
* ``compiled``: ``torch.compile`` of the unpatched model; ``compiled+patched``: of the patched.

Each variant is its own deep copy of one prototype per (model, mode), made before any patching
or compiling, so no compiled graph is invalidated by another variant's patching. Every shape
starts from the prototype's weights, reloaded in place into each copy and checked identical
(training steps move each copy differently). Patched copies are unpatched (and checked against
the unpatched copy) once their mode is done.

Modes: ``infer`` (forward under ``torch.no_grad()``, model cast to ``--dtype``); ``train`` (one
step: forward under autocast, loss, backward, SGD ``step()``, ``zero_grad(set_to_none=True)``;
float32 weights); ``generate`` (decoders only: greedy ``generate`` of exactly ``--new-tokens``
tokens with the KV cache after a ``--gen-shapes`` prompt).

Measured per (model, shape, mode, variant):

* wall: ``perf_counter`` from the step's start to after a device synchronize, median and
  20%/80% quantiles over the rounds;
* host: ``perf_counter`` from the step's start until the Python call returns, before any
  synchronize: what the host spends issuing the step;
* GPU (CUDA): the GPU's own time with the host far ahead: the stream is blocked by
  ``torch.cuda._sleep``, a CUDA event, the step, a second event; valid only if the host finished
  issuing before the sleep ended (else retried with a longer sleep, then reported as None);
* peak memory (CUDA): ``max_memory_allocated`` during one step, above what was allocated when
  it started (``peak_total_mb``: the absolute peak, every resident copy included);
* first call: the first step's wall time (for compiled variants: compilation included), never
  part of the timings; tokens/s for ``generate``;
* correctness: before timing, every variant's output (``infer``: the judged output tensor;
  ``train``: output, loss and every gradient of one forward/backward in eval mode;
  ``generate``: the token ids) against the ``eager`` one: max |diff| / max |eager|, flagged
  (never failed) beyond the dtype's tolerance.
"""

from __future__ import annotations

import argparse
import copy
import csv
import datetime as _dt
import gc
import inspect
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusedops.tools import _model_zoo as zoo
from fusedops.tools import _report
from fusedops.tools.bench import CHECK_TOL
from fusedops.tools.cli import torch_threads

VARIANTS = ("eager", "patched", "compiled", "compiled+patched")
MODES = ("infer", "train", "generate")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_SHAPES = "1x128,8x512,32x512"
DEFAULT_GEN_SHAPES = "1x32,8x32"
RATIOS = (("patched", "eager"), ("compiled+patched", "compiled"))
NOISE = 0.02  # ratios within 1 +- NOISE are "same"
MIN_VERDICT_ROUNDS = 5
LR = 1e-4
GPU_SAMPLES = 5
SLEEP_MIN_MS = 20.0
SLEEP_MAX_MS = 5000.0


class ArgError(ValueError):
    """A bad command-line value; the message names the argument."""


@dataclass
class Options:
    """Everything one run needs, resolved and validated (see :func:`resolve`)."""

    models: tuple[str, ...] = zoo.MODELS
    shapes: tuple[tuple[int, int], ...] = ((1, 128), (8, 512), (32, 512))
    gen_shapes: tuple[tuple[int, int], ...] = ((1, 32), (8, 32))
    modes: tuple[str, ...] = MODES
    variants: tuple[str, ...] = ("eager", "patched")
    device: str = "cpu"
    preset: str = "tiny"
    dtype: str = "fp32"
    rounds: int = 10
    gen_rounds: int = 5
    warmup: int = 3
    new_tokens: int = 128
    threads: int | None = None
    out: str = "bench_models_out"
    compile_backend: str = "inductor"
    force_patch: bool = False
    patch_accepts_force: bool = False
    seed: int = 0
    quiet: bool = False
    plot: bool = True
    argv: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fusedops bench-models",
        description="Whole-model benchmark of fusedops.patch_model: eager / patched / compiled / "
                    "compiled+patched, interleaved in one process.")
    p.add_argument("--models", default=",".join(zoo.MODELS), help="bert,gpt2,llama")
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help=f"BATCHxTOKENS for infer/train (default {DEFAULT_SHAPES})")
    p.add_argument("--gen-shapes", default=DEFAULT_GEN_SHAPES,
                   help=f"BATCHxPROMPT for generate (default {DEFAULT_GEN_SHAPES})")
    p.add_argument("--modes", default=",".join(MODES), help="infer,train,generate")
    p.add_argument("--variants", default=None,
                   help="eager,patched,compiled,compiled+patched (default: all four on CUDA, "
                        "eager,patched elsewhere)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="inference dtype and training autocast dtype (default bf16 on CUDA, "
                        "fp32 elsewhere: no autocast)")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds (default 10)")
    p.add_argument("--gen-rounds", type=int, default=None,
                   help="timed rounds for generate (default min(rounds, 5))")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant after the "
                   "first call (default 3; 1 for generate)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated (default 128)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--preset", default=None, choices=zoo.PRESETS,
                   help="model sizes (default full on CUDA, tiny elsewhere)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--out", default="bench_models_out", help="output folder")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    p.add_argument("--force-patch", action="store_true",
                   help="patch_model(force=True) where patch_model accepts it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def _pick(text: str, arg: str, allowed: Sequence[str]) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    if not items:
        raise ArgError(f"{arg}: empty list (choose from {', '.join(allowed)})")
    for item in items:
        if item not in allowed:
            raise ArgError(f"{arg}: unknown value {item!r} (choose from {', '.join(allowed)})")
    return tuple(dict.fromkeys(items))


def parse_shapes(text: str, arg: str = "--shapes") -> tuple[tuple[int, int], ...]:
    """``"1x128,8x512"`` -> ``((1, 128), (8, 512))``; :class:`ArgError` naming ``arg``."""
    shapes = []
    for item in (s.strip() for s in text.split(",")):
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ArgError(f"{arg}: {item!r} is not BATCHxTOKENS with positive integers "
                           "(e.g. 8x512)")
        shapes.append((int(parts[0]), int(parts[1])))
    return tuple(dict.fromkeys(shapes))


def _positive(value: int, arg: str) -> int:
    if value < 1:
        raise ArgError(f"{arg}: must be at least 1, got {value}")
    return value


def resolve(args: argparse.Namespace, argv: Sequence[str] = ()) -> Options:
    """Validate the parsed arguments and fill the device-dependent defaults."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type not in ("cuda", "cpu"):
        raise ArgError(f"--device: {device!r} is not supported (cuda or cpu)")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ArgError("--device: cuda requested but CUDA is not available")
    cuda = torch.device(device).type == "cuda"
    default_variants = ",".join(VARIANTS if cuda else VARIANTS[:2])
    rounds = _positive(args.rounds, "--rounds")
    if args.threads is not None:
        _positive(args.threads, "--threads")
    return Options(
        models=_pick(args.models, "--models", zoo.MODELS),
        shapes=parse_shapes(args.shapes, "--shapes"),
        gen_shapes=parse_shapes(args.gen_shapes, "--gen-shapes"),
        modes=_pick(args.modes, "--modes", MODES),
        variants=tuple(v for v in VARIANTS  # canonical order: eager first, the reference
                       if v in _pick(args.variants or default_variants, "--variants", VARIANTS)),
        device=device, preset=args.preset or ("full" if cuda else "tiny"),
        dtype=args.dtype or ("bf16" if cuda else "fp32"), rounds=rounds,
        gen_rounds=_positive(args.gen_rounds or min(rounds, 5), "--gen-rounds"),
        warmup=max(0, args.warmup), new_tokens=_positive(args.new_tokens, "--new-tokens"),
        threads=args.threads, out=args.out, compile_backend=args.compile_backend,
        force_patch=args.force_patch,
        patch_accepts_force="force" in inspect.signature(_patch_model()).parameters,
        seed=args.seed, quiet=args.quiet, plot=not args.no_plot, argv=list(argv))


def _patch_model() -> Callable[..., Any]:
    import fusedops

    return fusedops.patch_model


def _check_lengths(opts: Options) -> None:
    """Every requested sequence must fit each model's position embeddings."""
    longest = max(t for _, t in opts.shapes)
    longest_gen = max(p for _, p in opts.gen_shapes) + opts.new_tokens
    for name in opts.models:
        limit = zoo.max_positions(zoo.config_for(name, opts.preset))
        if any(m in opts.modes for m in ("infer", "train")) and longest > limit:
            raise ArgError(f"--shapes: {longest} tokens exceed {name}'s {limit} positions")
        if "generate" in opts.modes and name in zoo.DECODERS and longest_gen > limit:
            raise ArgError(f"--gen-shapes/--new-tokens: prompt + new tokens = {longest_gen} "
                           f"exceed {name}'s {limit} positions")


# ---------------------------------------------------------------------------------------------
# variants


@dataclass
class Variant:
    """One variant's own copy of the model (and its optimizer in ``train`` mode)."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    error: str | None = None


def _short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _apply_patch(model: nn.Module, opts: Options) -> dict:
    """``patch_model`` on ``model``; returns what it did (counts, time, ``applied``)."""
    kwargs = {"force": True} if opts.force_patch and opts.patch_accepts_force else {}
    t0 = time.perf_counter()
    report = _patch_model()(model, **kwargs)
    seconds = time.perf_counter() - t0
    replaced = list(getattr(report, "replaced", []) or [])
    patterns = list(getattr(report, "fused_patterns", []) or [])
    return {
        "seconds": seconds,
        "applied": getattr(report, "applied", None),
        "forced": bool(kwargs),
        "replaced": len(replaced),
        "fused_types": _counts(r.get("fused_type") for r in replaced),
        "fused_patterns": len(patterns),
        "patterns": _counts(f"{r.get('pattern')} ({r.get('via')})" for r in patterns),
        "skipped": len(getattr(report, "skipped", []) or []),
        "pattern_skipped": len(getattr(report, "pattern_skipped", []) or []),
    }


def _counts(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[str(item)] = out.get(str(item), 0) + 1
    return out


def _same_weights(models: Sequence[nn.Module]) -> bool:
    first = [p.detach() for p in models[0].parameters()]
    for model in models[1:]:
        params = [p.detach() for p in model.parameters()]
        if len(params) != len(first) or not all(
                torch.equal(a, b) for a, b in zip(first, params, strict=True)):
            return False
    return True


def make_variants(proto: nn.Module, mode: str, opts: Options) -> tuple[list[Variant], dict]:
    """One deep copy of ``proto`` per variant, patched and/or compiled (``nn.Module.compile``,
    in place, so ``generate``'s own ``self(...)`` calls run compiled). Returns the variants and
    ``{"patch": {variant: what patch_model did}}``."""
    variants, patch = [], {}
    for name in opts.variants:
        v = Variant(name, copy.deepcopy(proto))
        try:
            if "patched" in name:
                patch[name] = _apply_patch(v.model, opts)
            if name.startswith("compiled"):
                v.model.compile(backend=opts.compile_backend,
                                dynamic=None if mode == "generate" else False)
        except Exception as exc:
            v.error = _short_error(exc)
        if mode == "train":
            v.model.train()
            v.optimizer = torch.optim.SGD(v.model.parameters(), lr=LR)
        variants.append(v)
    return variants, {"patch": patch}


def reset_weights(variants: Sequence[Variant], proto: nn.Module) -> bool:
    """Load ``proto``'s parameters and buffers into every variant (in place, so compiled graphs
    and optimizers keep theirs): training steps of an earlier shape moved each copy's weights
    differently (dropout draws differ). True when every variant now equals ``proto``."""
    state = proto.state_dict()
    for v in variants:
        v.model.load_state_dict(state)
    return _same_weights([proto, *(v.model for v in variants)])


def unpatch_variants(variants: Sequence[Variant]) -> dict[str, bool]:
    """``unpatch_model`` on the patched copies; True where every module class (and the attention
    implementation) is back to the unpatched copy's."""
    import fusedops

    plain = next((v.model for v in variants if "patched" not in v.name), None)
    out = {}
    for v in variants:
        if "patched" not in v.name:
            continue
        fusedops.unpatch_model(v.model)
        if plain is None:
            out[v.name] = not getattr(fusedops.patching, "is_patched", lambda m: False)(v.model)
            continue
        same_types = [type(m) for m in v.model.modules()] == [type(m) for m in plain.modules()]
        same_attn = (getattr(v.model.config, "_attn_implementation", None)
                     == getattr(plain.config, "_attn_implementation", None))
        out[v.name] = same_types and same_attn
    return out


# ---------------------------------------------------------------------------------------------
# measuring


def _quantiles(values: Sequence[float]) -> dict[str, float | None]:
    """Median and 20%/80% quantiles (linear interpolation between closest ranks)."""
    v = sorted(values)
    if not v:
        return {"median": None, "p20": None, "p80": None}

    def q(p: float) -> float:
        pos = p * (len(v) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return v[lo] + (v[hi] - v[lo]) * (pos - lo)

    return {"median": q(0.5), "p20": q(0.2), "p80": q(0.8)}


def _sync_fn(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def time_once(step: Callable[[], Any], sync: Callable[[], None]) -> tuple[float, float]:
    """(wall, host) seconds of one step: the device is idle at the start; host = until the
    call returns, wall = until the device is done."""
    sync()
    t0 = time.perf_counter()
    step()
    t1 = time.perf_counter()
    sync()
    return time.perf_counter() - t0, t1 - t0


def time_rounds(steps: dict[str, Callable[[], Any]], sync: Callable[[], None], rounds: int,
                warmup: int) -> tuple[dict[str, list[tuple[float, float]]], dict[str, str]]:
    """Warm every step up, then ``rounds`` rounds, each timing every step once (the starting
    step rotates each round). The same :func:`time_once` times every variant; the garbage
    collector runs between rounds, never inside one. A step that raises is dropped with its
    error. Returns ``({name: [(wall_s, host_s) per round]}, {name: error})``."""
    live = dict(steps)
    errors: dict[str, str] = {}
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in steps}
    for name, step in steps.items():
        try:
            for _ in range(warmup):
                step()
        except Exception as exc:
            errors[name] = _short_error(exc)
            live.pop(name)
    # Objects alive now (torch, transformers, the models) are left out of the collections
    # between rounds, which then cost what the rounds allocated, not the whole process.
    gc.freeze()
    try:
        for r in range(rounds):
            names = list(live)
            if not names:
                break
            order = names[r % len(names):] + names[:r % len(names)]
            gc.collect()
            gc.disable()
            try:
                for name in order:
                    try:
                        samples[name].append(time_once(live[name], sync))
                    except Exception as exc:
                        errors[name] = _short_error(exc)
                        live.pop(name)
            finally:
                gc.enable()
    finally:
        gc.unfreeze()
    return samples, errors


_CYCLES_PER_MS: list[float] = []


def _cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep`` (measured once per process)."""
    if not _CYCLES_PER_MS:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 20_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        _CYCLES_PER_MS.append(cycles / max(start.elapsed_time(end), 1e-3))
    return _CYCLES_PER_MS[0]


def gpu_once(step: Callable[[], Any], sleep_ms: float) -> tuple[float | None, float, float]:
    """One step enqueued behind a ``sleep_ms`` GPU sleep: ``(GPU ms between the events around
    the step, or None if the host was still issuing when the sleep ended; host ms from before
    the sleep was enqueued until the step returned; measured sleep ms)``."""
    torch.cuda.synchronize()
    e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    cycles = int(sleep_ms * _cycles_per_ms())
    t0 = time.perf_counter()
    e0.record()
    torch.cuda._sleep(cycles)
    e1.record()
    step()
    e2.record()
    issued_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    slept_ms = e0.elapsed_time(e1)
    return (e1.elapsed_time(e2) if issued_ms < slept_ms else None), issued_ms, slept_ms


def gpu_times(steps: dict[str, Callable[[], Any]], host_ms: dict[str, float],
              samples: int = GPU_SAMPLES) -> dict[str, dict]:
    """CUDA: the median GPU time of ``samples`` steps per variant (interleaved like the rounds),
    each behind a sleep of 3x the variant's median host time (at least 20 ms). An invalid
    sample is retried twice with a longer sleep; a variant whose host keeps catching up (a step
    that synchronizes inside) gets ``gpu_ms`` None and a ``gpu_note``."""
    sleep = {n: min(SLEEP_MAX_MS, max(SLEEP_MIN_MS, 3 * host_ms.get(n, 0.0) + 5)) for n in steps}
    got: dict[str, list[float]] = {n: [] for n in steps}
    notes: dict[str, str] = {}
    for _ in range(samples):
        for name, step in steps.items():
            if name in notes:
                continue
            for _attempt in range(3):
                ms, issued, slept = gpu_once(step, sleep[name])
                if ms is not None:
                    got[name].append(ms)
                    break
                sleep[name] = min(SLEEP_MAX_MS, max(4 * sleep[name], 2 * issued))
            else:
                notes[name] = (f"host still issuing after a {slept:.0f} ms GPU sleep "
                               f"({issued:.0f} ms): the step waits for the GPU")
    return {n: {"gpu_ms": None if n in notes else _quantiles(got[n])["median"],
                "gpu_note": notes.get(n), "gpu_samples": len(got[n])} for n in steps}


def peak_memory(step: Callable[[], Any], device: torch.device) -> tuple[float | None, float | None]:
    """CUDA: (MiB allocated at the peak of one step above what was allocated at its start,
    absolute peak MiB). (None, None) elsewhere."""
    if device.type != "cuda":
        return None, None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return (peak - before) / 2**20, peak / 2**20


# ---------------------------------------------------------------------------------------------
# correctness


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (inf on a shape mismatch, nan on non-finite values)."""
    return _rel_many([out], [ref])


def _rel_many(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> float:
    """The largest |out - ref| over all tensors / the largest |ref| over all tensors."""
    if len(outs) != len(refs) or any(a.shape != b.shape for a, b in zip(outs, refs, strict=True)):
        return math.inf
    diff = scale = 0.0
    for a, b in zip(outs, refs, strict=True):
        if b.numel():
            diff = max(diff, (a.detach().float() - b.detach().float()).abs().max().item())
            scale = max(scale, b.detach().float().abs().max().item())
    if math.isnan(diff):
        return math.nan
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def compare(outputs: list[torch.Tensor], ref: list[torch.Tensor], ref_name: str, mode: str,
            dtype_name: str, new_tokens: int) -> dict:
    """One variant's outputs against the reference variant's: relative differences (output;
    for ``train`` also loss and all gradients), the tolerance of ``dtype_name`` and whether
    they are within it; for ``generate`` the fraction of equal generated tokens."""
    if mode == "generate":
        a, b = outputs[0][:, -new_tokens:], ref[0][:, -new_tokens:]
        match = (a == b).float().mean().item() if a.shape == b.shape else 0.0
        return {"vs": ref_name, "token_match": match, "ok": match == 1.0}
    tol = CHECK_TOL.get(DTYPES[dtype_name], 1e-3)
    d: dict[str, Any] = {"vs": ref_name, "output_rel": _rel(outputs[0], ref[0])}
    if mode == "train":
        d["loss_rel"] = _rel(outputs[1], ref[1])
        d["grad_rel"] = _rel_many(outputs[2:], ref[2:])
    values = [v for k, v in d.items() if k.endswith("_rel")]
    d["max_rel"] = math.nan if any(math.isnan(v) for v in values) else max(values)
    d["tol"] = tol
    d["ok"] = d["max_rel"] <= tol
    return d


# ---------------------------------------------------------------------------------------------
# one group: a model, a mode, a shape, every variant


@dataclass
class Group:
    name: str
    mode: str
    batch: int
    tokens: int
    new_tokens: int | None

    @property
    def shape(self) -> str:
        text = f"{self.batch}x{self.tokens}"
        return text + (f"+{self.new_tokens}" if self.new_tokens else "")

    def record(self, variant: str) -> dict:
        return {"model": self.name, "mode": self.mode, "batch": self.batch,
                "tokens": self.tokens, "new_tokens": self.new_tokens, "shape": self.shape,
                "variant": variant, "status": "ok", "error": None}


def _steps_for(v: Variant, group: Group, inputs: dict, opts: Options,
               device: torch.device) -> tuple[Callable[[], Any], Callable[[], list] | None]:
    """The timed step of ``v`` and, for ``train``, its separate correctness pass."""
    if group.mode == "infer":
        return zoo.infer_step(v.model, inputs), None
    if group.mode == "generate":
        return zoo.generate_step(v.model, inputs, opts.new_tokens), None
    amp = None if opts.dtype == "fp32" else DTYPES[opts.dtype]
    autocast = zoo.autocast_for(device, amp)
    assert v.optimizer is not None
    return (zoo.train_step(v.model, inputs, v.optimizer, autocast),
            lambda: zoo.train_check(v.model, inputs, autocast))


def dynamo_counts() -> tuple[int, dict[str, int]]:
    """(graphs dynamo has compiled so far in this process, graph breaks by first line of their
    reason); (0, {}) when dynamo was never imported."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0, {}
    counters = utils.counters
    breaks: dict[str, int] = {}
    for reason, n in counters["graph_break"].items():
        key = str(reason).strip().splitlines()[0][:120] if str(reason).strip() else "?"
        breaks[key] = breaks.get(key, 0) + n
    return int(counters["stats"]["unique_graphs"]), breaks


def _compile_stats(before: tuple[int, dict[str, int]]) -> dict:
    graphs, breaks = dynamo_counts()
    new = {k: n - before[1].get(k, 0) for k, n in breaks.items() if n > before[1].get(k, 0)}
    return {"graphs": graphs - before[0], "graph_breaks": sum(new.values()),
            "graph_break_reasons": dict(sorted(new.items(), key=lambda kv: -kv[1])[:5])}


def first_call(v: Variant, group: Group, inputs: dict, opts: Options, device: torch.device,
               rec: dict) -> tuple[Callable[[], Any], list[torch.Tensor]]:
    """Run ``v``'s correctness pass (``train`` only, timed as ``check_s``) and its first step
    (timed as ``first_call_s``: compilation included for compiled variants); returns the step
    and the outputs to compare. Compiled variants also get ``compile``: the graphs and graph
    breaks dynamo produced meanwhile."""
    sync = _sync_fn(device)
    step, check = _steps_for(v, group, inputs, opts, device)
    counts = dynamo_counts() if v.name.startswith("compiled") else None
    outputs = None
    if check is not None:
        t0 = time.perf_counter()
        outputs = check()
        sync()
        rec["check_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = step()
    sync()
    rec["first_call_s"] = time.perf_counter() - t0
    if counts is not None:
        rec["compile"] = _compile_stats(counts)
    return step, outputs if outputs is not None else [out]


def _free(device: torch.device) -> None:
    """Return freed device memory to the driver (CUDA only; a no-op elsewhere)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def run_group(variants: Sequence[Variant], group: Group, opts: Options, device: torch.device,
              proto: nn.Module | None = None) -> tuple[list[dict], dict]:
    """Correctness check, first calls, interleaved timing, GPU time and peak memory of every
    variant at one (model, mode, shape), all starting from ``proto``'s weights when given.
    Returns (one record per variant, the summary row)."""
    same = reset_weights(variants, proto) if proto is not None else None
    if any(v.name.startswith("compiled") for v in variants):
        torch._dynamo.reset()  # fresh, shape-specialised graphs for this group
    vocab = zoo.vocab_size(variants[0].model)
    inputs = zoo.make_inputs(group.name, vocab, group.batch, group.tokens, device,
                             seed=opts.seed, labels=group.mode == "train")
    records = {v.name: group.record(v.name) for v in variants}
    steps: dict[str, Callable[[], Any]] = {}
    ref: tuple[str, list[torch.Tensor]] | None = None
    for v in variants:
        rec = records[v.name]
        try:
            if v.error:
                raise RuntimeError(v.error)
            step, outputs = first_call(v, group, inputs, opts, device, rec)
        except Exception as exc:
            rec.update(status="error", error=v.error or _short_error(exc))
            _free(device)
            continue
        if ref is None:
            ref = (v.name, outputs)
        else:
            rec["check"] = compare(outputs, ref[1], ref[0], group.mode, opts.dtype,
                                   opts.new_tokens)
        steps[v.name] = step
        del outputs
    del ref
    _free(device)
    generate = group.mode == "generate"
    rounds = opts.gen_rounds if generate else opts.rounds
    warmup = min(opts.warmup, 1) if generate else opts.warmup
    graphs_before = dynamo_counts()[0]
    samples, errors = time_rounds(steps, _sync_fn(device), rounds, warmup)
    recompiled = dynamo_counts()[0] - graphs_before
    _fill_timings(records, samples, errors, group)
    live = {n: s for n, s in steps.items() if n not in errors}
    if device.type == "cuda":
        _device_extras(live, records, generate, device)
    row = summarize_group(group, records, samples)
    row["weights_identical"] = same
    row["graphs_compiled_while_timing"] = recompiled
    return list(records.values()), row


def _device_extras(steps: dict[str, Callable[[], Any]], records: dict[str, dict],
                   generate: bool, device: torch.device) -> None:
    """CUDA: GPU time (not for ``generate``, whose stopping check waits for the GPU after
    every token) and peak memory of every variant, after its timed rounds."""
    note = None
    if generate:
        note = "generate waits for the GPU after every token: no GPU-only time"
    elif not hasattr(torch.cuda, "_sleep"):
        note = "torch.cuda._sleep is missing: no GPU-only time"
    else:
        host = {n: records[n]["host_ms"]["median"] for n in steps}
        try:
            for name, g in gpu_times(steps, host).items():
                records[name].update(g)
        except Exception as exc:
            note = f"GPU time failed: {_short_error(exc)}"
    for name, step in steps.items():
        if note:
            records[name]["gpu_note"] = note
        try:
            records[name]["peak_mb"], records[name]["peak_total_mb"] = peak_memory(step, device)
        except Exception as exc:
            records[name]["peak_note"] = f"failed: {_short_error(exc)}"
            _free(device)


def _fill_timings(records: dict[str, dict], samples: dict[str, list[tuple[float, float]]],
                  errors: dict[str, str], group: Group) -> None:
    for name, got in samples.items():
        rec = records[name]
        if name in errors:
            rec.update(status="error", error=errors[name])
        wall = [w * 1e3 for w, _ in got]
        host = [h * 1e3 for _, h in got]
        rec["wall_ms"] = _quantiles(wall)
        rec["host_ms"] = _quantiles(host)
        rec["samples_wall_ms"] = wall
        rec["samples_host_ms"] = host
        rec.setdefault("gpu_ms", None)
        median = rec["wall_ms"]["median"]
        if group.new_tokens and median:
            rec["tokens_per_s"] = group.batch * group.new_tokens / (median / 1e3)


def verdict(ratio: float | None, p20: float | None, p80: float | None,
            rounds: int = MIN_VERDICT_ROUNDS) -> str | None:
    """``slower`` / ``faster`` when the ratio of medians is beyond ``1 +- NOISE`` and the
    paired per-round ratios agree (p20 above 1 / p80 below 1), else ``same``; None with fewer
    than :data:`MIN_VERDICT_ROUNDS` paired rounds."""
    if ratio is None or p20 is None or p80 is None or rounds < MIN_VERDICT_ROUNDS:
        return None
    if ratio > 1 + NOISE and p20 > 1:
        return "slower"
    if ratio < 1 - NOISE and p80 < 1:
        return "faster"
    return "same"


def summarize_group(group: Group, records: dict[str, dict],
                    samples: dict[str, list[tuple[float, float]]]) -> dict:
    """The summary row: median wall per variant, each ratio of :data:`RATIOS` (ratio of the
    medians, p20/p80 of the paired per-round ratios, verdict) and the worst check result."""
    ok = {n: r for n, r in records.items()
          if r["status"] == "ok" and (r.get("wall_ms") or {}).get("median")}
    row: dict[str, Any] = {k: v for k, v in group.record("").items()
                           if k not in ("variant", "status", "error")}
    row["wall_ms"] = {n: r["wall_ms"]["median"] for n, r in ok.items()}
    row["errors"] = {n: r["error"] for n, r in records.items() if r["status"] != "ok"}
    row["ratios"] = {}
    for a, b in RATIOS:
        if a in ok and b in ok:
            pairs = zip(samples[a], samples[b], strict=True)  # both ran every round
            paired = [wa / wb for (wa, _), (wb, _) in pairs]
            q = _quantiles(paired)
            ratio = ok[a]["wall_ms"]["median"] / ok[b]["wall_ms"]["median"]
            row["ratios"][f"{a}/{b}"] = {
                "ratio": ratio, "p20": q["p20"], "p80": q["p80"], "rounds": len(paired),
                "verdict": verdict(ratio, q["p20"], q["p80"], len(paired))}
    checks = [r["check"] for r in records.values() if r.get("check")]
    rels = [c["max_rel"] for c in checks if "max_rel" in c]
    row["max_rel_diff"] = (math.nan if any(math.isnan(x) for x in rels) else max(rels)) \
        if rels else None
    matches = [c["token_match"] for c in checks if "token_match" in c]
    row["token_match"] = min(matches) if matches else None
    row["check_ok"] = all(c["ok"] for c in checks) if checks else None
    return row


# ---------------------------------------------------------------------------------------------
# the run


def _git_commit() -> str | None:
    import subprocess

    try:
        out = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse",
                              "--short", "HEAD"], capture_output=True, text=True, timeout=5)
    except Exception:
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def metadata(opts: Options, device: torch.device) -> dict:
    """Where and how the run happened: device (GPU name), library versions, date, argv,
    the resolved options."""
    import fusedops

    try:
        import transformers

        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    info = _report.device_info(device)
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(opts.argv),
        "command": " ".join(["python -m fusedops bench-models", *opts.argv]),
        "device": info,
        "gpu": info["name"] if device.type == "cuda" else None,
        "versions": {"torch": torch.__version__, "triton": info.get("triton"),
                     "transformers": hf_version, "fusedops": fusedops.__version__,
                     "python": info.get("python"), "git": _git_commit()},
        "torch_threads": torch.get_num_threads(),
        "patch_model_accepts_force": opts.patch_accepts_force,
        "options": {k: v for k, v in asdict(opts).items() if k != "argv"},
    }


def _say(opts: Options, text: str) -> None:
    if not opts.quiet:
        print(text, file=sys.stderr, flush=True)


def _patch_line(name: str, mode: str, patch: dict) -> str:
    parts = []
    for variant, p in patch.items():
        kinds = ", ".join(f"{n} {k}" for k, n in {**p["fused_types"], **p["patterns"]}.items())
        applied = "" if p["applied"] is None else f", applied={p['applied']}"
        parts.append(f"{variant}: {p['replaced']} modules swapped, {p['fused_patterns']} "
                     f"patterns fused ({kinds or 'nothing'}){applied}, {p['seconds']:.2f}s")
    return f"  patch_model {name} {mode}: " + "; ".join(parts)


def _run_model(name: str, opts: Options, device: torch.device, result: dict,
               on_group: Callable[[dict], None] | None) -> None:
    t0 = time.perf_counter()
    base = zoo.build(name, opts.preset, device, seed=opts.seed)
    entry = result["models"][name] = {
        "class": type(base).__name__, "params": zoo.param_count(base),
        "config": {k: v for k, v in base.config.to_diff_dict().items()
                   if isinstance(v, (int, float, str, bool))},
        "modes": {}}
    _say(opts, f"{name}: {entry['class']}, {entry['params'] / 1e6:.1f}M parameters "
               f"({opts.preset}), built in {time.perf_counter() - t0:.1f}s")
    for mode in opts.modes:
        if mode == "generate" and name not in zoo.DECODERS:
            continue
        proto = copy.deepcopy(base)
        if mode != "train":
            proto.to(DTYPES[opts.dtype])
        variants, info = make_variants(proto, mode, opts)
        entry["modes"][mode] = info
        if info["patch"]:
            _say(opts, _patch_line(name, mode, info["patch"]))
        shapes = opts.gen_shapes if mode == "generate" else opts.shapes
        for batch, tokens in shapes:
            group = Group(name, mode, batch, tokens,
                          opts.new_tokens if mode == "generate" else None)
            t1 = time.perf_counter()
            records, row = run_group(variants, group, opts, device, proto)
            result["records"] += records
            result["summary"].append(row)
            walls = ", ".join(f"{n} {_num(ms)} ms" for n, ms in row["wall_ms"].items())
            _say(opts, f"  {name} {group.shape} {mode}: {walls} "
                       f"({time.perf_counter() - t1:.1f}s)")
            if on_group is not None:
                on_group(result)
        info["unpatched_ok"] = unpatch_variants(variants)
        del variants, proto
        _free(device)
    del base
    _free(device)


def run(opts: Options, on_group: Callable[[dict], None] | None = None) -> dict:
    """The whole benchmark. Returns ``{"meta", "models", "records", "summary"}``: one record
    per (model, mode, shape, variant), one summary row per (model, mode, shape)."""
    device = torch.device(opts.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the synchronizes and memory statistics use it
    with torch_threads(opts.threads):
        result: dict[str, Any] = {"meta": metadata(opts, device), "models": {}, "records": [],
                                  "summary": []}
        compiled = any(v.startswith("compiled") for v in opts.variants)
        saved = _raise_recompile_limit(64) if compiled else None
        try:
            for name in opts.models:
                _run_model(name, opts, device, result, on_group)
        finally:
            _restore_recompile_limit(saved)
    return result


def _raise_recompile_limit(limit: int) -> int | None:
    """Generate's growing KV cache and the per-group resets recompile more than dynamo's
    default limit allows before it silently falls back to eager."""
    cfg = getattr(getattr(torch, "_dynamo", None), "config", None)
    if cfg is None or not hasattr(cfg, "recompile_limit"):
        return None
    saved = cfg.recompile_limit
    cfg.recompile_limit = max(saved, limit)
    return saved


def _restore_recompile_limit(saved: int | None) -> None:
    if saved is not None:
        torch._dynamo.config.recompile_limit = saved


# ---------------------------------------------------------------------------------------------
# output


def _num(x: float | None) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def _check_text(check: dict | None) -> str:
    if not check:
        return "ref"
    mark = "" if check.get("ok") else " !"
    if "token_match" in check:
        return f"tokens {100 * check['token_match']:.0f}%{mark}"
    return f"{check['max_rel']:.1e}{mark}"


def format_details(result: dict) -> str:
    """One row per (model, shape, mode, variant): wall (median, p20-p80), host, GPU, peak."""
    rows = []
    for r in result["records"]:
        head = [r["model"], r["shape"], r["mode"], r["variant"]]
        if r["status"] != "ok" and not r.get("wall_ms", {}).get("median"):
            rows.append(head + ["error"] + [""] * 7 + [str(r["error"])[:60]])
            continue
        w = r["wall_ms"]
        rows.append(head + [
            _num(w["median"]), f"{_num(w['p20'])}-{_num(w['p80'])}",
            _num(r["host_ms"]["median"]), _num(r.get("gpu_ms")), _num(r.get("peak_mb")),
            _num(r.get("first_call_s")), _num(r.get("tokens_per_s")),
            _check_text(r.get("check")) if r["status"] == "ok" else "error: " + r["error"][:50]])
    headers = ["model", "shape", "mode", "variant", "wall ms", "p20-p80", "host ms", "GPU ms",
               "peak MB", "1st call s", "tok/s", "diff"]
    return _report.table(rows, headers, align="llll" + "r" * 8)


def _ratio_text(ratio: dict | None) -> str:
    if not ratio:
        return "-"
    return f"{ratio['ratio']:.3f} {ratio['verdict'] or '?'}"


def format_summary(result: dict) -> str:
    """One row per (model, shape, mode): median wall ms per variant, the ratios
    patched/eager and compiled+patched/compiled, and the worst correctness difference."""
    variants = result["meta"]["options"]["variants"]
    headers = ["model", "shape", "mode"]
    for v in variants:
        headers.append(f"{v} ms")
        for a, b in RATIOS:
            if v == a and b in variants:
                headers.append(f"{a}/{b}")
    headers.append("max diff")
    rows = []
    for row in result["summary"]:
        cells = [row["model"], row["shape"], row["mode"]]
        for v in variants:
            cells.append(_num(row["wall_ms"].get(v)) if v in row["wall_ms"] else "error")
            for a, b in RATIOS:
                if v == a and b in variants:
                    cells.append(_ratio_text(row["ratios"].get(f"{a}/{b}")))
        if row["token_match"] is not None:
            diff = f"tokens {100 * row['token_match']:.0f}%"
        else:
            diff = "-" if row["max_rel_diff"] is None else f"{row['max_rel_diff']:.1e}"
        cells.append(diff + ("" if row["check_ok"] in (True, None) else " !"))
        rows.append(cells)
    return _report.table(rows, headers, align="lll" + "r" * (len(headers) - 3))


def format_notes(result: dict) -> str:
    """The lines printed above the tables: device, what patching did, anything flagged."""
    meta = result["meta"]
    dev = meta["device"]
    opts = meta["options"]
    lines = [f"device: {dev['name']} ({dev['type']}), torch {meta['versions']['torch']}, "
             f"transformers {meta['versions']['transformers']}, dtype {opts['dtype']}, "
             f"preset {opts['preset']}, {opts['rounds']} rounds ({opts['gen_rounds']} for "
             "generate)"]
    if not dev.get("fused_kernels_available"):
        lines.append("no fused kernel on this device: 'patched' runs the PyTorch reference "
                     "path, so no speed-up is expected or claimed")
    if opts["force_patch"] and not meta["patch_model_accepts_force"]:
        lines.append("--force-patch ignored: this patch_model has no 'force' parameter")
    for name, entry in result["models"].items():
        for mode, info in entry["modes"].items():
            for variant, ok in info.get("unpatched_ok", {}).items():
                if not ok:
                    lines.append(f"WARNING {name} {mode} {variant}: unpatch_model left changes")
            for variant, p in info["patch"].items():
                if p["applied"] is False:
                    lines.append(f"{name} {mode} {variant}: patch_model applied nothing here")
    lines += _compile_notes(result)
    lines.append(
        "ratios: median wall time of the first over the second (< 1: faster); 'slower' / "
        f"'faster' beyond {NOISE:.0%} with the paired per-round ratios' p20/p80 agreeing, "
        f"else 'same' ('?': under {MIN_VERDICT_ROUNDS} rounds). diff: the relative output "
        "difference against the reference variant ('ref': eager when measured), max diff the "
        "worst of a row ('!' beyond the dtype's tolerance)")
    return "\n".join(lines)


def _compile_notes(result: dict) -> list[str]:
    lines = []
    for row in result["summary"]:
        if row.get("weights_identical") is False:
            lines.append(f"WARNING {row['model']} {row['shape']} {row['mode']}: the variants' "
                         "weights differ")
        if row.get("graphs_compiled_while_timing"):
            lines.append(f"WARNING {row['model']} {row['shape']} {row['mode']}: dynamo compiled "
                         f"{row['graphs_compiled_while_timing']} graphs while timing")
    for r in result["records"]:
        comp = r.get("compile")
        if comp and comp["graph_breaks"]:
            top = next(iter(comp["graph_break_reasons"]), "?")
            lines.append(f"{r['model']} {r['shape']} {r['mode']} {r['variant']}: "
                         f"{comp['graphs']} graphs, {comp['graph_breaks']} graph breaks "
                         f"(most: {top[:70]})")
    return lines


CSV_FIELDS = ("model", "mode", "batch", "tokens", "new_tokens", "variant", "status",
              "wall_ms", "wall_p20_ms", "wall_p80_ms", "host_ms", "host_p20_ms", "host_p80_ms",
              "gpu_ms", "peak_mb", "peak_total_mb", "first_call_s", "check_s", "tokens_per_s",
              "ratio", "ratio_vs", "check_max_rel", "check_token_match", "check_ok", "error")


def _csv_row(r: dict, ratios: dict[tuple, dict]) -> dict:
    w, h = r.get("wall_ms") or {}, r.get("host_ms") or {}
    check = r.get("check") or {}
    pair = next((f"{a}/{b}" for a, b in RATIOS if a == r["variant"]), None)
    ratio = ratios.get((r["model"], r["mode"], r["shape"]), {}).get(pair) if pair else None
    return {**{k: r.get(k) for k in CSV_FIELDS},
            "wall_ms": w.get("median"), "wall_p20_ms": w.get("p20"), "wall_p80_ms": w.get("p80"),
            "host_ms": h.get("median"), "host_p20_ms": h.get("p20"), "host_p80_ms": h.get("p80"),
            "ratio": ratio["ratio"] if ratio else None, "ratio_vs": pair if ratio else None,
            "check_max_rel": check.get("max_rel"), "check_token_match": check.get("token_match"),
            "check_ok": check.get("ok")}


def write_csv(result: dict, path: str | os.PathLike) -> Path:
    """One CSV row per record (the ratio column: patched/eager or compiled+patched/compiled)."""
    ratios = {(s["model"], s["mode"], s["shape"]): s["ratios"] for s in result["summary"]}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in result["records"]:
            writer.writerow(_csv_row(r, ratios))
    return path


def plot_ratios(result: dict, path: str | os.PathLike) -> Path | None:
    """Horizontal bars: each ratio per (model, shape, mode), whiskers at the paired per-round
    p20/p80. None (and one line on stderr) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed", file=sys.stderr)
        return None
    rows = result["summary"]
    colors = {"patched/eager": "#d62728", "compiled+patched/compiled": "#2ca02c"}
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) * len(colors) + 1.5))
    height = 0.8 / len(colors)
    for k, (key, color) in enumerate(colors.items()):
        ys, xs, lo, hi = [], [], [], []
        for i, row in enumerate(rows):
            r = row["ratios"].get(key)
            if r:
                ys.append(i + (k - (len(colors) - 1) / 2) * height)
                xs.append(r["ratio"])
                lo.append(max(0.0, r["ratio"] - r["p20"]))
                hi.append(max(0.0, r["p80"] - r["ratio"]))
        if xs:
            ax.barh(ys, xs, height=height, color=color, label=key, xerr=[lo, hi], capsize=2)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [f"{r['model']} {r['shape']} {r['mode']}" for r in rows],
                  fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("wall-time ratio (< 1: the patched variant is faster)")
    meta = result["meta"]
    ax.set_title(f"bench-models on {meta['device']['name']} ({meta['options']['dtype']}, "
                 f"{meta['options']['preset']})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(result: dict, out_dir: str | os.PathLike, plot: bool = True) -> list[Path]:
    """``bench_models.json`` (every measurement and the metadata), ``.csv``, ``.txt`` (the
    printed report) and ``.png`` (unless ``plot`` is False or matplotlib is missing)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _report.write_json(out / "bench_models.json", result)
    paths = [out / "bench_models.json", write_csv(result, out / "bench_models.csv")]
    (out / "bench_models.txt").write_text(format_report(result) + "\n")
    paths.append(out / "bench_models.txt")
    if plot and result["summary"]:
        png = plot_ratios(result, out / "bench_models.png")
        if png is not None:
            paths.append(png)
    return paths


def format_report(result: dict) -> str:
    """Notes, the per-variant details table, then the summary table (last)."""
    return "\n\n".join([format_notes(result), format_details(result), format_summary(result)])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        opts = resolve(args, argv)
        _check_lengths(opts)
    except ArgError as exc:
        print(f"bench-models: error: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(opts.out)

    def checkpoint(partial: dict) -> None:
        _report.write_json(out_dir / "bench_models.json", partial)

    result = run(opts, on_group=checkpoint)
    paths = write_outputs(result, out_dir, plot=opts.plot)
    _say(opts, "wrote " + ", ".join(str(p) for p in paths))
    print(format_report(result))
    return 0
