"""GPU targets of a TensorRT for RTX plan (rules/targets.toml): parse `--compute-capability`, choose
the targets a model's quantized formats need, and say which GPUs the plan runs on."""
from __future__ import annotations

from functools import lru_cache

from ..errors import QdqError
from ..rulebook.files import bundled, read_rule_file


@lru_cache(maxsize=1)
def table() -> dict:
    return read_rule_file(bundled("targets.toml")).data


def _order(sm: str) -> int:
    return int(sm[2:])


def known() -> list[str]:
    return sorted(table()["sm"], key=_order)


def parse(text: str | None) -> list[str] | None:
    """'sm89,sm120' (also '8.9,12.0' or '89') -> ['sm89', 'sm120']; None when not given."""
    if text is None:
        return None
    out = []
    for item in (t.strip().lower() for t in text.split(",")):
        if not item:
            continue
        sm = "sm" + item.replace("sm", "").replace(".", "").replace("_", "")
        if sm not in table()["sm"]:
            raise QdqError(f"--compute-capability {item!r} is not a target TensorRT for RTX compiles for",
                           "use some of " + ",".join(known()))
        if sm not in out:
            out.append(sm)
    if not out:
        raise QdqError("--compute-capability is empty", "write --compute-capability sm89,sm120")
    return sorted(out, key=_order)


def needed(formats: set[str]) -> str | None:
    """The oldest target with kernels for every format in `formats` (INT8, FP8, INT4), or None."""
    needs = table()["needs"]
    sms = [needs[f] for f in formats if f in needs]
    return max(sms, key=_order) if sms else None


def choose(formats: set[str], given: list[str] | None) -> tuple[list[str] | None, str]:
    """The targets to set (None: the builder's default) and a note when the model decided them.
    Given targets older than a format needs are refused: the build would fail or drop them."""
    floor = needed(formats)
    if given:
        old = [sm for sm in given if floor and _order(sm) < _order(floor)]
        if old:
            fmt = next(f for f in formats if table()["needs"].get(f) == floor)
            raise QdqError(f"--compute-capability {','.join(old)}: {fmt} kernels need {floor} or later",
                           f"target {floor} or later, or quantize to INT8 for older GPUs")
        return given, ""
    default = table()["default"]
    if floor and any(_order(sm) < _order(floor) for sm in default):
        chosen = [sm for sm in default if _order(sm) >= _order(floor)]
        return chosen, f"targets {','.join(chosen)} ({' and '.join(sorted(formats))} needs {floor} or later)"
    return None, ""


def describe(sms: list[str]) -> str:
    """'sm89 (Ada: RTX 40xx, ...), sm120 (...)'."""
    return ", ".join(f"{sm} ({table()['sm'][sm]['gpus']})" for sm in sms)


def default() -> list[str]:
    return list(table()["default"])
