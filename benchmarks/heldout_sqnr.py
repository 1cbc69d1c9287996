#!/usr/bin/env python3
"""Output SQNR and cosine of quantized models against float on held-out samples.

    .venv/bin/python benchmarks/heldout_sqnr.py FLOAT.onnx DATA.npz Q1.onnx [Q2.onnx ...]

DATA is a benchmark data file (/tmp/qdqgraph-tfm/data/NAME.npz, /tmp/qdqgraph-zoo/data/NAME.npz):
arrays named like the model inputs, first axis = sample; the calibration files hold its
even-indexed samples, so the odd-indexed ones are scored here (`__meta__` is skipped). Per model
and output, one JSON line: SQNR in dB over all held-out samples together, and the mean per-sample
cosine, against the float model's outputs (onnxruntime, CPU).
"""
from __future__ import annotations

import json
import sys

import numpy as np
import onnxruntime as ort


def outputs(path: str, data, names: list[str], index: list[int]) -> list[list[np.ndarray]]:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    inputs = {i.name for i in sess.get_inputs()}
    return [sess.run(None, {k: data[k][i] for k in names if k in inputs}) for i in index]


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__)
        return 2
    float_model, data_path, quantized = argv[0], argv[1], argv[2:]
    data = np.load(data_path)
    names = [k for k in data.files if k != "__meta__"]
    index = list(range(1, data[names[0]].shape[0], 2))
    ref = outputs(float_model, data, names, index)
    for q in quantized:
        got = outputs(q, data, names, index)
        line: dict = {"model": q, "samples": len(index)}
        for j in range(len(ref[0])):
            r = [np.asarray(s[j], np.float64) for s in ref]
            g = [np.asarray(s[j], np.float64) for s in got]
            signal = sum(float(np.sum(a ** 2)) for a in r)
            noise = sum(float(np.sum((a - b) ** 2)) for a, b in zip(r, g))
            cos = [float(np.sum(a * b) / (np.linalg.norm(a) * np.linalg.norm(b) or 1.0)) for a, b in zip(r, g)]
            line[f"output{j}"] = {"sqnr_db": round(10 * np.log10(signal / noise), 2) if noise else "inf",
                                  "cosine": round(float(np.mean(cos)), 6)}
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
