"""`fedccrl train`: federated training of one (algorithm, seed) for each held-out domain, in one process.

For each held-out entry h (a domain name or its index, pipeline/params.py) it writes <out>/d<h>/model.pt (final global model), best.pt (global model at the
round of best source-validation accuracy), history.json and history.csv (per-round metrics), all at
once at the end. One process per (algorithm, seed) instead of one per run saves the ~5 s of imports and
MLflow start-up each run used to pay (issue 15); on the CPU the held-out domains train side by side in
worker processes, one torch thread each (`worker_count`), and only this process talks to MLflow. Round checkpoints live outside the DVC output (DVC deletes outputs before a
rerun), under --checkpoints, keyed by a hash of everything that determines the run.
"""
from __future__ import annotations

import csv
import json
import os
import sys
import traceback
from pathlib import Path

import click

from fedccrl_core import contract
from pipeline.cli import run_stage
from pipeline.params import ParamError, check_train, get, held_out_entry, load_params, validate_params

LOG = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731


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
    }


def local_config(cfg: dict):
    """The LocalConfig every algorithm's local training reads, from a validated train_config()."""
    from fedccrl_core.algorithms import LocalConfig

    return LocalConfig(rounds=cfg["rounds"], local_epochs=cfg["local_epochs"], batch_size=cfg["batch_size"],
                       lr=float(cfg["lr"]), weight_decay=float(cfg["weight_decay"]), lr_schedule=cfg["lr_schedule"],
                       mean=tuple(cfg["mean"]), std=tuple(cfg["std"]), fast=cfg["fast"])


def resolve_model(cfg: dict) -> tuple[str, str]:
    from fedccrl_core.data.registry import resolve_backbone, resolve_pretrained

    return resolve_backbone(cfg["backbone"], cfg["dataset"]), resolve_pretrained(cfg["pretrained"], cfg["dataset"])


def load_clients(shards: Path, pools: Path, domains: list[str], device):
    from fedccrl_core.data.pools import load_pool
    from fedccrl_core.data.shards import load_client
    from fedccrl_core.federation.client import ClientData

    clients = []
    from fedccrl_core.data.shards import MIXED

    for entry in load_manifest_clients(shards):
        held_out = [d for d in entry.get("domain_counts", {entry["domain"]: 1}) if d not in domains]
        if entry["domain"] != MIXED and entry["domain"] not in domains:
            continue
        s = load_client(shards, entry["id"], exclude_domain=held_out[0] if held_out else None, mmap=True)
        if not len(s.train_y):
            continue                                   # a mixed client holding only the held-out domain
        mu, sigma = load_pool(pools, entry["id"])
        if s.train_rows is not None:
            mu, sigma = mu[s.train_rows], sigma[s.train_rows]
        if len(mu) != len(s.train_y):
            raise ValueError(f"{pools}/{entry['id']}.npz: {len(mu)} statistics for {len(s.train_y)} training samples "
                             "(pools are stale: rerun the pools stage)")
        clients.append(ClientData.from_numpy(s.client_id, s.domain, s.train_x, s.train_y, s.val_x, s.val_y, device,
                                             mu, sigma, lazy=True))  # images read when sampled (issue 18)
    return clients


def load_manifest_clients(shards: Path) -> list[dict]:
    from fedccrl_core.data.shards import load_manifest

    return load_manifest(shards)["clients"]


def plan_runs(params: dict, cfg: dict, manifest: dict, algorithm: str, seed: int, held_out: list,
              targets: list[str], out: Path, checkpoints: Path, alg_hp: dict) -> list[dict]:
    """One job per held-out entry (checked by check_train; `targets` are their domain names): everything a
    worker needs (plain data, picklable), its run key (the hash of everything that determines the run, naming
    its round checkpoint) and its output folder out/d<entry>."""
    from pipeline.tracking import code_hash, params_hash

    domains = list(manifest["domains"])
    backbone, pretrained = resolve_model(cfg)
    jobs = []
    for h, target in zip(held_out, targets):
        i = domains.index(target)
        run_params = {**{k: v for k, v in cfg.items() if k != "hparams"}, "backbone": backbone,
                      "pretrained": pretrained, "algorithm": algorithm, "seed": seed, "held_out": domains[i],
                      algorithm: alg_hp, "partition": params.get("partition"), "image_size": manifest["image_size"]}
        run_key = params_hash({**run_params, "manifest": params_hash(manifest), "code": code_hash()})
        ckpt = checkpoints / contract.checkpoint_dir_name(algorithm, seed, h) / f"{run_key}.pt"
        jobs.append({"index": i, "target": domains[i], "sources": [d for d in domains if d != domains[i]],
                     "algorithm": algorithm, "seed": seed, "cfg": cfg, "backbone": backbone,
                     "pretrained": pretrained, "run_params": run_params, "run_key": run_key, "ckpt": ckpt,
                     "out": out / contract.domain_dir_name(h), "flower": get(params, "train.flower", {}),
                     "domains": domains, "classes": list(manifest["classes"]),
                     "image_size": manifest["image_size"], "resize": manifest.get("resize_policy", "resize SxS bilinear")})
    return jobs


def mlflow_params(params: dict, job: dict, device: str) -> dict:
    """A child run's MLflow params: params.yaml's dotted keys with the values the run actually used (the
    backbone, pretrained weights and image size that `auto` resolved to, every hyperparameter of its
    algorithm as validated, the device that ran), for its one algorithm, seed and held-out domain
    (train.algorithm, train.seed, train.held_out)."""
    from pipeline.params import TrainSweep
    from pipeline.tracking import flatten

    t = params["train"]
    train = {k: t[k] for k in TrainSweep.model_fields if k in t and k not in ("held_out", "algorithms", "seeds")}
    if train.get("engine") != "flower":
        train.pop("flower", None)
    train.update(device=device, algorithm=job["algorithm"], seed=job["seed"], held_out=job["target"])
    train[job["algorithm"]] = job["run_params"][job["algorithm"]]
    return flatten({"dataset": params["dataset"],
                    "preprocess": {**params["preprocess"], "image_size": job["image_size"]},
                    "partition": params.get("partition") or {},
                    "model": {"backbone": job["backbone"], "pretrained": job["pretrained"]},
                    "train": train, "evaluate": {"batch_size": params["evaluate"]["batch_size"]}})


def run_one(job: dict, shards: Path, pools: Path, report, run_ids=None) -> dict:
    """Train one held-out domain (in this process or in a worker) and write job['out'] at once at the end.
    report(kind, payload) receives every round record ("round") as it appears. On the CPU the run uses one
    torch thread, whatever the machine's core count, so its numbers are the same on every machine and with
    any number of workers (parallelism comes from training several held-out domains at once). run_ids(), if
given, returns the MLflow ids the outputs record; a worker receives them from the parent meanwhile."""
    import numpy as np
    import torch

    from fedccrl_core.algorithms import build_algorithm
    from fedccrl_core.checkpoint import save_model
    from fedccrl_core.data.shards import load_domain_test
    from fedccrl_core.federation.client import ClientData
    from fedccrl_core.federation.engine import EvalSets, InProcessEngine, resolve_device

    cfg, target, out = job["cfg"], job["target"], Path(job["out"])
    device = resolve_device(cfg["device"])
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    log = lambda msg: LOG(f"[{job['algorithm']} {target}] {msg}")  # noqa: E731
    try:
        log(f"seed {job['seed']}: held-out {target}, sources {job['sources']}, {job['backbone']} on {device}")
        clients = load_clients(shards, pools, job["sources"], device)
        if len(clients) < 2:
            raise ValueError(f"{shards}: need at least 2 source clients, found {len(clients)}")
        tx, ty = load_domain_test(shards, target)
        evalsets = EvalSets(torch.cat([c.val_x for c in clients]), torch.cat([c.val_y for c in clients]),
                            ClientData.from_numpy("target", target, tx, ty, tx[:0], ty[:0], device).train_x,
                            torch.from_numpy(np.asarray(ty, dtype=np.int64)).to(device), cfg["eval_batch_size"])
        del tx, ty      # the NCHW copy in evalsets is the one copy of the target domain kept for training
        alg = build_algorithm(job["algorithm"], local_config(cfg), cfg["hparams"])
        torch.manual_seed(job["seed"])
        model = alg.build_model(job["backbone"], len(job["classes"]), job["pretrained"], alg.hp).to(device)
        on_round = lambda rec: report("round", rec)  # noqa: E731
        if cfg["engine"] == "flower":  # same algorithm, seeds and record dicts over Flower (fedccrl_flower/run.py)
            from fedccrl_flower.run import train_with_flower

            result = train_with_flower(
                job["flower"], algorithm=job["algorithm"], local=alg.local, hparams=alg.hp,
                backbone=job["backbone"], pretrained=job["pretrained"], num_classes=len(job["classes"]),
                seed=job["seed"], held_out=target, shards=shards, pools=pools, device=cfg["device"],
                eval_batch_size=cfg["eval_batch_size"], client_fraction=cfg["client_fraction"],
                checkpoint=job["ckpt"], run_info={"run_key": job["run_key"]}, on_round=on_round, log=log,
                client_state=cfg["client_state"])
        else:
            result = InProcessEngine(alg, model, clients, evalsets, cfg["rounds"], job["seed"],
                                     float(cfg["client_fraction"]), job["ckpt"], on_round=on_round,
                                     run_info={"run_key": job["run_key"]}, log=log,
                                     concurrent_clients=cfg["concurrent_clients"],
                                     client_state=cfg["client_state"]).run()
    finally:
        torch.set_num_threads(threads)

    if run_ids is not None:
        job.update(run_ids())
    meta = {"backbone": job["backbone"], "num_classes": len(job["classes"]), "classes": job["classes"],
            "image_size": job["image_size"], "mean": list(cfg["mean"]), "std": list(cfg["std"]),
            "resize": job["resize"], "dataset": cfg["dataset"], "domains": job["domains"],
            "held_out_domain": target, "held_out_index": job["index"], "algorithm": job["algorithm"],
            "seed": job["seed"], "hparams": alg.hp, "params_hash": job["run_key"], "git_commit": job["commit"],
            "mlflow_run_id": job["mlflow_run_id"], "mlflow_experiment_id": job["mlflow_experiment_id"]}
    from fedccrl_core.fsio import atomic_dir

    with atomic_dir(out) as tmp:  # fedccrl_core.fsio: .<out>.tmp-<pid>-<token>, renamed into place when complete
        model.load_state_dict(result.final_weights)
        save_model(tmp / contract.MODEL_FILE, model, {**meta, "round": cfg["rounds"]})
        model.load_state_dict(result.best_weights)
        save_model(tmp / contract.BEST_FILE, model, {**meta, "round": result.best_round})
        (tmp / contract.HISTORY_FILE).write_text(json.dumps({"meta": meta, contract.BEST_ROUND: result.best_round,
                                                      "rounds": result.history}, indent=1))
        keys = [*contract.HISTORY_CSV_FIELDS,
                *sorted({k for r in result.history for k in r if contract.is_loss_term(k)})]
        with open(tmp / contract.HISTORY_CSV, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(result.history)
    final = result.history[-1]
    log(f"done: final target acc {final[contract.TARGET_ACC]:.4f}; best-val round {result.best_round} -> {out}")
    return {contract.FINAL_TARGET_ACC: final[contract.TARGET_ACC],
            contract.BEST_VAL_TARGET_ACC: result.history[result.best_round - 1][contract.TARGET_ACC],
            contract.BEST_ROUND: result.best_round}


def worker_count(setting: str, cfg: dict, n_jobs: int) -> int:
    """How many held-out domains train at once (--workers). auto: one per CPU core this process may use,
    on the CPU in-process engine; 1 on CUDA (one device; clients already overlap on CUDA streams) and with
    Flower (each run starts its own federation)."""
    if setting != "auto":
        try:
            n = int(setting)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"--workers must be auto or an integer >= 1, got {setting!r}")
        return min(n, n_jobs)
    if cfg["engine"] == "flower" or cfg["device"] == "cuda":
        return 1
    if cfg["device"] == "auto":
        import torch

        if torch.cuda.is_available():
            return 1
    return max(1, min(len(os.sched_getaffinity(0)), n_jobs))


def _worker_main(job: dict, shards: Path, pools: Path, queue, ids) -> None:
    """A worker process (spawned): one run, its records and outcome sent to the parent, which alone talks
    to MLflow."""
    from fedccrl_core.errors import FedCCRLError
    from fedccrl_core.procs import die_with_parent

    die_with_parent()  # the parent killed (kill -9 included): no orphan trainer
    try:
        summary = run_one(job, shards, pools, lambda kind, rec: queue.put((kind, job["index"], rec)), ids.recv)
        queue.put(("done", job["index"], summary))
    except (ValueError, FileNotFoundError, FedCCRLError) as e:
        queue.put(("error", job["index"], f"{job['target']}: {e}"))
    except BaseException:
        queue.put(("crash", job["index"], traceback.format_exc()))


def run_jobs(jobs: list[dict], workers: int, shards: Path, pools: Path, start, on_message) -> None:
    """Run the jobs, `workers` at a time: in this process when workers == 1, else in spawned worker
    processes (one torch thread each). start(job) opens the job's MLflow run and returns the ids its outputs
    record: in this process before an in-process job, and while a worker already trains (so MLflow's start-up,
    ~10 s on a new store, overlaps training). on_message(kind, index, payload) receives "round" records and
    "done" summaries, in this process."""
    if workers == 1:
        for job in jobs:
            job.update(start(job))
            on_message("done", job["index"],
                       run_one(job, shards, pools, lambda kind, rec, i=job["index"]: on_message(kind, i, rec)))
        return
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")  # not fork: torch's OpenMP pool does not survive a fork
    q = ctx.Queue()
    pending, live, done = list(jobs), {}, set()
    try:
        while pending or live:
            while pending and len(live) < workers:
                job = pending.pop(0)
                ids, ids_child = ctx.Pipe()
                p = ctx.Process(target=_worker_main, args=(job, shards, pools, q, ids_child), daemon=True)
                p.start()
                live[job["index"]] = p
                ids.send(start(job))
            try:
                kind, index, payload = q.get(timeout=0.5)
            except queue_mod.Empty:
                for index, p in list(live.items()):
                    if p.exitcode not in (None, 0) and index not in done:
                        raise RuntimeError(f"training worker for held-out index {index} died (exit code {p.exitcode})")
                continue
            if kind == "error":
                raise ValueError(payload)
            if kind == "crash":
                raise RuntimeError(f"training worker for held-out index {index} failed:\n{payload}")
            on_message(kind, index, payload)
            if kind == "done":
                done.add(index)
                live.pop(index).join()
    finally:
        for p in live.values():
            p.terminate()
        for p in live.values():
            p.join(10)


def train(shards: Path, pools: Path, algorithm: str, seed: int, held_out: list | None, out: Path,
          params_path: Path, checkpoints: Path, workers: str = "auto") -> None:
    from fedccrl_core.algorithms import build_algorithm
    from fedccrl_core.data.shards import load_manifest
    from fedccrl_core.fsio import write_text
    from pipeline.tracking import (ChildRun, dvc_experiment_name, git_commit, params_hash, parent_run_id,
                                   run_status)

    params = load_params(params_path)  # the whole file, before any data is read and before MLflow
    cfg = train_config(params, algorithm)
    held_out = [held_out_entry(h) for h in held_out] if held_out else list(params["train"]["held_out"])
    manifest = load_manifest(shards)  # metadata only: the held-out domains and the clients' sizes
    targets = check_train(params, manifest, algorithm, held_out)  # before any shard is read, before MLflow
    from fedccrl_core.data.pools import check_pools
    from fedccrl_core.data.shards import client_ids

    check_pools(pools, sorted({c for t in targets for c in client_ids(manifest, t)}))  # present, before MLflow
    alg_hp = build_algorithm(algorithm, local_config(cfg), cfg["hparams"]).hp
    jobs = plan_runs(params, cfg, manifest, algorithm, seed, held_out, targets, out, checkpoints, alg_hp)
    n_workers = worker_count(workers, cfg, len(jobs))

    sweep_params = {k: v for k, v in params.items() if k not in ("evaluate", "export")}
    from fedccrl_core.algorithms import ALGORITHMS

    swept = set(params["train"]["algorithms"])  # the parent names only the groups of the sweep's algorithms
    sweep_params = {**sweep_params, "train": {k: v for k, v in sweep_params.get("train", {}).items()
                                              if k not in ("held_out", "algorithms", "seeds")
                                              and (k not in ALGORITHMS or k in swept)}}
    experiment = f"fedccrl-{cfg['dataset']}"
    commit = git_commit()
    from fedccrl_core.federation.engine import resolve_device

    device = resolve_device(cfg["device"]).type  # what ran, not `auto`
    tracking = get(params, "tracking", {}) or {}
    system_metrics_s = tracking.get("system_metrics_interval_s", 10.0) if tracking.get("system_metrics", True) else None
    shards_manifest = Path(shards) / "manifest.json"
    runs: dict[int, ChildRun] = {}
    parent: list[str] = []  # found or created on the first start(): MLflow starts up while a worker trains

    def start(job):
        ckpt = job["ckpt"]
        side = ckpt.with_suffix(".mlflow.json")
        resumable = ckpt.is_file() or ckpt.with_name(ckpt.name + ".prev").is_file()  # federation/checkpoints.py
        recorded = json.loads(side.read_text())["run_id"] if side.is_file() else None
        # continue the recorded run when its checkpoint is there, and also when its process was killed before the
        # first checkpoint (the run is still RUNNING): one run per training, never a RUNNING one left behind
        resume_id = recorded if recorded and (resumable or run_status(recorded) == "RUNNING") else None
        if not parent:
            parent.append(parent_run_id(experiment, params_hash(sweep_params), sweep_params))
        run = ChildRun(experiment, parent[0], f"{algorithm}-{cfg['dataset']}-s{seed}-{job['target']}",
                       mlflow_params(params, job, device),
                       {"git_commit": commit, "mlflow.source.git.commit": commit.removesuffix("-dirty"),
                        **({"dvc.exp_name": dvc_experiment_name()} if dvc_experiment_name() else {}),
                        "dvc_stage": f"train@{algorithm}-{seed}", "fedccrl.role": "child",
                        "fedccrl.sweep": params_hash(sweep_params), "held_out": job["target"],
                        "algorithm": algorithm, "seed": str(seed)}, resume_run_id=resume_id,
                       dataset={"name": f"{cfg['dataset']}-shards", "path": shards_manifest,
                                "profile": {"domains": manifest["domains"], "clients": len(manifest["clients"]),
                                            "image_size": manifest["image_size"], "held_out": job["target"]}},
                       system_metrics_s=system_metrics_s,
                       on_created=lambda run_id: write_text(side, json.dumps({"run_id": run_id})))
        write_text(side, json.dumps({"run_id": run.run_id}))
        runs[job["index"]] = run
        return {"commit": commit, "mlflow_run_id": run.run_id, "mlflow_experiment_id": run.experiment_id}

    def on_message(kind, index, payload):
        if kind == "round":
            runs[index].log_round(payload)
        elif kind == "done":
            job = next(j for j in jobs if j["index"] == index)  # every round in MLflow, also after a kill or a lost store
            late = runs[index].backfill(json.loads((Path(job["out"]) / contract.HISTORY_FILE).read_text())["rounds"])
            if late:
                LOG(f"[{algorithm} {job['target']}] MLflow: round(s) {late} logged now (the run that trained them "
                    f"was interrupted before they reached MLflow)")
            runs[index].log_metrics(payload)
            runs[index].finish()

    LOG(f"train {algorithm} seed {seed}: held-out {[j['target'] for j in jobs]}, {n_workers} at a time")
    try:
        run_jobs(jobs, n_workers, shards, pools, start, on_message)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM (fedccrl_core/procs.py): resumable, not failed
        for run in runs.values():
            run.finish("KILLED")
        raise
    except BaseException:
        for run in runs.values():
            run.finish("FAILED")
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
