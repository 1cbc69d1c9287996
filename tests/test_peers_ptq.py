"""benchmarks/peers_ptq.py: the parts that do not need the peers installed."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from conftest_helpers import benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "peers_ptq.py"


def _module():
    return benchmark("peers_ptq")


def test_two_value_fields_keep_the_new_raw_data():
    p = _module()
    old, new = np.array([1.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32)
    t = numpy_helper.from_array(new, "w")          # raw_data: the new values
    t.float_data.extend(old.tolist())               # the stale copy beside them
    const = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(new, "c"))
    const.attribute[0].t.float_data.extend(old.tolist())
    g = helper.make_graph([const, helper.make_node("Add", ["w", "c"], ["y"])], "g", [],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])], [t])
    m = helper.make_model(g)
    note = p.one_value_field(m)
    assert note == {"repaired_two_value_fields": ["w", "c"]}
    onnx.checker.check_model(m)
    assert numpy_helper.to_array(m.graph.initializer[0]).tolist() == [3.0, 4.0]


def test_table_takes_the_last_row_of_a_rerun(tmp_path):
    row = {"model": "m", "tool": "quark-cle", "quantize": {"ok": True, "seconds": 1.0},
           "holdout": {"outputs": {"y": {"sqnr_db": 10.0, "cosine": 0.9}}}, "int8_flops_share": 1.0,
           "trt_rtx": {"ok": False, "error": "TensorRT could not build the engine: IBuilder::buildSerializedNetwork: "
                                             "Error Code 4: API Usage Error (x)"}}
    rerun = dict(row, holdout={"outputs": {"y": {"sqnr_db": 20.0, "cosine": 0.99}}})
    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps(row) + "\n" + json.dumps(rerun) + "\n")
    out = subprocess.run([sys.executable, str(SCRIPT), "--table", str(f)], capture_output=True, text=True,
                         check=True).stdout
    body = [x for x in out.splitlines() if x.startswith("| m |")]
    assert len(body) == 1 and "20.0 / 0.99000" in body[0]
    assert "no: API Usage Error (x)" in body[0]


def test_unknown_tool_is_one_line_exit_2():
    p = subprocess.run([sys.executable, str(SCRIPT), "--tools", "nosuch"], capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "nosuch" in p.stderr


def test_unknown_set_is_one_line_exit_2():
    p = subprocess.run([sys.executable, str(SCRIPT), "--set", "zoo,nosuch"], capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "nosuch" in p.stderr


def test_a_model_is_looked_up_in_the_chosen_sets_only(tmp_path):
    for root, name in ((tmp_path / "zoo", "cnn"), (tmp_path / "tfm", "bert")):
        for sub, ext in (("models", "onnx"), ("data", "npz")):
            (root / sub).mkdir(parents=True)
            (root / sub / f"{name}.{ext}").write_bytes(b"")
    base = [sys.executable, str(SCRIPT), "--zoo", str(tmp_path / "zoo"), "--tfm", str(tmp_path / "tfm"),
            "--out", str(tmp_path / "out"), "--tools", "qdqgraph"]
    p = subprocess.run([*base, "--set", "tfm", "--only", "cnn"], capture_output=True, text=True)
    assert p.returncode == 2 and "cnn" in p.stderr and str(tmp_path / "tfm") in p.stderr
    a = type("A", (), {"roots": {"cnn": tmp_path / "zoo", "bert": tmp_path / "tfm"}})
    model, calib, data = _module().files("bert", a)
    assert (model, calib, data) == (tmp_path / "tfm" / "models" / "bert.onnx", tmp_path / "tfm" / "calib" / "bert.npz",
                                    tmp_path / "tfm" / "data" / "bert.npz")


def test_table_shows_the_transformer_evaluators_metric(tmp_path):
    row = {"model": "vit_s_focus", "tool": "qdqgraph", "quantize": {"ok": True, "seconds": 3.0},
           "holdout": {"outputs": {"y": {"sqnr_db": 30.0, "cosine": 0.999}}}, "int8_flops_share": 0.5,
           "trt_rtx": {"ok": True}}
    task = {"tool": "qdqgraph", "task_metrics": {"vit_s_focus": {
        "float_task": {"mean_iou": 0.8, "iou>=0.5": 0.9}, "other_task": {"mean_iou": 0.75, "iou>=0.5": 0.85},
        "agreement": {"mask_iou_float_vs_other": 0.93}}}}
    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps(row) + "\n" + json.dumps(task) + "\n")
    out = subprocess.run([sys.executable, str(SCRIPT), "--table", str(f)], capture_output=True, text=True,
                         check=True).stdout
    body = [x for x in out.splitlines() if x.startswith("| vit_s_focus |")]
    assert len(body) == 1
    assert "mean_iou (0.800)" in body[0] and "0.750 (0.930)" in body[0] and "50.0%" in body[0]


def test_remeasure_keeps_the_last_quantize_record_of_a_written_model(tmp_path):
    f = tmp_path / "rows.jsonl"
    rows = [{"model": "m", "tool": "aimet-cle", "quantize": {"ok": True, "seconds": 5.0}},
            {"model": "m", "tool": "aimet-cle", "quantize": {"ok": True, "seconds": 7.0}},
            {"model": "n", "tool": "aimet-cle", "quantize": {"ok": False, "error": "x"}},
            {"tool": "aimet-cle", "task_metrics": {}}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    saved = _module().saved_quantize(f)
    assert saved == {("m", "aimet-cle"): {"ok": True, "seconds": 7.0}}
    assert _module().saved_quantize(tmp_path / "none.jsonl") == {}


def _matmul_models(tmp_path):
    """A float MatMul and the same with its input and weight quantized (Q/DQ, INT8, scale 0.02)."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 4)).astype(np.float32)
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])
    inits = [numpy_helper.from_array(w, "w")]
    f = tmp_path / "float.onnx"
    onnx.save(helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "f", [x], [y],
                                                  inits), opset_imports=[helper.make_opsetid("", 13)]), f)
    inits += [numpy_helper.from_array(np.array(0.02, np.float32), "s"),
              numpy_helper.from_array(np.array(0, np.int8), "z")]
    nodes = [helper.make_node("QuantizeLinear", [t, "s", "z"], [t + "_q"]) for t in ("x", "w")]
    nodes += [helper.make_node("DequantizeLinear", [t + "_q", "s", "z"], [t + "_dq"]) for t in ("x", "w")]
    nodes.append(helper.make_node("MatMul", ["x_dq", "w_dq"], ["y"]))
    q = tmp_path / "qdq.onnx"
    onnx.save(helper.make_model(helper.make_graph(nodes, "q", [x], [y], inits),
                                opset_imports=[helper.make_opsetid("", 13)]), q)
    feeds = [{"x": rng.normal(size=(2, 8)).astype(np.float32)} for _ in range(3)]
    return f, q, feeds, w


def test_unfused_scoring_computes_the_qdq_as_written(tmp_path):
    f, q, feeds, w = _matmul_models(tmp_path)
    data = type("D", (), {"batches": lambda self, n: iter(feeds)})()
    got = _module().fidelity_plain(f, q, data, unfused=True)
    def qdq(a):
        return np.clip(np.round(a / 0.02), -128, 127) * 0.02
    ref = np.concatenate([(d["x"] @ w).ravel() for d in feeds]).astype(np.float64)
    out = np.concatenate([(qdq(d["x"]) @ qdq(w)).ravel() for d in feeds]).astype(np.float64)
    sqnr = 10 * np.log10(ref @ ref / ((ref - out) @ (ref - out)))
    assert got["samples"] == 3
    assert abs(got["outputs"]["y"]["sqnr_db"] - sqnr) < 0.02


def test_model_optimizer_runs_with_the_calibration_asked(tmp_path):
    """`modelopt` is Model Optimizer with max calibration; `modelopt-entropy` with its own INT8 default."""
    assert _module().MODELOPT == {"modelopt": "max", "modelopt-entropy": "entropy"}
    peer = benchmark("peer_int8")
    fake = tmp_path / "python"          # stands in for the Model Optimizer venv's python: writes its argv
    fake.write_text('#!/bin/sh\nshift 2\nprintf "%s\\n" "$@" > "$3"\n')
    fake.chmod(0o755)
    src, calib = tmp_path / "m.onnx", tmp_path / "c.npz"
    src.write_bytes(b"model")
    calib.write_bytes(b"data")
    for method in ("max", "entropy"):
        dst = tmp_path / f"{method}.onnx"
        assert peer.modelopt_int8(src, calib, dst, str(fake), 16, method) is None
        argv = dst.read_text().splitlines()
        assert argv[1:] == [str(calib), str(dst), "16", method]
        assert Path(argv[0]).name == "m.onnx" and Path(argv[0]) != src      # a private copy of the model
