"""SimReport: the predicted engine, layer by layer, as JSON, as a text table, or as ONNX."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..rulebook.match import Context
from .conditions import evaluate
from .export import to_onnx

if TYPE_CHECKING:
    from .ir import SimGraph
    from .rules import SimRuleSet


@dataclass
class Port:
    tensor: str
    precision: str                       # "int8" | "fp32" | "fp16"

    def to_json(self):
        return {"tensor": self.tensor, "precision": self.precision}


@dataclass
class Layer:
    name: str                            # the fused ONNX node names joined by " + " (as TensorRT does)
    nodes: list[str]                     # ONNX node names in the layer
    ops: list[str]                       # their op types
    kind: str                            # convolution, gemm, pooling, elementwise, shuffle, reformat, ...
    inputs: list[Port]
    outputs: list[Port]
    reformat: bool
    rule: str                            # the rule that made the layer
    flops: float = 0.0
    flops_share: float = 0.0
    at_graph_io: bool = False            # a reformat on a graph input or output (P12)
    why: list[tuple[str, str]] = field(default_factory=list)   # reformats: (rule tried, why it failed)

    @property
    def int8(self) -> bool:
        """A layer runs INT8 when its (first) activation input is INT8 (F9)."""
        return not self.reformat and bool(self.inputs) and self.inputs[0].precision == "int8"

    def to_json(self):
        d = {"name": self.name, "nodes": self.nodes, "ops": self.ops, "kind": self.kind,
             "inputs": [p.to_json() for p in self.inputs], "outputs": [p.to_json() for p in self.outputs],
             "reformat": self.reformat, "rule": self.rule, "flops": self.flops,
             "flops_share": round(self.flops_share, 6)}
        if self.reformat:
            d["at_graph_io"] = self.at_graph_io
            d["why"] = [{"rule": r, "reason": w} for r, w in self.why]
        return d


@dataclass
class SimReport:
    layers: list[Layer]
    eliminated: list[dict] = field(default_factory=list)      # cancelled DQ -> Q pairs
    events: list[dict] = field(default_factory=list)          # propagation rewrites that fired
    node_names: set[str] = field(default_factory=set)         # every ONNX node name of the input
    graph_inputs: list[tuple] = field(default_factory=list)   # (name, dtype, shape) for the ONNX export
    graph_outputs: list[tuple] = field(default_factory=list)
    steps: int = 0                                            # propagation rewrites until the fixpoint
    misses: dict = field(default_factory=dict)                # node -> {rule id: why it did not apply}
    shapes: dict = field(default_factory=dict)                # tensor -> shape, for the ONNX export
    final: tuple[SimGraph, SimRuleSet] | None = field(default=None, repr=False)  # (SimGraph after propagation, rule set)
    quantized: str = "INT8"                                   # the Q/DQ's types: INT8, FP8, INT4, "A+B", or
                                                              # "" (no Q/DQ)
    int4_weight_layers: int = 0                               # GEMM layers with INT4 weights (weight-only)

    @property
    def reformats(self) -> list[Layer]:
        return [x for x in self.layers if x.reformat]

    @property
    def formats(self) -> frozenset[str]:
        """The quantized formats the engine computes in (INT8, FP8, INT4); none for a float engine."""
        computes = self.summary["int8_layers"] or self.int4_weight_layers
        return frozenset(self.quantized.split("+")) if computes and self.quantized else frozenset()

    @property
    def summary(self) -> dict:
        total = sum(x.flops for x in self.layers)
        int8_flops = sum(x.flops for x in self.layers if x.int8)
        compute = [x for x in self.layers if not x.reformat]
        return {"layers": len(self.layers), "int8_layers": sum(1 for x in compute if x.int8),
                "float_layers": sum(1 for x in compute if not x.int8), "reformats": len(self.reformats),
                "reformats_inside": sum(1 for x in self.reformats if not x.at_graph_io),
                "int8_flops_share": round(int8_flops / total, 6) if total else 0.0, "quantized": self.quantized,
                "int4_weight_layers": self.int4_weight_layers}

    def to_dict(self) -> dict:
        return {"layers": [x.to_json() for x in self.layers], "summary": self.summary,
                "eliminated": self.eliminated, "events": self.events}

    def layer_of(self, node: str) -> Layer | None:
        return next((x for x in self.layers if node in x.nodes), None)

    def explain(self, rule_id: str, node: str) -> tuple[bool, str]:
        """Did rule `rule_id` apply to ONNX node `node`, and if not, why? ("why is this Q a
        Reformat", "why did this BN not fuse").) The rule's own answer when it was tried on the
        node; otherwise what became of the node, or the rule's conditions on the final graph."""
        for e in self.events:
            if e["rule"] == rule_id and node in e["nodes"]:
                return True, e["detail"]
        why = self.misses.get(node, {}).get(rule_id)
        if why is not None:
            return False, why
        assert self.final is not None, "explain() needs the report of a simulation (SimReport.final)"
        g, rules = self.final
        rule = rules.by_id.get(rule_id)
        if rule is None:
            raise KeyError(f"no simulator rule {rule_id!r}")
        sim = next((n for n in g.nodes.values() if node == n.name or node in n.origin), None)
        if sim is not None:
            m = evaluate(Context(g), rule, sim)
            if not m:
                return False, m.reason
        layer = self.layer_of(node)
        if layer is not None:
            return False, f"it is in the {layer.rule} layer {layer.name}"
        for e in self.eliminated:
            if node in e["nodes"]:
                return False, f"{e['rule']} removed it"
        return False, "never tried on it" if sim is not None else "it is not in the simulated graph"

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def table(self, width: int = 70) -> str:
        """One line per layer: kind, precision in -> out, rule, FLOPs share, fused nodes; the
        reasons under each reformat; the summary last."""
        rows = [("#", "kind", "in -> out", "rule", "flops", "layer")]
        # the simulator marks every quantized tensor "int8"; the listing names the model's one format
        shown = {"int8": self.quantized.lower()} if self.quantized in ("FP8",) else {}
        for i, x in enumerate(self.layers):
            prec = (f"{','.join(shown.get(p.precision, p.precision) for p in x.inputs)} -> "
                    f"{','.join(shown.get(p.precision, p.precision) for p in x.outputs)}")
            name = x.name if len(x.name) <= width else x.name[:width - 3] + "..."
            rows.append((str(i), x.kind + ("*" if x.reformat and x.at_graph_io else ""), prec, x.rule,
                         f"{100 * x.flops_share:.1f}%" if x.flops else "", name))
        widths = [max(len(r[c]) for r in rows) for c in range(5)]
        lines = []
        for k, r in enumerate(rows):
            lines.append("  ".join(r[c].ljust(widths[c]) for c in range(5)) + "  " + r[5])
            above = self.layers[k - 1] if k else None
            if above is not None and above.reformat:
                for rule, why in above.why:
                    lines.append(" " * (widths[0] + 2) + f"- {rule}: {why}")
        s = self.summary
        q = self.quantized or "quantized"
        if s["int4_weight_layers"]:
            lines.append(f"{s['int4_weight_layers']} GEMM layers with INT4 weights (weight-only: they run in "
                         f"the float type of their activations)")
        lines.append(f"{s['layers']} layers: {s['int8_layers']} {q}, {s['float_layers']} float, "
                     f"{s['reformats']} reformats ({s['reformats_inside']} inside the network; * = at a graph "
                     f"input/output); {q} FLOPs {100 * s['int8_flops_share']:.1f}%")
        return "\n".join(lines)

    def to_onnx(self):
        return to_onnx(self)
