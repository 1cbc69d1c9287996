"""Calibration data from a folder of images, with a preprocessing spec.

    --preprocess "resize=256,crop=224,mean=0.485,0.456,0.406,std=0.229,0.224,0.225,layout=NCHW,color=RGB"

or a path to a small spec file holding the same text. Keys: resize (short side, or HxW), crop
(centre crop, N or HxW), scale (pixel values are divided by it first; default 255), mean and std
(per channel, after scaling), layout NCHW or NHWC, color RGB, BGR or L. Pillow is needed
(`pip install 'qdqgraph[images]'`) and imported only here.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import QdqError
from ..graph.outputs import require_regular

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
_KEYS = {"resize", "crop", "scale", "mean", "std", "layout", "color"}


@dataclass(frozen=True)
class Preprocess:
    resize: tuple[int, ...] | None = None
    crop: tuple[int, int] | None = None
    scale: float = 255.0
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    layout: str = "NCHW"
    color: str = "RGB"


def _hw(text: str, key: str) -> tuple[int, ...]:
    try:
        parts = tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        raise QdqError(f"--preprocess {key}={text} is not a size", f"write {key}=224 or {key}=224x320") from None
    if len(parts) not in (1, 2) or min(parts) <= 0:
        raise QdqError(f"--preprocess {key}={text} is not a size", f"write {key}=224 or {key}=224x320")
    return parts


def parse_preprocess(text: str) -> Preprocess:
    """Parse the spec (or read it from a file when `text` names one)."""
    p = Path(text)
    if len(text) < 4096 and p.is_file():
        text = p.read_text().strip().replace("\n", ",")
    fields: dict[str, list[str]] = {}
    key = None
    for token in (t.strip() for t in text.split(",") if t.strip()):
        if "=" in token:
            key, value = (x.strip() for x in token.split("=", 1))
            if key not in _KEYS:
                raise QdqError(f"--preprocess: unknown key {key!r}", f"use {', '.join(sorted(_KEYS))}")
            fields[key] = [value]
        elif key in ("mean", "std"):
            fields[key].append(token)   # mean=0.485,0.456,0.406: the values after the first
        else:
            raise QdqError(f"--preprocess: cannot read {token!r}", "write key=value pairs separated by commas")
    kw: dict[str, Any] = {}       # Preprocess's fields
    if "resize" in fields:
        kw["resize"] = _hw(fields["resize"][0], "resize")
    if "crop" in fields:
        c = _hw(fields["crop"][0], "crop")
        kw["crop"] = (c[0], c[-1])
    try:
        if "scale" in fields:
            kw["scale"] = float(fields["scale"][0])
        for k in ("mean", "std"):
            if k in fields:
                kw[k] = tuple(float(v) for v in fields[k])
    except ValueError:
        raise QdqError("--preprocess: scale, mean and std take numbers", "e.g. mean=0.485,0.456,0.406") from None
    if "std" in kw and any(v == 0 for v in kw["std"]):
        raise QdqError("--preprocess: std must not be 0", "give the per-channel standard deviations")
    if "layout" in fields:
        kw["layout"] = fields["layout"][0].upper()
        if kw["layout"] not in ("NCHW", "NHWC"):
            raise QdqError(f"--preprocess layout={fields['layout'][0]}", "use layout=NCHW or layout=NHWC")
    if "color" in fields:
        kw["color"] = fields["color"][0].upper()
        if kw["color"] not in ("RGB", "BGR", "L"):
            raise QdqError(f"--preprocess color={fields['color'][0]}", "use color=RGB, BGR or L")
    return Preprocess(**kw)


def image_files(folder: Path) -> list[Path]:
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    for p in files:
        require_regular(p, "image")
    return files


def load_image(path: Path, spec: Preprocess) -> np.ndarray:
    """One image as a [1, C, H, W] (or [1, H, W, C]) float32 tensor."""
    try:
        from PIL import Image
    except ImportError:
        raise QdqError("reading images needs Pillow", "pip install 'qdqgraph[images]'") from None
    try:
        img: Image.Image = Image.open(path)
        img = img.convert("L" if spec.color == "L" else "RGB")
    except (OSError, ValueError) as e:
        raise QdqError(f"{path} is not a readable image ({e})", "remove it from the calibration folder") from None
    if spec.resize:
        if len(spec.resize) == 2:
            size = (spec.resize[1], spec.resize[0])
        else:  # short side
            w, h = img.size
            s = spec.resize[0] / min(w, h)
            size = (max(1, round(w * s)), max(1, round(h * s)))
        # Pillow >= 10 sets Image.BILINEAR at import time, out of its type stubs' sight; the
        # typed Image.Resampling.BILINEAR needs Pillow 9.1 and the extra allows 9.0
        img = img.resize(size, Image.BILINEAR)  # type: ignore[attr-defined]
    if spec.crop:
        ch, cw = spec.crop
        w, h = img.size
        if ch > h or cw > w:
            raise QdqError(f"{path}: crop {ch}x{cw} is larger than the image {h}x{w}", "resize first (resize=N)")
        left, top = (w - cw) // 2, (h - ch) // 2
        img = img.crop((left, top, left + cw, top + ch))
    a = np.asarray(img, dtype=np.float32)
    if a.ndim == 2:
        a = a[:, :, None]
    if spec.color == "BGR":
        a = a[:, :, ::-1]
    a = a / np.float32(spec.scale)
    c = a.shape[2]
    mean = np.array(spec.mean * (c if len(spec.mean) == 1 else 1), np.float32)[:c]
    std = np.array(spec.std * (c if len(spec.std) == 1 else 1), np.float32)[:c]
    if mean.size != c or std.size != c:
        raise QdqError(f"--preprocess mean/std give {len(spec.mean)}/{len(spec.std)} values for {c} channels",
                       "give one value or one per channel")
    a = (a - mean) / std
    if spec.layout == "NCHW":
        a = a.transpose(2, 0, 1)
    return np.ascontiguousarray(a[None], dtype=np.float32)


def read_image_folder(folder: Path, spec: Preprocess, input_name: str) -> dict[str, np.ndarray]:
    files = image_files(folder)
    if not files:
        raise QdqError(f"{folder} holds no images", f"put {', '.join(sorted(IMAGE_SUFFIXES))} files in it")
    tensors = [load_image(p, spec) for p in files]
    shapes = {t.shape for t in tensors}
    if len(shapes) > 1:
        raise QdqError(f"images in {folder} preprocess to different shapes {sorted(shapes)}",
                       "add crop=N (or resize=HxW) to --preprocess")
    return {input_name: np.stack(tensors)}
