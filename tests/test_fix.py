"""`qdqgraph fix`: Q/DQ models of other tools rewritten to TensorRT's placement, their scales kept.

Each kind of move on a tiny graph with a QAT-style or onnxruntime-style placement built here; the
float graph kept (strip(fix(m)) == strip(m)); qdqgraph's own output left as it is; bad input
refused in one line through the CLI."""
import hashlib
import json
import subprocess
import sys

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import helper, numpy_helper

import motifs
import qdqgraph
from qdqgraph.graph import io
from qdqgraph.cli import main
from qdqgraph.errors import QdqError
from qdqgraph.passes.strip import strip_qdq
from qdqgraph.trtsim import lint
from conftest_helpers import files


# ---------------------------------------------------------------- building Q/DQ models of other tools

def place(model, edges, weights=(), qtype=np.int8, shared=False, weight_qdq=False):
    """`model` with a Q -> DQ on each consumer edge {(node, input index): scale or (scale, zero point)}
    (one pair per edge, as a QAT toolkit's per-module quantizers write them; `shared`: one per tensor
    and scale), and each weight {initializer: axis or None} quantized to INT8 from its max (an INT8
    constant -> DQ, or with `weight_qdq` the float weight -> Q -> DQ)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    nodes = {n.name: n for n in g.node}
    inits = {i.name: i for i in g.initializer}
    new, made = [], {}
    for k, ((node, i), sz) in enumerate(edges.items()):
        scale, zp = sz if isinstance(sz, tuple) else (sz, 0)
        n = nodes[node]
        t = n.input[i]
        if shared and (t, scale, zp) in made:
            n.input[i] = made[t, scale, zp]
            continue
        s, z = f"{t}_s{k}", f"{t}_z{k}"
        g.initializer.extend([numpy_helper.from_array(np.array(scale, np.float32), s),
                              numpy_helper.from_array(np.array(zp, qtype), z)])
        new += [helper.make_node("QuantizeLinear", [t, s, z], [f"{t}_q{k}"], name=f"{t}_Q{k}"),
                helper.make_node("DequantizeLinear", [f"{t}_q{k}", s, z], [f"{t}_dq{k}"], name=f"{t}_DQ{k}")]
        n.input[i] = made[t, scale, zp] = f"{t}_dq{k}"
    for w, axis in dict(weights).items():
        v = numpy_helper.to_array(inits[w]).astype(np.float32)
        shape = [-1 if d == axis else 1 for d in range(v.ndim)]
        amax = np.abs(v).max(axis=tuple(d for d in range(v.ndim) if d != axis)) if axis is not None else np.abs(v).max()
        sc = np.asarray(amax / 127, np.float32)
        attrs = {"axis": axis} if axis is not None else {}
        g.initializer.remove(inits[w])
        g.initializer.extend([numpy_helper.from_array(sc, f"{w}_ws"),
                              numpy_helper.from_array(np.zeros(sc.shape, np.int8), f"{w}_wz")])
        if weight_qdq:
            g.initializer.append(numpy_helper.from_array(v, f"{w}_float"))
            new.append(helper.make_node("QuantizeLinear", [f"{w}_float", f"{w}_ws", f"{w}_wz"], [f"{w}_wq"],
                                        name=f"{w}_Q", **attrs))
            src = f"{w}_wq"
        else:
            q = np.clip(np.rint(v / (sc.reshape(shape) if axis is not None else sc)), -128, 127).astype(np.int8)
            g.initializer.append(numpy_helper.from_array(q, f"{w}_int8"))
            src = f"{w}_int8"
        new.append(helper.make_node("DequantizeLinear", [src, f"{w}_ws", f"{w}_wz"], [w], name=f"{w}_DQ", **attrs))
    g.node.extend(new)
    graph = gs.import_onnx(m)
    graph.toposort()
    out = gs.export_onnx(graph)
    out.opset_import[0].version = max(13, out.opset_import[0].version)
    onnx.checker.check_model(out, full_check=True)
    return out


def qdq_params(model) -> dict:
    """tensor quantized -> (scale, zero point, axis) of its DQ, for every DQ of `model`."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    out = {}
    for n in model.graph.node:
        if n.op_type != "DequantizeLinear":
            continue
        src = n.input[0]
        q = producers.get(src)
        name = q.input[0] if q is not None and q.op_type == "QuantizeLinear" and q.input[0] not in inits \
            else n.output[0].removesuffix("_dequantized")
        axis = next((a.i for a in n.attribute if a.name == "axis"), None)
        out[name] = (inits[n.input[1]], inits[n.input[2]], axis if inits[n.input[1]].size > 1 else None)
    return out


def consumer_edges(model) -> set:
    """(consumer node, input index) of every edge that reads a DQ's output."""
    dq_out = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    return {(n.name, i) for n in model.graph.node for i, t in enumerate(n.input) if t in dq_out}


def structure(model, atol=None):
    """The stripped graph as a multiset of node fingerprints (op, attributes, and the fingerprints of
    what feeds each input: a graph input by name, a constant by shape), and its constants in
    fingerprint order: two graphs with the same ops connected the same way compare equal."""
    loaded = io.load(model)
    strip_qdq(loaded.graph)
    graph = loaded.graph
    graph.toposort()
    key: dict[str, str] = {t.name: f"input:{t.name}" for t in graph.inputs}
    nodes, consts = [], []
    for n in graph.nodes:
        ins = []
        for t in n.inputs:
            if not t.name:
                ins.append("")
            elif isinstance(t, gs.Constant):
                ins.append(f"const{tuple(t.values.shape)}")
            else:
                ins.append(key[t.name])
        attrs = sorted((k, repr(v)) for k, v in n.attrs.items() if not isinstance(v, gs.Graph))
        fp = hashlib.sha1(repr((n.op, attrs, ins)).encode()).hexdigest()[:16]
        for j, o in enumerate(n.outputs):
            key[o.name] = f"{fp}:{j}"
        nodes.append(fp)
        consts += [(fp, i, t.values) for i, t in enumerate(n.inputs) if isinstance(t, gs.Constant)]
    outputs = [key.get(t.name, t.name) for t in graph.outputs]
    consts.sort(key=lambda c: (c[0], c[1]))
    return sorted(nodes), outputs, consts


def assert_same_float_graph(a, b, atol: float):
    na, oa, ca = structure(a)
    nb, ob, cb = structure(b)
    assert na == nb and oa == ob
    assert len(ca) == len(cb)
    for (_, _, x), (_, _, y) in zip(ca, cb):
        assert x.shape == y.shape and x.dtype == y.dtype
        if np.issubdtype(x.dtype, np.floating):
            np.testing.assert_allclose(x.astype(np.float64), y.astype(np.float64), rtol=0, atol=atol)
        else:
            np.testing.assert_array_equal(x, y)


def without_clamps(model):
    """`model` with the Clips fix wrote for one-sided uint8 ranges bypassed."""
    loaded = io.load(model)
    g = loaded.graph
    for n in [n for n in g.nodes if n.op == "Clip" and n.name.endswith("_clamp")]:
        src, out = n.inputs[0], n.outputs[0]
        for c in list(out.outputs):
            c.inputs[next(i for i, t in enumerate(c.inputs) if t is out)] = src
        n.outputs.clear()
    g.cleanup().toposort()
    return io.to_model(loaded)


def codes(model) -> set:
    return {d.code for d in lint(io.load(model).graph)}


def moves(result, kind):
    return {m.tensor: m for m in result.report.moves if m.kind == kind}


def pool_gemm():
    """conv -> relu -> MaxPool -> Flatten -> Gemm: a scale before the pool serves the Gemm's input."""
    g = motifs.G("pool_gemm")
    x = g.input("x", ["n", 16, 8, 8])
    r = g.node("Relu", [g.conv(x, 16, 32, "conv")], name="relu")
    p = g.node("MaxPool", [r], name="pool", kernel_shape=[8, 8])
    f = g.node("Flatten", [p], name="flat")
    g.node("Gemm", [f, g.weight("fc.w", (32, 32)), g.weight("fc.b", (32,), 0.1)], ["y"], name="fc")
    g.output("y")
    return g.model()


def folded_relu(relu: bool):
    """conv -> [relu] -> conv: without the Relu, as onnxruntime leaves it when it folds the Relu into
    the uint8 Q that follows."""
    g = motifs.G("folded_relu")
    x = g.input("x", ["n", 16, 8, 8])
    y = g.conv(x, 16, 16, "stem")
    if relu:
        y = g.node("Relu", [y], name="relu")
    g.node("Conv", [y, g.weight("head.w", (16, 16, 1, 1))], ["y"], name="head", kernel_shape=[1, 1])
    g.output("y")
    return g.model()


# ---------------------------------------------------------------- each kind of move

def test_both_add_inputs_qat_drops_the_conv_side_and_keeps_scales():
    """pytorch-quantization's placement: every Conv input and both residual Add inputs, one Q/DQ per
    quantizer. The conv-side Add input is dropped (P6), the two pairs on the skip tensor become one
    with the larger scale, every other scale and the INT8 weights are written as they were."""
    m = motifs.residual_add()
    edges = {("stem", 0): 0.02, ("conv1", 0): 0.03, ("conv2", 0): 0.025, ("head", 0): 0.04,
             ("add", 0): 0.05, ("add", 1): 0.035}
    qat = place(m, edges, {"stem.w": 0, "conv1.w": 0, "conv2.w": 0, "head.w": 0})
    assert "QDQ202" in codes(qat)
    r = qdqgraph.fix(qat)
    assert not r.report.unchanged
    assert "QDQ202" not in codes(r.model) and not r.report.lint_after
    assert set(moves(r, "dropped")) == {"conv2_out"}
    assert "P6" in moves(r, "dropped")["conv2_out"].detail
    merged = moves(r, "merged")["stem_relu_out"]
    assert merged.amax_after == pytest.approx(0.035 * 127)
    before, after = qdq_params(qat), qdq_params(r.model)
    assert float(after["stem_relu_out"][0]) == np.float32(0.035)
    for t in ("x", "relu1_out", "relu2_out"):
        assert after[t][0] == before[t][0] and after[t][0].dtype == np.float32
        assert t in moves(r, "kept")
    inits = {i.name: numpy_helper.to_array(i) for i in r.model.graph.initializer}
    for w in ("stem.w", "conv1.w", "conv2.w", "head.w"):
        np.testing.assert_array_equal(after[w][0], before[w][0])
        assert after[w][2] == 0
        src = next(n.input[0] for n in r.model.graph.node if n.op_type == "DequantizeLinear" and n.output[0].startswith(w))
        np.testing.assert_array_equal(inits[src], numpy_helper.to_array(
            next(i for i in qat.graph.initializer if i.name == f"{w}_int8")))
    assert consumer_edges(r.model) == {("stem", 0), ("stem", 1), ("conv1", 0), ("conv1", 1), ("conv2", 0),
                                       ("conv2", 1), ("add", 1), ("head", 0), ("head", 1)}
    assert r.report.tensorrt_after["reformats_inside"] <= r.report.tensorrt_before["reformats_inside"]


def test_concat_inputs_with_unequal_scales_share_the_largest():
    """TensorFlow's placement around a Concat (each pool output and each pool input quantized on its
    own): one scale for the Concat group, the largest (P8); the Concat output takes it (R6); the
    MaxPool's input Q/DQ is dropped (MaxPool commutes), the AveragePool's kept."""
    m = motifs.concat_of_pools()
    edges = {("conv_a", 0): 0.03, ("conv_b", 0): 0.03, ("pool_a", 0): 0.02, ("pool_b", 0): 0.025,
             ("concat", 0): 0.02, ("concat", 1): 0.06}
    qat = place(m, edges, {"conv_a.w": 0, "conv_b.w": 0, "head.w": 0}, shared=True)
    assert "QDQ203" in codes(qat)
    r = qdqgraph.fix(qat)
    after = qdq_params(r.model)
    for t in ("pool_a_out", "pool_b_out", "concat_out"):
        assert float(after[t][0]) == np.float32(0.06), t
    assert moves(r, "merged")["pool_a_out"].amax_after == pytest.approx(0.06 * 127)
    assert moves(r, "moved")["concat_out"].source == "pool_b_out"
    assert set(moves(r, "dropped")) == {"relu_a_out"} and "MaxPool" in moves(r, "dropped")["relu_a_out"].detail
    assert float(after["relu_b_out"][0]) == np.float32(0.025)
    assert "QDQ203" not in codes(r.model) and r.report.tensorrt_after["reformats_inside"] == 0


def test_scale_carried_across_maxpool_and_flatten():
    """A scale on the MaxPool's input (a QAT export) is the scale the Gemm's input needs: carried
    across MaxPool and Flatten (R2), not calibrated."""
    m = pool_gemm()
    qat = place(m, {("conv", 0): 0.03, ("pool", 0): 0.045}, {"conv.w": 0, "fc.w": 0})
    r = qdqgraph.fix(qat)                          # no calibration data: none needed
    moved = moves(r, "moved")["flat_out"]
    assert moved.source == "relu_out" and moved.via == ["flat", "pool"]
    assert float(qdq_params(r.model)["flat_out"][0]) == np.float32(0.045)
    assert "fc.w" in moves(r, "converted")           # Gemm transB=0 wants axis 1 (P2), the export had axis 0
    assert qdq_params(r.model)["fc.w"][2] == 1


def test_uint8_asymmetric_converted_to_int8_symmetric():
    """onnxruntime's default: uint8 activations with a zero point. amax = max(|0 - zp|, |255 - zp|)
    x scale, scale = amax / 127, zero point int8 0; TensorRT rejects the original (C2, QDQ207)."""
    m = motifs.residual_add()
    edges = {("stem", 0): (0.02, 128), ("conv1", 0): (0.01, 0), ("add", 1): (0.01, 0), ("conv2", 0): (0.015, 3),
             ("add", 0): (0.03, 100), ("head", 0): (0.02, 0)}
    ort = place(m, edges, {"stem.w": 0, "conv1.w": 0, "conv2.w": 0, "head.w": 0}, qtype=np.uint8, shared=True)
    assert "QDQ207" in codes(ort)
    r = qdqgraph.fix(ort)
    after = qdq_params(r.model)
    assert float(after["x"][0]) == pytest.approx(128 * 0.02 / 127, rel=1e-6)
    assert float(after["relu1_out"][0]) == pytest.approx(252 * 0.015 / 127, rel=1e-6)
    assert float(after["stem_relu_out"][0]) == pytest.approx(255 * 0.01 / 127, rel=1e-6)
    assert all(v[1].dtype == np.int8 and not v[1].any() for v in after.values())
    conv = moves(r, "converted")
    assert {"x", "relu1_out", "stem_relu_out", "relu2_out"} <= set(conv) and "uint8 zero point 128" in conv["x"].detail
    assert "QDQ207" not in codes(r.model) and not r.report.lint_after
    assert r.report.clamps == []              # after a Relu the range's stop at 0 folded nothing


def test_a_relu_folded_into_a_uint8_range_is_kept_as_a_clip():
    """onnxruntime removes a Relu before an asymmetric uint8 Q (zero point 0 clamps at 0). The
    symmetric INT8 Q does not clamp, so fix writes the clamp as a Clip: the output follows the float
    model with its Relu, where a plain conversion would let the negative values through."""
    with_relu, ort_graph = folded_relu(True), folded_relu(False)
    data = motifs.sample_data(with_relu)
    import onnxruntime as ort
    peak = ort.InferenceSession(io.with_outputs(with_relu, ["relu_out"]).SerializeToString()).run(
        ["relu_out"], {"x": data["x"][0]})[0].max()
    s = float(peak) / 255
    ort_model = place(ort_graph, {("stem", 0): (0.03, 128), ("head", 0): (s, 0)}, {"stem.w": 0, "head.w": 0},
                      qtype=np.uint8)
    r = qdqgraph.fix(ort_model)
    clips = [n for n in r.model.graph.node if n.op_type == "Clip"]
    assert len(clips) == 1 and r.report.clamps[0]["min"] == 0 and r.report.clamps[0]["max"] is None
    def run(m):
        return ort.InferenceSession(m.SerializeToString()).run(["y"], {"x": data["x"][0]})[0]
    want, got = run(with_relu), run(r.model)
    cos = float((want * got).sum() / np.linalg.norm(want) / np.linalg.norm(got))
    assert cos > 0.99
    stripped = io.load(ort_model)
    strip_qdq(stripped.graph)
    plain = run(io.to_model(stripped))
    assert float((want * plain).sum() / np.linalg.norm(want) / np.linalg.norm(plain)) < cos


def test_missing_scale_refused_without_data_and_calibrated_with_it():
    """TensorFlow's "outputs and weights" placement leaves the model input float: the first Conv's
    input has no scale in the model. Without data: one QdqError naming it; with data: calibrated."""
    m = motifs.residual_add()
    edges = {("stem_relu", 0): 0.05, ("conv1", 0): 0.03, ("add", 1): 0.03, ("relu1", 0): 0.04, ("conv2", 0): 0.02,
             ("add", 0): 0.05, ("relu2", 0): 0.06, ("head", 0): 0.03}
    tf = place(m, edges, {"stem.w": 0, "conv1.w": 0, "conv2.w": 0, "head.w": 0}, shared=True)
    with pytest.raises(QdqError, match=r"no scale for 1 tensor\(s\) .*: x;"):
        qdqgraph.fix(tf)
    r = qdqgraph.fix(tf, calib=motifs.sample_data(m), method="max")
    added = moves(r, "added")["x"]
    assert "calibrated" in added.detail and r.report.calibrated["tensors"] == 1
    assert float(qdq_params(r.model)["x"][0]) == pytest.approx(added.amax_after / 127, rel=1e-6)
    assert {"stem_out", "conv1_out", "conv2_out", "add_out"} <= set(moves(r, "dropped"))
    assert "QDQ201" in codes(tf) and "QDQ201" not in codes(r.model)


def test_float_weights_through_qdq_keep_their_form_and_scales():
    m = motifs.conv_relu()
    qat = place(m, {("conv", 0): 0.05}, {"conv.w": 0}, weight_qdq=True)
    r = qdqgraph.fix(qat)
    assert r.report.unchanged and r.model is qat


# ---------------------------------------------------------------- the float graph is kept

@pytest.mark.parametrize("case", ["residual_qat", "concat_tf", "pool_gemm", "ort_uint8", "bn_unfolded", "ort_folded"])
def test_strip_of_fix_is_strip_of_the_model(case):
    """Only Q/DQ change: stripping the output gives the graph stripping the input gives (weights
    within half a quantization step where they were re-quantized), but for the Clips that keep a
    clamp a Relu folded into a uint8 range did."""
    w = {"stem.w": 0, "conv1.w": 0, "conv2.w": 0, "head.w": 0}
    if case == "residual_qat":
        m = place(motifs.residual_add(), {("stem", 0): 0.02, ("conv1", 0): 0.03, ("add", 0): 0.05, ("add", 1): 0.03,
                                          ("conv2", 0): 0.02, ("head", 0): 0.04}, w)
    elif case == "concat_tf":
        m = place(motifs.concat_of_pools(), {("conv_a", 0): 0.03, ("conv_b", 0): 0.03, ("pool_a", 0): 0.02,
                                             ("pool_b", 0): 0.02, ("concat", 0): 0.02, ("concat", 1): 0.06},
                  {"conv_a.w": 0})
    elif case == "pool_gemm":
        m = place(pool_gemm(), {("conv", 0): 0.03, ("pool", 0): 0.045}, {"conv.w": 0, "fc.w": 0})
    elif case == "ort_uint8":
        m = place(motifs.residual_add(), {("stem", 0): (0.02, 128), ("conv1", 0): (0.01, 0), ("add", 1): (0.01, 0),
                                          ("conv2", 0): (0.015, 3), ("add", 0): (0.03, 100), ("head", 0): (0.02, 0)},
                  w, qtype=np.uint8, shared=True)
    elif case == "ort_folded":
        m = place(folded_relu(False), {("stem", 0): (0.03, 128), ("head", 0): (0.01, 0)}, {"stem.w": 0}, qtype=np.uint8)
    else:
        m = place(motifs.conv_bn_relu(), {("conv", 0): 0.03, ("bn", 0): 0.1, ("relu", 0): 0.1}, {"conv.w": 0})
    r = qdqgraph.fix(m)
    assert not r.report.unchanged
    fixed = without_clamps(r.model)
    assert len(fixed.graph.node) == len(r.model.graph.node) - len(r.report.clamps)
    assert len(r.report.clamps) == (case == "ort_folded")
    assert_same_float_graph(fixed, m, atol=0.3 * 0.5 / 127 * 4)
    assert "BatchNormalization" in {n.op_type for n in r.model.graph.node} or case != "bn_unfolded"


# ---------------------------------------------------------------- qdqgraph's own output

@pytest.mark.parametrize("name,options", [("residual_add", {}), ("concat_of_pools", {}), ("se_block", {}),
                                          ("residual_add", {"high_precision": "fp32"}),
                                          ("fpn_upsample", {"high_precision": "fp32", "weights": "qdq"}),
                                          ("attention_block", {"precision": "fp8"})])
def test_fix_of_qdqgraph_output_changes_nothing(name, options):
    m = motifs.ALL[name]()
    q = qdqgraph.quantize(m, calib=motifs.sample_data(m), **options).model
    r = qdqgraph.fix(q)
    assert r.report.unchanged, [(x.kind, x.tensor, x.detail) for x in r.report.moves if x.kind != "kept"]
    assert r.model.SerializeToString() == q.SerializeToString()
    assert r.report.lint_after == r.report.lint_before


@pytest.mark.parametrize("precision,name,node,gone", [("int8", "residual_add", "head", {"relu2_out", "head.w"}),
                                                      ("fp8", "attention_block", "o_proj", {"ctx_merge_out", "wo"})])
def test_fix_rebuilds_qdqgraph_output_without_moving_the_rest(precision, name, node, gone):
    """A selection makes fix rebuild: the excluded node's Q/DQ go, every other site keeps its exact
    scale (INT8 and FP8 alike)."""
    m = motifs.ALL[name]()
    q = qdqgraph.quantize(m, calib=motifs.sample_data(m), high_precision="fp32", precision=precision,
                          int8_attention="on").model
    r = qdqgraph.fix(q, exclude_nodes=[f"^{node}$"])
    assert not r.report.unchanged and set(moves(r, "dropped")) == gone
    before, after = qdq_params(q), qdq_params(r.model)
    assert set(after) == set(before) - gone
    for t, (s, z, axis) in after.items():
        np.testing.assert_array_equal(s, before[t][0])
        assert z.dtype == before[t][1].dtype and axis == before[t][2], t
    assert r.config.precision == precision


# ---------------------------------------------------------------- bad input and the CLI

def run_cli(*argv):
    return subprocess.run([sys.executable, "-m", "qdqgraph", "fix", *map(str, argv)], capture_output=True, text=True,
                          check=False)


def one_line(p):
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1 and err[0].startswith("qdqgraph: error: "), p.stderr
    assert "Traceback" not in p.stderr
    return err[0]


def test_cli_writes_model_and_report(tmp_path):
    m = place(motifs.residual_add(), {("stem", 0): 0.02, ("conv1", 0): 0.03, ("add", 0): 0.05, ("add", 1): 0.03,
                                      ("conv2", 0): 0.02, ("head", 0): 0.04}, {"stem.w": 0, "conv1.w": 0})
    src = tmp_path / "qat.onnx"
    onnx.save(m, src)
    before = src.read_bytes()
    assert main(["fix", str(src), "--report", str(tmp_path / "r.json"), "--quiet"]) == 0
    out = tmp_path / "qat.fixed.onnx"
    onnx.checker.check_model(onnx.load(out), full_check=True)
    assert src.read_bytes() == before
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["counts"]["dropped"] == 1 and doc["lint"]["codes_before"] == {"QDQ202": 1}
    assert doc["lint"]["after"] == [] and doc["tensorrt"]["after"]["reformats_inside"] == 0
    assert {"kind", "tensor", "what", "detail"} <= set(doc["moves"][0])
    p = run_cli(src)                                   # the default output exists now
    assert "exists" in one_line(p) and "--force" in p.stderr
    p = run_cli(src, "--force", "--exclude-node", "^head$")
    assert p.returncode == 0 and "dropped activation relu2_out" in p.stdout and "linter findings: 1 -> 0" in p.stdout
    assert "also an input" in one_line(run_cli(src, "-o", src, "--force"))
    assert not [f for f in files(tmp_path) if f.endswith(".tmp")]


def test_cli_refuses_a_float_model(tmp_path):
    src = tmp_path / "float.onnx"
    onnx.save(motifs.residual_add(), src)
    line = one_line(run_cli(src))
    assert "no QuantizeLinear or DequantizeLinear" in line and "qdqgraph insert" in line
    assert files(tmp_path) == {"float.onnx"}


@pytest.mark.parametrize("bad", [0.0, float("nan"), -0.5])
def test_cli_refuses_a_bad_scale(tmp_path, bad):
    m = place(motifs.conv_relu(), {("conv", 0): 0.05}, {"conv.w": 0})
    for init in m.graph.initializer:
        if init.name.startswith("x_s"):
            init.CopyFrom(numpy_helper.from_array(np.array(bad, np.float32), init.name))
    src = tmp_path / "bad.onnx"
    onnx.save(m, src)
    line = one_line(run_cli(src))
    assert "has a scale of" in line and "finite and > 0" in line
    assert files(tmp_path) == {"bad.onnx"}


def test_cli_refuses_missing_scales_without_data(tmp_path):
    m = place(motifs.conv_relu(), {}, {"conv.w": 0})
    src = tmp_path / "w.onnx"
    onnx.save(m, src)
    line = one_line(run_cli(src))
    assert "no scale for 1 tensor(s)" in line and ": x;" in line and "--calib" in line
    np.savez(tmp_path / "d.npz", **motifs.sample_data(motifs.conv_relu()))
    p = run_cli(src, "--calib", tmp_path / "d.npz")
    assert p.returncode == 0 and "added activation x: calibrated" in p.stdout


def test_int4_weights_refused(tmp_path):
    m = motifs.gemm_transB()
    q = qdqgraph.quantize(m, precision="int4", int4_method="rtn", block_size=16, high_precision="fp32").model
    src = tmp_path / "i4.onnx"
    onnx.save(q, src)
    assert "block-quantized (INT4 weights)" in one_line(run_cli(src))


def test_a_clamp_keeps_the_bound_at_zero_and_a_whole_upper_bound():
    from qdqgraph.fix.facts import clamp_bounds
    assert clamp_bounds(0.0, 6.0000002) == (0.0, 6.0)           # ReLU6 folded: its 6 stays
    assert clamp_bounds(0.0, 3.7123) == (0.0, None)             # a calibrated maximum is not a bound


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("case,words", [
    ("int8_input", "which no QuantizeLinear makes"),
    ("q_to_output", "feeds a graph output, not a DequantizeLinear"),
    ("qlinear", "operator-style quantization"),
])
def test_models_fix_cannot_read_are_refused(case, words):
    s = numpy_helper.from_array(np.array(0.1, np.float32), "s")
    z = numpy_helper.from_array(np.array(0, np.int8), "z")
    f32 = onnx.TensorProto.FLOAT
    if case == "int8_input":
        m = _model([helper.make_node("DequantizeLinear", ["x", "s", "z"], ["y"], name="dq")],
                   [helper.make_tensor_value_info("x", onnx.TensorProto.INT8, [4])],
                   [helper.make_tensor_value_info("y", f32, [4])], [s, z])
    elif case == "q_to_output":
        m = _model([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], name="q")],
                   [helper.make_tensor_value_info("x", f32, [4])],
                   [helper.make_tensor_value_info("y", onnx.TensorProto.INT8, [4])], [s, z])
    else:
        m = _model([helper.make_node("QLinearMatMul", ["x", "s", "z", "x", "s", "z", "s", "z"], ["y"], name="mm")],
                   [helper.make_tensor_value_info("x", onnx.TensorProto.INT8, [4, 4])],
                   [helper.make_tensor_value_info("y", onnx.TensorProto.INT8, [4, 4])], [s, z])
    with pytest.raises(QdqError, match=words):
        qdqgraph.fix(m)


def test_cli_refuses_fix_input(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(place(motifs.conv_relu(), {("conv", 0): 0.05}, {"conv.w": 0}), src)
    assert main(["fix", str(src), "--fix-input", "x=1"]) == 2
