"""What every backend shares: the build options and result, a logger that keeps the compiler's lines,
the ONNX parser's errors as one line, and the build itself on TensorRT's builder API (which
datacenter TensorRT and TensorRT for RTX share). A backend module says how to import its compiler,
how to set up the network and the config, and how to read the compiled engine back."""
from __future__ import annotations

import importlib
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..graph import io, outputs
from ..errors import QdqError
from ..trtsim.engine_report import EngineReport
from .profiles import InputProfile


@dataclass
class BuildOptions:
    profiles: dict[str, InputProfile] = field(default_factory=dict)
    timing_cache: str | os.PathLike | None = None
    workspace_mb: int | None = None
    compute_capabilities: list[str] | None = None     # TensorRT for RTX targets ("sm89"); None: the default
    formats: frozenset = frozenset()                   # quantized formats in the model (INT8, FP8, INT4)
    verbose: bool = False
    force: bool = True


@dataclass
class BuildResult:
    plan: Path
    backend: str
    version: str
    strongly_typed: bool
    seconds: float = 0.0
    engine: EngineReport | None = None      # the compiled engine's kernels, where the backend can read them
    engine_note: str = ""                   # why there is none
    targets: list[str] = field(default_factory=list)   # compute capabilities the plan was compiled for
    targets_note: str = ""
    warnings: list[str] = field(default_factory=list)  # the compiler's warnings, each once ("(x9)")
    repaired: list[str] = field(default_factory=list)  # what the compiler was given differently from the file

    @property
    def layer_info(self) -> bool:
        return self.engine is not None


class Log:
    """A TensorRT logger that keeps every line by severity; prints warnings and errors as they come
    only with `verbose` (they are summarised once after the build otherwise)."""

    def __init__(self, trt, verbose: bool):
        self.lines: list[tuple[int, str]] = []
        self.notes: list[str] = []            # what qdqgraph repaired before the compiler read the model
        outer = self

        class Logger(trt.ILogger):
            def __init__(self):
                trt.ILogger.__init__(self)

            def log(self, severity, msg):
                outer.lines.append((int(severity), msg))
                if verbose and int(severity) <= int(trt.ILogger.Severity.INFO):
                    print(f"[TensorRT] {msg}")

        self.logger = Logger()
        self._error = int(trt.ILogger.Severity.ERROR)
        self._warning = int(trt.ILogger.Severity.WARNING)

    @property
    def errors(self) -> list[str]:
        return [m for s, m in self.lines if s <= self._error]

    @property
    def messages(self) -> list[str]:
        return [m for _, m in self.lines]

    def warnings(self) -> list[str]:
        """Each warning once, with its count: the compiler repeats some per layer."""
        counts = Counter(m.strip() for s, m in self.lines if s == self._warning)
        return [f"{m} (x{n})" if n > 1 else m for m, n in counts.items()]


def parser_errors(parser) -> list[str]:
    """The ONNX parser's errors as lines naming node, op type and description."""
    lines = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        name = getattr(e, "node_name", lambda: "")() or ""
        op = getattr(e, "node_operator", lambda: "")() or ""
        where = f"node {name} ({op})" if name else f"node #{e.node()}" if e.node() >= 0 else "model"
        desc = re.sub(r"\s+", " ", str(e.desc())).strip()
        lines.append(f"{where}: {desc}")
    return lines


def import_compiler(module: str, label: str, install: str):
    """The compiler's Python module, or a QdqError naming what is missing and `install`."""
    try:
        trt = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken or stub package that raises on import
        raise QdqError(f"{label} is not installed here (import {module}: {type(e).__name__}: {_first_line(e)})",
                       install) from None
    if not hasattr(trt, "Builder"):
        raise QdqError(f"the installed `{module}` package has no builder (a placeholder without the library)",
                       install)
    return trt


def unavailable(import_module) -> str | None:
    """None when `import_module()` succeeds, else its one-line reason."""
    try:
        import_module()
    except QdqError as e:
        return e.problem
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def make_builder(trt, logger, gpu_needed: bool):
    try:
        builder = trt.Builder(logger)
    except Exception as e:  # noqa: BLE001 - TensorRT raises TypeError/RuntimeError without a GPU
        builder, reason = None, _first_line(e)
    else:
        reason = "the builder could not be created"
    if builder is None:
        if gpu_needed:
            raise QdqError(f"TensorRT found no usable CUDA GPU ({reason})",
                           "run qdqgraph build on a machine with an NVIDIA GPU, driver and CUDA, "
                           "or use --backend tensorrt-rtx, which builds without one")
        raise QdqError(f"the TensorRT builder could not start ({reason})", "reinstall the backend's package")
    return builder


def compile_onnx(trt, model: str | os.PathLike, options: BuildOptions, log: Log, *, flags: int,
                 configure, gpu_needed: bool):
    """Parse `model` and build it; `configure(config)` sets the backend's own options. Returns the
    serialized plan (bytes) and the timing cache (or None). Parser and builder failures are
    QdqErrors naming the nodes and the compiler's message."""
    builder = make_builder(trt, log.logger, gpu_needed)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, log.logger)
    repaired, notes = io.repaired_for_compiler(model)
    log.notes.extend(notes)
    parsed = parser.parse(repaired, str(model)) if repaired is not None else parser.parse_from_file(str(model))
    if not parsed:
        errors = parser_errors(parser) or log.errors or ["no detail given"]
        raise QdqError(f"TensorRT's ONNX parser rejected {Path(model).name}: " + "; ".join(errors[:3]),
                       "qdqgraph report MODEL lints the placement; fix or exclude the named nodes")
    config = builder.create_builder_config()
    if options.workspace_mb:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_mb) << 20)
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    configure(config)
    cache = None
    if options.timing_cache:
        tc = Path(options.timing_cache)
        cache = config.create_timing_cache(tc.read_bytes() if tc.exists() else b"")
        config.set_timing_cache(cache, ignore_mismatch=False)
    dynamic = [network.get_input(i) for i in range(network.num_inputs)
               if any(d < 0 for d in network.get_input(i).shape)]
    missing = [t.name for t in dynamic if t.name not in options.profiles]
    if missing:
        raise QdqError(f"input {missing[0]!r} has dynamic dims {list(dynamic[0].shape)} and no shapes were given",
                       f"pass --shapes {missing[0]}:1x... (or --calib DATA, whose shapes are taken)")
    if options.profiles:
        profile = builder.create_optimization_profile()
        for p in options.profiles.values():
            profile.set_shape(p.name, p.min, p.opt, p.max)
        config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise QdqError("TensorRT could not build the engine: " + ("; ".join(
            re.sub(r"\s+", " ", m).strip()[:300] for m in log.errors[-3:]) or "no detail given"),
            "rerun with --verbose for TensorRT's log")
    return bytes(serialized), cache


def write_plan(plan: Path, data: bytes, cache, options: BuildOptions) -> None:
    outputs.write_bytes(plan, data, options.force)
    if cache is not None and options.timing_cache:
        outputs.write_bytes(Path(options.timing_cache), bytes(cache.serialize()))
