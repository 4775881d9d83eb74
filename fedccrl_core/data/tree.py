"""The one walker of image folders, with one rule for what is not a sample (`images.is_ignored_name`).

- `scan_tree`: a raw `<domain>/<class>/<file>` tree (the download stage's checks, the partition stage);
- `scan_classes`: one domain's `<class>/<file>` folders (also a source's domain folders, data/layout.py);
- `subfolders` and `walk_files`: the folders `fedccrl-serve` reads (`evaluate`'s class folders, `predict`'s
  folders searched recursively).

What is never opened (`not_regular`: a FIFO, socket or device would block its reader or be no image), and what is
never followed (a symlink loop; with `within`, a site's folder, a symlink that leaves it), is listed with why.

Sorted by name everywhere, so every reader sees the same files in the same order. Numpy/PIL only: serving
imports it without torch.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fedccrl_core.data.images import is_ignored_name
from fedccrl_core.foundation.errors import DataError

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


@dataclass(frozen=True)
class LeftOut:
    """A path of an image tree that is no sample (passed over by the walker, unreadable, or listed but absent) and
    why; the data report and a site's manifest list it."""

    path: str
    reason: str


def not_regular(path: str | os.PathLike) -> str | None:
    """Why `path` must not be opened as an image (a FIFO would block the reader for ever), else None.
    os.stat never opens the file; a path that cannot be stat'ed is left to the decoder's error."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return f"{kind}, not a regular file; never opened"


def not_followed(path: str | os.PathLike, within: Path | None) -> str | None:
    """Why the symlink `path` is not followed: a loop, or (with `within`, a resolved folder) a target outside
    `within`; else None (a dangling symlink is left to the decoder's error)."""
    if not os.path.islink(path):
        return None
    try:
        target = Path(os.path.realpath(path, strict=True))
    except OSError as e:
        return "a symlink loop; not followed" if e.errno == errno.ELOOP else None
    if within is not None and not target.is_relative_to(within):
        return f"a symlink to {target}, outside {within}; not followed"
    return None


def _entries(folder: str | os.PathLike[str]) -> list[os.DirEntry]:
    with os.scandir(folder) as it:
        return sorted(it, key=lambda e: e.name)


def subfolders(folder: str | os.PathLike[str]) -> list[Path]:
    """The folders in `folder`, sorted, ignored names skipped."""
    return [Path(e.path) for e in _entries(folder) if e.is_dir() and not is_ignored_name(e.name)]


def walk_files(folder: str | os.PathLike[str]) -> Iterator[Path]:
    """Every file under `folder`, recursively, sorted, ignored names (of files and folders) skipped."""
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not is_ignored_name(d))
        for name in sorted(files):
            if not is_ignored_name(name):
                yield Path(root) / name


def scan_classes(
    folder: str | os.PathLike, rel: str, within: Path | None = None
) -> tuple[dict[str, list[str]], list[LeftOut]]:
    """`folder/<class>/<file>` -> ({class: sorted file names}, the entries passed over, paths spelled
    `rel/<class>/<file>`). Ignored names are skipped silently at the class level and listed at the file level; a
    symlink loop, a file that is not a regular file and (with `within`) a symlink leaving `within` are listed."""
    classes: dict[str, list[str]] = {}
    ignored: list[LeftOut] = []
    for c in _entries(folder):
        if is_ignored_name(c.name):
            continue
        why = not_followed(c.path, within)
        if why or not c.is_dir():
            ignored.append(LeftOut(f"{rel}/{c.name}", why or "file outside any class folder"))
            continue
        names = []
        for f in _entries(c.path):
            path = f"{rel}/{c.name}/{f.name}"
            why = "hidden or system file" if is_ignored_name(f.name) else not_followed(f.path, within)
            if not why and f.is_dir():
                why = "folder nested below a class folder"
            why = why or not_regular(f.path)
            if why:
                ignored.append(LeftOut(path, why))
            else:
                names.append(f.name)
        classes[c.name] = names
    return classes, ignored


@dataclass
class Tree:
    """A scanned raw tree: files[domain][class] = sorted file names."""

    root: Path
    files: dict[str, dict[str, list[str]]]
    ignored: list[LeftOut] = field(default_factory=list)

    def count(self, domain: str) -> int:
        return sum(len(v) for v in self.files.get(domain, {}).values())

    def relpaths(self, domains: list[str] | None = None) -> list[str]:
        out: list[str] = []
        for d in domains or sorted(self.files):
            for c in sorted(self.files[d]):
                out.extend(f"{d}/{c}/{f}" for f in self.files[d][c])
        return out


def scan_tree(root: str | os.PathLike[str]) -> Tree:
    """Scan `root/<domain>/<class>/<file>`. Ignored names are skipped; stray files are listed as ignored."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: raw data folder not found")
    files: dict[str, dict[str, list[str]]] = {}
    ignored: list[LeftOut] = []
    for d in _entries(root):
        if is_ignored_name(d.name):
            continue
        if not d.is_dir():
            ignored.append(LeftOut(d.name, "file outside any domain folder"))
            continue
        files[d.name], more = scan_classes(d.path, d.name)
        ignored += more
    return Tree(root, files, ignored)
