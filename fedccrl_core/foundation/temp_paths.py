"""Temporary paths of the atomic writes (fsio.py): their names, their owners, and the removal of what a dead owner
left (floor 0, docs/architecture.md).

Every temporary path is named after the output it will become, next to it, owned by one process:

    .<name>.tmp-<pid>-<token>     a file or folder being written  (fsio's `atomic_path`, `atomic_file`, `atomic_dir`,
                                  `scratch_dir`)
    .<name>.old-<pid>-<token>     the previous output folder, moved aside for the instant of the swap

A process that dies (kill -9, power loss) leaves its temporary path behind. The first write into the
same folder by a later process removes it with a one-line notice on stderr, once the owner is known to be gone:
no process has that pid, or the process that has it now started after the path was last written (the pid
was reused). Paths of a live writer are never touched, so concurrent writers in one folder are safe.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil

TEMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}$")
_swept: set[str] = set()


def _notice(msg: str) -> None:
    print(f"notice: {msg}", file=sys.stderr, flush=True)


def temp_path(path: str | os.PathLike, kind: str = "tmp") -> Path:
    """A fresh temporary name next to `path`, owned by this process."""
    path = Path(path)
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


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


def remove_path(p: Path) -> None:
    """Remove a file, a link or a folder (with what it holds); nothing when it is gone already."""
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
        remove_path(p)
        removed.append(p)
        log(
            f"removed {p}, a temporary {'folder' if e.is_dir(follow_symlinks=False) else 'file'} left by "
            f"process {pid}, which is no longer running"
        )
    return removed


def sweep_once(parent: Path) -> None:
    """sweep_stale over a folder, once per process: a writer called every round (or once per client)
    does not rescan it."""
    key = str(parent.resolve())
    if key not in _swept:
        sweep_stale(parent)
        _swept.add(key)
