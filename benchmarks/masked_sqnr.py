#!/usr/bin/env python3
"""Output SQNR of a quantized transformer against float, split by the attention mask: over all
positions, the real tokens and the padded positions, and along the depth (every LayerNormalization
output of the float model that the quantized model still has by name).

    .venv/bin/python benchmarks/masked_sqnr.py FLOAT.onnx DATA.npz QUANT.onnx [--mask attention_mask]
                                               [--samples odd|even|first8]

DATA: arrays named like the model inputs, first axis = sample (a zoo data file: `odd` scores the
held-out half, the calibration file holding the even-indexed samples; `first8` the first 8, what
`qdqgraph insert` prints). A [batch, seq] mask input says which positions are tokens; tensors with a
seq-long axis after the first are split along it. One line per tensor: SQNR all / real / padded
(dB) and the padded positions' share of the error.
"""
from __future__ import annotations

import argparse

import numpy as np
import onnx
import onnxruntime as ort


def session(path: str, extra: list[str]) -> ort.InferenceSession:
    m = onnx.shape_inference.infer_shapes(onnx.load(path))
    types = {v.name: v.type.tensor_type.elem_type for v in m.graph.value_info}
    made = {o for n in m.graph.node for o in n.output}
    have = {o.name for o in m.graph.output}
    for e in extra:
        if e in made and e not in have:
            m.graph.output.append(onnx.helper.make_tensor_value_info(e, types.get(e, onnx.TensorProto.FLOAT), None))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def db(signal: float, noise: float) -> float:
    return float(10 * np.log10(signal / noise)) if noise > 0 else float("inf")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("float_model")
    ap.add_argument("data")
    ap.add_argument("quant_model")
    ap.add_argument("--mask", default="attention_mask")
    ap.add_argument("--samples", choices=["odd", "even", "first8"], default="odd")
    a = ap.parse_args()
    data = np.load(a.data)
    names = [k for k in data.files if k != "__meta__"]
    if a.mask not in names:
        print(f"masked_sqnr: {a.data} has no '{a.mask}' array; pass --mask NAME of the [batch, seq] mask input")
        return 2
    n = data[names[0]].shape[0]
    index = {"odd": range(1, n, 2), "even": range(0, n, 2), "first8": range(min(n, 8))}[a.samples]
    norms = [nd.output[0] for nd in onnx.load(a.float_model).graph.node if nd.op_type == "LayerNormalization"]
    fs, qs = session(a.float_model, norms), session(a.quant_model, norms)
    f_out, q_out = [o.name for o in fs.get_outputs()], {o.name for o in qs.get_outputs()}
    sums: dict[str, np.ndarray] = {}
    for i in index:
        feed = {k: data[k][i] for k in names}
        real = data[a.mask][i].reshape(-1).astype(bool)
        ref = dict(zip(f_out, fs.run(None, {k: v for k, v in feed.items() if k in {x.name for x in fs.get_inputs()}})))
        got = dict(zip([o.name for o in qs.get_outputs()],
                       qs.run(None, {k: v for k, v in feed.items() if k in {x.name for x in qs.get_inputs()}})))
        for name in f_out:
            if name not in q_out:
                continue
            x, y = ref[name].astype(np.float64), got[name].astype(np.float64)
            axis = next((j for j in range(1, x.ndim) if x.shape[j] == real.size), None)
            s = sums.setdefault(name, np.zeros(6))
            s[:2] += [np.sum(x ** 2), np.sum((x - y) ** 2)]
            if axis is not None:
                xm, ym = np.moveaxis(x, axis, 0), np.moveaxis(y, axis, 0)
                s[2:] += [np.sum(xm[real] ** 2), np.sum((xm - ym)[real] ** 2),
                          np.sum(xm[~real] ** 2), np.sum((xm - ym)[~real] ** 2)]
    print(f"{'tensor':70s} {'all':>6s} {'real':>6s} {'padded':>6s}  padded share of the error")
    for name, s in sums.items():
        split = f" {db(s[2], s[3]):6.1f} {db(s[4], s[5]):6.1f}  {s[5] / s[1]:.2f}" if s[2] and s[1] else ""
        print(f"{name[-70:]:70s} {db(s[0], s[1]):6.1f}{split}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
