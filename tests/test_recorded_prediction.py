"""The prediction `insert` records in the written model (trtsim.recorded) and `qdqgraph report`'s use
of it: trusted only for the graph it was made from, the target and the qdqgraph version."""
import json

import numpy as np
import onnx
import pytest

import motifs
import qdqgraph
from qdqgraph.cli import main
from qdqgraph.cli import report as report_cli
from qdqgraph.trtsim import recorded


@pytest.fixture()
def written(tmp_path, capsys):
    m = motifs.residual_add(projection=True)
    src = tmp_path / "m.onnx"
    onnx.save(m, src)
    np.savez(tmp_path / "d.npz", **motifs.sample_data(m))
    out = tmp_path / "q.onnx"
    assert main(["insert", str(src), "--calib", str(tmp_path / "d.npz"), "-o", str(out)]) == 0
    capsys.readouterr()
    return out


class Counter:
    """report's simulation, counted."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = report_cli.simulate_and_lint

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(report_cli, "simulate_and_lint", counted)


def _report(path, capsys, *extra):
    code = main(["report", str(path), *extra])
    return code, capsys.readouterr().out


def test_report_prints_the_record_as_it_would_compute_it(written, tmp_path, capsys, monkeypatch):
    model = onnx.load(written)
    assert recorded.recorded(model, "tensorrt") is not None
    count = Counter(monkeypatch)
    code, kept = _report(written, capsys, "--json", str(tmp_path / "kept.json"))
    assert code == 0 and count.calls == 0             # nothing simulated
    code, fresh = _report(written, capsys, "--recompute", "--json", str(tmp_path / "fresh.json"))
    assert code == 0 and count.calls == 1
    assert kept == fresh and "INT8 FLOPs" in kept
    assert (tmp_path / "kept.json").read_text() == (tmp_path / "fresh.json").read_text()
    _, quiet = _report(written, capsys, "--quiet")
    assert quiet.splitlines()[0] == fresh.splitlines()[-1] and count.calls == 1


def test_an_edited_graph_is_simulated_again(written, tmp_path, capsys, monkeypatch):
    model = onnx.load(written)
    qs = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    # the graph changes, the metadata (with the old record) stays: a rename of a Q's input would be
    # as good; here the first Q is bypassed, so its consumers read the float tensor
    q = qs[0]
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0])
    for n in model.graph.node:
        for i, t in enumerate(n.input):
            if t == dq.output[0]:
                n.input[i] = q.input[0]
    model.graph.node.remove(dq)
    model.graph.node.remove(q)
    edited = tmp_path / "edited.onnx"
    onnx.save(model, edited)
    assert any(p.key == recorded.KEY for p in onnx.load(edited).metadata_props)
    assert recorded.recorded(onnx.load(edited), "tensorrt") is None
    count = Counter(monkeypatch)
    _, kept = _report(written, capsys)
    assert count.calls == 0
    _, out = _report(edited, capsys)
    assert count.calls == 1                            # the record no longer describes the graph
    _, fresh = _report(edited, capsys, "--recompute")
    assert out == fresh and out != kept


def test_the_record_is_for_its_target_version_and_rules(written, monkeypatch):
    model = onnx.load(written)
    assert recorded.recorded(model, "tensorrt-rtx") is None
    assert recorded.recorded(model, "tensorrt") is not None
    monkeypatch.setattr(recorded, "rules_digest", lambda target: "other rules")
    assert recorded.recorded(model, "tensorrt") is None
    monkeypatch.undo()
    monkeypatch.setattr(recorded, "__version__", "0.0.0-other")
    assert recorded.recorded(model, "tensorrt") is None


def test_a_damaged_record_is_ignored(written):
    model = onnx.load(written)
    for p in model.metadata_props:
        if p.key == recorded.KEY:
            p.value = "not base64 %%%"
    assert recorded.recorded(model, "tensorrt") is None
    recorded.forget(model)
    assert not any(p.key == recorded.KEY for p in model.metadata_props)


def test_the_api_model_holds_the_record_of_its_own_graph():
    m = motifs.residual_add()
    r = qdqgraph.quantize(m, motifs.sample_data(m))
    kept = recorded.recorded(r.model, "tensorrt")
    assert kept is not None
    sim = qdqgraph.trtsim.simulate(r.model)
    assert kept.table == sim.table()
    assert json.dumps(kept.report) == json.dumps(sim.to_dict())


def test_simulate_and_lint_is_simulate_then_lint():
    from qdqgraph.placement import load_ruleset
    for name in ("residual_add", "concat_of_pools", "se_block"):
        m = motifs.ALL[name]()
        q = qdqgraph.quantize(m, motifs.sample_data(m)).model
        region = load_ruleset().region
        sim, found = qdqgraph.trtsim.simulate_and_lint(q, region=region)
        alone = qdqgraph.trtsim.simulate(q)
        assert json.dumps(sim.to_dict()) == json.dumps(alone.to_dict()) and sim.table() == alone.table()
        assert [str(d) for d in found] == [str(d) for d in qdqgraph.trtsim.lint(q, alone, region=region)]


def test_a_fixed_model_reports_its_own_graph(written, tmp_path, capsys):
    """fix keeps a model's metadata: whatever record the fixed model holds must describe its graph
    (fix drops the record when it writes a new graph; an unchanged graph keeps a valid one)."""
    out = tmp_path / "fixed.onnx"
    assert main(["fix", str(written), "-o", str(out), "--force"]) == 0
    capsys.readouterr()
    _, kept = _report(out, capsys)
    _, fresh = _report(out, capsys, "--recompute")
    assert kept == fresh and "INT8 FLOPs" in fresh


def test_report_prints_a_record_without_the_checker_or_the_json_report(written, tmp_path, capsys, monkeypatch):
    """A record that matches its graph is printed from the graph alone: the checker, the external
    data and the JSON report (nine tenths of the record) are for the simulation and --json."""
    _, fresh = _report(written, capsys, "--recompute")
    count = Counter(monkeypatch)

    def refused(*args, **kwargs):
        raise AssertionError("the record path ran the checker or parsed the JSON report")
    monkeypatch.setattr(qdqgraph.graph.io, "validate", refused)
    real_loads = recorded.json.loads
    monkeypatch.setattr(recorded.json, "loads", lambda text: refused() if b'"layers"' in text else real_loads(text))
    code, kept = _report(written, capsys)
    assert code == 0 and count.calls == 0 and kept == fresh
    _, quiet = _report(written, capsys, "--quiet")
    assert quiet.splitlines() == fresh.splitlines()[-1:] and count.calls == 0


def test_an_unrecorded_model_is_still_checked(written, tmp_path, capsys, monkeypatch):
    model = onnx.load(written)
    recorded.forget(model)
    plain = tmp_path / "plain.onnx"
    onnx.save(model, plain)
    checked = []
    real = qdqgraph.graph.io.validate
    monkeypatch.setattr(qdqgraph.graph.io, "validate", lambda *a, **k: checked.append(1) or real(*a, **k))
    count = Counter(monkeypatch)
    _, out = _report(plain, capsys)
    assert checked and count.calls == 1
    _, kept = _report(written, capsys)
    assert out == kept and count.calls == 1 and len(checked) == 1


def test_a_record_is_used_for_a_model_with_external_data(written, tmp_path, capsys, monkeypatch):
    """A record made of the graph with its weights in matches once the weights kept in another file
    are read; without that file, report says so (exit 2)."""
    def external(model, name):
        onnx.save(model, tmp_path / name, save_as_external_data=True, all_tensors_to_one_file=True,
                  location=name + ".data", size_threshold=0)
        return tmp_path / name
    first = external(onnx.load(written), "first.onnx")
    model = onnx.load(first)                        # onnx marks the weights read in: another graph's bytes
    assert recorded.recorded(model, "tensorrt") is None
    sim, found = qdqgraph.trtsim.simulate_and_lint(model, region=qdqgraph.load_ruleset().region)
    assert recorded.record(model, sim, found, "tensorrt")
    ext = external(model, "ext.onnx")
    assert onnx.load(ext, load_external_data=False).graph.initializer[0].data_location == onnx.TensorProto.EXTERNAL
    _, fresh = _report(ext, capsys, "--recompute")
    count = Counter(monkeypatch)
    code, out = _report(ext, capsys)
    assert code == 0 and count.calls == 0 and out == fresh
    (tmp_path / "ext.onnx.data").unlink()
    assert main(["report", str(ext)]) == 2
    assert "ext.onnx.data" in capsys.readouterr().err


def test_the_record_without_its_json_report_is_the_rest_of_it(written):
    model = onnx.load(written)
    sim = qdqgraph.trtsim.simulate(model)
    # a finding that looks like the report's key: it sits inside a string, where its quotes are escaped
    lint = ['x,"report":{"layers":[]}', "y"]
    assert recorded.record(model, sim, lint, "tensorrt")
    whole, part = recorded.recorded(model, "tensorrt"), recorded.recorded(model, "tensorrt", report=False)
    assert whole is not None and part is not None and part.report is None
    assert (part.table, part.lint) == (whole.table, whole.lint) == (sim.table(), lint)
    assert json.dumps(whole.report) == json.dumps(sim.to_dict())


def test_the_digest_hashes_each_message_of_the_graph_in_turn(written):
    """The digest of records already written: field name, then each item serialized, field by field
    (how a field's items are fed to the hash may change; the value may not)."""
    import hashlib
    model = onnx.load(written)
    h = hashlib.sha256()
    for field, value in model.graph.ListFields():
        h.update(field.name.encode())
        for item in (value if field.is_repeated else [value]):
            h.update(item.SerializeToString() if hasattr(item, "SerializeToString") else str(item).encode())
    for part in (*model.opset_import, *model.functions):
        h.update(part.SerializeToString())
    assert recorded.digest(model) == h.hexdigest()
    model.graph.node[0].name += "x"
    assert recorded.digest(model) != h.hexdigest()


def test_the_digest_sums_the_graph_size_protobuf_would(written, monkeypatch):
    """The size the digest compares with MAX_GRAPH_BYTES, summed from the fields it serializes
    anyway, is the graph's ByteSize (names and doc strings, multi-byte varints included), and a
    graph over the limit has no digest."""
    model = onnx.load(written)
    model.graph.doc_string = "é" * 200          # a 2-byte length, UTF-8
    seen = []
    real = recorded._graph_size

    def checked(graph, sizes):
        seen.append((real(graph, sizes), graph.ByteSize()))
        return seen[-1][0]
    monkeypatch.setattr(recorded, "_graph_size", checked)
    assert recorded.digest(model) is not None
    assert seen and seen[0][0] == seen[0][1]
    monkeypatch.setattr(recorded, "MAX_GRAPH_BYTES", model.graph.ByteSize() - 1)
    assert recorded.digest(model) is None
    monkeypatch.setattr(recorded, "MAX_GRAPH_BYTES", model.graph.ByteSize())
    assert recorded.digest(model) is not None
