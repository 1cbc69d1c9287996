#!/usr/bin/env bash
# Export the torchvision CNNs the slow tier and the benchmarks use (benchmarks/export_torchvision.py).
#
#   benchmarks/setup_torchvision.sh [OUT_DIR]       (default /tmp/qdqgraph-tv/models)
#
# Makes OUT_DIR/../venv with the pinned torch/torchvision (about 5.6 GB; skipped when it exists) and
# exports ResNet-18/50, EfficientNet-B0 and MobileNetV3-Large with calibration data (skipped when
# OUT_DIR/manifest.json lists them). PYTHON picks the interpreter (default python3).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${1:-/tmp/qdqgraph-tv/models}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
VENV=$(dirname "$OUT")/venv
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, torchvision" 2>/dev/null; then
    echo "== venv for the export ($VENV)" >&2
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.14.1 torchvision==0.29.1 onnx==1.23.2 onnxruntime==1.32.0 numpy
fi
if [ -f "$OUT/manifest.json" ] && "$VENV/bin/python" - "$OUT" <<'PY'
import hashlib, json, sys
from pathlib import Path
d = Path(sys.argv[1])
m = json.loads((d / "manifest.json").read_text())
models = m if isinstance(m, list) else m.get("models", [])
need = ["resnet18", "resnet50", "efficientnet_b0", "mobilenet_v3_large"]
ok = all((d / f"{n}.onnx").exists() and (d / f"{n}.calib.npz").exists() for n in need)
# a file changed since its export (a tool that writes into its input) is exported again
ok = ok and all(hashlib.sha256((d / x["file"]).read_bytes()).hexdigest() == x["sha256"] for x in models if x.get("sha256"))
sys.exit(0 if ok else 1)
PY
then
    echo "== torchvision models: skipped ($OUT has them)" >&2
else
    echo "== export_torchvision.py" >&2
    "$VENV/bin/python" "$REPO/benchmarks/export_torchvision.py" "$OUT"
fi
