"""A large graph's calibration session, opened in a thread while P14 refines the plan
(calib.opening): taken only where it is the session calibration would open, and then the written
model is the one calibration writes when it opens its own."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import motifs
import qdqgraph
from qdqgraph.calib import calibration, collect, opening
from qdqgraph.calib.histogram import COMPILED
from qdqgraph.execution import runtime
from qdqgraph.graph import io
from qdqgraph.samples.data import CalibrationData

needs_kernel = pytest.mark.skipif(not COMPILED, reason="the session is opened ahead only on the compiled kernel's path")


@pytest.fixture
def large(monkeypatch):
    """Every graph counts as large (the session opened the large graphs' way, as unordered_session
    opens it for them), on two cores."""
    monkeypatch.setattr(runtime, "LARGE_GRAPH_NODES", 0)
    monkeypatch.setattr(collect, "cores", lambda: 2)


def _spy(monkeypatch) -> dict:
    """What the opening did: the threads that opened sessions, and what calibration took."""
    seen: dict = {"openers": [], "taken": []}
    real_large, real_take = runtime.large_unordered, opening.Opened.take

    def large_unordered(*a, **k):
        opener, blocked = real_large(*a, **k)

        def spied():
            seen["openers"].append(threading.current_thread() is threading.main_thread())
            return opener()
        return spied, blocked

    def take(self, wanted):
        got = real_take(self, wanted)
        seen["taken"].append(got is not None)
        return got
    monkeypatch.setattr(runtime, "large_unordered", large_unordered)
    monkeypatch.setattr(opening.Opened, "take", take)
    return seen


@needs_kernel
@pytest.mark.parametrize("method", ["percentile", "max"])
def test_the_session_opened_ahead_writes_the_same_model(method, large, monkeypatch):
    m = motifs.residual_add()
    data = motifs.sample_data(m)
    seen = _spy(monkeypatch)
    ahead = qdqgraph.quantize(m, data, method=method)
    assert seen["openers"] == [False] and seen["taken"] == [True]       # opened in a thread, and taken
    monkeypatch.setattr(calibration, "open_ahead", lambda *a, **k: None)
    seen["openers"].clear()
    own = qdqgraph.quantize(m, data, method=method)
    assert seen["openers"] == [True]    # calibration opened its own, in the main thread, the same large way
    assert ahead.model.SerializeToString() == own.model.SerializeToString()


@needs_kernel
def test_another_tensor_set_drops_it_and_calibration_opens_its_own(large, monkeypatch):
    from qdqgraph.placement import plan_placement
    from qdqgraph.prepare import clean, model_inputs
    m = motifs.residual_add()
    loaded = io.load(m)
    clean(loaded)
    groups = plan_placement(loaded.graph).groups()
    assert len(groups) >= 2
    data = CalibrationData(motifs.sample_data(m), model_inputs(loaded.graph))
    one = dict(list(groups.items())[:1])
    seen = _spy(monkeypatch)
    got = collect.collect(loaded, one, data, method="entropy", opened=collect.open_ahead(loaded, groups, "entropy"))
    assert seen["taken"] == [False]     # opened for all groups, asked for one: dropped
    alone = collect.collect(loaded, one, data, method="entropy")
    again = collect.collect(loaded, groups, data, method="entropy", opened=collect.open_ahead(loaded, groups, "entropy"))
    assert seen["taken"] == [False, True]
    plain = collect.collect(loaded, groups, data, method="entropy")
    for a, b in ((got, alone), (again, plain)):
        assert a.states.keys() == b.states.keys()
        for rep in a.states:
            assert a.states[rep].amax == b.states[rep].amax
            assert np.array_equal(a.states[rep].counts, b.states[rep].counts)


def test_a_failed_opening_is_dropped_and_the_key_names_the_graph():
    m = motifs.residual_add()
    loaded = io.load(m)

    def fails():
        raise RuntimeError("onnxruntime cannot open it")
    key = opening.key(loaded, ["x"], 1, False, ["CPUExecutionProvider"], 1)
    o = opening.Opened(key, loaded, {}, [], fails, None)
    assert o.take(key) is None          # calibration opens its own, which raises what is wrong
    ok = opening.Opened(key, loaded, {}, [], lambda: "session", None)
    assert ok.take(opening.key(loaded, ["x"], 1, False, ["CPUExecutionProvider"], 2)) is None
    assert opening.key(io.load(m), ["x"], 1, False, ["CPUExecutionProvider"], 1) != key      # another graph
    ok = opening.Opened(key, loaded, {}, [], lambda: "session", None)
    assert ok.take(key)[3] == "session"


@needs_kernel
def test_no_session_ahead_where_a_recipe_runs_before_calibration_or_the_graph_is_small(monkeypatch):
    monkeypatch.setattr(collect, "cores", lambda: 2)
    opened = []
    real = calibration.open_ahead
    monkeypatch.setattr(calibration, "open_ahead", lambda *a, **k: opened.append(1) or real(*a, **k))
    m = motifs.residual_add()
    qdqgraph.quantize(m, motifs.sample_data(m))
    assert opened == []                 # a small graph: its session costs less than the thread
    monkeypatch.setattr(runtime, "LARGE_GRAPH_NODES", 0)
    m = motifs.attention_block()
    r = qdqgraph.quantize(m, motifs.sample_data(m))
    assert "output-aware scales" in r.report.profile.to_dict() and opened == []
    m = motifs.residual_add()
    qdqgraph.quantize(m, motifs.sample_data(m), smooth_quant=0.5)
    assert opened == []                 # SmoothQuant rescales the graph before calibration
    qdqgraph.quantize(m, motifs.sample_data(m))
    assert opened == [1]
