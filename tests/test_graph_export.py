"""qdqgraph.graph.export writes what gs.export_onnx writes, byte for byte, or hands the graph back
(None) for graphsurgeon to write: graphs built here with subgraphs, attributes of every kind,
constants of every element type qdqgraph writes, external-data stubs and sparse initializers."""
import logging

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from qdqgraph.graph import export as fast_export
from qdqgraph.graph import io


def _old(graph: gs.Graph) -> onnx.ModelProto:
    """What to_model wrote before graph/export.py: 4-bit constants packed, then graphsurgeon."""
    io._pack_4bit(graph)
    return gs.export_onnx(graph, do_type_check=True)


def _same(build) -> onnx.ModelProto:
    """Exports two graphs `build` makes alike, one each way; the bytes must agree."""
    want = _old(build())
    graph = build()
    got = fast_export.export(graph)
    assert got is not None, "export handed back a graph it should write"
    assert got.SerializeToString() == want.SerializeToString()
    # a second export of the same graph (its LazyValues renamed, opsets filled in) writes it again
    again = fast_export.export(graph)
    assert again is not None and again.SerializeToString() == want.SerializeToString()
    return got


def _stub(name: str) -> onnx.TensorProto:
    """An initializer whose data lies outside the proto (as to_model_and_weights writes them)."""
    t = onnx.TensorProto()
    t.name, t.data_type, t.data_location = "stale-" + name, onnx.TensorProto.FLOAT, onnx.TensorProto.EXTERNAL
    t.dims.extend([64, 3])
    for k, v in (("location", "*/_ORT_MEM_ADDR_/*"), ("offset", "0"), ("length", "768")):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def _constants() -> list[gs.Constant]:
    rng = np.random.default_rng(0)
    arrays = {
        "w_f32": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
        "w_f16": rng.standard_normal((4, 3)).astype(np.float16),
        "w_bf16": rng.standard_normal((5,)).astype(ml_dtypes.bfloat16),
        "w_i8": rng.integers(-128, 127, (4, 3)).astype(np.int8),
        "zp_u8": np.array(7, dtype=np.uint8),
        "w_i4": rng.integers(-8, 7, (3, 5)).astype(ml_dtypes.int4),
        "w_u4": rng.integers(0, 15, (1,)).astype(ml_dtypes.uint4),
        "w_f8": rng.standard_normal((2, 2)).astype(ml_dtypes.float8_e4m3fn),
        "w_f8e5": rng.standard_normal((3,)).astype(ml_dtypes.float8_e5m2),
        "s_i64": np.array(3, dtype=np.int64),
        "mask": np.array([True, False]),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "f64": np.arange(3, dtype=np.float64),
    }
    out = [gs.Constant(k, v) for k, v in arrays.items()]
    out.append(gs.Constant("w_default_loc", np.ones(2, np.float32), data_location=onnx.TensorProto.DEFAULT))
    out.append(gs.Constant("w_stub", gs.ir.tensor.LazyValues(_stub("w_stub"))))
    out.append(gs.Constant("w_lazy", gs.ir.tensor.LazyValues(
        onnx.numpy_helper.from_array(np.arange(6, dtype=np.int32).reshape(2, 3), "other-name"))))
    return out


def _attrs(branch: gs.Graph) -> dict:
    """One of every attribute value graphsurgeon writes."""
    return {
        "i": 3, "zero": 0, "neg": -1, "flag": True, "np_i": np.int64(9), "f": 0.5, "np_f": np.float32(1.25),
        "s": "relu", "b": b"\x00bytes", "empty_s": "", "ints": [1, 2, 3], "tuple": (4, 5), "floats": [0.5, 1.0],
        "mixed": [1, 2.5], "np_floats": np.array([0.25, 0.75], dtype=np.float32), "strings": ["a", b"b"],
        "to": np.float16, "to_bf16": ml_dtypes.bfloat16,
        "value": gs.Constant("attr_t", np.arange(4, dtype=np.float32)),
        "lazy_value": gs.Constant("attr_lazy", gs.ir.tensor.LazyValues(
            onnx.numpy_helper.from_array(np.ones((2,), np.int64), "x"))),
        "f8_value": gs.Constant("attr_f8", np.ones(3, ml_dtypes.float8_e4m3fn)),
        "body": branch,
    }


def _branch(name: str, outer: list[gs.Tensor], depth: int) -> gs.Graph:
    """A subgraph that reads outer-scope tensors, holds a constant of its own, has outputs with and
    without types, and (depth > 0) a subgraph of its own."""
    own = gs.Constant(f"{name}_own", np.full((2,), depth, np.float32))
    mid = gs.Variable(f"{name}_mid", dtype=np.float32, shape=[2, "M"])
    untyped = gs.Variable(f"{name}_untyped")
    shaped_only = gs.Variable(f"{name}_shape_only", shape=[None, 2])
    out = gs.Variable(f"{name}_out", dtype=np.float32)
    nodes = [gs.Node("Add", f"{name}_add", inputs=[*outer, own], outputs=[mid]),
             gs.Node("Relu", f"{name}_relu", inputs=[mid], outputs=[untyped, shaped_only])]
    if depth:
        inner = _branch(f"{name}_in", [mid], depth - 1)
        nodes.append(gs.Node("If", f"{name}_if", attrs={"then_branch": inner, "else_branch": inner},
                             inputs=[untyped], outputs=[out]))
    else:
        nodes.append(gs.Node("Identity", inputs=[untyped], outputs=[out]))
    trip = gs.Variable(f"{name}_iter", dtype=np.int64, shape=())
    return gs.Graph(nodes=nodes, inputs=[trip], outputs=[out, gs.Variable(f"{name}_free", shape=[1])],
                    name=f"{name}_graph", doc_string="a branch" if depth else "")


def _full(import_domains: bool = True) -> gs.Graph:
    consts = _constants()
    x = gs.Variable("x", dtype=np.float32, shape=["N", 3, None, 4])
    scalar = gs.Variable("scalar", dtype=np.int64, shape=())
    unshaped = gs.Variable("unshaped", dtype=np.float16)
    nodes, prev = [], x
    for i, c in enumerate(consts):
        typed = i % 3 > 0                  # untyped ones get no value info (a shape alone: an error)
        nxt = gs.Variable(f"t{i}", dtype=np.float32 if typed else None, shape=[i, "B"] if typed and i % 2 else None)
        nodes.append(gs.Node("Mul", f"n{i}", inputs=[prev, c], outputs=[nxt], domain="" if i % 2 else None))
        prev = nxt
    branch = _branch("b", [prev, consts[0]], depth=2)
    y = gs.Variable("y", dtype=ml_dtypes.float8_e4m3fn, shape=[1])
    nodes.append(gs.Node("Custom", "custom", attrs=_attrs(branch), inputs=[prev, gs.Variable.empty(), scalar],
                         outputs=[y], domain="com.example"))
    nodes.append(gs.Node("Loop", "", attrs={"body": _branch("loop", [y, x], depth=1)}, inputs=[scalar, y],
                         outputs=[gs.Variable("z", dtype=np.int8, shape=[2, 2])]))
    # shapes None and [None] of one type: two different value infos
    nodes.append(gs.Node("Other", "other", inputs=[unshaped], domain="ai.example",
                         outputs=[gs.Variable("w", dtype=onnx.TensorProto.INT4), gs.Variable("u", dtype=np.float16, shape=[None])]))
    nodes.append(gs.Node("NoDomain", inputs=[x], outputs=[gs.Variable("v", dtype=np.bool_, shape=[])], domain=None))
    graph = gs.Graph(nodes=nodes, inputs=[x, scalar, unshaped], outputs=[nodes[-3].outputs[0], nodes[-1].outputs[0], y, *nodes[-2].outputs],
                     name="full", doc_string="every case", opset=17,
                     import_domains=[onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("com.example", 2)]
                     if import_domains else None, producer_name="p", producer_version="1")
    graph.ir_version = 9 if import_domains else None
    return graph


def test_a_graph_of_every_case_writes_the_same_bytes():
    model = _same(_full)
    assert len(model.graph.sparse_initializer) == 0 and model.graph.node[-3].attribute[-1].g.node
    # the int4 constants went in packed, the stub stayed a stub
    names = {t.name: t for t in model.graph.initializer}
    assert len(names["w_i4"].raw_data) == 8 and names["w_stub"].data_location == onnx.TensorProto.EXTERNAL


def test_opset_imports_made_when_the_graph_has_none():
    model = _same(lambda: _full(import_domains=False))
    assert [o.domain for o in model.opset_import][0] == ""


def test_sparse_initializers_and_graph_io_constants():
    def build():
        sparse = onnx.helper.make_sparse_tensor(
            onnx.numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "sv"),
            onnx.numpy_helper.from_array(np.array([0, 3], np.int64), "si"), [4])
        sparse.values.name = "sp"
        sp = gs.Constant("sp", gs.ir.tensor.SparseValues(sparse))
        c = gs.Constant("c_io", np.ones((2, 2), np.float32))
        out = gs.Variable("o", dtype=np.float32, shape=[4])
        return gs.Graph(nodes=[gs.Node("Add", "a", inputs=[sp, c], outputs=[out])], inputs=[c], outputs=[out, c],
                        opset=13)
    model = _same(build)
    assert len(model.graph.sparse_initializer) == 1


def test_duplicate_node_names_warn_and_write_the_same(caplog):
    def build():
        a, b, c = (gs.Variable(n, dtype=np.float32, shape=[1]) for n in "abc")
        return gs.Graph(nodes=[gs.Node("Relu", "dup", inputs=[a], outputs=[b]),
                               gs.Node("Relu", "dup", inputs=[b], outputs=[c])], inputs=[a], outputs=[c], opset=13)
    _same(build)


@pytest.mark.parametrize("case", ["function", "attribute_ref", "export_dtype", "sequence", "untyped_io", "np_dim",
                                  "untyped_value_info", "bool_list"])
def test_cases_left_to_graphsurgeon(case):
    """Where it would not write what graphsurgeon writes, export returns None; to_model then
    writes the graph (or raises) as graphsurgeon does."""
    x = gs.Variable("x", dtype=np.float32, shape=[2])
    y = gs.Variable("y", dtype=np.float32, shape=[2])
    node = gs.Node("Relu", "r", inputs=[x], outputs=[y])
    graph = gs.Graph(nodes=[node], inputs=[x], outputs=[y], opset=18)
    if case == "function":
        f = gs.Function("f", domain="local", nodes=[], inputs=[], outputs=[])
        graph.functions.append(f)
    elif case == "attribute_ref":
        node.attrs["alpha"] = gs.Node.AttributeRef("alpha", float)
    elif case == "export_dtype":
        c = gs.Constant("c", np.ones(2, np.float32), export_dtype=onnx.TensorProto.BFLOAT16)
        node.inputs.append(c)
    elif case == "sequence":
        y.type = "sequence_type"
    elif case == "untyped_io":
        y.dtype = None
    elif case == "np_dim":
        x.shape = [np.int64(2)]
    elif case == "bool_list":
        node.attrs["flags"] = [True, False]
    elif case == "untyped_value_info":
        mid = gs.Variable("mid", shape=[2])
        node.outputs = [mid]
        graph.nodes.append(gs.Node("Relu", "r2", inputs=[mid], outputs=[y]))
    assert fast_export.export(graph) is None
    try:
        want = gs.export_onnx(graph, do_type_check=True).SerializeToString()
    except Exception as e:              # graphsurgeon refuses it: so does to_model
        with pytest.raises(type(e)):
            io.to_model(io.Loaded(graph), tidy=False)
        return
    got = io.to_model(io.Loaded(graph), tidy=False)
    assert got.graph.SerializeToString() == onnx.ModelProto.FromString(want).graph.SerializeToString()


def test_to_model_writes_the_same_bytes_as_before(monkeypatch):
    def to_model(fast: bool) -> bytes:
        graph = _full()
        if not fast:
            monkeypatch.setattr(fast_export, "export", lambda g: None)
        try:
            return io.to_model(io.Loaded(graph, metadata_props={"k": "v"}), provenance={"n0": "rule"},
                               tidy=False).SerializeToString()
        finally:
            monkeypatch.undo()
    assert to_model(True) == to_model(False)
