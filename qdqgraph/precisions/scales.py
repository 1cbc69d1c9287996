"""Scale arithmetic shared by every format: amax to a float32 scale TensorRT takes.

TensorRT rejects a scale that is zero, negative or not a finite number (docs/TRT_RULES.md C3), and
quantizes as clamp(round(x / s)) (C4); every scale qdqgraph writes comes from here.
"""
from __future__ import annotations

import math

import numpy as np

INT8_MAX = 127                # scale = amax / 127 (TRT_RULES C4)
ZERO_RANGE_EPS = 2.0 ** -24   # an amax at or below this counts as zero (PTQ-TK, TRT_RULES C3)
ZERO_RANGE_AMAX = 1.0
"""amax used by `safe_scale` for a tensor whose range is zero (or not a finite number).

Any positive scale represents an all-zero tensor exactly, so the choice only matters if the tensor
turns non-zero at inference. PyTorch's toolkit uses a scale of 1.0 (amax 127), which rounds every
|x| < 0.5 to zero; we use amax 1.0, i.e. scale 1/127 (``3c010204`` in a TensorRT cache, TRT_RULES
K1): the grid of a tensor calibrated to [-1, 1], the usual range of normalised activations."""


def safe_scale(amax, qmax: float = INT8_MAX) -> np.float32:
    """Scale ``amax / qmax`` (INT8: 127, FP8: 448) as float32, always finite and > 0 (TRT rejects 0,
    NaN, negatives).

    An amax that is not finite or is <= 2**-24 (zero range) gets `ZERO_RANGE_AMAX` / qmax; an amax so
    large that its scale overflows float32 gets the largest finite float32."""
    a = float(amax)
    if not (math.isfinite(a) and a > ZERO_RANGE_EPS):
        a = ZERO_RANGE_AMAX
    f32max = float(np.finfo(np.float32).max)
    return np.float32(min(a / qmax, f32max))


def safe_scales(amax: np.ndarray, qmax: float = INT8_MAX) -> np.ndarray:
    """`safe_scale` of each element (per-channel scales), the same float32 values, vectorised."""
    a = np.array(amax, dtype=np.float64, copy=True)
    a[~(np.isfinite(a) & (a > ZERO_RANGE_EPS))] = ZERO_RANGE_AMAX
    return np.minimum(a / qmax, float(np.finfo(np.float32).max)).astype(np.float32)
