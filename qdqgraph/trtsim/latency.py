"""The latency estimate (qdqgraph/trtsim/estimate.py) of a predicted engine: the simulator's layers turned
into the estimate's per-layer work, so a Q/DQ model and its float original can be compared on a
named GPU before any engine is built ("INT8 estimated 1.9x faster than FP16 on ... (roofline
estimate)").

The conversion, per simulated layer:
- bytes: every input and output port's tensor (its shape from the simulation, symbolic dims counted
  as 1) times its precision's size, plus the layer's weights: each constant of two or more dimensions
  that a node of the layer reads, at 1 byte when the layer computes in INT8 (or FP8) and at the float
  size otherwise. Tensors are counted linear: the channel padding of TensorRT's vectorized formats is
  not known before the build;
- flops: the simulator's own count for the layer (convolutions and GEMMs, qdqgraph/trtsim/flops.py);
- precision: the first input's; float ports are taken as `float_precision` (FP16 by default, what
  TensorRT runs float layers in when FP16 is enabled, as in NVIDIA's --best oracles);
- kinds: convolution, gemm and matmul layers (a MatMul's GEMM, weighted or batched) are placed on
  the math roof, every other layer (reformat, pooling, elementwise, shuffle, ...) on the bandwidth
  roof; each layer is one kernel.
Layout reformats that TensorRT adds between formats are not predicted by the simulator and so are
not counted.
"""
from __future__ import annotations

import math

from .estimate import Constants, Estimate, LayerEstimate, LayerWork, fitted, gpu, layer_ms
from .report import Layer, SimReport

_SIZE = {"int8": 1, "fp8": 1, "int4": 0.5, "fp16": 2, "bf16": 2, "fp32": 4}
_MATH_KINDS = {"convolution": "conv", "gemm": "gemm", "matmul": "gemm"}


def _elements(shape) -> int:
    if not shape:
        return 1
    return math.prod(d if isinstance(d, int) and d > 0 else 1 for d in shape)


def _precision(p: str | None, float_precision: str) -> str:
    return float_precision if p in (None, "fp32", "fp16", "bf16") else p


def _weights(sim: SimReport, layer: Layer) -> int:
    """Elements of the constants (two or more dimensions) that the layer's nodes read."""
    if sim.final is None:
        return 0
    g = sim.final[0]
    seen, total = set(), 0
    for name in layer.nodes:
        node = g.nodes.get(name)
        if node is None:
            continue
        for t in node.inputs:
            st = g.tensors.get(t) if t else None
            if st is not None and st.value is not None and st.value.ndim >= 2 and t not in seen:
                seen.add(t)
                total += int(st.value.size)
    return total


def layer_work(sim: SimReport, layer: Layer, float_precision: str = "fp16") -> LayerWork:
    def port_bytes(p) -> float:
        return _elements(sim.shapes.get(p.tensor)) * _SIZE.get(_precision(p.precision, float_precision), 4)

    kind = _MATH_KINDS.get(layer.kind, "memory")
    first = _precision(layer.inputs[0].precision if layer.inputs else None, float_precision)
    weight_size = 1 if first in ("int8", "fp8") else _SIZE.get(first, 4)
    nbytes = sum(port_bytes(p) for p in layer.inputs + layer.outputs) + _weights(sim, layer) * weight_size
    flops = layer.flops if kind != "memory" else 0.0
    precision = first if flops else None
    return LayerWork(layer.name, layer.kind, kind, float(nbytes), float(flops), precision)


def estimate_sim(sim: SimReport, gpu_name: str, float_precision: str = "fp16",
                 constants: Constants | None = None) -> Estimate:
    """The predicted engine `sim` on the GPU named `gpu_name` (rules/gpus.toml)."""
    g = gpu(gpu_name)
    c = constants or fitted()
    layers = []
    for layer in sim.layers:
        w = layer_work(sim, layer, float_precision)
        layers.append(LayerEstimate(w, layer_ms(w, g, c)))
    return Estimate(g, c, layers, "predicted engine")


def speed_line(quantized: SimReport, float_engine: SimReport | float, gpu_name: str) -> str:
    """One line for a summary: the quantized engine against the FP16 engine of the same model
    (`float_engine`: its prediction, or its estimate in ms, `estimate_sim(...).total_ms`)."""
    q = estimate_sim(quantized, gpu_name)
    f = estimate_sim(float_engine, gpu_name).total_ms if isinstance(float_engine, SimReport) else float(float_engine)
    label = quantized.quantized if quantized.quantized else "quantized"
    ratio = f / q.total_ms if q.total_ms else float("inf")
    verdict = f"{ratio:.2f}x faster than" if ratio >= 1 else f"{1 / ratio:.2f}x slower than"
    return (f"{label} estimated {verdict} FP16 on {q.gpu.title} ({q.total_ms:.3f} vs {f:.3f} ms; "
            f"roofline estimate, not a measurement)")


# the GPU a summary's estimate names when the user names none: one each compiler targets
DEFAULT_GPU = {"tensorrt": "a100-sxm4-80gb", "tensorrt-rtx": "rtx-4090"}

