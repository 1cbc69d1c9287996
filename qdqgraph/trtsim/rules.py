"""The simulator's rules: rules/tensorrt/*.toml parsed and validated into frozen dataclasses.

A rule names an `action` (a rewrite mechanism implemented in code: move a Q backward, absorb an
epilogue, ...), the op class it applies to and the `when` conditions (a closed registry in
conditions.py; "not " negates). Code asks `ruleset.for_action(a)` and tries the rules in file
order; a rule file cannot run code. Unknown keys, actions, op classes or conditions are load-time
errors that name the file, the line and the rule id.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import QdqError
from ..ops import vocabulary
from ..rulebook.files import bundled_files, read_rule_file

# action -> what the code does with a rule of that action (the closed registry of mechanisms)
ACTIONS = {
    "eliminate": "an op that computes nothing at inference is removed, its consumers read its input",
    "fold_weight": "a constant -> [Q ->] DQ becomes an INT8 weight",
    "merge": "Qs (or DQs) with identical parameters on one tensor become one",
    "q_backward": "Q(Op(x)) -> Op(Q(x)): the op runs on INT8",
    "dq_forward": "Op(DQ(x)) -> DQ(Op(x)): the op runs on INT8",
    "cancel": "DQ(s) -> Q(s) disappears",
    "requantize": "DQ(s1) -> Q(s2) becomes one INT8 -> INT8 requantize",
    "weighted": "a layer rooted at a weighted op, with its DQ'd input and INT8 weight",
    "epilogue": "an op fuses into the weighted layer before it",
    "output_q": "a trailing Q becomes the layer's output scale",
    "residual_dq": "the DQ on a fused residual input is absorbed",
    "post_pool": "an INT8 MaxPool after Conv-Act fuses into the conv (ConvActPool)",
    "requant_fuse": "a requantize after an INT8 output fuses into the layer",
    "fc_reshape": "a reshape in front of a fully connected layer fuses into it",
    "quantized_op": "DQ -> Op -> Q of a non-weighted op becomes one INT8 layer",
    "buffer": "an INT8 op that becomes no layer: its inputs are written into one shared buffer (Concat)",
    "int8_copy": "data movement on INT8 data runs as its own INT8 layer",
    "pointwise": "a chain of float pointwise ops runs as one float layer",
    "float": "any other op runs in the float type of its tensors",
    "reformat": "a Q or DQ that nothing absorbed runs as a standalone Reformat",
}
_KEYS = {"id", "doc", "ref", "action", "op", "when"}


@dataclass(frozen=True)
class SimRule:
    id: str
    doc: str
    ref: str
    action: str
    op: str                      # op class or "any"
    when: tuple[str, ...]
    source: str


@dataclass(frozen=True)
class SimRuleSet:
    rules: tuple[SimRule, ...]
    by_id: dict = field(default_factory=dict, compare=False)
    _by_action: dict = field(default_factory=dict, compare=False, repr=False)

    def for_action(self, action: str) -> tuple[SimRule, ...]:
        found = self._by_action.get(action)
        if found is None:
            found = self._by_action[action] = tuple(r for r in self.rules if r.action == action)
        return found

    def rule(self, action: str) -> SimRule:
        """The one rule of an action that has exactly one (e.g. the reformat fallback)."""
        found = self.for_action(action)
        if not found:
            raise QdqError(f"no simulator rule with action {action!r}", "restore rules/tensorrt/*.toml")
        return found[0]


def _line_of(text: str, rule_id: str) -> int:
    for i, line in enumerate(text.splitlines(), 1):
        if re.search(r'id\s*=\s*"' + re.escape(rule_id) + '"', line):
            return i
    return 0


def parse_sim_rules(data: dict, source: str, text: str, conditions: dict) -> list[SimRule]:
    vocab = vocabulary()
    if data.get("schema") != 1:
        raise QdqError(f"{source}: expected `schema = 1` at the top", "add it (the rule-file format version)")
    unknown_tables = set(data) - {"schema", "rule"}
    if unknown_tables:
        raise QdqError(f"{source}: unknown table(s) {sorted(unknown_tables)}", "use [[rule]]")
    out = []
    for body in data.get("rule", []):
        rid = body.get("id")
        where = f"{source}:{_line_of(text, rid) if rid else 0} rule {rid or '(no id)'}"
        missing = [k for k in ("id", "doc", "ref", "action", "op") if not body.get(k)]
        if missing:
            raise QdqError(f"{where}: missing {', '.join(missing)}", "every rule needs id, doc, ref, action and op")
        unknown = set(body) - _KEYS
        if unknown:
            raise QdqError(f"{where}: unknown key(s) {sorted(unknown)}", f"use {sorted(_KEYS)}")
        if body["action"] not in ACTIONS:
            raise QdqError(f"{where}: unknown action {body['action']!r}", f"actions: {', '.join(sorted(ACTIONS))}")
        op = body["op"]
        if op != "any" and not vocab.known(op):
            raise QdqError(f"{where}: unknown op class {op!r}", "op classes are in rules/op_classes.toml")
        when = tuple(body.get("when", ()))
        for cond in when:
            name = cond.removeprefix("not ").split(":", 1)[0]
            if name not in conditions:
                raise QdqError(f"{where}: unknown condition {name!r}",
                               f"known conditions: {', '.join(sorted(conditions))}")
        out.append(SimRule(rid, body["doc"], body["ref"], body["action"], op, when, source))
    return out


def rule_files() -> list:
    return bundled_files("tensorrt")


def load_sim_rules(extra: list | tuple = (), conditions: dict | None = None) -> SimRuleSet:
    """The bundled rules/tensorrt/*.toml plus users' files; a user rule replaces a bundled one with
    the same id, otherwise comes first within its action."""
    if conditions is None:
        from .conditions import CONDITIONS
        conditions = CONDITIONS
    seen: dict[str, SimRule] = {}
    ordered: list[SimRule] = []
    bundled = {str(f) for f in rule_files()}
    for f in [Path(p) for p in extra] + rule_files():
        rf = read_rule_file(f)
        text = rf.text
        for r in parse_sim_rules(rf.data, rf.source, text, conditions):
            if r.id in seen:
                first = seen[r.id].source
                if first == r.source or (first in bundled and r.source in bundled):
                    raise QdqError(f"{f}:{_line_of(text, r.id)}: rule id {r.id} appears twice", "give each rule its own id")
                continue
            seen[r.id] = r
            ordered.append(r)
    return SimRuleSet(tuple(ordered), dict(seen))
