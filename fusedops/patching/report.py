"""What patch_model did: :class:`PatchReport`, its table and its JSON form."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

OPS = ("softmax", "layernorm", "rmsnorm")


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0:
        return "0"
    return f"{v:.3g}"


@dataclasses.dataclass
class PatchReport:
    """What :func:`patch_model` did. ``str(report)`` is a table; see also :meth:`to_dict`.

    Attributes:
        model: class name of the patched model.
        ops: the ops that were patched.
        functional: whether functional calls were routed (see ``routed_functions``).
        applied: False when patch_model left the model as it was (see ``reason``).
        reason: why nothing was applied (e.g. no fused backend for the model's device), or
            None.
        backend: the backend the model's tensors would run on (``"triton"``, ``"metal"``, or
            ``"native"``: PyTorch's own ops) with their device and dtype.
        routed_functions: one dict per module whose own code's functional calls now reach
            the fused ops: ``name``, ``type``, ``calls`` (the functions named) and ``via``
            (``"globals"``: a copy of the forward whose globals route; ``"mode"``: a
            TorchFunctionMode while the module's own code runs, for ``tensor.softmax``).
        replaced: one dict per swapped module: ``name`` (qualified), ``type`` (original class),
            ``fused_type``, ``op``, ``shape`` (LayerNorm/RMSNorm ``normalized_shape``, else
            None), ``config``.
        skipped: one dict per LayerNorm/RMSNorm/Softmax module left alone: ``name``, ``type``,
            ``op``, ``reason``.
        fused_patterns: one dict per module whose epilogue pattern now runs fused: ``name``,
            ``type``, ``pattern`` (what was fused) and ``via`` (``"hf attention"``: the config's
            attention implementation switched to fusedops' eager one; ``"traced forward"``: a
            torch.fx rewrite of that module's forward).
        pattern_skipped: candidate modules (a LayerNorm/Softmax child, or a forward that calls
            softmax) whose forward could not be proven exact, with ``name``, ``type``,
            ``reason``.
        lean_dropout: the qualified names of the ``nn.Dropout`` modules whose eval-mode call
            now returns its input without calling ``F.dropout`` (the same tensor ``F.dropout``
            returns there; training mode unchanged): host time of eval forwards.
        excluded: the qualified names of the excluded subtrees (functional calls inside them
            are not routed either).
        unmatched_exclude: ``exclude`` entries that matched no module (typos, usually).
        verification: None, or (with ``example_inputs``) a dict with ``backend`` (the backend
            that ran), ``mode`` (how the pass ran), ``fused_calls`` (per-op calls that ran on
            fused kernels, from :func:`fusedops.count_fused_calls`), ``routed_calls`` (per-op
            calls sent to fusedops, whatever the backend), and ``outputs`` (per output: ``name``,
            ``shape``, ``dtype``, ``max_abs_diff``, ``max_rel_diff`` against the unpatched
            model).
    """

    model: str
    ops: tuple[str, ...]
    functional: bool
    applied: bool = True
    reason: str | None = None
    backend: str | None = None
    replaced: list[dict] = dataclasses.field(default_factory=list)
    skipped: list[dict] = dataclasses.field(default_factory=list)
    fused_patterns: list[dict] = dataclasses.field(default_factory=list)
    pattern_skipped: list[dict] = dataclasses.field(default_factory=list)
    routed_functions: list[dict] = dataclasses.field(default_factory=list)
    lean_dropout: list[str] = dataclasses.field(default_factory=list)
    excluded: list[str] = dataclasses.field(default_factory=list)
    unmatched_exclude: list[str] = dataclasses.field(default_factory=list)
    verification: dict | None = None

    @property
    def max_abs_diff(self) -> float | None:
        """Largest ``max_abs_diff`` over all outputs (None without a verification pass)."""
        return self._worst("max_abs_diff")

    @property
    def max_rel_diff(self) -> float | None:
        """Largest ``max_rel_diff`` over all outputs (None without a verification pass)."""
        return self._worst("max_rel_diff")

    def _worst(self, key: str) -> float | None:
        if not self.verification or not self.verification["outputs"]:
            return None
        return max(o[key] for o in self.verification["outputs"])

    def to_dict(self) -> dict:
        """Plain-Python (JSON-serialisable) form of the report."""
        d = dataclasses.asdict(self)
        d["ops"] = list(self.ops)
        return d

    def to_json(self, **kwargs: Any) -> str:
        """JSON form of :meth:`to_dict`; keyword arguments go to :func:`json.dumps`."""
        kwargs.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        lines = [
            f"fusedops.patch_model({self.model}): ops={', '.join(self.ops) or 'none'}; "
            f"functional routing {'on' if self.functional else 'off'}; "
            f"backend: {self.backend or 'unknown'}",
        ]
        if not self.applied:
            return "\n".join([*lines, "", f"Nothing applied: {self.reason}"])
        lines += ["", f"Replaced modules ({len(self.replaced)}):"]
        lines += _table(
            ["name", "type", "fused type", "shape", "config"],
            [
                [r["name"] or "(root)", r["type"], r["fused_type"],
                 "-" if r["shape"] is None else "x".join(map(str, r["shape"])), r["config"]]
                for r in self.replaced
            ],
        )
        if self.routed_functions:
            lines += ["", f"Routed functional calls ({len(self.routed_functions)}):"]
            lines += _table(
                ["name", "type", "calls", "via"],
                [[r["name"] or "(root)", r["type"], ", ".join(r["calls"]), r["via"]]
                 for r in self.routed_functions],
            )
        lines += ["", f"Skipped modules ({len(self.skipped)}):"]
        lines += _table(
            ["name", "type", "reason"],
            [[s["name"] or "(root)", s["type"], s["reason"]] for s in self.skipped],
        )
        lines += ["", f"Fused epilogue patterns ({len(self.fused_patterns)}):"]
        lines += _table(
            ["name", "type", "pattern", "via"],
            [[f["name"] or "(root)", f["type"], f["pattern"], f["via"]]
             for f in self.fused_patterns],
        )
        if self.pattern_skipped:
            lines += ["", f"Pattern candidates left alone ({len(self.pattern_skipped)}):"]
            lines += _table(
                ["name", "type", "reason"],
                [[s["name"] or "(root)", s["type"], s["reason"]] for s in self.pattern_skipped],
            )
        if self.lean_dropout:
            lines += ["", f"Dropout modules whose eval-mode call skips F.dropout "
                      f"({len(self.lean_dropout)}; the same result, training unchanged)."]
        if self.excluded:
            lines += ["", "Excluded subtrees (no module swap, no functional routing): "
                      + ", ".join(n or "(root)" for n in self.excluded)]
        if self.unmatched_exclude:
            lines += ["", "Warning: exclude entries that matched nothing: "
                      + ", ".join(self.unmatched_exclude)]
        return "\n".join(lines + ["", *self._verification_lines()])

    def _verification_lines(self) -> list[str]:
        v = self.verification
        if v is None:
            return ["Verification: not run (pass example_inputs=... to run one forward)."]
        lines = [f"Verification ({v['mode']}; backend: {v['backend']}):"]
        calls = v.get("module_calls")
        if calls is not None:
            lines.append("  swapped module calls: "
                         + ", ".join(f"{op}={calls.get(op, 0)}" for op in OPS))
        routed = v["routed_calls"]
        fused = v["fused_calls"]
        lines.append(
            "  calls routed to fusedops: "
            + ", ".join(f"{op}={routed.get(op, 0)}" for op in OPS)
        )
        if v.get("pattern_calls"):
            lines.append("  epilogue pattern calls: " + ", ".join(
                f"{k}={n}" for k, n in v["pattern_calls"].items()))
        lines.append(
            "  calls run on fused kernels: "
            + ", ".join(f"{k}={fused.get(k, 0)}" for k in sorted(fused))
        )
        if v.get("note"):
            lines.append(f"  note: {v['note']}")
        lines += _table(
            ["output", "shape", "dtype", "max abs diff", "max rel diff"],
            [
                [o["name"], "x".join(map(str, o["shape"])) or "()", o["dtype"],
                 _fmt(o["max_abs_diff"]), _fmt(o["max_rel_diff"])]
                for o in v["outputs"]
            ],
        )
        return lines


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return ["  (none)"]
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]
