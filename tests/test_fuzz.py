"""Fuzzing: random DAGs over the op vocabulary (tests/fuzzgraphs.py). insert and report never raise
anything but qdqgraph's own clear errors, and every output passes the checker, runs in
onnxruntime and keeps the Q/DQ invariants. A bounded, deterministic number of examples here;
benchmarks/fuzz.py runs the same for as long as asked."""
import hashlib

import numpy as np
import onnx
from hypothesis import HealthCheck, given, settings

import fuzzgraphs
import qdqgraph
from qdqgraph.graph import io
from qdqgraph import trtsim
from qdqgraph.cli import main
from qdqgraph.errors import QdqError
from qdqgraph.passes.strip import strip_qdq
from qdqgraph.prepare import clean
from qdqgraph.testing.render import render

def fuzz(examples: int):
    """Deterministic, bounded hypothesis settings for CI (benchmarks/fuzz.py runs longer)."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _feed(data):
    return {k: v[0] for k, v in data.items()}


@fuzz(100)
@given(fuzzgraphs.models())
def test_insert_and_report_on_random_graphs(case):
    model, steps, seed = case
    data = fuzzgraphs.sample_data(model)
    try:
        result = qdqgraph.quantize(model, data)
    except QdqError:
        return                                   # a clear refusal is allowed; a crash is not
    out = result.model
    onnx.checker.check_model(out, full_check=True)
    assert fuzzgraphs.invariant_problems(out) == [], (steps, seed)
    outputs = fuzzgraphs.run_ort(out, _feed(data))
    assert len(outputs) == len(model.graph.output)
    rep = trtsim.simulate(io.load(out).graph)
    assert rep.summary["layers"] >= 1
    trtsim.lint(io.load(out).graph)


@fuzz(25)
@given(fuzzgraphs.models())
def test_cli_insert_report_exit_codes_and_nothing_lost(tmp_path_factory, case):
    model, steps, seed = case
    d = tmp_path_factory.mktemp("cli")
    src, npz, out = d / "m.onnx", d / "d.npz", d / "m.qdq.onnx"
    onnx.save(model, src)
    np.savez(npz, **fuzzgraphs.sample_data(model))
    before = hashlib.sha256(src.read_bytes()).hexdigest()
    code = main(["insert", str(src), "--calib", str(npz), "-o", str(out), "--verify", "0", "--quiet"])
    assert code in (0, 2), (steps, seed, code)
    assert hashlib.sha256(src.read_bytes()).hexdigest() == before          # input untouched
    assert out.exists() == (code == 0)                                      # nothing half-written
    assert not [p.name for p in d.iterdir() if p.name.startswith(".")]     # no temp files left
    if code == 0:
        assert main(["report", str(out), "--quiet"]) == 0


@fuzz(40)
@given(fuzzgraphs.models())
def test_strip_of_insert_equals_clean_on_random_graphs(case):
    model, steps, seed = case
    data = fuzzgraphs.sample_data(model)
    expected = io.load(model)
    clean(expected)
    try:
        quantized = io.load(qdqgraph.quantize(model, data, weights="qdq", high_precision="fp32",
                                                  output_aware=False).model)
    except QdqError:
        return
    strip_qdq(quantized.graph)
    assert sorted(render(quantized.graph).splitlines()) == sorted(render(expected.graph).splitlines()), steps
    feed = _feed(data)
    for a, b in zip(fuzzgraphs.run_ort(io.to_model(quantized), feed), fuzzgraphs.run_ort(io.to_model(expected), feed)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@fuzz(20)
@given(fuzzgraphs.models())
def test_insert_is_deterministic_on_random_graphs(case):
    model, _, _ = case
    data = fuzzgraphs.sample_data(model)
    try:
        a = qdqgraph.quantize(model, data).model.SerializeToString()
    except QdqError:
        return
    assert qdqgraph.quantize(model, data).model.SerializeToString() == a


def test_invariant_checker_catches_what_it_claims():
    """The fuzz tests' own invariant checker must fail on a broken model (else it proves nothing)."""
    m = fuzzgraphs.random_model(["conv", "relu"], 1)
    out = qdqgraph.quantize(m, fuzzgraphs.sample_data(m)).model
    assert fuzzgraphs.invariant_problems(out) == []
    for init in out.graph.initializer:
        if init.name.endswith("zero_point"):
            init.CopyFrom(onnx.numpy_helper.from_array(np.ones_like(onnx.numpy_helper.to_array(init)), init.name))
            break
    assert any("zero point" in p for p in fuzzgraphs.invariant_problems(out))
