"""Per-sample style statistics of every client (FedCCRL Eq. 6-8): the pools stage.

For every training sample x_j of client i, after the training normalization
x = (u8 / 255 - mean) / std (`statistics.normalize_u8`, params preprocess.mean/std):

    Eq. 6:  mu(x)_c    = 1/(HW) sum_{h,w} x_{c,h,w}
    Eq. 7:  sigma(x)_c = sqrt(1/(HW) sum_{h,w} (x_{c,h,w} - mu(x)_c)^2)   (+eps inside the root, see channel_stats)

stored as `<client_id>.npz` with `mu`, `sigma` float32 [n_train, 3] (row j = train sample j of the
shard), plus `manifest.json`. Only statistics leave this stage, never images.

Eq. 8: each round client i uploads F_i, the statistics of ceil(r * n_i) of its samples;
`sample_statistics` draws those rows without replacement with a numpy Generator.
The reference code (SanphouWang/FedCCRL 60b2d9b algorithm/client/fedccrl.py:21-44) uploads
floor(r * n_i) rows, the first of a freshly shuffled pass (a uniform subset without replacement,
as here), recomputed every round with torch.var's unbiased variance: `sample_statistics(...,
rounding="floor")` and `unbiased_sigma` give that (train.fedccrl.upload: floor_unbiased, the reference code's upload).


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import inspect
import math
import os
import sys
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedccrl_core.foundation.errors import DataError
from fedccrl_core.foundation.records import Record

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# how a user remakes the pools: the pipeline's partition stage writes them (with the shards), `fedccrl pools` alone
REBUILD = "rebuild them with `fedccrl pools`, or rerun the partition stage"
STALE = f"the pools are stale: {REBUILD}"
_BATCH = 32


class PoolEntry(Record):
    """One client of the pools' manifest: its pool file and its number of rows (= its training samples)."""

    id: str
    domain: str
    file: str
    n: int


class PoolManifest(Record):
    """The pools' manifest.json, written by `build_pools`, read by `load_pool_manifest`."""

    format_version: int
    dataset: str
    image_size: int
    mean: list[float]
    std: list[float]
    eps: float
    statistics: str
    clients: list[PoolEntry]

    def entry(self, client_id: str) -> PoolEntry | None:
        return next((c for c in self.clients if c.id == client_id), None)


def compute_statistics(images_u8: np.ndarray, mean, std, batch: int = _BATCH) -> tuple[np.ndarray, np.ndarray]:
    """uint8 NHWC images -> (mu, sigma) float32 [n, 3] of the normalized images (Eq. 6-7)."""
    import torch

    from fedccrl_core.learning.statistics import channel_stats, normalize_u8

    n = images_u8.shape[0]
    mu = np.empty((n, 3), dtype=np.float32)
    sigma = np.empty((n, 3), dtype=np.float32)
    with torch.no_grad():
        for s in range(0, n, batch):
            # NHWC -> contiguous NCHW first: the per-channel reductions of Eq. 6-7 then run on contiguous planes
            x = normalize_u8(
                torch.from_numpy(np.ascontiguousarray(images_u8[s : s + batch].transpose(0, 3, 1, 2))), mean, std
            )
            m, sd = channel_stats(x)
            mu[s : s + batch] = m.numpy()
            sigma[s : s + batch] = sd.numpy()
    return mu, sigma


def build_pools(
    shards_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    mean: Sequence[float],
    std: Sequence[float],
    progress: bool = True,
) -> PoolManifest:
    """The pools stage: statistics of every client's training samples, written atomically. `mean` and `std`:
    params.yaml's preprocess.mean and preprocess.std (three each, std > 0: its schema's)."""
    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_core.data.shards import load_client
    from fedccrl_core.foundation.fsio import atomic_dir, write_json
    from fedccrl_core.learning.statistics import channel_stats

    mean, std = [float(a) for a in mean], [float(a) for a in std]
    t0 = time.monotonic()
    shards = load_manifest(shards_dir)
    entries: list[PoolEntry] = []
    with atomic_dir(out_dir) as stage:
        for c in shards.clients:
            shard = load_client(shards_dir, c.id)
            mu, sigma = compute_statistics(shard.train_x, mean, std)
            fname = f"{c.id}.npz"
            np.savez(stage / fname, mu=mu, sigma=sigma)
            entries.append(PoolEntry(id=c.id, domain=c.domain, file=fname, n=int(mu.shape[0])))
            if progress:
                print(f"pools: wrote {fname} ({mu.shape[0]} samples)", file=sys.stderr, flush=True)
        eps = inspect.signature(channel_stats).parameters["eps"].default
        manifest = PoolManifest(
            format_version=FORMAT_VERSION,
            dataset=shards.dataset,
            image_size=shards.image_size,
            mean=mean,
            std=std,
            eps=eps,
            statistics="per-sample channel mean and std of (u8/255 - mean)/std (Eq. 6-7); "
            "rows align with the shard's train samples",
            clients=entries,
        )
        write_json(stage / MANIFEST, manifest.to_dict(), indent=2, ensure_ascii=False)
    if progress:
        print(
            f"pools: {len(entries)} clients -> {out_dir} in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True
        )
    return manifest


def load_pool_manifest(pools_dir: str | os.PathLike) -> PoolManifest:
    from fedccrl_core.data.manifest import read_manifest

    return read_manifest(pools_dir, "pools", "pools", PoolManifest, FORMAT_VERSION)


def check_pools(pools_dir: str | os.PathLike, client_ids: list[str]) -> None:
    """Every client's pool file is listed and present (metadata only: what `train` checks before any work)."""
    pools_dir = Path(pools_dir)
    listed = {c.id: c.file for c in load_pool_manifest(pools_dir).clients}
    unlisted = [c for c in client_ids if c not in listed]
    if unlisted:
        raise DataError(f"{pools_dir / MANIFEST}: no client(s) {unlisted} ({STALE})")
    missing = [str(pools_dir / listed[c]) for c in client_ids if not (pools_dir / listed[c]).is_file()]
    if missing:
        raise DataError(
            f"{missing[0]}: pool file missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )


def load_pool(pools_dir: str | os.PathLike, client_id: str) -> tuple[np.ndarray, np.ndarray]:
    """(mu, sigma) float32 [n_train, 3] of a client (errors name the pool file)."""
    pools_dir = Path(pools_dir)
    entry = load_pool_manifest(pools_dir).entry(client_id)
    if entry is None:
        raise DataError(f"{pools_dir / MANIFEST}: no client '{client_id}'")
    path = pools_dir / entry.file
    if not path.is_file():
        raise DataError(f"{path}: pool file missing (client {client_id})")
    try:
        with np.load(path, allow_pickle=False) as z:
            if "mu" not in z.files or "sigma" not in z.files:
                raise DataError(f"{path}: pool file lacks 'mu' or 'sigma'")
            mu, sigma = z["mu"], z["sigma"]
    except DataError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise DataError(f"{path}: corrupt pool file ({e.__class__.__name__}: {e})") from e
    n = entry.n
    for name, a in (("mu", mu), ("sigma", sigma)):
        if a.dtype != np.float32 or a.shape != (n, 3):
            raise DataError(f"{path}: {name} is {a.dtype} {tuple(a.shape)}, expected float32 ({n}, 3)")
    return mu, sigma


def upload_size(n: int, r: float, rounding: str = "ceil") -> int:
    """ceil(r * n_i) of Eq. 8, robust to float error (0.07 * 100 = 7.000000000000001 -> 7, not 8);
    rounding="floor": the reference code's int(n_i * r), float error included (int(100 * 0.29) = 28). r in (0, 1]:
    params.yaml's schema (train.fedccrl.r); the floor's zero rows depend on the data, so they are refused here."""
    if rounding == "floor":
        k = int(n * r)
        if k == 0:
            raise DataError(
                f"params.yaml: train.fedccrl.upload floor_unbiased uploads floor(r * n) = 0 rows "
                f"of a client with n = {n} (r = {r}); raise r or use upload: ceil"
            )
        return k
    return min(n, max(1, math.ceil(round(r * n, 9))))  # r * n below 5e-10 rounds to 0: Eq. 8's ceil is still 1


def sample_statistics(
    mu: np.ndarray, sigma: np.ndarray, r: float, generator: np.random.Generator, rounding: str = "ceil"
) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 8: F_i = the statistics of ceil(r * n_i) (or floor, `upload_size`) of the client's samples,
    drawn without replacement."""
    if mu.shape != sigma.shape or mu.ndim != 2:
        raise DataError(f"pool: mu {mu.shape} and sigma {sigma.shape} must be matching [n, C] arrays")
    n = mu.shape[0]
    rows = generator.choice(n, size=upload_size(n, r, rounding), replace=False)
    return mu[rows], sigma[rows]


def unbiased_sigma(sigma: np.ndarray, hw: int) -> np.ndarray:
    """The std of Eq. 7 with the unbiased variance (divided by HW - 1), from the stored population
    sigma = sqrt(var + eps): sqrt((sigma^2 - eps) HW / (HW - 1) + eps), in float64."""
    from fedccrl_core.learning.statistics import channel_stats

    eps = inspect.signature(channel_stats).parameters["eps"].default
    var = np.maximum(sigma.astype(np.float64) ** 2 - eps, 0.0) * hw / (hw - 1)
    return np.sqrt(var + eps).astype(np.float32)
