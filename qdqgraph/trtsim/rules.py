"""The simulator's rules: rules/tensorrt/*.toml parsed and validated into frozen dataclasses.

A rule names an `action` (a rewrite mechanism implemented in code: move a Q backward, absorb an
epilogue, ...), the op class it applies to and the `when` conditions (a closed registry in
conditions.py; "not " negates). Code asks `ruleset.for_action(a)` and tries the rules in file
order; a rule file cannot run code. Unknown keys, actions, op classes or conditions are load-time
errors that name the file, the line and the rule id.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ..errors import QdqError
from ..ops import vocabulary
from ..rulebook.files import bundled_files
from ..rulebook.loader import Table, TableSpec, load_tables
from ..rulebook.match import Conditions, op_matches
from .conditions import CONDITIONS

# action -> what the code does with a rule of that action (the closed registry of mechanisms)
ACTIONS = {
    "eliminate": "an op that computes nothing at inference is removed, its consumers read its input",
    "fold_weight": "a constant -> [Q ->] DQ becomes an INT8 weight",
    "merge": "Qs (or DQs) with identical parameters on one tensor become one",
    "q_backward": "Q(Op(x)) -> Op(Q(x)): the op runs on INT8",
    "dq_forward": "Op(DQ(x)) -> DQ(Op(x)): the op runs on INT8",
    "cancel": "DQ(s) -> Q(s) disappears",
    "requantize": "DQ(s1) -> Q(s2) becomes one INT8 -> INT8 requantize",
    "attention": "an attention block with all four GEMM inputs dequantized fuses into one INT8 layer",
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
    "extra_output_q": "a second Q of a layer's output, at another scale, is written by the same kernel (TensorRT for RTX)",
    "float_output_q": "a Q after a float layer a generated kernel computes (pointwise ops, an LSTM's gates) is its last step: that kernel rounds as it writes (TensorRT for RTX)",
    "dq_absorbed": "a DQ read only by float layers costs no kernel: they dequantize as they read (TensorRT for RTX)",
    "q_absorbed": "a Q read only through DQs by float layers rounds in a float kernel, not as an INT8 output (TensorRT for RTX)",
    "reformat": "a Q or DQ that nothing absorbed runs as a standalone Reformat",
}
SPECS = {"rule": TableSpec({"action": "str", "op": "str", "when": "str_list"},
                          required=("id", "doc", "ref", "action", "op"))}


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
    _by_op: dict = field(default_factory=dict, compare=False, repr=False)

    def for_action(self, action: str) -> tuple[SimRule, ...]:
        found = self._by_action.get(action)
        if found is None:
            found = self._by_action[action] = tuple(r for r in self.rules if r.action == action)
        return found

    def for_op(self, action: str, vocab, op: str) -> tuple[SimRule, ...]:
        """The rules of `action` whose op class (in `vocab`) holds the op type `op`, in file
        order: the only ones that can fire on a node of that type. Found once per op type."""
        found = self._by_op.get((action, op))
        if found is None or found[0] is not vocab:
            found = self._by_op[(action, op)] = (vocab, tuple(
                r for r in self.for_action(action) if op_matches(vocab, r.op, op)))
        return found[1]

    def rule(self, action: str) -> SimRule:
        """The one rule of an action that has exactly one (e.g. the reformat fallback)."""
        found = self.for_action(action)
        if not found:
            raise QdqError(f"no simulator rule with action {action!r}", "restore rules/tensorrt/*.toml")
        return found[0]


def sim_rule(t: Table, conditions: Conditions) -> SimRule:
    """A checked [[rule]] table as a simulator rule: a known action, op class and conditions."""
    action, op = t.body["action"], t.body["op"]
    if action not in ACTIONS:
        raise t.error(f"unknown action {action!r}", f"actions: {', '.join(sorted(ACTIONS))}")
    if op != "any" and not vocabulary().known(op):
        raise t.error(f"unknown op class {op!r}", "op classes are in rules/op_classes.toml")
    when = tuple(t.body.get("when", ()))
    conditions.check(when, t.where)
    return SimRule(t.id, t.doc, t.ref, action, op, when, t.source)


# compiler -> the bundled folders of its rules: the datacenter rules, and for TensorRT for RTX an overlay
# whose rules replace those with the same id (or come first within their action)
TARGETS = {"tensorrt": ("tensorrt",), "tensorrt-rtx": ("tensorrt_rtx", "tensorrt")}


def rule_files(target: str = "tensorrt") -> list:
    """The bundled rule files of `target`, its overlay first."""
    if target not in TARGETS:
        raise QdqError(f"unknown target {target!r}", "use one of " + ", ".join(TARGETS))
    return [f for folder in TARGETS[target] for f in bundled_files(folder)]


def load_sim_rules(extra: list | tuple = (), conditions: Conditions | None = None,
                   target: str = "tensorrt") -> SimRuleSet:
    """The bundled rules of `target` (rules/tensorrt/*.toml, under rules/tensorrt_rtx/ for TensorRT
    for RTX) plus users' files; a user rule replaces a bundled one with the same id, otherwise comes
    first within its action. The bundled rules alone are read once per target."""
    if not extra and conditions is None:
        return _bundled_rules(target)
    return _load(tuple(extra), conditions, target)


@lru_cache(maxsize=4)
def _bundled_rules(target: str) -> SimRuleSet:
    return _load((), None, target)


def _load(extra: tuple, conditions: Conditions | None, target: str) -> SimRuleSet:
    files = rule_files(target)
    base = len(bundled_files("tensorrt"))          # the overlay replaces by id, as a user's file does
    tables = load_tables([Path(p) for p in extra] + files, SPECS, bundled=base)
    rules = tuple(sim_rule(t, conditions or CONDITIONS) for t in tables)
    return SimRuleSet(rules, {r.id: r for r in rules})
