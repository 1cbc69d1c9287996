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


needs_fork = pytest.mark.skipif(not __import__("qdqgraph.execution.ahead", fromlist=["x"]).available(),
                                reason="no os.fork or a single core")


@needs_fork
@pytest.mark.parametrize("name", ["residual_add", "attention_block"])
def test_the_float_engine_predicted_in_a_child_gives_the_same_line(name, monkeypatch):
    """On a large graph the FP16 engine is predicted in a forked child while the parent predicts the
    quantized one: the line is the one predicted in the process, and a child did compute it."""
    import os
    from qdqgraph import prediction
    m = motifs.ALL[name]()
    data = motifs.sample_data(m)
    here = qdqgraph.quantize(m, data).report.tensorrt["speed"]
    parent, pids, real = os.getpid(), [], prediction.float_engine_ms

    def spied(*a):
        if os.getpid() == parent:
            pids.append(parent)
        return real(*a)
    monkeypatch.setattr(prediction, "LARGE_GRAPH_NODES", 0)
    monkeypatch.setattr(prediction, "float_engine_ms", spied)
    started = []
    real_start = prediction.ahead.start
    monkeypatch.setattr(prediction.ahead, "start", lambda fn: started.append(1) or real_start(fn))
    assert qdqgraph.quantize(m, data).report.tensorrt["speed"] == here
    assert started == [1] and pids == []      # computed in the child, not again in the parent


@needs_fork
@pytest.mark.parametrize("trouble", ["dies", "hangs"])
def test_a_child_that_dies_or_hangs_leaves_the_float_engine_to_the_parent(trouble, monkeypatch):
    """A child that dies, or hangs after the fork (a lock another thread held), is given up (the
    hung one after the wait, killed) and the FP16 engine predicted in the process: the same line,
    the same warnings, no hang."""
    import os
    import time
    from qdqgraph import prediction
    m = motifs.residual_add()
    data = motifs.sample_data(m)
    here = qdqgraph.quantize(m, data).report
    parent, real = os.getpid(), prediction.float_engine_ms

    def troubled(*a):
        if os.getpid() != parent:
            if trouble == "dies":
                os._exit(7)
            time.sleep(600)
        return real(*a)
    monkeypatch.setattr(prediction, "LARGE_GRAPH_NODES", 0)
    monkeypatch.setattr(prediction, "WAIT_MIN_S", 0.5)
    monkeypatch.setattr(prediction, "float_engine_ms", troubled)
    t = time.perf_counter()
    r = qdqgraph.quantize(m, data)
    assert r.report.tensorrt["speed"] == here.tensorrt["speed"] and r.report.warnings == here.warnings
    assert time.perf_counter() - t < 60


def test_no_float_engine_child_beside_a_busy_core_on_two(monkeypatch):
    """insert --verify's child holds a core: on two cores the FP16 engine is predicted in the
    process; on three it gets a child of its own."""
    from qdqgraph import prediction
    m = motifs.residual_add()
    loaded = io.load(qdqgraph.quantize(m, motifs.sample_data(m)).model)
    started = []
    monkeypatch.setattr(prediction, "LARGE_GRAPH_NODES", 0)
    monkeypatch.setattr(prediction.ahead, "start", lambda fn: started.append(1))
    for n, busy, want in ((2, 1, []), (2, 0, [1]), (3, 1, [1])):
        started.clear()
        monkeypatch.setattr(prediction, "cores", lambda: n)
        assert prediction._float_ahead(loaded, "tensorrt", DEFAULT_GPU["tensorrt"], busy) is None
        assert started == want, (n, busy)
