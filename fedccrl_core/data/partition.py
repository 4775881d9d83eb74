"""The partition stage (FedCCRL Sec. 3.1): decode a raw tree once, split every domain into clients
(data/splits.py), write one shard per client (data/shards.py) and the manifest (data/manifest.py), atomically.

Client id `<domain>_c<k>`, k = 0..K-1 (per_domain and reference schemes); `c<k>` over all domains for feddg_bench.
Randomness: numpy Generator seeded by SeedSequence([partition.seed, domain index]), so a domain's split does not
depend on the other domains (feddg_bench: SeedSequence([partition.seed]), one draw over all domains).

Images are decoded ONCE here (`shards.decode_labelled`, RESIZE_POLICY) at the resolved `preprocess.image_size`;
unreadable files are skipped and listed in the manifest.

Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from fedccrl_core.data.images import RESIZE_POLICY
from fedccrl_core.data.manifest import FORMAT_VERSION, MANIFEST, ClientEntry, ShardManifest, SkippedImage
from fedccrl_core.data.shards import LAYOUT, decode_labelled, write_client, write_mixed_client
from fedccrl_core.data.splits import Scheme, client_splits, small_domain_warning, split_train_val
from fedccrl_core.foundation.errors import DataError

Decoded = tuple[np.ndarray, np.ndarray, np.ndarray]  # a domain's readable images: x uint8 NHWC, y int64, paths str


@dataclass(frozen=True)
class PartitionSettings:
    """How the shards are made: params.yaml's `partition` group and the resolved image size, validated by its
    schema (pipeline/fedccrl_pipeline/params.py). `num_clients` and `lam` are set when `scheme` is feddg_bench."""

    image_size: int
    clients_per_domain: int = 2
    val_fraction: float = 0.1
    dirichlet_alpha: float | None = None
    seed: int = 0
    scheme: Scheme = "per_domain"
    num_clients: int | None = None
    lam: float | None = None

    def recorded(self, params: dict | None) -> dict:
        """The manifest's `params`: `params` (the params.yaml values the caller names) and these settings, as
        dotted keys."""
        return dict(
            params or {},
            **{
                "partition.clients_per_domain": self.clients_per_domain,
                "partition.val_fraction": self.val_fraction,
                "partition.dirichlet_alpha": self.dirichlet_alpha,
                "partition.seed": self.seed,
                "partition.scheme": self.scheme,
                **(
                    {"partition.num_clients": self.num_clients, "partition.lambda": self.lam}
                    if self.scheme == "feddg_bench"
                    else {}
                ),
                "image_size (resolved)": self.image_size,
            },
        )


def client_id(domain: str, k: int) -> str:
    return f"{domain}_c{k}"


def partition(
    raw_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    spec,
    settings: PartitionSettings,
    params: dict | None = None,
    workers: int | None = None,
    progress: bool = True,
) -> ShardManifest:
    """Decode raw_dir once, split every domain into clients, write shards + manifest atomically. `params`: the
    params.yaml values the manifest records besides `settings`."""
    from fedccrl_core.data.validate import check_layout, scan_tree
    from fedccrl_core.foundation.fsio import atomic_dir, write_json

    t0 = time.monotonic()
    raw_dir = Path(raw_dir)
    tree = scan_tree(raw_dir)
    domains, classes = check_layout(spec, tree)
    s, feddg = settings, settings.scheme == "feddg_bench"
    clients: list[ClientEntry] = []
    skipped: list[SkippedImage] = []
    domain_sizes: dict[str, int] = {}
    decoded: list[Decoded] = []
    warnings: list[str] = []
    with atomic_dir(out_dir) as stage:
        for di, domain in enumerate(domains):
            xs, y, paths, bad = _decode_domain(
                raw_dir, tree.files[domain], domain, classes, s.image_size, workers, progress
            )
            skipped += bad
            domain_sizes[domain] = int(y.size)
            warn = small_domain_warning(domain, y, classes, 1 if feddg else s.clients_per_domain)
            if warn:
                warnings.append(warn)
                print(f"warning: {warn}", file=sys.stderr, flush=True)
            if s.scheme == "feddg_bench":
                decoded.append((xs, y, paths))
                continue
            clients += _write_domain(stage, (xs, y, paths), domain, di, len(classes), s, s.scheme, progress)
            del xs
        if feddg:
            clients = _write_feddg_bench(stage, decoded, domains, len(classes), s, progress)
        manifest = _manifest(spec.name, domains, classes, s, params, domain_sizes, clients, skipped, warnings)
        write_json(stage / MANIFEST, manifest.to_dict(), indent=2, ensure_ascii=False)
    if progress:
        print(
            f"partition: {len(clients)} clients, {sum(domain_sizes.values())} images ({len(skipped)} skipped) "
            f"at {s.image_size}px -> {out_dir} in {time.monotonic() - t0:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    return manifest


def _manifest(
    dataset: str,
    domains: list[str],
    classes: list[str],
    s: PartitionSettings,
    params: dict | None,
    domain_sizes: dict[str, int],
    clients: list[ClientEntry],
    skipped: list[SkippedImage],
    warnings: list[str],
) -> ShardManifest:
    """The shards' manifest.json record of a partition made with `s`."""
    return ShardManifest(
        format_version=FORMAT_VERSION,
        dataset=dataset,
        domains=domains,
        classes=classes,
        num_classes=len(classes),
        image_size=s.image_size,
        resize_policy=RESIZE_POLICY,
        layout=LAYOUT,
        seed=s.seed,
        params=s.recorded(params),
        domain_sizes=domain_sizes,
        clients=clients,
        skipped=skipped,
        **({"warnings": warnings} if warnings else {}),  # absent when none: a run's key hashes the manifest
    )


def _decode_domain(
    raw_dir: Path,
    files: dict[str, list[str]],
    domain: str,
    classes: list[str],
    image_size: int,
    workers: int | None,
    progress: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[SkippedImage]]:
    """A domain's images (`files[class]`: the file names of each class), decoded once: `shards.decode_labelled`."""
    rels = [f"{domain}/{c}/{f}" for c in classes for f in files[c]]
    ys = [i for i, c in enumerate(classes) for _ in files[c]]
    return decode_labelled([raw_dir / r for r in rels], rels, ys, image_size, workers, progress, f"partition {domain}")


def _write_domain(
    stage: Path,
    data: Decoded,
    domain: str,
    di: int,
    num_classes: int,
    s: PartitionSettings,
    scheme: Literal["per_domain", "reference"],
    progress: bool,
) -> list[ClientEntry]:
    """The per_domain and reference schemes (`scheme`, s.scheme's): domain `di`'s clients (`splits.client_splits`),
    one shard each."""
    xs, y, paths = data
    rng = np.random.default_rng(np.random.SeedSequence([s.seed, di]))
    clients: list[ClientEntry] = []
    for k, (tr, va) in enumerate(
        client_splits(y, s.clients_per_domain, s.val_fraction, rng, s.dirichlet_alpha, scheme)
    ):
        cid = client_id(domain, k)
        if tr.size == 0:
            raise DataError(
                f"partition: client {cid} got no training samples "
                f"({domain} has {y.size} readable images for {s.clients_per_domain} clients)"
            )
        clients.append(write_client(stage, cid, domain, di, k, xs, y, paths, tr, va, num_classes))
        if progress:
            print(
                f"partition: wrote {clients[-1].file} ({tr.size} train, {va.size} val)",
                file=sys.stderr,
                flush=True,
            )
    return clients


def _write_feddg_bench(
    stage: Path, decoded: list[Decoded], domains: list[str], num_classes: int, s: PartitionSettings, progress: bool
) -> list[ClientEntry]:
    """FedDG-Bench's lambda partition (fedccrl_core/data/feddg_bench.py) over ALL domains; clients `c<k>`
    (k zero-padded to the width of num_clients - 1).

    Each shard also stores train_domain / val_domain (the domain index of each row). A leave-one-domain-out
    run drops the held-out domain's rows from every client (`load_client(exclude_domain=...)`) and the
    clients left with no training rows (`client_ids`), so no target image is ever in a training client;
    the target's test set is all its rows, under train.privacy its val rows (`load_domain_test`). Each client's train/val split is stratified
    by class (`split_train_val`), as in the per_domain scheme. `dirichlet_alpha` adds label skew inside each
    (client, domain) count (feddg_bench.py, "Label skew").
    """
    from fedccrl_core.data import feddg_bench

    assert s.num_clients is not None and s.lam is not None  # refused up front otherwise
    num_clients = s.num_clients
    xs = np.concatenate([d[0] for d in decoded])
    y = np.concatenate([d[1] for d in decoded])
    paths = np.concatenate([d[2] for d in decoded])
    dom = np.repeat(np.arange(len(decoded)), [d[1].size for d in decoded]).astype(np.int64)
    rng = np.random.default_rng(np.random.SeedSequence([s.seed]))
    clients: list[ClientEntry] = []
    for k, idx in enumerate(feddg_bench.assign(dom, len(domains), num_clients, s.lam, rng, y, s.dirichlet_alpha)):
        cid = f"c{k:0{len(str(num_clients - 1))}d}"  # zero-padded: sorts in client order
        tr, va = split_train_val(idx, y, s.val_fraction, rng)
        if tr.size == 0:
            raise DataError(
                f"partition: client {cid} got no training samples ({y.size} images for "
                f"{num_clients} clients); lower partition.num_clients"
            )
        clients.append(write_mixed_client(stage, cid, k, xs, y, paths, dom, idx, tr, va, domains, num_classes))
        if progress:
            print(
                f"partition: wrote {clients[-1].file} ({tr.size} train, {va.size} val; {clients[-1].domain_counts})",
                file=sys.stderr,
                flush=True,
            )
    return clients
