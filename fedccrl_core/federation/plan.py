"""A run, planned: the typed description of one (algorithm, seed, held-out domain) that every engine trains and that
`finish.py` writes, whatever the data's place. The train stage plans its runs from a shard manifest (`plan_runs`: the
central partition, every client's data on this machine); `fedccrl federate` plans one from the federation file
(`plan_deployed`: the sites hold their data). Both key the run the same way (`run_key`: every setting of the run,
the data's description and the training code), so a round checkpoint is resumed only by the same run and code.


Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.data.manifest import ShardManifest
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.hparams import HParams
from fedccrl_core.foundation.runkey import code_hash, params_hash


@dataclass(frozen=True)
class RunSettings:
    """What every run of one `fedccrl train` or `fedccrl federate` shares, from the validated params file
    (pipeline/fedccrl_pipeline/params.py)."""

    dataset: str
    backbone: str  # resolved: never `auto`
    pretrained: str  # resolved: never `auto`
    local: LocalConfig  # train.* + preprocess mean, std
    engine: str  # train.engine: inprocess | flower
    device: str  # train.device: auto | cpu | cuda
    client_fraction: float
    concurrent_clients: int | str
    client_state: str
    eval_batch_size: int  # evaluate.batch_size


@dataclass(frozen=True)
class RunIds:
    """The ids a job's outputs record: the code's commit and the MLflow run that records the job (set by the
    caller's start(); fedccrl_core does not talk to MLflow)."""

    commit: str = ""
    mlflow_run_id: str | None = None
    mlflow_experiment_id: str | None = None


@dataclass
class TrainJob:
    """One held-out domain of one (algorithm, seed): everything a worker needs, picklable."""

    index: int  # the held-out domain's index in `domains`
    target: str  # the held-out domain
    sources: list[str]  # the domains whose training images the run trains on
    algorithm: str
    seed: int
    hparams: HParams  # train.<algorithm>: the algorithm's frozen Params (Algorithm.validated)
    settings: RunSettings
    run_key: str  # `run_key`: names its round checkpoint
    ckpt: Path
    out: Path
    domains: list[str]
    classes: list[str]
    image_size: int
    resize: str
    # the MLflow run that records the job (set by the caller's start(), fedccrl_core does not talk to MLflow)
    commit: str = ""
    mlflow_run_id: str | None = None
    mlflow_experiment_id: str | None = None
    # train.engine flower: a function of the transport (fedccrl_flower/run.py) that trains the job over Flower,
    # bound by the caller (the library does not import the transport); None: the in-process engine
    flower_train: Callable | None = None
    deployed: bool = False  # `fedccrl federate`: the sites train on their machines and hold the data
    data_key: str = ""  # the hash of what describes its images (the manifest, the federation file): its study

    def record_ids(self, ids: RunIds) -> None:
        self.commit, self.mlflow_run_id, self.mlflow_experiment_id = (
            ids.commit,
            ids.mlflow_run_id,
            ids.mlflow_experiment_id,
        )


# train.privacy keys that do not change what a run trains: the sweep's budget and the study ledgers' folder
_NOT_RUN_KEY = {"max_sweep_epsilon", "study_dir"}


def run_params(settings: RunSettings, algorithm: str, seed: int, target: str, hparams: HParams) -> dict[str, Any]:
    """Every setting that determines one run, as the run key hashes it. A run without DP keeps its key (and its
    checkpoint) with no privacy key; the sweep's budget (train.privacy.max_sweep_epsilon) is checked before the sweep
    trains and does not change what a run trains, nor does where the study ledgers are. A named study
    (train.privacy.study) is a new study: its runs are new runs."""
    s = settings
    local = s.local.model_dump(exclude={"privacy"} if s.local.privacy is None else {"privacy": _NOT_RUN_KEY})
    if local.get("privacy", {}).get("study") == "":  # the images' own study: the key it had before studies were named
        del local["privacy"]["study"]
    return {
        "dataset": s.dataset,
        "backbone": s.backbone,
        "pretrained": s.pretrained,
        **local,
        "engine": s.engine,
        "device": s.device,
        "client_fraction": s.client_fraction,
        "concurrent_clients": s.concurrent_clients,
        "client_state": s.client_state,
        "eval_batch_size": s.eval_batch_size,
        "algorithm": algorithm,
        "seed": seed,
        "held_out": target,
        algorithm: hparams.model_dump(),
    }


def run_key(params: dict[str, Any], data: dict[str, Any]) -> str:
    """The run's key: the hash of its settings (`run_params` and what its engine adds), of `data` (what describes the
    data it trains on) and of the training code (fedccrl_core/foundation/runkey.py `code_hash`)."""
    return params_hash({**params, **data, "code": code_hash()})


def plan_runs(
    settings: RunSettings,
    partition: dict,
    manifest: ShardManifest,
    algorithm: str,
    seed: int,
    held_out: list,
    targets: list[str],
    out: Path,
    checkpoints: Path,
    hparams: HParams,
) -> list[TrainJob]:
    """One job per held-out entry of the central partition (checked by pipeline/fedccrl_pipeline/sweep.py
    `check_train`; `targets` are their domain names), keyed by its settings, the manifest and the training code, its
    output folder out/d<entry>. `hparams`: the algorithm's Params; `partition`: params.yaml's partition group."""
    domains = list(manifest.domains)
    jobs = []
    for h, target in zip(held_out, targets):
        i = domains.index(target)
        params = {
            **run_params(settings, algorithm, seed, target, hparams),
            "partition": partition,
            "image_size": manifest.image_size,
        }
        data_key = params_hash(manifest.to_dict())
        key = run_key(params, {"manifest": data_key})
        jobs.append(
            TrainJob(
                index=i,
                target=target,
                sources=[d for d in domains if d != target],
                algorithm=algorithm,
                seed=seed,
                hparams=hparams,
                settings=settings,
                run_key=key,
                ckpt=checkpoints / contract.checkpoint_dir_name(algorithm, seed, h) / f"{key}.pt",
                out=out / contract.domain_dir_name(h),
                domains=domains,
                classes=list(manifest.classes),
                image_size=manifest.image_size,
                resize=manifest.resize,
                data_key=data_key,
            )
        )
    return jobs


@dataclass(frozen=True)
class DeployedData:
    """What the operator of a deployment knows of the data (the federation file, fedccrl_flower/sites.py): the
    domains in order, the class list, the image size and resize policy, and which domains the sites hold."""

    dataset: str
    domains: list[str]
    classes: list[str]
    image_size: int
    resize: str
    site_domains: list[str]  # each site's domain, in the federation file's order
    description: dict[str, Any]  # the federation file, whole: part of the run key


def plan_deployed(
    settings: RunSettings,
    data: DeployedData,
    engine_params: dict[str, Any],
    algorithm: str,
    seed: int,
    target: str,
    out: Path,
    work: Path,
    hparams: HParams,
) -> TrainJob:
    """The one job of `fedccrl federate`: held-out `target`, trained by the sites over Flower, its round checkpoint
    in the ServerApp's work folder `work`. `engine_params`: the Flower settings the run's spec carries (part of the
    key). The domains it trains on are those of its source sites."""
    settings = dataclasses.replace(settings, engine="flower")
    params = {**run_params(settings, algorithm, seed, target, hparams), "flower": engine_params}
    data_key = params_hash(data.description)
    key = run_key(params, {"federation": data_key})
    return TrainJob(
        index=data.domains.index(target),
        target=target,
        sources=[d for d in data.domains if d != target and d in data.site_domains],
        algorithm=algorithm,
        seed=seed,
        hparams=hparams,
        settings=settings,
        run_key=key,
        ckpt=Path(work).resolve() / "checkpoint.pt",
        out=Path(out),
        domains=list(data.domains),
        classes=list(data.classes),
        image_size=data.image_size,
        resize=data.resize,
        deployed=True,
        data_key=data_key,
    )
