"""A convolution's geometry from its attributes, its input as receptive-field patches, and a
grouped convolution in numpy for the recipes that compute one layer alone (learned rounding's and
output-aware scales' patches, the depthwise check)."""
from __future__ import annotations

import itertools

import numpy as np
import onnx_graphsurgeon as gs


def conv_geometry(node: gs.Node, spatial: tuple, kernel: tuple):
    """(strides, dilations, pads [begins..., ends...], output sizes) of a Conv on `spatial` input
    sizes, auto_pad resolved as ONNX defines it."""
    d = len(kernel)
    strides = list(node.attrs.get("strides", [1] * d))
    dil = list(node.attrs.get("dilations", [1] * d))
    pads = list(node.attrs.get("pads", [0] * 2 * d))
    auto = node.attrs.get("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else str(auto)
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        for i in range(d):
            out = -(-spatial[i] // strides[i])
            total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dil[i] + 1 - spatial[i])
            small, large = total // 2, total - total // 2
            pads[i], pads[i + d] = (small, large) if auto == "SAME_UPPER" else (large, small)
    elif auto == "VALID":
        pads = [0] * 2 * d
    outs = [(spatial[i] + pads[i] + pads[i + d] - dil[i] * (kernel[i] - 1) - 1) // strides[i] + 1 for i in range(d)]
    return strides, dil, pads, outs


def grouped_conv(node: gs.Node, x: np.ndarray, w: np.ndarray, b: np.ndarray | None,
                 positions: np.ndarray | None = None) -> np.ndarray:
    """The Conv `node` computes on `x` [N, C, *spatial] with weight `w` [O, C/group, *kernel] and
    bias `b`, one kernel tap and input channel of a group at a time: cheap where each group reads
    few channels (a depthwise convolution reads one). With `positions` (flat indices into the
    output's spatial grid), only those outputs: [N, O, len(positions)]."""
    group = int(node.attrs.get("group", 1))
    out_ch, per_group = w.shape[0], w.shape[1]
    kernel = tuple(w.shape[2:])
    d = len(kernel)
    strides, dil, pads, outs = conv_geometry(node, x.shape[2:], kernel)
    xp = np.pad(x, [(0, 0), (0, 0)] + [(pads[i], pads[i + d]) for i in range(d)])
    at = None if positions is None else np.unravel_index(positions, outs)
    y = np.zeros((x.shape[0], out_ch, *(outs if at is None else [len(at[0])])), dtype=np.float32)
    per_out = out_ch // group
    spread = (1, out_ch) + (1,) * (d if at is None else 1)
    for ci in range(per_group):
        channels = (np.arange(out_ch) // per_out) * per_group + ci
        src = xp if per_group == 1 and per_out == 1 else xp[:, channels]
        for taps in itertools.product(*(range(k) for k in kernel)):
            if at is None:
                window = tuple(slice(taps[i] * dil[i], taps[i] * dil[i] + (outs[i] - 1) * strides[i] + 1, strides[i])
                               for i in range(d))
            else:
                window = tuple(at[i] * strides[i] + taps[i] * dil[i] for i in range(d))
            y += w[(slice(None), ci) + taps].reshape(spread) * src[(slice(None), slice(None)) + window]
    if b is not None:
        y += b.reshape(spread)
    return y


def patches(node: gs.Node, x: np.ndarray, kernel: tuple, positions: np.ndarray) -> np.ndarray:
    """The receptive fields of the output `positions` (flat indices into the output's spatial grid)
    of the Conv `node` on one sample `x` [C, *spatial], as [len(positions), C, prod(kernel)]: the
    patch of each position, channel-major, in the order of the weight's [O, C/group, *kernel]
    flattened past its first axis (a patch row times that flattened weight is the output there,
    bias aside, for one group)."""
    strides, dil, pads, outs = conv_geometry(node, x.shape[1:], kernel)
    d = len(kernel)
    xp = np.pad(x, [(0, 0)] + [(pads[i], pads[i + d]) for i in range(d)])
    pos = np.unravel_index(positions, outs)
    cols = []
    for offs in itertools.product(*(range(k) for k in kernel)):
        idx = tuple(pos[i] * strides[i] + offs[i] * dil[i] for i in range(d))
        cols.append(xp[(slice(None),) + idx])           # [C, n]
    return np.stack(cols, axis=-1).transpose(1, 0, 2)   # [n, C, prod(kernel)]


def output_positions(node: gs.Node, spatial: tuple, kernel: tuple) -> int:
    """How many output positions the Conv `node` has on input sizes `spatial`."""
    return int(np.prod(conv_geometry(node, spatial, kernel)[3]))


def patch_rows(node: gs.Node, x: np.ndarray, kernel: tuple, most: int) -> np.ndarray:
    """The receptive fields of the Conv `node` on `x` [N, C, *spatial] as rows [n, C * prod(kernel)]
    (channel-major, `patches`), of at most `most` output positions of each of the N samples,
    evenly strided over the output grid (every position where there are no more)."""
    total = output_positions(node, x.shape[2:], kernel)
    at = np.arange(0, total, position_step(total, most))
    return np.concatenate([patches(node, one, kernel, at).reshape(len(at), -1) for one in x])


def position_step(total: int, most: int) -> int:
    """The stride over `total` output positions that keeps at most `most` of them (`patch_rows`)."""
    return max(1, -(-total // most))
