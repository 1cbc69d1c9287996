"""Read the compiled engine back from TensorRT for RTX's build log, without a GPU.

With DETAILED profiling verbosity and a VERBOSE logger, the builder logs `Layers:` followed by one
line per kernel of the compiled engine (then `I/O Tensors:`):

    Name: stem/Conv_myl0_1, LayerType: correlation, Inputs: [ { Name: t, Dimensions: [1,4,32,32], ...
    Datatype: Int8, Format: ... }], Constants: [ ... ], Outputs: [ ... ], TacticName: ..., StreamId: 0,
    Metadata: [ONNX Layer: stem/Conv][ONNX Layer: input_dq][ONNX Layer: stem/Conv_weight_dq]

Each line becomes an EngineLayer (qdqgraph.trtsim.engine_report), the schema `report --against`
reads: the ONNX nodes from the metadata, each input's and output's precision and shape, qdqgraph's
kind, and for a generated kernel (`kgen`, named `__myl_<Op><Op>..._myl<k>_<i>`) the ops it strings
together. A generated kernel made only of scaling, clamping, rounding, casts and data movement is a
standalone quantize (quantized out: INT8 rounds, `...MinMaxRounCast`, FP8 scales and casts, `MulCast`)
or dequantize (quantized in, float out): the reformats that cost time.
"""
from __future__ import annotations

import re

from ..trtsim.engine_report import EngineLayer, EngineReport, compiler_node, compiler_tokens, precision_of

_KINDS = {"correlation": "convolution", "deconv": "deconvolution", "gemm": "gemm", "maxpool": "pooling",
          "avgpool": "pooling", "runtime_fusion": "fusion", "signal": "event", "wait": "event"}
# the ops of a generated kernel that only scale, clamp, round, cast or move data
_QDQ_OPS = {"Mul", "Div", "Min", "Max", "Roun", "Cast"}
_MOVE_OPS = {"Resh", "Tran", "Move", "Conc", "Slic", "Copy", "Expa", "Squeeze", "Unsq", "Gath"}
_FIELD = re.compile(r"(?:^|, )(Name|LayerType|Inputs|Constants|Outputs|TacticName|StreamId|Metadata): ")
_TENSOR = re.compile(r"\{ Name: (?P<name>.*?), Dimensions: \[(?P<dims>[^\]]*)\].*?Datatype: (?P<dtype>\w+)")
_META = re.compile(r"\[ONNX Layer: ([^\]]*)\]")
_GENERATED = re.compile(r"^__myl_(?P<ops>[A-Za-z0-9]+?)_myl\d+_\d+$")


def listing_lines(log: list[str]) -> list[str]:
    """The kernel lines of the `Layers:` listing in the builder's log messages (one message may
    hold the whole listing, or one line each)."""
    lines = [ln for msg in log for ln in msg.splitlines()]
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip() == "Layers:")
    except StopIteration:
        return []
    out = []
    for ln in lines[start + 1:]:
        if ln.startswith("Name: "):
            out.append(ln)
        elif out and not ln.strip() or ln.startswith("I/O Tensors:"):
            break
    return out


def _fields(line: str) -> dict[str, str]:
    marks = list(_FIELD.finditer(line))
    return {m.group(1): line[m.end():marks[k + 1].start() if k + 1 < len(marks) else len(line)]
            for k, m in enumerate(marks)}


def _tensors(text: str, shapes: dict) -> list[tuple[str, str | None]]:
    out = []
    for m in _TENSOR.finditer(text or ""):
        dims = [int(d) for d in m.group("dims").split(",") if d.strip().lstrip("-").isdigit()]
        shapes[m.group("name")] = dims
        out.append((m.group("name"), precision_of(m.group("dtype"))))
    return out


def fused_ops(name: str) -> list[str]:
    """'__myl_MulCastAddReluMulMinMaxRounCast_myl0_2' -> [Mul, Cast, Add, Relu, Mul, Min, Max, Roun,
    Cast]; a name the compiler cut ends in 'Etc' (kept, so the list is known to be partial)."""
    m = _GENERATED.match(name)
    return re.findall(r"[A-Z][a-z0-9]*", m.group("ops")) if m else []


def _kind(layer_type: str, name: str, fused: list[str], inputs, outputs) -> tuple[str, bool]:
    """qdqgraph's kind of a kernel, and whether it is a standalone quantize/dequantize."""
    if name.startswith("_gemm_mha") or "_mha" in name and layer_type == "kgen":
        return "attention", False
    if layer_type != "kgen":
        return _KINDS.get(layer_type, layer_type), False
    if fused and "Etc" not in fused and set(fused) <= _QDQ_OPS | _MOVE_OPS:
        ins = {p for _, p in inputs}
        outs = {p for _, p in outputs}
        quantized = {"int8", "fp8", "int4"}
        if outs & quantized:            # INT8 rounds (Roun); FP8 only scales and casts
            return "quantize", True
        if ins & quantized and outs and not outs & quantized:
            return "dequantize", True
        if set(fused) <= _MOVE_OPS | {"Cast"}:
            return "shuffle", False
    return "pointwise", False


def parse_listing(lines: list[str], source: str = "") -> EngineReport:
    """EngineLayers from the kernel lines of a `Layers:` listing."""
    out = []
    for line in lines:
        f = _fields(line)
        name, layer_type = f.get("Name", "").strip(), f.get("LayerType", "").strip()
        shapes: dict = {}
        inputs, outputs = _tensors(f.get("Inputs", ""), shapes), _tensors(f.get("Outputs", ""), shapes)
        fused = fused_ops(name)
        kind, reformat = _kind(layer_type, name, fused, inputs, outputs)
        nodes = list(dict.fromkeys(compiler_node(t) for t in _META.findall(f.get("Metadata", ""))))
        out.append(EngineLayer(name, compiler_tokens(name), layer_type, "QDQ" if reformat else None, inputs, outputs,
                               nodes=nodes, kind=kind, fused=fused, shapes=shapes,
                               constants=_tensors(f.get("Constants", ""), shapes)))
    return EngineReport(out, source)
