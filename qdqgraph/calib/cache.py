"""Calibration caches: qdqgraph's JSON and TensorRT's text format (TRT_RULES K1).

JSON (``write_json`` / ``read_json``)::

    {"format": "qdqgraph-calib", "version": 1, "tool_version": "0.1.0", "method": "entropy",
     "samples": 500, "tensors": {"input": {"amax": 2.64, "scale": 0.0207874...}, ...}}

``amax`` is the calibrated range and is what ``read_json`` returns; ``scale`` is the float32 INT8
scale qdqgraph derives from it (``methods.safe_scale``), written for the reader's convenience.

TensorRT (``write_tensorrt`` / ``read_tensorrt``)::

    TRT-100900-EntropyCalibration2
    images: 3c010204
    model/conv1/Relu:0: 3d8f5c29

Each line is ``<name>: <hex>``, hex being the big-endian IEEE-754 bit pattern of the float32 scale
(amax / 127), lowercase, without ``0x`` or zero padding; a zero scale is ``0``. Lines are split on
the last ``": "`` because names may contain ``:``. Reading gives ``amax = scale * 127``; zero
scales (TensorRT writes them for tensors it saw as all-zero) come back as amax 0.0 so that the
caller applies ``safe_scale`` and warns.

``load_cache`` sniffs the format. Writes are atomic (temporary file in the same folder, fsync,
``os.replace``). A malformed file raises ``ValueError("<file>:<line>: <what is wrong>")``.
"""
from __future__ import annotations

import json
import math
import re
import struct

import numpy as np

from ..precisions.scales import INT8_MAX, safe_scale

from ..graph import io
from ..version import __version__

JSON_FORMAT = "qdqgraph-calib"
JSON_VERSION = 1
TRT_ALGOS = ("EntropyCalibration2", "MinMaxCalibration")    # the two seen in real caches
_HEADER = re.compile(r"TRT-(\d+)-(\S+)")
_HEX = re.compile(r"[0-9a-fA-F]{1,8}")


# --------------------------------------------------------------------------------------- helpers
def scale_to_hex(scale) -> str:
    """float32 scale -> TensorRT cache hex: big-endian bits, lowercase, no padding (0 -> '0')."""
    s = np.float32(scale)
    if s == 0:
        s = np.float32(0.0)                      # write -0.0 as 0
    return format(struct.unpack(">I", struct.pack(">f", s))[0], "x")


def hex_to_scale(text: str) -> np.float32:
    """TensorRT cache hex (1-8 hex digits) -> float32 scale."""
    if not _HEX.fullmatch(text):
        raise ValueError(f"{text!r} is not 1-8 hex digits")
    return np.float32(struct.unpack(">f", bytes.fromhex(text.zfill(8)))[0])


def _check_amax(name, amax) -> float:
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
    try:
        a = float(amax)
    except (TypeError, ValueError):
        raise ValueError(f"amax of tensor {name!r} is not a number: {amax!r}") from None
    if not (math.isfinite(a) and a >= 0.0):
        raise ValueError(f"amax of tensor {name!r} must be finite and >= 0, got {a!r}")
    return a + 0.0                               # -0.0 -> 0.0


def _read_text(path) -> str:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:1: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _bad(path, line: int, what: str) -> ValueError:
    return ValueError(f"{path}:{line}: {what}")


# ------------------------------------------------------------------------------------------ JSON
def write_json(path, amaxes: dict, method: str, samples: int, force: bool = True) -> None:
    """Write qdqgraph's JSON cache of `amaxes` (tensor name -> amax), atomically."""
    tensors = {}
    for name, amax in amaxes.items():
        a = _check_amax(name, amax)
        tensors[name] = {"amax": a, "scale": float(safe_scale(a))}
    if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or samples < 0:
        raise ValueError(f"samples must be a non-negative integer, got {samples!r}")
    doc = {"format": JSON_FORMAT, "version": JSON_VERSION, "tool_version": str(__version__),
           "method": str(method), "samples": int(samples), "tensors": tensors}
    io.write_text_atomic(path, json.dumps(doc, indent=1, allow_nan=False, ensure_ascii=False) + "\n", force)


def _json_line(text: str, key: str | None) -> int:
    """Line of the first occurrence of the JSON-encoded `key` (1 if not found): for error messages."""
    if key is None:
        return 1
    at = text.find(json.dumps(key, ensure_ascii=False) + ":")
    if at < 0:
        at = text.find(json.dumps(key) + ":")
    return text.count("\n", 0, at) + 1 if at >= 0 else 1


def _reject_constant(token: str):
    raise ValueError(f"{token} is not a number JSON allows")


def read_json(path) -> dict[str, float]:
    """Read qdqgraph's JSON cache: tensor name -> amax."""
    text = _read_text(path)
    try:
        doc = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise _bad(path, e.lineno, f"not valid JSON ({e.msg})") from None
    except ValueError as e:                       # NaN / Infinity from _reject_constant
        token = str(e).split(" ")[0]
        at = text.find(token)
        raise _bad(path, text.count("\n", 0, at) + 1 if at >= 0 else 1, str(e)) from None
    if not isinstance(doc, dict) or doc.get("format") != JSON_FORMAT:
        raise _bad(path, _json_line(text, "format") if isinstance(doc, dict) else 1,
                   f"not a qdqgraph calibration cache (needs \"format\": \"{JSON_FORMAT}\")")
    if doc.get("version") != JSON_VERSION:
        raise _bad(path, _json_line(text, "version"),
                   f"unsupported cache version {doc.get('version')!r} (this qdqgraph reads {JSON_VERSION})")
    tensors = doc.get("tensors")
    if not isinstance(tensors, dict):
        raise _bad(path, _json_line(text, "tensors"), "\"tensors\" must be an object of name -> {amax, scale}")
    out = {}
    for name, entry in tensors.items():
        amax = entry.get("amax") if isinstance(entry, dict) else None
        if isinstance(amax, bool) or not isinstance(amax, (int, float)) or not (math.isfinite(amax) and amax >= 0):
            raise _bad(path, _json_line(text, name),
                       f"tensor {name!r} needs an \"amax\" that is a finite number >= 0, got {amax!r}")
        out[name] = float(amax)
    return out


# ------------------------------------------------------------------------------------- TensorRT
def write_tensorrt(path, amaxes: dict, algo: str = "EntropyCalibration2", trt_version: int = 100900,
                   force: bool = True) -> None:
    """Write a TensorRT calibration cache (scale = amax/127 per tensor, zero amax as `0`), atomically.

    `trt_version` is TensorRT's version integer (``100900`` for 10.9.0, ``8601`` for 8.6.1)."""
    if isinstance(trt_version, bool) or not isinstance(trt_version, (int, np.integer)) or trt_version < 0:
        raise ValueError(f"trt_version must be a non-negative integer, got {trt_version!r}")
    if not isinstance(algo, str) or not re.fullmatch(r"[A-Za-z0-9_]+", algo):
        raise ValueError(f"algo must be a word such as {' or '.join(TRT_ALGOS)}, got {algo!r}")
    lines = [f"TRT-{int(trt_version)}-{algo}"]
    for name, amax in amaxes.items():
        a = _check_amax(name, amax)
        if "\n" in name or "\r" in name:
            raise ValueError(f"tensor name {name!r} has a line break; a TensorRT cache cannot hold it")
        if a / INT8_MAX > float(np.finfo(np.float32).max):
            raise ValueError(f"amax of tensor {name!r} ({a!r}) overflows a float32 scale")
        scale = np.float32(a / INT8_MAX)
        lines.append(f"{name}: {scale_to_hex(scale)}")
    io.write_text_atomic(path, "\n".join(lines) + "\n", force)


def read_tensorrt(path) -> dict[str, float]:
    """Read a TensorRT calibration cache: tensor name -> amax (scale * 127; 0.0 for zero scales)."""
    text = _read_text(path)
    lines = text.split("\n")
    header = lines[0].rstrip("\r")
    if not _HEADER.fullmatch(header):
        raise _bad(path, 1, f"not a TensorRT calibration cache (first line should be like "
                            f"'TRT-100900-EntropyCalibration2', got {header[:60]!r})")
    out = {}
    for no, raw in enumerate(lines[1:], start=2):
        line = raw.rstrip("\r")
        if not line.strip():
            continue
        name, sep, hexpart = line.rpartition(": ")
        if not sep:
            raise _bad(path, no, f"expected '<tensor name>: <hex scale>', got {line[:60]!r}")
        if not name:
            raise _bad(path, no, "empty tensor name")
        try:
            scale = hex_to_scale(hexpart.strip())
        except ValueError as e:
            raise _bad(path, no, f"bad scale for tensor {name!r}: {e}") from None
        if not (np.isfinite(scale) and scale >= 0):
            raise _bad(path, no, f"scale of tensor {name!r} is {float(scale)!r} (it must be finite and >= 0)")
        if name in out:
            raise _bad(path, no, f"tensor {name!r} appears twice")
        out[name] = float(scale) * INT8_MAX + 0.0
    return out


# ----------------------------------------------------------------------------------------- sniff
def load_cache(path) -> dict[str, float]:
    """Read either cache format (sniffed from the content): tensor name -> amax."""
    text = _read_text(path)
    head = text.lstrip()
    if head.startswith("{"):
        return read_json(path)
    if head.startswith("TRT-") and text.startswith("TRT-"):
        return read_tensorrt(path)
    raise _bad(path, 1, "not a qdqgraph JSON or TensorRT calibration cache")
