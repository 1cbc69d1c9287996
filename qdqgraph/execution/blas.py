"""numpy's BLAS on one thread for a while, where it is an OpenBLAS this process can reach, and the
numeric searches of several tensors run at once on it (`mapped`).

The recipes that search each tensor with numpy (recipes/output_aware, recipes/int4_weights) run
several at once on one BLAS thread each: two searches whose products each start two BLAS threads on
two cores wait on one another (MiniLM-L6's 24 output-aware searches in one process: 1.19-1.33 s
one at a time, BLAS threaded; 0.90-1.08 s two at a time on one BLAS thread each; slower than one at
a time when both are threaded). The threads cost resident memory that stays (MiniLM's insert: about
+33 MB from the search on; a malloc_trim after the search did not give it back, and where it lies,
numpy's arenas or OpenBLAS's per-thread buffers, is not measured). One BLAS thread also makes the products' sums the same on any
machine of the same CPU kind, whatever its cores: a threaded OpenBLAS splits a product by the cores
it has, and the last bits of a sum can follow the split.

numpy's wheels carry OpenBLAS (`scipy_openblas` with 64-bit integers, or plain `openblas`); its
thread count is set through the library numpy has loaded, found in /proc/self/maps. Elsewhere
(another BLAS, another OS) `one_thread` yields False, changes nothing, and `mapped` runs one item
at a time.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import os
import threading
from typing import Callable, Generator, Iterator, Sequence, TypeVar

from ..calib.collect import cores

T = TypeVar("T")
R = TypeVar("R")

# (get, set) symbol pairs of OpenBLAS builds: numpy's own wheels, then a system OpenBLAS
_SYMBOLS = (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
            ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
            ("openblas_get_num_threads", "openblas_set_num_threads"))
_LOCK = threading.RLock()


def _libraries() -> list[str]:
    """Paths of the OpenBLAS libraries this process has loaded."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.isabs(p))


@functools.cache
def _controls() -> tuple | None:
    """(get, set) of the loaded OpenBLAS's thread count, or None (looked for once)."""
    import numpy  # noqa: F401 - its BLAS is the one loaded
    for path in _libraries():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for get_name, set_name in _SYMBOLS:
            get, put = getattr(lib, get_name, None), getattr(lib, set_name, None)
            if get is not None and put is not None:
                get.restype, get.argtypes = ctypes.c_int, []
                put.restype, put.argtypes = None, [ctypes.c_int]
                return get, put
    return None


@contextlib.contextmanager
def one_thread() -> Iterator[bool]:
    """numpy's BLAS on one thread inside the block (True), its count before restored after; False
    where it cannot be set (nothing changed). Process-wide: one block at a time."""
    controls = _controls()
    if controls is None:
        yield False
        return
    get, put = controls
    with _LOCK:
        before = get()
        put(1)
        try:
            yield True
        finally:
            put(before)


def mapped(fn: Callable[[T], R], items: Sequence[T], most: int = 4) -> Generator[R, None, None]:
    """fn(item) for each of `items`, yielded in order, with numpy's BLAS on one thread (`one_thread`)
    until the last is yielded: on up to `most` threads, one a core, where it could be set; else one
    item at a time, as a plain loop would. `fn` must only compute (numpy lets go of the GIL in its
    loops and products) on what nobody changes meanwhile: the graph is the caller's, read before and
    written as the results come."""
    with one_thread() as single:
        threads = min(most, cores(), len(items)) if single else 1
        if threads <= 1:
            for item in items:
                yield fn(item)
            return
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="qdqgraph-search") as pool:
            yield from pool.map(fn, items)
