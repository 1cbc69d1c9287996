"""Placement rules: rules/placement.toml (and users' --rules files) parsed into frozen dataclasses.

Validation happens at load time: an unknown op class, condition, capture or key is an error that
names the file, the line and the rule id.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import QdqError
from ..ops import Vocabulary, vocabulary
from ..rulebook.files import bundled, read_rule_file


@dataclass(frozen=True)
class Target:
    """One input edge (or a set of them) that a rule quantizes."""

    input: int | str           # index, "$capture" or "all"
    kind: str                  # "activation" or "weight"
    axis: int | None = None    # weights: output-channel axis; None = per-tensor
    share_scale: str | None = None  # "output": one scale with the node's output (Concat)


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

    def stage(self, n: int) -> tuple[Rule, ...]:
        return tuple(r for r in self.rules if r.stage == n)


_RULE_KEYS = {"id", "doc", "ref", "op", "when", "quantize", "stage"}
_EXCLUDE_KEYS = {"id", "doc", "ref", "op", "path", "when", "advisory"}
_TARGET_KEYS = {"input", "kind", "axis", "share_scale"}
_REGION_KEYS = {"id", "doc", "ref", "max_flops_share"}
_STEP = re.compile(r"^[A-Za-z][A-Za-z0-9]*(\|[A-Za-z][A-Za-z0-9]*)*\??$")


def _line_of(text: str, rule_id: str) -> int:
    for i, line in enumerate(text.splitlines(), 1):
        if re.search(r'id\s*=\s*"' + re.escape(rule_id) + '"', line):
            return i
    return 0


def _checked_header(body: dict, allowed: set, source: str, text: str, kind: str) -> tuple[str, str]:
    """(id, "file:line kind id") of one table, after checking its id, doc, ref and keys."""
    rid = body.get("id")
    where = f"{source}:{_line_of(text, rid) if rid else 0} {kind} {rid or '(no id)'}"
    if not rid or not body.get("doc") or not body.get("ref"):
        raise QdqError(f"{where}: every rule needs id, doc and ref", "add the missing keys")
    unknown = set(body) - allowed
    if unknown:
        raise QdqError(f"{where}: unknown key(s) {sorted(unknown)}", f"use {sorted(allowed)}")
    return rid, where


def _parse_target(t: dict, where: str) -> Target:
    unknown = set(t) - _TARGET_KEYS
    if unknown:
        raise QdqError(f"{where}: unknown key(s) {sorted(unknown)} in quantize", f"use {sorted(_TARGET_KEYS)}")
    inp = t.get("input")
    if not (isinstance(inp, int) or inp == "all" or (isinstance(inp, str) and inp.startswith("$"))):
        raise QdqError(f"{where}: quantize input must be an index, \"all\" or a \"$capture\", not {inp!r}",
                       "fix the rule")
    kind = t.get("kind", "activation")
    if kind not in ("activation", "weight"):
        raise QdqError(f"{where}: quantize kind must be \"activation\" or \"weight\", not {kind!r}", "fix the rule")
    axis = t.get("axis", "tensor")
    if kind == "weight":
        if not (axis == "tensor" or isinstance(axis, int)):
            raise QdqError(f"{where}: weight axis must be an integer or \"tensor\"", "fix the rule")
    axis = None if axis == "tensor" else axis
    share = t.get("share_scale")
    if share not in (None, "output"):
        raise QdqError(f"{where}: share_scale can only be \"output\"", "fix the rule")
    return Target(inp, kind, axis if kind == "weight" else None, share)


def parse_rules(data: dict, source: str, text: str, vocab: Vocabulary, conditions: dict) -> list[Rule]:
    """Validate one rule file's contents; `conditions` maps condition names to their checkers."""
    if data.get("schema") != 1:
        raise QdqError(f"{source}: expected `schema = 1` at the top", "add it (the rule-file format version)")
    unknown_tables = set(data) - {"schema", "rule", "exclude", "region"}
    if unknown_tables:
        raise QdqError(f"{source}: unknown table(s) {sorted(unknown_tables)}", "use [[rule]], [[exclude]] or [[region]]")
    out = []
    for table, allowed in (("exclude", _EXCLUDE_KEYS), ("rule", _RULE_KEYS)):
        for body in data.get(table, []):
            rid, where = _checked_header(body, allowed, source, text, "rule")
            op = body.get("op")
            path = tuple(body.get("path", ()))
            if table == "rule" and not op:
                raise QdqError(f"{where}: a [[rule]] needs an op class", "add op = \"<class>\"")
            if table == "exclude" and bool(op) == bool(path):
                raise QdqError(f"{where}: an [[exclude]] needs exactly one of op or path", "fix the rule")
            if op and op != "any" and not vocab.known(op):
                raise QdqError(f"{where}: unknown op class {op!r}", "op classes are in rules/op_classes.toml")
            for step in path:
                if not _STEP.match(step):
                    raise QdqError(f"{where}: bad path step {step!r}", "write OpType, A|B, or a trailing ? for optional")
            when = tuple(body.get("when", ()))
            captures = set()
            for cond in when:
                name = cond.removeprefix("not ").split(":", 1)[0]
                if name not in conditions:
                    raise QdqError(f"{where}: unknown condition {name!r}",
                                   f"known conditions: {', '.join(sorted(conditions))}")
                captures |= set(getattr(conditions[name], "captures", ()))
            targets = tuple(_parse_target(t, where) for t in body.get("quantize", ()))
            if table == "rule" and not targets:
                raise QdqError(f"{where}: a [[rule]] must quantize something", "add quantize = [...]")
            for t in targets:
                if isinstance(t.input, str) and t.input.startswith("$") and t.input[1:] not in captures:
                    raise QdqError(f"{where}: capture {t.input} is not set by any of its conditions",
                                   f"captures available: {sorted(captures) or 'none'}")
            stage = body.get("stage", 1)
            if stage not in (1, 2):
                raise QdqError(f"{where}: stage must be 1 or 2", "fix the rule")
            out.append(Rule(id=rid, doc=body["doc"], ref=body["ref"], source=source, op=op, path=path,
                            when=when, quantize=targets, stage=stage,
                            advisory=bool(body.get("advisory", False)), is_exclusion=(table == "exclude")))
    return out


def parse_regions(data: dict, source: str, text: str) -> list[RegionRule]:
    """The [[region]] tables of one rule file, validated."""
    out = []
    for body in data.get("region", []):
        rid, where = _checked_header(body, _REGION_KEYS, source, text, "region")
        share = body.get("max_flops_share")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            raise QdqError(f"{where}: max_flops_share must be a number in [0, 1], not {share!r}",
                           "write e.g. max_flops_share = 0.005 (0 turns the rule off)")
        out.append(RegionRule(rid, body["doc"], body["ref"], source, float(share)))
    return out


def load_ruleset(extra: list[str | Path] | tuple = (), conditions: dict | None = None) -> RuleSet:
    """The bundled rules plus users' files; a user rule replaces a bundled one with the same id and
    otherwise comes first."""
    if conditions is None:
        from .planner import CONDITIONS
        conditions = CONDITIONS
    vocab = vocabulary()
    bundled_path = bundled("placement.toml")
    files = [Path(p) for p in extra] + [bundled_path]
    seen: dict[str, Rule] = {}
    ordered: list[Rule] = []
    regions: list[RegionRule] = []
    for f in files:
        rf = read_rule_file(f)
        data, text = rf.data, rf.text
        regions += [r for r in parse_regions(data, rf.source, text) if r.id not in {x.id for x in regions}]
        for r in parse_rules(data, rf.source, text, vocab, conditions):
            if r.id in seen:
                if seen[r.id].source == r.source:
                    raise QdqError(f"{f}:{_line_of(text, r.id)}: rule id {r.id} appears twice", "give each rule its own id")
                continue  # overridden by a user file read earlier
            seen[r.id] = r
            ordered.append(r)
    return RuleSet(exclusions=tuple(r for r in ordered if r.is_exclusion),
                   rules=tuple(r for r in ordered if not r.is_exclusion),
                   by_id=dict(seen), region=regions[0] if regions else None)
