"""The CLI contract: outputs, exit codes, one-line errors, nothing written on failure."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import motifs
from qdqgraph.graph import io
from qdqgraph.cli import main
from conftest_helpers import files


def one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("qdqgraph: error: ")
    assert "Traceback" not in err[0]
    return err[0]


def test_insert_writes_default_output_and_report(model_and_data, capsys):
    mp, dp = model_and_data
    before = mp.read_bytes()
    rp = mp.parent / "r.json"
    assert main(["insert", str(mp), "--calib", str(dp), "--report", str(rp)]) == 0
    out = mp.parent / "m.qdq.onnx"
    onnx.checker.check_model(onnx.load(out), full_check=True)
    assert mp.read_bytes() == before
    text = capsys.readouterr().out
    assert "Conv" in text and f"wrote {out}" in text
    assert "float vs quantized on 8 samples" in text and "output y: cosine 0.9" in text
    # the verify figure is on calibration samples, and it says how to score others
    assert f"(calibration samples; on samples the run has not seen: qdqgraph compare {mp} {out} --data HELD_OUT)" in text
    report = json.loads(rp.read_text())
    assert report["ops"]["Conv"]["quantized"] == 4 and report["activation_sites"] == 4
    assert not [p for p in files(mp.parent) if p.endswith(".tmp")]


def test_existing_output_refused_without_force(model_and_data, capsys):
    mp, dp = model_and_data
    out = mp.parent / "m.qdq.onnx"
    out.write_bytes(b"keep me")
    assert main(["insert", str(mp), "--calib", str(dp)]) == 2
    assert "exists" in one_error_line(capsys) and "--force" in capsys.readouterr().err + "--force"
    assert out.read_bytes() == b"keep me"
    assert main(["insert", str(mp), "--calib", str(dp), "--force"]) == 0
    assert out.read_bytes() != b"keep me"


def test_output_equal_to_input_refused_even_with_force(model_and_data, capsys):
    mp, dp = model_and_data
    before = mp.read_bytes()
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(mp), "--force"]) == 2
    assert "also an input" in one_error_line(capsys)
    assert mp.read_bytes() == before


def test_not_onnx(tmp_path, capsys):
    p = tmp_path / "notes.onnx"
    p.write_text("this is not a model")
    assert main(["insert", str(p), "--calib", "random"]) == 2
    assert "not a readable ONNX model" in one_error_line(capsys)
    assert files(tmp_path) == {"notes.onnx"}


def test_truncated_onnx(model_and_data, capsys):
    mp, dp = model_and_data
    data = mp.read_bytes()
    mp.write_bytes(data[: len(data) // 2])
    assert main(["insert", str(mp), "--calib", str(dp)]) == 2
    one_error_line(capsys)
    assert "m.qdq.onnx" not in files(mp.parent)


def test_already_quantized_refused(model_and_data, capsys):
    mp, dp = model_and_data
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(mp.parent / "q.onnx")]) == 0
    capsys.readouterr()
    assert main(["insert", str(mp.parent / "q.onnx"), "--calib", str(dp)]) == 2
    assert "already holds quantization" in one_error_line(capsys)
    assert "q.qdq.onnx" not in files(mp.parent)


@pytest.mark.parametrize("bad,words", [
    ({"y": np.zeros((2, 1, 16, 8, 8), np.float32)}, "no array for model input"),
    ({"x": np.zeros((2, 1, 16, 8, 8), np.float64)}, "float64; the model input wants float32"),
    ({"x": np.zeros((2, 1, 3, 8, 8), np.float32)}, "has shape [1, 3, 8, 8]"),
    ({"x": np.zeros((2, 16, 8), np.float32)}, "rank 4"),
    ({"x": np.full((2, 1, 16, 8, 8), np.nan, np.float32)}, "NaN or Inf"),
    ({"x": np.zeros((2, 1, 16, 8, 8), np.float32), "extra": np.zeros(3)}, "not model inputs"),
])
def test_bad_calibration_data(model_and_data, capsys, bad, words):
    mp, _ = model_and_data
    dp = mp.parent / "bad.npz"
    np.savez(dp, **bad)
    assert main(["insert", str(mp), "--calib", str(dp)]) == 2
    assert words in one_error_line(capsys)
    assert "m.qdq.onnx" not in files(mp.parent)


def test_pickled_npz_refused(model_and_data, capsys):
    mp, _ = model_and_data
    dp = mp.parent / "pickled.npz"
    np.savez(dp, x=np.array([{"a": 1}], dtype=object))
    assert main(["insert", str(mp), "--calib", str(dp)]) == 2
    assert "pickled" in one_error_line(capsys)


def test_no_calibration_refused_and_random_warns(model_and_data, capsys):
    mp, _ = model_and_data
    assert main(["insert", str(mp)]) == 2
    assert "--calib random" in one_error_line(capsys)
    assert main(["insert", str(mp), "--calib", "random"]) == 0
    assert "random data" in capsys.readouterr().err


@pytest.mark.parametrize("args,words", [(["--calib", "random", "--smooth-quant"], "on calibration data, and --calib random is not data"),
                                        (["--smooth-quant", "2"], "--smooth-quant must be at most 1")])
def test_bad_smooth_quant_is_one_line_and_writes_nothing(model_and_data, capsys, args, words):
    mp, dp = model_and_data
    before = files(mp.parent)
    argv = ["insert", str(mp)] + (args if "--calib" in args else ["--calib", str(dp)] + args)
    assert main(argv) == 2
    assert words in one_error_line(capsys)
    assert files(mp.parent) == before


def test_unwritable_output_folder(model_and_data, capsys, tmp_path, monkeypatch):
    mp, dp = model_and_data
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root writes anywhere: make the folder read-only in qdqgraph's eyes
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == ro and mode == os.W_OK else real(p, mode))
    try:
        assert main(["insert", str(mp), "--calib", str(dp), "-o", str(ro / "o.onnx")]) == 2
        assert "not writable" in one_error_line(capsys)
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o700)


def test_missing_output_folder(model_and_data, capsys):
    mp, dp = model_and_data
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(mp.parent / "nope" / "o.onnx")]) == 2
    assert "does not exist" in one_error_line(capsys)


def test_internal_error_is_one_line_and_exit_1(model_and_data, capsys, monkeypatch):
    mp, dp = model_and_data
    import qdqgraph.pipeline as pipeline

    def boom(*a, **k):
        raise RuntimeError("simulated bug")
    monkeypatch.setattr(pipeline, "insert_qdq", boom)
    assert main(["insert", str(mp), "--calib", str(dp)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "internal error" in err[0] and "--debug" in err[0]
    with pytest.raises(RuntimeError):
        main(["--debug", "insert", str(mp), "--calib", str(dp)])


def test_interrupted_write_leaves_nothing(model_and_data, capsys, monkeypatch):
    mp, dp = model_and_data

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", interrupted)
    monkeypatch.setattr(os, "link", interrupted)
    assert main(["insert", str(mp), "--calib", str(dp)]) == 130
    assert files(mp.parent) == {"m.onnx", "calib.npz"}


def test_full_disk_leaves_nothing(model_and_data, capsys, monkeypatch):
    mp, dp = model_and_data
    import errno

    from qdqgraph.graph import wire

    def full(model, f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(wire, "write_model", full)
    assert main(["insert", str(mp), "--calib", str(dp)]) == 2
    assert "no space left" in one_error_line(capsys)
    assert files(mp.parent) == {"m.onnx", "calib.npz"}


def test_python_dash_m_runs_the_command():
    r = subprocess.run([sys.executable, "-m", "qdqgraph", "insert", "/nonexistent/m.onnx", "--calib", "random"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("qdqgraph: error: model file not found")


def test_entry_keeps_the_exit_code_and_leaves_the_garbage_to_the_process(monkeypatch):
    """entry(): main()'s code as the exit status, the garbage frozen first (the interpreter's last
    collection would free it)."""
    import gc
    import qdqgraph.cli as cli
    done = []
    monkeypatch.setattr(cli, "main", lambda: 2)
    monkeypatch.setattr(gc, "freeze", lambda: done.append("frozen"))
    with pytest.raises(SystemExit) as e:
        cli.entry()
    assert e.value.code == 2 and done == ["frozen"]


def test_console_script_and_example(tmp_path):
    exe = Path(sys.executable).parent / "qdqgraph"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "qdqgraph.cli"]
    r = subprocess.run(cmd + ["example", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(cmd + ["insert", str(tmp_path / "tiny_resnet.onnx"), "--calib",
                              str(tmp_path / "tiny_resnet_calib.npz")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "BatchNormalization folded" in r.stdout
    g = io.load(tmp_path / "tiny_resnet.qdq.onnx").graph
    assert sum(n.op == "DequantizeLinear" for n in g.nodes) > 0
    r = subprocess.run(cmd + ["insert", str(tmp_path / "missing.onnx"), "--calib", "random"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not found" in r.stderr


@pytest.mark.parametrize("method", ["max", "entropy", "percentile"])
def test_calibrate_shards_merge_to_the_full_run(model_and_data, capsys, method):
    mp, dp = model_and_data
    d = mp.parent
    assert main(["calibrate", str(mp), "--calib", str(dp), "-o", str(d / "full.json"), "--method", method,
                 "--lanes", "1"]) == 0
    for i in (1, 2, 3):
        # (a batch size and a number of lanes of its own per shard: the histograms depend on neither)
        assert main(["calibrate", str(mp), "--calib", str(dp), "--shard", f"{i}/3", "-o", str(d / f"s{i}.state"),
                     "--batch-size", str(i), "--lanes", str(i)]) == 0
    assert main(["calibrate", "--merge", *(str(d / f"s{i}.state") for i in (1, 2, 3)), "-o", str(d / "m.json"),
                 "--method", method]) == 0
    full = json.loads((d / "full.json").read_text())
    merged = json.loads((d / "m.json").read_text())
    assert merged["samples"] == full["samples"] == 8
    assert {k: v["amax"] for k, v in merged["tensors"].items()} == {k: v["amax"] for k, v in full["tensors"].items()}
    # the merged cache drives insert without data
    assert main(["insert", str(mp), "--calib-cache", str(d / "m.json"), "-o", str(d / "q.onnx")]) == 0
    assert (d / "q.onnx").exists()


@pytest.mark.parametrize("flags", [["--lanes", "0"], ["--batch-size", "0"]])
@pytest.mark.parametrize("command", ["insert", "calibrate"])
def test_bad_counts_are_one_line_errors(model_and_data, capsys, command, flags):
    mp, dp = model_and_data
    out = mp.parent / ("q.onnx" if command == "insert" else "c.json")
    assert main([command, str(mp), "--calib", str(dp), "-o", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flags[0]} must be at least 1" in err and not out.exists()


def _q_scales(path) -> dict:
    m = onnx.load(str(path))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    return {n.input[0]: float(inits[n.input[1]]) for n in m.graph.node
            if n.op_type == "QuantizeLinear" and n.input[1] in inits and inits[n.input[1]].size == 1}


def test_insert_calibrates_what_the_cache_lacks(model_and_data, capsys):
    mp, dp = model_and_data
    d = mp.parent
    assert main(["calibrate", str(mp), "--calib", str(dp), "-o", str(d / "full.json"), "--method", "max"]) == 0
    doc = json.loads((d / "full.json").read_text())
    dropped = sorted(doc["tensors"])[-1]
    del doc["tensors"][dropped]
    (d / "part.json").write_text(json.dumps(doc))
    capsys.readouterr()
    # without data: one line that names a lacking tensor and the fix
    assert main(["insert", str(mp), "--calib-cache", str(d / "part.json"), "-o", str(d / "q.onnx")]) == 2
    line = one_error_line(capsys)
    assert dropped in line and "--calib" in line and not (d / "q.onnx").exists()
    # with data: the lacking group is calibrated, the others come from the cache
    assert main(["insert", str(mp), "--calib-cache", str(d / "part.json"), "--calib", str(dp), "--method", "max",
                 "-o", str(d / "q.onnx")]) == 0
    assert "1 of" in capsys.readouterr().err
    assert main(["insert", str(mp), "--calib-cache", str(d / "full.json"), "-o", str(d / "ref.onnx")]) == 0
    got, ref = _q_scales(d / "q.onnx"), _q_scales(d / "ref.onnx")
    assert dropped in got and got == ref
    # and a cached range is taken as it is, not recalibrated
    doc["tensors"][sorted(doc["tensors"])[0]]["amax"] *= 4
    (d / "part.json").write_text(json.dumps(doc))
    assert main(["insert", str(mp), "--calib-cache", str(d / "part.json"), "--calib", str(dp), "--method", "max",
                 "-o", str(d / "q2.onnx")]) == 0
    changed = {k for k, v in _q_scales(d / "q2.onnx").items() if v != ref[k]}
    assert changed and dropped not in changed


def test_calibrate_tensorrt_cache_round_trip(model_and_data, capsys):
    mp, dp = model_and_data
    d = mp.parent
    assert main(["calibrate", str(mp), "--calib", str(dp), "-o", str(d / "c.cache"), "--format", "tensorrt",
                 "--method", "entropy"]) == 0
    text = (d / "c.cache").read_text().splitlines()
    assert text[0].startswith("TRT-") and text[0].endswith("-EntropyCalibration2")
    assert any(line.startswith("x: ") for line in text[1:])
    assert main(["insert", str(mp), "--calib-cache", str(d / "c.cache"), "-o", str(d / "q.onnx")]) == 0


def test_merge_refuses_shards_of_different_models(model_and_data, capsys, tmp_path):
    mp, dp = model_and_data
    other = tmp_path / "other.onnx"
    onnx.save(motifs.residual_add(projection=True), other)
    assert main(["calibrate", str(mp), "--calib", str(dp), "--shard", "1/2", "-o", str(tmp_path / "a.state")]) == 0
    assert main(["calibrate", str(other), "--calib", str(dp), "--shard", "2/2", "-o", str(tmp_path / "b.state")]) == 0
    capsys.readouterr()
    assert main(["calibrate", "--merge", str(tmp_path / "a.state"), str(tmp_path / "b.state"),
                 "-o", str(tmp_path / "m.json")]) == 2
    assert "another model" in one_error_line(capsys)
    assert not (tmp_path / "m.json").exists()


def test_calibrate_bad_shard_spec(model_and_data, capsys):
    mp, dp = model_and_data
    assert main(["calibrate", str(mp), "--calib", str(dp), "--shard", "3/2", "-o", str(mp.parent / "x.state")]) == 2
    assert "--shard" in one_error_line(capsys)


def test_a_closed_pipe_on_stdout_is_no_internal_error(tmp_path, monkeypatch, capsys):
    """`qdqgraph report m.onnx | head -1`: the reader stops early and the next write raises
    BrokenPipeError; qdqgraph exits as a process killed by SIGPIPE would (141), without a word."""
    import sys

    import onnx

    from qdqgraph.testing import models
    path = tmp_path / "r18.onnx"
    onnx.save(models.resnet18("qat-residual"), path)
    sink = open(tmp_path / "sink", "w")

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

        def fileno(self):
            return sink.fileno()
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["report", str(path)]) == 141
    err = capsys.readouterr().err
    assert "internal error" not in err and "Traceback" not in err
