"""Work started ahead, in a forked child process, and read when it is needed.

A run's last stages are single-threaded Python (the simulator's predictions, the record, the save),
and opening an onnxruntime session on a large written model is single-threaded too: on the
10,000-node CNN, --verify's session took 4.5 s to open while the two predictions before it took
4.9 s, one after the other on a machine with a second core idle. A child forked when the written
model exists opens the session and compares while the parent predicts and saves; the parent reads
the comparison when it prints it. The child computes from the parent's memory as it was at the
fork (copy on write), so the comparison is the one the parent would have made.

Where the child fails in any way (an exception, a crash, a result that does not unpickle), `result`
raises `Failed` and the caller computes the work itself: the child only ever saves time. There is
no child but on Linux, on a single core, or while Ray runs in the process.
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import time
from typing import Any, Callable

from ..calib.collect import cores
from . import distributed


class Failed(Exception):
    """The child did not hand back a result; the work is to be done in the process."""


def available() -> bool:
    """Whether work can be started ahead here: on Linux (macOS's system libraries are not safe to use
    in a child forked without exec, which is why Python's multiprocessing spawns there), with a
    second core usable."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and cores() >= 2


class Ahead:
    """`fn()` computing in a forked child; `result()` waits for it and returns its value."""

    def __init__(self, fn: Callable[[], Any]):
        for stream in (sys.stdout, sys.stderr):      # nothing buffered is written twice
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:                                  # the child: never returns
            _child(fn, read, write)
        os.close(write)
        self.pid: int | None = pid
        self.fd: int | None = read

    def result(self, timeout: float | None = None) -> Any:
        """fn()'s value; Failed where the child did not give one, or has not within `timeout`
        seconds (then it is killed: a child stuck on a lock another thread of the parent held at
        the fork must not hang the run)."""
        if self.fd is None:
            raise Failed("already read or cancelled")
        chunks = []
        until = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                if until is not None and not select.select([self.fd], [], [], max(0.0, until - time.monotonic()))[0]:
                    self.cancel()
                    raise Failed(f"no result within {timeout:g} s")
                chunk = os.read(self.fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        except Failed:
            raise
        except BaseException:           # interrupted (Ctrl-C, SIGTERM): the child's work is not wanted
            self.cancel()
            raise
        self._close()
        status = self._reap()
        if status != 0 or not chunks:
            raise Failed(f"the child ended with status {status}")
        try:
            kind, value = pickle.loads(b"".join(chunks))
        except Exception as e:  # noqa: BLE001 - any unreadable result is a failure to fall back from
            raise Failed(f"the child's result did not unpickle: {e}") from None
        if kind != "ok":
            raise Failed(value)
        return value

    def cancel(self) -> None:
        """Stop the child (its work is no longer wanted) and reap it."""
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._close()
        self._reap()

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _reap(self) -> int | None:
        if self.pid is None:
            return None
        _, status = os.waitpid(self.pid, 0)
        self.pid = None
        return os.waitstatus_to_exitcode(status)


def _child(fn: Callable[[], Any], read: int, write: int) -> None:
    """Run `fn`, write ("ok", value) or ("error", why) to `write`, and leave without the parent's
    exit handlers (os._exit: no atexit, no flushing of inherited buffers)."""
    code = 0
    try:
        os.close(read)
        try:
            out = pickle.dumps(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - the parent falls back, whatever it was
            out = pickle.dumps(("error", f"{type(e).__name__}: {e}"))
        with os.fdopen(write, "wb") as f:
            f.write(out)
    except BaseException:  # noqa: BLE001 - a child that cannot even report ends with a failure status
        code = 1
    finally:
        os._exit(code)


def start(fn: Callable[[], Any]) -> Ahead | None:
    """`fn` started in a forked child, or None where that is not available (`available`)."""
    if not available() or distributed.running():
        return None
    try:
        return Ahead(fn)
    except OSError:
        return None
