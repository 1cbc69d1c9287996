"""Crashes on valid models (issue 33): a sparse initializer, INT4 AWQ of an FP16 model, onnxruntime's
segmentation fault on FP16-island graphs, and what a sweep of the commands and their main options over
real models turned up. Each was an exit 1 (a traceback), an exit 2 blaming a valid model, or a dead
process; each works now, as docs/BAD_INPUT.md lists (case 43 on). Models are tiny and built in code."""
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import motifs
from qdqgraph.cli import main


def _ort(model, feed):
    import onnxruntime as ort
    blob = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, feed)


def _sqnr(want, got) -> float:
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    return float(10 * np.log10((want ** 2).sum() / max(((want - got) ** 2).sum(), 1e-30)))


# ------------------------------------------------------------------ 33. sparse initializers

def _sparse(t: onnx.TensorProto, coordinates: bool = False) -> onnx.SparseTensorProto:
    """`t` as a SparseTensorProto holding its non-zero values; indices linear ([NNZ]) or, with
    `coordinates`, one row of coordinates per value ([NNZ, rank])."""
    a = numpy_helper.to_array(t)
    nz = np.nonzero(a)
    if coordinates:
        indices = np.stack(nz, axis=1).astype(np.int64)
    else:
        indices = np.ravel_multi_index(nz, a.shape).astype(np.int64)
    return helper.make_sparse_tensor(numpy_helper.from_array(a[nz], t.name), numpy_helper.from_array(indices, ""),
                                     list(a.shape))


def sparse_model(dense: onnx.ModelProto) -> onnx.ModelProto:
    """`dense` with its conv weights moved to graph.sparse_initializer (one with coordinate indices)
    and a bias as a Constant node's sparse_value: the same model, as onnxruntime runs it."""
    m = onnx.ModelProto()
    m.CopyFrom(dense)
    g = m.graph
    weights = [t for t in g.initializer if t.name.endswith(".w")]
    for k, t in enumerate(weights):
        g.sparse_initializer.append(_sparse(t, coordinates=k == 1))
        g.initializer.remove(t)
    bias = next(t for t in g.initializer if t.name == "conv1.b")
    g.node.insert(0, helper.make_node("Constant", [], [bias.name], name="bias_const", sparse_value=_sparse(bias)))
    g.initializer.remove(bias)
    onnx.checker.check_model(m)
    return m


def _pruned(model: onnx.ModelProto) -> onnx.ModelProto:
    """Half of every weight's values zero (a pruned model: what is stored sparse)."""
    for t in model.graph.initializer:
        a = numpy_helper.to_array(t).copy()
        if a.ndim and a.size > 1:
            a[np.abs(a) < np.median(np.abs(a))] = 0
            t.CopyFrom(numpy_helper.from_array(a, t.name))
    return model


def test_43_sparse_to_dense_keeps_the_declared_type():
    from qdqgraph.graph import io
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float16, np.int8):
        a = (rng.standard_normal((3, 4, 5)) * 4).astype(dtype)
        a[rng.random(a.shape) < 0.6] = 0
        for coordinates in (False, True):
            dense = io.sparse_to_dense(_sparse(numpy_helper.from_array(a, "w"), coordinates))
            back = numpy_helper.to_array(dense)
            assert dense.name == "w" and back.dtype == a.dtype and np.array_equal(back, a), (dtype, coordinates)


def test_43_a_sparse_model_quantizes_as_its_dense_twin(tmp_path, capsys):
    """Was: graphsurgeon read the sparse weight as float64, and calibration failed with `onnxruntime
    cannot run the model for calibration (... bound to different types (tensor(float) and
    tensor(double) ...)`: exit 2, blaming a model onnxruntime runs."""
    dense = _pruned(motifs.residual_add())
    sparse = sparse_model(dense)
    data = motifs.sample_data(dense)
    feed = {"x": data["x"][0]}
    np.testing.assert_array_equal(_ort(sparse, feed)[0], _ort(dense, feed)[0])   # one model, two storages
    dp = tmp_path / "d.npz"
    np.savez(dp, **data)
    written = {}
    for name, m in (("dense", dense), ("sparse", sparse)):
        onnx.save(m, tmp_path / f"{name}.onnx")
        out = tmp_path / f"{name}.q.onnx"
        assert main(["insert", str(tmp_path / f"{name}.onnx"), "--calib", str(dp), "-o", str(out)]) == 0, \
            capsys.readouterr().err
        said = capsys.readouterr().out
        written[name] = onnx.load(str(out))
    assert "repaired: 5 sparse initializer(s) or constant(s) (stem.w, conv1.w, conv2.w, head.w, conv1.b) stored " \
           "dense, of their declared type" in said, said
    q = written["sparse"]
    onnx.checker.check_model(q, full_check=True)
    assert not q.graph.sparse_initializer
    qd = written["dense"]
    assert sorted(n.op_type for n in q.graph.node if n.op_type != "Constant") == \
        sorted(n.op_type for n in qd.graph.node)
    np.testing.assert_allclose(_ort(q, feed)[0], _ort(qd, feed)[0], rtol=0, atol=1e-3)
    weights = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer if t.data_type == TensorProto.INT8}
    twins = {t.name: numpy_helper.to_array(t) for t in qd.graph.initializer if t.data_type == TensorProto.INT8}
    assert weights.keys() == twins.keys() and sum(w.ndim == 4 for w in weights.values()) == 4, weights.keys()
    for name, w in weights.items():                        # the same INT8 weights, zeros kept zero
        np.testing.assert_array_equal(w, twins[name])


@pytest.mark.parametrize("precision", ["fp8", "int4"])
def test_43_sparse_weights_in_fp8_and_int4(tmp_path, capsys, precision):
    dense = _pruned(motifs.layernorm_mlp())
    m = onnx.ModelProto()
    m.CopyFrom(dense)
    for t in [t for t in m.graph.initializer if numpy_helper.to_array(t).ndim == 2]:
        m.graph.sparse_initializer.append(_sparse(t))
        m.graph.initializer.remove(t)
    assert len(m.graph.sparse_initializer) >= 2
    mp, dp, out = tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path / "q.onnx"
    onnx.save(m, mp)
    data = motifs.sample_data(dense)
    np.savez(dp, **data)
    extra = ["--block-size", "32"] if precision == "int4" else []
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(out), "--precision", precision, *extra]) == 0, \
        capsys.readouterr().err
    q = onnx.load(str(out))
    onnx.checker.check_model(q, full_check=True)
    assert any(n.op_type == "DequantizeLinear" for n in q.graph.node)
    feed = {k: v[0] for k, v in data.items()}
    assert _sqnr(_ort(dense, feed)[0], _ort(q, feed)[0]) > 15


def test_43_strip_fix_report_of_a_sparse_qdq_model(tmp_path, capsys):
    """insert's output with its INT8 weights, scales and zero points stored sparse: strip, fix and
    report read it as the dense model (was: float64 arrays where the model declares INT8 and FP16)."""
    m = _pruned(motifs.residual_add())
    mp, dp, q = tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path / "q.onnx"
    onnx.save(m, mp)
    np.savez(dp, **motifs.sample_data(m))
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(q), "--quiet", "--verify", "0"]) == 0
    dense_q = onnx.load(str(q))
    sq = onnx.ModelProto()
    sq.CopyFrom(dense_q)
    moved = [t for t in sq.graph.initializer if t.dims and np.prod(t.dims) > 1]
    for t in moved:
        sq.graph.sparse_initializer.append(_sparse(t))
        sq.graph.initializer.remove(t)
    assert {TensorProto.INT8, TensorProto.FLOAT16} <= {t.data_type for t in moved}
    sp = tmp_path / "sq.onnx"
    onnx.save(sq, sp)
    capsys.readouterr()
    for name, src in (("dense", q), ("sparse", sp)):
        assert main(["strip", str(src), "-o", str(tmp_path / f"{name}.strip.onnx")]) == 0
        assert main(["fix", str(src), "-o", str(tmp_path / f"{name}.fix.onnx"), "--calib", str(dp)]) == 0
    err = capsys.readouterr().err
    assert "stored dense, of their declared type" in err and "error" not in err, err
    assert "sparse initializer(s) stored dense" in err                       # fix's "as it was" says so
    feed = {"x": motifs.sample_data(m)["x"][0]}
    for kind in ("strip", "fix"):
        a, b = onnx.load(str(tmp_path / f"dense.{kind}.onnx")), onnx.load(str(tmp_path / f"sparse.{kind}.onnx"))
        onnx.checker.check_model(b, full_check=True)   # fix: "nothing to fix", the input with its sparse weights dense
        np.testing.assert_array_equal(_ort(a, feed)[0], _ort(b, feed)[0])
    reports = []
    for src in (q, sp):
        assert main(["report", str(src)]) == 0
        reports.append(capsys.readouterr().out)
    assert reports[0] == reports[1] and "INT8" in reports[0]


# --------------------------------------------------------------- 34. INT4 AWQ of an FP16 model

def fp16_mlp(hidden: int = 128) -> onnx.ModelProto:
    """x (float16) -> MatMul -> Relu -> Gemm (+ bias) -> y, every tensor float16 (a model converted to
    FP16). Two input channels are 8x larger than the rest, as LLM activations have: what AWQ's scales
    are for."""
    rng = np.random.default_rng(0)
    f16 = TensorProto.FLOAT16
    gain = np.ones(hidden, np.float32)
    gain[[3, 77]] = 8
    inits = [numpy_helper.from_array((rng.standard_normal((hidden, hidden)) * hidden ** -0.5).astype(np.float16), n)
             for n in ("w1", "w2")]
    inits += [numpy_helper.from_array(gain.astype(np.float16), "gain"),
              numpy_helper.from_array((rng.standard_normal(hidden) * 0.1).astype(np.float16), "b2")]
    nodes = [helper.make_node("Mul", ["x", "gain"], ["xg"], name="gain"),
             helper.make_node("MatMul", ["xg", "w1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="act"),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], name="fc2")]
    g = helper.make_graph(nodes, "fp16_mlp", [helper.make_tensor_value_info("x", f16, ["b", hidden])],
                          [helper.make_tensor_value_info("y", f16, ["b", hidden])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def test_44_with_outputs_declares_each_tensor_as_the_model_types_it():
    from qdqgraph.graph import io
    m = onnx.shape_inference.infer_shapes(fp16_mlp())
    out = io.with_outputs(m, ["h", "r", "nowhere"])
    types = {o.name: o.type.tensor_type.elem_type for o in out.graph.output}
    assert types == {"y": TensorProto.FLOAT16, "h": TensorProto.FLOAT16, "r": TensorProto.FLOAT16, "nowhere": 0}
    bare = fp16_mlp()                              # no value_info: onnxruntime infers the type
    got = _ort(io.with_outputs(bare, ["r"]), {"x": np.ones((2, 128), np.float16)})
    assert got[1].dtype == np.float16 and got[1].shape == (2, 128)


@pytest.mark.parametrize("method", [[], ["--int4-method", "awq"]])
def test_44_int4_awq_of_an_fp16_model(tmp_path, capsys, method):
    """Was: `onnxruntime cannot run the model for INT4 AWQ (... Type (tensor(float)) of output arg (r)
    of node (act) does not match expected type (tensor(float16)))`: the helper model that reads the
    activations AWQ weighs declared them float32; exit 2, blaming the model."""
    m = fp16_mlp()
    rng = np.random.default_rng(1)
    mp, dp = tmp_path / "m.onnx", tmp_path / "d.npz"
    onnx.save(m, mp)
    np.savez(dp, x=rng.standard_normal((16, 4, 128)).astype(np.float16))
    sqnr = {}
    for name, how in (("awq", method), ("rtn", ["--int4-method", "rtn"])):
        out = tmp_path / f"{name}.onnx"
        assert main(["insert", str(mp), "--calib", str(dp), "--precision", "int4", "--block-size", "32",
                     "-o", str(out), *how]) == 0, capsys.readouterr().err
        capsys.readouterr()
        q = onnx.load(str(out))
        onnx.checker.check_model(q, full_check=True)
        assert q.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
        assert sum(n.op_type == "DequantizeLinear" for n in q.graph.node) == 2
        x = rng.standard_normal((64, 128)).astype(np.float16)
        want, = _ort(m, {"x": x})
        got, = _ort(q, {"x": x})
        assert got.dtype == np.float16 and np.isfinite(got).all()
        sqnr[name] = _sqnr(want, got)
    assert sqnr["awq"] > 18 and sqnr["awq"] > sqnr["rtn"] + 1, sqnr       # AWQ weighs the large channels


# ------------------------------------------------------- 35. fix of insert's BF16-island output

@pytest.mark.parametrize("name", ["se_block", "concat_of_pools", "residual_hardswish"])
def test_45_fix_of_inserts_bf16_output_is_a_no_op(tmp_path, capsys, name):
    """A BF16 island holds its own copy of a scale, rounded to BF16 (2^-8, where FP16 rounds at 2^-11).
    Was: `QuantizeLinear 'relu_out_q' and DequantizeLinear 'relu_out_dq_fp32' have different scales or
    zero points` (exit 2, on qdqgraph's own output), and where the pair passed, `internal error:
    InvariantError: ... QuantizeLinear relu_out_q: quantizes a non-float tensor relu_out` (exit 1: a
    BF16 tensor did not count as float)."""
    m = motifs.ALL[name]()
    mp, dp, q = tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path / "q.onnx"
    onnx.save(m, mp)
    np.savez(dp, **motifs.sample_data(m))
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(q), "--high-precision", "bf16", "--quiet",
                 "--verify", "0"]) == 0
    written = onnx.load(str(q))
    assert TensorProto.BFLOAT16 in {t.data_type for t in written.graph.initializer}
    capsys.readouterr()
    for extra in ([], ["--calib", str(dp)]):
        out = tmp_path / f"f{len(extra)}.onnx"
        assert main(["fix", str(q), "-o", str(out), *extra]) == 0, capsys.readouterr().err
        said = capsys.readouterr().out
        assert "nothing to fix" in said and out.read_bytes() == q.read_bytes(), said


def test_45_bf16_counts_as_float_and_float8_does_not():
    import ml_dtypes
    from qdqgraph.graph.view import is_float_dtype
    assert all(is_float_dtype(d) for d in (np.float32, np.float16, ml_dtypes.bfloat16, TensorProto.BFLOAT16))
    assert not any(is_float_dtype(d) for d in (ml_dtypes.float8_e4m3fn, TensorProto.FLOAT8E4M3FN, ml_dtypes.int4,
                                               np.int8, None))


def test_45_scale_tolerance_is_the_coarsest_scale_types_rounding():
    import ml_dtypes
    from qdqgraph.fix.facts import scale_tolerance
    s = np.array(0.13403438, np.float32)
    assert scale_tolerance(s, s) == 1e-3
    assert scale_tolerance(s, s.astype(np.float16)) == 1e-3           # FP16's 2^-10 is under it
    tol = scale_tolerance(s, s.astype(ml_dtypes.bfloat16))
    assert tol == 2.0 ** -7
    rel = abs(float(s.astype(ml_dtypes.bfloat16)) - float(s)) / float(s)
    assert 1e-3 < rel <= tol                                            # what BF16 did to this scale


# ------------------------------------- 36. onnxruntime's MatmulTransposeFusion on FP16 islands

def _recorded_sessions(monkeypatch) -> list:
    """Record the optimization level and disabled optimizers of every onnxruntime session made."""
    import onnxruntime as ort
    made = []
    real = ort.InferenceSession

    def recording(source, opts=None, *a, disabled_optimizers=None, **k):
        level = opts.graph_optimization_level if opts is not None else None
        made.append((level, list(disabled_optimizers or [])))
        return real(source, opts, *a, disabled_optimizers=disabled_optimizers, **k)
    monkeypatch.setattr(ort, "InferenceSession", recording)
    return made


def test_46_every_session_turns_off_matmul_transpose_fusion(tmp_path, capsys, monkeypatch):
    """MatmulTransposeFusion was reported to kill onnxruntime 1.32 with a segmentation fault on
    FP16-island ViT graphs: every session qdqgraph makes that optimizes (calibration, verify,
    compare, qdqgraph.session) runs without it."""
    import onnxruntime as ort
    import qdqgraph
    m = motifs.attention_block()
    mp, dp, q = tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path / "q.onnx"
    onnx.save(m, mp)
    np.savez(dp, **motifs.sample_data(m))
    made = _recorded_sessions(monkeypatch)
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(q), "--quiet"]) == 0
    assert main(["compare", str(mp), str(q), "--data", str(dp)]) == 0
    qdqgraph.session(str(q))
    optimizing = [d for level, d in made if level != ort.GraphOptimizationLevel.ORT_DISABLE_ALL]
    assert len(optimizing) >= 4, made
    assert all("MatmulTransposeFusion" in d and "WeightBiasQuantization" in d for d in optimizing), made


def test_46_fp16_island_attention_runs_in_a_subprocess(tmp_path):
    """insert's FP16-island attention (Transpose -> MatMul in FP16, the pattern of the reported crash)
    through qdqgraph.session in a child process, so a segmentation fault fails this test instead of
    ending the test run; its output is close to the float model's."""
    m = motifs.attention_block(seq=16, hidden=64, heads=4)
    mp, dp, q = tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path / "q.onnx"
    onnx.save(m, mp)
    data = motifs.sample_data(m)
    np.savez(dp, **data)
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(q), "--quiet", "--verify", "0",
                 "--int8-attention", "off"]) == 0
    written = onnx.load(str(q))
    fp16 = {vi.name for vi in onnx.shape_inference.infer_shapes(written).graph.value_info
            if vi.type.tensor_type.elem_type == TensorProto.FLOAT16}
    transposed = [n for n in written.graph.node if n.op_type == "MatMul"
                  and any(p.op_type == "Transpose" and p.output[0] in n.input for p in written.graph.node)]
    assert transposed and any(set(n.input) & fp16 for n in transposed)      # the pattern is there
    np.save(tmp_path / "x.npy", data["x"][0])
    child = textwrap.dedent(f"""
        import numpy as np, qdqgraph
        s = qdqgraph.session({str(q)!r})
        y = s.run(None, {{"x": np.load({str(tmp_path / "x.npy")!r})}})[0]
        np.save({str(tmp_path / "y.npy")!r}, y)
    """)
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    want, = _ort(m, {"x": data["x"][0]})
    assert _sqnr(want, np.load(tmp_path / "y.npy")) > 20


@pytest.mark.slow
def test_46_vit_fp16_islands_in_child_processes(tmp_path):
    """The two reported commands on the transformer set's ViT, each in a child process (a segmentation
    fault is then a failed test): insert, `fix --calib` of its output, and `insert --exclude-node
    '.*'`; each exits 0 and its verify is printed. About 70 s on 2 shared cores."""
    import os
    from pathlib import Path
    from test_models import missing
    tfm = Path(os.environ.get("QDQGRAPH_TRANSFORMERS", "/tmp/qdqgraph-tfm"))
    model, calib = tfm / "models" / "vit_s_focus.onnx", tfm / "calib" / "vit_s_focus.npz"
    if not model.exists() or not calib.exists():
        missing("the transformer set's vit_s_focus")
    q = tmp_path / "q.onnx"
    runs = [["insert", model, "--calib", calib, "-o", q, "--samples", "8", "--verify", "2"],
            ["fix", q, "--calib", calib, "--samples", "8", "-o", tmp_path / "f.onnx"],
            ["insert", model, "--calib", calib, "-o", tmp_path / "x.onnx", "--samples", "8", "--verify", "2",
             "--exclude-node", ".*"]]
    for argv in runs:
        r = subprocess.run([sys.executable, "-m", "qdqgraph", *map(str, argv)], capture_output=True, text=True,
                           timeout=1200)
        assert r.returncode == 0, (argv[0], r.returncode, r.stderr[-2000:])
        assert argv[0] == "fix" or "SQNR" in r.stdout, r.stdout[-2000:]
    assert {p.name for p in tmp_path.iterdir()} >= {"q.onnx", "f.onnx", "x.onnx"}


# ------------------------------------- 37. --calib random on a model that cannot take dims of 1

def reflect_pad_conv() -> onnx.ModelProto:
    """x [n, 4, t] -> Pad (reflect, 2 each side of t) -> Conv1d -> y: valid for t >= 3, as audio
    front ends are (silero-vad's STFT pads so)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array([0, 0, 2, 0, 0, 2], np.int64), "pads"),
             numpy_helper.from_array((rng.standard_normal((8, 4, 3)) * 0.3).astype(np.float32), "w")]
    nodes = [helper.make_node("Pad", ["x", "pads"], ["p"], name="pad", mode="reflect"),
             helper.make_node("Conv", ["p", "w"], ["y"], name="conv", kernel_shape=[3])]
    g = helper.make_graph(nodes, "reflect_pad_conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, "t"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8, None])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def test_47_random_data_the_model_cannot_take_says_why(tmp_path, capsys):
    """Was: `onnxruntime failed on calibration sample 0 (... Pad reflect requires axis length >= 2 ...);
    check that the data fits the model's inputs`, about data qdqgraph made itself."""
    from test_bad_input import refused
    mp = tmp_path / "m.onnx"
    onnx.save(reflect_pad_conv(), mp)
    assert main(["insert", str(mp), "--calib", "random", "-o", str(tmp_path / "q.onnx")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("qdqgraph: error:")]
    assert len(err) == 1 and "onnxruntime failed on calibration sample 0" in err[0], err
    assert "; --calib random sets the dynamic dims (x[0], x[2]) to 1, which this model does not take; pass " \
           "calibration data of the shapes it runs on with --calib DATA" in err[0], err
    assert {p.name for p in tmp_path.iterdir()} == {"m.onnx"}
    dp = tmp_path / "d.npz"                        # real data of that shape: the same model quantizes
    np.savez(dp, x=np.random.default_rng(1).standard_normal((8, 1, 4, 16)).astype(np.float32))
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(tmp_path / "q.onnx"), "--quiet"]) == 0
    short = tmp_path / "short.npz"                 # the user's own data: the hint stays about the data
    np.savez(short, x=np.zeros((2, 1, 4, 1), np.float32))
    line = refused(capsys, ["insert", mp, "--calib", short, "-o", tmp_path / "q2.onnx"],
                   "check that the data fits the model's inputs")
    assert "--calib random" not in line
