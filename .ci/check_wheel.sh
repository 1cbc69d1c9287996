#!/usr/bin/env bash
# The install users do: build a wheel and an sdist, install each into a fresh venv outside the
# checkout, and run the main commands from there (an editable install hides missing package data).
#   .ci/check_wheel.sh [PYTHON]      (default python3)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${1:-python3}
WORK=$(mktemp -d /tmp/qdqgraph-wheel.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m venv "$WORK/build-venv"
"$WORK/build-venv/bin/pip" install -q build
"$WORK/build-venv/bin/python" -m build -q --sdist --wheel --outdir "$WORK/dist" "$REPO" >/dev/null
ls "$WORK/dist"
for kind in whl tar.gz; do
    venv="$WORK/venv-$kind"
    "$PY" -m venv "$venv"
    "$venv/bin/pip" install -q "$WORK"/dist/qdqgraph-*."$kind"
    run="$WORK/run-$kind"
    mkdir -p "$run"
    cd "$run"            # outside the checkout: only the installed package can be imported
    "$venv/bin/qdqgraph" example ex >/dev/null
    "$venv/bin/qdqgraph" insert ex/tiny_resnet.onnx --calib ex/tiny_resnet_calib.npz -o ex/q.onnx --report ex/r.json --quiet
    "$venv/bin/qdqgraph" report ex/q.onnx --quiet >/dev/null
    "$venv/bin/qdqgraph" strip ex/q.onnx -o ex/back.onnx >/dev/null
    if [ "$kind" = whl ]; then          # the rtx extra: an engine built from the installed package's rules
        "$venv/bin/pip" install -q "$(ls "$WORK"/dist/qdqgraph-*.whl)[rtx]"
        "$venv/bin/qdqgraph" build ex/q.onnx -o ex/q.engine --calib ex/tiny_resnet_calib.npz \
            --layer-info ex/layers.json > ex/build.txt
        grep -q "compute kernels: 10/10 as predicted" ex/build.txt || { cat ex/build.txt; exit 1; }
    fi
    "$venv/bin/python" - <<'PY'
import onnx, onnxruntime as ort, numpy as np, qdqgraph, pathlib
assert "site-packages" in qdqgraph.__file__, qdqgraph.__file__
for name in ("ex/q.onnx", "ex/back.onnx"):
    m = onnx.load(name)
    onnx.checker.check_model(m, full_check=True)
    x = np.load("ex/tiny_resnet_calib.npz")["input"][0]
    so = ort.SessionOptions(); so.add_session_config_entry("session.disable_quant_qdq", "0")
    ort.InferenceSession(name, so, disabled_optimizers=["WeightBiasQuantization"]).run(None, {"input": x})
print("installed package at", pathlib.Path(qdqgraph.__file__).parent)
PY
    echo "$kind install: example, insert, report, strip ok"
    cd "$REPO"
done
