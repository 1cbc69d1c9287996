"""What the slow tier and benchmarks/build_engines.py build: a real model's float, INT8, FP8, INT4
and FP32-island outputs, each compiled by TensorRT for RTX, its engine read back and checked
against the prediction."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from ..graph import io
from ..backends import BuildOptions, tensorrt_rtx
from ..backends.profiles import profiles
from ..config import QuantizeConfig
from ..errors import QdqError
from ..prepare import model_inputs, read_data
from ..trtsim import kernel_agreement, simulate
from ..trtsim.diff import standalone_kernels

# variant -> QuantizeConfig keywords (None: the float model as it is)
VARIANTS: dict[str, dict | None] = {
    "float": None,
    "int8": {},
    "fp8": {"precision": "fp8"},
    "int4": {"precision": "int4"},
    "int8-fp32": {"high_precision": "fp32"},
    "int8-rtx": {"target": "tensorrt-rtx"},       # placed for TensorRT for RTX
}


@dataclass
class Built:
    model: str
    variant: str
    seconds: float = 0.0                 # the compiler's build time
    insert_seconds: float = 0.0
    engine_bytes: int = 0
    targets: list[str] = field(default_factory=list)
    kernels: int = 0
    agreement: dict = field(default_factory=dict)
    not_quantized: list[str] = field(default_factory=list)   # kernels predicted quantized, compiled float
    quantize_kernels: tuple[int, int] = (0, 0)               # standalone quantize kernels: predicted, compiled
    datacenter_reformats: int = 0                            # the same predicted by the datacenter rules
    warnings: list[str] = field(default_factory=list)
    skipped: str = ""                    # why this variant does not apply to the model

    def row(self) -> str:
        if self.skipped:
            return f"| {self.model} | {self.variant} | - | - | - | - | - | {self.skipped} |"
        a = self.agreement
        share = f"{a['agree']}/{a['compute_kernels']}" if a else "-"
        return (f"| {self.model} | {self.variant} | {self.insert_seconds:.1f} | {self.seconds:.1f} | "
                f"{self.engine_bytes / 1e6:.2f} | {share} | {self.quantize_kernels[0]} / {self.quantize_kernels[1]} | "
                f"{len(self.warnings)} warning(s) |")


def quantized_model(model: Path, calib: Path, variant: str) -> onnx.ModelProto:
    """The model as the variant writes it (the float model itself for "float")."""
    from ..pipeline import quantize
    options = VARIANTS[variant]
    if options is None:
        return onnx.load(str(model))
    return quantize(model, str(calib), config=QuantizeConfig(**options)).model


def build_variant(model: Path, calib: Path, variant: str, out_dir: Path) -> Built:
    """Quantize `model` as `variant`, write it to out_dir, build it with TensorRT for RTX (profile
    from the calibration data's shapes) and check its compute kernels against the prediction."""
    out = Built(model.stem, variant)
    t0 = time.perf_counter()
    try:
        m = quantized_model(model, calib, variant)
    except QdqError as e:
        if variant == "int4" and "MatMul or Gemm" in e.problem:
            out.skipped = "no MatMul/Gemm weight to store in INT4"
            return out
        if variant == "int4" and "not divisible by the INT4 block size" in e.problem:
            out.skipped = "a GEMM's K is not a multiple of the INT4 block size"
            return out
        raise
    out.insert_seconds = time.perf_counter() - t0
    path = Path(out_dir) / f"{model.stem}.{variant}.onnx"
    io.save(m, path, force=True)
    loaded = io.load(path)
    data = read_data(loaded, str(calib), QuantizeConfig())
    sim = simulate(loaded.graph, target=tensorrt_rtx.NAME)
    plan = path.with_suffix(".engine")
    result = tensorrt_rtx.build(path, plan, BuildOptions(profiles=profiles(model_inputs(loaded.graph), data),
                                                         formats=sim.formats, force=True))
    out.seconds, out.engine_bytes = result.seconds, os.path.getsize(plan)
    out.targets, out.warnings = result.targets, result.warnings
    if result.engine is not None:
        out.kernels = len(result.engine.layers)
        agreement = kernel_agreement(sim, result.engine)
        out.agreement = agreement.summary()
        out.quantize_kernels = (len(sim.reformats), len(standalone_kernels(sim, result.engine)))
        out.datacenter_reformats = len(simulate(loaded.graph).reformats)
        out.not_quantized = [c.kernel for c in agreement.checks
                             if c.predicted == "quantized" and c.compiled not in ("int8", "fp8", "int4")]
    return out
