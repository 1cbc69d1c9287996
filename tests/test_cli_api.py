"""The CLI parses into the same QuantizeConfig the API takes, and gives the same model."""
import numpy as np
import onnx
import pytest

import motifs
import qdqgraph
from qdqgraph.cli import build_parser, main
from qdqgraph.cli.args import config as config_of


@pytest.fixture
def model_and_data(tmp_path):
    m = motifs.residual_add(projection=True)
    mp, dp = tmp_path / "m.onnx", tmp_path / "calib.npz"
    onnx.save(m, mp)
    np.savez(dp, **motifs.sample_data(m))
    return mp, dp


CASES = [
    ([], {}),
    (["--method", "entropy", "--high-precision", "fp32"], {"method": "entropy", "high_precision": "fp32"}),
    (["--method", "max", "--weights", "qdq", "--exclude-node", "add"],
     {"method": "max", "weights": "qdq", "exclude_nodes": ("add",)}),
    (["--percentile", "99.9", "--bias-correction", "--samples", "6"],
     {"percentile": 99.9, "bias_correction": True, "samples": 6}),
    (["--accuracy-budget", "60", "--max-float-layers", "1", "--sensitivity-samples", "4"],
     {"accuracy_budget": 60.0, "max_float_layers": 1, "sensitivity_samples": 4}),
]


@pytest.mark.parametrize("flags,options", CASES)
def test_cli_and_api_write_the_same_model(model_and_data, tmp_path, flags, options):
    mp, dp = model_and_data
    out = tmp_path / "cli.onnx"
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(out), "--quiet", "--verify", "0", *flags]) == 0
    args = build_parser().parse_args(["insert", str(mp), "--calib", str(dp), *flags])
    config = config_of(args)
    assert config == qdqgraph.QuantizeConfig(providers=("CPUExecutionProvider",), **options)
    api = qdqgraph.quantize(str(mp), calib=str(dp), config=config)
    assert onnx.load(str(out)).SerializeToString() == api.model.SerializeToString()


def test_keyword_options_and_a_config_are_one_and_the_same(model_and_data):
    mp, dp = model_and_data
    a = qdqgraph.quantize(str(mp), calib=str(dp), method="max", high_precision="fp32")
    b = qdqgraph.quantize(str(mp), calib=str(dp), config=qdqgraph.QuantizeConfig(method="max", high_precision="fp32"))
    c = qdqgraph.quantize(str(mp), calib=str(dp), config=qdqgraph.QuantizeConfig(method="max"), high_precision="fp32")
    assert a.model.SerializeToString() == b.model.SerializeToString() == c.model.SerializeToString()
    with pytest.raises(qdqgraph.QdqError, match="unknown option"):
        qdqgraph.quantize(str(mp), calib=str(dp), methd="max")


def test_calibrate_api_equals_the_cli_cache(model_and_data, tmp_path):
    mp, dp = model_and_data
    out = tmp_path / "c.json"
    assert main(["calibrate", str(mp), "--calib", str(dp), "-o", str(out), "--method", "entropy", "--quiet"]) == 0
    cal = qdqgraph.calibrate(str(mp), str(dp), method="entropy")
    api = tmp_path / "api.json"
    cal.save(api)
    import json
    assert json.loads(out.read_text())["tensors"] == json.loads(api.read_text())["tensors"]
