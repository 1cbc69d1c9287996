"""Issue 32: the data-driven recipes run on a bounded, stated sample. Output-aware scales keep at
most MAX_ROWS rows of each linear-layer input, strided over the rows of no more samples than
ROW_BUDGET rows take (samples.rows.RowSample), and say so in the report; the fragile-heads check
measures nothing on a model none of whose outputs has a head of its own."""
import numpy as np
import pytest

import motifs
import qdqgraph
from motifs import G
from qdqgraph import QuantizeConfig
from qdqgraph.prepare import prepare, read_data
from qdqgraph.recipes import output_aware
from qdqgraph.recipes.fidelity import may_have_heads, node_flops
from qdqgraph.samples.rows import RowSample


def stream(sample: RowSample, samples: list[dict], available: int | None = None) -> int:
    """Feed `samples` until the sample wants no more; returns how many were fed."""
    fed = 0
    for values in samples:
        fed += 1
        if not sample.add(values, len(samples) if available is None else available):
            break
    return fed


def test_the_rows_kept_are_the_stride_over_all_rows_without_holding_them():
    """Uniform samples: the rows kept are r[::planned // keep][:keep] of the rows of every sample
    run, concatenated (what holding them all gave), and the channel maxima are over all rows."""
    rng = np.random.default_rng(0)
    samples = [{"a": rng.standard_normal((1, 37, 8)).astype(np.float32),
                "b": rng.standard_normal((3, 5, 4)).astype(np.float32)} for _ in range(11)]
    s = RowSample(keep=50, budget=10_000, max_samples=32)
    assert stream(s, samples) == 11
    for name in ("a", "b"):
        every = np.concatenate([v[name].reshape(-1, v[name].shape[-1]) for v in samples])
        step = max(1, every.shape[0] // 50)
        np.testing.assert_array_equal(s.rows()[name], every[::step][:50])
        np.testing.assert_array_equal(s.channel_max()[name], np.abs(every).max(axis=0))
    assert s.stated() == {"samples": 11, "max_samples": 32, "row_budget": 10_000, "max_rows": 50,
                          "rows_seen": 11 * 37, "rows_kept": 50}


@pytest.mark.parametrize("rows_per_sample,budget,max_samples,available,runs", [
    (1500, 8192, 32, 16, 6),      # 1,500 tokens a sample: six samples reach a budget of 8192 rows
    (64, 8192, 32, 24, 24),       # MiniLM: 64 tokens, every sample and still under the budget
    (64, 100, 32, 24, 2),
    (10, 8192, 5, 24, 5),         # at most max_samples
    (10, 8192, 32, 3, 3),         # at most the samples there are
])
def test_the_samples_run_stop_at_the_row_budget(rows_per_sample, budget, max_samples, available, runs):
    x = np.ones((1, rows_per_sample, 4), np.float32)
    s = RowSample(keep=512, budget=budget, max_samples=max_samples)
    assert stream(s, [{"x": x}] * available) == runs
    got = s.rows()["x"]
    assert got.shape[0] <= 512 and got.shape[0] == min(512, runs * rows_per_sample)
    assert s.stated()["samples"] == runs and s.stated()["rows_seen"] == runs * rows_per_sample


def test_samples_of_other_lengths_still_keep_at_most_the_cap():
    rng = np.random.default_rng(1)
    samples = [{"x": rng.standard_normal((1, n, 6)).astype(np.float32)} for n in (40, 90, 7, 300, 64)]
    s = RowSample(keep=64, budget=10_000, max_samples=32)
    stream(s, samples)
    got = s.rows()["x"]
    assert 0 < got.shape[0] <= 64
    every = np.concatenate([v["x"].reshape(-1, 6) for v in samples])
    assert {r.tobytes() for r in got} <= {r.tobytes() for r in every}      # rows of the data, none made up


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        RowSample(keep=0, budget=10, max_samples=1)


def test_output_aware_states_its_sample_and_honours_the_row_cap(monkeypatch):
    """A 16-token model on 12 samples, with a cap of 20 rows and a budget of 40 rows: three samples
    are run (48 rows), 20 rows of each input kept, and the report and the summary say so."""
    monkeypatch.setattr(output_aware, "MAX_ROWS", 20)
    monkeypatch.setattr(output_aware, "ROW_BUDGET", 40)
    seen = []
    real = output_aware._choose

    def spy(view, linear, xs, cmax, pooled=None):
        seen.extend(x.shape[0] for x in xs.values())
        return real(view, linear, xs, cmax, pooled)
    monkeypatch.setattr(output_aware, "_choose", spy)
    m = motifs.attention_block()
    data = {k: np.repeat(v[:1], 12, axis=0) for k, v in motifs.sample_data(m).items()}
    r = qdqgraph.quantize(m, data, output_aware=True, int8_attention="on", fragile_heads=False)
    rows = r.report.output_aware["rows"]
    tokens = int(np.prod(next(iter(data.values())).shape[1:-1]))
    assert rows["samples"] == -(-40 // tokens) and rows["max_rows"] == 20 and rows["row_budget"] == 40
    assert seen and max(seen) <= 20 and rows["rows_kept"] == max(seen)
    assert rows["rows_seen"] == rows["samples"] * tokens
    assert f"strided over {rows['rows_seen']} rows of {rows['samples']} sample(s)" in r.report.summary()


def test_output_aware_on_the_defaults_keeps_the_rows_it_chose_before():
    """Under the budget (every sample run), the rows and channel maxima are those of holding every
    sample's rows and striding over them: the choice is unchanged."""
    m = motifs.attention_block()
    loaded, plan = prepare(m)
    data = read_data(loaded, motifs.sample_data(m), QuantizeConfig())
    tensors = ["ctx_merge_out"]
    xs, cmax, first, stated = output_aware.rows(loaded, tensors, data)
    every = []
    from qdqgraph.execution.runtime import float_activations
    for values in float_activations(loaded, tensors, data, output_aware.SAMPLES, "test"):
        every.append(np.asarray(values["ctx_merge_out"], np.float32).reshape(-1, xs["ctx_merge_out"].shape[1]))
    every = np.concatenate(every)
    step = max(1, every.shape[0] // output_aware.MAX_ROWS)
    np.testing.assert_array_equal(xs["ctx_merge_out"], every[::step][:output_aware.MAX_ROWS])
    np.testing.assert_array_equal(cmax["ctx_merge_out"], np.abs(every).max(axis=0))
    assert stated["samples"] == data.count and set(first) == set(tensors)


# ------------------------------------------------------------------ fragile heads: nothing to measure

def one_trunk():
    """Two outputs out of one trunk: the token states and their mean (as MiniLM's last_hidden_state
    and sentence_embedding); every quantized node reaches both."""
    g = G("one_trunk")
    x = g.input("x", ["n", 16, 8, 8])
    t = g.node("Relu", [g.conv(x, 16, 16, "c0")], name="r0")
    t = g.conv(t, 16, 16, "c1")
    g.node("Identity", [t], ["states"], name="states_id")
    g.node("GlobalAveragePool", [t], ["pooled"], name="pool")
    g.output("states")
    g.output("pooled")
    return g.model()


def test_no_head_means_no_fidelity_measurement():
    m = one_trunk()
    loaded, plan = prepare(m)
    assert not may_have_heads(loaded.graph, plan, node_flops(loaded.graph))
    data = {"x": np.random.default_rng(0).standard_normal((8, 1, 16, 8, 8)).astype(np.float32)}
    r = qdqgraph.quantize(m, data, bias_correction=False, sqnr_floor=None)
    assert r.plan.activation_sites() and len(r.model.graph.output) == 2
    assert r.report.fidelity is None and "fidelity" not in r.report.profile.rows


def test_a_model_with_a_head_of_its_own_is_still_measured():
    from test_fidelity_defaults import data_for, two_heads
    m = two_heads()
    loaded, plan = prepare(m)
    order = [n.name for n in loaded.graph.nodes]
    assert may_have_heads(loaded.graph, plan, node_flops(loaded.graph))
    assert [n.name for n in loaded.graph.nodes] == order          # the graph is not reordered
    r = qdqgraph.quantize(m, data_for(), bias_correction=False, sqnr_floor=None)
    assert r.report.fidelity and "first" in r.report.fidelity
