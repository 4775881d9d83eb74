"""What a train run is checked against before any shard is read and before MLflow: its
held-out entries against the manifest's domains, and every source client's BatchNorm batch."""

from __future__ import annotations

import re

from fedccrl_core.data.manifest import ShardManifest
from fedccrl_core.foundation.errors import ParamError
from fedccrl_pipeline.cross_checks import resolve_held_out
from fedccrl_pipeline.params import ParamsFile


def held_out_entry(text: str | int) -> int | str:
    """A held-out domain as the train stage's --held-out gives it (DVC passes ${item.held_out}): an index or a name."""
    if isinstance(text, int):
        return text
    return int(text) if re.fullmatch(r"[0-9]+", text) else text


def manifest_held_out(manifest: ShardManifest, entries: list, key: str = "train.held_out") -> list[str]:
    """Held-out entries -> the shards' domain names (pipeline/fedccrl_pipeline/params.py `resolve_held_out`, against the manifest:
    imagefolder's domains only the data knows); ParamError naming each bad entry."""
    names, problems = resolve_held_out(list(manifest.domains), entries, f"the shards ({manifest.dataset})", key)
    if problems:
        raise ParamError(*problems)
    return names


def check_batches(manifest: ShardManifest, target: str, batch_size: int, key: str) -> None:
    """Every source client must get a batch of >= 2 samples (BatchNorm, which every backbone has, cannot train on
    one; the local loop skips such batches, so the client would train nothing). From the manifest's counts only,
    before any shard is read."""
    if batch_size < 2:
        raise ParamError(
            f"params.yaml: key '{key}': got {batch_size}; must be >= 2 for a BatchNorm model "
            "(a batch of 1 trains nothing)"
        )
    for c in manifest.clients:
        counts = c.train_domain_counts or {c.domain: c.n_train}
        n = sum(v for d, v in counts.items() if d != target)
        if 0 < n < 2:
            raise ParamError(
                f"data/shards manifest: client {c.id} has {n} training sample without the held-out "
                f"domain {target}; BatchNorm needs a batch of at least 2 (fewer "
                "partition.clients_per_domain or a lower partition.val_fraction)"
            )


def check_train(cfg: ParamsFile, manifest: ShardManifest, algorithm: str, held_out: list) -> list[str]:
    """Everything a train run is checked against before any shard is read and before MLflow: the held-out entries
    it trains (`--held-out` values: names or indices) and train.held_out against the manifest's domains, and every
    source client's BatchNorm batch under the batch size the algorithm trains with (FedBN's own 64 replaces
    train.batch_size). `cfg` has passed validate_params(data, (algorithm,)). Returns the held-out domains'
    names, in the order given."""
    from fedccrl_core.algorithms import build_algorithm
    from fedccrl_core.data.manifest import client_ids

    manifest_held_out(manifest, cfg.train.held_out)
    targets = manifest_held_out(manifest, [held_out_entry(h) for h in held_out], key="--held-out")
    alg = build_algorithm(algorithm, cfg.local, getattr(cfg.train, algorithm))
    # an algorithm whose own batch_size replaces train.batch_size (local_bn.py: FedBN, SiloBN, FedFD(-A))
    key = f"train.{algorithm}.batch_size" if getattr(alg.hp, "batch_size", None) is not None else "train.batch_size"
    for target in targets:
        check_batches(manifest, target, alg.local.batch_size, key)
        if cfg.train.engine == "flower":
            cfg.train.flower.require_clients(len(client_ids(manifest, target)), target)
    return targets
