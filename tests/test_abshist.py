"""The compiled |x| histogram kernel: bit-for-bit the numpy path of RangeState.update, on any data
and any cutting into batches; its own argument checks; and that it is built where it can be."""
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qdqgraph.calib import histogram
from qdqgraph.calib.histogram import RangeState

needs_kernel = pytest.mark.skipif(not histogram.COMPILED,
                                  reason="the compiled histogram kernel was not built (no C compiler at install)")


def test_kernel_is_built_where_a_c_compiler_is():
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine: calibration counts with numpy")
    assert histogram.COMPILED, "a C compiler is here but qdqgraph/calib/_abshist.c was not built: reinstall"


def _run(batches, monkeypatch, compiled: bool, num_bins=2048) -> dict:
    with monkeypatch.context() as m:
        if not compiled:
            m.setattr(histogram, "_abshist", None)
        s = RangeState(num_bins)
        for b in batches:
            s.update(b)
        return s.to_dict()


floats = hnp.arrays(np.float32, st.integers(0, 300),
                    elements=st.floats(-1e6, 1e6, width=32, allow_nan=False, allow_infinity=False))


@needs_kernel
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(floats, min_size=1, max_size=6), st.sampled_from([2, 7, 2048]))
def test_kernel_equals_numpy_on_any_batches(monkeypatch, batches, num_bins):
    assert _run(batches, monkeypatch, True, num_bins) == _run(batches, monkeypatch, False, num_bins)


@needs_kernel
@pytest.mark.parametrize("case", ["growth", "zeros_then_huge", "denormals", "strided", "float16", "odd_sizes"])
def test_kernel_equals_numpy_on_edge_cases(monkeypatch, case):
    rng = np.random.default_rng(11)
    if case == "growth":          # every batch wider than the last: the range doubles many times
        batches = [rng.standard_normal(4099).astype(np.float32) * 3.0 ** k for k in range(8)]
    elif case == "zeros_then_huge":
        batches = [np.zeros(17, np.float32), np.array([3e38, -1.0, 0.0, 1e-30], np.float32)]
    elif case == "denormals":
        batches = [np.array([1e-45, -3e-42, 0.0, 1e-39], np.float32), rng.standard_normal(100).astype(np.float32)]
    elif case == "strided":       # non-contiguous views, as a sliced feature map would be
        big = rng.standard_normal((2, 8, 20, 20)).astype(np.float32)
        batches = [big[:, :, ::2, ::3], big[1, ::-1], big.transpose(0, 2, 3, 1)]
    elif case == "float16":
        batches = [rng.standard_normal(1001).astype(np.float16) * np.float16(k + 1) for k in range(3)]
    else:
        batches = [rng.laplace(size=n).astype(np.float32) for n in (1, 2, 3, 5, 4096 + 3)]
    a, b = _run(batches, monkeypatch, True), _run(batches, monkeypatch, False)
    assert a == b
    assert a["count"] == sum(x.size for x in batches)


@needs_kernel
def test_kernel_counts_nothing_when_a_value_does_not_fit():
    from qdqgraph.calib import _abshist
    counts = np.zeros(8, np.int64)
    m, fits = _abshist.abs_hist(np.array([0.5, -7.5], np.float32), 1.0, counts)
    assert (m, fits) == (7.5, True) and counts.tolist() == [1, 0, 0, 0, 0, 0, 0, 1]
    m, fits = _abshist.abs_hist(np.array([1.0, 8.0], np.float32), 1.0, counts)  # 8.0 -> bin 8 of 8
    assert (m, fits) == (8.0, False) and counts.tolist() == [1, 0, 0, 0, 0, 0, 0, 1]
    m, fits = _abshist.abs_hist(np.array([1.0, np.nan], np.float32), 1.0, counts)
    assert np.isnan(m) and not fits and counts.sum() == 2
    m, fits = _abshist.abs_hist(np.array([-np.inf, 1.0], np.float32), 1.0, counts)
    assert m == np.inf and not fits and counts.sum() == 2
    m, fits = _abshist.abs_hist(np.zeros(0, np.float32), 1.0, counts)
    assert m == 0.0 and fits and counts.sum() == 2


@needs_kernel
@pytest.mark.parametrize("pos", [0, 5, 15, 16, 31, 37, 39])
def test_kernel_sees_a_bad_value_or_the_maximum_at_any_position(pos):
    """The kernel spreads values over sub-histograms; a NaN, an out-of-range value or the maximum in
    any of them (or in the tail after the last full group) must be seen."""
    from qdqgraph.calib import _abshist
    x = np.full(40, 0.25, np.float32)
    counts = np.zeros(8, np.int64)
    x[pos] = -6.5
    assert _abshist.abs_hist(x, 1.0, counts) == (6.5, True)
    assert counts.tolist() == [39, 0, 0, 0, 0, 0, 1, 0]
    for bad in (np.nan, 9.0, np.inf):
        y = x.copy()
        y[pos] = bad
        m, fits = _abshist.abs_hist(y, 1.0, counts)
        assert not fits and counts.tolist() == [39, 0, 0, 0, 0, 0, 1, 0]
        assert np.isnan(m) if np.isnan(bad) else m == abs(bad)


@needs_kernel
@pytest.mark.parametrize("x, counts", [
    (np.zeros(4, np.float64), np.zeros(8, np.int64)),            # float64 data
    (np.zeros(4, np.float32), np.zeros(8, np.int32)),            # int32 counts
    (np.zeros(4, np.float32), np.zeros(0, np.int64)),            # no bins
    (np.zeros((4, 4), np.float32)[:, ::2], np.zeros(8, np.int64)),  # not contiguous
])
def test_kernel_rejects_wrong_buffers(x, counts):
    from qdqgraph.calib import _abshist
    with pytest.raises((TypeError, ValueError, BufferError)):
        _abshist.abs_hist(x, 1.0, counts)
    assert not counts.any()


@needs_kernel
def test_kernel_rejects_read_only_counts():
    from qdqgraph.calib import _abshist
    counts = np.zeros(8, np.int64)
    counts.setflags(write=False)
    with pytest.raises((TypeError, ValueError, BufferError)):
        _abshist.abs_hist(np.ones(3, np.float32), 1.0, counts)
