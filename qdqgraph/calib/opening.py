"""A large graph's calibration session, opened in a thread while the placement plan is refined.

On a graph of runtime.LARGE_GRAPH_NODES nodes or more, opening calibration's onnxruntime session
is single-threaded (1.2-1.9 s on the 10,000-node CNN), and so is the P14 prediction that refines
the plan before it (2.3-3.0 s of Python); onnxruntime opens a session without holding the GIL. So
where nothing between the placement and the calibration changes the graph (no recipe runs before
calibration), the pipeline has the session for the placement's tensors opened in a thread as soon
as the placement exists (`collect.open_ahead`), and calibration takes it where the refined plan
asks for the same tensors of the same graph with the same options (`key`): the model, options and
session calibration would have opened itself, so the same ranges. Anything else (another tensor
set, another graph, a failed opening) drops it and calibration opens its own as it always did; a
failure is then raised by that opening, with its message.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from ..graph import io


def key(loaded: io.Loaded, tensors: list[str], stride: int, only: bool, providers: list[str], threads: int) -> tuple:
    """What a calibration session depends on: the graph (this very one, as long as it has these
    nodes), the tensors it outputs, the subsampling stride, the pruning, the providers and
    onnxruntime's threads."""
    g = loaded.graph
    ends = (id(g.nodes[0]), id(g.nodes[-1])) if g.nodes else ()
    return id(g), len(g.nodes), ends, tuple(tensors), stride, only, tuple(providers), threads


class Opened:
    """A calibration session being opened by `opener()` in a thread; what `collect` needs besides
    (the graph with its outputs, the tensors to fetch, the outputs observed, the layout)."""

    def __init__(self, key: tuple, shell: io.Loaded, fetch: dict, observed: list[str],
                 opener: Callable[[], Any], blocked: Any):
        self.key, self.shell, self.fetch, self.observed, self.blocked = key, shell, fetch, observed, blocked
        self._opener: Callable[[], Any] | None = opener
        self._session: Any = None
        self._thread = threading.Thread(target=self._open, name="qdqgraph-calibration-session", daemon=True)
        self._thread.start()

    def _open(self) -> None:
        try:
            assert self._opener is not None
            self._session = self._opener()
        except BaseException:       # noqa: BLE001 - calibration opens its own, which raises it
            self._session = None
        finally:
            self._opener = None

    def take(self, wanted: tuple) -> tuple | None:
        """(shell, fetch, observed, session, blocked) where `wanted` is this session's key, else None
        (dropped). Waits for the opening to end."""
        self._thread.join()
        session, self._session = self._session, None
        if session is None or wanted != self.key:
            return None
        return self.shell, self.fetch, self.observed, session, self.blocked

    def drop(self) -> None:
        """Wait for the opening to end and let the session go (nothing may fork while it opens)."""
        self._thread.join()
        self._session = None
