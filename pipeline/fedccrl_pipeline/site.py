"""`fedccrl site prepare`: run at a site, turn the site's own image folder into its SuperNode's data.

    fedccrl site prepare --images DIR --domain NAME --client-id ID --classes classes.txt --out SITE [--params params.yaml]

writes SITE/shards (this site's shard and manifest) and SITE/pools (its statistics, FedCCRL Eq. 6-7); the SuperNode
then runs with `--node-config "client-id=ID shards=SITE/shards pools=SITE/pools ..."`. The federation's settings
(`preprocess.image_size`, `preprocess.mean/std`, `partition.val_fraction`, `partition.seed`, `dataset.name`) are
read from the operator's params.yaml, the class order from the class file the operator publishes (see
fedccrl_core/data/site.py for the split, the checks and the folder layout). Not a pipeline stage: no dvc.yaml
stage runs it.

    fedccrl site classes [--params params.yaml] > classes.txt

prints the class file the operator publishes: a registry dataset's classes (dataset.name), in label order.
"""

from __future__ import annotations

import click

from fedccrl_pipeline.params import load_config
from fedccrl_pipeline.stage_runtime import folders_apart, run_stage


def _run(images: str, domain: str, client_id: str, classes: str, out: str, params_path: str) -> None:
    folders_apart({"images": images, "classes": classes, "params": params_path}, {"out": out})
    cfg = load_config(params_path)  # the whole file, before any image is read
    from fedccrl_core.data.registry import get_dataset, resolve_image_size
    from fedccrl_core.data.site import Federation, prepare_site, read_class_list
    from fedccrl_core.foundation.errors import DataError

    spec, p = get_dataset(cfg.dataset.name), cfg.partition
    if p.scheme != "per_domain":
        raise DataError(
            f"{params_path}: partition.scheme is {p.scheme!r}: a central split of every domain; a site splits its "
            "own images as the per_domain scheme does (set partition.scheme: per_domain for a deployment)"
        )
    fed = Federation(
        dataset=spec.name,
        classes=read_class_list(classes),
        image_size=resolve_image_size(cfg.preprocess.image_size, spec),
        val_fraction=p.val_fraction,
        seed=p.seed,
        mean=list(cfg.preprocess.mean),
        std=list(cfg.preprocess.std),
        source=params_path,
    )
    prepare_site(images, out, fed, spec, domain, client_id, classes)


@click.group()
def command() -> None:
    """Commands run at a site of a deployment (on the site's own data)."""


@command.command()
@click.option("--images", required=True, type=click.Path(file_okay=False), help="the site's <class>/<image> folder")
@click.option("--domain", required=True, help="the site's domain name (PACS: photo, art_painting, cartoon, sketch)")
@click.option("--client-id", required=True, help="the site's client id (its SuperNode's client-id)")
@click.option("--classes", required=True, type=click.Path(dir_okay=False), help="the federation's class file")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="site folder to (re)create")
@click.option(
    "--params",
    "params_path",
    default="params.yaml",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="the operator's params.yaml: the federation's image size, mean/std, val_fraction and seed",
)
def prepare(images: str, domain: str, client_id: str, classes: str, out: str, params_path: str) -> None:
    """Decode the site's images once, split them train/val, write SITE/shards and SITE/pools."""
    run_stage(_run, images, domain, client_id, classes, out, params_path)


def _classes(params_path: str) -> None:
    cfg = load_config(params_path)
    from fedccrl_core.data.registry import get_dataset
    from fedccrl_core.foundation.errors import DataError

    spec = get_dataset(cfg.dataset.name)
    if spec.classes is None:
        raise DataError(
            f"{params_path}: dataset.name {spec.name} discovers its classes from the images: write the class file "
            "yourself, class names in label order (sorted, as the partition stage orders them), one a line"
        )
    click.echo("\n".join(sorted(spec.classes)))


@command.command()
@click.option("--params", "params_path", default="params.yaml", show_default=True, type=click.Path(dir_okay=False))
def classes(params_path: str) -> None:
    """Print the federation's class file (a registry dataset's classes, in label order), for the operator."""
    run_stage(_classes, params_path)
