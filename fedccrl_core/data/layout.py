"""Finding a dataset inside an extracted tree and laying it out as out/<domain>/<class>/<image>.

A tree is recognized by the registry's domain names (`find_registry_root`), as a plain image folder
(`find_imagefolder_root`), or through miniDomainNet's split files (`materialize_split_files`).


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from fedccrl_core.data.archives import member_path
from fedccrl_core.data.images import is_ignored_name
from fedccrl_core.data.tree import LeftOut, scan_classes, subfolders
from fedccrl_core.foundation.errors import DataError

_MAX_DEPTH = 5


def _subdirs(p: Path) -> list[Path]:
    try:
        return subfolders(p)
    except OSError:  # an unreadable folder holds no dataset: the search goes on elsewhere
        return []


def _walk_dirs(top: Path, depth: int = _MAX_DEPTH):
    """Breadth-first directories under `top` (itself first), at most `depth` levels deep."""
    level = [top]
    for _ in range(depth + 1):
        nxt = []
        for d in level:
            yield d
            nxt.extend(_subdirs(d))
        level = nxt


def find_registry_root(top: Path, spec) -> tuple[Path, dict[str, Path]]:
    """The folder whose children are the registry's domain folders (e.g. `PACS/`, `kfold/`).

    Returns (root, {registry domain: folder}). DataError naming the missing domain(s) otherwise.
    """
    best: tuple[int, Path | None, dict] = (0, None, {})
    for d in _walk_dirs(top):
        mapping: dict[str, Path] = {}
        for child in _subdirs(d):
            canon = spec.canonical_domain(child.name)
            if canon is not None and canon not in mapping:
                mapping[canon] = child
        if len(mapping) == len(spec.domains):
            return d, mapping
        if len(mapping) > best[0]:
            best = (len(mapping), d, mapping)
    if best[1] is None:
        raise DataError(
            f"{spec.name}: none of the domain folders {', '.join(spec.domains)} was found in the "
            f"source (searched {_MAX_DEPTH} levels deep)"
        )
    missing = [d for d in spec.domains if d not in best[2]]
    raise DataError(
        f"{spec.name}: domain '{missing[0]}' is missing from the source (found "
        f"{', '.join(sorted(best[2]))} in {best[1].relative_to(top) if best[1] != top else '.'}; "
        f"missing: {', '.join(missing)})"
    )


def _has_files_at_depth(d: Path, depth: int) -> bool:
    """True if some regular file (not an ignored name) sits exactly `depth` folder levels below d (d/x/.../file)."""
    if depth == 0:
        try:
            return any(c.is_file() and not is_ignored_name(c.name) for c in d.iterdir())
        except OSError:
            return False
    return any(_has_files_at_depth(c, depth - 1) for c in _subdirs(d))


def _first_file(top: Path, depth: int = _MAX_DEPTH + 2) -> Path | None:
    """The first regular file breadth-first under `top` (sorted, ignored names skipped), or None."""
    for d in _walk_dirs(top, depth):
        try:
            files = sorted(c for c in d.iterdir() if c.is_file() and not is_ignored_name(c.name))
        except OSError:
            continue
        if files:
            return files[0]
    return None


def find_imagefolder_root(top: Path) -> tuple[Path, dict[str, Path]]:
    """Strip wrapper folders (`mydata/`, or `export/mydata/`: each holding one folder and no images of its
    own at the class level) until the children are <domain>/<class>/<image>. A single folder whose
    children hold images is a domain (a one-domain dataset), never a wrapper."""
    root = top
    for _ in range(_MAX_DEPTH):
        subs = _subdirs(root)
        if (
            len(subs) == 1
            and not _has_files_at_depth(subs[0], 1)
            and any(_has_files_at_depth(subs[0], k) for k in range(2, _MAX_DEPTH + 1))
        ):
            root = subs[0]
            continue
        break
    subs = _subdirs(root)
    if not subs or not any(_has_files_at_depth(s, 1) for s in subs):
        raise DataError(f"imagefolder: no <domain>/<class>/<image> tree found in the source: {_why_not(top, root)}")
    return root, {s.name: s for s in subs}


def _why_not(top: Path, root: Path) -> str:
    """What the source holds instead of <domain>/<class>/<image>, for the error message."""
    first = _first_file(top)
    if first is None:
        return f"it holds no files (searched {_MAX_DEPTH + 2} folder levels)"
    depth = len(first.relative_to(root).parts) - 1  # folders between root and the file
    where = f"below the wrapper folder(s) {root.relative_to(top).as_posix()}/" if root != top else "below the source"
    found = (
        f"images must sit 2 folder levels down (<domain>/<class>/<image>), but the first file, "
        f"{first.relative_to(top).as_posix()}, is {depth} folder level(s) {where}"
    )
    if depth < 2:
        return f"{found}; add the missing <domain>/ or <class>/ folder(s)"
    subs = _subdirs(root)
    return (
        f"{found}; a wrapper folder is stripped only when it holds a single folder, and this level holds "
        f"{len(subs)} ({', '.join(s.name for s in subs[:4])}{', ...' if len(subs) > 4 else ''}): point "
        f"dataset.source at the folder whose children are the domains"
    )


def materialize(domain_dirs: dict[str, Path], out: Path, move: bool) -> list[LeftOut]:
    """Build out/<domain>/<class>/<file> from the found domain folders; returns the entries passed over."""
    ignored: list[LeftOut] = []
    put = os.rename if move else shutil.copyfile
    for domain, ddir in domain_dirs.items():
        (out / domain).mkdir(parents=True, exist_ok=True)
        classes, more = scan_classes(ddir, domain)
        ignored += more
        for c, names in classes.items():
            (out / domain / c).mkdir(exist_ok=True)
            for name in names:
                put(ddir / c / name, out / domain / c / name)
    return ignored


def materialize_split_files(top: Path, spec, out: Path, move: bool) -> tuple[list[LeftOut], list[LeftOut]]:
    """miniDomainNet (Dassl): keep exactly the images listed in splits_mini/<domain>_{train,test}.txt.

    Each line is '<domain>/<class>/<file> <label>'. Returns (missing, ignored): files listed but
    absent, and duplicate lines. The class list is derived from the listed class folders.
    """
    split_dir = next((d for d in _walk_dirs(top) if d.name == "splits_mini"), None)
    if split_dir is None:
        raise DataError(f"{spec.name}: no splits_mini/ folder with the miniDomainNet split files in the source")
    root = split_dir.parent
    missing: list[LeftOut] = []
    ignored: list[LeftOut] = []
    seen: set[str] = set()
    label_of: dict[str, str] = {}
    for domain in spec.domains:
        for split in ("train", "test"):
            fpath = split_dir / f"{domain}_{split}.txt"
            if not fpath.is_file():
                raise DataError(f"{spec.name}: split file {fpath.name} is missing from splits_mini/")
            for ln, line in enumerate(fpath.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                parts = line.split()
                if len(parts) != 2:
                    raise DataError(f"{spec.name}: {fpath.name} line {ln}: expected '<path> <label>', got {line!r}")
                rel = member_path(parts[0])
                if rel is None or len(rel.parts) < 3:
                    raise DataError(f"{spec.name}: {fpath.name} line {ln}: bad image path {parts[0]!r}")
                cls = rel.parts[-2]
                if label_of.setdefault(cls, parts[1]) != parts[1]:
                    raise DataError(
                        f"{spec.name}: {fpath.name} line {ln}: class '{cls}' has label {parts[1]}, "
                        f"elsewhere {label_of[cls]}"
                    )
                dst_rel = f"{domain}/{cls}/{rel.parts[-1]}"
                if dst_rel in seen:
                    ignored.append(LeftOut(dst_rel, f"listed twice (again in {fpath.name})"))
                    continue
                seen.add(dst_rel)
                src = root / rel
                if not src.is_file():
                    missing.append(LeftOut(dst_rel, f"listed in {fpath.name} but missing from the source"))
                    continue
                (out / domain / cls).mkdir(parents=True, exist_ok=True)
                (os.rename if move else shutil.copyfile)(src, out / dst_rel)
    return missing, ignored
