"""Warnings on stderr: one stream, one prefix, each said once per run; warnings that differ only in
the names they quote are said SAME_SHOWN times, then counted (a 20,000-node model never prints
thousands of lines)."""
from __future__ import annotations

import re
import sys

_SAID: set[str] = set()
_FORMS: dict[str, int] = {}      # a warning's form (its quoted names blanked) -> how many were said
SAME_SHOWN = 3                   # warnings of one form said in full; the rest become a count
_QUOTED = re.compile(r"'[^']*'")


def _form(text: str) -> str:
    return _QUOTED.sub("'?'", text)


def _say(text: str) -> None:
    print(f"qdqgraph: warning: {text}", file=sys.stderr)


def warn(message: str) -> None:
    """One warning, once; past SAME_SHOWN of its form, one line says the rest are not shown."""
    text = str(message).strip()
    if not text or text in _SAID:
        return
    _SAID.add(text)
    form = _form(text)
    n = _FORMS[form] = _FORMS.get(form, 0) + 1
    if n <= SAME_SHOWN:
        _say(text)
    elif n == SAME_SHOWN + 1:
        _say(f"further warnings of the form \"{form}\" are not shown")


def warn_all(lines) -> None:
    """Each warning once; past SAME_SHOWN of one form, the rest are one line with their count and
    the first few names."""
    forms: dict[str, list[str]] = {}
    for w in (str(x).strip() for x in lines):
        if w and w not in _SAID and w not in forms.get(_form(w), []):
            forms.setdefault(_form(w), []).append(w)
    for form, said in forms.items():
        room = max(SAME_SHOWN - _FORMS.get(form, 0), 0)
        for w in said[:room]:
            warn(w)
        rest = said[room:]
        if rest:
            _SAID.update(rest)
            _FORMS[form] = _FORMS.get(form, 0) + len(rest)
            names = [m for w in rest[:3] for m in _QUOTED.findall(w)[:1]]
            _say(f"{len(rest)} more warning(s) of the form \"{form}\" ({', '.join(names)}"
                 f"{', ...' if len(rest) > 3 else ''})")


def reset() -> None:
    _SAID.clear()
    _FORMS.clear()
