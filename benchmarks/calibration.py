"""Calibration cost on ResNet-50 (torchvision architecture, opset 17): qdqgraph's methods against
plain inference, onnxruntime's quantize_static calibrators and Model Optimizer, in one run.

    .venv/bin/python benchmarks/calibration.py [--model /tmp/qdqgraph-tv/models/resnet50.onnx]
        [--sizes 64,512] [--batches 1,8] [--tools plain,plain-lanes,max,entropy,entropy-1lane,entropy-nokernel,
        percentile,mse,ort-minmax,ort-entropy,ort-percentile,modelopt] [--modelopt-python /tmp/mo-venv/bin/python]
        [--memory-gb 20]

Every configuration runs in its own process, which reports its wall time (the calibration step, not
the import or the data generation) and its peak RSS (ru_maxrss). For qdqgraph the wall time covers
loading, planning, the onnxruntime session and the thresholds, and for plain inference the session
and the run over the samples; "loop" is the pass over the samples alone, the part that grows with N.
"entropy-nokernel" is qdqgraph entropy as it runs where no C compiler built the histogram kernel;
"entropy-1lane" is qdqgraph entropy with one onnxruntime run at a time (`--lanes 1`), where the
default runs two batches at once with half the cores each; "plain-lanes" is plain inference run
that same way, two batches at once, to show what the lanes alone gain. The samples (random, seeded,
1x3x224x224) are written to a folder of one .npz per 8 samples, which every tool streams. Sizes
whose predicted memory exceeds --memory-gb are skipped and said so: onnxruntime's histogram
calibrators keep every batch's activations (about 110 MB per sample on ResNet-50). Ratios are to
plain inference of the same samples at the same batch size, in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QDQ_METHODS = ("max", "entropy", "percentile", "mse")
ORT_METHODS = {"ort-minmax": "MinMax", "ort-entropy": "Entropy", "ort-percentile": "Percentile"}
ORT_MB_PER_SAMPLE = {"ort-minmax": 0, "ort-entropy": 110, "ort-percentile": 110}

CHILD = r'''
import json, resource, sys, time
from pathlib import Path
import numpy as np
tool, model, folder, batch, out = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
files = sorted(folder.glob("*.npz"))

def batches():
    buf = []
    for f in files:
        with np.load(f) as z:
            for x in z["input"]:
                buf.append(x)
                if len(buf) == batch:
                    yield np.concatenate(buf)
                    buf = []
    if buf:
        yield np.concatenate(buf)

if tool == "plain":
    import onnxruntime as ort
    t0 = time.perf_counter()
    s = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    t = time.perf_counter()
    for b in batches():
        s.run(None, {"input": b})
    loop = time.perf_counter() - t
    seconds = time.perf_counter() - t0
elif tool == "plain-lanes":        # two batches at once, each run on half the cores, as qdqgraph's lanes
    import os, threading
    from concurrent.futures import ThreadPoolExecutor
    import onnxruntime as ort
    t0 = time.perf_counter()
    o = ort.SessionOptions()
    o.intra_op_num_threads = max(1, len(os.sched_getaffinity(0)) // 2)
    s = ort.InferenceSession(model, o, providers=["CPUExecutionProvider"])
    it, lock = batches(), threading.Lock()
    def lane():
        while True:
            with lock:
                b = next(it, None)
            if b is None:
                return
            s.run(None, {"input": b})
    t = time.perf_counter()
    with ThreadPoolExecutor(2) as ex:
        for f in [ex.submit(lane) for _ in range(2)]:
            f.result()
    loop = time.perf_counter() - t
    seconds = time.perf_counter() - t0
elif tool.startswith("qdq-"):
    from qdqgraph import QuantizeConfig
    from qdqgraph.calib.calibration import calibrate_plan
    from qdqgraph.prepare import prepare, read_data
    method, _, variant = tool[4:].partition("+")
    if variant == "nokernel":      # bin inside onnxruntime and count with numpy, as without a C compiler
        import qdqgraph.calib.collect
        qdqgraph.calib.collect.COMPILED = False
    t = time.perf_counter()
    config = QuantizeConfig(method=method, batch_size=batch, lanes=1 if variant == "1lane" else None)
    loaded, plan = prepare(model, config)
    cal = calibrate_plan(loaded, plan, read_data(loaded, str(folder), config), config)
    seconds = time.perf_counter() - t
    loop = cal.seconds
elif tool.startswith("ort-"):
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static
    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = batches()
        def get_next(self):
            b = next(self.it, None)
            return None if b is None else {"input": b}
    t = time.perf_counter()
    quantize_static(model, out, Reader(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8,
                    weight_type=QuantType.QInt8, per_channel=True,
                    calibrate_method=getattr(CalibrationMethod, sys.argv[6]))
    seconds = time.perf_counter() - t
elif tool == "modelopt":
    from modelopt.onnx.quantization import quantize
    data = np.concatenate([np.load(f)["input"].reshape(-1, 3, 224, 224) for f in files])
    t = time.perf_counter()
    quantize(model, quantize_mode="int8", calibration_data={"input": data}, calibration_method="max",
             calibration_eps=["cpu"], output_path=out)
    seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "loop": loop if tool.startswith(("qdq-", "plain")) else seconds,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''


def make_data(folder: Path, n: int, seed: int = 0) -> None:
    import numpy as np
    rng = np.random.default_rng(seed)
    for k in range(0, n, 8):
        m = min(8, n - k)
        np.savez(folder / f"s{k:05d}.npz", input=rng.standard_normal((m, 1, 3, 224, 224), dtype=np.float32))


def run(tool: str, model: str, folder: Path, batch: int, python: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / ("out.json" if tool.startswith("qdq-") else "out.onnx"))
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        p = subprocess.run([python, "-c", CHILD, tool, model, str(folder), str(batch), out, *extra],
                           capture_output=True, text=True, env=env)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["failed"])[-1][:160]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/qdqgraph-tv/models/resnet50.onnx")
    ap.add_argument("--sizes", default="64,512")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tools", default="plain,plain-lanes,max,entropy,entropy-1lane,entropy-nokernel,percentile,mse,"
                                      "ort-minmax,ort-entropy,ort-percentile,modelopt")
    ap.add_argument("--modelopt-python", default="/tmp/mo-venv/bin/python")
    ap.add_argument("--memory-gb", type=float, default=20.0)
    args = ap.parse_args()
    if not Path(args.model).exists():
        print(f"{args.model} missing: run benchmarks/export_torchvision.py first")
        return 0
    tools = args.tools.split(",")
    have_mo = Path(args.modelopt_python).exists()
    print(f"load average at start {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores")
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory() as d:
            folder = Path(d)
            make_data(folder, n)
            for batch in (int(b) for b in args.batches.split(",")):
                base = base_loop = None
                for tool in tools:
                    label, python, extra, key = tool, sys.executable, [], tool
                    if tool in QDQ_METHODS:
                        label, key = f"qdqgraph {tool}", f"qdq-{tool}"
                    elif tool.endswith("-nokernel") and tool[:-9] in QDQ_METHODS:
                        label, key = f"qdqgraph {tool[:-9]}, no compiled kernel", f"qdq-{tool[:-9]}+nokernel"
                    elif tool.endswith("-1lane") and tool[:-6] in QDQ_METHODS:
                        label, key = f"qdqgraph {tool[:-6]}, one lane", f"qdq-{tool[:-6]}+1lane"
                    elif tool == "plain-lanes":
                        label = "plain, two batches at once"
                    elif tool in ORT_METHODS:
                        label = f"onnxruntime {ORT_METHODS[tool]}"
                        extra = [ORT_METHODS[tool]]
                        need_gb = ORT_MB_PER_SAMPLE[tool] * n / 1024
                        if need_gb > args.memory_gb:
                            rows.append((n, batch, label, None, None, f"skipped: needs ~{need_gb:.0f} GB "
                                                                          f"(110 MB per sample kept)"))
                            print(rows[-1], flush=True)
                            continue
                    elif tool == "modelopt":
                        label = "Model Optimizer (max)"
                        if not have_mo:
                            rows.append((n, batch, label, None, None, f"not installed ({args.modelopt_python})"))
                            continue
                        if batch != 1:
                            rows.append((n, batch, label, None, None, "batch set by its API, measured at batch 1"))
                            continue
                        python = args.modelopt_python
                    r = run(key, args.model, folder, batch, python, extra)
                    if "error" in r:
                        rows.append((n, batch, label, None, None, r["error"]))
                    else:
                        if tool == "plain":
                            base, base_loop = r["seconds"], r["loop"]
                        rows.append((n, batch, label, r["seconds"], r["peak_mb"], "", r["loop"]))
                    print(rows[-1], flush=True)
                for i, row in enumerate(rows):
                    if row[0] == n and row[1] == batch and row[3] is not None and base and len(row) == 7:
                        rows[i] = row + (row[3] / base, row[6] / base_loop)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}\n")
    print("| samples | batch | tool | seconds | x plain inference | loop x plain | peak RSS MB | note |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        n, batch, label, sec, mb, note = row[:6]
        ratio, loop = (f"{row[7]:.2f}", f"{row[8]:.2f}") if len(row) > 8 else ("-", "-")
        print(f"| {n} | {batch} | {label} | {'-' if sec is None else f'{sec:.1f}'} | {ratio} | {loop} | "
              f"{'-' if mb is None else f'{mb:.0f}'} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
