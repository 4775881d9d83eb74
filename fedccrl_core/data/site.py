"""A site prepares its own data: one client's shard and statistics, from the site's own image folder.

In a deployment each site keeps its images. `prepare_site` turns the site's `<class>/<image>` folder into what
its SuperNode reads (`shards=<site>/shards pools=<site>/pools`), with the central stages' layout and file
formats, restricted to that one site:

    <site>/shards/manifest.json     a ShardManifest (shards.py) listing only this site's client
    <site>/shards/<client_id>.npz   its shard, written by `shards.write_client` (the partition stage's writer)
    <site>/pools/manifest.json      a PoolManifest (pools.py), written by `pools.build_pools` (the pools stage)
    <site>/pools/<client_id>.npz    mu, sigma of its training images (FedCCRL Eq. 6-7)

Decoding is `shards.decode_labelled` (the partition stage's decoder: RESIZE_POLICY at the federation's image
size, unreadable files skipped and listed under `skipped`). The train/val split is the per_domain scheme's
(`shards.client_splits`) for one client: stratified by class at `partition.val_fraction`, with the partition
stage's numpy Generator, SeedSequence([partition.seed, domain index]). Stored paths read `<domain>/<class>/<file>`,
as the partition stage's (relative to a raw root). So a site that holds a whole domain of a registry dataset, with
client id `<domain>_c0`, writes the very shard and statistics files the central stages write at
`partition.clients_per_domain: 1` (tests/test_site.py).

The federation's settings come from the operator's params.yaml (`preprocess.image_size`, `preprocess.mean/std`,
`partition.val_fraction`, `partition.seed`, `dataset.name`) and its class list from a small text file the operator
publishes: class names in order, one a line (label i = line i). The site names its domain and client id.

What differs from the central manifest (the contract's one change): `domains` is the registry's domain list for a
registry dataset (PACS, OfficeHome, ...), but only the site's own domain for `imagefolder`, whose other domains a
site cannot know (its client's `domain_index` is then 0, an index into that list, and its Generator is seeded with
domain index 0); `domain_sizes` has the site's entry only; `params` holds `site.client_id`, which marks the folder
as a site's. So a SuperNode on a site folder is started with `client-id=<id>`, not `partition-id=<k>` (which
looks the held-out domain up among the manifest's domains). A class of the list that the site lacks is allowed,
with a warning naming it (recorded under `warnings`): the model keeps every class's output, and the client's
`train_class_hist` shows 0 for it. An evaluation-only site (the held-out domain) prepares its folder the same way:
its test set is its train + val, under train.privacy its val (`shards.load_domain_test`). In a run, the federation's domains and the held-out
one come from the run's spec, not from this manifest (fedccrl_flower/site_data.py `check_site_data`).

What in the image folder is not a sample is passed over, listed under `skipped` with why and named on stderr, and
never opened (tree.py `scan_classes`): a FIFO, socket or device, a symlink loop, a symlink whose target lies outside
the image folder (not followed: a site exports only the folder it names), a hidden or stray entry.

Checked before any image is decoded, each error naming the file or folder: the class file (present, UTF-8, no
empty line, no duplicate, no stray whitespace, no `/`; the registry's classes for a registry dataset), a class
folder that is not in the list, an image folder with no image, and an existing output folder (only a site folder
prepared with the same federation settings, domain and client id is replaced; one prepared with other settings,
or anything else, is refused). The output is written in a temporary sibling folder and renamed at the end
(`fsio.atomic_dir`): a failure leaves no partial folder and an earlier site folder untouched.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedccrl_core.data import manifest as manifest_mod
from fedccrl_core.data import pools as pools_mod
from fedccrl_core.data import shards as shards_mod
from fedccrl_core.data import splits as splits_mod
from fedccrl_core.data.images import RESIZE_POLICY
from fedccrl_core.data.registry import DatasetSpec
from fedccrl_core.data.tree import scan_classes
from fedccrl_core.foundation.errors import DataError

SHARDS = "shards"  # <site>/shards: what the SuperNode's node config `shards=` names
POOLS = "pools"  # <site>/pools: its `pools=`
SITE_KEY = "site.client_id"  # the manifest's `params` key that marks a site's shards
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class SiteSettings:
    """The settings a site prepares its data with, shared with its federation (the operator's params.yaml and class
    file); not fedccrl_flower/federation.py's `Federation`, a SuperLink connection."""

    dataset: str
    classes: list[str]
    image_size: int
    val_fraction: float
    seed: int
    mean: list[float]
    std: list[float]
    source: str = "params.yaml"  # where the settings come from, for messages


def class_name_problem(name: str) -> str | None:
    """Why `name` cannot be a class of a class file (a class folder's name), else None."""
    if name != name.strip():
        return f"class name {name!r} has leading or trailing whitespace"
    if "/" in name or "\\" in name or name.startswith("."):
        return f"{name!r} is not a folder name"
    return None


def class_list_of(images: str | os.PathLike) -> list[str]:
    """The class file of a `<class>/<image>` folder (`fedccrl site classes --images`): its class folders that hold
    a file, sorted (as the partition stage orders an imagefolder's classes); DataError naming the folder."""
    images = Path(images)
    if not images.is_dir():
        raise DataError(f"--images {images}: image folder not found")
    found, _ = scan_classes(images, images.name)
    classes = sorted(c for c, files in found.items() if files)
    for c in classes:
        problem = class_name_problem(c)
        if problem:
            raise DataError(f"{images / c}: {problem}")
    if len(classes) < 2:
        raise DataError(
            f"--images {images}: {len(classes)} class folder(s) holding a file; a classifier needs at least 2 "
            "(expected one subfolder per class, holding that class's images)"
        )
    return classes


def read_class_list(path: str | os.PathLike) -> list[str]:
    """The federation's class file: class names in order, one a line; DataError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: class file not found (the operator publishes it: class names in order, one a line)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: class file is not UTF-8 text ({e})") from e
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline
    classes: list[str] = []
    seen: dict[str, int] = {}
    for no, raw in enumerate(lines, 1):
        name = raw.removesuffix("\r")
        if not name.strip():
            raise DataError(f"{path}: line {no} is empty (one class name a line, no blank lines)")
        problem = class_name_problem(name)
        if problem:
            raise DataError(f"{path}: line {no}: {problem}")
        if name in seen:
            raise DataError(f"{path}: line {no}: class '{name}' is listed twice (first on line {seen[name]})")
        seen[name] = no
        classes.append(name)
    if len(classes) < 2:
        raise DataError(f"{path}: {len(classes)} class(es); a classifier needs at least 2")
    return classes


def check_site_name(spec: DatasetSpec, domain: str, client_id: str) -> None:
    """A site's client id and domain (a registry dataset's domains are known); DataError naming the option."""
    if not _ID.match(client_id):
        raise DataError(f"--client-id {client_id!r}: letters, digits, '.', '_' and '-' only, not starting with one")
    if not domain or domain != domain.strip() or "/" in domain or domain.startswith("."):
        raise DataError(f"--domain {domain!r}: not a folder name")
    if spec.domains and domain not in spec.domains:
        raise DataError(f"--domain '{domain}' is not a domain of {spec.name} (domains: {', '.join(spec.domains)})")


def check_classes(fed: SiteSettings, spec: DatasetSpec, classes_file: str) -> None:
    """The class list against a registry dataset's (its classes are known); DataError naming the class file."""
    if spec.classes is not None and fed.classes != sorted(spec.classes):
        raise DataError(
            f"{classes_file}: the class list differs from the federation's ({spec.name}, dataset.name in "
            f"{fed.source}): expected, in order: {', '.join(sorted(spec.classes))}"
        )


def check_federation(fed: SiteSettings, spec: DatasetSpec, domain: str, client_id: str, classes_file: str) -> None:
    """The site's names and the class list against the dataset registry; DataError naming the file or option."""
    check_site_name(spec, domain, client_id)
    check_classes(fed, spec, classes_file)


def _settings(dataset, classes, image_size, val_fraction, seed, domain, client_id) -> dict[str, object]:
    """What a site folder was prepared with, as the keys its errors name."""
    return {
        "dataset.name": dataset,
        "classes": classes,
        "preprocess.image_size": image_size,
        "partition.val_fraction": val_fraction,
        "partition.seed": seed,
        "--domain": domain,
        "--client-id": client_id,
    }


def check_existing(out: Path, fed: SiteSettings, domain: str, client_id: str) -> None:
    """An existing --out is replaced only when it is a site folder prepared with the same settings (a rerun, e.g.
    after adding images); anything else is refused, naming what differs, before any work."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"--out {out}: exists and is not a folder")
    entries = sorted(e.name for e in os.scandir(out))
    if not entries:
        return
    stray = [e for e in entries if e not in (SHARDS, POOLS)]
    if stray or not (out / SHARDS / manifest_mod.MANIFEST).is_file():
        raise DataError(
            f"--out {out}: exists and is not a site folder (it holds {', '.join(stray or entries)}); "
            "it would be replaced whole: remove it or choose another --out"
        )
    path = out / SHARDS / manifest_mod.MANIFEST
    m = manifest_mod.load_manifest(out / SHARDS)
    if SITE_KEY not in m.params or len(m.clients) != 1:
        raise DataError(f"{path}: these are a partition stage's shards, not a site's; choose another --out")
    want = _settings(fed.dataset, fed.classes, fed.image_size, fed.val_fraction, fed.seed, domain, client_id)
    c = m.clients[0]
    have = _settings(
        m.dataset,
        m.classes,
        m.image_size,
        m.params.get("partition.val_fraction"),
        m.params.get("partition.seed"),
        c.domain,
        c.id,
    )
    pm_path = out / POOLS / pools_mod.MANIFEST
    if pm_path.is_file():
        pm = pools_mod.load_pool_manifest(out / POOLS)
        have.update({"preprocess.mean": pm.mean, "preprocess.std": pm.std})
        want.update({"preprocess.mean": fed.mean, "preprocess.std": fed.std})
    diff = [f"{k} {have[k]!r} (now {want[k]!r})" for k in want if have[k] != want[k]]
    if diff:
        raise DataError(
            f"{path}: this site folder was prepared with other settings: {'; '.join(diff)}. The federation's "
            f"settings are {fed.source} and the class file; remove {out} to prepare it again with them"
        )


def scan_site(
    images: Path, classes: list[str], classes_file: str, domain: str
) -> tuple[list[Path], list[str], list[int], list[manifest_mod.SkippedImage]]:
    """The site's `<class>/<image>` files: (files, paths `<domain>/<class>/<file>`, labels, what was passed over
    and why: a FIFO or other non-regular file, a symlink loop, a symlink leaving `images` (not followed), a hidden
    or stray entry; each also a notice on stderr); a class folder not in the list, or no image at all, is a
    DataError naming the folder."""
    if not images.is_dir():
        raise DataError(f"--images {images}: image folder not found")
    found, ignored = scan_classes(images, domain, within=images.resolve())
    passed_over = [manifest_mod.SkippedImage(path=i.path, reason=i.reason) for i in ignored]
    for item in ignored:
        print(f"notice: skipped {images}/{item.path.split('/', 1)[1]} ({item.reason})", file=sys.stderr)
    extra = [c for c in found if c not in classes]
    if extra:
        raise DataError(
            f"{images / extra[0]}: class folder '{extra[0]}' is not in the class list {classes_file} "
            f"(not listed: {', '.join(extra)})"
        )
    index = {c: i for i, c in enumerate(classes)}
    files, rels, ys = [], [], []
    for c in classes:  # label order: the class file's
        for f in found.get(c, []):
            files.append(images / c / f)
            rels.append(f"{domain}/{c}/{f}")
            ys.append(index[c])
    if not files:
        why = f"; {len(ignored)} skipped, e.g. {ignored[0].path}: {ignored[0].reason}" if ignored else ""
        raise DataError(
            f"--images {images}: no image found (expected one subfolder per class of {classes_file}, "
            f"holding that class's images{why})"
        )
    return files, rels, ys, passed_over


def _warnings(domain: str, y: np.ndarray, classes: list[str], images: Path) -> list[str]:
    present = sorted(set(y.tolist()))
    out = [
        f"site: {images}: no readable image of class '{classes[i]}'; the model keeps its output, but this "
        "site neither trains nor validates on it"
        for i in range(len(classes))
        if i not in present
    ]
    if present:
        small = splits_mod.small_domain_warning(
            domain, np.searchsorted(present, y), [classes[i] for i in present], 1, "site", "Add images"
        )
        if small:
            out.append(small)
    return out


def _read_site(
    images: Path, fed: SiteSettings, classes_file: str, domain: str, client_id: str, workers, progress: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[manifest_mod.SkippedImage]]:
    """The site's images decoded at the federation's size: (images, labels, paths, what was skipped and why); a
    DataError when none is readable."""
    files, rels, ys, passed_over = scan_site(images, fed.classes, classes_file, domain)
    xs, y, paths, unreadable = shards_mod.decode_labelled(
        files, rels, ys, fed.image_size, workers, progress, f"site {client_id}"
    )
    if not y.size:
        raise DataError(f"--images {images}: none of its {len(files)} images is readable (e.g. {unreadable[0].path})")
    return xs, y, paths, passed_over + unreadable


def _site_manifest(
    fed: SiteSettings,
    domains: list[str],
    domain: str,
    client_id: str,
    n_images: int,
    entry,
    skipped: list,
    warnings: list[str],
) -> manifest_mod.ShardManifest:
    """The site's one-client shard manifest, in the partition stage's format."""
    return manifest_mod.ShardManifest(
        format_version=manifest_mod.FORMAT_VERSION,
        dataset=fed.dataset,
        domains=domains,
        classes=fed.classes,
        num_classes=len(fed.classes),
        image_size=fed.image_size,
        resize_policy=RESIZE_POLICY,
        layout=shards_mod.LAYOUT,
        seed=fed.seed,
        params={
            "dataset.name": fed.dataset,
            "partition.val_fraction": fed.val_fraction,
            "partition.seed": fed.seed,
            "image_size (resolved)": fed.image_size,
            SITE_KEY: client_id,
        },
        domain_sizes={domain: n_images},
        clients=[entry],
        skipped=skipped,
        **({"warnings": warnings} if warnings else {}),
    )


def prepare_site(
    images: str | os.PathLike,
    out: str | os.PathLike,
    fed: SiteSettings,
    spec: DatasetSpec,
    domain: str,
    client_id: str,
    classes_file: str,
    workers: int | None = None,
    progress: bool = True,
) -> manifest_mod.ShardManifest:
    """Write `<out>/shards` and `<out>/pools` for one site (module docstring); every check runs before any work."""
    from fedccrl_core.foundation.fsio import atomic_dir, write_json

    images, out = Path(images), Path(out)
    t0 = time.monotonic()
    check_federation(fed, spec, domain, client_id, classes_file)
    mean, std = [float(a) for a in fed.mean], [float(a) for a in fed.std]  # validated by params.yaml's schema
    check_existing(out, fed, domain, client_id)
    xs, y, paths, skipped = _read_site(images, fed, classes_file, domain, client_id, workers, progress)
    warnings = _warnings(domain, y, fed.classes, images)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr, flush=True)
    domains = list(spec.domains) if spec.domains else [domain]  # check_federation: a registry domain
    di = domains.index(domain)
    rng = np.random.default_rng(np.random.SeedSequence([fed.seed, di]))  # the partition stage's, per domain
    ((tr, va),) = splits_mod.client_splits(y, 1, fed.val_fraction, rng)
    if tr.size == 0:
        raise DataError(f"--images {images}: {y.size} readable image(s) leave no training sample")
    with atomic_dir(out) as stage:
        (stage / SHARDS).mkdir()
        entry = shards_mod.write_client(
            stage / SHARDS, client_id, domain, di, 0, xs, y, paths, tr, va, len(fed.classes)
        )
        manifest = _site_manifest(fed, domains, domain, client_id, int(y.size), entry, skipped, warnings)
        write_json(stage / SHARDS / manifest_mod.MANIFEST, manifest.to_dict(), indent=2, ensure_ascii=False)
        if progress:
            print(
                f"site: wrote {SHARDS}/{entry.file} ({tr.size} train, {va.size} val, {len(skipped)} skipped)",
                file=sys.stderr,
                flush=True,
            )
        pools_mod.build_pools(stage / SHARDS, stage / POOLS, mean, std, progress=False)  # Eq. 6-7: the pools stage
        if progress:
            print(f"site: wrote {POOLS}/{entry.file} (Eq. 6-7 statistics of {tr.size} images)", file=sys.stderr)
    if progress:
        print(
            f"site: {client_id} ({domain}): {y.size} images at {fed.image_size}px -> {out} "
            f"in {time.monotonic() - t0:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    return manifest
