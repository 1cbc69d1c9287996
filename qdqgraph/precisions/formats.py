"""The quantized number formats a Q/DQ model can carry, and what each means for scales and weights.

TensorRT takes the quantized type from the zero point's type (docs/TRT_RULES.md C2) and quantizes
as `clamp(round(x / s))` with round-half-to-even (C4):

- `int8`: zero point int8 0, range [-128, 127], scale = amax / 127 (TensorRT's and PyTorch's
  quantization toolkit's convention); opset 13 for per-channel weights.
- `fp8`: zero point float8e4m3fn 0, range [-448, 448] (E4M3, saturating), scale = amax / 448 (C4);
  opset 19 (the first with float8 types, C1). FP8 runs on Ada/Hopper and later (C5).
- `int4`: weights only, in blocks along the reduction axis (qdqgraph.recipes.int4_weights);
  activations stay in the float type. Opset 21 (blocked DequantizeLinear, INT4, C1).

`precision` names the format of a run (insert --precision); int8 is the default.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
from .scales import safe_scales
from .registry import precision as _record, precisions as _records

PRECISIONS = tuple(_records())
DEFAULT_PRECISION = PRECISIONS[0]
# the opset each precision's Q/DQ need (TRT_RULES C1), and why, for the messages
OPSETS = {p.name: (p.opset, p.opset_why) for p in _records().values()}


def label(precision: str | None) -> str:
    """How reports name the quantized layers of a run: INT8, FP8 (INT4 weights: INT4)."""
    return _record(precision).label


@dataclass(frozen=True)
class Format:
    """How activations and weights of one precision are quantized."""

    name: str
    qmax: float                # amax maps to this quantized value: scale = amax / qmax
    zero_point: np.dtype       # the zero point's (and the quantized tensor's) type
    min_opset: int             # the ONNX opset that has the type (and per-channel axis)

    def scale_of(self, amax):
        """float32 scale(s) for amax value(s), always finite and > 0 (TRT_RULES C3)."""
        return safe_scales(np.asarray(amax, dtype=np.float64), self.qmax)

    def quantize(self, x: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """`x / scale` in this format, as TensorRT's IQuantizeLayer (round half to even, saturate)."""
        v = x.astype(np.float32) / scale
        if self.zero_point == np.int8:
            return np.clip(np.rint(v), -128, 127).astype(np.int8)
        return np.clip(v, -self.qmax, self.qmax).astype(self.zero_point)

    def fake_quantize(self, x: np.ndarray, scale) -> np.ndarray:
        """Quantize then dequantize (float32), for measuring the error a scale causes."""
        return self.quantize(x, scale).astype(np.float32) * scale


INT8 = Format("int8", 127.0, np.dtype(np.int8), _record("int8").opset)
FP8 = Format("fp8", 448.0, np.dtype(ml_dtypes.float8_e4m3fn), _record("fp8").opset)
ACTIVATION_FORMATS = {"int8": INT8, "fp8": FP8}


def activation_format(precision: str) -> Format | None:
    """The Q/DQ format of a run's activations (and INT8/FP8 weights); None for int4 (weight-only)."""
    return ACTIVATION_FORMATS.get(precision)


# The zero-point types TensorRT takes, each selecting its quantized type (TRT_RULES C2), and the
# 4-bit types (stored two to a byte).
ZERO_POINT_TYPES = {np.dtype(np.int8): "INT8", np.dtype(ml_dtypes.float8_e4m3fn): "FP8",
                    np.dtype(ml_dtypes.int4): "INT4"}
FOUR_BIT_TYPES = (np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4))


def quantized_label(zero_point) -> str:
    """INT8, FP8 or INT4: the quantized type a Q/DQ's zero point (an array, or None) selects; INT8
    when there is none (ONNX's default) or its type is not one of ZERO_POINT_TYPES."""
    return "INT8" if zero_point is None else ZERO_POINT_TYPES.get(np.dtype(zero_point.dtype), "INT8")
