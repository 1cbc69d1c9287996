"""Read TensorRT's per-layer engine information into the simulator's per-layer form.

Accepted: the JSON of `trtexec --exportLayerInfo` / `IEngineInspector.get_engine_information(JSON)`
(`{"Layers": [...], "Bindings": [...]}`, or a bare list of layers); layers as dicts (detailed
verbosity) or as names only (default verbosity: precisions unknown). A layer's name joins the fused
ONNX nodes with " + " (pointwise groups as `PWN(a, PWN(b, c))`); weight and TensorRT-internal names
appear in it too, so the reader keeps every token and `diff` keeps those that are ONNX node names.

Standalone Q/DQ: `Origin: "QDQ"` (TRT >= 8.4), or, in TRT 8.2-era files without `Origin`, a
`Scale` or `Reformat` layer that changes float <-> Int8. Layout reformats (`Origin: "REFORMAT"`,
"Reformatting CopyNode ...") and TensorRT's own NoOp/Constant layers carry no ONNX node.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import io
from ..errors import QdqError

_LAYOUT_PREFIX = "Reformatting CopyNode"


def precision_of(fmt: str | None) -> str | None:
    """'Thirty-two wide channel vectorized row major Int8 format' -> int8; FP16/Half -> fp16; FP32/Float -> fp32."""
    if not fmt:
        return None
    f = fmt.lower()
    if "int8" in f:
        return "int8"
    if "fp16" in f or "half" in f:
        return "fp16"
    if "fp32" in f or "float" in f:
        return "fp32"
    if "bf16" in f or "bfloat" in f:
        return "bf16"
    if "fp8" in f:
        return "fp8"
    if "int32" in f:
        return "int32"
    return "other"


def split_name(name: str) -> list[str]:
    """Tokens of a fused layer name: ' + ' parts, with PWN(a, PWN(b, c)) groups opened."""
    out = []
    for part in name.split(" + "):
        out.extend(_open_pwn(part.strip()))
    return [t for t in out if t]


def _open_pwn(token: str) -> list[str]:
    m = re.fullmatch(r"PWN\((.*)\)", token)
    if not m:
        return [token]
    inner, parts, depth, cur = m.group(1), [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    parts.append(cur.strip())
    return [t for p in parts for t in _open_pwn(p)]


@dataclass
class EngineLayer:
    name: str
    tokens: list[str]
    layer_type: str | None
    origin: str | None
    inputs: list[tuple[str, str | None]] = field(default_factory=list)    # (tensor, precision)
    outputs: list[tuple[str, str | None]] = field(default_factory=list)

    @property
    def layout(self) -> bool:
        """A layout/format reformat or copy that TensorRT added (no ONNX node behind it)."""
        return self.origin == "REFORMAT" or self.name.startswith(_LAYOUT_PREFIX)

    @property
    def qdq_reformat(self) -> bool:
        """A Q or DQ that ran on its own."""
        if self.origin == "QDQ":
            return True
        if self.origin is None and self.layer_type in ("Scale", "Reformat") and not self.layout:
            ins = {p for _, p in self.inputs if p}
            outs = {p for _, p in self.outputs if p}
            return bool(ins and outs) and (("int8" in ins) != ("int8" in outs))
        return False

    def to_json(self):
        return {"name": self.name, "type": self.layer_type, "origin": self.origin,
                "inputs": [{"tensor": t, "precision": p} for t, p in self.inputs],
                "outputs": [{"tensor": t, "precision": p} for t, p in self.outputs],
                "reformat": self.qdq_reformat}


@dataclass
class EngineReport:
    layers: list[EngineLayer]
    source: str = ""

    @property
    def reformats(self) -> list[EngineLayer]:
        return [x for x in self.layers if x.qdq_reformat]


def _ports(items) -> list[tuple[str, str | None]]:
    out = []
    for p in items or []:
        if isinstance(p, dict):
            out.append((p.get("Name", ""), precision_of(p.get("Format/Datatype"))))
    return out


def parse_engine_info(data, source: str = "") -> EngineReport:
    layers = data.get("Layers") if isinstance(data, dict) else data
    if not isinstance(layers, list):
        raise QdqError(f"{source or 'engine report'}: no \"Layers\" list", "pass trtexec --exportLayerInfo JSON")
    out = []
    for item in layers:
        if isinstance(item, str):
            out.append(EngineLayer(item, split_name(item), None, None))
        elif isinstance(item, dict) and "Name" in item:
            out.append(EngineLayer(item["Name"], split_name(item["Name"]), item.get("LayerType"), item.get("Origin"),
                                   _ports(item.get("Inputs")), _ports(item.get("Outputs"))))
        else:
            raise QdqError(f"{source or 'engine report'}: a layer is neither a name nor an object with \"Name\"",
                           "pass trtexec --exportLayerInfo JSON")
    return EngineReport(out, source)


def read_engine_report(path) -> EngineReport:
    p = Path(path)
    data = io.read_json(p, "an engine report", "pass the file written by trtexec --exportLayerInfo")
    return parse_engine_info(data, str(p))
