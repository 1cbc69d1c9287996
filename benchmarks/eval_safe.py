#!/usr/bin/env python3
"""Run the zoo's eval_models.py with onnxruntime's faulty rewrites turned off, as qdqgraph tells
users to run its outputs (README, Deployment; qdqgraph.execution.runtime.DISABLED_OPTIMIZERS).

    ZOO/venv/bin/python benchmarks/eval_safe.py EVAL_MODELS.py [its arguments...]

The names come from $QDQGRAPH_ORT_DISABLED (comma-separated; benchmarks/zoo_accuracy.py --safe-ort
sets it from qdqgraph.execution.runtime), and with $QDQGRAPH_ORT_BASIC=1 sessions run at the basic
optimization level. Every tool's model is scored the same way: onnxruntime's ReluQuantRewrite drops
a Relu before an FP8 QuantizeLinear and so breaks any FP8 Q/DQ model with Relu -> Q, whoever made
it; and onnxruntime 1.31's extended-level rewrites leave FP8 tensors feeding a Transpose or
Unsqueeze, and the session refuses the graph (1.32 does not).
"""
import os
import runpy
import sys

import onnxruntime as ort

DISABLED = [n for n in os.environ.get("QDQGRAPH_ORT_DISABLED", "").split(",") if n]
_Session = ort.InferenceSession


BASIC = os.environ.get("QDQGRAPH_ORT_BASIC") == "1"


class SafeSession(_Session):
    def __init__(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, **kwargs):
        kwargs.setdefault("disabled_optimizers", DISABLED)
        if BASIC:
            sess_options = sess_options or ort.SessionOptions()
            sess_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        super().__init__(path_or_bytes, sess_options, providers, provider_options, **kwargs)


ort.InferenceSession = SafeSession
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
