"""Safe extraction of .zip and .tar(.gz) archives (recognized by content, not by name).

Every archive member must land inside the extraction directory: absolute names, `..`
components, drive letters, symlinks or hardlinks whose target leaves the directory, and tar
device/FIFO members are refused with UnsafeArchiveError naming the member. All members are
checked before the first byte is written. Links that stay inside are materialized as copies of
their target (data/raw never holds links). Regular files are written with no permission, owner or
time metadata applied: a tar member through Python's own `tarfile` extraction with `filter="data"`
(PEP 706), which refuses the same unsafe members again (a second line of defence, never the first:
our checks run on every member before anything is written, and name it); a zip member streamed out
(zipfile has no such filter).


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tarfile
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from fedccrl_core.data.checksums import CHUNK, fmt_mb
from fedccrl_core.foundation.errors import DataError, UnsafeArchiveError
from fedccrl_core.foundation.progress import progress as counter


def member_path(name: str) -> PurePosixPath | None:
    """Normalized relative path of an archive member, or None if it is unsafe (absolute, .., drive)."""
    n = name.replace("\\", "/")
    if n.startswith("/") or (len(n) >= 2 and n[1] == ":") or "\x00" in n:
        return None
    parts = [p for p in n.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        return None
    return PurePosixPath(*parts) if parts else PurePosixPath(".")


def _link_target_inside(member: PurePosixPath, target: str, symlink: bool) -> PurePosixPath | None:
    """Where a link points, relative to the extraction root; None if it escapes the root."""
    t = target.replace("\\", "/")
    if t.startswith("/") or (len(t) >= 2 and t[1] == ":"):
        return None
    base = list(member.parent.parts) if symlink else []  # hardlink targets are archive-root relative
    for p in t.split("/"):
        if p in ("", "."):
            continue
        if p == "..":
            if not base:
                return None
            base.pop()
        else:
            base.append(p)
    return PurePosixPath(*base) if base else None


@dataclass
class _Plan:
    files: list = field(default_factory=list)  # (member handle, relpath)
    dirs: list = field(default_factory=list)  # relpath
    links: list = field(default_factory=list)  # (relpath, target relpath)
    total_bytes: int = 0


def _plan_zip(zf: zipfile.ZipFile, archive: Path) -> _Plan:
    plan = _Plan()
    for info in zf.infolist():
        rel = member_path(info.filename)
        if rel is None:
            raise UnsafeArchiveError(
                f"{archive}: unsafe member {info.filename!r} (absolute path or '..'); nothing was extracted"
            )
        mode = (info.external_attr >> 16) & 0xFFFF
        if stat.S_ISLNK(mode):
            target = zf.read(info).decode("utf-8", "replace")
            inside = _link_target_inside(rel, target, symlink=True)
            if inside is None:
                raise UnsafeArchiveError(
                    f"{archive}: symlink member {info.filename!r} -> {target!r} points "
                    f"outside the extraction directory; nothing was extracted"
                )
            plan.links.append((rel, inside))
            continue
        if info.flag_bits & 0x1:
            raise DataError(f"{archive}: member {info.filename!r} is encrypted")
        if info.is_dir() or str(rel) == ".":
            plan.dirs.append(rel)
            continue
        if mode and not (stat.S_ISREG(mode) or stat.S_IFMT(mode) == 0):
            raise UnsafeArchiveError(
                f"{archive}: member {info.filename!r} is not a regular file (mode {oct(mode)}); nothing was extracted"
            )
        plan.files.append((info, rel))
        plan.total_bytes += info.file_size
    return plan


def _plan_tar(tf: tarfile.TarFile, archive: Path) -> _Plan:
    plan = _Plan()
    for m in tf.getmembers():
        rel = member_path(m.name)
        if rel is None:
            raise UnsafeArchiveError(
                f"{archive}: unsafe member {m.name!r} (absolute path or '..'); nothing was extracted"
            )
        if m.ischr() or m.isblk() or m.isfifo() or m.isdev():
            raise UnsafeArchiveError(f"{archive}: member {m.name!r} is a device or FIFO; nothing was extracted")
        if m.issym() or m.islnk():
            inside = _link_target_inside(rel, m.linkname, symlink=m.issym())
            if inside is None:
                kind = "symlink" if m.issym() else "hardlink"
                raise UnsafeArchiveError(
                    f"{archive}: {kind} member {m.name!r} -> {m.linkname!r} points outside "
                    f"the extraction directory; nothing was extracted"
                )
            plan.links.append((rel, inside))
            continue
        if m.isdir() or str(rel) == ".":
            plan.dirs.append(rel)
            continue
        if not m.isfile():
            raise UnsafeArchiveError(f"{archive}: member {m.name!r} has an unsupported type; nothing was extracted")
        plan.files.append((m, rel))
        plan.total_bytes += m.size
    return plan


def archive_kind(path: str | os.PathLike) -> str | None:
    """'zip' or 'tar' by content (magic bytes), else None."""
    path = Path(path)
    if zipfile.is_zipfile(path):
        return "zip"
    try:
        if tarfile.is_tarfile(path):
            return "tar"
    except OSError:
        return None
    return None


def _open(archive: Path, kind: str) -> zipfile.ZipFile | tarfile.TarFile:
    try:
        if kind == "zip":
            return zipfile.ZipFile(archive)
        return tarfile.open(archive, "r:*")
    except (zipfile.BadZipFile, tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"{archive}: cannot open archive ({e})") from e


def _extract_member(ar: zipfile.ZipFile | tarfile.TarFile, member, rel: Path, dest: Path, archive: Path) -> None:
    """One checked regular file out of the archive, never over an existing file."""
    target = dest / rel
    if target.exists():
        raise DataError(f"{archive}: member {str(rel)!r} would overwrite an existing file")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        if isinstance(ar, zipfile.ZipFile):
            with ar.open(member) as src, open(target, "xb") as f:
                shutil.copyfileobj(src, f, CHUNK)
        else:  # the member under its checked, normalized name
            ar.extract(member.replace(name=str(rel), deep=False), dest, set_attrs=False, filter="data")
    except tarfile.FilterError as e:
        raise UnsafeArchiveError(
            f"{archive}: member {member.name!r} refused by tarfile's data filter ({e}); nothing usable was extracted"
        ) from e
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise DataError(f"{archive}: cannot extract member {str(rel)!r} ({e})") from e


def _copy_links(plan: _Plan, dest: Path, archive: Path, progress: bool) -> None:
    """A link inside the archive becomes a copy of its target file; one whose target is no file is skipped."""
    for rel, target_rel in plan.links:
        src, dst = dest / target_rel, dest / rel
        if src.is_file() and not src.is_symlink() and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
        elif progress:
            print(
                f"extract {archive.name}: skipped link {str(rel)!r} -> {str(target_rel)!r} "
                f"(target is not a file in the archive)",
                file=sys.stderr,
                flush=True,
            )


def safe_extract(archive: str | os.PathLike, dest: str | os.PathLike, progress: bool = True) -> int:
    """Extract a zip or tar(.gz/.bz2/.xz) archive into `dest`, refusing anything unsafe.

    Every member is checked first (UnsafeArchiveError naming it); then regular files are streamed
    out. Returns the number of files written. `dest` may already hold files from another archive;
    a member that would overwrite an existing file is an error.
    """
    archive, dest = Path(archive), Path(dest)
    kind = archive_kind(archive)
    if kind is None:
        raise DataError(f"{archive}: not a zip or tar archive")
    dest.mkdir(parents=True, exist_ok=True)
    with _open(archive, kind) as ar:
        try:
            plan = _plan_zip(ar, archive) if isinstance(ar, zipfile.ZipFile) else _plan_tar(ar, archive)
        except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as e:
            raise DataError(f"{archive}: corrupt archive ({e})") from e
        free = shutil.disk_usage(dest).free
        if plan.total_bytes > free:
            raise DataError(
                f"{archive}: needs {fmt_mb(plan.total_bytes)} to extract but only {fmt_mb(free)} "
                f"is free next to the output"
            )
        for rel in plan.dirs:
            (dest / rel).mkdir(parents=True, exist_ok=True)
        bar = counter(len(plan.files), f"extract {archive.name}", progress)
        for member, rel in plan.files:
            _extract_member(ar, member, rel, dest, archive)
            bar.update(1)
        bar.close()
        _copy_links(plan, dest, archive, progress)
    return len(plan.files)
