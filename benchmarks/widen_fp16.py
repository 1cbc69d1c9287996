#!/usr/bin/env python3
"""What scoring a written model with its FP16 islands computed in float32 (io.widen_fp16) changes:
the time onnxruntime takes to open the session, and the outputs, against onnxruntime's own handling
of FP16 (runtime.LARGE_GRAPH_NODES says where qdqgraph takes which).

    .venv/bin/python benchmarks/widen_fp16.py FLOAT.onnx WRITTEN.onnx CALIB.npz [--samples 32]

Prints the session-open seconds both ways (each session made once, in this process: compare the two
within one run) and, over the first --samples samples, per output: the SQNR of each way against the
float model and of the two against each other.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qdqgraph.graph import io, proto                      # noqa: E402
from qdqgraph.execution import runtime                     # noqa: E402
from qdqgraph.prepare import model_inputs                  # noqa: E402
from qdqgraph.samples.data import CalibrationData, read_arrays   # noqa: E402


def opened(model, widen: bool):
    light, weights = io.split_weights(model)
    if widen:
        light = proto.copy_model(light)
        weights = io.widen_fp16(light, weights)
    t = time.perf_counter()
    sess = runtime.session(light, purpose="benchmark", weights=weights)
    return sess, time.perf_counter() - t


def db(sig: float, err: float) -> str:
    return "inf" if err == 0 else f"{10 * np.log10(sig / err):.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("float_model")
    ap.add_argument("written")
    ap.add_argument("calib")
    ap.add_argument("--samples", type=int, default=32)
    args = ap.parse_args()
    written = io.read_model(args.written)
    print(f"{args.written}: {len(written.graph.node)} nodes")
    own, own_s = opened(written, widen=False)
    wide, wide_s = opened(written, widen=True)
    print(f"session open: onnxruntime's FP16 handling {own_s:.2f} s, widened {wide_s:.2f} s")
    f_loaded = io.load(args.float_model)
    f_sess = runtime.graph_session(f_loaded, purpose="benchmark")
    inputs = model_inputs(f_loaded.graph)
    data = CalibrationData(read_arrays(args.calib, inputs, None), inputs, args.samples)
    names = [o.name for o in f_sess.get_outputs()]
    q_inputs = {i.name for i in own.get_inputs()}
    acc = {k: np.zeros(4) for k in names}
    n = 0
    for feed in data.batches(1):
        f = f_sess.run(names, feed)
        qfeed = {k: v for k, v in feed.items() if k in q_inputs}
        a, b = own.run(names, qfeed), wide.run(names, qfeed)
        for k, x, y, z in zip(names, f, a, b):
            x, y, z = (np.asarray(v, dtype=np.float64) for v in (x, y, z))
            acc[k] += [np.sum(x * x), np.sum((x - y) ** 2), np.sum((x - z) ** 2), np.sum((y - z) ** 2)]
        n += 1
    print(f"| output | SQNR to float, onnxruntime's FP16 (dB) | SQNR to float, widened (dB) | the two against each other (dB) |  ({n} samples)")
    print("|---|---|---|---|")
    for k, (sig, e_own, e_wide, e_two) in acc.items():
        print(f"| {k} | {db(sig, e_own)} | {db(sig, e_wide)} | {db(sig, e_two)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
