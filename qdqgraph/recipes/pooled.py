"""Output-aware scales for a layer whose output a global max pool reads: the error measured where
the maximum is read.

A text or signal CNN often ends its convolutions in a global max pool: each output channel keeps
one position of each sample, the largest, and those positions are where the input's rare large
values sit. The search's usual measure, the output error over a strided sample of positions,
sees few of them; it prefers a range that clips them and no smoothing, while the pool reads the
clipped values. Measured on a file-type classifier (a LayerNorm output, 256 channels, 5x1 conv,
GELU, global max pool), on the pooled values: 25.4 dB at the range the usual measure picks,
26.8 at the calibrated one, 35.7 at the best plain range (no clipping), 40.5 dB with a smoothing
at alpha 0.8 and no clipping.

For such a layer (`max_pooled`), `PooledRows` keeps, of each sample it is shown, the input rows of
the positions where each output channel peaks in float; `errors` measures each candidate by the
error of the layer's output at those (position, channel) pairs, relative to the float peaks: one
row a channel a sample, K multiply-adds each. Where several convolutions read the tensor (a text
CNN's kernel sizes), each keeps its own rows and peaks, their errors add up, and one smoothing
factor per input channel serves them all. The peaks are the layer's own (before its bias and
the ops up to the pool): where the pool reads them as long as those ops increase with their
input where the maxima are (a bias, ReLU, GELU, SiLU, tanh, a positive scale); an op that turns
the order over (a negative scale) makes the measure read other positions than the pool does.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ..graph.view import GraphView

MAX_REGION = 32          # ops between the layer and the pool, at most
POOLED_ROWS = 16384      # distinct peak rows kept over all samples, at most


def max_pooled(view: GraphView, node: gs.Node) -> bool:
    """Does every path from `node`'s output end in a global max pool (class `max_over_positions`),
    through at most MAX_REGION ops of class `to_max_pool` whose other inputs are constants or
    tensors of the same region, none of it a graph output or read by a subgraph or another op?"""
    start = node.outputs[0]
    tensors = {start.name}
    region: dict[int, gs.Node] = {}
    todo = [start]
    pools = 0
    while todo:
        t = todo.pop()
        users = view.consumers(t)
        if not users or view.is_graph_output(t) or view.used_in_subgraph(t):
            return False
        for user, _ in users:
            if view.vocab.is_(user, "max_over_positions") and global_max(view, user):
                pools += 1
                continue
            if not view.vocab.is_(user, "to_max_pool") or len(user.outputs) != 1:
                return False
            if id(user) not in region:
                region[id(user)] = user
                if len(region) > MAX_REGION:
                    return False
                tensors.add(user.outputs[0].name)
                todo.append(user.outputs[0])
    inputs = (x for n in region.values() for x in n.inputs if x.name)
    return pools > 0 and all(x.name in tensors or view.is_constant(x) for x in inputs)


def global_max(view: GraphView, node: gs.Node) -> bool:
    """Does `node` (class `max_over_positions`) take the maximum over every axis of its input past
    the first two (batch, channels), each channel its own: a GlobalMaxPool; a ReduceMax over exactly
    those axes (PyTorch's `x.amax(dim=2)`); a MaxPool whose window covers the whole of a static input,
    unpadded (`F.max_pool1d(x, x.size(2))`)?"""
    if view.vocab.is_(node, "global_max_pool"):
        return True
    shape = view.shape(node.inputs[0]) if node.inputs else None
    if shape is None or len(shape) < 3:
        return False
    rank = len(shape)
    spatial = set(range(2, rank))
    if view.vocab.is_(node, "reduce_max"):
        axes = node.attrs.get("axes")
        if axes is None and len(node.inputs) > 1 and node.inputs[1].name:
            value = view.constant_value(node.inputs[1])
            axes = None if value is None else value.reshape(-1).tolist()
        return axes is not None and {int(a) % rank for a in axes} == spatial
    if view.vocab.is_(node, "max_pool"):
        sizes = list(shape[2:])
        kernel = list(node.attrs.get("kernel_shape", []))
        pads = list(node.attrs.get("pads", [0] * 2 * len(kernel)))
        auto = node.attrs.get("auto_pad", "NOTSET")
        auto = auto.decode() if isinstance(auto, bytes) else str(auto)
        dilations = list(node.attrs.get("dilations", [1] * len(kernel)))
        return all(isinstance(d, int) for d in sizes) and kernel == sizes and not any(pads) and \
            auto in ("NOTSET", "VALID") and all(d == 1 for d in dilations) and len(node.outputs) == 1
    return False


class PooledRows:
    """Of each sample, the input rows at the positions where each of one layer's M output channels
    peaks in float, and which row each channel reads; at most POOLED_ROWS distinct rows in all.
    `node` and `kernel`: the convolution whose receptive fields the rows are (conv_math.patch_rows);
    `taps`: the values of each input channel in a row."""

    def __init__(self, w: np.ndarray, taps: int = 1, node: gs.Node | None = None, kernel: tuple = ()):
        self.w = w                                  # [K, M]
        self.taps, self.node, self.kernel = taps, node, kernel
        self.rows: list[np.ndarray] = []            # per sample: [u, K]
        self.pick: list[np.ndarray] = []            # per sample: [M], indices into its rows
        self.count = 0

    def full(self) -> bool:
        return self.count >= POOLED_ROWS

    def add(self, x: np.ndarray) -> None:
        """One sample's rows [P, K], every position of the layer's output."""
        if self.full() or x.shape[0] == 0:
            return
        peak = (x @ self.w).argmax(axis=0)
        kept, pick = np.unique(peak, return_inverse=True)
        self.rows.append(np.ascontiguousarray(x[kept]))
        self.pick.append(pick.reshape(-1))
        self.count += len(kept)

    def peaks(self) -> list[np.ndarray]:
        """The float output at each channel's peak, per sample ([M] each)."""
        m = np.arange(self.w.shape[1])
        return [(r @ self.w)[p, m] for r, p in zip(self.rows, self.pick)]


def errors(layers: list[tuple], quant, ranges: list[float], part: int | None = None) -> list[float]:
    """The relative error of the layers' outputs at their float peaks, for each of `ranges`, over
    all of `layers` [(PooledRows, its peaks, s over its rows' columns, its weight [K, M] quantized)]
    (the layers that read one tensor): the input divided by s and quantized at the range
    (`quant(x, amax)`); on the first `part` samples (all when None)."""
    norm, parts = 0.0, []
    for pooled, peaks, s, wq in layers:
        k = len(pooled.rows) if part is None else min(part, len(pooled.rows))
        norm += float(sum(np.sum(v.astype(np.float64) ** 2) for v in peaks[:k]))
        parts.append(([r / s for r in pooled.rows[:k]], pooled.pick, peaks, np.ascontiguousarray(wq.T)))
    out = []
    for amax in ranges:
        total = 0.0
        for scaled, picks, peaks, wt in parts:
            for r, p, f in zip(scaled, picks, peaks):
                q = quant(r, amax)[p]                    # [M, K]: the row each channel peaks at
                e = np.einsum("mk,mk->m", q, wt) - f
                total += float(np.sum(e.astype(np.float64) ** 2))
        out.append(total / (norm or 1.0))
    return out
