"""`fedccrl partition`: split every domain of --raw into K clients and write one shard per client; with --pools,
also every client's statistic pool (FedCCRL Eq. 6-7, as `fedccrl pools` writes it).

Reads `dataset.name`, `preprocess.image_size` and the `partition` group (see fedccrl_core/data/shards.py for the
split and the shard format), and with --pools `preprocess.mean` and `preprocess.std` (fedccrl_core/data/pools.py).
The pipeline's partition stage writes both: as a stage of its own the pools paid a process start, torch's import
and a round of DVC's bookkeeping for a fraction of a second of work (docs/benchmarks.md).
"""
from __future__ import annotations

import click

from pipeline.cli import folders_apart, run_stage
from pipeline.params import load_config


def _run(raw: str, out: str, pools: str | None, params_path: str) -> None:
    folders_apart({"raw": raw}, {"out": out, "pools": pools})
    cfg = load_config(params_path)  # the whole file, before any image is read
    from fedccrl_core.data.registry import get_dataset, resolve_image_size
    from fedccrl_core.data.shards import partition

    spec, size_param, p = get_dataset(cfg.dataset.name), cfg.preprocess.image_size, cfg.partition
    feddg = p.scheme == "feddg_bench"
    partition(raw, out, spec, resolve_image_size(size_param, spec), clients_per_domain=p.clients_per_domain,
              val_fraction=p.val_fraction, dirichlet_alpha=p.dirichlet_alpha, seed=p.seed, scheme=p.scheme,
              num_clients=p.num_clients if feddg else None, lam=p.lambda_ if feddg else None,
              params={"dataset.name": spec.name, "preprocess.image_size": size_param})
    if pools is not None:
        from fedccrl_core.data.pools import build_pools

        build_pools(out, pools, cfg.preprocess.mean, cfg.preprocess.std)


@click.command()
@click.option("--raw", required=True, type=click.Path(file_okay=False), help="raw <domain>/<class>/<image> folder")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="shards folder to (re)create")
@click.option("--pools", type=click.Path(file_okay=False),
              help="also write the statistic pools to this folder (to (re)create), as `fedccrl pools` does")
@click.option("--params", "params_path", default="params.yaml", show_default=True, type=click.Path(dir_okay=False))
def command(raw: str, out: str, pools: str | None, params_path: str) -> None:
    """Decode once, split into clients (train/val), write <client>.npz shards and manifest.json (and the pools)."""
    run_stage(_run, raw, out, pools, params_path)
