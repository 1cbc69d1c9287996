"""One float pass over the calibration data for transformer models: what the recipes take from the
float run they share must be what their own runs gave. The calibration of a graph cut down to its
observed tensors bins what the whole graph's run bins; the float outputs output-aware's run keeps
stand for the calibration's; the groups output-aware chose a range for are not calibrated; the
massive columns found from output-aware's run are those a run of their own finds. Each is checked
against the separate pass it replaces, on a small encoder layer built here."""
import numpy as np
import pytest

import motifs
import qdqgraph
from qdqgraph import pipeline
from qdqgraph.calib import calibration as calibration_module
from qdqgraph.calib import collect as collect_module
from qdqgraph.calib.collect import Keeper, collect
from qdqgraph.execution import runtime
from qdqgraph.prepare import model_inputs, prepare
from qdqgraph.recipes import massive_columns, output_aware
from qdqgraph.samples.data import CalibrationData

T, H = 16, 32


def encoder_layer():
    """A post-LN encoder layer as BERT exports it: Q/K/V projections, heads, softmax, context,
    output projection + residual + LayerNorm, GELU-free FFN (fc1 -> Relu -> fc2) + residual +
    LayerNorm; an input channel 40x the rest feeds a massive output column of fc2."""
    g = motifs.G("encoder_layer")
    x = g.input("x", [1, T, H])
    heads, d = 2, H // 2
    ones, zeros = np.ones(H, np.float32), np.zeros(H, np.float32)
    q = g.node("MatMul", [x, g.weight("wq", (H, H))], name="q_proj")
    k = g.node("MatMul", [x, g.weight("wk", (H, H))], name="k_proj")
    v = g.node("MatMul", [x, g.weight("wv", (H, H))], name="v_proj")
    shape = g.const("heads_shape", np.array([0, 0, heads, d], np.int64))
    q = g.node("Transpose", [g.node("Reshape", [q, shape], name="q_heads")], name="q_t", perm=[0, 2, 1, 3])
    k = g.node("Transpose", [g.node("Reshape", [k, shape], name="k_heads")], name="k_t", perm=[0, 2, 3, 1])
    v = g.node("Transpose", [g.node("Reshape", [v, shape], name="v_heads")], name="v_t", perm=[0, 2, 1, 3])
    s = g.node("Div", [g.node("MatMul", [q, k], name="qk"), g.const("sqrt_d", np.array(np.sqrt(d), np.float32))],
               name="scale")
    c = g.node("MatMul", [g.node("Softmax", [s], name="softmax", axis=-1), v], name="pv")
    c = g.node("Reshape", [g.node("Transpose", [c], name="ctx_t", perm=[0, 2, 1, 3]),
                           g.const("merge_shape", np.array([0, 0, H], np.int64))], name="ctx_merge")
    o = g.node("MatMul", [c, g.weight("wo", (H, H))], name="o_proj")
    h = g.node("LayerNormalization", [g.node("Add", [o, x], name="residual1"), g.const("g1", ones),
                                      g.const("b1", zeros)], name="ln1", axis=-1)
    f = g.node("Relu", [g.node("MatMul", [h, g.weight("w1", (H, 2 * H))], name="fc1")], name="act")
    w2 = (np.random.default_rng(3).standard_normal((2 * H, H)) * 0.3).astype(np.float32)
    w2[:, 5] *= 60.0                       # output column 5 of fc2: massive on every token
    y = g.node("MatMul", [f, g.const("w2", w2)], name="fc2")
    y = g.node("Add", [y, g.const("b2", np.full(H, 0.1, np.float32))], name="fc2_bias")
    g.node("LayerNormalization", [g.node("Add", [y, h], name="residual2"), g.const("g2", ones),
                                  g.const("b2n", zeros)], ["y"], name="ln2", axis=-1)
    g.output("y")
    return g.model(17)


def encoder_data(n=12, seed=0):
    return {"x": np.random.default_rng(seed).standard_normal((n, 1, T, H)).astype(np.float32)}


def _same_states(a, b):
    assert set(a) == set(b)
    for rep in a:
        x, y = a[rep], b[rep]
        assert (x.width, x.amax, x.count) == (y.width, y.amax, y.count), rep
        np.testing.assert_array_equal(x.counts, y.counts, err_msg=rep)


def _sessions(monkeypatch) -> list[int]:
    """The node counts of the graphs calibration sessions are opened on."""
    seen: list[int] = []
    for name in ("unordered_session", "graph_session"):
        real = getattr(collect_module, name)

        def spy(loaded, *a, _real=real, **k):
            seen.append(len(loaded.graph.nodes))
            return _real(loaded, *a, **k)
        monkeypatch.setattr(collect_module, name, spy)
    return seen


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_calibration_without_outputs_runs_only_what_its_tensors_need(monkeypatch, binning, lanes):
    """Keeping no float outputs, the calibration runs the graph cut down to its tensors, and its
    states are those of the whole graph's run bit for bit, for the early groups alone (most of the
    graph cut) and for all of them."""
    loaded, plan = prepare(encoder_layer())
    data = CalibrationData(encoder_data(), model_inputs(loaded.graph))
    groups = plan.groups()
    early = {rep: m for rep, m in groups.items() if any(t in ("x", "q_proj_out", "q_t_out") for t in m)}
    assert early and len(early) < len(groups)
    for chosen in (early, groups):
        seen = _sessions(monkeypatch)
        whole = collect(loaded, chosen, data, method="percentile", lanes=lanes)
        cut = collect(loaded, chosen, data, method="percentile", lanes=lanes, outputs=False)
        assert cut.outputs is None and cut.samples == whole.samples
        assert whole.outputs is not None or binning == "in-graph"       # (which keeps none)
        _same_states(whole.states, cut.states)
        assert seen[-1] < seen[0]            # the cut graph, the whole one
    inputs_only = {rep: m for rep, m in groups.items() if m == ["x"]}
    assert inputs_only                     # read from the feed: the cut graph has nothing left to run
    _same_states(collect(loaded, inputs_only, data, method="percentile").states,
                 collect(loaded, inputs_only, data, method="percentile", outputs=False).states)


def test_a_graph_too_large_to_cut_is_run_whole(monkeypatch):
    """Above the sizes where onnxruntime is opened another way (LARGE_GRAPH_NODES, shared weights),
    the graph is not cut: the values observed would not be those of the whole graph's run."""
    loaded, plan = prepare(encoder_layer())
    assert collect_module.prunable(loaded.graph)
    monkeypatch.setattr(runtime, "SHARE_WEIGHTS_MIN_BYTES", 1024)
    assert not collect_module.prunable(loaded.graph)
    monkeypatch.setattr(runtime, "SHARE_WEIGHTS_MIN_BYTES", None)
    monkeypatch.setattr(collect_module, "LARGE_GRAPH_NODES", 10)
    assert not collect_module.prunable(loaded.graph)
    data = CalibrationData(encoder_data(4), model_inputs(loaded.graph))
    seen = _sessions(monkeypatch)
    collect(loaded, plan.groups(), data, outputs=False)
    assert seen and seen[0] >= len(loaded.graph.nodes)


def _separate_passes(monkeypatch) -> None:
    """quantize() as it ran before the passes were shared: output-aware keeps no float outputs, the
    calibration calibrates every group and keeps the outputs, massive columns runs its own pass."""
    monkeypatch.setattr(pipeline, "output_keeper", lambda graph: Keeper([]))
    monkeypatch.setattr(massive_columns.Products, "maxima", lambda self, *a: None)
    real = pipeline._ranges

    def every_group(*a, **k):
        return real(*a[:8])
    monkeypatch.setattr(pipeline, "_ranges", every_group)


def test_the_shared_pass_writes_the_model_the_separate_passes_write(monkeypatch):
    m, data = encoder_layer(), encoder_data()
    calls = []
    real = calibration_module.calibrate_plan

    def spy(loaded, plan, *a, **k):
        calls.append((len(plan.groups()), k.get("only"), k.get("keep_outputs", True)))
        return real(loaded, plan, *a, **k)
    monkeypatch.setattr(pipeline, "calibrate_plan", spy)
    shared = qdqgraph.quantize(m, data)
    assert shared.report.output_aware is not None
    (groups, only, kept), = calls
    assert only is not None and 0 < len(only) < groups and not kept
    _separate_passes(monkeypatch)
    separate = qdqgraph.quantize(m, data)
    assert calls[-1][1] is None and calls[-1][2]
    assert shared.model.SerializeToString() == separate.model.SerializeToString()
    assert shared.report.samples == separate.report.samples == len(data["x"])
    # the float outputs verify compares against: the float model's, from output-aware's run (the
    # graph before its smoothing) instead of the calibration's (after): the same up to float32 rounding
    a, b = shared.reference, separate.reference
    assert a is not None and b is not None and a.samples == b.samples == collect_module.KEEP_SAMPLES
    for x, y in zip(a.outputs["y"], b.outputs["y"]):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
    for fa, fb in zip(a.batches, b.batches):
        np.testing.assert_array_equal(fa["x"], fb["x"])


def test_the_reference_output_aware_keeps_is_the_float_models_run(monkeypatch):
    """The float outputs kept from output-aware's run are exactly those of a run of the float graph
    (the graph output is already an output of that session: nothing about the run changes)."""
    m, data = encoder_layer(), encoder_data()
    r = qdqgraph.quantize(m, data)
    loaded, _ = prepare(m)
    runs = list(runtime.float_activations(loaded, ["y"], CalibrationData(data, model_inputs(loaded.graph)),
                                          collect_module.KEEP_SAMPLES, "test"))
    assert len(r.reference.outputs["y"]) == len(runs) == collect_module.KEEP_SAMPLES
    for kept, ran in zip(r.reference.outputs["y"], runs):
        np.testing.assert_array_equal(kept, ran["y"])


def test_too_few_rows_samples_leave_the_outputs_to_the_calibration(monkeypatch):
    """Where output-aware's run stops before KEEP_SAMPLES samples (its rows are enough), the
    calibration keeps the float outputs as before."""
    monkeypatch.setattr(output_aware, "SAMPLES", 3)
    calls = []
    real = calibration_module.calibrate_plan

    def spy(loaded, plan, *a, **k):
        calls.append(k.get("keep_outputs", True))
        return real(loaded, plan, *a, **k)
    monkeypatch.setattr(pipeline, "calibrate_plan", spy)
    r = qdqgraph.quantize(encoder_layer(), encoder_data())
    assert calls == [True] and r.reference is not None and r.reference.samples == collect_module.KEEP_SAMPLES


def _massive_runs(monkeypatch) -> list[int]:
    """The samples each float run of massive columns' own takes."""
    runs: list[int] = []
    real = massive_columns.float_activations

    def spy(*a, **k):
        runs.append(0)
        for values in real(*a, **k):
            runs[-1] += 1
            yield values
    monkeypatch.setattr(massive_columns, "float_activations", spy)
    return runs


def _products(loaded, plan, data) -> massive_columns.Products:
    """Products ridden along output-aware's float run, as quantize() makes it."""
    products = massive_columns.Products(loaded)
    output_aware.run(loaded, plan, data, (products,))
    return products


def _own_and_products(monkeypatch):
    """The encoder layer prepared, its data, the products of output-aware's run, the list the
    massive-columns runs are counted into, and massive columns' choice from its own run."""
    loaded, plan = prepare(encoder_layer())
    data = CalibrationData(encoder_data(), model_inputs(loaded.graph))
    products = _products(loaded, plan, data)
    plan = pipeline.plan_for(loaded, qdqgraph.QuantizeConfig())
    runs = _massive_runs(monkeypatch)
    return loaded, plan, data, products, runs, massive_columns.choose(loaded, plan, data)


@pytest.mark.parametrize("rows", [8, 40, 4096])
def test_massive_columns_from_the_shared_run_are_its_own_runs(monkeypatch, rows):
    """The channel maxima computed from output-aware's run (its rows of fc2's input, times the
    weight) choose the columns massive columns' own run chooses, over the same samples (its ROWS
    rule: one sample of 16 rows, three, all twelve), the run then not made."""
    monkeypatch.setattr(massive_columns, "ROWS", rows)
    loaded, plan, data, products, runs, own = _own_and_products(monkeypatch)
    assert runs == [min(-(-rows // T), massive_columns.SAMPLES)]
    shared = massive_columns.choose(loaded, plan, data, products)
    assert len(runs) == 1                    # no run of its own
    assert list(own) == list(shared) == ["fc2"] and own["fc2"][1] == shared["fc2"][1] == [5]
    assert shared["fc2"][2] == pytest.approx(own["fc2"][2], rel=1e-4)
    np.testing.assert_array_equal(own["fc2"][0], shared["fc2"][0])       # the graph's weight, as it is now


def test_a_ratio_at_the_threshold_is_left_to_the_own_run(monkeypatch):
    """Where a column's ratio is within MARGIN of RATIO, the rounding between the two runs could
    choose differently: the recipe runs its own pass."""
    loaded, plan, data, products, runs, own = _own_and_products(monkeypatch)
    monkeypatch.setattr(massive_columns, "RATIO", own["fc2"][2] * (1 + massive_columns.MARGIN / 2))
    massive_columns.choose(loaded, plan, data, products)
    assert len(runs) == 2
    monkeypatch.setattr(massive_columns, "RATIO", own["fc2"][2] * (1 + 3 * massive_columns.MARGIN))
    massive_columns.choose(loaded, plan, data, products)
    assert len(runs) == 2


def test_products_that_miss_samples_or_layers_leave_the_own_run(monkeypatch):
    """Fewer samples kept than the own run would take (output-aware's run stopped earlier), or a
    candidate whose input that run did not fetch: the recipe runs its own pass."""
    loaded, plan = prepare(encoder_layer())
    data = CalibrationData(encoder_data(), model_inputs(loaded.graph))
    monkeypatch.setattr(output_aware, "SAMPLES", 2)
    products = _products(loaded, plan, data)
    monkeypatch.setattr(massive_columns, "ROWS", 3 * T)
    plan = pipeline.plan_for(loaded, qdqgraph.QuantizeConfig())
    runs = _massive_runs(monkeypatch)
    massive_columns.choose(loaded, plan, data, products)
    assert runs == [3]
    products.samples = [{} for _ in products.samples]
    massive_columns.choose(loaded, plan, data, products)
    assert len(runs) == 2


def test_a_product_that_is_not_finite_leaves_the_own_run():
    """onnxruntime's max may drop a NaN the own run's keeps: a layer whose product is not finite on a
    sample is left out of the products (its choice made by the own run)."""
    loaded, plan = prepare(encoder_layer())
    products = massive_columns.Products(loaded)
    (name, (x, _)), = [(n, io_) for n, io_ in products.layers.items() if n == "fc2"]
    good = np.random.default_rng(0).standard_normal((1, T, 2 * H)).astype(np.float32)
    bad = good.copy()
    bad[0, 3, 1] = np.nan
    products.add(0, 1, {}, {x: good})
    products.add(1, 1, {}, {x: bad})
    assert name in products.samples[0] and name not in products.samples[1]
