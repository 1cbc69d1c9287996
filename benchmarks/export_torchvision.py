#!/usr/bin/env python3
"""Export torchvision classifiers to float ONNX, with calibration data, for qdqgraph benchmarks.

    python benchmarks/export_torchvision.py OUT_DIR [--only resnet18,resnet50] [--opset 17]
                                            [--samples 16] [--seed 0] [--bn keep|fold]
                                            [--bn-stats data|random] [--zero-bias] [--show-nodes K]

For each model it writes
    OUT_DIR/<name>.onnx        float model, input "input" [batch, 3, 224, 224], output "logits" [batch, 1000]
    OUT_DIR/<name>.calib.npz   one array "input" of shape [N, 1, 3, 224, 224] float32 (N batch-1 samples)
and updates OUT_DIR/manifest.json (versions, op counts, sha256, torch-vs-onnxruntime difference).

No weights can be downloaded, so every model is built with weights=None from a fixed seed (per model,
so --only does not change a model). Then, so that folding BatchNorm changes the weights for real:
every BatchNorm gets a seeded random weight ~ U(0.5, 1.5) and bias ~ N(0, 0.2); its running_mean and
running_var are, by default (--bn-stats data), measured on 32 other smooth random images, as in a
trained network, which keeps activations at a trained network's scale (with --bn-stats random they
are random too, N(0, 0.2) and log-uniform in [0.5, 2], and ResNet-50's activations grow into the
thousands). Conv/Linear biases that torchvision initialises to zero get small random values
(--zero-bias keeps them zero; the exporter then shares the identical zero tensors through Identity nodes). The legacy TorchScript exporter
(torch.onnx.export(..., dynamo=False)) is used, on the model in eval mode. By default (--bn keep)
the BatchNormalization nodes are kept in the ONNX graph so that qdqgraph's own BN folding pass has
work to do: with training=TrainingMode.EVAL the legacy exporter would fuse every Conv+BN pair itself
(its "eval peephole"), leaving no BatchNormalization node; --bn fold asks for that instead.

The calibration images are smooth random images (a few octaves of low-frequency noise, upsampled
bilinearly, with correlated colour channels) in [0, 1], normalised with the ImageNet mean and std.
They depend only on --seed and --samples, so every model gets the same images.

torch and torchvision are imported only when a model is exported; this script needs a virtual
environment with torch==2.14.1 and torchvision==0.29.1 (see PIP_COMMAND) plus onnx, onnxruntime
and numpy. The torch build does not matter: a CUDA build runs on the CPU here.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import warnings
import zlib
from collections import Counter
from pathlib import Path

import numpy as np

MODELS = ("resnet18", "resnet50", "efficientnet_b0", "mobilenet_v3_large")
TORCH_PIN = ("2.14.1", "0.29.1")
PIP_COMMAND = ("python3.11 -m venv /tmp/qdqgraph-tv/venv && /tmp/qdqgraph-tv/venv/bin/pip install "
               "torch==2.14.1 torchvision==0.29.1 onnx==1.23.2 onnxruntime==1.31.1 numpy")
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
IMAGE_SIZE = 224
INPUT_NAME = "input"
OUTPUT_NAME = "logits"
CHECK_BATCH = 4  # samples run through both torch and onnxruntime as one batch (checks the dynamic axis)


class MissingDependency(SystemExit):
    pass


def _need_torch():
    """Import torch and torchvision, or stop with the command that installs them."""
    try:
        import torch
        import torchvision
    except ImportError as e:
        msg = (f"error: {e}\n"
               f"export_torchvision.py needs torch and torchvision: "
               f"run with a venv that has torch=={TORCH_PIN[0]} torchvision=={TORCH_PIN[1]}, e.g.\n"
               f"    {PIP_COMMAND}\n"
               f"    /tmp/qdqgraph-tv/venv/bin/python {' '.join(sys.argv)}")
        print(msg, file=sys.stderr)
        raise MissingDependency(2) from None
    have = (torch.__version__.split("+")[0], torchvision.__version__.split("+")[0])
    if have != TORCH_PIN:
        print(f"warning: torch {torch.__version__} / torchvision {torchvision.__version__}; the benchmark "
              f"models were made with torch=={TORCH_PIN[0]} torchvision=={TORCH_PIN[1]}, other versions "
              f"may give other random weights and other node names", file=sys.stderr)
    return torch, torchvision


def _need_onnx():
    try:
        import onnx
        import onnxruntime
    except ImportError as e:
        print(f"error: {e}\nexport_torchvision.py needs onnx and onnxruntime too:\n    {PIP_COMMAND}",
              file=sys.stderr)
        raise MissingDependency(2) from None
    return onnx, onnxruntime


def model_seed(seed: int, name: str) -> int:
    """Per-model seed: the same model gets the same weights whatever --only selects."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**31 - 1)


# ----------------------------------------------------------------------------- calibration images

def _bilinear_matrix(n_out: int, n_in: int) -> np.ndarray:
    """(n_out, n_in) matrix of bilinear interpolation weights (half-pixel centres, edges clamped)."""
    pos = (np.arange(n_out) + 0.5) * n_in / n_out - 0.5
    pos = np.clip(pos, 0, n_in - 1)
    lo = np.floor(pos).astype(int)
    hi = np.minimum(lo + 1, n_in - 1)
    frac = pos - lo
    m = np.zeros((n_out, n_in), dtype=np.float64)
    m[np.arange(n_out), lo] += 1 - frac
    m[np.arange(n_out), hi] += frac
    return m


def smooth_images(n: int, seed: int, size: int = IMAGE_SIZE) -> np.ndarray:
    """n smooth random RGB images, ImageNet-normalised, shape [n, 1, 3, size, size] float32."""
    rng = np.random.default_rng([seed, 0x1A6E])
    octaves = [(3, 1.0), (6, 0.6), (12, 0.35), (28, 0.2), (56, 0.1)]  # (grid size, amplitude)
    mats = {g: _bilinear_matrix(size, g) for g, _ in octaves}
    out = np.empty((n, 1, 3, size, size), dtype=np.float32)
    for i in range(n):
        # A luminance field shared by the channels plus a weaker field per channel: colours correlate
        # as in photos, and the image has large blobs with some finer texture on top.
        field = np.zeros((4, size, size))
        for g, amp in octaves:
            grid = rng.standard_normal((4, g, g)) * amp
            field += mats[g] @ grid @ mats[g].T
        tint = rng.normal(0.0, 0.15, size=3)  # a colour cast per image
        img = field[0][None] + 0.5 * field[1:] + tint[:, None, None]
        img = img / (img.std() + 1e-8)
        brightness, contrast = rng.uniform(0.35, 0.65), rng.uniform(0.12, 0.25)
        img = np.clip(brightness + contrast * img, 0.0, 1.0)
        out[i, 0] = (img - IMAGENET_MEAN[:, None, None]) / IMAGENET_STD[:, None, None]
    return out


STATS_IMAGES = 32


def stats_images(seed: int) -> np.ndarray:
    """Images for measuring BN statistics (--bn-stats data): other images than the calibration set."""
    return smooth_images(STATS_IMAGES, seed + 0x5EED).reshape(STATS_IMAGES, 3, IMAGE_SIZE, IMAGE_SIZE)


# ----------------------------------------------------------------------------- models

def randomize_batchnorm(torch, model, seed: int) -> int:
    """Give every BatchNorm seeded random statistics and affine parameters; returns how many.

    running_mean ~ N(0, 0.2), running_var log-uniform in [0.5, 2], weight ~ U(0.5, 1.5), bias ~ N(0, 0.2).
    """
    g = torch.Generator().manual_seed(seed)
    count = 0
    with torch.no_grad():
        for m in _batchnorms(torch, model):
            c = m.num_features
            u = lambda lo, hi: lo + (hi - lo) * torch.rand(c, generator=g)  # noqa: E731
            m.running_mean.copy_(torch.randn(c, generator=g) * 0.2)
            m.running_var.copy_(torch.exp(u(np.log(0.5), np.log(2.0))))
            if m.affine:
                m.weight.copy_(u(0.5, 1.5))
                m.bias.copy_(torch.randn(c, generator=g) * 0.2)
            count += 1
    return count


def _batchnorms(torch, model):
    return [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def measure_batchnorm_stats(torch, model, images: np.ndarray) -> None:
    """Set every BN's running_mean/var to the statistics of what reaches it on `images`.

    One forward pass with only the BatchNorms in training mode and momentum=None (a plain average):
    each BN normalises with the batch's own statistics, which are then exactly what it holds, so in
    eval mode on these images every BN sees what it was measured on, as in a trained network.
    The random weight/bias set before are kept.
    """
    bns = _batchnorms(torch, model)
    saved = [m.momentum for m in bns]
    model.eval()
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    with torch.no_grad():
        model(torch.from_numpy(images))
    for m, mom in zip(bns, saved):
        m.momentum = mom
    model.eval()


def randomize_zero_biases(torch, model, seed: int) -> int:
    """Give Conv/Linear biases that init left all-zero small seeded random values; returns how many.

    torchvision zero-initialises e.g. the squeeze-excitation and classifier biases; the legacy exporter
    then deduplicates the identical zero initializers into Identity nodes, which a trained model
    would not have.
    """
    g = torch.Generator().manual_seed(seed)
    count = 0
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)) and m.bias is not None \
                    and not torch.any(m.bias != 0):
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.05)
                count += 1
    return count


def build_model(torch, torchvision, name: str, seed: int, bn_stats: str, zero_bias: bool):
    torch.manual_seed(seed)
    model = getattr(torchvision.models, name)(weights=None)
    n_bn = randomize_batchnorm(torch, model, seed + 1)
    n_bias = 0 if zero_bias else randomize_zero_biases(torch, model, seed + 2)
    if bn_stats == "data":
        measure_batchnorm_stats(torch, model, stats_images(seed + 3))
    return model.eval(), n_bn, n_bias


def export_onnx(torch, model, example, path: Path, opset: int, bn: str) -> None:
    training = torch.onnx.TrainingMode.PRESERVE if bn == "keep" else torch.onnx.TrainingMode.EVAL
    with warnings.catch_warnings():
        # The legacy exporter is deprecated (asked for here on purpose), and PRESERVE warns about
        # constant folding in case the model is in training mode, which it is not.
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*constant folding.*")
        warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export.*")
        torch.onnx.export(
            model, (example,), str(path),
            dynamo=False,
            opset_version=opset,
            export_params=True,
            do_constant_folding=True,
            training=training,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
        )


def _dims(value_info) -> list:
    return [d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else None)
            for d in value_info.type.tensor_type.shape.dim]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def process(name: str, out_dir: Path, args, calib: np.ndarray, calib_path: Path) -> dict:
    torch, torchvision = _need_torch()
    onnx, ort = _need_onnx()
    seed = model_seed(args.seed, name)
    t0 = time.time()
    model, n_bn, n_bias = build_model(torch, torchvision, name, seed, args.bn_stats, args.zero_bias)
    t_build = time.time() - t0
    onnx_path = out_dir / f"{name}.onnx"
    export_onnx(torch, model, torch.from_numpy(calib[0]), onnx_path, args.opset, args.bn)
    t_export = time.time() - t0 - t_build

    proto = onnx.load(str(onnx_path))
    onnx.checker.check_model(proto, full_check=True)
    nodes = proto.graph.node
    op_counts = dict(sorted(Counter(n.op_type for n in nodes).items(), key=lambda kv: (-kv[1], kv[0])))
    init_names = {i.name for i in proto.graph.initializer}
    inputs = [{"name": i.name, "shape": _dims(i)} for i in proto.graph.input if i.name not in init_names]
    outputs = [{"name": o.name, "shape": _dims(o)} for o in proto.graph.output]

    # torch and onnxruntime on the same batch of calibration samples (batch > 1: the dynamic axis).
    batch = np.concatenate(list(calib[: max(1, min(CHECK_BATCH, len(calib)))]), axis=0)
    with torch.no_grad():
        ref = model(torch.from_numpy(batch)).numpy()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    got = sess.run([OUTPUT_NAME], {INPUT_NAME: batch})[0]
    if got.shape != ref.shape:
        raise RuntimeError(f"{name}: onnxruntime gave shape {got.shape}, torch {ref.shape}")
    diff = float(np.max(np.abs(got.astype(np.float64) - ref)))
    scale = float(np.max(np.abs(ref)))
    top1_agree = float(np.mean(got.argmax(1) == ref.argmax(1)))

    print(f"\n== {name}  ({time.time() - t0:.1f}s: build {t_build:.1f}s, export {t_export:.1f}s)")
    print(f"   {onnx_path}  {onnx_path.stat().st_size / 1e6:.1f} MB, {len(nodes)} nodes, "
          f"{len(proto.graph.initializer)} initializers; torch: {n_bn} BatchNorms ({args.bn_stats} stats), "
          f"{n_bias} zero biases made random")
    print(f"   input  {inputs[0]['name']} {inputs[0]['shape']}   output {outputs[0]['name']} {outputs[0]['shape']}")
    print("   ops: " + ", ".join(f"{k} {v}" for k, v in op_counts.items()))
    print(f"   torch vs onnxruntime (CPU, batch {len(batch)}): max abs diff {diff:.3g}  "
          f"(max |logit| {scale:.3g}, relative {diff / max(scale, 1e-30):.3g}), top-1 agree {top1_agree:.0%}")
    if args.show_nodes:
        print(f"   first {args.show_nodes} nodes (name, op type):")
        for n in nodes[: args.show_nodes]:
            print(f"     {n.name:<45} {n.op_type}")

    return {
        "name": name,
        "file": onnx_path.name,
        "calib": calib_path.name,
        "opset": args.opset,
        "seed": args.seed,
        "model_seed": seed,
        "batchnorm": args.bn,
        "bn_stats": args.bn_stats,
        "random_zero_biases": n_bias,
        "inputs": inputs,
        "outputs": outputs,
        "nodes": len(nodes),
        "op_counts": op_counts,
        "initializers": len(proto.graph.initializer),
        "bytes": onnx_path.stat().st_size,
        "sha256": sha256(onnx_path),
        "calib_samples": int(calib.shape[0]),
        "calib_sha256": sha256(calib_path),
        "check": {"batch": int(len(batch)), "max_abs_diff": diff, "max_abs_logit": scale,
                  "top1_agree": top1_agree},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--only", help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--opset", type=int, default=17, help="ONNX opset (default 17)")
    p.add_argument("--samples", type=int, default=16, help="calibration samples per model (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights, BatchNorm values and images (default 0)")
    p.add_argument("--bn", choices=("keep", "fold"), default="keep",
                   help="keep: BatchNormalization nodes stay in the ONNX graph (default); "
                        "fold: let the exporter fuse them into the Convs")
    p.add_argument("--bn-stats", choices=("data", "random"), default="data",
                   help="data: BN running mean/var measured on separate smooth images, so activations keep a "
                        "trained network's scale (default); random: running mean/var random too")
    p.add_argument("--zero-bias", action="store_true",
                   help="leave the biases torchvision initialises to zero at zero (the exporter then "
                        "shares them through Identity nodes)")
    p.add_argument("--show-nodes", type=int, default=0, metavar="K",
                   help="print the first K node names and op types of each model")
    args = p.parse_args(argv)

    names = MODELS if not args.only else tuple(s.strip() for s in args.only.split(",") if s.strip())
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {','.join(MODELS)}")
    if args.samples < 1:
        p.error("--samples must be at least 1")

    torch, torchvision = _need_torch()  # fail early, before writing anything
    onnx, ort = _need_onnx()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    calib = smooth_images(args.samples, args.seed)
    print(f"calibration images: {calib.shape} {calib.dtype}, mean {calib.mean():.3f}, std {calib.std():.3f}, "
          f"range [{calib.min():.2f}, {calib.max():.2f}]")

    entries = []
    for name in names:
        calib_path = out_dir / f"{name}.calib.npz"
        np.savez(calib_path, **{INPUT_NAME: calib})
        entries.append(process(name, out_dir, args, calib, calib_path))

    manifest_path = out_dir / "manifest.json"
    manifest = {"models": []}
    if manifest_path.exists():  # --only updates the entries it made and keeps the others
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError):
            pass
    kept = [m for m in manifest.get("models", []) if m.get("name") not in names]
    order = {n: i for i, n in enumerate(MODELS)}
    manifest = {
        "generator": "benchmarks/export_torchvision.py",
        "versions": {"torch": torch.__version__, "torchvision": torchvision.__version__,
                     "onnx": onnx.__version__, "onnxruntime": ort.__version__, "numpy": np.__version__},
        "models": sorted(kept + entries, key=lambda m: order.get(m["name"], len(order))),
    }
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"\nwrote {manifest_path} ({len(manifest['models'])} models)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
