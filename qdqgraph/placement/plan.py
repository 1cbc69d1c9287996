"""The plan: which tensors get Q/DQ, on which consumer edges, by which rule; a decision per node.

A `Plan` is what placement produces and every later stage reads (calibration observes its scale
groups, insertion writes its sites, the report lists its decisions). `Selection` holds the user's
choices that placement obeys (excluded and included nodes, nodes the fallback returned to float).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass
class Site:
    """One tensor that gets a Q->DQ (activation) or an INT8 copy + DQ (weight)."""

    tensor: str
    kind: str                       # "activation" | "weight"
    rule: str
    axis: int | None = None         # weights: per-channel axis; None = per-tensor
    edges: list[tuple[str, int]] = field(default_factory=list)  # (consumer node name, input index)
    group: str | None = None        # tensors with the same group share one scale
    exact_amax: float | None = None # a range known from the graph (a one-hot: 1.0), not calibrated


@dataclass
class Decision:
    node: str
    op: str
    quantized: bool
    rule: str | None
    reason: str


@dataclass
class Plan:
    sites: dict[str, Site] = field(default_factory=dict)
    decisions: dict[str, Decision] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    _edges: set = field(default_factory=set, repr=False, compare=False)

    def add_edge(self, site: Site, edge: tuple[str, int]) -> None:
        """Quantize `edge` through `site` (once)."""
        if edge not in self._edges:
            site.edges.append(edge)
            self._edges.add(edge)

    def activation_sites(self) -> list[Site]:
        return [s for s in self.sites.values() if s.kind == "activation"]

    def weight_sites(self) -> list[Site]:
        return [s for s in self.sites.values() if s.kind == "weight"]

    def groups(self) -> dict[str, list[str]]:
        """Scale-sharing groups: representative -> member tensors (every activation site is in one)."""
        out: dict[str, list[str]] = {}
        for s in self.activation_sites():
            out.setdefault(s.group or s.tensor, []).append(s.tensor)
        return out

    def is_quantized_edge(self, edge: tuple[str, int]) -> bool:
        return edge in self._edges

    def quantized_edges(self) -> set[tuple[str, int]]:
        return set(self._edges)

    def quantized_nodes(self) -> list[str]:
        return [n for n, d in self.decisions.items() if d.quantized]


@dataclass(frozen=True)
class Selection:
    """User choices: op types and node-name patterns to exclude, and patterns to force in."""

    exclude_ops: tuple[str, ...] = ()
    exclude_nodes: tuple[str, ...] = ()
    include_nodes: tuple[str, ...] = ()
    float_nodes: tuple[tuple[str, str], ...] = ()   # (exact node name, why): accuracy fallback
    region_nodes: tuple[tuple[str, str, str], ...] = ()   # (exact node name, rule id, why): P14

    def excluded(self, node) -> tuple[str, str] | None:
        """(rule id, why) if the node must stay float: "fallback", the P14 rule's id, or
        "user-exclude"; None otherwise."""
        for name, why in self.float_nodes:
            if node.name == name:
                return "fallback", why
        for name, rid, why in self.region_nodes:
            if node.name == name:
                return rid, why
        if node.op in self.exclude_ops:
            return "user-exclude", f"--exclude-op {node.op}"
        for pat in self.exclude_nodes:
            if re.search(pat, node.name or ""):
                return "user-exclude", f"--exclude-node {pat}"
        return None

    def included(self, node) -> bool:
        return self.includes(node.name or "")

    def includes(self, name: str) -> bool:
        """Does --include-node force the node of this name in?"""
        return any(re.search(p, name) for p in self.include_nodes)
