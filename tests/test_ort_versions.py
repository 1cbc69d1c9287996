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
from qdqgraph.execution import dequantized, runtime
from qdqgraph.graph import io, proto
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


HIDDEN = 256     # GEMMs large enough that a prepacked weight adds in another order than a computed one


def _written(cnn=False, **kw):
    """A written model (INT8 weights of 64 KB, FP16 islands; or a residual CNN's of 36 KB) and its
    float model."""
    m = motifs.residual_add(c=64) if cnn else motifs.attention_block(seq=8, hidden=HIDDEN, heads=2, bias=True)
    return qdqgraph.quantize(m, motifs.sample_data(m), **kw).model, m


def _as_written(model, level, widen=False):
    """The outputs of `model` in a session qdqgraph configures but does not fold (what it computed
    before its sessions dequantized weights once)."""
    opts = runtime._options()
    opts.graph_optimization_level = level
    runtime._exact_int8(opts)
    if widen:
        model = proto.copy_model(model)
        io.widen_fp16(model, {})
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"],
                                disabled_optimizers=runtime.DISABLED_OPTIMIZERS)


@pytest.mark.parametrize("level,widen,cnn", [(LEVEL.ORT_ENABLE_ALL, False, False), (LEVEL.ORT_ENABLE_BASIC, False, False),
                                             (LEVEL.ORT_DISABLE_ALL, True, False), (LEVEL.ORT_ENABLE_ALL, False, True),
                                             (LEVEL.ORT_DISABLE_ALL, True, True)])
def test_weights_dequantized_once_compute_what_the_model_as_written_does(level, widen, cnn, monkeypatch):
    """Bit for bit, on each onnxruntime: the attention block's weights folded at every level; the
    CNN's only where onnxruntime optimizes nothing (over a constant weight it runs another
    convolution, whose sums differ in the last bits)."""
    monkeypatch.setattr(runtime, "LARGE_GRAPH_NODES", 0 if widen else 10 ** 9)    # FP16 computed in float32 or not
    model, float_model = _written(cnn)
    light, weights = io.split_weights(model)
    folded, _, count = dequantized.fold(light, weights, float32=level != LEVEL.ORT_ENABLE_ALL or widen,
                                        optimized=level != LEVEL.ORT_DISABLE_ALL)
    weight_dqs = sum(n.op_type == "DequantizeLinear" and n.input[0] in {t.name for t in model.graph.initializer}
                     for n in model.graph.node)
    assert count == (0 if cnn and level != LEVEL.ORT_DISABLE_ALL else weight_dqs) and weight_dqs > 0
    assert sum(n.op_type == "DequantizeLinear" for n in folded.graph.node) == \
        sum(n.op_type == "DequantizeLinear" for n in model.graph.node) - count
    opts = runtime._options()
    opts.graph_optimization_level = level
    sess = runtime.session(model, purpose="comparison", opts=opts, widen=widen)
    plain = _as_written(model, level, widen)
    data = motifs.sample_data(float_model, n=4)
    for i in range(4):
        feed = {k: v[i] for k, v in data.items()}
        for got, want in zip(sess.run(None, feed), plain.run(None, feed)):
            assert np.array_equal(got, want)


def test_float32_weights_are_left_where_onnxruntime_may_fuse_them():
    model, _ = _written(high_precision="fp32")
    light, weights = io.split_weights(model)
    assert dequantized.fold(light, weights, float32=False)[2] == 0
    assert dequantized.fold(light, weights, float32=True)[2] > 0


def test_small_weights_and_the_byte_budget_bound_the_folding(monkeypatch):
    model, _ = _written()
    light, weights = io.split_weights(model)
    every = dequantized.fold(light, weights, float32=True)[2]
    assert dequantized.fold(light, weights, float32=True, max_bytes=HIDDEN * HIDDEN * 2)[2] == 1
    held = sum(a.nbytes for a in weights.values())        # a session's weights already past the bound
    monkeypatch.setattr(dequantized, "FOLD_SESSION_MAX_BYTES", held + HIDDEN * HIDDEN * 2)
    assert dequantized.fold(light, weights, float32=True)[2] == 1
    monkeypatch.setattr(dequantized, "FOLD_SESSION_MAX_BYTES", held)
    assert dequantized.fold(light, weights, float32=True)[2] == 0
    monkeypatch.setattr(dequantized, "FOLD_SESSION_MAX_BYTES", 1 << 30)
    monkeypatch.setattr(dequantized, "FOLD_MIN_BYTES", HIDDEN * HIDDEN + 1)
    assert every > 0 and dequantized.fold(light, weights, float32=True)[2] == 0


def test_nothing_is_folded_where_a_prepacking_kernel_reads_another_constant():
    """A float layer's own constant weight would be computed unpacked once prepacking is off (its
    sums move): with o_proj float, no weight of the block is folded, and its outputs stay those
    of the model as written."""
    model, float_model = _written(exclude_nodes=["^o_proj$"])
    light, weights = io.split_weights(model)
    assert dequantized.fold(light, weights, float32=False)[2] == 0
    plain = _as_written(model, LEVEL.ORT_ENABLE_ALL)
    sess = runtime.session(model, purpose="comparison")
    feed = {k: v[0] for k, v in motifs.sample_data(float_model, n=1).items()}
    assert all(np.array_equal(a, b) for a, b in zip(sess.run(None, feed), plain.run(None, feed)))


def test_a_weight_also_listed_as_a_graph_input_is_kept():
    """An older model lists its initializers among the graph inputs too (an input with a default):
    the folded weight's INT8 initializer stays, so the session still runs on the data alone."""
    model, float_model = _written()
    model = proto.copy_model(model)
    weights = [t for t in model.graph.initializer if t.data_type == 3]          # the INT8 weights
    assert weights
    model.graph.input.extend(proto.value_info(t.name, np.int8, list(t.dims)) for t in weights)
    light, split = io.split_weights(model)
    assert dequantized.fold(light, split, float32=False)[2] > 0
    feed = {k: v[0] for k, v in motifs.sample_data(float_model, n=1).items()}
    got = runtime.session(model, purpose="comparison").run(None, feed)
    want = _as_written(model, LEVEL.ORT_ENABLE_ALL).run(None, feed)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
