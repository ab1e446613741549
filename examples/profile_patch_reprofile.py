"""The measure-first workflow on your own model, through the Python API.

    python examples/profile_patch_reprofile.py                        # the model in custom_model.py
    python examples/profile_patch_reprofile.py my_pkg.models:build    # any MODULE:FACTORY

``FACTORY()`` must return ``(model, example_inputs)``. The script profiles the model, measures the
fused-vs-native speed-up on the model's own softmax/LayerNorm shapes, prints Amdahl's prediction,
patches the model, checks the outputs, re-profiles, and compares measured latency with the
prediction. Every number printed is measured here.
"""

from __future__ import annotations

import copy
import os
import sys

import torch

import fusedops
from fusedops.tools import _report
from fusedops.tools.profile import (
    call_model,
    format_profile,
    load_target,
    move_inputs,
    profile_model,
)

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str]) -> int:
    target = argv[0] if argv else os.path.join(HERE, "custom_model.py") + ":make_model"
    device = _report.pick_device(None)
    model, inputs = load_target(target)
    model = model.to(device).eval()
    inputs = move_inputs(inputs, device)

    # 1. profile the unpatched model (also times fused vs native on its own shapes)
    before = profile_model(model, inputs, label=target)
    print(format_profile(before))

    # 2. patch a copy (keep the original to compare against)
    patched = copy.deepcopy(model)
    report = fusedops.patch_model(patched, example_inputs=inputs)
    print("\n" + str(report))

    # 3. verify: outputs of the patched model vs the original
    with torch.no_grad():
        ref, out = call_model(model, inputs), call_model(patched, inputs)
    print(f"\nmax |patched - original| = {(out - ref).abs().max().item():.3g}")

    # 4. re-profile and compare
    after = profile_model(patched, inputs, measure_speedups=False, label=target + " (patched)")
    print("\n" + format_profile(after))
    b_ms, a_ms = before["latency"]["median_ms"], after["latency"]["median_ms"]
    line = (f"\nmedian forward latency {_report.fmt_ms(b_ms)} -> {_report.fmt_ms(a_ms)}: "
            f"measured {b_ms / a_ms:.3f}x")
    if "amdahl" in before:
        line += f", Amdahl predicted {before['amdahl']['predicted_speedup']:.3f}x"
    print(line)
    if not _report.device_info(device)["fused_kernels_available"]:
        print("no fused GPU kernel on this device: the patched model ran the reference path, "
              "so no speed-up is claimed.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
