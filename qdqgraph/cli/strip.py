"""`qdqgraph strip`: remove Q/DQ (back to float, weights dequantized)."""
from __future__ import annotations

from ..graph import outputs, io
from . import args as a
from ..fix.facts import strip_to_float

EXAMPLES = """examples:
  qdqgraph strip model.qdq.onnx -o back_to_float.onnx
"""


def add(sub) -> None:
    p = sub.add_parser("strip", help="remove Q/DQ from a model (back to float, weights dequantized)",
                       formatter_class=a.Formatter, epilog=EXAMPLES,
                       description="Bypass every Q->DQ pair and turn every INT8 weight + DQ into a float weight. "
                                   "Float islands keep their type (a Cast stands where a Q/DQ converted); a "
                                   "Relu or Clip folded into a Q range that starts at 0 (onnxruntime's uint8) "
                                   "is kept as a Clip. Operator-style models (QLinearConv, ...) are refused.")
    g = p.add_argument_group("input")
    g.add_argument("model", help="a Q/DQ ONNX model")
    g = a.add_output(p)
    g.add_argument("-o", "--output", required=True, help="the float model to write")
    p.set_defaults(run=run)


def run(args) -> int:
    io.require_model_file(args.model)
    out = outputs.Plan(args.force, inputs=[args.model]).output(args.output, "output model")
    assert out is not None                          # -o/--output is required
    loaded = io.load(args.model)
    n, clamps = strip_to_float(loaded.graph)
    io.save(io.to_model(loaded), out, force=args.force)
    if not args.quiet:
        kept = ""
        if clamps:
            k = len(clamps)
            kept = (f", kept {k} {'clamps as Clips' if k > 1 else 'clamp as a Clip'} (a Relu or Clip folded into a "
                    f"Q range that starts at 0: {', '.join(t for t, _, _ in clamps[:3])}{', ...' if k > 3 else ''})")
        print(f"removed {n.count('removed')} DequantizeLinear nodes{kept}; wrote {out}")
    return 0
