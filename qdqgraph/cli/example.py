"""`qdqgraph example`: a small ResNet-style model and calibration data to try qdqgraph on."""
from __future__ import annotations

from pathlib import Path

from ..graph import outputs, io
from ..errors import QdqError
from . import args as a
import numpy as np
from ..graph.example import smooth_images, tiny_resnet

EXAMPLES = """examples:
  qdqgraph example out && qdqgraph insert out/tiny_resnet.onnx --calib out/tiny_resnet_calib.npz
"""


def add(sub) -> None:
    p = sub.add_parser("example", help="write a small ResNet-style model and calibration data to try qdqgraph on",
                       formatter_class=a.Formatter, epilog=EXAMPLES,
                       description="Write FOLDER/tiny_resnet.onnx (Conv+BN+ReLU, residual blocks, a Gemm head, "
                                   "seeded random weights) and FOLDER/tiny_resnet_calib.npz.")
    p.add_argument("folder", help="where to write tiny_resnet.onnx and tiny_resnet_calib.npz (made if missing)")
    p.add_argument("--samples", type=int, default=64, help="calibration samples to generate")
    a.add_output(p)
    p.set_defaults(run=run)


def run(args) -> int:

    a.at_least(args.samples, "--samples", 1)
    folder = Path(args.folder)
    if folder.exists() and not folder.is_dir():
        raise QdqError(f"{folder} is a file, not a folder", "name a folder to write the example into")
    model_path, data_path = folder / "tiny_resnet.onnx", folder / "tiny_resnet_calib.npz"
    if folder.is_dir():
        plan = outputs.Plan(args.force)
        plan.output(model_path, "example model")
        plan.output(data_path, "example data")
    folder.mkdir(parents=True, exist_ok=True)
    images = smooth_images(args.samples)

    def write_npz(tmp: Path) -> None:
        with open(tmp, "wb") as f:          # a file object: np.savez adds no .npz suffix
            np.savez(f, input=images)
    io.save(tiny_resnet(), model_path, force=args.force)
    outputs.write_atomic(data_path, write_npz, force=args.force)
    if not args.quiet:
        print(f"wrote {model_path} and {data_path} ({args.samples} samples)")
        print(f"next: qdqgraph insert {model_path} --calib {data_path}")
    return 0
