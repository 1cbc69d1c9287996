"""The compiled |x| histogram kernel: bit-for-bit the numpy path of RangeState.update, on any data
and any cutting into batches, with each of the loops this CPU runs (AVX-512, AVX2, generic C); its
own argument checks; and that it is built, with its vector loops, where it can be."""
import platform
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


ISAS = histogram._abshist.ISAS if histogram.COMPILED else ("generic",)


def test_vector_loops_are_used_where_the_cpu_has_them():
    """The loop is chosen at import from what the CPU reports; a build that lost its vector loops
    (or picked a slower one first) would still be correct but 2x slower."""
    if not histogram.COMPILED:
        pytest.skip("the compiled histogram kernel was not built (no C compiler at install)")
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("reads the CPU flags from /proc/cpuinfo (x86-64 Linux)")
    flags = set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    expect = [isa for isa, flag in (("avx512", "avx512f"), ("avx2", "avx2")) if flag in flags] + ["generic"]
    assert histogram._abshist.ISAS == tuple(expect)


class _Loop:
    """The kernel module with one loop forced."""

    def __init__(self, isa):
        self.kernel, self.isa = histogram._abshist, isa

    def abs_hist(self, x, inv, counts):
        return self.kernel.abs_hist(x, inv, counts, self.isa)


def _run(batches, monkeypatch, compiled: bool, num_bins=2048, isa=None) -> dict:
    with monkeypatch.context() as m:
        if not compiled:
            m.setattr(histogram, "_abshist", None)
        elif isa is not None:
            m.setattr(histogram, "_abshist", _Loop(isa))
        s = RangeState(num_bins)
        for b in batches:
            s.update(b)
        return s.to_dict()


floats = hnp.arrays(np.float32, st.integers(0, 300),
                    elements=st.floats(-1e6, 1e6, width=32, allow_nan=False, allow_infinity=False))


@needs_kernel
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(floats, min_size=1, max_size=6), st.sampled_from([2, 7, 2048]), st.sampled_from(ISAS))
def test_kernel_equals_numpy_on_any_batches(monkeypatch, batches, num_bins, isa):
    assert _run(batches, monkeypatch, True, num_bins, isa) == _run(batches, monkeypatch, False, num_bins)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", ["growth", "zeros_then_huge", "denormals", "strided", "float16", "odd_sizes",
                                  "relu"])
def test_kernel_equals_numpy_on_edge_cases(monkeypatch, case, isa):
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
    elif case == "relu":          # mostly zeros, as after a ReLU: the AVX-512 loop counts bin 0 apart
        batches = [np.maximum(rng.standard_normal(n), 0.9).astype(np.float32) - np.float32(0.9)
                   for n in (3000, 1024, 1023, 17)]
        batches.append(np.zeros(2049, np.float32))
    else:
        batches = [rng.laplace(size=n).astype(np.float32) for n in (1, 2, 3, 5, 4096 + 3)]
    a, b = _run(batches, monkeypatch, True, isa=isa), _run(batches, monkeypatch, False)
    assert a == b
    assert a["count"] == sum(x.size for x in batches)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_kernel_counts_nothing_when_a_value_does_not_fit(isa):
    from qdqgraph.calib import _abshist
    counts = np.zeros(8, np.int64)
    m, fits = _abshist.abs_hist(np.array([0.5, -7.5], np.float32), 1.0, counts, isa)
    assert (m, fits) == (7.5, True) and counts.tolist() == [1, 0, 0, 0, 0, 0, 0, 1]
    m, fits = _abshist.abs_hist(np.array([1.0, 8.0], np.float32), 1.0, counts, isa)  # 8.0 -> bin 8 of 8
    assert (m, fits) == (8.0, False) and counts.tolist() == [1, 0, 0, 0, 0, 0, 0, 1]
    m, fits = _abshist.abs_hist(np.array([1.0, np.nan], np.float32), 1.0, counts, isa)
    assert np.isnan(m) and not fits and counts.sum() == 2
    m, fits = _abshist.abs_hist(np.array([-np.inf, 1.0], np.float32), 1.0, counts, isa)
    assert m == np.inf and not fits and counts.sum() == 2
    m, fits = _abshist.abs_hist(np.zeros(0, np.float32), 1.0, counts, isa)
    assert m == 0.0 and fits and counts.sum() == 2


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("pos", [0, 5, 7, 8, 15, 16, 31, 1023, 1024, 1040, 2047, 2048, 2060, 2063])
def test_kernel_sees_a_bad_value_or_the_maximum_at_any_position(pos, isa):
    """The loops spread values over vector lanes, sub-histograms and chunks of 1024; a NaN, an
    out-of-range value or the maximum in any of them (or in the tail after the last full vector)
    must be seen, and zeros anywhere counted in bin 0."""
    from qdqgraph.calib import _abshist
    x = np.full(2064, 0.25, np.float32)
    x[::3] = 0.0                     # zeros and 0.25 both land in bin 0
    x[pos] = -6.5
    base = [x.size - 1, 0, 0, 0, 0, 0, 1, 0]
    counts = np.zeros(8, np.int64)
    assert _abshist.abs_hist(x, 1.0, counts, isa) == (6.5, True)
    assert counts.tolist() == base
    for bad in (np.nan, 9.0, np.inf):
        y = x.copy()
        y[pos] = bad
        m, fits = _abshist.abs_hist(y, 1.0, counts, isa)
        assert not fits and counts.tolist() == base
        assert np.isnan(m) if np.isnan(bad) else m == abs(bad)


@needs_kernel
def test_kernel_rejects_an_unknown_loop():
    from qdqgraph.calib import _abshist
    counts = np.zeros(8, np.int64)
    with pytest.raises(ValueError, match="no neon loop"):
        _abshist.abs_hist(np.ones(3, np.float32), 1.0, counts, "neon")
    assert not counts.any()


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


@needs_kernel
def test_kernel_flushing_to_64_bit_totals_counts_the_same(tmp_path):
    """Data longer than FLUSH_EVERY values (2**30: a 32-bit counter could wrap) is counted in blocks
    moved to 64-bit totals. Too large to run as is, so the kernel is built again with blocks of 1000
    values and compared with the installed one on every loop."""
    import glob
    import importlib.util
    import subprocess
    import sysconfig
    from pathlib import Path
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on this machine")
    src = Path(histogram.__file__).with_name("_abshist.c")
    out = tmp_path / ("_abshist" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-I" + sysconfig.get_paths()["include"],
                    "-DFLUSH_EVERY=((Py_ssize_t)1000)", str(src), "-o", str(out)], check=True)
    spec = importlib.util.spec_from_file_location("_abshist", glob.glob(str(out))[0])
    small = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(small)
    real = histogram._abshist
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(0, 5000))
        x = (rng.laplace(size=n) * rng.choice([0.1, 1.0, 10.0])).astype(np.float32)
        if n:
            x[rng.integers(0, n, size=max(1, n // 3))] = 0.0
        bins = int(rng.choice([2, 7, 2048]))
        inv = float(np.float32(bins / (float(np.abs(x).max(initial=0.0)) * rng.choice([0.8, 1.5]) + 1e-3)))
        for isa in ISAS:
            a, b = np.zeros(bins, np.int64), np.zeros(bins, np.int64)
            assert small.abs_hist(x, inv, a, isa) == real.abs_hist(x, inv, b, isa)
            np.testing.assert_array_equal(a, b)
