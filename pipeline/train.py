"""`fedccrl train`: federated training of one (algorithm, seed) for each held-out domain, in one process.

For each held-out entry h (a domain name or its index, pipeline/params.py) it writes <out>/d<h>/model.pt (final
global model), best.pt (global model at the round of best source-validation accuracy), history.json and
history.csv (per-round metrics), all at once at the end. One process per (algorithm, seed) saves the imports and
MLflow start-up each run used to pay; on the CPU the held-out domains train side by side in worker
processes, one torch thread each, and only this process talks to MLflow. The jobs themselves are
fedccrl_core/federation/jobs.py; the MLflow side is pipeline/train_tracking.py. Round checkpoints live
outside the DVC output (DVC deletes outputs before a rerun), under --checkpoints, keyed by the run's hash.
"""
from __future__ import annotations

from pathlib import Path

import click

from fedccrl_core.federation.jobs import LOG
from pipeline.cli import run_stage
from pipeline.params import ParamError, check_train, held_out_entry, load_params, validate_params


def train_config(params: dict, algorithm: str) -> dict:
    """Every param the run depends on, from the validated params file (pipeline/params.py); ParamError with one
    line per problem. The raw values are kept (e.g. an int lr stays an int), so a run's key and its MLflow params
    are those of params.yaml as written."""
    from fedccrl_core.algorithms import ALGORITHMS

    if algorithm not in ALGORITHMS:
        raise ParamError(f"--algorithm: got {algorithm!r}; must be one of {', '.join(ALGORITHMS)} "
                         "(params.yaml train.algorithms)")
    validate_params(params, (algorithm,))
    t = params["train"]
    return {
        "dataset": params["dataset"]["name"],
        "backbone": params["model"]["backbone"], "pretrained": params["model"]["pretrained"],
        "mean": params["preprocess"]["mean"], "std": params["preprocess"]["std"],
        **{k: t[k] for k in ("engine", "device", "rounds", "local_epochs", "batch_size", "lr", "weight_decay",
                             "lr_schedule", "client_fraction")},
        "fast": t.get("fast", True), "concurrent_clients": t.get("concurrent_clients", "auto"),
        "client_state": t.get("client_state", "persistent"),
        "eval_batch_size": params["evaluate"]["batch_size"],
        "hparams": t.get(algorithm) or {},
        # only when on: a run without DP keeps the run key (and checkpoint) it had before train.privacy existed
        **({"privacy": t["privacy"]} if (t.get("privacy") or {}).get("enabled") else {}),
    }


def train(shards: Path, pools: Path, algorithm: str, seed: int, held_out: list | None, out: Path,
          params_path: Path, checkpoints: Path, workers: str = "auto") -> None:
    from fedccrl_core.algorithms import build_algorithm
    from fedccrl_core.data.pools import check_pools
    from fedccrl_core.data.shards import client_ids, load_manifest
    from fedccrl_core.federation.jobs import local_config, plan_runs, run_jobs, worker_count
    from pipeline.train_tracking import TrainTracking

    params = load_params(params_path)  # the whole file, before any data is read and before MLflow
    cfg = train_config(params, algorithm)
    held_out = [held_out_entry(h) for h in held_out] if held_out else list(params["train"]["held_out"])
    manifest = load_manifest(shards)  # metadata only: the held-out domains and the clients' sizes
    targets = check_train(params, manifest, algorithm, held_out)  # before any shard is read, before MLflow
    check_pools(pools, sorted({c for t in targets for c in client_ids(manifest, t)}))  # present, before MLflow
    alg_hp = build_algorithm(algorithm, local_config(cfg), cfg["hparams"]).hp
    jobs = plan_runs(params, cfg, manifest, algorithm, seed, held_out, targets, out, checkpoints, alg_hp)
    if cfg["engine"] == "flower":  # the same jobs over Flower (fedccrl_flower/run.py)
        from fedccrl_flower.run import train_with_flower

        for job in jobs:
            job["flower_train"] = train_with_flower
    n_workers = worker_count(workers, cfg, len(jobs))
    tracking = TrainTracking(params, cfg, algorithm, seed, manifest, shards, jobs)
    LOG(f"train {algorithm} seed {seed}: held-out {[j['target'] for j in jobs]}, {n_workers} at a time")
    try:
        run_jobs(jobs, n_workers, shards, pools, tracking.start, tracking.on_message)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM (fedccrl_core/procs.py): resumable, not failed
        tracking.finish_all("KILLED")
        raise
    except BaseException:
        tracking.finish_all("FAILED")
        raise


@click.command("train")
@click.option("--shards", type=click.Path(path_type=Path), required=True)
@click.option("--pools", type=click.Path(path_type=Path), required=True)
@click.option("--algorithm", required=True)
@click.option("--seed", type=int, required=True)
@click.option("--held-out", multiple=True,
              help="a held-out domain: its name, or its index in the manifest's domain order (pipeline/params.py); "
                   "repeatable; default: params.yaml train.held_out")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="folder of this (algorithm, seed): each held-out entry h is written to <out>/d<h>")
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
@click.option("--checkpoints", type=click.Path(path_type=Path), default=Path(".fedccrl/checkpoints"),
              help="round checkpoints for resume (outside the DVC output)")
@click.option("--workers", default="auto", show_default=True,
              help="held-out domains trained at once (auto: one per CPU core; 1 on CUDA and with Flower); "
                   "results do not depend on it")
def command(shards, pools, algorithm, seed, held_out, out, params_path, checkpoints, workers):
    """Federated training of one (algorithm, seed) for every held-out domain; each round logged to MLflow and
    checkpointed."""
    run_stage(train, shards, pools, algorithm, seed, list(held_out), out, params_path, checkpoints, workers)
