"""What stands at an output path decides how it is written (`output_target`; floor 0, docs/architecture.md), since
a rename replaces the directory entry, not what it points at:
    nothing, a regular file  a temporary file next to it, renamed over it (fsio.py)
    a symlink (or a chain)   the same, at the file the link ends at (missing or not); the link stays
    a FIFO, character device, socket, `-` (stdout), /dev/stdout and other links into /proc
                             opened and written in place (`stream`), no temporary file, no rename: a reader gets
                             the bytes, a device stays a device. Whatever was written before an error
                             has been read already, so "complete or absent" cannot hold there.
    a folder, a block device refused with an OutputError before anything is written
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from fedccrl_core.foundation.output_errors import OutputError, as_output_error, output_error

STDOUT = "-"
_MAX_LINKS = 40  # as the kernel's limit on a path's symlinks (ELOOP)


def output_target(path: str | os.PathLike) -> tuple[Path, str]:
    """(where to write, how) for the output `path` a user named: how is "file" (a temporary file next to
    `where`, renamed over it) or "stream" (opened and written in place; `where` is `path`, or "-" for
    stdout). A link is followed to the path it ends at; a link into /proc (/dev/stdout, /dev/fd/1) names
    an open file of a process and is streamed into, never replaced. Raises OutputError, before anything
    is written, for a folder, a block device and a link loop."""
    if os.fspath(path) == STDOUT:
        return Path(STDOUT), "stream"
    path = Path(path)
    end, via_proc, own_fds = path, False, f"/proc/{os.getpid()}/fd"
    for _ in range(_MAX_LINKS):
        if not end.is_symlink():
            break
        parent = os.path.realpath(end.parent)
        if parent == own_fds and end.name.isdigit():  # /dev/stdout, /dev/fd/N: this process's descriptor N
            return Path(parent, end.name), "stream"
        via_proc |= parent == "/proc" or parent.startswith("/proc/")
        end = Path(parent, os.readlink(end))
    else:
        raise OutputError(f"{path}: cannot write (too many levels of symbolic links)")
    try:
        mode = os.stat(path).st_mode  # follows the links as open() would
    except FileNotFoundError:
        if via_proc:
            raise OutputError(f"{path}: cannot write (it names no open file)") from None
        return end, "file"  # nothing there yet, or a dangling link: the file the link names
    except OSError as e:
        raise output_error(path, e) from e
    if stat.S_ISDIR(mode) or stat.S_ISBLK(mode):  # a block device is a disk: never overwritten by an output file
        raise OutputError(f"{path}: cannot write (is {kind_of(mode)}, not a file)")
    if via_proc or not stat.S_ISREG(mode):  # FIFO, character device, socket
        return path, "stream"
    return end, "file"


def display_name(path: Path) -> Path:
    """The output as messages name it: "stdout" for "-"."""
    return Path("stdout") if os.fspath(path) == STDOUT else path


def kind_of(mode: int) -> str:
    """What a file mode is, in words ("a folder", "a FIFO", ...)."""
    return (
        "a folder"
        if stat.S_ISDIR(mode)
        else "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a character device"
        if stat.S_ISCHR(mode)
        else "a block device"
        if stat.S_ISBLK(mode)
        else "a regular file"
    )


class _RawOutput(io.FileIO):
    """A file descriptor written in place whose write errors (a full device: ENOSPC; a failing one: EIO; a
    reader that left: EPIPE) are OutputError naming the output, also when the buffer above flushes."""

    def __init__(self, fd: int, name: Path):
        super().__init__(fd, "wb", closefd=True)
        self.output = name

    def write(self, b):
        try:
            return super().write(b)
        except OSError as e:
            raise output_error(self.output, e) from e


class _Stdout(io.RawIOBase):
    """sys.stdout's bytes (whatever sys.stdout is when written to), with write errors as in _RawOutput;
    closing it leaves stdout open."""

    output = Path("stdout")

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        try:
            sys.stdout.buffer.write(b)
            sys.stdout.buffer.flush()
        except OSError as e:
            raise output_error(self.output, e) from e
        return len(b)


def _open_raw(path: Path, name: Path) -> io.RawIOBase:
    if os.fspath(path) == STDOUT:
        sys.stdout.flush()  # what was printed before comes first
        return _Stdout()
    if path.parent == Path(f"/proc/{os.getpid()}/fd"):
        # a duplicate, not a reopen: a reopened descriptor would write from offset 0 of a file stdout appends to
        for std in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                std.flush()
        return _RawOutput(os.dup(int(path.name)), name)
    if stat.S_ISSOCK(os.stat(path).st_mode):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(os.fspath(path))
        except BaseException:
            s.close()
            raise
        return _RawOutput(s.detach(), name)
    # no O_CREAT: if the node went away, nothing is created in its place; a FIFO waits here for a reader
    return _RawOutput(os.open(path, os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC), name)


@contextlib.contextmanager
def stream(path: Path, name: Path, mode: str, verify, previous, open_kwargs) -> Iterator:
    """`atomic_file` for a FIFO, device, socket or stdout: written in place, flushed and closed at the end;
    errors name the output as the user gave it (`name`)."""
    if verify is not None or previous is not None:  # nothing to read back, nothing to keep aside
        raise OutputError(f"{name}: cannot write (this output must be a regular file)")
    with as_output_error(name):
        raw = _open_raw(path, name)
    buffered = io.BufferedWriter(raw)
    f: IO[Any] = io.TextIOWrapper(buffered, **open_kwargs) if mode == "w" else buffered
    try:
        with as_output_error(name, any_errno=False):
            yield f
        with as_output_error(name):
            f.close()  # flushes: a full device fails here
    except BaseException:
        with contextlib.suppress(OSError):
            f.close()
        with contextlib.suppress(OSError):
            raw.close()
        raise
