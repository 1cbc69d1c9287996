#!/usr/bin/env python3
"""Learned rounding (--learned-rounding on) against nearest rounding, on torchvision's exports and
the transformer set.

    PYTHONPATH=.:TORCH_SITE_PACKAGES python benchmarks/learned_rounding.py [--only a,b] [--out DIR]

Needs PyTorch importable (the `learn` extra; benchmarks/setup_torchvision.sh makes a venv with it
whose site-packages can be put on PYTHONPATH). For every model it runs `qdqgraph.quantize` in this
process twice, float32 islands (as docs/ACCURACY.md scores accuracy), --learned-rounding off and
on, timed, and keeps the INT8 FLOPs share the simulator predicts and the pass's own record (layers
learned, the output SQNR it measured on calibration samples before and after). Then:

  * torchvision (untrained weights, so no task metric): output SQNR against float and top-1
    agreement with float, over the calibration samples next to each model (the samples the
    rounding was learned on: there is no other data for them);
  * the transformer set: task metric and worst-output SQNR from benchmarks/transformers/evaluate.py
    --compare on its held-out data (transformer_recipes.score_tfm).

The zoo is measured with benchmarks/zoo_accuracy.py (--variant ... --learned-rounding on|off).
Prints one markdown table; --json keeps everything.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
TV = Path(os.environ.get("QDQGRAPH_TORCHVISION", "/tmp/qdqgraph-tv/models"))
TFM = Path(os.environ.get("QDQGRAPH_TRANSFORMERS", "/tmp/qdqgraph-tfm"))
TV_MODELS = ["resnet18", "mobilenet_v3_large", "efficientnet_b0", "resnet50"]
TFM_MODELS = ["vit_s_focus", "whisper_tiny_en_encoder", "gector_distilbert", "whisper_tiny_en_decoder"]
MODES = ("off", "on")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def paths(name):
    if name in TV_MODELS:
        return TV / f"{name}.onnx", TV / f"{name}.calib.npz"
    return TFM / "models" / f"{name}.onnx", TFM / "calib" / f"{name}.npz"


def quantize(name: str, mode: str, out: Path) -> dict:
    import onnx
    import qdqgraph
    model, calib = paths(name)
    t = time.perf_counter()
    r = qdqgraph.quantize(model, calib=calib, high_precision="fp32", learned_rounding=mode)
    secs = time.perf_counter() - t
    (out / mode).mkdir(parents=True, exist_ok=True)
    onnx.save(r.model, out / mode / f"{name}.onnx")
    sim = r.report.tensorrt or {}
    lr = r.report.learned_rounding or {}
    row = {"seconds": round(secs, 1), "int8_flops": sim.get("int8_flops_share"),
           "learned": lr.get("learned"), "candidates": lr.get("candidates"),
           "learn_seconds": lr.get("seconds"), "calib_sqnr_before_db": lr.get("sqnr_before_db"),
           "calib_sqnr_after_db": lr.get("sqnr_after_db"), "dropped": lr.get("dropped")}
    log(f"{mode:4s} {name:26s} {secs:7.1f} s  {json.dumps({k: v for k, v in row.items() if k != 'seconds'})}")
    return row


def tv_fidelity(name: str, path: Path) -> dict:
    """Output SQNR and top-1 agreement against float over the calibration samples."""
    import onnxruntime as ort
    from qdqgraph.execution.runtime import DISABLED_OPTIMIZERS
    model, calib = paths(name)
    z = np.load(calib)
    f = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    q = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"], disabled_optimizers=list(DISABLED_OPTIMIZERS))
    key = f.get_inputs()[0].name
    sig = err = 0.0
    agree = []
    for x in z[z.files[0]]:
        a = np.asarray(f.run(None, {key: x})[0], np.float64)
        b = np.asarray(q.run(None, {key: x})[0], np.float64)
        sig += float(np.sum(a * a))
        err += float(np.sum((a - b) ** 2))
        agree.append(float(np.mean(a.argmax(-1) == b.argmax(-1))))
    return {"sqnr_db": round(10 * np.log10(sig / max(err, 1e-30)), 2), "top1_agreement": round(float(np.mean(agree)), 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/qdqgraph-learned-rounding"))
    ap.add_argument("--only", default="", help="comma-separated model names")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    names = [n for n in TV_MODELS + TFM_MODELS if not a.only or n in a.only.split(",")]
    names = [n for n in names if all(p.exists() for p in paths(n))]
    rows: dict = {}
    for n in names:
        for mode in MODES:
            rows[(mode, n)] = quantize(n, mode, a.out)
            if n in TV_MODELS:
                rows[(mode, n)].update(tv_fidelity(n, a.out / mode / f"{n}.onnx"))
    tfm = [n for n in names if n in TFM_MODELS]
    if tfm:
        from transformer_recipes import fidelity_text, float_task_text, score_tfm, task_text
        for mode in MODES:
            scored = score_tfm(a.out / mode, tfm, a.out / f"{mode}.json")
            for n in tfm:
                rows[(mode, n)].update(task=task_text(n, scored.get(n)), float_task=float_task_text(n, scored.get(n)),
                                       fidelity=fidelity_text(n, scored.get(n)))
    print("| model | float task | task nearest -> learned | output SQNR nearest -> learned | INT8 FLOPs | "
          "layers learned | insert s nearest / learned | calib SQNR (pass's check) |")
    print("|---|---|---|---|---|---|---|---|")
    for n in names:
        o, l = rows[("off", n)], rows[("on", n)]
        if n in TV_MODELS:
            task = f"top-1 agreement {o['top1_agreement']:.3f} -> {l['top1_agreement']:.3f}"
            fid = f"{o['sqnr_db']:.1f} -> {l['sqnr_db']:.1f} dB"
            ftask = "- (untrained)"
        else:
            task, fid, ftask = f"{o['task']} -> {l['task']}", f"{o['fidelity']} -> {l['fidelity']}", o["float_task"]
        check = (f"{l['calib_sqnr_before_db']:.1f} -> {l['calib_sqnr_after_db']:.1f} dB"
                 + (" (not written)" if l.get("dropped") else "")) if l.get("calib_sqnr_before_db") is not None else "-"
        print(f"| {n} | {ftask} | {task} | {fid} | {100 * (l['int8_flops'] or 0):.1f}% | "
              f"{l['learned']} of {l['candidates']} | {o['seconds']:.0f} / {l['seconds']:.0f} | {check} |")
    if a.json:
        a.json.write_text(json.dumps({f"{m}/{n}": r for (m, n), r in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
