"""Matching a rule against a node: a closed registry of named conditions and one evaluator.

A condition is a function `cond(ctx, node, arg) -> Match`: `hit(note, **captures)` when it holds
(the note says what it found, e.g. the channel counts of a tiny conv), `miss(reason)` when it does
not (the reason answers "why did this rule not apply?"). A rule's `when` list names conditions,
with an optional `:arg` and a `not ` prefix; `evaluate` checks the rule's op class, then each
condition in order, and stops at the first that fails. Placement and the simulator each keep a
`Conditions` registry of their own; a rule file can only name what is registered, never run code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Mapping

from ..errors import QdqError

@dataclass(frozen=True)
class Match:
    """The result of a condition or a rule: did it hold, why not (or what it found), captures."""

    ok: bool
    reason: str = ""
    captures: Mapping[str, Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.ok


_HIT = Match(True)        # the plain hit, shared: a Match is not changed once made


def hit(note: str = "", **captures) -> Match:
    return Match(True, note, captures) if note or captures else _HIT


def miss(reason: str) -> Match:
    return Match(False, reason)


@dataclass
class Context:
    """What conditions see: the graph (a placement GraphView or a simulator SimGraph), and, as the
    caller has them, the plan so far, the layer being grown, the edge the node was reached through,
    and precomputed facts (the simulator's residual candidates)."""

    graph: Any
    plan: Any = None
    layer: Any = None
    tensor: str | None = None
    candidates: dict = field(default_factory=dict)
    memo: dict = field(default_factory=dict)      # what conditions found, shared by the caller's contexts
                                                  # while the graph stays as it is


@dataclass(frozen=True)
class Condition:
    name: str
    fn: Callable[..., Match]
    captures: tuple[str, ...] = ()


class Conditions:
    """A closed registry of named conditions."""

    def __init__(self, owner: str):
        self.owner = owner
        self._by_name: dict[str, Condition] = {}
        self._steps: dict[tuple, tuple] = {}       # a rule's `when` -> its parsed steps (rules are read once)

    def register(self, name: str, captures: tuple[str, ...] = ()):
        def wrap(fn):
            if name in self._by_name:
                raise ValueError(f"condition {name!r} registered twice in {self.owner}")
            self._by_name[name] = Condition(name, fn, tuple(captures))
            return fn
        return wrap

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Condition:
        return self._by_name[name]

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def check(self, when, where: str) -> set[str]:
        """Raise (naming `where`) if `when` names an unknown condition; the captures it sets."""
        captures: set[str] = set()
        for cond in when:
            name = parse(cond)[1]
            if name not in self._by_name:
                raise QdqError(f"{where}: unknown condition {name!r}", f"known conditions: {', '.join(self.names())}")
            captures |= set(self._by_name[name].captures)
        return captures

    def evaluate(self, when, ctx: Context, node) -> Match:
        """Each condition of `when` in order: the first miss explains; on a hit, the notes of the
        conditions that explain themselves, joined, and all captures."""
        key = when if isinstance(when, tuple) else tuple(when)
        steps = self._steps.get(key)
        if steps is None:
            steps = self._steps[key] = self._parsed(key)
        captures: dict[str, Any] = {}
        notes: list[str] = []
        for cond, negated, fn, arg in steps:
            m = fn(ctx, node, arg)
            if negated:
                m = miss(f"{cond[4:]} holds" + (f" ({m.reason})" if m.reason else "")) if m.ok else hit()
            if not m.ok:
                return m
            if m.reason:
                notes.append(m.reason)
            if m.captures:
                captures.update(m.captures)
        return hit("; ".join(notes), **captures)

    def _parsed(self, when) -> tuple:
        """(condition text, negated, function, argument) of each condition of `when`."""
        out = []
        for cond in when:
            negated, name, arg = parse(cond)
            out.append((cond, negated, self._by_name[name].fn, arg))
        return tuple(out)


@lru_cache(maxsize=4096)
def parse(cond: str) -> tuple[bool, str, str]:
    """'not name:arg' -> (negated, name, arg)."""
    negated = cond.startswith("not ")
    name, _, arg = cond.removeprefix("not ").partition(":")
    return negated, name, arg


def op_matches(vocab, rule_op: str | None, node) -> bool:
    return rule_op == "any" or (rule_op is not None and vocab.is_(node, rule_op))
