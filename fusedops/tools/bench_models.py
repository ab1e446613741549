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

* wall: ``perf_counter`` from the round's start to after a device synchronize, per step, median
  and 20%/80% quantiles over the rounds; a round runs each variant's step ``--min-round-ms``
  worth of times back to back (the count set once per group from the fastest variant, at most
  64; ``steps_per_round`` in the summary), so a short step's sample is not one scheduling
  jitter of the host;
* host: ``perf_counter`` from the round's start until the last Python call returns, before any
  synchronize, per step: what the host spends issuing the step;
* GPU (CUDA): the GPU's own time with the host far ahead: the stream is blocked by
  ``torch.cuda._sleep``, a CUDA event, the step, a second event; valid only if the host finished
  issuing before the sleep ended (else retried with a longer sleep, then reported as None);
* GPU busy (CUDA): the time the GPU spends in the step's kernels, copies and memsets, from the
  profiler's records of a few steps (overlapping spans once; gaps between kernels left out),
  valid where the GPU time above is not (a step that waits for the GPU inside); measured after
  every model's timed rounds, each model built and patched again, since the profiler slows the
  process's later host work (``--no-busy`` skips it);
* peak memory (CUDA): ``max_memory_allocated`` during one step, above what was allocated when
  it started (``peak_total_mb``: the absolute peak, every resident copy included);
* first call: the first step's wall time (for compiled variants: compilation included), never
  part of the timings; tokens/s for ``generate``;
* correctness: before timing, every variant's output (``infer``: the judged output tensor;
  ``train``: output, loss and every gradient of one forward/backward in eval mode;
  ``generate``: the token ids) against the ``eager`` one: max |diff| / max |eager|, flagged
  (never failed) beyond the dtype's tolerance.

This module is the command line and the run loop. The parts: ``bench_models_common`` (the
options and constants), ``bench_models_variants`` (the copies: patching, compiling, weights),
``bench_models_group`` (one model, mode and shape), ``bench_models_timing``,
``bench_models_check`` (correctness) and ``bench_models_report`` (tables, CSV, plot, files).
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import inspect
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from fusedops.tools import _model_zoo as zoo
from fusedops.tools import _report
from fusedops.tools import bench_models_variants as model_variants
from fusedops.tools.bench_harness import versions
from fusedops.tools.bench_models_common import (
    DTYPES,
    MODES,
    VARIANTS,
    Options,
    free_memory,
    short_error,
)
from fusedops.tools.bench_models_group import Group, busy_times, run_group
from fusedops.tools.bench_models_report import (
    fmt_num,
    format_patch_line,
    format_report,
    write_outputs,
)
from fusedops.tools.cli import UsageError, torch_threads

DEFAULT_SHAPES = "1x128,8x512,32x512"
DEFAULT_GEN_SHAPES = "1x32,8x32"

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
    p.add_argument("--min-round-ms", type=float, default=50.0,
                   help="steps per round so that the fastest variant's round lasts about this "
                        "long, at most 64 (default 50; 0: one step per round)")
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
    p.add_argument("--no-busy", action="store_true",
                   help="skip the GPU busy times (CUDA: measured with the profiler after every "
                        "timed round, each model built again)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def _pick(text: str, arg: str, allowed: Sequence[str]) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    if not items:
        raise UsageError(f"{arg}: empty list (choose from {', '.join(allowed)})")
    for item in items:
        if item not in allowed:
            raise UsageError(f"{arg}: unknown value {item!r} (choose from {', '.join(allowed)})")
    return tuple(dict.fromkeys(items))


def parse_shapes(text: str, arg: str = "--shapes") -> tuple[tuple[int, int], ...]:
    """``"1x128,8x512"`` -> ``((1, 128), (8, 512))``; :class:`UsageError` naming ``arg``."""
    shapes = []
    for item in (s.strip() for s in text.split(",")):
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise UsageError(f"{arg}: {item!r} is not BATCHxTOKENS with positive integers "
                             "(e.g. 8x512)")
        shapes.append((int(parts[0]), int(parts[1])))
    return tuple(dict.fromkeys(shapes))


def _positive(value: int, arg: str) -> int:
    if value < 1:
        raise UsageError(f"{arg}: must be at least 1, got {value}")
    return value


def resolve(args: argparse.Namespace, argv: Sequence[str] = ()) -> Options:
    """Validate the parsed arguments and fill the device-dependent defaults."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type not in ("cuda", "cpu"):
        raise UsageError(f"--device: {device!r} is not supported (cuda or cpu)")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device: cuda requested but CUDA is not available")
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
        min_round_ms=max(0.0, args.min_round_ms),
        warmup=max(0, args.warmup), new_tokens=_positive(args.new_tokens, "--new-tokens"),
        threads=args.threads, out=args.out, compile_backend=args.compile_backend,
        force_patch=args.force_patch,
        patch_accepts_force=_accepts_force(model_variants.patch_model_fn()),
        seed=args.seed, quiet=args.quiet, plot=not args.no_plot, busy=not args.no_busy,
        argv=list(argv))


def _accepts_force(patch_model: Callable[..., Any]) -> bool:
    return "force" in inspect.signature(patch_model).parameters


def _check_lengths(opts: Options) -> None:
    """Every requested sequence must fit each model's position embeddings."""
    longest = max(t for _, t in opts.shapes)
    longest_gen = max(p for _, p in opts.gen_shapes) + opts.new_tokens
    for name in opts.models:
        limit = zoo.max_positions(zoo.config_for(name, opts.preset))
        if any(m in opts.modes for m in ("infer", "train")) and longest > limit:
            raise UsageError(f"--shapes: {longest} tokens exceed {name}'s {limit} positions")
        if "generate" in opts.modes and name in zoo.DECODERS and longest_gen > limit:
            raise UsageError(f"--gen-shapes/--new-tokens: prompt + new tokens = {longest_gen} "
                             f"exceed {name}'s {limit} positions")


# ---------------------------------------------------------------------------------------------
# the run


def metadata(opts: Options, device: torch.device) -> dict:
    """Where and how the run happened: device (GPU name), library versions, date, argv,
    the resolved options."""
    try:
        import transformers

        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    info = _report.device_info(device)
    lib = versions()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(opts.argv),
        "command": " ".join(["python -m fusedops bench-models", *opts.argv]),
        "device": info,
        "gpu": info["name"] if device.type == "cuda" else None,
        "versions": {"torch": lib["torch"], "triton": lib["triton"], "transformers": hf_version,
                     "fusedops": lib["fusedops"], "python": lib["python"], "git": lib["git"]},
        "torch_threads": torch.get_num_threads(),
        "patch_model_accepts_force": opts.patch_accepts_force,
        "options": {k: v for k, v in asdict(opts).items() if k != "argv"},
    }


def _say(opts: Options, text: str) -> None:
    if not opts.quiet:
        print(text, file=sys.stderr, flush=True)


def _mode_variants(name: str, base: torch.nn.Module, opts: Options, device: torch.device
                   ) -> Iterator[tuple[str, torch.nn.Module, list, dict, list[Group]]]:
    """Per mode of model ``name``: ``(mode, prototype, variants, patch info, groups)``; the
    variants' patched copies are unpatched (``info["unpatched_ok"]``) and freed once the caller
    asks for the next mode (drop your references first)."""
    for mode in opts.modes:
        if mode == "generate" and name not in zoo.DECODERS:
            continue
        proto = copy.deepcopy(base)
        if mode != "train":
            proto.to(DTYPES[opts.dtype])
        variants, info = model_variants.make_variants(proto, mode, opts)
        shapes = opts.gen_shapes if mode == "generate" else opts.shapes
        groups = [Group(name, mode, batch, tokens, opts.new_tokens if mode == "generate" else None)
                  for batch, tokens in shapes]
        yield mode, proto, variants, info, groups
        info["unpatched_ok"] = model_variants.unpatch_variants(variants)
        del variants, proto
        free_memory(device)


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
    for mode, proto, variants, info, groups in _mode_variants(name, base, opts, device):
        entry["modes"][mode] = info
        if info["patch"]:
            _say(opts, format_patch_line(name, mode, info["patch"]))
        for group in groups:
            t1 = time.perf_counter()
            records, row = run_group(variants, group, opts, device, proto)
            result["records"] += records
            result["summary"].append(row)
            walls = ", ".join(f"{n} {fmt_num(ms)} ms" for n, ms in row["wall_ms"].items())
            _say(opts, f"  {name} {group.shape} {mode}: {walls} "
                       f"({time.perf_counter() - t1:.1f}s)")
            if on_group is not None:
                on_group(result)
        del proto, variants  # (freed when the next mode is made)
    del base
    free_memory(device)


def _busy_model(name: str, opts: Options, device: torch.device, result: dict,
                on_group: Callable[[dict], None] | None) -> None:
    """The GPU busy time of every variant of model ``name`` (``busy_times``), into the run's
    records: the model built and patched again, after every timed round of the run."""
    base = zoo.build(name, opts.preset, device, seed=opts.seed)
    records = {(r["model"], r["mode"], r["shape"], r["variant"]): r for r in result["records"]}
    for mode, proto, variants, _info, groups in _mode_variants(name, base, opts, device):
        for group in groups:
            t1 = time.perf_counter()
            for variant, got in busy_times(variants, group, opts, device, proto).items():
                rec = records.get((name, mode, group.shape, variant))
                if rec is not None:
                    rec.update(got)
            _say(opts, f"  {name} {group.shape} {mode}: GPU busy time "
                       f"({time.perf_counter() - t1:.1f}s)")
            if on_group is not None:
                on_group(result)
        del proto, variants
    del base
    free_memory(device)


def run(opts: Options, on_group: Callable[[dict], None] | None = None) -> dict:
    """The whole benchmark. Returns ``{"meta", "models", "records", "summary"}``: one record
    per (model, mode, shape, variant), one summary row per (model, mode, shape). On CUDA (unless
    ``opts.busy`` is off) the GPU busy times come last, after every model's timed rounds."""
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
            if device.type == "cuda" and opts.busy:
                for name in opts.models:
                    try:
                        _busy_model(name, opts, device, result, on_group)
                    except Exception as exc:  # the timings stand; say why busy times are missing
                        result["meta"].setdefault("busy_errors", {})[name] = short_error(exc)
                        free_memory(device)
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
# entry point


def main(argv: list[str] | None = None) -> int:
    """Run the command. A bad argument raises :class:`~fusedops.tools.cli.UsageError` before
    anything is written (``python -m fusedops``: one line on stderr, exit status 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    opts = resolve(args, argv)
    _check_lengths(opts)
    out_dir = Path(opts.out)

    def checkpoint(partial: dict) -> None:
        _report.write_json(out_dir / "bench_models.json", partial)

    result = run(opts, on_group=checkpoint)
    paths = write_outputs(result, out_dir, plot=opts.plot)
    _say(opts, "wrote " + ", ".join(str(p) for p in paths))
    print(format_report(result))
    return 0
