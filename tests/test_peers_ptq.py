"""benchmarks/peers_ptq.py: the parts that do not need the peers installed."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "peers_ptq.py"


def _module():
    spec = importlib.util.spec_from_file_location("peers_ptq", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
