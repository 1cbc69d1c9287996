"""Calibration from a folder of images with a preprocessing spec."""
import numpy as np
import pytest

import motifs
import qdqgraph
from qdqgraph.cli import main
from qdqgraph.errors import QdqError
from qdqgraph.samples.images import load_image, parse_preprocess

PIL = pytest.importorskip("PIL.Image", reason="Pillow is the optional 'images' extra")


def write_images(folder, sizes):
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for k, (h, w) in enumerate(sizes):
        PIL.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / f"{k}.png")


def test_spec_parsing():
    s = parse_preprocess("resize=256,crop=224,mean=0.485,0.456,0.406,std=0.229,0.224,0.225,layout=NCHW,color=BGR")
    assert s.resize == (256,) and s.crop == (224, 224) and s.mean == (0.485, 0.456, 0.406)
    assert s.std == (0.229, 0.224, 0.225) and s.color == "BGR"
    for bad, words in (("resize=abc", "not a size"), ("foo=1", "unknown key"), ("std=0", "must not be 0"),
                       ("layout=CHW", "NCHW")):
        with pytest.raises(QdqError, match=words):
            parse_preprocess(bad)


def test_image_pipeline_values(tmp_path):
    write_images(tmp_path / "imgs", [(40, 60)])
    spec = parse_preprocess("resize=20,crop=16,scale=255,mean=0.5,std=0.25,layout=NCHW,color=RGB")
    x = load_image(tmp_path / "imgs" / "0.png", spec)
    assert x.shape == (1, 3, 16, 16) and x.dtype == np.float32
    img = PIL.open(tmp_path / "imgs" / "0.png").convert("RGB").resize((30, 20), PIL.BILINEAR)
    ref = (np.asarray(img, np.float32)[2:18, 7:23] / 255 - 0.5) / 0.25
    np.testing.assert_allclose(x[0].transpose(1, 2, 0), ref, rtol=1e-6)


def test_insert_from_an_image_folder(tmp_path, capsys):
    write_images(tmp_path / "imgs", [(40, 60), (50, 50), (64, 32)])
    g = motifs.G("img")
    x = g.input("x", ["n", 3, 16, 16])
    g.node("Relu", [g.conv(x, 3, 16, "conv")], ["y"], name="relu")
    g.output("y")
    m = g.model()
    r = qdqgraph.quantize(m, tmp_path / "imgs", preprocess="resize=20,crop=16,mean=0.5,std=0.25")
    assert r.report.samples == 3
    import onnx
    onnx.save(m, tmp_path / "m.onnx")
    assert main(["insert", str(tmp_path / "m.onnx"), "--calib", str(tmp_path / "imgs")]) == 2
    assert "no --preprocess" in capsys.readouterr().err
    assert main(["insert", str(tmp_path / "m.onnx"), "--calib", str(tmp_path / "imgs"), "--preprocess",
                 "resize=20,crop=16"]) == 0
