"""The stage profile: seconds and memory per stage and per step, in every report and with --verbose;
and the output-aware search's scan, which must choose what measuring every candidate on all rows
chooses."""
import json

import numpy as np
import pytest
import onnx

import motifs
import qdqgraph
from qdqgraph.execution import profile
from qdqgraph.cli import main
from qdqgraph.recipes import output_aware


def test_report_profiles_every_stage_and_the_steps_inside():
    m = motifs.residual_add(projection=True)
    r = qdqgraph.quantize(m, motifs.sample_data(m))
    rows = r.report.to_dict()["profile"]
    top = {k: v for k, v in rows.items() if "/" not in k}
    assert list(top) == list(r.report.stages)          # every stage, in run order
    for name, row in top.items():
        assert abs(row["seconds"] - r.report.stages[name]) < 1e-3, name
    for row in rows.values():
        assert row["calls"] >= 1 and row["seconds"] >= 0 and row["peak_rss_mb"] > 0
    assert {"clean/fold_constants", "clean/fold_batchnorm", "plan/placement", "plan/refine (P14)",
            "simulate/quantized engine", "calibrate/onnxruntime session"} <= set(rows)
    peaks = [row["peak_rss_mb"] for k, row in rows.items() if "/" not in k and row["calls"] == 1]
    assert peaks == sorted(peaks)                       # a high-water mark never falls (a stage run twice
    #                                                     keeps its first place and its last mark)
    assert rows["clean"]["seconds"] >= sum(v["seconds"] for k, v in rows.items() if k.startswith("clean/")) - 1e-3
    passes = [p for p in r.report.passes if p.name == "fold_constants"]
    assert passes and all(p.seconds > 0 for p in passes)


def test_a_step_outside_a_run_does_nothing():
    with profile.step("nothing open"):
        pass
    p = profile.Profile()
    with p.stage("a"):
        with profile.step("b"):
            with profile.step("c"):
                pass
    with p.stage("a"):
        pass
    with profile.step("after"):
        pass
    assert list(p.rows) == ["a", "a/b", "a/b/c"] and p.rows["a"]["calls"] == 2
    lines = p.lines()
    assert lines[1].split()[:2] == ["a", "x2"] and lines[2].split()[0] == "b" and lines[-1].split()[0] == "total"


def test_a_large_model_run_frees_the_garbage_of_each_stage_as_it_ends(monkeypatch):
    """Graphs are reference cycles: what a stage drops waits for the collector unless the profile
    collects as each stage ends, which it does for a run on a large model (memory.EVERY_STAGE_BYTES), at
    the stages' ends only, and never for a small one."""
    from qdqgraph.execution import memory
    calls = []
    monkeypatch.setattr(memory, "collect", lambda: calls.append(1))
    p = profile.Profile()
    with p.stage("a"):
        with profile.step("inner"):
            pass
    assert calls == []                                  # collect is off: nothing
    p.collect = True
    with p.stage("b"):
        with profile.step("inner"):
            pass
    assert calls == [1]                                 # the stage's end, not its step's
    m = motifs.residual_add(projection=True)
    monkeypatch.setattr(memory, "EVERY_STAGE_BYTES", 1)
    calls.clear()
    r = qdqgraph.quantize(m, motifs.sample_data(m))
    assert len(calls) >= len(r.report.stages)
    monkeypatch.setattr(memory, "EVERY_STAGE_BYTES", 1 << 40)
    calls.clear()
    qdqgraph.quantize(m, motifs.sample_data(m))
    assert calls == []


def test_insert_verbose_prints_the_profile_and_the_json_holds_it(tmp_path, capsys):
    m = motifs.residual_add(projection=True)
    src = tmp_path / "m.onnx"
    onnx.save(m, src)
    np.savez(tmp_path / "d.npz", **motifs.sample_data(m))
    assert main(["insert", str(src), "--calib", str(tmp_path / "d.npz"), "-o", str(tmp_path / "q.onnx"),
                 "--report", str(tmp_path / "r.json"), "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "profile: stage" in out and "\n  save " in out and "\n  verify " in out and "\n  total " in out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert {"load", "clean", "plan", "calibrate", "insert", "simulate", "save"} <= set(doc["profile"])
    assert "save" in doc["stages"]
    assert main(["insert", str(src), "--calib", str(tmp_path / "d.npz"), "-o", str(tmp_path / "q.onnx"),
                 "--force"]) == 0
    assert "profile: stage" not in capsys.readouterr().out


def _exhaustive(x, w, cmax, extra, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(output_aware, "SCAN_STRIDE", 1)
        return output_aware._search(x, w, cmax, extra, output_aware.ALPHAS)


def test_the_scan_chooses_what_measuring_every_candidate_on_all_rows_chooses(monkeypatch):
    """Outlier channels, heavy tails, a few large rows, many outputs (projected): the grid scanned on
    every 8th row keeps the candidate the full measurement picks, at every alpha and at alpha 0."""
    rng = np.random.default_rng(3)
    for case in range(6):
        k, m = (64, 300) if case % 2 else (96, 48)
        x = rng.standard_t(3 + case, size=(512, k)).astype(np.float32)
        x[:, rng.integers(0, k, size=2)] *= 20.0 * (case + 1)
        x[::97] *= 8.0
        w = (rng.standard_normal((k, m)) / np.sqrt(k)).astype(np.float32)
        cmax = np.abs(x).max(axis=0)
        extra = (float(np.percentile(np.abs(x), 99.99)),)
        (alpha, amax, err), at_zero = output_aware._search(x, w, cmax, extra, output_aware.ALPHAS)
        (alpha_all, amax_all, err_all), at_zero_all = _exhaustive(x, w, cmax, extra, monkeypatch)
        # the same candidate; its error measured again on all rows may differ in the last bits (the
        # BLAS of a machine may block the product of the scanned rows differently)
        assert (alpha, amax) == (alpha_all, amax_all), case
        assert err == pytest.approx(err_all, rel=1e-6) and at_zero == pytest.approx(at_zero_all, rel=1e-6), case
