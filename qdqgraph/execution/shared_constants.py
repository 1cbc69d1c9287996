"""Equal small constants merged into one initializer, in a session's own copy of a large graph.

A written Q/DQ model gives every QuantizeLinear and DequantizeLinear a zero point of its own (and
every Clip its bounds): the 10,000-node CNN's written model holds 24,003 initializers, 11,000 of
them repeats of a few values. onnxruntime spends about 0.1 ms per initializer opening a session:
--verify's session on that model opened in 4.7-4.9 CPU s, 3.9 with the repeats merged (merging
included; docs/SCALE.md, 2026-11-29). Readers of an equal constant read the same values either way,
so the session computes the same outputs bit for bit. The written model keeps its initializers
as they are.
"""
from __future__ import annotations

from ..graph import io, proto

# A constant of at most this many bytes is compared with the others (a per-channel zero point of
# 64 INT8 channels; a scalar): larger ones are weights, rarely equal, and costly to compare.
SHARE_MAX_BYTES = 64


def share_equal_constants(model: proto.ModelProto) -> int:
    """Merge `model`'s equal small initializers (same type, shape and bytes; at most
    SHARE_MAX_BYTES, held in the proto) into the first of each kind, in place; returns how many
    were dropped. A graph with subgraphs (whose bodies may read an outer name), and initializers that
    are also graph inputs or outputs, are left as they are."""
    g = model.graph
    if next(iter(io.subgraphs(g)), None) is not None:
        return 0
    fixed = {v.name for v in g.input} | {v.name for v in g.output}
    first: dict[tuple, str] = {}
    renamed: dict[str, str] = {}
    for t in g.initializer:
        if t.name in fixed or proto.is_external(t) or io.declared_bytes(t) > SHARE_MAX_BYTES:
            continue
        raw = t.raw_data
        key = (t.data_type, tuple(t.dims), raw) if raw else \
            (t.data_type, tuple(t.dims), tuple(t.int32_data), tuple(t.int64_data), tuple(t.float_data),
             tuple(t.double_data), tuple(t.uint64_data), tuple(t.string_data))
        kept = first.setdefault(key, t.name)
        if kept != t.name:
            renamed[t.name] = kept
    if not renamed:
        return 0
    for node in g.node:
        for k, name in enumerate(node.input):
            if name in renamed:
                node.input[k] = renamed[name]
    kept_inits = [t for t in g.initializer if t.name not in renamed]
    del g.initializer[:]
    g.initializer.extend(kept_inits)
    infos = [v for v in g.value_info if v.name not in renamed]
    if len(infos) < len(g.value_info):
        del g.value_info[:]
        g.value_info.extend(infos)
    return len(renamed)
