"""Models as real exporters write them: PyTorch 1.2 at opset 9 (no node names, initializers also
listed as graph inputs), onnx.compose.merge_models outputs (one opset_import per merged graph) and
Paddle's placeholder dim names. Each is built here in code the way its exporter wrote it, and must
come out quantized, valid and loadable by onnxruntime."""
import importlib.util

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import qdqgraph
from qdqgraph.graph import io
from qdqgraph.cli import main
from qdqgraph.errors import QdqError
from qdqgraph.placement import plan_placement


# ---------------------------------------------------------------------- the vintages, built in code

def torch12_cnn(seed: int = 0) -> onnx.ModelProto:
    """A small residual CNN as PyTorch 1.2 exported it at opset 9: every node `name` empty, tensors
    named by numbers, a BatchNormalization, and every initializer also declared as a graph input."""
    rng = np.random.default_rng(seed)
    nodes, inits, counter = [], [], [0]

    def fresh():
        counter[0] += 1
        return str(counter[0])

    def weight(shape, scale=0.3):
        name = fresh()
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def node(op, inputs, **attrs):
        out = fresh()
        nodes.append(helper.make_node(op, inputs, [out], name="", **attrs))
        return out

    def conv(x, cin, cout):
        return node("Conv", [x, weight((cout, cin, 3, 3)), weight((cout,), 0.1)], kernel_shape=[3, 3],
                    pads=[1, 1, 1, 1], strides=[1, 1], dilations=[1, 1], group=1)

    x = "input.1"
    h = conv(x, 3, 16)
    bn = [weight((16,), 0.1) for _ in range(3)]
    var = fresh()
    inits.append(numpy_helper.from_array((1 + rng.random(16)).astype(np.float32), var))
    h = node("Relu", [node("BatchNormalization", [h, bn[0], bn[1], bn[2], var], epsilon=1e-5, momentum=0.9)])
    h = node("Relu", [conv(h, 16, 32)])
    r = conv(node("Relu", [conv(h, 32, 32)]), 32, 32)
    h = node("Relu", [node("Add", [r, h])])
    h = node("Relu", [conv(h, 32, 32)])
    h = node("Flatten", [node("GlobalAveragePool", [h])], axis=1)
    y = node("Gemm", [h, weight((10, 32)), weight((10,), 0.1)], alpha=1.0, beta=1.0, transB=1)
    graph_inputs = [helper.make_tensor_value_info(x, T.FLOAT, [1, 3, 32, 32])]
    graph_inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    g = helper.make_graph(nodes, "torch-jit-export", graph_inputs,
                          [helper.make_tensor_value_info(y, T.FLOAT, [1, 10])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 9)], producer_name="pytorch",
                          producer_version="1.2")
    m.ir_version = 4
    onnx.checker.check_model(m)
    return m


def _unsqueeze_block(prefix: str, seed: int) -> onnx.ModelProto:
    """Conv -> Relu -> Unsqueeze -> Squeeze at opset 12 (Unsqueeze's axes became an input at 13)."""
    w = numpy_helper.from_array(
        (np.random.default_rng(seed).standard_normal((16, 16, 3, 3)) * 0.2).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name=""),
             helper.make_node("Relu", ["c"], ["r"], name=""),
             helper.make_node("Unsqueeze", ["r"], ["u"], axes=[0], name=""),
             helper.make_node("Squeeze", ["u"], ["y"], axes=[0], name="")]
    g = helper.make_graph(nodes, prefix, [helper.make_tensor_value_info("x", T.FLOAT, [1, 16, 8, 8])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [1, 16, 8, 8])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 12)])
    m.ir_version = 7
    return onnx.compose.add_prefix(m, f"{prefix}/")


def merged_model() -> onnx.ModelProto:
    """Two opset-12 graphs joined by onnx.compose.merge_models: two default-domain opset_imports."""
    m = onnx.compose.merge_models(_unsqueeze_block("a", 0), _unsqueeze_block("b", 1), io_map=[("a/y", "b/x")])
    assert [o.version for o in m.opset_import if o.domain == ""] == [12, 12]
    return m


def paddle_cnn(dims=("?", 3, "?", "?"), out_dims=("?", 32, "?", "?")) -> onnx.ModelProto:
    """Two convs with Paddle's input [?, 3, ?, ?]: every dynamic dim named "?"."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 3, 3, 3)) * 0.3).astype(np.float32), "conv1.w"),
             numpy_helper.from_array((rng.standard_normal((32, 16, 3, 3)) * 0.3).astype(np.float32), "conv2.w")]
    nodes = [helper.make_node("Conv", ["x", "conv1.w"], ["c1"], pads=[1] * 4, name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "conv2.w"], ["c2"], pads=[1] * 4, name="conv2"),
             helper.make_node("Relu", ["c2"], ["y"], name="relu2")]
    g = helper.make_graph(nodes, "paddle", [helper.make_tensor_value_info("x", T.FLOAT, list(dims))],
                          [helper.make_tensor_value_info("y", T.FLOAT, list(out_dims))], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)])
    m.ir_version = 7
    return m


def _data(name: str, shape, n: int = 8, seed: int = 1) -> dict:
    return {name: np.random.default_rng(seed).standard_normal((n, *shape)).astype(np.float32)}


def _dims(vi) -> list:
    return [d.dim_param if d.WhichOneof("value") == "dim_param" else
            d.dim_value if d.WhichOneof("value") == "dim_value" else None for d in vi.type.tensor_type.shape.dim]


def _loads_everywhere(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model, full_check=True)
    ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


# ---------------------------------------------------------------------- PyTorch 1.2, opset 9

def test_unnamed_opset9_export_is_quantized():
    """Before, every decision keyed on '' and overwrote the last: 0 Q/DQ placed, exit 0."""
    m = torch12_cnn()
    r = qdqgraph.quantize(m, _data("input.1", (1, 3, 32, 32)))
    conv = r.report.ops["Conv"]
    assert conv == {"quantized": 5, "skipped": 0}
    assert r.report.activation_sites >= 5 and r.report.weight_sites == 5
    assert any("nodes without a name" in line for line in r.report.repairs)
    assert r.report.tensorrt["int8_flops_share"] > 0.9
    names = [n.name for n in r.model.graph.node]
    assert all(names) and len(set(names)) == len(names)
    assert r.report.batchnorm_folded == 1          # its parameters, listed as inputs too, are constants
    assert [i.name for i in r.model.graph.input] == ["input.1"]
    _loads_everywhere(r.model)
    assert all(n.name == "" for n in m.graph.node)  # the caller's model is left as it was


def test_unnamed_opset9_export_cli(tmp_path, capsys):
    mp, dp, out = tmp_path / "t12.onnx", tmp_path / "t12.npz", tmp_path / "q.onnx"
    onnx.save(torch12_cnn(), mp)
    np.savez(dp, **_data("input.1", (1, 3, 32, 32)))
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(out), "--verify", "0"]) == 0
    text = capsys.readouterr().out
    assert "repaired: " in text and "nodes without a name or with a repeated one were named" in text
    assert "placed: 0 activation" not in text and "INT8 FLOPs 0.0%" not in text
    q = onnx.load(out)
    assert sum(n.op_type == "DequantizeLinear" for n in q.graph.node) >= 10
    _loads_everywhere(q)


def test_initializers_listed_as_inputs_need_no_data_and_stay_out_of_the_inputs():
    loaded = io.load(torch12_cnn())
    assert [t.name for t in loaded.graph.inputs] == ["input.1"]
    from qdqgraph.prepare import model_inputs
    assert [s.name for s in model_inputs(loaded.graph)] == ["input.1"]


def test_name_nodes_is_unique_deterministic_and_keeps_existing_names():
    x = gs.Variable("x", np.float32, [1, 4])
    a, b, c, d = (gs.Variable(n, np.float32, [1, 4]) for n in "abcd")
    nodes = [gs.Node("Relu", "", inputs=[x], outputs=[a]),
             gs.Node("Relu", "Relu_0", inputs=[a], outputs=[b]),      # the name the first would get
             gs.Node("Relu", "act", inputs=[b], outputs=[c]),
             gs.Node("Relu", "act", inputs=[c], outputs=[d])]         # a repeat
    graph = gs.Graph(nodes=nodes, inputs=[x], outputs=[d], opset=13)
    assert io.name_nodes(graph) == 2
    assert [n.name for n in graph.nodes] == ["Relu_0_1", "Relu_0", "act", "act_3"]
    assert io.name_nodes(graph) == 0


def test_placement_refuses_an_unnamed_graph():
    """The plan keys on node names: a graph not loaded by qdqgraph is refused, not merged."""
    graph = gs.import_onnx(torch12_cnn())
    with pytest.raises(QdqError, match="has no name; placement addresses nodes by their names"):
        plan_placement(graph)


# ---------------------------------------------------------------------- onnx.compose.merge_models

def test_merged_model_opsets_are_merged_before_the_opset_is_raised(tmp_path, capsys):
    """Before, the opset was raised to 13 in one of two entries; onnxruntime then read Unsqueeze's
    opset-13 form at opset 12 and insert exited 2 blaming the model."""
    mp, dp, out = tmp_path / "merged.onnx", tmp_path / "d.npz", tmp_path / "q.onnx"
    onnx.save(merged_model(), mp)
    np.savez(dp, **_data("a/x", (1, 16, 8, 8)))
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(out), "--verify", "0"]) == 0
    text = capsys.readouterr().out
    assert "2 opset_import entries for the default domain (12, 12) merged into one at 12" in text
    q = onnx.load(out)
    assert [o.domain for o in q.opset_import].count("") == 1
    assert sum(n.op_type == "QuantizeLinear" for n in q.graph.node) >= 2
    _loads_everywhere(q)


def test_merged_model_in_fp8():
    """FP8 raises the opset to 19: the merged model converts consistently there too."""
    r = qdqgraph.quantize(merged_model(), _data("a/x", (1, 16, 8, 8)), precision="fp8")
    assert [o.version for o in r.model.opset_import if o.domain == ""] == [19]
    _loads_everywhere(r.model)


def test_opset_entries_at_different_versions_are_read_at_the_highest():
    m = merged_model()
    m.opset_import[0].version = 11
    lines = io.merge_opset_imports(m)
    assert [(o.domain, o.version) for o in m.opset_import] == [("", 12)]
    assert lines == ["2 opset_import entries for the default domain (11, 12) merged into one at 12; "
                     "its nodes are read at opset 12"]


# ---------------------------------------------------------------------- Paddle's "?" dims

def test_placeholder_dims_become_distinct_names(tmp_path, capsys):
    """Paddle names H and W "?": TensorRT would read them as one symbol and force H == W."""
    mp, dp, out = tmp_path / "p.onnx", tmp_path / "d.npz", tmp_path / "q.onnx"
    onnx.save(paddle_cnn(), mp)
    np.savez(dp, **_data("x", (1, 3, 16, 24)))
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(out), "--verify", "0"]) == 0
    assert "repaired: dims of 'x' renamed (? -> x_dim0, ? -> x_dim2, ? -> x_dim3)" in capsys.readouterr().out
    q = onnx.load(out)
    dims = _dims(q.graph.input[0])
    assert dims == ["x_dim0", 3, "x_dim2", "x_dim3"] and len(set(dims)) == 4
    out_dims = _dims(q.graph.output[0])
    assert "?" not in out_dims and out_dims[0] == "x_dim0"   # shape inference carries the input's batch
    named = [d for d in out_dims if isinstance(d, str)]
    assert len(set(named)) == len(named)
    assert sum(n.op_type == "QuantizeLinear" for n in q.graph.node) == 2
    _loads_everywhere(q)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert sess.run(None, {"x": np.zeros((1, 3, 16, 24), np.float32)})[0].shape == (1, 32, 16, 24)


def test_empty_and_repeated_dim_names_renamed_shared_ones_kept():
    """A name repeated within one input and an empty one are renamed; `batch`, shared by two
    inputs, is a symbol the exporter meant and stays."""
    m = paddle_cnn(dims=("batch", 3, "s", "s"))
    m.graph.input.append(helper.make_tensor_value_info("z", T.FLOAT, ["batch", ""]))
    m.graph.output.append(helper.make_tensor_value_info("z", T.FLOAT, ["batch", ""]))
    lines = io.unique_dim_names(m)
    assert _dims(m.graph.input[0]) == ["batch", 3, "s", "x_dim3"]
    assert _dims(m.graph.input[1]) == ["batch", "z_dim1"]
    assert len(lines) == 2 and "s -> x_dim3" in lines[0] and "(empty) -> z_dim1" in lines[1]


def test_a_renamed_dim_never_takes_a_name_the_model_uses():
    m = paddle_cnn(dims=("x_dim0", 3, "?", "?"))
    io.unique_dim_names(m)
    assert _dims(m.graph.input[0]) == ["x_dim0", 3, "x_dim2", "x_dim3"]
    m = paddle_cnn(dims=("?", 3, "x_dim0", "x_dim0"))
    io.unique_dim_names(m)
    dims = _dims(m.graph.input[0])
    assert dims[0] == "x_dim0_1" and len(set(dims)) == 4


def test_a_model_without_repairs_is_loaded_unchanged():
    m = paddle_cnn(dims=("n", 3, "h", "w"), out_dims=("n", 32, "h", "w"))
    before = m.SerializeToString()
    loaded = io.load(m)
    assert loaded.repairs == [] and m.SerializeToString() == before
    assert list(loaded.graph.inputs[0].shape) == ["n", 3, "h", "w"]


# ---------------------------------------------------------------------- a plan that quantizes little

def _files(folder):
    return {p.name for p in folder.iterdir()}


@pytest.fixture
def t12_files(tmp_path):
    mp, dp = tmp_path / "t12.onnx", tmp_path / "t12.npz"
    onnx.save(torch12_cnn(), mp)
    np.savez(dp, **_data("input.1", (1, 3, 32, 32)))
    return mp, dp


def test_a_float_plan_on_a_cnn_is_a_warning_naming_the_cause(t12_files, capsys):
    mp, dp = t12_files
    out = mp.parent / "q.onnx"
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(out), "--verify", "0", "--exclude-op", "Conv"]) == 0
    err = capsys.readouterr().err
    # the residual Adds beside the excluded convs get no Q/DQ either (P6 needs the branch's conv INT8;
    # they used to, as 2 standalone reformats that P14 then dropped), so the plan quantizes nothing
    assert "the plan runs no layer in INT8" not in err and len(err.splitlines()) == 1, err
    line = next(x for x in err.splitlines() if "INT8 FLOPs 0.0%" in x)
    assert line.startswith("qdqgraph: warning: the plan quantizes nothing (INT8 FLOPs 0.0%) on a "
                           "model with 5 Conv, 1 Gemm: every Conv excluded by --exclude-op Conv; every Gemm "
                           "skipped by P10-gemv")
    assert "--require-int8 PCT makes this an error" in line
    assert out.exists()


def test_a_quantized_cnn_gets_no_such_warning(t12_files, capsys):
    mp, dp = t12_files
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(mp.parent / "q.onnx"), "--verify", "0",
                 "--require-int8", "90"]) == 0
    assert "weighted FLOPs" not in capsys.readouterr().err


def test_require_int8_exits_2_and_writes_nothing(t12_files, capsys):
    mp, dp = t12_files
    before = _files(mp.parent)
    assert main(["insert", str(mp), "--calib", str(dp), "--verify", "0", "--exclude-op", "Conv",
                 "--report", str(mp.parent / "r.json"), "--require-int8", "50"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["qdqgraph: error: INT8 FLOPs 0.0% is below --require-int8 50 (every Conv excluded by "
                   "--exclude-op Conv); change what keeps the convolutions and GEMMs float (see the plan with "
                   "--report), or lower --require-int8"]
    assert _files(mp.parent) == before


def _if_model() -> onnx.ModelProto:
    """All the compute inside an If whose condition is an input (as VAD models are exported)."""
    rng = np.random.default_rng(0)

    def branch(name):
        w = numpy_helper.from_array((rng.standard_normal((32, 16, 3, 3)) * 0.2).astype(np.float32), f"{name}.w")
        return helper.make_graph([helper.make_node("Conv", ["x", w.name], [f"{name}_y"], pads=[1] * 4,
                                                   name=f"{name}_conv")],
                                 name, [], [helper.make_tensor_value_info(f"{name}_y", T.FLOAT, None)], [w])
    nodes = [helper.make_node("If", ["flag"], ["y"], name="pick", then_branch=branch("then"),
                              else_branch=branch("else"))]
    g = helper.make_graph(nodes, "vad", [helper.make_tensor_value_info("x", T.FLOAT, [1, 16, 8, 8]),
                                         helper.make_tensor_value_info("flag", T.BOOL, [])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [1, 32, 8, 8])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_compute_inside_if_branches_is_named_as_the_cause():
    """Without calibration data no sample chooses a branch, so both stay float: the warning names
    them. With data, the branch the samples take is quantized (qdqgraph.graph.branches) and nothing warns."""
    cache = {"x": 1.0}
    r = qdqgraph.quantize(_if_model(), calib_cache=cache)
    warning = next(w for w in r.report.warnings if "weighted FLOPs" in w or "quantizes nothing" in w)
    assert warning.startswith("the plan quantizes nothing (INT8 FLOPs 0.0%) on a model with 2 Conv: compute "
                              "inside If/Loop branches (2 Conv), which stay float")
    with pytest.raises(QdqError, match="below --require-int8 10 \\(compute inside If/Loop branches"):
        qdqgraph.quantize(_if_model(), calib_cache=cache, require_int8=10)
    data = _data("x", (1, 16, 8, 8)) | {"flag": np.ones(8, bool)}
    r = qdqgraph.quantize(_if_model(), data, require_int8=50)
    assert not [w for w in r.report.warnings if "weighted FLOPs" in w or "quantizes nothing" in w]
    assert r.report.tensorrt["int8_flops_share"] > 0.5


def test_a_model_without_convs_or_gemms_gets_a_note_not_a_warning():
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g",
                          [helper.make_tensor_value_info("x", T.FLOAT, [1, 8])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [1, 8])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    r = qdqgraph.quantize(m, _data("x", (1, 8)))
    assert not [w for w in r.report.warnings if "quantizes nothing" in w]
    assert r.report.notes and r.report.notes[0].startswith("the plan quantizes nothing")


@pytest.mark.parametrize("value, message", [          # the API's words (the CLI says --require-int8)
    (-1, "require_int8= must be at least 0, got -1"),
    (101, "require_int8= must be at most 100, got 101"),
    (float("nan"), "require_int8= must be a finite number"),
    ("50", "require_int8= must be a finite number"),
])
def test_require_int8_range(value, message):
    with pytest.raises(QdqError, match=message):
        qdqgraph.QuantizeConfig(require_int8=value)


def test_require_int8_refused_for_int4_weights(t12_files, capsys):
    mp, _ = t12_files
    assert main(["insert", str(mp), "--precision", "int4", "--int4-method", "rtn", "--require-int8", "10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--precision int4 quantizes weights only" in err[0]
    assert _files(mp.parent) == {"t12.onnx", "t12.npz"}


# ------------------------------------------------------------------ the compiler builds each vintage

@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="needs TensorRT for RTX")
@pytest.mark.parametrize("vintage", ["torch12", "merged", "paddle"])
def test_each_vintage_is_quantized_and_built_by_tensorrt_for_rtx(vintage, tmp_path, capsys):
    """The issue's must-show: the opset-9 unnamed-node export, the merge_models output and the "?"
    model are quantized, load in onnxruntime and compile with TensorRT for RTX, their quantized
    convolutions as INT8 kernels."""
    import json
    model, shape, shapes = {
        "torch12": (torch12_cnn(), (1, 3, 32, 32), "input.1:1x3x32x32"),
        "merged": (merged_model(), None, None),
        "paddle": (paddle_cnn(), (1, 3, 48, 64), "x:1x3x48x192"),
    }[vintage]
    name = model.graph.input[0].name
    if shape is None:
        dims = [d.dim_value or 1 for d in model.graph.input[0].type.tensor_type.shape.dim]
        shape, shapes = tuple(dims), f"{name}:" + "x".join(map(str, dims))
    data = {name: np.random.default_rng(1).standard_normal((8, *shape)).astype(np.float32)}
    out = qdqgraph.quantize(model, data).model
    _loads_everywhere(out)
    path = tmp_path / f"{vintage}.qdq.onnx"
    onnx.save(out, path)
    assert main(["build", str(path), "-o", str(tmp_path / "e.engine"), "--shapes", shapes,
                 "--layer-info", str(tmp_path / "l.json")]) == 0
    doc = json.loads((tmp_path / "l.json").read_text())
    assert doc["check"]["summary"]["quantized_kernels"] >= 1 and doc["check"]["summary"]["share"] == 1.0
