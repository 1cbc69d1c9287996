"""The check that every model the suite writes passes the full ONNX checker and builds with TensorRT
for RTX: tests/collect_written.py keeps what qdqgraph writes (in this process and in the qdqgraph
processes tests start), .ci/check_written.py checks and builds each distinct one."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

import collect_written
import motifs
import qdqgraph
from qdqgraph.graph import io

ROOT = Path(__file__).resolve().parents[1]


def _manifest(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "manifest.jsonl").read_text().splitlines()]


def test_writes_in_process_are_kept_once_per_content_with_the_test_that_wrote_them(tmp_path, monkeypatch):
    folder = tmp_path / "kept"
    # the writer unwrapped (undone after the test): in a collecting run the suite's own wrapper is on it,
    # and this test's writes belong in its folder alone
    monkeypatch.setattr(io, "save", getattr(io.save, "__wrapped__", io.save))
    monkeypatch.setattr(qdqgraph, "save", getattr(qdqgraph.save, "__wrapped__", qdqgraph.save))
    collect_written.wrap(io, folder)
    collect_written.wrap(io, folder)                     # idempotent: one record per write
    m = qdqgraph.quantize(motifs.residual_add(), motifs.sample_data(motifs.residual_add())).model
    io.save(m, tmp_path / "a.onnx")
    qdqgraph.save(m, tmp_path / "b.onnx")
    entries = _manifest(folder)
    assert [e["name"] for e in entries] == ["a.onnx", "b.onnx"]
    assert entries[0]["sha256"] == entries[1]["sha256"]
    assert all(e["test"].endswith("::test_writes_in_process_are_kept_once_per_content_with_the_test_that_wrote_them")
               for e in entries)
    kept = folder / entries[0]["model"]
    assert kept.read_bytes() == (tmp_path / "a.onnx").read_bytes()
    assert sorted(p.name for p in folder.iterdir()) == sorted(["manifest.jsonl", kept.name])


def test_writes_of_qdqgraph_subprocesses_are_kept_too(tmp_path, monkeypatch):
    folder = tmp_path / "kept"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(collect_written._SITECUSTOMIZE.format(tests=str(collect_written.HERE),
                                                                                 env=collect_written.ENV))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hook), str(ROOT)]),
               **{collect_written.ENV: str(folder)})
    r = subprocess.run([sys.executable, "-m", "qdqgraph", "example", str(tmp_path / "ex")], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    entries = _manifest(folder)
    assert [e["name"] for e in entries] == ["tiny_resnet.onnx"]
    assert (folder / entries[0]["model"]).read_bytes() == (tmp_path / "ex" / "tiny_resnet.onnx").read_bytes()


def _custom_op_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    node = helper.make_node("Mystery", ["x"], ["y"], name="mystery", domain="example.custom")
    return helper.make_model(helper.make_graph([node], "custom", [x], [y]),
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("example.custom", 1)])


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="needs TensorRT for RTX")
def test_the_check_fails_naming_each_model_that_does_not_build(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / ".ci"))
    import check_written
    folder = tmp_path / "kept"
    monkeypatch.setattr(io, "save", getattr(io.save, "__wrapped__", io.save))      # not the suite's wrapper
    monkeypatch.setattr(qdqgraph, "save", getattr(qdqgraph.save, "__wrapped__", qdqgraph.save))
    collect_written.wrap(io, folder)
    m = motifs.residual_add()
    io.save(qdqgraph.quantize(m, motifs.sample_data(m)).model, tmp_path / "q.onnx")
    io.save(_custom_op_model(), tmp_path / "custom.onnx")
    assert check_written.main([str(folder), "--jobs", "1"]) == 1
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "test_the_check_fails_naming_each_model_that_does_not_build" in failed[0], out
    assert "Mystery" in out and "1 passed, 1 failed, 0 expected failures" in out, out
    # the residual block's engine, against its prediction (the custom op's model builds no engine)
    line = next(x for x in out.splitlines() if x.startswith("prediction against TensorRT for RTX"))
    assert " in 1 engines;" in line and "counted right in 1 of them" in line, line
    # a test that says why its model cannot build moves it to the expected ones
    monkeypatch.setattr(check_written, "EXPECTED_TESTS", [("test_the_check_fails_naming", "a custom op, on purpose")])
    assert check_written.main([str(folder), "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "expected: " in out and "a custom op, on purpose" in out and "NOTE: expected to fail but passes" in out


def test_the_prediction_line_counts_kernels_and_quantize_counts(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / ".ci"))
    import check_written
    rows = [{"prediction": {"compute_kernels": 5, "as_predicted": 4, "standalone_quantize": {"predicted": 2, "compiled": 2}}},
            {"prediction": {"compute_kernels": 3, "as_predicted": 3, "standalone_quantize": {"predicted": 1, "compiled": 0}}},
            {"build": "failed"}]
    assert check_written.prediction_line(rows) == ("prediction against TensorRT for RTX: compute kernels 7/8 as "
                                                   "predicted in 2 engines; standalone quantize kernels counted "
                                                   "right in 1 of them")
    assert check_written.prediction_line([{"build": "x"}]) == "prediction: no engine listed its kernels"
