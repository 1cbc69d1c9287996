#!/usr/bin/env python3
"""Cross-layer equalization, bias correction, fragile heads and the SQNR floor, one at a time and as
the default, on the zoo, torchvision and the transformer set (issue 31).

    python benchmarks/fidelity_defaults.py [--only a,b] [--variants none,cle,...] [--samples 32]
                                           [--jsonl OUT.jsonl] [--holdout all|N] [--options JSON]

For every model and variant it runs `qdqgraph.quantize` in this process on the model's calibration
file, timed, and measures the written model (FP16 islands, as written) in onnxruntime, opened by
qdqgraph's session (onnxruntime's rewrites that TensorRT does not make are off), against the float
model: the output SQNR on the first --samples calibration samples (what the measured decisions see:
qdqgraph.pipeline.FIDELITY_SAMPLES)
and on the held-out samples the run never saw (the data file's odd-indexed samples, where it has
the model's inputs; its even-indexed ones are the calibration file), per output and over all
outputs: by default all of them (`--holdout all`; `--holdout N` takes the first N, 0 none), and
beside that the first --holdout-first (16, what runs before 2026-11-29 reported) as `holdout_first`;
with the INT8 FLOPs share the simulator predicts and the nodes each decision returned to float. One JSON line per (model, variant) goes to
--jsonl as it finishes; a markdown table is printed at the end. Task metrics come from
benchmarks/zoo_accuracy.py with the same options as --variant (docs/ACCURACY.md). --options adds
`qdqgraph.quantize` keywords to every variant (a JSON object; lists become tuples), e.g.
'{"include_nodes": ["attention/output/dense"], "bias_correction": true}', and the rows record them.
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
    "all": ("+ --bias-correction auto --sqnr-floor 25 (fragile heads on)",
            {**OFF, "bias_correction": None, "fragile_heads": True, "sqnr_floor": 25.0}),
    "default": ("the defaults", {}),
    "default-floor": ("the defaults, --sqnr-floor 25", {"sqnr_floor": 25.0}),
    "no-dw": ("the defaults, --depthwise-check off", {"depthwise_check": False}),
    "lr": ("the defaults, --learned-rounding on (PyTorch on the path)", {"learned_rounding": "on"}),
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


HOLDOUT_FIRST = 16   # the held-out samples scored before `--holdout all` was the default


def holdout_count(text: str) -> int | None:
    """`--holdout`: 'all' (None: every held-out sample) or a count >= 0 (0: none)."""
    if text.strip().lower() == "all":
        return None
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"--holdout takes 'all' or a count >= 0, not {text}")
    return n


def data_of(model: Path, npz: Path, samples: int | None, odd: bool = False):
    """The model and its first `samples` samples of `npz` (None: all; odd: the odd-indexed ones)."""
    from qdqgraph.graph import io
    from qdqgraph.samples.data import CalibrationData, read_arrays
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
    data.limit = data.count
    return loaded, data


def fidelity(model, loaded, data) -> dict | None:
    from qdqgraph.recipes.fidelity import fidelity_of, reference
    if data is None:
        return None
    ref = reference(loaded, data, data.limit)
    f = fidelity_of(model, ref)
    return f.to_dict() | {"samples": ref.samples}


def held_out(written, paths, holdout: int | None, first: int = HOLDOUT_FIRST) -> dict:
    """The written model's fidelity on the held-out samples (`holdout`: None all, 0 none), and on the
    first `first` of them where those are fewer (`holdout_first`), keyed as a row keeps them."""
    model, _, held = paths
    if held is None or not held.exists() or holdout == 0:
        return {}
    loaded, ho = data_of(model, held, holdout, odd=True)
    out = {"holdout": fidelity(written, loaded, ho)}
    if ho is not None and first and first < ho.count:
        loaded, head = data_of(model, held, first, odd=True)
        out["holdout_first"] = fidelity(written, loaded, head)
    return out


def run_one(name, paths, variant, opts, samples, holdout, first=HOLDOUT_FIRST) -> dict:
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
    row.update(held_out(r.model, paths, holdout, first))
    return row


def _db(r: dict | None, key: str) -> str:
    v = ((r or {}).get(key) or {}).get("overall_db")
    return "-" if v is None else f"{v:.1f}" if isinstance(v, (int, float)) else str(v)


def _held(r: dict) -> str:
    """The held-out figure with its sample count, and the first HOLDOUT_FIRST's where scored."""
    h = r.get("holdout") or {}
    out = _db(r, "holdout") + (f" (n={h['samples']}" if h.get("samples") else "")
    if r.get("holdout_first"):
        out += f"; first {r['holdout_first']['samples']}: {_db(r, 'holdout_first')}"
    return out + (")" if h.get("samples") else "")


def _did(r: dict) -> str:
    """What the default's measured decisions did."""
    f = r.get("fidelity") or {}
    out = []
    if r.get("equalized"):
        out.append(f"{len(r['equalized']['pairs'])} pairs equalized")
    b = f.get("bias_correction")
    if b:
        out.append(f"bias {'kept' if b['kept'] else 'dropped'} ({b['with_db']} vs {b['without_db']} dB)")
    for h in f.get("heads", []):
        out.append(f"head '{h['output']}' {'float' if h['kept'] else 'kept'} ({h['before_db']} -> {h['after_db']} dB)")
    fl = f.get("floor")
    if fl:
        out.append(f"floor: {len(fl['nodes'])} nodes float, {100 * fl.get('flops_share', 0):.1f}% FLOPs, "
                   f"{fl['before_db']} -> {fl.get('after_db', fl['before_db'])} dB, sweep {fl['sweep_seconds']} s"
                   if fl["kept"] else f"floor: nothing ({fl.get('why') or 'no gain'}; sweep {fl['sweep_seconds']} s)")
    return "; ".join(out) or "-"


def table(rows: list[dict]) -> str:
    """One line per model: output SQNR (calibration samples / held-out) of each variant, INT8 FLOPs
    and insert seconds of the plain run and the default, and what the default did."""
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    head = ["model"] + [f"{v} dB (calib / held-out)" for v in variants] + \
        ["INT8 FLOPs none -> all", "insert s none -> all", "what `all` did"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for m in dict.fromkeys(r["model"] for r in rows):
        got = {r["variant"]: r for r in rows if r["model"] == m}
        cells = [m]
        for v in variants:
            r = got.get(v)
            cells.append("-" if r is None else (r["error"][:40] if "error" in r else f"{_db(r, 'calib')} / {_held(r)}"))
        n, d = got.get("none") or {}, got.get("all") or got.get("default") or {}
        q = [f"{100 * x['int8_flops']:.1f}%" if x.get("int8_flops") is not None else "-" for x in (n, d)]
        t = [f"{x['seconds']:.1f}" if "seconds" in x else "-" for x in (n, d)]
        cells += [" -> ".join(q), " -> ".join(t), _did(d) if d and "error" not in d else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--holdout", type=holdout_count, default=None, metavar="all|N",
                    help="held-out samples to score: all (the default) or the first N (0: none)")
    ap.add_argument("--holdout-first", type=int, default=HOLDOUT_FIRST, metavar="N",
                    help="also score the first N held-out samples where there are more (0: not)")
    ap.add_argument("--jsonl", type=Path, default=Path("/tmp/qdqgraph-fidelity.jsonl"))
    ap.add_argument("--options", type=json.loads, default={},
                    help="more qdqgraph.quantize keywords for every variant, as a JSON object")
    ap.add_argument("--table", type=Path, nargs="+", metavar="JSONL",
                    help="only print the table of rows saved by earlier runs")
    a = ap.parse_args()
    if a.table:
        print(table([json.loads(line) for p in a.table for line in p.read_text().splitlines() if line.strip()]))
        return
    found = models()
    names = [n for n in a.only.split(",") if n in found] if a.only else list(found)
    extra = {k: tuple(v) if isinstance(v, list) else v for k, v in a.options.items()}
    rows = []
    for n in names:
        for v in a.variants.split(","):
            try:
                row = run_one(n, found[n], v, {**VARIANTS[v][1], **extra}, a.samples, a.holdout,
                             a.holdout_first)
                if extra:
                    row["options"] = a.options
            except Exception as e:  # noqa: BLE001 - a failure is a table cell
                row = {"model": n, "variant": v, "error": f"{type(e).__name__}: {e}"[:300]}
            rows.append(row)
            with a.jsonl.open("a") as f:
                f.write(json.dumps(row) + "\n")
            log(f"{n:26s} {v:10s} {json.dumps({k: row.get(k) for k in ('seconds', 'int8_flops', 'error')})} "
                f"calib {(row.get('calib') or {}).get('overall_db')} holdout {(row.get('holdout') or {}).get('overall_db')} "
                f"({(row.get('holdout') or {}).get('samples')} samples; first "
                f"{(row.get('holdout_first') or {}).get('samples')}: {(row.get('holdout_first') or {}).get('overall_db')})")
    print(table(rows))


if __name__ == "__main__":
    main()
