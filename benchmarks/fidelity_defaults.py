#!/usr/bin/env python3
"""Cross-layer equalization, bias correction, fragile heads and the SQNR floor, one at a time and as
the default, on the zoo, torchvision and the transformer set (issue 31).

    python benchmarks/fidelity_defaults.py [--only a,b] [--variants none,cle,...] [--samples 32]
                                           [--jsonl OUT.jsonl] [--holdout 16]

For every model and variant it runs `qdqgraph.quantize` in this process on the model's calibration
file, timed, and measures the written model (FP16 islands, as written) in onnxruntime, opened by
qdqgraph's session (onnxruntime's rewrites that TensorRT does not make are off), against the float
model: the output SQNR on the first --samples calibration samples (what the measured decisions see:
qdqgraph.pipeline.FIDELITY_SAMPLES)
and on --holdout samples the run never saw (the zoo's data file, odd-indexed samples, where it has
the model's inputs), per output and over all outputs; with the INT8 FLOPs share the simulator
predicts and the nodes each decision returned to float. One JSON line per (model, variant) goes to
--jsonl as it finishes; a markdown table is printed at the end. Task metrics come from
benchmarks/zoo_accuracy.py with the same options as --variant (docs/ACCURACY.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ZOO = Path(os.environ.get("QDQGRAPH_ZOO", "/tmp/qdqgraph-zoo"))
TV = Path(os.environ.get("QDQGRAPH_TV", "/tmp/qdqgraph-tv/models"))
TFM = Path(os.environ.get("QDQGRAPH_TRANSFORMERS", "/tmp/qdqgraph-tfm"))

OFF = {"equalize": "off", "bias_correction": False, "fragile_heads": False, "sqnr_floor": None}
VARIANTS = {
    "none": ("nothing of issue 31", OFF),
    "cle": ("+ --equalize on", {**OFF, "equalize": "on"}),
    "bias": ("+ --bias-correction on", {**OFF, "bias_correction": True}),
    "bias-auto": ("+ --bias-correction auto", {**OFF, "bias_correction": None}),
    "heads": ("+ --fragile-heads on", {**OFF, "fragile_heads": True}),
    "floor": ("+ --sqnr-floor 25", {**OFF, "sqnr_floor": 25.0}),
    "default": ("the defaults", {}),
}


def models() -> dict[str, tuple[Path, Path, Path | None]]:
    """name -> (model, calibration npz, held-out npz or None)."""
    out = {}
    for p in sorted((ZOO / "models").glob("*.onnx")):
        out[p.stem] = (p, ZOO / "calib" / f"{p.stem}.npz", ZOO / "data" / f"{p.stem}.npz")
    for p in sorted(TV.glob("*.onnx")):
        out[p.stem] = (p, TV / f"{p.stem}.calib.npz", None)
    for p in sorted((TFM / "models").glob("*.onnx")):
        out[p.stem] = (p, TFM / "calib" / f"{p.stem}.npz", TFM / "data" / f"{p.stem}.npz")
    return {k: v for k, v in out.items() if v[1].exists()}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def data_of(model: Path, npz: Path, samples: int, odd: bool = False):
    from qdqgraph import io
    from qdqgraph.data import CalibrationData, read_arrays
    from qdqgraph.prepare import model_inputs
    loaded = io.load(model)
    inputs = model_inputs(loaded.graph)
    z = np.load(npz, allow_pickle=True)
    names = [i.name for i in inputs]
    if any(n not in z.files for n in names):
        return loaded, None
    arrays = {n: z[n][1::2] if odd else z[n] for n in names}
    if min(len(a) for a in arrays.values()) == 0:
        return loaded, None
    data = CalibrationData(read_arrays(arrays, inputs), inputs, samples)
    data.limit = samples
    return loaded, data


def fidelity(model, loaded, data) -> dict | None:
    from qdqgraph.fidelity import fidelity_of, reference
    if data is None:
        return None
    ref = reference(loaded, data, data.limit)
    f = fidelity_of(model, ref)
    return f.to_dict() | {"samples": ref.samples}


def run_one(name, paths, variant, opts, samples, holdout) -> dict:
    import qdqgraph
    model, calib, held = paths
    t = time.perf_counter()
    r = qdqgraph.quantize(model, calib=str(calib), **opts)
    secs = time.perf_counter() - t
    loaded, cal = data_of(model, calib, samples)
    row = {"model": name, "variant": variant, "seconds": round(secs, 2),
           "int8_flops": (r.report.tensorrt or {}).get("int8_flops_share"),
           "calib": fidelity(r.model, loaded, cal),
           "stages": {k: round(v, 2) for k, v in r.report.stages.items()},
           "fidelity": r.report.fidelity, "equalized": r.report.equalized,
           "bias_corrected": r.report.bias_corrected}
    if held is not None and held.exists() and holdout:
        loaded, ho = data_of(model, held, holdout, odd=True)
        row["holdout"] = fidelity(r.model, loaded, ho)
    return row


def table(rows: list[dict]) -> str:
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    lines = ["| model | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
    for m in dict.fromkeys(r["model"] for r in rows):
        cells = []
        for v in variants:
            r = next((x for x in rows if x["model"] == m and x["variant"] == v), None)
            if r is None or "error" in r:
                cells.append((r or {}).get("error", "-")[:40])
                continue
            c = (r.get("calib") or {}).get("overall_db", "-")
            h = (r.get("holdout") or {}).get("overall_db")
            q = r.get("int8_flops")
            cells.append(f"{c} / {h if h is not None else '-'} dB, {100 * q:.1f}%, {r['seconds']:.1f} s"
                         if q is not None else f"{c} dB, {r['seconds']:.1f} s")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--holdout", type=int, default=16)
    ap.add_argument("--jsonl", type=Path, default=Path("/tmp/qdqgraph-fidelity.jsonl"))
    a = ap.parse_args()
    found = models()
    names = [n for n in a.only.split(",") if n in found] if a.only else list(found)
    rows = []
    for n in names:
        for v in a.variants.split(","):
            try:
                row = run_one(n, found[n], v, VARIANTS[v][1], a.samples, a.holdout)
            except Exception as e:  # noqa: BLE001 - a failure is a table cell
                row = {"model": n, "variant": v, "error": f"{type(e).__name__}: {e}"[:300]}
            rows.append(row)
            with a.jsonl.open("a") as f:
                f.write(json.dumps(row) + "\n")
            log(f"{n:26s} {v:10s} {json.dumps({k: row.get(k) for k in ('seconds', 'int8_flops', 'error')})} "
                f"calib {(row.get('calib') or {}).get('overall_db')} holdout {(row.get('holdout') or {}).get('overall_db')}")
    print(table(rows))


if __name__ == "__main__":
    main()
