"""numpy's BLAS run on one thread for a while, where it is an OpenBLAS this process can reach.

The searches that run numpy on several tensors at once (recipes/output_aware) want one BLAS thread
each: two searches whose products each start two BLAS threads on two cores wait on one another
(MiniLM-L6's 24 searches: 1.03-1.10 s one at a time, 1.16-1.31 s two at a time with BLAS
threaded, 0.79-0.86 s two at a time on one BLAS thread each). One BLAS thread also makes the
products' sums the same on any machine of the same CPU kind, whatever its cores: a threaded
OpenBLAS splits a product by the cores it has, and the last bits of a sum follow the split.

numpy's wheels carry OpenBLAS (`scipy_openblas` with 64-bit integers, or plain `openblas`); its
thread count is set through the library numpy has loaded, found in /proc/self/maps. Elsewhere
(another BLAS, another OS) `one_thread` yields False and changes nothing.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Iterator

# (get, set) symbol pairs of OpenBLAS builds: numpy's own wheels, then a system OpenBLAS
_SYMBOLS = (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
            ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
            ("openblas_get_num_threads", "openblas_set_num_threads"))
_LOCK = threading.RLock()
_found: tuple | None = None
_looked = False


def _libraries() -> list[str]:
    """Paths of the OpenBLAS libraries this process has loaded."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.isabs(p))


def _controls() -> tuple | None:
    """(get, set) of the loaded OpenBLAS's thread count, or None."""
    global _found, _looked
    if _looked:
        return _found
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
                _found = (get, put)
                break
        if _found is not None:
            break
    _looked = True
    return _found


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
