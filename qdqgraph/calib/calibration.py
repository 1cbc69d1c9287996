"""Calibration as a step of its own: ranges per scale group from data, from a cache, or from
shards merged; `qdqgraph.calibrate` in the API and `qdqgraph calibrate` on the command line.

    cal = qdqgraph.calibrate("model.onnx", "data.npz", method="entropy")
    cal.save("calib.json")                    # or format="tensorrt", or "state" (mergeable)
    part = qdqgraph.calibrate("model.onnx", "data.npz", shard=(2, 4))   # states of shard 2 of 4
    cal = qdqgraph.merge_calibrations(["s1.json", "s2.json", "s3.json", "s4.json"], method="entropy")
    cal = qdqgraph.calibrate("model.onnx", "data/", method="entropy", ray="local")   # shards as Ray tasks

With `config.ray` (an address, or "local"), the shards run as Ray tasks (qdqgraph.execution.distributed), one
per CPU of the cluster, and their states merge in shard order into the states of one run: the
ranges are those of one process, bit for bit.
"""
from __future__ import annotations

import hashlib
import re
import time
import warnings
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path

from ..graph import proto, io, outputs
from .. import api_checks
from ..execution import distributed
from . import cache as cache_files
from .collect import FloatOutputs, collect, default_lanes, open_ahead
from .opening import Opened
from .methods import compute_amax
from .states import merge_state_files, save_states
from ..config import DEFAULT_PERCENTILE, QuantizeConfig, config_from
from ..samples.data import CalibrationData
from ..errors import QdqError
from ..placement.plan import Plan
from ..prepare import prepare, read_data
from ..execution.progress import stage
from ..execution.runtime import register_custom_ops

FORMATS = ("json", "tensorrt", "state")


@dataclass
class Calibration:
    """The ranges of one calibration: amax per scale group (representative tensor), the groups,
    and, for a shard or on request, the mergeable histogram states."""

    groups: dict[str, list[str]]
    amax: dict[str, float] = field(default_factory=dict)
    states: dict | None = None
    method: str = "percentile"
    samples: int = 0
    seconds: float = 0.0
    model_id: str = ""
    shard: str | None = None
    outputs: FloatOutputs | None = field(default=None, repr=False)   # the graph's outputs on the first samples

    def per_tensor(self) -> dict[str, float]:
        return {t: self.amax[rep] for rep, members in self.groups.items() for t in members if rep in self.amax}

    def save(self, path, format: str = "json", force: bool = True) -> None:
        """Write a qdqgraph JSON cache, a TensorRT calibration cache, or the states (to merge); an
        existing file is replaced only with `force` (qdqgraph.graph.outputs)."""
        if format not in FORMATS:
            raise QdqError(f"unknown calibration format {format!r}", f"use one of {', '.join(FORMATS)}")
        if format == "state":
            if self.states is None:
                raise QdqError("this calibration kept no states to save", "calibrate with keep_states=True or a shard")
            save_states(path, self.states, self.groups, self.samples, self.model_id, shard=self.shard, force=force)
        elif format == "tensorrt":
            algo = "EntropyCalibration2" if self.method == "entropy" else "MinMaxCalibration"
            cache_files.write_tensorrt(path, self.per_tensor(), algo=algo, force=force)
        else:
            cache_files.write_json(path, self.per_tensor(), self.method, self.samples, force=force)


def model_id(model) -> str:
    """sha256 of the model file (or of the ModelProto's bytes): ties saved state to its model."""
    h = hashlib.sha256()
    if proto.is_model(model):
        h.update(model.SerializeToString())
    else:
        with open(model, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def amax_from_states(states: dict, method: str, percentile: float = DEFAULT_PERCENTILE) -> dict[str, float]:
    return {k: float(compute_amax(s, method, percentile=percentile)) for k, s in states.items()}


def exact_ranges(plan: Plan, amax: dict[str, float]) -> dict[str, float]:
    """`amax` with the ranges the graph fixes (a one-hot's 1.0) in place of estimated or cached ones."""
    for rep, members in plan.groups().items():
        exact = [e for t in members if (e := plan.sites[t].exact_amax) is not None]
        if rep in amax and len(exact) == len(members):
            amax[rep] = max(exact)
    return amax


def read_cache(path) -> dict[str, float]:
    """A calibration cache (qdqgraph JSON or TensorRT text, sniffed): tensor -> amax. Any problem
    with the file is a QdqError naming it."""
    p = Path(path)
    if not p.exists():
        raise QdqError(f"calibration cache not found: {p}", "check the --calib-cache path")
    if p.is_dir():
        raise QdqError(f"calibration cache {p} is a folder", "pass the cache file itself")
    outputs.require_regular(p, "calibration cache")
    try:
        return cache_files.load_cache(p)
    except ValueError as e:
        raise QdqError(str(e), "pass a cache written by `qdqgraph calibrate` or a TensorRT calibration cache") from None
    except OSError as e:
        raise QdqError(f"calibration cache {p} cannot be read ({e.strerror or e})", "check its permissions") from None


def ranges_from_cache(plan: Plan, cache, can_calibrate: bool = False) -> tuple[dict[str, float], set[str]]:
    """(amax per scale group found in a cache file or a dict {tensor: amax} (API), the groups it
    lacks). Lacking any is an error unless `can_calibrate` (data was given for them)."""
    if isinstance(cache, dict):
        table = {}
        for name, amax in cache.items():
            try:
                table[name] = cache_files._check_amax(name, amax)
            except ValueError as e:
                raise QdqError(f"calibration ranges: {e}", "give each tensor a finite amax >= 0") from None
    else:
        table = read_cache(cache)
    out, missing = {}, set()
    for rep, members in plan.groups().items():
        found = [table[t] for t in members if t in table]
        if found:
            out[rep] = max(found)
        else:
            missing.add(rep)
    if missing and not can_calibrate:
        first = sorted(missing)[0]
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        where = "the given ranges" if isinstance(cache, dict) else f"calibration cache {cache}"
        raise QdqError(f"{where} has no range for tensor '{first}'{more}",
                       "add --calib DATA to calibrate what the cache lacks, or pass a cache made for this model")
    return exact_ranges(plan, out), missing


def calibrate_plan(loaded: io.Loaded, plan: Plan, data: CalibrationData, config: QuantizeConfig,
                   progress=None, only: set[str] | None = None, keep_states: bool = False,
                   keep_outputs: bool = True, opened: Opened | None = None) -> Calibration:
    """Calibrate the scale groups of `plan` (or those in `only`) on `data`; with `keep_outputs`, keep the
    graph outputs of the first samples (Calibration.outputs), else run only what the groups need.
    `opened`: the session `open_session_ahead` began opening, taken where it is the one needed."""
    config_method = config.method
    assert config_method is not None, "QuantizeConfig fills in the precision's default method"
    groups = plan.groups()
    if only is not None:
        groups = {rep: members for rep, members in groups.items() if rep in only}
    if not groups:
        return Calibration({}, method=config_method)
    stage(progress, "calibrating", data.count)
    method = "entropy" if keep_states else config_method
    providers = list(config.providers) if config.providers else None
    outputs = None
    if config.ray:
        states, samples, seconds = _collect_on_ray(loaded, groups, data, method, config, providers, progress)
    else:
        got = collect(loaded, groups, data, method=method, batch_size=config.batch_size, providers=providers,
                      progress=progress, lanes=config.lanes, outputs=keep_outputs, opened=opened)
        states, samples, seconds, outputs = got.states, got.samples, got.seconds, got.outputs
    amax = {} if keep_states else exact_ranges(plan, amax_from_states(states, config_method, config.percentile))
    return Calibration(groups, amax, states if keep_states else None, config_method, samples, seconds,
                       outputs=outputs)


def open_session_ahead(loaded: io.Loaded, plan: Plan, config: QuantizeConfig) -> Opened | None:
    """The session `calibrate_plan(loaded, plan, ..., config)` opens for all of the plan's groups,
    opening in a thread (calib.opening) where the graph is large; None where it is not, or under Ray."""
    if config.ray:
        return None
    assert config.method is not None, "QuantizeConfig fills in the precision's default method"
    return open_ahead(loaded, plan.groups(), config.method, list(config.providers) if config.providers else None,
                      config.lanes)


def _collect_on_ray(loaded: io.Loaded, groups: dict[str, list[str]], data: CalibrationData, method: str,
                    config: QuantizeConfig, providers, progress) -> tuple[dict, int, float]:
    """collect() over `data` cut into one shard per task slot of the Ray cluster, each shard a
    task (`_shard_states`), the states merged in shard order: the states of one run over all of
    `data` (a shard starts its histograms from the set's first sample, as one run does). The
    shards run with this process's lanes, so a failure names the sample and tensor one process
    would name. Returns (states, samples, seconds)."""
    start = time.perf_counter()
    lanes = config.lanes or default_lanes()

    def shards(slots: int) -> list[tuple[int, int]]:
        n = min(slots, data.count)
        return [(i, n) for i in range(1, n + 1)]
    shared = (distributed.pack(loaded), groups, data, method, config.batch_size, providers, lanes)
    parts = distributed.run(config.ray, _shard_states, shared, shards, progress, what="calibration shard")
    states = {rep: reduce(lambda a, b: a.merge(b), (p[0][rep] for p in parts)) for rep in groups}
    return states, sum(p[1] for p in parts), time.perf_counter() - start


# collect numbers the samples of the data it is given from 0; a shard's are renumbered from the
# start of the whole set, as one process numbers them (the shared first-sample run of a later
# shard is numbered 0 too, but its failure is also the first shard's, which is reported instead)
_SAMPLE = re.compile(r"(calibration sample )(\d+)")


def _shard_states(packed, groups, data: CalibrationData, method: str, batch_size: int, providers, lanes: int,
                  index: int, count: int, progress=None) -> tuple[dict, int]:
    """In a Ray task: the states of shard `index` of `count` of `data`. A folder's files are read
    here, only those of this shard (and the set's first sample); an in-memory set arrives whole
    through the object store and is sliced. Returns (states, samples)."""
    shard = data.shard(index, count)
    offset = shard.first - data.first

    def renumber(m: re.Match) -> str:
        return m.group(1) + str(int(m.group(2)) + offset)
    try:
        got = collect(distributed.unpack(packed), groups, shard, method=method, batch_size=batch_size,
                      providers=providers, progress=progress, lanes=lanes,
                      threads=max(1, distributed.TASK_CPUS // lanes))
    except QdqError as e:
        if offset == 0:
            raise
        raise QdqError(_SAMPLE.sub(renumber, e.problem), e.fix) from None
    return got.states, got.samples


def calibrate(model, calib, *, config: QuantizeConfig | None = None, shard: tuple[int, int] | None = None,
              keep_states: bool = False, progress=None, **options) -> Calibration:
    """Calibrate the tensors `quantize` would quantize with this config, without writing a model.
    `shard=(i, n)` calibrates the i-th of n parts of the samples and keeps its states (to be merged
    with `merge_calibrations`); `keep_states` keeps them for a whole run too. With `ray=ADDRESS`
    (or "local"), the samples are calibrated in shards on Ray, to the same ranges."""
    api_checks.calibrate(model, calib, config, shard)
    cfg = config_from(config, **options)
    with distributed.scope():
        return _calibrate(model, calib, cfg, shard, keep_states, progress)


def _calibrate(model, calib, cfg: QuantizeConfig, shard, keep_states: bool, progress) -> Calibration:
    if calib is None:
        raise QdqError("no calibration data given", "pass --calib DATA.npz")
    for lib in cfg.custom_op_libraries:
        register_custom_ops(lib)
    said: list[str] = []
    loaded, plan = prepare(model, cfg, warnings_to=said)
    for line in said:                    # the command line prints them as `qdqgraph: warning:`
        warnings.warn(line, stacklevel=3)
    data = read_data(loaded, calib, cfg)
    if shard is not None:
        data = data.shard(*shard)
        keep_states = True
    cal = calibrate_plan(loaded, plan, data, cfg, progress, keep_states=keep_states)
    cal.groups = plan.groups()
    cal.model_id = model_id(model)
    cal.shard = f"{shard[0]}/{shard[1]}" if shard else None
    return cal


def merge_calibrations(paths, method: str = "percentile", percentile: float = DEFAULT_PERCENTILE) -> Calibration:
    """Merge the saved states of shards of one calibration into the ranges of one run over all
    their samples (bit for bit what one process gives)."""
    QuantizeConfig(method=method, percentile=percentile)       # checks both
    doc = merge_state_files(list(paths))
    return Calibration(doc["groups"], amax_from_states(doc["states"], method, percentile), doc["states"], method,
                       doc["samples"], model_id=doc["model"])
