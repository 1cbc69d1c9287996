"""What an `insert` run did, as data (JSON) and as the summary the CLI prints."""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

from .placement.plan import Plan


@dataclass
class InsertReport:
    input: str | None = None
    output: str | None = None
    method: str = "percentile"
    samples: int = 0
    calibration_seconds: float = 0.0
    opset_raised_from: int | None = None
    no_ops_removed: int = 0
    fixed_inputs: dict[str, object] = field(default_factory=dict)
    ifs_inlined: list[str] = field(default_factory=list)
    smoothed: dict[str, list[str]] = field(default_factory=dict)
    constants_folded: int = 0
    batchnorm_folded: int = 0
    batchnorm_kept: list[dict] = field(default_factory=list)
    activation_sites: int = 0
    weight_sites: int = 0
    ops: dict[str, dict[str, int]] = field(default_factory=dict)
    skipped: list[dict] = field(default_factory=list)
    sites: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    fallback: dict | None = None
    tensorrt: dict | None = None      # the simulator's summary of the written model
    precision: dict | None = None     # the float islands' type and what stayed float32
    bias_corrected: int = 0           # weighted ops whose bias absorbed the weight-quantization shift

    def fill_from_plan(self, plan: Plan, amax: dict[str, float] | None = None) -> None:
        counts: dict[str, Counter] = defaultdict(Counter)
        for d in plan.decisions.values():
            counts[d.op]["quantized" if d.quantized else "skipped"] += 1
            if not d.quantized:
                self.skipped.append({"node": d.node, "op": d.op, "rule": d.rule, "reason": d.reason})
        self.ops = {op: {"quantized": c["quantized"], "skipped": c["skipped"]} for op, c in sorted(counts.items())}
        self.activation_sites = len(plan.activation_sites())
        self.weight_sites = len(plan.weight_sites())
        for s in sorted(plan.sites.values(), key=lambda s: s.tensor):
            entry = {"tensor": s.tensor, "kind": s.kind, "rule": s.rule, "consumers": [e[0] for e in s.edges]}
            if s.kind == "weight":
                entry["axis"] = s.axis
            elif amax is not None:
                entry["amax"] = amax.get(s.group or s.tensor)
                if s.group and s.group != s.tensor:
                    entry["shares_scale_with"] = s.group
            self.sites.append(entry)
        self.warnings.extend(plan.notes)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, default=float)

    def summary(self, max_examples: int = 3) -> str:
        lines = []
        if self.opset_raised_from:
            lines.append(f"opset raised from {self.opset_raised_from} to 13 (per-channel Q/DQ needs it)")
        if self.fixed_inputs:
            fixed = ", ".join(f"{k}={v}" for k, v in self.fixed_inputs.items())
            lines.append(f"fixed inputs: {fixed} (the written model no longer has them)")
        if self.ifs_inlined:
            lines.append(f"inlined: {len(self.ifs_inlined)} If node(s) with a constant condition "
                         f"({', '.join(self.ifs_inlined[:max_examples])}{', ...' if len(self.ifs_inlined) > max_examples else ''})")
        removed = f"{self.no_ops_removed} Identity/Dropout removed, " if self.no_ops_removed else ""
        lines.append(f"cleaned: {removed}{self.constants_folded} constant nodes folded, "
                     f"{self.batchnorm_folded} BatchNormalization folded, {len(self.batchnorm_kept)} kept")
        for bn in self.batchnorm_kept[:max_examples]:
            lines.append(f"  kept {bn['node']}: {bn['reason']}")
        if self.samples:
            lines.append(f"calibrated: {self.method} over {self.samples} samples in {self.calibration_seconds:.1f} s")
        lines.append(f"placed: {self.activation_sites} activation Q/DQ, {self.weight_sites} weight DQ")
        if self.smoothed:
            nodes = sum(len(v) for v in self.smoothed.values())
            lines.append(f"smoothing: {len(self.smoothed)} activations migrate their outliers into {nodes} weights")
        if self.bias_corrected:
            lines.append(f"bias correction: {self.bias_corrected} biases absorb the weight-quantization shift")
        width = max([len(op) for op in self.ops] + [7])
        lines.append(f"  {'op':<{width}}  quantized  skipped")
        for op, c in self.ops.items():
            lines.append(f"  {op:<{width}}  {c['quantized']:>9}  {c['skipped']:>7}")
        by_rule: dict[tuple, list[str]] = defaultdict(list)
        for s in self.skipped:
            by_rule[(s["op"], s["rule"], s["reason"] if s["rule"] != "user-exclude" else s["reason"])].append(s["node"])
        if by_rule:
            lines.append("skipped (op, rule: reason):")
            for (op, rule, reason), nodes in sorted(by_rule.items(), key=lambda kv: (-len(kv[1]), kv[0])):
                ex = ", ".join(nodes[:max_examples]) + (f", ... ({len(nodes)} in all)" if len(nodes) > max_examples else "")
                lines.append(f"  {op} {rule}: {reason}  [{ex}]")
        if self.precision:
            p = self.precision
            lines.append(f"float islands: {p['high_precision']} ({p['retyped_tensors']} tensors retyped, {p['casts']} "
                         f"casts, {len(p['kept_fp32'])} nodes kept fp32); in onnxruntime, run it with "
                         f"disabled_optimizers=['WeightBiasQuantization'] (README, Deployment)")
        if self.tensorrt:
            t = self.tensorrt
            lines.append(f"TensorRT prediction: {t['layers']} layers, {t['int8_layers']} INT8, {t['float_layers']} "
                         f"float, {t['reformats']} reformats ({t['reformats_inside']} inside the network), "
                         f"INT8 FLOPs {100 * t['int8_flops_share']:.1f}% (qdqgraph report OUT.onnx for the layers)")
        if self.fallback:
            fb = self.fallback
            lines.append(f"fallback: output SQNR {fb['all_int8_db']:.1f} dB all INT8 -> {fb['final_db']:.1f} dB with "
                         f"{len(fb['float_nodes'])} node(s) in float (budget {fb['budget_db']} dB, "
                         f"max {fb['max_float_layers']}; {fb['samples']} samples, {fb['seconds']:.1f} s)")
            for n in fb["float_nodes"]:
                gain = next(r["gain_db"] for r in fb["ranking"] if r["node"] == n)
                lines.append(f"  float: {n} (+{gain:.1f} dB alone)")
        for w in self.warnings:
            lines.append(f"warning: {w}")
        if self.output:
            lines.append(f"wrote {self.output}")
        return "\n".join(lines)
