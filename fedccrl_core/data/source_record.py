"""The data report's `source` (data/download.json): what dataset.source said and what it turned out to be, filled in
by the download stage as it obtains the source (sources.py) and read by validation (validate.py) for the report.

Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ArchiveRecord:
    """A source archive as the data report's source lists it: its file name, where it came from (`url`, downloaded,
    or `path`, a local file; the other one None), its sha256, the expected sha256 (params' dataset.sha256, else the
    registry's when the archive is one it knows by hash), whether they agree, and the registry's name for it."""

    file: str
    url: str | None
    path: str | None
    sha256: str
    expected_sha256: str | None
    verified: bool
    known_as: str | None

    def to_dict(self) -> dict:
        """The report's entry: the fields in declaration order, of `url` and `path` only the one it came from."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None or k not in ("url", "path")}


@dataclass
class SourceRecord:
    """The data report's `source`, filled in as the source is obtained: what dataset.source said (`param`), what it
    was (`kind`: generated, folder, archive, url or registry), a folder's `path`, a generated tree's generator, seed
    and counts, the archives, then where the domains were found (`root`, and `domain_folders` by domain)."""

    param: str
    kind: str | None = None
    path: str | None = None
    generator: str | None = None
    seed: int | None = None
    images_per_class: int | None = None
    images: int | None = None
    archives: list[ArchiveRecord] | None = None
    root: str | None = None
    domain_folders: dict[str, str] | None = None

    def to_dict(self) -> dict:
        """The report's entry: the fields set, in declaration order, each archive as its entry."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):  # the archives (the one list)
                value = [a.to_dict() for a in value]
            if value is not None:
                out[f.name] = value
        return out
