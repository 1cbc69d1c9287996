"""FLOPs and bytes counted at the calibration data's shapes: io.bound_dims gives each symbolic
dimension of the graph the value it takes there, the simulator counts at those values
(SimGraph.bind), insert plans and predicts with them, and the written model keeps them for
`qdqgraph report`."""
import numpy as np
import onnx

import motifs
from qdqgraph.cli import main
from qdqgraph.graph import io
from qdqgraph.trtsim import recorded, simulate

HEADS, HIDDEN, SEQ = 2, 32, 16


def _qk_flops(sim) -> float:
    return next(x.flops for x in sim.layers if "qk" in x.nodes)


def test_bound_dims_binds_the_inputs_symbols_and_those_inference_names(monkeypatch):
    """The input's own symbols from the data's shape; a symbol only an inner tensor carries (as
    ONNX inference names what it cannot tie to an input: unk__N) from inference at that shape; a
    CNN whose only symbol is its input's batch binds without inference."""
    loaded = io.load(motifs.attention_block(seq="s"))
    scores = next(n for n in loaded.graph.nodes if n.name == "qk").outputs[0]
    scores.shape = ["b", HEADS, "s", "unk__9"]
    assert io.bound_dims(loaded, {"x": (1, SEQ, HIDDEN)}) == {"b": 1, "s": SEQ, "unk__9": SEQ}

    cnn = io.load(motifs.residual_add())

    def refuse(*a, **k):
        raise AssertionError("no inference for the inputs' own symbols")
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", refuse)
    assert io.bound_dims(cnn, {"x": (3, 16, 8, 8)}) == {"n": 3}


def test_the_simulator_counts_flops_at_the_bound_dims():
    """The attention scores' GEMM: 2 x heads x s x s x d, with s unknown counted as 1 before."""
    graph = io.load(motifs.attention_block(seq="s")).graph
    d = HIDDEN // HEADS
    assert _qk_flops(simulate(graph)) == 2 * HEADS * d
    assert _qk_flops(simulate(graph, dims={"b": 1, "s": SEQ})) == 2 * HEADS * SEQ * SEQ * d


def test_insert_predicts_at_the_calibration_shapes_and_report_recomputes_there(tmp_path, capsys):
    m = motifs.attention_block(seq="s")
    src, data, out = tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path / "q.onnx"
    onnx.save(m, src)
    np.savez(data, x=np.random.default_rng(0).standard_normal((8, 1, SEQ, HIDDEN)).astype(np.float32))
    assert main(["insert", str(src), "--calib", str(data), "-o", str(out), "--verify", "0"]) == 0
    capsys.readouterr()
    written = onnx.load(out)
    assert recorded.dims_of(written) == {"b": 1, "s": SEQ}
    kept = recorded.recorded(written, "tensorrt")
    assert kept is not None
    qk = next(x for x in kept.report["layers"] if "qk" in x["nodes"])      # with the context GEMM where fused
    gemms = 2 if "pv" in qk["nodes"] else 1
    assert qk["flops"] == gemms * 2 * HEADS * SEQ * SEQ * (HIDDEN // HEADS)
    assert main(["report", str(out), "--quiet"]) == 0
    recorded_line = capsys.readouterr().out
    assert main(["report", str(out), "--quiet", "--recompute"]) == 0
    assert capsys.readouterr().out == recorded_line and "INT8 FLOPs" in recorded_line


def test_fix_predicts_at_the_inputs_dims_or_the_datas_and_records_it():
    """`fix` of insert's output: its predictions at the dims the input recorded (not each symbolic
    dim as 1), and the written model keeps them and the prediction for `report`; with data, at the
    data's shapes."""
    import qdqgraph
    m = motifs.attention_block(seq="s")
    rng = np.random.default_rng(0)
    q = qdqgraph.quantize(m, calib={"x": rng.standard_normal((8, 1, SEQ, HIDDEN)).astype(np.float32)},
                          high_precision="fp32", int8_attention="on").model
    assert recorded.dims_of(q) == {"b": 1, "s": SEQ}
    r = qdqgraph.fix(q, exclude_nodes=["^o_proj$"])          # a selection: fix rebuilds
    assert not r.report.unchanged
    assert recorded.dims_of(r.model) == {"b": 1, "s": SEQ}
    kept = recorded.recorded(r.model, "tensorrt")
    assert kept is not None and kept.report["summary"] == r.report.tensorrt_after
    flops = sum(x["flops"] for x in kept.report["layers"])
    assert flops > 4 * sum(x.flops for x in simulate(r.model, dims={}).layers)    # counted at s = SEQ, not 1
    longer = {"x": rng.standard_normal((4, 1, 2 * SEQ, HIDDEN)).astype(np.float32)}
    r2 = qdqgraph.fix(q, calib=longer, exclude_nodes=["^o_proj$"])
    assert recorded.dims_of(r2.model) == {"b": 1, "s": 2 * SEQ}


def test_fix_predicts_and_records_for_its_target():
    """`fix --target tensorrt-rtx` predicts with TensorRT for RTX's rules, as insert and report do,
    and records that prediction for that target (it predicted for TensorRT whatever the target)."""
    import qdqgraph
    from qdqgraph.trtsim import simulate_and_lint
    m = motifs.attention_block(seq="s")
    rng = np.random.default_rng(0)
    q = qdqgraph.quantize(m, calib={"x": rng.standard_normal((8, 1, SEQ, HIDDEN)).astype(np.float32)},
                          high_precision="fp32", int8_attention="on").model
    r = qdqgraph.fix(q, exclude_nodes=["^o_proj$"], target="tensorrt-rtx")
    assert recorded.recorded(r.model, "tensorrt-rtx") is not None
    assert recorded.recorded(r.model, "tensorrt") is None
    want, _ = simulate_and_lint(r.model, target="tensorrt-rtx", dims=recorded.dims_of(r.model))
    assert r.report.tensorrt_after == dict(want.summary)
