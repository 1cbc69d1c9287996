"""Engine latency: FP16 against qdqgraph INT8 (and Model Optimizer INT8 where it is installed), with
TensorRT's trtexec, in one run; prints median GPU compute time and the ratios.

    .venv/bin/python benchmarks/engine_latency.py [--tv /tmp/qdqgraph-tv/models] [--zoo /tmp/qdqgraph-zoo]
        [--batches 1,32] [--modelopt-python /path/to/venv/bin/python] [--trtexec trtexec]

Models: ResNet-50, EfficientNet-B0, MobileNetV3-Large (benchmarks/export_torchvision.py) and MiniLM
(benchmarks/setup_zoo.sh). On a machine without TensorRT (and its trtexec) it says so and exits 0:
NOTHING HERE HAS RUN AGAINST A REAL TENSORRT YET (no machine of the project has one).
"""
from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onnx  # noqa: E402

import qdqgraph  # noqa: E402
from qdqgraph.graph import io  # noqa: E402
from qdqgraph.errors import QdqError  # noqa: E402
from qdqgraph.passes.precision import lower_float_islands  # noqa: E402

MEDIAN = re.compile(r"GPU Compute Time:.*?median = ([0-9.]+) ms")


def models(tv: Path, zoo: Path):
    for n in ("resnet50", "efficientnet_b0", "mobilenet_v3_large"):
        yield n, tv / f"{n}.onnx", tv / f"{n}.calib.npz"
    yield "minilm_l6_v2", zoo / "models" / "minilm_l6_v2.onnx", zoo / "calib" / "minilm_l6_v2.npz"


def shapes_for(model: onnx.ModelProto, batch: int) -> str:
    """trtexec --shapes with the batch dim set and other dynamic dims at 128 (sequence length)."""
    parts = []
    for i in model.graph.input:
        dims = [d.dim_value if d.dim_value > 0 else (batch if k == 0 else 128)
                for k, d in enumerate(i.type.tensor_type.shape.dim)]
        parts.append(f"{i.name}:{'x'.join(map(str, dims))}")
    return ",".join(parts)


def trtexec(binary: str, onnx_path: Path, shapes: str, flags: list[str]) -> float:
    cmd = [binary, f"--onnx={onnx_path}", f"--shapes={shapes}", "--useCudaGraph", "--noDataTransfers", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True)
    m = MEDIAN.search(out.stdout)
    if out.returncode != 0 or not m:
        tail = (out.stdout + out.stderr).strip().splitlines()[-3:]
        raise RuntimeError(f"trtexec failed on {onnx_path.name}: {' | '.join(tail)}")
    return float(m.group(1))


def fp16_float_model(src: Path, dst: Path) -> None:
    """The float model with FP16 islands everywhere (strongly typed TensorRT runs ONNX types)."""
    model, _ = io.raise_opset(onnx.load(src), 19, why="the FP16 baseline")
    loaded = io.load(model)
    lower_float_islands(loaded.graph, "fp16", 19)
    onnx.save(io.to_model(loaded), dst)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tv", type=Path, default=Path("/tmp/qdqgraph-tv/models"))
    ap.add_argument("--zoo", type=Path, default=Path("/tmp/qdqgraph-zoo"))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--trtexec", default="trtexec")
    ap.add_argument("--modelopt-python", help="python of an environment with nvidia-modelopt[onnx]")
    args = ap.parse_args()
    try:
        import tensorrt as trt  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(f"TensorRT is not installed here ({type(e).__name__}: {e}); no engine latency measured.")
        return 0
    binary = shutil.which(args.trtexec)
    if binary is None:
        print(f"{args.trtexec} not found on PATH (it ships with TensorRT's tar/deb packages); no latency measured.")
        return 0
    major = int(str(trt.__version__).split(".")[0])
    int8_flags = ["--stronglyTyped"] if major == 10 else [] if major >= 11 else ["--int8", "--fp16"]
    fp16_flags = [] if major >= 10 else ["--fp16"]       # TRT >= 10 runs the FP16 model as typed
    rows = []
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        for name, src, calib in models(args.tv, args.zoo):
            if not src.exists():
                print(f"skip {name}: {src} missing")
                continue
            f16 = d / f"{name}.fp16.onnx"
            fp16_float_model(src, f16)
            q = d / f"{name}.qdq.onnx"
            try:
                io.save(qdqgraph.quantize(str(src), str(calib) if calib.exists() else "random").model, q)
            except QdqError as e:
                print(f"skip {name}: {e}")
                continue
            mo = None
            if args.modelopt_python:
                mo = d / f"{name}.mo.onnx"
                subprocess.run([args.modelopt_python, "-m", "modelopt.onnx.quantization", f"--onnx_path={src}",
                                "--quantize_mode=int8", f"--output_path={mo}"], check=False, capture_output=True)
                mo = mo if mo.exists() else None
            for batch in (int(b) for b in args.batches.split(",")):
                shapes = shapes_for(onnx.load(src, load_external_data=False), batch)
                t16 = trtexec(binary, f16, shapes, fp16_flags)
                t8 = trtexec(binary, q, shapes, int8_flags)
                tmo = trtexec(binary, mo, shapes, int8_flags) if mo else None
                rows.append((name, batch, t16, t8, tmo))
                print(rows[-1], flush=True)
    print("\n| model | batch | FP16 ms | qdqgraph INT8 ms | FP16 / qdqgraph | Model Optimizer INT8 ms | MO / qdqgraph |")
    print("|---|---|---|---|---|---|---|")
    for name, batch, t16, t8, tmo in rows:
        mo_cols = f"{tmo:.3f} | {tmo / t8:.2f}" if tmo else "not run | -"
        print(f"| {name} | {batch} | {t16:.3f} | {t8:.3f} | {t16 / t8:.2f} | {mo_cols} |")
    if rows:
        print(f"median speed-up over FP16: {statistics.median(r[2] / r[3] for r in rows):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
