"""A client's shard file: its format, its one decoder and its writers (the partition stage's, a site's), and its
readers (used by training, evaluation, export and the Flower clients).

Images are decoded ONCE (`decode_labelled`: `images.load_rgb` + `images.resize_u8`, RESIZE_POLICY) at the resolved
`preprocess.image_size`; unreadable files are skipped and listed in the manifest (data/manifest.py).
`decode_labelled` and `write_client` are the one decoder and writer of a client's shard: the partition stage
(data/partition.py) and a site that prepares its own data (site.py) use them.
Storage: one uncompressed `<client_id>.npz` per client holding train_x uint8 [n, S, S, 3] (NHWC),
train_y int64 [n], train_paths str [n] (relative to the raw root), and the same for val_*; a feddg_bench client
(`write_mixed_client`) also train_domain / val_domain (each row's domain index). A held-out domain's test set is
the union of its clients' train + val (`load_domain_test`), so nothing is stored twice; under train.privacy their
val only (`held_out_parts`).

Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import os
import struct
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedccrl_core.data.images import decode_images
from fedccrl_core.data.manifest import (
    MANIFEST,
    MIXED,
    ClientEntry,
    ShardManifest,
    SkippedImage,
    client_entry,
    domain_name,
    load_manifest,
)
from fedccrl_core.foundation.errors import DataError

# isort: off
# isort: on

SHARD_KEYS = ("train_x", "train_y", "train_paths", "val_x", "val_y", "val_paths")
LAYOUT = "uint8 NHWC [n, S, S, 3]; labels int64; paths relative to the raw root"


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


def class_hist(y: np.ndarray, num_classes: int) -> list[int]:
    """Samples per class of labels `y` (a ClientEntry's train_class_hist / val_class_hist)."""
    return np.bincount(y, minlength=num_classes).astype(int).tolist()


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
        train_class_hist=class_hist(y[tr], num_classes),
        val_class_hist=class_hist(y[va], num_classes),
    )


def write_mixed_client(
    folder: Path,
    cid: str,
    k: int,
    xs: np.ndarray,
    y: np.ndarray,
    paths: np.ndarray,
    dom: np.ndarray,
    idx: np.ndarray,
    tr: np.ndarray,
    va: np.ndarray,
    domains: list[str],
    num_classes: int,
) -> ClientEntry:
    """Write `<cid>.npz` of a feddg_bench client (rows `idx` of xs/y/paths, `tr` as train and `va` as val) with
    each row's domain index `dom` (train_domain, val_domain) into `folder`; its manifest entry (its domain MIXED
    unless it holds one domain only)."""
    fname = f"{cid}.npz"
    np.savez(
        folder / fname,
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
    return ClientEntry(
        id=cid,
        domain=domains[present[0]] if len(present) == 1 else MIXED,
        domain_index=present[0] if len(present) == 1 else -1,
        k=k,
        file=fname,
        n_train=int(tr.size),
        n_val=int(va.size),
        domain_counts={domains[d]: int((dom[idx] == d).sum()) for d in present},
        train_domain_counts={domains[d]: int((dom[tr] == d).sum()) for d in present},
        train_class_hist=class_hist(y[tr], num_classes),
        val_class_hist=class_hist(y[va], num_classes),
    )


# ---------------------------------------------------------------- readers (used by training / evaluation)
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
    entry = client_entry(manifest, shards_dir, client_id)
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


def held_out_parts(private: bool) -> tuple[str, ...]:
    """Which rows of a held-out domain's clients are its test set. Without DP every one, train + val: the papers'
    leave-one-domain-out protocol. Under train.privacy their val rows only: in a study (one shard folder, every
    held-out domain of a sweep) a domain's train rows are training images of the runs that hold out another domain,
    and exact counts over them would be releases outside epsilon; its val rows are trained on by no run of the study
    (docs/privacy.md, "What a site returns for evaluation")."""
    return ("val",) if private else ("train", "val")


def load_domain_test(
    shards_dir: str | os.PathLike, domain: str | int, private: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """A held-out domain's test set: all its clients' rows of `held_out_parts(private)`, (uint8 NHWC, int64 labels)."""
    shards_dir = Path(shards_dir)
    manifest = load_manifest(shards_dir)
    name = domain_name(manifest, domain)
    parts = [
        _domain_rows(shards_dir, manifest, entry, name, held_out_parts(private))
        for entry in sorted((c for c in manifest.clients if c.holds(name)), key=lambda c: c.k)
    ]
    if not parts:
        raise DataError(f"{shards_dir / MANIFEST}: no clients for domain '{name}'")
    x, y = np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])
    if not len(y):
        raise DataError(
            f"{shards_dir / MANIFEST}: domain '{name}' has no val rows, its test set under train.privacy "
            "(partition.val_fraction)"
        )
    return x, y


def load_client_domain(
    shards_dir: str | os.PathLike, client_id: str, domain: str | int, private: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """One client's share of `load_domain_test`: its rows of `domain` (none when it holds none)."""
    shards_dir = Path(shards_dir)
    manifest = load_manifest(shards_dir)
    entry = client_entry(manifest, shards_dir, client_id)
    name = domain_name(manifest, domain)
    if not entry.holds(name):
        s = manifest.image_size
        return np.zeros((0, s, s, 3), np.uint8), np.zeros(0, np.int64)
    return _domain_rows(shards_dir, manifest, entry, name, held_out_parts(private))


def _domain_rows(shards_dir: Path, manifest: ShardManifest, entry: ClientEntry, name: str, parts: tuple[str, ...]):
    a = _read_shard(shards_dir / entry.file, entry, manifest)
    di = manifest.domains.index(name)
    xs, ys = [], []
    for part in parts:
        keep = a[f"{part}_domain"] == di if f"{part}_domain" in a else slice(None)
        xs.append(a[f"{part}_x"][keep])
        ys.append(a[f"{part}_y"][keep])
    return np.concatenate(xs), np.concatenate(ys)
