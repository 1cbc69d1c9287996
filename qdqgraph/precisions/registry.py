"""The precisions qdqgraph writes, one record each, read from rules/precisions.toml.

Code asks a record (`precision("fp8").opset`, `.weights_only`, `.placement`) instead of comparing
precision names; a new precision is a table in that file plus its Format in formats.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..errors import QdqError
from ..rulebook.files import bundled, read_rule_file

FILE = "precisions.toml"
_FIELDS = {"label": str, "opset": int, "opset_why": str, "method": str, "placement": str, "weights_only": bool,
           "bits": int}
_OPTIONAL = {"min_scale_values": (int, 1)}      # field: (type, value when the table leaves it out)


@dataclass(frozen=True)
class Precision:
    name: str
    label: str            # INT8, FP8, INT4: how reports name its quantized layers
    opset: int            # the first ONNX opset with its Q/DQ
    opset_why: str
    method: str           # default calibration method
    placement: str        # its placement file read over placement.toml ("" = none)
    weights_only: bool    # activations stay float
    bits: int
    min_scale_values: int = 1   # fewest values a weight's (blocked) scale may hold and still parse in TensorRT


@lru_cache(maxsize=1)
def precisions() -> dict[str, Precision]:
    """Every precision of rules/precisions.toml, in the file's order (the first is the default)."""
    rf = read_rule_file(bundled(FILE))
    out = {}
    for name, table in rf.data.items():
        missing = [k for k in _FIELDS if k not in table]
        wrong = [k for k, t in _FIELDS.items() if k in table and type(table[k]) is not t]
        wrong += [k for k, (t, _) in _OPTIONAL.items() if k in table and type(table[k]) is not t]
        if missing or wrong:
            raise QdqError(f"{rf.source}: precision {name!r} lacks {missing} or has a wrong type in {wrong}",
                           "reinstall qdqgraph (its bundled rule files are damaged)")
        optional = {k: table.get(k, default) for k, (_, default) in _OPTIONAL.items()}
        out[name] = Precision(name, **{k: table[k] for k in _FIELDS}, **optional)
    return out


def precision(name: str | None) -> Precision:
    """The record of `name` (None: the default precision)."""
    table = precisions()
    if name is None:
        return next(iter(table.values()))
    if name not in table:
        raise QdqError(f"unknown precision {name!r}", f"use one of {', '.join(table)}")
    return table[name]
