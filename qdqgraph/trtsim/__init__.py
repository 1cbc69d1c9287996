"""A TensorRT explicit-quantization simulator: how TensorRT will move, fuse and run the Q/DQ of a graph.

    from qdqgraph import trtsim
    report = trtsim.simulate(graph)          # gs.Graph, qdqgraph Loaded, ModelProto or path
    print(report.table()); report.to_json(); report.summary; report.to_onnx()
    trtsim.lint(graph)                       # QDQ2xx diagnostics: placements that cost fusion
    engine = trtsim.read_engine_report("layers.json")   # trtexec --exportLayerInfo / engine inspector
    print(trtsim.diff(report, engine).table())

The rules are data: rules/tensorrt/propagation.toml and fusion.toml (TRT_RULES.md sections 2-3),
each with an id; `report.explain(rule_id, node)` says whether a rule applied to a node and why not.
Besides rule ids, reasons and removals name three guards that are not rewrites: "R5-a" (no rule
moves a Q over that op: it does not commute), "unused" (nodes nothing reads; no layer is built) and
"constant" (ops on constants, folded at build time).

Precision: a layer is INT8 when its activation input is (F9); float layers are FP32, or FP16 where
the tensors are float16 (strong typing). An engine built with --best/--fp16 may pick FP16 for FP32
tensors by speed: `diff` compares int8 vs float unless exact=True. Layout reformats TensorRT adds
(NC/32 <-> linear copies) are not predicted; `diff` lists and skips them.
"""
from .diff import Diff, KernelAgreement, diff, kernel_agreement
from .engine_report import EngineLayer, EngineReport, read_engine_report
from .lint import Diagnostic, lint, simulate_and_lint
from .propagate import FixpointExceeded
from .report import Layer, Port, SimReport
from .rules import load_sim_rules
from .simulate import simulate

__all__ = ["simulate", "SimReport", "Layer", "Port", "lint", "simulate_and_lint", "Diagnostic", "read_engine_report", "EngineReport",
           "EngineLayer", "diff", "Diff", "kernel_agreement", "KernelAgreement", "load_sim_rules", "FixpointExceeded"]
