"""Turn a calibration state into an amax (and an amax into a TensorRT-safe INT8 scale).

Methods (TRT_RULES K3, K4), all on the |x| histogram of a `RangeState`:

* ``max``: the running max |x| (TensorRT's MinMax calibrator). Works on any state with `.amax`.
* ``entropy``: TensorRT's EntropyCalibration2 as PyTorch's toolkit implements it. Set
  ``bins[0] = bins[1]``; for every candidate ``i`` in ``128 .. n`` (``n`` = bins up to the one that
  holds max |x|), ``P = bins[:i]`` with the outliers ``sum(bins[i:])`` folded into ``P[i-1]``, and
  ``Q`` = ``bins[:i]`` cut into 128 groups (bin j goes to group ``floor(128*j/i)``) with each group's
  total spread evenly over its non-zero bins (0 on empty bins). Both are normalised and the
  candidate with the smallest ``KL(P||Q)`` wins (+inf when ``P[i-1] > 0`` but ``Q[i-1] == 0``).
* ``percentile``: ``bin_edges[k]`` for the first bin ``k`` whose cumulative share reaches ``p/100``.
* ``mse``: over the bin centres ``c_i`` (i >= 128), the amax ``c_i`` whose fake quantisation of all
  centres gives the least count-weighted squared error.

Threshold convention (entropy). The winning ``i`` becomes ``amax = bin_edges[i] = i * width``, and
among equal divergences the *last* (largest) ``i`` wins, as in PyTorch's toolkit
(``_compute_amax_entropy``). TensorRT's own binary is not public; the GTC 2017 pseudocode writes
``(m + 0.5) * width``, half a bin higher. We follow the toolkit because it is NVIDIA's published,
runnable reference (so our numbers can be checked against it), because ``i * width`` is exactly the
right edge of the kept part of the histogram (every folded outlier is clipped to that edge, which is
what P models), and because the last argmin clips the least when divergences tie. The two
conventions differ by half a bin (1/4096 of the range), far below INT8 resolution (1/127).

Every method returns a float with ``0 < amax <= state.amax`` when ``state.amax > 0`` (a threshold
above the seen max is cut to it, and a percentile landing on 0 becomes the first bin's right edge),
and 0.0 for a state that saw only zeros (or nothing): `safe_scale` then supplies the scale.

Numerics only need numpy: the KL search is vectorised over all candidates with prefix sums
(one pass of O(128 * candidates)), and the MSE search in chunks of candidates.
"""
from __future__ import annotations

import math

import numpy as np

from .histogram import RangeState
from ..precisions.scales import INT8_MAX, ZERO_RANGE_AMAX, ZERO_RANGE_EPS, safe_scale, safe_scales  # noqa: F401

METHODS = ("max", "entropy", "percentile", "mse")

START_BIN = 128               # first candidate threshold bin (entropy and mse), as TensorRT/PTQ-TK
QUANT_LEVELS = 128            # quantised levels of |x| for the entropy method (int8 magnitude)

_MSE_CHUNK = 128              # candidate rows per block in the MSE search (bounds temp memory)


def compute_amax(state, method: str, percentile: float = 99.99) -> float:
    """amax of `state` by `method` (one of `METHODS`); see the module docstring."""
    if method not in METHODS:
        raise ValueError(f"unknown calibration method {method!r}; use one of {', '.join(METHODS)}")
    top = float(state.amax)
    if method == "max" or top <= 0.0:
        return top if top > 0.0 else 0.0
    if not isinstance(state, RangeState):
        raise TypeError(f"method {method!r} needs a histogram (RangeState), got {type(state).__name__}")
    if method == "percentile":
        p = float(percentile)
        if not (0.0 < p <= 100.0):
            raise ValueError(f"percentile must be in (0, 100], got {percentile!r}")
        amax = _percentile_amax(state, p)
    elif method == "entropy":
        amax = _entropy_amax(state)
    else:
        amax = _mse_amax(state)
    amax = min(float(amax), top)
    return amax if amax > 0.0 else top


# ------------------------------------------------------------------------------------ percentile
def _percentile_amax(state: RangeState, p: float) -> float:
    cum = np.cumsum(state.counts)
    k = int(np.searchsorted(cum, p / 100.0 * cum[-1], side="left"))
    k = min(k, state.num_bins - 1)
    # left edge of the bin where the share is reached (PTQ-TK); the right edge when that is 0
    return max(k, 1) * state.width


# --------------------------------------------------------------------------------------- entropy
def _xlogx(v: np.ndarray) -> np.ndarray:
    out = np.zeros_like(v, dtype=np.float64)
    pos = v > 0
    out[pos] = v[pos] * np.log(v[pos])
    return out


def entropy_divergences(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(candidates i, KL(P_i || Q_i)) of the entropy method for a histogram of |x|.

    `counts` is the histogram up to its last non-empty bin; ``bins[0] = bins[1]`` is applied here.
    Written out, with b = bins, T = sum(b), o_i = sum(b[i:]), S_i = T - o_i, and per group g of the
    i-split its total G_g and count of non-zero bins C_g (so Q_j = G_g / C_g on non-zero bins):

        KL_i = (sum_j P_j log P_j - sum_j P_j log Q_j) / T - log T + log S_i
        sum_j P_j log P_j = sum_{j<i-1} b_j log b_j + (b_{i-1} + o_i) log(b_{i-1} + o_i)
        sum_j P_j log Q_j = sum_g G_g log(G_g / C_g) + o_i log Q_{i-1}

    Every term is a prefix-sum difference, so all candidates cost O(128) each."""
    b = np.asarray(counts, dtype=np.float64).copy()
    n = b.size
    if n < START_BIN:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    b[0] = b[1]
    total = b.sum()
    cand = np.arange(START_BIN, n + 1, dtype=np.int64)
    cs = np.concatenate(([0.0], np.cumsum(b)))
    nzc = np.concatenate(([0], np.cumsum(b > 0)))
    xl = _xlogx(b)
    pl = np.concatenate(([0.0], np.cumsum(xl)))

    kept = cs[cand]                       # S_i
    outl = total - kept                   # o_i (clamped: rounding may leave -tiny)
    outl[outl < 0] = 0.0
    last = b[cand - 1]
    a_term = pl[cand - 1] + _xlogx(last + outl)

    g = np.arange(QUANT_LEVELS + 1, dtype=np.int64)
    starts = (g[None, :] * cand[:, None] + QUANT_LEVELS - 1) // QUANT_LEVELS   # ceil(g*i/128)
    gsum = np.diff(cs[starts], axis=1)
    gnz = np.diff(nzc[starts], axis=1).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        per_group = np.where(gsum > 0, gsum * np.log(gsum / gnz), 0.0)
        q_last = gsum[:, -1] / gnz[:, -1]     # group 127 always holds bin i-1
        b_term = per_group.sum(axis=1) + np.where((outl > 0) & (last > 0), outl * np.log(q_last), 0.0)
        kl = (a_term - b_term) / total - math.log(total) + np.log(kept)
    kl[(last == 0) & (outl > 0)] = np.inf
    kl[kept <= 0] = np.inf
    return cand, kl


def _entropy_amax(state: RangeState) -> float:
    n = state.used_bins()
    cand, kl = entropy_divergences(state.counts[:n])
    if cand.size == 0:
        return state.amax                 # fewer than 128 bins hold data: nothing to search
    best = kl.size - 1 - int(np.argmin(kl[::-1]))     # last argmin
    return float(cand[best]) * state.width


# ------------------------------------------------------------------------------------------- mse
def mse_scores(counts: np.ndarray, width: float) -> tuple[np.ndarray, np.ndarray]:
    """(candidate amaxes, score) of the MSE method: candidates are the bin centres from bin 128 on;
    the score is mean over bins of ``count * (fake_quant(centre) - centre)**2``."""
    counts = np.asarray(counts, dtype=np.float64)
    n = counts.size
    centres = (np.arange(n, dtype=np.float64) + 0.5) * width
    cands = centres[START_BIN:]
    scores = np.empty(cands.size)
    for lo in range(0, cands.size, _MSE_CHUNK):
        amax = cands[lo:lo + _MSE_CHUNK, None]
        scale = INT8_MAX / amax
        q = np.minimum(np.rint(centres[None, :] * scale), INT8_MAX) / scale
        scores[lo:lo + _MSE_CHUNK] = ((q - centres[None, :]) ** 2 * counts[None, :]).mean(axis=1)
    return cands, scores


def _mse_amax(state: RangeState) -> float:
    n = state.used_bins()
    cands, scores = mse_scores(state.counts[:n], state.width)
    if cands.size == 0:
        return state.amax
    return float(cands[int(np.argmin(scores))])
