"""The `qdqgraph` command: thin; each subcommand parses its arguments (shared argument groups in
args.py, checked into a QuantizeConfig before any work), calls the API and prints.

Exit codes: 0 done, 2 bad input or usage (one line on stderr naming the problem and the fix; with
--debug the traceback before it, the exit code the same), 1 an internal error (one line; the
traceback with --debug), 3 `report --strict` with findings, 130
interrupted (Ctrl-C), 143 terminated (SIGTERM: handled as Ctrl-C is, so no temporary file is left
and the line says what was written). Warnings go to stderr, each once, prefixed `qdqgraph: warning:`.
"""
from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import traceback
import warnings
from contextlib import contextmanager

from ..graph import outputs
from ..errors import QdqError, cli_words
from . import build, calibrate, compare, estimate, example, fix, insert, report, strip
from .args import Formatter, Parser, UsageError
from .messages import reset, warn
from ..version import __version__


def build_parser() -> Parser:
    ap = Parser(prog="qdqgraph", formatter_class=Formatter,
                description="Float ONNX to TensorRT-ready explicit-quantization (Q/DQ) ONNX.",
                epilog="Run `qdqgraph COMMAND --help` for a command's options and examples.")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    ap.add_argument("--version", action="version", version=f"qdqgraph {_version()}")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    for module in (insert, fix, calibrate, report, compare, example, strip, build, estimate):
        module.add(sub)
    return ap


def _version() -> str:
    return __version__


def _quiet_onnxruntime() -> None:
    """onnxruntime logs graph-optimizer notes at warning level to the terminal, in colour and
    before qdqgraph's own lines; only its errors are of use here."""
    try:
        import onnxruntime as ort
    except ImportError:  # pragma: no cover - a dependency
        return
    ort.set_default_logger_severity(3)


@contextmanager
def _quiet_graphsurgeon(debug: bool):
    """onnx-graphsurgeon prints its notes (`[W] Could not convert: BFLOAT16 ...`) on stdout, which
    holds only qdqgraph's own lines (the summary, or nothing with --quiet): within a run they are
    dropped, or with --debug written to stderr. Its critical messages still raise."""
    try:
        from onnx_graphsurgeon.logger import G_LOGGER
    except ImportError:  # pragma: no cover - a dependency
        yield
        return

    def to_stderr(message, severity, mode=None, stack_depth=2):
        if debug and severity >= G_LOGGER.WARNING:
            text = message() if callable(message) else message
            print(f"qdqgraph: debug: onnx-graphsurgeon: {text}", file=sys.stderr)
    G_LOGGER.log = to_stderr                         # its warning() and friends call self.log
    try:
        yield
    finally:
        del G_LOGGER.log                             # the class's own method again


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so it unwinds as Ctrl-C does (temporary files removed)."""


def _on_sigterm(signum, frame):
    raise Terminated()


def _handle_sigterm():
    """Install the SIGTERM handler for this run; returns the handler to restore (the default one where
    the old one was not Python's), or None where none was installed (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    return signal.SIG_DFL if old is None else old


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if debug:
        argv.remove("--debug")
    reset()
    written_before = len(outputs.written())

    def show_warning(message, category, filename, lineno, file=None, line=None):
        warn(str(message))
    old_show = warnings.showwarning
    warnings.showwarning = show_warning
    old_term = _handle_sigterm()
    try:
        args, extra = build_parser().parse_known_args(argv)
        if extra:                      # the command's own help, not the top-level one
            raise UsageError(f"unrecognized arguments: {' '.join(extra)}", f"see `qdqgraph {args.command} --help`")
        if args.command != "example":
            _quiet_onnxruntime()
        with cli_words(), _quiet_graphsurgeon(debug):
            return args.run(args)
    except QdqError as e:
        if debug:                      # the traceback, then the same line and exit code as without --debug
            traceback.print_exc()
        print(f"qdqgraph: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        if debug:
            traceback.print_exc()
        what = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        done = outputs.written()[written_before:]
        if done:
            print(f"qdqgraph: {what} after writing {', '.join(str(p) for p in done)}", file=sys.stderr)
        else:
            print(f"qdqgraph: {what}; no output was written", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except BrokenPipeError:            # the reader of stdout stopped (`qdqgraph report m.onnx | head`)
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no error at interpreter exit
        except OSError:
            pass
        return 141                     # as a process killed by SIGPIPE: what the shell expects of a pipe
    except SystemExit as e:            # --help and --version exit through argparse
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    except Exception as e:  # a bug in qdqgraph: one line, the traceback with --debug
        if debug:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"qdqgraph: internal error: {type(e).__name__}: {first} (rerun with --debug for the traceback "
              f"and report it)", file=sys.stderr)
        return 1
    finally:
        warnings.showwarning = old_show
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


__all__ = ["main", "entry", "build_parser", "warn"]


def entry() -> None:
    """The `qdqgraph` command (the console script, `python -m qdqgraph`): main(), then the exit.
    The run's graphs are cyclic garbage by then, and the interpreter's last collection would free
    them cycle by cycle (0.9 s after a 10,000-node CNN's insert): frozen, they go with the process."""
    code = main()
    gc.freeze()
    sys.exit(code)

