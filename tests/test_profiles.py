"""Optimization profiles: trtexec-style shape flags and shapes derived from calibration data."""
import numpy as np
import pytest

from qdqgraph.samples.data import CalibrationData, InputSpec
from qdqgraph.errors import QdqError
from qdqgraph.backends.profiles import from_data, from_flags, parse_shapes, profiles

IMG = InputSpec("input", np.dtype(np.float32), ("batch", 3, "h", "w"))
IDS = InputSpec("ids:0", np.dtype(np.int64), ("batch", "seq"))
FIXED = InputSpec("fixed", np.dtype(np.float32), (1, 8))


def test_parse_shapes_trtexec_form_and_names_with_colons():
    assert parse_shapes("input:1x3x224x224,ids:0:2x128") == {"input": (1, 3, 224, 224), "ids:0": (2, 128)}
    assert parse_shapes(" scalar: ") == {"scalar": ()}


@pytest.mark.parametrize("bad, words", [
    ("1x3x224x224", "no input name"),
    ("input:1x3xAx224", "whole numbers"),
    ("input:1x0x2", "at least 1"),
    ("a:1x2,a:1x3", "twice"),
    ("", "empty"),
])
def test_parse_shapes_errors_name_the_problem(bad, words):
    with pytest.raises(QdqError, match=words):
        parse_shapes(bad)


def test_from_flags_checks_names_rank_fixed_dims_and_order():
    got = from_flags([IMG, IDS], shapes="input:4x3x224x224")
    assert got["input"].min == got["input"].opt == got["input"].max == (4, 3, 224, 224)
    got = from_flags([IMG, IDS], min_="ids:0:1x16", opt="ids:0:8x128", max_="ids:0:32x512")
    assert (got["ids:0"].min, got["ids:0"].opt, got["ids:0"].max) == ((1, 16), (8, 128), (32, 512))
    with pytest.raises(QdqError, match="no model input is named 'nope'"):
        from_flags([IMG], shapes="nope:1x2")
    with pytest.raises(QdqError, match="rank 2"):
        from_flags([IMG], shapes="input:1x3")
    with pytest.raises(QdqError, match="fixes it at 1"):
        from_flags([FIXED], shapes="fixed:2x8")
    with pytest.raises(QdqError, match="not ordered"):
        from_flags([IDS], min_="ids:0:8x16", opt="ids:0:4x128", max_="ids:0:32x512")
    with pytest.raises(QdqError, match="go together"):
        from_flags([IDS], min_="ids:0:1x16")
    with pytest.raises(QdqError, match="both given"):
        from_flags([IDS], shapes="ids:0:1x16", min_="ids:0:1x16", opt="ids:0:1x16", max_="ids:0:1x16")


def test_from_data_takes_min_max_and_most_frequent_shape():
    rng = np.random.default_rng(0)
    chunks = [{"input": rng.standard_normal((3, 1, 3, 32, 48)).astype(np.float32)},
              {"input": rng.standard_normal((1, 1, 3, 64, 40)).astype(np.float32)}]
    data = CalibrationData(chunks, [IMG])
    p = from_data(data)["input"]
    assert p.min == (1, 3, 32, 40) and p.max == (1, 3, 64, 48) and p.opt == (1, 3, 32, 48)
    wide = from_data(data, max_batch=16)["input"]
    assert wide.min[0] == 1 and wide.max[0] == 16 and wide.opt == p.opt


def test_static_inputs_need_no_profile_and_dynamic_ones_must_be_covered():
    assert profiles([FIXED]) == {}
    with pytest.raises(QdqError, match="without a shape range: input"):
        profiles([IMG, FIXED])
    data = CalibrationData({"input": np.zeros((2, 1, 3, 8, 8), np.float32),
                            "ids:0": np.zeros((2, 1, 5), np.int64)}, [IMG, IDS])
    got = profiles([IMG, IDS], data, shapes="ids:0:1x64")
    assert got["ids:0"].opt == (1, 64) and got["input"].opt == (1, 3, 8, 8)
