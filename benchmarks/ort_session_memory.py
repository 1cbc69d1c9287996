#!/usr/bin/env python3
"""What one onnxruntime session adds to resident memory over a model's weights, with and without
its weight prepacking (and memory arena): where insert's peak on a large model comes from.

    .venv/bin/python benchmarks/ort_session_memory.py MODEL.onnx CALIB.npz [MODE [OUTPUTS.npz]]

MODE: default, noprepack, noprepack_noarena, shared or shared_noprepack; OUTPUTS.npz: the first
run's outputs are saved there, to compare modes.

The weights reach onnxruntime as OrtValues over the graph's own arrays, as in qdqgraph's sessions
(add_external_initializers: onnxruntime copies them, or prepacks them into its own buffers). `shared`:
with add_initializer instead (onnxruntime's shared initializers, used in place), the model written to
a temporary folder beside an empty file of the stubs' location, which onnxruntime checks exists.
Prints RSS before and after creating the session, the peak, the session's creation seconds and the
seconds per run (batch 1, first sample).
"""
from __future__ import annotations

import os
import resource
import sys
import tempfile
import time

import numpy as np


def main() -> int:
    import onnxruntime as ort

    from qdqgraph.graph import io
    from qdqgraph.execution.profile import rss_mb
    model_path, calib, mode = sys.argv[1], sys.argv[2], (sys.argv[3] if len(sys.argv) > 3 else "default")
    loaded = io.load(model_path)
    model, weights = io.to_model_and_weights(loaded)
    before, load_peak = rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if "noprepack" in mode:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    if "noarena" in mode:
        opts.enable_cpu_mem_arena = False
    values = [ort.OrtValue.ortvalue_from_numpy(a) for a in weights.values()]
    folder = tempfile.TemporaryDirectory()
    if "shared" in mode:
        for name, value in zip(weights, values):
            opts.add_initializer(name, value)
        source = os.path.join(folder.name, "model.onnx")
        with open(source, "wb") as f:
            f.write(io.session_bytes(model))
        open(os.path.join(folder.name, io.IN_MEMORY_LOCATION), "wb").close()
    else:
        opts.add_external_initializers(list(weights), values)
        source = io.session_bytes(model)
    t0 = time.perf_counter()
    sess = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
    t1 = time.perf_counter()
    feed = {k: v[0] for k, v in np.load(calib).items()}
    if len(sys.argv) > 4:                # save the first run's outputs, to compare the modes
        np.savez(sys.argv[4], *sess.run(None, feed))
    sess.run(None, feed)
    t2 = time.perf_counter()
    for _ in range(3):
        sess.run(None, feed)
    t3 = time.perf_counter()
    print(f"{mode}: weights {sum(a.nbytes for a in weights.values()) / 2**20:.0f} MB; RSS before the session "
          f"{before:.0f} MB, after {rss_mb():.0f} MB; peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB "
          f"(loading: {load_peak:.0f}); session {t1 - t0:.2f} s; run {(t3 - t2) / 3:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
