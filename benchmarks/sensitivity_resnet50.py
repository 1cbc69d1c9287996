"""Cost of a full per-layer sensitivity run against one calibration, on ResNet-50 (opset 17).

    .venv/bin/python benchmarks/sensitivity_resnet50.py [--model /tmp/qdqgraph-tv/models/resnet50.onnx]
        [--calib-samples 512] [--sensitivity-samples 8] [--batch 8]

Calibration: `--calib-samples` image-like samples (random, seeded; the model's weights are random
too: this measures time, not accuracy), the default method. Sensitivity: every quantized unit,
both directions (only this unit INT8; only this unit float), on the first `--sensitivity-samples`
samples (qdqgraph.recipes.sensitivity.measure, no early stop). Printed in one run, with plain onnxruntime
inference over the calibration samples for scale. Target (accuracy issue): sensitivity within 3x
of one calibration.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import qdqgraph  # noqa: E402
from qdqgraph.graph import io  # noqa: E402
from qdqgraph.samples.data import CalibrationData  # noqa: E402
from qdqgraph.prepare import model_inputs  # noqa: E402
from qdqgraph.execution.runtime import session  # noqa: E402
from qdqgraph.recipes.sensitivity import measure  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/qdqgraph-tv/models/resnet50.onnx")
    ap.add_argument("--calib-samples", type=int, default=512)
    ap.add_argument("--sensitivity-samples", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="calibration and inference batch size")
    args = ap.parse_args()
    if not Path(args.model).exists():
        print(f"{args.model} missing: run benchmarks/export_torchvision.py first")
        return 0
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.calib_samples, 1, 3, 224, 224), dtype=np.float32)
    data = {"input": x}
    loaded = io.load(args.model)
    cd = CalibrationData(data, model_inputs(loaded.graph))

    sess = session(io.to_model(loaded), purpose="timing")
    t0 = time.perf_counter()
    for b in cd.batches(args.batch):
        sess.run(None, b)
    t_plain = time.perf_counter() - t0

    result = qdqgraph.quantize(args.model, data, batch_size=args.batch, high_precision="fp32")
    t_cal = result.report.calibration_seconds

    sens, _ = measure(result.model, result.plan, cd, samples=args.sensitivity_samples)
    t_sens = sens.seconds
    units = len(sens.units)
    print(f"load average {os.getloadavg()[0]:.2f}; ResNet-50, {units} quantized units")
    print()
    print("| step | samples | runs | seconds | / one calibration |")
    print("|---|---|---|---|---|")
    print(f"| plain onnxruntime inference (batch {args.batch}) | {args.calib_samples} | "
          f"{-(-args.calib_samples // args.batch)} | {t_plain:.1f} | {t_plain / t_cal:.2f} |")
    print(f"| calibration ({result.report.method}, batch {args.batch}) | {args.calib_samples} | "
          f"{-(-args.calib_samples // args.batch)} | {t_cal:.1f} | 1.00 |")
    print(f"| sensitivity, both directions, every unit | {sens.samples} | {sens.runs} | {t_sens:.1f} | "
          f"{t_sens / t_cal:.2f} |")
    print()
    print(f"sensitivity / calibration = {t_sens / t_cal:.2f}x (target <= 3x); cost = (2 x {units} + 2) runs "
          f"of {sens.samples} samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
