"""What an `insert` run did, as data (JSON) and as the summary the CLI prints.

The report is built from what the stages hand it: every pass's PassResult (in `passes`), the
plan's decisions and sites, the calibration's sample count, the fallback, the simulator's summary,
and the seconds each stage took (`stages`). The summary's numbers are read from those.
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from .formats import DEFAULT_PRECISION, OPSETS, label
from .passes.base import PassResult
from .profile import Profile
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
        """Seconds and memory per stage and per step inside one (qdqgraph.profile)."""
        found = self.__dict__.get("_profile")
        if found is None:
            found = self.__dict__["_profile"] = Profile()
        return found

    @contextmanager
    def stage(self, name: str):
        """Time a stage (a stage run twice adds up), and profile it: its seconds and memory, and
        those of the steps inside it (qdqgraph.profile.step)."""
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

    def _passes(self, name: str) -> list[PassResult]:
        return [p for p in self.passes if p.name == name]

    def _last(self, name: str) -> PassResult | None:
        found = self._passes(name)
        return found[-1] if found else None

    @property
    def no_ops_removed(self) -> int:
        return sum(p.count("removed") for p in self._passes("remove_no_ops"))

    @property
    def constants_folded(self) -> int:
        return sum(p.count("folded") for p in self._passes("fold_constants"))

    @property
    def ifs_inlined(self) -> list[str]:
        return [n for p in self._passes("inline_constant_ifs") for n in p["inlined"]]

    @property
    def batchnorm_folded(self) -> int:
        return sum(p.count("folded") for p in self._passes("fold_batchnorm"))

    @property
    def batchnorm_kept(self) -> list[dict]:
        return [{"node": n, "reason": r} for p in self._passes("fold_batchnorm") for n, r in p["kept"]]

    @property
    def fixed_inputs(self) -> dict:
        p = self._last("fix_inputs")
        return dict(p["fixed"]) if p else {}

    @property
    def smoothed(self) -> dict[str, list[str]]:
        p = self._last("smooth")
        return dict(p["smoothed"]) if p else {}

    @property
    def output_aware(self) -> dict | None:
        p = self._last("output_aware")
        return p.details if p else None

    @property
    def learned_rounding(self) -> dict | None:
        p = self._last("learned_rounding")
        return p.details if p else None

    @property
    def bias_corrected(self) -> int:
        p = self._last("bias_correction")
        return p.count("corrected") if p else 0

    @property
    def precision(self) -> dict | None:
        p = self._last("float_islands")
        if p is None:
            return None
        return {"high_precision": p["dtype"], "retyped_tensors": p["retyped"], "casts": p["casts"],
                "dq_copies": p["dq_copies"], "kept_fp32": [{"node": n, "rule": r} for n, r in p["kept"]]}

    # ------------------------------------------------------------------ output

    def to_dict(self) -> dict:
        out = asdict(self)
        out["passes"] = [p.to_dict() for p in self.passes]
        out["stages"] = {k: round(v, 4) for k, v in self.stages.items()}
        out["profile"] = self.profile.to_dict()
        for name in ("no_ops_removed", "constants_folded", "ifs_inlined", "batchnorm_folded", "batchnorm_kept",
                     "fixed_inputs", "smoothed", "bias_corrected", "precision", "output_aware", "int4",
                     "learned_rounding"):
            out[name] = getattr(self, name)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=_jsonable)

    def summary(self, max_examples: int = 3, warnings: bool = True) -> str:
        """The lines the CLI prints; `warnings=False` leaves the warnings out (the CLI writes them
        to stderr)."""
        lines = []
        precision = (self.config or {}).get("precision", DEFAULT_PRECISION)
        q = label(precision)
        for r in self.repairs:
            lines.append(f"repaired: {r}")
        if self.opset_raised_from:
            to, why = OPSETS[precision]
            lines.append(f"opset raised from {self.opset_raised_from} to {to} ({why} needs it)")
        if self.fixed_inputs:
            fixed = ", ".join(f"{k}={v}" for k, v in self.fixed_inputs.items())
            lines.append(f"fixed inputs: {fixed} (the written model no longer has them)")
        inlined = self.ifs_inlined
        if inlined:
            lines.append(f"inlined: {len(inlined)} If node(s) with a constant condition "
                         f"({', '.join(inlined[:max_examples])}{', ...' if len(inlined) > max_examples else ''})")
        removed = f"{self.no_ops_removed} Identity/Dropout removed, " if self.no_ops_removed else ""
        kept = self.batchnorm_kept
        lines.append(f"cleaned: {removed}{self.constants_folded} constant nodes folded, "
                     f"{self.batchnorm_folded} BatchNormalization folded, {len(kept)} kept")
        for bn in kept[:max_examples]:
            lines.append(f"  kept {bn['node']}: {bn['reason']}")
        if self.samples:
            lines.append(f"calibrated: {self.method} over {self.samples} samples in {self.calibration_seconds:.1f} s")
        if self.int4:
            i = self.int4
            lines.append(f"INT4 weights: {i['weights']} MatMul/Gemm weights in blocks of {i['block_size']} "
                         f"({i['method']}), {i['bytes_before'] / 2**20:.1f} MiB -> {i['bytes_after'] / 2**20:.1f} MiB; "
                         f"activations stay in the float type")
        else:
            lines.append(f"placed: {self.activation_sites} activation Q/DQ, {self.weight_sites} weight DQ")
        smoothed = self.smoothed
        if smoothed:
            n_weights = sum(len(v) for v in smoothed.values())
            lines.append(f"smoothing: {len(smoothed)} activations migrate their outliers into {n_weights} weights")
        oa = self.output_aware
        if oa:
            t = oa["tensors"]
            n_smoothed = sum(1 for v in t.values() if v["smoothing"] != "none")
            lines.append(f"output-aware scales: {len(t)} linear-layer inputs, {n_smoothed} smoothed "
                         f"({len(oa['folded'])} folded into a LayerNorm or the producing layer, "
                         f"{len(oa['multiplied'])} by an inserted Mul)")
        a = self.attention
        if a and a.get("gemms"):
            if "loss_db" in a:
                lines.append(f"attention: {a['gemms']} GEMMs {q if a['int8'] else 'float'}; {q} attention costs "
                             f"{a['loss_db']:.1f} dB output SQNR ({a['all_int8_db']:.1f} dB all {q}, "
                             f"{a['attention_float_db']:.1f} dB with it float; {a['max_loss_db']:g} dB allowed)")
            else:
                lines.append(f"attention: {a['gemms']} GEMMs {q if a['int8'] else 'float'} "
                             f"(--int8-attention {a['mode']}{'; ' + a['why'] if a.get('why') else ''})")
        lr = self.learned_rounding
        if lr:
            lines.append(_learned_rounding_line(lr))
        if self.bias_corrected:
            lines.append(f"bias correction: {self.bias_corrected} biases absorb the weight-quantization shift")
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
            for (op, rule, reason), nodes in sorted(by_rule.items(), key=lambda kv: (-len(kv[1]), kv[0])):
                ex = ", ".join(nodes[:max_examples]) + (f", ... ({len(nodes)} in all)" if len(nodes) > max_examples else "")
                lines.append(f"  {op} {rule}: {reason}  [{ex}]")
        p = self.precision
        if p and p["high_precision"] != "fp32":
            hint = ("; in onnxruntime, run it in qdqgraph.session(model) (README, Deployment)"
                    if precision == "fp8" else "")
            lines.append(f"float islands: {p['high_precision']} ({p['retyped_tensors']} tensors retyped, {p['casts']} "
                         f"casts, {len(p['kept_fp32'])} nodes kept fp32){hint}")
        compiler = "TensorRT for RTX" if (self.tensorrt or {}).get("target") == "tensorrt-rtx" else "TensorRT"
        if self.tensorrt and self.int4:
            t = self.tensorrt
            lines.append(f"{compiler} prediction: {t['layers']} layers, {t.get('int4_weight_layers', 0)} GEMMs with INT4 "
                         f"weights (weight-only: they run in the float type of their activations), "
                         f"{t['reformats']} reformats")
        elif self.tensorrt:
            t = self.tensorrt
            lines.append(f"{compiler} prediction: {t['layers']} layers, {t['int8_layers']} {q}, {t['float_layers']} "
                         f"float, {t['reformats']} reformats ({t['reformats_inside']} inside the network), "
                         f"{q} FLOPs {100 * t['int8_flops_share']:.1f}% (qdqgraph report OUT.onnx for the layers)")
            lines += _reformat_lines(t.get("inner_reformats", []), max_examples)
            if t.get("speed"):
                lines.append(f"speed: {t['speed']}")
        if self.fallback:
            fb = self.fallback
            where = " in the written model" if fb.get("measured") == "written model" else ""
            lines.append(f"fallback: output SQNR {fb['all_int8_db']:.1f} dB all {q} -> {fb['final_db']:.1f} dB{where} "
                         f"with {len(fb['float_nodes'])} node(s) in float (budget {fb['budget_db']} dB, "
                         f"max {fb['max_float_layers']}; {fb['samples']} samples, {fb['seconds']:.1f} s)")
            for n in fb["float_nodes"]:
                gain = next(r["gain_db"] for r in fb["ranking"] if r["node"] == n)
                lines.append(f"  float: {n} (+{gain:.1f} dB alone)")
        for n in self.notes:
            lines.append(f"note: {n}")
        for w in (dict.fromkeys(self.warnings) if warnings else ()):
            lines.append(f"warning: {w}")
        if self.output:
            lines.append(f"wrote {self.output}")
        return "\n".join(lines)


def _pct(share: float) -> str:
    return f"{100 * share:.2g}%" if share < 0.001 else f"{100 * share:.1f}%"


def _reformat_lines(found: list[dict], max_examples: int) -> list[str]:
    """The reformats inside the network, grouped by the rule that made them and the op before them,
    with what removing one would cost."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in found:
        groups[(r["rule"], r["after"], r["direction"])].append(r)
    lines = []
    for (rule, after, direction), rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        shares = [r["region_flops_share"] for r in rs]
        names = ", ".join(r["name"] for r in rs[:max_examples]) + (", ..." if len(rs) > max_examples else "")
        cost = (f"removing one floats the INT8 region behind it ({_pct(min(shares))}-{_pct(max(shares))} of FLOPs)"
                if max(shares) > 0 else "no INT8 compute behind it")
        lines.append(f"  {len(rs)} reformat(s) {direction}{' after ' + after if after else ''}, {rule}: "
                     f"{rs[0]['reason']}; {cost}  [{names}]")
    return lines


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


def _learned_rounding_line(lr: dict) -> str:
    """The summary's line on learned rounding: layers, time, and the output SQNR it was judged by."""
    layers = lr.get("layers", [])
    better = sum(1 for x in layers if x["kept"])
    head = (f"learned rounding: {better} of {lr['candidates']} INT8 weights beat nearest rounding on held-out rows "
            f"({lr['rows']} rows a layer, {lr['samples']} samples), {lr['seconds']:.1f} s")
    if "sqnr_before_db" not in lr:
        return head + "; every weight rounded to nearest"
    sqnr = (f"output SQNR on {lr['check_samples']} calibration samples {lr['sqnr_before_db']:.1f} -> "
            f"{lr['sqnr_after_db']:.1f} dB")
    if lr.get("dropped"):
        return f"{head}; not written ({lr['dropped']}; {sqnr}), so every weight is rounded to nearest"
    return f"{head}; {sqnr}"
