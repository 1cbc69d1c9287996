"""Memory of a run on a large model: no two onnxruntime sessions over a model's weights alive at once
where one suffices, and no optimized model written out where nothing can be blocked."""
import weakref

import onnxruntime as ort

import motifs
import qdqgraph
from qdqgraph.execution import evaluate, runtime
from qdqgraph.graph import io
from qdqgraph.recipes import sensitivity


def _live_sessions(monkeypatch, module, name, made=None):
    """Wrap module.name (a session factory); returns the list `made` of (weakref, sessions of that list
    alive when it was made)."""
    made = [] if made is None else made
    real = getattr(module, name)

    def spy(*args, **kwargs):
        live = sum(r() is not None for r, _ in made)
        out = real(*args, **kwargs)
        sess = out[0] if isinstance(out, tuple) else out
        made.append((weakref.ref(sess), live))
        return out
    monkeypatch.setattr(module, name, spy)
    return made


def test_compare_frees_the_float_session_before_the_quantized_one(monkeypatch):
    m = motifs.attention_block()
    data = motifs.sample_data(m)
    q = qdqgraph.quantize(m, data).model
    made = _live_sessions(monkeypatch, evaluate, "graph_session")
    result = evaluate.compare(m, q, calib=data, tensors=False)
    assert len(made) == 2 and made[1][1] == 0          # the float session was gone when the second was made
    assert result.samples == 8 and result.outputs and result.outputs[0].sqnr_db > 10


def test_compare_with_tensor_pairs_still_runs_both(monkeypatch):
    m = motifs.attention_block()
    data = motifs.sample_data(m)
    q = qdqgraph.quantize(m, data).model
    made = _live_sessions(monkeypatch, evaluate, "graph_session")
    result = evaluate.compare(m, q, calib=data, tensors=True)
    assert len(made) == 2 and result.tensors


def test_sensitivity_reference_runs_before_the_switchable_session(monkeypatch):
    m = motifs.attention_block()
    data = motifs.sample_data(m)
    monkeypatch.setattr(sensitivity, "_kept_outputs", lambda *a, **k: None)    # the float model is run again
    made: list = []
    _live_sessions(monkeypatch, sensitivity, "graph_session", made)
    _live_sessions(monkeypatch, sensitivity, "session", made)
    qdqgraph.quantize(m, data)                       # int8_attention auto: the attention check measures
    assert len(made) >= 2
    assert all(live == 0 for _, live in made)         # the reference session, then the switchable one


def test_the_attention_check_measures_against_the_calibration_outputs(monkeypatch):
    """The float outputs the calibration kept serve the attention check: no float session of its
    own (a second copy of the weights on a large model), and the same decision and figures."""
    m = motifs.attention_block()
    data = motifs.sample_data(m)
    made = _live_sessions(monkeypatch, sensitivity, "graph_session")
    kept = qdqgraph.quantize(m, data).report.attention
    assert made == [] and kept["samples"] == 8
    monkeypatch.setattr(sensitivity, "_kept_outputs", lambda *a, **k: None)
    again = qdqgraph.quantize(m, data).report.attention
    assert len(made) == 1                                # without them: the reference session
    assert kept["int8"] == again["int8"]
    for k in ("all_int8_db", "attention_float_db"):
        assert abs(kept[k] - again[k]) <= 0.02, (k, kept, again)


def test_no_optimized_model_saved_without_conv_or_pooling(monkeypatch):
    seen = []
    real = runtime.session

    def spy(model, providers=None, purpose="calibration", weights=None, opts=None, threads=0):
        seen.append(opts.optimized_model_filepath if opts is not None else "")
        return real(model, providers, purpose, weights=weights, opts=opts, threads=threads)
    monkeypatch.setattr(runtime, "session", spy)
    loaded = io.load(motifs.attention_block())
    names = [t.name for t in loaded.graph.tensors().values() if t.inputs and t.dtype is not None][:3]
    sess, blocked = runtime.unordered_session(loaded, names)
    assert seen == [""] and isinstance(sess, ort.InferenceSession) and blocked.channels == {}
    seen.clear()
    loaded = io.load(motifs.residual_add())
    runtime.unordered_session(loaded, [loaded.graph.nodes[0].outputs[0].name])
    assert seen and seen[0].endswith("optimized.onnx")


def test_shared_weights_session_runs_on_the_graph_arrays(monkeypatch):
    """Past SHARE_WEIGHTS_MIN_BYTES the weights are onnxruntime shared initializers (no copy, no
    prepacking): the outputs equal a session over the full export without prepacking."""
    import numpy as np

    monkeypatch.setattr(runtime, "SHARE_WEIGHTS_MIN_BYTES", 0)
    monkeypatch.setattr(io, "IN_MEMORY_MIN_BYTES", 64)
    m = motifs.attention_block()
    loaded = io.load(m)
    feed = {k: v[0] for k, v in motifs.sample_data(m).items()}
    sess = runtime.graph_session(loaded)
    weights, _ = sess._qdqgraph_weights
    assert weights and all(a is loaded.graph.tensors()[k].values for k, a in weights.items())
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.disable_prepacking", "1")
    ref = ort.InferenceSession(io.to_model(loaded).SerializeToString(), opts)
    for a, b in zip(sess.run(None, feed), ref.run(None, feed)):
        np.testing.assert_array_equal(a, b)


def test_a_large_switchable_session_computes_the_qdq_as_written(monkeypatch):
    """From LEAN_SESSION_MIN_BYTES of weights the sensitivity session runs at onnxruntime's basic
    level (no fused kernels holding their own copies of the weights); under it, the full level."""
    m = motifs.attention_block()
    data = motifs.sample_data(m)
    levels = []
    real = sensitivity._Switch.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        levels.append(self.sess.get_session_options().graph_optimization_level)
    monkeypatch.setattr(sensitivity._Switch, "__init__", spy)
    small = qdqgraph.quantize(m, data).report.attention
    monkeypatch.setattr(sensitivity, "LEAN_SESSION_MIN_BYTES", 0)
    lean = qdqgraph.quantize(m, data).report.attention
    assert levels == [ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC]
    assert small["int8"] == lean["int8"] and abs(small["all_int8_db"] - lean["all_int8_db"]) < 0.5
