"""Sensitivity and fallback on constructed cases."""
import numpy as np
import onnx_graphsurgeon as gs
from onnx import numpy_helper

import motifs
import qdqgraph
from qdqgraph.graph import io
from qdqgraph.samples.data import CalibrationData
from qdqgraph.prepare import model_inputs
from qdqgraph.recipes.sensitivity import measure


def test_switchable_model_all_float_equals_float_model():
    m = motifs.residual_add(projection=True)
    data = motifs.sample_data(m)
    r = qdqgraph.quantize(m, data, high_precision="fp32")     # sensitivity works on the float32 Q/DQ model
    loaded = io.load(m)
    cd = CalibrationData(data, model_inputs(loaded.graph))
    sens, evaluate = measure(r.model, r.plan, cd, samples=4)
    quantized = {n for n, d in r.plan.decisions.items() if d.quantized}
    assert {u.node for u in sens.units} == quantized
    assert evaluate(quantized) == float("inf")          # every unit float: exactly the float model
    assert np.isfinite(sens.all_int8_db) and sens.all_int8_db > 15
    for u in sens.units:
        assert u.only_quantized_db > sens.all_int8_db - 1e-6  # one unit in INT8 is no worse than all
    assert sens.runs == 2 * len(sens.units) + 2              # batched: one run per variant


def test_fallback_picks_the_damaged_layer():
    """Make conv2's weight quantize badly (one huge outlier per output channel): fallback must
    return exactly that conv to float first."""
    m = motifs.residual_add()
    w = [t for t in m.graph.initializer if t.name == "conv2.w"][0]
    arr = numpy_helper.to_array(w).copy()
    arr[:, 0, 0, 0] = 60.0   # outliers: per-channel scale 60/127 crushes the other weights
    w.CopyFrom(numpy_helper.from_array(arr, "conv2.w"))
    data = motifs.sample_data(m)
    r = qdqgraph.quantize(m, data, max_float_layers=1)
    assert r.report.fallback["float_nodes"] == ["conv2"]
    assert r.plan.decisions["conv2"].rule == "fallback" and not r.plan.decisions["conv2"].quantized
    assert r.report.fallback["final_db"] > r.report.fallback["all_int8_db"]
    g = io.load(r.model).graph
    conv2 = [n for n in g.nodes if n.name == "conv2"][0]
    # a float layer of the default FP16-island model: its weight is float16, not INT8
    assert isinstance(conv2.inputs[1], gs.Constant) and conv2.inputs[1].values.dtype == np.float16
    assert "fallback: output SQNR" in r.report.summary()


def test_budget_already_met_returns_nothing():
    m = motifs.conv_relu()
    r = qdqgraph.quantize(m, motifs.sample_data(m), accuracy_budget=5.0)
    assert r.report.fallback["float_nodes"] == []
    assert r.plan.decisions["conv"].quantized
