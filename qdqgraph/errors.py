"""Errors that qdqgraph reports to its users.

A `QdqError` is the user's problem (bad input, bad usage): the CLI prints its one-line message
and exits 2, with no traceback unless `--debug`. Any other exception is a bug in qdqgraph: the
CLI prints one line that says so and exits 1.
"""
from __future__ import annotations


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
