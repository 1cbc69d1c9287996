"""A latency estimate of a TensorRT engine from its layer information, without a GPU.

Each layer of the engine (the JSON of `trtexec --exportLayerInfo`, the engine inspector's, or
qdqgraph's own `build --layer-info`) is placed on a roofline of a named GPU:

    time = max(bytes / (bandwidth * bandwidth_fraction), flops / (peak[precision] * math_fraction)) + launch

- bytes: every input and output tensor (its Dimensions times its data type's size, channels padded to
  the vector width of a vectorized format such as NC/32HW32) plus the layer's weights and bias;
- flops: 2 x multiply-adds of a convolution (output elements x input channels per group x kernel
  area, read from the layer's parameters) or of a matrix product; every other layer (pointwise,
  pooling, reformat, shuffle, softmax) is bound by its bytes and counts no math;
- precision: the data type of the layer's first input (Int8 runs on the INT8 tensor cores, Half on
  FP16, Float on TF32 where the GPU has it);
- launch: a fixed cost per kernel; layers TensorRT lists but runs no kernel for (NoOp, Constant)
  cost nothing.

The GPUs (bandwidth and dense throughput from the vendors' spec sheets) and the three global
constants live in rules/gpus.toml; the constants are fitted by benchmarks/fit_estimate.py on the
measured per-layer timings of NVIDIA's published engines. It is an estimate, not a measurement: the
kernel TensorRT picks, the cache and the clocks are not modelled.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..graph import io
from ..errors import QdqError
from ..rulebook.files import bundled, read_rule_file

PRECISIONS = ("fp32", "tf32", "fp16", "int8", "fp8")

# layer types that run no kernel of their own
_NO_KERNEL = frozenset({"NoOp", "Constant", "TrainStation"})
# TensorRT layer types and qdqgraph kinds that compute a convolution or a matrix product
_CONV_TYPES = frozenset({"CaskConvolution", "ConvActPool", "CudaDepthwiseConvolution", "FusedConvActConvolution",
                         "CudnnConvolution", "CaskDeconvolution", "CudnnDeconvolution", "Convolution",
                         "Deconvolution", "convolution"})
_GEMM_TYPES = frozenset({"FullyConnected", "CaskFullyConnected", "MatrixMultiply", "CaskGemmMatrixMultiply",
                         "gemm", "matmul"})

# vector width of a channel-vectorized format, by the word TensorRT's format string starts with
_VECTOR_WORDS = {"two": 2, "four": 4, "eight": 8, "sixteen": 16, "thirty-two": 32}

_FIX_LAYERS = "pass the JSON of trtexec --exportLayerInfo --profilingVerbosity=detailed (or of the engine inspector)"
_FIX_PROFILE = "pass the JSON of trtexec --exportProfile"


@dataclass(frozen=True)
class Gpu:
    name: str
    title: str
    bandwidth_gbs: float
    tflops: dict                       # precision -> dense TFLOPS/TOPS
    source: str

    def peak(self, precision: str) -> float:
        """Dense throughput in TFLOPS for a precision, falling back to the unit the GPU would use."""
        for p in {"fp8": ("fp8", "fp16"), "tf32": ("tf32", "fp32"), "int8": ("int8", "fp16")}.get(precision,
                                                                                                  (precision,)):
            if p in self.tflops:
                return self.tflops[p]
        return self.tflops.get("fp32", 1.0)


@dataclass(frozen=True)
class Constants:
    bandwidth_fraction: float
    math_fraction: float
    launch_us: float


def _table() -> dict:
    return read_rule_file(bundled("gpus.toml")).data


def gpus() -> dict[str, Gpu]:
    out = {}
    for name, row in _table().get("gpu", {}).items():
        out[name] = Gpu(name, row.get("title", name), float(row["bandwidth_gbs"]),
                        {p: float(row[p]) for p in PRECISIONS if p in row}, row.get("source", ""))
    return out


def fitted() -> Constants:
    f = _table()["fit"]
    return Constants(float(f["bandwidth_fraction"]), float(f["math_fraction"]), float(f["launch_us"]))


def fitted_engines() -> dict[str, str]:
    """The engines the constants were fitted on (a path under the oracles folder -> its GPU's name)."""
    return dict(_table()["fit"].get("engines", {}))


def gpu(name: str) -> Gpu:
    known = gpus()
    key = name.strip().lower()
    if key not in known:
        raise QdqError(f"unknown GPU {name!r}; known: {', '.join(sorted(known))}",
                       "pass one of them to --gpu, or add a row to rules/gpus.toml")
    return known[key]


# --- per-layer work -------------------------------------------------------------------------------

def dtype_size(fmt: str | None) -> float:
    """Bytes per element of a TensorRT format/datatype string ('Thirty-two wide channel vectorized row
    major Int8 format' -> 1, 'Half' -> 2, 'Row major linear FP32' -> 4); unknown counts 4."""
    f = (fmt or "").lower()
    for words, size in ((("int4", "fp4"), 0.5), (("int8", "fp8", "e4m3", "uint8", "bool"), 1),
                        (("bf16", "bfloat16", "fp16", "half"), 2), (("int64",), 8),
                        (("fp32", "float", "int32"), 4)):
        if any(w in f for w in words):
            return size
    return 4


def precision_of(fmt: str | None) -> str | None:
    f = (fmt or "").lower()
    if "int8" in f:
        return "int8"
    if "fp8" in f or "e4m3" in f:
        return "fp8"
    if "fp16" in f or "half" in f or "bf16" in f or "bfloat16" in f:
        return "fp16"
    if "fp32" in f or "float" in f:
        return "fp32"
    return None


def _vector_width(fmt: str | None) -> int:
    """Channels a format pads to: 32 for 'Thirty-two wide channel vectorized ...', 8 for 'Channel major
    FP16 format where channel % 8 == 0', 1 for linear formats."""
    f = (fmt or "").lower()
    if "channel %" in f:
        try:
            return int(f.split("channel %")[1].split("==")[0])
        except ValueError:
            return 1
    if "wide channel vectorized" in f:
        return _VECTOR_WORDS.get(f.split(" wide")[0].strip(), 1)
    return 1


def _dims(port: dict) -> list[int] | None:
    d = port.get("Dimensions") if isinstance(port, dict) else None
    if isinstance(d, list) and d and all(isinstance(x, int) for x in d):
        return [max(x, 1) for x in d]       # a dynamic -1 counts 1
    return None


def tensor_bytes(port: dict) -> float:
    dims = _dims(port)
    if dims is None:
        return 0.0
    fmt = port.get("Format/Datatype")
    width = _vector_width(fmt)
    if width > 1 and len(dims) >= 2:
        dims = list(dims)
        dims[1] = -(-dims[1] // width) * width
    return float(math.prod(dims)) * dtype_size(fmt)


def _param(layer: dict, key: str):
    """A convolution parameter, plain (`Kernel`) or prefixed in a fused layer (`ConvKernel`)."""
    return layer.get(key, layer.get("Conv" + key))


def _weight_bytes(layer: dict) -> float:
    total = 0.0
    for key in ("Weights", "Bias", "ConvWeights", "ConvBias"):
        w = layer.get(key)
        if isinstance(w, dict) and isinstance(w.get("Count"), (int, float)):
            total += w["Count"] * dtype_size(w.get("Type"))
    return total


def _conv_flops(layer: dict, inp: list[int] | None, out: list[int] | None) -> float:
    kernel = _param(layer, "Kernel")
    if not isinstance(kernel, list) or inp is None or len(inp) < 3:
        return 0.0
    groups = _param(layer, "Groups") or 1
    maps = _param(layer, "OutMaps") or (out[1] if out else 0)
    n, cin, spatial = inp[0], inp[1], inp[2:]
    stride = _param(layer, "Stride") or [1] * len(kernel)
    pre = _param(layer, "PrePadding") or [0] * len(kernel)
    post = _param(layer, "PostPadding") or [0] * len(kernel)
    dil = _param(layer, "Dilation") or [1] * len(kernel)
    deconv = "deconv" in str(layer.get("LayerType", "")).lower() or "deconv" in str(
        layer.get("ParameterType", "")).lower()
    try:
        if deconv:                 # the work of a transposed conv scales with its input positions
            positions = math.prod(spatial)
        else:
            positions = math.prod((s + a + b - d * (k - 1) - 1) // st + 1
                                  for s, k, st, a, b, d in zip(spatial, kernel, stride, pre, post, dil))
    except (TypeError, ZeroDivisionError):
        positions = math.prod(out[2:]) if out and len(out) > 2 else 0
    if positions <= 0 and out and len(out) > 2:
        positions = math.prod(out[2:])
    return 2.0 * n * maps * positions * (cin / max(groups, 1)) * math.prod(kernel)


def _gemm_flops(layer: dict, ins: list, out: list[int] | None) -> float:
    a = _dims(ins[0]) if ins else None
    b = _dims(ins[1]) if len(ins) > 1 else None
    if a and b and len(b) >= 2:                          # [.., M, K] x [.., K, N]
        return 2.0 * math.prod(a) * b[-1]
    maps = _param(layer, "OutMaps")
    if a and maps:                                       # fully connected: K = all but the batch axis
        return 2.0 * a[0] * math.prod(a[1:]) * maps
    if a and out:
        return 2.0 * math.prod(out) * a[-1]
    return 0.0


@dataclass
class LayerWork:
    name: str
    layer_type: str
    kind: str              # conv, gemm, memory (bytes-bound), none (no kernel)
    bytes: float
    flops: float
    precision: str | None  # of the math


def layer_work(layer) -> LayerWork:
    if isinstance(layer, str):
        return LayerWork(layer, "", "unknown", 0.0, 0.0, None)
    name = str(layer.get("Name", ""))
    ltype = str(layer.get("LayerType") or layer.get("Kind") or "")
    ins = [p for p in layer.get("Inputs") or [] if isinstance(p, dict)]
    outs = [p for p in layer.get("Outputs") or [] if isinstance(p, dict)]
    if ltype in _NO_KERNEL:
        return LayerWork(name, ltype, "none", 0.0, 0.0, None)
    nbytes = sum(tensor_bytes(p) for p in ins + outs) + _weight_bytes(layer)
    qkind = layer.get("Kind")
    first = ins[0] if ins else {}
    out = _dims(outs[0]) if outs else None
    if ltype in _CONV_TYPES or qkind == "convolution":
        kind, flops = "conv", _conv_flops(layer, _dims(first), out)
    elif ltype in _GEMM_TYPES or qkind == "gemm":
        kind, flops = "gemm", _gemm_flops(layer, ins, out)
    else:
        kind, flops = "memory", 0.0
    precision = precision_of(first.get("Format/Datatype")) if flops else None
    if precision == "fp32":
        precision = "tf32"
    return LayerWork(name, ltype, kind, nbytes, flops, precision)


def read_layers(path) -> list[dict]:
    data = io.read_json(Path(path), "an engine's layer information", _FIX_LAYERS)
    layers = data.get("Layers") if isinstance(data, dict) else data
    if not isinstance(layers, list) or not layers:
        raise QdqError(f"{path}: no \"Layers\" list (not TensorRT layer information)", _FIX_LAYERS)
    if not any(isinstance(x, dict) and x.get("Inputs") for x in layers):
        raise QdqError(f"{path} lists layer names only, without tensor shapes: nothing to estimate from",
                       "rebuild the engine with --profilingVerbosity=detailed and export its layer information again")
    return layers


def read_profile(path) -> dict[str, float]:
    """Layer name -> average milliseconds, from `trtexec --exportProfile` (a list: a {"count"} header,
    then one {"name", "averageMs", ...} per layer)."""
    data = io.read_json(Path(path), "a per-layer profile", _FIX_PROFILE)
    items = data if isinstance(data, list) else data.get("Layers") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise QdqError(f"{path} is not a per-layer profile (no list of layers)", _FIX_PROFILE)
    out: dict[str, float] = {}
    for x in items:
        if isinstance(x, dict) and isinstance(x.get("name"), str):
            ms = x.get("averageMs", x.get("timeMs"))
            if isinstance(ms, (int, float)):
                out[x["name"]] = out.get(x["name"], 0.0) + float(ms)
    if not out:
        raise QdqError(f"{path} lists no layer timings", _FIX_PROFILE)
    return out


# --- the estimate ---------------------------------------------------------------------------------

def layer_ms(work: LayerWork, g: Gpu, c: Constants) -> float:
    if work.kind == "none" or (work.bytes <= 0 and work.flops <= 0):
        return 0.0
    memory = work.bytes / (g.bandwidth_gbs * 1e9 * c.bandwidth_fraction)
    # an unknown math type (precision None) takes the fp32 peak, which is also peak()'s fallback
    compute = work.flops / (g.peak(work.precision or "fp32") * 1e12 * c.math_fraction) if work.flops else 0.0
    return (max(memory, compute) + c.launch_us * 1e-6) * 1e3


@dataclass
class LayerEstimate:
    work: LayerWork
    ms: float
    measured_ms: float | None = None

    @property
    def bound(self) -> str:
        return "math" if self.work.flops and self.work.kind != "memory" else "memory"


@dataclass
class Estimate:
    gpu: Gpu
    constants: Constants
    layers: list[LayerEstimate]
    source: str = ""
    measured_ms: float | None = None
    unmatched: list[str] = field(default_factory=list)   # profiled layers the layer JSON does not name

    @property
    def total_ms(self) -> float:
        return sum(x.ms for x in self.layers)

    @property
    def kernels(self) -> int:
        return sum(1 for x in self.layers if x.ms > 0)

    @property
    def error(self) -> float | None:
        """(estimate - measured) / measured; None without a measured time or with a measured 0.0."""
        if not self.measured_ms:
            return None
        return self.total_ms / self.measured_ms - 1.0

    def summary(self) -> str:
        s = (f"estimated {self.total_ms:.3f} ms on {self.gpu.title} ({self.kernels} kernels; roofline estimate, "
             f"not a measurement)")
        if self.measured_ms is not None:
            s += f"; measured {self.measured_ms:.3f} ms"
            error = self.error
            if error is not None:
                s += f", error {error * 100:+.1f} %"
        return s

    def table(self, top: int = 10) -> str:
        rows = sorted(self.layers, key=lambda x: -x.ms)[:top]
        measured = any(x.measured_ms is not None for x in rows)
        head = f"  {'est ms':>8}" + (f" {'meas ms':>8}" if measured else "") + f"  {'GFLOP':>7} {'MB':>7}  layer"
        lines = [self.summary(), f"top {len(rows)} layers by estimate:", head]
        for x in rows:
            m = (f" {x.measured_ms:8.4f}" if x.measured_ms is not None else f" {'-':>8}") if measured else ""
            lines.append(f"  {x.ms:8.4f}{m}  {x.work.flops / 1e9:7.2f} {x.work.bytes / 1e6:7.2f}  "
                         f"{x.work.layer_type}: {x.work.name[:70]}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = {"gpu": self.gpu.name, "gpu_title": self.gpu.title, "source": self.source,
             "total_ms": round(self.total_ms, 6), "kernels": self.kernels,
             "constants": {"bandwidth_fraction": self.constants.bandwidth_fraction,
                           "math_fraction": self.constants.math_fraction, "launch_us": self.constants.launch_us},
             "method": "roofline estimate from layer shapes and the GPU's spec-sheet figures, not a measurement",
             "layers": [{"name": x.work.name, "type": x.work.layer_type, "kind": x.work.kind,
                         "bytes": x.work.bytes, "flops": x.work.flops, "precision": x.work.precision,
                         "ms": round(x.ms, 6), **({"measured_ms": x.measured_ms} if x.measured_ms is not None else {})}
                        for x in self.layers]}
        if self.measured_ms is not None:
            d["measured_ms"] = round(self.measured_ms, 6)
            error = self.error
            if error is not None:           # a measured 0.0 gives no error figure
                d["error"] = round(error, 4)
            d["unmatched_profile_layers"] = self.unmatched
        return d


def estimate_layers(layers: list, g: Gpu, constants: Constants | None = None,
                    profile: dict[str, float] | None = None, source: str = "") -> Estimate:
    c = constants or fitted()
    out = []
    for layer in layers:
        w = layer_work(layer)
        out.append(LayerEstimate(w, layer_ms(w, g, c), profile.get(w.name) if profile else None))
    est = Estimate(g, c, out, source)
    if profile is not None:
        est.measured_ms = sum(profile.values())
        named = {x.work.name for x in out}
        est.unmatched = [n for n in profile if n not in named]
    return est


def estimate(layers_path, gpu_name: str, profile_path=None, constants: Constants | None = None) -> Estimate:
    """The engine at `layers_path` (layer information JSON) on the GPU named `gpu_name` (rules/gpus.toml),
    with the measured per-layer profile beside it when `profile_path` is given."""
    g = gpu(gpu_name)
    layers = read_layers(layers_path)
    profile = read_profile(profile_path) if profile_path else None
    return estimate_layers(layers, g, constants, profile, str(layers_path))
