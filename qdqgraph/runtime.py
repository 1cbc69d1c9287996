"""onnxruntime sessions for calibration, comparison and sensitivity: one place that builds them."""
from __future__ import annotations

import tempfile
from pathlib import Path

import onnx

from . import io
from .errors import QdqError

# Shared libraries of custom ops (onnxruntime's register_custom_ops_library), from
# --custom-op-library; models with custom-domain ops run in onnxruntime only with them.
_custom_op_libraries: list[str] = []


def register_custom_ops(path: str) -> None:
    p = Path(path)
    if not p.is_file():
        raise QdqError(f"custom op library not found: {p}", "pass the path of the shared library (.so)")
    if str(p) not in _custom_op_libraries:
        _custom_op_libraries.append(str(p))


# onnxruntime's WeightBiasQuantization (a basic-level graph optimization since 1.20) rewrites
# DQ(weight) -> Conv/Gemm with a float bias into an int32 bias quantized with scale
# input_scale * weight_scale. With FP16 scales it miscomputes: on ddddocr_ocr's FP16-island model the
# output SQNR against float fell from 25.7 dB to 3.3 dB (onnxruntime 1.31.1). TensorRT keeps the bias
# in float, so measuring without it is also closer to the engine. See README, "Deployment".
DISABLED_OPTIMIZERS = ["WeightBiasQuantization"]


def graph_session(loaded: io.Loaded, providers: list[str] | None = None, purpose: str = "calibration",
                  outputs: list[str] | None = None):
    """A session over a graphsurgeon graph whose large constants reach onnxruntime from memory;
    `outputs`: float tensors to add as graph outputs."""
    model, weights = io.to_model_and_weights(loaded)
    if outputs:
        model = io.with_outputs(model, outputs)
    return session(model, providers, purpose, weights=weights)


def session(model: onnx.ModelProto, providers: list[str] | None = None, purpose: str = "calibration",
            weights: dict | None = None):
    """A session over `model`; `weights` (name -> array) supply the initializers `model` holds only
    as stubs (`io.to_model_and_weights`); without them, large initializers are split off here."""
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        for lib in _custom_op_libraries:
            opts.register_custom_ops_library(lib)
        providers = providers or ["CPUExecutionProvider"]
        light, weights = (model, weights) if weights is not None else io.split_weights(model)
        blob = io.session_bytes(light) if weights else None
        if blob is not None:
            # the weights reach onnxruntime from memory; it reads them in place, so the session keeps them
            values = [ort.OrtValue.ortvalue_from_numpy(a) for a in weights.values()]
            opts.add_external_initializers(list(weights), values)
            sess = ort.InferenceSession(blob, opts, providers=providers, disabled_optimizers=DISABLED_OPTIMIZERS)
            sess._qdqgraph_weights = (weights, values)
            return sess
        if weights:                      # the rest is still too large for one proto: write it all out
            model = io.fill_weights(light, weights)
        blob = io.session_bytes(model)
        if blob is not None:
            return ort.InferenceSession(blob, opts, providers=providers, disabled_optimizers=DISABLED_OPTIMIZERS)
        with tempfile.TemporaryDirectory() as d:
            return ort.InferenceSession(io.save_temp(model, d), opts, providers=providers,
                                        disabled_optimizers=DISABLED_OPTIMIZERS)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        custom = sorted({f"{n.domain}::{n.op_type}" for n in model.graph.node
                         if n.domain not in ("", "ai.onnx", "ai.onnx.ml", "com.microsoft")})
        fix = ("pass --custom-op-library LIB.so for " + ", ".join(custom) + ", or --calib-cache FILE"
               if custom else "check that the model runs in onnxruntime, or pass --calib-cache")
        raise QdqError(f"onnxruntime cannot run the model for {purpose} ({first})", fix) from e


def float_activations(loaded: io.Loaded, names: list[str], data, samples: int, purpose: str):
    """Yield {tensor: value} of the float model's tensors `names`, one calibration sample at a time,
    for the first `samples` samples."""
    sess = graph_session(io.Loaded(graph=loaded.graph.copy(), ir_version=loaded.ir_version), purpose=purpose,
                         outputs=names)
    for k, feed in enumerate(data.batches(1)):
        if k >= samples:
            return
        yield dict(zip(names, sess.run(names, feed)))
