"""The deploy group of an operator's params.yaml (the project `fedccrl deploy init` writes, project/dvc.yaml): one
typed group `deploy` (where the SuperLink is, which runs to train over it, the test folder), validated before any
work; the file's other groups are the training settings (params.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator

from fedccrl_core.algorithm_params import PARAMS
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.errors import ParamError
from fedccrl_core.foundation.hparams import Declared, validate
from fedccrl_flower.settings import superlink_address
from fedccrl_pipeline.params_groups import one_of, unique
from fedccrl_pipeline.params_yaml import read_yaml


class DeployParams(Declared):
    """deploy.* of the operator's pipeline (project/dvc.yaml): where the SuperLink is, which runs to train over it
    and the operator's test folder."""

    superlink: str = Field(description="host:port of the SuperLink's control API")
    root_certificates: str = Field(description='the SuperLink\'s CA certificate (TLS); "" = --insecure (loopback)')
    algorithms: Annotated[list[one_of(PARAMS)], Field(min_length=1)]  # type: ignore[valid-type]  # a Literal built at import
    seeds: Annotated[list[int], Field(min_length=1)]
    held_out: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]  # domain names
    test_shards: str | None = Field(
        default=None,
        description="the operator's test folder of the held-out domain(s) (a shard folder, relative to this file); "
        "null = none: the sites' accuracies only, and the export's parity on generated images",
    )

    @field_validator("superlink")
    @classmethod
    def _superlink(cls, v: str) -> str:
        return superlink_address(v)  # as train.flower.superlink and a site's site.toml spell it

    @field_validator("held_out", "algorithms", "seeds")
    @classmethod
    def _no_repeats(cls, v):
        return unique(v)


class DeployFile(Declared):
    deploy: DeployParams


def load_deploy(path: str | Path) -> DeployParams:
    """The deploy group of `path`, typed (the file's other groups are not read); ParamError naming the file and
    each key otherwise."""
    data = read_yaml(path)  # an operator's params.yaml: its deploy group beside the training settings
    return validate(DeployFile, {"deploy": data.get("deploy")}, file=str(path)).deploy


def test_shards(deploy_path: Path | None, shards: Path | None) -> Path | None:
    """The operator's test folder: `shards` when given, else deploy.test_shards of the deploy file (relative to its
    folder; None when null). ParamError naming the key when it names a folder without a shard manifest."""
    if shards is not None or deploy_path is None:
        return shards
    rel = load_deploy(deploy_path).test_shards
    if rel is None:
        return None
    from fedccrl_core.data.manifest import MANIFEST

    folder = Path(deploy_path).parent / rel
    if not (folder / MANIFEST).is_file():
        raise ParamError(
            f"{deploy_path}: key 'deploy.test_shards': {folder} holds no {MANIFEST} (prepare it with `fedccrl site "
            "prepare`, or set null to run without a test folder)"
        )
    return folder


def deployed_run_dirs(deploy: DeployParams, root: Path) -> list[Path]:
    """Every run of a deployment, in project/dvc.yaml's layout: <root>/<algorithm>/s<seed>/d<held-out domain>."""
    return [contract.run_dir(root, a, s, h) for a in deploy.algorithms for s in deploy.seeds for h in deploy.held_out]
