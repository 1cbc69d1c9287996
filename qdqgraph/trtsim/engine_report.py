"""Read TensorRT's per-layer engine information into the simulator's per-layer form.

Accepted: the JSON of `trtexec --exportLayerInfo` / `IEngineInspector.get_engine_information(JSON)`
(`{"Layers": [...], "Bindings": [...]}`, or a bare list of layers); layers as dicts (detailed
verbosity) or as names only (default verbosity: precisions unknown). A layer's name joins the fused
ONNX nodes with " + " (pointwise groups as `PWN(a, PWN(b, c))`); weight and TensorRT-internal names
appear in it too, so the reader keeps every token and `diff` keeps those that are ONNX node names.

Standalone Q/DQ: `Origin: "QDQ"` (TRT >= 8.4), or, in TRT 8.2-era files without `Origin`, a
`Scale` or `Reformat` layer that changes float <-> Int8. Layout reformats (`Origin: "REFORMAT"`,
"Reformatting CopyNode ...") and TensorRT's own NoOp/Constant layers carry no ONNX node.

qdqgraph's own layer JSON (`build --layer-info`, any backend) uses the same keys and adds, per layer,
"Nodes" (the ONNX nodes the kernel computes, from the compiler's metadata), "Kind" (convolution,
gemm, attention, pointwise, quantize, dequantize, pooling, ...), "Fused" (the ops a generated kernel
strings together) and each tensor's "Dimensions"; its "Origin" is "QDQ" for a kernel that only
quantizes or dequantizes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..graph import io
from ..errors import QdqError

_LAYOUT_PREFIX = "Reformatting CopyNode"


def precision_of(fmt: str | None) -> str | None:
    """'Thirty-two wide channel vectorized row major Int8 format' -> int8; FP16/Half -> fp16; BF16/BFloat16 -> bf16; FP32/Float -> fp32."""
    if not fmt:
        return None
    f = fmt.lower()
    if "int8" in f:
        return "int8"
    if "int4" in f:
        return "int4"
    if "fp16" in f or "half" in f:
        return "fp16"
    if "bf16" in f or "bfloat" in f:        # before "float": BFloat16 holds the word
        return "bf16"
    if "fp32" in f or "float" in f:
        return "fp32"
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
    nodes: list[str] = field(default_factory=list)       # ONNX nodes behind the kernel (compiler metadata)
    kind: str | None = None                              # qdqgraph's kind, where the backend told it
    fused: list[str] = field(default_factory=list)       # ops strung together in a generated kernel
    shapes: dict[str, list[int]] = field(default_factory=dict)   # tensor -> dims, where given
    constants: list[tuple[str, str | None]] = field(default_factory=list)   # weights and other constants

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
        return {"name": self.name, "type": self.layer_type, "origin": self.origin, "kind": self.kind,
                "nodes": self.nodes, "fused": self.fused,
                "inputs": [{"tensor": t, "precision": p, "shape": self.shapes.get(t)} for t, p in self.inputs],
                "outputs": [{"tensor": t, "precision": p, "shape": self.shapes.get(t)} for t, p in self.outputs],
                "reformat": self.qdq_reformat}

    def to_trt_json(self) -> dict:
        """The layer in TensorRT's layer-information keys plus qdqgraph's (read back by parse_engine_info)."""
        def port(t, p):
            d = {"Name": t, "Format/Datatype": _DATATYPE.get(p or "", p or "")}
            if t in self.shapes:
                d["Dimensions"] = self.shapes[t]
            return d
        return {"Name": self.name, "LayerType": self.layer_type, "Origin": self.origin, "Kind": self.kind,
                "Nodes": self.nodes, "Fused": self.fused, "Inputs": [port(t, p) for t, p in self.inputs],
                "Outputs": [port(t, p) for t, p in self.outputs]}


@dataclass
class EngineReport:
    layers: list[EngineLayer]
    source: str = ""
    backend: str = ""        # the compiler that built it, where qdqgraph's layer JSON says

    @property
    def reformats(self) -> list[EngineLayer]:
        return [x for x in self.layers if x.qdq_reformat]


_DATATYPE = {"int8": "Int8", "fp16": "Half", "fp32": "Float", "bf16": "BFloat16", "fp8": "FP8", "int32": "Int32",
             "int4": "Int4"}

_FIX = "pass the JSON of trtexec --exportLayerInfo (or of the engine inspector)"


def _ports(items, where: str, shapes: dict) -> list[tuple[str, str | None]]:
    if items is None:
        return []
    if not isinstance(items, list):
        raise QdqError(f"{where}: \"Inputs\"/\"Outputs\" must be lists, not {type(items).__name__}", _FIX)
    out = []
    for p in items:
        if isinstance(p, dict):
            name, fmt = p.get("Name", ""), p.get("Format/Datatype")
            if not isinstance(name, str) or not (fmt is None or isinstance(fmt, str)):
                raise QdqError(f"{where}: a tensor's \"Name\" and \"Format/Datatype\" must be strings", _FIX)
            dims = p.get("Dimensions")
            if isinstance(dims, list) and all(isinstance(d, int) for d in dims):
                shapes[name] = dims
            out.append((name, precision_of(fmt)))
    return out


_MYELIN_SUFFIX = re.compile(r"_myl\d+_\d+$")


def compiler_node(text: str) -> str:
    """The ONNX node a TensorRT for RTX name part stands for. Inside an If branch the compiler prefixes
    the conditional and the branch (`$$myelin$$(Unnamed IfConditional* 0)^$$myelin$$then^then.c/Conv`)
    and, in metadata, appends them (`then.c/Conv | then_16k (then_branch) | /If (If)`)."""
    return text.split(" | ")[0].rsplit("^", 1)[-1].strip()


def compiler_tokens(name: str) -> list[str]:
    """The ONNX node names a TensorRT for RTX kernel's name carries: `_myl<k>_<i>` appended, merged
    GEMMs joined with '+'."""
    return [compiler_node(t) for t in _MYELIN_SUFFIX.sub("", name).split("+") if t]


def _tokens(name: str, compiler_listing: bool) -> list[str]:
    """Tokens of a layer name: qdqgraph's own layer JSON (with a "Kind") holds compiler kernel names."""
    return compiler_tokens(name) if compiler_listing else split_name(name)


def _strings(item: dict, key: str, at: str) -> list[str]:
    v = item.get(key, [])
    if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
        raise QdqError(f"{at}: \"{key}\" must be a list of strings", _FIX)
    return v


def parse_engine_info(data, source: str = "") -> EngineReport:
    where = source or "engine report"
    layers = data.get("Layers") if isinstance(data, dict) else data
    if not isinstance(layers, list):
        raise QdqError(f"{where}: no \"Layers\" list (not TensorRT layer information)", _FIX)
    if not layers:
        raise QdqError(f"{where} lists no layers", _FIX)
    out = []
    for k, item in enumerate(layers):
        if isinstance(item, str):
            out.append(EngineLayer(item, split_name(item), None, None))
        elif isinstance(item, dict) and isinstance(item.get("Name"), str):
            at = f"{where}: layer {k} ({item['Name'][:60]})"
            kind, origin = item.get("LayerType"), item.get("Origin")
            if not (kind is None or isinstance(kind, str)) or not (origin is None or isinstance(origin, str)):
                raise QdqError(f"{at}: \"LayerType\" and \"Origin\" must be strings", _FIX)
            shapes: dict = {}
            nodes = _strings(item, "Nodes", at)
            qkind = item.get("Kind")
            out.append(EngineLayer(item["Name"], _tokens(item["Name"], isinstance(qkind, str)), kind, origin,
                                   _ports(item.get("Inputs"), at, shapes), _ports(item.get("Outputs"), at, shapes),
                                   nodes=nodes, kind=qkind if isinstance(qkind, str) else None,
                                   fused=_strings(item, "Fused", at), shapes=shapes))
        else:
            raise QdqError(f"{where}: layer {k} is neither a name nor an object with a string \"Name\"", _FIX)
    backend = data.get("backend") if isinstance(data, dict) else None
    return EngineReport(out, source, backend if isinstance(backend, str) else "")


def read_engine_report(path) -> EngineReport:
    p = Path(path)
    data = io.read_json(p, "an engine report", _FIX)
    return parse_engine_info(data, str(p))
