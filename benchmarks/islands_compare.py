#!/usr/bin/env python3
"""The float islands' two ways on real models, in one process: the opset raised in memory (the
default) and the exported model converted and read back (io.raise_graph_opset patched to refuse).

    .venv/bin/python benchmarks/islands_compare.py MODEL.onnx:CALIB.npz [...]

Per model: whether the written bytes are the same, and the "float islands" stage's seconds each way.
"""
from __future__ import annotations

import sys

import qdqgraph
from qdqgraph.graph import io


def run(model: str, calib: str, exported: bool):
    real = io.raise_graph_opset
    if exported:
        io.raise_graph_opset = lambda graph, minimum: False      # type: ignore[assignment]
    try:
        r = qdqgraph.quantize(model, calib=calib)
        return r.model.SerializeToString(), r.report.profile.to_dict().get("float islands", {}).get("seconds", 0.0)
    finally:
        io.raise_graph_opset = real                               # type: ignore[assignment]


def main() -> int:
    differ = 0
    for arg in sys.argv[1:]:
        model, calib = arg.rsplit(":", 1)
        old, t_old = run(model, calib, True)
        new, t_new = run(model, calib, False)
        differ += old != new
        print(f"{model}: {'same bytes' if old == new else 'DIFFERENT bytes'}; float islands "
              f"{t_old:.2f} s exported way, {t_new:.2f} s in memory", flush=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
