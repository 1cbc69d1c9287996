"""Calibration folders are read one file at a time (flat memory), with the same samples as one file."""
import numpy as np

from qdqgraph.samples.data import CalibrationData, FileChunk, InputSpec, read_arrays

SPEC = [InputSpec("x", np.dtype(np.float32), ("n", 4))]


def test_folder_chunks_hold_one_file_and_give_the_same_samples(tmp_path):
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((3, 1, 4)).astype(np.float32) for _ in range(4)]
    for k, a in enumerate(parts):
        np.savez(tmp_path / f"part{k}.npz", x=a)
    chunks = read_arrays(tmp_path, SPEC)
    assert all(isinstance(c, FileChunk) for c in chunks)
    data = CalibrationData(chunks, SPEC)
    got = [data.sample(i)["x"] for i in range(data.count)]
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(parts).reshape(12, 4))
    assert FileChunk._last[0] == tmp_path / "part3.npz"      # only the last file read is held
    assert data.count == 12
