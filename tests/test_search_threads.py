"""The output-aware search of several tensors at once: one BLAS thread each (execution.blas), the
same choices in the same order as one at a time."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from qdqgraph.execution import blas
from qdqgraph.recipes import output_aware


def test_one_thread_sets_the_count_inside_and_restores_it_after():
    controls = blas._controls()
    if controls is None:
        pytest.skip("numpy's BLAS here is not an OpenBLAS this process can reach")
    get, put = controls
    put(2)
    try:
        with blas.one_thread() as single:
            assert single is True
            assert get() == 1
        assert get() == 2
        with pytest.raises(RuntimeError):
            with blas.one_thread():
                raise RuntimeError("the block fails")
        assert get() == 2
    finally:
        put(2)


def test_one_thread_without_a_reachable_blas_changes_nothing(monkeypatch):
    monkeypatch.setattr(blas, "_controls", lambda: None)
    with blas.one_thread() as single:
        assert single is False


def _jobs(n: int, seed: int = 0) -> tuple[list, dict, dict]:
    rng = np.random.default_rng(seed)
    jobs, xs, cmax = [], {}, {}
    for i in range(n):
        k, m = 48, 40 + 8 * i
        x = rng.standard_normal((256, k)).astype(np.float32)
        x[:, i % k] *= 30.0                               # an outlier channel for the smoothing to find
        w = (rng.standard_normal((k, m)) * 0.1).astype(np.float32)
        t = f"t{i}"
        xs[t], cmax[t] = x, np.abs(x).max(axis=0)
        jobs.append((t, [], w, 1, 0, None, None))
    return jobs, xs, cmax


def _threads_seen(monkeypatch, cores: int) -> set[str]:
    """The names of the threads `_search` will run on, collected as it runs, with `cores` cores."""
    seen: set[str] = set()
    real = output_aware._search

    def spy(*args):
        seen.add(threading.current_thread().name)
        return real(*args)
    monkeypatch.setattr(output_aware, "_search", spy)
    monkeypatch.setattr(blas, "cores", lambda: cores)
    return seen


def test_the_tensors_searched_at_once_get_what_each_gets_alone(monkeypatch):
    jobs, xs, cmax = _jobs(7)
    seen = _threads_seen(monkeypatch, 2)
    at_once = output_aware._searched(jobs, xs, cmax)
    with blas.one_thread():
        alone = [output_aware._searched([job], xs, cmax)[0] for job in jobs]
    assert at_once == alone                            # same errors to the last bit, in the jobs' order
    assert len(at_once) == len(jobs)
    if blas._controls() is not None:
        assert any(name.startswith("qdqgraph-search") for name in seen)


def test_one_core_searches_on_this_thread(monkeypatch):
    jobs, xs, cmax = _jobs(3, seed=1)
    seen = _threads_seen(monkeypatch, 1)
    output_aware._searched(jobs, xs, cmax)
    assert seen == {threading.current_thread().name}


def test_mapped_yields_in_order_and_gives_blas_its_threads_back_when_closed_early(monkeypatch):
    controls = blas._controls()
    if controls is None:
        pytest.skip("numpy's BLAS here is not an OpenBLAS this process can reach")
    get, put = controls
    put(2)
    monkeypatch.setattr(blas, "cores", lambda: 2)
    try:
        assert list(blas.mapped(lambda i: i * i, list(range(9)))) == [i * i for i in range(9)]
        assert get() == 2
        it = blas.mapped(lambda i: (get(), i), list(range(5)))
        first = next(it)
        assert first == (1, 0)          # the item ran with BLAS on one thread
        it.close()
        assert get() == 2
    finally:
        put(2)
