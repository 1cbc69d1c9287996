"""The shortcuts that keep large graphs fast give what the general path gives."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import motifs
from qdqgraph.graph import io
from qdqgraph.passes import constants


def _folded(model, monkeypatch, shortcut: bool) -> tuple[bytes, dict]:
    loaded = io.load(model)
    with monkeypatch.context() as m:
        if not shortcut:
            m.setattr(constants, "_foldable", lambda graph: True)
        r = constants.fold_constants(loaded.graph)
    return io.to_model(loaded).SerializeToString(), r.counts


def test_a_graph_with_nothing_to_fold_is_left_as_graphsurgeon_leaves_it(monkeypatch):
    for name in ("residual_add", "conv_bn_relu", "se_block", "concat_of_pools"):
        m = motifs.ALL[name]()
        assert not constants._foldable(io.load(m).graph), name
        assert _folded(m, monkeypatch, True) == _folded(m, monkeypatch, False), name


def _with(node_op: str) -> onnx.ModelProto:
    """x -> Relu, beside a node that folding changes: a Constant, a Shape of x, or an Add of constants."""
    inits = [numpy_helper.from_array(np.ones((2, 3), np.float32), "c")]
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu")]
    if node_op == "Constant":
        nodes.append(helper.make_node("Constant", [], ["k"], name="k", value=numpy_helper.from_array(np.ones(3, np.float32))))
        nodes.append(helper.make_node("Add", ["y", "k"], ["z"], name="add"))
    elif node_op == "Shape":
        nodes.append(helper.make_node("Shape", ["x"], ["s"], name="shape", start=1))   # [3]
        nodes.append(helper.make_node("Cast", ["s"], ["sf"], name="cast", to=TensorProto.FLOAT))
        nodes.append(helper.make_node("Add", ["y", "sf"], ["z"], name="add"))
    else:
        nodes.append(helper.make_node("Add", ["c", "c"], ["cc"], name="consts"))
        nodes.append(helper.make_node("Add", ["y", "cc"], ["z"], name="add"))
    outs = [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_what_folding_changes_takes_graphsurgeons_path(monkeypatch):
    for op in ("Constant", "Shape", "constant inputs"):
        m = _with(op)
        assert constants._foldable(io.load(m).graph), op
        data, counts = _folded(m, monkeypatch, True)
        assert counts["folded"] >= 1, op
        assert (data, counts) == _folded(m, monkeypatch, False), op
