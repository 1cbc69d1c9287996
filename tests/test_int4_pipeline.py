"""insert --precision int4 end to end: which weights the rules choose, what is written, strip, and
the one-line errors for combinations that cannot work."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import motifs
import qdqgraph
from qdqgraph.graph import io
from qdqgraph.errors import QdqError
from qdqgraph.execution.runtime import DISABLED_OPTIMIZERS


def mlp(k=256, hidden=128):
    """LayerNorm -> fc1 (K=k) -> Relu -> fc2 (K=hidden): two weights that block sizes 128 and 64 divide."""
    g = motifs.G("int4_mlp")
    x = g.input("x", ["b", 8, k])
    n = g.node("LayerNormalization", [x, g.const("ln.s", np.ones(k, np.float32)),
                                      g.const("ln.b", np.zeros(k, np.float32))], name="ln", axis=-1)
    h = g.node("Relu", [g.node("MatMul", [n, g.weight("w1", (k, hidden))], name="fc1")], name="act")
    g.node("MatMul", [h, g.weight("w2", (hidden, 64))], ["y"], name="fc2")
    g.output("y")
    return g.model()


def _run(model, feed):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"],
                                disabled_optimizers=DISABLED_OPTIMIZERS).run(None, feed)[0]


def _cos(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_int4_writes_blocked_int4_weights_and_no_activation_qdq(method):
    m = mlp()
    data = motifs.sample_data(m)
    r = qdqgraph.quantize(m, data if method == "awq" else None, precision="int4", int4_method=method,
                          block_size=64)
    onnx.checker.check_model(r.model, full_check=True)
    assert io.opset_of(r.model) >= 21
    inits = {t.name: t for t in r.model.graph.initializer}
    dqs = [n for n in r.model.graph.node if n.op_type == "DequantizeLinear"]
    assert not any(n.op_type == "QuantizeLinear" for n in r.model.graph.node)   # activations stay float
    assert len(dqs) == 2
    for n in dqs:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["block_size"] == 64 and attrs["axis"] == 0
        assert inits[n.input[0]].data_type == onnx.TensorProto.INT4
        assert inits[n.input[2]].data_type == onnx.TensorProto.INT4
    assert r.report.int4["bytes_after"] < r.report.int4["bytes_before"] / 4
    # each DequantizeLinear carries the placement rule of its weight's site
    assert {n.name: {p.key: p.value for p in n.metadata_props}.get(io.RULE_KEY) for n in dqs} == \
        {"w1_int4_dequantize": "P1-matmul", "w2_int4_dequantize": "P1-matmul"}
    assert "INT4 weights: 2 MatMul/Gemm weights in blocks of 64" in r.report.summary()
    assert r.report.tensorrt["int4_weight_layers"] == 2 and "2 GEMMs with INT4 weights" in r.report.summary()
    feed = {"x": data["x"][0]}
    # 16 levels per block: about 20 dB per Gaussian weight, so two layers land near cosine 0.99
    assert _cos(_run(r.model, feed), _run(m, feed)) > 0.98


def test_strip_of_int4_gives_back_a_float_model():
    m = mlp()
    data = motifs.sample_data(m)
    r = qdqgraph.quantize(m, data, precision="int4")
    loaded = io.load(r.model)
    qdqgraph.strip_qdq(loaded.graph)
    stripped = io.to_model(loaded)
    onnx.checker.check_model(stripped, full_check=True)
    assert not any(n.op_type == "DequantizeLinear" for n in stripped.graph.node)
    feed = {"x": data["x"][0]}
    assert _cos(_run(stripped, feed), _run(m, feed)) > 0.98       # the INT4-rounded weights remain


def test_int4_rules_leave_a_gemv_and_excluded_nodes_float():
    m = mlp()
    r = qdqgraph.quantize(m, None, precision="int4", int4_method="rtn", exclude_nodes=("fc2",))
    int4 = next(p for p in r.report.passes if p.name == "int4_weights")
    assert set(int4["weights"]) == {"w1"}
    g = motifs.gemv()
    with pytest.raises(QdqError, match="excluded as a GEMV by P10-gemv"):
        qdqgraph.quantize(g, None, precision="int4", int4_method="rtn")      # P10-gemv keeps it float


def test_int4_refuses_what_cannot_work_in_one_line():
    m = mlp(k=96)
    with pytest.raises(QdqError, match="block"):
        qdqgraph.quantize(m, None, precision="int4", int4_method="rtn")             # 96 % 128 != 0
    with pytest.raises(QdqError, match="no MatMul or Gemm weight"):
        qdqgraph.quantize(motifs.conv_relu(), None, precision="int4", int4_method="rtn")
    with pytest.raises(QdqError, match="int4_method='awq' searches scales on calibration data"):
        qdqgraph.quantize(mlp(), None, precision="int4")          # the API's words, not the CLI's flags
    with pytest.raises(QdqError, match="not to precision='int4'"):
        qdqgraph.quantize(mlp(), motifs.sample_data(mlp()), precision="int4", accuracy_budget=30)
    with pytest.raises(QdqError, match="block_size= must be even"):
        qdqgraph.QuantizeConfig(precision="int4", block_size=33)


def test_cli_int4_without_data_and_bad_block_size(tmp_path):
    mp = tmp_path / "m.onnx"
    onnx.save(mlp(), mp)
    out = tmp_path / "o.onnx"
    cmd = [sys.executable, "-m", "qdqgraph", "insert", str(mp), "--precision", "int4", "--int4-method", "rtn",
           "-o", str(out), "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert out.exists()
    bad = subprocess.run(cmd[:-3] + ["--block-size", "96", "-o", str(tmp_path / "b.onnx")], capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "96" in bad.stderr and not (tmp_path / "b.onnx").exists()
    no_data = subprocess.run(cmd[:-5] + ["-o", str(tmp_path / "c.onnx")], capture_output=True, text=True)   # awq
    assert no_data.returncode == 2 and len(no_data.stderr.strip().splitlines()) == 1
    assert "--int4-method awq searches scales on calibration data" in no_data.stderr
    assert not (tmp_path / "c.onnx").exists()


def test_checks_name_a_block_size_that_does_not_divide_and_a_wrong_block_count():
    from qdqgraph.passes.check import qdq_violations
    r = qdqgraph.quantize(mlp(), None, precision="int4", int4_method="rtn", block_size=64)
    loaded = io.load(r.model)
    assert qdq_violations(loaded.graph) == []
    dq = next(n for n in loaded.graph.nodes if n.op == "DequantizeLinear")
    dq.attrs["block_size"] = 96                                    # K = 256
    assert any("block size 96 does not divide axis 0 of size 256" in v for v in qdq_violations(loaded.graph))
    dq.attrs["block_size"] = 128                                   # divides, but the scales hold 4 blocks
    assert any("4 scale blocks for axis 0 of size 256 in blocks of 128" in v for v in qdq_violations(loaded.graph))


def test_a_malformed_head_size_condition_is_a_rule_file_error(tmp_path):
    rules = tmp_path / "r.toml"
    rules.write_text('schema = 1\n[[exclude]]\nid = "x"\ndoc = "d"\nref = "r"\nop = "matmul"\n'
                     'when = ["attention:any", "not attention_head_size:16"]\n')
    m = motifs.attention_block()
    with pytest.raises(QdqError, match="attention_head_size takes LOW-HIGH/STEP"):
        qdqgraph.quantize(m, motifs.sample_data(m), rules=(str(rules),))


def test_lint_names_an_int4_block_size_that_does_not_divide():
    from qdqgraph.trtsim.lint import lint
    loaded = io.load(qdqgraph.quantize(mlp(), None, precision="int4", int4_method="rtn", block_size=64).model)
    assert "QDQ214" not in [d.code for d in lint(loaded.graph)]
    next(n for n in loaded.graph.nodes if n.op == "DequantizeLinear").attrs["block_size"] = 96
    found = [d for d in lint(loaded.graph) if d.code == "QDQ214"]
    assert found and "block size 96 does not divide axis 0 of size 256" in found[0].message
