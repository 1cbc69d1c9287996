"""`qdqgraph strip`: remove Q/DQ (back to float, weights dequantized)."""
from __future__ import annotations

from .. import outputs
from . import args as a

EXAMPLES = """examples:
  qdqgraph strip model.qdq.onnx -o back_to_float.onnx
"""


def add(sub) -> None:
    p = sub.add_parser("strip", help="remove Q/DQ from a model (back to float, weights dequantized)",
                       formatter_class=a.Formatter, epilog=EXAMPLES,
                       description="Bypass every Q->DQ pair and turn every INT8 weight + DQ into a float weight. "
                                   "Float islands keep their type (a Cast stands where a Q/DQ converted).")
    g = p.add_argument_group("input")
    g.add_argument("model", help="a Q/DQ ONNX model")
    g = a.add_output(p)
    g.add_argument("-o", "--output", required=True, help="the float model to write")
    p.set_defaults(run=run)


def run(args) -> int:
    from .. import io
    from ..passes.strip import strip_qdq
    io.require_model_file(args.model)
    out = outputs.Plan(args.force, inputs=[args.model]).output(args.output, "output model")
    loaded = io.load(args.model)
    n = strip_qdq(loaded.graph)
    io.save(io.to_model(loaded), out, force=args.force)
    if not args.quiet:
        print(f"removed {n.count('removed')} DequantizeLinear nodes; wrote {out}")
    return 0
