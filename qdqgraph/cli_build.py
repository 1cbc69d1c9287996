"""`qdqgraph build` (and `insert --engine`): Q/DQ ONNX to a TensorRT engine, its layer report, and
the diff against the simulator's prediction. TensorRT is imported lazily (qdqgraph.engine)."""
from __future__ import annotations

from pathlib import Path

from .errors import QdqError


def add_shape_args(p) -> None:
    p.add_argument("--shapes", metavar="NAME:1x3x224x224,...",
                   help="fixed shapes of dynamic inputs (trtexec's form); min = opt = max")
    p.add_argument("--min", dest="min_shapes", metavar="SPEC", help="smallest shapes (with --opt and --max)")
    p.add_argument("--opt", dest="opt_shapes", metavar="SPEC", help="most frequent shapes")
    p.add_argument("--max", dest="max_shapes", metavar="SPEC", help="largest shapes")
    p.add_argument("--max-batch", type=int, metavar="N",
                   help="with shapes derived from data: let a dynamic batch dim range over 1..N")


def add_engine_args(p) -> None:
    p.add_argument("--layer-info", metavar="LAYERS.json",
                   help="write TensorRT's engine inspector JSON, and diff it against the simulator")
    p.add_argument("--timing-cache", metavar="FILE", help="TensorRT timing cache to read and update")
    p.add_argument("--workspace", type=int, metavar="MB", help="builder workspace limit in MiB")


def add_build(sub) -> None:
    p = sub.add_parser("build", help="build a TensorRT engine from a Q/DQ model (needs TensorRT and a GPU)",
                       description="Build a strongly typed TensorRT engine (TensorRT >= 10; INT8+FP16 flags on "
                                   "8/9) from a Q/DQ ONNX model, write its layer information, and diff it "
                                   "against qdqgraph's prediction.")
    p.add_argument("model", help="Q/DQ ONNX model (qdqgraph insert's output, or any other)")
    p.add_argument("-o", "--output", required=True, metavar="MODEL.plan", help="serialized engine to write")
    p.add_argument("--calib", help="samples whose shapes give the profile of dynamic inputs (like insert's --calib)")
    add_shape_args(p)
    add_engine_args(p)
    p.add_argument("--force", action="store_true", help="overwrite an existing engine")
    p.add_argument("--verbose", action="store_true", help="print TensorRT's log")
    p.set_defaults(run=run_build)


def require_folders(*paths) -> None:
    """Each given output path's folder exists (checked before any work is done)."""
    for p in paths:
        if p and not Path(p).resolve().parent.is_dir():
            raise QdqError(f"folder of {p} does not exist", "create it or choose another path")


def _check_paths(model: Path, plan: Path, layer_info, force: bool) -> None:
    if plan.exists() and not force:
        raise QdqError(f"{plan} exists", "pass --force to overwrite it, or choose another -o")
    if model.exists() and plan.resolve() == model.resolve():
        raise QdqError(f"the engine path {plan} is the input model", "choose another -o")
    require_folders(plan, layer_info)


def engine_profiles(args, loaded, data=None):
    from .prepare import model_inputs
    from .profiles import profiles
    return profiles(model_inputs(loaded.graph), data, args.shapes, args.min_shapes, args.opt_shapes,
                    args.max_shapes, args.max_batch)


def build_and_diff(model_path: Path, plan: Path, args, loaded, data=None) -> None:
    """Build, then print the engine summary and, with --layer-info, the diff against the simulator."""
    from . import engine
    from .trtsim import diff, read_engine_report, simulate
    shapes = engine_profiles(args, loaded, data)
    for p in shapes.values():
        print(f"profile {p.trtexec()}")
    result = engine.build(model_path, plan, profiles=shapes, layer_info=args.layer_info,
                          timing_cache=args.timing_cache, workspace_mb=args.workspace,
                          verbose=getattr(args, "verbose", False))
    print(f"wrote {result.plan} (TensorRT {result.tensorrt_version}, "
          f"{'strongly typed' if result.strongly_typed else 'INT8+FP16 flags'}, {result.seconds:.0f} s)")
    if result.layer_info:
        print(diff(simulate(loaded.graph), read_engine_report(result.layer_info)).table())
        print(f"wrote {result.layer_info}")


def run_build(args) -> int:
    from . import engine, io
    from .config import QuantizeConfig
    from .prepare import read_data
    model, plan = Path(args.model), Path(args.output)
    _check_paths(model, plan, args.layer_info, args.force)
    loaded = io.load(model)
    data = read_data(loaded, args.calib, QuantizeConfig()) if args.calib else None
    engine_profiles(args, loaded, data)      # shape errors before the TensorRT check
    engine.import_tensorrt()
    build_and_diff(model, plan, args, loaded, data)
    return 0
