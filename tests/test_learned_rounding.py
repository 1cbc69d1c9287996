"""Learned rounding (insert --learned-rounding): AdaRound per layer, written as INT8 weights with the
scales and axes placement chose. The tests that learn need PyTorch (the `learn` extra) and are
skipped without it; CI runs them in a step of their own with a PyTorch on the path (.ci/run)."""
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdqgraph import quantize
from qdqgraph.cli import main
from qdqgraph.errors import QdqError
from qdqgraph.recipes.conv_math import conv_geometry as _conv_geometry
from qdqgraph.recipes.learned_rounding import _patches, Target


def conv_model(seed: int = 0, group: int = 1) -> onnx.ModelProto:
    """x [1, 8, 12, 12] -> Conv 3x3 (16 outputs, padded, bias) -> y."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((16, 8 // group, 3, 3)).astype(np.float32) * 0.2
    b = rng.standard_normal(16).astype(np.float32) * 0.1
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1], group=group)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 12, 12])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_patches_are_the_convolution():
    """The rows a convolution is learned on are its receptive fields: rows @ W^T is the Conv's output
    at the positions they were taken from (strided, dilated, padded, grouped)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 6, 9, 11)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 2)).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], strides=[2, 1], dilations=[1, 2], pads=[1, 0, 2, 1], group=2)
    import onnxruntime as ort
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    class N:                                # the attributes _patches reads, as graphsurgeon gives them
        attrs = {"strides": [2, 1], "dilations": [1, 2], "pads": [1, 0, 2, 1], "group": 2}
    t = Target(N(), None, None)             # type: ignore[arg-type]
    _, _, _, outs = _conv_geometry(N, x.shape[2:], (3, 2))
    assert list(outs) == list(y.shape[2:])
    total = int(np.prod(outs))
    rows = _patches(t, (3, 2), x, total, np.random.default_rng(0))     # every position, in a random order
    wg = w.reshape(2, 2, -1)
    got = np.einsum("rgk,gok->rgo", rows, wg).reshape(total, 4)
    want = y[0].reshape(4, -1).T                                         # [positions, outputs]
    # the same set of output rows (the order is the sample's)
    assert np.allclose(np.sort(got, axis=0), np.sort(want, axis=0), atol=1e-4)


def smooth_images(n: int, seed: int = 1) -> np.ndarray:
    """Inputs with correlated neighbours and channels, as images and feature maps have (on
    uncorrelated inputs nearest rounding is already the best rounding of a layer's output)."""
    rng = np.random.default_rng(seed)
    low = rng.standard_normal((n, 8, 4, 4)).astype(np.float32)
    mix = rng.standard_normal((8, 8)).astype(np.float32) / 3 + np.eye(8, dtype=np.float32)
    x = np.einsum("dc,nchw->ndhw", mix, np.kron(low, np.ones((1, 1, 3, 3), np.float32)))
    return (x + 0.1 * rng.standard_normal(x.shape)).astype(np.float32)


def _weights(model: onnx.ModelProto) -> dict:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _structure(model: onnx.ModelProto) -> list:
    return [(n.op_type, n.name, list(n.input), list(n.output), [(a.name, helper.get_attribute_value(a))
                                                                for a in n.attribute]) for n in model.graph.node]


def _layer_error(model: onnx.ModelProto, data: np.ndarray, float_model: onnx.ModelProto) -> float:
    import onnxruntime as ort
    q = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    f = ort.InferenceSession(float_model.SerializeToString(), providers=["CPUExecutionProvider"])
    err = sig = 0.0
    for x in data:
        ref = f.run(None, {"x": x[None]})[0].astype(np.float64)
        got = q.run(None, {"x": x[None]})[0].astype(np.float64)
        err += float(np.sum((got - ref) ** 2))
        sig += float(np.sum(ref ** 2))
    return err / sig


@pytest.mark.parametrize("group", [1, 2])
def test_learned_rounding_lowers_the_layer_error_and_changes_only_weight_values(group):
    pytest.importorskip("torch")
    model = conv_model(group=group)
    data = smooth_images(48)
    nearest = quantize(model, {"x": data[:32]}, learned_rounding="off", high_precision="fp32")
    learned = quantize(model, {"x": data[:32]}, learned_rounding="on", high_precision="fp32")
    # the same graph: nodes, names, attributes, scales; only the INT8 weight values differ
    assert _structure(learned.model) == _structure(nearest.model)
    wn, wl = _weights(nearest.model), _weights(learned.model)
    assert wn.keys() == wl.keys()
    changed = [k for k in wn if not np.array_equal(wn[k], wl[k])]
    assert changed and all(wn[k].dtype == np.int8 and wl[k].dtype == np.int8 for k in changed)
    assert all(np.abs(wn[k].astype(int) - wl[k].astype(int)).max() == 1 for k in changed)   # up or down
    # the layer's output error against float, on samples it did not learn from, is lower
    held_out = data[32:]
    assert _layer_error(learned.model, held_out, model) < 0.97 * _layer_error(nearest.model, held_out, model)
    lr = learned.report.learned_rounding
    assert lr["learned"] == 1 and lr["sqnr_after_db"] > lr["sqnr_before_db"]
    assert "learned rounding: 1 of 1" in learned.report.summary()
    assert nearest.report.learned_rounding is None


def test_default_without_torch_rounds_to_nearest(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)        # import torch raises ImportError
    data = np.random.default_rng(1).standard_normal((8, 8, 12, 12)).astype(np.float32)
    r = quantize(conv_model(), {"x": data})
    assert r.report.learned_rounding is None


def test_auto_learns_small_models_only_and_the_default_is_off(monkeypatch):
    pytest.importorskip("torch")
    from qdqgraph.recipes import learned_rounding
    data = smooth_images(16)
    assert quantize(conv_model(), {"x": data}).report.learned_rounding is None      # off by default
    assert quantize(conv_model(), {"x": data}, learned_rounding="auto").report.learned_rounding is not None
    monkeypatch.setattr(learned_rounding, "AUTO_WORK", 1.0)          # every model is "large"
    r = quantize(conv_model(), {"x": data}, learned_rounding="auto")
    assert r.report.learned_rounding is None
    assert any("--learned-rounding on" in n for n in r.report.notes)


def test_on_without_torch_is_one_line_exit_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)
    mp, dp = tmp_path / "m.onnx", tmp_path / "c.npz"
    onnx.save(conv_model(), mp)
    np.savez(dp, x=np.zeros((2, 8, 12, 12), np.float32))
    assert main(["insert", str(mp), "--calib", str(dp), "--learned-rounding", "on"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert "pip install 'qdqgraph[learn]'" in err[0] and "PyTorch" in err[0]
    assert not (tmp_path / "m.qdq.onnx").exists()
    with pytest.raises(QdqError, match="PyTorch"):
        quantize(conv_model(), {"x": np.zeros((2, 8, 12, 12), np.float32)}, learned_rounding="on")


@pytest.mark.parametrize("options, words", [
    (dict(precision="fp8"), "INT8 weights"),
    (dict(weights="qdq"), "weights='qdq'"),
    (dict(learned_rounding="yes"), "unknown learned_rounding='yes'"),
])
def test_on_refuses_what_it_cannot_learn(options, words):
    options = {"learned_rounding": "on", **options}
    with pytest.raises(QdqError, match=words):
        quantize(conv_model(), {"x": np.zeros((2, 8, 12, 12), np.float32)}, **options)


def test_on_needs_real_data():
    pytest.importorskip("torch")
    with pytest.raises(QdqError, match="calibration data"):
        quantize(conv_model(), "random", learned_rounding="on")


def test_not_written_where_an_output_loses(monkeypatch):
    """The model-level check: a learned rounding that costs any output more than MAX_OUTPUT_LOSS_DB
    is not written, even where the outputs together gain (a small output drowned by a large one)."""
    pytest.importorskip("torch")
    from qdqgraph.recipes import learned_rounding
    real = learned_rounding.output_sqnr

    def one_output_worse(*args, **kwargs):
        (b, each_b), (a, each_a) = real(*args, **kwargs)
        return [(b, each_b), (b + 1.0, [x - 1.0 for x in each_b])]
    monkeypatch.setattr(learned_rounding, "output_sqnr", one_output_worse)
    data = smooth_images(16)
    r = quantize(conv_model(), {"x": data}, learned_rounding="on", high_precision="fp32")
    nearest = quantize(conv_model(), {"x": data}, learned_rounding="off", high_precision="fp32")
    assert all(np.array_equal(_weights(r.model)[k], v) for k, v in _weights(nearest.model).items())
    lr = r.report.learned_rounding
    assert lr["learned"] == 0 and "output y loses more than" in lr["dropped"]
    assert "not written (output y loses" in r.report.summary()
