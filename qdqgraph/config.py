"""One configuration for a run, shared by the CLI and the API, with every default in one place.

`QuantizeConfig` is frozen and checks itself when it is made: a bad value is a QdqError that names
the option and the fix, before any work is done. The CLI parses its flags into one and calls the
same `qdqgraph.quantize` / `qdqgraph.calibrate` the API does, so a flag and a keyword argument of
the same name always mean the same thing.
"""
from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, fields, replace
from functools import lru_cache

from .calib.methods import METHODS
from .errors import QdqError
from .formats import DEFAULT_PRECISION, PRECISIONS, Format, activation_format
from .passes.insert import WEIGHT_FORMATS
from .passes.precision import HIGH_PRECISIONS
from .estimate import gpu as known_gpu
from .trtsim.rules import TARGETS
from .placement.plan import Selection

# The calibration method and percentile: the best across the model zoo (docs/ACCURACY.md).
# Percentile 99.99 keeps every zoo model within a point of float and rescues the layout detector
# that max calibration breaks; TensorRT's entropy method clips post-ReLU tensors of small CNNs.
DEFAULT_METHOD = "percentile"
DEFAULT_PERCENTILE = 99.99
# FP8's exponent keeps small values precise however large amax is, so clipping buys little and
# costs the outliers: max calibration, the best on the zoo in FP8 (docs/ACCURACY.md, FP8 section).
DEFAULT_METHODS = {"int8": DEFAULT_METHOD, "fp8": "max", "int4": "max"}
DEFAULT_BLOCK_SIZE = 128       # INT4 weights: elements per scale along the reduction axis
INT4_METHODS = ("rtn", "awq")
DEFAULT_SMOOTH_ALPHA = 0.5
DEFAULT_SENSITIVITY_SAMPLES = 8
ATTENTION_MODES = ("auto", "on", "off")
LEARNED_ROUNDING_MODES = ("auto", "on", "off")
ATTENTION_MAX_LOSS_DB = 3.0    # --int8-attention auto keeps attention INT8 while it costs at most this
                               # much output SQNR, measured against the same plan with attention float


@lru_cache(maxsize=1)
def onnx_op_types() -> frozenset[str]:
    import onnx
    return frozenset(s.name for s in onnx.defs.get_all_schemas_with_history())


def _int(name: str, value, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise QdqError(f"{name} must be a whole number, got {value!r}", f"pass {name} {minimum} or more")
    if value < minimum:
        raise QdqError(f"{name} must be at least {minimum}, got {value}", f"pass {name} {minimum} or more")


def _number(name: str, value, low: float | None = None, high: float | None = None, low_open: bool = False,
            fix: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise QdqError(f"{name} must be a finite number, got {value!r}", fix or f"pass a number to {name}")
    if low is not None and (value < low or (low_open and value == low)):
        raise QdqError(f"{name} must be {'above' if low_open else 'at least'} {low:g}, got {value:g}", fix)
    if high is not None and value > high:
        raise QdqError(f"{name} must be at most {high:g}, got {value:g}", fix)


def _regex(name: str, pattern) -> None:
    if not isinstance(pattern, str):
        raise QdqError(f"{name} takes a regular expression, got {pattern!r}", f"pass {name} 'REGEX'")
    try:
        re.compile(pattern)
    except re.error as e:
        raise QdqError(f"{name} {pattern!r} is not a valid regular expression ({e})",
                       "escape special characters, e.g. 'head\\.0' or 'layer\\[1\\]'") from None


def _op_type(op) -> None:
    if not isinstance(op, str) or op in onnx_op_types():
        return
    close = [o for o in onnx_op_types() if o.lower() == op.lower()] or difflib.get_close_matches(op, onnx_op_types(), 1)
    hint = f"did you mean {close[0]}?" if close else "op types are ONNX names such as Softmax or MatMul"
    raise QdqError(f"--exclude-op {op!r} is not an ONNX op type", hint)


def _tuple(value) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)):
        return (value,)
    return tuple(value)


@dataclass(frozen=True)
class QuantizeConfig:
    """Everything that decides what `quantize` writes (the data and the cache are arguments)."""

    # calibration
    method: str | None = None                  # None: DEFAULT_METHODS[precision]
    percentile: float = DEFAULT_PERCENTILE
    batch_size: int = 1
    samples: int | None = None                 # the first N samples only
    lanes: int | None = None                   # batches run at once on the CPU (default: collect.default_lanes)
    preprocess: str | None = None              # for a folder of images
    providers: tuple[str, ...] | None = None   # onnxruntime execution providers (None: CPU)
    custom_op_libraries: tuple[str, ...] = ()
    ray: str | None = None                     # Ray address for calibration and sensitivity, or "local"
                                               # (a Ray of the run's own); None: one process
    # placement
    rules: tuple[str, ...] = ()
    exclude_ops: tuple[str, ...] = ()
    exclude_nodes: tuple[str, ...] = ()
    include_nodes: tuple[str, ...] = ()
    fixed_inputs: tuple[tuple[str, object], ...] = ()   # (input name, value); a dict is accepted
    # what is written
    precision: str = DEFAULT_PRECISION         # int8 | fp8 | int4 (INT4 weights, activations float)
    block_size: int = DEFAULT_BLOCK_SIZE       # int4: weights per scale along the reduction axis
    int4_method: str = "awq"                   # int4: rtn | awq (activation-aware, needs data)
    weights: str = "int8"
    high_precision: str = "fp16"
    target: str = "tensorrt"                   # the compiler placed and predicted for: tensorrt | tensorrt-rtx
    gpu: str | None = None                     # the GPU of the summary's speed estimate (rules/gpus.toml);
                                               # None: trtsim.latency.DEFAULT_GPU of the target
    # recipes
    bias_correction: bool = False
    smooth_quant: float | None = None          # SmoothQuant alpha in [0, 1], one for the whole model
    output_aware: bool | None = None           # linear-layer input ranges (and smoothing) chosen by
                                               # their output error; None: on for transformers
    int8_attention: str = "auto"               # on | off | auto: INT8 where it costs at most
                                               # ATTENTION_MAX_LOSS_DB of output SQNR (measured)
    learned_rounding: str = "auto"             # on | off | auto: INT8 weight rounding learned per layer on
                                               # the data (AdaRound, qdqgraph.passes.learned_rounding);
                                               # auto: where PyTorch is installed, on models small
                                               # enough (learned_rounding.AUTO_WORK)
    # accuracy
    accuracy_budget: float | None = None       # minimum output SQNR (dB) against float
    max_float_layers: int | None = None
    sensitivity_samples: int = DEFAULT_SENSITIVITY_SAMPLES
    require_int8: float | None = None          # minimum % of the weighted FLOPs TensorRT runs quantized
                                               # (INT8, or FP8 with precision fp8); below it, an error

    def __post_init__(self):
        for name in ("rules", "exclude_ops", "exclude_nodes", "include_nodes", "custom_op_libraries"):
            object.__setattr__(self, name, tuple(str(x) for x in _tuple(getattr(self, name))))
        if self.providers is not None:
            object.__setattr__(self, "providers", _tuple(self.providers))
        fixed = self.fixed_inputs
        if isinstance(fixed, dict):
            fixed = tuple(fixed.items())
        object.__setattr__(self, "fixed_inputs", tuple(fixed))
        if self.precision not in PRECISIONS:
            raise QdqError(f"unknown precision {self.precision!r}", f"use one of {', '.join(PRECISIONS)}")
        if self.method is None:
            object.__setattr__(self, "method", DEFAULT_METHODS[self.precision])
        self.check()

    def check(self) -> None:
        if self.method not in METHODS:
            raise QdqError(f"unknown calibration method {self.method!r}", f"use one of {', '.join(METHODS)}")
        _number("--percentile", self.percentile, 0.0, 100.0, low_open=True,
                fix=f"pass a percentile in (0, 100], e.g. {DEFAULT_PERCENTILE}")
        _int("--batch-size", self.batch_size, 1)
        _int("--samples", self.samples, 1, optional=True)
        _int("--lanes", self.lanes, 1, optional=True)
        if self.ray is not None and (not isinstance(self.ray, str) or not self.ray.strip()):
            raise QdqError(f"--ray takes a Ray address, got {self.ray!r}",
                           "pass --ray alone (a Ray on this machine) or --ray HOST:PORT")
        if self.ray is not None and self.providers not in (None, ("CPUExecutionProvider",)):
            raise QdqError("--ray runs onnxruntime on the CPUs of the Ray workers (its tasks ask for no GPU)",
                           "drop --providers, or drop --ray")
        _int("--sensitivity-samples", self.sensitivity_samples, 1)
        _int("--max-float-layers", self.max_float_layers, 0, optional=True)
        _int("--block-size", self.block_size, 2)
        if self.block_size % 2:
            raise QdqError(f"--block-size must be even (two INT4 values per byte), got {self.block_size}",
                           f"pass --block-size {DEFAULT_BLOCK_SIZE}, 64 or 32")
        if self.int4_method not in INT4_METHODS:
            raise QdqError(f"unknown --int4-method {self.int4_method!r}", f"use one of {', '.join(INT4_METHODS)}")
        if self.weights not in WEIGHT_FORMATS:
            raise QdqError(f"unknown weight format {self.weights!r}", f"use one of {', '.join(WEIGHT_FORMATS)}")
        if self.high_precision not in HIGH_PRECISIONS:
            raise QdqError(f"unknown high precision {self.high_precision!r}", f"use one of {', '.join(HIGH_PRECISIONS)}")
        if self.output_aware not in (None, True, False):
            raise QdqError(f"output_aware must be true, false or None (auto), got {self.output_aware!r}",
                           "pass --output-aware on|off|auto")
        if self.output_aware and self.precision != "int8":
            raise QdqError(f"--output-aware on chooses INT8 ranges; it does not apply to --precision {self.precision}",
                           "drop --output-aware, or use --precision int8")
        if self.output_aware and self.smooth_quant is not None:
            raise QdqError("--output-aware on and --smooth-quant both choose the smoothing",
                           "pass one of them (--output-aware on picks the strength per layer)")
        if self.int8_attention not in ATTENTION_MODES:
            raise QdqError(f"unknown --int8-attention {self.int8_attention!r}", f"use one of {', '.join(ATTENTION_MODES)}")
        self._check_learned_rounding()
        if self.smooth_quant is not None:
            _number("--smooth-quant", self.smooth_quant, 0.0, 1.0,
                    fix=f"pass an alpha in [0, 1] (default {DEFAULT_SMOOTH_ALPHA})")
        if self.target not in TARGETS:
            raise QdqError(f"unknown target {self.target!r}", f"use one of {', '.join(TARGETS)}")
        if self.gpu is not None:
            known_gpu(self.gpu)                    # one line naming the GPUs it knows
        if self.require_int8 is not None:
            _number("--require-int8", self.require_int8, 0.0, 100.0,
                    fix="pass a percentage of the weighted FLOPs in [0, 100], e.g. --require-int8 50")
            if self.precision == "int4":
                raise QdqError("--require-int8 checks the share of FLOPs run on quantized activations, and "
                               "--precision int4 quantizes weights only", "drop --require-int8, or use --precision int8 or fp8")
        if self.accuracy_budget is not None:
            _number("--accuracy-budget", self.accuracy_budget, fix="pass an output SQNR in dB, e.g. --accuracy-budget 30")
        for p in self.exclude_nodes:
            _regex("--exclude-node", p)
        for p in self.include_nodes:
            _regex("--include-node", p)
        for op in self.exclude_ops:
            _op_type(op)
        names = [n for n, _ in self.fixed_inputs]
        if len(set(names)) != len(names):
            raise QdqError(f"--fix-input names an input twice ({', '.join(sorted(names))})", "give each input once")

    def _check_learned_rounding(self) -> None:
        if self.learned_rounding not in LEARNED_ROUNDING_MODES:
            raise QdqError(f"unknown --learned-rounding {self.learned_rounding!r}",
                           f"use one of {', '.join(LEARNED_ROUNDING_MODES)}")
        if self.learned_rounding != "on":
            return
        if self.precision != "int8":
            raise QdqError(f"--learned-rounding on learns INT8 weights; it does not apply to --precision {self.precision}",
                           "drop --learned-rounding, or use --precision int8")
        if self.weights != "int8":
            raise QdqError("--learned-rounding on writes the learned INT8 weights, and --weights qdq writes float "
                           "weights that the engine rounds to nearest", "drop --weights qdq, or --learned-rounding")
        from .passes.learned_rounding import require_torch
        require_torch()

    # ------------------------------------------------------------------ views

    def with_(self, **changes) -> "QuantizeConfig":
        """A copy with `changes` (checked like a new one)."""
        return replace(self, **changes)

    @property
    def fixed(self) -> dict:
        return dict(self.fixed_inputs)

    @property
    def format(self) -> Format | None:
        """The Q/DQ format of activations and weights (None for int4: weights only)."""
        return activation_format(self.precision)

    @property
    def fallback(self) -> bool:
        return self.accuracy_budget is not None or self.max_float_layers is not None

    def selection(self, float_nodes: tuple = ()) -> Selection:
        return Selection(self.exclude_ops, self.exclude_nodes, self.include_nodes, tuple(float_nodes))

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = [[k, _jsonable(x)] for k, x in v] if f.name == "fixed_inputs" else \
                list(v) if isinstance(v, tuple) else v
        return out


def _jsonable(value):
    try:
        import numpy as np
        return np.asarray(value).tolist()
    except Exception:  # noqa: BLE001 - a value numpy cannot read is reported as its text
        return str(value)


def config_from(config: QuantizeConfig | None = None, **options) -> QuantizeConfig:
    """`config` with `options` applied, or a new config of `options`; unknown option names are a
    QdqError that names the known ones."""
    known = {f.name for f in fields(QuantizeConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise QdqError(f"unknown option(s) {unknown}", f"known options: {', '.join(sorted(known))}")
    return config.with_(**options) if config is not None else QuantizeConfig(**options)
