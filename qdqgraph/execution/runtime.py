"""onnxruntime sessions for calibration, comparison and sensitivity: one place that builds them."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..graph import io, proto
from ..errors import QdqError
from . import dequantized
from .shared_constants import share_equal_constants
from .profile import step
import onnxruntime as ort

# Shared libraries of custom ops (onnxruntime's register_custom_ops_library), from
# --custom-op-library; models with custom-domain ops run in onnxruntime only with them.
_custom_op_libraries: list[str] = []


def register_custom_ops(path: str) -> None:
    """Check that onnxruntime can load the custom-op library at `path` (now, before any work), and
    register it for every session made after. A library it cannot load is a QdqError and is not
    registered."""
    p = Path(path)
    if not p.exists():
        raise QdqError(f"custom op library not found: {p}", "pass the path of the shared library (.so)")
    if not p.is_file():
        raise QdqError(f"custom op library {p} is not a file", "pass the path of the shared library (.so)")
    if str(p) in _custom_op_libraries:
        return
    try:
        ort.SessionOptions().register_custom_ops_library(str(p))
    except Exception as e:  # onnxruntime raises its own Fail (dlopen or RegisterCustomOps failed)
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        why = text.split(" with error: ", 1)[-1].removeprefix(f"{p}: ")
        raise QdqError(f"onnxruntime cannot load the custom op library {p} ({why})",
                       "pass a shared library (.so) built for this onnxruntime that exports RegisterCustomOps") from None
    _custom_op_libraries.append(str(p))


def custom_op_libraries() -> list[str]:
    """The custom-op libraries registered in this process (a Ray worker registers them too)."""
    return list(_custom_op_libraries)


# onnxruntime's WeightBiasQuantization (a basic-level graph optimization since 1.20) rewrites
# DQ(weight) -> Conv/Gemm with a float bias into an int32 bias quantized with scale
# input_scale * weight_scale. With FP16 scales it miscomputes: on ddddocr_ocr's FP16-island model the
# output SQNR against float fell from 25.7 dB to 3.3 dB (onnxruntime 1.31.1). TensorRT keeps the bias
# in float, so measuring without it is also closer to the engine. See README, "Deployment".
#
# Its ReluQuantRewrite (and ClipQuantRewrite) drop a Relu (a Clip at 0) before a QuantizeLinear whose
# zero point is its type's lowest value, which is right for uint8; before an FP8 QuantizeLinear
# (zero point 0) it drops the Relu anyway, and the negative values pass: a residual CNN in FP8 fell
# to cosine 0.37 against float (0.998 without the rewrite; onnxruntime 1.32). With qdqgraph's
# symmetric INT8 (zero point 0, lowest -128) the rewrites never apply, so turning them off changes
# nothing there.
#
# Its MatmulTransposeFusion (a Transpose, or a Transpose and a Cast, folded into a FusedMatMul) was
# reported to kill the process with a segmentation fault on FP16-island ViT graphs with onnxruntime
# 1.32 (`fix --calib` of insert's ViT output, `insert --exclude-node '.*'`; turning off either this
# fusion or NchwcTransformer avoided it). It did not reproduce on an AMD EPYC (AVX-512 without FP16
# arithmetic) with 1.32.0 or 1.31.1: there onnxruntime computes an FP16 MatMul through Casts to
# float32, and the fusion leaves FP16 graphs as they are. Turning it off costs nothing measurable: on
# MiniLM-L6 (float32) and ViT-S (FP16 islands) the outputs were bit-identical and no slower with it
# off (the Transpose it folds is a copy next to the GEMM). NchwcTransformer stays on: the blocked
# layout is most of onnxruntime's speed on float32 convolutions.
FP16_FAULTS = ["WeightBiasQuantization", "MatmulTransposeFusion"]
FP8_FAULTS = ["ReluQuantRewrite", "ClipQuantRewrite"]
DISABLED_OPTIMIZERS = FP16_FAULTS + FP8_FAULTS


def graph_session(loaded: io.Loaded, providers: list[str] | None = None, purpose: str = "calibration",
                  outputs: list[str] | None = None, optimize: bool = True, widen: bool = False, spin: bool = True,
                  share: bool = False):
    """A session over a graphsurgeon graph whose large constants reach onnxruntime from memory;
    `outputs`: float tensors to add as graph outputs; `optimize=False`: no graph optimizations;
    `widen`: FP16 computed as float32 (`session`); `spin=False`: its threads stop spinning when a
    run ends, for callers that compute between runs (`_options`); `share`: its weights are the
    graph's arrays, whatever their size (`session`)."""
    with step("export for onnxruntime"):
        model, weights = io.to_model_and_weights(loaded)
    if outputs:
        model = io.with_outputs(model, outputs)
    opts = _options(spin=spin) if not optimize or not spin else None
    if opts is not None and not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return session(model, providers, purpose, weights=weights, opts=opts, widen=widen, share=share)


def _options(spin: bool = True, threads: int = 0):
    """Session options; `spin=False`: onnxruntime's worker threads stop spinning as soon as a run
    ends instead of spinning for the next, so work between runs (binning) gets the cores. (They
    still spin within a run: turning spinning off altogether made each run of a small model wait
    on thread wake-ups, EfficientNet-B0's calibration loop 6.4 s -> 8.3 s for 512 samples.)
    `threads`: onnxruntime's intra-op threads per run (0: its default, one per core)."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = threads
    if not spin:
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    for lib in _custom_op_libraries:
        opts.register_custom_ops_library(lib)
    return opts


def session(model: proto.ModelProto, providers: list[str] | None = None, purpose: str = "calibration",
            weights: dict | None = None, opts=None, threads: int = 0, widen: bool = False, as_written: bool = False,
            share: bool = False, spin: bool = True):
    """A session over `model`; `weights` (name -> array) supply the initializers `model` holds only
    as stubs (`io.to_model_and_weights`); without them, large initializers are split off here.
    `opts`: session options of the caller's own (custom-op libraries already registered); else
    `threads`: onnxruntime's intra-op threads (0: one per core) and `spin=False`: its threads stop
    spinning when a run ends, for callers that compute between runs (`_options`). `widen`: on a graph of
    LARGE_GRAPH_NODES nodes or more, the model's FP16 tensors computed as float32 (io.widen_fp16;
    `model` is not changed), for sessions that score a written model (see LARGE_GRAPH_NODES).
    `as_written`: onnxruntime's basic optimization level, the Q/DQ computed as written, without the
    fused kernels' copies of the weights. `share`: the `weights` are onnxruntime shared
    initializers whatever their size (as from SHARE_WEIGHTS_MIN_BYTES on: no copy; unpacked GEMMs,
    whose sums differ in the last bits), for a session whose weights would otherwise be a second
    copy of the model's, held while the model's own session runs."""
    opts = opts or _options(spin=spin, threads=threads)
    if as_written:
        opts = _as_written(opts)
    with step("onnxruntime session"):
        return _session(model, providers, purpose, weights, opts, widen, share)


def _as_written(opts):
    """`opts` at onnxruntime's basic optimization level (or left with none): the Q/DQ run as written,
    none of its fused kernels (nor their copies of the weights)."""
    if opts.graph_optimization_level != ort.GraphOptimizationLevel.ORT_DISABLE_ALL:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return opts


def _session(model: proto.ModelProto, providers: list[str] | None, purpose: str, weights: dict | None, opts,
             widen: bool = False, share: bool = False):
    try:
        providers = providers or ["CPUExecutionProvider"]
        light, weights = (model, weights) if weights is not None else io.split_weights(model)
        if widen and len(light.graph.node) >= LARGE_GRAPH_NODES and not io.has_fp16_inputs(light):
            light = proto.copy_model(light) if light is model else light     # stubs: the weights are not copied
            weights = io.widen_fp16(light, weights)
            share_equal_constants(light)                # the zero points' repeats opened once (shared_constants)
            model = light if not weights else model     # without weights apart, `light` is the whole model
            # and the Q/DQ computed as written, without any of onnxruntime's graph optimizations
            # (see LARGE_GRAPH_NODES)
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        model, light, weights = _dequantize_once(model, light, weights, opts, providers)
        blob = io.session_bytes(light) if weights else None
        if blob is not None:
            # the weights reach onnxruntime from memory; it reads them in place, so the session keeps them
            values = [ort.OrtValue.ortvalue_from_numpy(a) for a in weights.values()]
            if share or (SHARE_WEIGHTS_MIN_BYTES is not None
                         and sum(a.nbytes for a in weights.values()) >= SHARE_WEIGHTS_MIN_BYTES):
                sess = _shared_session(blob, weights, values, opts, providers)
            else:
                opts.add_external_initializers(list(weights), values)
                sess = _inference_session(blob, opts, providers)
            sess._qdqgraph_weights = (weights, values)
            return sess
        if weights:                      # the rest is still too large for one proto: write it all out
            model = io.fill_weights(light, weights)
        blob = io.session_bytes(model)
        if blob is not None:
            return _inference_session(blob, opts, providers)
        with tempfile.TemporaryDirectory() as d:
            return _inference_session(io.save_temp(model, d), opts, providers)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        custom = sorted({f"{n.domain}::{n.op_type}" for n in model.graph.node
                         if n.domain not in ("", "ai.onnx", "ai.onnx.ml", "com.microsoft")})
        cache = purpose == "calibration"     # a calibration cache stands in for that run alone
        fix = ("pass --custom-op-library LIB.so for " + ", ".join(custom) + (", or --calib-cache FILE" if cache else "")
               if custom else "check that the model runs in onnxruntime" + (", or pass --calib-cache" if cache else ""))
        raise QdqError(f"onnxruntime cannot run the model for {purpose} ({first})", fix) from e


def _dequantize_once(model: proto.ModelProto, light: proto.ModelProto, weights: dict, opts, providers: list):
    """(model, light, weights) with the constant weights' DequantizeLinear computed once
    (execution.dequantized) on the CPU provider alone: float32 ones too where `opts` fuse
    nothing, any reader's where they optimize nothing; without prepacking then. Another provider gets the Q/DQ as written."""
    if providers != ["CPUExecutionProvider"]:
        return model, light, weights
    level = opts.graph_optimization_level
    fusing = level not in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
    light, weights, folded = dequantized.fold(light, weights, float32=not fusing,
                                              optimized=level != ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    if not folded:
        return model, light, weights
    _config(opts, "session.disable_prepacking", "1")
    return (light if not weights else model), light, weights


# A graph of this many nodes or more is large: opening an onnxruntime session on it costs more than
# the few samples qdqgraph runs through it, and where that cost has a way around, it takes it.
# - A session that scores a written model (comparison, --verify, the fidelity recipes) computes its FP16 tensors in float32 (io.widen_fp16): onnxruntime's own
# handling of FP16 (a Cast to float32 and back around each node it has no FP16 kernel for, then the
# pairs between such nodes removed) costs time that grows with the square of the graph, 27 s to open
# a 10,000-node CNN's Q/DQ model with FP16 islands against 4.0 s widened. Below it onnxruntime's
# handling stays: the two are not the same arithmetic (its FP16 kernels, DequantizeLinear's among
# them, round their outputs to FP16), and a Q/DQ model amplifies the difference: a value moved by an
# FP16 rounding lands on the other side of an INT8 rounding step, so the two ways give two draws of
# the quantization noise, each as far from float as the other (benchmarks/widen_fp16.py: the 10k CNN
# 33.3 and 33.1 dB from float, 31.7 dB apart; MiniLM-L6's last_hidden_state 5.8 and 5.7 dB, 16.3 dB
# apart). TensorRT's own kernels are a third draw. Those sessions also run without graph
# optimizations there: the Q/DQ run as written (TensorRT's arithmetic up to the order of sums).
# onnxruntime's fusions took half of the 8.2 s of opening the 10k CNN's written model; its basic
# level still cost 6.6 s against 4.8 s with none (40k: 41.7 against 28.4 s), for bit-identical
# outputs and 8 runs no faster.
# - The calibration session hands its outputs out in plain layout (`unordered_session`): the blocked
#   layout needs a second session (the first writes the optimized graph that shows which outputs
#   are blocked), 5.8 s of the 10k CNN's calibrate stage for 8 samples of 8x8 maps. It also stops
#   at onnxruntime's extended level, without the layout level: the NCHWc transformer, asked for every
#   tensor in plain layout, adds a reorder per output and takes time that grows with the square of
#   the graph to do it (the 10k CNN's float model with every tensor an output opened in 4.5 s with
#   it, 1.5 s without, and ran 8 samples in 2.2 s against 1.6 s; at 40k nodes 52.5 s to open against
#   9.0 s without any optimization; benchmarks/ort_session_open.py).
# - The island-ranges session runs unoptimized (passes.precision.measure_ranges): it opens 3x
#   faster (10k nodes: 4.8 s -> 1.4 s); below, optimized, since each Q and DQ unfused ran Whisper
#   tiny.en's encoder at 0.64 s a sample.
LARGE_GRAPH_NODES = 5000


# onnxruntime copies every initializer handed to it with add_external_initializers, or prepacks it
# into a buffer of its own: a session holds a second copy of the model's weights (+466 MB on a 453 MB
# encoder, benchmarks/ort_session_memory.py). As shared initializers (add_initializer) without
# prepacking it runs on the graph's arrays in place (+15 MB), but unpacked GEMMs round differently
# (outputs 1e-6 apart, relative), so that calibration could move. Sessions whose weights reach this
# many bytes take that way; None: none do. From 256 MiB on: there the copy is what the memory is
# spent on (the 453 MB encoder's insert peaked at 1448 MB with every session copying, 1303 MB with
# them sharing, one run each), and the 1e-6 moves a scale as a second calibration draw would (the
# encoder's written model then verified at 24.3 dB from float instead of 24.1); every smaller model,
# the zoo's and torchvision's among them, is computed as before.
SHARE_WEIGHTS_MIN_BYTES: int | None = 256 << 20


def _shared_session(blob: bytes, weights: dict, values: list, opts, providers: list[str]):
    """A session over the model `blob` whose stub initializers are onnxruntime shared initializers
    over `weights` (no copy, no prepacking). onnxruntime checks that a stub's data file exists: the
    model is read from a temporary folder beside an empty file of the stubs' location."""
    _config(opts, "session.disable_prepacking", "1")
    for name, value in zip(weights, values):
        opts.add_initializer(name, value)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.onnx")
        with open(path, "wb") as f:
            f.write(blob)
        open(os.path.join(d, io.IN_MEMORY_LOCATION), "wb").close()
        return _inference_session(path, opts, providers)


# onnxruntime 1.31 (onnxruntime-gpu's newest release) refuses FP8 Q/DQ models at its extended
# optimization level: its fusions (MatMulIntegerToFloat, and the Q/DQ moves through Squeeze and
# Transpose) produce nodes whose schema has no float8 type, and the session fails with "Type
# 'tensor(float8e4m3fn)' of input parameter (...) of operator (MatMulIntegerToFloat) ... is
# invalid". 1.32 accepts the same models. On that failure the session is made again at the basic
# level, which has none of those fusions (the failure is matched, not the version, so any release
# that refuses FP8 there is covered and none that accepts it loses its optimizations).
FP8_REFUSED = "Type 'tensor(float8"


# onnxruntime fuses DQ -> MatMul/Conv -> Q into integer kernels; on an x86 CPU with AVX2 and no
# VNNI (AMD Zen 3, Intel before Cascade Lake) those multiply unsigned by signed 8-bit values into
# 16-bit sums that saturate where weights use the whole INT8 range, as per-channel scales and
# smoothing make them. TensorRT's INT8 kernels accumulate in 32 bits. On such a CPU a two-GEMM
# LayerNorm model whose output-aware scales made it 37.6 dB from float (computed with the Q/DQ as
# written: unfused, or with this entry) scored 22.0 dB in a default session, below the 29.6 dB of
# the plain scales, and a fidelity decision or --verify would have said so. This entry makes
# onnxruntime take its exact path there; it changes nothing on a CPU with VNNI or AVX-512.
EXACT_INT8 = ("session.x64quantprecision", "1")


def _exact_int8(opts) -> None:
    _config(opts, *EXACT_INT8)


def _config(opts, key: str, value: str) -> None:
    """`opts`'s session config entry `key` set to `value`, unless already set (the caller's own
    setting stays; onnxruntime warns on an entry set twice)."""
    try:
        opts.get_session_config_entry(key)
    except Exception:
        opts.add_session_config_entry(key, value)


# onnxruntime 1.32 on a CPU without VNNI, under EXACT_INT8, fails to open some Q/DQ files of other
# tools (AMD Quark's CLE output of transformers) in its integer fusion: "Attempt to
# replace the existing tensor". At the basic level, without that fusion, they open and compute
# the Q/DQ as written.
FUSION_FAILURES = (FP8_REFUSED, "Attempt to replace the existing tensor")


def _inference_session(source, opts, providers: list[str]):
    """onnxruntime.InferenceSession with qdqgraph's disabled rewrites and its exact INT8 kernels
    (EXACT_INT8); where that fails at a higher optimization level than the basic one with one of
    FUSION_FAILURES, made again at the basic level, which computes the Q/DQ as written. Where the
    basic level fails too, the first failure is raised; any other failure is raised at once."""
    _exact_int8(opts)
    level = ort.GraphOptimizationLevel
    retry = opts.graph_optimization_level not in (level.ORT_ENABLE_BASIC, level.ORT_DISABLE_ALL)
    severity = opts.log_severity_level
    if retry and severity >= 3:
        opts.log_severity_level = 4      # errors only: a failure is raised, not also logged (it may be retried)
    try:
        return ort.InferenceSession(source, opts, providers=providers, disabled_optimizers=DISABLED_OPTIMIZERS)
    except Exception as e:
        if not retry or not any(known in str(e) for known in FUSION_FAILURES):
            raise
        first = e
    finally:
        opts.log_severity_level = severity
    opts.graph_optimization_level = level.ORT_ENABLE_BASIC
    try:
        return ort.InferenceSession(source, opts, providers=providers, disabled_optimizers=DISABLED_OPTIMIZERS)
    except Exception:
        raise first from None


# onnxruntime's CPU provider runs convolutions in a blocked channel layout (NCHWc: channels in
# blocks of 8 with AVX2, 16 with AVX-512) and adds a ReorderOutput node for every graph output it
# has to hand back in NCHW. When the observed tensors are graph outputs, those reorders are work
# inference alone never does: on ResNet-50 (53 observed tensors) a batch-1 run took 33.6 ms
# instead of 27.1 for plain inference, and 29.3 with the blocked tensors as outputs. A histogram
# or a max does not depend on the order of the values, so the calibration session can hand out the
# blocked tensors as they are, provided no channel padding is in them: only tensors whose channel
# count is a multiple of the largest block are taken blocked, and the caller checks every run's
# shapes (`BlockedOutputs.check`).
_NCHWC = "com.microsoft.nchwc"
_REORDER_OUTPUT = "ReorderOutput"
NCHWC_LARGEST_BLOCK = 16


class BlockedOutputs:
    """What `unordered_session` did: `fetch` maps each requested output to the name to fetch, and
    `channels` holds, for the outputs fetched blocked, the channel count they must show."""

    def __init__(self, fetch: dict[str, str], channels: dict[str, int]):
        self.fetch, self.channels = fetch, channels

    def check(self, arrays: dict) -> bool:
        """True if every blocked output of a run (name -> array) carries exactly its channels."""
        return all(arrays[n].ndim >= 2 and arrays[n].shape[1] == c for n, c in self.channels.items())


def unordered_session(loaded: io.Loaded, outputs: list[str], providers: list[str] | None = None,
                      purpose: str = "calibration", blocked: bool = True, threads: int = 0):
    """A session over `loaded` with the float tensors `outputs` as graph outputs, for consumers to
    whom only the multiset of values matters (histograms, max): with onnxruntime's CPU provider,
    outputs it computes in a blocked channel layout come out in that layout (see above) unless
    `blocked` is False. `threads`: onnxruntime's threads per run (0: one per core).
    The consumer works between runs, so onnxruntime's threads stop spinning when a run ends
    (measured on 512 samples at batch 1, against spinning on: calibration loop on ResNet-50 19.4-20.1 s
    -> 18.5-18.9 s, EfficientNet-B0 7.8 -> 6.4 s, MobileNetV3-Large 4.8 -> 4.2 s).
    Returns (session, BlockedOutputs)."""
    if len(loaded.graph.nodes) >= LARGE_GRAPH_NODES:
        opener, same = large_unordered(loaded, outputs, providers, purpose, threads)
        return opener(), same
    with step("export for onnxruntime"):
        model, weights = io.to_model_and_weights(loaded)
    model = io.with_outputs(model, outputs)
    same = BlockedOutputs({n: n for n in outputs}, {})

    def plain():
        return session(model, providers, purpose, weights=weights, opts=_options(spin=False, threads=threads))
    if not blocked or list(providers or ["CPUExecutionProvider"]) != ["CPUExecutionProvider"] \
            or not _may_block(loaded):
        return plain(), same
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as d:
        # onnxruntime optimizes the graph and writes the result (weights in a file beside it); any
        # failure on this way (a full disk, a model it cannot save) leaves the plain-layout session
        opts = _options(spin=False, threads=threads)
        opts.optimized_model_filepath = os.path.join(d, "optimized.onnx")
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "weights.bin")
        opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        try:
            first = session(model, providers, purpose, weights=weights, opts=opts)
            optimized = proto.load_bare(opts.optimized_model_filepath)
        except Exception:                # the plain session says what is wrong if it also fails
            return plain(), same
        found = _drop_reorders(optimized, set(outputs))
        if not found.channels:
            return first, same
        del first
        opts = _options(spin=False, threads=threads)
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        try:
            path = os.path.join(d, "unordered.onnx")
            proto.save_bare(optimized, path)
            with step("onnxruntime session"):
                return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"]), found
        except Exception:
            return plain(), same


def large_unordered(loaded: io.Loaded, outputs: list[str], providers: list[str] | None = None,
                    purpose: str = "calibration", threads: int = 0):
    """`unordered_session` on a graph of LARGE_GRAPH_NODES nodes or more, in two parts: the model
    exported here, and a callable that opens its session (no blocked layout to hand out, and none
    to compute in: see LARGE_GRAPH_NODES). onnxruntime opens a session without holding the GIL, so
    another thread may call it while this one computes (calib.opening). Returns (opener, BlockedOutputs)."""
    with step("export for onnxruntime"):
        model, weights = io.to_model_and_weights(loaded)
    model = io.with_outputs(model, outputs)
    opts = _options(spin=False, threads=threads)
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    return (lambda: session(model, providers, purpose, weights=weights, opts=opts)), \
        BlockedOutputs({n: n for n in outputs}, {})


# Ops onnxruntime's NCHWc transformer starts a blocked region at; a graph without them has no blocked
# outputs, and saving its optimized model (its weights written out, a transient copy of them: 453 MB
# on a 453 MB encoder) is skipped.
_BLOCKING_OPS = {"Conv", "MaxPool", "AveragePool", "GlobalMaxPool", "GlobalAveragePool"}


def _may_block(loaded: io.Loaded) -> bool:
    return any(n.op in _BLOCKING_OPS for g in (loaded.graph, *loaded.graph.subgraphs(recursive=True))
               for n in g.nodes)


def _drop_reorders(model: proto.ModelProto, outputs: set[str]) -> BlockedOutputs:
    """Remove the ReorderOutput nodes that only convert a requested graph output back from a blocked
    layout without padding, and output their blocked input instead (in place)."""
    g = model.graph
    used = _inputs_read(g)
    producer = {o: n for n in g.node for o in n.output}
    fetch = {n: n for n in outputs}
    channels: dict[str, int] = {}
    dropped = []
    outs = [o.name for o in g.output]
    for name in outs:
        if name not in outputs:
            continue
        n = producer.get(name)
        found = _blocked_source(n, name, used, outs, channels)
        if found is None:
            continue
        src, c = found
        fetch[name], channels[src] = src, c
        dropped.append(n)
    if dropped:                          # one rebuild: removing one by one is quadratic in protobuf
        _remove_reorders(g, dropped)
    _retarget_outputs(g, fetch)
    return BlockedOutputs(fetch, channels)


def _blocked_source(n, name: str, used: set[str], outs: list[str],
                    channels: dict[str, int]) -> tuple[str, int] | None:
    """(blocked input, channels) when `n`, the producer of output `name`, is a ReorderOutput that can go; else None."""
    if n is None or n.domain != _NCHWC or n.op_type != _REORDER_OUTPUT or name in used:
        return None
    attrs = {a.name: proto.attribute_value(a) for a in n.attribute}
    c, src = attrs.get("channels", 0), n.input[0]
    if attrs.get("channels_last", 0) or c <= 0 or c % NCHWC_LARGEST_BLOCK or src in outs or src in channels:
        return None
    return src, int(c)


def _remove_reorders(g: proto.GraphProto, dropped: list) -> None:
    """Rebuild the node list of `g` without the ReorderOutput nodes in `dropped`."""
    gone = {n.output[0] for n in dropped}
    kept = []
    for n in g.node:
        if not (n.op_type == _REORDER_OUTPUT and n.output and n.output[0] in gone):
            kept.append(proto.copy_node(n))
    del g.node[:]
    g.node.extend(kept)


def _retarget_outputs(g: proto.GraphProto, fetch: dict[str, str]) -> None:
    """Turn each graph output that is fetched from another tensor into that tensor (float)."""
    for o in g.output:
        if o.name in fetch and fetch[o.name] != o.name:
            new = fetch[o.name]
            o.CopyFrom(proto.value_info(new, proto.FLOAT))


def _inputs_read(g: proto.GraphProto) -> set[str]:
    """Every tensor name a node of `g` or of any subgraph reads."""
    return {i for graph in (g, *io.subgraphs(g)) for n in graph.node for i in n.input}


def float_activations(loaded: io.Loaded, names: list[str], data, samples: int, purpose: str):
    """Yield {tensor: value} of the float model's tensors `names`, one calibration sample at a time,
    for the first `samples` samples."""
    for _, values in float_runs(loaded, names, data, samples, purpose):
        yield values


def float_runs(loaded: io.Loaded, names: list[str], data, samples: int, purpose: str):
    """`float_activations`, each sample's values with its feed: (feed, {tensor: value}). The caller
    works on each sample's values between runs: the session's threads stop spinning when a run
    ends (`_options`), which would otherwise hold the cores that work wants (numpy's products of
    MiniLM's residual layers took 0.13 s a sample against 2 ms)."""
    sess = graph_session(io.Loaded(graph=loaded.graph.copy(), ir_version=loaded.ir_version), purpose=purpose,
                         outputs=names, spin=False)
    for k, feed in enumerate(data.batches(1)):
        if k >= samples:
            return
        yield feed, dict(zip(names, sess.run(names, feed)))


def deployment_session(model, providers: list[str] | None = None, options=None):
    """An onnxruntime session that computes a qdqgraph model as TensorRT does: onnxruntime's own
    optimizations, less the rewrites that change what a Q/DQ model computes (DISABLED_OPTIMIZERS:
    WeightBiasQuantization's INT32 bias, ReluQuantRewrite's dropped Relu before an FP8 Q; and
    MatmulTransposeFusion, reported to crash on FP16 islands), at the basic
    level where this onnxruntime refuses FP8 above it. `model`: a path or a ModelProto; `options`:
    onnxruntime.SessionOptions of the caller's (custom-op libraries registered, threads); `providers`:
    onnxruntime's names (default: CPU). Exported as `qdqgraph.session`."""
    source = model.SerializeToString() if isinstance(model, proto.ModelProto) else str(model)
    return _inference_session(source, options or ort.SessionOptions(), providers or ["CPUExecutionProvider"])
