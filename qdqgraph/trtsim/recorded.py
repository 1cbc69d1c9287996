"""The prediction `insert` records in the model it writes, for `qdqgraph report` to print without
loading and simulating the graph again.

`insert` has already simulated the written graph (its summary and speed line) when it writes the
model, so it keeps what `report` prints (the layer table, the linter's findings, the JSON report) in
the model's metadata under KEY, with a digest of what the simulation read: the graph, the opset
imports and local functions. `report` trusts the record only when that digest, the target, the
qdqgraph version and the bundled rule files (a digest of their bytes) still match; a model edited since (by hand, by another tool, by `qdqgraph fix`,
which keeps the metadata) is simulated again. The record is JSON, xz-compressed (preset 1: 1% of
the file on a 10,000-node CNN, 0.06 s), in base64.
"""
from __future__ import annotations

import base64
import hashlib
import json
import lzma
from dataclasses import dataclass
from functools import lru_cache

from ..rulebook.files import bundled_dir
from ..version import __version__
from .rules import rule_files

KEY = "qdqgraph.prediction"
# the values of the graph's symbolic dimensions the prediction was made at (io.bound_dims: the
# calibration data's shapes), JSON; `report` simulates again at them
DIMS_KEY = "qdqgraph.dims"
FORMAT = 1
MAX_GRAPH_BYTES = 1 << 30          # a larger graph is not serialized again for its digest


@dataclass
class Recorded:
    """What `report` prints for the model: the table, the linter's lines, the JSON report (None
    where `recorded` was not asked for it)."""
    table: str
    lint: list[str]
    report: dict | None


def digest(model) -> str | None:
    """sha256 of what the simulation reads from `model` (a ModelProto): its graph, opset imports
    and local functions, hashed field by field and element by element (a serialized copy of the
    whole graph would hold the weights twice: +453 MB on a 453 MB encoder). None for a graph too
    large to record (over MAX_GRAPH_BYTES serialized).

    The graph's size is summed from the fields' serialized bytes the hash reads anyway (`_graph_size`),
    not asked of protobuf: GraphProto.ByteSize() serializes the whole graph once more (upb), 0.11 to
    0.26 s of MiniLM-L6's insert for its 35 MB written model against 0.02 s for its initializers."""
    graph = model.graph
    if sum(len(t.raw_data) for t in graph.initializer) > MAX_GRAPH_BYTES:    # a lower bound of the size
        return None
    h = hashlib.sha256()
    sizes: list[int | None] = []
    for field, value in graph.ListFields():
        h.update(field.name.encode())
        repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED
        items = value if repeated else [value]
        tag = _varint_size(field.number << 3)
        if field.message_type is not None:      # one update for the field's messages: the same bytes, faster
            parts = [item.SerializeToString() for item in items]
            sizes += [tag + _varint_size(len(b)) + len(b) for b in parts]
            h.update(b"".join(parts))
        else:
            for item in items:
                text = str(item).encode()
                h.update(text)
                sizes.append(tag + _varint_size(len(text)) + len(text) if isinstance(item, str) else None)
    if _graph_size(graph, sizes) > MAX_GRAPH_BYTES:
        return None
    for part in (*model.opset_import, *model.functions):
        h.update(part.SerializeToString())
    return h.hexdigest()


def _graph_size(graph, sizes: list[int | None]) -> int:
    """graph.ByteSize() from the encoded sizes of its set fields (None: a field not summed here),
    asked of protobuf where a field is not summed or the graph holds fields this onnx does not know."""
    try:
        from google.protobuf.unknown_fields import UnknownFieldSet  # type: ignore[import-untyped]
        unknown = len(UnknownFieldSet(graph))
    except Exception:  # noqa: BLE001 - an older protobuf: ask it
        unknown = 1
    if unknown or any(s is None for s in sizes):
        return graph.ByteSize()
    return sum(s for s in sizes if s is not None)


def _varint_size(n: int) -> int:
    """Bytes of `n` (>= 0) as a protobuf varint."""
    return max(1, (n.bit_length() + 6) // 7)


@lru_cache(maxsize=4)
def rules_digest(target: str) -> str:
    """sha256 of the bundled rule files a prediction for `target` reads: the simulator's, and the
    top-level ones (op classes; placement's P14 rule, the linter's region check)."""
    h = hashlib.sha256()
    top = sorted((f for f in bundled_dir().iterdir() if f.name.endswith(".toml")), key=lambda f: f.name)
    for f in [*rule_files(target), *top]:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def record(model, sim, diagnostics, target: str, dims: dict[str, int] | None = None) -> bool:
    """Keep `sim` (a SimReport of `model`'s graph) and the linter's `diagnostics` in `model`'s
    metadata (in place, replacing an earlier record), and `dims`, the symbolic dimensions' values
    it was simulated at (DIMS_KEY; kept also when the graph is too large for a digest). False, and
    no prediction recorded, when the graph is too large for a digest."""
    forget(model)
    if dims:
        entry = model.metadata_props.add()
        entry.key, entry.value = DIMS_KEY, json.dumps(dims, sort_keys=True, separators=(",", ":"))
    graph_digest = digest(model)
    if graph_digest is None:
        return False
    doc = {"format": FORMAT, "version": __version__, "rules": rules_digest(target), "target": target,
           "digest": graph_digest,
           "table": sim.table(), "lint": [str(d) for d in diagnostics], "report": sim.to_dict()}
    value = base64.b64encode(lzma.compress(json.dumps(doc, separators=(",", ":")).encode(), preset=1)).decode()
    entry = model.metadata_props.add()
    entry.key, entry.value = KEY, value
    return True


def forget(model) -> None:
    """Remove the record (and the dimensions it was made at) from `model`'s metadata (in place)."""
    kept = [(p.key, p.value) for p in model.metadata_props if p.key not in (KEY, DIMS_KEY)]
    if len(kept) != len(model.metadata_props):
        del model.metadata_props[:]
        for k, v in kept:
            entry = model.metadata_props.add()
            entry.key, entry.value = k, v


def dims_of(model) -> dict[str, int]:
    """The symbolic dimensions' values `model`'s prediction was made at (DIMS_KEY), or {}: `model` a
    ModelProto, or a qdqgraph Loaded (its metadata read into a dict)."""
    props = model.metadata_props
    value = props.get(DIMS_KEY) if isinstance(props, dict) else next((p.value for p in props if p.key == DIMS_KEY), None)
    try:
        doc = json.loads(value) if value is not None else {}
    except ValueError:
        return {}
    return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, int) and v > 0} \
        if isinstance(doc, dict) else {}


# the JSON report, the record's last key (`record` writes it so): what precedes it is the rest
_REPORT_KEY = b',"report":'


def recorded(model, target: str, report: bool = True) -> Recorded | None:
    """The record in `model`'s metadata when it still describes the model for `target`: same
    graph (digest), same target, same qdqgraph version and bundled rules. None otherwise (no record, an unreadable
    one, or a model changed since it was written). `report=False`: without the JSON report, which
    is then not parsed (nine tenths of the record: 0.1 s on a 10,000-node CNN)."""
    value = next((p.value for p in model.metadata_props if p.key == KEY), None)
    if value is None:
        return None
    try:
        doc = _parse(lzma.decompress(base64.b64decode(value, validate=True)), report)
    except (ValueError, lzma.LZMAError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != __version__ \
            or doc.get("target") != target or doc.get("rules") != rules_digest(target):
        return None
    if doc.get("digest") != digest(model):
        return None
    try:
        return Recorded(table=str(doc["table"]), lint=[str(x) for x in doc["lint"]],
                        report=dict(doc["report"]) if report else None)
    except (KeyError, TypeError, ValueError):
        return None


def _parse(text: bytes, report: bool):
    """The record's JSON document; without `report`, its keys before the JSON report alone. In the
    compact JSON `record` writes, the first `,"report":` is that key: the values before it are
    strings (a quote inside one is escaped), numbers and a list of strings, where no key follows a
    comma. Any other text is parsed whole."""
    cut = -1 if report else text.find(_REPORT_KEY)
    if cut > 0:
        try:
            return json.loads(text[:cut] + b"}")
        except ValueError:
            pass
    return json.loads(text)
