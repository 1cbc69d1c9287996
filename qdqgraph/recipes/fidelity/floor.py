"""The floor's fallback: quantized nodes back to float, most output SQNR per FLOP first, until the
output SQNR reaches the floor or the float FLOPs would take the quantized share below its minimum."""
from __future__ import annotations

from typing import Callable

import onnx_graphsurgeon as gs

from ...placement.plan import Plan
from ..sensitivity import Sensitivity
from ...trtsim.flops import node_flops as _flops
from ...trtsim.ir import SimGraph


def node_flops(graph: gs.Graph, dims: dict[str, int] | None = None) -> dict[str, float]:
    """FLOPs of every weighted node of a float graph (multiply-adds count 2), by node name; `dims`:
    the symbolic dimensions' values to count at (io.bound_dims), else each counts as 1."""
    g = SimGraph.from_gs(graph).bind(dims)
    return {name: f for name, n in g.nodes.items() if (f := _flops(g, n))}


def quantized_share(plan: Plan, flops: dict[str, float]) -> float:
    """The share of the weighted FLOPs whose node the plan quantizes."""
    total = sum(flops.values())
    q = sum(f for n, f in flops.items() if (d := plan.decisions.get(n)) is not None and d.quantized)
    return q / total if total else 0.0


def ranked(sens: Sensitivity, flops: dict[str, float]) -> list[str]:
    """The weighted units with a gain, most dB per FLOP first."""
    weighted = [u for u in sens.units if u.gain_db > 0 and flops.get(u.node, 0.0) > 0]
    return [u.node for u in sorted(weighted, key=lambda u: (-u.gain_db / flops[u.node], u.node))]


def floor_units(sens: Sensitivity, evaluate: Callable[[set], float], floor_db: float, flops: dict[str, float],
                allowed_flops: float) -> tuple[list[str], float, float]:
    """Greedy over the weighted units (Conv, Gemm, MatMul) with a gain, by dB per FLOP: a unit joins
    when the sweep says it raises the output SQNR and its FLOPs fit `allowed_flops`. Units without
    FLOPs (an Add, a pooling) are left out: the sweep cannot see what returning one costs the
    layers around it (their fusion; on ppocr_mobile_v2_cls three of them took the written model
    from 16.8 to 15.1 dB where the sweep promised 21.4). Returns (units, the sweep's SQNR with them
    float, their FLOPs)."""
    chosen: list[str] = []
    current, spent = sens.all_int8_db, 0.0
    for u in ranked(sens, flops):
        if current >= floor_db:
            break
        f = flops[u]
        if spent + f > allowed_flops:
            continue
        trial = evaluate(set(chosen) | {u})
        if trial > current:
            chosen.append(u)
            current, spent = trial, spent + f
    return chosen, current, spent
