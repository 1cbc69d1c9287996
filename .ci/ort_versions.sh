#!/usr/bin/env bash
# qdqgraph's FP8 and INT4 tests on onnxruntime 1.31.1, the newest onnxruntime-gpu (what
# `qdqgraph[gpu]` installs), besides the 1.32 of the main venv: 1.31 refuses FP8 Q/DQ graphs at its
# extended optimization level, and qdqgraph's own sessions must fall back to the basic level there.
#   .ci/ort_versions.sh [PYTEST ARGS]     venv: $QDQGRAPH_ORT131_VENV (default /tmp/qdqgraph-ort-1.31.1),
#                                         made once and reused while it holds 1.31.1 and this checkout
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
ORT=1.31.1
VENV=${QDQGRAPH_ORT131_VENV:-/tmp/qdqgraph-ort-$ORT}
PY=${PYTHON3:-python3}

right() {      # run from / so that `import qdqgraph` finds the venv's install, not the current folder
    (cd / && "$VENV/bin/python" - "$ORT" "$REPO") <<'PY' 2>/dev/null
import sys, pathlib, onnxruntime, qdqgraph, pytest
want, repo = sys.argv[1], pathlib.Path(sys.argv[2]).resolve()
ok = onnxruntime.__version__ == want and pathlib.Path(qdqgraph.__file__).resolve().is_relative_to(repo)
sys.exit(0 if ok else 1)
PY
}

if [ -x "$VENV/bin/python" ] && right; then
    echo "== reusing $VENV"
else
    echo "== making $VENV (onnxruntime==$ORT over the test extra)"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q -e "$REPO[test]" "onnxruntime==$ORT"
    right || { echo "ort_versions: $VENV does not hold onnxruntime $ORT and this checkout" >&2; exit 1; }
fi
"$VENV/bin/python" -c "import onnxruntime; print('== onnxruntime', onnxruntime.__version__)"
# the unit tests, and FP8/INT4 of every zoo and torchvision model built by TensorRT for RTX (slow tier,
# where QDQGRAPH_ZOO / QDQGRAPH_TORCHVISION point at the models; skipped without them)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_fp8.py tests/test_int4_pipeline.py \
    tests/test_int4_weights.py tests/test_ort_versions.py tests/test_engines.py -k "not test_engines or fp8 or int4" "$@"
