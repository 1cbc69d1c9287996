"""`qdqgraph build` and `insert --engine` on a machine without TensorRT: one clear line, exit 2,
nothing written. Building itself needs TensorRT and a GPU (tests below skip without them and say so)."""
import importlib.util

import numpy as np
import onnx
import pytest

import motifs
import qdqgraph
from qdqgraph.cli import main

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None


@pytest.fixture
def qdq_model(tmp_path):
    m = motifs.residual_add()
    src = tmp_path / "m.onnx"
    onnx.save(m, src)
    np.savez(tmp_path / "d.npz", **motifs.sample_data(m))
    q = tmp_path / "m.qdq.onnx"
    onnx.save(qdqgraph.quantize(m, motifs.sample_data(m)).model, q)
    return src, q, tmp_path / "d.npz"


@pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed here: the missing-TensorRT error cannot be shown")
def test_build_without_tensorrt_is_one_line_exit_2_and_writes_nothing(qdq_model, tmp_path, capsys):
    _, q, data = qdq_model
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["build", str(q), "-o", str(tmp_path / "m.plan"), "--calib", str(data),
                 "--layer-info", str(tmp_path / "l.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "TensorRT is not installed" in err[0] and "pip install" in err[0]
    assert "Traceback" not in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed here: the missing-TensorRT error cannot be shown")
def test_insert_engine_without_tensorrt_fails_before_writing(qdq_model, tmp_path, capsys):
    src, _, data = qdq_model
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["insert", str(src), "--calib", str(data), "-o", str(tmp_path / "out.onnx"),
                 "--engine", str(tmp_path / "out.plan")]) == 2
    assert "TensorRT is not installed" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_build_checks_its_paths_then_tensorrt_then_shapes(qdq_model, tmp_path, capsys):
    """Output paths are checked first (cheap, and wrong whatever the machine); then TensorRT's
    presence, since no shape matters without it; the shapes last."""
    _, q, _ = qdq_model
    assert main(["build", str(q), "-o", str(q)]) == 2
    assert "also an input" in capsys.readouterr().err
    assert main(["build", str(q), "-o", str(tmp_path / "no" / "m.plan"), "--shapes", "x:1x16x8x8"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["build", str(q), "-o", str(tmp_path / "m.plan"), "--shapes", "x:1x16"]) == 2
    assert ("TensorRT is not installed" if not HAVE_TRT else "rank 2") in capsys.readouterr().err


@pytest.mark.skipif(not HAVE_TRT, reason="needs TensorRT and an NVIDIA GPU (not installable on the project's machines)")
def test_build_writes_engine_and_layer_info(qdq_model, tmp_path):
    _, q, _ = qdq_model
    assert main(["build", str(q), "-o", str(tmp_path / "m.plan"), "--shapes", "x:1x16x8x8",
                 "--layer-info", str(tmp_path / "l.json")]) == 0
    assert (tmp_path / "m.plan").stat().st_size > 0
    from qdqgraph.trtsim import read_engine_report
    assert read_engine_report(tmp_path / "l.json").layers
