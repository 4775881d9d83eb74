"""`fedccrl train`: federated training of one (algorithm, seed, held-out domain) on the in-process engine.

Writes <out>/model.pt (final global model), <out>/best.pt (global model at the round of best
source-validation accuracy), <out>/history.json and <out>/history.csv (per-round metrics), all at
once at the end. Round checkpoints live outside the DVC output (DVC deletes outputs before a
rerun), under --checkpoints, keyed by a hash of everything that determines the run.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import sys
from pathlib import Path

import click

from pipeline.cli import run_stage
from pipeline.params import check_sweep, get, load_params

LOG = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731


def train_config(params: dict, algorithm: str) -> dict:
    """Validate and collect every param the run depends on (one error line naming the key)."""
    from fedccrl_core.algorithms import ALGORITHMS

    if algorithm not in ALGORITHMS:
        raise ValueError(f"params.yaml: train.algorithms has unknown algorithm {algorithm!r}; "
                         f"choose from {', '.join(ALGORITHMS)}")
    num = (int, float)
    cfg = {
        "dataset": get(params, "dataset.name", str),
        "backbone": get(params, "model.backbone", str),
        "pretrained": get(params, "model.pretrained", str),
        "mean": get(params, "preprocess.mean", list), "std": get(params, "preprocess.std", list),
        "engine": get(params, "train.engine", str, choices=("inprocess", "flower")),
        "device": get(params, "train.device", str, choices=("auto", "cpu", "cuda")),
        "rounds": get(params, "train.rounds", int), "local_epochs": get(params, "train.local_epochs", int),
        "batch_size": get(params, "train.batch_size", int), "lr": get(params, "train.lr", num),
        "weight_decay": get(params, "train.weight_decay", num),
        "lr_schedule": get(params, "train.lr_schedule", str, choices=("cosine", "constant")),
        "client_fraction": get(params, "train.client_fraction", num),
        "fast": get(params, "train.fast", bool, default=True),
        "concurrent_clients": get(params, "train.concurrent_clients", (str, int), default="auto"),
        "client_state": get(params, "train.client_state", str, choices=("persistent", "stateless"),
                            default="persistent"),
        "eval_batch_size": get(params, "evaluate.batch_size", int, default=256),
        "hparams": get(params, f"train.{algorithm}", dict, default={}) or {},
    }
    for k in ("rounds", "local_epochs", "batch_size"):
        if cfg[k] < 1:
            raise ValueError(f"params.yaml: key 'train.{k}' must be >= 1, got {cfg[k]}")
    cc = cfg["concurrent_clients"]
    if cc != "auto" and (not isinstance(cc, int) or cc < 1):
        raise ValueError(f"params.yaml: key 'train.concurrent_clients' must be auto or an integer >= 1, got {cc!r}")
    for k in ("mean", "std"):
        if len(cfg[k]) != 3 or not all(isinstance(v, num) for v in cfg[k]):
            raise ValueError(f"params.yaml: key 'preprocess.{k}' must be a list of 3 numbers")
    return cfg


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
        s = load_client(shards, entry["id"], exclude_domain=held_out[0] if held_out else None)
        if not len(s.train_y):
            continue                                   # a mixed client holding only the held-out domain
        mu, sigma = load_pool(pools, entry["id"])
        if s.train_rows is not None:
            mu, sigma = mu[s.train_rows], sigma[s.train_rows]
        if len(mu) != len(s.train_y):
            raise ValueError(f"{pools}/{entry['id']}.npz: {len(mu)} statistics for {len(s.train_y)} training samples "
                             "(pools are stale: rerun the pools stage)")
        clients.append(ClientData.from_numpy(s.client_id, s.domain, s.train_x, s.train_y, s.val_x, s.val_y, device,
                                             mu, sigma))
    return clients


def load_manifest_clients(shards: Path) -> list[dict]:
    from fedccrl_core.data.shards import load_manifest

    return load_manifest(shards)["clients"]


def train(shards: Path, pools: Path, algorithm: str, seed: int, held_out: int, out: Path, params_path: Path,
          checkpoints: Path) -> None:
    import numpy as np
    import torch

    from fedccrl_core.algorithms import build_algorithm
    from fedccrl_core.checkpoint import save_model
    from fedccrl_core.data.shards import load_domain_test, load_manifest
    from fedccrl_core.federation.client import ClientData
    from fedccrl_core.federation.engine import EvalSets, InProcessEngine, resolve_device
    from pipeline.tracking import ChildRun, code_hash, dvc_experiment_name, git_commit, params_hash, parent_run_id

    params = load_params(params_path)
    check_sweep(params)  # before any data is read and before MLflow
    cfg = train_config(params, algorithm)
    alg = build_algorithm(algorithm, local_config(cfg), cfg["hparams"])  # train.<algorithm> checked before any data
    manifest = load_manifest(shards)
    domains, classes = list(manifest["domains"]), list(manifest["classes"])
    if not 0 <= held_out < len(domains):
        raise ValueError(f"params.yaml: train.held_out index {held_out} out of range for {len(domains)} domains {domains}")
    target = domains[held_out]
    sources = [d for d in domains if d != target]
    backbone, pretrained = resolve_model(cfg)
    device = resolve_device(cfg["device"])
    LOG(f"train {algorithm} seed {seed}: held-out {target}, sources {sources}, {backbone} on {device}")

    clients = load_clients(shards, pools, sources, device)
    if len(clients) < 2:
        raise ValueError(f"{shards}: need at least 2 source clients, found {len(clients)}")
    tx, ty = load_domain_test(shards, target)
    evalsets = EvalSets(torch.cat([c.val_x for c in clients]), torch.cat([c.val_y for c in clients]),
                        ClientData.from_numpy("target", target, tx, ty, tx[:0], ty[:0], device).train_x,
                        torch.from_numpy(np.asarray(ty, dtype=np.int64)).to(device), cfg["eval_batch_size"])
    del tx, ty      # the NCHW copy in evalsets is the one copy of the target domain kept for training

    torch.manual_seed(seed)
    model = alg.build_model(backbone, len(classes), pretrained, alg.hp).to(device)

    run_params = {**{k: v for k, v in cfg.items() if k != "hparams"}, "backbone": backbone, "pretrained": pretrained,
                  "algorithm": algorithm, "seed": seed, "held_out": target, algorithm: alg.hp,
                  "partition": params.get("partition"), "image_size": manifest["image_size"]}
    run_key = params_hash({**run_params, "manifest": params_hash(manifest), "code": code_hash()})
    sweep_params = {k: v for k, v in params.items() if k not in ("evaluate", "export")}
    sweep_params = {**sweep_params, "train": {k: v for k, v in sweep_params.get("train", {}).items()
                                              if k not in ("held_out", "algorithms", "seeds")}}
    sweep_key = params_hash(sweep_params)
    ckpt = checkpoints / f"{algorithm}-s{seed}-d{held_out}" / f"{run_key}.pt"
    side = ckpt.with_suffix(".mlflow.json")

    experiment = f"fedccrl-{cfg['dataset']}"
    resumable = ckpt.is_file() or ckpt.with_name(ckpt.name + ".prev").is_file()  # federation/checkpoints.py
    resume_id = json.loads(side.read_text())["run_id"] if (resumable and side.is_file()) else None
    commit = git_commit()
    run = ChildRun(experiment, parent_run_id(experiment, sweep_key, sweep_params),
                   f"{algorithm}-{cfg['dataset']}-s{seed}-{target}", run_params,
                   {"git_commit": commit, "mlflow.source.git.commit": commit.removesuffix("-dirty"),
                    **({"dvc.exp_name": dvc_experiment_name()} if dvc_experiment_name() else {}),
                    "dvc_stage": f"train@{algorithm}-{seed}-{held_out}",
                    "fedccrl.role": "child", "fedccrl.sweep": sweep_key, "held_out": target,
                    "algorithm": algorithm, "seed": str(seed)}, resume_run_id=resume_id)
    side.parent.mkdir(parents=True, exist_ok=True)
    side.write_text(json.dumps({"run_id": run.run_id}))
    try:
        if cfg["engine"] == "flower":  # same algorithm, seeds and record dicts over Flower (fedccrl_flower/run.py)
            from fedccrl_flower.run import train_with_flower

            result = train_with_flower(
                get(params, "train.flower", dict, default={}), algorithm=algorithm, local=alg.local, hparams=alg.hp,
                backbone=backbone, pretrained=pretrained, num_classes=len(classes), seed=seed, held_out=target,
                shards=shards, pools=pools, device=cfg["device"], eval_batch_size=cfg["eval_batch_size"],
                client_fraction=cfg["client_fraction"], checkpoint=ckpt, run_info={"run_key": run_key},
                on_round=run.log_round, log=LOG, client_state=cfg["client_state"])
        else:
            engine = InProcessEngine(alg, model, clients, evalsets, cfg["rounds"], seed,
                                     float(cfg["client_fraction"]), ckpt, on_round=run.log_round,
                                     run_info={"run_key": run_key}, concurrent_clients=cfg["concurrent_clients"],
                                     client_state=cfg["client_state"])
            result = engine.run()
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM (fedccrl_core/procs.py): resumable, not failed
        run.finish("KILLED")
        raise
    except BaseException:
        run.finish("FAILED")
        raise

    meta = {"backbone": backbone, "num_classes": len(classes), "classes": classes,
            "image_size": manifest["image_size"], "mean": list(cfg["mean"]), "std": list(cfg["std"]),
            "resize": manifest.get("resize_policy", "resize SxS bilinear"), "dataset": cfg["dataset"],
            "domains": domains, "held_out_domain": target, "held_out_index": held_out, "algorithm": algorithm,
            "seed": seed, "hparams": alg.hp, "params_hash": run_key, "git_commit": commit, "mlflow_run_id": run.run_id,
            "mlflow_experiment_id": run.experiment_id}
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.load_state_dict(result.final_weights)
    save_model(tmp / "model.pt", model, {**meta, "round": cfg["rounds"]})
    model.load_state_dict(result.best_weights)
    save_model(tmp / "best.pt", model, {**meta, "round": result.best_round})
    (tmp / "history.json").write_text(json.dumps({"meta": meta, "best_round": result.best_round,
                                                  "rounds": result.history}, indent=1))
    keys = ["round", "target_acc", "val_acc", "loss", "train_acc", "lr", "seconds", "bytes_up", "bytes_down"]
    keys += sorted({k for r in result.history for k in r if k.startswith("l_")})
    with open(tmp / "history.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(result.history)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    final = result.history[-1]
    run.mlflow.log_metrics({"final_target_acc": final["target_acc"],
                            "best_val_target_acc": result.history[result.best_round - 1]["target_acc"],
                            "best_round": result.best_round})
    run.finish()
    LOG(f"done: final target acc {final['target_acc']:.4f}; best-val round {result.best_round} -> {out}")


@click.command("train")
@click.option("--shards", type=click.Path(path_type=Path), required=True)
@click.option("--pools", type=click.Path(path_type=Path), required=True)
@click.option("--algorithm", required=True)
@click.option("--seed", type=int, required=True)
@click.option("--held-out", type=int, required=True, help="index into the dataset's domains")
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
@click.option("--checkpoints", type=click.Path(path_type=Path), default=Path(".fedccrl/checkpoints"),
              help="round checkpoints for resume (outside the DVC output)")
def command(shards, pools, algorithm, seed, held_out, out, params_path, checkpoints):
    """Federated training for one held-out domain; every round logged to MLflow and checkpointed."""
    run_stage(train, shards, pools, algorithm, seed, held_out, out, params_path, checkpoints)
