"""params.yaml: one typed model of the whole file, validated at the start of every stage, before any data is
read and before any MLflow run is opened.

Each group is a pydantic model (fedccrl_core/foundation/hparams.py: strict types, unknown keys refused). `train.<algorithm>`
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
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, create_model, field_validator

from fedccrl_core.algorithm_params import PARAMS
from fedccrl_core.algorithm_params.train import LocalConfig, TrainSettings
from fedccrl_core.data.registry import AUTO, LAYOUT_GENERATED, REGISTRY
from fedccrl_core.data.splits import SCHEMES
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.backbone_names import BACKBONES
from fedccrl_core.foundation.errors import ParamError
from fedccrl_core.foundation.hparams import Declared, Sha256, validate
from fedccrl_core.privacy.settings import PrivacySettings
from fedccrl_flower.settings import FlowerSettings
from fedccrl_pipeline import quantize
from fedccrl_pipeline.cross_checks import problem_line, resolve_held_out
from fedccrl_pipeline.params_yaml import read_yaml

__all__ = [
    "ParamError",
    "ParamsFile",
    "check_config",
    "load_config",
    "resolve_held_out",
    "run_dirs",
    "validate_params",
]


def one_of(values) -> Any:
    """A Literal of `values` (built at import, from a registry)."""
    return Literal[tuple(values)]


def unique(v: list) -> list:
    """`v` unchanged; ValueError naming each entry listed more than once."""
    repeats = sorted({repr(x) for x in v if v.count(x) > 1})
    if repeats:
        raise ValueError(f"{', '.join(repeats)} listed more than once (each entry is one DVC stage and one MLflow run)")
    return v


# ---- the groups, in params.yaml's order ------------------------------------------------------------------------
class DatasetParams(Declared):
    name: one_of(REGISTRY)  # type: ignore[valid-type]  # a Literal built at import
    source: str = Field("registry", min_length=1)
    sha256: Sha256 | dict[str, Sha256] | None = None
    seed: int = 0


class DownloadParams(Declared):
    timeout_s: float = Field(gt=0)
    deadline_s: float = Field(3600.0, gt=0, description="the whole download of one archive, retries included")
    retries: int = Field(ge=0)
    max_bad_fraction: float = Field(ge=0, le=1)

    @field_validator("deadline_s")
    @classmethod
    def _deadline_covers_a_read(cls, v, info):
        t = info.data.get("timeout_s")
        if t is not None and v < t:
            raise ValueError(f"must be >= download.timeout_s={t:g}: it bounds the whole download of one archive")
        return v


class PreprocessParams(Declared):
    image_size: Literal["auto"] | Annotated[int, Field(ge=8)]
    mean: Annotated[list[float], Field(min_length=3, max_length=3)]
    std: Annotated[list[Annotated[float, Field(gt=0)]], Field(min_length=3, max_length=3)]


class PartitionParams(Declared):
    clients_per_domain: int = Field(ge=1)
    # 1 leaves a client no training samples; 0 no source validation, so train's best-val model (best.pt) would be
    # the untrained round-0 model and evaluate's best_val_target_acc meaningless
    val_fraction: float = Field(gt=0, lt=1)
    dirichlet_alpha: float | None = Field(None, gt=0)
    seed: int
    num_clients: int | None = Field(12, ge=1, description="C, feddg_bench only")
    lambda_: float | None = Field(0.1, alias="lambda", ge=0, le=1, description="feddg_bench only")
    scheme: one_of(SCHEMES) = "per_domain"  # type: ignore[valid-type]  # a Literal built at import

    @field_validator("scheme")
    @classmethod
    def _feddg_bench_needs(cls, v, info):
        if v == "feddg_bench":
            missing = [
                k
                for k, f in (("num_clients", "num_clients"), ("lambda", "lambda_"))
                if f not in info.data or info.data[f] is None
            ]
            if missing:
                raise ValueError(f"feddg_bench needs partition.{missing[0]}")
        return v


class ModelParams(Declared):
    backbone: one_of((AUTO, *BACKBONES))  # type: ignore[valid-type]  # a Literal built at import
    pretrained: str = Field(min_length=1, description="auto | imagenet | none | <path to a torchvision state_dict>")


HeldOut = Annotated[int, Field(ge=0)] | Annotated[str, Field(min_length=1)]


class TrainSweep(TrainSettings):
    """train.*: the DVC matrix (algorithms x seeds), the held-out domains each train stage covers, and the
    settings every algorithm shares (those its local training reads are the library's TrainSettings)."""

    held_out: Annotated[list[HeldOut], Field(min_length=1)]
    algorithms: Annotated[list[one_of(PARAMS)], Field(min_length=1)]  # type: ignore[valid-type]  # a Literal built at import
    seeds: Annotated[list[int], Field(min_length=1)]
    engine: Literal["inprocess", "flower"]
    flower: FlowerSettings = Field(default_factory=FlowerSettings)
    device: Literal["auto", "cpu", "cuda"]
    client_fraction: float = Field(gt=0, le=1)
    concurrent_clients: Literal["auto"] | Annotated[int, Field(ge=1)] = "auto"
    client_state: Literal["persistent", "stateless"] = "persistent"
    privacy: PrivacySettings = Field(default_factory=PrivacySettings)  # differential privacy, off by default

    @field_validator("held_out", "algorithms", "seeds")
    @classmethod
    def _no_repeats(cls, v):
        return unique(v)


# train.<algorithm>: each algorithm's own declaration (absent or partial groups take the declared defaults)
if TYPE_CHECKING:  # the groups are built from PARAMS at import: to the type checker, each one is Any

    class TrainParams(TrainSweep):
        def __getattr__(self, algorithm: str) -> Any: ...

else:
    TrainParams = create_model(
        "TrainParams",
        __base__=TrainSweep,
        **{name: (params, Field(default_factory=params)) for name, params in PARAMS.items()},
    )


class EvaluateParams(Declared):
    batch_size: int = Field(ge=1)


class ExportParams(Declared):
    min_agreement: float = Field(ge=0, le=1)
    batch_size: int = Field(ge=1)
    int8: bool = Field(
        False, description="also write model.int8.onnx, static INT8 (pipeline/fedccrl_pipeline/quantize.py)"
    )
    int8_max_drop: float = Field(
        quantize.MAX_DROP_POINTS,
        ge=-100,
        le=100,
        description="points of held-out accuracy the INT8 model may lose against float32 before it is refused",
    )
    int8_calibration_images: int = Field(
        quantize.CALIBRATION_IMAGES, ge=1, le=100_000, description="source-domain images that calibrate INT8"
    )


class FiguresParams(Declared):
    seed: int
    preview_images: int = Field(ge=1)
    tsne_points: int = Field(ge=3)  # t-SNE's perplexity (>= 2) must stay below the number of points
    gradcam_images: int = Field(ge=1)


class TrackingParams(Declared):
    system_metrics: bool = Field(
        True, description="MLflow system metrics (CPU, RAM, GPU where present) on each training run"
    )
    system_metrics_interval_s: float = Field(10.0, gt=0, description="seconds between two samples")


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
