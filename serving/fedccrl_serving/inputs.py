"""What `fedccrl-serve` reads: files, folders (recursive) and glob patterns for `predict`, and a labelled
`<class>/<image>` folder for `evaluate`. Folders are walked by fedccrl_core/data/tree.py, with the project's one
rule for what is not a sample; a file that is not a regular file (a FIFO named x.jpg) is skipped with a notice and
never opened."""

from __future__ import annotations

import glob
from pathlib import Path

from fedccrl_core.data.tree import not_regular, subfolders, walk_files
from fedccrl_serving.console import Fatal, note

# What a folder walk picks up; a file named explicitly (or by a glob) is always tried.
IMAGE_SUFFIXES = (
    ".jpg",
    ".jpeg",
    ".jpe",
    ".jfif",
    ".png",
    ".bmp",
    ".gif",
    ".tif",
    ".tiff",
    ".webp",
    ".ppm",
    ".pgm",
    ".pbm",
    ".pnm",
)


def _regular(path: Path) -> bool:
    """False, with a notice naming the file and why, for a FIFO, socket or device: it is never opened."""
    why = not_regular(path)
    if why:
        note(f"skipped {path}: {why}")
    return why is None


def _walk(folder: Path) -> tuple[list[Path], int]:
    """Image files under folder (recursive, sorted, ignored names skipped) and the count of other files."""
    found, skipped = [], 0
    for path in walk_files(folder):
        if not path.name.lower().endswith(IMAGE_SUFFIXES):
            skipped += 1
        elif _regular(path):
            found.append(path)
    return found, skipped


def collect_inputs(specs: tuple[str, ...]) -> list[Path]:
    """Files, folders (recursive) and glob patterns -> an ordered, de-duplicated list of files."""
    out: list[Path] = []
    skipped = 0
    for spec in specs:
        p = Path(spec)
        if p.is_file():
            out.append(p)
        elif p.exists() and not p.is_dir():
            _regular(p)  # a FIFO, socket or device named explicitly: skipped with a notice
        elif p.is_dir():
            files, n_skip = _walk(p)
            if not files:
                raise Fatal(f"{spec}: folder has no image files ({', '.join(IMAGE_SUFFIXES[:6])}, ...)")
            out += files
            skipped += n_skip
        elif glob.has_magic(spec):
            matches = sorted(glob.glob(spec, recursive=True))
            if not matches:
                raise Fatal(f"{spec}: no file matches this pattern")
            for m in map(Path, matches):
                if m.is_dir():
                    files, n_skip = _walk(m)
                    out += files
                    skipped += n_skip
                elif _regular(m):
                    out.append(m)
        else:
            raise Fatal(f"{spec}: no such file or folder")
    if skipped:
        note(f"skipped {skipped} files without an image extension in the folders given")
    if not out:
        raise Fatal("no input images")
    return list(dict.fromkeys(out))


def labelled_files(folder: Path, classes: tuple[str, ...]) -> tuple[list[Path], list[int]]:
    """<folder>/<class>/<image...> -> (files, class indices). Unknown class folders are an error."""
    if not folder.is_dir():
        raise Fatal(f"{folder}: no such folder" if not folder.exists() else f"{folder}: not a folder")
    subdirs = subfolders(folder)
    if not subdirs:
        raise Fatal(f"{folder}: no class folders (expected <class>/<image> with classes {', '.join(classes)})")
    unknown = [d.name for d in subdirs if d.name not in classes]
    if unknown:
        raise Fatal(
            f"{folder}: class folders not among the model's classes: {', '.join(unknown)} "
            f"(model classes: {', '.join(classes)})"
        )
    files, labels = [], []
    for d in subdirs:
        found, _ = _walk(d)
        files += found
        labels += [classes.index(d.name)] * len(found)
    if not files:
        raise Fatal(f"{folder}: the class folders hold no image files")
    return files, labels
