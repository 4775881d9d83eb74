"""Checks on a raw `<domain>/<class>/<image>` tree, and the data report of the download stage.

Checks, in this order (the cheap ones first):
1. layout: the registry's domains are all present (error names the missing domain); every domain
   holds the registry's classes exactly (error names the domain and the missing/extra class); for
   a dataset whose classes are derived (imagefolder, miniDomainNet) every domain must hold the same
   class set (error names the domain that differs) and, where known, the number of classes matches;
2. counts: files per domain (and in total) equal the registry's expected counts (error names the
   domain, the count found and the count expected);
3. decoding: every file is decoded with `images.load_rgb` in a process pool; zero-byte, non-image,
   corrupt or truncated files are listed by relative path and reason. More than
   `max_bad_fraction` of bad files fails the run.

Count policy: the expected counts are counts of *files in the official archive*, so a file that
is present but cannot be decoded still counts toward its domain's count (a count mismatch means
missing or extra files: the wrong archive or version; unreadable files are a separate matter,
governed by `download.max_bad_fraction`). Files listed by a split file but absent from the archive
(miniDomainNet) count toward the expected count and are reported as bad. Bad files stay in the raw
tree (it mirrors the source); the partition stage skips them and lists them in its manifest.
Hidden files (`.DS_Store`, `._x`) and OS thumbnails (`Thumbs.db`) are not samples: they are
listed under `ignored` and neither counted nor decoded.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import TYPE_CHECKING

from fedccrl_core.data.images import RESIZE_POLICY, check_images
from fedccrl_core.data.registry import DatasetSpec
from fedccrl_core.data.tree import LeftOut, Tree, scan_tree
from fedccrl_core.foundation.errors import DataError

if TYPE_CHECKING:
    from fedccrl_core.data.source_record import SourceRecord

REPORT_VERSION = 1
COUNT_POLICY = (
    "expected counts are counts of files in the source (bad files included); "
    "bad files stay in the raw tree and are skipped by partition"
)


class ValidationError(DataError):
    """A failed check; `.report` holds the report (status 'failed') written for the user."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


def domain_order(spec: DatasetSpec, found: list[str] | set[str]) -> list[str]:
    """Registry order for registered domains; sorted discovered names for imagefolder."""
    return list(spec.domains) if spec.domains else sorted(found)


def check_layout(spec: DatasetSpec, tree: Tree) -> tuple[list[str], list[str]]:
    """Domains and classes against the registry; returns (domains in order, sorted classes)."""
    found = set(tree.files)
    if spec.domains:
        missing = [d for d in spec.domains if d not in found]
        if missing:
            raise DataError(
                f"{spec.name}: domain '{missing[0]}' is missing from {tree.root} "
                f"(missing: {', '.join(missing)}; found: {', '.join(sorted(found)) or 'nothing'})"
            )
        extra = sorted(found - set(spec.domains))
        if extra:
            raise DataError(
                f"{spec.name}: unexpected domain folder '{extra[0]}' in {tree.root} "
                f"(the registry's domains are {', '.join(spec.domains)})"
            )
    elif len(found) < 2:
        raise DataError(
            f"{spec.name}: {tree.root} holds {len(found)} domain folder(s) "
            f"({', '.join(sorted(found)) or 'none'}); domain generalization needs at least 2 "
            f"(layout <domain>/<class>/<image>)"
        )
    domains = domain_order(spec, found)
    if spec.classes is not None:
        want = set(spec.classes)
        for d in domains:
            have = set(tree.files[d])
            if have != want:
                miss, extra = sorted(want - have), sorted(have - want)
                what = f"class '{miss[0]}' is missing" if miss else f"unexpected class folder '{extra[0]}'"
                raise DataError(
                    f"{spec.name}: domain '{d}': {what} (missing: {', '.join(miss) or '-'}; "
                    f"extra: {', '.join(extra) or '-'})"
                )
        classes = sorted(want)
    else:
        union = set().union(*(set(tree.files[d]) for d in domains))
        for d in domains:
            have = set(tree.files[d])
            if have != union:
                miss = sorted(union - have)
                raise DataError(
                    f"{spec.name}: domain '{d}' lacks class(es) {', '.join(miss)} that other domains "
                    f"have; every domain must hold the same classes"
                )
        classes = sorted(union)
        if spec.expected_num_classes is not None and len(classes) != spec.expected_num_classes:
            raise DataError(f"{spec.name}: found {len(classes)} classes, expected {spec.expected_num_classes}")
    for d in domains:
        for c in classes:
            if not tree.files[d][c]:
                raise DataError(f"{spec.name}: domain '{d}', class '{c}' has no images")
    return domains, classes


def check_counts(spec: DatasetSpec, tree: Tree, domains: list[str], extra: dict[str, int] | None = None) -> None:
    """Files per domain (+ `extra` listed-but-missing files) against the registry's expected counts."""
    extra = extra or {}
    counts = {d: tree.count(d) + extra.get(d, 0) for d in domains}
    for d in domains:
        want = spec.expected_count(d) if spec.domains else None
        if want is not None and counts[d] != want:
            raise DataError(
                f"{spec.name}: domain '{d}' has {counts[d]:,} images, expected {want:,} "
                f"(registry count; wrong or incomplete archive?)"
            )
    total = sum(counts.values())
    if spec.total is not None and total != spec.total:
        raise DataError(f"{spec.name}: {total:,} images in all, expected {spec.total:,}")


def tree_digest(entries: list[tuple[str, str]]) -> str:
    """sha256 over `sha256sum`-style lines '<file sha256>  <relpath>' in sorted path order."""
    h = hashlib.sha256()
    for rel, digest in sorted(entries):
        h.update(f"{digest}  {rel}\n".encode())
    return h.hexdigest()


def _archive_sha256(source: SourceRecord | None):
    """The source archive's sha256 (one archive), {file: sha256} (several), or None (folder, generated)."""
    arch = (source.archives if source is not None else None) or []
    if len(arch) == 1:
        return arch[0].sha256
    return {a.file: a.sha256 for a in arch} or None


def _check_images(
    spec: DatasetSpec,
    tree: Tree,
    domains: list[str],
    missing: list[LeftOut],
    n: int,
    max_bad_fraction: float,
    report: dict,
    workers: int | None,
    progress: bool,
) -> None:
    """Decode every image of `domains` into the report's bad list and tree digest; a DataError when more than
    `max_bad_fraction` of the `n` images (the missing ones counted) are unreadable."""
    rels = tree.relpaths(domains)
    results = check_images([tree.root / r for r in rels], workers=workers, progress=progress)
    bad = [LeftOut(r, why) for r, (why, _) in zip(rels, results) if why is not None] + missing
    bad.sort(key=lambda b: b.path)
    report["n_bad"] = len(bad)
    report["bad_fraction"] = round(len(bad) / n, 6) if n else 0.0
    report["max_bad_fraction"] = max_bad_fraction
    report["bad"] = [dataclasses.asdict(b) for b in bad]
    report["tree_sha256"] = tree_digest([(r, dg) for r, (_, dg) in zip(rels, results) if dg])
    if n and len(bad) / n > max_bad_fraction:
        shown = "; ".join(f"{b.path} ({b.reason})" for b in bad[:5])
        raise DataError(
            f"{spec.name}: {len(bad)} of {n} images are unreadable ({len(bad) / n:.2%} > "
            f"download.max_bad_fraction {max_bad_fraction:.2%}): {shown}"
            f"{' ...' if len(bad) > 5 else ''}"
        )


def validate_tree(
    spec: DatasetSpec,
    root: str | os.PathLike,
    max_bad_fraction: float,
    *,
    source: SourceRecord | None = None,
    missing: list[LeftOut] | None = None,
    ignored: list[LeftOut] | None = None,
    warnings: list[str] | None = None,
    workers: int | None = None,
    progress: bool = True,
) -> dict:
    """Run all checks on `root`; return the report (status 'ok') or raise ValidationError with a report."""
    tree = scan_tree(root)
    missing = list(missing or [])
    report = {
        "report_version": REPORT_VERSION,
        "dataset": spec.name,
        "status": "failed",
        "error": None,
        "source": source.to_dict() if source is not None else {},
        "sha256": _archive_sha256(source),
        "count_policy": COUNT_POLICY,
        "resize_policy": RESIZE_POLICY,
        "warnings": list(warnings or []),
        "ignored": [dataclasses.asdict(i) for i in [*(ignored or []), *tree.ignored]],
    }
    try:
        domains, classes = check_layout(spec, tree)
        report.update(domains=domains, classes=classes)
        extra: dict[str, int] = {}
        for m in missing:
            d = m.path.split("/", 1)[0]
            extra[d] = extra.get(d, 0) + 1
        report["counts"] = {d: {c: len(tree.files[d][c]) for c in classes} for d in domains}
        totals = {d: tree.count(d) + extra.get(d, 0) for d in domains}
        report["domain_totals"] = totals
        report["total"] = total = sum(totals.values())
        report["expected"] = {
            "domain_totals": ({d: spec.expected_count(d) for d in domains} if spec.domain_counts else None),
            "total": spec.total,
        }
        check_counts(spec, tree, domains, extra)
        _check_images(spec, tree, domains, missing, total, max_bad_fraction, report, workers, progress)
    except DataError as e:
        report["error"] = str(e)
        raise ValidationError(str(e), report) from e
    report["status"] = "ok"
    return report
