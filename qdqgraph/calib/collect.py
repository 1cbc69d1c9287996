"""Run the float model through onnxruntime and reduce each planned tensor into running state.

Only the tensors the plan quantizes become extra outputs of one session; each batch is reduced at
once and dropped, so memory does not grow with the number of samples. Tensors that must share one
scale (a Concat group) feed one state.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import onnx

from .. import io
from ..data import CalibrationData
from ..errors import QdqError


class MaxState:
    """Running max |x| (the `max` method needs nothing more)."""

    __slots__ = ("amax", "count")

    def __init__(self):
        self.amax = 0.0
        self.count = 0

    def update(self, x: np.ndarray) -> None:
        if x.size:
            m = float(np.max(np.abs(x)))
            if not np.isfinite(m):
                raise ValueError("non-finite values")
            self.amax = max(self.amax, m)
            self.count += x.size


def new_state(method: str):
    if method == "max":
        return MaxState()
    from .histogram import RangeState
    return RangeState()


@dataclass
class Collected:
    states: dict[str, object]          # group representative -> state
    samples: int
    seconds: float
    batches: int = 0
    providers: list[str] = field(default_factory=list)


def _session(model: onnx.ModelProto, providers: list[str]):
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    blob = io.session_bytes(model)
    try:
        if blob is not None:
            return ort.InferenceSession(blob, opts, providers=providers)
        with tempfile.TemporaryDirectory() as d:
            return ort.InferenceSession(io.save_temp(model, d), opts, providers=providers)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise QdqError(f"onnxruntime cannot run the model for calibration ({first})",
                       "check that the model runs in onnxruntime, or pass --calib-cache") from e


def collect(model: onnx.ModelProto, groups: dict[str, list[str]], data: CalibrationData,
            method: str = "max", batch_size: int = 1, providers: list[str] | None = None,
            progress=None) -> Collected:
    """Reduce every tensor of `groups` (representative -> member tensors) over all samples."""
    providers = providers or ["CPUExecutionProvider"]
    tensors = sorted({t for members in groups.values() for t in members})
    owner = {t: rep for rep, members in groups.items() for t in members}
    sess = _session(io.with_outputs(model, tensors), providers)
    states = {rep: new_state(method) for rep in groups}
    wanted = [t for t in tensors]
    start = time.perf_counter()
    seen = batches = 0
    for feed in data.batches(batch_size):
        try:
            values = sess.run(wanted, feed)
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise QdqError(f"onnxruntime failed on calibration sample {seen} ({first})",
                           "check that the data fits the model's inputs") from e
        for name, v in zip(wanted, values):
            try:
                states[owner[name]].update(v)
            except ValueError:
                raise QdqError(f"tensor '{name}' became NaN or Inf on calibration sample {seen}",
                               "check the calibration data and the float model's numerics") from None
        n = next(iter(feed.values())).shape[0] if batch_size > 1 and data.batchable() else 1
        seen += n
        batches += 1
        if progress is not None:
            progress(n)
    return Collected(states, seen, time.perf_counter() - start, batches, list(sess.get_providers()))
