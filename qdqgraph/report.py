"""What an `insert` run did, as data (JSON) and as the summary the CLI prints.

The report is built from what the stages hand it: every pass's PassResult (in `passes`), the
plan's decisions and sites, the calibration's sample count, the fallback, the simulator's summary,
and the seconds each stage took (`stages`). The summary's numbers are read from those.
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, is_dataclass

from .precisions.formats import DEFAULT_PRECISION, OPSETS, label
from .passes.base import PassResult
from .passes.registry import DESCRIPTIONS, SummaryContext, report_fields
from .execution.profile import Profile
from .placement.plan import Plan


class RunLog:
    """What a run's report keeps of its stages: the seconds each took (`stages`), the passes'
    results (`passes`) and their warnings (`warnings`); the report dataclasses declare the fields."""

    # declared here for the type checker only (RunLog is no dataclass: the subclasses' fields stand)
    stages: dict[str, float]
    passes: list[PassResult]
    warnings: list[str]

    @property
    def profile(self) -> Profile:
        """Seconds and memory per stage and per step inside one (qdqgraph.execution.profile)."""
        found = self.__dict__.get("_profile")
        if found is None:
            found = self.__dict__["_profile"] = Profile()
        return found

    @contextmanager
    def stage(self, name: str):
        """Time a stage (a stage run twice adds up), and profile it: its seconds and memory, and
        those of the steps inside it (qdqgraph.execution.profile.step)."""
        path = self.profile.path(name)
        before = self.profile.rows.get(path, {}).get("seconds", 0.0)
        try:
            with self.profile.stage(name):
                yield
        finally:                                 # one clock: the stage's seconds are its profile row's
            self.stages[name] = self.stages.get(name, 0.0) + self.profile.rows[path]["seconds"] - before

    def add(self, results: list[PassResult]) -> None:
        for r in results:
            self.passes.append(r)
            self.warnings.extend(r.warnings)


@dataclass
class InsertReport(RunLog):
    input: str | None = None
    output: str | None = None
    config: dict = field(default_factory=dict)
    method: str = "percentile"
    samples: int = 0
    calibration_seconds: float = 0.0
    opset_raised_from: int | None = None
    repairs: list[str] = field(default_factory=list)          # what loading repaired (io.Loaded.repairs)
    passes: list[PassResult] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)    # seconds per stage, in run order
    activation_sites: int = 0
    weight_sites: int = 0
    ops: dict[str, dict[str, int]] = field(default_factory=dict)
    skipped: list[dict] = field(default_factory=list)
    sites: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)            # why little or nothing was quantized
    fallback: dict | None = None
    attention: dict | None = None     # --int8-attention: what was measured and decided
    depthwise: dict | None = None     # --depthwise-check: what was measured and decided
    fidelity: dict | None = None      # measured decisions: bias correction (auto), fragile heads, --sqnr-floor
    int4: dict | None = None          # --precision int4: weights, bytes before and after
    tensorrt: dict | None = None      # the simulator's summary of the written model

    # ------------------------------------------------------------------ filled by the stages

    def fill_from_plan(self, plan: Plan, amax: dict[str, float] | None = None) -> None:
        counts: dict[str, Counter] = defaultdict(Counter)
        self.skipped = []
        for d in plan.decisions.values():
            counts[d.op]["quantized" if d.quantized else "skipped"] += 1
            if not d.quantized:
                self.skipped.append({"node": d.node, "op": d.op, "rule": d.rule, "reason": d.reason})
        self.ops = {op: {"quantized": c["quantized"], "skipped": c["skipped"]} for op, c in sorted(counts.items())}
        self.activation_sites = len(plan.activation_sites())
        self.weight_sites = len(plan.weight_sites())
        self.sites = []
        for s in sorted(plan.sites.values(), key=lambda s: s.tensor):
            entry: dict[str, object] = {"tensor": s.tensor, "kind": s.kind, "rule": s.rule,
                                        "consumers": [e[0] for e in s.edges]}
            if s.kind == "weight":
                entry["axis"] = s.axis
            elif amax is not None:
                entry["amax"] = amax.get(s.group or s.tensor)
                if s.group and s.group != s.tensor:
                    entry["shares_scale_with"] = s.group
            self.sites.append(entry)
        self.warnings.extend(plan.notes)

    # ------------------------------------------------------------------ read from the passes

    def __getattr__(self, name: str):
        """A field a pass adds to the report (passes.registry.describe), read from the passes' results:
        report.batchnorm_folded, report.precision, ..."""
        fields = report_fields()
        if name.startswith("__") or name not in fields:
            raise AttributeError(name)
        return fields[name](self._results(name))

    def _results(self, field_name: str) -> list[PassResult]:
        owner = next(n for n, d in DESCRIPTIONS.items() if field_name in d.fields)
        return [p for p in self.passes if p.name == owner]

    # ------------------------------------------------------------------ output

    def to_dict(self) -> dict:
        """`dataclasses.asdict(self)` (containers copied, dataclasses as dicts), then the passes, stages
        and profile as their own to_dict; the fields copied by `_copied`, not by asdict's generic walk
        (its deepcopy of every string and number costs 1 s on a report of 10,000 nodes)."""
        out = {f.name: (None if f.name == "passes" else _copied(getattr(self, f.name))) for f in fields(self)}
        out["passes"] = [p.to_dict() for p in self.passes]
        out["stages"] = {k: round(v, 4) for k, v in self.stages.items()}
        out["profile"] = self.profile.to_dict()
        for name in report_fields():
            out[name] = getattr(self, name)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=_jsonable)

    def summary(self, max_examples: int = 3, warnings: bool = True) -> str:
        """The lines the CLI prints; `warnings=False` leaves the warnings out (the CLI writes them
        to stderr). The report's own sections and the passes' (passes.registry.describe) in the
        order of their positions; the cleaning passes share one line."""
        precision = (self.config or {}).get("precision", DEFAULT_PRECISION)
        ctx = SummaryContext(label(precision), precision, max_examples)
        sections: list[tuple[int, list[str]]] = [
            (0, [f"repaired: {r}" for r in self.repairs]), (5, self._opset_lines(precision)),
            (40, self._calibration_lines()), (45, self._placement_lines()), (64, self._depthwise_lines(ctx)),
            (65, self._attention_lines(ctx)),
            (80, self._op_lines(ctx)), (100, self._prediction_lines(ctx)), (110, self._fallback_lines(ctx)),
            (115, _fidelity_lines(self.fidelity, ctx.label)), (120, [f"note: {n}" for n in self.notes])]
        sections += self._pass_sections(ctx)
        lines = [line for _, part in sorted(sections, key=lambda s: s[0]) for line in part]
        lines += [f"warning: {w}" for w in (dict.fromkeys(self.warnings) if warnings else ())]
        if self.output:
            lines.append(f"wrote {self.output}")
        return "\n".join(lines)

    def _pass_sections(self, ctx: SummaryContext) -> list[tuple[int, list[str]]]:
        """Each pass's lines at its position; the phrases of the cleaning passes, in run order, as the
        one "cleaned:" line (with the lines under it) at theirs."""
        by_name: dict[str, list[PassResult]] = {}
        for r in self.passes:
            by_name.setdefault(r.name, []).append(r)
        out: list[tuple[int, list[str]]] = []
        phrases, under, clean_order = [], [], None
        for name, results in by_name.items():
            d = DESCRIPTIONS.get(name)
            if d is None:
                continue
            if d.lines is not None:
                out.append((d.order, d.lines(results, ctx)))
            if d.phrase is not None:
                phrase, more = d.phrase(results, ctx)
                phrases += [phrase] if phrase else []
                under += more
                clean_order = d.order
        if clean_order is not None:
            out.append((clean_order, [f"cleaned: {', '.join(phrases)}", *under]))
        return out

    def _opset_lines(self, precision: str) -> list[str]:
        if not self.opset_raised_from:
            return []
        to, why = OPSETS[precision]
        return [f"opset raised from {self.opset_raised_from} to {to} ({why} needs it)"]

    def _calibration_lines(self) -> list[str]:
        if not self.samples:
            return []
        return [f"calibrated: {self.method} over {self.samples} samples in {self.calibration_seconds:.1f} s"]

    def _placement_lines(self) -> list[str]:
        if not self.int4:
            return [f"placed: {self.activation_sites} activation Q/DQ, {self.weight_sites} weight DQ"]
        i = self.int4
        return [f"INT4 weights: {i['weights']} MatMul/Gemm weights in blocks of {i['block_size']} "
                f"({i['method']}), {i['bytes_before'] / 2**20:.1f} MiB -> {i['bytes_after'] / 2**20:.1f} MiB; "
                f"activations stay in the float type"]

    def _depthwise_lines(self, ctx: SummaryContext) -> list[str]:
        d, q = self.depthwise, ctx.label
        if not d or "candidates" not in d:
            return []
        worst = sorted(d["candidates"].values())
        head = (f"{len(worst)} depthwise convolution(s) whose own {q} output is under {d['local_db']:g} dB "
                f"({worst[0]:.1f} to {worst[-1]:.1f} dB)")
        measured = (f"outputs {d['all_quantized_db']:.1f} -> {d['floated_db']:.1f} dB with them float on "
                    f"{d['samples']} sample(s), {d['flops_share']:.1f}% of the FLOPs")
        if d["kept_float"]:
            return [f"kept float: {head}: {measured}"]
        why = (f"already over {d['enough_db']:g} dB" if d["all_quantized_db"] >= d.get("enough_db", float("inf"))
               else "too little gain")
        return [f"depthwise check: {head} stay {q}: {measured}, {why}"]

    def _attention_lines(self, ctx: SummaryContext) -> list[str]:
        a, q = self.attention, ctx.label
        if not a or not a.get("gemms"):
            return []
        if "loss_db" in a:
            return [f"attention: {a['gemms']} GEMMs {q if a['int8'] else 'float'}; {q} attention costs "
                    f"{a['loss_db']:.1f} dB output SQNR ({a['all_int8_db']:.1f} dB all {q}, "
                    f"{a['attention_float_db']:.1f} dB with it float; {a['max_loss_db']:g} dB allowed)"]
        return [f"attention: {a['gemms']} GEMMs {q if a['int8'] else 'float'} "
                f"(--int8-attention {a['mode']}{'; ' + a['why'] if a.get('why') else ''})"]

    def _op_lines(self, ctx: SummaryContext) -> list[str]:
        """The op table (quantized and skipped per op type) and the skipped nodes by rule."""
        lines = []
        width = max([len(op) for op in self.ops] + [7])
        if self.ops:
            lines.append(f"  {'op':<{width}}  quantized  skipped")
        for op, c in self.ops.items():
            lines.append(f"  {op:<{width}}  {c['quantized']:>9}  {c['skipped']:>7}")
        by_rule: dict[tuple, list[str]] = defaultdict(list)
        for s in self.skipped:
            by_rule[(s["op"], s["rule"], s["reason"])].append(s["node"])
        if by_rule:
            lines.append("skipped (op, rule: reason):")
        k = ctx.max_examples
        for (op, rule, reason), nodes in sorted(by_rule.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            ex = ", ".join(nodes[:k]) + (f", ... ({len(nodes)} in all)" if len(nodes) > k else "")
            lines.append(f"  {op} {rule}: {reason}  [{ex}]")
        return lines

    def _prediction_lines(self, ctx: SummaryContext) -> list[str]:
        t, q = self.tensorrt, ctx.label
        if not t:
            return []
        compiler = "TensorRT for RTX" if t.get("target") == "tensorrt-rtx" else "TensorRT"
        if self.int4:
            return [f"{compiler} prediction: {t['layers']} layers, {t.get('int4_weight_layers', 0)} GEMMs with INT4 "
                    f"weights (weight-only: they run in the float type of their activations), "
                    f"{t['reformats']} reformats"]
        lines = [f"{compiler} prediction: {t['layers']} layers, {t['int8_layers']} {q}, {t['float_layers']} "
                 f"float, {t['reformats']} reformats ({t['reformats_inside']} inside the network), "
                 f"{q} FLOPs {100 * t['int8_flops_share']:.1f}% (qdqgraph report OUT.onnx for the layers)"]
        lines += _reformat_lines(t.get("inner_reformats", []), ctx.max_examples, q)
        if t.get("speed"):
            lines.append(f"speed: {t['speed']}")
        return lines

    def _fallback_lines(self, ctx: SummaryContext) -> list[str]:
        fb = self.fallback
        if not fb:
            return []
        where = " in the written model" if fb.get("measured") == "written model" else ""
        lines = [f"fallback: output SQNR {fb['all_int8_db']:.1f} dB all {ctx.label} -> {fb['final_db']:.1f} dB{where} "
                 f"with {len(fb['float_nodes'])} node(s) in float (budget {fb['budget_db']} dB, "
                 f"max {fb['max_float_layers']}; {fb['samples']} samples, {fb['seconds']:.1f} s)"]
        for n in fb["float_nodes"]:
            gain = next(r["gain_db"] for r in fb["ranking"] if r["node"] == n)
            lines.append(f"  float: {n} (+{gain:.1f} dB alone)")
        return lines


def _db(v) -> str:
    return f"{v:.1f} dB" if isinstance(v, (int, float)) else f"{v} dB"


def _fidelity_lines(f: dict | None, q: str) -> list[str]:
    """What the measured decisions did (bias correction auto, fragile heads, --sqnr-floor)."""
    if not f or "first" not in f:
        return []
    lines = [f"output SQNR on {f['samples']} calibration samples: {_db(f['first']['overall_db'])}"
             + (f" -> {_db(f['final']['overall_db'])}" if f["final"]["overall_db"] != f["first"]["overall_db"] else "")
             + f" ({f['seconds']:.1f} s measuring)"]
    b = f.get("bias_correction")
    if b:
        lines.append(f"  bias correction {'kept' if b['kept'] else 'dropped'}: {_db(b['with_db'])} with it, "
                     f"{_db(b['without_db'])} without")
    for h in f.get("heads", []):
        if h["kept"]:
            lines.append(f"  kept float: the head of output '{h['output']}' (SQNR {_db(h['before_db'])} -> "
                         f"{_db(h['after_db'])}, {_pct(h['flops_share'])} of FLOPs, {len(h['nodes'])} node(s))")
        else:
            lines.append(f"  output '{h['output']}' is fragile ({_db(h['before_db'])}); keeping its head float "
                         f"gave {_db(h['after_db'])}, so it stays {q}")
    fl = f.get("floor")
    if fl:
        if fl["kept"]:
            lines.append(f"  --sqnr-floor {fl['floor_db']:g}: {len(fl['nodes'])} node(s) back to float, most dB per "
                         f"FLOP first: {_db(fl['before_db'])} -> {_db(fl['after_db'])}, {_pct(fl['flops_share'])} of "
                         f"FLOPs ({q} share kept >= {100 * fl['min_int8_share']:g}%; sweep {fl['sweep_seconds']:.1f} s)")
            if fl.get("stopped"):
                lines.append(f"    not more: {fl['stopped']}")
        else:
            lines.append(f"  --sqnr-floor {fl['floor_db']:g}: {_db(fl['before_db'])} is below it, and "
                         + (fl["why"] if fl.get("why") else
                            f"no node within the FLOPs budget ({q} share kept >= {100 * fl['min_int8_share']:g}%) "
                            f"raised it (sweep {fl['sweep_seconds']:.1f} s)")
                         + (f"; {fl['stopped']}" if fl.get("stopped") else ""))
    return lines


def _pct(share: float) -> str:
    return f"{100 * share:.2g}%" if share < 0.001 else f"{100 * share:.1f}%"


def _reformat_lines(found: list[dict], max_examples: int, quantized: str = "INT8") -> list[str]:
    """The reformats inside the network, grouped by the rule that made them and the op before them,
    with what removing one would cost; `quantized` names the precision (INT8, FP8)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in found:
        groups[(r["rule"], r["after"], r["direction"])].append(r)
    lines = []
    for (rule, after, direction), rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        shares = [r["region_flops_share"] for r in rs]
        names = ", ".join(r["name"] for r in rs[:max_examples]) + (", ..." if len(rs) > max_examples else "")
        cost = (f"removing one floats the {quantized} region behind it ({_pct(min(shares))}-{_pct(max(shares))} "
                f"of FLOPs)" if max(shares) > 0 else f"no {quantized} compute behind it")
        direction = direction.replace("int8", quantized.lower())
        lines.append(f"  {len(rs)} reformat(s) {direction}{' after ' + after if after else ''}, {rule}: "
                     f"{rs[0]['reason']}; {cost}  [{names}]")
    return lines


_ATOMS = frozenset({str, int, float, bool, type(None)})


@dataclass
class _Box:
    value: object


def _copied(value):
    """What `dataclasses.asdict` makes of a field's value: plain dicts, lists and tuples copied,
    immutable atoms as they are; anything else (a dataclass, a subclass of a container, a numpy
    value) through asdict itself."""
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind is dict:
        return {_copied(k): _copied(v) for k, v in value.items()}
    if kind is list:
        return [_copied(v) for v in value]
    if kind is tuple:
        return tuple(_copied(v) for v in value)
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return asdict(_Box(value))["value"]


def _jsonable(value):
    try:
        import numpy as np
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, np.ndarray):
            return value.tolist()
    except ImportError:  # pragma: no cover
        pass
    return str(value)


