#!/usr/bin/env bash
# Set up the model zoo that benchmarks/zoo_accuracy.py measures qdqgraph on.
#
#   benchmarks/setup_zoo.sh [ZOO_DIR]        (default /tmp/qdqgraph-zoo)
#
# Does what <shared>/zoo/README.md describes, skipping every step whose outputs already exist:
#   1. Debian's espeak-ng (speech for silero_vad_op15)    apt-get, when espeak-ng is missing
#   2. ZOO/venv with <shared>/zoo/requirements.txt      redone when requirements.txt changes
#   3. ZOO/models   get_models.py                       skipped when manifest.json lists files that exist
#   4. ZOO/data     make_data.py                        only for models whose .npz is missing
#   5. ZOO/calib/<name>.npz  even-indexed samples of ZOO/data/<name>.npz, no __meta__
#   6. ZOO/float.json        eval_models.py (float only)
#   7. ZOO/ort_qdq + ZOO/ort.json   eval_models.py --ort-qdq (onnxruntime quantize_static baseline)
#
# The zoo scripts are read from ${QDQGRAPH_SHARED:-<repo>/../shared}/zoo.
# Environment: PYTHON (interpreter for the venv, default python3; the pins are for 3.11),
#              FORCE=1 redoes every step.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SHARED=${QDQGRAPH_SHARED:-$REPO/../shared}
ZS=$(cd "$SHARED/zoo" && pwd) || { echo "no zoo scripts in $SHARED/zoo (set QDQGRAPH_SHARED)" >&2; exit 2; }
ZOO=${1:-/tmp/qdqgraph-zoo}
mkdir -p "$ZOO"
ZOO=$(cd "$ZOO" && pwd)
PYTHON=${PYTHON:-python3}
FORCE=${FORCE:-0}
VPY=$ZOO/venv/bin/python

T0=$SECONDS
step_start() { STEP=$1; TS=$SECONDS; echo "== $STEP" >&2; }
step_end() { echo "   $STEP: $((SECONDS - TS)) s" >&2; }
skip() { echo "== $1: skipped ($2)" >&2; }

# 1. espeak-ng -------------------------------------------------------------------------------
if command -v espeak-ng >/dev/null 2>&1 && [ "$FORCE" != 1 ]; then
    skip "espeak-ng" "installed"
else
    step_start "apt-get install espeak-ng"
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
    $SUDO apt-get update
    $SUDO apt-get install -y espeak-ng
    step_end
fi

# 2. venv ------------------------------------------------------------------------------------
REQ_SUM=$(sha256sum "$ZS/requirements.txt" | cut -d' ' -f1)
STAMP=$ZOO/venv/.requirements.sha256
if [ -x "$VPY" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$REQ_SUM" ] && [ "$FORCE" != 1 ]; then
    skip "venv" "$ZOO/venv matches requirements.txt"
else
    step_start "venv + pip install -r requirements.txt"
    [ -x "$VPY" ] || "$PYTHON" -m venv "$ZOO/venv"
    "$VPY" -m pip install -q -r "$ZS/requirements.txt"
    echo "$REQ_SUM" > "$STAMP"
    step_end
fi

# 3. models ----------------------------------------------------------------------------------
# get_models.py writes manifest.json last, so a manifest whose files all exist, with the sha256 it
# recorded, is a finished run (a tool that writes into its input, as Model Optimizer 0.47 does, makes
# the models be extracted again).
models_ok() {
    "$VPY" - "$ZOO/models" <<'EOF'
import hashlib, json, sys
from pathlib import Path
d = Path(sys.argv[1])
man = json.loads((d / "manifest.json").read_text())
ok = len(man) > 0 and all((d / m["file"]).is_file() for m in man)
ok = ok and all(hashlib.sha256((d / m["file"]).read_bytes()).hexdigest() == m["sha256"] for m in man if m.get("sha256"))
ok = ok and (not any(m["name"] == "minilm_l6_v2" for m in man) or (d / "minilm_l6_v2.tokenizer.json").is_file())
sys.exit(0 if ok else 1)
EOF
}
if [ -f "$ZOO/models/manifest.json" ] && models_ok 2>/dev/null && [ "$FORCE" != 1 ]; then
    skip "get_models.py" "$ZOO/models/manifest.json and its models exist, unchanged"
else
    step_start "get_models.py"
    rm -f "$ZOO/models/manifest.json"
    "$VPY" "$ZS/get_models.py" "$ZOO/models"
    step_end
fi

# 4. data ------------------------------------------------------------------------------------
MISSING=$("$VPY" - "$ZOO/models" "$ZOO/data" "$FORCE" <<'EOF'
import json, sys
from pathlib import Path
man = json.loads((Path(sys.argv[1]) / "manifest.json").read_text())
force = sys.argv[3] == "1"
print(",".join(m["name"] for m in man if force or not (Path(sys.argv[2]) / f"{m['name']}.npz").is_file()))
EOF
)
if [ -z "$MISSING" ]; then
    skip "make_data.py" "every model has its $ZOO/data/<name>.npz"
else
    step_start "make_data.py ($MISSING)"
    "$VPY" "$ZS/make_data.py" "$ZOO/models" "$ZOO/data" --only "$MISSING"
    step_end
fi

# 5. calibration split -----------------------------------------------------------------------
# Exactly the README's split: even-indexed samples, arrays named like the inputs, no __meta__.
# (onnxruntime's baseline in eval_models.py calibrates on the same even-indexed samples.)
step_start "calibration split"
mkdir -p "$ZOO/calib"
"$VPY" - "$ZOO" "$FORCE" <<'EOF'
import glob, os, sys, numpy as np
zoo, force = sys.argv[1], sys.argv[2] == "1"
for p in sorted(glob.glob(f"{zoo}/data/*.npz")):     # even-indexed samples, no __meta__
    dst = f"{zoo}/calib/{os.path.basename(p)}"
    if not force and os.path.exists(dst) and os.path.getmtime(dst) >= os.path.getmtime(p):
        continue
    z = np.load(p)
    np.savez(dst + ".tmp.npz", **{k: z[k][::2] for k in z.files if k != "__meta__"})
    os.replace(dst + ".tmp.npz", dst)
    print("   wrote", dst, file=sys.stderr)
EOF
step_end

# 6. float evaluation ------------------------------------------------------------------------
if [ -f "$ZOO/float.json" ] && [ "$FORCE" != 1 ]; then
    skip "eval_models.py (float)" "$ZOO/float.json exists"
else
    step_start "eval_models.py (float)"
    "$VPY" "$ZS/eval_models.py" "$ZOO/models" "$ZOO/data" --json "$ZOO/float.json.tmp"
    mv "$ZOO/float.json.tmp" "$ZOO/float.json"
    step_end
fi

# 7. onnxruntime baseline --------------------------------------------------------------------
if [ -f "$ZOO/ort.json" ] && [ "$FORCE" != 1 ]; then
    skip "eval_models.py --ort-qdq" "$ZOO/ort.json exists"
else
    step_start "eval_models.py --ort-qdq"
    "$VPY" "$ZS/eval_models.py" "$ZOO/models" "$ZOO/data" --ort-qdq "$ZOO/ort_qdq" --json "$ZOO/ort.json.tmp"
    mv "$ZOO/ort.json.tmp" "$ZOO/ort.json"
    step_end
fi

echo "zoo ready in $ZOO ($((SECONDS - T0)) s)" >&2
