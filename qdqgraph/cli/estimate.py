"""`qdqgraph estimate`: an engine's latency on a named GPU, estimated from its layers (no GPU needed)."""
from __future__ import annotations

import json

from ..graph import outputs
from . import args as a
from ..trtsim.estimate import estimate, gpu, gpus

EXAMPLES = """examples:
  qdqgraph estimate layers.json --gpu rtx-4090
  qdqgraph estimate layers.json --gpu a100-sxm4-40gb --profile profile.json --json r.json
  qdqgraph estimate layers.json --gpu list          # the known GPUs (rules/gpus.toml)
"""


def add(sub) -> None:
    p = sub.add_parser("estimate", help="estimate a TensorRT engine's latency on a GPU from its layer information",
                       formatter_class=a.Formatter, epilog=EXAMPLES,
                       description="Place every layer of a TensorRT engine (trtexec --exportLayerInfo with "
                                   "--profilingVerbosity=detailed, or build --layer-info) on a roofline of the GPU: "
                                   "bytes moved and convolution/GEMM math from its shapes and data types, against "
                                   "the GPU's spec-sheet bandwidth and dense throughput, plus a launch cost per "
                                   "kernel; the constants are fitted on NVIDIA's published engines "
                                   "(docs/PREDICTION.md, 'Latency estimate'). An estimate, not a measurement.")
    g = p.add_argument_group("input")
    g.add_argument("layers", metavar="LAYERS.json", help="the engine's layer information (JSON)")
    g.add_argument("--gpu", required=True, metavar="NAME", help="a GPU of rules/gpus.toml, e.g. rtx-4090")
    g.add_argument("--profile", metavar="PROFILE.json",
                   help="the engine's measured per-layer times (trtexec --exportProfile): print the error too")
    g = a.add_output(p)
    g.add_argument("--top", type=int, default=10, metavar="N", help="list the N slowest layers")
    g.add_argument("--json", metavar="FILE", help="write the estimate (estimate.total_ms, estimate.measured_ms, "
                                                  "per layer) as JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    a.at_least(args.top, "--top", 0)
    if args.gpu.strip().lower() == "list":
        for g in gpus().values():
            peaks = ", ".join(f"{k} {v:g}" for k, v in g.tflops.items())
            print(f"{g.name:16} {g.title}: {g.bandwidth_gbs:g} GB/s; dense TFLOPS {peaks} ({g.source})")
        return 0
    gpu(args.gpu)                                    # an unknown name fails before any file is read
    plan = outputs.Plan(args.force, inputs=[args.layers, args.profile])
    json_path = plan.output(args.json, "--json")
    est = estimate(args.layers, args.gpu, args.profile)
    if not args.quiet:
        print(est.table(args.top) if args.top else est.summary())
    if json_path:
        outputs.write_text(json_path, json.dumps({"estimate": est.to_dict()}, indent=1) + "\n", force=args.force)
    return 0
