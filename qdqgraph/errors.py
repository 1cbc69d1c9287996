"""Errors that qdqgraph reports to its users.

A `QdqError` is the user's problem (bad input, bad usage): the CLI prints its one-line message
and exits 2, with no traceback unless `--debug`. Any other exception is a bug in qdqgraph: the
CLI prints one line that says so and exits 1.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar


class QdqError(Exception):
    """A problem with the user's input or request, with the fix in the message."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}; {fix}" if fix else problem)


class ArgumentTypeError(QdqError, TypeError):
    """A Python API function was given an argument of a type it does not take (qdqgraph.api_checks):
    a QdqError with the fix, and a TypeError for code that catches those."""


class InvariantError(AssertionError):
    """qdqgraph produced a model that breaks one of its own Q/DQ invariants (a bug)."""


# ------------------------------------------------------------------ options in the user's words

_CLI_WORDS: ContextVar[bool] = ContextVar("qdqgraph_cli_words", default=False)
_FLAGS = {"exclude_ops": "--exclude-op", "exclude_nodes": "--exclude-node", "include_nodes": "--include-node",
          "fixed_inputs": "--fix-input", "custom_op_libraries": "--custom-op-library"}
_SWITCHES: frozenset[str] = frozenset()                  # flags that take no value
_ON_OFF = frozenset({"output_aware", "bias_correction", "fragile_heads", "depthwise_check"})   # True / False / None: on / off / auto
_UNSET = object()


@contextmanager
def cli_words():
    """Within it, `option` names options as command-line flags (the `qdqgraph` command runs in it)."""
    token = _CLI_WORDS.set(True)
    try:
        yield
    finally:
        _CLI_WORDS.reset(token)


def cli_words_on() -> bool:
    """Whether messages now name options as command-line flags."""
    return _CLI_WORDS.get()


def option(name: str, value=_UNSET, literal: bool = True) -> str:
    """An option of `qdqgraph.quantize` (a QuantizeConfig field, or `calib`, `calib_cache`, `shapes`)
    as the user wrote it: `--block-size 64` from the command line, `block_size=64` from the Python
    API; without `value`, the flag or `block_size=` alone. `literal=False`: `value` is a placeholder
    (DATA.npz), written as it is in both."""
    if not _CLI_WORDS.get():
        return f"{name}=" if value is _UNSET else f"{name}={value!r}" if literal else f"{name}={value}"
    flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
    if value is _UNSET or (name in _SWITCHES and value is True):
        return flag
    if name in _ON_OFF:
        value = {True: "on", False: "off", None: "auto"}.get(value, value)
    return f"{flag} {value}"
