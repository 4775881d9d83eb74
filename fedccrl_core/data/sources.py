"""Source resolution and the download stage: from `dataset.source` to a validated data/raw.

The jobs it combines live in their own modules: HTTP download (`http`), safe extraction
(`archives`), finding the dataset in a tree (`layout`), sha256 (`checksums`); the atomic output is
fedccrl_core.foundation.fsio's.

A *source* (params `dataset.source`) is one of
- `registry`: the registry's URL(s) for the dataset, or the generator for `synthetic`;
- an http(s) URL;
- a local archive (.zip, .tar, .tar.gz/.tgz; recognized by content, not by name);
- a local folder.

Checksums. A sha256 that is known (params `dataset.sha256`, or the registry's) is verified on the
archive BEFORE anything is extracted; a mismatch raises ChecksumError. `dataset.sha256` is one hex
string for a one-archive source, or a mapping {archive file name: sha256} for the registry's
multi-archive miniDomainNet source. A URL with no known sha256
is downloaded, its sha256 is computed and written to the report, and a warning on stderr asks the
user to pin `dataset.sha256`. An archive (local or downloaded) with no sha256 in params is hashed;
when the hash is one of the registry's known archives (e.g. shared/datasets/pacs/pacs_128.zip) the
report gives the registry's sha256 as `expected_sha256` and `"verified": true`.

Mirror. With the environment variable FEDCCRL_DATASET_MIRROR set to a base URL, `registry` fetches
each of the registry's archives from `<base>/<its file name>` (PACS: `<base>/PACS.zip`) instead of
its URL, with the same checksum checks; the report records the URL used. CI serves its local copies
this way (tests/test_readme_blocks.py); a site with its own copy of the datasets can do the same.

Safety (refused archive members) is described in `archives`, retries in `http`.

Atomicity. The output tree is built in a temporary folder next to `--out` and the archives are
downloaded and extracted in a scratch folder beside it (fedccrl_core.foundation.fsio: `.<out>.tmp-<pid>-<token>`,
`.<out>.work.tmp-<pid>-<token>`); the tree is renamed into place only after validation, replacing an
old `--out`; on any failure or interruption both are removed, so no half-finished `--out` and no
stray temp file is left (and a killed run's leftovers are removed by the next one).


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from fedccrl_core.data.archives import safe_extract
from fedccrl_core.data.checksums import sha256_file
from fedccrl_core.data.http import DEADLINE_S, download_url
from fedccrl_core.data.layout import find_imagefolder_root, find_registry_root, materialize, materialize_split_files
from fedccrl_core.data.source_record import ArchiveRecord, SourceRecord
from fedccrl_core.data.tree import LeftOut
from fedccrl_core.foundation.errors import ChecksumError, DataError
from fedccrl_core.foundation.fsio import atomic_dir, scratch_dir, write_json

MIRROR_ENV = "FEDCCRL_DATASET_MIRROR"


def registry_url(src) -> str:
    """Where the registry's archive `src` (a registry.Source) is fetched from: its URL, or the mirror's."""
    base = os.environ.get(MIRROR_ENV, "").strip()
    if not base:
        return src.url
    if not _is_url(base):
        raise DataError(f"environment variable {MIRROR_ENV}={base!r}: not an http(s) base URL")
    return f"{base.rstrip('/')}/{src.filename}"


def _is_url(s: str) -> bool:
    return s.startswith(("http://", "https://"))


def _expected_shas(sha256: str | dict[str, str] | None, n: int, names: list[str]) -> list[str | None]:
    """dataset.sha256: null, one hex string (one archive), or {archive file name: hex} (several); the hex is the
    schema's (foundation/hparams.py Sha256), how many and which archives the source's."""
    if sha256 is None:
        return [None] * n
    if isinstance(sha256, str):
        if n != 1:
            raise DataError(
                f"params.yaml: dataset.sha256 is one hash but the source has {n} archives "
                f"({', '.join(names)}); give a mapping {{file name: sha256}}"
            )
        return [sha256]
    unknown = sorted(set(sha256) - set(names))
    if unknown:
        raise DataError(
            f"params.yaml: dataset.sha256 names unknown archive '{unknown[0]}' (archives: {', '.join(names)})"
        )
    return [sha256.get(nm) for nm in names]


def _warn(msg: str, warnings: list[str]) -> None:
    warnings.append(msg)
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def _archive_name_from_url(url: str) -> str:
    from urllib.parse import urlparse

    name = Path(urlparse(url).path).name
    return name if name and name not in ("download", "uc") else "archive"


def _archive_record(file: str, digest: str, want: str | None, spec, url=None, path=None) -> ArchiveRecord:
    """The record of the archive `file` (from `url` or `path`) whose sha256 is `digest`: a mismatch with `want` was
    refused before this."""
    known = spec.known_archive(digest)
    expected = want or (known.sha256 if known else None)
    return ArchiveRecord(file, url, path, digest, expected, expected == digest, known.filename if known else None)


def _fetch_urls(
    urls: list[tuple[str, str, str | None]],
    work: Path,
    timeout_s,
    retries,
    backoff_s,
    progress,
    warnings: list[str],
    spec,
    deadline_s=DEADLINE_S,
) -> list[tuple[Path, ArchiveRecord]]:
    """Download each (url, filename, expected sha256) into work/; return (path, archive record)."""
    out: list[tuple[Path, ArchiveRecord]] = []
    for url, fname, want in urls:
        dest = work / f"{len(out)}-{fname}"
        digest = download_url(
            url,
            dest,
            sha256=want,
            timeout_s=timeout_s,
            retries=retries,
            backoff_s=backoff_s,
            progress=progress,
            label=fname,
            deadline_s=deadline_s,
        )
        rec = _archive_record(fname, digest, want, spec, url=url)
        if not rec.verified:
            _warn(
                f"{url}: no sha256 is known for {fname}; its sha256 is {digest}. Pin it in params.yaml "
                f"(dataset.sha256: {digest}) so a changed file is caught",
                warnings,
            )
        out.append((dest, rec))
    return out


def _local_archive(path: Path, want: str | None, spec) -> ArchiveRecord:
    """Hash a local archive and verify it against `want` BEFORE anything is extracted."""
    digest = sha256_file(path)
    if want and digest != want:
        raise ChecksumError(
            f"{path}: sha256 mismatch: expected {want} (dataset.sha256), got {digest}; nothing was extracted"
        )
    return _archive_record(path.name, digest, want, spec, path=str(path))


def _remote_urls(spec, source: str, sha256) -> tuple[str, list[tuple[str, str, str | None]]] | None:
    """A `registry` or http(s) source: (its kind, its (url, file name, expected sha256) list); None otherwise."""
    if source == "registry":  # a dataset with a download: the schema's (pipeline params.py check_config)
        if not spec.sources:
            raise DataError(f"params.yaml: dataset.source 'registry': the registry has no download for {spec.name!r}")
        names = [s.filename for s in spec.sources]
        params_sha = _expected_shas(sha256, len(names), names)
        return "registry", [(registry_url(s), s.filename, p or s.sha256) for s, p in zip(spec.sources, params_sha)]
    if _is_url(source):
        fname = _archive_name_from_url(source)
        reg = next((s for s in spec.sources if s.url == source), None)
        want = _expected_shas(sha256, 1, [fname])[0] or (reg.sha256 if reg else None)
        return "url", [(source, fname, want)]
    return None


def _local_source(spec, source: str, sha256, work: Path, src_rec: SourceRecord, progress: bool) -> tuple[Path, bool]:
    """A local folder or archive: (the tree to map, whether its files may be moved); the archive extracted into
    work/extract after its sha256 is checked."""
    p = Path(source).expanduser()
    if p.is_dir():
        if sha256 is not None:
            raise DataError(f"params.yaml: dataset.sha256 does not apply to a folder source ({p})")
        src_rec.kind, src_rec.path = "folder", str(p.resolve())
        return p, False
    if p.is_file():
        want = _expected_shas(sha256, 1, [p.name])[0]
        rec = _local_archive(p, want, spec)
        safe_extract(p, work / "extract", progress=progress)
        src_rec.kind, src_rec.archives = "archive", [rec]
        return work / "extract", True
    raise DataError(
        f"params.yaml: dataset.source {source!r} is neither 'registry', an http(s) URL, nor an existing file or folder"
    )


def _map_tree(spec, top: Path, stage: Path, move: bool, src_rec: SourceRecord) -> tuple[list[LeftOut], list[LeftOut]]:
    """Lay `top`'s images out as stage/<domain>/<class>/<image>: (missing, ignored)."""
    from fedccrl_core.data import registry

    if spec.layout == registry.LAYOUT_SPLIT_FILES:
        src_rec.root = "splits_mini/.."
        return materialize_split_files(top, spec, stage, move)
    if spec.domains:
        root, ddirs = find_registry_root(top, spec)
    else:
        root, ddirs = find_imagefolder_root(top)
    src_rec.root = str(root.relative_to(top)) if root != top else "."
    src_rec.domain_folders = {d: p.name for d, p in ddirs.items()}
    return [], materialize(ddirs, stage, move)


def _obtain(spec, source: str, sha256, seed: int, stage: Path, work: Path, fetch, progress: bool):
    """Fill `stage` from `source` (generated, downloaded, extracted or copied): (the report's source record,
    missing, ignored). fetch(urls) downloads into `work` (_fetch_urls)."""
    from fedccrl_core.data import registry, synthetic

    if source == "registry" and spec.layout == registry.LAYOUT_GENERATED:  # sha256 null: the schema's
        n = synthetic.generate(stage, seed=seed, progress=progress)
        per_class = synthetic.IMAGES_PER_CLASS
        generated = SourceRecord(
            source, "generated", generator=synthetic.__name__, seed=seed, images_per_class=per_class, images=n
        )
        return generated, [], []
    src_rec = SourceRecord(source)
    remote = _remote_urls(spec, source, sha256)
    if remote is None:
        top, move = _local_source(spec, source, sha256, work, src_rec, progress)
    else:
        src_rec.kind, urls = remote
        fetched = fetch(urls)
        top, move = work / "extract", True
        for path, _ in fetched:
            safe_extract(path, top, progress=progress)
            path.unlink()
        src_rec.archives = [rec for _, rec in fetched]
    missing, ignored = _map_tree(spec, top, stage, move, src_rec)
    return src_rec, missing, ignored


def _validated(spec, stage: Path, report_path, max_bad_fraction: float, workers, progress: bool, **found) -> dict:
    """validate_tree's report on `stage`, written to `report_path` (also when validation fails)."""
    from fedccrl_core.data import validate

    try:
        report = validate.validate_tree(spec, stage, max_bad_fraction, workers=workers, progress=progress, **found)
    except validate.ValidationError as e:
        if report_path is not None and e.report is not None:
            write_json(report_path, e.report, indent=2, ensure_ascii=False)
        raise
    if report_path is not None:
        write_json(report_path, report, indent=2, ensure_ascii=False)
    return report


def prepare_raw(
    spec,
    source: str,
    out: str | os.PathLike,
    report_path: str | os.PathLike | None,
    *,
    sha256: str | dict[str, str] | None = None,
    seed: int = 0,
    timeout_s: float = 60,
    retries: int = 3,
    backoff_s: float = 1.0,
    max_bad_fraction: float = 0.01,
    workers: int | None = None,
    progress: bool = True,
    deadline_s: float | None = DEADLINE_S,
) -> dict:
    """The download stage: obtain `source`, extract safely, map to out/<domain>/<class>/<image>, validate.

    `spec` is a DatasetSpec (see registry.get_dataset). Writes the report JSON to `report_path`
    (also with status 'failed' when validation fails) and returns it. `out` appears only complete.
    """
    t0 = time.monotonic()
    out = Path(out)
    warnings: list[str] = []
    with atomic_dir(out) as stage:
        with scratch_dir(out.with_name(f"{out.name}.work")) as work:

            def fetch(urls):
                return _fetch_urls(urls, work, timeout_s, retries, backoff_s, progress, warnings, spec, deadline_s)

            src_rec, missing, ignored = _obtain(spec, source, sha256, seed, stage, work, fetch, progress)
        if progress:
            print(f"download: source ready in {time.monotonic() - t0:.1f}s; validating", file=sys.stderr, flush=True)
        report = _validated(
            spec,
            stage,
            report_path,
            max_bad_fraction,
            workers,
            progress,
            source=src_rec,
            missing=missing,
            ignored=ignored,
            warnings=warnings,
        )
    if progress:
        print(
            f"download: {report['total']} images in {len(report['domains'])} domains -> {out} "
            f"({report['n_bad']} bad) in {time.monotonic() - t0:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    return report
