"""params.yaml: one typed model of the whole file, validated at the start of every stage, before any data is
read and before any MLflow run is opened.

Each group is a pydantic model (params_groups.py; fedccrl_core/foundation/hparams.py: strict types, unknown keys refused). `train.<algorithm>`
is that algorithm's own declaration (`Algorithm.Params`, declared without torch in fedccrl_core/algorithm_params/,
so a stage that trains nothing does not import torch), `train.flower` the Flower engine's
(fedccrl_flower/settings.py): nothing here repeats them. Every problem becomes one line naming the key, the
value and what is allowed (ParamError); `fedccrl <stage>` prints each as `error: ...` and exits 2.

`load_config` returns the typed model, and that is what every stage and training job receives (a default is
declared once, in these models or the library's `TrainSettings`/`Algorithm.Params`, and equals params.yaml's:
tests/test_params_registry.py). The checks of a run against the data are pipeline/fedccrl_pipeline/sweep.py.
The file is read by params_yaml.py; an operator's deploy group (`fedccrl deploy init`) is deploy_params.py's.

`train.held_out` lists domains by name (`[sketch]`) or by index. Indices follow the manifest's domain order:
the dataset registry's order for a registered dataset (fedccrl_core/data/registry.py: synthetic photo, art,
cartoon, sketch; PACS photo, art_painting, cartoon, sketch; ...), sorted folder names for `imagefolder`.
An entry is also the run's name: models/<algorithm>/s<seed>/d<entry> (d3 or dsketch).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from pydantic import Field

from fedccrl_core.algorithm_params.train import LocalConfig, TrainSettings
from fedccrl_core.data.registry import AUTO, LAYOUT_GENERATED, REGISTRY
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.errors import ParamError
from fedccrl_core.foundation.hparams import Declared, validate
from fedccrl_pipeline.cross_checks import problem_line, resolve_held_out
from fedccrl_pipeline.params_groups import (
    DatasetParams,
    DownloadParams,
    EvaluateParams,
    ExportParams,
    FiguresParams,
    ModelParams,
    PartitionParams,
    PreprocessParams,
    TrackingParams,
    TrainParams,
)
from fedccrl_pipeline.params_yaml import read_yaml

__all__ = ["ParamsFile", "check_config", "load_config", "run_dirs", "validate_params"]


class ParamsFile(Declared):
    dataset: DatasetParams
    download: DownloadParams
    preprocess: PreprocessParams
    partition: PartitionParams
    model: ModelParams
    train: TrainParams
    evaluate: EvaluateParams
    export: ExportParams
    figures: FiguresParams
    tracking: TrackingParams = Field(default_factory=TrackingParams)
    # an operator's project only (`fedccrl deploy init`): its deployment, validated by deploy_params.py
    deploy: dict[str, Any] | None = None

    @functools.cached_property
    def local(self) -> LocalConfig:
        """What every algorithm's local training reads: the train settings and preprocess's normalization, built
        once from the values validated with the file (model_construct: they are not validated a second time)."""
        privacy = self.train.privacy  # only when on: a run without DP keeps its run key (and checkpoint)
        mean_r, mean_g, mean_b = self.preprocess.mean  # three each, validated
        std_r, std_g, std_b = self.preprocess.std
        return LocalConfig.model_construct(
            **{name: getattr(self.train, name) for name in TrainSettings.model_fields},
            mean=(mean_r, mean_g, mean_b),
            std=(std_r, std_g, std_b),
            privacy=privacy if privacy.enabled else None,
        )

    def as_written(self) -> dict:
        """The keys params.yaml sets, with their validated values (`lr: 1e-3` is 0.001), by their YAML names; not
        an operator's deploy group (no training setting)."""
        return self.model_dump(by_alias=True, exclude_unset=True, exclude={"deploy"})


# ---- the checks that involve more than one key -------------------------------------------------------------
def check_config(cfg: ParamsFile, run_algorithms: tuple[str, ...] = (), downloads: bool = True) -> list[str]:
    """Problems that involve more than one key: held_out against the dataset's domains, the backbone against
    `pretrained`, and what an algorithm to be trained (listed in train.algorithms, or `run_algorithms`: a stage's
    --algorithm) needs of its own group. One line each. `downloads=False`: a command that reads its images from
    elsewhere (a site's `--images`), for which dataset.source does not apply."""
    out = []
    spec = REGISTRY[cfg.dataset.name]
    if cfg.dataset.source == "registry" and downloads:  # what the registry has to give (fedccrl_core/data/sources.py)
        if spec.layout == LAYOUT_GENERATED and cfg.dataset.sha256 is not None:
            out.append(
                problem_line(
                    "dataset.sha256", cfg.dataset.sha256, f"does not apply to the generated dataset {spec.name!r}"
                )
                + ": set it to null"
            )
        elif spec.layout != LAYOUT_GENERATED and not spec.sources:
            out.append(
                problem_line(
                    "dataset.source",
                    "registry",
                    f"the registry has no download for {spec.name!r}: set dataset.source to a URL, an archive or a "
                    "folder",
                )
            )
    if spec.domains:  # imagefolder discovers its domains: checked against the manifest by the train stage
        out += resolve_held_out(list(spec.domains), cfg.train.held_out, spec.name)[1]
    backbone = spec.backbone if cfg.model.backbone == AUTO else cfg.model.backbone
    pretrained = spec.pretrained if cfg.model.pretrained == AUTO else cfg.model.pretrained
    if backbone == "small_cnn" and pretrained != "none":
        out.append(
            problem_line(
                "model.pretrained",
                cfg.model.pretrained,
                f"{backbone} (model.backbone {cfg.model.backbone!r}) has no pretrained weights: use none"
                + (" or auto" if spec.pretrained == "none" else ""),
            )
        )
    for name in dict.fromkeys([*cfg.train.algorithms, *run_algorithms]):
        group = getattr(cfg.train, name)
        out += group.selected_problems(f"train.{name}")
        if cfg.train.privacy.enabled and type(group).dp_refusal:
            out.append(
                problem_line(
                    "train.privacy.enabled",
                    True,
                    f"{name} cannot train under train.privacy: {type(group).dp_refusal}. Set train.privacy.enabled "
                    f"to false, or leave {name} out of train.algorithms",
                )
            )
            continue
        out += [
            problem_line(key, getattr(cfg.train.privacy, key.rsplit(".", 1)[1]), why)
            for key, why in cfg.train.privacy.unprotected(name, getattr(type(group), "uploads_statistics", False))
        ]
    return out


# ---- loading -------------------------------------------------------------------------------------------------
def validate_params(data: dict, run_algorithms: tuple[str, ...] = (), downloads: bool = True) -> ParamsFile:
    """The whole file, typed; ParamError listing every problem (one line each). `run_algorithms`: registered
    algorithms a stage trains besides train.algorithms (`fedccrl train --algorithm`, `fedccrl-bench accuracy`);
    `downloads=False`: dataset.source does not apply (check_config)."""
    cfg = validate(ParamsFile, data)
    problems = check_config(cfg, tuple(run_algorithms), downloads)
    if problems:
        raise ParamError(*problems)
    return cfg


def load_config(path: str | Path = "params.yaml", downloads: bool = True) -> ParamsFile:
    return validate_params(read_yaml(path), downloads=downloads)


def run_dirs(cfg: ParamsFile, root: Path) -> list[Path]:
    """Every run of the sweep, in dvc.yaml's layout: <root>/<algorithm>/s<seed>/d<held_out entry>."""
    t = cfg.train
    return [contract.run_dir(root, a, s, h) for a in t.algorithms for s in t.seeds for h in t.held_out]
