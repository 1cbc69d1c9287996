"""Massive output channels of residual-writing linear layers computed in float
(qdqgraph.recipes.massive_columns, qdqgraph.passes.float_columns), on a constructed block whose
channel 5 is huge on one token only, as trained encoders' FFN outputs are."""
import numpy as np

import motifs
import qdqgraph
from qdqgraph import QuantizeConfig
from qdqgraph.graph import io
from qdqgraph.passes import float_columns
from qdqgraph.prepare import prepare, read_data
from qdqgraph.recipes import massive_columns

T, K = 16, 32
BIG = 5


def block(norm_after=True, big=40.0):
    """x -> LayerNorm -> MatMul (+ bias) -> + residual -> LayerNorm: channel 0 of the input is 20
    on token 0 (the data's doing) and reaches output channel BIG through a weight of 40."""
    g = motifs.G("block")
    x = g.input("x", [1, T, K])
    ones, zeros = np.ones(K, np.float32), np.zeros(K, np.float32)
    ln = g.node("LayerNormalization", [x, g.const("g1", ones), g.const("b1", zeros)], name="ln1", axis=-1)
    w = (np.random.default_rng(1).standard_normal((K, K)) * 0.3).astype(np.float32)
    w[0, BIG] = big
    y = g.node("MatMul", [ln, g.const("w", w)], name="dense")
    y = g.node("Add", [y, g.const("bias", np.full(K, 0.1, np.float32))], name="dense_bias")
    y = g.node("Add", [y, ln], name="residual")
    if norm_after:
        g.node("LayerNormalization", [y, g.const("g2", ones), g.const("b2", zeros)], ["y"], name="ln2", axis=-1)
    else:
        g.node("Relu", [y], ["y"], name="act")
    g.output("y")
    return g.model(17)


def data(n=16, seed=0):
    x = np.random.default_rng(seed).standard_normal((n, 1, T, K)).astype(np.float32)
    x[:, 0, 0, 0] = 20.0            # LayerNorm keeps it large: channel 0 of token 0
    return {"x": x}


def sqnr(ref, got):
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    return 10 * np.log10((ref ** 2).sum() / max(((ref - got) ** 2).sum(), 1e-30))


def test_massive_picks_few_large_columns_only():
    c = np.ones(64, np.float32)
    c[[3, 40]] = [50.0, 20.0]
    cols, ratio = massive_columns.massive(c)
    assert cols == [3, 40] and ratio == 50.0
    c[[1, 2, 4, 5, 6]] = 30.0              # more than MAX_COLUMNS: a wide output, not a few outliers
    assert massive_columns.massive(c)[0] == []
    assert massive_columns.massive(np.zeros(8, np.float32))[0] == []
    c = np.ones(64, np.float32)
    c[7] = massive_columns.RATIO * 0.9     # under the threshold
    assert massive_columns.massive(c)[0] == []


def test_only_layers_that_write_a_normalized_residual_are_candidates():
    loaded, plan = prepare(block())
    assert list(massive_columns.candidates(loaded, plan)) == ["dense"]
    loaded, plan = prepare(block(norm_after=False))
    assert massive_columns.candidates(loaded, plan) == {}


def test_the_split_computes_the_same_float_model():
    loaded, plan = prepare(block())
    before = io.to_model(io.Loaded(graph=loaded.graph.copy(), ir_version=loaded.ir_version))
    chosen = massive_columns.choose(loaded, plan, read_data(loaded, data(), QuantizeConfig()))
    assert list(chosen) == ["dense"] and chosen["dense"][1] == [BIG] and chosen["dense"][2] >= massive_columns.RATIO
    res = float_columns.apply(loaded.graph, chosen)
    assert res.changed and res["layers"]["dense"]["columns"] == [BIG]
    assert not any(n.op == "MatMul" and n.name != "dense" for n in loaded.graph.nodes)
    after = io.to_model(io.Loaded(graph=loaded.graph, ir_version=loaded.ir_version))
    feed = {"x": data(1, seed=5)["x"][0]}
    np.testing.assert_allclose(qdqgraph.session(after).run(None, feed)[0],
                               qdqgraph.session(before).run(None, feed)[0], rtol=1e-4, atol=1e-4)


def test_float_columns_raise_the_output_sqnr(monkeypatch):
    m = block()
    on = qdqgraph.quantize(m, data(32), high_precision="fp32")
    assert on.report.float_columns == {"dense": {"columns": [BIG], "ratio": on.report.float_columns["dense"]["ratio"]}}
    assert "float columns: 1 massive output channel(s) of 1 linear layer(s)" in on.report.summary()
    monkeypatch.setattr(massive_columns, "RATIO", float("inf"))
    off = qdqgraph.quantize(m, data(32), high_precision="fp32")
    assert not off.report.float_columns
    feeds = [{"x": x} for x in data(8, seed=9)["x"]]
    ref = [qdqgraph.session(m).run(None, f)[0] for f in feeds]
    on_db = sqnr(ref, [qdqgraph.session(on.model).run(None, f)[0] for f in feeds])
    off_db = sqnr(ref, [qdqgraph.session(off.model).run(None, f)[0] for f in feeds])
    assert on_db > off_db + 3.0, (on_db, off_db)


def test_no_columns_without_data_or_on_a_model_without_them():
    assert not qdqgraph.quantize(block(), "random", high_precision="fp32").report.float_columns
    plain = qdqgraph.quantize(block(big=0.3), data(16), high_precision="fp32")   # no massive channel
    assert not plain.report.float_columns and "float columns" not in plain.report.summary()


def test_the_maxima_stop_at_the_row_budget(monkeypatch):
    loaded, plan = prepare(block())
    seen = []
    real = massive_columns.float_activations

    def counted(*args, **kwargs):
        for values in real(*args, **kwargs):
            seen.append(1)
            yield values
    monkeypatch.setattr(massive_columns, "float_activations", counted)
    monkeypatch.setattr(massive_columns, "ROWS", 2 * T)        # two samples of T tokens
    assert list(massive_columns.choose(loaded, plan, read_data(loaded, data(), QuantizeConfig()))) == ["dense"]
    assert len(seen) == 2


def test_a_graph_before_opset_12_is_left_as_it_is():
    g = motifs.G("old")
    x = g.input("x", [1, T, K])
    g.node("MatMul", [x, g.weight("w", (K, K))], ["y"], name="dense")
    g.output("y")
    loaded, _ = prepare(g.model(13))
    loaded.graph.opset = 11            # loading raises older models to 13; the pass is guarded anyway
    w = np.ones((K, K), np.float32)
    res = float_columns.apply(loaded.graph, {"dense": (w, [BIG], 50.0)})
    assert not res.changed and [n.op for n in loaded.graph.nodes] == ["MatMul"]


def test_the_prediction_holds_the_float_column_products_as_float_gemm_layers():
    """TensorRT for RTX compiles each Einsum to a GEMM kernel on fp16 inputs (MiniLM's build): the
    simulation must predict both as compute layers in float, or the engine check cannot match them."""
    from qdqgraph.trtsim import simulate
    out = qdqgraph.quantize(block(), data(32), high_precision="fp16")
    assert out.report.float_columns
    for target in ("tensorrt", "tensorrt-rtx"):
        sim = simulate(out.model, target=target)
        einsums = [x for x in sim.layers if any(op == "Einsum" for op in x.ops)]
        assert len(einsums) == 2, [(x.name, x.ops) for x in einsums]
        for x in einsums:
            assert x.kind == "matmul" and x.ops == ["Einsum"], (x.kind, x.ops)
            assert x.inputs and x.inputs[0].precision not in ("int8", "fp8"), x.inputs
        dense = next(x for x in sim.layers if "dense" in x.nodes)
        assert dense.inputs[0].precision == "int8"
