#!/usr/bin/env python3
"""What opening an onnxruntime session costs on a large graph, by optimization level, with the
model's own outputs or with every tensor an output (as calibration asks), and what 8 runs then
take. The residual CNNs of benchmarks/scale.py, each size and setting in its own process.

    .venv/bin/python benchmarks/ort_session_open.py [--sizes 10000,40000] [--out DIR]

The table: seconds to open, seconds for 8 runs at batch 1, per setting. `all+ext` is what
qdqgraph's calibration session takes on graphs of runtime.LARGE_GRAPH_NODES nodes or more
(every tensor an output, onnxruntime's extended level: no layout level, no NCHWc reorders).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {          # name -> (every tensor an output, optimization level)
    "own+all": (False, "ORT_ENABLE_ALL"),
    "own+none": (False, "ORT_DISABLE_ALL"),
    "all+all": (True, "ORT_ENABLE_ALL"),
    "all+ext": (True, "ORT_ENABLE_EXTENDED"),
    "all+none": (True, "ORT_DISABLE_ALL"),
}


def child(path: str, setting: str) -> None:
    import numpy as np
    import onnx
    import onnxruntime as ort
    every, level = SETTINGS[setting]
    m = onnx.load(path)
    if every:
        have = {o.name for o in m.graph.output}
        for n in m.graph.node:
            for t in n.output:
                if t not in have:
                    m.graph.output.add().name = t
                    m.graph.output[-1].type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    blob = m.SerializeToString()
    opts = ort.SessionOptions()
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    t = time.perf_counter()
    s = ort.InferenceSession(blob, opts, providers=["CPUExecutionProvider"])
    opened = time.perf_counter() - t
    i = s.get_inputs()[0]
    x = np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 1 for d in i.shape]).astype(np.float32)
    t = time.perf_counter()
    for _ in range(8):
        s.run(None, {i.name: x})
    print(json.dumps({"open_s": opened, "runs_s": time.perf_counter() - t}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10000,40000")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "qdqgraph-targets")
    ap.add_argument("--child", nargs=2)
    a = ap.parse_args()
    if a.child:
        return child(*a.child)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import onnx
    import scale
    a.out.mkdir(parents=True, exist_ok=True)
    print("| nodes | " + " | ".join(f"{s} open s | {s} 8 runs s" for s in SETTINGS) + " |")
    print("|---|" + "---|---|" * len(SETTINGS))
    for size in (int(x) for x in a.sizes.split(",")):
        path = a.out / f"resnet_{size}.onnx"
        if not path.exists():
            onnx.save(scale.residual_cnn(size), str(path))
        cells = []
        for setting in SETTINGS:
            got = subprocess.run([sys.executable, __file__, "--child", str(path), setting],
                                 capture_output=True, text=True, check=True)
            r = json.loads(got.stdout.strip().splitlines()[-1])
            cells += [f"{r['open_s']:.2f}", f"{r['runs_s']:.2f}"]
        print(f"| {size} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
