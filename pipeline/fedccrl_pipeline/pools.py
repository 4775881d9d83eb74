"""`fedccrl pools`: per-sample channel mean/std of every client's training images (FedCCRL Eq. 6-7).

Reads `preprocess.mean` and `preprocess.std` (see fedccrl_core/data/pools.py).
"""

from __future__ import annotations

import click

from fedccrl_pipeline.params import load_config
from fedccrl_pipeline.stage_runtime import folders_apart, run_stage


def _run(shards: str, out: str, params_path: str) -> None:
    folders_apart({"shards": shards}, {"out": out})
    cfg = load_config(params_path)  # the whole file, before any shard is read
    from fedccrl_core.data.pools import build_pools

    build_pools(shards, out, cfg.preprocess.mean, cfg.preprocess.std)


@click.command()
@click.option("--shards", required=True, type=click.Path(file_okay=False), help="shards folder (partition stage)")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="pools folder to (re)create")
@click.option("--params", "params_path", default="params.yaml", show_default=True, type=click.Path(dir_okay=False))
def command(shards: str, out: str, params_path: str) -> None:
    """Write <client>.npz with mu, sigma float32 [n_train, 3] and manifest.json."""
    run_stage(_run, shards, out, params_path)
