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

from .graph import proto
from .calib.methods import METHODS
from .errors import QdqError, cli_words_on as _CLI, option
from .precisions.formats import DEFAULT_PRECISION, PRECISIONS, Format, activation_format
from .precisions.registry import precision, precisions
from .passes.insert import WEIGHT_FORMATS
from .passes.precision import HIGH_PRECISIONS
from .trtsim.estimate import gpu as known_gpu
from .trtsim.rules import TARGETS
from .placement.plan import Selection
from .recipes.learned_rounding import require_torch

# The calibration method of each precision (rules/precisions.toml, with why) and the percentile:
# the best across the model zoo (docs/ACCURACY.md).
DEFAULT_METHODS = {p.name: p.method for p in precisions().values()}
DEFAULT_METHOD = DEFAULT_METHODS[DEFAULT_PRECISION]
DEFAULT_PERCENTILE = 99.99
DEFAULT_BLOCK_SIZE = 128       # INT4 weights: elements per scale along the reduction axis
INT4_METHODS = ("rtn", "awq")
INT4_ONLY = {"block_size": DEFAULT_BLOCK_SIZE, "int4_method": "awq"}   # INT4's options: their defaults
DEFAULT_SMOOTH_ALPHA = 0.5
DEFAULT_SENSITIVITY_SAMPLES = 8
ATTENTION_MODES = ("auto", "on", "off")
EQUALIZE_MODES = ("auto", "on", "off")
# --sqnr-floor: the output SQNR (dB, calibration samples, against float) a run reaches when it can:
# below it, quantized nodes go back to float, most dB per FLOP first, while at least
# DEFAULT_FLOOR_INT8_FLOPS % of the weighted FLOPs stay quantized. Not on by default: what it buys
# and what it costs are in docs/ACCURACY.md.
DEFAULT_SQNR_FLOOR = 25.0
DEFAULT_FLOOR_INT8_FLOPS = 90.0
LEARNED_ROUNDING_MODES = ("auto", "on", "off")
DEPTHWISE_LOCAL_DB = 21.0      # --depthwise-check: a depthwise convolution whose own output SQNR is under
                               # this with its input and weight quantized is a candidate for float
DEPTHWISE_MAX_FLOPS = 0.03     # ... while the candidates cost at most this share of the FLOPs
DEPTHWISE_MIN_GAIN_DB = 1.0    # ... and go float when the model's outputs gain at least this (measured)
DEPTHWISE_ENOUGH_DB = 30.0     # ... and are under this with them quantized: above it, no FLOPs are spent
ATTENTION_MAX_LOSS_DB = 3.0    # --int8-attention auto keeps attention INT8 while it costs at most this
                               # much output SQNR, measured against the same plan with attention float


@lru_cache(maxsize=1)
def onnx_op_types() -> frozenset[str]:
    return proto.op_types()


def _int(name: str, value, minimum: int, optional: bool = False) -> None:
    """`name`: the QuantizeConfig field, named in the user's words (qdqgraph.errors.option)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise QdqError(f"{option(name)} must be a whole number, got {value!r}",
                       f"pass {option(name, minimum)} or more")
    if value < minimum:
        raise QdqError(f"{option(name)} must be at least {minimum}, got {value}", f"pass {option(name, minimum)} or more")


def _number(name: str, value, low: float | None = None, high: float | None = None, low_open: bool = False,
            fix: str = "") -> None:
    """`name`: the QuantizeConfig field, named in the user's words (qdqgraph.errors.option)."""
    said = option(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise QdqError(f"{said} must be a finite number, got {value!r}", fix or f"pass a number to {said}")
    if low is not None and (value < low or (low_open and value == low)):
        raise QdqError(f"{said} must be {'above' if low_open else 'at least'} {low:g}, got {value:g}", fix)
    if high is not None and value > high:
        raise QdqError(f"{said} must be at most {high:g}, got {value:g}", fix)


def _regex(name: str, pattern) -> None:
    if not isinstance(pattern, str):
        raise QdqError(f"{option(name)} takes a regular expression, got {pattern!r}",
                       f"pass {option(name, 'REGEX')}")
    try:
        re.compile(pattern)
    except re.error as e:
        raise QdqError(f"{option(name, repr(pattern), literal=False)} is not a valid regular expression ({e})",
                       "escape special characters, e.g. 'head\\.0' or 'layer\\[1\\]'") from None


def _op_type(op) -> None:
    if not isinstance(op, str) or op in onnx_op_types():
        return
    close = [o for o in onnx_op_types() if o.lower() == op.lower()] or difflib.get_close_matches(op, onnx_op_types(), 1)
    hint = f"did you mean {close[0]}?" if close else "op types are ONNX names such as Softmax or MatMul"
    raise QdqError(f"{option('exclude_ops', repr(op), literal=False)} is not an ONNX op type", hint)


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
    block_size: int | None = None              # int4: weights per scale along the reduction axis
                                               # (None: DEFAULT_BLOCK_SIZE); int4 only
    int4_method: str | None = None             # int4: rtn | awq (activation-aware, needs data; None:
                                               # awq); int4 only
    weights: str = "int8"
    high_precision: str = "fp16"
    target: str = "tensorrt"                   # the compiler placed and predicted for: tensorrt | tensorrt-rtx
    gpu: str | None = None                     # the GPU of the summary's speed estimate (rules/gpus.toml);
                                               # None: trtsim.latency.DEFAULT_GPU of the target
    # recipes
    bias_correction: bool | None = False       # None: auto, kept where it raises the written model's
                                               # output SQNR on the calibration samples (measured);
                                               # off by default: +0.1 to +1.5 dB for 2-4x the insert
                                               # time (docs/ACCURACY.md)
    equalize: str = "off"                      # cross-layer equalization of Conv -> [Relu] -> Conv
                                               # pairs: on | off | auto (passes.equalize); off by
                                               # measurement: it cost silero_vad_op15 10 dB
                                               # (docs/ACCURACY.md)
    depthwise_check: bool = True               # depthwise convolutions whose quantized output falls under
                                               # DEPTHWISE_LOCAL_DB on their own return to float where
                                               # the outputs gain (measured; recipes.depthwise)
    fragile_heads: bool = True                 # keep float the head of an output far less accurate than
                                               # the others, within 2 % of the FLOPs (measured)
    sqnr_floor: float | None = None            # output SQNR (dB) the run falls back to reach, e.g.
                                               # DEFAULT_SQNR_FLOOR; None: no floor (the default: its
                                               # sweep cost 5-30x the insert time, docs/ACCURACY.md)
    floor_int8_flops: float = DEFAULT_FLOOR_INT8_FLOPS  # the floor keeps >= this % of FLOPs quantized
    smooth_quant: float | None = None          # SmoothQuant alpha in [0, 1], one for the whole model
    output_aware: bool | None = None           # linear-layer input ranges (and smoothing) chosen by
                                               # their output error; None: on for transformers
    int8_attention: str = "auto"               # on | off | auto: INT8 where it costs at most
                                               # ATTENTION_MAX_LOSS_DB of output SQNR (measured)
    learned_rounding: str = "off"              # on | off | auto: INT8 weight rounding learned per layer on
                                               # the data (AdaRound, qdqgraph.recipes.learned_rounding);
                                               # auto: where PyTorch is installed, on models small
                                               # enough (learned_rounding.AUTO_WORK). Off by default:
                                               # measured, it gained on 4 of 5 models and cost silero's
                                               # speech output 5 dB on held-out data (docs/ACCURACY.md)
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
        for name in INT4_ONLY:
            if getattr(self, name) is not None and self.precision != "int4":
                raise QdqError(f"{option(name)} applies to {option('precision', 'int4')} only (this run is "
                               f"{self.precision.upper()})",
                               f"drop {option(name)}, or add {option('precision', 'int4')}")
        if self.precision == "int4":
            for name, default in INT4_ONLY.items():
                if getattr(self, name) is None:
                    object.__setattr__(self, name, default)
        self.check()

    def check(self) -> None:
        """Every option, in one order (the first problem is the one said): calibration, execution,
        precision and formats, recipes, target, selection."""
        self._check_calibration()
        self._check_execution()
        self._check_precision()
        self._check_recipes()
        self._check_target()
        self._check_selection()

    def _check_calibration(self) -> None:
        """The calibration method, percentile, batch size, samples and lanes."""
        if self.method not in METHODS:
            raise QdqError(f"unknown calibration method {self.method!r}", f"use one of {', '.join(METHODS)}")
        _number("percentile", self.percentile, 0.0, 100.0, low_open=True,
                fix=f"pass a percentile in (0, 100], e.g. {DEFAULT_PERCENTILE}")
        _int("batch_size", self.batch_size, 1)
        _int("samples", self.samples, 1, optional=True)
        _int("lanes", self.lanes, 1, optional=True)

    def _check_execution(self) -> None:
        """Ray and the providers, the sensitivity samples and the float-layer cap."""
        if self.ray is not None and (not isinstance(self.ray, str) or not self.ray.strip()):
            raise QdqError(f"{option('ray')} takes a Ray address, got {self.ray!r}",
                           f"pass {option('ray', 'local')} (a Ray on this machine) or {option('ray', 'HOST:PORT')}"
                           if not _CLI() else "pass --ray alone (a Ray on this machine) or --ray HOST:PORT")
        if self.ray is not None and self.providers not in (None, ("CPUExecutionProvider",)):
            raise QdqError(f"{option('ray')} runs onnxruntime on the CPUs of the Ray workers (its tasks ask for no GPU)",
                           f"drop {option('providers')}, or drop {option('ray')}")
        _int("sensitivity_samples", self.sensitivity_samples, 1)
        _int("max_float_layers", self.max_float_layers, 0, optional=True)

    def _check_precision(self) -> None:
        """INT4's block size and method, the weight format, the float islands' type."""
        if self.precision == "int4":
            _int("block_size", self.block_size, 2)
            if int(self.block_size or 0) % 2:
                raise QdqError(f"{option('block_size')} must be even (two INT4 values per byte), got {self.block_size}",
                               f"pass {option('block_size', DEFAULT_BLOCK_SIZE)}, 64 or 32")
            if self.int4_method not in INT4_METHODS:
                raise QdqError(f"unknown {option('int4_method', self.int4_method)}",
                               f"use one of {', '.join(INT4_METHODS)}")
        if self.weights not in WEIGHT_FORMATS:
            raise QdqError(f"unknown weight format {self.weights!r}", f"use one of {', '.join(WEIGHT_FORMATS)}")
        if self.high_precision not in HIGH_PRECISIONS:
            raise QdqError(f"unknown high precision {self.high_precision!r}", f"use one of {', '.join(HIGH_PRECISIONS)}")

    def _check_recipes(self) -> None:
        """Output-aware scales, the attention mode, SmoothQuant."""
        if self.output_aware not in (None, True, False):
            raise QdqError(f"{option('output_aware')} must be on, off or auto (True, False or None), got "
                           f"{self.output_aware!r}", f"pass {option('output_aware', 'on|off|auto', literal=False)}"
                           if _CLI() else "pass output_aware=True, False or None")
        if self.output_aware and self.precision != "int8":
            raise QdqError(f"{option('output_aware', True)} chooses INT8 ranges; it does not apply to "
                           f"{option('precision', self.precision)}",
                           f"drop {option('output_aware')}, or use {option('precision', 'int8')}")
        if self.output_aware and self.smooth_quant is not None:
            raise QdqError(f"{option('output_aware', True)} and {option('smooth_quant')} both choose the smoothing",
                           f"pass one of them ({option('output_aware', True)} picks the strength per layer)")
        if self.bias_correction not in (None, True, False):
            raise QdqError(f"{option('bias_correction')} must be on, off or auto (True, False or None), got "
                           f"{self.bias_correction!r}", f"pass {option('bias_correction', 'on|off|auto', literal=False)}"
                           if _CLI() else "pass bias_correction=True, False or None")
        if self.equalize not in EQUALIZE_MODES:
            raise QdqError(f"unknown {option('equalize', self.equalize)}", f"use one of {', '.join(EQUALIZE_MODES)}")
        if self.depthwise_check not in (True, False):
            raise QdqError(f"{option('depthwise_check')} must be on or off (True or False), got {self.depthwise_check!r}",
                           f"pass {option('depthwise_check', 'on|off', literal=False)}" if _CLI()
                           else "pass depthwise_check=True or False")
        if self.fragile_heads not in (True, False):
            raise QdqError(f"{option('fragile_heads')} must be on or off (True or False), got {self.fragile_heads!r}",
                           f"pass {option('fragile_heads', 'on|off', literal=False)}" if _CLI()
                           else "pass fragile_heads=True or False")
        if self.sqnr_floor is not None:
            _number("sqnr_floor", self.sqnr_floor, fix=f"pass an output SQNR in dB, e.g. {option('sqnr_floor', 25)}")
        _number("floor_int8_flops", self.floor_int8_flops, 0.0, 100.0,
                fix=f"pass a percentage of the weighted FLOPs in [0, 100], e.g. {DEFAULT_FLOOR_INT8_FLOPS:g}")
        if self.int8_attention not in ATTENTION_MODES:
            raise QdqError(f"unknown {option('int8_attention', self.int8_attention)}",
                           f"use one of {', '.join(ATTENTION_MODES)}")
        self._check_learned_rounding()
        if self.smooth_quant is not None:
            _number("smooth_quant", self.smooth_quant, 0.0, 1.0,
                    fix=f"pass an alpha in [0, 1] (default {DEFAULT_SMOOTH_ALPHA})")

    def _check_target(self) -> None:
        """The target, the GPU and --require-int8."""
        if self.target not in TARGETS:
            raise QdqError(f"unknown target {self.target!r}", f"use one of {', '.join(TARGETS)}")
        if self.gpu is not None:
            known_gpu(self.gpu)                    # one line naming the GPUs it knows
        if self.require_int8 is not None:
            _number("require_int8", self.require_int8, 0.0, 100.0,
                    fix=f"pass a percentage of the weighted FLOPs in [0, 100], e.g. {option('require_int8', 50)}")
            if precision(self.precision).weights_only:
                raise QdqError(f"{option('require_int8')} checks the share of FLOPs run on quantized activations, and "
                               f"{option('precision', 'int4')} quantizes weights only",
                               f"drop {option('require_int8')}, or use {option('precision', 'int8')} or fp8")

    def _check_selection(self) -> None:
        """The accuracy budget, node and op selection, fixed inputs."""
        if self.accuracy_budget is not None:
            _number("accuracy_budget", self.accuracy_budget,
                    fix=f"pass an output SQNR in dB, e.g. {option('accuracy_budget', 30)}")
        for p in self.exclude_nodes:
            _regex("exclude_nodes", p)
        for p in self.include_nodes:
            _regex("include_nodes", p)
        for op in self.exclude_ops:
            _op_type(op)
        names = [n for n, _ in self.fixed_inputs]
        if len(set(names)) != len(names):
            raise QdqError(f"{option('fixed_inputs')} names an input twice ({', '.join(sorted(names))})",
                           "give each input once")

    def _check_learned_rounding(self) -> None:
        """--learned-rounding: a mode, INT8 weights only, PyTorch where it is asked for."""
        if self.learned_rounding not in LEARNED_ROUNDING_MODES:
            raise QdqError(f"unknown {option('learned_rounding', self.learned_rounding)}",
                           f"use one of {', '.join(LEARNED_ROUNDING_MODES)}")
        if self.learned_rounding != "on":
            return
        if self.precision != "int8":
            raise QdqError(f"{option('learned_rounding', 'on')} learns INT8 weights; it does not apply to "
                           f"{option('precision', self.precision)}",
                           f"drop {option('learned_rounding')}, or use {option('precision', 'int8')}")
        if self.weights != "int8":
            raise QdqError(f"{option('learned_rounding', 'on')} writes the learned INT8 weights, and "
                           f"{option('weights', 'qdq')} writes float weights that the engine rounds to nearest",
                           f"drop {option('weights', 'qdq')}, or {option('learned_rounding')}")
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
