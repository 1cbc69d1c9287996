"""The INT8 Q/DQ models of other tools, for the benchmarks that read them (fix.py, simulate_models.py):
onnxruntime's `quantize_static` in QDQ form, and Model Optimizer's INT8 in its own venv
(benchmarks/setup_modelopt.sh)."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

MO_CHILD = r'''
import sys, numpy as np
from modelopt.onnx.quantization import quantize
d = np.load(sys.argv[2])
data = {k: d[k][: int(sys.argv[4])] for k in d.files}
data = {k: v.reshape(-1, *v.shape[2:]) if v.ndim >= 2 and v.shape[1] == 1 else v for k, v in data.items()}
quantize(sys.argv[1], quantize_mode="int8", calibration_data=data, calibration_method=sys.argv[5],
         calibration_eps=["cpu"], output_path=sys.argv[3], log_level="ERROR")
'''


def ort_qdq(src: Path, calib: Path, dst: Path, samples: int, signed: bool = False) -> None:
    """onnxruntime's quantize_static, QDQ, per channel, on the first `samples` calibration samples;
    `signed`: INT8 activations and weights (else its default, uint8 activations)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    d = np.load(calib)
    feeds = [{k: d[k][i] for k in d.files} for i in range(min(samples, len(d[d.files[0]])))]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(feeds)

        def get_next(self):
            return next(self.it, None)

    types = {"activation_type": QuantType.QInt8, "weight_type": QuantType.QInt8} if signed else {}
    quantize_static(str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ, per_channel=True, **types)


def modelopt_int8(src: Path, calib: Path, dst: Path, python: str, samples: int, method: str = "max") -> str | None:
    """Model Optimizer's INT8 (`method`: its calibration, "max" or "entropy", its own default; its FP16
    float parts) into `dst`; None when it wrote the model, else its last error line. It gets a private
    copy: 0.47 saves over its input."""
    with tempfile.TemporaryDirectory() as d:
        private = Path(d) / src.name
        shutil.copy2(src, private)
        p = subprocess.run([python, "-c", MO_CHILD, str(private), str(calib), str(dst), str(samples), method],
                           capture_output=True, text=True, check=False)
    if dst.exists():
        return None
    return "Model Optimizer failed: " + ((p.stderr.strip().splitlines() or ["?"])[-1][:100])
