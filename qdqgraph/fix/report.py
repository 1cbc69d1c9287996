"""What a `fix` run did, as data (JSON) and as the summary the CLI prints: what was read, every
move (kept, moved, merged, converted, dropped, added), and the linter's findings and the predicted
reformats inside the network before and after."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from ..passes.base import PassResult
from ..report import RunLog
from .scales import KINDS, Move

SHOWN_PER_KIND = 4             # moves listed per kind in the summary (all of them in the JSON)


@dataclass
class FixReport(RunLog):
    input: str | None = None
    output: str | None = None
    config: dict = field(default_factory=dict)
    read: dict = field(default_factory=dict)                  # what the model held (facts.Facts.counts)
    moves: list[Move] = field(default_factory=list)
    unchanged: bool = False                                   # the model was already as TensorRT wants it
    activation_sites: int = 0
    weight_sites: int = 0
    calibrated: dict | None = None                            # {"method", "samples", "tensors"}
    clamps: list[dict] = field(default_factory=list)          # one-sided Q ranges restored as Clips
    lint_before: list[str] = field(default_factory=list)
    lint_after: list[str] = field(default_factory=list)
    tensorrt_before: dict | None = None                       # simulator summaries
    tensorrt_after: dict | None = None
    high_precision: str = "keep"
    passes: list[PassResult] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    opset_raised_from: int | None = None

    def counts(self) -> dict[str, int]:
        c = Counter(m.kind for m in self.moves)
        return {k: c[k] for k in KINDS}

    @staticmethod
    def codes(lines: list[str]) -> dict[str, int]:
        return dict(sorted(Counter(x.split(" ", 1)[0] for x in lines).items()))

    def to_dict(self) -> dict:
        return {"input": self.input, "output": self.output, "unchanged": self.unchanged, "read": self.read,
                "placed": {"activation_sites": self.activation_sites, "weight_sites": self.weight_sites},
                "counts": self.counts(), "moves": [m.to_dict() for m in self.moves], "calibrated": self.calibrated,
                "clamps": self.clamps,
                "lint": {"before": self.lint_before, "after": self.lint_after,
                         "codes_before": self.codes(self.lint_before), "codes_after": self.codes(self.lint_after)},
                "tensorrt": {"before": self.tensorrt_before, "after": self.tensorrt_after},
                "high_precision": self.high_precision, "config": self.config, "warnings": self.warnings,
                "passes": [p.to_dict() for p in self.passes],
                "stages": {k: round(v, 4) for k, v in self.stages.items()}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=str) + "\n"

    def summary(self, warnings: bool = True) -> str:
        """The lines the CLI prints; `warnings=False` leaves the warnings out (the CLI writes them
        to stderr)."""
        r = self.read
        types = ", ".join(f"{n} {t}" for t, n in r.get("types", {}).items())
        lines = [f"read: {r.get('activation_dq', 0)} activation Q/DQ on {r.get('activation_tensors', 0)} tensors, "
                 f"{r.get('weight_dq', 0)} weight DQ, {r.get('bias_dq', 0)} bias DQ ({types})"]
        if self.unchanged:
            lines.append("nothing to fix: the Q/DQ already sit where TensorRT's rules put them, with scales it takes; "
                         "the model is written as it was")
        else:
            c = self.counts()
            lines.append(f"placed by TensorRT's rules: {self.activation_sites} activation Q/DQ, {self.weight_sites} "
                         "weight DQ; " + ", ".join(f"{k} {c[k]}" for k in KINDS))
            for kind in KINDS[1:]:
                shown = [m for m in self.moves if m.kind == kind]
                for m in shown[:SHOWN_PER_KIND]:
                    lines.append(f"  {kind} {m.what} {m.tensor}: {m.detail}")
                if len(shown) > SHOWN_PER_KIND:
                    lines.append(f"  ... and {len(shown) - SHOWN_PER_KIND} more {kind} (--report for all)")
            if self.clamps:
                shown = ", ".join(f"{c['tensor']} [{_bound(c['min'], '-inf')}, {_bound(c['max'], 'inf')}]"
                                  for c in self.clamps[:3])
                more = f" and {len(self.clamps) - 3} more" if len(self.clamps) > 3 else ""
                lines.append(f"clamps kept: {len(self.clamps)} Q ranges that stop at 0 (a Relu or Clip folded into an "
                             f"asymmetric Q) are Clip nodes now, as the symmetric INT8 Q no longer clamps: {shown}{more}")
            if self.calibrated:
                lines.append(f"calibrated: {self.calibrated['tensors']} scale groups the model held no scale for, "
                             f"{self.calibrated['method']} over {self.calibrated['samples']} samples")
        before, after = self.codes(self.lint_before), self.codes(self.lint_after)
        by_code = ", ".join(f"{k} {before.get(k, 0)} -> {after.get(k, 0)}" for k in sorted(set(before) | set(after)))
        lines.append(f"linter findings: {len(self.lint_before)} -> {len(self.lint_after)}" +
                     (f" ({by_code})" if by_code else ""))
        b, a = self.tensorrt_before, self.tensorrt_after
        if b and a:
            lines.append(f"TensorRT prediction: reformats inside the network {b['reformats_inside']} -> "
                         f"{a['reformats_inside']}, layers {b['int8_layers']}/{b['layers']} -> "
                         f"{a['int8_layers']}/{a['layers']} {a.get('quantized') or 'quantized'}, quantized FLOPs "
                         f"{100 * b['int8_flops_share']:.1f}% -> {100 * a['int8_flops_share']:.1f}%")
        if self.output:
            lines.append(f"wrote {self.output}")
        lines += [f"warning: {w}" for w in (dict.fromkeys(self.warnings) if warnings else ())]
        return "\n".join(lines)


def _bound(b, none: str) -> str:
    return none if b is None else f"{b:g}"
