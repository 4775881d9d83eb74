"""`fedccrl partition`: split every domain of --raw into K clients and write one shard per client.

Reads `dataset.name`, `preprocess.image_size` and the `partition` group (see fedccrl_core/data/partition.py and
splits.py for the split, shards.py for the shard format). The clients' statistic pools are the next stage's
(`fedccrl pools`).
"""

from __future__ import annotations

import click

from fedccrl_pipeline.params import load_config
from fedccrl_pipeline.stage_runtime import folders_apart, run_stage


def _run(raw: str, out: str, params_path: str) -> None:
    folders_apart({"raw": raw}, {"out": out})
    cfg = load_config(params_path)  # the whole file, before any image is read
    from fedccrl_core.data.partition import PartitionSettings, partition
    from fedccrl_core.data.registry import get_dataset, resolve_image_size

    spec, size_param, p = get_dataset(cfg.dataset.name), cfg.preprocess.image_size, cfg.partition
    feddg = p.scheme == "feddg_bench"
    settings = PartitionSettings(
        resolve_image_size(size_param, spec),
        clients_per_domain=p.clients_per_domain,
        val_fraction=p.val_fraction,
        dirichlet_alpha=p.dirichlet_alpha,
        seed=p.seed,
        scheme=p.scheme,
        num_clients=p.num_clients if feddg else None,
        lam=p.lambda_ if feddg else None,
    )
    partition(raw, out, spec, settings, params={"dataset.name": spec.name, "preprocess.image_size": size_param})


@click.command()
@click.option("--raw", required=True, type=click.Path(file_okay=False), help="raw <domain>/<class>/<image> folder")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="shards folder to (re)create")
@click.option("--params", "params_path", default="params.yaml", show_default=True, type=click.Path(dir_okay=False))
def command(raw: str, out: str, params_path: str) -> None:
    """Decode once, split into clients (train/val), write <client>.npz shards and manifest.json."""
    run_stage(_run, raw, out, params_path)
