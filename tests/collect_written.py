"""Collect every model qdqgraph writes during a test run, for the check that each one passes the full
ONNX checker and builds with TensorRT for RTX (.ci/check_written.py).

Set QDQGRAPH_COLLECT_WRITTEN=DIR and run pytest: every model written through qdqgraph's one model
writer (`qdqgraph.graph.io.save`, which the CLI, the Python API's `save` and the slow tier's builder all
use) is copied to DIR/<sha256>.onnx, once per content, and DIR/manifest.jsonl gets one line per write:
{"sha256", "model" (the copy, relative to DIR), "test" (the pytest node id that wrote it), "name"
(the file name written), "bytes"}.

In the pytest process the writer is wrapped from tests/conftest.py. qdqgraph runs that tests start
with `python -m qdqgraph` (or `-c`) inherit the environment: conftest puts a folder holding a
`sitecustomize.py` first on their PYTHONPATH, which wraps the writer when `qdqgraph.graph.io` is imported
(and nothing else), then runs any other `sitecustomize` the interpreter would have run. The test id
comes from PYTEST_CURRENT_TEST, which pytest sets and subprocesses inherit.

A model written with external data (past 2 GB, or past a test's lowered threshold) is copied with
its data file into DIR/<sha256>/ under their written names ("model" in its manifest line names the
copy); past MAX_EXTERNAL_BYTES it is only listed ("skipped" says why), and the checker says so.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

ENV = "QDQGRAPH_COLLECT_WRITTEN"
MAX_EXTERNAL_BYTES = 1 << 30            # a model with external data past this is listed, not copied
HERE = Path(__file__).resolve().parent


def _test_id() -> str:
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    return current.rsplit(" (", 1)[0] if current else "(outside a test)"


def record(folder: Path, written: Path, files: list) -> None:
    """Copy the model file `written` (with `files`, what the writer wrote for it) into `folder`
    under its content hash and add a manifest line."""
    folder.mkdir(parents=True, exist_ok=True)
    entry: dict = {"test": _test_id(), "name": written.name}
    paths = [written] + [Path(f) for f in files if Path(f) != written]
    size = sum(p.stat().st_size for p in paths)
    entry["bytes"] = size
    if len(paths) > 1:                       # the model and its external data file, beside it by name
        entry["external"] = True
        if size > MAX_EXTERNAL_BYTES:
            entry["skipped"] = f"{size / 1e9:.1f} GB with its external data, past the {MAX_EXTERNAL_BYTES / 1e9:.0f} GB kept"
            _append(folder, entry)
            return
        digest = hashlib.sha256(b"".join(_digest(p).encode() for p in paths)).hexdigest()
        target = folder / digest
        if not target.exists():
            scratch = Path(tempfile.mkdtemp(dir=folder, prefix=".collect."))
            for p in paths:
                shutil.copyfile(p, scratch / p.name)
            try:
                os.rename(scratch, target)
            except OSError:                  # another process kept the same model first
                shutil.rmtree(scratch, ignore_errors=True)
        entry.update(sha256=digest, model=f"{digest}/{written.name}")
    else:
        blob = written.read_bytes()
        digest = hashlib.sha256(blob).hexdigest()
        entry.update(sha256=digest, model=f"{digest}.onnx")
        target = folder / f"{digest}.onnx"
        if not target.exists():
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".collect.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, target)
    _append(folder, entry)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _append(folder: Path, entry: dict) -> None:
    line = (json.dumps(entry) + "\n").encode()
    fd = os.open(folder / "manifest.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)                   # one write per line: O_APPEND keeps processes' lines whole
    finally:
        os.close(fd)


def wrap(module, folder: Path) -> None:
    """Wrap `module.save` (qdqgraph.graph.io's model writer) to record what it writes; idempotent."""
    original = module.save
    if getattr(original, "_collects_written", False):
        return

    @functools.wraps(original)
    def save(model, path, *args, **kwargs):
        files = original(model, path, *args, **kwargs)
        record(folder, Path(path), list(files))
        return files

    save._collects_written = True          # type: ignore[attr-defined]
    module.save = save
    import sys
    package = sys.modules.get("qdqgraph")
    if package is not None and getattr(package, "save", None) is original:
        package.save = save                  # `qdqgraph.save` is the same function, re-exported


_SITECUSTOMIZE = '''\
# written by tests/collect_written.py for one test run: wraps qdqgraph's model writer in qdqgraph
# processes the tests start, then runs the sitecustomize this one shadows
import importlib.abc, importlib.machinery, os, sys
_HERE = os.path.dirname(os.path.abspath(__file__))


class _AfterQdqgraphIo(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "qdqgraph.graph.io":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            sys.path.insert(0, {tests!r})
            try:
                import collect_written
            finally:
                sys.path.remove({tests!r})
            collect_written.wrap(module, collect_written.Path(os.environ[collect_written.ENV]))
        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("{env}"):
    sys.meta_path.insert(0, _AfterQdqgraphIo())
_other = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if p and
                                                  os.path.abspath(p) != _HERE])
if _other is not None and _other.loader is not None:
    import importlib.util
    _module = importlib.util.module_from_spec(_other)
    _other.loader.exec_module(_module)
'''


def start(folder: Path) -> Path:
    """Collect into `folder` from this process and the qdqgraph processes it starts; returns the
    folder of the sitecustomize put on PYTHONPATH."""
    import qdqgraph.graph.io
    folder.mkdir(parents=True, exist_ok=True)
    wrap(qdqgraph.graph.io, folder)
    hook = Path(tempfile.mkdtemp(prefix="qdqgraph-collect-"))
    (hook / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(tests=str(HERE), env=ENV))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(hook) + (os.pathsep + old if old else "")
    os.environ[ENV] = str(folder.resolve())
    return hook
