"""If branches chosen by an input (a voice-activity model's `sr`): each branch is quantized from
the calibration samples that take it, a branch no sample takes stays float with a note, the
simulator counts the branch that runs, and the written model passes the checker and runs in
onnxruntime for both rates."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import qdqgraph
from qdqgraph.graph import io
from qdqgraph.cli import main
from qdqgraph.execution.runtime import DISABLED_OPTIMIZERS
from qdqgraph.testing.branches import vad_if_calib, vad_if_model
from qdqgraph.trtsim import simulate


def _ops(graph: onnx.GraphProto, op: str) -> list[onnx.NodeProto]:
    return [n for n in graph.node if n.op_type == op]


def _branch(model: onnx.ModelProto, key: str) -> onnx.GraphProto:
    node = _ops(model.graph, "If")[0]
    return next(a.g for a in node.attribute if a.name == key)


def _sqnr(model, float_model, calib, rate) -> float:
    """Output SQNR (dB) against float over the samples of `calib` that have sample rate `rate`
    (all of them when none has), fed at that rate."""
    q = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"],
                             disabled_optimizers=DISABLED_OPTIMIZERS)
    f = ort.InferenceSession(float_model.SerializeToString(), providers=["CPUExecutionProvider"])
    sig = err = 0.0
    xs = calib["x"][calib["sr"] == rate] if (calib["sr"] == rate).any() else calib["x"]
    for x in xs[:16]:
        feed = {"x": x, "sr": np.array(rate, np.int64)}
        want, got = f.run(None, feed)[0], q.run(None, feed)[0]
        sig += float(np.sum(want.astype(np.float64) ** 2))
        err += float(np.sum((want.astype(np.float64) - got) ** 2))
    return float("inf") if err == 0 else 10 * np.log10(sig / err)


@pytest.fixture(scope="module")
def one_rate():
    m, calib = vad_if_model(), vad_if_calib(64, sr=(16000,))
    return m, calib, qdqgraph.quantize(m, calib)


def test_the_branch_every_sample_takes_is_quantized_by_default(one_rate):
    m, calib, r = one_rate
    assert r.report.tensorrt["int8_flops_share"] > 0.5          # was 0.0 %, with a --fix-input hint
    then, other = _branch(r.model, "then_branch"), _branch(r.model, "else_branch")
    assert len(_ops(then, "QuantizeLinear")) == 3 and len(_ops(then, "DequantizeLinear")) == 6
    assert not _ops(other, "QuantizeLinear")
    notes = "\n".join(r.report.notes)
    assert "then-branch is quantized on the 64 calibration samples that take it" in notes
    assert "else-branch stays float: no calibration sample takes it" in notes
    assert "--fix-input" not in notes and not any("quantizes nothing" in w for w in r.report.warnings)


def test_the_written_model_passes_the_checker_and_runs_for_both_rates(one_rate):
    m, calib, r = one_rate
    onnx.checker.check_model(r.model, full_check=True)
    assert _sqnr(r.model, m, calib, 16000) > 30             # the quantized branch
    assert _sqnr(r.model, m, calib, 8000) > 40              # the float branch (FP16 Sigmoid after it)


def test_mixed_rates_quantize_each_branch_from_its_own_samples():
    m = vad_if_model()
    calib = vad_if_calib(64, sr=(16000, 8000))
    calib["x"][calib["sr"] == 8000] *= 4                    # the 8 kHz samples are 4x louder
    r = qdqgraph.quantize(m, calib)
    scales = {}
    for key in ("then_branch", "else_branch"):
        body = _branch(r.model, key)
        inits = {t.name: onnx.numpy_helper.to_array(t) for t in body.initializer}
        q = [n for n in _ops(body, "QuantizeLinear") if n.input[0] == "x"]
        assert len(q) == 1, key
        scales[key] = float(inits[q[0].input[1]].astype(np.float32))
    assert 3 < scales["else_branch"] / scales["then_branch"] < 5   # each branch saw its own inputs
    assert r.report.tensorrt["int8_flops_share"] > 0.5
    assert sum("calibration samples that take it" in n for n in r.report.notes) == 2
    onnx.checker.check_model(r.model, full_check=True)
    assert _sqnr(r.model, m, calib, 16000) > 30 and _sqnr(r.model, m, calib, 8000) > 30


def test_the_simulator_counts_the_branch_that_runs():
    float_model = vad_if_model()
    sim = simulate(io.load(float_model).graph)
    assert sim.summary["int8_flops_share"] == 0.0
    assert any("then.conv2/Conv" in "+".join(layer.nodes) for layer in sim.layers)   # the then-branch, on a tie
    only_8k = qdqgraph.quantize(float_model, vad_if_calib(32, sr=(8000,)), high_precision="fp32")
    sim = simulate(io.load(only_8k.model).graph)
    names = "+".join("+".join(layer.nodes) for layer in sim.layers)
    assert "else.conv2/Conv" in names and "then.conv2/Conv" not in names      # the branch the data took
    assert sim.summary["int8_flops_share"] > 0.5


def test_without_calibration_data_the_branches_stay_float_with_a_note():
    r = qdqgraph.quantize(vad_if_model(), calib_cache={"x": 1.0})
    assert not _ops(_branch(r.model, "then_branch"), "QuantizeLinear")
    assert any("branches stay float (no calibration data" in n for n in r.report.notes)


HAVE_RTX = importlib.util.find_spec("tensorrt_rtx") is not None


@pytest.mark.skipif(not HAVE_RTX, reason="needs TensorRT for RTX: pip install 'qdqgraph[rtx]'")
def test_tensorrt_for_rtx_builds_the_if_with_int8_convolutions_in_the_branches(tmp_path):
    """The compiler keeps the If (a conditional jump over both branches, compiled ahead of time);
    the convolutions of each quantized branch are INT8 kernels, those of a float branch float."""
    m = vad_if_model()
    for rates, int8_branches in (((16000,), {"then"}), ((16000, 8000), {"then", "else"})):
        out, engine, layers = tmp_path / "q.onnx", tmp_path / "q.engine", tmp_path / "l.json"
        onnx.save(qdqgraph.quantize(m, vad_if_calib(32, sr=rates)).model, out)
        assert main(["build", str(out), "-o", str(engine), "--shapes", "x:1x1x512,sr:", "--layer-info",
                     str(layers), "--force"]) == 0
        compiled = json.loads(layers.read_text())["Layers"]
        assert {"cjmp", "jmp"} <= {layer["Kind"] for layer in compiled}
        convs = {layer["Name"].rsplit("^", 1)[-1].split("/")[0]: layer["Inputs"][0]["Format/Datatype"]
                 for layer in compiled if layer["Kind"] == "convolution"}
        assert set(convs) == {"then.conv2", "then.conv3", "else.conv1", "else.conv2"}, convs
        assert {name for name, dtype in convs.items() if dtype == "Int8"} == \
            {name for name in convs if name.split(".")[0] in int8_branches}


def test_outer_qdq_names_do_not_repeat_a_branchs():
    """An If branch quantized first (its Q of an outer tensor x named x_quantized) and the outer
    graph's Q of the same x: the outer one takes another name, so the model keeps one name per
    output (was: the ONNX checker's 'x_quantized has been used as output names multiple times', an
    internal error; found by tests/test_fuzz.py)."""
    import fuzzgraphs
    model = fuzzgraphs.random_model(["conv", "conv_bn", "if_branch"], 0, False)
    r = qdqgraph.quantize(model, fuzzgraphs.sample_data(model), weights="qdq", high_precision="fp32",
                          output_aware=False)
    onnx.checker.check_model(r.model, full_check=True)
