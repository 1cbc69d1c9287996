"""Paddle exports declare outputs the checker lets pass at their own opset and refuses once the Q/DQ
raise it: `shape {}` (rank 0) on a 4-D output, which comes back from the graph without a shape, and
a rank newer shape inference proves wrong. Both precisions of the float parts write a model that
passes the checker, instead of an internal error."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import qdqgraph


def paddle_like(opset=11, declared=()):
    """conv -> Relu -> conv -> Sigmoid at `opset`, the output declared with dims `declared` (empty:
    `shape {}`, as a Paddle export writes it)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32), "w1"),
             numpy_helper.from_array((rng.standard_normal((4, 8, 3, 3)) * 0.3).astype(np.float32), "w2")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="c1", pads=[1] * 4),
             helper.make_node("Relu", ["a"], ["b"], name="r"),
             helper.make_node("Conv", ["b", "w2"], ["c"], name="c2", pads=[1] * 4),
             helper.make_node("Sigmoid", ["c"], ["y"], name="s")]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    out.type.tensor_type.shape.SetInParent()
    for d in declared:
        out.type.tensor_type.shape.dim.add().dim_value = d
    graph = helper.make_graph(nodes, "paddle_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                    ["n", 3, 16, 16])], [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    onnx.checker.check_model(model)
    return model


def data(n=8):
    return {"x": np.random.default_rng(1).standard_normal((n, 1, 3, 16, 16)).astype(np.float32)}


@pytest.mark.parametrize("high_precision", ["fp32", "fp16"])
@pytest.mark.parametrize("declared", [(), (1, 4)])
def test_a_stale_output_declaration_is_written_as_a_model_the_checker_takes(high_precision, declared):
    out = qdqgraph.quantize(paddle_like(declared=declared), data(), high_precision=high_precision)
    onnx.checker.check_model(out.model)
    y = out.model.graph.output[0].type.tensor_type
    assert y.HasField("shape")
    if declared:                      # rank 2 proven wrong: the written model declares what inference finds
        assert len(y.shape.dim) == 4
        assert any("rejects the declared output shapes" in w for w in out.report.warnings)
    assert any(n.op_type == "QuantizeLinear" for n in out.model.graph.node)
