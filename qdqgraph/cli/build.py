"""`qdqgraph build` (and `insert --engine`): Q/DQ ONNX to an engine on a backend (qdqgraph.backends),
the engine read back into the simulator's layer schema, and checked against the prediction."""
from __future__ import annotations

import json
from pathlib import Path

from ..graph import outputs, io
from . import args as a
from ..backends.profiles import profiles
from ..prepare import model_inputs, read_data
from ..backends import choose, targets, BuildOptions
from ..trtsim import diff, kernel_agreement, simulate
from ..trtsim.diff import standalone_kernels
from ..errors import QdqError
from ..config import QuantizeConfig


EXAMPLES = """examples:
  qdqgraph build model.qdq.onnx -o model.engine --layer-info layers.json      # any machine, GPU or not
  qdqgraph build model.qdq.onnx -o model.engine --backend tensorrt-rtx --compute-capability sm89,sm120
  qdqgraph build model.qdq.onnx -o model.plan --minShapes input:1x3x224x224 --optShapes input:8x3x224x224 \\
      --maxShapes input:32x3x224x224
"""


def add(sub) -> None:
    p = sub.add_parser("build", help="build a TensorRT engine from a Q/DQ model (TensorRT for RTX needs no GPU)",
                       formatter_class=a.Formatter, epilog=EXAMPLES,
                       description="Build a strongly typed engine from a Q/DQ ONNX model with TensorRT for RTX "
                                   "(ahead of time, no GPU needed) or datacenter TensorRT (>= 10; INT8+FP16 flags "
                                   "on 8/9; needs a GPU), read the compiled engine back and check its compute "
                                   "kernels against qdqgraph's prediction.")
    g = p.add_argument_group("input")
    g.add_argument("model", help="Q/DQ ONNX model (qdqgraph insert's output, or any other)")
    g.add_argument("--calib", help="samples whose shapes give the profile of dynamic inputs (like insert's --calib)")
    a.add_shapes(p)
    a.add_engine(p)
    g = a.add_output(p)
    g.add_argument("-o", "--output", required=True, metavar="MODEL.engine", help="serialized engine to write")
    g.add_argument("--verbose", action="store_true", help="print the compiler's log")
    p.set_defaults(run=run_build)


def engine_profiles(args, loaded, data=None):
    return profiles(model_inputs(loaded.graph), data, args.shapes, args.min_shapes, args.opt_shapes,
                    args.max_shapes, args.max_batch)


def check_engine_args(args):
    """The backend and targets before any work: a missing compiler is one line, nothing written."""
    targets.parse(args.compute_capability)
    return choose(args.backend)


def comparison(sim, engine) -> tuple[str, dict]:
    """The compiled engine against the prediction, as text and as a dict: compute kernels and
    standalone quantize kernels for a compiler listing (layers with a qdqgraph kind), layer by layer
    for datacenter TensorRT's inspector JSON."""
    if any(e.kind for e in engine.layers):
        agreement = kernel_agreement(sim, engine)
        predicted, compiled = len(sim.reformats), len(standalone_kernels(sim, engine))
        text = (agreement.table() + f"\nstandalone quantize kernels: predicted {predicted}, compiled {compiled}")
        return text, dict(agreement.to_dict(), reformats={"predicted": predicted, "compiled": compiled})
    d = diff(sim, engine)
    return d.table(), d.to_dict()


def _layer_json(result, check: dict) -> str:
    doc = {"backend": result.backend, "version": result.version, "targets": result.targets,
           "Layers": [e.to_trt_json() for e in result.engine.layers], "check": check}
    return json.dumps(doc, indent=1) + "\n"


def build_and_check(model_path: Path, plan: Path, args, loaded, data=None, backend=None) -> None:
    """Build, print the engine summary and the compiler's warnings once each, check the compute
    kernels against the prediction, and write --layer-info."""
    backend = backend or choose(args.backend)
    shapes = engine_profiles(args, loaded, data)
    for p in shapes.values():
        print(f"profile {p.trtexec()}")
    sim = simulate(loaded.graph, target=backend.NAME)
    options = BuildOptions(profiles=shapes, timing_cache=args.timing_cache, workspace_mb=args.workspace,
                           compute_capabilities=targets.parse(args.compute_capability),
                           formats=sim.formats,
                           verbose=getattr(args, "verbose", False), force=args.force)
    result = backend.build(model_path, plan, options)
    kind = "strongly typed" if result.strongly_typed else "INT8+FP16 flags"
    print(f"wrote {result.plan} ({'TensorRT for RTX' if result.backend == 'tensorrt-rtx' else 'TensorRT'} "
          f"{result.version}, {kind}, {result.seconds:.1f} s)")
    if result.targets:
        print(f"runs on {targets.describe(result.targets)}" + (f"; {result.targets_note}" if result.targets_note else ""))
    for r in result.repaired:
        print(f"for the compiler: {r}")
    for w in result.warnings:
        print(f"compiler warning: {w}")
    if result.engine is not None:
        text, check = comparison(sim, result.engine)
        print(text)
        if args.layer_info:
            outputs.write_text(Path(args.layer_info), _layer_json(result, check), force=args.force)
            print(f"wrote {args.layer_info}")
    elif args.layer_info:
        raise QdqError(f"engine written to {result.plan}; --layer-info not written: {result.engine_note}",
                       "read it on a machine with that GPU, or build with --backend tensorrt-rtx, which "
                       "lists the kernels without one")


def run_build(args) -> int:
    a.at_least(args.max_batch, "--max-batch", 1)
    a.at_least(args.workspace, "--workspace", 1)
    io.require_model_file(args.model)
    check = outputs.Plan(args.force, inputs=[args.model, args.calib])
    plan = check.output(args.output, "engine")
    assert plan is not None                     # -o/--output is required
    check.output(args.layer_info, "--layer-info")
    backend = check_engine_args(args)           # the compiler's absence first: no shape matters without it
    model = Path(args.model)
    loaded = io.load(model)
    data = read_data(loaded, args.calib, QuantizeConfig()) if args.calib else None
    engine_profiles(args, loaded, data)
    build_and_check(model, plan, args, loaded, data, backend)
    return 0
