import os
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

GOLDEN = HERE / "golden"
# every pass run by any test checks what it declares it requires and ensures (qdqgraph.passes.registry)
os.environ.setdefault("QDQGRAPH_CHECK_PASSES", "1")


def pytest_configure(config):
    # the fast tier for inner-loop work is `pytest -m "not slow and not ray"`
    config.addinivalue_line("markers", "ray: starts local Ray clusters (tests/test_ray.py); seconds per start")


@pytest.fixture
def golden():
    """Compare text with tests/golden/NAME.txt; QDQGRAPH_UPDATE_GOLDEN=1 rewrites the file (then
    read the diff before committing it)."""
    def check(name: str, text: str):
        path = GOLDEN / f"{name}.txt"
        if os.environ.get("QDQGRAPH_UPDATE_GOLDEN"):
            path.write_text(text + "\n")
        assert path.exists(), f"no golden file {path}; run with QDQGRAPH_UPDATE_GOLDEN=1 and review it"
        assert text + "\n" == path.read_text()
    return check



@pytest.fixture
def model_and_data(tmp_path):
    """A small residual CNN and calibration data for it, as files (CLI tests)."""
    import motifs
    m = motifs.residual_add()
    mp = tmp_path / "m.onnx"
    onnx.save(m, mp)
    dp = tmp_path / "calib.npz"
    np.savez(dp, **motifs.sample_data(m))
    return mp, dp


def pytest_sessionstart(session):
    # QDQGRAPH_COLLECT_WRITTEN=DIR: keep a copy of every model qdqgraph writes (tests/collect_written.py;
    # .ci/check_written.py checks and builds them)
    folder = os.environ.get("QDQGRAPH_COLLECT_WRITTEN")
    if folder:
        import collect_written
        session.config._qdqgraph_collect_hook = collect_written.start(Path(folder))


def pytest_sessionfinish(session, exitstatus):
    # the sitecustomize folder is the run's own temporary: gone with it (the collected models stay)
    hook = getattr(session.config, "_qdqgraph_collect_hook", None)
    if hook is not None:
        import shutil
        shutil.rmtree(hook, ignore_errors=True)


from qdqgraph.calib import collect as collect_module  # noqa: E402 (after the path set-up above)
from qdqgraph.calib import histogram as histogram_module  # noqa: E402


@pytest.fixture(params=["kernel", "in-graph"])
def binning(request, monkeypatch):
    """Run a collection test once per binning path."""
    if request.param == "kernel" and not histogram_module.COMPILED:
        pytest.skip("the compiled histogram kernel was not built (no C compiler at install)")
    monkeypatch.setattr(collect_module, "COMPILED", request.param == "kernel")
    return request.param
