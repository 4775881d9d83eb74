"""params.yaml `train.*` keys every algorithm's local training reads (TrainSettings), and with preprocess's
normalization what an algorithm is built with (LocalConfig); fedccrl_core/algorithms/base.py trains with them.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from fedccrl_core.foundation.hparams import Declared
from fedccrl_core.foundation.imagenet_stats import IMAGENET_MEAN, IMAGENET_STD
from fedccrl_core.privacy.settings import PrivacySettings


class TrainSettings(Declared):
    """params.yaml `train.*` keys that every algorithm's local training reads, declared once: the type, bounds
    and default of each. The defaults are params.yaml's (tests/test_params_registry.py); pipeline/fedccrl_pipeline/params.py's
    `TrainSweep` extends this model with the sweep's own keys."""

    rounds: int = Field(10, ge=1, description="T (paper: 10)")
    local_epochs: int = Field(2, ge=1, description="E (paper: 3; 2 with lr 0.003 on the embedded default)")
    batch_size: int = Field(32, ge=1)
    lr: float = Field(0.003, gt=0, description="Adam (paper: 0.001; 0.003 on the embedded default)")
    weight_decay: float = Field(1e-4, ge=0)
    lr_schedule: Literal["cosine", "constant"] = Field("cosine", description="cosine over rounds x local_epochs")
    fast: bool = Field(
        True,
        description="CUDA: bf16 autocast, cuDNN autotuning, static batch shapes, fused Adam; "
        "channels_last on every device (fastpath.py)",
    )


class LocalConfig(TrainSettings):
    """What every algorithm's local training needs: the train settings and the normalization of
    params.yaml `preprocess` (mean, std). Immutable; `model_copy(update=...)` makes a changed copy."""

    model_config = ConfigDict(frozen=True)

    mean: tuple[float, float, float] = Field(IMAGENET_MEAN, strict=False)  # a JSON list too (Flower's spec)
    std: tuple[float, float, float] = Field(IMAGENET_STD, strict=False)
    privacy: PrivacySettings | None = None  # train.privacy when enabled; None = off, the paper's protocol

    @property
    def private(self) -> bool:
        """Trained under train.privacy: the releases noised and charged, the held-out domain scored on its val rows
        (data/shards.py held_out_parts)."""
        return self.privacy is not None and self.privacy.enabled
