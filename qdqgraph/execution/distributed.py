"""Work split over Ray (`--ray [ADDRESS]`): calibration shards and sensitivity units as tasks.

qdqgraph schedules nothing itself. Ray places the tasks; this module only runs a list of parts of
one job as Ray tasks and hands back their results in the order of the parts, so that the caller
can combine them into exactly what one process computes: calibration states of contiguous sample
shards, merged in shard order (`calibration.py`; states merge exactly, calib/histogram.py), and the
SQNRs of disjoint runs of sensitivity units (`sensitivity.py`; a unit's runs do not depend on the
others'). A failure is reported as one process would have met it first: the error of the earliest
failing part (parts are in the one process's order), as the same `QdqError` (message and fix);
parts after it are cancelled, parts before it still finish in case they fail earlier.

Where Ray comes from:
* no address, or "local": a Ray started for the run on this machine (one CPU per core) and stopped
  when the run ends (`ray.shutdown`, waiting for its processes to exit);
* an address ("auto", "HOST:PORT", "ray://HOST:PORT"): that cluster, only disconnected from at the
  end. Every node needs qdqgraph (this version) installed, and the data at the same path where the
  calibration data is a folder (its files travel as paths and are read by the worker that uses them);
* a Ray this process is already connected to (a notebook's, a test's) is used as it is and left
  running, whatever the address.
Inside a `scope()` (one `quantize` or `calibrate` call) a Ray started by the first stage that
needs it serves the later stages too and stops when the scope ends, so `insert --ray
--accuracy-budget` starts Ray once for calibration and sensitivity.

Each task asks Ray for one CPU (`TASK_CPUS`) and runs onnxruntime with that many threads per
onnxruntime run, so that the tasks of a node together use its cores instead of each spinning up
threads for all of them. Progress: every task counts its work into one small actor that the
driver reads a few times a second, so one bar advances over all workers.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time

from ..graph import io
from ..errors import QdqError
from .progress import step
from .runtime import custom_op_libraries, register_custom_ops
import socket
from ..calib.collect import cores

LOCAL = "local"                    # --ray without an address: a Ray of our own on this machine
INSTALL = "pip install 'qdqgraph[ray]'"
TASK_CPUS = 1                      # CPUs a task asks for, and onnxruntime threads per run in it
POLL_SECONDS = 0.25                # how often the driver reads progress while tasks run
REPORT_SECONDS = 0.2               # how often a task sends its counts (at most)
CONNECT_SECONDS = 10.0             # to wait for a cluster's address to answer at all
_CONNECT_FIX = ("check the address (start a cluster with `ray start --head`), or pass --ray without an "
                "address for a Ray on this machine")


def running() -> bool:
    """Whether this process is connected to Ray (Ray is not imported to say no)."""
    ray = sys.modules.get("ray")
    try:
        return ray is not None and bool(ray.is_initialized())
    except Exception:  # noqa: BLE001 - a Ray that cannot answer is not one to share the process with
        return False


def require():
    """The ray module; without it a QdqError naming the extra to install."""
    try:
        import ray
    except ImportError as e:
        raise QdqError(f"--ray needs Ray, which is not installed here ({e})", f"{INSTALL}, or drop --ray") from None
    return ray


# -------------------------------------------------------------------------- connection

_scopes: list[list[bool]] = []     # open scopes, innermost last: [whether it started Ray]


@contextlib.contextmanager
def scope():
    """One run (a `quantize` or `calibrate` call): a Ray that a stage inside starts stays up for
    the later stages and is stopped when the run ends, error or not. Starts nothing itself."""
    started = [False]
    _scopes.append(started)
    try:
        yield
    finally:
        _scopes.remove(started)
        if started[0]:
            _stop()


@contextlib.contextmanager
def connected(address: str | None = LOCAL, cpus: int | None = None):
    """Ray, connected for the work inside: reused if this process is already connected; else
    started (no address or "local", with `cpus` CPUs, default one per core) or connected to
    (`address`), and stopped or disconnected at the end of the innermost `scope()`, or of this
    block outside any."""
    ray = require()
    if ray.is_initialized():
        yield ray
        return
    _start(ray, address, cpus)
    if _scopes:
        _scopes[-1][0] = True
        yield ray
        return
    try:
        yield ray
    finally:
        _stop()


def _start(ray, address: str | None, cpus: int | None) -> None:
    # Ray's INFO and WARNING lines (the start, the token it generates) would break the CLI's
    # one-line output; its errors still show
    quiet = dict(logging_level=logging.ERROR, log_to_driver=False)
    local = address in (None, LOCAL)
    try:
        if local:
            # a Ray started for one run reports no usage statistics unless the user asked for them
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            ray.init(address=LOCAL, num_cpus=cpus or cores(), include_dashboard=False, **quiet)
        else:
            assert address is not None       # None is local
            _check_reachable(address)
            ray.init(address=address, **quiet)
    except QdqError:
        raise
    except Exception as e:  # Ray raises ConnectionError, ValueError, RuntimeError, ... here
        if ray.is_initialized():
            ray.shutdown()
        if local:
            raise QdqError(f"Ray could not start on this machine ({_first_line(e)})",
                           "check the free space in /tmp and /dev/shm, or drop --ray") from None
        raise QdqError(f"cannot connect to Ray at {address} ({_first_line(e)})", _CONNECT_FIX) from None


def _check_reachable(address: str) -> None:
    """Fail at once on a HOST:PORT nothing listens on: ray.init retries such an address for
    minutes (more than 8 measured here, against a closed port) before it gives up."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return                           # "auto" and the like: Ray resolves them, and fails fast
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
    except OSError as e:
        raise QdqError(f"cannot connect to Ray at {address} ({e.strerror or e})", _CONNECT_FIX) from None


def _stop() -> None:
    """Stop the Ray this process started (wait for its raylet, GCS and workers to exit), or only
    disconnect from a cluster it connected to."""
    import ray
    if ray.is_initialized():
        ray.shutdown(wait_for_processes=True)


def slots() -> int:
    """The CPUs of the connected cluster: how many tasks run at once."""
    import ray
    return max(1, int(ray.cluster_resources().get("CPU", 1)) // TASK_CPUS)


# -------------------------------------------------------------------------- what travels

def pack(loaded: io.Loaded) -> tuple:
    """A graph as it travels to a task: the ModelProto with its large weights as arrays beside
    it (arrays go through Ray's object store without a copy on the same node). Exported from a
    copy: exporting tidies a graph in place, and the caller's graph must not change."""
    return io.to_model_and_weights(io.Loaded(graph=loaded.graph.copy(), ir_version=loaded.ir_version))


def unpack(packed: tuple) -> io.Loaded:
    """The graph of `pack`, in a task."""
    model, weights = packed
    return io.load(io.fill_weights(model, weights), check=False)


def split(items: list, parts: int) -> list[list]:
    """`items` cut into `parts` contiguous runs of sizes differing by one at most (the
    arithmetic of CalibrationData.shard), none empty."""
    n = len(items)
    parts = max(1, min(parts, n))
    return [items[k * n // parts:(k + 1) * n // parts] for k in range(parts)]


# -------------------------------------------------------------------------- tasks

class _Counter:
    """Work done by all tasks since the driver last looked (a Ray actor of no CPU)."""

    def __init__(self):
        self.done = 0

    def add(self, n: int) -> None:
        self.done += n

    def take(self) -> int:
        n, self.done = self.done, 0
        return n


class _Reporter:
    """A task's `progress` callable: counts sent to the driver's counter every REPORT_SECONDS at
    most, the rest when the task ends."""

    def __init__(self, counter):
        self.counter, self.pending, self.sent = counter, 0, time.monotonic()

    def __call__(self, n: int = 1) -> None:
        self.pending += n
        if time.monotonic() - self.sent >= REPORT_SECONDS:
            self.counter.add.remote(self.pending)
            self.pending, self.sent = 0, time.monotonic()

    def flush(self) -> None:
        if self.pending:
            import ray
            ray.get(self.counter.add.remote(self.pending))   # counted before the result arrives
            self.pending = 0


def _call(task, counter, libraries, *args):
    """Run in a Ray worker: `task(*args, progress=...)`. A QdqError comes back as a value (its
    class, problem and fix): pickled as an exception it would lose the fix as a field."""
    for lib in libraries:
        register_custom_ops(lib)
    report = _Reporter(counter)
    try:
        return True, task(*args, progress=report)
    except QdqError as e:
        return False, (type(e), e.problem, e.fix)
    finally:
        report.flush()


def run(address: str | None, task, shared: tuple, parts, progress=None, what: str = "part") -> list:
    """`task(*shared, *part, progress=...)` for each part, as Ray tasks; their results, in the
    order of the parts. `shared`: values every task reads, put in Ray's object store once.
    `parts`: a list of argument tuples, or a function of the cluster's task slots that makes it.
    `progress` (a plain callable) is advanced by the counts the tasks report. Raises the error
    of the earliest failing part (see the module docstring)."""
    with connected(address) as ray:
        calls = parts(slots()) if callable(parts) else parts
        refs_shared = [ray.put(v) for v in shared]
        counter = ray.remote(num_cpus=0)(_Counter).remote()
        remote = ray.remote(num_cpus=TASK_CPUS)(_call)
        libraries = custom_op_libraries()
        refs = [remote.remote(task, counter, libraries, *refs_shared, *call) for call in calls]
        try:
            return _gather(ray, refs, counter, progress, what)
        finally:
            with contextlib.suppress(Exception):
                ray.kill(counter)


def _gather(ray, refs, counter, progress, what: str) -> list:
    """The results of `refs` in order, or the error of the earliest failing one."""
    index = {ref: k for k, ref in enumerate(refs)}
    results: dict[int, object] = {}
    failures: dict[int, BaseException] = {}
    _wait(ray, list(refs), index, results, failures, counter, progress, what)
    if failures:
        raise failures[min(failures)]
    return [results[k] for k in range(len(refs))]


def _wait(ray, pending: list, index: dict, results: dict, failures: dict, counter, progress, what: str) -> None:
    """Collect results and failures until no part that matters is left. Parts after a failure are
    left to finish unread, not cancelled: in Ray 2.60 a cancel that crosses the task's completion
    aborts the driver ("Tried to complete task that was not pending", seen here; Ray #54798 fixed
    one such race). The Ray a run started stops at its end anyway, and a cluster ends a driver's
    tasks when the driver disconnects."""
    from ray.exceptions import RayError, RayTaskError, TaskCancelledError
    n = len(index)
    while pending:
        done, rest = ray.wait(pending, num_returns=len(pending), timeout=POLL_SECONDS)
        pending[:] = rest
        for ref in done:
            k = index[ref]
            try:
                ok, value = ray.get(ref)
            except TaskCancelledError:
                continue
            except RayTaskError as e:          # not a QdqError: a bug, raised as it is (exit 1)
                failures[k] = _cause(e, what, k, n)
                continue
            except RayError as e:              # the worker died, its node left, ...
                failures[k] = QdqError(f"Ray lost {what} {k + 1} of {n} ({_first_line(e)})",
                                       "check the cluster's memory and logs, or drop --ray to run in one process")
                continue
            if ok:
                results[k] = value
            else:
                cls, problem, fix = value
                try:
                    failures[k] = cls(problem, fix)
                except TypeError:              # a subclass made otherwise: its message stands
                    failures[k] = QdqError(problem, fix)
        if progress is not None:
            step(progress, ray.get(counter.take.remote()))
        if failures:                           # later parts cannot be the one process's error
            pending[:] = [ref for ref in pending if index[ref] < min(failures)]


def _cause(e, what: str, k: int, n: int) -> BaseException:
    cause = getattr(e, "cause", None)
    if isinstance(cause, ImportError):
        return QdqError(f"a Ray worker cannot run {what} {k + 1} of {n} ({_first_line(cause)})",
                        "install qdqgraph, this version, on every node of the cluster")
    return cause if isinstance(cause, BaseException) else e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


__all__ = ["LOCAL", "INSTALL", "TASK_CPUS", "require", "scope", "connected", "slots", "pack", "unpack", "split",
           "run"]
