"""How a domain's samples are split into clients and each client's into train/val (FedCCRL Sec. 3.1): pure
functions on labels, used by the partition stage (data/partition.py) and by a site that prepares its own client
(data/site.py).

Each source domain S_i is split into K clients D_j, disjoint and complete (union of a domain's clients = S_i).
Each client's samples are then split into train/val with `val_fraction`, stratified by class (the reference
protocol's 90/10 split).

- Default (dirichlet_alpha = null): stratified even split: each class's shuffled samples are dealt
  to the K clients in turn (the dealing position carries over from class to class), so client
  sizes differ by at most one and every client gets the domain's class mix.
- Label skew (dirichlet_alpha = a > 0): for each class, client shares p ~ Dirichlet(a * 1_K); the
  class's shuffled samples are cut at the cumulative shares. Redrawn (up to 1000 times) until every
  client has at least MIN_CLIENT_SAMPLES samples.

Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np

from fedccrl_core.foundation.errors import DataError

MIN_CLIENT_SAMPLES = 2
# Supervised contrastive alignment (FedCCRL Eq. 11) needs, for a sample i, positives P(i) = other samples
# of its class: a client with fewer than 2 training images of a class cannot form them, and its class
# signal is one image. A domain whose smallest class has fewer than this many images per client is warned of.
MIN_IMAGES_PER_CLASS_PER_CLIENT = 2
_DIRICHLET_TRIES = 1000


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
