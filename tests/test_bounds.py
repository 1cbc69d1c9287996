"""passes.bounds: bounds on max |x| that hold for every input, and the range run that skips what they bound."""
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import motifs
import qdqgraph
from qdqgraph.graph import io
from qdqgraph.graph.view import GraphView
from qdqgraph.passes import precision
from qdqgraph.passes.bounds import Bounds, below
from qdqgraph.passes.precision import RANGE_LIMIT, measure_ranges


def _measured(model: onnx.ModelProto, names: list[str], feeds: list[dict]) -> dict[str, float]:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.output[:]
    m.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    out = dict.fromkeys(names, 0.0)
    for feed in feeds:
        for n, v in zip(names, sess.run(names, feed)):
            if v.size:
                out[n] = max(out[n], float(np.nanmax(np.abs(v))))
    return out


@pytest.mark.parametrize("name", ["conv_relu", "residual_projection", "se_block", "silu_conv", "attention_block",
                                  "gemm", "convtranspose_grouped", "fpn_upsample", "residual_hardswish",
                                  "layernorm_mlp", "bmm", "concat_of_pools"])
def test_bounds_hold_on_the_quantized_motifs(name):
    """Every bounded float tensor of a written Q/DQ model stays within its bound on data far
    outside the calibration range (10x larger), and the bounds cover most tensors."""
    m = motifs.ALL[name]()
    q = qdqgraph.quantize(m, motifs.sample_data(m), high_precision="fp32").model
    view = GraphView(io.load(q).graph)
    b = Bounds(view)
    names = [n for n in b.bound if view.is_float(view.tensors[n]) and n not in {t.name for t in view.graph.inputs}]
    data = motifs.sample_data(m, n=4, seed=7)
    feeds = [{k: (v[i] * 10 if v.dtype == np.float32 else v[i]) for k, v in data.items()} for i in range(4)]
    got = _measured(q, names, feeds)
    assert names
    for n in names:
        assert got[n] <= b.bound[n], (n, got[n], b.bound[n])


def _qdq_chain(scale: float, then: list[onnx.NodeProto], inits: list) -> onnx.ModelProto:
    s = onnx.numpy_helper.from_array(np.array(scale, np.float32), "s")
    z = onnx.numpy_helper.from_array(np.array(0, np.int8), "z")
    nodes = [onnx.helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="Q"),
             onnx.helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xdq"], name="DQ"), *then]
    graph = onnx.helper.make_graph(nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])],
                                   [s, z, *inits])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 19)])


class _Feeds:
    def __init__(self, feeds):
        self.feeds = feeds

    def batches(self, n):
        yield from self.feeds


def test_no_session_when_every_tensor_is_bounded(monkeypatch):
    """A DQ (127 x 0.01) through Relu and a Clip: bounded far below the limit, so measure_ranges
    runs nothing at all."""
    m = _qdq_chain(0.01, [onnx.helper.make_node("Relu", ["xdq"], ["r"], name="relu"),
                          onnx.helper.make_node("Clip", ["r", "lo", "hi"], ["y"], name="clip")],
                   [onnx.numpy_helper.from_array(np.array(0, np.float32), "lo"),
                    onnx.numpy_helper.from_array(np.array(6, np.float32), "hi")])

    def refuse(*a, **k):
        raise AssertionError("no session should be made")
    monkeypatch.setattr(precision, "graph_session", refuse)
    assert measure_ranges(io.load(m), _Feeds([{"x": np.ones(4, np.float32)}])) == {}
    assert below(GraphView(io.load(m).graph), RANGE_LIMIT) >= {"xdq", "r", "y"}


def test_a_tensor_whose_bound_reaches_the_limit_is_measured_and_kept_fp32():
    """x 100 after a DQ that reaches 127: the bound (12700) is over the limit, so the Mul's output
    is run; data at the DQ's edge puts it over the limit and the Mul stays float32, data near 0
    does not, and the ranges measured before (`known`) are not run again."""
    m = _qdq_chain(1.0, [onnx.helper.make_node("Mul", ["xdq", "k"], ["y"], name="amplify")],
                   [onnx.numpy_helper.from_array(np.array(100, np.float32), "k")])
    view = GraphView(io.load(m).graph)
    assert Bounds(view).bound["y"] == pytest.approx(12800, rel=1e-4)          # 128 x 1.0 x 100
    hot = measure_ranges(io.load(m), _Feeds([{"x": np.array([0, 1, 2, 120], np.float32)}]))
    assert set(hot) == {"y"} and hot["y"] == pytest.approx(12000)
    cold = measure_ranges(io.load(m), _Feeds([{"x": np.array([0, 1, 2, 3], np.float32)}]))
    assert cold["y"] == pytest.approx(300)
    known = {"y": 9000.0}
    assert measure_ranges(io.load(m), _Feeds([{"x": np.zeros(4, np.float32)}]), known=known) is known
    assert known == {"y": 9000.0}
    loaded = io.load(m)
    precision.lower_float_islands(loaded.graph, "fp16", 19, hot)
    kept = {n.name for n in loaded.graph.nodes if n.op == "Mul" and n.outputs[0].dtype == np.float32}
    assert "amplify" in kept


def _counting(monkeypatch) -> list:
    """The outputs asked of each run of measure_ranges' session."""
    asked: list = []
    real = precision.graph_session

    def session(*a, **k):
        sess = real(*a, **k)

        class Counted:
            def run(self, names, feed):
                asked.append(list(names))
                return sess.run(names, feed)
        return Counted()
    monkeypatch.setattr(precision, "graph_session", session)
    return asked


def test_a_tensor_settled_far_below_the_limit_is_run_on_two_samples_only(monkeypatch):
    """Two samples within a factor 2 of each other, far below the limit: the tensor is not run
    on the other two (even the fourth, which would reach the limit: the margin is the bet)."""
    m = _qdq_chain(1.0, [onnx.helper.make_node("Mul", ["xdq", "k"], ["y"], name="amplify")],
                   [onnx.numpy_helper.from_array(np.array(100, np.float32), "k")])
    asked = _counting(monkeypatch)
    feeds = [{"x": np.array([0, 1, 2, v], np.float32)} for v in (3, 4, 5, 120)]
    got = measure_ranges(io.load(m), _Feeds(feeds))
    assert asked == [["y"], ["y"]] and got["y"] == pytest.approx(400)
    assert precision.settled([300.0, 400.0]) and not precision.settled([300.0, 1200.0])


def test_a_tensor_that_moved_between_the_first_samples_is_run_on_every_sample(monkeypatch):
    """A state zero on the first sample of a stream, then growing: every sample is run, and the
    fourth puts it over the limit (the op stays float32)."""
    m = _qdq_chain(1.0, [onnx.helper.make_node("Mul", ["xdq", "k"], ["y"], name="amplify")],
                   [onnx.numpy_helper.from_array(np.array(100, np.float32), "k")])
    asked = _counting(monkeypatch)
    feeds = [{"x": np.array([0, 0, 0, v], np.float32)} for v in (0, 3, 5, 120)]
    got = measure_ranges(io.load(m), _Feeds(feeds))
    assert len(asked) == 4 and got["y"] == pytest.approx(12000)
    assert not precision.settled([0.0, 300.0]) and not precision.settled([1100.0, 1100.0])


def test_softmax_mix_and_layernorm_bounds():
    """Softmax @ V is a convex mix of V's rows; LayerNormalization's output is at most sqrt(N - 1)
    times its scale plus its bias; an op not covered is unbounded."""
    g = motifs.G("mix")
    a = g.input("a", [1, 4, 4])
    v = g.input("v", [1, 4, 8])
    s = g.node("Softmax", [a], name="sm", axis=-1)
    vc = g.node("Clip", [v, g.const("lo", np.array(-3, np.float32)), g.const("hi", np.array(2, np.float32))],
                name="clip")
    g.node("MatMul", [s, vc], ["mix"], name="mm")
    ln = g.node("LayerNormalization", [v, g.const("gamma", np.full(8, 2, np.float32)),
                                       g.const("beta", np.full(8, 0.5, np.float32))], name="ln", axis=-1)
    g.node("Exp", [ln], ["e"], name="exp")
    g.node("Log", [vc], ["l"], name="log")
    for o in ("mix", "e", "l"):
        g.output(o)
    b = Bounds(GraphView(io.load(g.model()).graph))
    assert 3.0 <= b.bound["mix"] < 3.1
    assert b.bound[ln] == pytest.approx(2 * math.sqrt(7) + 0.5, rel=1e-5)
    assert "l" not in b.bound


def test_a_value_the_op_writes_itself_is_in_the_bound():
    """Pad before opset 11 writes its `value` attribute: the bound covers it, not only the input's."""
    g = motifs.G("pad")
    x = g.input("x", [1, 2, 4, 4])
    c = g.node("Clip", [x], name="clip", min=-1.0, max=1.0)
    g.node("Pad", [c], ["y"], name="pad", pads=[0, 0, 1, 1, 0, 0, 1, 1], value=1e5)
    g.output("y")
    b = Bounds(GraphView(io.load(g.model(opset=10)).graph))
    assert b.bound[c] == pytest.approx(1.0, rel=1e-5) and b.bound["y"] >= 1e5


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_a_constants_bound_is_its_max_abs_in_float64(dtype):
    """A constant's bound (taken in its own type, the float32 ones in the kernel's one pass) is
    max |x| computed in float64, NaN and infinity included, 0 for an empty one."""
    import onnx_graphsurgeon as gs
    rng = np.random.default_rng(0)
    cases = [rng.standard_normal((300, 7)) * 100, np.array([1.0, -np.inf]), np.array([np.nan, 2.0]), np.zeros(0)]
    for k, values in enumerate(cases):
        c = gs.Constant(f"c{k}", np.asarray(values, dtype=dtype))
        g = gs.Graph(nodes=[gs.Node("Relu", inputs=[c], outputs=[gs.Variable(f"y{k}", dtype=dtype)])], opset=17)
        want = float(np.max(np.abs(c.values.astype(np.float64)))) if c.values.size else 0.0
        got = Bounds(GraphView(g)).of(c)
        assert got == want or (np.isnan(got) and np.isnan(want)), (dtype, k, got, want)


@pytest.mark.parametrize("scale, zero_point", [
    (np.float32(0.0173), np.int8(0)), (np.float32(0.5), np.int8(-3)), (np.float32(0.25), np.uint8(128)),
    (np.float16(0.1), None), (np.float32(-0.5), np.int8(0)), (np.array([[0.02]], np.float32), np.array([[5]], np.int8)),
    (np.float32(np.inf), np.int8(0)), (np.float32(np.nan), np.int8(0)),
    (np.array([0.1, 0.3], np.float32), np.array([0, 0], np.int8)), (np.array([0.1, 0.3], np.float32), np.int8(2)),
])
def test_dequantize_bound_is_numpys_float64_figure(scale, zero_point):
    """A DQ's bound (one scale and zero point read as Python floats) is the float64 figure numpy's
    reductions give, to the bit."""
    import onnx_graphsurgeon as gs
    q = gs.Variable("q", np.int8 if zero_point is None else np.asarray(zero_point).dtype, (1, 4))
    y = gs.Variable("y", np.float32, (1, 4))
    ins = [q, gs.Constant("s", np.asarray(scale))]
    if zero_point is not None:
        ins.append(gs.Constant("z", np.asarray(zero_point)))
    node = gs.Node("DequantizeLinear", "dq", inputs=ins, outputs=[y])
    got = Bounds(GraphView(gs.Graph(nodes=[node], inputs=[q], outputs=[y], opset=19)))._dequantize(node)
    s = np.asarray(scale, np.float64)
    if not np.all(np.isfinite(s)):
        assert got == math.inf
        return
    info = np.iinfo(np.asarray(zero_point).dtype if zero_point is not None else np.uint8)
    z = np.asarray(zero_point, np.float64) if zero_point is not None else np.zeros(1)
    want = float(np.max(np.maximum(np.abs(info.max - z), np.abs(z - info.min)))) * float(np.max(np.abs(s)))
    assert got == want
