"""One output policy for every file qdqgraph writes (models, reports, JSON, caches, engines, examples).

- never an input of the same run, never another output of the same run, never through a dangling
  symbolic link, never a folder, never anything but a regular file: a device (`/dev/null`,
  `/dev/full`), a FIFO or a socket is refused, with or without --force, since writing means
  renaming a new file over the name and would replace the node itself;
- never an existing file unless the caller forces it (the CLI's `--force`), and the check is the
  write itself: the finished temporary file is hard-linked to its name, which fails if the name
  appeared meanwhile, so two runs cannot both claim one file (where a file system has no hard
  links, the name is reserved with an exclusive create instead);
- atomic: written to a temporary file beside the target, flushed to disk, then renamed, so a
  failed or interrupted run leaves nothing half-written;
- mode from the umask (0644 by default), like any file a program creates (not mkstemp's 0600,
  which a TensorRT or Triton container running as another user cannot read); a file overwritten
  with --force keeps its mode.

`Plan` checks a run's outputs against its inputs and each other before any work is done (and
that no input is a FIFO, device or socket, which would hang the run: `require_regular`);
`write_atomic` writes one file; `written()` lists what this process has written (the CLI says it
when a run is interrupted after writing).
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import Callable

from ..errors import QdqError

_WRITTEN: list[Path] = []


def _umask_mode() -> int:
    old = os.umask(0)
    os.umask(old)
    return 0o666 & ~old


def written() -> list[Path]:
    """The files this process has written, in order."""
    return list(_WRITTEN)


def _same(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return a.resolve() == b.resolve()


_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"))


def special_kind(path) -> str | None:
    """What `path` is when it exists and is neither a regular file nor a folder (links followed):
    "a character device", "a block device", "a FIFO", "a socket" or "a special file"; else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def _refuse_special(p: Path, what: str) -> None:
    kind = special_kind(p)
    if kind is not None:
        raise QdqError(f"{what} {p} is {kind}, not a regular file",
                       "name a regular file (qdqgraph writes a new file and renames it into place, which would "
                       "replace the node)")


def require_regular(path, what: str) -> None:
    """A QdqError when the input `path` exists and is a FIFO, a device or a socket (links followed):
    reading one would wait for a writer forever, or read different bytes on each pass."""
    kind = special_kind(path)
    if kind is not None:
        raise QdqError(f"{what} {path} is {kind}, not a regular file",
                       "save its contents to a file and pass that (qdqgraph reads its inputs as files, "
                       "some more than once)")


def check_output(path, what: str, force: bool, inputs=()) -> Path:
    """Check one output path (see the module doc); returns it as a Path."""
    p = Path(path)
    if os.path.islink(p) and not p.exists():
        raise QdqError(f"{what} {p} is a broken symbolic link", "remove the link or choose another path")
    if p.is_dir():
        raise QdqError(f"{what} {p} is a folder", "name a file inside it")
    _refuse_special(p, what)
    for src in inputs:
        if src is not None and _same(p, Path(src)):
            raise QdqError(f"{what} {p} is also an input of this run ({src})", "choose another output path")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise QdqError(f"folder {parent} of {what} {p} does not exist", "create it or choose another path")
    if not os.access(parent, os.W_OK):
        raise QdqError(f"folder {parent} of {what} {p} is not writable", "choose another path")
    if p.exists() and not force:
        raise QdqError(f"{p} exists", "pass --force to overwrite it, or choose another path")
    return p


class Plan:
    """The outputs of one run, checked together: against the run's inputs and each other."""

    def __init__(self, force: bool = False, inputs=()):
        self.force = force
        self.inputs: list[Path] = []
        self.outputs: list[tuple[str, Path]] = []
        self.input(*inputs)

    def input(self, *paths) -> None:
        """Add inputs of the run; a FIFO, device or socket among them is refused (see require_regular)."""
        for p in paths:
            if p is not None:
                require_regular(p, "input")
                self.inputs.append(Path(p))

    def output(self, path, what: str) -> Path | None:
        if path is None:
            return None
        p = check_output(path, what, self.force, self.inputs)
        for other_what, other in self.outputs:
            if _same(p, other):
                raise QdqError(f"{what} and {other_what} are both {p}", "give each output its own path")
        self.outputs.append((what, p))
        return p


def write_atomic(path, write: Callable[[Path], object], force: bool = True, companions=()) -> list[Path]:
    """Write `path` through `write(temporary path)` (what it returns is ignored), atomically (see the
    module doc). `companions`: (final path, writer) of files that belong to it (a model's external
    data), written first. Returns the files written."""
    final = Path(path)
    _refuse_special(final, "output")          # also for writers that skipped check_output
    folder = final.parent if str(final.parent) else Path(".")
    done: list[Path] = []
    for companion, companion_write in companions:
        done += write_atomic(companion, companion_write, force)
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        try:                                 # an overwritten file keeps its mode; a new one gets the umask's
            mode = os.stat(final).st_mode & 0o7777
        except OSError:
            mode = _umask_mode()
        os.chmod(tmp, mode)
        _publish(tmp, final, force)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        for p in done:                       # a model without its data is no model
            with contextlib.suppress(OSError):
                p.unlink()
                _WRITTEN.remove(p)
        raise
    _sync_folder(folder)
    _WRITTEN.append(final)
    return done + [final]


def _publish(tmp: Path, final: Path, force: bool) -> None:
    if force:
        _refuse_special(final, "output")      # a node made while the file was being written
        os.replace(tmp, final)
        return
    try:
        os.link(tmp, final)                  # fails if `final` exists: the check and the write are one
    except FileExistsError:
        raise QdqError(f"{final} appeared while qdqgraph was writing it (another run writing the same file?)",
                       "choose another output path, or pass --force") from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        try:                                 # no hard links here: reserve the name, then replace it
            os.close(os.open(final, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            raise QdqError(f"{final} appeared while qdqgraph was writing it (another run writing the same file?)",
                           "choose another output path, or pass --force") from None
        os.replace(tmp, final)
        return
    tmp.unlink()


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable (POSIX)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text(path, text: str, force: bool = True) -> list[Path]:
    def write(tmp: Path) -> None:
        tmp.write_text(text, encoding="utf-8", newline="\n")
    return _as_qdq_error(path, lambda: write_atomic(path, write, force))


def write_bytes(path, data: bytes, force: bool = True) -> list[Path]:
    return _as_qdq_error(path, lambda: write_atomic(path, lambda tmp: tmp.write_bytes(data), force))


def _as_qdq_error(path, fn):
    try:
        return fn()
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise QdqError(f"no space left to write {path}", "free disk space or choose another path") from e
        if e.errno in (errno.EACCES, errno.EPERM):
            raise QdqError(f"permission denied writing {path}", "choose a folder you can write to") from e
        raise QdqError(f"could not write {path} ({e.strerror or e})", "choose another path") from e
