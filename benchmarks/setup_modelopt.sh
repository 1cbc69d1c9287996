#!/usr/bin/env bash
# Make a venv with NVIDIA Model Optimizer's ONNX PTQ (nvidia-modelopt[onnx]) for the peer baselines
# (benchmarks/peers_lowbit.py, calibration.py, simulate_models.py, engine_latency.py).
#
#   benchmarks/setup_modelopt.sh [VENV]        (default /tmp/mo-venv)
#
# Skipped when VENV's python already imports modelopt.onnx.quantization. PYTHON picks the base
# interpreter (default python3); MODELOPT and TORCH pin versions (default 0.47.0 and 2.14.1).
#
# torch: the CPU build of TORCH is taken from PyTorch's CPU wheel index when that index answers;
# otherwise pip takes TORCH from the default index, which on x86_64 is a CUDA build (it runs on the
# CPU too, but pulls several GB of nvidia-* wheels). modelopt needs torch>=2.8 only to import.
# onnxruntime: modelopt[onnx] itself pins onnxruntime-gpu~=1.24 (and onnx~=1.21) on Linux x86_64;
# that wheel has the CPU execution provider, so no separate `onnxruntime` is installed beside it
# (both ship the same `onnxruntime` module and would overwrite each other).
set -euo pipefail
VENV=${1:-/tmp/mo-venv}
PYTHON=${PYTHON:-python3}
MODELOPT=${MODELOPT:-0.47.0}
TORCH=${TORCH:-2.14.1}
CPU_INDEX=https://download.pytorch.org/whl/cpu

report() {
    "$VENV/bin/python" - <<'PY'
from importlib.metadata import version, PackageNotFoundError
for p in ["nvidia-modelopt", "torch", "onnxruntime-gpu", "onnxruntime", "onnx", "numpy", "cupy-cuda12x"]:
    try:
        print(f"{p}=={version(p)}")
    except PackageNotFoundError:
        pass
import torch
print(f"torch build: cuda={torch.version.cuda} (cuda available: {torch.cuda.is_available()})")
import onnxruntime as ort
print("onnxruntime providers:", ",".join(ort.get_available_providers()))
PY
}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import modelopt.onnx.quantization" 2>/dev/null; then
    echo "== $VENV already imports modelopt.onnx.quantization: skipped" >&2
    report
    exit 0
fi

echo "== venv $VENV" >&2
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
if "$VENV/bin/python" -c "import urllib.request as u; u.urlopen('$CPU_INDEX/torch/', timeout=10)" 2>/dev/null; then
    echo "== torch==$TORCH (CPU build, $CPU_INDEX)" >&2
    "$VENV/bin/pip" install -q --index-url "$CPU_INDEX" "torch==$TORCH"
else
    echo "== $CPU_INDEX unreachable: torch==$TORCH from the default index (CUDA build on x86_64)" >&2
    "$VENV/bin/pip" install -q "torch==$TORCH"
fi
echo "== nvidia-modelopt[onnx]==$MODELOPT" >&2
"$VENV/bin/pip" install -q "nvidia-modelopt[onnx]==$MODELOPT" "torch==$TORCH"
"$VENV/bin/python" -c "import modelopt.onnx.quantization"
report
