"""The simulator against real TensorRT engines (../shared/oracles): the graphs the engines were
built from are rebuilt in code (qdqgraph/testing/models.py, no torch), simulated and diffed layer by layer.
Also the engine-report reader (8.4 `Origin: QDQ` and 8.2-era `Scale` forms, names-only files) and
the diff itself (it must see grouping and precision differences)."""
import copy
import json
import re

import pytest

from qdqgraph import trtsim
from qdqgraph.errors import QdqError
from qdqgraph.trtsim.engine_report import parse_engine_info, precision_of, split_name
from qdqgraph.testing.oracles import ORACLES, compare, oracles_dir

FOLDER = oracles_dir()
needs_oracles = pytest.mark.skipif(FOLDER is None, reason="no oracles folder: set QDQGRAPH_SHARED or QDQGRAPH_ORACLES")
_RESULTS = {}


def result(name):
    if name not in _RESULTS:
        _RESULTS[name] = compare(name, FOLDER)
    return _RESULTS[name]


def visible(tokens, names):
    return frozenset(t for t in tokens if t in names)


@needs_oracles
@pytest.mark.parametrize("name", list(ORACLES))
def test_simulation_matches_the_engine(name):
    """>= 95 % of layers have the same fused ONNX nodes and the same int8/float precision of every
    input and output, and the standalone Q/DQ reformats are the same ones as in the engine."""
    r = result(name)
    assert r.diff.compared >= 20
    assert r.diff.share >= 0.95, r.diff.table()
    assert len(r.diff.sim_reformats) == len(r.diff.engine_reformats), r.diff.table()
    engine_keys = {visible(e.tokens, r.sim.node_names) for e in r.engine.reformats}
    sim_keys = {visible(x.nodes, set().union(*engine_keys)) for x in r.sim.reformats}
    assert sim_keys == engine_keys


@needs_oracles
@pytest.mark.parametrize("name", list(ORACLES))
def test_every_onnx_node_the_engine_names_exists_in_the_rebuilt_graph(name):
    """The rebuilt graphs carry the exporters' node names, so no engine layer is left unmatched
    for want of a name (weights, biases and TensorRT's own names are not ONNX nodes)."""
    r = result(name)
    tokens = {t for e in r.engine.layers if not e.layout for t in e.tokens}
    onnx_like = {t for t in tokens if re.fullmatch(r"[A-Z][A-Za-z]*_\d+", t)
                 or (t.startswith(("resnet50/", "QuantLinearNode__")) and not t.endswith(":0"))}
    assert onnx_like and onnx_like <= r.sim.node_names, sorted(onnx_like - r.sim.node_names)


@needs_oracles
def test_the_diff_tells_placements_apart():
    """qat's prediction against the qat-residual engine: the residual Q/DQ changes 16 layers."""
    sim = result("trex/pytorch-resnet18-a100-qat").sim
    other = result("trex/pytorch-resnet18-a100-qat-residual").engine
    d = trtsim.diff(sim, other)
    assert d.share < 0.8 and len(d.sim_reformats) != len(d.engine_reformats)


@needs_oracles
def test_the_diff_sees_grouping_and_precision_changes():
    name = "trex/pytorch-resnet18-a100-qat-residual"
    r = result(name)
    data = json.loads((FOLDER / f"{name}.graph.json").read_text())
    changed = copy.deepcopy(data)
    fused = next(x for x in changed["Layers"] if " + Add_42 + Relu_43" in x["Name"])
    fused["Name"] = fused["Name"].replace(" + Add_42 + Relu_43", "")       # Add no longer fused
    changed["Layers"].append({"Name": "Add_42 + Relu_43", "LayerType": "ElementWise", "Inputs": [], "Outputs": []})
    first_conv = next(x for x in changed["Layers"] if "Conv_22" in x["Name"])
    first_conv["Outputs"][0]["Format/Datatype"] = "Row major linear FP32"    # Int8 -> FP32
    d = trtsim.diff(r.sim, parse_engine_info(changed))
    assert [s.name for s, _, _ in d.precision] == [r.sim.layer_of("Conv_22").name]
    assert {e.name for e in d.engine_only} == {fused["Name"], "Add_42 + Relu_43"}
    assert [s.name for s in d.sim_only] == [r.sim.layer_of("Add_42").name]
    assert len(d.matched) == len(r.diff.matched) - 2 and d.share == len(d.matched) / (len(d.matched) + 4)


@needs_oracles
def test_scale_form_of_trt_8_2_reads_like_origin_qdq():
    """Same ONNX, two TensorRT versions: the 8.2-era file reports standalone Qs as `Scale` layers
    without Origin, the 8.4 one as `Reformat`/`Origin: QDQ`; the reader finds the same ones."""
    for placement in ("qat", "qat-residual"):
        old = trtsim.read_engine_report(FOLDER / f"more/trex-mobilenetv2-titanrtx-{placement}.trex010.graph.json")
        new = trtsim.read_engine_report(FOLDER / f"more/trex-mobilenetv2-titanrtx-{placement}.trex011.graph.json")
        assert any(e.layer_type == "Scale" for e in old.reformats)
        assert sorted(e.name for e in old.reformats) == sorted(e.name for e in new.reformats)


@needs_oracles
def test_names_only_layer_info_reads_without_precisions():
    report = trtsim.read_engine_report(FOLDER / "more/pr3444-resnet18-yolov3neck-orin-qat.layer_info.json")
    assert report.layers and all(not e.inputs and not e.outputs for e in report.layers)
    assert any("/backbone/conv1/Conv" in e.tokens for e in report.layers)


def test_layer_names_split_into_onnx_tokens():
    name = "features.0.0.weight + QuantizeLinear_8 + Conv_12 + PWN(PWN(Sigmoid_3, Mul_4), Add_5)"
    assert split_name(name) == ["features.0.0.weight", "QuantizeLinear_8", "Conv_12", "Sigmoid_3", "Mul_4", "Add_5"]
    assert split_name("resnet50/quant_conv1_conv/BiasAdd__1121") == ["resnet50/quant_conv1_conv/BiasAdd__1121"]


@pytest.mark.parametrize("fmt, precision", [
    ("Thirty-two wide channel vectorized row major Int8 format", "int8"), ("Row major linear FP32", "fp32"),
    ("Channel major FP16 format where channel % 8 == 0", "fp16"), ("Half", "fp16"), ("Float", "fp32"), (None, None)])
def test_formats_map_to_precisions(fmt, precision):
    assert precision_of(fmt) == precision


def test_reader_errors_are_one_line_qdq_errors(tmp_path):
    with pytest.raises(QdqError, match="not found"):
        trtsim.read_engine_report(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(QdqError, match="is not an engine report"):
        trtsim.read_engine_report(bad)
    bad.write_text('{"Bindings": []}')
    with pytest.raises(QdqError, match="no \"Layers\" list"):
        trtsim.read_engine_report(bad)


ABLATIONS = {   # a rule replaced by a weaker one (user rule file): the oracles must notice
    "F2-output-q": ('action = "output_q"\nop = "quantize"\nwhen = ["sole_consumer", "layer_int8"]', "qat"),
    "R5c-merge-q": ('action = "merge"\nop = "quantize"\nwhen = ["requant"]', "qat-residual"),
    "R2-maxpool-q": ('action = "q_backward"\nop = "max_pool"\nwhen = ["not_int8"]', "qat"),
    "F2-conv-act-pool": ('action = "post_pool"\nop = "max_pool"\nwhen = ["requant"]', "qat-residual"),
}


@needs_oracles
@pytest.mark.parametrize("rule_id", sorted(ABLATIONS))
def test_weakening_a_rule_breaks_an_oracle(rule_id, tmp_path):
    body, placement = ABLATIONS[rule_id]
    f = tmp_path / "weaker.toml"
    f.write_text(f'schema = 1\n[[rule]]\nid = "{rule_id}"\ndoc = "weaker"\nref = "test"\n{body}\n')
    r = result(f"trex/pytorch-resnet18-a100-{placement}")
    from qdqgraph.graph import io
    from qdqgraph.testing import models
    weaker = trtsim.simulate(io.load(models.resnet18(placement)).graph, rules=trtsim.load_sim_rules([f]))
    d = trtsim.diff(weaker, r.engine)
    assert d.share < 0.95 or len(d.sim_reformats) != len(d.engine_reformats)
    assert r.diff.share >= 0.95
