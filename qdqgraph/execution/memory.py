"""Memory of a run: fewer full garbage collections while it builds large graphs, and one where a stage
dropped large garbage (a session and its weights) on a large model."""
from __future__ import annotations

import contextlib
import gc

import onnx_graphsurgeon as gs

from ..graph import io
# Python's cyclic garbage collector scans every tracked object at each full collection, and a
# graph is hundreds of thousands of them: at its default thresholds collection took a third of
# insert's time on a 10,000-node CNN (benchmarks/scale.py: 20.1 s -> 13.4 s with it off). A run
# collects far less often; the thresholds are restored when it ends.
RUN_GC_THRESHOLD = (100_000, 50, 100)
LARGE_MODEL_BYTES = 64 << 20     # above this, a run frees the garbage of its big stages at once
# ... and above this, that of every stage as it ends (Profile.collect) and the smoothing's replaced
# weights as it goes: a full collection costs about 30 ms on a small transformer, 0.6 s a run on
# MiniLM-L6 (86 MB), where the garbage is never large enough to set the peak
EVERY_STAGE_BYTES = 256 << 20


def free_if_large(loaded: io.Loaded, min_bytes: int = LARGE_MODEL_BYTES) -> None:
    """A full collection after the stages that drop large garbage (a session and its weights, the
    float weights after insertion), on large models only: the cyclic garbage of a stage would
    otherwise stay until the next full collection (fewer_collections), and peak memory with it
    (a 453 MB encoder: 2.2 GB -> 1.6 GB peak RSS). On small models a full collection costs more
    than the memory it frees."""
    if _weight_bytes(loaded) >= min_bytes:
        collect()


def collects_every_stage(loaded: io.Loaded) -> bool:
    """A model whose weights reach EVERY_STAGE_BYTES: its runs collect garbage as each stage ends
    (Profile.collect; the stages of the command, save and verify, included). On the 453 MB encoder
    the garbage of earlier stages held 1,000 MB at save and verify against 600 MB collected."""
    return _weight_bytes(loaded) >= EVERY_STAGE_BYTES


def _weight_bytes(loaded: io.Loaded) -> int:
    return sum(t.values.nbytes for t in loaded.graph.tensors().values()
               if isinstance(t, gs.Constant) and not isinstance(t._values, gs.ir.tensor.LazyValues))


def collect() -> None:
    """A full collection, then the C allocator's free pages handed back to the system (glibc's
    malloc_trim): a freed weight of a few MB lies inside malloc's heap, which keeps it resident."""
    gc.collect()
    if _TRIM is not None:
        _TRIM(0)


def _malloc_trim():
    try:
        import ctypes
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):        # not glibc: nothing to trim
        return None


_TRIM = _malloc_trim()


@contextlib.contextmanager
def fewer_collections():
    old = gc.get_threshold()
    gc.set_threshold(*RUN_GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*old)
