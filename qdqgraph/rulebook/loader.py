"""Rule files read into checked tables: the one loader of placement and simulator rules.

A rule file is TOML with `schema = 1` and arrays of tables (`[[rule]]`, `[[exclude]]`, ...). Each
kind of table has a `TableSpec`: the type of every key it may hold and the keys it must hold.
Every table has an `id`, a one-line `doc` and a `ref`. Files are read in order, users' files
before the bundled ones: the first table with an id wins (so a user's rule replaces a bundled one
of the same id), and an id twice in one file, or twice among the bundled files, is an error.
Every error names the file, the line of the table and its id.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from ..errors import QdqError
from .files import RuleFile, read_rule_file

SCHEMA = 1


def _is_str(v) -> bool:
    return isinstance(v, str)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def _is_str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _is_table_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, dict) for x in v)


# key type name -> (check, what to write in an error)
TYPES: dict[str, tuple[Callable, str]] = {
    "str": (_is_str, "a string"),
    "int": (_is_int, "an integer"),
    "number": (_is_number, "a number"),
    "bool": (_is_bool, "true or false"),
    "str_list": (_is_str_list, "a list of strings"),
    "table_list": (_is_table_list, "a list of tables ({ ... })"),
    "int_or_str": (lambda v: _is_int(v) or _is_str(v), "an integer or a string"),
}


@dataclass(frozen=True)
class TableSpec:
    """What one kind of table may hold: key -> type name (see TYPES), and the keys it must hold."""

    keys: dict[str, str]
    required: tuple[str, ...] = ("id", "doc", "ref")
    doc: str = ""


HEADER = {"id": "str", "doc": "str", "ref": "str"}


@dataclass(frozen=True)
class Table:
    """One checked table of a rule file."""

    kind: str               # the table name: "rule", "exclude", "region", ...
    id: str
    doc: str
    ref: str
    source: str             # the file it came from
    line: int
    body: dict = field(compare=False)

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line} {self.kind} {self.id}"

    def error(self, problem: str, fix: str) -> QdqError:
        return QdqError(f"{self.where}: {problem}", fix)


def _table_lines(text: str, kind: str) -> list[int]:
    """The line of each `[[kind]]` table, in order: the line of its `id = ...` when it has one,
    else its header's."""
    header = re.compile(r"^\s*\[\[\s*" + re.escape(kind) + r"\s*\]\]")
    any_header = re.compile(r"^\s*\[")
    id_line = re.compile(r"^\s*id\s*=")
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if not header.match(line):
            continue
        found = i + 1
        for j in range(i + 1, len(lines)):
            if any_header.match(lines[j]):
                break
            if id_line.match(lines[j]):
                found = j + 1
                break
        out.append(found)
    return out


def check_value(where: str, key: str, value, type_name: str) -> None:
    check, what = TYPES[type_name]
    if not check(value):
        raise QdqError(f"{where}: `{key}` must be {what}, not {value!r}"[:300], "fix the rule file")


def parse_file(rf: RuleFile, specs: dict[str, TableSpec]) -> list[Table]:
    """The checked tables of one rule file, in file order (kinds in the order of `specs`)."""
    data = rf.data
    if data.get("schema") != SCHEMA:
        raise QdqError(f"{rf.source}: expected `schema = {SCHEMA}` at the top", "add it (the rule-file format version)")
    unknown = sorted(set(data) - {"schema"} - set(specs))
    if unknown:
        tables = ", ".join(f"[[{k}]]" for k in specs)
        raise QdqError(f"{rf.source}: unknown table(s) {unknown}", f"use {tables}")
    out = []
    for kind, spec in specs.items():
        if kind not in data:
            continue
        bodies = data[kind]
        if not _is_table_list(bodies):
            raise QdqError(f"{rf.source}: `{kind}` must be an array of tables written [[{kind}]], not {bodies!r}"[:300],
                           f"write each one as a [[{kind}]] table")
        lines = _table_lines(rf.text, kind)
        allowed = {**HEADER, **spec.keys}
        for k, body in enumerate(bodies):
            line = lines[k] if k < len(lines) else 0
            rid = body.get("id")
            where = f"{rf.source}:{line} {kind} {rid if isinstance(rid, str) and rid else '(no id)'}"
            missing = [key for key in spec.required if key not in body or body[key] in ("", None)]
            if missing:
                raise QdqError(f"{where}: missing {', '.join(missing)}",
                               f"every [[{kind}]] needs {', '.join(spec.required)}")
            extra = sorted(set(body) - set(allowed))
            if extra:
                raise QdqError(f"{where}: unknown key(s) {extra}", f"use {sorted(allowed)}")
            for key, value in body.items():
                check_value(where, key, value, allowed[key])
            out.append(Table(kind, body["id"], body["doc"], body["ref"], rf.source, line, body))
    return out


def load_tables(files: list, specs: dict[str, TableSpec], bundled: int) -> list[Table]:
    """The tables of `files` (paths or bundled Traversables), users' files first; the last `bundled`
    files are the bundled ones. The first table of each id wins; an id repeated within one file or
    among the bundled files is an error."""
    seen: dict[str, Table] = {}
    out: list[Table] = []
    first_bundled = len(files) - bundled
    for k, f in enumerate(files):
        for t in parse_file(read_rule_file(f), specs):
            prior = seen.get(t.id)
            if prior is not None:
                if prior.source == t.source or (k >= first_bundled and prior_bundled(prior, files, first_bundled)):
                    raise QdqError(f"{t.source}:{t.line}: rule id {t.id} appears twice", "give each rule its own id")
                continue                    # replaced by a user's table read earlier
            seen[t.id] = t
            out.append(t)
    return out


def prior_bundled(prior: Table, files: list, first_bundled: int) -> bool:
    return prior.source in {str(f) for f in files[first_bundled:]}
