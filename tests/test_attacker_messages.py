"""Messages and the CLI/API contract (issue 33, cases 33 on): every line names what the user asked
for, in the words they used (a flag on the command line, a keyword argument in the Python API), and
the fix it names works; summaries name the precision asked; stdout holds only qdqgraph's lines.
docs/BAD_INPUT.md lists each case with its line; models are tiny and built in code."""
import ast
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import motifs
from conftest_helpers import files
from qdqgraph.cli import main
from qdqgraph.errors import QdqError
from test_bad_input import no_sessions, one_error_line, refused

ROOT = Path(__file__).resolve().parents[1]


def mlp(ks: list[int], n_out: int = 32) -> onnx.ModelProto:
    """MatMuls fc0, fc1, ... with reduction sizes `ks` (fc{i}'s K is ks[i]), input x [4, 8, ks[0]]."""
    rng = np.random.default_rng(0)
    nodes, weights, x = [], [], "x"
    for i, k in enumerate(ks):
        n = ks[i + 1] if i + 1 < len(ks) else n_out
        weights.append(numpy_helper.from_array((rng.standard_normal((k, n)) * 0.1).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"], name=f"fc{i}"))
        x = f"h{i}"
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8, ks[0]])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, [4, 8, n_out])], weights)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _save(tmp_path: Path, m: onnx.ModelProto, name: str = "m") -> tuple[Path, Path]:
    mp, dp = tmp_path / f"{name}.onnx", tmp_path / f"{name}.npz"
    onnx.save(m, mp)
    np.savez(dp, **motifs.sample_data(m))
    return mp, dp


def _run(capsys, argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


# --------------------------------------------- 33. INT4 block-size advice that divides every K

INT4 = ["--precision", "int4", "--int4-method", "rtn", "--verify", "0", "--quiet"]


@pytest.mark.parametrize("ks", [[96], [96, 40], [128, 96], [30, 50], [99], [128, 99]])
def test_33_int4_block_size_advice_divides_every_k(tmp_path, capsys, ks):
    mp, _ = _save(tmp_path, mlp(ks))
    line = refused(capsys, ["insert", mp, *INT4, "-o", tmp_path / "q.onnx"], "is not divisible by the INT4 block size 128",
                   folder=tmp_path)
    advised = re.search(r"use --block-size (\d+)((?: or \d+)*)", line)
    if advised is None:                               # none fits: said so, and why
        assert "no INT4 block size divides" in line and "is odd" in line, line
        assert np.gcd.reduce(ks) % 2 == 1
        return
    sizes = [int(advised.group(1))] + [int(b) for b in re.findall(r"\d+", advised.group(2))]
    assert all(k % b == 0 and b % 2 == 0 for b in sizes for k in ks), (line, sizes)
    # the advice works: the first size it names quantizes every weight
    rc, _, err = _run(capsys, ["insert", mp, *INT4, "--block-size", sizes[0], "-o", tmp_path / "q.onnx"])
    assert rc == 0, err
    assert sum(n.op_type == "DequantizeLinear" for n in onnx.load(str(tmp_path / "q.onnx")).graph.node) == len(ks)


def test_33_exclusion_is_offered_only_when_some_k_fits(tmp_path, capsys):
    mp, _ = _save(tmp_path, mlp([128, 99]))
    line = refused(capsys, ["insert", mp, *INT4, "-o", tmp_path / "q.onnx"], "fc1: K=99", folder=tmp_path)
    assert "--exclude-node 'fc1'" in line, line
    rc, _, err = _run(capsys, ["insert", mp, *INT4, "--exclude-node", "fc1", "-o", tmp_path / "q.onnx"])
    assert rc == 0, err                                # the advice works: fc0 (K=128) is INT4, fc1 float
    mp, _ = _save(tmp_path, mlp([99]), "odd")
    line = refused(capsys, ["insert", mp, *INT4, "-o", tmp_path / "q2.onnx"], "K=99 is odd", folder=tmp_path)
    assert "--exclude-node" not in line                # excluding the only GEMM would leave nothing to quantize


# ------------------------------------- 34. INT4-only options refused for other precisions, as asked

@pytest.mark.parametrize("precision,flag,value", [("int8", "--block-size", "64"), ("fp8", "--block-size", "128"),
                                                  ("int8", "--int4-method", "rtn")])
def test_34_int4_options_are_refused_for_other_precisions(model_and_data, capsys, monkeypatch, precision, flag, value):
    mp, dp = model_and_data
    no_sessions(monkeypatch)
    line = refused(capsys, ["insert", mp, "--calib", dp, "--precision", precision, flag, value],
                   f"{flag} applies to --precision int4 only (this run is {precision.upper()})",
                   f"drop {flag}, or add --precision int4", folder=mp.parent)
    assert "two INT4 values per byte" not in line


def test_34_an_odd_block_size_for_int8_speaks_of_int4_only(model_and_data, capsys):
    """Was: `--block-size must be even (two INT4 values per byte), got 63` for an INT8 run."""
    mp, dp = model_and_data
    refused(capsys, ["insert", mp, "--calib", dp, "--block-size", "63"], "--block-size applies to --precision int4 only")
    refused(capsys, ["insert", mp, "--precision", "int4", "--block-size", "63"], "--block-size must be even")


def test_34_the_api_says_it_in_keyword_arguments(model_and_data):
    import qdqgraph
    mp, dp = model_and_data
    with pytest.raises(QdqError) as e:
        qdqgraph.quantize(mp, str(dp), block_size=64)
    assert "block_size= applies to precision='int4' only" in str(e.value) and "--" not in str(e.value), e.value
    assert qdqgraph.QuantizeConfig(precision="int4").block_size == 128     # the default still applies to INT4
    assert qdqgraph.QuantizeConfig().block_size is None


# ---------------------------------------------- 35. a weight excluded as a GEMV is named as such

def test_35_int4_of_a_gemv_says_why_and_what_to_do(tmp_path, capsys):
    mp, _ = _save(tmp_path, motifs.gemv())
    line = refused(capsys, ["insert", mp, *INT4, "-o", tmp_path / "q.onnx"], "excluded as a GEMV by P10-gemv",
                   "no Tensor Core kernel", "--include-node 'gemv'", folder=tmp_path)
    assert "no MatMul or Gemm weight to quantize" not in line        # the weight exists
    # forced, in one block of 64: a one-value scale, which TensorRT's parser rejects; refused, not written
    line = refused(capsys, ["insert", mp, *INT4, "--block-size", "64", "--include-node", "gemv",
                            "-o", tmp_path / "q.onnx"], "64x1 weight w in blocks of 64", "a scale of 1 value",
                   "ScaleMode is illegal", "--block-size 32", folder=tmp_path)
    rc, _, err = _run(capsys, ["insert", mp, *INT4, "--block-size", "32", "--include-node", "gemv",
                               "-o", tmp_path / "q.onnx"])
    assert rc == 0, err                                               # the advice works
    written = onnx.load(str(tmp_path / "q.onnx")).graph
    assert any(n.op_type == "DequantizeLinear" for n in written.node)
    assert [list(i.dims) for i in written.initializer if i.name.endswith("_scale_fp16")] == [[2, 1]]


def test_35_int4_names_the_users_exclusion_and_the_absence_of_gemms(tmp_path, capsys):
    mp, _ = _save(tmp_path, mlp([128]))
    refused(capsys, ["insert", mp, *INT4, "--exclude-node", "fc0", "-o", tmp_path / "q.onnx"],
            "(fc0) excluded by --exclude-node fc0", "drop that exclusion", folder=tmp_path)
    cp, _ = _save(tmp_path, motifs.conv_relu(), "conv")
    refused(capsys, ["insert", cp, *INT4, "-o", tmp_path / "q.onnx"], "no MatMul or Gemm weight to quantize to INT4",
            folder=tmp_path)


# --------------------------------------- 36. every README section and docs file a message names exists

def _message_strings():
    """(file, line, text) of every string constant in qdqgraph/ that is not a docstring."""
    for path in sorted((ROOT / "qdqgraph").rglob("*.py")):
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
                yield path.relative_to(ROOT), n.lineno, n.value


def _headings(doc: Path) -> set[str]:
    return {line.lstrip("#").strip().lower() for line in doc.read_text().splitlines() if line.startswith("#")}


DOC_FILE = re.compile(r"\b(?:docs/)?([A-Z][A-Z_]+\.md)\b")
README_SECTION = re.compile(r"README[,:] ([A-Za-z][^)'\";,]*)")
DOC_SECTION = re.compile(r"([A-Z][A-Z_]+\.md), '([^']+)'")


def test_36_every_docs_reference_in_a_message_exists():
    refs = []
    for where, line, text in _message_strings():
        if "README" not in text and not DOC_FILE.search(text):
            continue
        for name in DOC_FILE.findall(text):
            refs.append((where, line, name, None))
        for section in README_SECTION.findall(text):
            refs.append((where, line, "README.md", section.strip()))
        for name, section in DOC_SECTION.findall(text):
            refs.append((where, line, name, section))
        if "README" in text:      # a README reference in a form this test does not read would go unchecked
            assert README_SECTION.search(text), f"{where}:{line}: README named without a section: {text!r}"
    assert refs, "no message names a docs file or README section (the scan found nothing)"
    for where, line, name, section in refs:
        doc = ROOT / name if name == "README.md" else ROOT / "docs" / name
        assert doc.is_file(), f"{where}:{line} names {name}, which does not exist"
        if section is not None:
            assert section.lower() in _headings(doc), f"{where}:{line} names section {section!r} of {name}: no such heading"


def test_36_the_zero_range_warning_names_an_existing_doc(tmp_path, capsys):
    """Was: `(see README: zero-range tensors)`, a section the README does not have."""
    m = motifs.conv_relu()
    mp, dp = _save(tmp_path, m)
    np.savez(dp, x=np.zeros_like(motifs.sample_data(m)["x"]))
    rc, _, err = _run(capsys, ["insert", mp, "--calib", dp, "--verify", "0", "-o", tmp_path / "q.onnx"])
    assert rc == 0
    said = [w for w in err.splitlines() if "was zero over all calibration samples" in w]
    assert said and all("(docs/CALIBRATION.md)" in w for w in said), err
    assert "tensor that was zero over all samples" in (ROOT / "docs" / "CALIBRATION.md").read_text()


# ------------------------------------------------ 37. onnx-graphsurgeon's notes never reach stdout

def bf16_constant_model() -> onnx.ModelProto:
    """residual_add plus a BFLOAT16 initializer cast to float and added to the output: onnx-graphsurgeon
    warns that it cannot convert BFLOAT16 to a NumPy type on every import."""
    m = motifs.residual_add()
    y = m.graph.output[0].name
    m.graph.initializer.append(helper.make_tensor("bias_bf16", TensorProto.BFLOAT16, [1], [0.5]))
    m.graph.node.extend([helper.make_node("Cast", ["bias_bf16"], ["bias_f"], to=TensorProto.FLOAT, name="cast_bf16"),
                         helper.make_node("Add", [y, "bias_f"], ["y2"], name="add_bf16")])
    m.graph.output[0].name = "y2"
    return m


@pytest.mark.parametrize("quiet", [True, False])
def test_37_graphsurgeon_warnings_stay_off_stdout(tmp_path, capsys, monkeypatch, quiet):
    import onnx_graphsurgeon as gs
    from onnx_graphsurgeon.logger import G_LOGGER
    m = bf16_constant_model()
    monkeypatch.setattr(G_LOGGER, "once_logged", set())              # its "once" warnings fire again here
    gs.import_onnx(m)
    assert "[W] Could not convert: BFLOAT16" in capsys.readouterr().out    # the model does trigger one
    monkeypatch.setattr(G_LOGGER, "once_logged", set())
    mp, dp = _save(tmp_path, m)
    rc, out, err = _run(capsys, ["insert", mp, "--calib", dp, "--verify", "0", "-o", tmp_path / "q.onnx"]
                        + (["--quiet"] if quiet else []))
    assert rc == 0, err
    assert "[W]" not in out + err and "Could not convert" not in out + err
    if quiet:
        assert out == ""
    else:
        assert f"wrote {tmp_path / 'q.onnx'}" in out
    # with --debug the note goes to stderr, marked as onnx-graphsurgeon's
    monkeypatch.setattr(G_LOGGER, "once_logged", set())
    rc, out, err = _run(capsys, ["--debug", "insert", mp, "--calib", dp, "--verify", "0", "--quiet", "--force",
                                 "-o", tmp_path / "q.onnx"])
    assert rc == 0 and out == "" and "qdqgraph: debug: onnx-graphsurgeon: Could not convert: BFLOAT16" in err
    assert not hasattr(G_LOGGER, "__dict__") or "log" not in G_LOGGER.__dict__       # its own logger again


# ------------------------------------------- 38. FP8 and INT4 summaries name FP8 and INT4, never INT8

UNQUALIFIED_INT8 = re.compile(r"(?<![-\w])int8\b")      # a port type, not a rule id (F1-weighted-int8) or flag


def _no_int8_words(text: str) -> None:
    assert "INT8" not in text, text
    assert not UNQUALIFIED_INT8.search(text), text


@pytest.mark.parametrize("motif,precision", [("attention_block", "fp8"), ("layernorm_mlp", "fp8"),
                                             ("residual_add", "fp8"), ("layernorm_mlp", "int4")])
def test_38_summaries_name_the_precision_asked(tmp_path, capsys, motif, precision):
    mp, dp = _save(tmp_path, getattr(motifs, motif)())
    q = tmp_path / "q.onnx"
    extra = ["--block-size", "32", "--int4-method", "rtn"] if precision == "int4" else []
    rc, out, err = _run(capsys, ["insert", mp, "--calib", dp, "--precision", precision, *extra, "-o", q,
                                 "--report", tmp_path / "r.json"])
    assert rc == 0, err
    assert f"{precision.upper()}" in out
    _no_int8_words(out + err)
    rc, out, err = _run(capsys, ["report", q])
    assert rc == 0, err
    _no_int8_words(out + err)
    if motif == "attention_block":                     # the listing's ports name FP8
        assert re.search(r"fp8 -> fp8", out), out


def test_38_a_float_model_is_not_called_int8(tmp_path, capsys):
    mp, _ = _save(tmp_path, motifs.residual_add())
    rc, out, _ = _run(capsys, ["report", mp])
    assert rc == 0 and "0 quantized," in out and "INT8" not in out, out


# --------------------------------------------------------- 39. no rule id twice in one line

def _rule_ids() -> set[str]:
    from qdqgraph.placement import load_ruleset
    from qdqgraph.trtsim.rules import load_sim_rules
    ids = set()
    for precision in ("int8", "fp8", "int4"):
        rules = load_ruleset((), precision)
        ids |= set(rules.by_id) | ({rules.region.id} if rules.region else set())
    ids |= set(load_sim_rules().by_id)
    assert "P14-small-int8-region" in ids and "F6-reformat" in ids
    return ids


@pytest.mark.parametrize("motif,precision", [("small_head", "int8"), ("tiny_conv", "int8"), ("attention_block", "int8"),
                                             ("conv_gemv", "int8"), ("residual_add", "fp8"), ("layernorm_mlp", "fp8")])
def test_39_no_line_names_a_rule_id_twice(tmp_path, capsys, motif, precision):
    """Was: `Gemm P14-small-int8-region: P14-small-int8-region: its INT8 region holds 0.00% ...`."""
    mp, dp = _save(tmp_path, getattr(motifs, motif)())
    q = tmp_path / "q.onnx"
    rc, out, err = _run(capsys, ["insert", mp, "--calib", dp, "--precision", precision, "-o", q, "--verify", "0"])
    assert rc == 0, err
    text = out + err
    rc, out, err = _run(capsys, ["report", q])
    text += out + err
    ids = _rule_ids()
    found = 0
    for line in text.splitlines():
        for rid in ids:
            n = len(re.findall(rf"(?<![\w-]){re.escape(rid)}(?![\w-])", line))
            found += n
            assert n <= 1, f"{rid} named {n} times: {line}"
    assert found, text                                  # the lines do name rules


# ---------------------------------- 40. options that need calibration data are never silently dropped

NEEDS_DATA = [(["--output-aware", "on"], "--output-aware on"), (["--smooth-quant"], "--smooth-quant 0.5"),
              (["--bias-correction"], "--bias-correction"), (["--accuracy-budget", "30"], "--accuracy-budget 30.0"),
              (["--max-float-layers", "2"], "--max-float-layers 2")]


@pytest.mark.parametrize("flags,said", NEEDS_DATA)
@pytest.mark.parametrize("source", ["random", "cache"])
def test_40_an_option_that_needs_data_is_refused_without_it(tmp_path, capsys, monkeypatch, flags, said, source):
    import qdqgraph
    m = motifs.layernorm_mlp()
    mp, dp = _save(tmp_path, m)
    if source == "cache":
        cache = qdqgraph.calibrate(mp, str(dp))
        cache.save(tmp_path / "c.json")
    no_sessions(monkeypatch)
    calib = ["--calib", "random"] if source == "random" else ["--calib-cache", tmp_path / "c.json"]
    given = "--calib random is not data" if source == "random" else "only a calibration cache was given"
    refused(capsys, ["insert", mp, *calib, *flags, "-o", tmp_path / "q.onnx"], f"{said} ", given,
            f"pass --calib DATA.npz, or drop {said}", folder=tmp_path)


def test_40_the_api_refuses_it_in_keyword_arguments(tmp_path):
    import qdqgraph
    with pytest.raises(QdqError) as e:
        qdqgraph.quantize(motifs.layernorm_mlp(), "random", output_aware=True)
    text = str(e.value)
    assert "output_aware=True chooses" in text and "calib='random' is not data" in text and "--" not in text, text


def test_40_output_aware_on_with_data_is_used(tmp_path, capsys):
    mp, dp = _save(tmp_path, motifs.conv_relu())          # a CNN: auto would leave it off
    rc, out, err = _run(capsys, ["insert", mp, "--calib", dp, "--output-aware", "on", "--verify", "0",
                                 "-o", tmp_path / "q.onnx"])
    assert rc == 0, err
    assert "output-aware scales:" in out, out


# ------------------------------------- 41. engine shape flags without --engine; checked with it

@pytest.mark.parametrize("flags,said", [(["--shapes", "x:2x8x32"], "--shapes"),
                                        (["--minShapes", "x:1x8x32"], "--min/--minShapes"),
                                        (["--optShapes", "x:1x8x32"], "--opt/--optShapes"),
                                        (["--maxShapes", "x:1x8x32"], "--max/--maxShapes"),
                                        (["--max-batch", "4"], "--max-batch"), (["--workspace", "64"], "--workspace"),
                                        (["--compute-capability", "sm89"], "--compute-capability")])
def test_41_engine_flags_without_engine_are_refused(tmp_path, capsys, monkeypatch, flags, said):
    mp, dp = _save(tmp_path, motifs.layernorm_mlp())
    no_sessions(monkeypatch)
    refused(capsys, ["insert", mp, "--calib", dp, *flags, "-o", tmp_path / "q.onnx"], f"{said} ",
            "this run builds no engine (no --engine", f"add --engine MODEL.plan to build one, or drop {said}",
            folder=tmp_path)


@pytest.mark.parametrize("flags,words", [(["--shapes", "nosuch:1x8x32"], "no model input is named 'nosuch'; the inputs are: x"),
                                         (["--shapes", "x:1x8xq"], "dims must be whole numbers"),
                                         (["--shapes", "x:1x8"], "rank 2"),
                                         (["--minShapes", "x:1x8x32"], "--min, --opt and --max go together"),
                                         (["--minShapes", "x:4x8x32", "--optShapes", "x:2x8x32", "--maxShapes", "x:8x8x32"],
                                          "not ordered")])
def test_41_engine_shapes_are_checked_before_any_work(tmp_path, capsys, monkeypatch, flags, words):
    from qdqgraph.cli import build
    mp, dp = _save(tmp_path, motifs.layernorm_mlp())
    monkeypatch.setattr(build, "check_engine_args", lambda args: None)   # no compiler needed to check shapes
    no_sessions(monkeypatch)
    refused(capsys, ["insert", mp, "--calib", dp, "--engine", tmp_path / "m.plan", *flags, "-o", tmp_path / "q.onnx"],
            words, folder=tmp_path)



def test_41_engine_shapes_of_a_corrupt_model_are_one_line(tmp_path, capsys, monkeypatch):
    """The shapes check reads the model's inputs first: a file that is no ONNX model is the same one
    line as without --engine, exit 2 (was: an internal error, exit 1, from the protobuf decoder)."""
    from qdqgraph.cli import build
    monkeypatch.setattr(build, "check_engine_args", lambda args: None)
    bad = tmp_path / "bad.onnx"
    bad.write_text("not a model")
    refused(capsys, ["insert", bad, "--calib", "random", "--engine", tmp_path / "m.plan", "--shapes", "x:1x3",
                     "-o", tmp_path / "q.onnx"], "is not a readable ONNX model", folder=tmp_path)

# ------------------------------------------- 42. the API's checks speak keyword arguments, the CLI flags

API_CASES = [(dict(percentile=0), "percentile= must be above 0", "--percentile must be above 0"),
             (dict(batch_size=0), "batch_size= must be at least 1", "--batch-size must be at least 1"),
             (dict(exclude_nodes="["), "exclude_nodes='[' is not a valid regular expression",
              "--exclude-node '[' is not a valid regular expression"),
             (dict(exclude_ops="softmax"), "exclude_ops='softmax' is not an ONNX op type", "--exclude-op 'softmax'"),
             (dict(require_int8=150), "require_int8= must be at most 100", "--require-int8 must be at most 100"),
             (dict(precision="fp8", output_aware=True), "output_aware=True chooses INT8 ranges",
              "--output-aware on chooses INT8 ranges"),
             (dict(int4_method="rtn"), "int4_method= applies to precision='int4' only", "--int4-method applies to")]

CLI_FLAGS = {"percentile": ["--percentile", "0"], "batch_size": ["--batch-size", "0"], "exclude_nodes": ["--exclude-node", "["],
             "exclude_ops": ["--exclude-op", "softmax"], "require_int8": ["--require-int8", "150"],
             "output_aware": ["--output-aware", "on"], "precision": ["--precision", "fp8"],
             "int4_method": ["--int4-method", "rtn"]}


@pytest.mark.parametrize("options,api,cli", API_CASES)
def test_42_one_check_two_wordings(model_and_data, capsys, monkeypatch, options, api, cli):
    import qdqgraph
    mp, dp = model_and_data
    no_sessions(monkeypatch)
    with pytest.raises(QdqError) as e:
        qdqgraph.quantize(mp, str(dp), **options)
    assert api in str(e.value) and "--" not in str(e.value), e.value
    argv = ["insert", mp, "--calib", dp] + [w for k in options for w in CLI_FLAGS[k]]
    refused(capsys, argv, cli)
    assert files(mp.parent) == {"m.onnx", "calib.npz"}
