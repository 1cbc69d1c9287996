"""Whether the attention's two batched GEMMs run INT8: `--int8-attention auto|on|off`.

Placement quantizes both GEMMs of every attention block the rules allow (P15): TensorRT then runs
the block as one fused INT8 attention layer (F10). That is fast, but the probabilities on a fixed
scale of 1/127 and per-tensor INT8 queries, keys and values cost some models a lot (a ViT with 257
tokens loses about 16 dB of output SQNR; text encoders of 128 tokens lose little). In `auto` mode
(the default) the Q/DQ model is built twice in one switchable session (qdqgraph.recipes.sensitivity): all
INT8, and with every attention GEMM float; the attention stays INT8 when that costs at most
ATTENTION_MAX_LOSS_DB, else its GEMMs return to float with the measured cost as the reason. `off`
floats them without measuring; `on` keeps them.
"""
from __future__ import annotations

import onnx_graphsurgeon as gs

from ..graph import attention, io
from ..config import ATTENTION_MAX_LOSS_DB, QuantizeConfig
from ..samples.data import CalibrationData
from ..placement.plan import Plan
from ..errors import option
from ..precisions.formats import label
from .sensitivity import floated_gain
from ..graph.view import GraphView


def attention_gemms(graph: gs.Graph, plan: Plan) -> list[str]:
    """The quantized nodes of `plan` that are the first or second GEMM of an attention block."""
    g = GraphView(graph, lazy=True).named()        # read only: the graph stays as it is
    nodes = {n.name: n for n in graph.nodes}
    return sorted(name for name in plan.quantized_nodes()
                  if name in nodes and g.vocab.is_(nodes[name], "matmul") and attention.of(g, nodes[name]) is not None)


def decide(loaded: io.Loaded, plan: Plan, amax: dict, data: CalibrationData | None,
           cfg: QuantizeConfig, progress=None, float_outputs=None) -> tuple[tuple, dict]:
    """((node, why) to return to float, the record for the report). `float_outputs`: the float
    graph's outputs the calibration kept (calib.collect.FloatOutputs), measured against instead of
    running it again where they cover the samples."""
    gemms = attention_gemms(loaded.graph, plan)
    info = {"mode": cfg.int8_attention, "gemms": len(gemms), "max_loss_db": ATTENTION_MAX_LOSS_DB}
    if not gemms or cfg.int8_attention == "on":
        info["int8"] = bool(gemms)
        return (), info
    if cfg.int8_attention == "off":
        info["int8"] = False
        return tuple((n, f"attention: {option('int8_attention', 'off')}") for n in gemms), info
    if data is None:
        info.update(int8=True, why="no calibration data to measure its cost")
        return (), info
    all_db, floated_db, samples = floated_gain(loaded, plan, amax, data, cfg, set(gemms), progress, float_outputs)
    loss = floated_db - all_db
    info.update(all_int8_db=round(all_db, 2), attention_float_db=round(floated_db, 2),
                loss_db=round(loss, 2), samples=samples, int8=bool(loss <= ATTENTION_MAX_LOSS_DB))
    if info["int8"]:
        return (), info
    why = (f"attention: {label(cfg.precision)} attention costs {loss:.1f} dB output SQNR ({all_db:.1f} -> "
           f"{floated_db:.1f} dB with it float, over {ATTENTION_MAX_LOSS_DB:g} dB allowed; "
           f"{option('int8_attention', 'on')} keeps it)")
    return tuple((n, why) for n in gemms), info
