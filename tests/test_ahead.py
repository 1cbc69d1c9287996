"""execution.ahead: work in a forked child, read when needed; and insert --verify's comparison
started there on a large written model (the same table as computed in the process)."""
import os
import time

import pytest

from qdqgraph.cli import insert as insert_cli
from qdqgraph.cli import main
from qdqgraph.execution import ahead, evaluate

pytestmark = pytest.mark.skipif(not ahead.available(), reason="no os.fork or a single core")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_childs_value_comes_back():
    parent = os.getpid()
    job = ahead.start(lambda: {"pid": os.getpid(), "values": list(range(100_000))})
    assert job is not None
    got = job.result()
    assert got["pid"] != parent and got["values"] == list(range(100_000))     # > a pipe's buffer
    with pytest.raises(ahead.Failed):
        job.result()                                                           # read once


def test_an_exception_or_a_crash_in_the_child_is_failed():
    def boom():
        raise ValueError("no")

    with pytest.raises(ahead.Failed, match="ValueError: no"):
        ahead.start(boom).result()
    with pytest.raises(ahead.Failed, match="status 3"):
        ahead.start(lambda: os._exit(3)).result()


def test_cancel_stops_and_reaps_the_child():
    job = ahead.start(lambda: time.sleep(60))
    pid = job.pid
    t = time.perf_counter()
    job.cancel()
    assert time.perf_counter() - t < 10 and job.pid is None and _gone(pid)


def test_the_child_writes_nothing_of_the_parents(capfd):
    print("before", end="")                    # buffered in the parent at the fork
    ahead.start(lambda: 1).result()
    assert capfd.readouterr().out == "before"


def _verify_lines(text: str) -> list[str]:
    lines = text.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("float vs quantized"))
    return lines[at:]


def test_insert_verify_started_ahead_prints_what_the_process_computes(model_and_data, capsys, monkeypatch):
    mp, dp = model_and_data
    started = []
    real_start = ahead.start

    def start(fn):
        job = real_start(fn)
        started.append(job)
        return job

    monkeypatch.setattr(ahead, "start", start)
    monkeypatch.setattr(insert_cli, "verify_ahead", lambda model: False)
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(mp.parent / "a.onnx")]) == 0
    alone = _verify_lines(capsys.readouterr().out)
    assert not started
    monkeypatch.setattr(insert_cli, "verify_ahead", lambda model: True)
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(mp.parent / "b.onnx")]) == 0
    assert len(started) == 1 and started[0].pid is None            # read and reaped
    assert _verify_lines(capsys.readouterr().out) == [x.replace("a.onnx", "b.onnx") for x in alone]
    assert (mp.parent / "a.onnx").read_bytes() == (mp.parent / "b.onnx").read_bytes()


def test_a_child_that_fails_leaves_the_comparison_to_the_process(model_and_data, capsys, monkeypatch):
    mp, dp = model_and_data
    parent = os.getpid()
    real_compare = evaluate.compare

    def compare(*a, **k):
        if os.getpid() != parent:
            raise RuntimeError("the child fails")
        return real_compare(*a, **k)

    monkeypatch.setattr(evaluate, "compare", compare)
    monkeypatch.setattr(insert_cli, "verify_ahead", lambda model: True)
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(mp.parent / "c.onnx")]) == 0
    lines = _verify_lines(capsys.readouterr().out)
    assert lines[0].startswith("float vs quantized on 8 samples") and "output y: cosine" in lines[1]


def test_a_run_that_fails_after_writing_cancels_the_child(model_and_data, capsys, monkeypatch):
    mp, dp = model_and_data
    started = []
    real_start = ahead.start

    def start(fn):
        job = real_start(lambda: time.sleep(60))
        started.append((job, job.pid))
        return job

    monkeypatch.setattr(ahead, "start", start)
    monkeypatch.setattr(insert_cli, "verify_ahead", lambda model: True)
    t = time.perf_counter()
    # every Conv float: the prediction's INT8 share is under what --require-int8 asks, after writing
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(mp.parent / "d.onnx"), "--require-int8", "100",
                 "--exclude-op", "Conv"]) == 2
    assert time.perf_counter() - t < 30
    assert len(started) == 1
    job, pid = started[0]
    assert job.pid is None and _gone(pid)
    assert not (mp.parent / "d.onnx").exists()


def test_verify_ahead_only_on_large_written_graphs():
    import onnx
    from onnx import helper
    small = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [], []))
    assert not insert_cli.verify_ahead(small)
    nodes = [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"]) for i in range(5000)]
    big = helper.make_model(helper.make_graph(nodes, "g", [], []))
    assert insert_cli.verify_ahead(big)
    heavy = onnx.TensorProto(name="w", data_type=onnx.TensorProto.FLOAT, dims=[65 << 20])   # 260 MB declared
    big.graph.initializer.append(heavy)
    assert not insert_cli.verify_ahead(big)


def test_an_interrupted_wait_stops_the_child():
    import signal

    class Stop(Exception):
        pass

    def stop(*_):
        raise Stop()

    job = ahead.start(lambda: time.sleep(60))
    pid = job.pid
    old = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        t = time.perf_counter()
        with pytest.raises(Stop):
            job.result()
        assert time.perf_counter() - t < 10 and _gone(pid) and job.pid is None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_no_child_off_linux_or_on_one_core(monkeypatch):
    monkeypatch.setattr(ahead.sys, "platform", "darwin")
    assert not ahead.available() and ahead.start(lambda: 1) is None
    monkeypatch.setattr(ahead.sys, "platform", "linux")
    monkeypatch.setattr(ahead, "cores", lambda: 1)
    assert not ahead.available() and ahead.start(lambda: 1) is None


def test_quantize_refuses_an_ahead_that_is_not_a_function(model_and_data):
    import qdqgraph
    from qdqgraph.errors import QdqError
    mp, dp = model_and_data
    with pytest.raises(QdqError, match=r"quantize\(ahead=\.\.\.\) takes a function"):
        qdqgraph.quantize(str(mp), calib=str(dp), ahead=1)


def test_no_child_while_ray_runs_in_the_process(monkeypatch):
    import sys
    import types
    from qdqgraph.execution import distributed
    fake = types.ModuleType("ray")
    fake.is_initialized = lambda: True
    monkeypatch.setitem(sys.modules, "ray", fake)
    assert distributed.running() and ahead.start(lambda: 1) is None
    fake.is_initialized = lambda: False
    job = ahead.start(lambda: 1)
    assert job is not None and job.result() == 1
    monkeypatch.delitem(sys.modules, "ray")
    assert not distributed.running()


def test_a_child_that_does_not_answer_in_time_is_killed():
    job = ahead.start(lambda: time.sleep(60))
    pid = job.pid
    t = time.perf_counter()
    with pytest.raises(ahead.Failed, match="within 0.5 s"):
        job.result(0.5)
    assert 0.4 < time.perf_counter() - t < 10 and job.pid is None and _gone(pid)
    assert ahead.start(lambda: 7).result(30) == 7          # in time: the value
