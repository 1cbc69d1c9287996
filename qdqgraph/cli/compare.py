"""`qdqgraph compare`: float against quantized on data, per output and per quantized tensor."""
from __future__ import annotations

import json

from ..graph import outputs, io
from . import args as a
from .progress import bars
from ..execution.evaluate import compare

EXAMPLES = """examples:
  qdqgraph compare model.onnx model.qdq.onnx --data data.npz
  qdqgraph compare model.onnx model.qdq.onnx --data data.npz --all --json cmp.json
"""


def add(sub) -> None:
    p = sub.add_parser("compare", help="float vs quantized: per-output and per-tensor agreement on data",
                       formatter_class=a.Formatter, epilog=EXAMPLES,
                       description="Run both models on the same samples: per output cosine, SQNR, max abs error "
                                   "and top-1 agreement (logits); per quantized tensor present in both, its SQNR, "
                                   "so the layer where the error jumps is named.")
    g = p.add_argument_group("input")
    g.add_argument("float_model", help="the float ONNX model")
    g.add_argument("quant_model", help="its quantized version (any Q/DQ model with the same tensor names)")
    g.add_argument("--data", required=True, help="samples, read like insert's --calib")
    g.add_argument("--samples", type=int, default=32, help="use the first N samples")
    g.add_argument("--preprocess", metavar="SPEC", help="for a folder of images, as for insert")
    g = a.add_output(p)
    g.add_argument("--all", action="store_true", help="list every quantized tensor, in graph order")
    g.add_argument("--json", metavar="FILE", help="write the comparison as JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    a.at_least(args.samples, "--samples", 1)
    io.require_model_file(args.float_model)
    io.require_model_file(args.quant_model)
    plan = outputs.Plan(args.force, inputs=[args.float_model, args.quant_model, args.data])
    json_path = plan.output(args.json, "--json")
    progress = bars(args)
    try:
        c = compare(args.float_model, args.quant_model, calib=args.data, samples=args.samples,
                    preprocess=args.preprocess, progress=progress)
    finally:
        if progress is not None:
            progress.close()
    if not args.quiet:
        print(c.table(every=args.all))
    if json_path:
        outputs.write_text(json_path, json.dumps(c.to_dict(), indent=1, default=float) + "\n", force=args.force)
    return 0
