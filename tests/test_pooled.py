"""Output-aware scales where a global max pool reads a convolution: the convolution's input read as
receptive-field patches (recipes/conv_math.patch_rows), the pooled-region test
(recipes/pooled.max_pooled), and the error measured at the float maxima, end to end on a
text-CNN-like model whose inputs carry rare large values in a few channels."""
import numpy as np
import onnx_graphsurgeon as gs
import pytest

import motifs
import qdqgraph
from qdqgraph.graph import io
from qdqgraph.graph.view import GraphView
from qdqgraph.passes.strip import strip_qdq
from qdqgraph.recipes import conv_math, output_aware, pooled
from test_recipes import run, sqnr

C, L, M = 32, 128, 48


def text_cnn(tail=("Relu",), pool="GlobalMaxPool", seed=0, head=True, **pool_attrs):
    """x [1, C, L] -> Conv1d (k=5) -> `tail` -> `pool` (`pool_attrs`) -> Flatten -> Gemm (the pool's
    output is the graph's without `head`)."""
    g = motifs.G("text_cnn", seed)
    x = g.input("x", [1, C, L])
    y = g.node("Conv", [x, g.weight("conv.w", (M, C, 5), 0.2), g.weight("conv.b", (M,), 0.1)], name="conv",
               kernel_shape=[5])
    for i, op in enumerate(tail):
        y = g.node(op, [y], name=f"tail{i}")
    if not head:
        g.node(pool, [y], ["y"], name="pool", **pool_attrs)
        g.output("y")
        return g.model(17)
    y = g.node(pool, [y], name="pool", **pool_attrs)
    y = g.node("Flatten", [y], name="flat")
    g.node("Gemm", [y, g.weight("head.w", (M, 4)), g.weight("head.b", (4,), 0.1)], ["y"], name="head")
    g.output("y")
    return g.model(17)


def spiky(n, seed):
    """Standard normal features, and in each sample one value of 15-30 in one of the first 4 channels."""
    r = np.random.default_rng(seed)
    x = r.standard_normal((n, 1, C, L)).astype(np.float32)
    for i in range(n):
        x[i, 0, r.integers(0, 4), r.integers(0, L)] = r.uniform(15, 30)
    return {"x": x}


def held_out_db(model, quantized, data):
    f = qdqgraph.session(model)
    ref = np.concatenate([f.run(None, {"x": x})[0] for x in data["x"]])
    got = np.concatenate([run(quantized, {"x": x})[0] for x in data["x"]])
    return sqnr(ref, got)


@pytest.mark.parametrize("kernel,attrs", [((5,), {}), ((3, 3), {"pads": [1, 2, 0, 1], "strides": [2, 1]}),
                                          ((3, 2), {"dilations": [2, 1], "auto_pad": "SAME_UPPER"})])
def test_patch_rows_times_the_weight_is_the_convolution(kernel, attrs):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 6) + (11, 9)[:len(kernel)]).astype(np.float32)
    w = rng.standard_normal((5, 6) + kernel).astype(np.float32)
    node = gs.Node("Conv", attrs={"kernel_shape": list(kernel), **attrs})
    full = conv_math.grouped_conv(node, x, w, None)                    # [2, 5, *out]
    rows = conv_math.patch_rows(node, x, kernel, 1 << 30)              # every position of both samples
    got = (rows @ w.reshape(5, -1).T).reshape(2, -1, 5)
    np.testing.assert_allclose(got, full.reshape(2, 5, -1).transpose(0, 2, 1), rtol=1e-5, atol=1e-5)
    few = conv_math.patch_rows(node, x, kernel, 4)                     # strided: at most 4 a sample
    assert few.shape[0] <= 8 and few.shape[1] == rows.shape[1]
    np.testing.assert_array_equal(few[0], rows[0])


@pytest.mark.parametrize("tail,pool,attrs,expected", [
    (("Relu",), "GlobalMaxPool", {}, True),
    ((), "GlobalMaxPool", {}, True),
    (("Sigmoid", "Tanh"), "GlobalMaxPool", {}, True),
    (("Relu",), "GlobalAveragePool", {}, False),
    (("Relu",), "ReduceMax", {"axes": [2]}, True),                 # x.amax(dim=2, keepdim=True)
    (("Relu",), "ReduceMax", {"axes": [-1]}, True),
    (("Relu",), "ReduceMax", {"axes": [1]}, False),                # over the channels
    (("Relu",), "MaxPool", {"kernel_shape": [L - 4]}, True),       # F.max_pool1d(x, x.size(2))
    (("Relu",), "MaxPool", {"kernel_shape": [3]}, False),          # a local pool
    (("Relu",), "MaxPool", {"kernel_shape": [L - 4], "pads": [1, 1]}, False),
])
def test_max_pooled_finds_a_layer_a_global_max_pool_reads(tail, pool, attrs, expected):
    view = GraphView(io.load(text_cnn(tail, pool, head=False, **attrs)).graph)
    (conv,) = [n for n in view.nodes if n.op == "Conv"]
    assert pooled.max_pooled(view, conv) is expected


def test_max_pooled_refuses_a_region_read_elsewhere():
    m = text_cnn()
    loaded = io.load(m)
    act = next(n for n in loaded.graph.nodes if n.name == "tail0")
    loaded.graph.outputs.append(act.outputs[0])                        # the activation is also a graph output
    view = GraphView(loaded.graph)
    (conv,) = [n for n in view.nodes if n.op == "Conv"]
    assert not pooled.max_pooled(view, conv)


def test_a_gelu_written_out_reaches_the_pool():
    """x * sigmoid(1.702 x): a Mul of two tensors of the region is still the region."""
    g = motifs.G("gelu_pool")
    x = g.input("x", [1, C, L])
    y = g.node("Conv", [x, g.weight("conv.w", (M, C, 5), 0.2)], name="conv", kernel_shape=[5])
    s = g.node("Sigmoid", [g.node("Mul", [y, g.const("k", np.float32(1.702))], name="scale")], name="gate")
    g.node("GlobalMaxPool", [g.node("Mul", [y, s], name="gelu")], ["y"], name="pool")
    g.output("y")
    view = GraphView(io.load(g.model(17)).graph)
    (conv,) = [n for n in view.nodes if n.op == "Conv"]
    assert pooled.max_pooled(view, conv)


def test_a_pooled_convolution_input_is_measured_at_the_maxima_and_gains():
    """Percentile calibration clips the rare large values the pool reads (about 24 dB held out);
    the output-aware search, measured at the maxima, smooths the input (a Mul over its channels)
    and keeps them: over 10 dB more."""
    m, cal, held = text_cnn(), spiky(32, 1), spiky(64, 2)
    plain = qdqgraph.quantize(m, cal, output_aware=False, high_precision="fp32")
    on = qdqgraph.quantize(m, cal, output_aware=True, high_precision="fp32")
    choice = on.report.output_aware["tensors"]["x"]
    assert choice["measured"] == "pooled maxima" and choice["error"] < 0.5 * choice["plain_error"]
    assert "1 read by a global max pool" in on.report.summary()
    (mul,) = [n for n in io.load(on.model).graph.nodes if n.op == "Mul"]
    assert mul.inputs[1].values.shape == (C, 1)                        # over axis 1 of [1, C, L]
    db_plain, db_on = held_out_db(m, plain.model, held), held_out_db(m, on.model, held)
    assert db_on > db_plain + 10, (db_plain, db_on)


def test_the_pooled_error_is_the_error_at_each_channels_float_peak():
    """pooled.errors against the measure written out: the quantized layer on every position of each
    sample, read at the position where each channel peaks in float."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((12, 7)).astype(np.float32)
    samples = [rng.standard_normal((30, 12)).astype(np.float32) * rng.uniform(0.5, 3, 12).astype(np.float32)
               for _ in range(5)]
    keep = pooled.PooledRows(w)
    for x in samples:
        keep.add(x)
    s = rng.uniform(0.5, 2, 12).astype(np.float32)
    wq = output_aware._quant_weight(w * s[:, None])
    ranges = [1.0, 2.5, 6.0]
    got = pooled.errors([(keep, keep.peaks(), s, wq)], output_aware._quant_act, ranges)

    def written_out(x, w, s, wq, amax):
        y = x @ w
        at, m = y.argmax(axis=0), np.arange(w.shape[1])
        yq = output_aware._quant_act(x / s, amax) @ wq
        return (float(np.sum((yq[at, m] - y[at, m]).astype(np.float64) ** 2)),
                float(np.sum(y[at, m].astype(np.float64) ** 2)))
    for amax, err in zip(ranges, got):
        num, den = np.sum([written_out(x, w, s, wq, amax) for x in samples], axis=0)
        assert err == pytest.approx(num / den, rel=1e-4)
    assert pooled.errors([(keep, keep.peaks(), s, wq)], output_aware._quant_act, ranges, part=2) != got
    # two layers that read one tensor (other kernel sizes): their errors and peaks add up
    w2 = rng.standard_normal((24, 5)).astype(np.float32)
    other = [rng.standard_normal((30, 24)).astype(np.float32) for _ in range(5)]
    keep2 = pooled.PooledRows(w2, taps=2)
    for x in other:
        keep2.add(x)
    s2 = np.repeat(s, 2)
    wq2 = output_aware._quant_weight(w2 * s2[:, None])
    both = pooled.errors([(keep, keep.peaks(), s, wq), (keep2, keep2.peaks(), s2, wq2)], output_aware._quant_act,
                         ranges)
    for amax, err in zip(ranges, both):
        parts = [written_out(x, w, s, wq, amax) for x in samples] + [written_out(x, w2, s2, wq2, amax) for x in other]
        num, den = np.sum(parts, axis=0)
        assert err == pytest.approx(num / den, rel=1e-4)


def test_by_default_the_search_runs_on_the_pooled_layers_alone():
    """A CNN that is no transformer: by default the search runs for the convolution a global max
    pool reads, and only for it; with a global average pool it does not run; off turns it off."""
    cal = spiky(32, 1)
    auto = qdqgraph.quantize(text_cnn(), cal)
    assert set(auto.report.output_aware["tensors"]) == {"x"}
    assert "float_columns" not in [p.name for p in auto.report.passes]     # massive columns: transformers only
    assert qdqgraph.quantize(text_cnn(pool="GlobalAveragePool"), cal).report.output_aware is None
    assert qdqgraph.quantize(text_cnn(), cal, output_aware=False).report.output_aware is None
    with pytest.warns(UserWarning, match="random data"):
        assert qdqgraph.quantize(text_cnn(), "random").report.output_aware is None


@pytest.mark.parametrize("pool,attrs", [("ReduceMax", {"axes": [2], "keepdims": 0}),
                                        ("MaxPool", {"kernel_shape": [L - 4]})])
def test_a_max_over_time_written_as_pytorch_exports_it_is_measured_at_the_maxima(pool, attrs):
    """`x.amax(dim=2)` and `F.max_pool1d(x, x.size(2))`, the max-over-time of text CNNs: the same
    measure by default, and the same gain over percentile calibration."""
    m, cal, held = text_cnn(pool=pool, **attrs), spiky(32, 1), spiky(32, 2)
    auto = qdqgraph.quantize(m, cal, high_precision="fp32")
    assert auto.report.output_aware["tensors"]["x"]["measured"] == "pooled maxima"
    plain = qdqgraph.quantize(m, cal, output_aware=False, high_precision="fp32")
    assert held_out_db(m, auto.model, held) > held_out_db(m, plain.model, held) + 10


def kim_text_cnn(kernels=(3, 4, 5), seed=0):
    """x [1, C, L] read by one Conv1d per kernel size, each -> Relu -> max over time (ReduceMax, as
    PyTorch exports x.amax(dim=2)), concatenated -> Gemm: Kim's text CNN."""
    g = motifs.G("kim_text_cnn", seed)
    x = g.input("x", [1, C, L])
    pooled_outs = []
    for k in kernels:
        y = g.node("Conv", [x, g.weight(f"conv{k}.w", (16, C, k), 0.2), g.weight(f"conv{k}.b", (16,), 0.1)],
                   name=f"conv{k}", kernel_shape=[k])
        y = g.node("Relu", [y], name=f"act{k}")
        pooled_outs.append(g.node("ReduceMax", [y], name=f"max{k}", axes=[2], keepdims=0))
    y = g.node("Concat", pooled_outs, name="cat", axis=1)
    g.node("Gemm", [y, g.weight("head.w", (16 * len(kernels), 4)), g.weight("head.b", (4,), 0.1)], ["y"], name="head")
    g.output("y")
    return g.model(17)


def test_a_tensor_read_by_convolutions_of_several_kernel_sizes_is_measured_at_all_their_maxima():
    """Kim's text CNN: the three convolutions read the same input with kernels 3, 4 and 5. The
    input is one target, each convolution measured at its own maxima, one smoothing factor per
    channel for all three (each weight's axis 1 times it): over 10 dB held out above percentile
    calibration."""
    m, cal, held = kim_text_cnn(), spiky(32, 1), spiky(32, 2)
    auto = qdqgraph.quantize(m, cal, high_precision="fp32")
    choice = auto.report.output_aware["tensors"]["x"]
    assert choice["measured"] == "pooled maxima" and choice["smoothing"] == "mul"
    plain = qdqgraph.quantize(m, cal, output_aware=False, high_precision="fp32")
    db_plain, db_auto = held_out_db(m, plain.model, held), held_out_db(m, auto.model, held)
    assert db_auto > db_plain + 10, (db_plain, db_auto)
    # the float function is kept: with its Q/DQ stripped (weights float), the written model computes
    # the float model's outputs, each convolution reading x / s with its weight's channels times s
    stripped = io.load(qdqgraph.quantize(m, cal, weights="qdq", high_precision="fp32").model)
    assert strip_qdq(stripped.graph)["removed"] > 0
    assert len([n for n in stripped.graph.nodes if n.op == "Mul"]) == 1
    f = qdqgraph.session(m)
    for x in held["x"][:4]:
        np.testing.assert_allclose(run(io.to_model(stripped), {"x": x})[0], f.run(None, {"x": x})[0],
                                   rtol=1e-4, atol=1e-4)
