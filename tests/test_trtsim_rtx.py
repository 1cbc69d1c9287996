"""TensorRT for RTX as a target: the simulator's overlay (rules/tensorrt_rtx/), the placement overlay
(rules/placement_tensorrt_rtx.toml), and both checked against the compiler on a squeeze-excite block."""
import importlib.util
import json

import numpy as np
import onnx
from onnx import TensorProto
import pytest

import motifs
import qdqgraph
from qdqgraph.cli import main
from qdqgraph.trtsim import simulate
from qdqgraph.trtsim.rules import load_sim_rules, rule_files

HAVE_RTX = importlib.util.find_spec("tensorrt_rtx") is not None


def quantized(model, target):
    return qdqgraph.quantize(model, motifs.sample_data(model), target=target).model


@pytest.fixture(scope="module")
def se():
    m = motifs.se_block()
    return {t: quantized(m, t) for t in ("tensorrt", "tensorrt-rtx")}


def test_the_overlay_replaces_rules_by_id_and_keeps_the_rest():
    base, rtx = load_sim_rules(), load_sim_rules(target="tensorrt-rtx")
    overlay = {r.id for r in rtx.rules if "tensorrt_rtx" in r.source}
    assert {"F4-pool", "F4-reduce-mean", "F2-output-q", "RTX-dq-into-float", "RTX-float-pointwise-q"} <= overlay
    assert "input_shared" in " ".join(rtx.by_id["F4-pool"].when) and "input_shared" not in base.by_id["F4-pool"].when
    assert len([r for r in rtx.rules if r.id == "F4-pool"]) == 1           # replaced, not added
    assert set(base.by_id) - set(rtx.by_id) == set()
    assert all(rtx.by_id[i] == base.by_id[i] for i in set(base.by_id) - overlay)
    assert len(rule_files("tensorrt-rtx")) > len(rule_files("tensorrt"))
    with pytest.raises(qdqgraph.QdqError, match="unknown target"):
        rule_files("tensorrt-9")


def test_a_pool_of_a_shared_tensor_runs_float_and_its_q_alone_on_rtx_only(se):
    dc, rtx = simulate(se["tensorrt"]), simulate(se["tensorrt"], target="tensorrt-rtx")
    assert [x.name for x in dc.reformats] == ["x_q"]
    assert [x.name for x in rtx.reformats] == ["x_q", "gap_out_q"]
    ok, why = rtx.explain("F4-pool", "gap")
    assert not ok and "input_shared holds" in why and "also read by" in why
    assert dc.explain("F4-pool", "gap")[0]
    # the DQ the float pool reads costs no kernel on RTX; no rule of that action on the datacenter side
    absorbed = [e for e in rtx.events if e["rule"] == "RTX-dq-into-float"]
    assert absorbed and not any(e["rule"] == "RTX-dq-into-float" for e in dc.events)


def pool_head(reader="conv"):
    """conv -> relu -> GlobalAveragePool read by a 1x1 conv, or by Flatten -> Gemm (a ResNet's
    head): the pool alone reads the relu."""
    g = motifs.G("pool_head")
    x = g.node("Relu", [g.conv(g.input("x", [8, 16, 8, 8]), 16, 32, "conv")], name="relu")
    p = g.node("GlobalAveragePool", [x], name="gap")
    if reader == "conv":
        g.node("Conv", [p, g.weight("fc.w", (16, 32, 1, 1))], ["y"], name="fc", kernel_shape=[1, 1])
    else:
        g.node("Gemm", [g.node("Flatten", [p], name="flat"), g.weight("fc.w", (16, 32))], ["y"], name="fc", transB=1)
    g.output("y")
    return g.model()


@pytest.mark.parametrize("reader,standalone", [("gemm", ["x_q"]), ("conv", ["x_q", "gap_out_q"])])
def test_a_pool_read_by_nothing_else_stays_int8_on_rtx_where_a_gemm_reads_it(reader, standalone):
    """TensorRT for RTX 1.7.1.116 computes such a pool in the generated kernel after the conv; read
    by a GEMM, that kernel rounds its output (INT8 pooling, F4-pool); read by a 1x1 conv, it stops at
    the clamp and __myl_MaxRounCast rounds alone."""
    m = quantized(pool_head(reader), "tensorrt")
    rtx = simulate(m, target="tensorrt-rtx")
    q = next(n.name for n in m.graph.node if n.op_type == "QuantizeLinear" and n.name != "x_q" and
             "relu" not in n.name)
    assert [x.name for x in rtx.reformats] == [s if s == "x_q" else q for s in standalone], rtx.table()
    assert bool(rtx.explain("F4-pool", "gap")[0]) == (reader == "gemm")


@pytest.mark.skipif(not HAVE_RTX, reason="needs TensorRT for RTX: pip install 'qdqgraph[rtx]'")
@pytest.mark.parametrize("reader", ["gemm", "conv"])
def test_a_pool_head_compiles_as_predicted(reader, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(quantized(pool_head(reader), "tensorrt"), path)
    assert main(["build", str(path), "-o", str(tmp_path / "m.engine"), "--layer-info", str(tmp_path / "l.json"),
                 "--quiet"]) == 0
    check = json.loads((tmp_path / "l.json").read_text())["check"]
    assert check["reformats"]["predicted"] == check["reformats"]["compiled"] == (1 if reader == "gemm" else 2), check


def test_rtx_placement_keeps_the_squeeze_excite_branch_float(se):
    decisions = {}
    for t in ("tensorrt", "tensorrt-rtx"):
        r = qdqgraph.quantize(motifs.se_block(), motifs.sample_data(motifs.se_block()), target=t)
        decisions[t] = r.plan.decisions
    rtx, dc = decisions["tensorrt-rtx"], decisions["tensorrt"]
    for conv in ("se_reduce", "se_expand"):
        assert dc[conv].quantized
        assert not rtx[conv].quantized and rtx[conv].rule == "P10-rtx-squeeze-excite"
        assert "global pool" in rtx[conv].reason or "pool" in rtx[conv].reason
    assert rtx["conv"].quantized and rtx["head"].quantized
    # and the float gate Mul rounds its own output on RTX: one standalone kernel left, the input's
    sim = simulate(se["tensorrt-rtx"], target="tensorrt-rtx")
    assert [x.name for x in sim.reformats] == ["x_q"]
    assert sim.explain("RTX-float-pointwise-q", "se_mul_out_q")[0]


def test_report_and_insert_take_the_target(se, tmp_path, capsys):
    path = tmp_path / "se.onnx"
    onnx.save(se["tensorrt"], path)
    assert main(["report", str(path), "--target", "tensorrt-rtx", "--json", str(tmp_path / "r.json"), "--quiet"]) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["target"] == "tensorrt-rtx" and doc["summary"]["reformats"] == 2
    src = tmp_path / "m.onnx"
    onnx.save(motifs.se_block(), src)
    import numpy as np
    np.savez(tmp_path / "d.npz", **motifs.sample_data(motifs.se_block()))
    assert main(["insert", str(src), "--calib", str(tmp_path / "d.npz"), "-o", str(tmp_path / "o.onnx"),
                 "--target", "tensorrt-rtx"]) == 0
    out = capsys.readouterr().out
    assert "TensorRT for RTX prediction" in out and "P10-rtx-squeeze-excite" in out


@pytest.mark.skipif(not HAVE_RTX, reason="needs TensorRT for RTX: pip install 'qdqgraph[rtx]'")
@pytest.mark.parametrize("placement", ["tensorrt", "tensorrt-rtx"])
def test_standalone_quantize_kernels_predicted_as_the_compiler_builds_them(se, placement, tmp_path, capsys):
    path = tmp_path / "se.onnx"
    onnx.save(se[placement], path)
    assert main(["build", str(path), "-o", str(tmp_path / "se.engine"), "--shapes", "x:1x16x8x8",
                 "--layer-info", str(tmp_path / "l.json")]) == 0
    counts = json.loads((tmp_path / "l.json").read_text())["check"]["reformats"]
    assert counts["predicted"] == counts["compiled"], counts
    assert counts["compiled"] == (2 if placement == "tensorrt" else 1)


def test_insert_summary_says_whether_int8_beats_fp16_on_a_named_gpu(tmp_path, capsys):
    import numpy as np
    m = motifs.residual_add()
    onnx.save(m, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", **motifs.sample_data(m))
    base = ["insert", str(tmp_path / "m.onnx"), "--calib", str(tmp_path / "d.npz"), "-o", str(tmp_path / "o.onnx"),
            "--force"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "speed: INT8 estimated" in out and "FP16 on NVIDIA A100" in out
    assert main(base + ["--target", "tensorrt-rtx", "--gpu", "l4"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("speed:"))
    assert "FP16 on NVIDIA L4" in line and "roofline estimate, not a measurement" in line
    assert main(base + ["--gpu", "h200"]) == 2
    assert "unknown GPU 'h200'" in capsys.readouterr().err


def test_a_layernorm_rounds_its_own_output_on_rtx_not_on_datacenter_tensorrt():
    m = quantized(motifs.layernorm_mlp(), "tensorrt")
    assert [x.name for x in simulate(m).reformats] == ["x_q", "ln_out_q"]
    rtx = simulate(m, target="tensorrt-rtx")
    assert [x.name for x in rtx.reformats] == ["x_q"]
    assert rtx.explain("RTX-float-pointwise-q", "ln_out_q")[0]


def test_a_float_conv_rounds_in_its_generated_epilogue_but_not_after_a_plain_relu():
    from qdqgraph.trtsim.conditions import c_generated_epilogue
    from qdqgraph.trtsim.fuse import LayerBuild
    from qdqgraph.trtsim.ir import SimGraph, SNode
    from qdqgraph.rulebook.match import Context
    from qdqgraph.graph import io
    g = SimGraph.from_gs(io.load(motifs.residual_hardswish()).graph)
    conv = next(n for n in g.nodes.values() if n.op == "Conv")
    layer = LayerBuild(conv, "F1", "convolution")
    layer.members.append(conv)
    assert not c_generated_epilogue(Context(g, layer=layer), conv, None)        # the conv alone
    relu = SNode("r", "Relu", [conv.outputs[0]], ["r_out"])
    layer.members.append(relu)                                                   # a ReLU the kernel applies
    assert not c_generated_epilogue(Context(g, layer=layer), conv, None)
    mul = next(n for n in g.nodes.values() if n.op == "Mul")                     # HardSwish's x * clip(...)
    layer.members.append(mul)
    assert c_generated_epilogue(Context(g, layer=layer), conv, None).ok


def bias_free_conv_relu():
    """conv (no bias) -> ReLU -> conv: the ReLU's output quantized for the second conv."""
    g = motifs.G("bias_free_conv_relu")
    x = g.node("Relu", [g.conv(g.input("x", ["n", 16, 8, 8]), 16, 16, "c1", bias=False)], name="act")
    g.node("Conv", [x, g.weight("c2.w", (16, 16, 3, 3))], ["y"], name="c2", pads=[1, 1, 1, 1])
    g.output("y")
    return g.model()


def test_a_quantized_conv_applies_its_relu_in_the_generated_kernel_that_rounds():
    # an INT8 convolution writes float; TensorRT for RTX 1.7.1.116 compiles c1 as a convolution then
    # __myl_MulCastReluMulMinMaxRounCast (dequantize, ReLU, requantize): no standalone quantize
    rtx = simulate(quantized(bias_free_conv_relu(), "tensorrt"), target="tensorrt-rtx")
    assert [x.name for x in rtx.reformats] == ["x_q"], rtx.table()
    assert rtx.explain("F2-output-q", "act_out_q")[0]


@pytest.mark.skipif(not HAVE_RTX, reason="needs TensorRT for RTX: pip install 'qdqgraph[rtx]'")
def test_a_quantized_conv_and_its_relu_compile_as_predicted(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(quantized(bias_free_conv_relu(), "tensorrt"), path)
    assert main(["build", str(path), "-o", str(tmp_path / "m.engine"), "--shapes", "x:1x16x8x8",
                 "--layer-info", str(tmp_path / "l.json"), "--quiet"]) == 0
    counts = json.loads((tmp_path / "l.json").read_text())["check"]["reformats"]
    assert counts == {"predicted": 1, "compiled": 1}


def q_read_by_float(reader):
    """float conv + ReLU -> Q -> DQ read by a float `reader` ("mul", "sigmoid", or "add": a residual
    Add that fuses into a second float conv); no INT8 op reads the DQ."""
    g = motifs.G(f"q_read_by_float_{reader}")
    x = g.input("x", [1, 16, 8, 8])
    t = g.node("Relu", [g.conv(x, 16, 16, "conv_a", bias=False)], name="relu_a")
    scale, zero = g.const("s", np.array(0.05, np.float32)), g.const("z", np.array(0, np.int8))
    dq = g.node("DequantizeLinear", [g.node("QuantizeLinear", [t, scale, zero], name="t_q"), scale, zero], name="t_dq")
    u = g.conv(t, 16, 16, "conv_b", bias=False)
    if reader == "mul":
        g.node("Mul", [dq, u], ["y"], name="gate_mul")
    elif reader == "sigmoid":
        g.node("Add", [g.node("Sigmoid", [dq], name="sig"), u], ["y"], name="res_add")
    else:
        g.node("Add", [dq, u], ["y"], name="res_add")
    g.output("y")
    return g.model()


@pytest.mark.parametrize("reader", ["mul", "sigmoid", "add"])
def test_a_q_read_only_by_float_ops_writes_no_int8_tensor_on_rtx(reader):
    m = q_read_by_float(reader)
    assert [x.name for x in simulate(m).reformats] == ["t_q", "t_dq"]    # datacenter TensorRT: as before
    rtx = simulate(m, target="tensorrt-rtx")
    assert rtx.reformats == [], rtx.table()
    assert rtx.explain("RTX-qdq-into-float", "t_q")[0]
    own = [x for x in rtx.layers if x.rule == "RTX-qdq-into-float"]
    # a pointwise reader rounds inside its kernel; the residual Add is in a conv's kernel: one of their own
    assert [x.nodes for x in own] == ([["t_q", "t_dq"]] if reader == "add" else []), rtx.table()


@pytest.mark.skipif(not HAVE_RTX, reason="needs TensorRT for RTX: pip install 'qdqgraph[rtx]'")
@pytest.mark.parametrize("reader", ["mul", "add"])
def test_a_q_read_only_by_float_ops_compiles_as_predicted(reader, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(q_read_by_float(reader), path)
    assert main(["build", str(path), "-o", str(tmp_path / "m.engine"), "--layer-info", str(tmp_path / "l.json"),
                 "--quiet"]) == 0
    counts = json.loads((tmp_path / "l.json").read_text())["check"]["reformats"]
    assert counts == {"predicted": 0, "compiled": 0}


def test_an_fp8_kernel_that_only_scales_and_casts_is_a_standalone_quantize():
    from qdqgraph.backends import listing
    line = ("Name: __myl_MulCast_myl0_26, LayerType: kgen, Inputs: [ { Name: p, Dimensions: [1,8,1,1], "
            "Strides: [8,1,1,1], Datatype: Half, Format: (Linear) }], Constants: [], Outputs: [ { Name: q, "
            "Dimensions: [1,8,1,1], Strides: [8,1,1,1], Datatype: FP8, Format: (Linear) }], TacticName: t, "
            "StreamId: 0, Metadata: [ONNX Layer: pool_q]")
    cast_only = line.replace("Datatype: FP8", "Datatype: Half")
    a, b = listing.parse_listing([line, cast_only]).layers
    assert a.kind == "quantize" and a.qdq_reformat and a.outputs == [("q", "fp8")]
    assert b.kind != "quantize" and not b.qdq_reformat


def cast_then_conv():
    """An FP16 input cast to float32, then a convolution: the Q of its input follows the Cast."""
    g = motifs.G("cast_then_conv")
    x = g.node("Cast", [g.input("x", [1, 16, 32, 32], TensorProto.FLOAT16)], name="to_float", to=TensorProto.FLOAT)
    g.node("Relu", [g.conv(x, 16, 16, "c1")], ["y"], name="act")
    g.output("y")
    return g.model()


def one_hot_gemm():
    """A one-hot (Equal, then a Cast to float) read by a MatMul, as magika's first layer."""
    g = motifs.G("one_hot_gemm")
    hot = g.node("Equal", [g.input("x", [64, 1], TensorProto.INT64),
                           g.const("classes", np.arange(32, dtype=np.int64).reshape(1, 32))], name="eq")
    f = g.node("Cast", [hot], name="to_float", to=TensorProto.FLOAT)
    g.node("MatMul", [f, g.weight("emb", (32, 64))], ["y"], name="embed")
    g.output("y")
    return g.model()


def lstm_then_gemm(steps):
    """A one-way LSTM of `steps` steps whose output a linear layer reads through a Reshape (the Q
    of the GEMM's input follows the Reshape, which the prediction, as the compiler, moves it past)."""
    g = motifs.G("lstm_then_gemm")
    hidden = 64
    y = g.node("LSTM", [g.input("x", [steps, 1, 16]), g.weight("W", (1, 4 * hidden, 16)),
                        g.weight("R", (1, 4 * hidden, hidden))], ["seq"], name="lstm", hidden_size=hidden)
    flat = g.node("Reshape", [y, g.const("shape", np.array([steps, hidden], np.int64))], name="flat")
    g.node("MatMul", [flat, g.weight("fc.w", (hidden, 64))], ["y"], name="fc")
    g.output("y")
    return g.model()


def scaled_input():
    """A graph input multiplied by a per-channel constant (a smoothing no producer could take), then
    a MatMul, as the Whisper decoder's encoder_hidden_states."""
    g = motifs.G("scaled_input")
    x = g.node("Mul", [g.input("x", [64, 128]), g.const("s", np.linspace(0.5, 2, 128).astype(np.float32))],
               name="smooth")
    g.node("MatMul", [x, g.weight("w", (128, 64))], ["y"], name="mm")
    g.output("y")
    return g.model()


# the model, the tensor its Q reads, and the rule by which TensorRT for RTX rounds that Q in the
# kernel that computes the tensor (None: a standalone quantize); measured with 1.7.1.116
CASES = {"cast-of-input": (cast_then_conv, "to_float_out", None),
         "one-hot": (one_hot_gemm, "to_float_out", "RTX-float-pointwise-q"),
         "lstm-8-steps": (lambda: lstm_then_gemm(8), "flat_out", None),
         "lstm-16-steps": (lambda: lstm_then_gemm(16), "flat_out", "RTX-recurrent-loop-q"),
         "scaled-input": (scaled_input, "smooth_out", None)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_q_after_a_cast_an_lstm_or_a_scaled_input_rounds_where_the_compiler_does(case):
    """A Cast of what another op computed (a one-hot's Equal) rounds its output in its generated
    kernel on TensorRT for RTX, a Cast of a graph input folds into a standalone quantize, as does a
    graph input's Mul by a constant (into the Q's scale: __myl_CastMulMinMaxRounCast); an LSTM run as
    a loop rounds in its last gate kernel, an unrolled one (8 steps) has its Q run alone."""
    build, tensor, rule = CASES[case]
    m = quantized(build(), "tensorrt")
    q = next(n.name for n in m.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor)
    assert q in [x.name for x in simulate(m).reformats]            # datacenter TensorRT: a reformat of its own
    rtx = simulate(m, target="tensorrt-rtx")
    assert (q in [x.name for x in rtx.reformats]) == (rule is None), rtx.table()
    if rule is not None:
        assert rtx.explain(rule, q)[0]


@pytest.mark.skipif(not HAVE_RTX, reason="needs TensorRT for RTX: pip install 'qdqgraph[rtx]'")
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_q_after_a_cast_an_lstm_or_a_scaled_input_compiles_as_predicted(case, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(quantized(CASES[case][0](), "tensorrt"), path)
    assert main(["build", str(path), "-o", str(tmp_path / "m.engine"), "--layer-info", str(tmp_path / "l.json"),
                 "--quiet"]) == 0
    check = json.loads((tmp_path / "l.json").read_text())["check"]
    assert check["reformats"]["predicted"] == check["reformats"]["compiled"] == (1 if CASES[case][2] is None else 0), check


def test_an_lstm_of_unknown_length_is_predicted_as_a_loop():
    """A symbolic sequence length (ddddocr's, known only at build) counts as a loop: its Q rounds in
    the gate kernel; the same model with 8 steps declared has its Q run alone."""
    m = quantized(lstm_then_gemm(8), "tensorrt")
    q = next(n.name for n in m.graph.node if n.op_type == "QuantizeLinear")
    assert q in [x.name for x in simulate(m, target="tensorrt-rtx").reformats]
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "steps"
    del m.graph.value_info[:]                  # the shapes inferred again from the symbolic input
    rtx = simulate(m, target="tensorrt-rtx")
    assert q not in [x.name for x in rtx.reformats], rtx.table()
    assert rtx.explain("RTX-recurrent-loop-q", q)[0]
