"""--ray: calibration shards and sensitivity units as Ray tasks give the one-process results bit
for bit, fail with the one-process error, and leave no Ray process behind.

Most tests share one local Ray of 2 CPUs (module scope: a start costs seconds); qdqgraph uses a
Ray this process is already connected to. The CLI's own start and stop, and its connecting to a
cluster it must leave running, are tested in subprocesses."""
import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
import onnx
import pytest

import motifs
import qdqgraph
from qdqgraph.execution import distributed
from qdqgraph.graph import io
from qdqgraph.calib.methods import METHODS
from qdqgraph.cli import main
from qdqgraph.samples.data import CalibrationData
from qdqgraph.prepare import model_inputs
from qdqgraph.recipes.sensitivity import measure

pytestmark = pytest.mark.ray       # starts Ray clusters: out of the fast tier (-m "not slow and not ray")

NO_RAY = "Ray is not installed (pip install 'qdqgraph[ray]')"
SAMPLES = 11                      # two shards of 5 and 6: a shard boundary inside a file below


@pytest.fixture(scope="module")
def ray():
    ray = pytest.importorskip("ray", reason=NO_RAY)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.ERROR,
             log_to_driver=False)
    yield ray
    ray.shutdown(wait_for_processes=True)


@pytest.fixture
def parts(monkeypatch):
    """The number of parts each distributed.run split its work into (proof that it did split)."""
    seen = []
    real = distributed.run

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(len(out))
        return out
    monkeypatch.setattr(distributed, "run", spy)
    return seen


class Recorder:
    """A progress object that keeps the stages and the counts."""

    def __init__(self):
        self.stages, self.counts = [], []

    def stage(self, name, total=None, unit="sample"):
        self.stages.append((name, total))

    def __call__(self, n=1):
        self.counts.append(n)


def model_and_data(n=SAMPLES, seed=3):
    m = motifs.residual_add(projection=True)
    data = motifs.sample_data(m, n=n, seed=seed)
    data["x"][0] *= 0.25          # the first sample, which starts every histogram, is not the widest
    return m, data


def as_folder(data: dict, folder: Path, sizes=(3, 4, 4)) -> Path:
    folder.mkdir()
    start = 0
    for k, size in enumerate(sizes):
        np.savez(folder / f"part{k}.npz", **{name: a[start:start + size] for name, a in data.items()})
        start += size
    assert start == len(next(iter(data.values())))
    return folder


# ------------------------------------------------------------------ Ray missing

def test_without_ray_the_flag_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    m, data = model_and_data()
    mp, dp = tmp_path / "m.onnx", tmp_path / "d.npz"
    onnx.save(m, mp)
    np.savez(dp, **data)
    monkeypatch.setitem(sys.modules, "ray", None)         # `import ray` now raises ImportError
    for command in (["calibrate", str(mp), "--calib", str(dp), "-o", str(tmp_path / "c.json"), "--ray"],
                    ["insert", str(mp), "--calib", str(dp), "-o", str(tmp_path / "q.onnx"), "--ray", "auto"]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "pip install 'qdqgraph[ray]'" in err, err
    assert not (tmp_path / "c.json").exists() and not (tmp_path / "q.onnx").exists()
    with pytest.raises(qdqgraph.QdqError, match=r"pip install 'qdqgraph\[ray\]'"):
        qdqgraph.calibrate(m, data, ray="local")


def test_what_ray_cannot_do_is_refused_before_any_work(tmp_path, capsys):
    for bad in ("", "  ", 5):
        with pytest.raises(qdqgraph.QdqError, match="ray= takes a Ray address"):
            qdqgraph.QuantizeConfig(ray=bad)
    with pytest.raises(qdqgraph.QdqError, match="ray= runs onnxruntime on the CPUs"):
        qdqgraph.QuantizeConfig(ray="local", providers=("CUDAExecutionProvider",))
    assert main(["calibrate", "--merge", str(tmp_path / "a.state"), "-o", str(tmp_path / "c.json"), "--ray"]) == 2
    assert "--merge runs no calibration" in capsys.readouterr().err


# ------------------------------------------------------------------ calibration

@pytest.mark.parametrize("source", ["arrays", "folder"])
@pytest.mark.parametrize("method", METHODS)
def test_ranges_equal_one_process(ray, parts, tmp_path, method, source):
    m, data = model_and_data()
    calib = data if source == "arrays" else str(as_folder(data, tmp_path / "data"))
    one = qdqgraph.calibrate(m, calib, method=method)
    progress = Recorder()
    got = qdqgraph.calibrate(m, calib, method=method, ray=distributed.LOCAL, progress=progress)
    assert parts == [2]
    assert got.samples == one.samples == SAMPLES
    assert got.amax == one.amax and len(one.amax) > 3
    assert progress.stages == [("calibrating", SAMPLES)] and sum(progress.counts) == SAMPLES


def test_states_equal_one_process_with_batches(ray, parts):
    """The merged histograms themselves, at a batch size that does not divide the shards."""
    m, data = model_and_data()
    one = qdqgraph.calibrate(m, data, batch_size=3, keep_states=True)
    got = qdqgraph.calibrate(m, data, batch_size=3, keep_states=True, ray=distributed.LOCAL)
    assert parts == [2]
    assert {k: s.to_dict() for k, s in got.states.items()} == {k: s.to_dict() for k, s in one.states.items()}


def test_a_ray_run_equals_merged_shard_files(ray, tmp_path):
    """--ray and the shards of `calibrate --shard I/N` then `--merge` are one computation."""
    m, data = model_and_data()
    mp, dp = tmp_path / "m.onnx", tmp_path / "d.npz"
    onnx.save(m, mp)
    np.savez(dp, **data)
    states = []
    for i in (1, 2, 3):
        states.append(str(tmp_path / f"s{i}.state"))
        assert main(["calibrate", str(mp), "--calib", str(dp), "--shard", f"{i}/3", "-o", states[-1], "--quiet"]) == 0
    merged = qdqgraph.merge_calibrations(states, method="entropy")
    got = qdqgraph.calibrate(str(mp), str(dp), method="entropy", ray=distributed.LOCAL)
    assert got.amax == merged.amax


# ------------------------------------------------------------------ sensitivity

def test_sensitivity_equals_one_process(ray, parts):
    m, data = model_and_data(n=8)
    r = qdqgraph.quantize(m, data, high_precision="fp32")
    cd = CalibrationData(data, model_inputs(io.load(m).graph))
    one, evaluate_one = measure(r.model, r.plan, cd, samples=4)
    progress = Recorder()
    got, evaluate = measure(r.model, r.plan, cd, samples=4, ray=distributed.LOCAL, progress=progress)
    assert parts == [2]
    assert len(one.units) > 3
    assert [asdict(u) for u in got.units] == [asdict(u) for u in one.units]     # every dB value, exactly
    assert [u.node for u in got.ranked()] == [u.node for u in one.ranked()]
    assert (got.all_int8_db, got.runs, got.samples) == (one.all_int8_db, one.runs, one.samples)
    some = {one.ranked()[0].node, one.ranked()[-1].node}
    assert evaluate(some) == evaluate_one(some)
    assert progress.stages == [("sensitivity", len(one.units))] and sum(progress.counts) == len(one.units)
    # some units switchable, the rest INT8 against the float graph (what the attention check does)
    only, reference = {u.node for u in one.units[:3]}, io.load(m)
    one, _ = measure(r.model, r.plan, cd, samples=4, only=only, reference=reference)
    got, _ = measure(r.model, r.plan, cd, samples=4, only=only, reference=reference, ray=distributed.LOCAL)
    assert [asdict(u) for u in got.units] == [asdict(u) for u in one.units] and len(one.units) == 3
    assert parts == [2, 2]


def test_insert_with_ray_writes_the_same_model(ray, parts, tmp_path):
    """insert --accuracy-budget --ray: calibration and sensitivity on Ray, the same model and ranking."""
    m, data = model_and_data(n=8)
    mp, dp = tmp_path / "m.onnx", tmp_path / "d.npz"
    onnx.save(m, mp)
    np.savez(dp, **data)
    reports = []
    for name, extra in (("one", []), ("ray", ["--ray"])):
        out, report = tmp_path / f"{name}.onnx", tmp_path / f"{name}.json"
        assert main(["insert", str(mp), "--calib", str(dp), "-o", str(out), "--report", str(report), "--quiet",
                     "--verify", "0", "--method", "entropy", "--accuracy-budget", "80", "--max-float-layers", "1",
                     *extra]) == 0
        reports.append(json.loads(report.read_text()))
    assert parts == [2, 2]                             # calibration, then sensitivity
    assert (tmp_path / "ray.onnx").read_bytes() == (tmp_path / "one.onnx").read_bytes()
    one, got = (r["fallback"] for r in reports)
    assert got["ranking"] == one["ranking"] and got["float_nodes"] == one["float_nodes"] != []


# ------------------------------------------------------------------ errors

@pytest.mark.parametrize("bad", ["nan input", "overflow"])
def test_a_failing_shard_is_the_one_process_error(ray, tmp_path, capsys, bad):
    """Sample 8 (in the second shard) is bad: as data (NaN) or in the model (an overflow to Inf
    that names the sample: the shard must number it as one process does)."""
    m, data = model_and_data()
    data["x"][8] = np.nan if bad == "nan input" else 3e38
    with pytest.raises(qdqgraph.QdqError) as one:
        qdqgraph.calibrate(m, data)
    with pytest.raises(qdqgraph.QdqError) as got:
        qdqgraph.calibrate(m, data, ray=distributed.LOCAL)
    assert (got.value.problem, got.value.fix) == (one.value.problem, one.value.fix)
    if bad == "overflow":
        assert "calibration sample 8" in one.value.problem
    mp, dp = tmp_path / "m.onnx", tmp_path / "d.npz"
    onnx.save(m, mp)
    np.savez(dp, **data)
    lines = []
    for extra in ([], ["--ray"]):
        assert main(["calibrate", str(mp), "--calib", str(dp), "-o", str(tmp_path / "c.json"), *extra]) == 2
        lines.append(capsys.readouterr().err)
    assert lines[0] == lines[1] and len(lines[0].strip().splitlines()) == 1, lines
    assert not (tmp_path / "c.json").exists()


def test_of_two_failing_shards_the_earlier_is_reported(ray):
    """Samples 4 (the first shard's last) and 5 (the second's first) are bad in different ways: the
    second shard fails first in time, but one process meets sample 4 first, and so must --ray."""
    m, data = model_and_data()
    data["x"][4] = np.nan
    data["x"][5] = 3e38
    with pytest.raises(qdqgraph.QdqError) as one:
        qdqgraph.calibrate(m, data)
    with pytest.raises(qdqgraph.QdqError) as got:
        qdqgraph.calibrate(m, data, ray=distributed.LOCAL)
    assert "NaN or Inf" in one.value.problem and "sample" not in one.value.problem
    assert str(got.value) == str(one.value)


def test_an_unreachable_cluster_is_one_line_at_once(tmp_path, capsys):
    pytest.importorskip("ray", reason=NO_RAY)
    m, data = model_and_data()
    mp, dp = tmp_path / "m.onnx", tmp_path / "d.npz"
    onnx.save(m, mp)
    np.savez(dp, **data)
    code, err = _subprocess(["calibrate", str(mp), "--calib", str(dp), "-o", str(tmp_path / "c.json"),
                             "--ray", "127.0.0.1:1"], timeout=60)
    assert code == 2 and err.startswith("qdqgraph: error: cannot connect to Ray at 127.0.0.1:1"), err
    assert len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------ processes

def _subprocess(args, env=None, timeout=300):
    done = subprocess.run([sys.executable, "-m", "qdqgraph", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    return done.returncode, done.stderr


def _processes_under(folder: str) -> list[str]:
    """The processes whose command line names `folder` (every Ray process names its session folder)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if folder in cmd:
            found.append(f"{proc.name}: {cmd[:120]}")
    return found


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="looks for processes in /proc")
def test_the_cli_starts_and_stops_its_own_ray(tmp_path):
    """`--ray` alone: a Ray of the command's own (in a folder of this test's, found by the command
    lines of its processes), gone when the command ends, whether it succeeds or fails."""
    pytest.importorskip("ray", reason=NO_RAY)
    m, data = model_and_data()
    mp, dp = tmp_path / "m.onnx", tmp_path / "d.npz"
    onnx.save(m, mp)
    np.savez(dp, **data)
    bad = dict(data)
    bad["x"] = data["x"].copy()
    bad["x"][9] = np.nan
    np.savez(tmp_path / "bad.npz", **bad)
    with tempfile.TemporaryDirectory(prefix="qr", dir="/tmp") as root:    # short: Ray's socket paths
        env = {"RAY_TMPDIR": root}
        code, err = _subprocess(["calibrate", str(mp), "--calib", str(dp), "-o", str(tmp_path / "ray.json"),
                                 "--method", "entropy", "--ray", "--quiet"], env)
        assert code == 0 and err == "", err
        assert Path(root, "ray").is_dir()                # the command's Ray did live there
        assert _processes_under(root) == []
        failing = ["calibrate", str(mp), "--calib", str(tmp_path / "bad.npz"), "-o", str(tmp_path / "bad.json")]
        code, err = _subprocess([*failing, "--ray"], env)
        assert code == 2 and _processes_under(root) == []
    assert _subprocess(failing) == (2, err)           # the one-process line, exactly
    assert len(err.strip().splitlines()) == 1 and "contains NaN or Inf" in err, err
    assert main(["calibrate", str(mp), "--calib", str(dp), "-o", str(tmp_path / "one.json"), "--method", "entropy",
                 "--quiet"]) == 0
    assert json.loads((tmp_path / "ray.json").read_text())["tensors"] == \
        json.loads((tmp_path / "one.json").read_text())["tensors"]


def test_the_cli_leaves_a_cluster_it_connects_to_running(ray, tmp_path):
    m, data = model_and_data()
    mp, dp = tmp_path / "m.onnx", tmp_path / "d.npz"
    onnx.save(m, mp)
    np.savez(dp, **data)
    address = ray.get_runtime_context().gcs_address
    code, err = _subprocess(["calibrate", str(mp), "--calib", str(dp), "-o", str(tmp_path / "c.json"),
                             "--ray", address, "--quiet"])
    assert code == 0 and err == "", err
    assert ray.cluster_resources().get("CPU") == 2                     # still up, this process still in it
    assert ray.get(ray.put(41)) == 41
    assert main(["calibrate", str(mp), "--calib", str(dp), "-o", str(tmp_path / "one.json"), "--quiet"]) == 0
    assert (tmp_path / "c.json").read_text() == (tmp_path / "one.json").read_text()
