"""Partition (FedCCRL Sec. 3.1) and the client shard format.

Each source domain S_i is split into K clients D_j, disjoint and complete (union of a domain's
clients = S_i). Client id `<domain>_c<k>`, k = 0..K-1. Each client's samples are then split into
train/val with `val_fraction`, stratified by class (the reference protocol's 90/10 split).

- Default (dirichlet_alpha = null): stratified even split: each class's shuffled samples are dealt
  to the K clients in turn (the dealing position carries over from class to class), so client
  sizes differ by at most one and every client gets the domain's class mix.
- Label skew (dirichlet_alpha = a > 0): for each class, client shares p ~ Dirichlet(a * 1_K); the
  class's shuffled samples are cut at the cumulative shares. Redrawn (up to 1000 times) until every
  client has at least MIN_CLIENT_SAMPLES samples.

Randomness: numpy Generator seeded by SeedSequence([partition.seed, domain index]), so a domain's
split does not depend on the other domains.

Images are decoded ONCE here (`images.load_rgb` + `images.resize_u8`, RESIZE_POLICY) at the
resolved `preprocess.image_size`; unreadable files are skipped and listed in the manifest. `decode_labelled` and
`write_client` are the one decoder and writer of a client's shard: a site that prepares its own data (site.py)
uses them too.
Storage: one uncompressed `<client_id>.npz` per client holding train_x uint8 [n, S, S, 3] (NHWC),
train_y int64 [n], train_paths str [n] (relative to the raw root), and the same for val_*; plus
`manifest.json`. A held-out domain's test set is the union of its clients' train + val
(`load_domain_test`), so nothing is stored twice.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import json
import os
import struct
import sys
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

import numpy as np

from fedccrl_core.data.images import RESIZE_POLICY, decode_images
from fedccrl_core.foundation.errors import DataError
from fedccrl_core.foundation.records import Record, parse_record

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_KEYS = ("train_x", "train_y", "train_paths", "val_x", "val_y", "val_paths")
MIN_CLIENT_SAMPLES = 2
# Supervised contrastive alignment (FedCCRL Eq. 11) needs, for a sample i, positives P(i) = other samples
# of its class: a client with fewer than 2 training images of a class cannot form them, and its class
# signal is one image. A domain whose smallest class has fewer than this many images per client is warned of.
MIN_IMAGES_PER_CLASS_PER_CLIENT = 2
_DIRICHLET_TRIES = 1000
LAYOUT = "uint8 NHWC [n, S, S, 3]; labels int64; paths relative to the raw root"
RESIZE_POLICY_BEFORE = "resize SxS bilinear"  # what shards written before `resize_policy` was recorded used


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


@dataclass
class ClientShard:
    client_id: str
    domain: str
    train_x: np.ndarray  # uint8 [n_train, S, S, 3] NHWC
    train_y: np.ndarray  # int64 [n_train]
    val_x: np.ndarray  # uint8 [n_val, S, S, 3]
    val_y: np.ndarray  # int64 [n_val]
    train_paths: np.ndarray  # str [n_train], relative to the raw root
    val_paths: np.ndarray  # str [n_val]
    train_rows: np.ndarray | None = None  # rows of the stored shard kept (None: all; see load_client exclude_domain)

    @property
    def n_train(self) -> int:
        return int(self.train_y.shape[0])

    @property
    def n_val(self) -> int:
        return int(self.val_y.shape[0])


def client_id(domain: str, k: int) -> str:
    return f"{domain}_c{k}"


# ---------------------------------------------------------------- splitting (pure functions on labels)
def assign_clients(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, dirichlet_alpha: float | None = None
) -> list[np.ndarray]:
    """Indices of `labels` per client: stratified even split, or Dirichlet(alpha) label skew."""
    labels = np.asarray(labels)
    classes = np.unique(labels)
    if dirichlet_alpha is None:
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        pos = 0
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            owner = (pos + np.arange(idx.size)) % num_clients
            for k in range(num_clients):
                parts[k].append(idx[owner == k])
            pos += idx.size
        return [np.sort(np.concatenate(p)) if p else np.empty(0, np.int64) for p in parts]
    if len(labels) < MIN_CLIENT_SAMPLES * num_clients:
        raise DataError(
            f"partition: {len(labels)} samples cannot give {num_clients} clients {MIN_CLIENT_SAMPLES} samples each"
        )
    for _ in range(_DIRICHLET_TRIES):
        parts = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            p = rng.dirichlet(np.full(num_clients, float(dirichlet_alpha)))
            cuts = (np.cumsum(p)[:-1] * idx.size).astype(int)
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].append(chunk)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(o.size for o in out) >= MIN_CLIENT_SAMPLES:
            return out
    raise DataError(
        f"partition: no Dirichlet({dirichlet_alpha}) draw in {_DIRICHLET_TRIES} tries gave every "
        f"client {MIN_CLIENT_SAMPLES}+ samples; raise partition.dirichlet_alpha or lower "
        f"partition.clients_per_domain"
    )


def split_train_val(
    idx: np.ndarray, labels: np.ndarray, val_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Stratified train/val split of a client's indices.

    Class c gets floor(f * n_c) val samples, and the remaining round(f * n) - sum floors go to the
    classes with the largest fractional parts (ties: lower class id), so the client's val size is
    round(f * n) and each class's share is within one sample of f * n_c.
    """
    idx = np.asarray(idx)
    if val_fraction == 0 or idx.size == 0:
        return np.sort(idx), np.empty(0, dtype=idx.dtype)
    y = labels[idx]
    classes = np.unique(y)
    n_c = np.array([(y == c).sum() for c in classes])
    quota = val_fraction * n_c
    take = np.floor(quota).astype(int)
    extra = round(val_fraction * idx.size) - int(take.sum())
    order = sorted(range(len(classes)), key=lambda i: (-(quota[i] - take[i]), i))
    for i in order[: max(0, extra)]:
        take[i] += 1
    val, train = [], []
    for c, t in zip(classes, take):
        members = rng.permutation(idx[y == c])
        t = min(t, members.size - 1) if members.size > 1 else 0  # never empty a class's train side
        val.append(members[:t])
        train.append(members[t:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


Scheme = Literal["per_domain", "reference", "feddg_bench"]  # params.yaml partition.scheme
SCHEMES: tuple[str, ...] = get_args(Scheme)
MIXED = "mixed"  # the `domain` of a feddg_bench client holding examples of several domains


def client_splits(
    labels: np.ndarray,
    num_clients: int,
    val_fraction: float,
    rng: np.random.Generator,
    dirichlet_alpha: float | None = None,
    scheme: Literal["per_domain", "reference"] = "per_domain",
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train, val) indices of each of a domain's clients.

    per_domain: clients first (`assign_clients`), then each client's own stratified `split_train_val`.
    reference: the reference FedCCRL code's split (SanphouWang/FedCCRL data/partition_data.py:128-165,
      so that its runs can be reproduced): an unstratified random val_fraction of the whole domain is validation, and the
      rest is dealt to the clients (`assign_clients`); the domain's validation examples are cut into
      near-equal random parts, one per client, so the union of the clients' val splits (the source
      validation set) is the pooled per-domain validation of the reference.
    """
    if scheme == "reference":
        perm = rng.permutation(len(labels))
        n_val = round(val_fraction * len(labels))
        val, train = perm[:n_val], np.sort(perm[n_val:])
        tr_parts = [train[i] for i in assign_clients(labels[train], num_clients, rng, dirichlet_alpha)]
        va_parts = np.array_split(val, num_clients)
        return [(t, np.sort(v)) for t, v in zip(tr_parts, va_parts)]
    return [
        split_train_val(idx, labels, val_fraction, rng)
        for idx in assign_clients(labels, num_clients, rng, dirichlet_alpha)
    ]


# ---------------------------------------------------------------- the partition stage
def _hist(y: np.ndarray, num_classes: int) -> list[int]:
    return np.bincount(y, minlength=num_classes).astype(int).tolist()


def small_domain_warning(
    domain: str,
    y: np.ndarray,
    classes: list[str],
    clients: int,
    who: str = "partition",
    remedy: str = "Add images, or lower partition.clients_per_domain",
) -> str | None:
    """A warning naming `domain` when one of its classes has fewer than MIN_IMAGES_PER_CLASS_PER_CLIENT
    readable images per client that shares it (e.g. one image per class), else None. `who` and `remedy`: the
    command that warns and what its user can do (a site cannot lower the number of clients)."""
    need = MIN_IMAGES_PER_CLASS_PER_CLIENT * clients
    counts = np.bincount(y, minlength=len(classes))
    small = [i for i, n in enumerate(counts) if n < need]
    if not small:
        return None
    worst = min(small, key=lambda i: (counts[i], i))
    return (
        f"{who}: domain '{domain}' is too small to train on: class '{classes[worst]}' has {counts[worst]} "
        f"image(s) for {clients} client(s) (fewer than {MIN_IMAGES_PER_CLASS_PER_CLIENT} per client; "
        f"{len(small)} of {len(classes)} classes are this small), so its clients see almost nothing of "
        f"the class. {remedy}"
    )


# ---------------------------------------------------------------- decoding and writing one client (partition, site)
def decode_labelled(
    files: Sequence[str | os.PathLike],
    rels: list[str],
    ys: list[int],
    image_size: int,
    workers: int | None,
    progress: bool,
    label: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[SkippedImage]]:
    """Decode `files` once at `image_size` (`images.decode_images`, RESIZE_POLICY): (x uint8 [n, S, S, 3], y int64
    [n], paths str [n] (`rels`, the names the shard records), the unreadable files as SkippedImage), readable files
    only, in order. The one decoder of the partition stage and of a site (fedccrl_core/data/site.py)."""
    xs = np.empty((len(rels), image_size, image_size, 3), dtype=np.uint8)
    keep = np.zeros(len(rels), dtype=bool)
    skipped: list[SkippedImage] = []
    for i, (arr, why) in enumerate(
        decode_images(list(files), image_size, workers=workers, progress=progress, label=label)
    ):
        if arr is None:
            skipped.append(SkippedImage(path=rels[i], reason=why))
        else:
            xs[i] = arr
            keep[i] = True
    xs = xs[keep]
    y = np.asarray(ys, dtype=np.int64)[keep]
    paths = np.asarray(rels, dtype=str)[keep] if keep.any() else np.empty(0, dtype="<U1")
    return xs, y, paths, skipped


def write_client(
    folder: Path,
    cid: str,
    domain: str,
    domain_index: int,
    k: int,
    xs: np.ndarray,
    y: np.ndarray,
    paths: np.ndarray,
    tr: np.ndarray,
    va: np.ndarray,
    num_classes: int,
) -> ClientEntry:
    """Write `<cid>.npz` (rows `tr` of xs/y/paths as train, `va` as val) into `folder`; its manifest entry. The one
    writer of a single-domain client's shard (the partition stage's per_domain and reference schemes, a site)."""
    fname = f"{cid}.npz"
    np.savez(
        folder / fname,
        train_x=xs[tr],
        train_y=y[tr],
        train_paths=paths[tr],
        val_x=xs[va],
        val_y=y[va],
        val_paths=paths[va],
    )
    return ClientEntry(
        id=cid,
        domain=domain,
        domain_index=domain_index,
        k=k,
        file=fname,
        n_train=int(tr.size),
        n_val=int(va.size),
        train_class_hist=_hist(y[tr], num_classes),
        val_class_hist=_hist(y[va], num_classes),
    )


def partition(
    raw_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    spec,
    image_size: int,
    clients_per_domain: int = 2,
    val_fraction: float = 0.1,
    dirichlet_alpha: float | None = None,
    seed: int = 0,
    params: dict | None = None,
    workers: int | None = None,
    progress: bool = True,
    scheme: Scheme = "per_domain",
    num_clients: int | None = None,
    lam: float | None = None,
) -> ShardManifest:
    """Decode raw_dir once, split every domain into K clients, write shards + manifest atomically. The settings are
    params.yaml's, validated by its schema (pipeline/fedccrl_pipeline/params.py): `num_clients` and `lam` are set
    when `scheme` is feddg_bench."""
    from fedccrl_core.data.validate import check_layout, scan_tree
    from fedccrl_core.foundation.fsio import atomic_dir, write_json

    t0 = time.monotonic()
    raw_dir = Path(raw_dir)
    tree = scan_tree(raw_dir)
    domains, classes = check_layout(spec, tree)
    cls_index = {c: i for i, c in enumerate(classes)}
    clients: list[ClientEntry] = []
    skipped: list[SkippedImage] = []
    domain_sizes: dict[str, int] = {}
    decoded: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    warnings: list[str] = []
    with atomic_dir(out_dir) as stage:
        for di, domain in enumerate(domains):
            rels = [f"{domain}/{c}/{f}" for c in classes for f in tree.files[domain][c]]
            ys = [cls_index[c] for c in classes for _ in tree.files[domain][c]]
            xs, y, paths, bad = decode_labelled(
                [raw_dir / r for r in rels], rels, ys, image_size, workers, progress, f"partition {domain}"
            )
            skipped += bad
            domain_sizes[domain] = int(y.size)
            warn = small_domain_warning(domain, y, classes, 1 if scheme == "feddg_bench" else clients_per_domain)
            if warn:
                warnings.append(warn)
                print(f"warning: {warn}", file=sys.stderr, flush=True)
            if scheme == "feddg_bench":
                decoded.append((xs, y, paths))
                continue
            rng = np.random.default_rng(np.random.SeedSequence([seed, di]))
            for k, (tr, va) in enumerate(
                client_splits(y, clients_per_domain, val_fraction, rng, dirichlet_alpha, scheme)
            ):
                cid = client_id(domain, k)
                if tr.size == 0:
                    raise DataError(
                        f"partition: client {cid} got no training samples "
                        f"({domain} has {y.size} readable images for {clients_per_domain} clients)"
                    )
                clients.append(write_client(stage, cid, domain, di, k, xs, y, paths, tr, va, len(classes)))
                if progress:
                    print(
                        f"partition: wrote {clients[-1].file} ({tr.size} train, {va.size} val)",
                        file=sys.stderr,
                        flush=True,
                    )
            del xs
        if scheme == "feddg_bench":
            assert num_clients is not None and lam is not None  # refused up front otherwise
            clients = _write_feddg_bench(
                stage, decoded, domains, len(classes), num_clients, lam, val_fraction, seed, progress, dirichlet_alpha
            )
        manifest = ShardManifest(
            format_version=FORMAT_VERSION,
            dataset=spec.name,
            domains=domains,
            classes=classes,
            num_classes=len(classes),
            image_size=image_size,
            resize_policy=RESIZE_POLICY,
            layout=LAYOUT,
            seed=seed,
            params=dict(
                params or {},
                **{
                    "partition.clients_per_domain": clients_per_domain,
                    "partition.val_fraction": val_fraction,
                    "partition.dirichlet_alpha": dirichlet_alpha,
                    "partition.seed": seed,
                    "partition.scheme": scheme,
                    **(
                        {"partition.num_clients": num_clients, "partition.lambda": lam}
                        if scheme == "feddg_bench"
                        else {}
                    ),
                    "image_size (resolved)": image_size,
                },
            ),
            domain_sizes=domain_sizes,
            clients=clients,
            skipped=skipped,
            **({"warnings": warnings} if warnings else {}),  # absent when none: a run's key hashes the manifest
        )
        write_json(stage / MANIFEST, manifest.to_dict(), indent=2, ensure_ascii=False)
    if progress:
        print(
            f"partition: {len(clients)} clients, {sum(domain_sizes.values())} images ({len(skipped)} skipped) "
            f"at {image_size}px -> {out_dir} in {time.monotonic() - t0:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    return manifest


def _write_feddg_bench(
    stage: Path,
    decoded: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    domains: list[str],
    num_classes: int,
    num_clients: int,
    lam: float,
    val_fraction: float,
    seed: int,
    progress: bool,
    dirichlet_alpha: float | None = None,
) -> list[ClientEntry]:
    """FedDG-Bench's lambda partition (fedccrl_core/data/feddg_bench.py) over ALL domains; clients `c<k>`
    (k zero-padded to the width of num_clients - 1).

    Each shard also stores train_domain / val_domain (the domain index of each row). A leave-one-domain-out
    run drops the held-out domain's rows from every client (`load_client(exclude_domain=...)`) and the
    clients left with no training rows (`client_ids`), so no target image is ever in a training client;
    the target's test set is all its rows (`load_domain_test`). Each client's train/val split is stratified
    by class (`split_train_val`), as in the per_domain scheme. `dirichlet_alpha` adds label skew inside each
    (client, domain) count (feddg_bench.py, "Label skew").
    """
    from fedccrl_core.data import feddg_bench

    xs = np.concatenate([d[0] for d in decoded])
    y = np.concatenate([d[1] for d in decoded])
    paths = np.concatenate([d[2] for d in decoded])
    dom = np.repeat(np.arange(len(decoded)), [d[1].size for d in decoded]).astype(np.int64)
    rng = np.random.default_rng(np.random.SeedSequence([seed]))
    clients: list[ClientEntry] = []
    for k, idx in enumerate(feddg_bench.assign(dom, len(domains), num_clients, lam, rng, y, dirichlet_alpha)):
        cid = f"c{k:0{len(str(num_clients - 1))}d}"  # zero-padded: sorts in client order
        tr, va = split_train_val(idx, y, val_fraction, rng)
        if tr.size == 0:
            raise DataError(
                f"partition: client {cid} got no training samples ({y.size} images for "
                f"{num_clients} clients); lower partition.num_clients"
            )
        fname = f"{cid}.npz"
        np.savez(
            stage / fname,
            train_x=xs[tr],
            train_y=y[tr],
            train_paths=paths[tr],
            train_domain=dom[tr],
            val_x=xs[va],
            val_y=y[va],
            val_paths=paths[va],
            val_domain=dom[va],
        )
        present = sorted(set(dom[idx].tolist()))
        clients.append(
            ClientEntry(
                id=cid,
                domain=domains[present[0]] if len(present) == 1 else MIXED,
                domain_index=present[0] if len(present) == 1 else -1,
                k=k,
                file=fname,
                n_train=int(tr.size),
                n_val=int(va.size),
                domain_counts={domains[d]: int((dom[idx] == d).sum()) for d in present},
                train_domain_counts={domains[d]: int((dom[tr] == d).sum()) for d in present},
                train_class_hist=_hist(y[tr], num_classes),
                val_class_hist=_hist(y[va], num_classes),
            )
        )
        if progress:
            print(
                f"partition: wrote {fname} ({tr.size} train, {va.size} val; {clients[-1].domain_counts})",
                file=sys.stderr,
                flush=True,
            )
    return clients


def _has_rows_outside(entry: ClientEntry, skip: str | None) -> bool:
    counts = entry.train_domain_counts
    if counts is None:
        return entry.domain != skip
    return any(n > 0 for d, n in counts.items() if d != skip)


# ---------------------------------------------------------------- loaders (used by training / evaluation)
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


def _client_entry(manifest: ShardManifest, shards_dir: Path, cid: str) -> ClientEntry:
    for c in manifest.clients:
        if c.id == cid:
            return c
    raise DataError(
        f"{shards_dir / MANIFEST}: no client '{cid}' (clients: {', '.join(c.id for c in manifest.clients)})"
    )


_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # a zip member's local file header (APPNOTE 4.3.7), 30 bytes


def _member_memmap(path: Path, name: str) -> np.memmap | None:
    """The array `name` of an .npz, memory-mapped read-only where it lies in the file (np.savez stores
    members uncompressed); None for a compressed member."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(f"{name}.npy")
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
        if head[0] != b"PK\x03\x04":
            raise zipfile.BadZipFile(f"member {name}.npy: bad local header")
        f.seek(info.header_offset + _LOCAL_HEADER.size + head[-2] + head[-1])  # + file name + extra field
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
        offset = f.tell()
    if dtype.hasobject:
        raise ValueError(f"member {name}.npy holds Python objects")
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")


def _read_shard(path: Path, entry: ClientEntry, manifest: ShardManifest, mmap: bool = False) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise DataError(f"{path}: shard file missing (client {entry.id})")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in SHARD_KEYS if k not in z.files]
            if missing:
                raise DataError(f"{path}: shard lacks key(s) {', '.join(missing)}")
            lazy = {"train_x": _member_memmap(path, "train_x")} if mmap else {}
            arrs: dict[str, np.ndarray] = {k: m if (m := lazy.get(k)) is not None else z[k] for k in SHARD_KEYS}
            if entry.domain_counts is not None:
                if "train_domain" not in z.files or "val_domain" not in z.files:
                    raise DataError(f"{path}: a mixed-domain shard lacks train_domain/val_domain")
                arrs["train_domain"], arrs["val_domain"] = z["train_domain"], z["val_domain"]
    except DataError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as e:
        raise DataError(f"{path}: corrupt shard ({e.__class__.__name__}: {e})") from e
    s, nc = manifest.image_size, len(manifest.classes)
    for part, n in (("train", entry.n_train), ("val", entry.n_val)):
        x, y, p = arrs[f"{part}_x"], arrs[f"{part}_y"], arrs[f"{part}_paths"]
        if x.dtype != np.uint8 or x.shape != (n, s, s, 3):
            raise DataError(f"{path}: {part}_x is {x.dtype} {tuple(x.shape)}, expected uint8 {(n, s, s, 3)}")
        if y.dtype != np.int64 or y.shape != (n,):
            raise DataError(f"{path}: {part}_y is {y.dtype} {tuple(y.shape)}, expected int64 ({n},)")
        if p.shape != (n,) or (n and p.dtype.kind != "U"):
            raise DataError(f"{path}: {part}_paths is {p.dtype} {tuple(p.shape)}, expected str ({n},)")
        if n and (y.min() < 0 or y.max() >= nc):
            raise DataError(f"{path}: {part}_y has labels outside [0, {nc})")
    return arrs


def load_client(
    shards_dir: str | os.PathLike, client_id: str, exclude_domain: str | int | None = None, mmap: bool = False
) -> ClientShard:
    """One client's shard, checked against the manifest (errors name the shard file).

    `mmap`: train_x is an np.memmap of the shard file (nothing of it read yet: a client's images are read only when it trains);
    when `exclude_domain` drops some of its rows, the kept rows are copied (a mixed feddg_bench client).
    `exclude_domain` (the held-out domain) drops that domain's rows of a mixed-domain (feddg_bench)
    client; `train_rows` then says which stored training rows were kept (the pools align with them).
    """
    shards_dir = Path(shards_dir)
    manifest = load_manifest(shards_dir)
    entry = _client_entry(manifest, shards_dir, client_id)
    a = _read_shard(shards_dir / entry.file, entry, manifest, mmap=mmap)
    rows = None
    if exclude_domain is not None and "train_domain" in a:
        skip = manifest.domains.index(domain_name(manifest, exclude_domain))
        rows = np.flatnonzero(a["train_domain"] != skip)
        keep_val = a["val_domain"] != skip
        for k in ("train_x", "train_y", "train_paths"):
            if rows.size < a[k].shape[0]:  # all rows kept: a memory-mapped train_x stays unread
                a[k] = a[k][rows]
        for k in ("val_x", "val_y", "val_paths"):
            a[k] = a[k][keep_val]
    return ClientShard(
        client_id=client_id,
        domain=entry.domain,
        train_x=a["train_x"],
        train_y=a["train_y"],
        val_x=a["val_x"],
        val_y=a["val_y"],
        train_paths=a["train_paths"],
        val_paths=a["val_paths"],
        train_rows=rows,
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


def load_domain_test(shards_dir: str | os.PathLike, domain: str | int) -> tuple[np.ndarray, np.ndarray]:
    """A held-out domain's test set: all its clients' train + val, (uint8 NHWC, int64 labels)."""
    shards_dir = Path(shards_dir)
    manifest = load_manifest(shards_dir)
    name = domain_name(manifest, domain)
    parts = [
        _domain_rows(shards_dir, manifest, entry, name)
        for entry in sorted((c for c in manifest.clients if c.holds(name)), key=lambda c: c.k)
    ]
    if not parts:
        raise DataError(f"{shards_dir / MANIFEST}: no clients for domain '{name}'")
    return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])


def load_client_domain(
    shards_dir: str | os.PathLike, client_id: str, domain: str | int
) -> tuple[np.ndarray, np.ndarray]:
    """One client's share of `load_domain_test`: its rows of `domain` (train + val; none when it holds none)."""
    shards_dir = Path(shards_dir)
    manifest = load_manifest(shards_dir)
    entry = _client_entry(manifest, shards_dir, client_id)
    name = domain_name(manifest, domain)
    if not entry.holds(name):
        s = manifest.image_size
        return np.zeros((0, s, s, 3), np.uint8), np.zeros(0, np.int64)
    return _domain_rows(shards_dir, manifest, entry, name)


def _domain_rows(shards_dir: Path, manifest: ShardManifest, entry: ClientEntry, name: str):
    a = _read_shard(shards_dir / entry.file, entry, manifest)
    di = manifest.domains.index(name)
    xs, ys = [], []
    for part in ("train", "val"):
        keep = a[f"{part}_domain"] == di if f"{part}_domain" in a else slice(None)
        xs.append(a[f"{part}_x"][keep])
        ys.append(a[f"{part}_y"][keep])
    return np.concatenate(xs), np.concatenate(ys)
