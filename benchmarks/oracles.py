#!/usr/bin/env python3
"""How well the TensorRT simulator predicts real engines: one row per oracle.

    .venv/bin/python benchmarks/oracles.py [--oracles DIR] [--details]

For each engine in ../shared/oracles (qdqgraph/trtsim/oracles.py lists them) it builds the Q/DQ
graph the engine was built from (qdqgraph/testing/models.py), simulates it, reads the engine's layer JSON
and diffs the two (qdqgraph/trtsim/diff.py): layers compared, matched (same fused ONNX nodes, same
int8/float precision of every input and output), their share, precision and grouping differences,
standalone Q/DQ reformats on each side, and the share when FP16 and FP32 are told apart too.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qdqgraph.testing.oracles import ORACLES, compare, folder_or_exit  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--oracles", type=Path, default=None, help="oracles folder (default ../shared/oracles)")
    ap.add_argument("--details", action="store_true", help="print each diff's differing layers")
    args = ap.parse_args(argv)
    folder = folder_or_exit(args.oracles)
    if folder is None:
        return 2
    header = ("oracle", "compared", "matched", "share", "precision", "grouping", "reformats sim/engine",
              "share fp16/fp32 exact")
    rows = []
    for name in ORACLES:
        r = compare(name, folder)
        s = r.diff.summary
        rows.append((name.split("/")[-1], str(r.diff.compared), str(s["matched"]), f"{100 * r.diff.share:.1f}%",
                     str(s["precision_differs"]), f"{s['grouping_engine_only']}+{s['grouping_sim_only']}",
                     f"{s['sim_reformats']}/{s['engine_reformats']}", f"{100 * r.exact.share:.1f}%"))
        if args.details:
            print(f"## {name}\n{r.diff.table()}\n")
    widths = [max(len(x[i]) for x in rows + [header]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
