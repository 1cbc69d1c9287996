"""`qdqgraph report`: what TensorRT is predicted to build from any Q/DQ model, and the linter."""
from __future__ import annotations

import json

from ..graph import outputs, io
from . import args as a
from ..placement import load_ruleset
from ..trtsim import read_engine_report, recorded, simulate_and_lint
from .build import comparison

EXAMPLES = """examples:
  qdqgraph report model.qdq.onnx                          # layers, precisions, reformats, findings
  qdqgraph report model.qdq.onnx --json sim.json --graph fused.onnx
  qdqgraph report model.qdq.onnx --against layers.json    # qdqgraph build --layer-info (or trtexec's), compared
  qdqgraph report model.qdq.onnx --target tensorrt-rtx --json r.json   # TensorRT for RTX's engine
  qdqgraph report model.qdq.onnx --strict                 # exit 3 when the linter finds a problem
"""


def add(sub) -> None:
    p = sub.add_parser("report", help="predict TensorRT's layers, precisions and reformats for any Q/DQ model",
                       formatter_class=a.Formatter, epilog=EXAMPLES,
                       description="Simulate TensorRT's explicit-quantization optimizer (Q/DQ propagation and "
                                   "fusion) on a Q/DQ ONNX model, lint its placement, and with --against diff "
                                   "the prediction against a real engine's layer information.")
    g = p.add_argument_group("input")
    g.add_argument("model", help="a Q/DQ ONNX model (qdqgraph's, Model Optimizer's, onnxruntime's, a QAT export)")
    g.add_argument("--against", metavar="LAYERS.json",
                   help="a compiled engine's layers: qdqgraph build --layer-info, trtexec --exportLayerInfo, or "
                        "the engine inspector's JSON")
    g.add_argument("--target", choices=("tensorrt", "tensorrt-rtx"),
                   help="the compiler to predict (default: the one that built --against, else tensorrt)")
    g = a.add_output(p)
    g.add_argument("--json", metavar="FILE", help="write the simulation report as JSON")
    g.add_argument("--graph", metavar="FILE", help="write the fused-layer graph as ONNX (opens in Netron)")
    g.add_argument("--strict", action="store_true", help="exit 3 when the linter finds a problem")
    g.add_argument("--recompute", action="store_true",
                   help="simulate and lint the model even when it holds the prediction qdqgraph insert "
                        "recorded for its graph (that record is used by default)")
    p.set_defaults(run=run)


def run(args) -> int:
    io.require_model_file(args.model)
    plan = outputs.Plan(args.force, inputs=[args.model, args.against])
    json_path = plan.output(args.json, "--json")
    graph_path = plan.output(args.graph, "--graph")
    engine = read_engine_report(args.against) if args.against else None
    target = args.target or (engine.backend if engine is not None and engine.backend else "tensorrt")
    model = io.read_model(args.model, external_data=False)
    kept = _kept(model, args.model, target, engine is None and not graph_path and not args.recompute,
                 report=bool(json_path))
    if kept is not None:
        return _print_kept(kept, args, target, json_path)
    dims = recorded.dims_of(model)                   # the shapes insert predicted at (its calibration data's)
    loaded = io.load(model, check=False)             # finish_reading checked it
    del model
    sim, diagnostics = simulate_and_lint(loaded.graph, region=load_ruleset(target=target).region, target=target,
                                         dims=dims)
    print(sim.table().splitlines()[-1] if args.quiet else sim.table())
    for d in diagnostics:
        print(d)
    against = None
    if engine is not None:
        text, against = comparison(sim, engine)
        print(text)
    if json_path:
        doc = dict(sim.to_dict(), target=target, **({"against": against} if against is not None else {}))
        outputs.write_text(json_path, json.dumps(doc, indent=1) + "\n", force=args.force)
    if graph_path:
        io.save(sim.to_onnx(), graph_path, force=args.force)
    return 3 if args.strict and diagnostics else 0



def _kept(model, path, target: str, wanted: bool, report: bool) -> recorded.Recorded | None:
    """The prediction recorded in `model` (read without its external data) where `wanted` and it
    still describes the graph; otherwise None, and `model` read in full and checked
    (io.finish_reading). The graph alone is tried first: a record needs neither the checker nor
    weights kept in other files (qdqgraph checked the graph it recorded; the two were 0.5 s of
    1.8 s on a 10,000-node CNN)."""
    kept = recorded.recorded(model, target, report=report) if wanted else None
    if kept is None and io.finish_reading(model, path) and wanted:
        kept = recorded.recorded(model, target, report=report)       # one recorded with its weights in
    return kept


def _print_kept(kept: recorded.Recorded, args, target: str, json_path) -> int:
    print(kept.table.splitlines()[-1] if args.quiet else kept.table)
    for line in kept.lint:
        print(line)
    if json_path:
        doc = dict(kept.report or {}, target=target)
        outputs.write_text(json_path, json.dumps(doc, indent=1) + "\n", force=args.force)
    return 3 if args.strict and kept.lint else 0
