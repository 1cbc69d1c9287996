"""A bounded, deterministic sample of the rows (tokens, positions) of activations, taken as the
samples stream past: what a recipe that measures a layer on its input rows keeps in memory.

Each tensor's values are read as rows of its last axis ([..., K] -> [N, K]). Before the first
sample the number of samples to run is not known to the caller; after it, `RowSample.plan` fixes
it: at most `max_samples` (and the data's count), and no more than it takes for every tensor to
show `budget` rows (a transformer of 1,500 tokens a sample reaches it in a few samples, one of 64
tokens needs them all). The rows kept are every `step`-th of the planned rows, counted across the
samples, at most `keep` of them, with `step` = planned rows // `keep`: the same rows as striding
over all the planned samples' rows held at once, without holding them. The largest |value| of
each channel is taken over every row seen.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class _Tensor:
    step: int
    planned: int                       # rows this tensor is expected to show over the planned samples
    seen: int = 0
    kept: list[np.ndarray] = field(default_factory=list)
    count: int = 0                     # rows kept so far
    cmax: np.ndarray | None = None


class RowSample:
    """Rows of several tensors, fed one sample at a time (`add`), planned after the first one."""

    def __init__(self, keep: int, budget: int, max_samples: int):
        if keep < 1 or budget < 1 or max_samples < 1:
            raise ValueError("RowSample takes positive bounds")
        self.keep, self.budget, self.max_samples = keep, budget, max_samples
        self.samples = 0                  # samples added
        self.planned = max_samples        # samples to run; fixed by the first `add`
        self.tensors: dict[str, _Tensor] = {}

    def plan(self, first: dict[str, np.ndarray], available: int) -> int:
        """The number of samples to run, from the first sample's row counts and the samples there are."""
        counts = [_rows_of(v) for v in first.values()]
        need = max((math.ceil(self.budget / n) for n in counts if n), default=1)
        return max(1, min(self.max_samples, available, need))

    def add(self, values: dict[str, np.ndarray], available: int) -> bool:
        """Take one sample's values ({tensor: array}); True while more samples are wanted."""
        if self.samples == 0:
            self.planned = self.plan(values, available)
            for name, v in values.items():
                planned = self.planned * _rows_of(v)
                self.tensors[name] = _Tensor(step=max(1, planned // self.keep), planned=planned)
        for name, v in values.items():
            t = self.tensors.get(name)
            if t is not None:
                _take(t, np.asarray(v, dtype=np.float32), self.keep)
        self.samples += 1
        return self.samples < self.planned

    def rows(self) -> dict[str, np.ndarray]:
        """{tensor: its kept rows [n, K]} (tensors that showed no rows are left out)."""
        return {name: np.ascontiguousarray(np.concatenate(t.kept)) for name, t in self.tensors.items() if t.kept}

    def channel_max(self) -> dict[str, np.ndarray]:
        """{tensor: max |x| of each channel over every row seen}."""
        return {name: t.cmax for name, t in self.tensors.items() if t.cmax is not None}

    def stated(self) -> dict:
        """What was sampled, for the report."""
        seen = [t.seen for t in self.tensors.values()]
        kept = [t.count for t in self.tensors.values()]
        return {"samples": self.samples, "max_samples": self.max_samples, "row_budget": self.budget,
                "max_rows": self.keep, "rows_seen": max(seen, default=0), "rows_kept": max(kept, default=0)}


def _rows_of(v) -> int:
    shape = np.shape(v)
    return int(np.prod(shape[:-1])) if len(shape) >= 1 and shape[-1] else 0


def _take(t: _Tensor, v: np.ndarray, keep: int) -> None:
    """The rows of this sample at the tensor's stride (global row index a multiple of `step`,
    below `keep` * `step`), and the channel maxima over all of its rows."""
    if v.ndim == 0 or v.size == 0:
        return
    r = v.reshape(-1, v.shape[-1])
    m = np.abs(r).max(axis=0)
    if t.cmax is None:
        t.cmax = m
    elif t.cmax.shape == m.shape:
        t.cmax = np.maximum(t.cmax, m)
    start = (-t.seen) % t.step
    stop = min(r.shape[0], keep * t.step - t.seen)
    if start < stop and (not t.kept or t.kept[0].shape[1:] == r.shape[1:]):
        part = r[start:stop:t.step]
        t.kept.append(part.copy())     # a copy: the sample's array is not held
        t.count += part.shape[0]
    t.seen += r.shape[0]
