"""insert's speed line, computed on the run's own graph stripped in place, says what simulating the
written model and its Q/DQ-free copy says."""
from __future__ import annotations

import pytest

import motifs
import qdqgraph
from qdqgraph.graph import io
from qdqgraph.passes.strip import strip_qdq
from qdqgraph.trtsim import simulate
from qdqgraph.trtsim.latency import DEFAULT_GPU, speed_line


@pytest.mark.parametrize("name", ["residual_add", "attention_block", "conv_bn_relu"])
@pytest.mark.parametrize("high_precision", ["fp16", "fp32"])
def test_speed_line_is_the_written_models(name, high_precision):
    m = motifs.ALL[name]()
    r = qdqgraph.quantize(m, motifs.sample_data(m), high_precision=high_precision)
    written = io.load(r.model).graph
    quantized = simulate(written)
    strip_qdq(written)
    assert r.report.tensorrt["speed"] == speed_line(quantized, simulate(written), DEFAULT_GPU["tensorrt"])
    assert "float engine" in "".join(r.report.profile.to_dict())


def test_the_float_engine_is_predicted_from_weight_shapes_alone():
    """The run strips its written graph with values=False: large weights become zeros of their shape
    that take no memory, and the prediction is the one from the dequantized values."""
    import numpy as np
    import onnx_graphsurgeon as gs
    m = motifs.attention_block()
    r = qdqgraph.quantize(m, motifs.sample_data(m))
    full, shapes = io.load(r.model).graph, io.load(r.model).graph
    strip_qdq(full)
    strip_qdq(shapes, values=False)
    big = [t for t in shapes.tensors().values() if isinstance(t, gs.Constant) and t.values.size >= 1024]
    assert big and all(t.values.strides == (0,) * t.values.ndim and not np.any(t.values) for t in big)
    assert simulate(full).to_dict() == simulate(shapes).to_dict()
