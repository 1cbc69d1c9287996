#!/usr/bin/env python3
"""qdqgraph's defaults beside the INT8 post-training recipes of AIMET-ONNX, AMD Quark and NVIDIA Model
Optimizer, in one run on the model zoo and the transformer set, each output scored the same way (issue 31).

    python benchmarks/peers_ptq.py [--set zoo,tfm] [--only a,b] [--tools qdqgraph,aimet-cle,...] [--out DIR]
        [--peer-python /tmp/peers-venv/bin/python] [--zoo-scripts /work/shared/zoo]
        [--samples 16] [--holdout 16] [--ada-iters 200] [--jsonl rows.jsonl] [--timeout 1200]
    python benchmarks/peers_ptq.py --table rows.jsonl [...]      # the tables of saved rows

The peers live in a venv of their own (never the project's):

    python3 -m venv /tmp/peers-venv
    /tmp/peers-venv/bin/pip install aimet-onnx==2.42.0 amd-quark==0.13 onnxruntime numpy

--set picks the models: `zoo` (default), the zoo's models with a data file (--zoo), and `tfm`, the
transformer set (--tfm, benchmarks/transformers/setup.sh: Whisper tiny.en encoder and decoder, ViT-S,
DistilBERT). Both keep MODEL.onnx under models/, its calibration file under calib/ and the full
data file under data/.

Every tool runs in a child process (qdqgraph: its CLI, `qdqgraph insert MODEL --calib CALIB -o OUT`,
defaults; a peer: this file with --child in the peers' python), timed in wall seconds, on the
model's calibration file (the even-indexed samples of the data file; --samples at most for the
peers, which keep every sample's activations in memory). Each peer is set up as a TensorRT user
would: INT8 weights and activations, symmetric (zero point 0), weights per output channel, biases
left float (TensorRT takes no INT32 bias), and the tool's own accuracy recipe:

  aimet-cle       AIMET: cross-layer equalization, then min/max calibration (every op's output quantized)
  aimet-adaround  AIMET: CLE, then AdaRound (--ada-iters iterations per layer)
  aimet-seqmse    AIMET: CLE, then sequential MSE weight ranges
  quark-cle       Quark: CLE, then its default activation calibration (percentile)
  quark-cle-gemm  quark-cle with OpTypesToQuantize Conv, ConvTranspose, Gemm, MatMul: their inputs
                  quantized, as TensorRT's guidance places Q/DQ, not every op (Quark's default). AIMET 2.42
                  has no such setting: its config refuses outputs left float by default
                  (NotImplementedError), and per op type with the GEMMs' inputs quantized it fails
                  ("Conflicting tensor quantizer settings for symmetric encodings")
  quark-adaround  Quark: CLE, then AdaRound (fast finetune, --ada-iters iterations per layer)
  quark-adaquant  Quark: CLE, then AdaQuant (fast finetune, --ada-iters iterations per layer)
  modelopt        NVIDIA Model Optimizer's INT8 (benchmarks/peer_int8.modelopt_int8: max calibration, its
                  defaults otherwise, so the float parts become FP16), in its own venv
                  (benchmarks/setup_modelopt.sh, --modelopt-python)
  modelopt-entropy  the same with Model Optimizer's own default calibration for INT8 (entropy)

Each written model is then measured in the project's python, the same way for every tool:
  * output SQNR and cosine to the float model on --holdout samples no tool saw (odd-indexed samples of
    the data file), run in onnxruntime with the rewrites TensorRT does not make turned off
    (qdqgraph.execution.evaluate.compare): per output; the table shows the lowest output;
  * the INT8 share of FLOPs as qdqgraph's TensorRT simulator predicts it (qdqgraph.trtsim.simulate);
  * whether TensorRT for RTX parses and builds it (no GPU needed; one optimization profile from the
    calibration shapes), with the first error line when not;
  * the task metric of the set's evaluator, through benchmarks/eval_safe.py with the same rewrites off,
    over all samples of the data file (neither can score a subset): the zoo's eval_models.py --compare;
    for the transformer set benchmarks/transformers/evaluate.py --compare in the set's venv (the
    Whisper encoder scored with the float decoder and the decoder with the float encoder's states; the
    pair, both of one tool, stays in the saved task line as whisper_tiny_en_pipeline).

One JSON line per (model, tool) goes to --jsonl; the task metrics follow as one line per tool.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ZOO = Path(os.environ.get("QDQGRAPH_ZOO", "/tmp/qdqgraph-zoo"))
TFM = Path(os.environ.get("QDQGRAPH_TRANSFORMERS", "/tmp/qdqgraph-tfm"))
SETS = ("zoo", "tfm")
PEERS = ("aimet-cle", "aimet-adaround", "aimet-seqmse", "quark-cle", "quark-adaround", "quark-adaquant",
         "quark-cle-gemm")
GEMMS = ["Conv", "ConvTranspose", "Gemm", "MatMul"]
MODELOPT = {"modelopt": "max", "modelopt-entropy": "entropy"}     # tool -> its calibration_method
TOOLS = ("qdqgraph", *PEERS, *MODELOPT)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def one_line(text: str) -> str:
    lines = [x.strip() for x in str(text).splitlines() if x.strip()]
    return (lines[-1] if lines else str(text))[:240]


# ----------------------------------------------------------------------------- peers (child process)

def feeds(model: str, calib: str, limit: int) -> list[dict]:
    """One feed per calibration sample (benchmarks/peers_lowbit.load_samples)."""
    sys.path.insert(0, str(HERE))
    from peers_lowbit import load_samples
    return load_samples(model, calib, limit)


def aimet_config(work: Path) -> str:
    """AIMET's per-channel config with activations symmetric too, signed (zero point 0), biases float."""
    import aimet_onnx
    base = Path(aimet_onnx.__file__).parent / "common" / "quantsim_config" / "default_config_per_channel.json"
    cfg = json.loads(base.read_text())
    cfg["defaults"]["ops"]["is_symmetric"] = "True"
    cfg["defaults"]["unsigned_symmetric"] = "False"
    cfg["params"]["bias"] = {"is_quantized": "False"}
    path = work / "aimet_config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def run_aimet(tool: str, model: str, out: str, data: list[dict], iters: int, work: Path) -> dict:
    import onnx
    from aimet_onnx import apply_adaround, apply_seq_mse
    from aimet_onnx.cross_layer_equalization import equalize_model
    from aimet_onnx.quantsim import QuantizationSimModel
    note: dict = {}
    m = onnx.load(model)
    equalize_model(m)
    # dummy_input: a real sample (AIMET's random one breaks models whose inputs steer their control flow)
    sim = QuantizationSimModel(m, param_type="int8", activation_type="int8", quant_scheme="min_max",
                               dummy_input=data[0], config_file=aimet_config(work),
                               providers=["CPUExecutionProvider"])
    if tool == "aimet-adaround":
        apply_adaround(sim, data, num_iterations=iters)
        note["adaround_iterations"] = iters
    elif tool == "aimet-seqmse":
        apply_seq_mse(sim, data)
    sim.compute_encodings(data)
    qdq = sim.to_onnx_qdq(export_int32_bias=False, force_activation_as="signed")
    note.update(one_value_field(qdq))
    onnx.save(qdq, out)
    return note


def one_value_field(m) -> dict:
    """AIMET 2.42 writes some weights it rescaled (CLE) with both raw_data and float_data, which the
    ONNX checker (and qdqgraph's loader) refuses; keep raw_data, the values it computed last, and
    say which tensors were repaired (the row shows it: the file as AIMET wrote it does not load)."""
    fixed = []
    consts = [a.t for n in m.graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
    for t in [*m.graph.initializer, *consts]:
        if t.raw_data and len(t.float_data):
            del t.float_data[:]
            fixed.append(t.name)
    return {"repaired_two_value_fields": fixed} if fixed else {}


def run_quark(tool: str, model: str, out: str, data: list[dict], iters: int, work: Path) -> dict:
    from quark.onnx import ModelQuantizer
    from quark.onnx.quantization.config.algorithm import AdaQuantConfig, AdaRoundConfig, CLEConfig
    from quark.onnx.quantization.config.config import QConfig
    from quark.onnx.quantization.config.spec import Int8Spec, QLayerConfig, QuantGranularity
    sys.path.insert(0, str(HERE))
    from peers_lowbit import Reader
    note: dict = {}
    algos = [CLEConfig()]
    if tool == "quark-adaround":
        algos.append(AdaRoundConfig(num_iterations=iters, batch_size=1, num_batches=len(data)))
        note["adaround_iterations"] = iters
    elif tool == "quark-adaquant":
        algos.append(AdaQuantConfig(num_iterations=iters, batch_size=1, num_batches=len(data)))
        note["adaquant_iterations"] = iters
    # Int8Spec: symmetric signed INT8, float scales, Quark's default calibration (percentile) for
    # activations; weights per output channel; no bias spec: biases stay float
    layer = QLayerConfig(activation=Int8Spec(), weight=Int8Spec(quant_granularity=QuantGranularity.Channel))
    extra = {"OpTypesToQuantize": GEMMS} if tool.endswith("-gemm") else {}
    cfg = QConfig(global_config=layer, algo_config=algos, Int32Bias=False, QuantizeBias=False, **extra)
    ModelQuantizer(cfg).quantize_model(model, out, Reader(data))
    return note


def prepare(model: str, work: Path, note: dict) -> str:
    """The model as a TensorRT user would hand it to a peer: at opset 13 at least (per-channel
    QuantizeLinear needs it; Quark refuses less), and with a named dimension where the export wrote
    -1 (AIMET makes a random input of that shape). Each change is noted in the row."""
    import onnx
    m = onnx.load(model)
    changed = False
    v = next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))
    if v < 13:
        m = onnx.version_converter.convert_version(m, 13)
        note["converted_opset"] = f"{v} -> 13"
        changed = True
    for i in m.graph.input:
        for k, d in enumerate(i.type.tensor_type.shape.dim):
            if d.HasField("dim_value") and d.dim_value <= 0:
                d.dim_param = f"{i.name}_dim{k}"
                note["named_dims"] = note.get("named_dims", 0) + 1
                changed = True
    if not changed:
        return model
    path = work / ("prepared-" + Path(model).name)
    onnx.save(m, str(path))
    return str(path)


def child(tool: str, model: str, calib: str, out: str, samples: int, iters: int) -> dict:
    r = {"tool": tool, "ok": False, "error": None}
    work = Path(out).parent
    work.mkdir(parents=True, exist_ok=True)
    data = feeds(model, calib, samples)
    r["samples"] = len(data)
    os.chdir(work)             # Quark writes its side files (quantized_info.csv, *.data) where it runs
    t = time.perf_counter()
    try:
        model = prepare(model, work, r)
        runner = run_aimet if tool.startswith("aimet") else run_quark
        r.update(runner(tool, model, out, data, iters, work))
        r["ok"] = Path(out).exists()
        r["error"] = None if r["ok"] else "wrote no model"
    except Exception as e:  # noqa: BLE001 - the table shows the failure
        import traceback
        traceback.print_exc()
        r["error"] = one_line(f"{type(e).__name__}: {e}")
    r["seconds"] = round(time.perf_counter() - t, 2)
    r["peak_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return r


# ----------------------------------------------------------------------------- quantize (parent)

def quantize(tool: str, model: Path, calib: Path, out: Path, a) -> dict:
    """Run `tool` on `model` in a child process; {ok, seconds, error, ...}."""
    out.unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    if tool in MODELOPT:
        sys.path.insert(0, str(HERE))
        from peer_int8 import modelopt_int8
        t = time.perf_counter()
        err = modelopt_int8(model, calib, out, a.modelopt_python, a.samples, MODELOPT[tool])
        return {"ok": err is None and out.exists(), "seconds": round(time.perf_counter() - t, 2), "error": err}
    if tool == "qdqgraph":
        cmd = [str(Path(sys.executable).parent / "qdqgraph"), "insert", str(model), "--calib", str(calib),
               "-o", str(out), "--force"]
    else:
        cmd = [a.peer_python, __file__, "--child", tool, str(model), str(calib), str(out),
               "--samples", str(a.samples), "--ada-iters", str(a.ada_iters)]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"ok": False, "seconds": a.timeout, "error": f"timed out after {a.timeout} s"}
    wall = round(time.perf_counter() - t, 2)
    logs = out.parent / "logs"
    logs.mkdir(exist_ok=True)
    (logs / f"{model.stem}.log").write_text(f"$ {' '.join(cmd)}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}\n")
    if tool == "qdqgraph":
        ok = p.returncode == 0 and out.exists()
        return {"ok": ok, "seconds": wall, "error": None if ok else one_line(p.stderr or p.stdout)}
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if not lines:
        why = f"killed by signal {-p.returncode}" if p.returncode < 0 else one_line(p.stderr) or f"exit {p.returncode}"
        return {"ok": False, "seconds": wall, "error": why}
    r = json.loads(lines[-1])
    r["wall_seconds"] = wall
    return r


# ----------------------------------------------------------------------------- measure (parent)

def held_out(model: Path, npz: Path, samples: int):
    """The model's held-out samples: odd-indexed samples of the data file (as fidelity_defaults)."""
    sys.path.insert(0, str(HERE))
    from fidelity_defaults import data_of
    return data_of(model, npz, samples, odd=True)[1]


def fidelity(model: Path, out: Path, data) -> dict:
    from qdqgraph.errors import QdqError
    from qdqgraph.execution.evaluate import compare
    try:
        c = compare(str(model), str(out), data=data, tensors=False)
    except QdqError as e:
        if "ONNX checker" in e.problem:
            return fidelity_plain(model, out, data) | {"loader": one_line(e.problem)}
        if "cannot run the model for comparison" not in e.problem:
            raise
        # onnxruntime's exact INT8 path refuses some peer files ("Attempt to replace the existing
        # tensor"); without graph rewrites the Q/DQ run as written, the arithmetic TensorRT does
        return fidelity_plain(model, out, data, unfused=True) | {"runner": one_line(e.problem)[:160]}
    except Exception as e:
        # onnxruntime's full optimization level breaks some peer files at run time (AIMET's and Model
        # Optimizer's ViT: its bicubic Resize, "'Cubic' mode only supports ..."); scored unfused too
        if type(e).__module__.split(".")[0] != "onnxruntime":
            raise
        return fidelity_plain(model, out, data, unfused=True) | {"runner": one_line(f"{type(e).__name__}: {e}")[:160]}
    return {"samples": c.samples,
            "outputs": {a.name: {"sqnr_db": round(a.sqnr_db, 2), "cosine": round(a.cosine, 6)} for a in c.outputs}}


def fidelity_plain(model: Path, out: Path, data, unfused: bool = False) -> dict:
    """`fidelity` for a file qdqgraph's loader refuses (the ONNX checker): both models in plain
    onnxruntime sessions with the same rewrites off; `unfused`: no graph rewrite at all (every
    Q/DQ computed as written, in float), for a file onnxruntime's fused INT8 kernels refuse."""
    import onnxruntime as ort
    from qdqgraph.execution.runtime import DISABLED_OPTIMIZERS
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if unfused:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    f, q = (ort.InferenceSession(str(p), opts, providers=["CPUExecutionProvider"],
                                 disabled_optimizers=DISABLED_OPTIMIZERS) for p in (model, out))
    names = [o.name for o in f.get_outputs()]
    sums: dict = {}
    n = 0
    for feed in data.batches(1):
        for name, a, b in zip(names, f.run(names, feed), q.run(names, feed)):
            if np.issubdtype(np.asarray(a).dtype, np.floating):
                a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
                s = sums.setdefault(name, np.zeros(4))
                s += [a @ a, b @ b, a @ b, (a - b) @ (a - b)]
        n += 1
    outs = {k: {"sqnr_db": round(float(10 * np.log10(v[0] / v[3])) if v[3] else float("inf"), 2),
                "cosine": round(float(v[2] / (np.sqrt(v[0] * v[1]) + 1e-30)), 6)} for k, v in sums.items()}
    return {"samples": n, "outputs": outs}


def int8_share(out: Path) -> float:
    from qdqgraph.trtsim import simulate
    return simulate(str(out)).summary["int8_flops_share"]


def trt_rtx(out: Path, model: Path, calib: Path) -> dict:
    """TensorRT for RTX: parse and build the file as written (one profile from the calibration shapes
    of the float model's inputs, which every tool keeps). A file qdqgraph's loader refuses is still
    built; the row notes the loader's reason."""
    from qdqgraph.backends import BuildOptions, tensorrt_rtx
    from qdqgraph.backends.profiles import profiles
    from qdqgraph.config import QuantizeConfig
    from qdqgraph.graph import io
    from qdqgraph.prepare import model_inputs, read_data
    from qdqgraph.trtsim import simulate
    row: dict = {}
    try:
        formats = simulate(io.load(out).graph, target=tensorrt_rtx.NAME).formats
    except Exception as e:  # noqa: BLE001 - noted, and built anyway
        formats = frozenset({"INT8"})
        row["loader"] = one_line(getattr(e, "problem", None) or str(e))
    loaded = io.load(model)
    data = read_data(loaded, str(calib), QuantizeConfig())
    options = BuildOptions(profiles=profiles(model_inputs(loaded.graph), data), force=True, formats=formats)
    plan = out.with_suffix(".engine")
    t = time.perf_counter()
    try:
        res = tensorrt_rtx.build(out, plan, options)
    except Exception as e:  # noqa: BLE001 - a failed build is a table cell
        why = one_line(getattr(e, "problem", None) or str(e))
        return row | {"ok": False, "seconds": round(time.perf_counter() - t, 2), "error": why}
    finally:
        plan.unlink(missing_ok=True)
    return row | {"ok": True, "seconds": round(res.seconds, 2), "warnings": len(res.warnings)}


def files(name: str, a) -> tuple[Path, Path, Path]:
    """The model, its calibration file and its full data file, in the folder of the model's set."""
    root = a.roots[name]
    return root / "models" / f"{name}.onnx", root / "calib" / f"{name}.npz", root / "data" / f"{name}.npz"


def measure(name: str, tool: str, out: Path, a) -> dict:
    model, calib, data = files(name, a)
    row: dict = {}
    steps = (("holdout", lambda: fidelity(model, out, held_out(model, data, a.holdout))),
             ("int8_flops_share", lambda: int8_share(out)),
             ("trt_rtx", lambda: trt_rtx(out, model, calib)))
    for key, fn in steps:
        try:
            row[key] = fn()
        except Exception as e:  # noqa: BLE001 - one failed measurement is one cell
            row[key] = {"error": one_line(f"{type(e).__name__}: {e}")}
    return row


def task_metrics(tool: str, names: list[str], a) -> dict:
    """The set's evaluator with --compare on the tool's folder, onnxruntime's unsafe rewrites off."""
    sys.path.insert(0, str(HERE))
    import zoo_accuracy
    from qdqgraph.execution.runtime import DISABLED_OPTIMIZERS
    os.environ["QDQGRAPH_ORT_DISABLED"] = ",".join(DISABLED_OPTIMIZERS)
    os.environ["QDQGRAPH_ORT_BASIC"] = "1"
    zoo_accuracy.SAFE_ORT = True
    folder = a.out / tool
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    zoo = [n for n in names if a.roots[n] == a.zoo]
    tfm = [n for n in names if a.roots[n] == a.tfm]
    res = {}
    if zoo:
        res.update(zoo_accuracy.eval_models(str(a.zoo / "venv" / "bin" / "python"), a.zoo_scripts, a.zoo, zoo,
                                            folder / "eval.json", folder / "logs" / "eval.log", compare=folder))
    if tfm:
        res.update(tfm_metrics(folder, tfm, a))
    return res


def tfm_metrics(folder: Path, names: list[str], a) -> dict:
    """benchmarks/transformers/evaluate.py --compare FOLDER in the transformer set's venv."""
    out, logf = folder / "eval-tfm.json", folder / "logs" / "eval-tfm.log"
    cmd = [str(a.tfm / "venv" / "bin" / "python"), str(HERE / "eval_safe.py"), str(HERE / "transformers" / "evaluate.py"),
           str(a.tfm / "models"), str(a.tfm / "data"), "--compare", str(folder), "--only", ",".join(names),
           "--json", str(out)]
    out.unlink(missing_ok=True)
    with logf.open("w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, check=False)
    if p.returncode == 0 and out.exists():
        return json.loads(out.read_text())
    why = f"evaluate.py exit {p.returncode}: {one_line(logf.read_text())}"
    return {n: {"eval_error": why} for n in names}


# ----------------------------------------------------------------------------- tables

def _lowest(row: dict) -> str:
    h = row.get("holdout") or {}
    if "error" in h:
        return h["error"][:110]
    outs = h.get("outputs") or {}
    if not outs:
        return "-"
    worst = min(outs.values(), key=lambda o: o["sqnr_db"])
    more = f" (min of {len(outs)})" if len(outs) > 1 else ""
    more += " (Q/DQ unfused: onnxruntime's optimized session fails on the file)" if h.get("runner") else ""
    return f"{worst['sqnr_db']:.1f} / {worst['cosine']:.5f}{more}"


def _metric(row: dict, tasks: dict) -> str:
    r = (tasks.get(row["tool"]) or {}).get(row["model"])
    if not r or "other_task" not in r:
        return "-" if not r else one_line(r.get("other_error") or r.get("eval_error") or "-")[:60]
    k = next(k for k in r["float_task"] if k != "speech_fraction")
    agree = next(iter((r.get("agreement") or {}).values()), None)
    return f"{r['other_task'][k]:.3f}" + (f" ({agree:.3f})" if isinstance(agree, float) else "")


def _short(error: str) -> str:
    """The builder's reason without its fixed prefix."""
    for prefix in ("TensorRT could not build the engine: ", "IBuilder::buildSerializedNetwork: ", "Error Code 4: "):
        error = error.removeprefix(prefix)
    return error[:110]


def table(rows: list[dict], tasks: dict) -> str:
    head = ["model", "metric (float)", "tool", "task metric (agreement with float)", "held-out SQNR dB / cosine (lowest output)",
            "INT8 FLOPs", "wall s", "TensorRT-RTX build"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    floats = {}
    for by_model in tasks.values():
        for m, r in (by_model or {}).items():
            if "float_task" in r:
                k = next(k for k in r["float_task"] if k != "speech_fraction")
                floats[m] = f"{k} ({r['float_task'][k]:.3f})"
    order = {t: i for i, t in enumerate(TOOLS)}
    for row in sorted(rows, key=lambda r: (r["model"], order.get(r["tool"], len(order)))):
        q = row.get("quantize") or {}
        if not q.get("ok"):
            cells = [row["model"], floats.get(row["model"], "-"), row["tool"], "-", f"failed: {q.get('error')}"[:170],
                     "-", f"{q.get('seconds', 0):.0f}", "-"]
        else:
            s = row.get("int8_flops_share")
            b = row.get("trt_rtx") or {}
            cells = [row["model"], floats.get(row["model"], "-"), row["tool"], _metric(row, tasks), _lowest(row),
                     f"{100 * s:.1f}%" if isinstance(s, float) else "- (not loadable)",
                     f"{q.get('wall_seconds', q['seconds']):.0f}",
                     ("builds" if b.get("ok") else f"no: {_short(str(b.get('error')))}")
                     + (" (qdqgraph's loader refuses the file: the ONNX checker)" if b.get("loader") else "")]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def saved_quantize(jsonl: Path) -> dict:
    """{(model, tool): the quantize record of its last row} in `jsonl` (rows that wrote a model)."""
    rows = [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()] if jsonl.exists() else []
    return {(r["model"], r["tool"]): r["quantize"] for r in rows if "model" in r and (r.get("quantize") or {}).get("ok")}


# ----------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=4, metavar=("TOOL", "MODEL", "CALIB", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--set", default="zoo", help=f"comma list of model sets: {', '.join(SETS)} (default zoo)")
    ap.add_argument("--zoo", type=Path, default=ZOO)
    ap.add_argument("--tfm", type=Path, default=TFM, help="the transformer set's folder")
    ap.add_argument("--zoo-scripts", type=Path, default=Path(os.environ.get("QDQGRAPH_SHARED", "/work/shared")) / "zoo")
    ap.add_argument("--only", default="", help="comma-separated models of the sets (default: all with a data file)")
    ap.add_argument("--tools", default=",".join(TOOLS), help=f"comma list of {', '.join(TOOLS)}")
    ap.add_argument("--peer-python", default="/tmp/peers-venv/bin/python")
    ap.add_argument("--modelopt-python", default="/tmp/mo-venv/bin/python")
    ap.add_argument("--out", type=Path, default=Path("/tmp/qdqgraph-peers"))
    ap.add_argument("--samples", type=int, default=16, help="most calibration samples a peer gets (default 16)")
    ap.add_argument("--holdout", type=int, default=16, help="held-out samples scored (default 16)")
    ap.add_argument("--ada-iters", type=int, default=200, help="AdaRound / AdaQuant iterations per layer")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds allowed per quantize run")
    ap.add_argument("--no-task", action="store_true", help="skip the zoo evaluator's task metrics")
    ap.add_argument("--task-only", action="store_true",
                    help="only the task metrics of the models already in OUT/TOOL (appended to --jsonl)")
    ap.add_argument("--remeasure", action="store_true",
                    help="measure again the models already in OUT/TOOL, keeping their last quantize record in "
                         "--jsonl (appended there as new rows)")
    ap.add_argument("--jsonl", type=Path, default=None, help="append rows here (default OUT/rows.jsonl)")
    ap.add_argument("--table", type=Path, nargs="+", metavar="JSONL", help="only print the tables of saved rows")
    a, rest = ap.parse_known_args()
    if a.child:
        tool, model, calib, out = a.child
        print(json.dumps(child(tool, model, calib, out, a.samples, a.ada_iters)), flush=True)
        return 0
    if a.table:
        rows = [json.loads(x) for p in a.table for x in p.read_text().splitlines() if x.strip()]
        tasks = {}
        for r in rows:
            if r.get("task_metrics"):
                tasks.setdefault(r["tool"], {}).update(r["task_metrics"])
        last = {(r["model"], r["tool"]): r for r in rows if "model" in r}     # a rerun replaces its row
        print(table(list(last.values()), tasks))
        return 0
    tools = [t for t in a.tools.split(",") if t]
    bad = [t for t in tools if t not in TOOLS]
    if bad:
        print(f"peers_ptq.py: unknown tool(s) {', '.join(bad)}; one of {', '.join(TOOLS)}", file=sys.stderr)
        return 2
    sets = [s for s in a.set.split(",") if s]
    if not sets or any(s not in SETS for s in sets):
        print(f"peers_ptq.py: unknown --set {a.set!r}; give a comma list of {', '.join(SETS)}", file=sys.stderr)
        return 2
    a.roots = {p.stem: root for root in (a.zoo if s == "zoo" else a.tfm for s in sets)
               for p in sorted((root / "data").glob("*.npz"))}
    names = [n for n in a.only.split(",") if n] or list(a.roots)
    missing = [n for n in names if n not in a.roots or not files(n, a)[0].exists()]
    if missing:
        where = " or ".join(str(a.zoo if s == "zoo" else a.tfm) for s in sets)
        print(f"peers_ptq.py: no model {', '.join(missing)} with a data file in {where}; check --set and --only",
              file=sys.stderr)
        return 2
    jsonl = a.jsonl or a.out / "rows.jsonl"
    a.out.mkdir(parents=True, exist_ok=True)
    rows, tasks = [], {}
    before = saved_quantize(jsonl) if a.remeasure else {}
    for tool in tools:
        done = []
        for n in names if not a.task_only else []:
            out = a.out / tool / f"{n}.onnx"
            model, calib, _ = files(n, a)
            if a.remeasure and (not out.exists() or (n, tool) not in before):
                continue
            q = before[n, tool] if a.remeasure else quantize(tool, model, calib, out, a)
            row = {"model": n, "tool": tool, "quantize": q}
            if q.get("ok"):
                row.update(measure(n, tool, out, a))
                done.append(n)
            rows.append(row)
            with jsonl.open("a") as f:
                f.write(json.dumps(row) + "\n")
            log(f"{tool:15s} {n:22s} {'ok' if q.get('ok') else q.get('error')} {q.get('seconds')} s; "
                f"held-out {_lowest(row)}; int8 {row.get('int8_flops_share')}; rtx {row.get('trt_rtx')}")
        if a.task_only:
            done = [n for n in names if (a.out / tool / f"{n}.onnx").exists()]
        if done and not a.no_task and not a.remeasure:
            tasks[tool] = task_metrics(tool, done, a)
            with jsonl.open("a") as f:
                f.write(json.dumps({"tool": tool, "task_metrics": tasks[tool]}) + "\n")
    print(table(rows, tasks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
