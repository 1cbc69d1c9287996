"""qdqgraph's own onnxruntime sessions on every onnxruntime the package declares: onnxruntime 1.31
(onnxruntime-gpu's newest) refuses FP8 Q/DQ graphs at its extended optimization level, and a
session it refuses that way is made again at the basic level. `.ci/ort_versions.sh` runs this file
and the FP8/INT4 tests on 1.31.1; the main venv runs them on 1.32."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import motifs
import qdqgraph
from qdqgraph.execution import runtime
from qdqgraph.errors import QdqError

LEVEL = ort.GraphOptimizationLevel
# onnxruntime 1.31.1's message for an FP8 attention projection (issue 30), as it prints it
REFUSED = ("[ONNXRuntimeError] : 10 : INVALID_GRAPH : This is an invalid model. Type Error: Type "
           "'tensor(float8e4m3fn)' of input parameter (x_quantized) of operator (MatMulIntegerToFloat) in node "
           "(k_proj) is invalid.")


def _fp8_model():
    m = motifs.attention_block(seq=8, hidden=32, heads=2)
    return qdqgraph.quantize(m, motifs.sample_data(m), precision="fp8", high_precision="fp32").model, m


def _refusing(monkeypatch, message=REFUSED):
    """onnxruntime.InferenceSession as 1.31 behaves: `message` above the basic level. Returns the
    optimization levels each attempt asked for."""
    real, levels = ort.InferenceSession, []

    def fake(source, opts=None, **kw):
        levels.append(opts.graph_optimization_level)
        if opts.graph_optimization_level not in (LEVEL.ORT_ENABLE_BASIC, LEVEL.ORT_DISABLE_ALL):
            raise RuntimeError(message)
        return real(source, opts, **kw)

    monkeypatch.setattr(ort, "InferenceSession", fake)
    return levels


def test_a_session_refused_for_fp8_above_basic_is_made_at_basic(monkeypatch):
    model, float_model = _fp8_model()
    levels = _refusing(monkeypatch)
    sess = runtime.session(model, purpose="sensitivity")
    assert levels == [LEVEL.ORT_ENABLE_ALL, LEVEL.ORT_ENABLE_BASIC]
    feed = {k: v[0] for k, v in motifs.sample_data(float_model).items()}
    got = sess.run(None, feed)[0]
    monkeypatch.undo()
    want = ort.InferenceSession(float_model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    assert got.shape == want.shape and np.isfinite(got).all()


def test_another_failure_is_not_retried(monkeypatch):
    model, _ = _fp8_model()
    levels = _refusing(monkeypatch, "[ONNXRuntimeError] : 1 : FAIL : Load model failed")
    with pytest.raises(QdqError, match="onnxruntime cannot run the model for sensitivity .*Load model failed"):
        runtime.session(model, purpose="sensitivity")
    assert levels == [LEVEL.ORT_ENABLE_ALL]


def test_fp8_transformer_quantizes_with_sensitivity_on_this_onnxruntime():
    """The run that failed on 1.31.1 (issue 30): FP8 with the sensitivity session, whose extended
    level fused the FP8 projections into MatMulIntegerToFloat."""
    m = motifs.attention_block(seq=8, hidden=32, heads=2)
    r = qdqgraph.quantize(m, motifs.sample_data(m, n=8), precision="fp8", high_precision="fp32",
                          max_float_layers=1)
    assert r.report.fallback is not None and r.report.fallback["samples"] > 0
    print(f"onnxruntime {ort.__version__}: all-FP8 output SQNR {r.report.fallback['all_int8_db']:.1f} dB")
