"""What a sweep's MLflow runs record of their data and params: the data they train on (`TrackedData`: the central
partition, `shards_data`, or a deployment's sites, `deployed_data`) and a child run's params as params.yaml spells
them, with the values the run used (`mlflow_params`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fedccrl_pipeline.run_names import flatten

if TYPE_CHECKING:
    from fedccrl_core.data.manifest import ShardManifest
    from fedccrl_flower.sites import FederationFile


@dataclass(frozen=True)
class TrackedData:
    """What a sweep's runs train on, as MLflow records it: the central partition (`shards_data`) or a deployment's
    sites (`deployed_data`)."""

    experiment: str  # fedccrl-<dataset>, or fedccrl-<dataset>-deploy
    stage: str  # the command that trains the runs (the child's dvc_stage tag)
    engine: str  # the child's fedccrl.engine tag
    name: str  # the MLflow dataset input's name
    path: Path  # the file that describes the data (the shards' manifest, the federation file)
    profile: dict  # its profile in MLflow (domains, clients, image size)
    exclude: tuple[str, ...]  # params.yaml's groups that do not describe these runs (the parent also leaves out
    # evaluate and export, which no run's training reads)
    params: dict = field(default_factory=dict)  # what the children's params add
    sweep: dict = field(default_factory=dict)  # what the parent's params add (its key: one parent per sweep)


def shards_data(dataset: str, engine: str, manifest: ShardManifest, shards: Path) -> TrackedData:
    """The train stage's data: the central partition in `shards`."""
    profile = {"domains": manifest.domains, "clients": len(manifest.clients), "image_size": manifest.image_size}
    return TrackedData(
        f"fedccrl-{dataset}",
        "train",
        engine,
        f"{dataset}-shards",
        Path(shards) / "manifest.json",
        profile,
        (),
    )


def deployed_data(fed_file: FederationFile, path: Path) -> TrackedData:
    """A deployment's data: the sites of the federation file at `path`, each holding its own images. The research
    params' dataset and partition groups do not describe it; the federation file does."""
    profile = {"domains": fed_file.domains, "clients": len(fed_file.sites), "image_size": fed_file.image_size}
    summary = {"sites": len(fed_file.sites), "classes": len(fed_file.classes), "image_size": fed_file.image_size}
    return TrackedData(
        f"fedccrl-{fed_file.dataset}-deploy",
        "federate",
        "flower deployment",
        f"{fed_file.dataset}-sites",
        Path(path),
        profile,
        ("evaluate", "dataset", "partition", "tracking"),
        {"federation": summary},
        {"federation": fed_file.to_dict()},
    )


def mlflow_params(params: dict, job, device: str, data: TrackedData) -> dict:
    """A child run's MLflow params: params.yaml's dotted keys with the values the run actually used (the
    backbone, pretrained weights and image size that `auto` resolved to, every hyperparameter of its
    algorithm as validated, the device that ran), for its one algorithm, seed and held-out domain
    (train.algorithm, train.seed, train.held_out), and what `data` adds. `params`: ParamsFile.as_written();
    `job`: a TrainJob."""
    from fedccrl_pipeline.params_groups import TrainSweep

    t = params["train"]
    train = {k: t[k] for k in TrainSweep.model_fields if k in t and k not in ("held_out", "algorithms", "seeds")}
    if job.settings.engine != "flower":
        train.pop("flower", None)
    train.update(device=device, algorithm=job.algorithm, seed=job.seed, held_out=job.target)
    train[job.algorithm] = job.hparams.model_dump()
    groups = {
        "dataset": params["dataset"],
        "preprocess": {**params["preprocess"], "image_size": job.image_size},
        "partition": params.get("partition") or {},
        "model": {"backbone": job.settings.backbone, "pretrained": job.settings.pretrained},
        "train": train,
        "evaluate": {"batch_size": params["evaluate"]["batch_size"]},
    }
    return flatten({**{k: v for k, v in groups.items() if k not in data.exclude}, **data.params})
