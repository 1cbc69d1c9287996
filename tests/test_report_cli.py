"""`qdqgraph report` and the prediction that `insert` prints."""
import json

import numpy as np
import onnx

import motifs
import qdqgraph
from qdqgraph.cli import main


def test_insert_predicts_no_reformat_inside_the_network(tmp_path, capsys):
    for name in ("residual_add", "concat_of_pools", "se_block", "conv_bn_relu"):
        m = motifs.ALL[name]()
        r = qdqgraph.quantize(m, motifs.sample_data(m))
        t = r.report.tensorrt
        assert t is not None and t["reformats_inside"] == 0, (name, t)
        assert t["int8_layers"] >= 1 and t["int8_flops_share"] > 0.9, (name, t)
        assert "TensorRT prediction:" in r.report.summary()


def test_report_cli_writes_json_and_graph(tmp_path, capsys):
    m = motifs.residual_add(projection=True)
    src = tmp_path / "m.onnx"
    onnx.save(m, src)
    np.savez(tmp_path / "d.npz", **motifs.sample_data(m))
    assert main(["insert", str(src), "--calib", str(tmp_path / "d.npz"), "-o", str(tmp_path / "q.onnx")]) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path / "q.onnx"), "--json", str(tmp_path / "r.json"),
                 "--graph", str(tmp_path / "g.onnx")]) == 0
    out = capsys.readouterr().out
    assert "INT8 FLOPs" in out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert set(doc["summary"]) >= {"layers", "int8_layers", "float_layers", "reformats", "int8_flops_share"}
    layer = doc["layers"][0]
    assert set(layer) >= {"name", "nodes", "ops", "inputs", "outputs", "reformat", "rule"}
    assert all(p["precision"] in ("int8", "fp32", "fp16") for x in doc["layers"] for p in x["inputs"] + x["outputs"])
    g = onnx.load(tmp_path / "g.onnx")
    assert len(g.graph.node) == doc["summary"]["layers"]


def test_report_strict_exits_3_on_a_bad_placement(tmp_path, capsys):
    """Both inputs of the residual Add quantized: the linter flags it."""
    m = motifs.residual_add()
    r = qdqgraph.quantize(m, motifs.sample_data(m), rules=[_rules_both_add_inputs(tmp_path)])
    p = tmp_path / "both.onnx"
    onnx.save(r.model, p)
    assert main(["report", str(p)]) == 0
    capsys.readouterr()
    assert main(["report", str(p), "--strict", "--quiet"]) == 3
    assert "QDQ2" in capsys.readouterr().out


def _rules_both_add_inputs(tmp_path):
    f = tmp_path / "both.toml"
    f.write_text('''schema = 1
[[rule]]
id = "P6-residual-add"
doc = "test override: quantize both Add inputs (what TensorRT's guides advise against)"
ref = "tests"
op = "add"
when = ["all_inputs_float"]
quantize = [{ input = "all", kind = "activation" }]
''')
    return f


def test_report_refuses_missing_model(capsys):
    assert main(["report", "/nonexistent/model.onnx"]) == 2
    assert "not found" in capsys.readouterr().err


def test_report_to_dict_is_what_asdict_makes(tmp_path):
    """InsertReport.to_dict copies its fields as dataclasses.asdict did (containers copied, nested
    dataclasses and tuples as asdict makes them), without asdict's walk."""
    from collections import OrderedDict
    from dataclasses import asdict, dataclass

    from qdqgraph.report import InsertReport

    @dataclass
    class Inner:
        a: int
        b: tuple

    m = motifs.residual_add()
    report = qdqgraph.quantize(m, motifs.sample_data(m)).report
    report.fallback = {"x": [1, 2.5, None, True, ("t", Inner(1, (2, 3)))], "y": Inner(4, ()),
                       "z": OrderedDict(k=[Inner(5, ("u",))]), "n": np.float32(1.5)}
    got = report.to_dict()
    want = asdict(report)
    for name in ("passes", "stages"):
        del got[name], want[name]
    got.pop("profile")
    for name in list(got):
        if name not in want:            # the passes' fields, read by to_dict after the copy
            del got[name]
    assert got == want and list(got) == list(want)
    assert got["sites"] is not report.sites and got["sites"][0] is not report.sites[0]
    assert got["fallback"]["y"] == {"a": 4, "b": ()} and type(got["fallback"]["z"]) is OrderedDict
    assert json.loads(report.to_json())["fallback"]["x"][4] == ["t", {"a": 1, "b": [2, 3]}]
