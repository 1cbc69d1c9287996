#!/usr/bin/env python3
"""How insert and report scale with the size of the graph: deep residual CNNs and transformer
encoders built in code (random weights), each size in its own process.

    .venv/bin/python benchmarks/scale.py [--sizes 2500,10000,40000] [--layers 24] [--large]
                                         [--samples 8] [--out DIR] [--timeout 900]

Per model: nodes, file size, wall seconds of `qdqgraph.quantize` split by stage (load, clean, plan,
calibrate, insert, simulate, save; from the run report's stage timings), of `qdqgraph report`
(load + simulate), and the peak RSS of the process. `--large` adds a transformer encoder of about
470 MB (24 layers, hidden 640) for the memory target. The table ends with the 40k/10k ratio of the
insert time without calibration.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- models

def residual_cnn(nodes: int, channels: int = 16, size: int = 8, seed: int = 0) -> onnx.ModelProto:
    """Conv -> Relu -> Conv -> Add(skip) -> Relu6 blocks (5 nodes, 2 convs each), `nodes` nodes in
    all; ReLU6 (Clip) keeps the residual stream bounded however deep the network is."""
    rng = np.random.default_rng(seed)
    blocks = max(1, nodes // 5)
    out_nodes = []
    inits = [numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
             numpy_helper.from_array(np.array(6.0, np.float32), "six")]
    x = "input"
    scale = np.sqrt(2.0 / (channels * 9)) * 0.5
    for b in range(blocks):
        names = []
        for k in (1, 2):
            w = f"b{b}.conv{k}.weight"
            inits.append(numpy_helper.from_array((rng.standard_normal((channels, channels, 3, 3)) * scale)
                                                 .astype(np.float32), w))
            bias = f"b{b}.conv{k}.bias"
            inits.append(numpy_helper.from_array((0.01 * rng.standard_normal(channels)).astype(np.float32), bias))
            names.append((w, bias))
        (w1, b1), (w2, b2) = names
        out_nodes += [
            helper.make_node("Conv", [x, w1, b1], [f"b{b}_c1"], name=f"b{b}/conv1", kernel_shape=[3, 3], pads=[1] * 4),
            helper.make_node("Relu", [f"b{b}_c1"], [f"b{b}_r1"], name=f"b{b}/relu1"),
            helper.make_node("Conv", [f"b{b}_r1", w2, b2], [f"b{b}_c2"], name=f"b{b}/conv2", kernel_shape=[3, 3],
                             pads=[1] * 4),
            helper.make_node("Add", [f"b{b}_c2", x], [f"b{b}_add"], name=f"b{b}/add"),
            helper.make_node("Clip", [f"b{b}_add", "zero", "six"], [f"b{b}_out"], name=f"b{b}/relu6"),
        ]
        x = f"b{b}_out"
    graph = helper.make_graph(out_nodes, "residual_cnn",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", channels, size, size])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", channels, size, size])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def encoder(layers: int = 24, hidden: int = 256, heads: int = 4, seq: int = 32, vocab: int = 1000,
            seed: int = 0) -> onnx.ModelProto:
    """A BERT-style encoder as PyTorch exports it: embeddings, then per layer Q/K/V projections,
    attention (MatMul, Div, mask Add, Softmax, MatMul), output projection, residual + LayerNorm,
    FFN with an erf GELU, residual + LayerNorm."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    d = hidden // heads
    counter = [0]

    def init(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(op, inputs, name, **attrs):
        counter[0] += 1
        out = f"{name}_out"
        nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    def dense(x, name, cin, cout):
        w = init(f"{name}.weight", (rng.standard_normal((cin, cout)) / np.sqrt(cin)).astype(np.float32))
        b = init(f"{name}.bias", (0.02 * rng.standard_normal(cout)).astype(np.float32))
        return node("Add", [node("MatMul", [x, w], f"{name}/MatMul"), b], f"{name}/Add")

    def layernorm(x, name):
        g = init(f"{name}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        b = init(f"{name}.bias", (0.1 * rng.standard_normal(hidden)).astype(np.float32))
        return node("LayerNormalization", [x, g, b], f"{name}/LayerNormalization", axis=-1, epsilon=1e-12)

    shape_heads = init("shape_heads", np.array([0, 0, heads, d], dtype=np.int64))
    shape_back = init("shape_back", np.array([0, 0, hidden], dtype=np.int64))
    sqrt_d = init("sqrt_d", np.array(np.sqrt(d), dtype=np.float32))
    one = init("one", np.array(1.0, dtype=np.float32))
    half = init("half", np.array(0.5, dtype=np.float32))
    sqrt2 = init("sqrt2", np.array(np.sqrt(2.0), dtype=np.float32))
    neg = init("neg", np.array(-10000.0, dtype=np.float32))
    table = init("embeddings.word", (0.5 * rng.standard_normal((vocab, hidden))).astype(np.float32))
    pos = init("embeddings.position", (0.1 * rng.standard_normal((1, seq, hidden))).astype(np.float32))
    x = node("Gather", [table, "input_ids"], "embeddings/Gather", axis=0)
    x = node("Add", [x, pos], "embeddings/Add")
    x = layernorm(x, "embeddings/LayerNorm")
    m = node("Cast", ["attention_mask"], "mask/Cast", to=TensorProto.FLOAT)
    m = node("Sub", [one, m], "mask/Sub")
    m = node("Mul", [m, neg], "mask/Mul")
    m = node("Unsqueeze", [m, init("axes12", np.array([1, 2], dtype=np.int64))], "mask/Unsqueeze")
    for k in range(layers):
        p = f"layer{k}"

        def heads_of(t, name, transpose):
            r = node("Reshape", [t, shape_heads], f"{name}/Reshape")
            return node("Transpose", [r], f"{name}/Transpose", perm=transpose)
        q = heads_of(dense(x, f"{p}/query", hidden, hidden), f"{p}/q", [0, 2, 1, 3])
        kk = heads_of(dense(x, f"{p}/key", hidden, hidden), f"{p}/k", [0, 2, 3, 1])
        v = heads_of(dense(x, f"{p}/value", hidden, hidden), f"{p}/v", [0, 2, 1, 3])
        s = node("MatMul", [q, kk], f"{p}/scores/MatMul")
        s = node("Div", [s, sqrt_d], f"{p}/scores/Div")
        s = node("Add", [s, m], f"{p}/scores/Add")
        a = node("Softmax", [s], f"{p}/Softmax", axis=-1)
        c = node("MatMul", [a, v], f"{p}/context/MatMul")
        c = node("Transpose", [c], f"{p}/context/Transpose", perm=[0, 2, 1, 3])
        c = node("Reshape", [c, shape_back], f"{p}/context/Reshape")
        o = dense(c, f"{p}/attention/output", hidden, hidden)
        x = layernorm(node("Add", [o, x], f"{p}/attention/residual"), f"{p}/attention/LayerNorm")
        h = dense(x, f"{p}/intermediate", hidden, 4 * hidden)
        g = node("Div", [h, sqrt2], f"{p}/gelu/Div")
        g = node("Erf", [g], f"{p}/gelu/Erf")
        g = node("Add", [g, one], f"{p}/gelu/Add")
        g = node("Mul", [h, g], f"{p}/gelu/Mul")
        g = node("Mul", [g, half], f"{p}/gelu/Mul_1")
        o = dense(g, f"{p}/output", 4 * hidden, hidden)
        x = layernorm(node("Add", [o, x], f"{p}/output/residual"), f"{p}/output/LayerNorm")
    graph = helper.make_graph(
        nodes, "encoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", seq]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", seq])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", seq, hidden])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def calibration(model: onnx.ModelProto, samples: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in model.graph.input:
        dims = [d.dim_value if d.dim_value > 0 else 1 for d in i.type.tensor_type.shape.dim]
        if i.type.tensor_type.elem_type == TensorProto.INT64:
            out[i.name] = (rng.integers(1, 1000, size=[samples] + dims) if "ids" in i.name
                           else np.ones([samples] + dims)).astype(np.int64)
        else:
            out[i.name] = rng.standard_normal([samples] + dims).astype(np.float32)
    return out


# ---------------------------------------------------------------------------- one measurement (child)

def child(model: str, calib: str, out: str) -> dict:
    import qdqgraph
    from qdqgraph.graph import io
    from qdqgraph import trtsim
    t0 = time.perf_counter()
    r = qdqgraph.quantize(model, calib=calib)
    t1 = time.perf_counter()
    io.save(r.model, out)
    t2 = time.perf_counter()
    stages = dict(getattr(r.report, "stages", None) or {})
    summary = r.report.tensorrt or {}
    del r
    t3 = time.perf_counter()
    loaded = io.load(out)
    t4 = time.perf_counter()
    trtsim.simulate(loaded.graph)
    t5 = time.perf_counter()
    stages["save"] = t2 - t1
    return {"insert_s": t1 - t0, "stages": stages, "report_load_s": t4 - t3, "report_simulate_s": t5 - t4,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "int8_layers": summary.get("int8_layers"), "layers": summary.get("layers")}


def measure(name: str, model: onnx.ModelProto, samples: int, folder: Path, timeout: int) -> dict:
    path = folder / f"{name}.onnx"
    big = sum(t.ByteSize() for t in model.graph.initializer) > 1_500_000_000
    onnx.save(model, str(path), save_as_external_data=big)
    calib = folder / f"{name}.npz"
    np.savez(calib, **calibration(model, samples))
    row = {"model": name, "nodes": len(model.graph.node), "file_mb": os.path.getsize(path) / 2**20}
    del model
    cmd = [sys.executable, __file__, "--child", str(path), str(calib), str(folder / f"{name}.qdq.onnx")]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        row["error"] = f"not finished in {timeout} s"
        return row
    row["wall_s"] = time.perf_counter() - start
    if done.returncode != 0:
        row["error"] = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        return row
    row.update(json.loads(done.stdout.strip().splitlines()[-1]))
    return row


STAGES = ("load", "clean", "plan", "calibrate", "insert", "island ranges", "float islands", "simulate", "save")


def table(rows: list[dict]) -> str:
    head = ("| model | nodes | file MB | insert s | " + " | ".join(STAGES) + " | insert s w/o calibrate | "
            "report s | peak RSS MB | RSS / file |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['nodes']} | {r['file_mb']:.1f} | {r['error']} |")
            continue
        st = r.get("stages", {})
        no_cal = r["insert_s"] - st.get("calibrate", 0.0) - st.get("island ranges", 0.0)
        lines.append(
            f"| {r['model']} | {r['nodes']} | {r['file_mb']:.1f} | {r['insert_s']:.2f} | "
            + " | ".join(f"{st[s]:.2f}" if s in st else "-" for s in STAGES)
            + f" | {no_cal:.2f} | {r['report_load_s'] + r['report_simulate_s']:.2f} | {r['peak_rss_mb']:.0f} | "
            f"{r['peak_rss_mb'] / r['file_mb']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.path.insert(0, str(ROOT))
        print(json.dumps(child(*sys.argv[2:5])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2500,10000,40000", help="residual CNN node counts")
    ap.add_argument("--layers", type=int, default=24, help="transformer encoder layers (0: none)")
    ap.add_argument("--large", action="store_true", help="add a ~470 MB encoder (memory target)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per model")
    ap.add_argument("--out", type=Path, help="keep the models here (default: a temporary folder)")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = ap.parse_args()
    cases = [(f"resnet_{n}", lambda n=n: residual_cnn(n)) for n in (int(s) for s in args.sizes.split(",") if s)]
    if args.layers:
        cases.append((f"encoder_{args.layers}x256", lambda: encoder(args.layers)))
    if args.large:
        cases.append(("encoder_24x640", lambda: encoder(24, hidden=640, heads=10)))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.out or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for name, make in cases:
            rows.append(measure(name, make(), args.samples, folder, args.timeout))
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(table(rows))
    by = {r["nodes"]: r for r in rows if "error" not in r and r["model"].startswith("resnet_")}
    sizes = sorted(by)
    if len(sizes) >= 2:
        a, b = by[sizes[-2]], by[sizes[-1]]
        cost = [r["insert_s"] - r.get("stages", {}).get("calibrate", 0.0) - r.get("stages", {}).get("island ranges", 0.0)
                for r in (a, b)]
        print(f"\ninsert without calibration, {sizes[-1]} / {sizes[-2]} nodes: {cost[1] / cost[0]:.2f}x "
              f"({cost[0]:.2f} s -> {cost[1]:.2f} s)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
