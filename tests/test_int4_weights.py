"""Weight-only INT4 (qdqgraph.recipes.int4_weights): blocked arithmetic, the written model (checker,
onnxruntime, packed INT4 storage), targets, and AWQ against RTN on activations with outlier channels.

onnxruntime's extended optimizations run DequantizeLinear(INT4) -> MatMul as MatMulNBits, which
also quantizes the activations; comparisons with the DequantizeLinear semantics use basic ones."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import motifs
from qdqgraph.graph import io
from qdqgraph.samples.data import CalibrationData
from qdqgraph.errors import QdqError
from qdqgraph.ops import DEQUANTIZE
from qdqgraph.recipes.int4_weights import (
    INT4_MAX,
    INT4_MIN,
    dequantize_blocked,
    int4_targets,
    quantize_blocked,
    quantize_int4_weights,
)
from qdqgraph.prepare import model_inputs

T = 16          # rows per sample
OUTLIERS = (3, 50, 100, 200)


def run(model, feed, exact=False):
    so = ort.SessionOptions()
    if exact:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feed)[0]


def outputs(model, x, exact=True):
    """The model's output on every sample of `x` [n, 1, T, K], rows stacked."""
    ys = [run(model, {"x": s}, exact) for s in x]
    return np.concatenate([y.reshape(-1, y.shape[-1]) for y in ys])


def rel_error(ref, got):
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    return float(((ref - got) ** 2).sum() / (ref ** 2).sum())


def cosine(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def uneven_weight(k, n, seed=0):
    """Gaussian [k, n] with runs of 32 rows, and columns, of magnitudes spread over 1e-2 .. 1: a
    scale applied to another block's rows or to the wrong columns shows."""
    rng = np.random.default_rng(seed)
    rows = np.repeat(10.0 ** rng.uniform(-2, 0, k // 32), 32)
    cols = 10.0 ** rng.uniform(-2, 0, n)
    return (rng.standard_normal((k, n)) * rows[:, None] * cols[None, :]).astype(np.float32)


def matmul_model(k=256, n=64, w=None, opset=21):
    g = motifs.G("int4_matmul")
    x = g.input("x", [1, T, k])
    g.node("MatMul", [x, g.const("w", uneven_weight(k, n) if w is None else w)], ["y"], name="fc")
    g.output("y")
    return g.model(opset)


def layernorm_model(k=256, n=64, gamma=None):
    """x -> LayerNorm(gamma) -> MatMul(w): gamma's large channels are outliers of the MatMul input."""
    g = motifs.G("int4_ln")
    x = g.input("x", [1, T, k])
    gamma = np.ones(k, np.float32) if gamma is None else gamma
    ln = g.node("LayerNormalization", [x, g.const("ln.s", gamma), g.const("ln.b", np.zeros(k, np.float32))],
                name="ln", axis=-1)
    g.node("MatMul", [ln, g.weight("w", (k, n))], ["y"], name="fc")
    g.output("y")
    return g.model(21)


def samples(k=256, n=8, seed=1):
    """`n` calibration samples of x [1, T, k]."""
    return np.random.default_rng(seed).standard_normal((n, 1, T, k)).astype(np.float32)


def quantized(model, **kw):
    """(written model, pass result)."""
    loaded = io.load(model)
    data = kw.pop("data", None)
    if data is not None:
        data = CalibrationData({"x": data}, model_inputs(loaded.graph))
    res = quantize_int4_weights(loaded, data=data, **kw)
    out = io.to_model(loaded)
    onnx.checker.check_model(out, full_check=True)
    return out, res


def dq_nodes(model):
    return [n for n in model.graph.node if n.op_type == DEQUANTIZE]


def init(model, name):
    return next(t for t in model.graph.initializer if t.name == name)


# ---------------------------------------------------------------------------- arithmetic

@pytest.mark.parametrize("axis", [0, 1])
def test_round_trip_is_within_half_a_scale(axis):
    w = uneven_weight(128, 96, seed=3)
    w = w if axis == 0 else w.T
    q, scale = quantize_blocked(w, axis, 32)
    assert q.dtype == np.int8 and scale.dtype == np.float32
    assert scale.shape == tuple(d // 32 if i == axis else d for i, d in enumerate(w.shape))
    assert q.min() >= INT4_MIN and q.max() <= INT4_MAX
    full = np.repeat(scale, 32, axis=axis)
    deq = dequantize_blocked(q, scale, axis, 32)
    assert np.all(np.abs(w - deq) <= full / 2 * (1 + 1e-6))
    # amax / 7: the largest value of each block is +-7 levels
    blocks = np.moveaxis(np.abs(q), axis, 0).reshape(4, 32, -1).max(axis=1)
    assert np.all(blocks == INT4_MAX)


def test_clipping_scales_down_and_saturates_and_zero_blocks_stay_finite():
    w = uneven_weight(64, 8, seed=4)
    w[:32, 0] = 0.0
    q1, s1 = quantize_blocked(w, 0, 32)
    q2, s2 = quantize_blocked(w, 0, 32, clip=0.5)
    assert np.all(np.isfinite(s1)) and np.all(s1 > 0)
    assert np.all(q1[:32, 0] == 0)
    np.testing.assert_allclose(s2[1:], s1[1:] * 0.5, rtol=1e-6)
    assert q2.min() == INT4_MIN or q2.max() == INT4_MAX       # half the range: the top values clamp
    ratio = np.full(s1.shape, 1.0, np.float32)
    ratio[1, 3] = 0.75
    _, s3 = quantize_blocked(w, 0, 32, clip=ratio)
    assert s3[1, 3] == pytest.approx(0.75 * s1[1, 3], rel=1e-6) and s3[0, 3] == s1[0, 3]


def test_float16_scale_is_the_one_q_was_computed_with():
    w = uneven_weight(64, 16, seed=5).astype(np.float16)
    q, scale = quantize_blocked(w, 0, 32, dtype=np.float16)
    assert scale.dtype == np.float16 and np.all(scale > 0)
    deq = dequantize_blocked(q, scale, 0, 32)
    full = np.repeat(scale.astype(np.float32), 32, axis=0)
    assert np.all(np.abs(w.astype(np.float32) - deq) <= full / 2 * (1 + 1e-3))


# ---------------------------------------------------------------------------- the written model

def test_written_model_runs_close_to_float_with_blocked_semantics():
    m = matmul_model()
    out, res = quantized(m, block_size=64)
    (dq,) = dq_nodes(out)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in dq.attribute}
    assert attrs == {"axis": 0, "block_size": 64}
    assert res["weights"]["w"]["blocks"] == 4 * 64 and res["weights"]["w"]["scaling"] == "none"
    x = samples(n=2)
    ref, got = outputs(m, x, exact=False), outputs(out, x, exact=False)
    assert cosine(ref, got) > 0.99
    # the stored tensors mean what dequantize_blocked says, in onnxruntime too
    q = onnx.numpy_helper.to_array(init(out, dq.input[0])).astype(np.int8)
    scale = onnx.numpy_helper.to_array(init(out, dq.input[1]))
    rows = x.reshape(-1, x.shape[-1])
    np.testing.assert_allclose(outputs(out, x), rows @ dequantize_blocked(q, scale, 0, 64), rtol=1e-4, atol=1e-5)
    # the threshold tells a misplaced scale: each row given another block's scale
    wrong = q.astype(np.float32) * np.tile(scale, (64, 1))
    assert cosine(ref, rows @ wrong) < 0.9


def test_int4_storage_is_packed_and_about_eight_times_smaller(tmp_path):
    m = matmul_model(k=512, n=512)
    out, res = quantized(m, block_size=128)
    (dq,) = dq_nodes(out)
    q, zero = init(out, dq.input[0]), init(out, dq.input[2])
    assert q.data_type == onnx.TensorProto.INT4 and zero.data_type == onnx.TensorProto.INT4
    assert len(q.raw_data) == 512 * 512 // 2
    assert not np.any(onnx.numpy_helper.to_array(zero).astype(np.int8))
    assert "w" not in {t.name for t in out.graph.initializer}
    onnx.save(m, tmp_path / "f.onnx")
    onnx.save(out, tmp_path / "q.onnx")
    ratio = (tmp_path / "f.onnx").stat().st_size / (tmp_path / "q.onnx").stat().st_size
    assert 6.5 < ratio < 8.0
    assert res["bytes_before"] == 512 * 512 * 4
    assert res["bytes_after"] == 512 * 512 // 2 + 4 * 512 * 4 + 4 * 512 // 2
    assert out.ir_version >= 10


def test_gemm_transB_blocks_along_axis_1():
    k, n = 128, 32
    g = motifs.G("int4_gemm")
    x = g.input("x", [T, k])
    g.node("Gemm", [x, g.const("w", uneven_weight(k, n).T.copy()), g.weight("b", (n,))], ["y"],
           name="gemm", transB=1)
    g.output("y")
    m = g.model(21)
    (target,) = int4_targets(io.load(m).graph)
    assert (target.node, target.weight, target.k, target.n, target.axis) == ("gemm", "w", k, n, 1)
    out, res = quantized(m, block_size=32)
    (dq,) = dq_nodes(out)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in dq.attribute}
    assert attrs["axis"] == 1 and list(init(out, dq.input[1]).dims) == [n, k // 32]
    feed = {"x": np.random.default_rng(2).standard_normal((T, k)).astype(np.float32)}
    assert cosine(run(m, feed), run(out, feed)) > 0.99


def test_float16_weights_get_a_float16_dequantize():
    g = motifs.G("int4_fp16")
    x = g.input("x", [T, 64], onnx.TensorProto.FLOAT16)
    g.node("MatMul", [x, g.const("w", uneven_weight(64, 32).astype(np.float16))], ["y"], name="fc")
    g.output("y", onnx.TensorProto.FLOAT16)
    m = g.model(21)
    out, _ = quantized(m, block_size=32)
    (dq,) = dq_nodes(out)
    assert init(out, dq.input[1]).data_type == onnx.TensorProto.FLOAT16
    feed = {"x": np.random.default_rng(2).standard_normal((T, 64)).astype(np.float16)}
    assert cosine(run(m, feed), run(out, feed)) > 0.99


# ---------------------------------------------------------------------------- targets

def test_k_not_divisible_names_the_node_and_block_sizes_that_fit():
    with pytest.raises(QdqError) as e:
        quantized(matmul_model(k=96), block_size=64)
    msg = str(e.value)
    assert "fc" in msg and "K=96" in msg and "64" in msg and "block_size=32 or 16" in msg


def test_requests_it_cannot_serve_raise():
    with pytest.raises(QdqError, match="needs calibration data"):
        quantized(matmul_model(), method="awq")
    with pytest.raises(QdqError, match="opset 21"):
        quantized(matmul_model(opset=17))
    with pytest.raises(QdqError, match="unknown INT4 method"):
        quantized(matmul_model(), method="gptq")


def two_matmuls(shared=False, dynamic=False):
    """x1 -> fc1(w1) -> y1 ; x2 -> fc2(w1 if shared else w2, or x1 when dynamic) -> y2."""
    g = motifs.G("int4_two")
    x1 = g.input("x1", [T, 64])
    x2 = g.input("x2", [T, 64] if not dynamic else [64, 32])
    g.node("MatMul", [x1, g.const("w1", uneven_weight(64, 32))], ["y1"], name="fc1")
    second = [x1, x2] if dynamic else [x2, "w1" if shared else g.const("w2", uneven_weight(64, 32, seed=1))]
    g.node("MatMul", second, ["y2"], name="fc2")
    g.output("y1")
    g.output("y2")
    return g.model(21)


def test_a_weight_that_is_not_a_constant_is_left_alone():
    out, res = quantized(two_matmuls(dynamic=True), block_size=32)
    assert list(res["weights"]) == ["w1"] and len(dq_nodes(out)) == 1
    fc2 = next(n for n in out.graph.node if n.name == "fc2")
    assert list(fc2.input) == ["x1", "x2"]


def test_exclude_keeps_the_float_weight():
    out, res = quantized(two_matmuls(), block_size=32, exclude=frozenset({"fc2"}))
    assert list(res["weights"]) == ["w1"] and len(dq_nodes(out)) == 1
    fc2 = next(n for n in out.graph.node if n.name == "fc2")
    assert fc2.input[1] == "w2" and init(out, "w2").data_type == onnx.TensorProto.FLOAT
    assert [t.node for t in int4_targets(io.load(two_matmuls()).graph, frozenset({"fc1"}))] == ["fc2"]


def test_a_shared_weight_is_quantized_once():
    m = two_matmuls(shared=True)
    out, res = quantized(m, block_size=32)
    (dq,) = dq_nodes(out)
    readers = [n for n in out.graph.node if dq.output[0] in n.input]
    assert sorted(n.name for n in readers) == ["fc1", "fc2"]
    assert res["weights"]["w1"]["nodes"] == ["fc1", "fc2"] and res.count("weights") == 1
    assert res["bytes_before"] == 64 * 32 * 4
    # AWQ cannot give the two inputs one scale: the shared weight is not scaled
    loaded = io.load(m)
    rng = np.random.default_rng(0)
    data = CalibrationData({k: rng.standard_normal((4, T, 64)).astype(np.float32) for k in ("x1", "x2")},
                           model_inputs(loaded.graph))
    res = quantize_int4_weights(loaded, block_size=32, method="awq", data=data)
    assert res["weights"]["w1"]["scaling"].startswith("skipped: a weight is shared")
    assert len([n for n in loaded.graph.nodes if n.op == DEQUANTIZE]) == 1


def test_a_weight_also_read_by_an_excluded_node_stays_counted():
    out, res = quantized(two_matmuls(shared=True), block_size=32, exclude=frozenset({"fc2"}))
    w = res["weights"]["w1"]
    assert w["float_kept"] and w["bytes_after"] > w["bytes_before"]
    assert init(out, "w1").data_type == onnx.TensorProto.FLOAT


# ---------------------------------------------------------------------------- AWQ

def outlier_gamma(k=256, factor=50.0):
    gamma = np.ones(k, np.float32)
    gamma[list(OUTLIERS)] = factor
    return gamma


def test_awq_beats_rtn_on_outlier_channels_and_reports_the_real_error():
    m = layernorm_model(gamma=outlier_gamma())
    x = samples()
    ref = outputs(m, x)
    rtn, _ = quantized(m, block_size=128)
    awq, res = quantized(m, block_size=128, method="awq", data=x)
    w = res["weights"]["w"]
    assert w["scaling"] == "layernorm" and w["alpha"] > 0 and res["rescaled"] == ["ln_out"]
    assert w["error"] < w["rtn_error"]
    e_rtn, e_awq = rel_error(ref, outputs(rtn, x)), rel_error(ref, outputs(awq, x))
    assert e_awq < 0.5 * e_rtn
    # 8 samples of 16 rows: the search saw every row, so its errors are the model's
    assert w["rtn_error"] == pytest.approx(e_rtn, rel=1e-3)
    assert w["error"] == pytest.approx(e_awq, rel=1e-3)
    # the LayerNorm took 1/s: its outlier channels shrank
    ln_scale = onnx.numpy_helper.to_array(init(awq, next(n for n in awq.graph.node if n.name == "ln").input[1]))
    assert ln_scale[list(OUTLIERS)].max() / np.median(ln_scale) < 0.5 * 50.0


def test_awq_is_never_worse_than_rtn_without_outliers():
    m = layernorm_model()
    x = samples(seed=4)
    ref = outputs(m, x)
    rtn, _ = quantized(m, block_size=64)
    awq, res = quantized(m, block_size=64, method="awq", data=x)
    w = res["weights"]["w"]
    assert w["error"] <= w["rtn_error"]
    assert rel_error(ref, outputs(awq, x)) <= rel_error(ref, outputs(rtn, x)) * (1 + 1e-6)


def test_awq_folds_into_the_producing_layer_and_skips_what_cannot_fold():
    """x -> fc1(w1, a few large output columns) -> Add(b) -> fc2(w2): fc2's input has outlier
    channels, and 1/s goes into w1's columns and b; fc1 reads the graph input (nothing to fold into)."""
    k = 128
    w1 = uneven_weight(k, k, seed=6)
    w1[:, [5, 70]] *= 50.0
    g = motifs.G("int4_chain")
    x = g.input("x", [1, T, k])
    h = g.node("Add", [g.node("MatMul", [x, g.const("w1", w1)], name="fc1"), g.weight("b", (k,))], name="bias")
    g.node("MatMul", [h, g.weight("w2", (k, 64))], ["y"], name="fc2")
    g.output("y")
    m = g.model(21)
    data = samples(k=k)
    ref = outputs(m, data)
    rtn, _ = quantized(m, block_size=64)
    awq, res = quantized(m, block_size=64, method="awq", data=data)
    assert res["weights"]["w2"]["scaling"] == "producer" and res["weights"]["w2"]["alpha"] > 0
    assert res["weights"]["w1"]["scaling"].startswith("skipped: no LayerNorm or linear producer")
    assert res["weights"]["w1"]["alpha"] == 0.0
    assert res["rescaled"] == ["bias_out", "fc1_out"]      # the fold divides fc1's output and the bias Add's
    assert len(dq_nodes(awq)) == 2 and not any(n.op_type == "Mul" for n in awq.graph.node)
    assert rel_error(ref, outputs(awq, data)) < rel_error(ref, outputs(rtn, data))


def test_a_fold_that_reorders_the_columns_is_undone():
    """fc1's output reaches fc2 through Reshape -> Transpose -> Reshape, which permutes its columns:
    dividing fc1's columns by fc2's s would divide the wrong channels, so the fold is checked,
    undone, and fc2's weights are not scaled."""
    k = 128
    w1 = uneven_weight(k, k, seed=7)
    w1[:, [5, 70]] *= 50.0
    g = motifs.G("int4_reorder")
    x = g.input("x", [1, T, k])
    h = g.node("MatMul", [x, g.const("w1", w1)], name="fc1")
    h = g.node("Reshape", [h, g.const("split", np.array([1, T, 2, k // 2], np.int64))], name="split")
    h = g.node("Transpose", [h], name="swap", perm=[0, 1, 3, 2])
    h = g.node("Reshape", [h, g.const("merge", np.array([1, T, k], np.int64))], name="merge")
    g.node("MatMul", [h, g.weight("w2", (k, 64))], ["y"], name="fc2")
    g.output("y")
    m = g.model(21)
    data = samples(k=k)
    awq, res = quantized(m, block_size=64, method="awq", data=data)
    assert res["weights"]["w2"]["scaling"] == "skipped: the fold into the producer does not keep the column order"
    assert res["weights"]["w2"]["alpha"] == 0.0 and res["rescaled"] == []
    assert cosine(outputs(m, data), outputs(awq, data)) > 0.99


def test_a_clip_that_raises_the_output_error_is_not_kept(monkeypatch):
    """The per-block clip search ignores the error's cross terms between blocks; its choice is kept
    only if the whole output error falls. A search that clips everything to half is refused."""
    from qdqgraph.recipes import int4_weights

    def halve(x, w, block_size, dtype=np.float32):
        return np.full((w.shape[0] // block_size, w.shape[1]), 0.5, np.float32)

    monkeypatch.setattr(int4_weights, "search_clip", halve)
    m = layernorm_model()
    _, res = quantized(m, block_size=64, method="awq", data=samples(seed=4))
    w = res["weights"]["w"]
    assert w["clip"]["clipped_blocks"] == 0 and w["error"] <= w["rtn_error"]


def test_the_written_int4_model_records_what_its_awq_folds_divide():
    """The LayerNorm that took AWQ's 1/s writes other values than the float model's under the same
    name: the written model lists it (io.RESCALED_KEY), as for INT8's smoothing."""
    import json
    import qdqgraph
    from qdqgraph.graph import io
    m = layernorm_model(gamma=outlier_gamma())
    q = qdqgraph.quantize(m, {"x": samples()}, precision="int4", int4_method="awq")
    assert json.loads({p.key: p.value for p in q.model.metadata_props}[io.RESCALED_KEY]) == ["ln_out"]
    rtn = qdqgraph.quantize(m, {"x": samples()}, precision="int4", int4_method="rtn")
    assert io.RESCALED_KEY not in {p.key for p in rtn.model.metadata_props}
