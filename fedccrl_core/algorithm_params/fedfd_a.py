"""train.fedfd_a: FedFD-A's hyperparameters (fedfd-a.txt sections 3.2-3.3); the algorithm is
fedccrl_core/algorithms/fedfd_a.py.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from fedccrl_core.algorithm_params.fedfd import FDParams
from fedccrl_core.foundation.hparams import hp


class FedFDAParams(FDParams):
    """train.fedfd_a (fedfd-a.txt sections 3.2-3.3)."""

    adapter: bool = hp(True, "instance feature adapter (section 3.3); false = FedFD (Table 3)")
    adapter_reduction: int = hp(
        16, "our choice: hidden width C/16 reproduces Table 4's +0.22M parameters on ResNet-18", ge=1
    )
    adapter_min_hidden: int = hp(4, "our choice: floor of the hidden width for narrow layers (small_cnn)", ge=1)
    adapter_init_alpha: float = hp(
        0.5, "our choice: initial bias of epsilon, so alpha starts inside the clamp's (0, 1)", ge=0, le=1
    )
    inference: Literal["adapter", "global", "instance"] = hp(
        "adapter", "Table 3 (c1): adapter (alpha = clamp(epsilon), Table 16) | global | instance (TBN)"
    )

    @field_validator("inference")
    @classmethod
    def _adapter_on(cls, v, info):
        if v == "adapter" and info.data.get("adapter") is False:
            raise ValueError("inference 'adapter' needs adapter: true (choose global or instance without it)")
        return v
