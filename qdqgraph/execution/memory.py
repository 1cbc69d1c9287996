"""Memory of a run: whether the model fits the memory this machine has left before the run starts,
fewer full garbage collections while it builds large graphs, and one where a stage dropped large
garbage (a session and its weights) on a large model."""
from __future__ import annotations

import contextlib
import gc
import os

import onnx_graphsurgeon as gs

from ..errors import QdqError
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


# What a run holds: the model's weights are arrays in memory for the whole run (nothing streams from
# disk), and its peak RSS, measured, is under 2x the weights on a 453 MB encoder (1.94x, insert with
# its defaults, --verify included: docs/SCALE.md) plus the interpreter and onnxruntime (BASE_BYTES).
PEAK_PER_WEIGHT_BYTE = 2.0
BASE_BYTES = 300 << 20
MEMORY_CHECK_ENV = "QDQGRAPH_MEMORY_CHECK"        # "off": the check below is not made


def fits(path, available: int | None = None) -> str | None:
    """Before a model file is loaded: a QdqError when its weights alone (bytes on disk, external data
    included) do not fit in the memory this machine has available (the run would be killed part-way,
    Linux overcommits); a warning line when its expected peak (PEAK_PER_WEIGHT_BYTE x the weights,
    plus BASE_BYTES) does not; else None. `available`: bytes (default: available_bytes())."""
    if os.environ.get(MEMORY_CHECK_ENV, "").lower() == "off":
        return None
    available = available_bytes() if available is None else available
    if available is None:
        return None
    weights = io.bytes_on_disk(path)
    peak = int(PEAK_PER_WEIGHT_BYTE * weights) + BASE_BYTES
    if weights + BASE_BYTES > available:
        raise QdqError(f"the model's weights ({_gb(weights)}) do not fit in the memory available here "
                       f"({_gb(available)}): qdqgraph holds them in memory, and a run peaks at about "
                       f"{_gb(peak)}",
                       f"run on a machine with {_gb(peak)} free, or set {MEMORY_CHECK_ENV}=off to try anyway")
    if peak > available:
        return (f"this run may run out of memory: the model's weights are {_gb(weights)}, a run peaks at "
                f"about {_gb(peak)}, and {_gb(available)} is available")
    return None


def available_bytes() -> int | None:
    """The memory a run can still take: the system's available memory (MemAvailable), or less under a
    cgroup limit (v2 memory.max, v1 memory.limit_in_bytes) less what the group uses; None where
    neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit, used in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as a, open(used) as b:
                cap, now = a.read().strip(), int(b.read().strip())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 1 << 60:           # "max", or v1's page-rounded 2^63: no limit
            found.append(max(int(cap) - now, 0))
    return min(found) if found else None


def _gb(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
