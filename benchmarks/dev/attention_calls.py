"""Host and wall time of one Hugging Face attention call, as patch_model runs it.

    PYTHONPATH=$PWD python benchmarks/dev/attention_calls.py [--out FILE] [--models bert,gpt2]

For each model (random weights, bf16, eager attention, inference) and batch x tokens, the
arguments of one real attention call are captured from a patched model's forward, then each
way of running that call is timed back to back (300 calls per sample, best of 7 samples; host:
until the last call returns, wall: until the GPU is done):

* ``eager``: the model's own ``eager_attention_forward``;
* ``native``: patch_model's attention function where it hands the call to that function (the
  size rule), i.e. the function's own cost on top of it;
* ``fused_first``: the fused softmax's first call of a shape (checks, launch rules, the launch
  recorded): one call per sample, each on a new shape's scores (key length + 1 each time);
* ``fused``: the fused softmax replaying its recorded launch (the steady state).

Needs CUDA and transformers. Prints a table and writes JSON (default
``out/attention_calls.json``); ``benchmarks/results/<gpu>/attention-calls.json`` is its output.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

SHAPES = {"bert": [(1, 128), (8, 512)], "gpt2": [(1, 128), (8, 512)],
          "llama": [(1, 128), (8, 512)]}
KEY = (True, torch.bfloat16, False)


def capture(name: str, batch: int, tokens: int):
    """A patched model's first attention call: (function args, kwargs)."""
    from transformers import AttentionInterface

    import fusedops
    from fusedops.patching import hf_attention
    from fusedops.tools import _model_zoo as zoo

    model = zoo.build(name, "full", torch.device("cuda")).to(torch.bfloat16)
    fusedops.patch_model(model)
    seen: list = []
    original = hf_attention.fused_eager_attention

    def spy(*args, **kwargs):
        if not seen:
            seen.append((args, kwargs))
        return original(*args, **kwargs)
    AttentionInterface._global_mapping[hf_attention.NAME] = spy
    try:
        inputs = zoo.make_inputs(name, zoo.vocab_size(model), batch, tokens, torch.device("cuda"))
        if name != "bert":
            inputs["use_cache"] = False
        with torch.no_grad():
            model(**inputs)
    finally:
        AttentionInterface._global_mapping[hf_attention.NAME] = original
    return seen[0]


def timed(fn, calls: int = 300, samples: int = 7) -> tuple[float, float]:
    """(host µs, wall µs) per call, best of ``samples``."""
    for _ in range(20):
        fn()
    host, wall = [], []
    for _ in range(samples):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        wall.append((t2 - t0) / calls * 1e6)
    return min(host), min(wall)


def first_calls(args, kwargs, samples: int = 7) -> tuple[float, float]:
    """(host µs, wall µs) of the fused softmax's first call of a shape: the key made one
    position longer for each sample, so every sample is a signature not seen before."""
    from fusedops.patching import hf_attention

    module, query, key, value, mask = args
    host, wall = [], []
    for i in range(1, samples + 1):
        k2 = torch.cat([key, key[:, :, :i]], dim=2)
        v2 = torch.cat([value, value[:, :, :i]], dim=2)
        m2 = None if mask is None else torch.cat([mask, mask[..., :i]], dim=-1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf_attention.fused_eager_attention(module, query, k2, v2, m2, **kwargs)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e6)
        wall.append((time.perf_counter() - t0) * 1e6)
    return sorted(host)[len(host) // 2], sorted(wall)[len(wall) // 2]


def measure(name: str, batch: int, tokens: int) -> dict:
    from fusedops import _dispatch
    from fusedops.patching import hf_attention

    args, kwargs = capture(name, batch, tokens)
    eager, _ = hf_attention._eager(args[0])
    rules = _dispatch.SIZE_RULES["attention"]
    saved = dict(rules)
    out: dict[str, tuple[float, float]] = {}
    try:
        with torch.no_grad():
            out["eager"] = timed(lambda: eager(*args, **kwargs))
            rules[KEY] = float("inf")
            out["native"] = timed(lambda: hf_attention.fused_eager_attention(*args, **kwargs))
            rules[KEY] = 0
            out["fused_first"] = first_calls(args, kwargs)
            out["fused"] = timed(lambda: hf_attention.fused_eager_attention(*args, **kwargs))
    finally:
        rules.clear()
        rules.update(saved)
    mask = args[4]
    return {"model": name, "shape": f"{batch}x{tokens}",
            "query": list(args[1].shape), "key": list(args[2].shape),
            "mask": None if mask is None else list(mask.shape),
            "host_us": {k: round(v[0], 1) for k, v in out.items()},
            "wall_us": {k: round(v[1], 1) for k, v in out.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(SHAPES))
    p.add_argument("--out", default="out/attention_calls.json")
    opts = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_calls.py needs a CUDA device")
    import fusedops

    records = []
    for name in opts.models.split(","):
        for batch, tokens in SHAPES[name]:
            records.append(measure(name, batch, tokens))
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "fusedops": fusedops.__version__, "calls_per_sample": 300, "samples": 7}
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    cols = ("eager", "native", "fused_first", "fused")
    print(f"{meta['device']}: host / wall µs per attention call (bf16, inference)")
    print(f"{'model':6} {'shape':6} {'mask':5} " + " ".join(f"{c:>15}" for c in cols))
    for r in records:
        cells = " ".join(f"{r['host_us'][c]:7.1f}/{r['wall_us'][c]:<7.1f}" for c in cols)
        print(f"{r['model']:6} {r['shape']:6} {'yes' if r['mask'] else 'no':5} {cells}")


if __name__ == "__main__":
    main()
