"""FP8 (insert --precision fp8): E4M3 Q/DQ with scale amax/448, placement where TensorRT runs FP8
(GEMMs, convolutions, the fused attention; rules/fp8.toml), the checks, and strip."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import motifs
import qdqgraph
from qdqgraph.graph import io
from qdqgraph.errors import QdqError
from qdqgraph.precisions.formats import FP8, INT8
from qdqgraph.passes.check import qdq_violations
from qdqgraph.execution.runtime import DISABLED_OPTIMIZERS

F8 = onnx.TensorProto.FLOAT8E4M3FN


def _run(model, feed):
    """As users are told to run an FP8 model in onnxruntime (README, Deployment)."""
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"],
                                disabled_optimizers=DISABLED_OPTIMIZERS).run(None, feed)


def _cos(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _inits(model):
    return {t.name: t for t in model.graph.initializer}


def _quantized_inputs(model) -> dict[str, set[int]]:
    """node name -> the input indices that come from a DequantizeLinear."""
    dq_out = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return {n.name: {k for k, i in enumerate(n.input) if i in dq_out} for n in model.graph.node}


def test_fp8_format_rounds_to_nearest_even_and_saturates():
    s = np.float32(1.0)
    x = np.array([1.0625, 1.1875, 500.0, -1e6, 0.0], np.float32)   # halfway cases of E4M3 at 1.0: step 1/8
    q = FP8.quantize(x, s).astype(np.float32)
    assert q.tolist() == [1.0, 1.25, 448.0, -448.0, 0.0]
    assert FP8.scale_of(448.0) == pytest.approx(1.0) and INT8.scale_of(127.0) == pytest.approx(1.0)


def test_fp8_insert_writes_e4m3_with_amax_over_448_and_runs():
    m = motifs.residual_add(projection=True, c=32)       # FP8 convolutions need > 16 channels (F8-conv-shape)
    data = motifs.sample_data(m)
    r = qdqgraph.quantize(m, data, precision="fp8", high_precision="fp32")
    inits = _inits(r.model)
    qdq = [n for n in r.model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert qdq and io.opset_of(r.model) >= 19
    assert {inits[n.input[2]].data_type for n in qdq} == {F8}
    weights = [n for n in r.model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    assert weights and all(inits[n.input[0]].data_type == F8 for n in weights)
    # the input's scale is its calibrated amax / 448 (max calibration is FP8's default)
    x = data["x"]
    scale = onnx.numpy_helper.to_array(inits[next(n.input[1] for n in qdq if n.input[0] == "x")])
    assert r.config.method == "max"
    assert float(scale) == pytest.approx(float(np.abs(x).max()) / 448, rel=1e-6)
    onnx.checker.check_model(r.model, full_check=True)
    assert qdq_violations(io.load(r.model).graph) == []
    feed = {"x": x[0]}
    # E4M3 keeps 3 mantissa bits: about 31 dB per quantized tensor, so four layers land near 26 dB
    # (cosine 0.9976 here; a Relu dropped before a Q, the fault of onnxruntime's ReluQuantRewrite, gives 0.37)
    assert _cos(_run(r.model, feed)[0], _run(m, feed)[0]) > 0.995


def test_fp8_quantizes_only_gemm_and_conv_inputs():
    """F8-gemm-conv-only: in INT8 the residual Add takes Q/DQ on its skip input (P6); in FP8 no
    pointwise op does, and the report names the rule."""
    m = motifs.residual_add(c=32)
    data = motifs.sample_data(m)
    int8 = _quantized_inputs(qdqgraph.quantize(m, data, high_precision="fp32").model)
    fp8 = qdqgraph.quantize(m, data, precision="fp8", high_precision="fp32")
    q8 = _quantized_inputs(fp8.model)
    assert int8["add"] and not q8["add"]
    assert q8["conv1"] and q8["conv2"] and q8["head"]
    assert fp8.plan.decisions["add"].rule == "F8-gemm-conv-only"


@pytest.mark.parametrize("hidden,heads,fp8_attention", [(32, 2, True), (48, 2, False)])
def test_fp8_attention_needs_a_head_size_multiple_of_16(hidden, heads, fp8_attention):
    m = motifs.attention_block(hidden=hidden, heads=heads)
    r = qdqgraph.quantize(m, motifs.sample_data(m), precision="fp8", high_precision="fp32", int8_attention="on")
    q = _quantized_inputs(r.model)
    assert bool(q["qk"]) == fp8_attention and bool(q["pv"]) == fp8_attention
    if not fp8_attention:
        assert r.plan.decisions["qk"].rule == "F8-attention-head-size"
        assert "head size is not a multiple of 16" in r.plan.decisions["qk"].reason
    else:
        probs = next(n for n in r.model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "softmax_out")
        s = onnx.numpy_helper.to_array(_inits(r.model)[probs.input[1]])
        assert float(s) == pytest.approx(1 / 448)              # the probabilities on a fixed scale


def test_fp8_attention_covers_longer_sequences_than_int8():
    """P10-attention-long: INT8 attention stops at 512 tokens; rules/fp8.toml replaces it by id with 3072."""
    m = motifs.attention_block(seq=1024)
    data = motifs.sample_data(m, n=2)
    int8 = qdqgraph.quantize(m, data, high_precision="fp32", int8_attention="on")
    fp8 = qdqgraph.quantize(m, data, precision="fp8", high_precision="fp32", int8_attention="on")
    assert int8.plan.decisions["qk"].rule == "P10-attention-long"
    assert _quantized_inputs(fp8.model)["qk"] == {0, 1}


def test_strip_of_fp8_gives_back_the_float_graph():
    m = motifs.attention_block()
    data = motifs.sample_data(m)
    r = qdqgraph.quantize(m, data, precision="fp8")             # FP16 islands, as written by default
    loaded = io.load(r.model)
    qdqgraph.strip_qdq(loaded.graph)
    stripped = io.to_model(loaded)
    onnx.checker.check_model(stripped, full_check=True)
    assert not any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in stripped.graph.node)
    feed = {"x": data["x"][0]}
    ref = _run(m, feed)[0]
    got = _run(stripped, feed)[0]
    assert _cos(got, ref) > 0.995                               # FP16 islands and FP8-rounded weights remain


def test_checks_name_fp8_specific_faults():
    m = motifs.conv_relu(c=32)
    r = qdqgraph.quantize(m, motifs.sample_data(m), precision="fp8", high_precision="fp32")
    loaded = io.load(r.model)
    g = loaded.graph
    zp = next(t for t in g.tensors().values() if isinstance(t, qdqgraph.graph.io.gs.Constant)
              and t.values.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and t.values.ndim == 0)
    zp.values = np.array(1.0, ml_dtypes.float8_e4m3fn)
    found = qdq_violations(g)
    assert any("zero point is not 0" in f for f in found)
    zp.values = np.array(0, np.int8)                           # an INT8 zero point on an FP8 tensor
    assert any("not float8e4m3fn" in f or "dequantizes float8_e4m3fn, not int8" in f for f in qdq_violations(g))


def test_fp8_rejects_int8_only_recipes_in_one_line():
    with pytest.raises(QdqError, match="output_aware=True chooses INT8 ranges"):
        qdqgraph.QuantizeConfig(precision="fp8", output_aware=True)
    with pytest.raises(QdqError, match="unknown precision"):
        qdqgraph.QuantizeConfig(precision="fp4")


def test_fp8_raises_the_opset_and_says_so():
    m = motifs.conv_relu(opset=13, c=32)
    r = qdqgraph.quantize(m, motifs.sample_data(m), precision="fp8")
    assert io.opset_of(r.model) >= 19
    assert "opset raised from 13 to 19 (FP8 Q/DQ (float8e4m3fn) needs it)" in r.report.summary()


def test_lint_names_fp8_attention_with_a_head_size_it_cannot_fuse():
    from qdqgraph.trtsim.lint import lint
    m = motifs.attention_block(hidden=48, heads=2)                     # head size 24
    data = motifs.sample_data(m)
    forced = qdqgraph.quantize(m, data, precision="fp8", high_precision="fp32", int8_attention="on",
                               include_nodes=("qk", "pv"))               # F8-attention-head-size is advisory
    assert [d.code for d in lint(forced.model)].count("QDQ212") == 1
    ok = qdqgraph.quantize(motifs.attention_block(), motifs.sample_data(motifs.attention_block()),
                           precision="fp8", high_precision="fp32", int8_attention="on")
    assert "QDQ212" not in [d.code for d in lint(ok.model)]


def test_lint_names_a_scale_of_the_wrong_type_and_int4_faults():
    from qdqgraph.trtsim.lint import lint
    m = motifs.conv_relu()
    loaded = io.load(qdqgraph.quantize(m, motifs.sample_data(m), high_precision="fp32").model)
    assert not [d for d in lint(loaded.graph) if d.code in ("QDQ213", "QDQ214")]
    dq = next(n for n in loaded.graph.nodes if n.op == "DequantizeLinear")
    dq.inputs[1] = qdqgraph.graph.io.gs.Constant("int_scale", np.array(1, np.int32))
    assert "QDQ213" in [d.code for d in lint(loaded.graph)]


def test_fp8_on_a_model_whose_opset_cannot_be_raised_is_one_line(monkeypatch):
    """onnx's version converter has no adapter for some ops; the run stops before any work, naming
    the opset FP8 needs and why."""
    from onnx import version_converter

    def no_adapter(model, target):
        raise RuntimeError("No Adapter For Current Version: op X\nmore lines")
    monkeypatch.setattr(version_converter, "convert_version", no_adapter)
    m = motifs.conv_relu(opset=13)
    with pytest.raises(QdqError) as e:
        qdqgraph.quantize(m, motifs.sample_data(m), precision="fp8")
    assert str(e.value).startswith("the model's opset 13 could not be raised to 19, which FP8 Q/DQ (float8e4m3fn) "
                                   "needs (No Adapter For Current Version: op X)")
    assert "\n" not in str(e.value)


def test_fp8_leaves_small_channel_and_large_filter_convs_in_fp16():
    """F8-conv-shape: FP8 convolution only with more than 16 channels in and out and a filter of at
    most 32 elements (a 1-channel stem, a 7x7 filter stay FP16); INT8 quantizes them all."""
    g = motifs.G("fp8_convs")
    x = g.input("x", ["n", 1, 16, 16])
    a = g.node("Relu", [g.conv(x, 1, 32, "stem")], name="r0")                  # 1 input channel
    b = g.node("Relu", [g.conv(a, 32, 32, "body")], name="r1")                 # 3x3, 32 -> 32
    g.node("Conv", [b, g.weight("big.w", (32, 32, 7, 7))], ["y"], name="big", kernel_shape=[7, 7],
           pads=[3, 3, 3, 3])                                                  # 49-element filter
    g.output("y")
    m = g.model()
    data = motifs.sample_data(m)
    fp8 = qdqgraph.quantize(m, data, precision="fp8", high_precision="fp32")
    q = _quantized_inputs(fp8.model)
    assert not q["stem"] and q["body"] == {0, 1} and not q["big"]
    assert fp8.plan.decisions["stem"].rule == fp8.plan.decisions["big"].rule == "F8-conv-shape"
    int8 = _quantized_inputs(qdqgraph.quantize(m, data, high_precision="fp32").model)
    assert int8["big"] == {0, 1}
