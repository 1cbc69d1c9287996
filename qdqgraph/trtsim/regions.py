"""INT8 regions of a predicted engine: the INT8 layers that hand INT8 tensors to each other, with
the standalone reformats on their border and the FLOPs they hold.

A region pays for its INT8 compute with the reformats that enter and leave it. One that holds a
small share of the FLOPs and is entered or left through a reformat inside the network costs more
than it saves: a standalone Reformat is a kernel launch and a memory pass of its own, while the
region's INT8 kernels save at most a part of a small layer's time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .report import Layer, SimReport


@dataclass
class Region:
    layers: list[Layer]
    entries: list[Layer] = field(default_factory=list)     # reformats into the region (float -> int8)
    exits: list[Layer] = field(default_factory=list)       # reformats out of it (int8 -> float)
    flops_share: float = 0.0

    @property
    def nodes(self) -> list[str]:
        return [n for x in self.layers for n in x.nodes]

    @property
    def inner_reformats(self) -> list[Layer]:
        """The border reformats inside the network (not on a graph input or output)."""
        return [x for x in self.entries + self.exits if not x.at_graph_io]


def int8_regions(report: SimReport) -> list[Region]:
    """The INT8 regions of `report`, in layer order: non-reformat layers with an INT8 input or
    output, joined where they read or write the same INT8 tensor (so the consumers of one Q are
    one region with its producer)."""
    members = [x for x in report.layers if not x.reformat and _int8_ports(x)]
    regions = _join(members)
    _attach_reformats(report.reformats, regions)
    for r in regions:
        r.flops_share = sum(x.flops_share for x in r.layers if x.int8)
    return regions


def _root(parent: list[int], i: int) -> int:
    """The representative of `i` in the union-find forest `parent` (halving the path on the way)."""
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


def _join(members: list[Layer]) -> list[Region]:
    """`members` grouped into regions where they read or write the same INT8 tensor, in order of
    each region's first layer."""
    parent = list(range(len(members)))
    first: dict[str, int] = {}            # int8 tensor -> the first member that reads or writes it
    for i, x in enumerate(members):
        for p in x.inputs + x.outputs:
            if p.precision == "int8":
                parent[_root(parent, i)] = _root(parent, first.setdefault(p.tensor, i))
    groups: dict[int, Region] = {}
    for i, x in enumerate(members):
        groups.setdefault(_root(parent, i), Region([])).layers.append(x)
    return list(groups.values())


def _attach_reformats(reformats: list[Layer], regions: list[Region]) -> None:
    """Add to each region the reformats that write its INT8 inputs (entries) and read its INT8
    outputs (exits), in reformat order."""
    by_tensor_in = {p.tensor: r for r in regions for x in r.layers for p in x.inputs if p.precision == "int8"}
    by_tensor_out = {p.tensor: r for r in regions for x in r.layers for p in x.outputs if p.precision == "int8"}
    for x in reformats:
        for p in x.outputs:
            r = by_tensor_in.get(p.tensor)
            if r is not None and x not in r.entries:
                r.entries.append(x)
        for p in x.inputs:
            r = by_tensor_out.get(p.tensor)
            if r is not None and x not in r.exits:
                r.exits.append(x)


def costly_regions(report: SimReport, max_share: float) -> list[Region]:
    """INT8 regions with a reformat inside the network on their border and at most `max_share`
    of the FLOPs."""
    return [r for r in int8_regions(report) if r.inner_reformats and r.flops_share <= max_share]


def _int8_ports(x: Layer) -> bool:
    return any(p.precision == "int8" for p in x.inputs + x.outputs)


def inner_reformats(report: SimReport) -> list[dict]:
    """Every standalone reformat inside the network, with the rule that made it (the last rule
    tried on it and why it failed), the op that produced its input, and what removing it by
    returning the INT8 region on its other side to float would cost (that region's share of the
    FLOPs; the smallest one where it borders two). The report lists these so that a reformat no
    placement removes is explained, not hidden."""
    border: dict[str, list[Region]] = {}
    for r in int8_regions(report):
        for x in r.entries + r.exits:
            border.setdefault(x.name, []).append(r)
    out = []
    for x in report.reformats:
        if x.at_graph_io:
            continue
        rule, reason = x.why[-1] if x.why else (x.rule, "")
        into = any(p.precision == "int8" for p in x.outputs)
        regions = sorted(border.get(x.name, []), key=lambda r: r.flops_share)
        region = regions[0] if regions else None
        out.append({"name": x.name, "direction": "float -> int8" if into else "int8 -> float", "rule": rule,
                    "reason": reason, "after": _producer_op(reason),
                    "region_layers": [y.name for y in region.layers] if region else [],
                    "region_flops_share": round(region.flops_share, 9) if region else 0.0})
    return out


def _producer_op(reason: str) -> str:
    """The op type a reason names first, as '(Op)' ('' when none)."""
    start = reason.find("(")
    end = reason.find(")", start)
    word = reason[start + 1:end] if start >= 0 and end > start else ""
    return word if word.isidentifier() else ""
