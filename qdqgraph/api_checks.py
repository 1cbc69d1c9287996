"""The Python API's argument checks: `quantize`, `calibrate`, `fix` and `strip_qdq` check what they
are given before any work, as the CLI checks its flags, and answer a wrong type with one
`ArgumentTypeError` (both a QdqError and a TypeError) that names the parameter, what it accepts and
what it got, in the API's words (keyword names, not command-line flags).

Each function raises or returns None; the API functions call them on their first line.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from .graph import proto
from .errors import ArgumentTypeError, QdqError
from .config import QuantizeConfig
import onnx_graphsurgeon as gs

MODEL = "a path (str or os.PathLike) to an .onnx file, or an onnx.ModelProto"
CALIB = ('a path (str or os.PathLike) to an .npz, an .npy or a folder of them or of images, a dict '
         '{input name: array (samples first)}, or "random"')
CACHE = "a path (str or os.PathLike) to a calibration cache, or a dict {tensor name: amax}"


def _got(value) -> str:
    """What was given, briefly: a scalar or string with its value, an array with its shape, else the type."""
    if isinstance(value, np.ndarray):
        return f"a numpy array of shape {value.shape}"
    if value is None:
        return "None"
    if isinstance(value, (str, int, float, bool)):
        text = repr(value)
        return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__.split('.')[0]}.{kind.__qualname__}"


def _is_path(value) -> bool:
    return isinstance(value, (str, os.PathLike)) and not isinstance(value, bytes)


def model(value, func: str) -> None:
    if proto.is_model(value) or _is_path(value):
        return
    if isinstance(value, (bytes, bytearray)):
        raise ArgumentTypeError(f"{func}(model=...) got bytes: it takes {MODEL}",
                                "for a serialized model pass onnx.load_from_string(data)")
    raise ArgumentTypeError(f"{func}(model=...) takes {MODEL}, not {_got(value)}",
                            "pass the model file's path or the loaded model")


def calib(value, func: str, required: bool = False) -> None:
    if value is None:
        if required:
            raise ArgumentTypeError(f"{func}() needs calibration data: calib is None",
                                    f"pass calib= {CALIB}")
        return
    if _is_path(value):
        return
    if isinstance(value, dict):
        _string_keys(value, f"{func}(calib=...)", "model input names", "key each array by the name of the input it feeds")
        return
    if isinstance(value, Mapping):              # np.load("x.npz"), a read-only mapping
        raise ArgumentTypeError(f"{func}(calib=...) takes {CALIB}, not {_got(value)}",
                                "pass dict(...) of it, or the file's path")
    if isinstance(value, np.ndarray):
        raise ArgumentTypeError(f"{func}(calib=...) takes {CALIB}, not {_got(value)}: qdqgraph cannot tell "
                                f"which model input a bare array feeds",
                                'pass calib={"<input name>": array}, one array per model input')
    raise ArgumentTypeError(f"{func}(calib=...) takes {CALIB}, not {_got(value)}",
                            "pass a data file's path or a dict of arrays")


def _string_keys(value: dict, where: str, what: str, fix: str) -> None:
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise ArgumentTypeError(f"{where} is a dict whose keys must be {what} (str), not {_got(bad[0])}", fix)


def config(value, func: str) -> None:
    if value is None or isinstance(value, QuantizeConfig):
        return
    hint = "pass qdqgraph.QuantizeConfig(...), or the options as keyword arguments"
    if isinstance(value, Mapping):
        hint = f"pass qdqgraph.QuantizeConfig(**options), or {func}(..., **options)"
    raise ArgumentTypeError(f"{func}(config=...) takes a qdqgraph.QuantizeConfig or None, not {_got(value)}", hint)


def calib_cache(value, func: str) -> None:
    if value is None or _is_path(value):
        return
    if isinstance(value, dict):
        _string_keys(value, f"{func}(calib_cache=...)", "tensor names", "key each amax by the tensor's name")
        return
    raise ArgumentTypeError(f"{func}(calib_cache=...) takes {CACHE}, not {_got(value)}",
                            "pass the cache file's path or a dict of amaxes")


def shard(value, func: str) -> None:
    if value is None:
        return
    ok = isinstance(value, (tuple, list)) and len(value) == 2 and \
        all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)
    if not ok:
        raise ArgumentTypeError(f"{func}(shard=...) takes a pair of integers (i, n), not {_got(value)}",
                                "pass e.g. shard=(1, 4) for the first of four parts")
    i, n = (int(v) for v in value)
    if not 1 <= i <= n:
        raise QdqError(f"{func}(shard=({i}, {n})): i must be in 1..n", "pass e.g. shard=(1, 4)")


def quantize(model_, calib_, config_, calib_cache_, ahead_=None) -> None:
    model(model_, "quantize")
    calib(calib_, "quantize")
    config(config_, "quantize")
    calib_cache(calib_cache_, "quantize")
    if ahead_ is not None and not callable(ahead_):
        raise ArgumentTypeError(f"quantize(ahead=...) takes a function of (written model, float outputs), "
                                f"not {_got(ahead_)}", "pass a callable, or leave ahead out")


def calibrate(model_, calib_, config_, shard_) -> None:
    model(model_, "calibrate")
    calib(calib_, "calibrate", required=True)
    config(config_, "calibrate")
    shard(shard_, "calibrate")


def fix(model_, calib_, config_) -> None:
    model(model_, "fix")
    calib(calib_, "fix")
    config(config_, "fix")


def graph(value, func: str) -> None:
    if isinstance(value, gs.Graph):
        return
    raise ArgumentTypeError(f"{func}(graph=...) takes an onnx_graphsurgeon Graph, not {_got(value)}",
                            "pass qdqgraph.load(model).graph (and qdqgraph.to_model(loaded) to get the model back)")
