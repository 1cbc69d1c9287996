"""RangeState (running |x| histogram) and the calibration methods, against plain references.

The references below are written straight from TRT_RULES K3/K4 as loops, independent of the
vectorised code in qdqgraph/calib/methods.py.
"""
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy.stats import entropy as scipy_entropy

from qdqgraph.calib.histogram import MIN_RANGE, RangeState
from qdqgraph.calib.methods import (METHODS, ZERO_RANGE_AMAX, ZERO_RANGE_EPS, compute_amax,
                                    entropy_divergences, safe_scale)


# ------------------------------------------------------------------------------ synthetic data
def _data(kind: str, n: int = 200_000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.uniform(0.0, 1.0, n).astype(np.float32)
    if kind == "gaussian":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "laplace":     # Laplacian body plus a few far outliers
        return np.concatenate([rng.laplace(0.0, 1.0, n), [40.0, -55.0, 60.0]]).astype(np.float32)
    if kind == "lattice":     # values on a coarse grid: many empty bins, exercises Q == 0
        return (rng.integers(-150, 150, n) * 0.37).astype(np.float32)
    raise AssertionError(kind)


def _state(x, num_bins=2048, batches=1) -> RangeState:
    s = RangeState(num_bins)
    for part in np.array_split(x, batches):
        s.update(part)
    return s


# -------------------------------------------------------------------------- plain references
def ref_entropy(counts: np.ndarray, edges: np.ndarray):
    """K3 literally: one loop per candidate, np.digitize groups, scipy's KL, last argmin."""
    bins = counts.astype(np.float64).copy()
    bins[0] = bins[1]
    divergences, candidates = [], []
    for i in range(128, len(bins) + 1):
        p = bins[:i].copy()
        p[i - 1] += bins[i:].sum()
        group = np.digitize(np.arange(i), np.linspace(0, i, 129)) - 1
        nonzero = bins[:i] != 0
        total = np.bincount(group, weights=bins[:i], minlength=128)
        members = np.bincount(group, weights=nonzero, minlength=128)
        q = np.where(nonzero, total[group] / np.maximum(members[group], 1), 0.0)
        divergences.append(scipy_entropy(p, q))
        candidates.append(i)
    divergences = np.array(divergences)
    last = len(divergences) - 1 - int(np.argmin(divergences[::-1]))
    return edges[candidates[last]], np.array(candidates), divergences


def ref_mse_scores(counts: np.ndarray, edges: np.ndarray):
    """K4 mse: every bin centre from 128 on as amax, fake-quantise all centres, weighted error."""
    centres = (edges[1:] + edges[:-1]) / 2
    cands, scores = [], []
    for i in range(128, len(centres)):
        amax = centres[i]
        q = np.minimum(np.round(centres * 127 / amax), 127) * amax / 127   # half-to-even
        cands.append(amax)
        scores.append(np.mean(counts * (q - centres) ** 2))
    return np.array(cands), np.array(scores)


def _trimmed(state: RangeState):
    """The histogram as PyTorch's toolkit would hold it: up to the bin holding max |x|."""
    counts, edges = state.histogram()
    n = state.used_bins()
    return counts[:n], edges[:n + 1]


# ---------------------------------------------------------------------------------- entropy
@pytest.mark.parametrize("kind,num_bins", [("uniform", 2048), ("gaussian", 2048), ("laplace", 2048),
                                           ("lattice", 1024)])
def test_entropy_matches_k3_reference_loop(kind, num_bins):
    s = _state(_data(kind), num_bins)
    counts, edges = _trimmed(s)
    want, ref_cands, ref_kl = ref_entropy(counts, edges)
    got = compute_amax(s, "entropy")
    assert abs(got - min(want, s.amax)) <= s.width      # <= 1 bin (K3 tolerance)
    cands, kl = entropy_divergences(counts)
    np.testing.assert_array_equal(cands, ref_cands)
    np.testing.assert_array_equal(np.isinf(kl), np.isinf(ref_kl))
    fin = np.isfinite(ref_kl)
    np.testing.assert_allclose(kl[fin], ref_kl[fin], rtol=1e-9, atol=1e-12)
    if kind == "lattice":
        assert np.isinf(ref_kl).any()                    # the +inf case was exercised


def test_entropy_uniform_threshold_near_one():
    s = _state(_data("uniform"), batches=4)
    assert 0.98 <= compute_amax(s, "entropy") <= s.amax <= 1.0


def test_entropy_and_percentile_laplace_well_below_max():
    x = _data("laplace")
    s = _state(x, batches=3)
    assert s.amax == pytest.approx(60.0)
    for method in ("entropy", "percentile"):
        assert compute_amax(s, method) < 0.3 * s.amax, method
    assert compute_amax(s, "mse") < s.amax


def test_entropy_relu_spike_is_flattened():
    """bins[0] = bins[1]: a ReLU output (half zeros) must not drag the threshold to 0."""
    x = np.maximum(_data("gaussian"), 0)
    s = _state(x)
    amax = compute_amax(s, "entropy")
    assert 2.5 < amax <= s.amax


# ------------------------------------------------------------------------------- percentile
@pytest.mark.parametrize("kind", ["uniform", "gaussian", "laplace"])
@pytest.mark.parametrize("p", [50.0, 99.0, 99.99, 100.0])
def test_percentile_within_one_bin_of_numpy(kind, p):
    x = _data(kind)
    s = _state(x, batches=5)
    got = compute_amax(s, "percentile", percentile=p)
    want = float(np.percentile(np.abs(x.astype(np.float64)), p))
    assert abs(got - want) <= s.width * 1.0001
    assert 0 < got <= s.amax


def test_percentile_on_mostly_zero_tensor_is_positive():
    x = np.zeros(100_000, dtype=np.float32)
    x[:5] = [0.5, 1.0, 2.0, 3.0, 4.0]
    s = _state(x)
    got = compute_amax(s, "percentile", percentile=99.0)   # the 99th percentile is 0
    assert got == pytest.approx(s.width)                   # first bin's right edge, never 0
    assert 0 < got < 0.01


@pytest.mark.parametrize("p", [0.0, -1.0, 100.5, float("nan")])
def test_percentile_out_of_range_raises(p):
    s = _state(_data("uniform", 1000))
    with pytest.raises(ValueError, match="percentile"):
        compute_amax(s, "percentile", percentile=p)


# ---------------------------------------------------------------------------------------- mse
@pytest.mark.parametrize("kind", ["uniform", "gaussian", "laplace"])
def test_mse_matches_brute_force(kind):
    s = _state(_data(kind, 50_000), num_bins=512)
    counts, edges = _trimmed(s)
    cands, scores = ref_mse_scores(counts, edges)
    best = cands[int(np.argmin(scores))]
    got = compute_amax(s, "mse")
    assert got == pytest.approx(min(best, s.amax), rel=1e-12)


def test_mse_gaussian_clips_the_tail_and_beats_max_on_raw_data():
    x = _data("gaussian", 100_000).astype(np.float64)
    s = _state(x)
    amax = compute_amax(s, "mse")
    assert 2.5 < amax < 0.9 * s.amax

    def raw_mse(a):
        q = np.clip(np.rint(x * 127 / a), -127, 127) * a / 127
        return np.mean((q - x) ** 2)
    assert raw_mse(amax) < raw_mse(s.amax)


# ---------------------------------------------------------------------------- all methods/K6
@pytest.mark.parametrize("kind", ["uniform", "gaussian", "laplace", "lattice"])
def test_every_method_within_zero_and_max(kind):
    x = _data(kind, 30_000)
    s = _state(x, batches=3)
    assert s.amax == float(np.max(np.abs(x)))
    for method in METHODS:
        a = compute_amax(s, method)
        assert isinstance(a, float)
        assert 0 < a <= s.amax, method
    assert compute_amax(s, "max") == s.amax


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hnp.arrays(np.float32, st.integers(1, 400),
                  elements=st.floats(-1e6, 1e6, allow_nan=False, width=32)),
       st.integers(1, 3))
def test_property_amax_never_exceeds_max(x, batches):
    s = _state(x, batches=min(batches, x.size))
    top = float(np.max(np.abs(x)))
    assert s.amax == top
    assert s.count == x.size == int(s.counts.sum())
    for method in METHODS:
        a = compute_amax(s, method)
        if top > 0:
            assert 0 < a <= top, method
        else:
            assert a == 0.0, method


def test_empty_or_zero_state_gives_zero_amax():
    assert all(compute_amax(RangeState(), m) == 0.0 for m in METHODS)
    s = RangeState()
    s.update(np.zeros((2, 3), np.float32))
    assert s.count == 6 and s.width > 0 and s.hist_max == pytest.approx(MIN_RANGE)
    assert all(compute_amax(s, m) == 0.0 for m in METHODS)


def test_unknown_method_and_wrong_state_type():
    s = _state(_data("uniform", 1000))
    with pytest.raises(ValueError, match="unknown calibration method"):
        compute_amax(s, "kl")

    class OnlyMax:
        amax = 3.5
    assert compute_amax(OnlyMax(), "max") == 3.5
    with pytest.raises(TypeError, match="RangeState"):
        compute_amax(OnlyMax(), "entropy")


# -------------------------------------------------------------------------------- safe_scale
@pytest.mark.parametrize("amax", [0.0, -0.0, -3.0, float("nan"), float("inf"), float("-inf"), 1e-30,
                                  ZERO_RANGE_EPS, 1e-7, 1.0, 6.5e4, 3.4e38, 1e300])
def test_safe_scale_always_finite_positive_float32(amax):
    s = safe_scale(amax)
    assert isinstance(s, np.float32)
    assert np.isfinite(s) and s > 0


def test_safe_scale_values():
    assert safe_scale(1.0) == np.float32(1 / 127)
    assert safe_scale(254.0) == np.float32(2.0)
    zero = np.float32(ZERO_RANGE_AMAX / 127)
    for a in (0.0, ZERO_RANGE_EPS, float("nan"), -1.0, float("inf")):
        assert safe_scale(a) == zero
    assert safe_scale(ZERO_RANGE_EPS * 2) == np.float32(ZERO_RANGE_EPS * 2 / 127)
    assert safe_scale(1e300) == np.finfo(np.float32).max


@settings(max_examples=200, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_property_safe_scale(amax):
    s = safe_scale(amax)
    assert np.isfinite(s) and s > 0
    if math.isfinite(amax) and ZERO_RANGE_EPS < amax < 1e38:
        assert s == np.float32(amax / 127)


# ------------------------------------------------------------------------- histogram basics
def _within_one_bin(counts, ref_counts):
    """Every value of `counts` is at most one bin away from where `ref_counts` has it."""
    c = np.cumsum(counts)
    r = np.concatenate(([0], np.cumsum(ref_counts), [np.sum(ref_counts)]))
    # r[k] = ref mass below bin k; c[k] = mass in bins 0..k; allowed: r[k] <= c[k] <= r[k+2]
    return bool(np.all(r[:-2] <= c) and np.all(c <= r[2:]) and c[-1] == r[-1])


def test_histogram_matches_numpy_histogram():
    x = _data("gaussian", 100_000)
    s = _state(x)
    counts, edges = s.histogram()
    assert counts.shape == (2048,) and edges.shape == (2049,)
    assert edges[0] == 0 and edges[-1] == pytest.approx(float(np.max(np.abs(x))), rel=1e-6)
    ref, _ = np.histogram(np.abs(x.astype(np.float64)), bins=edges)
    assert ref.sum() == x.size                              # max|x| lies inside the range
    assert np.abs(counts - ref).sum() <= 20                 # float32 rounding at a few edges
    assert _within_one_bin(counts, ref)
    assert counts[-1] >= 1                                  # max|x| is in the last bin


def test_first_batch_range_is_max_and_zero_range_gets_min_width():
    s = RangeState(1000)
    s.update(np.array([0.25, -2.0, 1.0], dtype=np.float32))
    assert s.hist_max == pytest.approx(2.0, rel=1e-6) and s.hist_max >= 2.0
    assert s.counts[999] == 1 and s.counts[0] == 0
    z = RangeState()
    z.update(np.zeros(10, np.float32))
    assert z.width == pytest.approx(MIN_RANGE / 2048) and z.counts[0] == 10


def test_range_grows_across_batches_by_doubling():
    rng = np.random.default_rng(3)
    b1 = rng.uniform(-1, 1, 10_000).astype(np.float32)
    b1[0] = 1.0
    b2 = rng.uniform(-3.5, 3.5, 10_000).astype(np.float32)
    s = RangeState()
    s.update(b1)
    w0 = s.width
    s.update(b2)
    assert s.width == w0 * 4                     # 1.0 -> 2.0 -> 4.0 covers 3.5
    assert s.hist_max >= s.amax == float(np.max(np.abs(b2)))
    assert s.count == 20_000 == s.counts.sum()
    assert s.counts.shape == (2048,)
    assert 0 < s.used_bins() <= 2048 and s.used_bins() > 1024 * 3.5 / 4 - 2
    assert np.all(s.counts[s.used_bins():] == 0)
    counts, edges = s.histogram()
    ref, _ = np.histogram(np.abs(np.concatenate([b1, b2]).astype(np.float64)), bins=edges)
    assert _within_one_bin(counts, ref)
    assert np.abs(counts - ref).sum() <= 10


def test_histogram_does_not_depend_on_batching():
    x = _data("laplace", 60_000, seed=5)
    first = np.concatenate([[0.5], x[:1000]]).astype(np.float32)  # small first batch: growth follows
    rest = x[1000:]
    a = RangeState()
    a.update(first)
    for part in np.array_split(rest, 7):
        a.update(part)
    b = RangeState()
    b.update(first)
    b.update(rest)
    assert a.width == b.width > 0
    np.testing.assert_array_equal(a.counts, b.counts)
    assert (a.amax, a.count) == (b.amax, b.count)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_start_sets_the_range_a_first_update_would_and_counts_nothing(dtype):
    x = _data("laplace", 5000, seed=3).astype(dtype)
    started = RangeState()
    started.start(x[:700])
    assert started.width > 0 and started.count == 0 and not started.counts.any()
    started.start(x * 100)                          # a started state keeps its range
    plain = RangeState()
    plain.update(x[:700])
    assert started.width == plain.width
    # then binning everything (the first part included) gives the histogram of a plain run
    started.update(x)
    plain.update(x[700:])
    assert (started.width, started.count) == (plain.width, plain.count) and started.amax == plain.amax
    np.testing.assert_array_equal(started.counts, plain.counts)


def test_start_refuses_non_finite_and_ignores_empty():
    s = RangeState()
    s.start(np.zeros(0, np.float32))
    assert s.width == 0.0
    with pytest.raises(ValueError, match="non-finite"):
        s.start(np.array([1.0, np.nan], np.float32))
    assert s.width == 0.0


def test_started_state_without_data_saves_and_merges():
    s = RangeState()
    s.start(np.array([2.0], np.float32))
    r = RangeState.from_dict(json.loads(json.dumps(s.to_dict())))
    assert (r.width, r.count) == (s.width, 0)
    other = _state(_data("uniform", 1000))
    m = r.merge(other)
    assert m.count == other.count and m.amax == other.amax


def test_extreme_growth_from_zero_range_to_float32_max():
    s = RangeState()
    s.update(np.zeros(5, np.float32))
    s.update(np.array([3e38, -1.0, 0.0], np.float32))
    assert s.amax == float(np.float32(3e38)) and s.hist_max >= s.amax
    assert s.count == 8 and s.counts.sum() == 8
    assert s.counts[0] == 7 and s.counts[s.used_bins() - 1] == 1
    big = RangeState()
    big.update(np.array([1e300, 2.0]))                        # float64 data stays float64
    assert big.amax == 1e300 and np.isfinite(big.width) and big.counts.sum() == 2
    assert all(0 < compute_amax(s, m) <= s.amax for m in METHODS)


def test_dtypes_float16_float64_int():
    for x in (np.array([1.0, -2.0], np.float16), np.array([1.0, -2.0]), np.array([1, -2], np.int64)):
        s = RangeState()
        s.update(x)
        assert s.amax == 2.0 and s.count == 2 and s.counts.sum() == 2


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_raises_and_leaves_state_unchanged(bad):
    s = RangeState()
    s.update(np.array([1.0, 2.0], np.float32))
    before = s.to_dict()
    x = np.array([0.5, bad, 1.0], np.float32)
    with pytest.raises(ValueError, match="non-finite"):
        s.update(x)
    assert s.to_dict() == before
    with pytest.raises(ValueError, match="non-finite"):
        RangeState().update(np.array([bad]))


def test_update_keeps_no_reference_and_does_not_modify_input():
    x = np.array([[1.0, -3.0], [0.5, 2.0]], np.float32)
    keep = x.copy()
    s = RangeState()
    s.update(x)
    np.testing.assert_array_equal(x, keep)
    snapshot = s.to_dict()
    x[:] = 1000.0
    assert s.to_dict() == snapshot
    assert set(RangeState.__slots__) == {"num_bins", "width", "amax", "count", "counts"}


def test_memory_is_flat_in_the_number_of_updates():
    rng = np.random.default_rng(7)
    s = RangeState()
    s.update(rng.standard_normal(1000))
    size1, json1 = s.nbytes, len(json.dumps(s.to_dict()))
    for k in range(300):
        s.update(rng.standard_normal(1000) * (1 + k / 10))   # growing range: many doublings
    assert s.nbytes == size1 == 2048 * 8
    assert s.counts.shape == (2048,)
    assert len(json.dumps(s.to_dict())) < json1 + 2048 * 6   # only digits grow, not the bin count
    assert s.count == 301_000


def test_bad_num_bins():
    for bad in (0, 1, 2.5, True, "8"):
        with pytest.raises(ValueError):
            RangeState(bad)
    assert RangeState(7).num_bins == 7   # odd bin counts work too
    s = RangeState(7)
    s.update(np.array([1.0]))
    s.update(np.array([5.0]))
    assert s.counts.sum() == 2 and s.hist_max >= 5.0


# ------------------------------------------------------------------------------------ merge
def test_merge_equals_one_run_when_widths_match():
    rng = np.random.default_rng(11)
    x1 = rng.standard_normal(40_000).astype(np.float32)
    x2 = np.clip(rng.laplace(0, 0.7, 30_000), -5.9, 5.9).astype(np.float32)
    top = np.float32(6.0)
    x1[0] = top
    x2[0] = -top                                  # both runs start with the same range
    a, b = RangeState(), RangeState()
    a.update(x1)
    b.update(x2)
    assert a.width == b.width
    m = a.merge(b)
    one = RangeState()
    one.update(np.concatenate([x1, x2]))
    assert m.width == one.width
    np.testing.assert_array_equal(m.counts, one.counts)
    assert (m.amax, m.count) == (one.amax, one.count)
    np.testing.assert_array_equal(b.merge(a).counts, m.counts)
    for method in METHODS:
        assert compute_amax(m, method) == compute_amax(one, method)


def test_merge_is_exact_when_widths_are_a_power_of_two_apart():
    rng = np.random.default_rng(12)
    x1 = rng.uniform(-1, 1, 20_000).astype(np.float32)
    x1[0] = 1.0
    x2 = rng.uniform(-2, 2, 20_000).astype(np.float32)
    x2[0] = 2.0
    a, b = _state(x1), _state(x2)
    assert b.width == 2 * a.width
    seq = RangeState()                             # one run over x1 then x2 doubles once
    seq.update(x1)
    seq.update(x2)
    m = a.merge(b)
    assert m.width == seq.width
    np.testing.assert_array_equal(m.counts, seq.counts)
    assert (m.amax, m.count) == (seq.amax, seq.count)


def test_merge_with_unrelated_widths_is_within_one_bin():
    rng = np.random.default_rng(13)
    x1 = rng.standard_normal(50_000).astype(np.float32)
    x2 = (rng.standard_normal(50_000) * 1.7).astype(np.float32)
    a, b = _state(x1), _state(x2)
    m = a.merge(b)
    assert m.width == max(a.width, b.width)
    assert m.count == 100_000 == m.counts.sum()
    assert m.amax == max(a.amax, b.amax)
    counts, edges = m.histogram()
    ref, _ = np.histogram(np.abs(np.concatenate([x1, x2]).astype(np.float64)), bins=edges)
    assert _within_one_bin(counts, ref)
    one = _state(np.concatenate([x1, x2]))
    for method in ("entropy", "percentile", "mse"):
        assert abs(compute_amax(m, method) - compute_amax(one, method)) <= 2 * m.width, method


def test_merge_with_empty_and_does_not_modify_inputs():
    a = _state(_data("gaussian", 1000))
    before = a.to_dict()
    m = a.merge(RangeState())
    assert m.to_dict() == before and m is not a
    assert RangeState().merge(a).to_dict() == before
    m.update(np.array([100.0]))
    assert a.to_dict() == before
    with pytest.raises(ValueError, match="bins"):
        a.merge(RangeState(1024))


# ------------------------------------------------------------------------------ save / load
def test_to_dict_from_dict_round_trip_through_json():
    s = _state(_data("laplace", 20_000), batches=4)
    d = json.loads(json.dumps(s.to_dict()))
    assert all(type(c) is int for c in d["counts"])
    r = RangeState.from_dict(d)
    assert (r.num_bins, r.width, r.amax, r.count) == (s.num_bins, s.width, s.amax, s.count)
    np.testing.assert_array_equal(r.counts, s.counts)
    for method in METHODS:
        assert compute_amax(r, method) == compute_amax(s, method)
    x = _data("gaussian", 5000, seed=9)
    s.update(x)
    r.update(x)                                     # a restored state keeps accumulating alike
    np.testing.assert_array_equal(r.counts, s.counts)


@pytest.mark.parametrize("change", [
    {"format": "other"}, {"version": 2}, {"counts": [1, 2]}, {"count": 999_999},
    {"width": -1.0}, {"amax": float("nan")}, {"num_bins": 1},
])
def test_from_dict_rejects_bad_input(change):
    d = _state(_data("uniform", 1000)).to_dict()
    d.update(change)
    with pytest.raises(ValueError):
        RangeState.from_dict(d)
