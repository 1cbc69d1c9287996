#!/usr/bin/env python3
"""Weights dequantized once (qdqgraph/execution/dequantized.py) against the model as written, in
qdqgraph's own onnxruntime sessions: are the outputs bit-identical, and how long do the runs take?

    .venv/bin/python benchmarks/dequantized_once.py WRITTEN.onnx:DATA.npz [...] [--samples 8] [--widen]

WRITTEN.onnx: a model `qdqgraph insert` wrote; DATA.npz: its calibration data (one array per input,
samples first). Each model gets two sessions, `runtime.session` as qdqgraph makes it and the same
with folding turned off, alternately timed over the first --samples samples; a table per model:
weights folded, CPU seconds of the runs each way, identical outputs or not. `--widen`: the sessions
that score a large written model (FP16 computed in float32, no graph optimizations), for any size.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qdqgraph.execution import dequantized, runtime  # noqa: E402
from qdqgraph.graph import io  # noqa: E402


def runs(model, feeds: list[dict], fold: bool, widen: bool) -> tuple[float, float, list, int]:
    """(session CPU s, runs CPU s, outputs, weights folded) of a session with or without folding."""
    real, count = dequantized.fold, []

    def counted(*a, **k):
        got = real(*a, **k) if fold else (a[0], a[1], 0)
        count.append(got[2])
        return got

    dequantized.fold = counted
    try:
        t = time.process_time()
        sess = runtime.session(model, purpose="comparison", widen=widen)
        opened = time.process_time() - t
    finally:
        dequantized.fold = real
    t = time.process_time()
    outs = [sess.run(None, f) for f in feeds]
    return opened, time.process_time() - t, outs, sum(count)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+", metavar="WRITTEN.onnx:DATA.npz")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--widen", action="store_true")
    args = ap.parse_args()
    if args.widen:
        runtime.LARGE_GRAPH_NODES = 0
    print("| model | weights folded | open, CPU s (as written / folded) | runs, CPU s (as written / folded) | identical |")
    print("|---|---|---|---|---|")
    for case in args.cases:
        path, data_path = case.rsplit(":", 1)
        model = io.read_model(path)
        data = np.load(data_path)
        feeds = [{k: data[k][i] for k in data.files} for i in range(min(args.samples, len(data[data.files[0]])))]
        o1, r1, plain, _ = runs(model, feeds, False, args.widen)
        o2, r2, folded, n = runs(model, feeds, True, args.widen)
        same = all(np.array_equal(a, b) for pa, pb in zip(plain, folded) for a, b in zip(pa, pb))
        print(f"| {Path(path).name} | {n} | {o1:.2f} / {o2:.2f} | {r1:.2f} / {r2:.2f} | {'yes' if same else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
