#!/usr/bin/env python3
"""Run the zoo's eval_models.py with onnxruntime's faulty rewrites turned off, as qdqgraph tells
users to run its outputs (README, Deployment; qdqgraph.runtime.DISABLED_OPTIMIZERS).

    ZOO/venv/bin/python benchmarks/eval_safe.py EVAL_MODELS.py [its arguments...]

The names come from $QDQGRAPH_ORT_DISABLED (comma-separated; benchmarks/zoo_accuracy.py --safe-ort
sets it from qdqgraph.runtime). Every tool's model is scored the same way: onnxruntime's
ReluQuantRewrite drops a Relu before an FP8 QuantizeLinear and so breaks any FP8 Q/DQ model with
Relu -> Q, whoever made it.
"""
import os
import runpy
import sys

import onnxruntime as ort

DISABLED = [n for n in os.environ.get("QDQGRAPH_ORT_DISABLED", "").split(",") if n]
_Session = ort.InferenceSession


class SafeSession(_Session):
    def __init__(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, **kwargs):
        kwargs.setdefault("disabled_optimizers", DISABLED)
        super().__init__(path_or_bytes, sess_options, providers, provider_options, **kwargs)


ort.InferenceSession = SafeSession
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
