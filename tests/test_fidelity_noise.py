"""benchmarks/fidelity_noise.py: the jitter it applies, and that the ranges it reads back from a
run's report, given unchanged as calib_cache, write the very same model (the base its spread is
measured against)."""
import numpy as np
import onnx

import qdqgraph
from conftest_helpers import benchmark
from motifs import G


def _module():
    return benchmark("fidelity_noise")


def _model():
    g = G("noise")
    x = g.input("x", ["n", 8, 12, 12])
    y = g.node("Relu", [g.conv(x, 8, 8, "c0")], name="r0")
    g.node("Relu", [g.conv(y, 8, 8, "c1")], ["y"], name="r1")
    g.output("y")
    return g.model()


def test_jitter_stays_within_rel_is_seeded_and_seed_zero_is_the_identity():
    fn = _module()
    amax = {f"t{i}": float(i + 1) for i in range(50)}
    assert fn.jittered(amax, 0.005, 0) == amax
    a, b = fn.jittered(amax, 0.005, 3), fn.jittered(amax, 0.005, 3)
    assert a == b and a != fn.jittered(amax, 0.005, 4)
    ratios = np.array([a[k] / amax[k] for k in amax])
    assert np.all(np.abs(ratios - 1) <= 0.005) and np.any(ratios != 1)


def test_spread_of_figures():
    fn = _module()
    s = fn.spread([24.0, 25.0, 26.0, "inf", None])
    assert s == {"mean": 25.0, "sd": 1.0, "min": 24.0, "max": 26.0, "n": 3}
    assert fn.spread([]) == {}


def test_the_reports_ranges_as_a_cache_write_the_same_model(tmp_path):
    fn = _module()
    path = tmp_path / "m.onnx"
    onnx.save(_model(), path)
    data = {"x": np.random.default_rng(0).standard_normal((8, 1, 8, 12, 12)).astype(np.float32)}
    first = qdqgraph.quantize(str(path), calib=data)
    amax = fn.ranges(first.report)
    assert amax and all(v > 0 for v in amax.values())
    again = qdqgraph.quantize(str(path), calib=data, calib_cache=amax)
    init = lambda m: {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}  # noqa: E731
    a, b = init(first.model), init(again.model)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    moved = qdqgraph.quantize(str(path), calib=data, calib_cache=fn.jittered(amax, 0.005, 1))
    c = init(moved.model)
    assert any(not np.array_equal(a[k], c[k]) for k in a)


def test_the_noise_of_every_held_out_sample_and_of_the_first_16(tmp_path):
    """fidelity_noise scores what fidelity_defaults scores: every odd-indexed sample of the data file
    by default, the first 16 of them beside, and its table shows both."""
    fn = _module()
    path, calib, held = tmp_path / "m.onnx", tmp_path / "calib.npz", tmp_path / "data.npz"
    onnx.save(_model(), path)
    x = np.random.default_rng(1).standard_normal((40, 1, 8, 12, 12)).astype(np.float32)
    np.savez(held, x=x)
    np.savez(calib, x=x[0::2])
    row = fn.run_model("m", (path, calib, held), {}, 2, 0.005, 32, None)
    assert set(row["default"]) == {"calib", "holdout", "holdout_first"}
    assert row["holdout"]["n"] == 2 and row["holdout_first"]["n"] == 2
    assert all(r["holdout"] is not None and r["holdout_first"] is not None for r in row["runs"])
    assert "| m | " in fn.table([row]) and fn.table([row]).count("±") >= 4
    few = fn.run_model("m", (path, calib, held), {}, 1, 0.005, 32, 8)
    assert "holdout_first" not in few and few["default"]["holdout_first"] is None
