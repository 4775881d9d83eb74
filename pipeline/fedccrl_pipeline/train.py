"""`fedccrl train`: federated training of one (algorithm, seed) for each held-out domain, in one process.

For each held-out entry h (a domain name or its index, pipeline/fedccrl_pipeline/params.py) it writes <out>/d<h>/model.pt (final
global model), best.pt (global model at the round of best source-validation accuracy), history.json and
history.csv (per-round metrics), all at once at the end. One process per (algorithm, seed) saves the imports and
MLflow start-up each run used to pay; on the CPU the held-out domains train side by side in worker
processes, one torch thread each, and only this process talks to MLflow. The jobs themselves are
fedccrl_core/federation/jobs.py; the MLflow side is pipeline/fedccrl_pipeline/train_tracking.py. Round checkpoints live
outside the DVC output (DVC deletes outputs before a rerun), under --checkpoints, keyed by the run's hash.
"""

from __future__ import annotations

import functools
from pathlib import Path

import click

from fedccrl_pipeline.stage_runtime import run_stage
from fedccrl_pipeline.sweep import check_train, held_out_entry
from fedccrl_pipeline.training import load_train_config, run_settings, train_tracked


def train(
    shards: Path,
    pools: Path,
    algorithm: str,
    seed: int,
    held_out: list | None,
    out: Path,
    params_path: Path,
    checkpoints: Path,
    workers: str = "auto",
) -> None:
    from fedccrl_core.algorithms import ALGORITHMS
    from fedccrl_core.data.manifest import client_ids, load_manifest
    from fedccrl_core.data.pools import check_pools
    from fedccrl_core.federation.jobs import LOG
    from fedccrl_core.federation.plan import plan_runs
    from fedccrl_core.federation.workers import worker_count
    from fedccrl_pipeline.study_privacy import join_study
    from fedccrl_pipeline.sweep_privacy import check_sweep_budget, manifest_plan
    from fedccrl_pipeline.tracked_data import shards_data
    from fedccrl_pipeline.train_tracking import TrainTracking

    cfg = load_train_config(params_path, algorithm)  # the whole file, before any data is read and before MLflow
    settings = run_settings(cfg)
    held_out = [held_out_entry(h) for h in held_out] if held_out else list(cfg.train.held_out)
    manifest = load_manifest(shards)  # metadata only: the held-out domains and the clients' sizes
    targets = check_train(cfg, manifest, algorithm, held_out)  # before any shard is read, before MLflow
    check_pools(pools, sorted({c for t in targets for c in client_ids(manifest, t)}))  # present, before MLflow
    # the sweep's epsilon per image, planned: checked against train.privacy.max_sweep_epsilon before MLflow
    plan = manifest_plan(cfg, manifest)
    planned_epsilon = check_sweep_budget(cfg, plan, algorithm, seed, targets)
    hparams = ALGORITHMS[algorithm].validated(getattr(cfg.train, algorithm))  # typed already: FedCCRL's variant read
    jobs = plan_runs(
        settings,
        cfg.partition.model_dump(by_alias=True),
        manifest,
        algorithm,
        seed,
        held_out,
        targets,
        out,
        checkpoints,
        hparams,
    )
    study = join_study(cfg, plan, algorithm, seed, targets, jobs)  # spent + these runs' plan, before MLflow
    if settings.engine == "flower":  # the same jobs over Flower (fedccrl_flower/run.py)
        from fedccrl_flower.run import train_with_flower
        from fedccrl_pipeline.mlflow_store import tracking_uri

        for job in jobs:  # train.flower as validated with the whole file, never validated again
            job.flower_train = functools.partial(
                train_with_flower, settings=cfg.train.flower, tracking_uri=tracking_uri()
            )
    n_workers = worker_count(workers, settings, len(jobs))
    data = shards_data(settings.dataset, settings.engine, manifest, shards)
    tracking = TrainTracking(cfg, settings, algorithm, seed, data, jobs, planned_epsilon, study)
    LOG(f"train {algorithm} seed {seed}: held-out {[j.target for j in jobs]}, {n_workers} at a time")
    train_tracked(jobs, n_workers, shards, pools, tracking)


@click.command("train")
@click.option("--shards", type=click.Path(path_type=Path), required=True)
@click.option("--pools", type=click.Path(path_type=Path), required=True)
@click.option("--algorithm", required=True)
@click.option("--seed", type=int, required=True)
@click.option(
    "--held-out",
    multiple=True,
    help="a held-out domain: its name, or its index in the manifest's domain order (pipeline/fedccrl_pipeline/params.py); "
    "repeatable; default: params.yaml train.held_out",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    required=True,
    help="folder of this (algorithm, seed): each held-out entry h is written to <out>/d<h>",
)
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
@click.option(
    "--checkpoints",
    type=click.Path(path_type=Path),
    default=Path(".fedccrl/checkpoints"),
    help="round checkpoints for resume (outside the DVC output)",
)
@click.option(
    "--workers",
    default="auto",
    show_default=True,
    help="held-out domains trained at once (auto: one per CPU core; 1 on CUDA and with Flower); "
    "results do not depend on it",
)
def command(shards, pools, algorithm, seed, held_out, out, params_path, checkpoints, workers):
    """Federated training of one (algorithm, seed) for every held-out domain; each round logged to MLflow and
    checkpointed."""
    run_stage(train, shards, pools, algorithm, seed, list(held_out), out, params_path, checkpoints, workers)
