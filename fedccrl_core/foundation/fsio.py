"""The one atomic write of the project (floor 0, docs/architecture.md): an output appears complete under its
name, or not at all, and a temporary path has one owner and one cleanup (temp_paths.py: its name, its owner, the
removal of a dead owner's leftovers).

Files are fsynced before the rename and the folder after it, so the rename is the commit point also
after a crash. An OSError while writing becomes `OutputError` naming the output (output_errors.py).
What stands at the output path decides how it is written (output_target.py): a symlink is followed, a FIFO,
device, socket or stdout is written in place, a folder or block device is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from fedccrl_core.foundation.output_errors import OutputError, as_output_error
from fedccrl_core.foundation.output_target import display_name, kind_of, output_target, stream
from fedccrl_core.foundation.temp_paths import remove_path, sweep_once, temp_path


def _make_parents(path: Path) -> list[Path]:
    """mkdir -p of `path`'s folder; returns the folders it created, deepest first, for `_unmake` on failure."""
    created, d = [], path.parent
    while not d.exists() and d != d.parent:
        created.append(d)
        d = d.parent
    with as_output_error(path):
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
        raise OutputError(f"{display_name(path)}: cannot write (this output must be a regular file)")
    parent = path.parent
    created = _make_parents(path)
    sweep_once(parent)
    tmp = temp_path(path)
    try:
        with as_output_error(path, any_errno=False):
            yield tmp
        with as_output_error(path):
            if not _synced:
                _fsync_path(tmp)  # FileNotFoundError -> the body wrote nothing: an error, never a missing output
        if verify is not None:
            verify(tmp)
        with as_output_error(path):
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
    name = display_name(Path(path))
    path, how = output_target(path)
    if how == "stream":
        with stream(path, name, mode, verify, previous, open_kwargs) as f:
            yield f
        return
    with atomic_path(path, verify=verify, previous=previous, _synced=True) as tmp:
        with as_output_error(path):
            f = open(tmp, "x" + mode[1:], **open_kwargs)
        try:
            with as_output_error(path, any_errno=False):
                yield f
            with as_output_error(path):
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
            raise OutputError(f"{out}: cannot write (is {kind_of(mode)}, not a folder)")
    out = end
    parent = out.parent
    created = _make_parents(out)
    sweep_once(parent)
    tmp = temp_path(out)
    try:
        with as_output_error(out):
            tmp.mkdir(mode=0o777 & ~_umask())
        with as_output_error(out, any_errno=False):
            yield tmp
        old = None
        with as_output_error(out):
            if out.exists() or out.is_symlink():
                old = temp_path(out, "old")
                os.rename(out, old)
            os.rename(tmp, out)
        _fsync_dir(parent)
        if old is not None:
            remove_path(old)
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
    sweep_once(near.parent)
    tmp = temp_path(near)
    try:
        with as_output_error(near):
            tmp.mkdir()
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _unmake(created)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
