"""Hugging Face BERT (eager attention) before and after ``fusedops.patch_model``.

The model is built from a config (random weights, nothing downloaded). Three variants are timed
in interleaved rounds so machine drift hits them alike: unpatched, patched with module swaps
and functional routing only (``patterns=False``), and fully patched (``patterns=True``, the
setting for large-batch inference: the attention's ``softmax(scores * scaling + mask)`` and
``LayerNorm(x + residual)`` fused).
Inference forward and a training step (forward + backward, dropout on) are both timed.

    python examples/bert_before_after.py                      # BERT-base size on the GPU
    python examples/bert_before_after.py --tiny --device cpu  # a smoke run anywhere

Prints a table and writes ``--out`` (JSON) with the device, versions and every sample's median.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform

import torch


def build(tiny: bool, seq: int, dropout: float):
    from transformers import BertConfig, BertModel

    size = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128) if tiny else dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    cfg = BertConfig(vocab_size=30522, max_position_embeddings=max(512, seq),
                     attn_implementation="eager", hidden_dropout_prob=dropout,
                     attention_probs_dropout_prob=dropout, **size)
    return BertModel(cfg)


def inputs_for(batch: int, seq: int, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 30522, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    # Padding on half the batch, so the attention mask matters.
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    for i in range(0, batch, 2):
        mask[i, lengths[i]:] = 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def main(argv: list[str] | None = None) -> int:
    import fusedops
    from fusedops.tools import _report
    from fusedops.tools.demo import interleaved_latency

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cuda, mps or cpu (default: what is present)")
    ap.add_argument("--dtype", default=None, help="float16/bfloat16/float32 (GPU default bf16)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide BERT")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--per-round", type=int, default=5)
    ap.add_argument("--no-train", action="store_true", help="time inference only")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    dev = _report.pick_device(args.device)
    gpu = dev.type != "cpu"
    dtype = _report.dtype_from_name(args.dtype or ("bfloat16" if gpu else "float32"))
    batch = args.batch or (32 if gpu and not args.tiny else 2)
    seq = args.seq or (512 if gpu and not args.tiny else 32)
    torch.manual_seed(0)
    base = build(args.tiny, seq, dropout=0.1).to(dev, dtype)
    inputs = inputs_for(batch, seq, dev)
    models = {"unpatched": base, "modules only": copy.deepcopy(base),
              "patched": copy.deepcopy(base)}
    fusedops.patch_model(models["modules only"], patterns=False)
    report = fusedops.patch_model(models["patched"], example_inputs=inputs, patterns=True)
    print(report)

    results: dict = {
        "device": _report.device_info(dev), "dtype": str(dtype).replace("torch.", ""),
        "batch": batch, "seq": seq, "model": "bert-tiny" if args.tiny else "bert-base",
        "torch": torch.__version__, "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "fused_patterns": report.fused_patterns,
        "verification": report.verification,
    }

    def infer(m):
        def run():
            with torch.no_grad():
                m(**inputs)
        return run

    def train_step(m):
        def run():
            out = m(**inputs).last_hidden_state
            out.float().square().mean().backward()
            m.zero_grad(set_to_none=True)
        return run

    for m in models.values():
        m.eval()
    samples, _ = interleaved_latency({k: infer(m) for k, m in models.items()}, dev,
                                     args.rounds, args.per_round, label="inference")
    results["inference_ms"] = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in samples.items()}
    if not args.no_train:
        for m in models.values():
            m.train()
        samples, _ = interleaved_latency({k: train_step(m) for k, m in models.items()}, dev,
                                         args.rounds, args.per_round, label="training step")
        results["train_step_ms"] = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in samples.items()}

    print(f"\nBERT {results['model']} batch {batch} x seq {seq}, {results['dtype']}, "
          f"{results['device']['name']}")
    print(f"{'':14}" + "".join(f"{k:>16}" for k in models))
    for key in ("inference_ms", "train_step_ms"):
        if key in results:
            row = results[key]
            print(f"{key:14}" + "".join(f"{row[k]:16.3f}" for k in models))
            results[key.replace("_ms", "_speedup")] = {
                k: row["unpatched"] / row[k] for k in models}
            print(f"{'  speedup':14}" + "".join(
                f"{row['unpatched'] / row[k]:15.3f}x" for k in models))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
