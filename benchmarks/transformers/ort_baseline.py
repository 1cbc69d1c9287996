#!/usr/bin/env python3
"""A baseline to measure against: onnxruntime quantize_static on every model of MODELS_DIR.

    python ort_baseline.py MODELS_DIR CALIB_DIR OUT_DIR [--only a,b] [--per-channel]

QDQ format, U8 activations (asymmetric), S8 weights, per-tensor unless --per-channel,
MinMax, after quant_pre_process, calibrated on CALIB_DIR/<name>.npz (make_data.py --calib:
the even-indexed samples). Writes OUT_DIR/<name>.onnx with the float file names, so that

    python evaluate.py MODELS_DIR DATA_DIR --compare OUT_DIR

scores it. The same settings as the zoo's `eval_models.py --ort-qdq`.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.shape_inference import quant_pre_process


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models_dir")
    ap.add_argument("calib_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--only", default="")
    ap.add_argument("--per-channel", action="store_true")
    a = ap.parse_args()
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    only = {s for s in a.only.split(",") if s}
    for m in json.loads((Path(a.models_dir) / "manifest.json").read_text()):
        if only and m["name"] not in only:
            continue
        cp = Path(a.calib_dir) / f"{m['name']}.npz"
        if not cp.exists():
            print(f"{m['name']}: no calibration data, skipped")
            continue
        src = Path(a.models_dir) / m["file"]
        dst = out / m["file"]
        z = np.load(cp)
        names = [i.name for i in ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).get_inputs()]
        feeds = [{k: z[k][i] for k in names} for i in range(len(z[names[0]]))]

        class Reader(CalibrationDataReader):
            def __init__(self):
                self.it = iter(feeds)

            def get_next(self):
                return next(self.it, None)
        t = time.time()
        pre = str(dst) + ".pre.onnx"
        try:
            quant_pre_process(str(src), pre, skip_symbolic_shape=True)
        except Exception as e:
            print(f"{m['name']}: quant_pre_process failed ({type(e).__name__}), quantizing the original")
            pre = str(src)
        quantize_static(pre, str(dst), Reader(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        per_channel=a.per_channel, extra_options={"ActivationSymmetric": False})
        if pre != str(src):
            os.remove(pre)
        print(f"{m['name']}: {dst} ({time.time() - t:.1f} s, {len(feeds)} calibration samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
