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
    # the graph alone first: a prediction recorded for it needs neither the checker nor weights kept
    # in other files (qdqgraph checked the graph it recorded; 0.5 s of 1.8 s on a 10,000-node CNN)
    model = io.read_model(args.model, external_data=False)
    use_record = engine is None and not graph_path and not args.recompute
    kept = recorded.recorded(model, target, report=bool(json_path)) if use_record else None
    if kept is None and io.finish_reading(model, args.model) and use_record:
        kept = recorded.recorded(model, target, report=bool(json_path))   # recorded with its weights in
    if kept is not None:
        print(kept.table.splitlines()[-1] if args.quiet else kept.table)
        for line in kept.lint:
            print(line)
        if json_path:
            doc = dict(kept.report or {}, target=target)
            outputs.write_text(json_path, json.dumps(doc, indent=1) + "\n", force=args.force)
        return 3 if args.strict and kept.lint else 0
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

