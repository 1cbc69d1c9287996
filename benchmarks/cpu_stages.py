#!/usr/bin/env python3
"""CPU seconds of each stage of `qdqgraph.quantize`, for a machine shared with other work, where the
stage profile's wall seconds swing too much to compare two trees.

    PYTHONPATH=TREE .venv/bin/python benchmarks/cpu_stages.py MODEL.onnx CALIB.npz [OUT.onnx]

The stage clock (qdqgraph.execution.profile's time.perf_counter) is replaced by time.process_time
(every thread of the process: onnxruntime's count in calibrate and island ranges). Prints one JSON
line: the stages, `no_data` (the whole quantize less calibrate and island ranges) and `total`; with
OUT, the written model is saved there (for `qdqgraph report OUT`). Run it from outside the checkout
(`cd /tmp`) with each tree on PYTHONPATH in turn, alternately.
"""
from __future__ import annotations

import json
import sys
import time


class _CpuClock:
    """time, with perf_counter reading the process's CPU time."""

    perf_counter = staticmethod(time.process_time)

    def __getattr__(self, name):
        return getattr(time, name)


def main() -> int:
    import qdqgraph
    import qdqgraph.execution.profile as profile
    from qdqgraph.graph import io
    profile.time = _CpuClock()                 # type: ignore[assignment]
    model, calib = sys.argv[1], sys.argv[2]
    start = time.process_time()
    r = qdqgraph.quantize(model, calib=calib)
    total = time.process_time() - start
    stages = {k: round(v, 2) for k, v in r.report.stages.items()}
    stages["no_data"] = round(total - stages.get("calibrate", 0.0) - stages.get("island ranges", 0.0), 2)
    stages["total"] = round(total, 2)
    print(json.dumps(stages))
    if len(sys.argv) > 3:
        io.save(r.model, sys.argv[3])
    return 0


if __name__ == "__main__":
    sys.exit(main())
