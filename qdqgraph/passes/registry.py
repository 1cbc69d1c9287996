"""What each pass needs and what it leaves, declared beside the pass and checked.

A pass function is declared with `@declare(name, requires=..., ensures=..., fixpoint=...)`:

- `requires`: conditions on the graph it is given (an opset, say); `ensures`: conditions on the graph
  it leaves, given its PassResult (a BatchNormalization left is one the result says it kept). Each is
  a `Condition`: a sentence and a check that returns the violations it finds, named.
- `fixpoint`: running the pass again on its own output changes nothing (tests/test_passes.py runs
  every declared graph-only pass twice).

A pass also says how the run's report shows it (`describe(name, lines=..., phrase=..., fields=...)`):
its summary lines, its phrase in the one "cleaned:" line of the cleaning passes, and the fields it adds
to the JSON report. The report walks the results in run order and asks here; it knows no pass by name.

The checks cost a walk of the graph each, so they run where QDQGRAPH_CHECK_PASSES=1 is set (the
test suite sets it, so every pass run by any test is checked) and not in users' runs. A violation is
an InvariantError naming the pass, the condition and the nodes: a bug in qdqgraph, not the model.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import onnx_graphsurgeon as gs

from ..errors import InvariantError
from ..ops import DEQUANTIZE, QUANTIZE
from .base import PassResult
from .check import qdq_violations

ENV = "QDQGRAPH_CHECK_PASSES"


@dataclass(frozen=True)
class Condition:
    text: str                                                       # "no QuantizeLinear/DequantizeLinear left"
    violations: Callable[[gs.Graph, PassResult | None], list[str]]  # what breaks it, named; [] when it holds


@dataclass(frozen=True)
class PassInfo:
    name: str                 # the PassResult's name
    function: str             # module.function, for the docs and the error
    requires: tuple[Condition, ...] = ()
    ensures: tuple[Condition, ...] = ()
    fixpoint: bool = False    # a second run on its output changes nothing
    graph_only: bool = False  # takes the graph alone: tests can run it on any graph
    extra: dict = field(default_factory=dict)


PASSES: dict[str, PassInfo] = {}


@dataclass(frozen=True)
class SummaryContext:
    label: str              # INT8, FP8, INT4: how the run names its quantized layers
    precision: str
    max_examples: int = 3


Results = list[PassResult]


# Where a pass's lines sit in the summary, among the report's own sections (report.SECTIONS):
# repairs 0, opset 5, fixed inputs 10, inlined Ifs 20, cleaned 30, calibrated 40, placed 45,
# smoothing 50, output-aware 60, attention 65, bias correction 70, op table 80, float islands 90,
# prediction 100, fallback 110, notes 120.


@dataclass(frozen=True)
class Description:
    order: int
    lines: Callable[[Results, SummaryContext], list[str]] | None = None
    phrase: Callable[[Results, SummaryContext], tuple[str, list[str]]] | None = None   # cleaning passes
    fields: dict[str, Callable[[Results], Any]] = field(default_factory=dict)


DESCRIPTIONS: dict[str, Description] = {}


def describe(name: str, order: int, *, lines=None, phrase=None, fields: dict | None = None) -> None:
    """How the report shows the results of pass `name`, at position `order` of the summary (the
    cleaning passes' phrases share the one "cleaned:" line): `lines(results, ctx)` -> summary lines;
    `phrase(results, ctx)` -> (a phrase of the "cleaned:" line, lines under it); `fields`: JSON report
    key -> function of the results (called with [] where the pass did not run: give the empty value)."""
    DESCRIPTIONS[name] = Description(order, lines, phrase, dict(fields or {}))


def report_fields() -> dict[str, Callable[[Results], Any]]:
    """Every JSON field the passes add, by key."""
    return {k: f for d in DESCRIPTIONS.values() for k, f in d.fields.items()}


def checking() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def _graph_of(args) -> gs.Graph | None:
    first = args[0] if args else None
    if isinstance(first, gs.Graph):
        return first
    inner = getattr(first, "graph", None)
    return inner if isinstance(inner, gs.Graph) else None


def _check(info: PassInfo, conditions: tuple[Condition, ...], graph: gs.Graph, res: PassResult | None,
           when: str) -> None:
    for c in conditions:
        found = c.violations(graph, res)
        if found:
            more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
            raise InvariantError(f"pass {info.name} ({info.function}) {when} '{c.text}': "
                                 f"{'; '.join(found[:3])}{more}")


def declare(name: str, *, requires: tuple[Condition, ...] = (), ensures: tuple[Condition, ...] = (),
            fixpoint: bool = False, graph_only: bool = False):
    """Register the decorated pass under `name` and check its conditions where checking() is on."""
    def wrap(fn):
        info = PassInfo(name, f"{fn.__module__}.{fn.__qualname__}", tuple(requires), tuple(ensures), fixpoint,
                        graph_only)
        PASSES[name] = info

        @functools.wraps(fn)
        def run(*args, **kwargs):
            graph = _graph_of(args) if checking() else None
            if graph is not None:
                _check(info, info.requires, graph, None, "requires")
            res = fn(*args, **kwargs)
            if graph is not None:
                _check(info, info.ensures, graph, res if isinstance(res, PassResult) else None, "did not ensure")
            return res
        run.pass_info = info      # type: ignore[attr-defined]
        return run
    return wrap


# ------------------------------------------------------------------ conditions several passes share

def _no_qdq(graph: gs.Graph, res: PassResult | None) -> list[str]:
    return [f"{n.op} {n.name}" for n in graph.nodes if n.op in (QUANTIZE, DEQUANTIZE)]


def _opset_at_least(minimum: int) -> Condition:
    def found(graph: gs.Graph, res: PassResult | None) -> list[str]:
        opset = int(getattr(graph, "opset", 0) or 0)
        return [f"the graph's opset is {opset}"] if opset and opset < minimum else []
    return Condition(f"opset {minimum} or later", found)


def _qdq_sound(graph: gs.Graph, res: PassResult | None) -> list[str]:
    return qdq_violations(graph)


NO_QDQ = Condition("no QuantizeLinear/DequantizeLinear left", _no_qdq)
QDQ_SOUND = Condition("every Q/DQ keeps the invariants of passes/check.py", _qdq_sound)
OPSET_13 = _opset_at_least(13)
