"""A model file's meta (`ModelMeta`): what serving, export and evaluation need to use a model, and where it came
from. Plain data, no torch: history.json holds one too, and the stages that read only histories (report) do not
import torch. The model file itself is fedccrl_core/learning/model_file.py.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedccrl_core.foundation.errors import DataError
from fedccrl_core.foundation.records import Record


class ModelMeta(Record):
    """A model file's meta (and a run's history.json `meta`, without `round`): what serving, export and
    evaluation need to use the model, and where it came from (fedccrl_core/federation/jobs.py `run_one`)."""

    backbone: str
    num_classes: int
    classes: list[str]
    image_size: int
    mean: list[float]  # the training normalization (params.yaml preprocess)
    std: list[float]
    resize: str | None = None  # the shards' resize policy
    dataset: str | None = None
    domains: list[str] | None = None
    held_out_domain: str | None = None
    held_out_index: int | None = None
    algorithm: str | None = None
    seed: int | None = None
    hparams: dict[str, Any] | None = None  # train.<algorithm> as validated (Algorithm.Params.model_dump())
    params_hash: str | None = None  # the run's key
    git_commit: str | None = None
    mlflow_run_id: str | None = None
    mlflow_experiment_id: str | None = None
    platform: str | None = None  # fedccrl_core/foundation/numerics.py numeric_platform
    round: int | None = None  # the round whose weights the file holds
    privacy: str | None = None  # settings.py NOT_PRIVATE_MARK when train.privacy.noise_seed seeded the noise

    def require(self, path: str | Path, *names: str) -> None:
        """DataError naming the file and the fields among `names` this meta lacks (a reader that needs them)."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise DataError(f"{path}: the model meta lacks {', '.join(repr(n) for n in missing)}")
