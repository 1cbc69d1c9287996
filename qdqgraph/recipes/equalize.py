"""Cross-layer equalization, the measuring half: the per-channel ranges of the tensor between each
Conv pair, on calibration samples (passes/equalize.py folds the scales they decide into the weights)."""
from __future__ import annotations

import numpy as np

from ..execution.runtime import float_activations
from ..passes.equalize import ChannelStats, pairs


def activation_ranges(loaded, data, samples: int = 16) -> dict[str, ChannelStats]:
    """Conv1 name -> ChannelStats of the tensor Conv2 reads, for every pair, over the first
    `samples` samples of the float model."""
    found = pairs(loaded.graph)
    tensors = {second.inputs[0].name: first.name for first, _, second in found}
    if not tensors:
        return {}
    peak: dict[str, np.ndarray] = {}
    square: dict[str, np.ndarray] = {}
    seen = 0
    for values in float_activations(loaded, sorted(tensors), data, samples, "equalization"):
        seen += 1
        for name, v in values.items():
            v = np.asarray(v, dtype=np.float64)
            axes = tuple(d for d in range(v.ndim) if d != 1)
            key = tensors[name]
            m, q = np.abs(v).max(axis=axes), (v ** 2).mean(axis=axes)
            peak[key] = m if key not in peak else np.maximum(peak[key], m)
            square[key] = q if key not in square else square[key] + q
    return {k: ChannelStats(peak[k], square[k] / max(seen, 1)) for k in peak}
