"""Bad input, round three (issue 33): special files as outputs and inputs, models from other tools in
`strip`/`report`/`fix`, SIGTERM, --debug's exit code, and the Python API's argument checks. Each case
gives exit 2 and one line `qdqgraph: error: <problem>; <fix>` (or exits 0 having done the right
thing), as docs/BAD_INPUT.md lists (cases 20 on); models are tiny and built in code."""
import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest_helpers import files
from qdqgraph.graph import outputs
from qdqgraph.cli import main
from qdqgraph.errors import QdqError
from test_bad_input import no_sessions, refused


# ------------------------------------------------------------- 20. special files as outputs

def _char_device(path: Path) -> Path:
    """A character device node like /dev/null (major 1, minor 3) at `path`; skips where mknod is not
    permitted (not root)."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError) as e:
        pytest.skip(f"cannot make a device node here ({e})")
    return path


def _special(kind: str, path: Path) -> Path:
    if kind == "fifo":
        os.mkfifo(path)
        return path
    return _char_device(path)


def _still(kind: str, path: Path) -> bool:
    mode = os.lstat(path).st_mode
    return stat.S_ISFIFO(mode) if kind == "fifo" else stat.S_ISCHR(mode)


@pytest.mark.parametrize("kind", ["fifo", "chardev"])
@pytest.mark.parametrize("flag", ["-o", "--report"])
def test_20_special_file_output_is_never_replaced(model_and_data, capsys, monkeypatch, kind, flag):
    mp, dp = model_and_data
    node = _special(kind, mp.parent / "node")
    argv = ["insert", mp, "--calib", dp, flag, node, "--force"]
    if flag == "--report":
        argv += ["-o", mp.parent / "q.onnx"]
    no_sessions(monkeypatch)
    line = refused(capsys, argv, "node is a " if kind == "fifo" else "node is a character device",
                   "not a regular file", "name a regular file", folder=mp.parent)
    assert _still(kind, node), line


@pytest.mark.parametrize("kind", ["fifo", "chardev"])
def test_20_strip_and_report_json_to_a_special_file(model_and_data, capsys, kind):
    mp, dp = model_and_data
    q = mp.parent / "q.onnx"
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(q), "--quiet", "--verify", "0"]) == 0
    capsys.readouterr()
    node = _special(kind, mp.parent / "node")
    refused(capsys, ["strip", q, "-o", node, "--force"], "not a regular file", folder=mp.parent)
    refused(capsys, ["report", q, "--json", node, "--force"], "not a regular file", folder=mp.parent)
    assert _still(kind, node)


def test_20_write_atomic_refuses_a_node_that_appears_while_writing(tmp_path):
    out = tmp_path / "r.json"

    def write(tmp: Path) -> None:                 # the node lands between the check and the rename
        tmp.write_text("{}")
        os.mkfifo(out)
    with pytest.raises(QdqError, match="is a FIFO, not a regular file"):
        outputs.write_atomic(out, write, force=True)
    assert stat.S_ISFIFO(os.lstat(out).st_mode) and files(tmp_path) == {"r.json"}


def test_20_dev_null_is_refused_by_the_check_alone():
    # the check only reads /dev/null's mode; nothing is written anywhere
    with pytest.raises(QdqError, match="/dev/null is a character device, not a regular file"):
        outputs.check_output("/dev/null", "--report", force=True)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


# ------------------------------------------------ 21. strip of other tools' Q/DQ and QOperator models

def _ort_uint8_relu_model():
    """onnxruntime's uint8 QDQ form of conv -> relu -> conv: the Relu is gone, folded into the uint8
    Q (zero point 0) after the first conv; weights INT8 constants -> DQ."""
    import onnxruntime as ort
    from qdqgraph.graph import io
    import motifs
    from test_fix import folded_relu, place
    with_relu = folded_relu(True)
    data = motifs.sample_data(with_relu)
    peak = ort.InferenceSession(io.with_outputs(with_relu, ["relu_out"]).SerializeToString()).run(
        ["relu_out"], {"x": data["x"][0]})[0].max()
    m = place(folded_relu(False), {("stem", 0): (0.03, 128), ("head", 0): (float(peak) / 255, 0)},
              {"stem.w": 0, "head.w": 0}, qtype=np.uint8)
    return m, data


def _run(model, data, outputs=None):
    import onnxruntime as ort
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(outputs, {"x": np.concatenate(list(data["x"]))})      # every sample in one batch


def test_21_strip_keeps_a_relu_onnxruntime_folded_into_a_uint8_range(tmp_path, capsys):
    from qdqgraph.graph import io
    m, data = _ort_uint8_relu_model()
    assert "Relu" not in {n.op_type for n in m.graph.node}
    src, out = tmp_path / "ort.qdq.onnx", tmp_path / "float.onnx"
    onnx.save(m, src)
    assert main(["strip", str(src), "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "kept 1 clamp as a Clip (a Relu or Clip folded into a Q range" in said and f"wrote {out}" in said
    stripped = onnx.load(str(out))
    onnx.checker.check_model(stripped, full_check=True)
    assert not {"QuantizeLinear", "DequantizeLinear"} & {n.op_type for n in stripped.graph.node}
    assert [o.name for o in stripped.graph.output] == [o.name for o in m.graph.output]
    want, = _run(m, data)
    got, = _run(stripped, data)
    cos = float((want * got).sum() / np.linalg.norm(want) / np.linalg.norm(got))
    assert cos > 0.99, cos
    head = next(n for n in stripped.graph.node if n.name == "head")      # what the Relu fed
    relu_place, = _run(io.with_outputs(stripped, [head.input[0]]), data, [head.input[0]])
    assert relu_place.min() >= 0 and (relu_place == 0).mean() > 0.2    # clamped, and there was something to clamp


def test_21_strip_leaves_qdqgraphs_own_output_without_clips(model_and_data, capsys):
    mp, dp = model_and_data
    q, back = mp.parent / "q.onnx", mp.parent / "back.onnx"
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(q), "--quiet", "--verify", "0"]) == 0
    assert main(["strip", str(q), "-o", str(back)]) == 0
    assert "Clip" not in {n.op_type for n in onnx.load(str(back)).graph.node}
    assert "clamps" not in capsys.readouterr().out


def qoperator_model():
    """onnxruntime's QOperator form: Q -> QLinearConv -> QLinearMatMul -> DQ (no DQ before the compute)."""
    f32, u8 = TensorProto.FLOAT, TensorProto.UINT8
    rng = np.random.default_rng(0)
    inits = [onnx.numpy_helper.from_array(v, n) for n, v in {
        "s": np.array(0.05, np.float32), "z": np.array(128, np.uint8),
        "ws": np.array(0.01, np.float32), "wz": np.array(0, np.uint8),
        "w": rng.integers(0, 255, (4, 3, 3, 3), dtype=np.uint8),
        "m": rng.integers(0, 255, (6, 5), dtype=np.uint8)}.items()]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
             helper.make_node("QLinearConv", ["xq", "s", "z", "w", "ws", "wz", "s", "z"], ["cq"], name="conv",
                              pads=[1, 1, 1, 1]),
             helper.make_node("QLinearMatMul", ["cq", "s", "z", "m", "ws", "wz", "s", "z"], ["mq"], name="mm"),
             helper.make_node("DequantizeLinear", ["mq", "s", "z"], ["y"], name="dq")]
    g = helper.make_graph(nodes, "qop", [helper.make_tensor_value_info("x", f32, [1, 3, 4, 6])],
                          [helper.make_tensor_value_info("y", f32, [1, 4, 4, 5])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def test_21_strip_refuses_a_qoperator_model(tmp_path, capsys):
    src = tmp_path / "qop.onnx"
    onnx.save(qoperator_model(), src)
    line = refused(capsys, ["strip", src, "-o", tmp_path / "f.onnx"], "QLinearConv, QLinearMatMul",
                   "operator-style quantization", "QDQ format", folder=tmp_path)
    assert "wrote" not in line and "removed" not in line


def test_21_report_names_the_qlinear_ops_tensorrt_rejects(tmp_path, capsys, model_and_data):
    from qdqgraph import trtsim
    src = tmp_path / "qop.onnx"
    onnx.save(qoperator_model(), src)
    found = [(d.node, d.message.split(" ")[0]) for d in trtsim.lint(qoperator_model()) if d.code == "QDQ215"]
    assert found == [("conv", "QLinearConv"), ("mm", "QLinearMatMul")]
    assert main(["report", str(src), "--strict"]) == 3
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("QDQ215")]
    assert len(lines) == 2 and "rejects" in lines[0] and "QuantFormat.QDQ" in lines[0]
    mp, dp = model_and_data                       # qdqgraph's own output: no such finding
    q = mp.parent / "q.onnx"
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(q), "--quiet", "--verify", "0"]) == 0
    assert not [d for d in trtsim.lint(onnx.load(str(q))) if d.code == "QDQ215"]


# ---------------------------------------------------------- 22. fix of a Q -> DQ -> Q -> DQ chain

def qdq_chain_model():
    """conv -> relu with its input through Q(0.05) -> DQ -> Q(0.04) -> DQ (two tools' quantizers in a row)."""
    import motifs
    m = motifs.conv_relu()
    g = m.graph
    conv = next(n for n in g.node if n.name == "conv")
    x = conv.input[0]
    g.initializer.extend([onnx.numpy_helper.from_array(np.array(v, t), n) for n, v, t in (
        ("s1", 0.05, np.float32), ("z1", 0, np.int8), ("s2", 0.04, np.float32), ("z2", 0, np.int8))])
    chain = [helper.make_node("QuantizeLinear", [x, "s1", "z1"], ["a_q"], name="q1"),
             helper.make_node("DequantizeLinear", ["a_q", "s1", "z1"], ["a_dq"], name="dq1"),
             helper.make_node("QuantizeLinear", ["a_dq", "s2", "z2"], ["b_q"], name="q2"),
             helper.make_node("DequantizeLinear", ["b_q", "s2", "z2"], ["b_dq"], name="dq2")]
    conv.input[0] = "b_dq"
    nodes = list(g.node)
    del g.node[:]
    g.node.extend(chain + nodes)
    onnx.checker.check_model(m, full_check=True)
    return m


def test_22_fix_reads_a_qdq_chain_as_its_last_pair(tmp_path, capsys):
    import qdqgraph
    src, out = tmp_path / "chain.onnx", tmp_path / "chain.fix.onnx"
    onnx.save(qdq_chain_model(), src)
    assert main(["fix", str(src), "-o", str(out)]) == 0           # was an IndexError, exit 1
    captured = capsys.readouterr()
    assert f"wrote {out}" in captured.out
    assert "read as their last pair" in captured.err and "dq1" in captured.err and "internal error" not in captured.err
    fixed = onnx.load(str(out))
    onnx.checker.check_model(fixed, full_check=True)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in fixed.graph.initializer}
    q, = [n for n in fixed.graph.node if n.op_type == "QuantizeLinear"]      # one pair left, on the conv input
    assert float(inits[q.input[1]]) == pytest.approx(0.04)                    # the scale the conv read
    r = qdqgraph.fix(qdq_chain_model())
    assert any("dq1" in w for w in r.report.warnings)
    back = tmp_path / "back.onnx"                                             # strip takes the chain too
    assert main(["strip", str(src), "-o", str(back)]) == 0
    assert not {"QuantizeLinear", "DequantizeLinear"} & {n.op_type for n in onnx.load(str(back)).graph.node}


# ------------------------------------------------------------------------------ 23. SIGTERM

# The run under test, in a child process: `insert` with the model write (or --verify, after it) made
# to wait, so that SIGTERM lands while the temporary file exists (or after the model is written).
_SLOW = r"""
import sys, time
import qdqgraph.execution.evaluate
import qdqgraph.graph.wire
from qdqgraph.cli import main
stage = sys.argv[1]
real_write = qdqgraph.graph.wire.write_model
def slow_write(model, f):
    real_write(model, f)
    if stage == "writing" and str(f.name).endswith(".tmp"):
        f.flush()
        print("READY", file=sys.stderr, flush=True)
        time.sleep(60)
def slow_compare(*a, **k):
    print("READY", file=sys.stderr, flush=True)
    time.sleep(60)
qdqgraph.graph.wire.write_model = slow_write
qdqgraph.execution.evaluate.compare = slow_compare
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("stage", ["writing", "verify"])
def test_23_sigterm_is_handled_like_ctrl_c(model_and_data, stage):
    import signal
    mp, dp = model_and_data
    out = mp.parent / "q.onnx"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW, stage, "insert", str(mp), "--calib", str(dp), "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr.readline().strip() == "READY"
        if stage == "writing":
            assert [p for p in files(mp.parent) if p.endswith(".tmp")]      # caught in the middle of the write
        proc.send_signal(signal.SIGTERM)
        err = proc.stderr.read().strip().splitlines()
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 143
    assert not [p for p in files(mp.parent) if p.endswith(".tmp")]
    if stage == "writing":
        assert err == ["qdqgraph: terminated (SIGTERM); no output was written"] and not out.exists()
    else:
        assert err == [f"qdqgraph: terminated (SIGTERM) after writing {out}"]
        onnx.checker.check_model(onnx.load(str(out)), full_check=True)


def test_23_main_restores_the_sigterm_handler(model_and_data, capsys):
    import signal
    before = signal.getsignal(signal.SIGTERM)
    assert main(["report", "missing.onnx"]) == 2
    assert signal.getsignal(signal.SIGTERM) is before or before is None


# ------------------------------------------------------------ 24. special files as inputs

def _input_case(case: str, mp: Path, dp: Path) -> tuple[list, str]:
    d = mp.parent
    fifo = d / "in.fifo"
    os.mkfifo(fifo)
    return {
        "model": (["insert", fifo, "--calib", dp, "-o", d / "q.onnx"], "model"),
        "calib": (["insert", mp, "--calib", fifo, "-o", d / "q.onnx"], "input"),
        "calib-cache": (["insert", mp, "--calib-cache", fifo, "-o", d / "q.onnx"], "input"),
        "rules": (["insert", mp, "--calib", dp, "--rules", fifo, "-o", d / "q.onnx"], "input"),
        "calibrate-calib": (["calibrate", mp, "--calib", fifo, "-o", d / "c.json"], "input"),
        "compare-data": (["compare", mp, mp, "--data", fifo], "input"),
        "report-model": (["report", fifo], "model"),
        "strip-model": (["strip", fifo, "-o", d / "f.onnx"], "model"),
        "fix-model": (["fix", fifo, "-o", d / "f.onnx"], "model"),
    }[case]


@pytest.mark.parametrize("case", ["model", "calib", "calib-cache", "rules", "calibrate-calib", "compare-data",
                                  "report-model", "strip-model", "fix-model"])
def test_24_a_fifo_as_input_is_refused_not_waited_on(model_and_data, capsys, monkeypatch, case):
    """Each run would wait forever for a writer to the FIFO; the timeout turns a hang into a failure."""
    import signal

    def hung(*a):
        raise AssertionError("qdqgraph waited on the FIFO")
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        mp, dp = model_and_data
        argv, what = _input_case(case, mp, dp)
        no_sessions(monkeypatch)
        refused(capsys, argv, f"{what} ", "in.fifo is a FIFO, not a regular file", "save its contents to a file",
                folder=mp.parent)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("where", ["data", "folder", "cache", "rules", "model"])
def test_24_the_api_refuses_special_files_too(model_and_data, where):
    """The readers behind the Python API check the file themselves (the CLI's check comes first)."""
    import signal

    import qdqgraph
    from qdqgraph.calib import calibration
    from qdqgraph.graph import io
    from qdqgraph.rulebook.files import read_rule_file

    def hung(*a):
        raise AssertionError("qdqgraph waited on the FIFO")
    mp, _ = model_and_data
    folder = mp.parent / "calib"
    folder.mkdir()
    fifo = (folder if where == "folder" else mp.parent) / "x.npz"
    os.mkfifo(fifo)
    call = {"data": lambda: qdqgraph.quantize(mp, calib=fifo),
            "folder": lambda: qdqgraph.calibrate(mp, folder),
            "cache": lambda: calibration.read_cache(fifo),
            "rules": lambda: read_rule_file(fifo),
            "model": lambda: io.load(fifo)}[where]
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        with pytest.raises(QdqError, match="x.npz is a FIFO, not a regular file"):
            call()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------------ 25. --debug's exit code

@pytest.mark.parametrize("where", ["before", "after"])
def test_25_debug_shows_the_traceback_and_keeps_exit_2(tmp_path, where):
    argv = ["--debug", "report", str(tmp_path / "missing.onnx")]
    if where == "after":
        argv = argv[1:] + ["--debug"]
    r = subprocess.run([sys.executable, "-m", "qdqgraph", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert err[0].startswith("Traceback") and "QdqError" in r.stderr
    assert err[-1].startswith("qdqgraph: error: model file not found:") and "missing.onnx" in err[-1]


def test_25_debug_keeps_the_ctrl_c_exit_code(model_and_data, capsys, monkeypatch):
    import qdqgraph.pipeline
    mp, dp = model_and_data

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(qdqgraph.pipeline, "quantize", interrupted)
    assert main(["--debug", "insert", str(mp), "--calib", str(dp)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1] == "qdqgraph: interrupted; no output was written"


# --------------------------------------------------------- 26. the Python API's argument types

def _api_cases(mp: Path, data: dict):
    import qdqgraph
    m = onnx.load(str(mp))
    return {   # name: (call, parameter named, words of what it accepts)
        "quantize-int": (lambda: qdqgraph.quantize(123, calib="random"), "quantize(model=...)", "onnx.ModelProto"),
        "quantize-bytes": (lambda: qdqgraph.quantize(m.SerializeToString(), calib="random"), "quantize(model=...)",
                           "onnx.load_from_string"),
        "calib-array": (lambda: qdqgraph.quantize(mp, calib=data["x"]), "quantize(calib=...)",
                        "which model input a bare array feeds"),
        "calib-int": (lambda: qdqgraph.quantize(mp, calib=5), "quantize(calib=...)", '"random"'),
        "calib-npzfile": (lambda: qdqgraph.quantize(mp, calib=np.load(mp.parent / "calib.npz")),
                          "quantize(calib=...)", "dict(...)"),
        "calib-keys": (lambda: qdqgraph.quantize(mp, calib={0: data["x"]}), "quantize(calib=...)", "input names"),
        "config-str": (lambda: qdqgraph.quantize(mp, calib="random", config="x"), "quantize(config=...)",
                       "qdqgraph.QuantizeConfig"),
        "config-dict": (lambda: qdqgraph.quantize(mp, calib="random", config={"method": "max"}),
                        "quantize(config=...)", "**options"),
        "calib-cache-int": (lambda: qdqgraph.quantize(mp, calib_cache=5), "quantize(calib_cache=...)", "amax"),
        "calibrate-int": (lambda: qdqgraph.calibrate(123, data), "calibrate(model=...)", "onnx.ModelProto"),
        "calibrate-none": (lambda: qdqgraph.calibrate(mp, None), "calibrate() needs calibration data", "calib="),
        "calibrate-shard": (lambda: qdqgraph.calibrate(mp, data, shard=3), "calibrate(shard=...)", "(i, n)"),
        "fix-int": (lambda: qdqgraph.fix(123), "fix(model=...)", "onnx.ModelProto"),
        "strip-path": (lambda: qdqgraph.strip_qdq(str(mp)), "strip_qdq(graph=...)", "qdqgraph.load(model).graph"),
        "strip-model": (lambda: qdqgraph.strip_qdq(m), "strip_qdq(graph=...)", "not onnx.ModelProto"),
    }


@pytest.mark.parametrize("case", ["quantize-int", "quantize-bytes", "calib-array", "calib-int", "calib-npzfile",
                                  "calib-keys", "config-str", "config-dict", "calib-cache-int", "calibrate-int",
                                  "calibrate-none", "calibrate-shard", "fix-int", "strip-path", "strip-model"])
def test_26_api_answers_wrong_types_naming_the_parameter(model_and_data, monkeypatch, case):
    import motifs
    mp, _ = model_and_data
    call, parameter, accepts = _api_cases(mp, motifs.sample_data(onnx.load(str(mp))))[case]
    no_sessions(monkeypatch)                          # checked before any work
    with pytest.raises(TypeError) as info:            # a TypeError and a QdqError at once
        call()
    e = info.value
    assert isinstance(e, QdqError) and e.fix
    text = str(e)
    assert parameter in text and accepts in text, text
    assert "--" not in text and "pathlib" not in text and "expected str, bytes" not in text   # API words only


def test_26_api_still_takes_what_it_documents(model_and_data):
    import qdqgraph
    import motifs
    mp, dp = model_and_data
    m = onnx.load(str(mp))
    data = motifs.sample_data(m)
    assert qdqgraph.quantize(m, calib=data, config=qdqgraph.QuantizeConfig(method="max")).model is not None
    assert qdqgraph.quantize(mp, calib=str(dp), method="max").model is not None
    assert qdqgraph.calibrate(str(mp), dp, method="max", shard=(1, 2)).shard == "1/2"


# ------------------------------------------- 27. --accuracy-budget claims what --verify measures

def residual_cnn(blocks: int = 3, c: int = 32) -> onnx.ModelProto:
    """A small residual CNN (stem, `blocks` conv-relu-conv blocks with identity skips, a 1x1 head),
    He-scaled weights so that activations keep their size through the blocks."""
    import motifs
    g = motifs.G("residual_cnn")
    x = g.input("x", ["n", 3, 16, 16])

    def conv(x, cin, cout, name, k=3):
        w = g.weight(f"{name}.w", (cout, cin, k, k), (2 / (cin * k * k)) ** 0.5)
        return g.node("Conv", [x, w, g.weight(f"{name}.b", (cout,), 0.1)], name=name, kernel_shape=[k, k],
                      pads=[k // 2] * 4)
    y = g.node("Relu", [conv(x, 3, c, "stem")], name="stem_relu")
    for b in range(blocks):
        a = g.node("Relu", [conv(y, c, c, f"b{b}.conv1")], name=f"b{b}.relu1")
        y = g.node("Relu", [g.node("Add", [conv(a, c, c, f"b{b}.conv2"), y], name=f"b{b}.add")], name=f"b{b}.relu2")
    g.node("Conv", [y, g.weight("head.w", (c, c, 1, 1), (1 / c) ** 0.5)], ["y"], name="head", kernel_shape=[1, 1])
    g.output("y")
    return g.model()


def _claim_and_verify(out: str) -> tuple[float, float]:
    import re
    claim = re.search(r"fallback: output SQNR [\d.]+ dB all INT8 -> ([\d.]+) dB in the written model", out)
    verify = re.search(r"float vs quantized on 8 samples\n  output y: cosine [\d.]+, SQNR ([\d.]+) dB", out)
    assert claim and verify, out
    return float(claim.group(1)), float(verify.group(1))


@pytest.mark.parametrize("budget", [32.5, 36.0])
def test_27_accuracy_budget_claims_what_verify_measures(tmp_path, capsys, budget):
    """The sweep's switchable model kept INT8-rounded weights on its "float" side, and the written
    model is planned again and gets FP16 islands: the claimed SQNR was the sweep's (here 33.0 dB all
    INT8 against a measured 31.6). Now the claim is the written model's, on the samples --verify uses."""
    import motifs
    import json
    m = residual_cnn()
    mp, dp, rp = tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path / "r.json"
    onnx.save(m, mp)
    np.savez(dp, **motifs.sample_data(m, n=16))
    assert main(["insert", str(mp), "--calib", str(dp), "--accuracy-budget", str(budget), "--report", str(rp)]) == 0
    captured = capsys.readouterr()
    claimed, verified = _claim_and_verify(captured.out)
    assert abs(claimed - verified) <= 0.1, captured.out         # both printed to one decimal
    assert verified >= budget, captured.out
    fb = json.loads(rp.read_text())["fallback"]
    assert fb["measured"] == "written model" and fb["met"] and fb["final_db"] >= budget
    assert "below --accuracy-budget" not in captured.err


def test_27_a_budget_out_of_reach_is_said_not_claimed(tmp_path, capsys):
    import motifs
    m = residual_cnn()
    mp, dp = tmp_path / "m.onnx", tmp_path / "d.npz"
    onnx.save(m, mp)
    np.savez(dp, **motifs.sample_data(m, n=16))
    assert main(["insert", str(mp), "--calib", str(dp), "--accuracy-budget", "60", "--max-float-layers", "1"]) == 0
    captured = capsys.readouterr()
    claimed, verified = _claim_and_verify(captured.out)
    assert abs(claimed - verified) <= 0.1 and claimed < 60, captured.out
    assert "below --accuracy-budget 60 (1 node(s) in float, --max-float-layers 1 reached)" in captured.err


# ----------------------------------------- 28. fix is a no-op on insert's own transformer output

def _qdq_scales(model: onnx.ModelProto) -> dict:
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    return {(n.op_type, n.input[0], n.output[0]): inits[n.input[1]].tobytes()
            for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")}


@pytest.mark.parametrize("calib", [False, True])
def test_28_fix_keeps_the_attention_insert_kept_float(tmp_path, capsys, calib):
    """insert keeps an attention float when INT8 costs it more than 3 dB (forced here with
    int8_attention="off"); fix planned the attention INT8 again: without --calib it refused ("no scale
    for k_t_out, q_t_out, v_t_out"), with it it calibrated and quantized the attention (30.4 -> 28.0 dB)."""
    import motifs
    import qdqgraph
    from qdqgraph.samples.data import CalibrationData
    from qdqgraph.execution.evaluate import compare
    from qdqgraph.prepare import model_inputs
    m = motifs.attention_block(seq=16, hidden=64, heads=4)
    data = motifs.sample_data(m, n=16)
    q = qdqgraph.quantize(m, data, int8_attention="off").model
    assert not {"qk", "pv"} & {c for n in q.graph.node if n.op_type == "DequantizeLinear"
                                for c in (x.name for x in q.graph.node if n.output[0] in x.input)}
    src, out, dp = tmp_path / "q.onnx", tmp_path / "q.fixed.onnx", tmp_path / "d.npz"
    onnx.save(q, src)
    np.savez(dp, **data)
    assert main(["fix", str(src), "-o", str(out), *(["--calib", str(dp)] if calib else [])]) == 0, \
        capsys.readouterr().err
    fixed = onnx.load(str(out))
    assert _qdq_scales(fixed) == _qdq_scales(q)                      # the same Q/DQ, the same scales
    assert fixed.SerializeToString() == q.SerializeToString()        # fix changed nothing

    def sqnr(model):
        cd = CalibrationData(data, model_inputs(qdqgraph.graph.io.load(m).graph), 8)
        return compare(m, model, data=cd, tensors=False).outputs[0].sqnr_db
    assert sqnr(fixed) >= sqnr(q) - 1e-6
    if calib:                                   # asked for, the attention goes INT8 (calibrated)
        r = qdqgraph.fix(q, data, int8_attention="on")
        assert {"qk", "pv"} <= set(r.plan.quantized_nodes()) and not r.report.unchanged
    else:                                       # and without data that is the one line naming the tensors
        with pytest.raises(QdqError, match="no scale for 3 tensor.*k_t_out, q_t_out, v_t_out"):
            qdqgraph.fix(q, int8_attention="on")


# ---------------------------------- 29. a plan with no INT8 layer is not written as a quantized model

def tiny_conv_chain(blocks: int = 10, c: int = 4, wide_blocks: int = 0, wide: int = 32) -> onnx.ModelProto:
    """Residual blocks of convs with `c` channels (placement keeps them float, P10-tiny-conv), after
    `wide_blocks` blocks of `wide` channels (INT8 convs) and a 1x1 conv down to `c` channels."""
    import motifs
    g = motifs.G("tiny_conv_chain")
    y = g.input("x", ["n", wide if wide_blocks else c, 16, 16])

    def conv(x, name, cin, cout, k=3):
        return g.node("Conv", [x, g.weight(f"{name}.w", (cout, cin, k, k), 0.02)], name=name, kernel_shape=[k, k],
                      pads=[k // 2] * 4)

    def block(y, b, width):
        a = conv(g.node("Relu", [conv(y, f"b{b}.conv1", width, width)], name=f"b{b}.relu1"), f"b{b}.conv2",
                 width, width)
        return g.node("Relu", [g.node("Add", [a, y], name=f"b{b}.add")], name=f"b{b}.relu2")
    for b in range(wide_blocks):
        y = block(y, b, wide)
    if wide_blocks:
        y = g.node("Relu", [conv(y, "narrow", wide, c, 1)], name="narrow.relu")
    for b in range(wide_blocks, wide_blocks + blocks):
        y = block(y, b, c)
    g.node("Identity", [y], ["y"], name="out")
    g.output("y")
    return g.model()


# P6 as it was: the skip of every residual Add quantized, whatever precision the branch's conv runs in
_P6_WHATEVER_THE_CONV = """schema = 1
[[rule]]
id = "P6-residual-add"
doc = "Add(conv_branch, skip) -> Add(conv_branch, DQ(Q(skip)))"
ref = "TRT_RULES.md P6"
op = "add"
when = ["residual_skip"]
quantize = [{ input = "$skip", kind = "activation" }]
"""


@pytest.mark.parametrize("blocks", [10, 300])
def test_29_no_int8_layer_no_qdq_written(tmp_path, capsys, blocks):
    """Was: "0 INT8, 20 reformats" and the Q/DQ written anyway (output SQNR 22.5 dB for nothing). The
    residual rule no longer quantizes these Adds (the next test); a rules file that does still gets
    the plan refused as a whole, whatever the model's size."""
    import motifs
    m = tiny_conv_chain(blocks)
    mp, dp, out, rules = tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path / "q.onnx", tmp_path / "p6.toml"
    onnx.save(m, mp)
    np.savez(dp, **motifs.sample_data(m, n=4))
    rules.write_text(_P6_WHATEVER_THE_CONV)
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(out), "--rules", str(rules)]) == 0
    captured = capsys.readouterr()
    written = onnx.load(str(out))
    assert not {"QuantizeLinear", "DequantizeLinear"} & {n.op_type for n in written.graph.node}
    assert "float16" in {onnx.helper.tensor_dtype_to_np_dtype(i.data_type).name for i in written.graph.initializer}
    assert f"0 INT8, {2 * blocks + 2} float, 0 reformats" in captured.out, captured.out
    said = [line for line in captured.err.splitlines() if "the plan runs no layer in INT8" in line]
    assert len(said) == 1 and f"{2 * blocks} standalone reformat(s)" in said[0] and \
        "the model is written in float with fp16 islands" in said[0], captured.err
    assert len(captured.err.splitlines()) <= 3, captured.err                  # whatever the model's size
    import re
    sqnr = float(re.search(r"output y: cosine [\d.]+, SQNR ([\d.]+) dB", captured.out).group(1))
    assert sqnr > 60, captured.out                        # float with FP16 islands (was 22.5 dB at 10 blocks)


def _qdq_only_kernels(layer_json: Path) -> list[str]:
    """The compiled kernels that only scale, round and cast (a quantize, or a quantize-dequantize
    round trip computed in float), from `build --layer-info`."""
    import json

    from qdqgraph.backends.listing import fused_ops
    names = [x["Name"] for x in json.loads(layer_json.read_text())["Layers"]]
    return [n for n in names if "Roun" in fused_ops(n) and set(fused_ops(n)) <= {"Mul", "Min", "Max", "Roun", "Cast"}]


@pytest.mark.parametrize("wide_blocks", [0, 3])
def test_29_residual_adds_beside_float_convs_get_no_qdq(tmp_path, capsys, wide_blocks):
    """An Add whose branch conv runs in float (P10-tiny-conv) gets no Q/DQ on its skip: it cannot run in
    the conv's INT8 epilogue, so the Q/DQ would only be reformats. Adds beside INT8 convs keep theirs.
    The compiled engine (TensorRT for RTX) then has no kernel that only quantizes, but the one that
    quantizes the network's input for the first INT8 conv."""
    import motifs
    from qdqgraph.graph import io
    from qdqgraph.placement.planner import plan_placement
    m = tiny_conv_chain(6, wide_blocks=wide_blocks)
    plan = plan_placement(io.load(m).graph)
    adds = {f"b{b}.add": plan.decisions[f"b{b}.add"] for b in range(wide_blocks + 6)}
    assert [d.quantized for d in adds.values()] == [True] * wide_blocks + [False] * 6
    assert all(d.rule == "P6-residual-add" and "runs in float (P10-tiny-conv)" in d.reason
               for d in list(adds.values())[wide_blocks:])
    mp, dp, rules = tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path / "p6.toml"
    onnx.save(m, mp)
    np.savez(dp, **motifs.sample_data(m, n=4))
    rules.write_text(_P6_WHATEVER_THE_CONV)
    if importlib.util.find_spec("tensorrt_rtx") is None:
        pytest.skip("needs TensorRT for RTX to compile: pip install 'qdqgraph[rtx]'")
    found = {}
    for label, extra in (("now", []), ("before", ["--rules", str(rules)])):
        out, layers = tmp_path / f"{label}.onnx", tmp_path / f"{label}.json"
        assert main(["insert", str(mp), "--calib", str(dp), "-o", str(out), *extra]) == 0
        text = capsys.readouterr().out
        assert main(["build", str(out), "-o", str(tmp_path / f"{label}.engine"), "--calib", str(dp),
                     "--layer-info", str(layers)]) == 0
        capsys.readouterr()
        found[label] = (text, _qdq_only_kernels(layers))
    text, kernels = found["now"]
    assert "reformats (0 inside the network)" in text and ("0 INT8" in text) == (not wide_blocks), text
    assert len(kernels) == (1 if wide_blocks else 0), kernels
    if wide_blocks:                # as it was: each tiny block's skip quantized and dequantized in float
        assert len(found["before"][1]) > len(kernels), found["before"][1]


def test_29_repeated_warnings_are_counted_not_printed(capsys):
    from qdqgraph.cli.messages import reset, warn, warn_all
    reset()
    warn_all([f"tensor 't{i}' was zero over all calibration samples; it got the safe scale" for i in range(5000)]
             + ["another warning"])
    for i in range(100):
        warn(f"node 'n{i}' is odd")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 + 1 + 1 + 3 + 1, err
    assert "4997 more warning(s) of the form \"tensor '?' was zero over all calibration samples" in err[3]
    assert err[4].endswith("another warning") and "further warnings of the form \"node '?' is odd\"" in err[-1]
    reset()


# ------------------------------------------------- 30. local functions (torch's dynamo exporter)

def local_function_model(c: int = 16) -> onnx.ModelProto:
    """Two calls of a local function ConvRelu (a FunctionProto in model.functions wrapping Conv +
    Relu), as torch's dynamo exporter writes modules."""
    fn = helper.make_function("pkg.custom", "ConvRelu", ["x", "w", "b"], ["y"],
                              [helper.make_node("Conv", ["x", "w", "b"], ["t"], kernel_shape=[3, 3], pads=[1] * 4),
                               helper.make_node("Relu", ["t"], ["y"])],
                              opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(0)
    inits, nodes, x = [], [], "x"
    for i in range(2):
        inits += [onnx.numpy_helper.from_array((rng.standard_normal((c, c, 3, 3)) * 0.1).astype(np.float32), f"w{i}"),
                  onnx.numpy_helper.from_array((rng.standard_normal(c) * 0.1).astype(np.float32), f"b{i}")]
        nodes.append(helper.make_node("ConvRelu", [x, f"w{i}", f"b{i}"], [f"y{i}"], name=f"block{i}",
                                      domain="pkg.custom"))
        x = f"y{i}"
    g = helper.make_graph(nodes, "local_functions", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", c, 8, 8])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["n", c, 8, 8])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("pkg.custom", 1)],
                          functions=[fn])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def test_30_local_functions_are_inlined_and_quantized(tmp_path, capsys):
    """Was: the functions dropped from the written model, which was left behind, and --verify's
    "pkg.custom:ConvRelu(-1) is not a registered function/op; pass --custom-op-library"."""
    import onnxruntime as ort
    m = local_function_model()
    mp, dp, out = tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path / "q.onnx"
    onnx.save(m, mp)
    np.savez(dp, x=np.random.default_rng(1).standard_normal((8, 2, 16, 8, 8)).astype(np.float32))
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert "repaired: 2 call(s) of 1 local function(s) (pkg.custom::ConvRelu) inlined" in captured.out
    assert "custom-op-library" not in captured.err and "passed through unquantized" not in captured.err
    assert "placed: 2 activation Q/DQ, 2 weight DQ" in captured.out and "SQNR" in captured.out
    q = onnx.load(str(out))
    onnx.checker.check_model(q, full_check=True)
    assert not q.functions and {n.op_type for n in q.graph.node} >= {"Conv", "Relu", "DequantizeLinear"}
    assert {n.name for n in q.graph.node if n.op_type == "Conv"} == {"ConvRelu/Conv_0__1", "ConvRelu/Conv_0__2"}
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert sess.run(None, {"x": np.ones((1, 16, 8, 8), np.float32)})[0].shape == (1, 16, 8, 8)
    import qdqgraph                                  # the API: the caller's model is left as it was
    before = m.SerializeToString()
    r = qdqgraph.quantize(m, calib=str(dp))
    assert len(r.model.functions) == 0 and r.plan.decisions["ConvRelu/Conv_0__1"].quantized
    assert m.SerializeToString() == before


# --------------------------------------- 31. outputs past 2 GB, and FP8/INT4 of models past 2 GB

def _mlp(hidden: int = 256, opset: int = 17) -> onnx.ModelProto:
    import motifs
    g = motifs.G("mlp")
    x = g.input("x", ["b", 8, hidden])
    h = g.node("Relu", [g.node("MatMul", [x, g.weight("w1", (hidden, hidden), hidden ** -0.5)], name="fc1")], name="act")
    g.node("MatMul", [h, g.weight("w2", (hidden, hidden), hidden ** -0.5)], ["y"], name="fc2")
    g.output("y")
    return g.model(opset)


def _no_large_serialization(monkeypatch):
    """The version converter serializes the model it converts, which protobuf refuses past 2 GB
    ("Failed to serialize proto"): a model past the (lowered) threshold must not reach it."""
    from onnx import version_converter
    from qdqgraph.graph import io
    real = version_converter.convert_version

    def convert(model, target):
        if io.tensor_bytes(model) >= io.EXTERNAL_DATA_THRESHOLD:
            raise RuntimeError("Failed to serialize proto")
        return real(model, target)
    monkeypatch.setattr(version_converter, "convert_version", convert)


@pytest.mark.parametrize("precision", ["int8", "fp8", "int4"])
def test_31_a_model_past_2gb_is_quantized_and_written_with_external_data(tmp_path, capsys, monkeypatch, precision):
    """Was: `External data file exists in .q.onnx.data.XXXX.tmp` for an output in the current folder
    (onnx looks for the data file relative to the working directory), and "Failed to serialize
    proto" raising the opset for FP8 (19) and INT4 (21). The threshold stands in for 2 GB."""
    import onnxruntime as ort
    from qdqgraph.graph import io
    import motifs
    m = _mlp(opset=13)
    monkeypatch.setattr(io, "EXTERNAL_DATA_THRESHOLD", 100_000)          # the weights: 2 x 256 KB
    _no_large_serialization(monkeypatch)
    monkeypatch.chdir(tmp_path)
    onnx.save(m, "m.onnx")
    np.savez("d.npz", **motifs.sample_data(m))
    extra = ["--int4-method", "rtn", "--block-size", "64"] if precision == "int4" else []
    assert main(["insert", "m.onnx", "--calib", "d.npz", "-o", "q.onnx", "--precision", precision, *extra]) == 0, \
        capsys.readouterr().err
    out = capsys.readouterr().out
    external = precision != "int4"                 # INT4 weights: 64 KB, below the threshold
    assert files(tmp_path) == {"m.onnx", "d.npz", "q.onnx"} | ({"q.onnx.data"} if external else set())
    onnx.checker.check_model(str(tmp_path / "q.onnx"), full_check=True)
    q = onnx.load(str(tmp_path / "q.onnx"), load_external_data=False)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in q.graph.initializer) == external
    assert io.opset_of(q) >= {"int8": 13, "fp8": 19, "int4": 21}[precision]
    sess = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"])
    assert sess.run(None, {"x": np.ones((1, 8, 256), np.float32)})[0].shape == (1, 8, 256)
    assert "SQNR" in out


def test_31_save_with_external_data_into_the_current_folder(tmp_path, monkeypatch):
    """onnx looked for the data file relative to the working directory, where the output policy's
    temporary file already stood: `External data file exists in .q.onnx.data.XXXX.tmp`."""
    import motifs
    from qdqgraph.graph import io
    monkeypatch.setattr(io, "EXTERNAL_DATA_THRESHOLD", 1000)
    monkeypatch.chdir(tmp_path)
    written = io.save(motifs.conv_relu(c=32), "q.onnx")
    assert [p.name for p in written] == ["q.onnx", "q.onnx.data"] and files(tmp_path) == {"q.onnx", "q.onnx.data"}
    onnx.checker.check_model("q.onnx", full_check=True)


@pytest.mark.slow
def test_31_a_real_model_past_2gb_int4(tmp_path, capsys):
    """Two MatMuls whose float weights total 2.15 GB (one tensor cannot pass protobuf's 2 GB), quantized
    to INT4 by rounding to nearest: the opset raised past protobuf's limit (was "Failed to serialize
    proto"), the output written. Needs about 14 GB of free memory."""
    from qdqgraph.execution.memory import available_bytes
    # the memory a run can take (MemAvailable: the page cache counts), not the pages free this moment:
    # a machine that has just built engines holds gigabytes as reclaimable cache
    available = available_bytes() or os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if available < 14 << 30:
        pytest.skip("needs about 14 GB of free memory")
    from onnx import numpy_helper
    n = 16_384                                     # 2 x 16384^2 x 4 bytes = 2.15 GB
    rng = np.random.default_rng(0)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
                           helper.make_node("MatMul", ["h", "w2"], ["y"], name="fc2")], "big",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, n])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, n])])
    for name in ("w1", "w2"):
        g.initializer.append(numpy_helper.from_array(rng.standard_normal((n, n), dtype=np.float32) * n ** -0.5, name))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    mp = tmp_path / "big.onnx"
    onnx.save(m, str(mp), save_as_external_data=True, location="big.onnx.data")
    del m, g
    assert main(["insert", str(mp), "--precision", "int4", "--int4-method", "rtn", "-o", str(tmp_path / "q.onnx"),
                 "--quiet"]) == 0, capsys.readouterr().err
    assert files(tmp_path) == {"big.onnx", "big.onnx.data", "q.onnx"}   # INT4: 0.54 GB, one file
    q = onnx.load(str(tmp_path / "q.onnx"), load_external_data=False)
    assert sum(nd.op_type == "DequantizeLinear" for nd in q.graph.node) == 2
    onnx.checker.check_model(str(tmp_path / "q.onnx"))


# ------------------------------------------------------------------ 32. BF16 islands

def test_32_bf16_islands_are_predicted_and_verify_says_why_it_is_skipped(tmp_path, capsys):
    """--high-precision bf16: the simulator read BF16 tensors as carrying no data and crashed (the
    summary said "the TensorRT simulation failed"); --verify then failed on onnxruntime's CPU, which has
    no BF16 kernels, with exit 2 after the model was written and a hint to pass --calib-cache."""
    import numpy as np
    import onnx

    import motifs
    from qdqgraph.cli import main
    m = motifs.residual_add()
    onnx.save(m, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", **motifs.sample_data(m))
    assert main(["insert", str(tmp_path / "m.onnx"), "--calib", str(tmp_path / "d.npz"), "-o",
                 str(tmp_path / "b.onnx"), "--high-precision", "bf16"]) == 0
    out, err = capsys.readouterr()
    assert "simulation failed" not in err and "TensorRT prediction:" in out
    assert "verify skipped: onnxruntime's CPU has no bfloat16 kernels" in out
    onnx.checker.check_model(onnx.load(str(tmp_path / "b.onnx")), full_check=True)


def _casts_and_kept(model: onnx.ModelProto) -> tuple[int, list[str]]:
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    kept = [n.op_type for n in model.graph.node if n.op_type not in ("Cast", "QuantizeLinear", "DequantizeLinear")
            and any(v.type.tensor_type.elem_type == TensorProto.FLOAT for v in model.graph.value_info
                    if v.name in n.output)]
    return len(casts), kept


def test_32_bf16_islands_are_bf16_like_fp16_islands_and_predicted_as_compiled(tmp_path, capsys):
    """--high-precision bf16 at opset 19 kept every Conv and MaxPool float32 behind Casts (their
    opset-19 schemas allow float16 but not bfloat16): 29 ops kept, 12 Casts, a prediction of 15
    reformats for the datacenter rules and 3 for TensorRT for RTX, whose compiler fused the Casts away
    and listed 1. The islands are now written at opset 22, as BF16 as FP16's, and the prediction for
    TensorRT for RTX matches its compiled engine."""
    from qdqgraph import quantize
    from qdqgraph.graph.example import smooth_images, tiny_resnet
    m, data = tiny_resnet(), {"input": smooth_images(8)}
    fp16 = onnx.shape_inference.infer_shapes(quantize(m, data, high_precision="fp16").model)
    bf16 = onnx.shape_inference.infer_shapes(quantize(m, data, high_precision="bf16").model)
    assert {o.version for o in bf16.opset_import if o.domain in ("", "ai.onnx")} == {22}
    assert _casts_and_kept(bf16) == _casts_and_kept(fp16), (_casts_and_kept(bf16), _casts_and_kept(fp16))
    convs = [n for n in bf16.graph.node if n.op_type == "Conv"]
    types = {v.name: v.type.tensor_type.elem_type for v in bf16.graph.value_info}
    assert convs and all(types[n.output[0]] == TensorProto.BFLOAT16 for n in convs)
    if importlib.util.find_spec("tensorrt_rtx") is None:
        pytest.skip("needs TensorRT for RTX to compile: pip install 'qdqgraph[rtx]'")
    mp, dp, out = tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path / "b.onnx"
    onnx.save(m, mp)
    np.savez(dp, **data)
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(out), "--high-precision", "bf16",
                 "--target", "tensorrt-rtx"]) == 0
    capsys.readouterr()
    assert main(["build", str(out), "-o", str(tmp_path / "b.engine"), "--calib", str(dp)]) == 0
    import re
    said = re.search(r"standalone quantize kernels: predicted (\d+), compiled (\d+)", capsys.readouterr().out)
    assert said and said.group(1) == said.group(2), said


def test_32_bf16_islands_of_a_model_that_cannot_reach_opset_22_say_so(monkeypatch):
    import qdqgraph
    from qdqgraph.graph import io
    from qdqgraph.graph.example import smooth_images, tiny_resnet
    real = io.raise_opset

    def no_22(model, minimum=13, why=""):
        if minimum >= 22:
            raise QdqError(f"the model's opset could not be raised to {minimum}, which {why} needs (no adapter)",
                           "re-export")
        return real(model, minimum, why)
    monkeypatch.setattr(io, "raise_opset", no_22)
    r = qdqgraph.quantize(tiny_resnet(), {"input": smooth_images(4)}, high_precision="bf16")
    assert {o.version for o in r.model.opset_import if o.domain in ("", "ai.onnx")} == {19}
    said = [w for w in r.report.warnings if "could not be raised to 22" in w]
    assert len(said) == 1 and "stay float32 behind Casts" in said[0], r.report.warnings
    assert sum(n.op_type == "Cast" for n in r.model.graph.node) > 2        # the convolutions' Casts


def test_32_a_bfloat16_kernel_type_reads_as_bf16_not_fp32():
    from qdqgraph.trtsim.engine_report import precision_of
    assert [precision_of(t) for t in ("BFloat16", "BF16 format", "Float", "Half")] == ["bf16", "bf16", "fp32", "fp16"]
