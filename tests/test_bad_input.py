"""Bad input, case by case (the security/robustness review): every case gives exit 2 and one line
`qdqgraph: error: <problem>; <fix>` on stderr, before expensive work where it can, and writes
nothing. Case numbers follow the review; models are tiny and built in code (tests/motifs.py)."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import motifs
from qdqgraph.cli import main
from conftest_helpers import files


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("qdqgraph: error: ")
    assert "; " in err[0] and "Traceback" not in err[0]
    return err[0]


def refused(capsys, argv, *words, folder: Path | None = None) -> str:
    """Run the CLI: exit 2, one error line holding `words`, and nothing new in `folder` (no output,
    no temporary file). Returns the line."""
    before = files(folder) if folder is not None else None
    assert main([str(a) for a in argv]) == 2
    line = one_error_line(capsys)
    for w in words:
        assert w in line, line
    if folder is not None:
        assert files(folder) == before
    return line


def no_sessions(monkeypatch):
    """Make any onnxruntime session an internal error (exit 1): a case that must be refused before
    any run on data then shows as exit 1 instead of 2."""
    import onnxruntime as ort

    def boom(*a, **k):
        raise AssertionError("an onnxruntime session was made before the input was checked")
    monkeypatch.setattr(ort, "InferenceSession", boom)


# ------------------------------------------------------------------------------ 1. --calib-cache

def _json_cache(amax) -> str:
    return json.dumps({"format": "qdqgraph-calib", "version": 1, "tensors": {"x": {"amax": amax}}})


CACHES = {   # name: (file content, or None for no file / "DIR" / "MODEL"; words of the error)
    "missing": (None, "calibration cache not found"),
    "folder": ("DIR", "is a folder"),
    "onnx": ("MODEL", "not UTF-8 text"),
    "json-list": ("[]", "not a qdqgraph JSON or TensorRT calibration cache"),
    "empty": ("", "not a qdqgraph JSON or TensorRT calibration cache"),
    "nan-amax": (_json_cache(float("nan")), "NaN is not a number JSON allows"),
    "negative-amax": (_json_cache(-1.0), "finite number >= 0, got -1.0"),
    "string-amax": (_json_cache("big"), "finite number >= 0, got 'big'"),
    "trt-bad-hex": ("TRT-100900-EntropyCalibration2\nx: zzzz\n", ":2: bad scale for tensor 'x'"),
    "trt-nan": ("TRT-100900-EntropyCalibration2\nx: 7fc00000\n", ":2: scale of tensor 'x' is nan (it must be finite and >= 0)"),
    "trt-no-separator": ("TRT-100900-EntropyCalibration2\nx 3c010204\n", ":2: expected '<tensor name>: <hex scale>'"),
}


@pytest.mark.parametrize("case", list(CACHES))
def test_1_bad_calib_cache(model_and_data, capsys, monkeypatch, case):
    mp, _ = model_and_data
    content, words = CACHES[case]
    path = mp.parent / f"{case}.cache"
    if content == "DIR":
        path.mkdir()
    elif content == "MODEL":
        path = mp
    elif content is not None:
        path.write_text(content)
    no_sessions(monkeypatch)
    line = refused(capsys, ["insert", mp, "--calib-cache", path, "-o", mp.parent / "q.onnx"], words,
                   folder=mp.parent)
    assert "--calib-cache" in line or "calibration cache" in line


# ------------------------------------------------------------------------------- 2. --rules FILE

HEAD = 'schema = 1\n'
CONV_RULE = '[[rule]]\nid = "my-conv"\ndoc = "d"\nref = "r"\nop = "conv"\n'
RULES = {   # name: (file content, words of the error)
    "rule-is-int": (HEAD + "rule = 5\n", "`rule` must be an array of tables"),
    "rule-is-str-list": (HEAD + 'rule = ["a"]\n', "`rule` must be an array of tables"),
    "id-is-int": (HEAD + '[[rule]]\nid = 5\ndoc = "d"\nref = "r"\nop = "conv"\nquantize = [{ input = 0 }]\n',
                  "`id` must be a string"),
    "input-99": (HEAD + CONV_RULE + 'quantize = [{ input = 99, kind = "activation" }]\n',
                 ":3 rule my-conv: quantize input 99"),
    "weight-axis-9": (HEAD + CONV_RULE + 'quantize = [{ input = 0 }, { input = 1, kind = "weight", axis = 9 }]\n',
                      ":3 rule my-conv: weight axis 9"),          # found when planning, still file:line and id
    "deep-nesting": ("x = " + "[" * 100000 + "]" * 100000 + "\n", "nested too deeply"),
    "binary": (bytes(range(256)) * 4, "is not a text file"),
    "folder": (None, "is a folder"),
    "any-all-rule": (HEAD + '[[rule]]\nid = "r-any"\ndoc = "d"\nref = "r"\nop = "any"\nquantize = [{ input = "all" }]\n',
                     '"any" is for [[exclude]] only'),
    "path-is-str": (HEAD + '[[exclude]]\nid = "e-path"\ndoc = "d"\nref = "r"\npath = "Conv"\n',
                    "`path` must be a list of strings, not 'Conv'"),
    # a P14 switch-off written without the format line (met on 2026-11-29): names the line and the fix
    "no-schema": ('[[region]]\nid = "P14-small-int8-region"\ndoc = "d"\nref = "r"\nmax_flops_share = 0\n',
                  "expected `schema = 1` at the top; add it (the rule-file format version)"),
}


@pytest.mark.parametrize("case", list(RULES))
def test_2_bad_rules_file(model_and_data, capsys, monkeypatch, case):
    mp, dp = model_and_data
    content, words = RULES[case]
    path = mp.parent / f"{case}.toml"
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    no_sessions(monkeypatch)
    line = refused(capsys, ["insert", mp, "--calib", dp, "--rules", path, "-o", mp.parent / "q.onnx"], words,
                   folder=mp.parent)
    assert f"{case}.toml" in line or str(path) in line


def test_2_exclude_path_of_300_optional_steps_is_fast(tmp_path, capsys):
    g = motifs.G("chain")
    y = g.conv(g.input("x", ["n", 8, 8, 8]), 8, 8, "c0")
    for i in range(300):                      # a chain every step of the path fits, in many ways
        y = g.node(("Relu", "Sigmoid", "Abs")[i % 3], [y], name=f"n{i}")
        if i % 50 == 49:
            y = g.conv(y, 8, 8, f"c{i + 1}")
    g.node("Identity", [y], ["y"], name="out")
    g.output("y")
    model = tmp_path / "chain.onnx"
    onnx.save(g.model(), model)
    steps = ", ".join(['"Relu|Sigmoid|Abs?"'] * 300)
    rules = tmp_path / "long.toml"
    rules.write_text(f'schema = 1\n[[exclude]]\nid = "e-long"\ndoc = "d"\nref = "r"\npath = [{steps}]\n')
    start = time.perf_counter()
    assert main(["insert", str(model), "--calib", "random", "--rules", str(rules), "-o", str(tmp_path / "q.onnx"),
                 "--verify", "0", "--quiet"]) == 0
    assert time.perf_counter() - start < 5.0
    assert (tmp_path / "q.onnx").exists()


# ------------------------------------------------------------------------------ 3. --percentile

@pytest.mark.parametrize("command", ["insert", "calibrate"])
@pytest.mark.parametrize("value,words", [("0", "must be above 0"), ("nan", "must be a finite number"),
                                         ("150", "must be at most 100"), ("-5", "must be above 0")])
def test_3_bad_percentile_refused_before_calibration(model_and_data, capsys, monkeypatch, command, value, words):
    mp, dp = model_and_data
    no_sessions(monkeypatch)
    start = time.perf_counter()
    refused(capsys, [command, mp, "--calib", dp, "-o", mp.parent / "out.onnx", f"--percentile={value}"],
            "--percentile", words, "(0, 100]", folder=mp.parent)
    assert time.perf_counter() - start < 1.0


# ------------------------------------------------------------------- 4. corrupt data, permissions

def _bad_data(kind: str, good: Path) -> Path:
    if kind == "npz-cut-in-half":
        out, data = good.with_name("half.npz"), good.read_bytes()
        out.write_bytes(data[: len(data) // 2])
    elif kind == "npz-random-bytes":
        out = good.with_name("random.npz")
        out.write_bytes(np.random.default_rng(0).bytes(4096))
    elif kind == "npz-bad-crc":
        out, data = good.with_name("crc.npz"), bytearray(good.read_bytes())
        data[200:260] = b"\xff" * 60                 # inside the first array's data
        out.write_bytes(bytes(data))
    elif kind == "npy-random-bytes":
        out = good.with_name("random.npy")
        out.write_bytes(np.random.default_rng(0).bytes(4096))
    else:                                            # npy-cut-in-half
        out = good.with_name("half.npy")
        with np.load(good) as z:
            np.save(out, z["x"])
        data = out.read_bytes()
        out.write_bytes(data[: len(data) // 2])
    return out


DATA_CASES = {"npz-cut-in-half": "may be truncated or corrupt", "npz-bad-crc": "may be truncated or corrupt",
              "npz-random-bytes": "is not an .npz file", "npy-random-bytes": "is not a .npy file",
              "npy-cut-in-half": "may be truncated or corrupt"}


@pytest.mark.parametrize("command", ["insert", "calibrate", "compare"])
@pytest.mark.parametrize("kind", list(DATA_CASES))
def test_4_corrupt_data_file(model_and_data, capsys, monkeypatch, command, kind):
    mp, dp = model_and_data
    bad = _bad_data(kind, dp)
    no_sessions(monkeypatch)
    argv = {"insert": ["insert", mp, "--calib", bad, "-o", mp.parent / "q.onnx"],
            "calibrate": ["calibrate", mp, "--calib", bad, "-o", mp.parent / "c.json"],
            "compare": ["compare", mp, mp, "--data", bad, "--json", mp.parent / "c.json"]}[command]
    line = refused(capsys, argv, bad.name, DATA_CASES[kind], folder=mp.parent)
    assert "pickled" not in line and "np.save" in line


def _deny(monkeypatch, path: Path):
    """Reading `path` is refused, as for a file without read permission (also when running as root)."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k:
                        False if Path(p) == path and mode & os.R_OK else real(p, mode, *a, **k))


@pytest.mark.parametrize("how", ["access", "open"])
@pytest.mark.parametrize("what", ["data", "model"])
def test_4_permission_denied_says_so(model_and_data, capsys, monkeypatch, what, how):
    mp, dp = model_and_data
    target = dp if what == "data" else mp
    if how == "access":
        _deny(monkeypatch, target)
    elif what == "data":                  # access says yes, opening fails (a root-squashed NFS share, say)
        import builtins

        import qdqgraph.samples.data

        def no_open(file, *a, **k):
            if Path(file) == target:
                raise PermissionError(13, "Permission denied", str(file))
            return builtins.open(file, *a, **k)
        monkeypatch.setattr(qdqgraph.samples.data, "open", no_open, raising=False)
    else:
        import builtins

        import qdqgraph.graph.wire
        real_load = onnx.load

        def no_load(f, *a, **k):
            if Path(f) == target:
                raise PermissionError(13, "Permission denied", str(f))
            return real_load(f, *a, **k)

        def no_open(file, *a, **k):       # io.load reads the model file with graph/wire.py
            if Path(file) == target:
                raise PermissionError(13, "Permission denied", str(file))
            return builtins.open(file, *a, **k)
        monkeypatch.setattr(onnx, "load", no_load)
        monkeypatch.setattr(qdqgraph.graph.wire, "open", no_open, raising=False)
    line = refused(capsys, ["insert", mp, "--calib", dp, "-o", mp.parent / "q.onnx"], "permission denied",
                   target.name, folder=mp.parent)
    assert "truncated" not in line and "corrupt" not in line


# --------------------------------------------------------------------------------- 5. bad regexes

@pytest.mark.parametrize("flag,pattern", [("--exclude-node", "["), ("--include-node", "(?P<")])
def test_5_bad_node_regex(model_and_data, capsys, monkeypatch, flag, pattern):
    mp, dp = model_and_data
    no_sessions(monkeypatch)
    refused(capsys, ["insert", mp, "--calib", dp, flag, pattern], flag, "not a valid regular expression",
            "escape", folder=mp.parent)


# ------------------------------------------------------------------- 6. --custom-op-library junk

@pytest.mark.parametrize("command", ["insert", "calibrate"])
def test_6_custom_op_library_that_is_not_a_library(model_and_data, capsys, monkeypatch, command):
    import qdqgraph.calib.calibration
    from qdqgraph.execution import runtime
    mp, dp = model_and_data
    lib = mp.parent / "libnot.so"
    lib.write_text("not a shared library")

    def no_calibration(*a, **k):
        raise AssertionError("calibration ran before the library was checked")
    monkeypatch.setattr(qdqgraph.calib.calibration, "collect", no_calibration)
    out = mp.parent / ("q.onnx" if command == "insert" else "c.json")
    refused(capsys, [command, mp, "--calib", dp, "--custom-op-library", lib, "-o", out],
            "cannot load the custom op library", "libnot.so", folder=mp.parent)
    assert str(lib) not in runtime._custom_op_libraries        # a later run is not poisoned by it


# ------------------------------------------------------------- 7. compare models of other inputs

def _conv_model(name="x", dtype=TensorProto.FLOAT, shape=("n", 16, 8, 8)):
    g = motifs.G("net")
    x = g.input(name, list(shape), dtype)
    if dtype != TensorProto.FLOAT:
        x = g.node("Cast", [x], to=TensorProto.FLOAT)
    if len(shape) == 3:
        x = g.node("Reshape", [x, g.const("shape", np.array([-1, 16, 8, 8]))])
    g.node("Relu", [g.conv(x, 16, 16, "conv")], ["y"], name="relu")
    g.output("y")
    return g.model()


@pytest.mark.parametrize("other,words", [
    (dict(name="z"), "input 'z' of"), (dict(dtype=TensorProto.DOUBLE), "input 'x' is float32"),
    (dict(shape=("n", 16, 64)), "input 'x' has rank 4")])
def test_7_compare_models_whose_inputs_differ(tmp_path, capsys, monkeypatch, other, words):
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    onnx.save(_conv_model(), a)
    onnx.save(_conv_model(**other), b)
    np.savez(tmp_path / "d.npz", x=np.ones((2, 1, 16, 8, 8), np.float32))
    no_sessions(monkeypatch)
    refused(capsys, ["compare", a, b, "--data", tmp_path / "d.npz"], words, "its own quantized version",
            folder=tmp_path)


# ----------------------------------------------------------------------- 8. string inputs, dtypes

@pytest.fixture
def string_input_model(tmp_path):
    g = motifs.G("strings")
    s = g.input("s", [1], TensorProto.STRING)
    x = g.input("x", ["n", 16, 8, 8])
    g.node("Relu", [g.conv(x, 16, 16, "conv")], ["y"], name="relu")
    g.node("Identity", [s], ["s_out"], name="keep")
    g.output("y")
    g.output("s_out", TensorProto.STRING)
    path = tmp_path / "s.onnx"
    onnx.save(g.model(), path)
    return path


@pytest.mark.parametrize("case", ["random", "data-of-another-dtype", "data-of-unicode", "fix-input"])
def test_8_string_input(string_input_model, capsys, monkeypatch, case):
    mp = string_input_model
    x = np.ones((2, 1, 16, 8, 8), np.float32)
    if case == "random":
        argv, words = ["--calib", "random"], ("input 's' is a string tensor", "cannot make random data", "--calib-cache")
    elif case == "fix-input":
        np.savez(mp.parent / "d.npz", x=x)
        argv, words = ["--calib", mp.parent / "d.npz", "--fix-input", "s=1"], ("input 's' is a string tensor",
                                                                                "--fix-input takes numbers")
    else:
        s = np.zeros((2, 1), np.int64) if case == "data-of-another-dtype" else np.array([["a"], ["b"]])
        np.savez(mp.parent / "d.npz", x=x, s=s)
        argv, words = ["--calib", mp.parent / "d.npz"], ("input 's' is a string tensor", "numeric inputs only")
    no_sessions(monkeypatch)
    line = refused(capsys, ["insert", mp, *argv, "-o", mp.parent / "q.onnx"], *words, folder=mp.parent)
    assert "np.object" not in line and "astype" not in line


def test_8_wrong_numeric_dtype_names_a_numpy_type_that_exists(model_and_data, capsys):
    mp, _ = model_and_data
    bad = mp.parent / "f64.npz"
    np.savez(bad, x=np.zeros((2, 1, 16, 8, 8), np.float64))
    line = refused(capsys, ["insert", mp, "--calib", bad], "float64; the model input wants float32",
                   ".astype(np.float32)", folder=mp.parent)
    assert "np.object" not in line


# ------------------------------------------------------------------------------------- 9. example

def test_9_example_refuses_to_overwrite_without_force(tmp_path, capsys):
    (tmp_path / "tiny_resnet.onnx").write_bytes(b"mine")
    refused(capsys, ["example", tmp_path], "tiny_resnet.onnx exists", "--force", folder=tmp_path)
    assert (tmp_path / "tiny_resnet.onnx").read_bytes() == b"mine"


def test_9_example_negative_samples_writes_nothing(tmp_path, capsys):
    refused(capsys, ["example", tmp_path / "ex", "--samples", "-3"], "--samples must be at least 1", folder=tmp_path)
    assert not (tmp_path / "ex").exists()


def test_9_example_into_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    refused(capsys, ["example", tmp_path / "afile"], "is a file, not a folder", folder=tmp_path)
    assert (tmp_path / "afile").read_text() == "x"


# --------------------------------------------------------------------------- 10. numbers and ops

@pytest.mark.parametrize("flags,words", [
    (["--accuracy-budget", "nan"], "--accuracy-budget must be a finite number"),
    (["--sensitivity-samples", "0"], "--sensitivity-samples must be at least 1"),
    (["--max-float-layers", "-1"], "--max-float-layers must be at least 0"),
    (["--exclude-op", "softmax"], "did you mean Softmax?"),
    (["--exclude-op", "NoSuchOp"], "'NoSuchOp' is not an ONNX op type")])
def test_10_bad_numbers_and_op_types(model_and_data, capsys, monkeypatch, flags, words):
    mp, dp = model_and_data
    no_sessions(monkeypatch)
    refused(capsys, ["insert", mp, "--calib", dp, *flags], words, folder=mp.parent)


# ----------------------------------------------------------------------------- 11. report --against

@pytest.mark.parametrize("content,words", [
    ("[]", "lists no layers"),
    ('{"Layers": []}', "lists no layers"),
    (json.dumps({"format": "qdqgraph-calib", "version": 1, "tensors": {}}), 'no "Layers" list'),
    ("[1, 2]", "layer 0 is neither a name nor an object"),
    ('{"Layers": [{"Name": 5}]}', "layer 0 is neither a name nor an object"),
    ('{"Layers": [{"Name": "conv", "Inputs": 5}]}', "must be lists"),
    ("not json at all", "not valid JSON"),
    (b"\x08\x07\x12\x05\xff\xfe", "a binary file"),
    (None, "is a folder")])
def test_11_report_against_a_file_that_is_no_layer_json(model_and_data, capsys, content, words):
    mp, _ = model_and_data
    against = mp.parent / "layers.json"
    if content is None:
        against.mkdir()
    elif isinstance(content, bytes):
        against.write_bytes(content)
    else:
        against.write_text(content)
    refused(capsys, ["report", mp, "--against", against], words, "trtexec --exportLayerInfo", folder=mp.parent)


# ------------------------------------------------------------------------------- 12. shard merges

@pytest.mark.parametrize("case,words", [("same-file-twice", "shard 1/2 is given twice"),
                                        ("copy-of-shard-1", "shard 1/2 is given twice"),
                                        ("shard-2-absent", "shard 2/2 is missing")])
def test_12_merge_needs_each_shard_once(model_and_data, capsys, case, words):
    mp, dp = model_and_data
    d = mp.parent
    assert main(["calibrate", str(mp), "--calib", str(dp), "--shard", "1/2", "-o", str(d / "s1.state"), "--quiet"]) == 0
    if case == "same-file-twice":
        states = [d / "s1.state", d / "s1.state"]
    elif case == "copy-of-shard-1":
        shutil.copy(d / "s1.state", d / "s1b.state")
        states = [d / "s1.state", d / "s1b.state"]
    else:
        states = [d / "s1.state"]
    refused(capsys, ["calibrate", "--merge", *states, "-o", d / "merged.json"], words, folder=d)


# ----------------------------------------------------------------------------- 13. output policy

def _policy_case(case: str, mp: Path, dp: Path) -> tuple[list, tuple]:
    d = mp.parent
    q = d / "q.onnx"
    if case in ("report-is-json-of-model", "compare-json-is-a-model"):
        q.write_bytes(mp.read_bytes())                # any model will do
    return {
        "report-is-the-input": (["insert", mp, "--calib", dp, "--report", mp, "--force"], ("also an input",)),
        "report-is-the-data": (["insert", mp, "--calib", dp, "--report", dp, "--force"], ("also an input",)),
        "report-is-the-output": (["insert", mp, "--calib", dp, "--report", q, "-o", q], ("both", "own path")),
        "report-is-json-of-model": (["report", q, "--json", q], ("also an input",)),
        "compare-json-is-a-model": (["compare", mp, q, "--data", dp, "--json", mp], ("also an input",)),
        "existing-report": (["insert", mp, "--calib", dp, "--report", d / "old.json", "-o", q],
                            ("old.json exists", "--force")),
        "report-is-a-folder": (["insert", mp, "--calib", dp, "--report", d / "folder", "-o", q], ("is a folder",)),
        "output-is-a-folder": (["insert", mp, "--calib", dp, "-o", d / "folder"], ("is a folder",)),
        "output-is-a-dangling-link": (["insert", mp, "--calib", dp, "-o", d / "link.onnx"], ("broken symbolic link",)),
        "dangling-link-with-force": (["insert", mp, "--calib", dp, "-o", d / "link.onnx", "--force"],
                                     ("broken symbolic link",)),
    }[case]


@pytest.mark.parametrize("case", ["report-is-the-input", "report-is-the-data", "report-is-the-output",
                                  "report-is-json-of-model", "compare-json-is-a-model", "existing-report",
                                  "report-is-a-folder", "output-is-a-folder", "output-is-a-dangling-link",
                                  "dangling-link-with-force"])
def test_13_output_policy(model_and_data, capsys, monkeypatch, case):
    mp, dp = model_and_data
    d = mp.parent
    (d / "old.json").write_text("old report")
    (d / "folder").mkdir()
    os.symlink(d / "nowhere.onnx", d / "link.onnx")
    argv, words = _policy_case(case, mp, dp)
    kept = {p: p.read_bytes() for p in d.iterdir() if p.is_file()}
    no_sessions(monkeypatch)
    refused(capsys, argv, *words, folder=d)
    assert {p: p.read_bytes() for p in kept} == kept       # nothing overwritten, the input least of all
    assert not (d / "nowhere.onnx").exists() and list((d / "folder").iterdir()) == []


def test_13_outputs_get_the_umask_mode(model_and_data, capsys):
    mp, dp = model_and_data
    old = os.umask(0o022)
    try:
        assert main(["insert", str(mp), "--calib", str(dp), "-o", str(mp.parent / "q.onnx"),
                     "--report", str(mp.parent / "r.json"), "--quiet"]) == 0
    finally:
        os.umask(old)
    assert (mp.parent / "q.onnx").stat().st_mode & 0o777 == 0o644
    assert (mp.parent / "r.json").stat().st_mode & 0o777 == 0o644


# ------------------------------------------------------------------------------------ 14. the race

def test_14_output_that_appears_while_writing_is_not_overwritten(model_and_data, capsys, monkeypatch):
    mp, dp = model_and_data
    out = mp.parent / "q.onnx"
    from qdqgraph.graph import wire
    real_write = wire.write_model

    def other_run_wins(model, f):                 # the other run's file lands between check and write
        real_write(model, f)
        if Path(f.name).name.startswith(".q.onnx."):
            out.write_bytes(b"the other run's model")
    monkeypatch.setattr(wire, "write_model", other_run_wins)
    line = refused(capsys, ["insert", mp, "--calib", dp, "-o", out], "appeared while", "q.onnx")
    assert out.read_bytes() == b"the other run's model"
    assert files(mp.parent) == {"m.onnx", "calib.npz", "q.onnx"}            # no temporary file left
    assert "wrote" not in capsys.readouterr().out and "--force" in line


def test_14_two_concurrent_runs_one_wins(model_and_data):
    mp, dp = model_and_data
    out = mp.parent / "q.onnx"
    cmd = [sys.executable, "-m", "qdqgraph", "insert", str(mp), "--calib", str(dp), "-o", str(out), "--verify", "0"]
    runs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for r in runs:
        stdout, stderr = r.communicate()
        results.append((r.returncode, stdout, stderr))
    assert sorted(rc for rc, _, _ in results) == [0, 2], results
    (_, out_ok, _), = [r for r in results if r[0] == 0]
    (_, out_lost, err_lost), = [r for r in results if r[0] == 2]
    assert f"wrote {out}" in out_ok and "wrote" not in out_lost
    assert err_lost.count("\n") == 1 and ("appeared while" in err_lost or "exists" in err_lost)
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)           # one complete result
    assert not [p for p in files(mp.parent) if p.endswith(".tmp")]


# ---------------------------------------------------------------------------------- 15. Ctrl-C

def test_15_ctrl_c_during_verify_says_what_was_written(model_and_data, capsys, monkeypatch):
    import qdqgraph.execution.evaluate
    mp, dp = model_and_data

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(qdqgraph.execution.evaluate, "compare", interrupted)
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(mp.parent / "q.onnx"),
                 "--report", str(mp.parent / "r.json")]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no output was written" not in err[0]
    assert err[0].startswith("qdqgraph: interrupted after writing") and "q.onnx" in err[0] and "r.json" in err[0]
    assert (mp.parent / "q.onnx").exists()


def test_15_ctrl_c_before_writing_says_nothing_was_written(model_and_data, capsys, monkeypatch):
    import qdqgraph.pipeline
    mp, dp = model_and_data

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(qdqgraph.pipeline, "quantize", interrupted)
    assert main(["insert", str(mp), "--calib", str(dp)]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["qdqgraph: interrupted; no output was written"]
    assert files(mp.parent) == {"m.onnx", "calib.npz"}


# --------------------------------------------------------------------------- 16. argparse errors

@pytest.mark.parametrize("argv,words", [
    (["insert", "m.onnx", "--bogus"], ("unrecognized arguments: --bogus", "`qdqgraph insert --help`")),
    (["insert", "m.onnx", "--method", "foo"], ("invalid choice: 'foo'", "`qdqgraph insert --help`")),
    (["frobnicate"], ("invalid choice: 'frobnicate'", "`qdqgraph --help`"))])
def test_16_usage_error_is_one_line(tmp_path, capsys, argv, words):
    refused(capsys, argv, *words, folder=tmp_path)
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------------------ 17. no TensorRT

def test_17_build_without_any_compiler_says_so_first(model_and_data, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)        # neither compiler importable
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)
    mp, _ = model_and_data
    line = refused(capsys, ["build", mp, "-o", mp.parent / "e.plan", "--shapes", "garbage"],
                   "no TensorRT compiler is installed", folder=mp.parent)
    assert "shapes" not in line.split(";")[0] and "qdqgraph[rtx]" in line


# ------------------------------------------------------------------ 18. stderr: only qdqgraph's own

_SNIPPET = """
import sys
import qdqgraph.cli, qdqgraph.execution.evaluate, qdqgraph.execution.runtime
from qdqgraph.errors import QdqError
mode = sys.argv[1]
if mode == "loud":             # onnxruntime left to log its warnings: the control
    qdqgraph.cli._quiet_onnxruntime = lambda: None
    options = qdqgraph.execution.runtime._options
    def loud(*a, **k):
        o = options(*a, **k)
        o.log_severity_level = 2
        return o
    qdqgraph.execution.runtime._options = loud
if mode == "error":            # an error after onnxruntime has run (calibration), during --verify
    def stop(*a, **k):
        raise QdqError("stopped after calibration", "the test's fix")
    qdqgraph.execution.evaluate.compare = stop
sys.exit(qdqgraph.cli.main(sys.argv[2:]))
"""


def test_18_stderr_holds_only_qdqgraph_lines(model_and_data):
    mp, dp = model_and_data
    d = mp.parent

    def start(mode, *argv):
        return subprocess.Popen([sys.executable, "-c", _SNIPPET, mode, "insert", str(mp), *argv],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs = {"loud": start("loud", "--calib", "random", "-o", str(d / "loud.onnx")),
            "random": start("quiet", "--calib", "random", "-o", str(d / "q.onnx")),
            "error": start("error", "--calib", str(dp), "-o", str(d / "e.onnx"))}
    got = {}
    for k, r in runs.items():
        out, err = r.communicate()
        got[k] = (r.returncode, out, err)
    rc, _, err = got["loud"]                  # the run does make onnxruntime warn, in colour
    assert rc == 0 and "onnxruntime" in err and "\x1b[" in err
    rc, out, err = got["random"]
    lines = err.strip().splitlines()
    assert rc == 0 and lines and all(x.startswith("qdqgraph: warning: ") for x in lines), err
    assert len(set(lines)) == len(lines) and sum("random data" in x for x in lines) == 1
    assert "warning" not in out and "onnxruntime" not in err and "\x1b[" not in err
    rc, out, err = got["error"]
    assert rc == 2 and err == "qdqgraph: error: stopped after calibration; the test's fix\n", err


def test_18_main_quiets_onnxruntimes_default_logger(model_and_data, capsys, monkeypatch):
    import onnxruntime as ort
    mp, _ = model_and_data
    said = []
    monkeypatch.setattr(ort, "set_default_logger_severity", said.append)
    assert main(["insert", str(mp), "--calib", "random", "-o", str(mp.parent / "q.onnx"), "--quiet"]) == 0
    assert said == [3]


# ------------------------------------------------------------------------- 19. --require-int8

@pytest.mark.parametrize("value, words", [
    ("-5", "--require-int8 must be at least 0, got -5"),
    ("150", "--require-int8 must be at most 100, got 150"),
    ("nan", "--require-int8 must be a finite number, got nan"),
])
def test_19_require_int8_out_of_range_refused_before_any_work(model_and_data, capsys, monkeypatch, value, words):
    mp, dp = model_and_data
    no_sessions(monkeypatch)
    refused(capsys, ["insert", mp, "--calib", dp, "--require-int8", value], words, "e.g. --require-int8 50",
            folder=mp.parent)


def test_19_require_int8_with_int4_refused(model_and_data, capsys, monkeypatch):
    mp, dp = model_and_data
    no_sessions(monkeypatch)
    refused(capsys, ["insert", mp, "--calib", dp, "--precision", "int4", "--require-int8", "10"],
            "--precision int4 quantizes weights only", "drop --require-int8", folder=mp.parent)


def test_19_plan_below_require_int8_writes_nothing(model_and_data, capsys):
    mp, dp = model_and_data
    refused(capsys, ["insert", mp, "--calib", dp, "--exclude-op", "Conv", "--report", mp.parent / "r.json",
                     "--require-int8", "50"],
            "INT8 FLOPs 0.0% is below --require-int8 50 (every Conv excluded by --exclude-op Conv)",
            "or lower --require-int8", folder=mp.parent)
