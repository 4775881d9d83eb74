"""Training jobs: one (algorithm, seed) trained for each held-out domain (`fedccrl train`, pipeline/train.py).

`plan_runs` turns validated params into one picklable job per held-out entry, keyed by a hash of everything that
determines the run (its round checkpoint's name); `run_one` trains a job on the in-process engine (or over Flower,
with the caller's `job["flower_train"]`) and writes its outputs at once at the end (the run layout of
fedccrl_core/contract.py); `run_jobs` runs jobs side by side in spawned workers, one torch thread each, and hands
their round records to the caller, which alone talks to the tracker (pipeline/tracking.py).
"""
from __future__ import annotations

import csv
import json
import os
import sys
import traceback
from pathlib import Path

from fedccrl_core import contract
from fedccrl_core.numerics import numeric_platform
from fedccrl_core.runkey import code_hash, params_hash

LOG = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731


def local_config(cfg: dict):
    """The LocalConfig every algorithm's local training reads, from a validated train_config()."""
    from fedccrl_core.algorithms import LocalConfig

    return LocalConfig(rounds=cfg["rounds"], local_epochs=cfg["local_epochs"], batch_size=cfg["batch_size"],
                       lr=float(cfg["lr"]), weight_decay=float(cfg["weight_decay"]), lr_schedule=cfg["lr_schedule"],
                       mean=tuple(cfg["mean"]), std=tuple(cfg["std"]), fast=cfg["fast"], privacy=cfg.get("privacy"))


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
                                             mu, sigma, lazy=True))  # images read when sampled: memory flat in the clients
    return clients


def load_manifest_clients(shards: Path) -> list[dict]:
    from fedccrl_core.data.shards import load_manifest

    return load_manifest(shards)["clients"]


def plan_runs(params: dict, cfg: dict, manifest: dict, algorithm: str, seed: int, held_out: list,
              targets: list[str], out: Path, checkpoints: Path, alg_hp: dict) -> list[dict]:
    """One job per held-out entry (checked by check_train; `targets` are their domain names): everything a
    worker needs (plain data, picklable), its run key (the hash of everything that determines the run, naming
    its round checkpoint) and its output folder out/d<entry>."""
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
                     "out": out / contract.domain_dir_name(h), "flower": params["train"].get("flower") or {},
                     "domains": domains, "classes": list(manifest["classes"]),
                     "image_size": manifest["image_size"], "resize": manifest.get("resize_policy", "resize SxS bilinear")})
    return jobs


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
        if cfg["engine"] == "flower":  # same algorithm, seeds and record dicts over Flower: job["flower_train"] is
            # fedccrl_flower.run.train_with_flower, set by the caller (the library does not import the transport)
            result = job["flower_train"](
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
            "mlflow_run_id": job["mlflow_run_id"], "mlflow_experiment_id": job["mlflow_experiment_id"],
            "platform": numeric_platform(str(device))}
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
