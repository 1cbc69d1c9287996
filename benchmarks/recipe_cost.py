#!/usr/bin/env python3
"""What the transformer recipes add to `insert`, and how it grows with layers.

    .venv/bin/python benchmarks/recipe_cost.py [--layers 3,6,12,24] [--samples 32]

BERT-style encoders built in code (benchmarks/scale.py's `encoder`, hidden 256, 4 heads, 32
tokens, random weights) are quantized twice each, in this process: with no recipe
(output_aware=False, int8_attention="on") and by default (output-aware scales and the attention
check). The table gives both totals and the seconds of the two recipe stages from the report,
and, per recipe, seconds per layer: linear growth keeps that column flat. Timings on a shared
machine are noisy; the ratios between rows of one run are what to read.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import qdqgraph  # noqa: E402
from scale import calibration, encoder  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="3,6,12,24")
    ap.add_argument("--samples", type=int, default=32)
    a = ap.parse_args()
    print("| layers | nodes | insert, no recipe (s) | insert, default (s) | output-aware scales (s) | attention check (s) "
          "| output-aware s/layer | attention check s/layer |")
    print("|---|---|---|---|---|---|---|---|")
    for layers in (int(x) for x in a.layers.split(",")):
        model = encoder(layers)
        data = calibration(model, a.samples)
        t = time.perf_counter()
        qdqgraph.quantize(model, data, output_aware=False, int8_attention="on")
        plain = time.perf_counter() - t
        t = time.perf_counter()
        r = qdqgraph.quantize(model, data)
        full = time.perf_counter() - t
        oa = r.report.stages.get("output-aware scales", 0.0)
        att = r.report.stages.get("attention check", 0.0)
        print(f"| {layers} | {len(model.graph.node)} | {plain:.1f} | {full:.1f} | {oa:.1f} | {att:.1f} "
              f"| {oa / layers:.2f} | {att / layers:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
