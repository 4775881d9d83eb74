"""`fedccrl partition`: split every domain of --raw into K clients and write one shard per client.

Reads `dataset.name`, `preprocess.image_size` and the `partition` group (see
fedccrl_core/data/shards.py for the split and the shard format).
"""
from __future__ import annotations

import click

from pipeline.cli import run_stage
from pipeline.download import exit_cleanly_on_sigterm
from pipeline.params import get, load_params


def _run(raw: str, out: str, params_path: str) -> None:
    from fedccrl_core.data.registry import get_dataset, resolve_image_size
    from fedccrl_core.data.shards import partition

    p = load_params(params_path)
    spec = get_dataset(get(p, "dataset.name", str))
    size_param = get(p, "preprocess.image_size", (int, str))
    image_size = resolve_image_size(size_param, spec)
    k = get(p, "partition.clients_per_domain", int)
    val_fraction = get(p, "partition.val_fraction", (int, float))
    alpha = get(p, "partition.dirichlet_alpha", (int, float, type(None)), default=None)
    seed = get(p, "partition.seed", int)
    scheme = get(p, "partition.scheme", str, default="per_domain")
    num_clients = get(p, "partition.num_clients", int, default=None) if scheme == "feddg_bench" else None
    lam = get(p, "partition.lambda", (int, float), default=None) if scheme == "feddg_bench" else None
    partition(raw, out, spec, image_size, clients_per_domain=k, val_fraction=float(val_fraction),
              dirichlet_alpha=None if alpha is None else float(alpha), seed=seed, scheme=scheme,
              num_clients=num_clients, lam=None if lam is None else float(lam),
              params={"dataset.name": spec.name, "preprocess.image_size": size_param})


@click.command()
@click.option("--raw", required=True, type=click.Path(file_okay=False), help="raw <domain>/<class>/<image> folder")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="shards folder to (re)create")
@click.option("--params", "params_path", default="params.yaml", show_default=True, type=click.Path(dir_okay=False))
def command(raw: str, out: str, params_path: str) -> None:
    """Decode once, split into clients (train/val), write <client>.npz shards and manifest.json."""
    exit_cleanly_on_sigterm()
    run_stage(_run, raw, out, params_path)
