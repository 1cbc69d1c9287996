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


def free_if_large(loaded: io.Loaded) -> None:
    """A full collection after the stages that drop large garbage (a session and its weights, the
    float weights after insertion), on large models only: the cyclic garbage of a stage would
    otherwise stay until the next full collection (fewer_collections), and peak memory with it
    (a 453 MB encoder: 2.2 GB -> 1.6 GB peak RSS). On small models a full collection costs more
    than the memory it frees."""
    if _weight_bytes(loaded) >= LARGE_MODEL_BYTES:
        gc.collect()


def _weight_bytes(loaded: io.Loaded) -> int:
    return sum(t.values.nbytes for t in loaded.graph.tensors().values()
               if isinstance(t, gs.Constant) and not isinstance(t._values, gs.ir.tensor.LazyValues))


@contextlib.contextmanager
def fewer_collections():
    old = gc.get_threshold()
    gc.set_threshold(*RUN_GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*old)
