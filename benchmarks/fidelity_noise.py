#!/usr/bin/env python3
"""How far the output SQNR of benchmarks/fidelity_defaults.py moves when nothing principled changes
(issue 31): the noise floor a lever has to clear.

    python benchmarks/fidelity_noise.py --only a,b [--runs 8] [--rel 0.005] [--samples 32]
                                        [--holdout all|N] [--options JSON] [--jsonl OUT.jsonl]

For every model it runs `qdqgraph.quantize` once with the defaults (plus --options), takes every
activation range the run chose (the report's sites), and runs it again --runs times with each range
multiplied by its own random factor in [1 - rel, 1 + rel] (seeded by the run's index; the ranges go
in as `calib_cache`, the weights and every other decision are the defaults'). Each written model is
measured as fidelity_defaults measures it: output SQNR over all outputs on the first --samples
calibration samples and on the --holdout held-out samples (the data file's odd-indexed ones: all of
them by default, and the first 16 beside them where there are more, as `holdout_first`). A 0.5 %
change of a range is far below what any calibration method can tell apart, so the spread of these
figures is what the benchmark reports for the same quantizer: a lever that moves a model by less
than about two standard deviations of this spread is not told apart from it.

One JSON line per model goes to --jsonl: the defaults' figures, each jittered run's, and the mean,
standard deviation, minimum and maximum of each set; a markdown table is printed at the end.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fidelity_defaults as fd  # noqa: E402


def jittered(amax: dict[str, float], rel: float, seed: int) -> dict[str, float]:
    """Every range times its own factor in [1 - rel, 1 + rel]; seed 0 leaves them as they are."""
    if seed == 0 or rel == 0:
        return dict(amax)
    rng = np.random.default_rng(seed)
    return {k: float(v) * (1.0 + float(rng.uniform(-rel, rel))) for k, v in sorted(amax.items())}


def ranges(report) -> dict[str, float]:
    """tensor -> amax of every activation site of a run's report (a shared scale under each name)."""
    return {s["tensor"]: float(s["amax"]) for s in report.sites
            if s.get("kind") != "weight" and s.get("amax") is not None}


def spread(values: list[float]) -> dict:
    v = [x for x in values if isinstance(x, (int, float)) and np.isfinite(x)]
    if not v:
        return {}
    return {"mean": round(float(np.mean(v)), 2), "sd": round(float(np.std(v, ddof=1)), 2) if len(v) > 1 else 0.0,
            "min": round(min(v), 2), "max": round(max(v), 2), "n": len(v)}


def measure(name, paths, opts, samples, holdout) -> tuple[float | None, dict, object]:
    """Calibration dB, {"holdout": dB, "holdout_first": dB} (those scored) and the run."""
    import qdqgraph
    model, calib, held = paths
    r = qdqgraph.quantize(model, calib=str(calib), **opts)
    loaded, cal = fd.data_of(model, calib, samples)
    c = (fd.fidelity(r.model, loaded, cal) or {}).get("overall_db")
    h = {k: (v or {}).get("overall_db") for k, v in fd.held_out(r.model, paths, holdout).items()}
    return c, h, r


def run_model(name, paths, opts, runs, rel, samples, holdout) -> dict:
    c0, h0, r0 = measure(name, paths, opts, samples, holdout)
    amax = ranges(r0.report)
    rows = []
    for seed in range(1, runs + 1):
        c, h, _ = measure(name, paths, {**opts, "calib_cache": jittered(amax, rel, seed)}, samples, holdout)
        rows.append({"seed": seed, "calib": c, "holdout": h.get("holdout"), "holdout_first": h.get("holdout_first")})
        fd.log(f"{name:26s} jitter {seed}: calib {c} holdout {h.get('holdout')} first {h.get('holdout_first')}")
    out = {"model": name, "rel": rel, "ranges": len(amax),
           "default": {"calib": c0, "holdout": h0.get("holdout"), "holdout_first": h0.get("holdout_first")},
           "runs": rows, "calib": spread([r["calib"] for r in rows]),
           "holdout": spread([r["holdout"] for r in rows])}
    if any(r["holdout_first"] is not None for r in rows):
        out["holdout_first"] = spread([r["holdout_first"] for r in rows])
    return out


def _cell(s: dict) -> str:
    return "-" if not s else f"{s['mean']:.2f} ± {s['sd']:.2f} ({s['min']:.1f} to {s['max']:.1f})"


def table(rows: list[dict]) -> str:
    head = ["model", "default dB (calib / held-out / first 16 held out)", "jittered calib dB: mean ± sd (min to max)",
            "jittered held-out dB: mean ± sd (min to max)", "the same, first 16 held out", "runs, rel"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['error'][:60]} | | | | |")
            continue
        d = r["default"]
        lines.append(f"| {r['model']} | {d['calib']} / {d['holdout']} / {d.get('holdout_first') or '-'} | "
                     f"{_cell(r['calib'])} | {_cell(r['holdout'])} | {_cell(r.get('holdout_first') or {})} | "
                     f"{len(r['runs'])}, ±{100 * r['rel']:g} % |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--rel", type=float, default=0.005, help="largest relative change of a range (0.005: 0.5 %%)")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--holdout", type=fd.holdout_count, default=None, metavar="all|N",
                    help="held-out samples to score: all (the default) or the first N (0: none)")
    ap.add_argument("--jsonl", type=Path, default=Path("/tmp/qdqgraph-fidelity-noise.jsonl"))
    ap.add_argument("--options", type=json.loads, default={},
                    help="more qdqgraph.quantize keywords for every run, as a JSON object")
    a = ap.parse_args()
    found = fd.models()
    names = [n for n in a.only.split(",") if n in found] if a.only else list(found)
    opts = {k: tuple(v) if isinstance(v, list) else v for k, v in a.options.items()}
    rows = []
    for n in names:
        try:
            row = run_model(n, found[n], opts, a.runs, a.rel, a.samples, a.holdout)
        except Exception as e:  # noqa: BLE001 - a failure is a table cell
            row = {"model": n, "error": f"{type(e).__name__}: {e}"[:300]}
        if a.options:
            row["options"] = a.options
        rows.append(row)
        with a.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
