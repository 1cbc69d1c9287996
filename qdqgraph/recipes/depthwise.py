"""Depthwise convolutions that quantization ruins on their own: `--depthwise-check on|off`.

A depthwise convolution (or a grouped one whose groups read a few channels each) computes each
output channel from one input channel. TensorRT quantizes an activation with one scale for the whole
tensor, so a channel whose values are a hundred times smaller than the tensor's largest sits on a
few INT8 steps; where batch normalization folded a large weight onto that channel, the convolution
writes that rounding at full size into its output. In a PP-LCNet detector the first depthwise
convolution's input is quantized at 31 dB and its output comes out at 9.6 dB; four more such layers
took the model's outputs to 2-5 dB while every dense convolution stayed above 19 dB. Placement cannot
see this; the calibration data can, cheaply, because such a layer is cheap to compute alone.

After calibration, each quantized convolution with at most MAX_PER_GROUP input channels per group is
computed in numpy on the first SAMPLES calibration samples, at POSITIONS output positions of each,
twice: in float, and with its input and its weight on the grid the plan gives them. The layers whose
own output SQNR is below DEPTHWISE_LOCAL_DB are the candidates, worst first, while they cost at most
DEPTHWISE_MAX_FLOPS of the model's FLOPs. The Q/DQ model is then measured with the candidates
quantized and float (one switchable session, qdqgraph.recipes.sensitivity); they return to float
when the outputs gain at least DEPTHWISE_MIN_GAIN_DB and are under DEPTHWISE_ENOUGH_DB with them
quantized (a model already that close to float spends no FLOPs on it). The summary line says
which, why and what it cost.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ..config import (DEPTHWISE_ENOUGH_DB, DEPTHWISE_LOCAL_DB, DEPTHWISE_MAX_FLOPS, DEPTHWISE_MIN_GAIN_DB,
                      QuantizeConfig)
from ..errors import option
from ..execution.runtime import float_activations
from ..graph import io
from ..graph.view import GraphView
from ..passes.insert import quantize_weight, weight_scales
from ..placement.plan import Plan
from ..precisions.formats import Format, label
from ..samples.data import CalibrationData
from .conv_math import conv_geometry, grouped_conv
from .fidelity.floor import node_flops
from .sensitivity import floated_gain

SAMPLES = 4             # calibration samples each layer is computed on
POSITIONS = 4096        # output positions of each sample it is computed at (all where there are fewer)
MAX_PER_GROUP = 4       # input channels per group: a dense convolution averages a crushed channel away


@dataclass
class Layer:
    node: gs.Node
    tensor: str                 # the quantized input
    weight: np.ndarray
    bias: np.ndarray | None
    axis: int | None            # the weight's per-channel axis


def candidates(graph: gs.Graph, plan: Plan) -> list[Layer]:
    """The quantized grouped convolutions of `plan` with few input channels per group, their input
    and weight quantized and their weight and bias constant."""
    view = GraphView(graph, lazy=True)      # read only: op types and constants
    acts = {e: s for s in plan.activation_sites() for e in s.edges}
    weights = {e: s for s in plan.weight_sites() for e in s.edges}
    nodes = {n.name: n for n in graph.nodes}
    found = []
    for name in plan.quantized_nodes():
        node = nodes.get(name)
        if node is None or not view.vocab.is_(node, "conv") or int(node.attrs.get("group", 1)) == 1:
            continue
        act, wsite = acts.get((name, 0)), weights.get((name, 1))
        if act is None or wsite is None or act.tensor != node.inputs[0].name:
            continue
        w = view.constant_value(node.inputs[1])
        bias = view.constant_value(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2].name else None
        if w is None or w.ndim < 3 or w.shape[1] > MAX_PER_GROUP or (len(node.inputs) > 2 and node.inputs[2].name
                                                                    and bias is None):
            continue
        found.append(Layer(node, act.tensor, w.astype(np.float32), None if bias is None else bias.astype(np.float32),
                           wsite.axis))
    return found


def local_sqnr(loaded: io.Loaded, layers: list[Layer], amax: dict[str, float], data: CalibrationData,
               fmt: Format) -> dict[str, float]:
    """{node: its own output SQNR (dB)} with its input at amax[tensor] and its weight per channel
    in `fmt`, against the float layer, on the first SAMPLES calibration samples."""
    weights = {}
    for layer in layers:
        s = weight_scales(layer.weight, layer.axis, fmt)
        shape = [-1 if d == layer.axis else 1 for d in range(layer.weight.ndim)] if layer.axis is not None else []
        weights[layer.node.name] = quantize_weight(layer.weight, s, layer.axis, fmt).astype(np.float32) * \
            (s.reshape(shape) if shape else s)
    signal: dict[str, float] = defaultdict(float)
    noise: dict[str, float] = defaultdict(float)
    names = sorted({layer.tensor for layer in layers})
    rng = np.random.default_rng(0)
    for values in float_activations(loaded, names, data, SAMPLES, "depthwise check"):
        for layer in layers:
            x = np.asarray(values[layer.tensor], dtype=np.float32)
            xq = fmt.fake_quantize(x, fmt.scale_of(amax[layer.tensor]))
            total = int(np.prod(conv_geometry(layer.node, x.shape[2:], layer.weight.shape[2:])[3]))
            at = np.sort(rng.choice(total, POSITIONS, replace=False)) if total > POSITIONS else None
            y = grouped_conv(layer.node, x, layer.weight, layer.bias, at)
            e = grouped_conv(layer.node, xq, weights[layer.node.name], layer.bias, at) - y
            signal[layer.node.name] += float(np.vdot(y, y))
            noise[layer.node.name] += float(np.vdot(e, e))
    return {name: 10.0 * float(np.log10(max(signal[name], 1e-30) / max(noise[name], 1e-30))) for name in signal}


def _chosen(local: dict[str, float], flops: dict[str, float], total: float) -> list[str]:
    """The layers under DEPTHWISE_LOCAL_DB, worst first, while their FLOPs stay within the budget."""
    out, spent = [], 0.0
    for name in sorted((n for n, db in local.items() if db < DEPTHWISE_LOCAL_DB), key=local.__getitem__):
        if spent + flops.get(name, 0.0) > DEPTHWISE_MAX_FLOPS * total:
            continue
        spent += flops.get(name, 0.0)
        out.append(name)
    return out


def decide(loaded: io.Loaded, plan: Plan, amax: dict[str, float], data: CalibrationData, cfg: QuantizeConfig,
           progress=None, float_outputs=None) -> tuple[tuple, dict]:
    """((node, why) to return to float, the record for the report). `amax`: the calibrated ranges, by
    scale-sharing group (Plan.groups), as insert_qdq reads them."""
    fmt = cfg.format
    assert fmt is not None, "weight-only runs take their own pipeline, without this check"
    layers = candidates(loaded.graph, plan)
    info: dict = {"checked": len(layers), "local_db": DEPTHWISE_LOCAL_DB}
    if not layers:
        return (), info
    per_tensor = {t: amax[rep] for rep, members in plan.groups().items() if rep in amax for t in members}
    local = local_sqnr(loaded, [x for x in layers if x.tensor in per_tensor], per_tensor, data, fmt)
    flops = node_flops(loaded.graph, loaded.dims)
    total = sum(flops.values()) or 1.0
    chosen = _chosen(local, flops, total)
    info["lowest"] = {n: round(db, 2) for n, db in sorted(local.items(), key=lambda kv: kv[1])[:5]}
    if not chosen:
        return (), info
    all_db, floated_db, samples = floated_gain(loaded, plan, amax, data, cfg, set(chosen), progress, float_outputs)
    gain = floated_db - all_db
    share = sum(flops.get(n, 0.0) for n in chosen) / total
    info.update(candidates={n: round(local[n], 2) for n in chosen}, all_quantized_db=round(all_db, 2),
                floated_db=round(floated_db, 2), flops_share=round(100.0 * share, 2), samples=samples,
                kept_float=bool(gain >= DEPTHWISE_MIN_GAIN_DB and all_db < DEPTHWISE_ENOUGH_DB),
                enough_db=DEPTHWISE_ENOUGH_DB)
    if not info["kept_float"]:
        return (), info
    q = label(cfg.precision)
    return tuple((n, f"depthwise check: {q} input and weight give its own output {local[n]:.1f} dB (under "
                     f"{DEPTHWISE_LOCAL_DB:g}); float, the outputs gain {gain:.1f} dB; "
                     f"{option('depthwise_check', 'off')} keeps it {q}") for n in chosen), info

