"""insert --smooth-quant: the smoothed float graph computes what the original did, and on an input
with outlier channels the INT8 model gets closer to float than without smoothing."""
import numpy as np
import onnxruntime as ort
import pytest

import motifs
from qdqgraph.graph import io
from qdqgraph.errors import QdqError
from qdqgraph.passes.smooth import channel_ranges, smooth, targets
from qdqgraph import QuantizeConfig, quantize
from qdqgraph.prepare import prepare, read_data

K, N, T = 32, 16, 8
OUTLIERS = (3, 17)


def matmul_model():
    """x[1, T, K] -> MatMul(W1) -> Relu -> y1 ; x -> Gemm-free MatMul(W2) -> y2 (both read x)."""
    g = motifs.G("smooth")
    x = g.input("x", [1, T, K])
    g.node("Relu", [g.node("MatMul", [x, g.weight("w1", (K, N))], name="mm1")], ["y1"], name="act")
    g.node("MatMul", [x, g.weight("w2", (K, N))], ["y2"], name="mm2")
    g.output("y1")
    g.output("y2")
    return g.model(17)


def data(n=16, seed=0):
    x = np.random.default_rng(seed).standard_normal((n, 1, T, K)).astype(np.float32)
    x[..., list(OUTLIERS)] *= 60.0          # a few channels far larger than the rest
    return {"x": x}


def run(model, feed):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)


def sqnr(ref, got):
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    return 10 * np.log10((ref ** 2).sum() / max(((ref - got) ** 2).sum(), 1e-30))


def test_smoothing_keeps_the_float_function_and_flattens_the_channels():
    loaded, plan = prepare(matmul_model())
    found = targets(loaded.graph, plan)
    assert sorted(n.name for n in found["x"]) == ["mm1", "mm2"]
    ranges = channel_ranges(loaded, ["x"], read_data(loaded, data(), QuantizeConfig()))
    before = io.to_model(io.Loaded(graph=loaded.graph.copy(), ir_version=loaded.ir_version))
    res = smooth(loaded.graph, found, ranges, 0.5)
    assert res["smoothed"] == {"x": ["mm1", "mm2"]} and res["max_ratio"]["x"] > 20
    after = io.to_model(loaded)
    feed = {"x": data(1, seed=5)["x"][0]}
    for a, b in zip(run(before, feed), run(after, feed)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
    # what the Q now sees: the smoothed input's channel ranges are far more even
    mul = next(n for n in loaded.graph.nodes if n.op == "Mul")
    scaled = ranges["x"] * mul.inputs[1].values
    assert scaled.max() / np.median(scaled) < 0.2 * res["max_ratio"]["x"]


def test_smoothing_brings_int8_closer_to_float_on_outlier_channels():
    model, d = matmul_model(), data()
    feed = {"x": data(1, seed=7)["x"][0]}
    ref = run(model, feed)
    plain = quantize(model, d, method="max", high_precision="fp32")
    smoothed = quantize(model, d, method="max", high_precision="fp32", smooth_quant=0.5)
    assert smoothed.report.smoothed == {"x": ["mm1", "mm2"]}
    got_plain, got_smooth = run(plain.model, feed), run(smoothed.model, feed)
    for r, p, s in zip(ref, got_plain, got_smooth):
        assert sqnr(r, s) > sqnr(r, p) + 6, (sqnr(r, p), sqnr(r, s))


@pytest.mark.parametrize("calib,alpha,words", [("random", 0.5, "on calibration data, and calib=.random. is not data"),
                                               (None, 1.5, "must be at most 1")])
def test_smooth_quant_refuses_bad_input(calib, alpha, words):
    with pytest.raises(QdqError, match=words.replace("[", r"\[").replace("]", r"\]")):
        quantize(matmul_model(), calib if calib else data(), smooth_quant=alpha)
