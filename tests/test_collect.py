"""Calibration collection: both ways of binning (the compiled kernel on raw tensors, and indices
computed inside onnxruntime) equal numpy binning exactly; batching and shared groups; max state."""
import numpy as np
import onnxruntime as ort
import pytest

import motifs
from qdqgraph.graph import io
from qdqgraph.calib import collect as collect_module
from qdqgraph.calib import histogram as histogram_module
from qdqgraph.calib.collect import collect
from qdqgraph.calib.histogram import RangeState
from qdqgraph.samples.data import CalibrationData
from qdqgraph.errors import QdqError
from qdqgraph.prepare import clean, model_inputs
from qdqgraph.placement import plan_placement


def prepared(model):
    loaded = io.load(model)
    clean(loaded)
    return loaded, plan_placement(loaded.graph)


def reference_states(loaded, groups, data):
    """One RangeState per group, fed the raw tensors through numpy (RangeState.update)."""
    g = loaded.graph.copy()
    t = g.tensors()
    names = sorted({m for ms in groups.values() for m in ms})
    g.outputs = [t[n] for n in names]
    sess = ort.InferenceSession(io.to_model(io.Loaded(graph=g, ir_version=8)).SerializeToString())
    owner = {m: rep for rep, ms in groups.items() for m in ms}
    states = {rep: RangeState() for rep in groups}
    for feed in data.batches(1):
        for n, v in zip(names, sess.run(names, feed)):
            states[owner[n]].update(v)
    return states


@pytest.fixture(params=[1, 2], ids=["1-lane", "2-lanes"])
def lanes(request, monkeypatch):
    """Run a collection test with one onnxruntime run at a time, and with two at once (the
    default where there are two cores)."""
    monkeypatch.setattr(collect_module, "default_lanes", lambda: request.param)
    return request.param


@pytest.mark.parametrize("name", ["residual_add", "concat_of_pools", "attention"])
def test_histograms_equal_numpy_reference(name, binning, lanes):
    m = motifs.ALL[name]()
    loaded, plan = prepared(m)
    arrays = motifs.sample_data(m, n=12)
    # growing ranges: later samples larger, so the range doubles during the run
    for k, v in arrays.items():
        if v.dtype == np.float32:
            arrays[k] = v * np.linspace(0.2, 3.0, len(v), dtype=np.float32).reshape(-1, *[1] * (v.ndim - 1))
    inputs = model_inputs(loaded.graph)
    data = CalibrationData(arrays, inputs)
    got = collect(loaded, plan.groups(), data, method="entropy")
    ref = reference_states(loaded, plan.groups(), data)
    # the in-graph path runs the first batch once more to learn the ranges its index graph needs
    # (lanes start from the first batch too: it is the first sample, binned before they start)
    assert got.samples == 12 and got.runs == (12 if binning == "kernel" else 13)
    for rep in plan.groups():
        a, b = got.states[rep], ref[rep]
        # numpy's update sets each range from the first batch and doubles it as needed; so do
        # both paths, with the same float32 arithmetic, so the widths, counts and maxima agree exactly
        assert a.width == b.width, rep
        np.testing.assert_array_equal(a.counts, b.counts)
        assert a.amax == pytest.approx(b.amax, rel=0, abs=0)
        assert a.count == b.count


def _growing(m, n):
    """Samples whose magnitude grows along the set (x0.2 .. x3), so ranges grow during a run and a
    range started from a batch's max differs from one started from the first sample's."""
    arrays = motifs.sample_data(m, n=n)
    for k, v in arrays.items():
        if v.dtype == np.float32:
            arrays[k] = v * np.geomspace(0.2, 3.0, len(v), dtype=np.float32).reshape(-1, *[1] * (v.ndim - 1))
    return arrays


def _assert_same_states(a, b):
    for rep in a:
        x, y = a[rep], b[rep]
        assert (x.width, x.amax, x.count) == (y.width, y.amax, y.count), rep
        np.testing.assert_array_equal(x.counts, y.counts, err_msg=rep)


@pytest.mark.parametrize("name", ["residual_add", "attention"])
def test_batch_size_does_not_change_the_histograms(name, binning, lanes):
    # every range starts from the first sample, so any batching gives the batch-1 histograms bit for
    # bit (started from the first batch's max they differ: TensorRT's behaviour, a user complaint)
    m = motifs.ALL[name]()
    loaded, plan = prepared(m)
    arrays = _growing(m, 9)
    inputs = model_inputs(loaded.graph)
    one = collect(loaded, plan.groups(), CalibrationData(arrays, inputs), method="entropy", batch_size=1)
    for b in (2, 4, 9):
        other = collect(loaded, plan.groups(), CalibrationData(arrays, inputs), method="entropy", batch_size=b)
        assert other.runs < one.runs and other.samples == 9
        _assert_same_states(one.states, other.states)


def test_shards_merge_into_the_full_run(binning, lanes):
    m = motifs.residual_add()
    loaded, plan = prepared(m)
    arrays = _growing(m, 10)
    data = CalibrationData(arrays, model_inputs(loaded.graph))
    full = collect(loaded, plan.groups(), data, method="entropy", batch_size=2).states
    for count in (2, 3):
        parts = [collect(loaded, plan.groups(), data.shard(i, count), method="entropy", batch_size=2).states
                 for i in range(1, count + 1)]
        merged = parts[0]
        for p in parts[1:]:
            merged = {rep: merged[rep].merge(p[rep]) for rep in merged}
        _assert_same_states(full, merged)


def test_max_method_equals_numpy_max(lanes):
    m = motifs.concat_of_pools()
    loaded, plan = prepared(m)
    arrays = motifs.sample_data(m, n=5)
    data = CalibrationData(arrays, model_inputs(loaded.graph))
    got = collect(loaded, plan.groups(), data, method="max")
    ref = reference_states(loaded, plan.groups(), data)
    for rep in plan.groups():
        assert got.states[rep].amax == ref[rep].amax


def test_concat_group_has_one_state(binning):
    m = motifs.concat_of_pools()
    loaded, plan = prepared(m)
    groups = plan.groups()
    big = [rep for rep, members in groups.items() if len(members) == 3]
    assert len(big) == 1
    data = CalibrationData(motifs.sample_data(m, n=3), model_inputs(loaded.graph))
    got = collect(loaded, groups, data, method="entropy")
    assert set(got.states) == set(groups)


def _big_map_model():
    g = motifs.G("big_map")
    x = g.input("x", ["n", 4, 40, 40])
    y = g.node("Relu", [g.conv(x, 4, 8, "c1")], name="r1")
    g.node("Conv", [y, g.weight("w2", (8, 8, 3, 3))], ["y"], name="c2", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    g.output("y")
    return g.model()


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_large_maps_are_histogrammed_on_the_stride_subsample(stride, binning):
    """40x40 maps (>= SUBSAMPLE_MIN_HW): the in-graph histogram equals numpy's histogram of
    x[:, :, ::stride, ::stride]; stride 1 is every value; the max method always sees every value."""
    m = _big_map_model()
    loaded, plan = prepared(m)
    arrays = motifs.sample_data(m, n=6)
    data = CalibrationData(arrays, model_inputs(loaded.graph))
    got = collect(loaded, plan.groups(), data, method="entropy", stride=stride)
    names = sorted({t for members in plan.groups().values() for t in members})
    sess = ort.InferenceSession(io.with_outputs(io.to_model(loaded), names).SerializeToString())
    owner = {t: rep for rep, members in plan.groups().items() for t in members}
    ref = {rep: RangeState() for rep in plan.groups()}
    full_max = dict.fromkeys(plan.groups(), 0.0)
    for feed in data.batches(1):
        for n, v in zip(names, sess.run(names, feed)):
            ref[owner[n]].update(v[:, :, ::stride, ::stride] if v.ndim == 4 else v)
            full_max[owner[n]] = max(full_max[owner[n]], float(np.abs(v).max()))
    for rep in plan.groups():
        np.testing.assert_array_equal(got.states[rep].counts, ref[rep].counts)
        assert got.states[rep].count == ref[rep].count
    exact = collect(loaded, plan.groups(), data, method="max")
    assert {r: exact.states[r].amax for r in plan.groups()} == full_max


def test_planned_tensor_that_is_also_a_model_output(binning):
    """A quantized tensor that the model already outputs (and a graph input, read from the feed)
    is binned once, with the model's own outputs untouched."""
    g = motifs.G("output_too")
    x = g.input("x", [1, 16, 8, 8])
    y = g.node("Relu", [g.conv(x, 16, 32, "c1")], ["mid"], name="r1")
    g.node("Conv", [y, g.weight("w2", (32, 32, 3, 3))], ["y"], name="c2", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    g.output("mid")
    g.output("y")
    m = g.model()
    loaded, plan = prepared(m)
    groups = plan.groups()
    assert any("mid" in members for members in groups.values())
    data = CalibrationData(motifs.sample_data(m, n=4), model_inputs(loaded.graph))
    got = collect(loaded, groups, data, method="percentile")
    assert [o.name for o in loaded.graph.outputs] == ["mid", "y"]
    ref = reference_states(loaded, groups, data)
    for rep in groups:
        np.testing.assert_array_equal(got.states[rep].counts, ref[rep].counts)
        assert got.states[rep].amax == ref[rep].amax and got.states[rep].count == ref[rep].count


def test_raw_graph_copies_the_graph_only_where_it_adds_nodes():
    """Outputs only: the graph itself comes back, unchanged (its session adds the outputs); a map
    to subsample or an observed input: a copy, the original untouched."""
    from qdqgraph.calib.collect import raw_graph
    g = motifs.G("small")
    x = g.input("x", [1, 16, 8, 8])
    y = g.node("Relu", [g.conv(x, 16, 32, "c1")], ["mid"], name="r1")
    g.node("Conv", [y, g.weight("w2", (32, 32, 3, 3))], ["y"], name="c2", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    g.output("y")
    loaded, _ = prepared(g.model())
    before = (len(loaded.graph.nodes), [t.name for t in loaded.graph.outputs])
    same, fetch = raw_graph(loaded.graph, ["mid", "x"], stride=1)
    assert same is loaded.graph and fetch == {"mid": "mid", "x": None}
    assert (len(loaded.graph.nodes), [t.name for t in loaded.graph.outputs]) == before
    copied, fetch = raw_graph(loaded.graph, ["mid", "x"], stride=2)        # x observed through a copy of it
    assert copied is not loaded.graph and fetch["x"] != "x" and fetch["x"] in {t.name for t in copied.outputs}
    assert (len(loaded.graph.nodes), [t.name for t in loaded.graph.outputs]) == before
    pruned, _ = raw_graph(loaded.graph, ["mid"], stride=1, only=True)
    assert pruned is not loaded.graph and [t.name for t in pruned.outputs] == ["mid"]


def test_bound_outputs_follow_input_shape_changes():
    """Outputs bound once per input shape: a new shape (dynamic dims, a last short batch) rebinds,
    and every run returns exactly what a plain run returns."""
    from qdqgraph.calib.collect import _BoundOutputs, raw_graph
    from qdqgraph.execution.runtime import session
    g = motifs.G("dyn")
    x = g.input("x", ["n", 16, "h", "w"])
    y = g.node("Relu", [g.conv(x, 16, 32, "c1")], ["mid"], name="r1")
    g.node("Conv", [y, g.weight("w2", (32, 32, 3, 3))], ["y"], name="c2", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    g.output("y")
    loaded, plan = prepared(g.model())
    graph, fetch = raw_graph(loaded.graph, ["mid"])
    # the tensors to fetch are outputs of the session's model (raw_graph adds no node here)
    model = io.with_outputs(io.to_model(io.Loaded(graph=graph, ir_version=loaded.ir_version)), [fetch["mid"]])
    sess = session(model, ["CPUExecutionProvider"])
    bound = _BoundOutputs(sess, [fetch["mid"]])
    rng = np.random.default_rng(0)
    last = None
    for shape in [(1, 16, 8, 8), (1, 16, 8, 8), (2, 16, 5, 7), (2, 16, 5, 7), (1, 16, 8, 8)]:
        feed = {"x": rng.standard_normal(shape).astype(np.float32)}
        out = bound.run(feed, 0)
        assert (out is bound.arrays) == (shape == last)      # a repeated shape ran into the bound arrays
        last = shape
        got = [a.copy() for a in out]
        np.testing.assert_array_equal(got[0], sess.run([fetch["mid"]], feed)[0])
        assert got[0].shape == (shape[0], 32, shape[2], shape[3])


def _spy_sessions(monkeypatch) -> list:
    """Record (blocked layout asked for, channels of the outputs fetched blocked, onnxruntime threads
    per run) per session."""
    calls = []
    real = collect_module.unordered_session

    def spy(*args, **kwargs):
        sess, blocked = real(*args, **kwargs)
        calls.append((kwargs.get("blocked", True), dict(blocked.channels), kwargs.get("threads")))
        return sess, blocked
    monkeypatch.setattr(collect_module, "unordered_session", spy)
    return calls


needs_kernel = pytest.mark.skipif(not histogram_module.COMPILED,
                                  reason="the compiled histogram kernel was not built (no C compiler at install)")


@needs_kernel
@pytest.mark.parametrize("method", ["entropy", "max"])
def test_blocked_layout_outputs_give_the_plain_layout_results(monkeypatch, method):
    """Convolutions of 16 and 32 channels run in onnxruntime's blocked layout; their outputs are
    fetched as they are, and the states equal numpy's over the plain-layout tensors."""
    calls = _spy_sessions(monkeypatch)
    m = motifs.concat_of_pools()
    loaded, plan = prepared(m)
    data = CalibrationData(motifs.sample_data(m, n=6), model_inputs(loaded.graph))
    got = collect(loaded, plan.groups(), data, method=method)
    if not calls[0][1]:
        pytest.skip("onnxruntime ran no convolution in its blocked (NCHWc) layout on this CPU")
    assert len(calls) == 1 and all(c in (16, 32) for c in calls[0][1].values())
    ref = reference_states(loaded, plan.groups(), data)
    for rep in plan.groups():
        assert got.states[rep].amax == ref[rep].amax
        if method == "entropy":
            assert got.states[rep].width == ref[rep].width
            np.testing.assert_array_equal(got.states[rep].counts, ref[rep].counts)


@needs_kernel
@pytest.mark.parametrize("batch_size", [1, 2])
def test_padded_blocked_outputs_are_collected_again_in_plain_layout(monkeypatch, batch_size, lanes):
    """A blocked output whose channel count is not its tensor's (padding) must not be binned: the
    whole collection restarts in plain layout, progress counted once (at batch 2 the padding shows
    in the run of the first sample alone that starts the ranges)."""
    from qdqgraph.execution import runtime
    calls = _spy_sessions(monkeypatch)
    shapes = []

    def padded(self, arrays):
        shapes.extend(arrays[n].shape for n in self.channels)
        return not self.channels         # as if every blocked output carried padded channels
    monkeypatch.setattr(runtime.BlockedOutputs, "check", padded)
    m = motifs.residual_add()
    loaded, plan = prepared(m)
    data = CalibrationData(motifs.sample_data(m, n=5), model_inputs(loaded.graph))
    done = []
    got = collect(loaded, plan.groups(), data, method="entropy", progress=done.append, batch_size=batch_size)
    if not calls[0][1]:
        pytest.skip("onnxruntime ran no convolution in its blocked (NCHWc) layout on this CPU")
    assert [c[0] for c in calls] == [True, False] and calls[1][1] == {} and shapes
    assert sum(done) == 5 and got.samples == 5
    ref = reference_states(loaded, plan.groups(), data)
    for rep in plan.groups():
        np.testing.assert_array_equal(got.states[rep].counts, ref[rep].counts)
        assert got.states[rep].count == ref[rep].count


def test_blocked_outputs_check_channels():
    from qdqgraph.execution.runtime import BlockedOutputs
    b = BlockedOutputs({"a": "a_blocked"}, {"a_blocked": 16})
    assert b.check({"a_blocked": np.zeros((1, 16, 4, 4), np.float32)})
    assert not b.check({"a_blocked": np.zeros((1, 32, 4, 4), np.float32)})
    assert not b.check({"a_blocked": np.zeros(16, np.float32)})


def test_reorders_read_by_a_node_or_padded_stay():
    """Only a reorder whose output nothing but the graph output reads, of a channel count that no
    block size pads, is dropped."""
    from onnx import helper
    from qdqgraph.execution.runtime import NCHWC_LARGEST_BLOCK, _drop_reorders

    def reorder(src, dst, channels):
        return helper.make_node("ReorderOutput", [src], [dst], domain="com.microsoft.nchwc", channels=channels)
    nodes = [reorder("b1", "t1", 32), reorder("b2", "t2", 32), reorder("b3", "t3", 12),
             helper.make_node("Relu", ["t2"], ["r"])]
    outs = [helper.make_tensor_value_info(n, 1, None) for n in ("t1", "t2", "t3", "r")]
    model = helper.make_model(helper.make_graph(nodes, "g", [], outs))
    got = _drop_reorders(model, {"t1", "t2", "t3"})
    assert NCHWC_LARGEST_BLOCK == 16
    assert got.fetch == {"t1": "b1", "t2": "t2", "t3": "t3"} and got.channels == {"b1": 32}
    assert [n.output[0] for n in model.graph.node] == ["t2", "t3", "r"]
    assert [o.name for o in model.graph.output] == ["b1", "t2", "t3", "r"]


def test_a_failed_optimized_model_leaves_the_plain_layout_session(monkeypatch):
    """Writing onnxruntime's optimized model is a speed-up only: when it fails (here a full disk),
    calibration goes on in plain layout."""
    import errno

    import onnx

    from qdqgraph.execution import runtime

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(onnx, "save", full)
    m = motifs.residual_add()
    loaded, plan = prepared(m)
    names = sorted({t for ms in plan.groups().values() for t in ms} - {"x"})
    sess, blocked = runtime.unordered_session(loaded, names)
    assert blocked.channels == {} and blocked.fetch == {n: n for n in names}
    feed = {"x": motifs.sample_data(m, n=1)["x"][0]}
    plain = ort.InferenceSession(io.with_outputs(io.to_model(loaded), names).SerializeToString())
    for a, b in zip(sess.run(names, feed), plain.run(names, feed)):
        np.testing.assert_array_equal(a, b)


@needs_kernel
def test_blocked_outputs_with_samples_of_different_sizes(monkeypatch):
    """Dynamic height and width: each new input shape rebinds the blocked outputs, checked again,
    and the histograms equal numpy's over the plain-layout tensors."""
    calls = _spy_sessions(monkeypatch)
    g = motifs.G("dyn_blocked")
    x = g.input("x", ["n", 16, "h", "w"])
    a = g.node("Relu", [g.conv(x, 16, 32, "c1")], name="r1")
    b = g.node("Relu", [g.conv(a, 32, 16, "c2")], name="r2")
    g.node("Conv", [b, g.weight("w3", (16, 16, 1, 1))], ["y"], name="c3", kernel_shape=[1, 1])
    g.output("y")
    loaded, plan = prepared(g.model())
    rng = np.random.default_rng(3)
    chunks = [{"x": rng.standard_normal((2, 1, 16, h, w)).astype(np.float32)} for h, w in ((8, 8), (5, 11), (8, 8))]
    data = CalibrationData(chunks, model_inputs(loaded.graph))
    got = collect(loaded, plan.groups(), data, method="entropy")
    if not calls[0][1]:
        pytest.skip("onnxruntime ran no convolution in its blocked (NCHWc) layout on this CPU")
    assert len(calls) == 1 and got.samples == 6
    ref = reference_states(loaded, plan.groups(), data)
    for rep in plan.groups():
        np.testing.assert_array_equal(got.states[rep].counts, ref[rep].counts)
        assert got.states[rep].amax == ref[rep].amax and got.states[rep].count == ref[rep].count


@needs_kernel
@pytest.mark.parametrize("method", ["entropy", "max"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_lanes_give_the_one_lane_states_bit_for_bit(monkeypatch, method, batch_size):
    """Batches run in 2 or 3 lanes at once, each binning into its own states, merge into exactly
    the states of one batch at a time (ranges grow during the run, so the lanes' widths differ
    before the merge); each lane binds its own outputs."""
    m = motifs.residual_add()
    loaded, plan = prepared(m)
    data = CalibrationData(_growing(m, 30), model_inputs(loaded.graph))
    one = collect(loaded, plan.groups(), data, method=method, batch_size=batch_size, lanes=1)
    bound = []
    real = collect_module._BoundOutputs.__init__

    def spy(self, *args):
        bound.append(self)
        real(self, *args)
    monkeypatch.setattr(collect_module._BoundOutputs, "__init__", spy)
    for lanes in (2, 3):
        bound.clear()
        done = []
        got = collect(loaded, plan.groups(), data, method=method, batch_size=batch_size, lanes=lanes,
                      progress=done.append)
        assert len(bound) == lanes and got.samples == 30 and sum(done) == 30
        for rep in plan.groups():
            a, b = one.states[rep], got.states[rep]
            assert (a.amax, a.count) == (b.amax, b.count), rep
            if method == "entropy":
                assert a.width == b.width, rep
                np.testing.assert_array_equal(a.counts, b.counts, err_msg=rep)


@needs_kernel
def test_lanes_share_the_cores_and_stop_at_the_earliest_failure(monkeypatch):
    """Each lane's onnxruntime run gets its share of the cores; a NaN stops every lane within a
    batch or so, and the error names the earliest bad sample whichever lane met it."""
    calls = _spy_sessions(monkeypatch)
    monkeypatch.setattr(collect_module, "cores", lambda: 4)
    m = motifs.residual_add()
    loaded, plan = prepared(m)
    arrays = motifs.sample_data(m, n=60)
    x = next(k for k, v in arrays.items() if v.dtype == np.float32)
    arrays[x][[7, 8, 40]] *= np.float32(1e37)    # finite inputs whose convolutions overflow
    data = CalibrationData(arrays, model_inputs(loaded.graph))
    for lanes, threads in ((1, 0), (2, 2), (4, 1), (None, 2)):      # default: 2 lanes from 2 cores
        calls.clear()
        done = []
        with pytest.raises(QdqError, match="NaN or Inf on calibration sample 7"):
            collect(loaded, plan.groups(), data, method="entropy", lanes=lanes, progress=done.append)
        # the lanes past the failure finish the batch they hold, and on a loaded machine a few more
        # before the failing lane's thread is scheduled again (19 samples done with 4 lanes on 2
        # busy cores); without the stop each lane runs on until it meets a bad sample of its own
        # (8 and 40 are bad too), so the lanes after the one that meets 40 run to the end
        assert [c[2] for c in calls] == [threads] and sum(done) <= 7 + 4 * (lanes or 2)


def test_lanes_must_be_positive():
    m = motifs.residual_add()
    loaded, plan = prepared(m)
    data = CalibrationData(motifs.sample_data(m, n=2), model_inputs(loaded.graph))
    with pytest.raises(QdqError, match="lanes must be at least 1"):
        collect(loaded, plan.groups(), data, method="entropy", lanes=0)


def test_a_large_graph_hands_its_outputs_out_in_plain_layout_from_one_session(monkeypatch):
    """From LARGE_GRAPH_NODES nodes on, the second session the blocked layout needs costs more than
    it saves: one session, every output in plain layout (the values of a plain session)."""
    from qdqgraph.execution import runtime
    m = motifs.residual_add()
    loaded, plan = prepared(m)
    names = sorted({t for ms in plan.groups().values() for t in ms} - {"x"})
    made = []
    real = runtime.ort.InferenceSession
    monkeypatch.setattr(runtime.ort, "InferenceSession", lambda *a, **k: made.append(1) or real(*a, **k))
    _, blocked = runtime.unordered_session(loaded, names)
    assert blocked.channels and len(made) == 2              # small: blocked, two sessions
    made.clear()
    monkeypatch.setattr(runtime, "LARGE_GRAPH_NODES", len(loaded.graph.nodes))
    sess, blocked = runtime.unordered_session(loaded, names)
    assert blocked.channels == {} and blocked.fetch == {n: n for n in names} and len(made) == 1
    # without onnxruntime's layout level, whose reorders of every output grow with the square of the graph
    assert sess.get_session_options().graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    feed = {"x": motifs.sample_data(m, n=1)["x"][0]}
    opts = ort.SessionOptions()            # a plain session at the same level
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    plain = ort.InferenceSession(io.with_outputs(io.to_model(loaded), names).SerializeToString(), opts)
    for a, b in zip(sess.run(names, feed), plain.run(names, feed)):
        np.testing.assert_array_equal(a, b)


def test_head_is_the_first_samples_and_leaves_the_data_as_it_was():
    m = motifs.residual_add()
    loaded, _ = prepared(m)
    data = CalibrationData(motifs.sample_data(m, n=6), model_inputs(loaded.graph))
    head = data.head(4)
    assert head.count == 4 and data.count == 6
    for i in range(4):
        for k, v in head.sample(i).items():
            assert np.array_equal(v, data.sample(i)[k])
    assert data.head(10).count == 6


@pytest.mark.parametrize("histogram", [False, True])
def test_calibration_graph_maps_the_graph_once_not_per_observed_tensor(monkeypatch, histogram):
    """The in-graph path (no compiled kernel) adds 2-4 nodes per observed tensor: adding them must
    not map every tensor of the graph each time (a 10,000-node model's calibration graph took more
    than 15 minutes that way)."""
    from qdqgraph.calib.collect import calibration_graph
    g = motifs.G("chain")
    t = g.input("x", [1, 4, 64, 64])
    for k in range(40):
        t = g.node("Relu", [t], [f"t{k}"], name=f"r{k}")
    g.output(t)
    loaded, _ = prepared(g.model())
    names = [f"t{k}" for k in range(40)]
    calls = []
    real = type(loaded.graph).tensors
    monkeypatch.setattr(type(loaded.graph), "tensors", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    built, probes = calibration_graph(loaded.graph, names, histogram, stride=2)
    assert len(calls) <= 4             # the copy and the lookup, not 2-4 per tensor
    assert [p.tensor for p in probes] == names
    out = {o.name for o in built.outputs}
    assert all(p.amax_out in out and (p.index_out in out) == histogram for p in probes)
