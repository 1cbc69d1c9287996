"""Reading a model with its large weights apart (graph/wire.py, io.read_weights_apart): the graph and
every tensor as onnx.load reads them, the large float weights in aligned arrays, and a truncated or
corrupt file the usual one-line error."""
import hashlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import motifs
from qdqgraph.errors import QdqError
from qdqgraph.graph import io, wire


def _model(extra_inits=(), opset=17) -> onnx.ModelProto:
    """x[1, 64] -> MatMul(w) -> Add(b) -> Mul(scale) -> y, and `extra_inits` kept as initializers."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w")       # 16 KB: apart
    b = numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "b")              # small: in the proto
    half = helper.make_tensor("half", TensorProto.FLOAT16, [2048],
                              rng.standard_normal(2048).astype(np.float16).tobytes(), raw=True)    # 4 KB
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("Add", ["m", "b"], ["a"], name="add"),
             helper.make_node("Identity", ["half"], ["h"], name="id")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 64]),
                               helper.make_tensor_value_info("h", TensorProto.FLOAT16, [2048])],
                              [w, b, half, *extra_inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _typed_fields() -> list[TensorProto]:
    """Initializers stored in typed fields and odd ones: float_data, int64_data, strings, empty,
    a large int8 (apart from the proto only for float types), a large double."""
    big_float_data = helper.make_tensor("fd", TensorProto.FLOAT, [2048], np.arange(2048, dtype=np.float32))
    ints = helper.make_tensor("i64", TensorProto.INT64, [1000], np.arange(1000, dtype=np.int64))
    strings = helper.make_tensor("s", TensorProto.STRING, [2], [b"ab", b"cd"])
    empty = numpy_helper.from_array(np.zeros((0, 8), np.float32), "empty")
    int8 = numpy_helper.from_array((np.arange(8192) % 100).astype(np.int8), "i8")
    double = numpy_helper.from_array(np.linspace(0, 1, 1024), "d")
    return [big_float_data, ints, strings, empty, int8, double]


def test_split_gives_back_the_file_bytes(tmp_path):
    m = _model(_typed_fields())
    p = tmp_path / "m.onnx"
    onnx.save(m, p)
    split = wire.read_split(p)
    assert sorted(split.raw) == [0, 2, 7, 8]                # w, half, i8, d: raw_data >= 4096 bytes
    assert all(wire.is_aligned(a) for a in split.raw.values())
    back = onnx.ModelProto.FromString(split.model)
    for i, a in split.raw.items():
        back.graph.initializer[i].raw_data = a.tobytes()
    assert back.SerializeToString() == p.read_bytes()


def test_weights_apart_are_the_arrays_onnx_reads(tmp_path):
    m = _model(_typed_fields())
    p = tmp_path / "m.onnx"
    onnx.save(m, p)
    model, arrays = io.read_weights_apart(p)
    assert sorted(arrays) == ["d", "half", "w"]
    want = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    for name, a in arrays.items():
        assert a.dtype == want[name].dtype and a.shape == want[name].shape and wire.is_aligned(a)
        np.testing.assert_array_equal(a, want[name])
    stubs = {t.name for t in model.graph.initializer if io.in_memory(t)}
    assert stubs == set(arrays)
    kept = {t.name: t for t in model.graph.initializer if t.name not in stubs}
    for name in ("fd", "i64", "s", "empty", "i8", "b"):
        assert kept[name].SerializeToString() == next(t for t in m.graph.initializer if t.name == name).SerializeToString()


def test_load_writes_the_same_model_as_before(tmp_path):
    m = _model(_typed_fields())
    p = tmp_path / "m.onnx"
    onnx.save(m, p)
    new = io.to_model(io.load(p)).SerializeToString()
    old = io.to_model(io.load(onnx.load(p))).SerializeToString()          # a ModelProto: read by onnx
    assert hashlib.sha256(new).digest() == hashlib.sha256(old).digest()
    loaded = io.load(p)
    w = loaded.graph.tensors()["w"]
    assert w.data_location is None and wire.is_aligned(w.values)


def test_low_opset_model_is_raised_with_weights_apart(tmp_path):
    m = _model(opset=11)
    p = tmp_path / "m11.onnx"
    onnx.save(m, p)
    assert io.to_model(io.load(p)).SerializeToString() == io.to_model(io.load(onnx.load(p))).SerializeToString()


def test_external_data_is_read(tmp_path):
    m = _model(_typed_fields())
    p = tmp_path / "ext.onnx"
    onnx.save(m, p, save_as_external_data=True, location="ext.bin", size_threshold=0)
    model, arrays = io.read_weights_apart(p)
    assert not any(onnx.external_data_helper.uses_external_data(t) and not io.in_memory(t)
                   for t in model.graph.initializer)
    # float raw_data of 4096 bytes or more (onnx keeps float_data in the proto)
    assert sorted(arrays) == sorted(arrays.external) == ["d", "half", "w"]
    assert all(wire.is_aligned(a) for a in arrays.values())
    np.testing.assert_array_equal(arrays["w"], numpy_helper.to_array(_model().graph.initializer[0]))
    got = io.to_model(io.load(p)).SerializeToString()
    assert got == io.to_model(io.load(onnx.load(p))).SerializeToString()


def test_missing_external_data_is_one_line(tmp_path):
    m = _model()
    p = tmp_path / "ext.onnx"
    onnx.save(m, p, save_as_external_data=True, location="ext.bin", size_threshold=0)
    (tmp_path / "ext.bin").unlink()
    with pytest.raises(QdqError) as e:
        io.load(p)
    assert "is not a readable ONNX model" in e.value.problem and "\n" not in e.value.problem


def test_external_data_outside_the_folder_is_refused(tmp_path):
    m = _model()
    (tmp_path / "sub").mkdir()
    p = tmp_path / "sub" / "ext.onnx"
    onnx.save(m, p, save_as_external_data=True, location="ext.bin", size_threshold=0)
    (tmp_path / "sub" / "ext.bin").rename(tmp_path / "ext.bin")
    bare = onnx.load(p, load_external_data=False)
    for t in bare.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../ext.bin"
    p.write_bytes(bare.SerializeToString())
    with pytest.raises(QdqError) as e:
        io.load(p)
    assert "not a readable ONNX model" in e.value.problem and "\n" not in e.value.problem


@pytest.mark.parametrize("cut", [1, 10, 200, 5000, -3])
def test_truncated_file_is_one_line(tmp_path, cut):
    data = _model().SerializeToString()
    p = tmp_path / "cut.onnx"
    p.write_bytes(data[:cut] if cut > 0 else data[:len(data) + cut])
    with pytest.raises(QdqError) as e:
        io.load(p)
    assert "\n" not in e.value.problem and str(p) in e.value.problem
    assert "not a readable ONNX model" in e.value.problem or "holds no graph nodes" in e.value.problem


def test_corrupt_bytes_are_one_line(tmp_path):
    p = tmp_path / "junk.onnx"
    p.write_bytes(b"\x0f\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01junk")
    with pytest.raises(QdqError) as e:
        io.load(p)
    assert "not a readable ONNX model" in e.value.problem and "\n" not in e.value.problem


def test_repeated_raw_data_last_wins(tmp_path):
    """Protobuf reads the last of a repeated bytes field; the reader too."""
    m = _model()
    t = m.graph.initializer[0]                                   # w, 16 KB
    first = np.ones((64, 64), np.float32).tobytes()
    tensor = t.SerializeToString()
    extra = wire.encode_varint((9 << 3) | 2) + wire.encode_varint(len(first)) + first
    # the tensor with a raw_data field before the one it holds: the later one wins
    doubled = onnx.TensorProto.FromString(extra + tensor)
    assert doubled.raw_data == t.raw_data
    m.graph.initializer[0].CopyFrom(doubled)
    data = m.SerializeToString()
    p = tmp_path / "m.onnx"
    p.write_bytes(data)
    _, arrays = io.read_weights_apart(p)
    np.testing.assert_array_equal(arrays["w"], numpy_helper.to_array(t))


def _every_kind_of_field() -> onnx.ModelProto:
    """A model with fields on both sides of ModelProto.graph (7) and GraphProto.initializer (5):
    producer name and IR version before, opsets, metadata and functions after; node and name before,
    doc string, value_info and metadata after; large and small initializers, an external one."""
    m = motifs.attention_block()
    m.producer_name, m.doc_string = "test", "a doc string"
    m.metadata_props.add(key="k", value="v")
    m.graph.doc_string = "graph doc"
    m.graph.value_info.add().name = "a_value"
    m.graph.metadata_props.add(key="gk", value="gv")
    m.functions.add(name="f", domain="local")
    big = onnx.numpy_helper.from_array(np.arange(50_000, dtype=np.float32), "big_unused")
    m.graph.initializer.append(big)
    far = onnx.numpy_helper.from_array(np.zeros(3, np.float32), "far")
    far.ClearField("raw_data")
    far.data_location = onnx.TensorProto.EXTERNAL
    far.external_data.add(key="location", value="elsewhere.bin")
    m.graph.initializer.append(far)
    return m


@pytest.mark.parametrize("make", [_every_kind_of_field, motifs.residual_add, motifs.se_block, onnx.ModelProto,
                                  lambda: onnx.helper.make_model(onnx.helper.make_graph([], "empty", [], []))])
def test_a_model_is_written_an_initializer_at_a_time_as_protobuf_serializes_it(make, tmp_path):
    """wire.write_model writes the bytes SerializeToString makes (protobuf serialized a 1.6 GB model
    in one piece at 0.12 GB/s), and io.save writes a model so (not the one naming external data that
    is not there: every model the suite saves is checked and built in CI)."""
    import io as bytes_io
    m = make()
    out = bytes_io.BytesIO()
    wire.write_model(m, out)
    assert out.getvalue() == m.SerializeToString()
    if make in (motifs.residual_add, motifs.se_block):
        path = tmp_path / "m.onnx"
        io.save(m, path)
        assert path.read_bytes() == m.SerializeToString()


def test_a_field_this_protobuf_does_not_know_is_written_too():
    """A field unknown to the installed onnx (a newer schema's) in the model or in its graph would not
    be among the parts write_model serializes: such a model is written whole, the field with it."""
    import io as bytes_io
    base = motifs.residual_add().SerializeToString()
    unknown = wire.encode_varint(1000 << 3) + wire.encode_varint(5)       # field 1000, a varint
    in_model = onnx.ModelProto.FromString(base + unknown)
    graph = onnx.ModelProto.FromString(base)
    in_graph = onnx.ModelProto()
    in_graph.CopyFrom(graph)
    in_graph.graph.ParseFromString(graph.graph.SerializeToString() + unknown)
    for m in (in_model, in_graph):
        out = bytes_io.BytesIO()
        wire.write_model(m, out)
        assert out.getvalue() == m.SerializeToString() and unknown in out.getvalue()
