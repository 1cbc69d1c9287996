"""compare(): known answers on constructed cases."""
import json

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest

import motifs
import qdqgraph
from qdqgraph.graph import io
from qdqgraph.execution.evaluate import add_float_twins, compare


def run_model(model, feed):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)


def test_identical_models_agree_perfectly():
    m = motifs.gemm_transB()
    c = compare(m, m, calib=motifs.sample_data(m), tensors=False)
    (out,) = c.outputs
    assert out.cosine == pytest.approx(1.0) and out.sqnr_db == float("inf") and out.max_abs_error == 0.0
    assert out.top1 == 1.0 and c.samples == 8


def test_mis_scaled_tensor_is_named():
    """Shrink one activation's scale 50x (clipping it hard): its SQNR must be the lowest."""
    m = motifs.residual_add(projection=True)
    data = motifs.sample_data(m)
    q = qdqgraph.quantize(m, data, high_precision="fp32").model
    loaded = io.load(q)
    target = "relu1_out"
    bad_scale = None
    for n in loaded.graph.nodes:
        if n.op in ("QuantizeLinear", "DequantizeLinear") and n.inputs[0].name in (target, f"{target}_quantized"):
            s = n.inputs[1]
            bad_scale = bad_scale or gs.Constant(s.name + "_bad", np.asarray(s.values / 50, dtype=np.float32))
            n.inputs[1] = bad_scale
    assert bad_scale is not None
    bad = io.to_model(loaded)
    onnx.checker.check_model(bad)
    good_c = compare(m, q, calib=data)
    bad_c = compare(m, bad, calib=data)
    assert bad_c.worst_tensors(1)[0].name == target
    assert bad_c.outputs[0].sqnr_db < good_c.outputs[0].sqnr_db - 6
    assert {a.name for a in bad_c.tensors} == {a.name for a in good_c.tensors} >= {target, "x", "stem_relu_out"}


def test_compare_cli_names_the_mis_scaled_tensor_and_writes_json(tmp_path, capsys):
    """The CLI on a float model and a copy with one activation's scale shrunk 50x: exit 0, the
    tensor named where the error jumps, and JSON with per-output and per-tensor figures."""
    import json

    from qdqgraph.cli import main
    m = motifs.residual_add(projection=True)
    data = motifs.sample_data(m)
    loaded = io.load(qdqgraph.quantize(m, data, high_precision="fp32").model)
    for n in loaded.graph.nodes:
        if n.op in ("QuantizeLinear", "DequantizeLinear") and n.inputs[0].name in ("relu1_out", "relu1_out_quantized"):
            n.inputs[1] = gs.Constant(n.inputs[1].name + "_bad", np.asarray(n.inputs[1].values / 50, np.float32))
    onnx.save(m, tmp_path / "f.onnx")
    onnx.save(io.to_model(loaded), tmp_path / "q.onnx")
    np.savez(tmp_path / "d.npz", **data)
    assert main(["compare", str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), "--data", str(tmp_path / "d.npz"),
                 "--json", str(tmp_path / "c.json"), "--all"]) == 0
    out = capsys.readouterr().out
    assert "the error jumps at relu1_out" in out
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["samples"] == 8 and doc["outputs"][0]["sqnr_db"] > 0
    assert {t["name"] for t in doc["tensors"]} >= {"relu1_out", "x"}
    assert main(["compare", str(tmp_path / "f.onnx"), str(tmp_path / "missing.onnx"), "--data",
                 str(tmp_path / "d.npz")]) == 2


def _data(m, samples):
    from qdqgraph.prepare import model_inputs
    from qdqgraph.samples.data import CalibrationData, read_arrays
    inputs = model_inputs(io.load(m).graph)
    return CalibrationData(read_arrays(motifs.sample_data(m), inputs, None), inputs, samples)


@pytest.mark.parametrize("batched", [True, False])
def test_verify_against_the_runs_float_outputs_gives_the_numbers_of_a_float_run(batched, monkeypatch):
    """compare() with the float outputs a run computed (the fidelity reference, one batch of 8 or
    one sample per batch) gives the figures of running the float model again, to the printed
    digits, and makes one session (the quantized model's) instead of two."""
    from qdqgraph.execution import evaluate
    from qdqgraph.recipes.fidelity import measure
    m = motifs.residual_add(projection=True)
    q = qdqgraph.quantize(m, motifs.sample_data(m)).model
    data = _data(m, None)
    if not batched:
        monkeypatch.setattr(data, "batchable", lambda: False)
    ref = measure.reference(io.load(m), data, 8)
    assert len(ref.batches) == (1 if batched else 8)
    old = compare(m, q, calib=motifs.sample_data(m), samples=8, tensors=False)
    sessions = []
    for name in ("graph_session", "session"):
        real = getattr(evaluate, name)
        monkeypatch.setattr(evaluate, name, lambda *a, real=real, **k: sessions.append(1) or real(*a, **k))
    new = compare(m, q, calib=motifs.sample_data(m), samples=8, tensors=False, reference=ref)
    assert len(sessions) == 1 and new.samples == old.samples == 8
    for a, b in zip(old.outputs, new.outputs):
        assert a.name == b.name and a.cosine == pytest.approx(b.cosine, abs=1e-6)
        assert a.sqnr_db == pytest.approx(b.sqnr_db, abs=0.01) and a.max_abs_error == pytest.approx(b.max_abs_error, rel=1e-3)
    assert old.table() == new.table()


def test_a_reference_that_lacks_samples_or_differs_is_not_used():
    """Fewer reference samples than compared, or a reference made on other inputs: None (the
    float model runs again)."""
    from qdqgraph.execution.evaluate import reused
    from qdqgraph.recipes.fidelity import measure
    m = motifs.residual_add(projection=True)
    outs = [o.name for o in m.graph.output]
    data = _data(m, 8)
    assert reused(measure.reference(io.load(m), data, 4), data, outs) is None
    other = _data(m, 8)
    ref = measure.reference(io.load(m), other, 8)
    ref.batches = [{k: v + 1 for k, v in b.items()} for b in ref.batches]
    assert reused(ref, data, outs) is None
    assert reused(measure.reference(io.load(m), other, 8), data, ["not_an_output"]) is None
    assert len(reused(measure.reference(io.load(m), other, 8), data, outs)) == 8


@pytest.mark.parametrize("lanes,batch", [(1, 1), (2, 1), (2, 4)])
def test_quantize_keeps_the_calibration_outputs_for_verify(lanes, batch):
    """The calibration runs' graph outputs on the first samples (in one lane or two, one sample or
    four a run) are the float reference verify uses: the printed comparison is that of running the
    float model again."""
    m = motifs.residual_add(projection=True)
    data = motifs.sample_data(m, n=10)
    r = qdqgraph.quantize(m, data, lanes=lanes, batch_size=batch)
    assert r.reference is not None and r.reference.samples >= 8
    old = compare(m, r.model, calib=data, samples=8, tensors=False)
    new = compare(m, r.model, calib=data, samples=8, tensors=False, reference=r.reference)
    assert new.table() == old.table() and new.samples == 8
    assert new.outputs[0].sqnr_db == pytest.approx(old.outputs[0].sqnr_db, abs=0.01)


@pytest.mark.parametrize("with_reference", [False, True])
def test_enough_output_values_stop_the_comparison_and_it_says_so(with_reference, monkeypatch):
    """`enough`: the comparison stops after the sample that brings the output values compared to
    that many, runs no more of either model, and its table says where it stopped; its figures are
    those of asking for that many samples. Without `enough`, or with tensors compared, every
    sample asked is compared."""
    from qdqgraph.execution import evaluate
    from qdqgraph.recipes.fidelity import measure
    m = motifs.residual_add(projection=True)
    data = motifs.sample_data(m, n=8)
    q = qdqgraph.quantize(m, data).model
    per_sample = sum(int(np.prod([d.dim_value or 2 for d in o.type.tensor_type.shape.dim])) for o in m.graph.output)
    ref = measure.reference(io.load(m), _data(m, None), 8) if with_reference else None
    runs = []
    for name in ("graph_session", "session"):
        real = getattr(evaluate, name)

        def counted(*a, real=real, **k):
            sess = real(*a, **k)
            run = sess.run
            return type("Counted", (), {"run": lambda self, *ra, **rk: runs.append(1) or run(*ra, **rk),
                                        "get_inputs": lambda self: sess.get_inputs()})()
        monkeypatch.setattr(evaluate, name, counted)
    short = compare(m, q, calib=data, samples=8, tensors=False, reference=ref, enough=3 * per_sample)
    assert short.samples == 3 and short.stopped_at == 3 * per_sample
    assert len(runs) == (3 if with_reference else 6)          # the float model too, where it runs
    assert "(enough: " in short.table() and "--verify N compares N" in short.table()
    three = compare(m, q, calib=data, samples=3, tensors=False, reference=ref)
    assert three.stopped_at is None and "enough" not in three.table()
    assert [o.sqnr_db for o in short.outputs] == [o.sqnr_db for o in three.outputs]
    assert compare(m, q, calib=data, samples=8, tensors=False, reference=ref).samples == 8
    assert compare(m, q, calib=data, samples=8, tensors=True, enough=per_sample).samples == 8
    assert compare(m, q, calib=data, samples=2, tensors=False, reference=ref, enough=3 * per_sample).stopped_at is None


def test_insert_verify_default_is_bounded_by_output_values_and_an_explicit_n_is_not(tmp_path, capsys, monkeypatch):
    """`insert`'s default --verify stops at VERIFY_VALUES output values and says so; --verify N
    compares N samples; --accuracy-budget keeps the default's full count."""
    from qdqgraph.cli import insert, main
    from qdqgraph.config import QuantizeConfig
    m = motifs.residual_add(projection=True)
    onnx.save(m, tmp_path / "f.onnx")
    np.savez(tmp_path / "d.npz", **motifs.sample_data(m, n=8))
    per_sample = sum(int(np.prod([d.dim_value or 2 for d in o.type.tensor_type.shape.dim])) for o in m.graph.output)
    monkeypatch.setattr(insert, "VERIFY_VALUES", 2 * per_sample)
    args = [str(tmp_path / "f.onnx"), "--calib", str(tmp_path / "d.npz"), "--force"]
    assert main(["insert", *args, "-o", str(tmp_path / "a.onnx")]) == 0
    assert "float vs quantized on 2 samples (enough: " in capsys.readouterr().out
    assert main(["insert", *args, "-o", str(tmp_path / "b.onnx"), "--verify", "8"]) == 0
    out = capsys.readouterr().out
    assert "float vs quantized on 8 samples\n" in out and "enough" not in out
    assert insert.verify_samples(None, QuantizeConfig(accuracy_budget=20.0)) == (8, None)
    assert insert.verify_samples(3, QuantizeConfig()) == (3, None)


# ------------------------------------------------------------------ tensors rescaled on purpose

def _with_metadata_removed(model: onnx.ModelProto) -> onnx.ModelProto:
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    kept = [(p.key, p.value) for p in bare.metadata_props if p.key != io.RESCALED_KEY]
    del bare.metadata_props[:]
    for k, v in kept:
        bare.metadata_props.add(key=k, value=v)
    return bare


def test_a_smoothing_folded_into_a_layernorm_is_recorded_and_not_compared():
    """Output-aware smoothing folded into a LayerNorm divides its output per channel, name kept: the
    written model records that tensor, and compare leaves it out (it said 0-10 dB there, a drop that
    is no quantization error) and says so."""
    from test_recipes import ln_data, ln_model
    m, data = ln_model(), ln_data(16)
    q = qdqgraph.quantize(m, data, high_precision="fp32")
    assert "ln_out" in q.report.output_aware["folded"]
    recorded = {p.key: p.value for p in q.model.metadata_props}
    # the head's input folds into the dense layer that makes it: a path of one tensor each
    assert json.loads(recorded[io.RESCALED_KEY]) == sorted(q.report.output_aware["folded"]) == ["dense_out", "ln_out"]
    c = compare(m, q.model, calib=data)
    assert c.rescaled == ["ln_out", "dense_out"] and not {"ln_out", "dense_out"} & {a.name for a in c.tensors}
    assert "not compared: 2 quantized tensor(s)" in c.table() and "ln_out, dense_out" in c.table()
    # without the record the tensor is compared, and its SQNR says nothing of the output's
    blind = compare(m, _with_metadata_removed(q.model), calib=data)
    (ln,) = [a for a in blind.tensors if a.name == "ln_out"]
    assert blind.rescaled == [] and ln.sqnr_db < blind.outputs[0].sqnr_db - 10, (ln.sqnr_db, blind.outputs[0].sqnr_db)


def test_an_equalized_pair_records_the_tensors_between_its_convs():
    from test_fidelity_defaults import OFF, data_for, dw_separable
    m, data = dw_separable(), data_for()
    q = qdqgraph.quantize(m, data, **{**OFF, "equalize": "on"})
    between = {"dw_out", "act_out"}
    assert set(q.report.passes[[p.name for p in q.report.passes].index("equalize")].details["rescaled"]) == between
    assert set(json.loads({p.key: p.value for p in q.model.metadata_props}[io.RESCALED_KEY])) == between
    c = compare(m, q.model, calib=data)
    assert set(c.rescaled) <= between and c.rescaled and not between & {a.name for a in c.tensors}


def test_a_model_without_the_record_compares_every_quantized_tensor():
    m = motifs.residual_add(projection=True)
    data = motifs.sample_data(m)
    q = qdqgraph.quantize(m, data, high_precision="fp32").model
    assert io.RESCALED_KEY not in {p.key for p in q.metadata_props}
    c = compare(m, q, calib=data)
    assert c.rescaled == [] and "not compared" not in c.table() and len(c.tensors) >= 3


def test_a_smoothing_mul_output_is_compared_with_the_same_mul_on_the_float_tensor():
    """A smoothing written as a Mul makes `x_smoothed`, a name the float model has not: compare gives
    the float model the same Mul on its own `x` and measures the quantized tensor against that (it
    left the tensor out before). The float twin is exact: the quantized model's sites bypassed (Q/DQ
    removed) compare at float precision."""
    from test_recipes import ln_data, ln_model
    m, data = ln_model(residual=True), ln_data(16)
    q = qdqgraph.quantize(m, data, high_precision="fp32")
    assert q.report.output_aware["multiplied"] == ["ln_out", "residual_out"]
    c = compare(m, q.model, calib=data)
    got = {a.name: a for a in c.tensors}
    assert set(got) == {"ln_out_smoothed", "residual_out_smoothed"} and c.unmatched == []
    assert all(20 < a.sqnr_db < 80 for a in got.values()), got
    # the twin is the quantized model's own Mul applied to the float model's tensor
    f_loaded, q_loaded = io.load(m), io.load(q.model)
    add_float_twins(f_loaded.graph, q_loaded.graph, set())
    scale = {n.outputs[0].name: n.inputs[1].values for n in q_loaded.graph.nodes if n.op == "Mul"}
    f_loaded.graph.outputs = [t for name, t in f_loaded.graph.tensors().items()
                              if name in ("ln_out", "ln_out_smoothed", "residual_out", "residual_out_smoothed")]
    got = dict(zip([t.name for t in f_loaded.graph.outputs],
                   run_model(io.to_model(f_loaded), {"x": data["x"][0]})))
    for x in ("ln_out", "residual_out"):
        np.testing.assert_allclose(got[f"{x}_smoothed"], got[x] * scale[f"{x}_smoothed"], rtol=1e-6, atol=1e-6)
    # a tensor the quantized model scales per channel (the record) gets no twin from it
    f_again = io.load(m)
    add_float_twins(f_again.graph, io.load(q.model).graph, {"ln_out"})
    assert "ln_out_smoothed" not in f_again.graph.tensors() and "residual_out_smoothed" in f_again.graph.tensors()


def test_a_quantized_tensor_with_no_float_twin_is_listed_as_unmatched():
    m = motifs.residual_add(projection=True)
    data = motifs.sample_data(m)
    loaded = io.load(qdqgraph.quantize(m, data, high_precision="fp32").model)
    q = next(n for n in loaded.graph.nodes if n.op == "QuantizeLinear" and n.inputs[0].name == "relu1_out")
    q.inputs[0].name = "renamed_relu1_out"          # a name the float model lacks, made by no Mul
    c = compare(m, io.to_model(loaded), calib=data)
    assert c.unmatched == ["renamed_relu1_out"] and "relu1_out" not in {a.name for a in c.tensors}
    assert "not compared: 1 quantized tensor(s) with no tensor of that name" in c.table()


def test_a_smoothing_mul_behind_an_fp16_cast_of_a_graph_input_gets_its_twin():
    """A smoothed graph input in a written model with FP16 islands: x -> Cast(fp16) -> Mul(1/s) -> Q.
    The float model has x, not the Cast's output: the twin is the Mul on x itself (the Whisper
    decoder's encoder_hidden_states_smoothed was listed as having no twin)."""
    x = gs.Variable("x", dtype=np.float32, shape=[1, 4, 8])
    f_graph = gs.Graph(nodes=[gs.Node("Relu", "relu", inputs=[x], outputs=[gs.Variable("y", dtype=np.float32)])],
                       inputs=[x], outputs=[])
    f_graph.outputs = [f_graph.nodes[0].outputs[0]]
    qx = gs.Variable("x", dtype=np.float32, shape=[1, 4, 8])
    half = gs.Variable("x_fp16", dtype=np.float16, shape=[1, 4, 8])
    smoothed = gs.Variable("x_smoothed", dtype=np.float16, shape=[1, 4, 8])
    inv = np.linspace(0.5, 2.0, 8).astype(np.float16)
    quantized = gs.Variable("x_smoothed_quantized", dtype=np.int8)
    q_graph = gs.Graph(nodes=[
        gs.Node("Cast", "cast", attrs={"to": onnx.TensorProto.FLOAT16}, inputs=[qx], outputs=[half]),
        gs.Node("Mul", "x_smooth", inputs=[half, gs.Constant("x_smooth_scale_fp16", inv)], outputs=[smoothed]),
        gs.Node("QuantizeLinear", "x_smoothed_q", inputs=[smoothed, gs.Constant("s", np.array(0.1, np.float16)),
                                                          gs.Constant("z", np.array(0, np.int8))], outputs=[quantized])],
        inputs=[qx], outputs=[quantized])
    add_float_twins(f_graph, q_graph, set())
    twin = f_graph.tensors()["x_smoothed"]
    (mul,) = twin.inputs
    assert mul.op == "Mul" and mul.inputs[0] is f_graph.tensors()["x"] and twin.dtype == np.float32
    np.testing.assert_array_equal(mul.inputs[1].values, inv.astype(np.float32))
    # a scaled-on-purpose input gets none
    f_again = gs.Graph(nodes=[], inputs=[gs.Variable("x", dtype=np.float32, shape=[1, 4, 8])], outputs=[])
    add_float_twins(f_again, q_graph, {"x"})
    assert "x_smoothed" not in f_again.tensors()
