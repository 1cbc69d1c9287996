"""The float model's outputs on the first calibration samples, and a written model's output SQNR
against them, over all outputs together and per output."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


from ...graph import io, proto
from ...samples.data import CalibrationData
from ...execution.runtime import graph_session, session


@dataclass
class Reference:
    batches: list[dict]
    outputs: dict[str, list[np.ndarray]]     # float output name -> its value per batch
    samples: int


@dataclass
class Fidelity:
    overall_db: float                        # all float outputs together (the fallback's figure)
    per_output: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"overall_db": _round(self.overall_db), "per_output": {k: _round(v) for k, v in self.per_output.items()}}


def _round(db: float) -> float | str:
    return round(db, 2) if np.isfinite(db) else "inf"


def _batches(data: CalibrationData, samples: int) -> tuple[list[dict], int]:
    """The first `samples` samples, as one batch where the model's batch axis is dynamic."""
    batches, seen = [], 0
    for b in data.batches(samples if data.batchable() else 1):
        batches.append(b)
        seen += int(np.shape(next(iter(b.values())))[0]) if data.batchable() else 1
        if seen >= samples:
            break
    return batches, min(seen, samples)


def reference(loaded: io.Loaded, data: CalibrationData, samples: int, providers: list[str] | None = None) -> Reference:
    batches, seen = _batches(data, samples)
    sess = graph_session(loaded, providers, purpose="fidelity reference")
    names = [o.name for o in sess.get_outputs()]
    outputs: dict[str, list[np.ndarray]] = {}
    for b in batches:
        for name, value in zip(names, sess.run(names, b)):
            if np.issubdtype(np.asarray(value).dtype, np.floating):
                outputs.setdefault(name, []).append(np.asarray(value, dtype=np.float64))
    return Reference(batches, outputs, seen)


def sqnr(ref: list[np.ndarray], got: list[np.ndarray]) -> float:
    sig = sum(float(np.sum(r ** 2)) for r in ref)
    err = sum(float(np.sum((r - np.asarray(g, dtype=np.float64)) ** 2)) for r, g in zip(ref, got))
    if err == 0:
        return float("inf")
    return 10 * float(np.log10(sig / err)) if sig > 0 else float("-inf")


def fidelity_of(model: proto.ModelProto, ref: Reference) -> Fidelity:
    """The output SQNR of `model` (as written) against the float outputs of `ref`."""
    sess = session(model, purpose="accuracy check", widen=True)
    inputs = {i.name for i in sess.get_inputs()}
    names = [n for n in ref.outputs if n in {o.name for o in sess.get_outputs()}]
    got: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for b in ref.batches:
        for name, value in zip(names, sess.run(names, {k: v for k, v in b.items() if k in inputs})):
            got[name].append(value)
    per = {n: sqnr(ref.outputs[n], got[n]) for n in names}
    overall = sqnr([r for n in names for r in ref.outputs[n]], [g for n in names for g in got[n]])
    return Fidelity(overall, per)
