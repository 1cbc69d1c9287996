"""`qdqgraph calibrate`: ranges only, as a qdqgraph JSON or TensorRT cache, or mergeable shard state."""
from __future__ import annotations

from ..execution import distributed
from ..graph import io, outputs
from ..calib.calibration import FORMATS, calibrate, merge_calibrations
from ..errors import QdqError
from . import args as a
from .progress import bars

EXAMPLES = """examples:
  qdqgraph calibrate model.onnx --calib data.npz -o calib.json --method entropy
  qdqgraph calibrate model.onnx --calib data.npz -o calib.cache --format tensorrt
  qdqgraph calibrate model.onnx --calib part2/ --shard 2/4 -o s2.state      # one of four machines
  qdqgraph calibrate --merge s1.state s2.state s3.state s4.state -o calib.json --method entropy
  qdqgraph calibrate model.onnx --calib data/ -o calib.json --ray            # shards on a Ray of this machine
  qdqgraph calibrate model.onnx --calib /shared/data/ -o calib.json --ray HEAD:6379   # on a Ray cluster
"""


def add(sub) -> None:
    p = sub.add_parser("calibrate", help="calibrate only: write a calibration cache (or shard state)",
                       formatter_class=a.Formatter, epilog=EXAMPLES,
                       description="Calibrate the tensors qdqgraph would quantize and write their ranges as a "
                                   "qdqgraph JSON or TensorRT calibration cache. Split large data with --shard "
                                   "I/N (writes state) and combine with --merge, or let Ray run the shards (--ray); "
                                   "the merged ranges equal one run's bit for bit.")
    g = p.add_argument_group("input")
    g.add_argument("model", nargs="?", help="float ONNX model (not needed with --merge)")
    a.add_calibration(p, data_help="calibration data, as for insert's --calib")
    g = p.add_argument_group("shards")
    g.add_argument("--shard", metavar="I/N", help="calibrate only shard I of N of the samples; writes state")
    g.add_argument("--merge", nargs="+", metavar="STATE", help="merge the state files of --shard runs (all N)")
    a.add_placement(p)
    a.add_runtime(p)
    g = a.add_output(p)
    g.add_argument("-o", "--output", required=True, help="cache (or state) file to write")
    g.add_argument("--format", choices=list(FORMATS),
                   help="json (the default), tensorrt (calibration-cache text), state (histograms, mergeable; "
                        "the default with --shard)")
    p.set_defaults(run=run)


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise QdqError(f"--shard {text!r} is not I/N", "write e.g. --shard 2/4") from None
    if not (1 <= i <= n):
        raise QdqError(f"--shard {text}: I must be between 1 and N", "write e.g. --shard 2/4")
    return i, n


def run(args) -> int:
    config = a.config(args)
    if args.model:
        io.require_model_file(args.model)
    plan = outputs.Plan(args.force, inputs=[args.model, args.calib, *(args.merge or []), *args.rules])
    out = plan.output(args.output, "output")
    if args.merge:
        if args.shard or args.calib:
            raise QdqError("--merge combines saved shards; it takes no --calib or --shard", "drop them")
        if config.ray:
            raise QdqError("--merge runs no calibration, so it has nothing for Ray to do", "drop --ray")
        assert config.method is not None        # QuantizeConfig sets the precision's default method
        cal = merge_calibrations(args.merge, config.method, config.percentile)
        cal.save(out, args.format or "json", force=args.force)
        if not args.quiet:
            print(f"merged {len(args.merge)} shards ({cal.samples} samples, {len(cal.groups)} scale groups); wrote {out}")
        return 0
    if not args.model:
        raise QdqError("no model given", "pass MODEL.onnx (or --merge STATE...)")
    if not args.calib:
        raise QdqError("no calibration data given", "pass --calib DATA.npz")
    shard = parse_shard(args.shard) if args.shard else None
    fmt = args.format or ("state" if shard else "json")
    if shard and fmt != "state":
        raise QdqError("--shard writes calibration state, to be merged", "drop --format, or use --format state")
    if config.providers:
        a.check_providers(config.providers)
    if config.ray:
        distributed.require()
    progress = bars(args)
    try:
        cal = calibrate(args.model, args.calib, config=config, shard=shard, keep_states=fmt == "state",
                        progress=progress)
    finally:
        if progress is not None:
            progress.close()
    cal.save(out, fmt, force=args.force)
    if not args.quiet:
        print(f"calibrated {len(cal.groups)} scale groups over {cal.samples} samples in {cal.seconds:.1f} s; wrote {out}")
    return 0
