"""`fedccrl site`: what a site of a deployment runs on its own data, and what the operator publishes to its sites.

    fedccrl site prepare --images DIR --domain NAME --client-id ID --classes classes.txt --out SITE [--params params.yaml]

writes SITE/shards (this site's shard and manifest) and SITE/pools (its statistics, FedCCRL Eq. 6-7). With
`--join-config site.toml --superlink HOST:PORT` (and `--root-certificates CA` or `--insecure`, optionally
`--auth-key KEY`, `--port N`) it also writes the site's join config (fedccrl_flower/site_config.py), checked before
any work and written once the site folder is. The federation's settings
(`preprocess.image_size`, `preprocess.mean/std`, `partition.val_fraction`, `partition.seed`, `dataset.name`) are
read from the operator's params.yaml, the class order from the class file the operator publishes (see
fedccrl_core/data/site.py for the split, the checks and the folder layout). Not a pipeline stage: no dvc.yaml
stage runs it. The images come from --images: params.yaml's dataset.source does not apply.

    fedccrl site join --config site.toml

runs the site's SuperNode: Flower's `flower-supernode`, its command line built from the join config and printed,
as a child that gets this process's signals; it exits with the SuperNode's exit code (fedccrl_flower/supernode.py).

    fedccrl site classes [--params params.yaml] [--images DIR] > classes.txt

prints the class file the operator publishes: a registry dataset's classes (dataset.name), in label order; for
`imagefolder`, the class folders of DIR (a `<class>/<image>` folder, e.g. the operator's test folder), sorted.

    fedccrl site federation --classes classes.txt --site ID=DOMAIN ... --out federation.json [--params params.yaml]

writes the federation file (fedccrl_flower/sites.py) from what the operator knows: its sites (client id and
domain, one --site each), the class file and params.yaml (dataset.name, preprocess.image_size): the values each
site's `prepare` writes into its manifest. Its domains are a registry dataset's, in the registry's order, or for
`imagefolder` the sites' domains, sorted (as the partition stage orders an imagefolder's domain folders).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from fedccrl_pipeline.params import load_config
from fedccrl_pipeline.stage_runtime import folders_apart, run_stage


def _federation_settings(params_path: str, classes: str):
    """(the dataset's registry entry, the SiteSettings: params.yaml's settings and the class file), before any work."""
    cfg = load_config(params_path, downloads=False)  # the whole file; a site's images come from --images
    from fedccrl_core.data.registry import get_dataset, resolve_image_size
    from fedccrl_core.data.site import SiteSettings, read_class_list
    from fedccrl_core.foundation.errors import DataError

    spec, p = get_dataset(cfg.dataset.name), cfg.partition
    if p.scheme != "per_domain":
        raise DataError(
            f"{params_path}: partition.scheme is {p.scheme!r}: a central split of every domain; a site splits its "
            "own images as the per_domain scheme does (set partition.scheme: per_domain for a deployment)"
        )
    fed = SiteSettings(
        dataset=spec.name,
        classes=read_class_list(classes),
        image_size=resolve_image_size(cfg.preprocess.image_size, spec),
        val_fraction=p.val_fraction,
        seed=p.seed,
        mean=list(cfg.preprocess.mean),
        std=list(cfg.preprocess.std),
        source=params_path,
    )
    return spec, fed


def _join_config(path: str | None, client_id: str, out: str, given: dict):
    """(path, the resolved join config) that `prepare --join-config` writes, checked before any work; None without
    --join-config. Its state folder: `state` beside the site folder."""
    from fedccrl_core.foundation.errors import DataError
    from fedccrl_core.foundation.records import parse_record
    from fedccrl_flower.site_config import PATH_KEYS, SiteConfig, check_site_files

    given = {k: v for k, v in given.items() if v is not None and v is not False}
    if path is None:
        if given:
            raise DataError(f"--{next(iter(given)).replace('_', '-')} belongs to the join config: give --join-config")
        return None
    raw = {"client_id": client_id, "site": out, "state_dir": str(Path(out).resolve().parent / "state"), **given}
    raw = {k: str(Path(v).resolve()) if k in PATH_KEYS else v for k, v in raw.items()}  # from the working folder
    where = f"--join-config {path}"
    cfg = parse_record(SiteConfig, raw, where)
    check_site_files(cfg, where, prepared=False)
    return Path(path), cfg


def _run(images, domain, client_id, classes, out, params_path, join_config, join: dict) -> None:
    folders_apart(
        {"images": images, "classes": classes, "params": params_path}, {"out": out, "join_config": join_config}
    )
    from fedccrl_core.data.site import prepare_site

    config = _join_config(join_config, client_id, out, join)
    spec, fed = _federation_settings(params_path, classes)
    prepare_site(images, out, fed, spec, domain, client_id, classes)
    if config is not None:
        from fedccrl_core.foundation.fsio import write_text
        from fedccrl_flower.site_config import site_config_text

        path, cfg = config
        write_text(path, site_config_text(cfg, path.resolve().parent))
        click.echo(f"site prepare: {path}: join with `fedccrl site join --config {path}`", err=True)


@click.group()
def command() -> None:
    """Commands run at a site of a deployment (on the site's own data), and what its operator publishes to them."""


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
@click.option("--join-config", type=click.Path(dir_okay=False), help="write the site's join config (site.toml) here")
@click.option("--superlink", help="join config: the SuperLink's Fleet API, host:port")
@click.option("--root-certificates", type=click.Path(dir_okay=False), help="join config: the SuperLink's CA (TLS)")
@click.option("--insecure", is_flag=True, help="join config: no TLS (loopback rehearsals only)")
@click.option("--auth-key", "auth_private_key", type=click.Path(dir_okay=False), help="join config: SuperNode auth key")
@click.option("--port", type=int, help="join config: the SuperNode's Runtime API port (one per SuperNode of a machine)")
@click.option(
    "--max-epsilon", type=float, help="join config: answer only runs under train.privacy with max_epsilon at most this"
)
@click.option("--max-delta", type=float, help="join config, with --max-epsilon: at a delta at most this (default 1e-5)")
@click.option(
    "--max-study-epsilon", type=float, help="join config, with --max-epsilon: the sum of the runs' max_epsilon"
)
def prepare(images, domain, client_id, classes, out, params_path, join_config, **join) -> None:
    """Decode the site's images once, split them train/val, write SITE/shards and SITE/pools (and the join config)."""
    run_stage(_run, images, domain, client_id, classes, out, params_path, join_config, join)


def _join(config: str) -> int:
    import shlex

    from fedccrl_core.foundation.errors import DataError
    from fedccrl_flower.site_budget import privacy_line
    from fedccrl_flower.site_config import load_site_config, supernode_argv
    from fedccrl_flower.supernode import find_supernode, run_supernode

    cfg = load_site_config(config)
    argv = supernode_argv(cfg, find_supernode())
    try:
        admits = privacy_line(cfg.max_epsilon, cfg.max_delta, cfg.max_study_epsilon, cfg.state_dir)
    except ValueError as e:
        raise DataError(f"{config}: key 'state_dir': {e}") from None
    if admits:
        click.echo(f"site join: privacy: {admits}", err=True)
    click.echo(f"site join: {shlex.join(argv)}", err=True)
    code = run_supernode(argv)
    click.echo(f"site join: flower-supernode exited with code {code}", err=True)
    return code


@command.command()
@click.option("--config", required=True, type=click.Path(dir_okay=False), help="the site's join config (site.toml)")
def join(config: str) -> None:
    """Run this site's SuperNode (Flower's flower-supernode) from its join config; exit with its exit code."""
    sys.exit(run_stage(_join, config))


def _classes(params_path: str, images: str | None) -> None:
    cfg = load_config(params_path, downloads=False)
    from fedccrl_core.data.registry import get_dataset
    from fedccrl_core.data.site import class_list_of
    from fedccrl_core.foundation.errors import DataError

    spec = get_dataset(cfg.dataset.name)
    if spec.classes is not None and images is not None:
        raise DataError(f"--images {images}: dataset.name {spec.name} ({params_path}) has its classes; drop --images")
    if spec.classes is None and images is None:
        raise DataError(
            f"{params_path}: dataset.name {spec.name} discovers its classes from the images: give a folder of "
            "them, one subfolder per class (fedccrl site classes --images DIR)"
        )
    click.echo("\n".join(sorted(spec.classes) if spec.classes is not None else class_list_of(images or "")))


@command.command()
@click.option("--params", "params_path", default="params.yaml", show_default=True, type=click.Path(dir_okay=False))
@click.option("--images", type=click.Path(file_okay=False), help="imagefolder: a <class>/<image> folder")
def classes(params_path: str, images: str | None) -> None:
    """Print the federation's class file (in label order), for the operator."""
    run_stage(_classes, params_path, images)


def _node_ids(node_ids: tuple[str, ...], named: dict) -> dict[str, str]:
    """--node-id ID=NODE, each naming a site given by --site and a number (`flwr supernode register`'s node id)."""
    from fedccrl_core.foundation.errors import DataError

    out: dict[str, str] = {}
    for arg in node_ids:
        cid, _, node = arg.partition("=")
        if cid not in named:
            raise DataError(f"--node-id {arg!r} (ID=NODE): '{cid}' is not a site given by --site")
        if not node.isdigit() or cid in out:
            raise DataError(f"--node-id {arg!r} (ID=NODE): one number per site, as flwr supernode register prints it")
        out[cid] = node
    return out


def _write_federation(params_path: str, classes: str, sites: tuple[str, ...], out: str, node_ids=()) -> None:
    from fedccrl_core.data.images import RESIZE_POLICY
    from fedccrl_core.data.site import check_classes, check_site_name
    from fedccrl_core.foundation.errors import DataError
    from fedccrl_core.foundation.fsio import write_json
    from fedccrl_flower.sites import FederationFile, Site

    spec, fed = _federation_settings(params_path, classes)
    check_classes(fed, spec, classes)
    named: dict[str, Site] = {}
    for arg in sites:
        cid, _, domain = arg.partition("=")
        try:
            check_site_name(spec, domain, cid)
        except DataError as e:
            raise DataError(f"--site {arg!r} (ID=DOMAIN): {e}") from None
        if cid in named:
            raise DataError(f"--site {arg!r}: client id '{cid}' is given twice (one SuperNode, one client id)")
        named[cid] = Site(id=cid, domain=domain)
    for cid, node in _node_ids(node_ids, named).items():
        named[cid] = Site(id=cid, domain=named[cid].domain, node_id=node)
    domains = list(spec.domains) if spec.domains else sorted({s.domain for s in named.values()})
    doc = FederationFile(
        dataset=spec.name,
        domains=domains,
        classes=fed.classes,
        image_size=fed.image_size,
        resize_policy=RESIZE_POLICY,
        sites=list(named.values()),
    )
    write_json(out, doc.to_dict(), indent=1)
    click.echo(f"site federation: {out}: {len(named)} sites, domains {', '.join(domains)}", err=True)


@command.command()
@click.option("--params", "params_path", default="params.yaml", show_default=True, type=click.Path(dir_okay=False))
@click.option("--classes", required=True, type=click.Path(dir_okay=False), help="the federation's class file")
@click.option("--site", "sites", required=True, multiple=True, help="a site: ID=DOMAIN (its client id and domain)")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="the federation file to write")
@click.option(
    "--node-id", "node_ids", multiple=True, help="a site's node id: ID=NODE (flwr supernode register printed NODE)"
)
def federation(params_path: str, classes: str, sites: tuple[str, ...], out: str, node_ids: tuple[str, ...]) -> None:
    """Write the federation file (fedccrl federate --federation) from the sites, the class file and params.yaml."""
    run_stage(_write_federation, params_path, classes, sites, out, node_ids)
