"""A model whose weights cannot fit in the memory left is refused before it is read (one line, exit
2, nothing written); one whose expected peak does not fit runs with a warning (execution.memory.fits)."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdqgraph.cli import main
from qdqgraph.errors import QdqError
from qdqgraph.execution import memory
from qdqgraph.graph import io

MB = 1 << 20


def _matmul_model(k: int = 512) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((k, k)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, k])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_bytes_on_disk_counts_the_external_data(tmp_path):
    m = _matmul_model()
    inline = tmp_path / "inline.onnx"
    onnx.save(m, inline)
    apart = tmp_path / "apart.onnx"
    onnx.save(m, apart, save_as_external_data=True, location="apart.data", size_threshold=0)
    assert apart.stat().st_size < 512 * 512 * 4 / 10            # the weights are not in the file
    assert io.bytes_on_disk(apart) >= 512 * 512 * 4
    assert abs(io.bytes_on_disk(apart) - io.bytes_on_disk(inline)) < 4096


def test_weights_that_cannot_fit_are_refused_and_a_tight_peak_is_a_warning(tmp_path, monkeypatch):
    path = tmp_path / "m.onnx"
    onnx.save(_matmul_model(), path)
    weights = io.bytes_on_disk(path)
    with pytest.raises(QdqError, match="do not fit in the memory available") as e:
        memory.fits(path, available=memory.BASE_BYTES + weights // 2)
    assert "QDQGRAPH_MEMORY_CHECK=off" in str(e.value.fix)
    warned = memory.fits(path, available=memory.BASE_BYTES + weights + weights // 2)
    assert warned and "may run out of memory" in warned
    assert memory.fits(path, available=memory.BASE_BYTES + 3 * weights) is None
    monkeypatch.setenv(memory.MEMORY_CHECK_ENV, "off")
    assert memory.fits(path, available=1) is None


def test_available_memory_is_read_on_linux():
    got = memory.available_bytes()
    assert got is None or got > 0


@pytest.mark.parametrize("command,out_name", [("insert", "o.onnx"), ("calibrate", "cache.json")])
def test_a_command_refuses_in_one_line_and_writes_nothing(model_and_data, capsys, monkeypatch, command, out_name):
    mp, dp = model_and_data
    monkeypatch.setattr(memory, "available_bytes", lambda: 64 * MB)
    out = mp.parent / out_name
    assert main([command, str(mp), "--calib", str(dp), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "do not fit in the memory available" in err[0]
    assert not out.exists() and sorted(p.name for p in mp.parent.iterdir()) == ["calib.npz", "m.onnx"]


@pytest.mark.parametrize("command,out_name", [("insert", "o.onnx"), ("calibrate", "cache.json")])
def test_a_command_warns_when_the_peak_is_tight(model_and_data, capsys, monkeypatch, command, out_name):
    mp, dp = model_and_data
    weights = io.bytes_on_disk(mp)
    monkeypatch.setattr(memory, "available_bytes", lambda: memory.BASE_BYTES + weights + 1)
    out = mp.parent / out_name
    assert main([command, str(mp), "--calib", str(dp), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert out.exists() and "may run out of memory" in err and "qdqgraph: warning:" in err
