"""params.yaml's groups, each a pydantic model (fedccrl_core/foundation/hparams.py `Declared`: strict types, unknown keys
refused), which params.py's `ParamsFile` puts together; `one_of` and `unique`, the validators they share with
deploy_params.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, create_model, field_validator

from fedccrl_core.algorithm_params import PARAMS
from fedccrl_core.algorithm_params.train import TrainSettings
from fedccrl_core.data.registry import AUTO, REGISTRY
from fedccrl_core.data.splits import SCHEMES
from fedccrl_core.foundation.backbone_names import BACKBONES
from fedccrl_core.foundation.hparams import Declared, Sha256
from fedccrl_core.privacy.settings import PrivacySettings
from fedccrl_flower.settings import FlowerSettings
from fedccrl_pipeline import quantize


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
