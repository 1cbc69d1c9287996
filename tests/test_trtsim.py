"""The TensorRT simulator end to end: qdqgraph's own output on the motifs, the report (JSON, table,
ONNX), the bounded fixpoint and node-order independence on random graphs (hypothesis)."""
import json
import random

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import motifs
import qdqgraph
from qdqgraph.graph import io
from qdqgraph import trtsim
from qdqgraph.trtsim.propagate import default_bound
from qdqgraph.trtsim.ir import SimGraph
from test_trtsim_rules import QG, S1, S2, conv_chain, residual

_QUANTIZED = {}


def quantized(name):
    """qdqgraph's output for a motif (cached: calibration is the slow part)."""
    if name not in _QUANTIZED:
        model = motifs.ALL[name]()
        _QUANTIZED[name] = qdqgraph.quantize(model, motifs.sample_data(model)).model
    return _QUANTIZED[name]


# ---------------------------------------------------------------------------- qdqgraph's own placements

@pytest.mark.parametrize("name", ["residual_add", "concat_of_pools", "se_block", "conv_bn_relu"])
def test_qdqgraph_placements_cost_no_reformat_inside_the_network(name):
    """Every Q/DQ that qdqgraph places must be absorbed by a TensorRT layer: the only standalone
    Reformats allowed are at graph inputs/outputs (P12). A failure names the placement at fault."""
    report = trtsim.simulate(quantized(name))
    inside = [x for x in report.reformats if not x.at_graph_io]
    assert not inside, "reformats inside the network:\n" + "\n".join(
        f"{x.name}: " + "; ".join(f"{r}: {w}" for r, w in x.why) for x in inside) + "\n" + report.table()
    assert report.summary["int8_layers"] >= 1


def test_every_motif_simulates_and_every_op_lands_in_one_layer():
    for name in ("residual_add", "se_block", "silu_conv", "attention", "tiny_conv", "paddle_constants", "bmm"):
        model = quantized(name)
        assert trtsim.lint(model) == [], f"{name}: qdqgraph's own output has QDQ2xx findings"
        report = trtsim.simulate(model)
        graph = io.load(model).graph
        ops = [n.name for n in graph.nodes if n.op not in ("QuantizeLinear", "DequantizeLinear", "Constant")]
        for op in ops:
            owners = [x for x in report.layers if op in x.nodes]
            assert len(owners) == 1, f"{name}: {op} is in {len(owners)} layers"


# ---------------------------------------------------------------------------- the report

def test_json_has_the_documented_shape_and_consistent_summary():
    report = trtsim.simulate(residual(quant_skip=False))
    data = json.loads(report.to_json())
    for layer in data["layers"]:
        assert {"name", "nodes", "ops", "inputs", "outputs", "reformat", "rule"} <= set(layer)
        assert len(layer["nodes"]) == len(layer["ops"])
        for port in layer["inputs"] + layer["outputs"]:
            assert set(port) == {"tensor", "precision"} and port["precision"] in ("int8", "fp32", "fp16")
    s = data["summary"]
    assert {"layers", "int8_layers", "float_layers", "reformats", "int8_flops_share"} <= set(s)
    assert s["layers"] == len(data["layers"]) == s["int8_layers"] + s["float_layers"] + s["reformats"]
    assert s["reformats"] == sum(1 for x in data["layers"] if x["reformat"])
    assert 0 < s["int8_flops_share"] <= 1
    assert abs(sum(x["flops_share"] for x in data["layers"]) - 1) < 1e-3


def test_reformat_reasons_name_the_rules_tried():
    """The skip is float, so the Add outputs float (F3) and the next conv's Q runs on its own; the
    stem's Q cannot be its output scale either (the stem also feeds the float skip)."""
    report = trtsim.simulate(residual(quant_skip=False))
    q = report.layer_of("head_in_q")
    assert q.reformat and not q.at_graph_io
    rules = dict(q.why)
    assert "F2-output-q" in rules and "F3" in rules["F2-output-q"]
    table = report.table()
    assert "also feeds add" in dict(report.layer_of("s_q").why)["F2-output-q"]
    assert "F2-output-q" in table and "head_in_q" in table and "reformats (2 inside the network" in table


def test_flops_count_weighted_ops_only():
    report = trtsim.simulate(conv_chain())
    assert report.layer_of("c1").flops == 2 * (8 * 4 * 4) * 8     # 2 * output elements * cin*kh*kw, batch 1
    assert report.layer_of("head").flops == 2 * (8 * 4 * 4) * 8
    assert all(x.flops == 0 for x in report.layers if x.reformat)


def test_a_matmul_takes_k_from_its_weight_when_the_activation_dim_is_symbolic():
    """A MatMul after a Reshape to a symbolic width (MiniLM's attention output projection) is
    2 * rows * K * N with K from the weight; the symbolic width would count as 1."""
    g = QG("symbolic_k")
    x = g.input("x", ["n", "s", "h"])
    g.node("MatMul", [x, g.weight("w", (16, 8))], ["y"], name="proj")
    g.output("y")
    assert trtsim.simulate(g.model(13)).layer_of("proj").flops == 2 * 8 * 16


def test_int8_regions_and_the_reformats_on_their_border(tmp_path):
    """small_head with P14 off: the conv trunk is one region entered at the graph input; the pooled
    Gemm head is another, entered through the Q after the float Softmax."""
    from qdqgraph.trtsim.regions import costly_regions, int8_regions
    rules = tmp_path / "off.toml"
    rules.write_text('schema = 1\n[[region]]\nid = "P14-small-int8-region"\ndoc = "d"\nref = "r"\n'
                     'max_flops_share = 0\n')
    m = motifs.small_head()
    report = trtsim.simulate(qdqgraph.quantize(m, motifs.sample_data(m), rules=[str(rules)],
                                               high_precision="fp32").model)
    trunk, head = int8_regions(report)
    assert {"c1", "c2"} <= set(trunk.nodes) and trunk.flops_share > 0.999
    assert [x.name for x in trunk.entries] == ["x_q"] and not trunk.inner_reformats
    assert {"gap", "head"} <= set(head.nodes) and head.flops_share < 0.001
    assert [x.name for x in head.inner_reformats] == ["softmax_out_q"] and not head.exits
    assert costly_regions(report, 0.005) == [head] and costly_regions(report, 1e-5) == []


def test_float16_graph_reports_fp16_float_layers():
    g = QG("fp16")
    x = g.input("x", ["n", 8, 4, 4], onnx.TensorProto.FLOAT16)
    g.node("Softmax", [g.node("Relu", [x], name="relu")], ["y"], name="softmax", axis=1)
    g.output("y", onnx.TensorProto.FLOAT16)
    report = trtsim.simulate(g.model(13))
    assert {p.precision for x in report.layers for p in x.inputs + x.outputs} == {"fp16"}


def test_onnx_export_is_a_checked_custom_domain_graph(tmp_path):
    report = trtsim.simulate(quantized("residual_add"))
    model = report.to_onnx()
    onnx.checker.check_model(model)
    assert {n.domain for n in model.graph.node} == {"qdqgraph.trtsim"}
    assert len(model.graph.node) == len(report.layers)
    for node, layer in zip(model.graph.node, report.layers):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert [s.decode() for s in attrs["nodes"]] == layer.nodes
        assert attrs["rule"].decode() == layer.rule
    assert [i.name for i in model.graph.input] == ["x"] and [o.name for o in model.graph.output] == ["y"]
    onnx.save(model, tmp_path / "engine.onnx")
    assert len(onnx.load(tmp_path / "engine.onnx").graph.node) == len(report.layers)


def test_the_callers_graph_is_not_modified():
    graph = io.load(quantized("residual_add")).graph
    before = [(n.name, n.op, [t.name for t in n.inputs]) for n in graph.nodes]
    trtsim.simulate(graph)
    assert [(n.name, n.op, [t.name for t in n.inputs]) for n in graph.nodes] == before


# ---------------------------------------------------------------------------- fixpoint and order

def test_fixpoint_bound_raises_instead_of_looping():
    assert trtsim.simulate(conv_chain()).steps == 0             # nothing to move
    pooled = QG("pool_chain")
    y = pooled.node("Relu", [pooled.qconv(pooled.qdq(pooled.input("x", ["n", 8, 4, 4]), "x"), "c1")], name="relu")
    for i in range(3):
        y = pooled.node("MaxPool", [y], name=f"pool{i}", kernel_shape=[1, 1])
    m = pooled.head(y)
    steps = trtsim.simulate(m).steps
    assert steps == 3                                          # the Q climbs three MaxPools, one at a time
    trtsim.simulate(m, bound=steps)
    with pytest.raises(trtsim.FixpointExceeded, match="did not settle within 2 rewrites"):
        trtsim.simulate(m, bound=2)


def test_a_graph_nothing_rewrites_is_tried_once_per_rewrite_and_node(monkeypatch):
    """Where no Q/DQ moves, each rewrite is tried once on each node (the worklists), not again in
    the confirming sweep; the misses are those of the final graph all the same."""
    from qdqgraph.trtsim import propagate as prop
    tried = []

    def counted(try_):
        def run(g, rules, trace, node):
            tried.append((try_.__name__, node.name))
            return try_(g, rules, trace, node)
        return run
    model = residual(quant_skip=False)
    monkeypatch.setattr(prop, "_TRIES", tuple(counted(t) for t in prop._TRIES))
    report = trtsim.simulate(model)
    assert report.steps == 0
    nodes = {name for _, name in tried}
    assert len(tried) == len(set(tried)) == 3 * len(nodes) > 0      # once per kind of rewrite and node
    q_dq = [n for n in io.load(model).graph.nodes if n.op in ("QuantizeLinear", "DequantizeLinear")]
    assert all(n.name in report.misses for n in q_dq if n.name in nodes)   # each tried Q/DQ says why it stayed


OPS = ("conv", "conv_float", "relu", "maxpool", "avgpool", "add", "mul", "concat", "transpose", "sigmoid", "flatten_gemm")


@st.composite
def qdq_graphs(draw):
    """Random DAGs of [1, 8, 4, 4] tensors with Q/DQ on random edges (two scales, so some are equal)."""
    g = QG("random", seed=draw(st.integers(0, 3)))
    tensors = [g.input("x", [1, 8, 4, 4])]
    n = draw(st.integers(1, 7))

    def pick(i, k):
        t = draw(st.sampled_from(tensors))
        if draw(st.booleans()):
            t = g.qdq(t, f"q{i}_{k}", draw(st.sampled_from((S1, S2))))
        return t

    for i in range(n):
        op = draw(st.sampled_from(OPS))
        a = pick(i, 0)
        if op == "conv":
            y = g.qconv(a, f"conv{i}")
        elif op == "conv_float":
            y = g.qconv(a, f"conv{i}", mode="float")
        elif op in ("relu", "sigmoid"):
            y = g.node(op.capitalize(), [a], name=f"{op}{i}")
        elif op == "maxpool":
            y = g.node("MaxPool", [a], name=f"maxpool{i}", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
        elif op == "avgpool":
            y = g.node("AveragePool", [a], name=f"avgpool{i}", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
        elif op in ("add", "mul"):
            y = g.node(op.capitalize(), [a, pick(i, 1)], name=f"{op}{i}")
        elif op == "concat":
            c = g.node("Concat", [a, pick(i, 1)], name=f"concat{i}", axis=1)
            y = g.qconv(g.qdq(c, f"cq{i}", S1) if draw(st.booleans()) else c, f"cconv{i}", cin=16)
        elif op == "transpose":
            y = g.node("Transpose", [a], name=f"transpose{i}", perm=[0, 1, 3, 2])
        else:
            f = g.node("Flatten", [g.node("GlobalAveragePool", [a], name=f"gap{i}")], name=f"flat{i}", axis=1)
            f = g.qdq(f, f"fq{i}", S2) if draw(st.booleans()) else f
            g.node("Gemm", [f, g.qweight(f"fc{i}", (4, 8)), g.const(f"fc{i}.b", np.zeros(4, np.float32))],
                   [f"out{i}"], name=f"fc{i}", transB=1)
            g.output(f"out{i}")
            continue
        tensors.append(y)
    if len(tensors) > 1 or not g.outputs:
        g.node("Identity", [tensors[-1]], ["y"], name="final")
        g.output("y")
    if draw(st.booleans()):                  # the unread tensors become outputs too (else they are dead)
        read = {i for n in g.nodes for i in n.input}
        for t in tensors[1:-1]:
            if t not in read:
                g.output(t)
    return g.model(13)


def _shuffled(model, seed):
    graph = gs.import_onnx(model)
    random.Random(seed).shuffle(graph.nodes)
    return graph


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(qdq_graphs(), st.integers(0, 100))
def test_random_graphs_settle_within_the_bound_and_do_not_depend_on_node_order(model, seed):
    report = trtsim.simulate(gs.import_onnx(model))
    assert report.steps <= default_bound(SimGraph.from_gs(gs.import_onnx(model)))
    report.final[0].check_index()       # the incremental index equals one built from scratch
    for n in model.graph.node:                # every node is in a layer, or was removed by a named rule
        owners = [x for x in report.layers if n.name in x.nodes]
        removed = [e["rule"] for e in report.eliminated if n.name in e["nodes"]]
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            assert len(owners) + len(removed) == 1, f"{n.name} in {len(owners)} layers\n{report.table()}"
        else:
            assert owners or removed, f"{n.name} vanished\n{report.table()}"
    assert trtsim.simulate(_shuffled(model, seed)).to_json() == report.to_json()


def test_resnet_report_does_not_depend_on_node_order():
    from qdqgraph.testing import models
    model = models.resnet18("qat")
    graph = io.load(model).graph
    reference = trtsim.simulate(graph).to_json()
    random.Random(7).shuffle(graph.nodes)
    assert trtsim.simulate(graph).to_json() == reference


def test_a_tensor_read_only_by_shape_keeps_its_producer():
    """A Shape puts no precision constraint on what it reads, but its producer is still computed:
    a conv whose output only a Shape reads (silero's decoder picks a branch from it) is a layer."""
    from onnx import TensorProto
    g = motifs.G("shape_only")
    x = g.input("x", ["n", 8, 4, 4])
    c = g.conv(x, 8, 8, "conv")
    g.node("Cast", [g.node("Shape", [c], name="shape")], ["y"], name="cast", to=TensorProto.FLOAT)
    g.output("y")
    report = trtsim.simulate(g.model())
    assert report.layer_of("conv") is not None, report.table()


def test_tensors_read_inside_an_if_body_keep_their_producers():
    """An If body reads outer tensors by name; their producers are not pruned as unused. An If
    whose condition is an input is read as the branch that runs (trtsim.branches): the then-branch,
    which the samples took and qdqgraph quantized, reads stem_relu through its own Q."""
    from test_fix_inputs import _if_model, _x
    m = _if_model("input")                      # If on an input: not inlined, bodies read stem_relu
    r = qdqgraph.quantize(m, {"x": _x(8)[:, None], "mode": np.ones(8, np.int64)}, high_precision="fp32")
    assert [n.op_type for n in r.model.graph.node].count("If") == 1
    rep = trtsim.simulate(r.model)
    nodes = {n for layer in rep.layers for n in layer.nodes}
    assert {"stem", "stem_relu", "then_conv", "head"} <= nodes and "else_conv" not in nodes
    stem = next(layer for layer in rep.layers if "stem" in layer.nodes)
    assert [p.precision for p in stem.outputs] == ["int8"]           # the branch's Q on stem_relu


def test_each_reformat_inside_is_listed_with_its_rule_and_the_cost_of_removing_it(tmp_path):
    """small_head with P14 off keeps one reformat inside (the Q after the float Softmax): the
    report names it, the rule that made it, the op before it and the FLOPs of the INT8 region behind it."""
    from qdqgraph.trtsim.regions import inner_reformats
    rules = tmp_path / "off.toml"
    rules.write_text('schema = 1\n[[region]]\nid = "P14-small-int8-region"\ndoc = "d"\nref = "r"\n'
                     'max_flops_share = 0\n')
    m = motifs.small_head()
    r = qdqgraph.quantize(m, motifs.sample_data(m), rules=[str(rules)], high_precision="fp32")
    found = inner_reformats(trtsim.simulate(r.model))
    assert [x["name"] for x in found] == ["softmax_out_q"]
    x = found[0]
    assert x["rule"] == "F6-reformat" and x["after"] == "Softmax" and x["direction"] == "float -> int8"
    assert 0 < x["region_flops_share"] < 0.001 and "flat + flat_out_dq + head.w_dq + head" in x["region_layers"]
    assert r.report.tensorrt["inner_reformats"] == found
    line = next(s for s in r.report.summary().splitlines() if "reformat(s) float -> int8" in s)
    assert "after Softmax, F6-reformat" in line and "softmax_out_q" in line
