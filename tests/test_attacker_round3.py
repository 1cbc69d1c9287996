"""Bad input, round three (issue 33): special files as outputs and inputs, models from other tools in
`strip`/`report`/`fix`, SIGTERM, --debug's exit code, and the Python API's argument checks. Each case
gives exit 2 and one line `qdqgraph: error: <problem>; <fix>` (or exits 0 having done the right
thing), as docs/BAD_INPUT.md lists (cases 20 on); models are tiny and built in code."""
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest_helpers import files
from qdqgraph import outputs
from qdqgraph.cli import main
from qdqgraph.errors import QdqError
from test_bad_input import no_sessions, refused


# ------------------------------------------------------------- 20. special files as outputs

def _char_device(path: Path) -> Path:
    """A character device node like /dev/null (major 1, minor 3) at `path`; skips where mknod is not
    permitted (not root)."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError) as e:
        pytest.skip(f"cannot make a device node here ({e})")
    return path


def _special(kind: str, path: Path) -> Path:
    if kind == "fifo":
        os.mkfifo(path)
        return path
    return _char_device(path)


def _still(kind: str, path: Path) -> bool:
    mode = os.lstat(path).st_mode
    return stat.S_ISFIFO(mode) if kind == "fifo" else stat.S_ISCHR(mode)


@pytest.mark.parametrize("kind", ["fifo", "chardev"])
@pytest.mark.parametrize("flag", ["-o", "--report"])
def test_20_special_file_output_is_never_replaced(model_and_data, capsys, monkeypatch, kind, flag):
    mp, dp = model_and_data
    node = _special(kind, mp.parent / "node")
    argv = ["insert", mp, "--calib", dp, flag, node, "--force"]
    if flag == "--report":
        argv += ["-o", mp.parent / "q.onnx"]
    no_sessions(monkeypatch)
    line = refused(capsys, argv, "node is a " if kind == "fifo" else "node is a character device",
                   "not a regular file", "name a regular file", folder=mp.parent)
    assert _still(kind, node), line


@pytest.mark.parametrize("kind", ["fifo", "chardev"])
def test_20_strip_and_report_json_to_a_special_file(model_and_data, capsys, kind):
    mp, dp = model_and_data
    q = mp.parent / "q.onnx"
    assert main(["insert", str(mp), "--calib", str(dp), "-o", str(q), "--quiet", "--verify", "0"]) == 0
    capsys.readouterr()
    node = _special(kind, mp.parent / "node")
    refused(capsys, ["strip", q, "-o", node, "--force"], "not a regular file", folder=mp.parent)
    refused(capsys, ["report", q, "--json", node, "--force"], "not a regular file", folder=mp.parent)
    assert _still(kind, node)


def test_20_write_atomic_refuses_a_node_that_appears_while_writing(tmp_path):
    out = tmp_path / "r.json"

    def write(tmp: Path) -> None:                 # the node lands between the check and the rename
        tmp.write_text("{}")
        os.mkfifo(out)
    with pytest.raises(QdqError, match="is a FIFO, not a regular file"):
        outputs.write_atomic(out, write, force=True)
    assert stat.S_ISFIFO(os.lstat(out).st_mode) and files(tmp_path) == {"r.json"}


def test_20_dev_null_is_refused_by_the_check_alone():
    # the check only reads /dev/null's mode; nothing is written anywhere
    with pytest.raises(QdqError, match="/dev/null is a character device, not a regular file"):
        outputs.check_output("/dev/null", "--report", force=True)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
