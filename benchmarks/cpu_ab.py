#!/usr/bin/env python3
"""insert and report in CPU seconds, two qdqgraph trees alternately: for a machine shared with
other work, where wall times of the same code swing too much to compare.

    .venv/bin/python benchmarks/cpu_ab.py MODEL CALIB --trees BASE,THIS [--repeat 2]

Per run, in a process of its own with that tree on PYTHONPATH: `qdqgraph.quantize(MODEL, calib=CALIB)`
with the defaults, the written model saved, then `report`'s work on the file (io.load,
trtsim.simulate, trtsim.lint). Prints one JSON line per run: CPU seconds of the process
(time.process_time: every thread, onnxruntime's included) for insert and for report, insert's wall
seconds, and the peak RSS (ru_maxrss, MB).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def child(model: str, calib: str, out: str) -> dict:
    import resource
    import time

    import qdqgraph
    from qdqgraph.graph import io
    from qdqgraph import trtsim
    from qdqgraph.placement import load_ruleset
    c0, w0 = time.process_time(), time.perf_counter()
    r = qdqgraph.quantize(model, calib=calib)
    c1, w1 = time.process_time(), time.perf_counter()
    io.save(r.model, out)
    del r
    c2 = time.process_time()
    graph = io.load(out).graph
    sim = trtsim.simulate(graph)
    trtsim.lint(graph, sim, region=load_ruleset().region)
    c3 = time.process_time()
    return {"tree": os.path.dirname(os.path.dirname(qdqgraph.__file__)), "insert_cpu_s": round(c1 - c0, 2),
            "insert_wall_s": round(w1 - w0, 2), "report_cpu_s": round(c3 - c2, 2),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(*sys.argv[2:5])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("calib")
    ap.add_argument("--trees", required=True, help="comma-separated checkouts of qdqgraph, run alternately")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for _ in range(args.repeat):
            for tree in args.trees.split(","):
                env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
                done = subprocess.run([sys.executable, __file__, "--child", os.path.abspath(args.model),
                                       os.path.abspath(args.calib), os.path.join(d, "out.onnx")],
                                      capture_output=True, text=True, env=env, cwd="/")
                lines = done.stdout.strip().splitlines()
                print(lines[-1] if done.returncode == 0 and lines else
                      json.dumps({"tree": tree, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
