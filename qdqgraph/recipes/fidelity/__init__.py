"""Measured decisions that bring a default run's outputs close to float: bias correction where it
helps, fragile heads kept float, and a FLOP-aware fallback up to an output-SQNR floor.

Each decision is taken on the model as quantize() writes it (inserted and deployed on a copy,
float islands and all), run in onnxruntime as TensorRT computes it, against the float model's
outputs on the first calibration samples (`reference`)."""
from .measure import Reference, Fidelity, reference, fidelity_of
from .heads import fragile_outputs, head_units, may_have_heads
from .floor import node_flops, floor_units
from .floor import ranked as floor_ranked

__all__ = ["Reference", "Fidelity", "reference", "fidelity_of", "fragile_outputs", "head_units", "may_have_heads",
           "node_flops", "floor_units", "floor_ranked"]
