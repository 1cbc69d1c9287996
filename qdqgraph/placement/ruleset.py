"""Placement rules: rules/placement.toml (and users' --rules files) read into frozen dataclasses.

Files are read and checked by the shared loader (qdqgraph.rulebook.loader: known keys, their types,
id/doc/ref, override by id, file:line in every error); what is placement's own is checked here:
op classes, conditions and the captures they set, path steps, quantize targets.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ..graph import proto
from ..precisions.registry import precision as precision_record
from ..ops import Vocabulary, vocabulary
from ..rulebook.files import bundled
from ..rulebook.loader import Table, TableSpec, check_value, load_tables
from .conditions import CONDITIONS


@dataclass(frozen=True)
class Target:
    """One input edge (or a set of them) that a rule quantizes."""

    input: int | str           # index, "$capture" or "all"
    kind: str                  # "activation" or "weight"
    axis: int | None = None    # weights: output-channel axis; None = per-tensor
    share_scale: str | None = None  # "output": one scale with the node's output (Concat)
    amax: float | None = None  # a fixed range (a Softmax's probabilities: 1.0), not calibrated


@dataclass(frozen=True)
class Rule:
    id: str
    doc: str
    ref: str
    source: str
    op: str | None = None                  # op class or "any"
    path: tuple[str, ...] = ()             # exclusion by op chain
    when: tuple[str, ...] = ()
    quantize: tuple[Target, ...] = ()
    stage: int = 1
    advisory: bool = False
    is_exclusion: bool = False
    line: int = 0

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line} rule {self.id}"


@dataclass(frozen=True)
class RegionRule:
    """A [[region]]: INT8 regions that hold at most `max_flops_share` of the FLOPs and are entered
    or left through a standalone reformat inside the network go back to float (0 turns it off)."""
    id: str
    doc: str
    ref: str
    source: str
    max_flops_share: float


@dataclass(frozen=True)
class RuleSet:
    exclusions: tuple[Rule, ...]
    rules: tuple[Rule, ...]
    by_id: dict = field(default_factory=dict, compare=False)
    region: RegionRule | None = None      # the [[region]] rule in force (a user file's first)
    target: str = "tensorrt"              # the compiler the plan is for (its simulator rules judge P14)
    precision: str = "int8"               # the precision it places (P14's reasons name it)

    def stage(self, n: int) -> tuple[Rule, ...]:
        return tuple(r for r in self.rules if r.stage == n)


SPECS = {
    "exclude": TableSpec({"op": "str", "path": "str_list", "when": "str_list", "advisory": "bool"}),
    "rule": TableSpec({"op": "str", "when": "str_list", "quantize": "table_list", "stage": "int"},
                      required=("id", "doc", "ref", "op", "quantize")),
    "region": TableSpec({"max_flops_share": "number"}, required=("id", "doc", "ref", "max_flops_share")),
}
_TARGET_KEYS = {"input": "int_or_str", "kind": "str", "axis": "int_or_str", "share_scale": "str", "amax": "number"}
_STEP = re.compile(r"^[A-Za-z][A-Za-z0-9]*(\|[A-Za-z][A-Za-z0-9]*)*\??$")


@lru_cache(maxsize=None)
def max_inputs(vocab: Vocabulary, cls: str) -> int | None:
    """The most inputs any op of class `cls` takes, by the ONNX schemas (None if unknown)."""
    best = None
    for op in vocab.ops_of(cls):
        n = proto.max_inputs(op)
        if n is None:
            return None
        best = n if best is None else max(best, n)
    return best


def _target(t: dict, rule: Table, vocab: Vocabulary, op: str) -> Target:
    where = rule.where
    unknown = sorted(set(t) - set(_TARGET_KEYS))
    if unknown:
        raise rule.error(f"unknown key(s) {unknown} in quantize", f"use {sorted(_TARGET_KEYS)}")
    for key, value in t.items():
        check_value(f"{where} quantize", key, value, _TARGET_KEYS[key])
    inp = t.get("input")
    if not (isinstance(inp, int) or inp == "all" or (isinstance(inp, str) and inp.startswith("$"))):
        raise rule.error(f"quantize input must be an index, \"all\" or a \"$capture\", not {inp!r}", "fix the rule")
    if isinstance(inp, int):
        most = max_inputs(vocab, op)
        if inp < 0 or (most is not None and inp >= most):
            raise rule.error(f"quantize input {inp}: ops of class {op!r} take inputs 0 to {(most or 1) - 1}",
                             "fix the rule's quantize input (inputs count from 0)")
    kind = t.get("kind", "activation")
    if kind not in ("activation", "weight"):
        raise rule.error(f"quantize kind must be \"activation\" or \"weight\", not {kind!r}", "fix the rule")
    axis = t.get("axis", "tensor")
    if kind == "weight" and not (axis == "tensor" or isinstance(axis, int)):
        raise rule.error("weight axis must be an integer or \"tensor\"", "fix the rule")
    share = t.get("share_scale")
    if share not in (None, "output"):
        raise rule.error("share_scale can only be \"output\"", "fix the rule")
    amax = t.get("amax")
    if amax is not None and (kind != "activation" or not amax > 0 or amax != amax or amax == float("inf")):
        raise rule.error(f"amax {amax!r}: a fixed range is a finite number > 0, on an activation", "fix the rule")
    return Target(inp, kind, None if axis == "tensor" or kind != "weight" else axis, share,
                  None if amax is None else float(amax))


def _rule(t: Table, vocab: Vocabulary) -> Rule:
    b = t.body
    op, path = b.get("op"), tuple(b.get("path", ()))
    if t.kind == "exclude" and bool(op) == bool(path):
        raise t.error("an [[exclude]] needs exactly one of op or path", "fix the rule")
    if t.kind == "rule" and op == "any":
        raise t.error("a [[rule]] needs an op class (\"any\" is for [[exclude]] only)",
                      "name the op class it quantizes (rules/op_classes.toml)")
    if op and op != "any" and not vocab.known(op):
        raise t.error(f"unknown op class {op!r}", "op classes are in rules/op_classes.toml")
    for step in path:
        if not _STEP.match(step):
            raise t.error(f"bad path step {step!r}", "write OpType, A|B, or a trailing ? for optional")
    when = tuple(b.get("when", ()))
    captures = CONDITIONS.check(when, t.where)
    # only a [[rule]] quantizes, and a [[rule]] names its op class (a required key)
    targets = tuple(_target(x, t, vocab, op) for x in b.get("quantize", ())) if op is not None else ()
    if t.kind == "rule" and not targets:
        raise t.error("a [[rule]] must quantize something", "add quantize = [...]")
    for x in targets:
        if isinstance(x.input, str) and x.input.startswith("$") and x.input[1:] not in captures:
            raise t.error(f"capture {x.input} is not set by any of its conditions",
                          f"captures available: {sorted(captures) or 'none'}")
    stage = b.get("stage", 1)
    if stage not in (1, 2):
        raise t.error("stage must be 1 or 2", "fix the rule")
    return Rule(id=t.id, doc=t.doc, ref=t.ref, source=t.source, op=op, path=path, when=when, quantize=targets,
                stage=stage, advisory=bool(b.get("advisory", False)), is_exclusion=t.kind == "exclude", line=t.line)


def _region(t: Table) -> RegionRule:
    share = t.body["max_flops_share"]
    if not 0.0 <= share <= 1.0:
        raise t.error(f"max_flops_share must be a number in [0, 1], not {share!r}",
                      "write e.g. max_flops_share = 0.005 (0 turns the rule off)")
    return RegionRule(t.id, t.doc, t.ref, t.source, float(share))


TARGET_FILES = {"tensorrt-rtx": "placement_tensorrt_rtx.toml"}  # where a compiler's placement differs


def load_ruleset(extra: list[str | Path] | tuple = (), precision: str = "int8", target: str = "tensorrt") -> RuleSet:
    """The bundled rules plus users' files; a user rule replaces a bundled one with the same id and
    otherwise comes first. A precision's own file (rules/fp8.toml, int4.toml) and a target's own
    (rules/placement_tensorrt_rtx.toml) are read between the two, as a user's file would be: their
    tables replace the placement tables of the same id."""
    vocab = vocabulary()
    own = precision_record(precision).placement            # where a precision's placement differs from INT8's
    layer = [bundled(own)] if own else []
    layer += [bundled(TARGET_FILES[target])] if target in TARGET_FILES else []
    tables = load_tables([Path(p) for p in extra] + layer + [bundled("placement.toml")], SPECS, bundled=1)
    rules = [_rule(t, vocab) for t in tables if t.kind != "region"]
    regions = [_region(t) for t in tables if t.kind == "region"]
    return RuleSet(exclusions=tuple(r for r in rules if r.is_exclusion),
                   rules=tuple(r for r in rules if not r.is_exclusion),
                   by_id={r.id: r for r in rules}, region=regions[0] if regions else None, target=target,
                   precision=precision)
