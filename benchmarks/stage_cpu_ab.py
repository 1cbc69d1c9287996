#!/usr/bin/env python3
"""CPU seconds per stage of `insert`, two qdqgraph trees alternately, and whether they write the
same bytes: for a machine shared with other work, where wall times swing too much to compare.

    .venv/bin/python benchmarks/stage_cpu_ab.py --trees BASE,THIS [--repeat 1] MODEL:CALIB ...

Per model, tree and repeat, in a process of its own with that tree first on sys.path:
`qdqgraph.quantize(MODEL, calib=CALIB)` with the defaults, every stage and step of the run's
profile (qdqgraph.execution.profile) timed also in CPU seconds (time.process_time: every thread,
onnxruntime's and OpenBLAS's included). One JSON line per run: the tree, CPU and wall seconds of
the whole insert, ru_maxrss (MB), sha256 (first 16 hex digits) of the written model's
SerializeToString(), and {stage: [CPU s, wall s, peak RSS MB]} for the stages over 0.05 CPU s.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys


def child(tree: str, model: str, calib: str) -> dict:
    sys.path.insert(0, tree)
    import contextlib
    import hashlib
    import resource
    import time

    import qdqgraph
    from qdqgraph.execution import profile
    assert qdqgraph.__file__.startswith(tree), qdqgraph.__file__
    plain = profile.Profile.stage

    @contextlib.contextmanager
    def stage(self, name):
        path, start = self.path(name), time.process_time()
        try:
            with plain(self, name):
                yield
        finally:
            self.rows[path]["cpu"] = self.rows[path].get("cpu", 0.0) + time.process_time() - start
    profile.Profile.stage = stage
    c0, w0 = time.process_time(), time.perf_counter()
    r = qdqgraph.quantize(model, calib=calib)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    rows = r.report.profile.rows
    return {"tree": tree, "model": model.rsplit("/", 1)[-1], "cpu": round(cpu, 2), "wall": round(wall, 2),
            "peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "sha": hashlib.sha256(r.model.SerializeToString()).hexdigest()[:16],
            "stages": {k: [round(v.get("cpu", 0.0), 2), round(v["seconds"], 2), v.get("peak_rss_mb")]
                       for k, v in rows.items() if v.get("cpu", 0.0) > 0.05}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", help="MODEL.onnx:CALIB.npz")
    ap.add_argument("--trees", required=False, help="BASE,THIS")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--child", nargs=3, metavar=("TREE", "MODEL", "CALIB"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(*a.child)))
        return 0
    if not a.trees or not a.models:
        ap.error("give --trees BASE,THIS and at least one MODEL:CALIB")
    for spec in a.models:
        model, calib = spec.rsplit(":", 1)
        for _ in range(a.repeat):
            for tree in a.trees.split(","):
                out = subprocess.run([sys.executable, __file__, "--child", tree, model, calib],
                                     capture_output=True, text=True)
                line = out.stdout.strip().splitlines()[-1:] or [json.dumps({"tree": tree, "failed": out.stderr[-300:]})]
                print(line[0], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
