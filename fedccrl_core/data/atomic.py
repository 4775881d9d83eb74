"""Atomic outputs: a directory or a JSON file appears complete under its name, or not at all.

`atomic_dir` builds an output in a temporary directory next to it (`.<out>.partial-XXXX`) and renames
it into place only on success, replacing an old output; on any failure or interruption the temporary
directory is removed, so no half-finished output and no stray temp file is left. Leftovers of an
earlier killed run are removed first.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def _remove_stale(parent: Path, name: str) -> None:
    """Remove leftovers of an earlier killed run (`.<name>.partial-*`, `.<name>.old-*`)."""
    if not parent.is_dir():
        return
    for p in parent.iterdir():
        if p.name.startswith((f".{name}.partial-", f".{name}.old-")):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike):
    """Yield an empty temp dir next to `out`; on success it replaces `out`, on failure it is removed.

    The old `out` is moved aside only at the very end, so a failed run leaves an earlier complete
    `out` untouched, and no run ever leaves a partial directory under the name `out`.
    """
    out = Path(out)
    parent = out.parent if str(out.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(parent, out.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())        # mkdtemp makes 0700; the output gets normal permissions
        yield tmp
        old = None
        if out.exists() or out.is_symlink():
            old = parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
        os.rename(tmp, out)
        if old is not None:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write JSON to a temp file in the same folder, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=False, ensure_ascii=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
