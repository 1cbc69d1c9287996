"""Placement rules: each rule id has a positive and a negative case (the negative one asserts the
reason), golden text per motif, and the structural guarantees of P5/P8."""
import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

import motifs
import qdqgraph
from qdqgraph import trtsim
from qdqgraph.graph import io
from qdqgraph.prepare import clean
from qdqgraph.placement import explain, plan_placement
from qdqgraph.testing.render import render, scales
from qdqgraph.placement import load_ruleset


def cleaned_graph(model):
    loaded = io.load(model)
    clean(loaded)
    return loaded.graph


# rule id -> (positive motif, node), (negative motif, node, words the reason must contain)
CASES = {
    "P10-softmax": (("attention", "softmax"), ("attention", "scale", "not in op class")),
    "P10-normalization": (("layernorm_mlp", "ln"), ("layernorm_mlp", "fc1", "not in op class")),
    "P10-layernorm-decomposed": (("layernorm_decomposed", "ln_sqrt"), ("layernorm_decomposed", "fc1", "on no chain")),
    "P10-gelu": (("attention", "gelu_erf"), ("attention", "o_proj", "on no chain")),
    "P10-attention-long": (("attention_long", "qk"), ("attention_block", "qk", "attention_length:512 holds")),
    "P10-gemv": (("gemv", "gemv"), ("gemm_transB", "fc", "is a GEMM")),
    "P10-tiny-conv": (("tiny_conv", "tiny"), ("tiny_conv", "narrow", "suits INT8 kernels")),
    "P10-conv-gemv": (("conv_gemv", "score"), ("conv_gemv", "feat", "32 output channels")),
    "P10-output-layer": (("pool_output", "gap"), ("pool_output", "conv", "not a graph output")),
    "P1-conv": (("conv_relu", "conv"), ("dynamic_weight_conv", "conv", "not a constant weight")),
    "P1-convtranspose": (("convtranspose", "up"), ("convtranspose_grouped", "up", "group is 2")),
    "P2-convtranspose-grouped": (("convtranspose_grouped", "up"), ("conv_relu", "conv", "not ConvTranspose")),
    "P1-gemm-transB": (("gemm_transB", "fc"), ("gemm", "fc", "transB is 0")),
    "P1-gemm": (("gemm", "fc"), ("gemm_transB", "fc", "transB is 1")),
    "P1-matmul": (("attention", "q_proj"), ("integer_path", "ids_mm", "integer path")),
    "P2-matmul-batched-weight": (("batched_weight", "bmm_w"), ("bmm", "bmm", "not a constant weight")),
    "P1-matmul-activations": (("bmm", "bmm"), ("bmm", "proj_a", "is a constant")),
    "P15-attention-scores": (("attention_mask", "qk"), ("attention_block", "pv", "not the scores one")),
    "P15-attention-context": (("attention_bias", "pv"), ("attention_fused_qkv", "o_proj", "not a batched GEMM")),
    "P6-residual-add": (("residual_add", "add"), ("integer_path", "sum", "conv pattern")),
    "P9-se-mul": (("se_block", "se_mul"), ("silu_conv", "silu_mul", "SiLU")),
    "P7-avgpool": (("concat_of_pools", "pool_b"), ("tiny_se_block", "gap", "feeds no quantized consumer")),
    "P8-concat": (("concat_of_pools", "concat"), ("concat_float", "concat", "feeds no quantized consumer")),
}


def test_every_rule_has_cases():
    ids = set(load_ruleset().by_id)
    assert ids == set(CASES), f"rules without cases: {ids - set(CASES)}; cases without rules: {set(CASES) - ids}"


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_positive(rule_id):
    (motif, node), _ = CASES[rule_id]
    graph = cleaned_graph(motifs.ALL[motif]())
    ok, why = explain(graph, node, rule_id)
    assert ok, f"{rule_id} should match {motif}/{node}: {why}"
    decision = plan_placement(graph).decisions.get(node)
    if decision is not None:  # the rule that decided is this one (rules earlier in order did not match)
        assert decision.rule == rule_id, decision


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_negative(rule_id):
    _, (motif, node, words) = CASES[rule_id]
    graph = cleaned_graph(motifs.ALL[motif]())
    ok, why = explain(graph, node, rule_id)
    assert not ok, f"{rule_id} should not match {motif}/{node}"
    assert words in why, why


GOLDEN_MOTIFS = ["conv_relu", "conv_bn_relu", "residual_add", "residual_projection", "concat_of_pools",
                 "se_block", "silu_conv", "attention", "gemm_transB", "convtranspose", "integer_path",
                 "tiny_conv", "paddle_constants", "attention_block", "attention_mask", "attention_fused_qkv"]


RULES_ONLY = {"output_aware": False, "int8_attention": "on"}


@pytest.mark.parametrize("name", GOLDEN_MOTIFS)
def test_golden(name, golden):
    """The placement rules' output (the accuracy recipes, which change weights and may return the
    attention to float on these random weights, are off: their tests are in test_recipes.py)."""
    m = motifs.ALL[name]()
    result = qdqgraph.quantize(m, motifs.sample_data(m), high_precision="fp32", **RULES_ONLY)
    golden(name, render(io.load(result.model).graph))


@pytest.mark.parametrize("name", ["attention_block", "attention_mask", "attention_fused_qkv", "attention_bias"])
def test_int8_attention_quantizes_the_four_gemm_inputs_and_fixes_the_probabilities(name):
    """TensorRT's INT8 attention: Q/DQ before both batched GEMMs (q, k; probabilities, v), the
    probabilities on the fixed range 1.0 (scale 1/127, whatever the data), the mask never quantized."""
    m = motifs.ALL[name]()
    result = qdqgraph.quantize(m, motifs.sample_data(m), high_precision="fp32", **RULES_ONLY)
    d = result.plan.decisions
    assert d["qk"].quantized and d["qk"].rule == "P15-attention-scores"
    assert d["pv"].quantized and d["pv"].rule == "P15-attention-context"
    probs = result.plan.sites["softmax_out"]
    assert probs.exact_amax == 1.0 and probs.edges == [("pv", 0)]
    scale = {n.input[0]: n.input[1] for n in result.model.graph.node if n.op_type == "QuantizeLinear"}
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in result.model.graph.initializer}
    assert float(inits[scale["softmax_out"]]) == np.float32(1.0 / 127)
    quantized = {t for t, s in result.plan.sites.items()}
    assert not quantized & {"mask_add_out", "scale_out", "mask_mul_out", "bias_add_out"}


def test_a_slim_se_block_stays_float():
    """The squeeze/excite convs of an 8 -> 2 -> 8 SE block stay float (P10-tiny-conv). Measured on
    ppocr_mobile_v2_cls: in INT8 they save one reformat but cost 3 dB of output SQNR (22.8 -> 19.8
    dB over its 48 samples) and one line of its test set."""
    graph = cleaned_graph(motifs.tiny_se_block())
    for node in ("se_reduce", "se_expand"):
        ok, why = explain(graph, node, "P10-tiny-conv")
        assert ok and "(< 16)" in why, why


def test_a_slim_se_block_leaves_its_pool_and_mul_float_too():
    """Its pool feeds a float conv and its gate comes from one, so neither the GlobalAveragePool nor
    the SE Mul can run INT8 (F4): quantizing them (as MO's "producer or consumer is quantizable" does)
    only adds standalone reformats. One is left: the Q in front of the INT8 head conv."""
    m = motifs.tiny_se_block()
    graph = cleaned_graph(m)
    ok, why = explain(graph, "gap", "P7-avgpool")
    assert not ok and "feeds no quantized consumer" in why, why
    ok, why = explain(graph, "se_mul", "P9-se-mul")
    assert not ok and "se_expand" in why and "runs in float" in why, why
    sim = trtsim.simulate(qdqgraph.quantize(m, motifs.sample_data(m), high_precision="fp32").model)
    inside = [x for x in sim.reformats if not x.at_graph_io]
    assert [x.nodes for x in inside] == [["se_mul_out_q"]], [x.nodes for x in inside]
    assert sim.summary["int8_flops_share"] > 0.99, sim.summary


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_an_upsampled_map_shares_its_source_scale_so_no_reformat_is_left(mode):
    """Q(Resize(x)) moves above a nearest Resize onto x (R2); it merges with x's own Q only if the
    two scales are equal, so placement puts both in one scale group. A linear Resize computes new
    values: no link, and it runs in float."""
    m = motifs.fpn_upsample(mode)
    plan = plan_placement(cleaned_graph(m))
    groups = {t: rep for rep, members in plan.groups().items() for t in members}
    linked = groups["coarse_relu_out"] == groups["up_out"] == groups["fine_relu_out"]
    assert linked == (mode == "nearest"), plan.groups()
    summary = trtsim.simulate(qdqgraph.quantize(m, motifs.sample_data(m), high_precision="fp32").model).summary
    if mode == "nearest":
        assert summary["reformats_inside"] == 0 and summary["float_layers"] == 0, summary


def test_a_residual_add_after_decomposed_hardswish_fuses_into_the_conv():
    """Both Add inputs end in x * clip(x + 3, 0, 6) / 6 after a conv: placement still sees conv
    branches (P6 quantizes the shorter one, the skip) and the simulator fuses Conv + PointWise +
    Add into one INT8 layer, leaving no reformat."""
    m = motifs.residual_hardswish()
    plan = plan_placement(cleaned_graph(m))
    assert plan.decisions["add"].rule == "P6-residual-add" and plan.decisions["add"].quantized
    skip = [t for t, s in plan.sites.items() if ("add", 0) in s.edges or ("add", 1) in s.edges]
    assert skip == ["hs1_div_out"], skip
    report = trtsim.simulate(qdqgraph.quantize(m, motifs.sample_data(m), high_precision="fp32").model)
    assert "add" in report.layer_of("conv_b2").nodes
    assert report.summary["reformats_inside"] == 0 and report.summary["float_layers"] == 0, report.table()


def test_residual_quantizes_skip_only():
    for name, skip in (("residual_add", "stem_relu_out"), ("residual_projection", "proj_out")):
        plan = plan_placement(cleaned_graph(motifs.ALL[name]()))
        quantized_inputs = {t for t, s in plan.sites.items() if ("add", 0) in s.edges or ("add", 1) in s.edges}
        assert quantized_inputs == {skip}, (name, quantized_inputs)


def test_one_shared_qdq_per_tensor():
    """P5: a tensor feeding several quantized consumers gets one Q and one DQ."""
    m = motifs.concat_of_pools()  # x feeds conv_a and conv_b
    g = io.load(qdqgraph.quantize(m, motifs.sample_data(m), high_precision="fp32").model).graph
    qs = [n for n in g.nodes if n.op == "QuantizeLinear" and n.inputs[0].name == "x"]
    assert len(qs) == 1
    dq_out = qs[0].outputs[0].outputs[0].outputs[0]
    assert sorted(n.name for n in dq_out.outputs) == ["conv_a", "conv_b"]


def test_concat_group_shares_one_scale():
    m = motifs.concat_of_pools()
    g = io.load(qdqgraph.quantize(m, motifs.sample_data(m), high_precision="fp32").model).graph
    s = scales(g)
    group = [s[f"{t}_q"] for t in ("pool_a_out", "pool_b_out", "concat_out")]
    assert all(v.dtype == np.float32 for v in group)
    assert group[0] == group[1] == group[2]
    assert s["x_q"] != group[0]


def test_weights_per_channel_with_axis_and_bias_float():
    for name, op, axis in (("conv_relu", "Conv", 0), ("gemm_transB", "Gemm", 0), ("gemm", "Gemm", 1),
                           ("convtranspose", "ConvTranspose", 1), ("attention", "MatMul", 1)):
        m = motifs.ALL[name]()
        g = io.load(qdqgraph.quantize(m, motifs.sample_data(m), high_precision="fp32").model).graph
        for n in g.nodes:
            if n.op != op or len(n.inputs) < 2 or not n.inputs[1].inputs:
                continue
            dq = n.inputs[1].inputs[0]
            if dq.op != "DequantizeLinear" or not isinstance(dq.inputs[0], gs.Constant):
                continue
            assert dq.attrs.get("axis") == axis, (name, n.name, dq.attrs)
            assert dq.inputs[0].values.dtype == np.int8
            assert dq.inputs[1].values.shape == (dq.inputs[0].values.shape[axis],)
            if len(n.inputs) > 2:
                assert isinstance(n.inputs[2], gs.Constant) and n.inputs[2].values.dtype == np.float32


def test_user_exclusions():
    graph = cleaned_graph(motifs.residual_add())
    sel = qdqgraph.Selection(exclude_ops=("Add",), exclude_nodes=("^conv1$",))
    plan = plan_placement(graph, selection=sel)
    assert plan.decisions["add"].rule == "user-exclude" and not plan.decisions["add"].quantized
    assert plan.decisions["conv1"].reason == "--exclude-node ^conv1$"
    assert plan.decisions["conv2"].quantized


def test_include_node_overrides_advisory_exclusion():
    graph = cleaned_graph(motifs.tiny_conv())
    assert not plan_placement(graph).decisions["tiny"].quantized
    plan = plan_placement(graph, selection=qdqgraph.Selection(include_nodes=("^tiny$",)))
    assert plan.decisions["tiny"].quantized and plan.decisions["tiny"].rule == "P1-conv"


def test_integer_tensors_never_quantized():
    """Integer tensors and their float derivatives get no Q/DQ, except a one-hot (Cast from bool):
    its 0/1 values are exact in INT8, so the MatMul it feeds runs INT8 (magika's first Dense)."""
    graph = cleaned_graph(motifs.integer_path())
    plan = plan_placement(graph)
    from qdqgraph.graph.view import GraphView
    view = GraphView(graph)
    for t in plan.sites:
        tensor = view.tensors[t]
        assert view.is_float(tensor) and (t not in view.integer_derived or t == "onehot_out"), t
    assert plan.decisions["onehot_mm"].quantized and not plan.decisions["ids_mm"].quantized
    assert "embed_out" in plan.sites or plan.decisions["dense"].quantized  # a Gather of a float table is real data


def test_a_rare_one_hot_keeps_amax_one_whatever_the_method():
    """A one-hot whose 1s are fewer than 0.01% of its values: percentile calibration would put its
    range below 1 and clip every 1; the graph fixes its range at exactly 1.0."""
    from onnx import TensorProto
    g = motifs.G("rare_one_hot")
    ids = g.input("ids", ["b", 4], TensorProto.INT64)
    onehot = g.node("Cast", [g.node("Equal", [g.node("Unsqueeze", [ids, g.const("ax", np.array([2], np.int64))], name="unsq"),
                                               g.const("vocab", np.arange(20000, dtype=np.int64))], name="eq")],
                    name="onehot", to=TensorProto.FLOAT)
    g.node("MatMul", [onehot, g.weight("w", (20000, 16))], ["y"], name="mm")
    g.output("y")
    m = g.model()
    data = {"ids": np.random.default_rng(0).integers(0, 20000, (4, 1, 4)).astype(np.int64)}
    for method in ("percentile", "entropy", "max"):
        r = qdqgraph.quantize(m, data, method=method, high_precision="fp32")
        s = {i.name: i for i in r.model.graph.initializer}["onehot_out_scale"]
        assert np.isclose(onnx.numpy_helper.to_array(s), 1.0 / 127), method
    # a calibration cache (say, merged from shards, whose states know nothing of the graph) with a
    # clipped range for the one-hot: insertion still uses the range the graph fixes
    r = qdqgraph.quantize(m, calib_cache={"onehot_out": 0.25}, high_precision="fp32")
    s = {i.name: i for i in r.model.graph.initializer}["onehot_out_scale"]
    assert np.isclose(onnx.numpy_helper.to_array(s), 1.0 / 127)


def _region_rule_file(tmp_path, share):
    f = tmp_path / "region.toml"
    f.write_text('schema = 1\n[[region]]\nid = "P14-small-int8-region"\ndoc = "d"\nref = "r"\n'
                 f'max_flops_share = {share}\n')
    return str(f)


def test_a_small_int8_region_behind_a_reformat_goes_back_to_float(tmp_path):
    """P14: the pooled Gemm head after a float Softmax holds under 0.1% of the FLOPs and could only
    be entered through a standalone Q; it runs float instead, and no reformat is left inside."""
    from qdqgraph.recipes.small_regions import predict
    loaded, plan = qdqgraph.prepare.prepare(motifs.small_head())
    for node in ("head", "gap"):
        d = plan.decisions[node]
        assert not d.quantized and d.rule == "P14-small-int8-region", d
    assert "softmax_out_q" in plan.decisions["head"].reason and "0.00% of the FLOPs" in plan.decisions["head"].reason
    assert plan.decisions["c2"].quantized
    assert predict(loaded.graph, plan).summary["reformats_inside"] == 0
    # turned off by a rule file (same id, share 0): the head is INT8 behind one standalone Q
    loaded, plan = qdqgraph.prepare.prepare(motifs.small_head(), rules=[_region_rule_file(tmp_path, 0)])
    assert plan.decisions["head"].quantized
    report = predict(loaded.graph, plan)
    assert report.summary["reformats_inside"] == 1 and report.layer_of("softmax_out_q").reformat


def test_a_region_above_the_share_or_forced_in_stays_int8(tmp_path):
    _, plan = qdqgraph.prepare.prepare(motifs.small_head(), rules=[_region_rule_file(tmp_path, 1e-6)])
    assert plan.decisions["head"].quantized          # the head holds more than 0.0001% of the FLOPs
    _, plan = qdqgraph.prepare.prepare(motifs.small_head(), include_nodes=("^head$",))
    assert plan.decisions["head"].quantized and plan.decisions["head"].rule == "P1-gemm"
    _, plan = qdqgraph.prepare.prepare(motifs.tiny_conv())   # its float -> INT8 head holds 5% of the FLOPs
    assert plan.decisions["head"].quantized


@pytest.mark.parametrize("share", ["2", '"half"', "-0.1", "true"])
def test_a_bad_region_share_is_a_one_line_error(tmp_path, share):
    with pytest.raises(qdqgraph.QdqError) as e:
        load_ruleset([_region_rule_file(tmp_path, share)])
    text = str(e.value).replace("`", "")
    assert "max_flops_share must be a number" in text and "region.toml:3" in text and "\n" not in text


def test_p14_reasons_give_the_share_at_the_calibration_shapes_where_it_differs(tmp_path):
    """P14 counts FLOPs at the declared shapes (a symbolic dimension as 1); where the data's shapes
    give the region another share, its reason says both (the Whisper decoder's per-token layers:
    0.03% declared, 1.05% at 64 tokens)."""
    import dataclasses
    from qdqgraph.recipes.small_regions import data_shares, predict, region_nodes
    from qdqgraph.trtsim.regions import costly_regions
    from qdqgraph.placement.ruleset import load_ruleset
    g = motifs.G("two_lengths")
    tok = g.input("tok", [1, "t", 32])              # a per-token layer: symbolic length
    mem = g.input("mem", [1, 64, 32])               # a fixed-length memory
    a = g.node("MatMul", [tok, g.weight("wt", (32, 32))], name="per_token")
    b = g.node("MatMul", [mem, g.weight("wm", (32, 32))], name="memory")
    g.output(a)
    g.output(b)
    loaded = io.load(g.model(17))
    shares = data_shares(loaded.graph, {"t": 64})
    assert shares(["per_token"]) == pytest.approx(0.5) and shares(["memory"]) == pytest.approx(0.5)
    assert data_shares(loaded.graph, {}) is None
    # the reason, from a prediction of small_head, with and without a differing share at the data's shapes
    loaded, plan = qdqgraph.prepare.prepare(motifs.small_head(), rules=[_region_rule_file(tmp_path, 0)])
    rule = dataclasses.replace(load_ruleset().region, max_flops_share=0.005)
    regions = costly_regions(predict(loaded.graph, plan), rule.max_flops_share)
    sel = qdqgraph.QuantizeConfig().selection(())
    same = region_nodes(regions, plan, rule, sel, "INT8", at_data=None)
    assert same and all("declared shapes" not in why for _, _, why in same)
    more = region_nodes(regions, plan, rule, sel, "INT8", at_data=lambda names: 0.0271)
    assert all("counted at the declared shapes, symbolic dimensions as 1 (2.71% at the calibration data's shapes)"
               in why for _, _, why in more)


@pytest.mark.parametrize("name", ["small_head", "attention_block", "residual_add", "conv_bn_relu", "se_block"])
@pytest.mark.parametrize("fmt_name", ["int8", "fp8"])
def test_p14_predicts_from_the_weights_types_and_shapes_as_from_their_values(name, fmt_name):
    """P14's prediction adds each quantized weight as zeros of its type and shape in no memory
    (planned_insertions' shapes_only: quantizing a 4.8 GB encoder's weights to predict its plan took
    most of P14's 25 s): the prediction is the one from the real insertion, and nothing else of the
    insertions differs, in INT8 and in FP8."""
    from qdqgraph.passes.insert import insert_qdq, planned_insertions
    from qdqgraph.precisions.formats import FP8, INT8
    from qdqgraph.recipes.small_regions import predict
    loaded, plan = qdqgraph.prepare.prepare(motifs.ALL[name]())
    fmt = FP8 if fmt_name == "fp8" else INT8
    ones = {rep: 1.0 for rep in plan.groups()}
    full = planned_insertions(loaded.graph, plan, ones, fmt=fmt)
    light = planned_insertions(loaded.graph, plan, ones, fmt=fmt, shapes_only=True)
    weights = [(a, b) for a, b in zip(full, light) if a.stored is not None]
    assert weights, name
    for a, b in zip(full, light):
        assert (a.source, a.scale_name, a.dq, a.q, a.axis) == (b.source, b.scale_name, b.dq, b.q, b.axis)
        assert np.array_equal(a.scale, b.scale) and a.scale.dtype == b.scale.dtype
    for a, b in weights:
        assert b.stored.dtype == a.stored.dtype and b.stored.shape == a.stored.shape
        assert b.stored.strides == (0,) * b.stored.ndim and not b.stored.flags.writeable
    if fmt is INT8:                               # what P14 predicts with
        copy = loaded.graph.copy()
        insert_qdq(copy, plan, ones, fmt=fmt)
        assert predict(loaded.graph, plan).to_dict() == trtsim.simulate(copy).to_dict()


def test_weight_scales_take_max_abs_without_a_copy():
    """weight_scales reads max |w| as max(max w, -min w): the same scales as from |w| itself, per
    tensor and per channel on every axis, for float32 and float16 weights."""
    from hypothesis import given, settings, strategies as st
    from hypothesis.extra.numpy import arrays
    from qdqgraph.passes.insert import weight_scales
    from qdqgraph.precisions.formats import FP8, INT8

    def reference(w, axis, fmt):
        a = np.abs(w.astype(np.float32))
        if axis is None:
            return np.asarray(fmt.scale_of(float(a.max()) if a.size else 0.0), dtype=np.float32)
        return fmt.scale_of(a.max(axis=tuple(d for d in range(w.ndim) if d != axis)) if w.ndim > 1 else a)

    floats = st.floats(-1e4, 1e4, allow_nan=False, width=16)

    @settings(max_examples=200, deadline=None)
    @given(arrays(st.sampled_from([np.float32, np.float16]), st.tuples(*[st.integers(1, 4)] * 3), elements=floats),
           st.sampled_from([None, 0, 1, 2]), st.sampled_from([INT8, FP8]))
    def check(w, axis, fmt):
        got, want = weight_scales(w, axis, fmt), reference(w, axis, fmt)
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    check()
    one = np.array([-3.0, 0.5, 2.0], np.float32)            # a 1-D weight with an axis: one scale each
    assert np.array_equal(weight_scales(one, 0), reference(one, 0, INT8))
