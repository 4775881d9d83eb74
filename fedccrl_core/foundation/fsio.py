"""The one atomic write of the project (floor 0, docs/architecture.md): an output appears complete under its
name, or not at all, and a temporary path has one owner and one cleanup.

Every temporary path is named after the output it will become, next to it, owned by one process:

    .<name>.tmp-<pid>-<token>     a file or folder being written  (`atomic_path`, `atomic_file`, `atomic_dir`,
                                  `scratch_dir`)
    .<name>.old-<pid>-<token>     the previous output folder, moved aside for the instant of the swap

A process that dies (kill -9, power loss) leaves its temporary path behind. The first write into the
same folder by a later process removes it with a one-line notice on stderr, once the owner is known to be gone:
no process has that pid, or the process that has it now started after the path was last written (the pid
was reused). Paths of a live writer are never touched, so concurrent writers in one folder are safe.

Files are fsynced before the rename and the folder after it, so the rename is the commit point also
after a crash. An OSError while writing becomes `OutputError` naming the output (no traceback), e.g.
`results/x.json: cannot write (No space left on device)`.

What stands at an output path decides how it is written (`output_target`), since a rename replaces the
directory entry, not what it points at:
    nothing, a regular file  the temporary file and rename above
    a symlink (or a chain)   the same, at the file the link ends at (missing or not); the link stays
    a FIFO, character device, socket, `-` (stdout), /dev/stdout and other links into /proc
                             opened and written in place, no temporary file, no rename: a reader gets
                             the bytes, a device stays a device. Whatever was written before an error
                             has been read already, so "complete or absent" cannot hold there.
    a folder, a block device refused with an OutputError before anything is written
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
import socket
import stat
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import psutil

from fedccrl_core.foundation.errors import FedCCRLError

TEMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}$")
# errors of the body of a write that are about the output, not about something the body reads
_OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
_swept: set[str] = set()


class OutputError(FedCCRLError, OSError):
    """An output could not be written (unwritable folder, full disk, read-only file system)."""


def _notice(msg: str) -> None:
    print(f"notice: {msg}", file=sys.stderr, flush=True)


def temp_path(path: str | os.PathLike, kind: str = "tmp") -> Path:
    """A fresh temporary name next to `path`, owned by this process."""
    path = Path(path)
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


# ---- ownership and cleanup ----------------------------------------------------------------------
def owner_alive(pid: int, mtime: float) -> bool:
    """Is the process that wrote a temporary path (pid in its name, last written at mtime) still running? A pid
    taken since by a process started after the path was last written is not its owner."""
    if pid <= 0:
        return False
    try:
        started = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:  # gone, or a zombie
        return False
    except psutil.AccessDenied:  # a process of another user: alive
        return True
    return started <= mtime + 2.0  # 2 s: the resolution of the kernel's start time


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def sweep_stale(parent: str | os.PathLike, name: str | None = None, log: Callable[[str], None] = _notice) -> list[Path]:
    """Remove the temporary paths in `parent` (of output `name`, or of any output) whose owner is gone.
    Returns the removed paths; each gets one line through `log`."""
    parent = Path(parent)
    removed: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for e in entries:
        m = TEMP_RE.match(e.name)
        if m is None or (name is not None and m["name"] != name):
            continue
        try:
            mtime = e.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        pid = int(m["pid"])
        if owner_alive(pid, mtime):
            continue
        p = Path(e.path)
        _remove(p)
        removed.append(p)
        log(
            f"removed {p}, a temporary {'folder' if e.is_dir(follow_symlinks=False) else 'file'} left by "
            f"process {pid}, which is no longer running"
        )
    return removed


def _sweep_once(parent: Path) -> None:
    """sweep_stale over a folder, once per process: a writer called every round (or once per client)
    does not rescan it."""
    key = str(parent.resolve())
    if key not in _swept:
        sweep_stale(parent)
        _swept.add(key)


# ---- errors -------------------------------------------------------------------------------------
def _output_error(path: Path, e: OSError) -> OutputError:
    """`<output>: cannot write (<reason>)`, naming the path the OS complained about when it is another
    one (a parent that is a file, say), never the temporary name."""
    reason = e.strerror or str(e) or e.__class__.__name__
    other = Path(os.fsdecode(e.filename)) if e.filename else None
    if other is not None and other != path and not other.name.startswith(f".{path.name}."):
        reason += f": {other}"
    return OutputError(f"{path}: cannot write ({reason})")


@contextlib.contextmanager
def _as_output_error(path: Path, any_errno: bool = True) -> Iterator[None]:
    try:
        yield
    except OutputError:
        raise
    except OSError as e:
        if any_errno or e.errno in _OUTPUT_ERRNOS:
            raise _output_error(path, e) from e
        raise


# ---- what stands at an output path ---------------------------------------------------------------
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
        raise _output_error(path, e) from e
    if stat.S_ISDIR(mode) or stat.S_ISBLK(mode):  # a block device is a disk: never overwritten by an output file
        raise OutputError(f"{path}: cannot write (is {_kind(mode)}, not a file)")
    if via_proc or not stat.S_ISREG(mode):  # FIFO, character device, socket
        return path, "stream"
    return end, "file"


def _display(path: Path) -> Path:
    return Path("stdout") if os.fspath(path) == STDOUT else path


def _kind(mode: int) -> str:
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
            raise _output_error(self.output, e) from e


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
            raise _output_error(self.output, e) from e
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
def _stream(path: Path, name: Path, mode: str, verify, previous, open_kwargs) -> Iterator:
    """`atomic_file` for a FIFO, device, socket or stdout: written in place, flushed and closed at the end;
    errors name the output as the user gave it (`name`)."""
    if verify is not None or previous is not None:  # nothing to read back, nothing to keep aside
        raise OutputError(f"{name}: cannot write (this output must be a regular file)")
    with _as_output_error(name):
        raw = _open_raw(path, name)
    buffered = io.BufferedWriter(raw)
    f: IO[Any] = io.TextIOWrapper(buffered, **open_kwargs) if mode == "w" else buffered
    try:
        with _as_output_error(name, any_errno=False):
            yield f
        with _as_output_error(name):
            f.close()  # flushes: a full device fails here
    except BaseException:
        with contextlib.suppress(OSError):
            f.close()
        with contextlib.suppress(OSError):
            raw.close()
        raise


def _make_parents(path: Path) -> list[Path]:
    """mkdir -p of `path`'s folder; returns the folders it created, deepest first, for `_unmake` on failure."""
    created, d = [], path.parent
    while not d.exists() and d != d.parent:
        created.append(d)
        d = d.parent
    with _as_output_error(path):
        path.parent.mkdir(parents=True, exist_ok=True)
    return created


def _unmake(created: list[Path]) -> None:
    """A failed write leaves no folder it created (still empty) behind: no partial output, not even a folder."""
    for d in created:
        try:
            d.rmdir()
        except OSError:  # not empty (someone else wrote there) or already gone
            return


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system can open a folder
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_path(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- files --------------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_path(
    path: str | os.PathLike,
    *,
    verify: Callable[[Path], object] | None = None,
    previous: str | os.PathLike | None = None,
    _synced: bool = False,
) -> Iterator[Path]:
    """Yield a temporary path next to `path` for the body to write by any means. On success it is
    fsynced, checked by `verify(tmp)` (which raises to refuse it), and renamed over `path`; the old
    `path` is first moved to `previous` when given (a fallback kept by the caller). On any failure or
    interruption the temporary file is removed and `path` is untouched. A symlink is followed to the file it
    ends at (`output_target`); a FIFO, device or socket is refused: the body writes a path, not a stream."""
    path, how = output_target(path)
    if how != "file":
        raise OutputError(f"{_display(path)}: cannot write (this output must be a regular file)")
    parent = path.parent
    created = _make_parents(path)
    _sweep_once(parent)
    tmp = temp_path(path)
    try:
        with _as_output_error(path, any_errno=False):
            yield tmp
        with _as_output_error(path):
            if not _synced:
                _fsync_path(tmp)  # FileNotFoundError -> the body wrote nothing: an error, never a missing output
        if verify is not None:
            verify(tmp)
        with _as_output_error(path):
            if previous is not None and path.is_file():
                os.replace(path, previous)
            os.replace(tmp, path)
        _fsync_dir(parent)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        _unmake(created)
        raise


@contextlib.contextmanager
def atomic_file(
    path: str | os.PathLike,
    mode: str = "wb",
    *,
    verify: Callable[[Path], object] | None = None,
    previous: str | os.PathLike | None = None,
    **open_kwargs,
):
    """`open(path, mode)` that writes a temporary file, fsyncs it and renames it over `path` on success
    (see `atomic_path`). `mode` is "w" (text, utf-8 by default) or "wb". A FIFO, character device,
    socket or "-" (stdout) is written in place instead (`output_target`)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_file: mode must be 'w' or 'wb', got {mode!r}")
    if mode == "w":
        open_kwargs.setdefault("encoding", "utf-8")
    name = _display(Path(path))
    path, how = output_target(path)
    if how == "stream":
        with _stream(path, name, mode, verify, previous, open_kwargs) as f:
            yield f
        return
    with atomic_path(path, verify=verify, previous=previous, _synced=True) as tmp:
        with _as_output_error(path):
            f = open(tmp, "x" + mode[1:], **open_kwargs)
        try:
            with _as_output_error(path, any_errno=False):
                yield f
            with _as_output_error(path):
                f.flush()
                os.fsync(f.fileno())
                f.close()
        except BaseException:
            with contextlib.suppress(OSError):
                f.close()
            raise


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_file(path, "wb") as f:
        f.write(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str, newline: str | None = None) -> Path:
    with atomic_file(path, "w", newline=newline) as f:
        f.write(text)
    return Path(path)


def write_json(path: str | os.PathLike, obj, *, indent: int | None = 1, allow_nan: bool = True, **dumps_kwargs) -> Path:
    """json.dumps(obj) and a newline, written atomically. `allow_nan=False` refuses NaN and infinity
    (not JSON) with a ValueError before anything is written."""
    return write_text(path, json.dumps(obj, indent=indent, allow_nan=allow_nan, **dumps_kwargs) + "\n")


# ---- folders ------------------------------------------------------------------------------------
def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary folder next to `out`; on success it replaces `out`, on failure it is
    removed. The old `out` is moved aside only at the very end, so a failed run leaves an earlier
    complete `out` untouched, and no run ever leaves a partial folder under the name `out`. A symlink is
    followed: the folder it ends at is replaced and the link stays. A FIFO, device or socket is refused."""
    out = Path(out)
    end = Path(os.path.realpath(out)) if out.is_symlink() else out
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISDIR(mode := os.stat(end).st_mode) and not stat.S_ISREG(mode):
            raise OutputError(f"{out}: cannot write (is {_kind(mode)}, not a folder)")
    out = end
    parent = out.parent
    created = _make_parents(out)
    _sweep_once(parent)
    tmp = temp_path(out)
    try:
        with _as_output_error(out):
            tmp.mkdir(mode=0o777 & ~_umask())
        with _as_output_error(out, any_errno=False):
            yield tmp
        old = None
        with _as_output_error(out):
            if out.exists() or out.is_symlink():
                old = temp_path(out, "old")
                os.rename(out, old)
            os.rename(tmp, out)
        _fsync_dir(parent)
        if old is not None:
            _remove(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _unmake(created)
        raise


@contextlib.contextmanager
def scratch_dir(near: str | os.PathLike) -> Iterator[Path]:
    """A temporary work folder next to `near` (same file system, so renames out of it are cheap),
    removed at the end whatever happens; left by a killed process, the next call removes it."""
    near = Path(near)
    created = _make_parents(near)
    _sweep_once(near.parent)
    tmp = temp_path(near)
    try:
        with _as_output_error(near):
            tmp.mkdir()
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _unmake(created)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
