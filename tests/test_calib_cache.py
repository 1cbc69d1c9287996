"""Calibration caches: qdqgraph JSON and TensorRT's text format (TRT_RULES K1), atomic writes."""
import json
import os
import struct

import numpy as np
import pytest

from qdqgraph.graph import io as qio
from qdqgraph.errors import QdqError
from qdqgraph.calib.cache import (hex_to_scale, load_cache, read_json, read_tensorrt, scale_to_hex,
                                  write_json, write_tensorrt)
from qdqgraph.calib.methods import safe_scale

REAL_LOOKING = """TRT-100900-EntropyCalibration2
images: 3c010204
/model.0/conv/Conv_output_0: 3d2d9e38
(Unnamed Layer* 64) [Shuffle]_output: 3c8a3d71
ONNXTRT_Broadcast_123_output: 0
StatefulPartitionedCall/model/conv/ReadVariableOp:0: 3f800000
"""


# ------------------------------------------------------------------------------------- hex
def test_k1_example_hex():
    assert scale_to_hex(np.float32(1 / 127)) == "3c010204"
    assert hex_to_scale("3c010204") == np.float32(1 / 127)


@pytest.mark.parametrize("value,text", [
    (1.0, "3f800000"), (0.0, "0"), (-0.0, "0"), (2.0, "40000000"), (0.5, "3f000000"),
    (1e-40, "116c2"),                                # subnormal: no zero padding
    (float(np.finfo(np.float32).max), "7f7fffff"),
])
def test_hex_known_values(value, text):
    assert scale_to_hex(value) == text
    assert hex_to_scale(text) == np.float32(value)


@pytest.mark.parametrize("value", [1 / 127, 3.14159, 1e-8, 123456.78, 2.0 ** -126, 7e-45, 0.0123])
def test_hex_round_trip_bitwise(value):
    s = np.float32(value)
    h = scale_to_hex(s)
    assert h == h.lower() and not h.startswith("0x") and (h == "0" or not h.startswith("0"))
    assert int(h, 16) == struct.unpack(">I", struct.pack(">f", s))[0]
    back = hex_to_scale(h)
    assert back.tobytes() == s.tobytes()
    assert scale_to_hex(back) == h


@pytest.mark.parametrize("bad", ["", "xyz", "123456789", "0x3f80", "3f 80"])
def test_hex_rejects_garbage(bad):
    with pytest.raises(ValueError):
        hex_to_scale(bad)


# -------------------------------------------------------------------------------- TensorRT
def test_read_real_looking_cache(tmp_path):
    p = tmp_path / "calibration.cache"
    p.write_text(REAL_LOOKING)
    got = read_tensorrt(p)
    assert list(got) == ["images", "/model.0/conv/Conv_output_0", "(Unnamed Layer* 64) [Shuffle]_output",
                         "ONNXTRT_Broadcast_123_output", "StatefulPartitionedCall/model/conv/ReadVariableOp:0"]
    assert got["images"] == pytest.approx(1.0, rel=1e-7)
    assert safe_scale(got["images"]) == np.float32(1 / 127)
    assert got["ONNXTRT_Broadcast_123_output"] == 0.0           # zero scale kept as amax 0
    assert got["StatefulPartitionedCall/model/conv/ReadVariableOp:0"] == 127.0
    assert load_cache(p) == got


def test_tensorrt_round_trip_with_awkward_names(tmp_path):
    amaxes = {"images": 1.0, "ReadVariableOp:0": 2.5, "a : b": 0.75, "c: d": 3.0, "ends with colon:": 4.0,
              "trailing ": 5.0, "zero": 0.0, "tiny": 1e-30, "big": 1e30, "ünïcode": 6.0}
    p = tmp_path / "c.cache"
    write_tensorrt(p, amaxes)
    lines = p.read_text(encoding="utf-8").split("\n")
    assert lines[0] == "TRT-100900-EntropyCalibration2"
    assert lines[1] == "images: 3c010204"
    assert "zero: 0" in lines and "a : b: 3bc18306" in lines and lines[-1] == ""
    got = read_tensorrt(p)
    assert list(got) == list(amaxes)
    for name, amax in amaxes.items():
        assert np.float32(got[name] / 127) == np.float32(amax / 127), name   # the scale round-trips bit for bit
        assert got[name] == pytest.approx(amax, rel=1e-6, abs=0), name
    assert got["zero"] == 0.0
    text = p.read_text(encoding="utf-8")
    write_tensorrt(p, got)                                     # read -> write reproduces the file
    assert p.read_text(encoding="utf-8") == text


def test_tensorrt_header_variants(tmp_path):
    p = tmp_path / "c.cache"
    write_tensorrt(p, {"x": 1.0}, algo="MinMaxCalibration", trt_version=8601)
    assert p.read_text().startswith("TRT-8601-MinMaxCalibration\nx: 3c010204\n")
    for bad in ({"algo": "Entropy Calibration"}, {"algo": ""}, {"trt_version": -1}, {"trt_version": "10"}):
        with pytest.raises(ValueError):
            write_tensorrt(p, {"x": 1.0}, **bad)


def test_tensorrt_reader_accepts_crlf_uppercase_and_blank_lines(tmp_path):
    p = tmp_path / "c.cache"
    p.write_bytes(b"TRT-8601-EntropyCalibration2\r\nimages: 3C010204\r\n\r\nout: 0\r\n")
    got = read_tensorrt(p)
    assert got == {"images": pytest.approx(1.0, rel=1e-7), "out": 0.0}


@pytest.mark.parametrize("body,line,what", [
    ("TRT-100900-EntropyCalibration2\nimages: 3c010204\nbroken line 3c010204\n", 3, "expected"),
    ("TRT-100900-EntropyCalibration2\nimages: zz\n", 2, "bad scale"),
    ("TRT-100900-EntropyCalibration2\na: 1\nimages: 123456789\n", 3, "bad scale"),
    ("TRT-100900-EntropyCalibration2\nneg: bf800000\n", 2, "finite and >= 0"),
    ("TRT-100900-EntropyCalibration2\nnan: 7fc00000\n", 2, "finite and >= 0"),
    ("TRT-100900-EntropyCalibration2\ninf: 7f800000\n", 2, "finite and >= 0"),
    ("TRT-100900-EntropyCalibration2\na: 0\nb: 0\na: 3c010204\n", 4, "twice"),
    ("TRT-100900-EntropyCalibration2\n: 3c010204\n", 2, "empty tensor name"),
    ("TRT100900-EntropyCalibration2\nimages: 3c010204\n", 1, "not a TensorRT calibration cache"),
])
def test_tensorrt_corrupt_files_name_file_and_line(tmp_path, body, line, what):
    p = tmp_path / "bad.cache"
    p.write_text(body)
    with pytest.raises(ValueError) as e:
        read_tensorrt(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:{line}: ") and what in msg
    assert "\n" not in msg


def test_write_tensorrt_rejects_bad_amax_and_names(tmp_path):
    p = tmp_path / "c.cache"
    for bad in ({"x": float("nan")}, {"x": -1.0}, {"x": float("inf")}, {"": 1.0}, {"a\nb": 1.0},
                {"x": 1e300}, {"x": "big"}):
        with pytest.raises(ValueError):
            write_tensorrt(p, bad)
    assert not p.exists()
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------ JSON
def test_json_round_trip_and_layout(tmp_path):
    amaxes = {"input": 2.640625, "conv1:0": 1e-3, "a : b": 123.456, "zero": 0.0, "ünï": 7.0}
    p = tmp_path / "calib.json"
    write_json(p, amaxes, method="entropy", samples=500)
    doc = json.loads(p.read_text(encoding="utf-8"))
    assert doc["format"] == "qdqgraph-calib" and doc["version"] == 1
    assert doc["method"] == "entropy" and doc["samples"] == 500
    assert isinstance(doc["tool_version"], str) and doc["tool_version"]
    assert doc["tensors"]["input"] == {"amax": 2.640625, "scale": float(np.float32(2.640625 / 127))}
    assert doc["tensors"]["zero"]["scale"] == float(safe_scale(0.0)) > 0
    got = read_json(p)
    assert got == amaxes and list(got) == list(amaxes)         # exact, order kept
    assert load_cache(p) == amaxes


def test_json_rejects_bad_amax_on_write(tmp_path):
    p = tmp_path / "c.json"
    for bad in ({"x": float("nan")}, {"x": -2.0}, {"x": float("inf")}, {"": 1.0}):
        with pytest.raises(ValueError):
            write_json(p, bad, "max", 1)
    with pytest.raises(ValueError):
        write_json(p, {"x": 1.0}, "max", -3)
    assert not p.exists()


def _json_doc(**tensors):
    return {"format": "qdqgraph-calib", "version": 1, "tool_version": "0.1.0", "method": "max",
            "samples": 3, "tensors": tensors}


@pytest.mark.parametrize("text,line,what", [
    ('{"format": "qdqgraph-calib",\n "version": 1,\n "tensors": {"a": {"amax": 1.0},}\n}\n', 3, "not valid JSON"),
    (json.dumps(_json_doc(a={"amax": 1.0}, b={"amax": -1.0}), indent=1), None, "'b'"),
    (json.dumps(_json_doc(a={"amax": 1.0}, b={"scale": 1.0}), indent=1), None, "'b'"),
    (json.dumps(_json_doc(a={"amax": "1.0"}), indent=1), None, "'a'"),
    (json.dumps(_json_doc(a={"amax": True}), indent=1), None, "'a'"),
    ('{\n "format": "qdqgraph-calib",\n "version": 1,\n "tensors": {"a": {"amax": NaN}}\n}\n', 4, "NaN"),
    (json.dumps({**_json_doc(), "version": 2}, indent=1), None, "version"),
    (json.dumps({"format": "other"}, indent=1), 2, "not a qdqgraph calibration cache"),
    ("[1, 2]", 1, "not a qdqgraph calibration cache"),
    (json.dumps({**_json_doc(), "tensors": [1]}, indent=1), None, "tensors"),
])
def test_json_corrupt_files_name_file_and_line(tmp_path, text, line, what):
    p = tmp_path / "bad.json"
    p.write_text(text)
    if line is None:        # the line of the offending key in the file as written
        key = {"'b'": '"b":', "'a'": '"a":', "version": '"version":', "tensors": '"tensors":'}[what]
        line = text[:text.index(key)].count("\n") + 1
        assert line > 1
    with pytest.raises(ValueError) as e:
        read_json(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:{line}: ") and what in msg
    assert "\n" not in msg


# ------------------------------------------------------------------------------- sniffing
def test_load_cache_sniffs_and_rejects_unknown(tmp_path):
    j, t, other = tmp_path / "a.json", tmp_path / "a.cache", tmp_path / "a.txt"
    write_json(j, {"x": 2.0}, "percentile", 10)
    write_tensorrt(t, {"x": 2.0})
    other.write_text("images: 3c010204\n")
    assert load_cache(j) == {"x": 2.0}
    assert load_cache(t)["x"] == pytest.approx(2.0, rel=1e-7)
    with pytest.raises(ValueError, match=r"a\.txt:1: not a qdqgraph JSON or TensorRT"):
        load_cache(other)
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00TRT")
    with pytest.raises(ValueError, match=r"bin:1: not UTF-8"):
        load_cache(tmp_path / "bin")


# ------------------------------------------------------------------------------ atomicity
@pytest.mark.parametrize("writer", ["json", "tensorrt"])
def test_failed_write_leaves_old_file_and_no_temp(tmp_path, monkeypatch, writer):
    p = tmp_path / "calib.out"
    p.write_text("old content\n")
    write = (lambda path, a: write_json(path, a, "max", 1)) if writer == "json" else write_tensorrt

    def boom(src, dst):
        assert os.path.exists(src) and os.path.dirname(src) == str(tmp_path)   # temp is a sibling
        raise OSError("disk full (simulated)")
    monkeypatch.setattr(qio.os, "replace", boom)
    with pytest.raises((OSError, QdqError), match="simulated"):
        write(p, {"x": 1.0})
    assert os.listdir(tmp_path) == ["calib.out"]
    assert p.read_text() == "old content\n"
    monkeypatch.undo()
    write(p, {"x": 1.0})
    assert os.listdir(tmp_path) == ["calib.out"]
    assert load_cache(p)["x"] == pytest.approx(1.0, rel=1e-7)


def test_failed_write_during_fsync_leaves_no_temp(tmp_path, monkeypatch):
    def boom(fd):
        raise OSError("fsync failed (simulated)")
    monkeypatch.setattr(qio.os, "fsync", boom)
    with pytest.raises((OSError, QdqError), match="simulated"):
        write_tensorrt(tmp_path / "c.cache", {"x": 1.0})
    assert os.listdir(tmp_path) == []


def test_write_keeps_mode_of_existing_file_and_is_readable(tmp_path):
    p = tmp_path / "c.cache"
    write_tensorrt(p, {"x": 1.0})
    assert os.stat(p).st_mode & 0o777 == 0o644
    os.chmod(p, 0o640)
    write_tensorrt(p, {"x": 2.0})
    assert os.stat(p).st_mode & 0o777 == 0o640
