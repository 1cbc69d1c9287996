"""What the simulator did and what it tried: rewrites that fired, and per Q/DQ node the rules that
were tried on it and why each failed (the answer to "why is this a Reformat?")."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Event:
    rule: str
    nodes: list[str]
    detail: str


@dataclass
class Trace:
    events: list[Event] = field(default_factory=list)
    misses: dict[str, dict[str, str]] = field(default_factory=dict)   # node -> rule id -> reason

    def fired(self, rule: str, nodes: list[str], detail: str) -> None:
        self.events.append(Event(rule, list(nodes), detail))

    def miss(self, nodes, rule: str, reason: str) -> None:
        """Record that `rule` did not absorb or move the Q/DQ node(s) `nodes`, and why (the last
        reason per rule wins: it is the one from the final graph)."""
        for n in [nodes] if isinstance(nodes, str) else nodes:
            self.misses.setdefault(n, {})[rule] = reason

    def why(self, names: list[str]) -> list[tuple[str, str]]:
        out, seen = [], set()
        for n in names:
            for rule, reason in self.misses.get(n, {}).items():
                if (rule, reason) not in seen:
                    seen.add((rule, reason))
                    out.append((rule, reason))
        return out
