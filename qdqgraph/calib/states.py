"""Saved calibration state: histograms per scale group, so that calibration can be split into
shards (processes or machines) and merged later into the state of one run over all the data."""
from __future__ import annotations

import json
from pathlib import Path

from ..version import __version__
from ..graph import io
from ..errors import QdqError
from .histogram import RangeState

FORMAT = "qdqgraph-calib-state"
VERSION = 1


def save_states(path, states: dict[str, RangeState], groups: dict[str, list[str]], samples: int,
                model_id: str, shard: str | None = None, force: bool = True) -> None:
    doc = {"format": FORMAT, "version": VERSION, "tool_version": __version__, "model": model_id,
           "samples": samples, "shard": shard, "groups": groups,
           "states": {rep: st.to_dict() for rep, st in sorted(states.items())}}
    io.write_text_atomic(path, json.dumps(doc) + "\n", force)


def load_states(path) -> dict:
    p = Path(path)
    doc = io.read_json(p, "a calibration state file", "pass files written by `qdqgraph calibrate --shard`")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise QdqError(f"{p} is not a calibration state file", "pass files written by `qdqgraph calibrate --shard`")
    if doc.get("version") != VERSION:
        raise QdqError(f"{p} has state version {doc.get('version')}; this qdqgraph reads {VERSION}",
                       "recalibrate with this version")
    try:
        doc["states"] = {rep: RangeState.from_dict(d) for rep, d in doc["states"].items()}
    except (ValueError, KeyError, AttributeError) as e:
        raise QdqError(f"{p}: bad calibration state ({e})", "recalibrate that shard") from None
    return doc


def _check_shards(paths, docs) -> None:
    """Shard states (written with `--shard I/N`) merge only as a full set: each of 1..N once."""
    labels = [d.get("shard") for d in docs]
    if not any(labels):
        return
    seen: dict[int, object] = {}
    total = None
    for p, label in zip(paths, labels):
        try:
            i, n = (int(x) for x in str(label).split("/"))
        except ValueError:
            raise QdqError(f"{p} holds the states of a whole run, not of a shard",
                           "merge only the files written by `qdqgraph calibrate --shard I/N`") from None
        if total is not None and n != total:
            raise QdqError(f"{p} is shard {label}, the others are of {total}", "merge the shards of one split")
        total = n
        if i in seen:
            raise QdqError(f"shard {i}/{n} is given twice ({seen[i]} and {p})", "pass each shard once")
        seen[i] = p
    assert total is not None, "a label was read: the loop set the total"
    missing = [f"{i}/{total}" for i in range(1, total + 1) if i not in seen]
    if missing:
        raise QdqError(f"shard {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing from the merge",
                       f"pass all {total} shard files")


def merge_state_files(paths) -> dict:
    """Merge shards of one calibration: same model, same scale groups. Returns a loaded doc."""
    docs = [load_states(p) for p in paths]
    first = docs[0]
    _check_shards(paths, docs)
    for p, d in zip(paths[1:], docs[1:]):
        if d["model"] != first["model"]:
            raise QdqError(f"{p} was calibrated on another model than {paths[0]}",
                           "merge only shards of the same model")
        if d["groups"] != first["groups"]:
            raise QdqError(f"{p} has other quantized tensors than {paths[0]} (different rules or options)",
                           "calibrate every shard with the same options")
    merged = dict(first)
    states = dict(first["states"])
    for d in docs[1:]:
        states = {rep: states[rep].merge(d["states"][rep]) for rep in states}
    merged["states"] = states
    merged["samples"] = sum(d["samples"] for d in docs)
    merged["shard"] = None
    return merged
