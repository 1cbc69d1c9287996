"""`qdqgraph build` (and `insert --engine`): Q/DQ ONNX to a TensorRT engine, its layer report, and
the diff against the simulator's prediction. TensorRT is imported lazily (qdqgraph.engine)."""
from __future__ import annotations

from pathlib import Path

from .. import outputs
from . import args as a


EXAMPLES = """examples:
  qdqgraph build model.qdq.onnx -o model.plan --layer-info layers.json
  qdqgraph build model.qdq.onnx -o model.plan --minShapes input:1x3x224x224 --optShapes input:8x3x224x224 \\
      --maxShapes input:32x3x224x224
"""


def add(sub) -> None:
    p = sub.add_parser("build", help="build a TensorRT engine from a Q/DQ model (needs TensorRT and a GPU)",
                       formatter_class=a.Formatter, epilog=EXAMPLES,
                       description="Build a strongly typed TensorRT engine (TensorRT >= 10; INT8+FP16 flags on "
                                   "8/9) from a Q/DQ ONNX model, write its layer information, and diff it "
                                   "against qdqgraph's prediction.")
    g = p.add_argument_group("input")
    g.add_argument("model", help="Q/DQ ONNX model (qdqgraph insert's output, or any other)")
    g.add_argument("--calib", help="samples whose shapes give the profile of dynamic inputs (like insert's --calib)")
    a.add_shapes(p)
    a.add_engine(p)
    g = a.add_output(p)
    g.add_argument("-o", "--output", required=True, metavar="MODEL.plan", help="serialized engine to write")
    g.add_argument("--verbose", action="store_true", help="print TensorRT's log")
    p.set_defaults(run=run_build)


def engine_profiles(args, loaded, data=None):
    from ..prepare import model_inputs
    from ..profiles import profiles
    return profiles(model_inputs(loaded.graph), data, args.shapes, args.min_shapes, args.opt_shapes,
                    args.max_shapes, args.max_batch)


def build_and_diff(model_path: Path, plan: Path, args, loaded, data=None) -> None:
    """Build, then print the engine summary and, with --layer-info, the diff against the simulator."""
    from .. import engine
    from ..trtsim import diff, read_engine_report, simulate
    shapes = engine_profiles(args, loaded, data)
    for p in shapes.values():
        print(f"profile {p.trtexec()}")
    result = engine.build(model_path, plan, profiles=shapes, layer_info=args.layer_info,
                          timing_cache=args.timing_cache, workspace_mb=args.workspace,
                          verbose=getattr(args, "verbose", False), force=args.force)
    print(f"wrote {result.plan} (TensorRT {result.tensorrt_version}, "
          f"{'strongly typed' if result.strongly_typed else 'INT8+FP16 flags'}, {result.seconds:.0f} s)")
    if result.layer_info:
        print(diff(simulate(loaded.graph), read_engine_report(result.layer_info)).table())
        print(f"wrote {result.layer_info}")


def run_build(args) -> int:
    from .. import engine, io
    from ..config import QuantizeConfig
    from ..prepare import read_data
    a.at_least(args.max_batch, "--max-batch", 1)
    a.at_least(args.workspace, "--workspace", 1)
    io.require_model_file(args.model)
    check = outputs.Plan(args.force, inputs=[args.model, args.calib])
    plan = check.output(args.output, "engine")
    check.output(args.layer_info, "--layer-info")
    engine.import_tensorrt()                 # TensorRT's absence first: no shape matters without it
    model = Path(args.model)
    loaded = io.load(model)
    data = read_data(loaded, args.calib, QuantizeConfig()) if args.calib else None
    engine_profiles(args, loaded, data)
    build_and_diff(model, plan, args, loaded, data)
    return 0
