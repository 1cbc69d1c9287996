"""Cross-layer equalization (insert --equalize): even out the per-channel weight ranges of two
convolutions in a row, folded into their weights.

For Conv1 -> [f] -> Conv2, where f is absent or positive-homogeneous (f(s x) = s f(x) for s > 0:
Relu, LeakyRelu, PRelu), dividing output channel i of Conv1 (its weights and bias) by s_i and
multiplying the weights that read input channel i of Conv2 by s_i leaves the model's function
unchanged. With r1_i = max|W1[i]| and r2_i = max|W2[:, i]|, s_i = sqrt(r1_i * r2_i) / r2_i gives both
weights the range sqrt(r1_i * r2_i) on channel i (Nagel et al., 2019, "Data-Free Quantization
Through Weight Equalization and Bias Correction"). Depthwise-separable networks gain most: a
depthwise conv whose BatchNorm was folded in has channel ranges orders of magnitude apart, and both
the per-tensor INT8 scale of the tensor between the two convs and the pointwise conv's per-output-
channel weight scale are sized by the largest channel, leaving the small ones a few levels.

TensorRT quantizes Conv1's weights per output channel, so r1_i itself costs nothing; what its
range stands for in the paper is the range of channel i of the tensor between the convs, which
is quantized per tensor. With calibration data, r1_i is that tensor's measured range (max |x| per
channel on the first samples, `activation_ranges`), and the scales balance the activation channels
against Conv2's input channels. Without data, the weights stand in, as in the paper. The weight
version hurt where a channel's weights are large and its activations small: silero_vad_op15's
output SQNR fell from 24.0 to 13.8 dB on its calibration samples (docs/ACCURACY.md).

Nothing is added to the graph. Clip and ReLU6 are not positive-homogeneous (scaling moves the clip
point), so a pair with one between is left alone, as is a pair whose middle tensor is read by
anything else or is a graph output. BatchNormalization is folded into the convs by the cleaning
stage before this pass runs. Pairs share convs along a chain (Conv1 -> Conv2 -> Conv3), so the
pass runs a few rounds, until the scales stop moving.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ..graph.view import GraphView
from .base import PassResult, result
from .registry import declare, describe

ROUNDS = 8
MAX_SCALE = 1e4          # s is clipped to [1/MAX_SCALE, MAX_SCALE]
CONVERGED = 1e-3         # a round whose scales all lie within 1 +- this ends the rounds


def _weighted_conv(view: GraphView, node: gs.Node) -> np.ndarray | None:
    """The constant float weight of a Conv (not ConvTranspose) with a constant or no bias, else None."""
    if not view.vocab.is_(node, "conv") or view.vocab.is_(node, "conv_transpose") or len(node.inputs) < 2:
        return None
    w = view.constant_value(node.inputs[1])
    if w is None or w.ndim < 3 or not np.issubdtype(w.dtype, np.floating):
        return None
    if len(node.inputs) > 2 and node.inputs[2].name and view.constant_value(node.inputs[2]) is None:
        return None
    return w


def _only_reader(view: GraphView, tensor: gs.Tensor) -> gs.Node | None:
    """The one node reading `tensor` (as its data input 0), when nothing else uses it."""
    if view.is_graph_output(tensor) or view.used_in_subgraph(tensor):
        return None
    users = view.consumers(tensor)
    if len(users) != 1 or users[0][1] != 0:
        return None
    return users[0][0]


def pairs(graph: gs.Graph) -> list[tuple[gs.Node, gs.Node | None, gs.Node]]:
    """(Conv1, activation or None, Conv2) for every pair equalization may rescale."""
    view = GraphView(graph)
    out = []
    for first in view.nodes:
        if _weighted_conv(view, first) is None or len(first.outputs) != 1:
            continue
        nxt = _only_reader(view, first.outputs[0])
        act = None
        if nxt is not None and view.vocab.is_(nxt, "positive_homogeneous") and len(nxt.outputs) == 1:
            act, nxt = nxt, _only_reader(view, nxt.outputs[0])
        if nxt is None or _weighted_conv(view, nxt) is None or nxt is first:
            continue
        w1, w2 = view.constant(first.inputs[1]), view.constant(nxt.inputs[1])
        if w2.shape[1] * int(nxt.attrs.get("group", 1)) != w1.shape[0]:
            continue
        if act is not None and not _slope_ok(view, act, w1.shape[0]):
            continue
        out.append((first, act, nxt))
    return out


def _slope_ok(view: GraphView, act: gs.Node, channels: int) -> bool:
    """A PRelu's slope must be a constant that is one value or one per channel (axis 1): the
    scale of a channel then passes through it."""
    if len(act.inputs) < 2:
        return True
    slope = view.constant_value(act.inputs[1])
    if slope is None:
        return False
    shape = list(np.shape(slope))
    if int(np.prod(shape)) == 1:
        return True
    if int(np.prod(shape)) != channels:
        return False
    # broadcast against [N, C, ...]: the channel axis is the fourth from the end of a 4-D input,
    # so a slope [C, 1, 1] or [1, C, 1, 1] is per channel
    return (len(shape) == 3 and shape[0] == channels) or (len(shape) == 4 and shape[1] == channels)


def _in_ranges(w2: np.ndarray, group: int) -> np.ndarray:
    """max |W2| per input channel of Conv2 (over the outputs that read it)."""
    o, cg = w2.shape[0], w2.shape[1]
    per = np.abs(w2).reshape(group, o // group, cg, -1).max(axis=(1, 3))     # [group, C/g]
    return per.reshape(-1)


def _in_scale(w2: np.ndarray, group: int, s: np.ndarray) -> np.ndarray:
    """W2 with the weights of input channel c multiplied by s[c]."""
    o, cg = w2.shape[0], w2.shape[1]
    per_out = s.reshape(group, 1, cg).repeat(o // group, axis=1).reshape(o, cg)
    return w2 * per_out.reshape(o, cg, *([1] * (w2.ndim - 2)))


def _scales(w1: np.ndarray, w2: np.ndarray, group: int) -> np.ndarray:
    r1 = np.abs(w1).reshape(w1.shape[0], -1).max(axis=1).astype(np.float64)
    r2 = _in_ranges(w2, group).astype(np.float64)
    s = np.ones_like(r1)
    ok = (r1 > 0) & (r2 > 0)
    s[ok] = np.sqrt(r1[ok] * r2[ok]) / r2[ok]
    return np.clip(s, 1 / MAX_SCALE, MAX_SCALE)


@dataclass
class ChannelStats:
    """Of the tensor between a pair's convs, per channel: max |x| and the mean of x^2."""
    peak: np.ndarray
    mean_square: np.ndarray

    def scaled(self, s: np.ndarray) -> "ChannelStats":
        return ChannelStats(self.peak / s, self.mean_square / s ** 2)


def noise(stats: ChannelStats, w2: np.ndarray, group: int) -> float:
    """The INT8 rounding noise power at Conv2's output (an estimate, in its units, which scaling
    leaves alone): the tensor between the convs per tensor (step max|x| / 127, variance step^2 /
    12, through every weight that reads it) plus Conv2's weights per output channel (step
    max|W2[o]| / 127, through the mean square of the inputs it reads)."""
    o, cg = w2.shape[0], w2.shape[1]
    step_a = float(stats.peak.max()) / 127
    n_act = step_a ** 2 / 12 * float(np.sum(w2 ** 2))
    step_w = np.abs(w2).reshape(o, -1).max(axis=1) / 127
    taps = int(np.prod(w2.shape[2:])) if w2.ndim > 2 else 1
    per_group = stats.mean_square.reshape(group, cg).sum(axis=1) * taps          # [group]
    n_w = float(np.sum(step_w ** 2 / 12 * np.repeat(per_group, o // group)))
    return n_act + n_w


STRENGTHS = (0.0, 0.25, 0.5, 0.75, 1.0)   # s ** strength tried where data chooses it


@declare("equalize")
def equalize(graph: gs.Graph, stats: dict[str, ChannelStats] | None = None, rounds: int = ROUNDS,
             choose: bool = False) -> PassResult:
    """Equalize every pair of `pairs(graph)` in place, for up to `rounds` rounds; `stats` (from
    `activation_ranges`) stand for Conv1's range where they have its pair. `choose`: with stats,
    apply s ** t for the t of STRENGTHS whose `noise` is least (t = 0: the pair is left as it is),
    so a pair is equalized only where the estimate says it gains. Details: `pairs` ([Conv1, Conv2]
    names of the pairs scaled), `rounds` (how many ran), `spread` ({Conv1: the largest over the
    smallest scale applied in its first round}), `measured` (pairs scaled by measured ranges),
    `noise_db` ({Conv1: the estimate's change, dB, over all rounds})."""
    found = pairs(graph)
    if not found:
        return result("equalize", False, pairs=[], rounds=0, spread={}, measured=0, noise_db={}, rescaled=[])
    view = GraphView(graph)
    w, b = _weights(view, found)
    act = {f.name: stats[f.name] for f, _, _ in found
           if stats and f.name in stats and stats[f.name].peak.size == w[f.name].shape[0]}
    spread: dict[str, float] = {}
    start_noise: dict[str, float] = {}
    done = 0
    for done in range(1, rounds + 1):
        moved = 0.0
        for first, _, second in found:
            s = _pair_scale(first, second, act, w, choose, start_noise)
            if s is None or np.all(s == 1.0):
                continue
            if first.name in act:
                act[first.name] = act[first.name].scaled(s)
            spread.setdefault(first.name, float(s.max() / s.min()))
            _rescale(first, second, s, w, b)
            moved = max(moved, float(np.max(np.abs(np.log(s)))))
        if moved < CONVERGED:
            break
    scaled = [(f, sc) for f, _, sc in found if f.name in spread]
    # the tensors between each scaled pair carry its scale: their values are no longer the float model's
    rescaled = sorted(t.name for f, act_node, _ in found if f.name in spread
                      for t in (f.outputs[0], *(act_node.outputs if act_node is not None else ())))
    noise_db = {f.name: round(10 * float(np.log10(noise(act[f.name], w[sc.name], int(sc.attrs.get("group", 1)))
                                                  / start_noise[f.name])), 2)
                for f, sc in scaled if f.name in start_noise and start_noise[f.name] > 0}
    _write_back(graph, view, {n.name for f, sc in scaled for n in (f, sc)}, w, b)
    return result("equalize", bool(scaled), pairs=[[f.name, sc.name] for f, sc in scaled], rounds=done,
                  spread={k: round(v, 2) for k, v in spread.items()}, measured=len(act), noise_db=noise_db,
                  rescaled=rescaled)


def _weights(view: GraphView, found) -> tuple[dict, dict]:
    """Each paired Conv's weight and bias (None without one), float64."""
    w: dict[str, np.ndarray] = {}
    b: dict[str, np.ndarray | None] = {}
    for first, _, second in found:
        for node in (first, second):
            if node.name not in w:
                w[node.name] = view.constant(node.inputs[1]).astype(np.float64)
                b[node.name] = (view.constant(node.inputs[2]).astype(np.float64)
                                if len(node.inputs) > 2 and node.inputs[2].name else None)
    return w, b


def _pair_scale(first: gs.Node, second: gs.Node, act: dict, w: dict, choose: bool,
                start_noise: dict) -> np.ndarray | None:
    """The per-channel scale of one pair this round: by Conv1's measured range where there is one
    (else its weight), at the strength of least estimated noise when `choose`; None: nothing to
    choose by."""
    group = int(second.attrs.get("group", 1))
    a = act.get(first.name)
    if a is None and choose:
        return None                    # nothing measured to choose by
    s = _scales(w[first.name] if a is None else a.peak.reshape(-1, 1), w[second.name], group)
    if a is not None and choose:
        start_noise.setdefault(first.name, noise(a, w[second.name], group))
        trials = {t: noise(a.scaled(s ** t), _in_scale(w[second.name], group, s ** t), group) for t in STRENGTHS}
        s = s ** min(trials, key=lambda t: (trials[t], t))
    return s


def _rescale(first: gs.Node, second: gs.Node, s: np.ndarray, w: dict, b: dict) -> None:
    """Conv1's output channels (and bias) divided by `s`, Conv2's input channels multiplied."""
    w[first.name] = w[first.name] / s.reshape(-1, *([1] * (w[first.name].ndim - 1)))
    if b[first.name] is not None:
        b[first.name] = b[first.name] / s
    w[second.name] = _in_scale(w[second.name], int(second.attrs.get("group", 1)), s)


def _write_back(graph: gs.Graph, view: GraphView, changed: set[str], w: dict, b: dict) -> None:
    """The rescaled weights and biases as new constants of the changed Convs, in their types."""
    nodes = {n.name: n for n in graph.nodes}
    for name in sorted(changed):
        node = nodes[name]
        dtype = view.constant(node.inputs[1]).dtype
        node.inputs[1] = gs.Constant(f"{name}_weight_equalized", w[name].astype(dtype))
        bias = b[name]
        if bias is not None:
            node.inputs[2] = gs.Constant(f"{name}_bias_equalized", bias.astype(view.constant(node.inputs[2]).dtype))


def _equalized(results) -> dict | None:
    return results[-1].details if results and results[-1].changed else None


def _equalized_lines(results, ctx) -> list[str]:
    eq = _equalized(results)
    if not eq:
        return []
    return [f"equalized: {len(eq['pairs'])} Conv pairs ({eq['rounds']} rounds; widest per-channel "
            f"scale spread {max(eq['spread'].values()):.3g}x)"]


describe("equalize", 67, lines=_equalized_lines, fields={"equalized": _equalized})
