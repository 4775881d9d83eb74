"""The shards' manifest (`manifest.json`, written by the partition stage, data/partition.py): its records, the one
reader of a stage's manifest (the shards', the pools' (pools.py)), and the questions asked of it: a domain by name
or held-out index, the training clients of a held-out run, the sites that only evaluate.

Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from fedccrl_core.foundation.errors import DataError
from fedccrl_core.foundation.records import Record, parse_record

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
RESIZE_POLICY_BEFORE = "resize SxS bilinear"  # what shards written before `resize_policy` was recorded used
MIXED = "mixed"  # the `domain` of a feddg_bench client holding examples of several domains


class ClientEntry(Record):
    """One client of the shard manifest: its shard file and sizes."""

    id: str
    domain: str  # MIXED for a feddg_bench client holding examples of several domains
    domain_index: int  # -1 for a MIXED client
    k: int
    file: str
    n_train: int
    n_val: int
    domain_counts: dict[str, int] | None = None  # feddg_bench only: examples per domain
    train_domain_counts: dict[str, int] | None = None  # feddg_bench only: training rows per domain
    train_class_hist: list[int]
    val_class_hist: list[int]

    def holds(self, domain: str) -> bool:
        """Whether the client holds examples of `domain`."""
        return domain in self.domain_counts if self.domain_counts is not None else self.domain == domain


class SkippedImage(Record):
    path: str  # relative to the raw root
    reason: str


class ShardManifest(Record):
    """The shards' manifest.json, written by `partition`, read by `load_manifest`."""

    format_version: int
    dataset: str
    domains: list[str]
    classes: list[str]
    num_classes: int
    image_size: int
    resize_policy: str | None = None  # absent in shards written before it was recorded
    layout: str
    seed: int
    params: dict[str, Any]  # the params.yaml values the shards were made with (dotted keys)
    domain_sizes: dict[str, int]
    clients: list[ClientEntry]
    skipped: list[SkippedImage]
    warnings: list[str] | None = None  # absent when none: a run's key hashes the manifest

    @property
    def resize(self) -> str:
        return self.resize_policy if self.resize_policy is not None else RESIZE_POLICY_BEFORE


# ---------------------------------------------------------------- the reader
M = TypeVar("M", bound=Record)


def read_manifest(folder: str | os.PathLike, what: str, stage: str, model: type[M], version: int = FORMAT_VERSION) -> M:
    """The one reader of a stage's manifest.json (the shards', the pools' (pools.py)): present, JSON, of the
    format version this code writes, and a `model`; DataError naming the file, the field and the stage to rerun."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path}: {what} manifest not found (run the {stage} stage)")
    st = path.stat()  # a manifest is parsed once per process: again only when its file was replaced or changed
    key = (str(path.resolve()), model, version, st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _PARSED:
        return _PARSED[key]
    manifest = _parse_manifest(path, what, stage, model, version)
    if len(_PARSED) >= 64:  # a process that reads many folders keeps the newest
        _PARSED.pop(next(iter(_PARSED)))
    _PARSED[key] = manifest
    return manifest


_PARSED: dict[tuple, Any] = {}  # read_manifest's: (path, model, version, the file's identity) -> the record


def _parse_manifest(path: Path, what: str, stage: str, model: type[M], version: int) -> M:
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: corrupt manifest ({e})") from e
    if not isinstance(m, dict):
        raise DataError(f"{path}: corrupt manifest (not a JSON object)")
    if "format_version" not in m:
        raise DataError(f"{path}: manifest lacks the field 'format_version'")
    if m["format_version"] != version:
        raise DataError(
            f"{path}: {what} format_version {m['format_version']} is not {version}; rerun the {stage} stage"
        )
    return parse_record(model, m, str(path))


def load_manifest(shards_dir: str | os.PathLike) -> ShardManifest:
    return read_manifest(shards_dir, "shard", "partition", ShardManifest)


# ---------------------------------------------------------------- questions asked of a manifest
def client_entry(manifest: ShardManifest, shards_dir: Path, cid: str) -> ClientEntry:
    """The manifest's entry of client `cid`; DataError naming the manifest and its clients when it has none."""
    for c in manifest.clients:
        if c.id == cid:
            return c
    raise DataError(
        f"{shards_dir / MANIFEST}: no client '{cid}' (clients: {', '.join(c.id for c in manifest.clients)})"
    )


def domain_name(manifest: ShardManifest, domain: str | int) -> str:
    """A domain given by name or by held-out index (registry order) -> its name."""
    doms = manifest.domains
    if isinstance(domain, (int, np.integer)) and not isinstance(domain, bool):
        if not 0 <= domain < len(doms):
            raise DataError(
                f"held-out index {domain} is out of range: {manifest.dataset} has domains "
                f"{', '.join(f'{i}={d}' for i, d in enumerate(doms))}"
            )
        return doms[int(domain)]
    if domain not in doms:
        raise DataError(f"domain '{domain}' is not in {manifest.dataset} (domains: {', '.join(doms)})")
    return str(domain)


def _has_rows_outside(entry: ClientEntry, skip: str | None) -> bool:
    counts = entry.train_domain_counts
    if counts is None:
        return entry.domain != skip
    return any(n > 0 for d, n in counts.items() if d != skip)


def client_ids(manifest: ShardManifest, exclude_domain: str | int | None = None) -> list[str]:
    """Client ids in manifest order, without the clients of `exclude_domain` (the held-out domain)."""
    skip = domain_name(manifest, exclude_domain) if exclude_domain is not None else None
    return [c.id for c in manifest.clients if _has_rows_outside(c, skip)]


def evaluation_sites(manifest: ShardManifest, held_out: str | int) -> list[str]:
    """Client ids in manifest order of the clients that hold only the held-out domain: in a Flower federation,
    the sites that evaluate the global model on it and never train (fedccrl_flower/evalsets.py)."""
    sources = set(client_ids(manifest, held_out))
    name = domain_name(manifest, held_out)
    return [c.id for c in manifest.clients if c.id not in sources and c.holds(name)]
