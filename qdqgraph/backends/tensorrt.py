"""Datacenter TensorRT (the `tensorrt` package, 8.x to 11.x): build a plan from a Q/DQ model and read
the engine back through the engine inspector, which needs the GPU the engine was built for.

- TensorRT >= 10: a strongly typed network (STRONGLY_TYPED; the only mode in 11): every tensor runs
  in its ONNX type, no precision flags;
- TensorRT 8/9: an explicit-batch network with the INT8 and FP16 builder flags (docs/TRT_RULES.md C7);
- the version is read from the package itself and must look like TensorRT's (8 to 11 and later);
  another compiler that also calls itself `tensorrt` is refused, not mistaken for TensorRT 1.

NOT RUN AGAINST A REAL DATACENTER TENSORRT: its wheels fetch their libraries from NVIDIA's own index
and cannot be installed on the project's machines, which have no GPU either. What surrounds the build
is tested (arguments, version detection, the missing-TensorRT error, the reader of the inspector's
JSON on NVIDIA's published reports); the build code is the API shared with TensorRT for RTX, whose
builds are tested for real (backends/tensorrt_rtx.py).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import QdqError
from ..trtsim.engine_report import parse_engine_info
from . import base
import time

NAME = "tensorrt"
INSTALL = ("install TensorRT on a machine with an NVIDIA GPU: pip install 'qdqgraph[trt]' "
           "--extra-index-url https://pypi.nvidia.com")
OLDEST = 8


def import_module():
    """The `tensorrt` module, or a QdqError naming what is missing and how to install it."""
    trt = base.import_compiler("tensorrt", "TensorRT", INSTALL)
    major(trt)
    return trt


def major(trt) -> int:
    """TensorRT's major version from `trt.__version__` ('10.13.0.35' -> 10); a version that is not
    TensorRT's numbering (another compiler's package, or none) is a QdqError."""
    version = str(getattr(trt, "__version__", ""))
    m = re.match(r"(\d+)\.\d+", version)
    if not m or int(m.group(1)) < OLDEST:
        raise QdqError(f"the installed `tensorrt` package reports version {version or 'none'!r}, which is not "
                       f"a TensorRT release ({OLDEST}.x or later)",
                       "install datacenter TensorRT (qdqgraph[trt]), or build with --backend tensorrt-rtx")
    return int(m.group(1))


def available() -> str | None:
    return base.unavailable(import_module)


def _network_flags(trt) -> tuple[int, bool]:
    flags = 0
    if major(trt) >= 10 and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED), True
    if major(trt) >= 11:
        return 0, True                        # TensorRT 11 is always strongly typed
    if hasattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    return flags, False


def build(model, plan: Path, options: base.BuildOptions) -> base.BuildResult:
    trt = import_module()
    t0 = time.perf_counter()
    log = base.Log(trt, options.verbose)
    flags, strongly = _network_flags(trt)

    def configure(config):
        if not strongly:
            config.set_flag(trt.BuilderFlag.INT8)     # mandatory for Q/DQ networks before strong typing (C7)
            config.set_flag(trt.BuilderFlag.FP16)     # float islands in FP16, as --best does
        if options.compute_capabilities:
            raise QdqError("--compute-capability is a TensorRT for RTX option",
                           "datacenter TensorRT builds for the GPU it runs on; drop the flag")

    data, cache = base.compile_onnx(trt, model, options, log, flags=flags, configure=configure, gpu_needed=True)
    base.write_plan(plan, data, cache, options)
    out = base.BuildResult(plan, NAME, str(trt.__version__), strongly, seconds=time.perf_counter() - t0,
                           warnings=log.warnings(), repaired=log.notes)
    engine = trt.Runtime(log.logger).deserialize_cuda_engine(data)
    if engine is None:
        out.engine_note = "layer information needs the GPU the engine was built for (the engine did not load)"
        return out
    info = engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON)
    out.engine = parse_engine_info(json.loads(info), str(plan))
    return out
