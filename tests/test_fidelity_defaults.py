"""Issue 31: cross-layer equalization, bias correction kept by measurement, fragile heads kept
float, and the SQNR floor, each on a model built in code where it measurably helps, each with its
off switch, through the API and the CLI."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import qdqgraph
from motifs import G
from qdqgraph.graph import io
from qdqgraph.cli import build_parser, main
from qdqgraph.cli.args import config as config_of
from qdqgraph.samples.data import CalibrationData, read_arrays
from qdqgraph.errors import QdqError
from qdqgraph.recipes.fidelity import fidelity_of, reference
from qdqgraph.passes.check import qdq_violations
from qdqgraph.passes.equalize import equalize, pairs
from qdqgraph.prepare import model_inputs

OFF = dict(equalize="off", bias_correction=False, fragile_heads=False, sqnr_floor=None)


def dw_separable(c=32, spread=100.0, act="Relu", trunk=0):
    """[trunk convs ->] depthwise 3x3 -> act -> pointwise 1x1, the depthwise conv's channel i
    scaled by f_i (f from 1 to `spread`) and the pointwise weights reading it by 1 / f_i: the
    function of a plain pair, with per-channel ranges `spread` apart (a folded BatchNorm's)."""
    g = G("dw_separable")
    x = g.input("x", ["n", c, 16, 16])
    for i in range(trunk):
        x = g.node("Relu", [g.conv(x, c, c, f"trunk{i}")], name=f"trunk{i}_relu")
    f = np.logspace(0, np.log10(spread), c).astype(np.float32)
    w1 = (g.rng.standard_normal((c, 1, 3, 3)) * 0.3).astype(np.float32) * f[:, None, None, None]
    b1 = (g.rng.standard_normal(c) * 0.1).astype(np.float32) * f
    y = g.node("Conv", [x, g.const("dw.w", w1), g.const("dw.b", b1)], name="dw", kernel_shape=[3, 3],
               pads=[1] * 4, group=c)
    if act == "Clip":
        y = g.node("Clip", [y, g.const("lo", np.float32(0)), g.const("hi", np.float32(6))], name="act")
    elif act:
        y = g.node(act, [y], name="act")
    w2 = (g.rng.standard_normal((2 * c, c, 1, 1)) * 0.3).astype(np.float32) / f[None, :, None, None]
    g.node("Conv", [y, g.const("pw.w", w2), g.const("pw.b", np.zeros(2 * c, np.float32))], ["y"], name="pw",
           kernel_shape=[1, 1])
    g.output("y")
    return g.model()


def two_heads(c=32, trunk=4):
    """A shared trunk, a classification head (1x1 conv, global pool) and a regression head whose
    output is the small difference of nearly equal channel pairs (offsets read at sub-pixel
    precision): INT8 at the head's input leaves the offsets far less accurate than the classes."""
    g = G("two_heads")
    x = g.input("x", ["n", c, 16, 16])
    t = x
    for i in range(trunk - 1):
        t = g.node("Relu", [g.conv(t, c, c, f"trunk{i}")], name=f"trunk{i}_relu")
    w = (g.rng.standard_normal((c, c, 3, 3)) * 0.3).astype(np.float32)
    w[1::2] = w[0::2] + 0.05 * g.rng.standard_normal(w[0::2].shape).astype(np.float32)
    t = g.node("Conv", [t, g.const("last.w", w)], name="last", kernel_shape=[3, 3], pads=[1] * 4)
    g.node("GlobalAveragePool", [g.conv(t, c, 16, "cls_conv", k=1)], ["cls"], name="cls_pool")
    r = (g.rng.standard_normal((16, c // 2)) * 0.3).astype(np.float32)
    wh = np.zeros((16, c, 1, 1), np.float32)
    wh[:, 0::2, 0, 0], wh[:, 1::2, 0, 0] = r, -r
    g.node("Conv", [t, g.const("offset.w", wh)], ["offset"], name="offset_conv", kernel_shape=[1, 1])
    g.output("cls")
    g.output("offset")
    return g.model()


def data_for(c=32, n=16, seed=1):
    return {"x": np.random.default_rng(seed).standard_normal((n, 1, c, 16, 16)).astype(np.float32)}


def sqnr(quantized: onnx.ModelProto, float_model: onnx.ModelProto, data: dict):
    """Output SQNR of the written model against float on the first 8 samples, measured here."""
    loaded = io.load(float_model)
    inputs = model_inputs(loaded.graph)
    return fidelity_of(quantized, reference(loaded, CalibrationData(read_arrays(data, inputs), inputs, 8), 8))


def scales_valid(model: onnx.ModelProto) -> bool:
    g = io.load(model).graph
    assert not qdq_violations(g)
    found = [n.inputs[1].values for n in g.nodes if n.op in ("QuantizeLinear", "DequantizeLinear")]
    return bool(found) and all(np.all(np.isfinite(s)) and np.all(s > 0) for s in found)


# ------------------------------------------------------------------ cross-layer equalization

def _run(model, feed):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)


@pytest.mark.parametrize("act", ["Relu", "LeakyRelu", None])
def test_equalize_keeps_the_function_and_the_nodes_and_evens_the_ranges(act):
    m = dw_separable(act=act)
    loaded = io.load(m)
    ops = [n.op for n in loaded.graph.nodes]
    done = equalize(loaded.graph)
    assert done.changed and done["pairs"] == [["dw", "pw"]]
    assert [n.op for n in loaded.graph.nodes] == ops                     # folded into weights: no node added
    feed = {"x": data_for(n=1)["x"][0]}
    np.testing.assert_allclose(_run(io.to_model(loaded), feed)[0], _run(m, feed)[0], rtol=1e-3, atol=1e-3)
    nodes = {n.name: n for n in loaded.graph.nodes}
    r1 = np.abs(nodes["dw"].inputs[1].values).reshape(32, -1).max(1)
    r2 = np.abs(nodes["pw"].inputs[1].values).max(axis=(0, 2, 3))
    np.testing.assert_allclose(r1, r2, rtol=1e-4)                        # both ranges sqrt(r1 * r2)
    before = io.load(m).graph
    r1_before = np.abs([n for n in before.nodes if n.name == "dw"][0].inputs[1].values).reshape(32, -1).max(1)
    assert r1_before.max() / r1_before.min() > 50 * r1.max() / r1.min()


def test_equalize_leaves_a_clip_between_the_convs_alone():
    """ReLU6 (Clip) is not positive-homogeneous: scaling a channel would move its clip point."""
    loaded = io.load(dw_separable(act="Clip"))
    assert pairs(loaded.graph) == []
    assert not equalize(loaded.graph).changed


def test_equalize_raises_the_output_sqnr_of_a_depthwise_separable_pair_and_off_switches_it_off():
    m, data = dw_separable(), data_for()
    off = qdqgraph.quantize(m, data, **OFF)
    on = qdqgraph.quantize(m, data, **{**OFF, "equalize": "on"})
    assert off.report.equalized is None and on.report.equalized["pairs"] == [["dw", "pw"]]
    db_off, db_on = sqnr(off.model, m, data).overall_db, sqnr(on.model, m, data).overall_db
    assert db_on > db_off + 10, (db_off, db_on)
    assert scales_valid(on.model)
    assert [n.op_type for n in on.model.graph.node if n.op_type == "Conv"] == ["Conv", "Conv"]
    assert "equalized: 1 Conv pairs" in on.report.summary()
    assert qdqgraph.quantize(m, data, **{**OFF, "equalize": "auto"}).report.equalized is not None


# ------------------------------------------------------------------ bias correction by measurement

def test_bias_correction_auto_keeps_it_only_where_the_written_model_improves():
    m, data = dw_separable(), data_for()
    r = qdqgraph.quantize(m, data, **{**OFF, "bias_correction": None})
    b = r.report.fidelity["bias_correction"]
    assert b["kept"] == (b["with_db"] > b["without_db"])
    assert (r.report.bias_corrected > 0) == b["kept"]
    assert f"bias correction {'kept' if b['kept'] else 'dropped'}" in r.report.summary()
    forced = qdqgraph.quantize(m, data, **{**OFF, "bias_correction": True})
    assert forced.report.bias_corrected == 2 and forced.report.fidelity is None
    assert qdqgraph.quantize(m, data, **OFF).report.bias_corrected == 0


# ------------------------------------------------------------------ fragile heads

def test_a_fragile_regression_head_is_kept_float_and_said_so():
    m, data = two_heads(), data_for()
    off = qdqgraph.quantize(m, data, **OFF)
    on = qdqgraph.quantize(m, data, **{**OFF, "fragile_heads": True})
    before, after = sqnr(off.model, m, data), sqnr(on.model, m, data)
    assert before.per_output["offset"] < before.per_output["cls"] - 10
    assert after.per_output["offset"] > before.per_output["offset"] + 3
    assert abs(after.per_output["cls"] - before.per_output["cls"]) < 0.5
    head = on.report.fidelity["heads"][0]
    assert head["kept"] and head["nodes"] == ["offset_conv"] and head["flops_share"] <= 0.02
    assert not on.plan.decisions["offset_conv"].quantized and off.plan.decisions["offset_conv"].quantized
    assert "kept float: the head of output 'offset'" in on.report.summary()
    assert scales_valid(on.model)


# ------------------------------------------------------------------ the SQNR floor

def test_the_floor_returns_the_most_db_per_flop_within_the_int8_flops_budget():
    m, data = dw_separable(trunk=4), data_for()
    plain = qdqgraph.quantize(m, data, **OFF)
    floor = qdqgraph.quantize(m, data, **{**OFF, "sqnr_floor": 25.0})
    fl = floor.report.fidelity["floor"]
    assert fl["kept"] and fl["nodes"]
    assert sqnr(floor.model, m, data).overall_db > sqnr(plain.model, m, data).overall_db + 3
    assert floor.report.tensorrt["int8_flops_share"] >= 0.9
    assert "--sqnr-floor 25:" in floor.report.summary() and "most dB per FLOP" in floor.report.summary()
    tight = qdqgraph.quantize(m, data, **{**OFF, "sqnr_floor": 25.0, "floor_int8_flops": 100.0})
    assert not tight.report.fidelity["floor"]["kept"]
    assert tight.report.tensorrt["int8_flops_share"] == plain.report.tensorrt["int8_flops_share"]
    assert scales_valid(floor.model)


def test_nothing_is_measured_without_real_data_or_with_everything_off():
    m = dw_separable()
    assert qdqgraph.quantize(m, "random").report.fidelity is None
    assert qdqgraph.quantize(m, data_for(), **OFF).report.fidelity is None


# ------------------------------------------------------------------ options: API and CLI

def test_bad_values_are_one_clear_error():
    with pytest.raises(QdqError, match="equalize='sometimes'"):
        qdqgraph.QuantizeConfig(equalize="sometimes")
    with pytest.raises(QdqError, match="sqnr_floor="):
        qdqgraph.QuantizeConfig(sqnr_floor=float("nan"))
    with pytest.raises(QdqError, match="floor_int8_flops="):
        qdqgraph.QuantizeConfig(floor_int8_flops=120)
    with pytest.raises(QdqError, match="bias_correction"):
        qdqgraph.QuantizeConfig(bias_correction="yes")


def test_cli_flags_reach_the_same_config_and_the_summary(tmp_path, capsys):
    m, data = two_heads(), data_for()
    mp, dp = tmp_path / "m.onnx", tmp_path / "calib.npz"
    onnx.save(m, mp)
    np.savez(dp, **data)
    flags = ["--equalize", "off", "--bias-correction", "off", "--fragile-heads", "off", "--sqnr-floor", "off"]
    args = build_parser().parse_args(["insert", str(mp), "--calib", str(dp), *flags])
    assert config_of(args) == qdqgraph.QuantizeConfig(providers=("CPUExecutionProvider",), **OFF)
    args = build_parser().parse_args(["insert", str(mp), "--calib", str(dp), "--bias-correction", "--sqnr-floor", "30",
                                      "--floor-int8-flops", "95"])
    assert (config_of(args).bias_correction, config_of(args).sqnr_floor, config_of(args).floor_int8_flops) == \
        (True, 30.0, 95.0)
    defaults = config_of(build_parser().parse_args(["insert", str(mp), "--calib", str(dp)]))
    api = qdqgraph.QuantizeConfig(providers=("CPUExecutionProvider",))
    assert (defaults.equalize, defaults.bias_correction, defaults.fragile_heads, defaults.sqnr_floor) == \
        (api.equalize, api.bias_correction, api.fragile_heads, api.sqnr_floor)
    out = tmp_path / "out.onnx"
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(out), "--verify", "0",
                 "--sqnr-floor", "off", "--bias-correction", "off"]) == 0
    assert "kept float: the head of output 'offset'" in capsys.readouterr().out
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(out), "--force", "--verify", "0", *flags]) == 0
    assert "kept float" not in capsys.readouterr().out
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(out), "--force", "--sqnr-floor", "loud"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 2 and "--sqnr-floor" in err[0]


def test_the_floor_keeps_the_int8_share_as_the_engine_counts_it(monkeypatch):
    """The budget holds for the engine, not only for the nodes the floor floats: each written model
    it checks is simulated, and a choice whose engine share falls under the minimum (a neighbour
    losing its INT8 input floats more) is cut back, or not kept, and said so."""
    import qdqgraph.pipeline as pipeline
    m, data = dw_separable(trunk=4), data_for()
    floor = qdqgraph.quantize(m, data, **{**OFF, "sqnr_floor": 25.0})
    fl = floor.report.fidelity["floor"]
    assert fl["kept"] and fl["int8_share_after"] >= 0.9
    assert fl["int8_share_after"] == round(floor.report.tensorrt["int8_flops_share"], 4)

    real = pipeline.simulate

    class Fewer:                      # the real prediction, its INT8 share under any budget
        def __init__(self, sim):
            self.sim = sim

        def __getattr__(self, name):
            return getattr(self.sim, name)

        @property
        def summary(self):
            return {**self.sim.summary, "int8_flops_share": 0.5}
    monkeypatch.setattr(pipeline, "simulate", lambda *a, **k: Fewer(real(*a, **k)))
    cut = qdqgraph.quantize(m, data, **{**OFF, "sqnr_floor": 25.0}).report.fidelity["floor"]
    assert not cut["kept"] and cut["nodes"] == [] and "as TensorRT builds it" in cut["stopped"]
    assert "as TensorRT builds it" in qdqgraph.quantize(m, data, **{**OFF, "sqnr_floor": 25.0}).report.summary()


# ------------------------------------------------------------------ benchmarks/fidelity_defaults.py's held-out set

def _bench():
    from conftest_helpers import benchmark
    return benchmark("fidelity_defaults")


def test_benchmark_holdout_takes_all_or_a_count():
    import argparse
    fd = _bench()
    assert fd.holdout_count("all") is None and fd.holdout_count(" ALL ") is None
    assert fd.holdout_count("16") == 16 and fd.holdout_count("0") == 0
    with pytest.raises(argparse.ArgumentTypeError):
        fd.holdout_count("-1")
    with pytest.raises(ValueError):
        fd.holdout_count("some")


def test_benchmark_scores_every_odd_sample_by_default_and_the_first_16_beside(tmp_path):
    """`--holdout all` scores every odd-indexed sample of the data file (the even ones are the
    calibration file), `holdout_first` the first 16 of them where there are more, `--holdout N` the
    first N alone, 0 none; a data file without the model's inputs gives no held-out figure."""
    fd = _bench()
    path, calib, held = tmp_path / "m.onnx", tmp_path / "calib.npz", tmp_path / "data.npz"
    onnx.save(dw_separable(c=8), path)
    x = data_for(c=8, n=42, seed=3)["x"]
    np.savez(held, x=x)
    np.savez(calib, x=x[0::2])
    written = qdqgraph.quantize(str(path), calib=str(calib)).model
    paths = (path, calib, held)

    every = fd.held_out(written, paths, None)
    assert every["holdout"]["samples"] == 21 and every["holdout_first"]["samples"] == 16
    assert every["holdout"]["overall_db"] != every["holdout_first"]["overall_db"]
    # the first 16 are the same samples `--holdout 16` scores; the 21 are the odd ones, none calibration's
    assert fd.held_out(written, paths, 16) == {"holdout": every["holdout_first"]}
    loaded, odd = fd.data_of(path, held, None, odd=True)
    assert odd.count == 21 and odd.limit == 21
    assert fd.held_out(written, paths, 5)["holdout"]["samples"] == 5
    assert fd.held_out(written, paths, 50)["holdout"] == every["holdout"]      # more than there are: all
    assert fd.held_out(written, paths, None, first=0).keys() == {"holdout"}
    assert fd.held_out(written, paths, 0) == {} and fd.held_out(written, (path, calib, None), None) == {}
    np.savez(held, y=x)
    assert fd.held_out(written, paths, None) == {"holdout": None}


def test_benchmark_table_says_how_many_held_out_samples():
    fd = _bench()
    row = {"model": "m", "variant": "default", "seconds": 1.0, "int8_flops": 1.0,
           "calib": {"overall_db": 25.68}, "holdout": {"overall_db": 25.38, "samples": 24},
           "holdout_first": {"overall_db": 24.78, "samples": 16}}
    assert "25.7 / 25.4 (n=24; first 16: 24.8)" in fd.table([row])
    assert "25.7 / - |" in fd.table([{**row, "holdout": None, "holdout_first": None}])
