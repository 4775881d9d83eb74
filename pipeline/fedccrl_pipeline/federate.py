"""`fedccrl federate`: the operator's training of one (algorithm, seed, held-out domain) over a Flower deployment
whose sites hold their own data. It reads no data file: the sites come from the federation file
(fedccrl_flower/sites.py), the training settings from params.yaml, n_i and every accuracy from the sites' replies
(the ServerApp evaluates on the sites: fedccrl_flower/evalsets.py). It submits the run to the SuperLink at
`--superlink` (TLS with `--root-certificates`; the ServerApp then runs on the SuperLink's host and keeps its
checkpoint and log in `--work` there), follows it through the team's MLflow tracking server (MLFLOW_TRACKING_URI:
the ServerApp reports each round, its status and the trained weights to the run's child run,
fedccrl_flower/tracked_report.py; this machine opens nothing on the SuperLink host's disk), and writes <out>/ as the train stage
writes a run folder (model.pt, best.pt, history.json, history.csv), through the train stage's own path
(pipeline/fedccrl_pipeline/training.py): the same run key with the code's hash, model meta with its provenance,
privacy summary, sweep budget and MLflow runs. <out> appears complete or not at all."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import click

from fedccrl_core.foundation.errors import FedCCRLError
from fedccrl_pipeline.stage_runtime import run_stage
from fedccrl_pipeline.training import load_train_config, run_settings, train_tracked

if TYPE_CHECKING:
    from collections.abc import Callable

    from fedccrl_core.federation.history import RunHistory
    from fedccrl_core.federation.plan import DeployedData
    from fedccrl_flower.settings import FlowerSettings
    from fedccrl_flower.sites import FederationFile
    from fedccrl_pipeline.study_privacy import Study


def federate(
    federation: Path,
    params_path: Path,
    algorithm: str,
    seed: int,
    held_out: str,
    superlink: str,
    root_certificates: str,
    out: Path,
    work: Path,
    timeout_s: float,
    deploy_path: Path | None = None,
    allow_refused: bool = False,
) -> None:
    """One deployed run of `algorithm` x `seed` holding out `held_out` over the federation file's sites: checked and
    planned before anything starts, counted in its study, trained over the SuperLink, tracked as the train stage's
    runs are; the sites it refused or dropped named (exit 2 unless `allow_refused`)."""
    from fedccrl_core.algorithms import ALGORITHMS
    from fedccrl_core.federation.history import load_history
    from fedccrl_core.federation.jobs import LOG
    from fedccrl_core.federation.plan import plan_deployed
    from fedccrl_flower.sites import read_federation
    from fedccrl_flower.spec import ServerSpec
    from fedccrl_pipeline.deploy_params import load_deploy
    from fedccrl_pipeline.deployed_study import catch_up
    from fedccrl_pipeline.study_privacy import join_study, study_of
    from fedccrl_pipeline.sweep_privacy import check_sweep_budget, federation_plan
    from fedccrl_pipeline.tracked_data import deployed_data
    from fedccrl_pipeline.train_tracking import TrainTracking

    deploy = load_deploy(deploy_path) if deploy_path is not None else None  # its deploy file, whole, first
    cfg = load_train_config(params_path, algorithm, downloads=False)  # the whole file first, before anything starts
    fed_file = read_federation(federation)
    try:
        target = fed_file.held_out(held_out)
    except ValueError as e:
        raise ValueError(f"{federation}: --held-out: {e}") from None
    settings, flower = run_settings(cfg), cfg.train.flower
    flower.require_clients(len(fed_file.sources(target)), target)
    # the sweep's epsilon per image, planned over the sites (their sizes unknown here: the worst case), before MLflow
    plan = federation_plan(cfg, fed_file, deploy)
    planned_epsilon = check_sweep_budget(cfg, plan, algorithm, seed, [target])
    hparams = ALGORITHMS[algorithm].validated(getattr(cfg.train, algorithm))
    engine = flower.model_dump(include=set(ServerSpec.FROM_SETTINGS))
    job = plan_deployed(settings, deployed_run_data(fed_file), engine, algorithm, seed, target, out, work, hparams)
    caught = study_of(cfg, job.data_key)
    if caught is not None:  # what an earlier federate of this run left uncounted, before the budget check
        catch_up(caught, job, LOG)
    study = join_study(cfg, plan, algorithm, seed, [target], [job])  # spent + this run's plan, before MLflow
    job.flower_train = _flower_train(flower, fed_file, superlink, root_certificates, timeout_s, study)
    tracking = TrainTracking(
        cfg, job.settings, algorithm, seed, deployed_data(fed_file, federation), [job], planned_epsilon, study
    )
    LOG(f"federate {algorithm} seed {seed}: held-out {target} over {superlink}")
    train_tracked([job], 1, None, None, tracking, progress=LOG)
    report_sites(load_history(job.out), allow_refused)


def _flower_train(
    flower: FlowerSettings,
    fed_file: FederationFile,
    superlink: str,
    root_certificates: str,
    timeout_s: float,
    study: Study | None,
) -> Callable:
    """The job's flower_train: train_deployed over `superlink`, the ServerApp reporting to this process's tracking
    server (fedccrl_flower/tracked_report.py); with a study, each record's releases counted in it as they arrive
    (deployed_study.counted: the ServerApp finds no pointer)."""
    from fedccrl_core.federation.jobs import LOG
    from fedccrl_flower.run import train_deployed
    from fedccrl_pipeline.deployed_study import counted
    from fedccrl_pipeline.mlflow_store import tracking_uri

    train = functools.partial(
        train_deployed,
        settings=flower,
        federation=fed_file,
        superlink=superlink,
        root_certificates=root_certificates,
        timeout_s=timeout_s,
        tracking_uri=tracking_uri(),
    )
    return counted(train, study, LOG) if study is not None else train


def deployed_run_data(fed_file: FederationFile) -> DeployedData:
    """What a deployed run trains on, as its plan keys it: the federation file's dataset, domains, classes, image
    size and sites (fedccrl_core/federation/plan.py)."""
    from fedccrl_core.federation.plan import DeployedData

    return DeployedData(
        dataset=fed_file.dataset,
        domains=list(fed_file.domains),
        classes=list(fed_file.classes),
        image_size=fed_file.image_size,
        resize=fed_file.resize_policy,
        site_domains=[site.domain for site in fed_file.sites],
        description=fed_file.to_dict(),
    )


class SitesRefused(FedCCRLError):
    """A deployment's run finished (its folder is written) with sites refused for what they sent or held."""


def report_sites(history: RunHistory, allow_refused: bool) -> None:
    """The run's sites in its final summary on stderr: each one dropped (did not answer) or refused (its data or
    its replies) by client id, round and reason. SitesRefused (exit code 2) when a site was refused, unless the
    operator allows it (--allow-refused-sites): the model then trained without that site's data."""
    from fedccrl_core.federation.jobs import LOG

    dropped, refused = history.dropped_sites(), history.refused_sites()
    for line in dropped:
        LOG(f"federate: dropped {line}")
    for line in refused:
        LOG(f"federate: REFUSED {line}")
    if not dropped and not refused:
        LOG("federate: every site took part in every round")
    if refused and not allow_refused:
        raise SitesRefused(
            f"{len(refused)} refusal(s) of a site in this run (the model trained without it): "
            + "; ".join(refused)
            + ". Fix the site (fedccrl site prepare with the federation file), or pass --allow-refused-sites"
        )


@click.command("federate")
@click.option("--federation", type=click.Path(path_type=Path), required=True, help="the federation file (JSON)")
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
@click.option("--algorithm", required=True)
@click.option("--seed", type=int, required=True)
@click.option("--held-out", required=True, help="the held-out domain: its name or its index in the federation file")
@click.option("--superlink", required=True, help="host:port of the SuperLink's control API (flwr run)")
@click.option("--root-certificates", default="", help='the SuperLink\'s CA certificate (TLS); "" = --insecure')
@click.option("--out", type=click.Path(path_type=Path), required=True, help="the run folder to write")
@click.option(
    "--work",
    type=click.Path(path_type=Path),
    default=None,
    help="the ServerApp's work folder (checkpoint, report; default <out>.flower)",
)
@click.option("--timeout-s", type=float, default=0.0, help="whole run (0 = no limit)")
@click.option(
    "--deploy",
    "deploy_path",
    type=click.Path(path_type=Path),
    default=None,
    help="the deployment's params file (deploy/params.yaml), validated first",
)
@click.option(
    "--allow-refused-sites",
    "allow_refused",
    is_flag=True,
    help="exit 0 although a site was refused for its data or replies (the model trained without it)",
)
def command(
    federation,
    params_path,
    algorithm,
    seed,
    held_out,
    superlink,
    root_certificates,
    out,
    work,
    timeout_s,
    deploy_path,
    allow_refused,
):
    """Train over a Flower deployment whose sites hold their own data; this machine reads no data file."""
    work = work or out.with_name(out.name + ".flower")
    run_stage(
        federate,
        federation,
        params_path,
        algorithm,
        seed,
        held_out,
        superlink,
        root_certificates,
        out,
        work,
        timeout_s,
        deploy_path,
        allow_refused,
    )
