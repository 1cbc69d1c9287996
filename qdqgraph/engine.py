"""Build a TensorRT engine from a Q/DQ model and read back what TensorRT made of it.

Written to TensorRT's documented Python API (docs/TRT_RULES.md C6-C8); `tensorrt` is imported only
here and only when a build is asked for:

- TensorRT >= 10: a strongly typed network (NetworkDefinitionCreationFlag.STRONGLY_TYPED; the only
  mode in 11, where the flag is ignored) and no precision flags: every tensor runs in its ONNX type;
- TensorRT 8/9: an explicit-batch network with the INT8 and FP16 builder flags;
- ONNX parser errors are raised with the node name and op type they concern;
- detailed profiling verbosity, so the engine inspector's JSON names every fused layer, its
  precisions and its origin; written to `layer_info` and diffed against the simulator.

NOT RUN AGAINST A REAL TENSORRT: no machine of the project has TensorRT and a GPU (README,
"TensorRT"). The tests cover what surrounds the build (arguments, profiles, the missing-TensorRT
error, the reader of the inspector's JSON on NVIDIA's published reports).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from . import io, outputs
from .errors import QdqError
from .profiles import InputProfile

INSTALL = ("install TensorRT on a machine with an NVIDIA GPU: pip install 'qdqgraph[trt]' "
           "--extra-index-url https://pypi.nvidia.com")


@dataclass
class BuildResult:
    plan: Path
    tensorrt_version: str
    strongly_typed: bool
    layer_info: Path | None = None
    seconds: float = 0.0


def import_tensorrt():
    """The `tensorrt` module, or a QdqError naming what is missing and how to install it."""
    try:
        import tensorrt as trt
    except Exception as e:  # noqa: BLE001 - ImportError, or a stub package that raises on import
        raise QdqError(f"TensorRT is not installed here (import tensorrt: {type(e).__name__}: "
                       f"{str(e).strip().splitlines()[0] if str(e).strip() else 'no module'})", INSTALL) from None
    if not hasattr(trt, "Builder"):
        raise QdqError("the installed `tensorrt` package is a placeholder without the library",
                       INSTALL)
    return trt


def _major(trt) -> int:
    try:
        return int(str(trt.__version__).split(".")[0])
    except ValueError:
        return 0


class _Logger:
    """A TensorRT logger that keeps the error lines, to name them when a build fails."""

    def __init__(self, trt, verbose: bool):
        self.errors: list[str] = []
        outer = self

        class Logger(trt.ILogger):
            def __init__(self):
                trt.ILogger.__init__(self)

            def log(self, severity, msg):
                if severity <= trt.ILogger.Severity.ERROR:
                    outer.errors.append(msg)
                if verbose or severity <= trt.ILogger.Severity.WARNING:
                    print(f"[TensorRT] {msg}")

        self.logger = Logger()


def _builder(trt, logger):
    try:
        builder = trt.Builder(logger)
    except Exception as e:  # noqa: BLE001 - TensorRT raises TypeError/RuntimeError without a GPU
        builder, reason = None, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    else:
        reason = "the builder could not be created"
    if builder is None:
        raise QdqError(f"TensorRT found no usable CUDA GPU ({reason})",
                       "run qdqgraph build on a machine with an NVIDIA GPU, driver and CUDA")
    return builder


def _network(trt, builder):
    major = _major(trt)
    flags = 0
    strongly = False
    if major >= 10 and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        strongly = True
    elif major >= 11:
        strongly = True                   # TensorRT 11 is always strongly typed
    elif hasattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    return builder.create_network(flags), strongly


def parser_errors(parser) -> list[str]:
    """The ONNX parser's errors as lines naming node, op type and description."""
    lines = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        name = getattr(e, "node_name", lambda: "")() or ""
        op = getattr(e, "node_operator", lambda: "")() or ""
        where = f"node {name} ({op})" if name else f"node #{e.node()}" if e.node() >= 0 else "model"
        lines.append(f"{where}: {e.desc()}")
    return lines


def build(model: str | os.PathLike, plan: str | os.PathLike, *, profiles: dict[str, InputProfile],
          layer_info: str | os.PathLike | None = None, timing_cache: str | os.PathLike | None = None,
          workspace_mb: int | None = None, verbose: bool = False, force: bool = True) -> BuildResult:
    """Build `model` into the serialized engine `plan`. The engine and the layer information are
    written by qdqgraph's output policy (qdqgraph.outputs; an existing file replaced only with
    `force`); the timing cache, read and updated, is always replaced."""
    import time
    trt = import_tensorrt()
    t0 = time.perf_counter()
    log = _Logger(trt, verbose)
    builder = _builder(trt, log.logger)
    network, strongly = _network(trt, builder)
    parser = trt.OnnxParser(network, log.logger)
    if not parser.parse_from_file(str(model)):
        errors = parser_errors(parser) or log.errors or ["no detail given"]
        raise QdqError(f"TensorRT's ONNX parser rejected {model}: " + "; ".join(errors[:5]),
                       "qdqgraph report MODEL lints the placement; fix or exclude the named nodes")
    config = builder.create_builder_config()
    if not strongly:
        config.set_flag(trt.BuilderFlag.INT8)       # mandatory for Q/DQ networks before strong typing (C7)
        config.set_flag(trt.BuilderFlag.FP16)       # float islands in FP16, as --best does
    if workspace_mb:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_mb) << 20)
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    cache = None
    if timing_cache:
        blob = Path(timing_cache).read_bytes() if Path(timing_cache).exists() else b""
        cache = config.create_timing_cache(blob)
        config.set_timing_cache(cache, ignore_mismatch=False)
    if profiles:
        profile = builder.create_optimization_profile()
        for p in profiles.values():
            profile.set_shape(p.name, p.min, p.opt, p.max)
        config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise QdqError("TensorRT could not build the engine: " + ("; ".join(log.errors[-3:]) or "no detail given"),
                       "rerun with --verbose for TensorRT's log")
    data = bytes(serialized)
    write_bytes_atomic(Path(plan), data, force)
    if cache is not None:
        write_bytes_atomic(Path(timing_cache), bytes(cache.serialize()))
    out = BuildResult(Path(plan), str(trt.__version__), strongly, seconds=time.perf_counter() - t0)
    if layer_info:
        runtime = trt.Runtime(log.logger)
        engine = runtime.deserialize_cuda_engine(data)
        info = engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON)
        io.write_text_atomic(Path(layer_info), json.dumps(json.loads(info), indent=1) + "\n", force)
        out.layer_info = Path(layer_info)
    return out


def write_bytes_atomic(path: Path, data: bytes, force: bool = True) -> None:
    """Write `data` to `path` by qdqgraph's output policy (qdqgraph.outputs)."""
    outputs.write_bytes(path, data, force)
