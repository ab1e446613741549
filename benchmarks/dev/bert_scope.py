"""BERT-base (eager attention) before/after of the host-time changes of session 26, in one
process (CUDA only): unpatched, module swaps only and the full patch, each patched variant with
the session's host paths ("new": routing scoped to the sites found, epilogue and masked-softmax
replay plans, the ops layer's add + LayerNorm replay, rows of any rank) and without them ("old": the whole
forward under the routing mode, REDISCOVER_EVERY = 1, none of the rest). Interleaved rounds,
medians; inference and a training step per batch.

    python benchmarks/dev/bert_scope.py [--shapes 1x128,8x128,32x512] [--out results.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch

sys.path.insert(0, "examples")
from bert_before_after import build, inputs_for  # noqa: E402

import fusedops  # noqa: E402
import fusedops.triton as ftriton  # noqa: E402
from fusedops import _replay, patching  # noqa: E402
from fusedops.tools.demo import interleaved_latency  # noqa: E402
from fusedops.triton import layernorm_epilogue as tle  # noqa: E402
from fusedops.triton import softmax_masked as tsmm  # noqa: E402

NEW, OLD = "new", "old"
_saved_runners: dict = {}


def host_paths(which: str) -> None:
    """Switch the session-26 host paths on ("new") or off ("old")."""
    new = which == NEW
    patching.REDISCOVER_EVERY = 64 if new else 1
    tle.PLANS = tsmm.PLANS = ftriton.EPILOGUE_ROWS_ND = new
    table = _replay.LAYERNORM_RESIDUAL
    if new:
        table.update(_saved_runners)
        _saved_runners.clear()
    else:
        _saved_runners.update(table)
        table.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x128,8x128,32x512")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--per-round", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    base = build(False, 512, dropout=0.1).to(dev, torch.bfloat16)
    modules, full = copy.deepcopy(base), copy.deepcopy(base)
    fusedops.patch_model(modules, patterns=False)
    fusedops.patch_model(full)
    variants = {
        "unpatched": (base, NEW), "modules old": (modules, OLD), "modules new": (modules, NEW),
        "patched old": (full, OLD), "patched new": (full, NEW),
    }
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "shapes": {}}

    def step(model, host, inputs, train):
        def run():
            host_paths(host)
            if train:
                out = model(**inputs).last_hidden_state
                out.float().square().mean().backward()
                model.zero_grad(set_to_none=True)
            else:
                with torch.no_grad():
                    model(**inputs)
        return run

    for shape in a.shapes.split(","):
        batch, seq = (int(v) for v in shape.split("x"))
        inputs = inputs_for(batch, seq, dev)
        row = results["shapes"][shape] = {}
        for train in (False, True):
            for m in (base, modules, full):
                m.train(train)
            fns = {k: step(m, host, inputs, train) for k, (m, host) in variants.items()}
            samples, _ = interleaved_latency(fns, dev, a.rounds, a.per_round,
                                             label=f"{shape} {'train' if train else 'infer'}")
            row["train" if train else "infer"] = {
                k: 1e3 * sorted(v)[len(v) // 2] for k, v in samples.items()}
    host_paths(NEW)
    print(f"\nBERT-base bf16, {results['device']}, ms (median), speedup vs unpatched")
    print(f"{'shape':14}" + "".join(f"{k:>18}" for k in variants))
    for shape, row in results["shapes"].items():
        for kind, ms in row.items():
            print(f"{shape + ' ' + kind:14}" + "".join(
                f"{ms[k]:10.2f} ({ms['unpatched'] / ms[k]:4.2f}x)" for k in variants))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
