#!/usr/bin/env python3
"""Issue 32's targets, measured as a user meets them: the whole `qdqgraph insert` command with the
defaults (wall seconds, peak RSS of the process), and `qdqgraph report` of the 10,000-node output.

    .venv/bin/python benchmarks/targets.py [--against TREE] [--tree TREE] [--repeat 2] [--out DIR]
        [--zoo /tmp/qdqgraph-zoo] [--tfm /tmp/qdqgraph-tfm] [--no-large] [--json OUT.json]

Each command runs in a process of its own with qdqgraph imported from TREE (default: this
checkout); with `--against BASE` every command also runs with BASE, alternately, so the two trees
see the same machine (it is shared and has 2 cores: compare within one run). The fastest of
`--repeat` runs is kept. "without data runs" is the insert's wall time less the stages that run
the model on calibration data (DATA_RUNS: calibration, the recipes that measure, and --verify's
comparison), read from the run's --report profile. The scale models (benchmarks/scale.py: residual
CNNs of 10,000 and 40,000 nodes, the 24x640 encoder of about 450 MB) are built into --out once.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

# the stages that run the model (float or quantized) on calibration samples; "verify" is the default
# `--verify 8` comparison, a run of the written model on 8 samples
DATA_RUNS = ("calibrate", "island ranges", "output-aware scales", "massive columns", "smooth", "attention check",
             "learned rounding", "bias correction", "sensitivity", "fidelity", "verify")


def bytecode(tree: Path) -> dict[str, str]:
    """The environment under which `tree`'s modules import from compiled bytecode, as from an
    installed package (pip compiles it at install): a cache folder of the tree's own, filled once.
    Without it, a checkout under PYTHONDONTWRITEBYTECODE compiles every module on each run (0.3 CPU s
    of a `report`)."""
    key = hashlib.sha1(str(tree.resolve()).encode()).hexdigest()[:12]
    cache = Path(tempfile.gettempdir()) / f"qdqgraph-bytecode-{key}"
    env = dict(os.environ, PYTHONPYCACHEPREFIX=str(cache))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "qdqgraph")], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    # under the prefix every module's bytecode lives there, numpy's and onnx's too: one start fills it,
    # so that the first measured command does not compile them
    env["PYTHONPATH"] = str(tree) + os.pathsep + os.environ.get("PYTHONPATH", "")
    subprocess.run([sys.executable, "-m", "qdqgraph", "--help"], env=env, check=True, cwd="/",
                   stdout=subprocess.DEVNULL)
    return {"PYTHONPYCACHEPREFIX": str(cache)}


_BYTECODE: dict[Path, dict[str, str]] = {}


def run(argv: list[str], tree: Path, timeout: int) -> dict:
    """Wall seconds, peak RSS (MB, the child's own ru_maxrss from wait4) and its output (stdout and
    stderr together, "stderr"), or the last line on failure, of `python -m qdqgraph ARGV` with
    `tree` first on the path, in a process of its own, its modules from compiled bytecode
    (`bytecode`; compiled again when the tree changed since, as Python checks each source's time)."""
    if tree not in _BYTECODE:
        _BYTECODE[tree] = bytecode(tree)
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""), **_BYTECODE[tree])
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    with tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "qdqgraph", *argv], env=env, cwd="/",
                                stdout=err, stderr=subprocess.STDOUT)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        text = err.read()
        last = (text.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    if proc.returncode != 0:
        return {"error": last if wall < timeout else f"not finished in {timeout} s", "wall_s": wall}
    return {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024, "stderr": text}


def without_data_runs(report: Path, wall: float, stderr: str = "") -> float:
    """`wall` less the DATA_RUNS stages: from the --report profile, and the verify stage (which runs
    after the report is written) from the profile table --verbose prints."""
    profile = json.loads(report.read_text()).get("profile", {})
    data = sum(profile[s]["seconds"] for s in DATA_RUNS if s in profile)
    for line in stderr.splitlines():
        cells = line.split()
        if len(cells) >= 2 and cells[0] == "verify" and line.startswith("  verify"):
            data += float(cells[1])
    return wall - data


def models(args) -> list[dict]:
    """(name, model, calib, file MB) of each case; the scale models built into args.out once."""
    import onnx
    import scale
    args.out.mkdir(parents=True, exist_ok=True)
    found = [("whisper_tiny_en_encoder", args.tfm / "models", args.tfm / "calib"),
             ("minilm_l6_v2", args.zoo / "models", args.zoo / "calib")]
    cases = [{"name": n, "model": d / f"{n}.onnx", "calib": c / f"{n}.npz"} for n, d, c in found]
    built = [("resnet_10000", lambda: scale.residual_cnn(10000)), ("resnet_40000", lambda: scale.residual_cnn(40000))]
    if not args.no_large:
        built.append(("encoder_24x640", lambda: scale.encoder(24, hidden=640, heads=10)))
    for name, make in built:
        path, calib = args.out / f"{name}.onnx", args.out / f"{name}.npz"
        if not (path.exists() and calib.exists()):
            m = make()
            onnx.save(m, str(path))
            np.savez(calib, **scale.calibration(m, 8))
        cases.append({"name": name, "model": path, "calib": calib})
    for c in cases:
        c["file_mb"] = c["model"].stat().st_size / 2**20
    return [c for c in cases if c["model"].exists() and c["calib"].exists()]


def measure(case: dict, tree: Path, folder: Path, timeout: int) -> dict:
    out, report = folder / f"{case['name']}.qdq.onnx", folder / f"{case['name']}.json"
    got = run(["insert", str(case["model"]), "--calib", str(case["calib"]), "-o", str(out), "--report", str(report),
               "--force", "--verbose"], tree, timeout)
    if "error" in got:
        return got
    got["without_data_s"] = without_data_runs(report, got["wall_s"], got.pop("stderr"))
    if case["name"] == "resnet_10000":
        rep = run(["report", str(out)], tree, timeout)
        rep.pop("stderr", None)
        got["report_s"] = rep.get("wall_s", float("nan"))
    return got


def best(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    return min(ok, key=lambda r: r["wall_s"]) if ok else runs[-1]


def verdicts(rows: dict, file_mb: dict) -> list[tuple[str, str, float, str]]:
    """(target, measured, limit, met) of each of the issue's targets, from this tree's rows."""
    def get(name, key):
        return rows.get(name, {}).get(key, float("nan"))
    ratio = get("resnet_40000", "without_data_s") / get("resnet_10000", "without_data_s")
    out = [("Whisper tiny.en encoder insert, s", get("whisper_tiny_en_encoder", "wall_s"), 10.0),
           ("MiniLM insert, s", get("minilm_l6_v2", "wall_s"), 5.0),
           ("10,000-node CNN insert, s", get("resnet_10000", "wall_s"), 10.0),
           ("10,000-node CNN insert without data runs, s", get("resnet_10000", "without_data_s"), 5.0),
           ("40k / 10k without data runs", ratio, 4.5),
           ("report of the 10,000-node output, s", get("resnet_10000", "report_s"), 2.0)]
    if "encoder_24x640" in rows:
        out.append(("encoder_24x640 peak RSS / file", get("encoder_24x640", "peak_rss_mb") / file_mb["encoder_24x640"], 2.0))
    return [(t, f"{v:.2f}", lim, "yes" if v <= lim else "no") if np.isfinite(v) else (t, "not measured", lim, "-")
            for t, v, lim in out]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, default=ROOT)
    ap.add_argument("--against", type=Path)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "qdqgraph-targets")
    ap.add_argument("--zoo", type=Path, default=Path("/tmp/qdqgraph-zoo"))
    ap.add_argument("--tfm", type=Path, default=Path("/tmp/qdqgraph-tfm"))
    ap.add_argument("--no-large", action="store_true", help="leave out the 450 MB encoder")
    ap.add_argument("--only", type=lambda s: set(s.split(",")))
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    trees = ([args.against] if args.against else []) + [args.tree]
    cases = [c for c in models(args) if not args.only or c["name"] in args.only]
    rows: dict[str, dict[str, dict]] = {str(t): {} for t in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            runs: dict[str, list[dict]] = {str(t): [] for t in trees}
            for _ in range(args.repeat):
                for tree in trees:
                    runs[str(tree)].append(measure(case, tree, Path(tmp), args.timeout))
                    print(case["name"], tree, json.dumps(runs[str(tree)][-1]), file=sys.stderr, flush=True)
            for tree in trees:
                rows[str(tree)][case["name"]] = best(runs[str(tree)])
    head = "| model | file MB | " + " | ".join(f"{label} insert s | w/o data runs s | peak RSS MB"
                                               for label in (["against", "this"] if args.against else ["this"]))
    print(head + " | ratio |")
    print("|" + "---|" * (head.count("|") + 1))
    for case in cases:
        cells = []
        for tree in trees:
            r = rows[str(tree)][case["name"]]
            cells.append(r["error"] if "error" in r else
                         f"{r['wall_s']:.2f} | {r['without_data_s']:.2f} | {r['peak_rss_mb']:.0f}")
        a, b = rows[str(trees[0])][case["name"]], rows[str(trees[-1])][case["name"]]
        ratio = f"{a['wall_s'] / b['wall_s']:.2f}x" if args.against and "error" not in a and "error" not in b else ""
        print(f"| {case['name']} | {case['file_mb']:.1f} | " + " | ".join(cells) + f" | {ratio} |")
    for tree in trees:
        r = rows[str(tree)].get("resnet_10000", {})
        if "report_s" in r:
            print(f"\nreport of resnet_10000's output ({tree}): {r['report_s']:.2f} s")
    print("\n| target (this tree) | measured | limit | met |\n|---|---|---|---|")
    for t, v, lim, met in verdicts(rows[str(args.tree)], {c["name"]: c["file_mb"] for c in cases}):
        print(f"| {t} | {v} | {lim:g} | {met} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
